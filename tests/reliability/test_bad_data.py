"""Data and options that no engine can fit give one clear error, naming the input, before any engine runs;
valid but extreme data are fitted (or reported unconverged), never crash inside a solver."""
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv

D = torch.float64
ENGINES = sorted(pcv.engines())


def logistic(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def poisson(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Poisson(rate=torch.exp(X @ w)), obs=y)


def no_latent(X, y=None):
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X.sum(-1)), obs=y)


def _data(n=20, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=D)
    return X, (X[:, 0] > 0).to(D)


@pytest.mark.parametrize("engine", ENGINES)
def test_zero_rows_name_the_arguments(engine):
    X, y = _data()
    with pytest.raises(ValueError, match=r"empty data .* arguments 'X', 'y' have 0 rows"):
        pcv.fit(logistic, X[:0], y=y[:0], engine=engine, progress=False)


@pytest.mark.parametrize("engine", ENGINES)
def test_non_finite_inputs_name_the_argument_and_entry(engine):
    X, y = _data()
    X[2, 1] = float("inf")
    with pytest.raises(ValueError, match=r"argument 'X' has 1 non-finite entry .* index \(2, 1\)"):
        pcv.fit(logistic, X, y=y, engine=engine, progress=False)


@pytest.mark.parametrize("engine", ["dual_vg", "laplace"])
@pytest.mark.parametrize("where", ["X", "y"])
def test_nan_inputs_name_the_argument_and_entry(engine, where):
    """A NaN makes a distribution's parameter (or an observation) invalid while the model is traced: the error still
    names the argument and the entry, as for inf, not the distribution's parameter."""
    X, y = _data()
    if where == "X":
        X[2, 1], at = float("nan"), r"\(2, 1\)"
    else:
        y[3], at = float("nan"), r"\(3,\)"
    with pytest.raises(ValueError, match=rf"argument '{where}' has 1 non-finite entry .* index {at}"):
        pcv.fit(logistic, X, y=y, engine=engine, progress=False)


def test_nan_observations_held_by_no_argument_name_the_site():
    X, y = _data()
    y[3] = float("nan")

    def closure(X):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    with pytest.raises(ValueError, match=r"site 'y': 1 observed value is inf or NaN: .* obs_mask"):
        pcv.fit(closure, X, engine="dual_vg", progress=False)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_without_latent_sites_is_refused(engine):
    X, y = _data()
    with pytest.raises(ValueError, match="no latent sample site"):
        pcv.fit(no_latent, X, y=y, engine=engine, progress=False)


