"""pyro_convexvb: fast convex variational inference engines for latent Gaussian models in Pyro.

Write an ordinary Pyro model, then swap the inference engine with one word::

    import pyro_convexvb as pcv
    res = pcv.fit(model, X, y=y, engine="dual_vg")
"""
import warnings as _warnings

import torch as _torch

# torch warns once per process that sparse CSR tensors are "in beta"; the package builds them on purpose (sparse
# designs, precisions): take that one warning here, so that it does not reach users from inside a fit
with _warnings.catch_warnings():
    _warnings.simplefilter("ignore")
    _torch.sparse_csr_tensor(_torch.tensor([0, 0]), _torch.tensor([], dtype=_torch.int64), _torch.tensor([]), (1, 1))

from .errors import ConvergenceError, ConvergenceWarning, NonConvexWarning, NotPositiveDefiniteError, UnsupportedModelError
from .posterior.gaussian import GaussianPosterior, GaussianPosteriorGuide
from .infer.engine import Engine, ModelEngine
from .infer.options import EngineOptions, option
from .infer.registry import engines, engines_that_fit, fit, get_engine, register_engine
from .infer.result import Criterion, History, InferenceResult, Optimality, Solution
from .lgm.extract import lgm_from_pyro
from .lgm.layout import LatentLayout
from .lgm.linear import linear
from .lgm.model import LatentGaussianModel, PriorBlock, SiteGroup
from .infer.convex_relaxation import ConvexVariationalRelaxation
from .infer.dual_vg import DualVG, dual_vg_objective
from .infer.diag_mixture import DiagMixtureELBO
from .posterior.mixture import AutoDiagMixture, DiagMixturePosterior
from .blr import BayesianLinearRegression
from .glm import GLM
from .logistic import BayesianLogisticRegression
from .online import OnlineADF, OnlineAdaGradLogistic, OnlineBayesLogistic, OnlineDimGauss, OnlineMarginalVB
from . import datasets, design, gp, linalg
from . import distributions
from .io import load, save
from . import distributed
from .design import ActiveLearner

__version__ = "0.1.0"
