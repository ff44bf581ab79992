"""Dual variational Gaussian inference (Khan et al. 2013): objective, bounds, optimisers and the DualVG guide."""
from .bounds import (
    LOGIT_BOUNDS,
    GaussianBound,
    GenericBound,
    LocalBound,
    LogitBohningBound,
    LogitJaakkolaBound,
    LogitJensenBound,
    LogitTightBound,
    PiecewiseQuadraticBound,
    PoissonBound,
    StackedBound,
    StochasticVolatility,
    StochasticVolatilityBound,
    make_bound,
    numerical_conjugate,
)
from .objective import (
    BandedPrecisionBackend,
    DualValue,
    LatentSpaceBackend,
    LatentSpaceHessian,
    SiteSpaceBackend,
    dual_vg_objective,
    exact_elbo,
    lvb_elbo,
    reduced_objective,
)
from .optim import DualSolution, initial_alpha, minimize_joint, solve_dual
from .guide import DualVG
from .engine import (
    DualState,
    DualVGEngine,
    DualVGOptions,
    build_dual_problem,
    dual_vg_applies,
    fit_dual_vg,
    site_space_predictive,
)