@pytest.mark.parametrize("engine", ["dual_vg", "laplace", "svi_automvn", "nuts"])
def test_masked_out_responses_may_hold_nan(engine):
    """``obs_mask``'s unused entries are never read: NaN there is not an input error, for the engines that run the
    Pyro model too (Pyro validates and differentiates the masked-out entries' log density before masking it: a
    NaN there failed its support check)."""
    def masked(X, y=None, m=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y, obs_mask=m)

    X, _ = _data()
    y = X @ torch.tensor([1.0, 2.0, 3.0], dtype=D)
    m = torch.ones(len(y), dtype=torch.bool)
    m[3], y[3] = False, float("nan")
    assert engine in pcv.engines_that_fit(masked, X, y=y, m=m)
    opts = {"nuts": dict(num_samples=100, warmup_steps=100, seed=0),
            "svi_automvn": dict(seed=0, max_steps=1500)}.get(engine, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        res = pcv.fit(masked, X, y=y, m=m, engine=engine, options=opts, progress=False)
    full = pcv.fit(masked, X[m], y=y[m], m=m[m], engine="dual_vg", progress=False)
    err = (res.posterior.loc[:3] - full.posterior.loc[:3]).abs() / full.posterior.scale[:3]
    assert float(err.max()) < {"dual_vg": 1e-7, "laplace": 1e-5}.get(engine, 0.3)
    if engine == "dual_vg":
        assert res.converged


def test_infinite_and_nan_options_are_refused():
    X, y = _data()
    with pytest.raises(ValueError, match="option 'lr' must be a finite number"):
        pcv.fit(logistic, X, y=y, engine="svi_autonormal", options={"lr": float("inf")})


def test_dual_vg_alpha0_of_the_wrong_length_names_the_option():
    X, y = _data()
    with pytest.raises(ValueError, match=r"option 'alpha0' .* shape \(20,\); got shape \(3,\)"):
        pcv.fit(logistic, X, y=y, engine="dual_vg", progress=False, options={"alpha0": torch.zeros(3, dtype=D)})


def test_dual_vg_fits_all_zero_counts_like_laplace():
    """All-zero counts on 1000 rows and 50 features: the Woodbury preconditioner of Newton-CG was indefinite in
    floating point there (``NotPositiveDefiniteError``) and the prior-marginal start sat at rates of e^25."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(1000, 50, generator=g, dtype=D)
    y = torch.zeros(1000, dtype=D)
    res = pcv.fit(poisson, X, y=y, engine="dual_vg", progress=False)
    lap = pcv.fit(poisson, X, y=y, engine="laplace", progress=False)
    assert res.converged
    sd = lap.posterior.variance.sqrt()
    # the Gaussian VB mean and the Laplace mode differ by O(sd^2) terms here: both within a fifth of an sd
    assert float(((res.posterior.loc - lap.posterior.loc).abs() / sd).max()) < 0.2
    assert torch.allclose(res.posterior.variance, lap.posterior.variance, rtol=0.1)


@pytest.mark.parametrize("draw", [False, True], ids=["constant", "poisson"])
def test_dual_vg_fits_counts_of_a_million_like_laplace(draw):
    """Counts ~1e6 that the design cannot reach without an intercept: from the prior-marginal or the data start
    the dual Newton iteration sat at gaps of 1e42-1e53 after 100 steps. It now starts at the Laplace
    approximation's dual point and ends at the resolution of float64: a gap below 1e-3 nats on a bound of
    -1.1e10 nats (1e-13 relative). Where that gap is within the certified rounding floor of a sum of 1000 terms of
    ~1e7 nats (about 1e-4) the fit reports converged; where rounding in the site means (``Sigma_t alpha`` with
    ``|alpha| ~ 1e6``) holds it a few times above that floor, it says so (not converged, with a warning)."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(1000, 50, generator=g, dtype=D)
    y = torch.full((1000,), 1e6, dtype=D)
    if draw:
        y = torch.poisson(y, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = pcv.fit(poisson, X, y=y, engine="dual_vg", progress=False)
    lap = pcv.fit(poisson, X, y=y, engine="laplace", progress=False)
    crit = res.optimality.criteria[0]
    assert crit.value < 1e-3
    assert res.converged == crit.met
    if res.converged:
        assert 1e-5 < crit.tol < 1e-3  # the rounding floor, above the default 1e-8 N
    else:  # stopped once g no longer changed and the gap stopped falling, well before the step cap, and says so
        assert any(issubclass(w.category, pcv.ConvergenceWarning) and "float64 resolution" in str(w.message)
                   for w in caught)
        assert "float64 resolution" in res.stop_reason and res.info["iterations"] < 100
    sd = lap.posterior.variance.sqrt()
    assert float(((res.posterior.loc - lap.posterior.loc).abs() / sd).max()) < 0.05
    assert torch.allclose(res.posterior.variance, lap.posterior.variance, rtol=0.05)


def test_the_gap_rounding_floor_leaves_ordinary_tolerances_alone():
    """On Bernoulli sites the float64 floor of the duality gap is far below the default ``1e-8 N``."""
    from pyro_convexvb.infer.dual_vg.optim import default_gap_tol, gap_rounding_floor, solve_dual
    from pyro_convexvb.infer.dual_vg import SiteSpaceBackend, make_bound
    from pyro_convexvb.infer.dual_vg.objective import reduced_objective
    from pyro_convexvb.lgm.sites import BernoulliLogit

    X, y = _data(n=200)
    K = X @ X.T + 1e-6 * torch.eye(200, dtype=D)
    backend, bound = SiteSpaceBackend(K, torch.zeros(200, dtype=D)), make_bound(BernoulliLogit(y))
    sol = solve_dual(backend, bound)
    val = reduced_objective(backend, bound, sol.alpha)
    assert sol.converged and sol.gap_tol == default_gap_tol(200)
    assert gap_rounding_floor(bound, sol.alpha, val) < 1e-3 * default_gap_tol(200)


def test_newton_cg_falls_back_to_the_jacobi_preconditioner_when_woodbury_is_indefinite():
    """A design entry of 1e30 makes the Woodbury form of the preconditioner indefinite in floating point: the
    Newton step is then solved with its diagonal form and the fit ends without a solver crash."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(1000, 50, generator=g, dtype=D)
    X[0, 0] = 1e30
    y = (torch.rand(1000, generator=g, dtype=D) < 0.5).to(D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(logistic, X, y=y, engine="dual_vg", progress=False)
    assert torch.isfinite(res.posterior.loc).all()
    assert res.converged == (res.optimality.criteria[0].value <= res.optimality.criteria[0].tol)


def test_a_singular_kernel_without_jitter_names_the_site_and_the_remedy():
    import numpy as np
    import gpytorch
    from pyro_convexvb.gp import GPClassifier

    rng = np.random.default_rng(0)
    X = np.repeat(rng.normal(size=(20, 2)), 2, axis=0)  # every input twice: K is singular
    y = (X[:, 0] > 0).astype(float)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    with pytest.raises(pcv.NotPositiveDefiniteError, match=r"site 'f'.*not positive definite.*jitter"):
        GPClassifier(kernel, engine="convex_relaxation", jitter=0.0).fit(X, y)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("labels", [2.0, -1.0])
def test_labels_outside_the_support_are_a_data_error_for_every_engine(engine, labels):
    """Labels 2 or -1 are refused as data (a ValueError naming the site), not as a model that other engines fit."""
    X, y = _data()
    y[y == 0] = labels
    with pytest.raises(ValueError, match=r"site 'y': observed values outside the support of Bernoulli") as e:
        pcv.fit(logistic, X, y=y, engine=engine, progress=False)
    assert "engines that fit" not in str(e.value)


def gaussian(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


@pytest.mark.parametrize("engine", ENGINES)
def test_observations_the_model_cannot_score_are_a_data_error_for_every_engine(engine):
    """Integer Bernoulli labels and a NumPy response fail in Pyro's own log_prob of the model as written (so in the
    diagnostics, LOO and Predictive too): every engine refuses them up front, naming the site and the remedy,
    instead of a bare torch error from inside a solver (or a fit whose diagnostics then crash)."""
    X, y = _data()
    with pytest.raises(ValueError, match=r"site 'y': Bernoulli.log_prob .* \(torch.int64, shape \(20,\)\).*"
                                         r"y.double\(\)"):
        pcv.fit(logistic, X, y=y.long(), engine=engine, progress=False)
    with pytest.raises(ValueError, match=r"site 'y': the observed value is a numpy.ndarray, not a torch tensor.*"
                                         r"torch.as_tensor\(y\)"):
        pcv.fit(logistic, X, y=y.numpy(), engine=engine, progress=False)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_column_response_is_a_data_error_for_every_engine(engine):
    """``y`` of shape (N, 1) under a plate of N would broadcast to N x N log-densities, and ``y`` of shape (N,) on a
    scalar distribution outside any plate has batch dimensions no plate declares: both refused, naming the shapes."""
    X, y = _data()
    with pytest.raises(ValueError, match=r"site 'y': the observed value has shape \(20, 1\), wider than the "
                                         r"distribution's shape \(20,\).*\(20, 20\).*y.squeeze\(1\)"):
        pcv.fit(gaussian, X, y=y[:, None], engine=engine, progress=False)

    def no_plate(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    with pytest.raises(ValueError, match=r"site 'y': the observed value has shape \(20,\), wider than the "
                                         r"distribution's shape \(\).*declared by no pyro.plate.*"
                                         r"pyro.plate\('data', 20\)"):
        pcv.fit(no_plate, y, engine=engine, progress=False)


def test_fit_arguments_given_as_options_name_the_argument():
    X, y = _data()
    for key in ("progress", "init"):
        with pytest.raises(TypeError, match=rf"options: '{key}' is an argument of pcv.fit, not an engine option"):
            pcv.fit(logistic, X, y=y, engine="dual_vg", options={key: None})


@pytest.mark.parametrize("engine", ENGINES)
def test_a_row_mask_around_the_whole_model_is_refused_by_every_engine(engine):
    """``poutine.mask(model, mask=(N,))`` also reaches the prior's site ``w``, whose log density would count once
    per row: Pyro's SVI refuses it, Pyro's NUTS and diag_mixture fitted the prior counted 14 times; now no engine
    claims the model and the refusal lists none."""
    from pyro import poutine

    X, y = _data()
    masked = poutine.mask(gaussian, mask=torch.arange(20) % 3 != 0)
    assert pcv.engines_that_fit(masked, X, y=y) == []
    with pytest.raises(pcv.UnsupportedModelError, match=r"site 'w'.*mask.*no registered engine fits this model"):
        pcv.fit(masked, X, y=y, engine=engine, progress=False)
