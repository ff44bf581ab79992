"""Ordinary Pyro idioms through the engines: offsets, masks, scales, factors, deterministic sites, obs_mask.

Every posterior and bound is checked in float64 against an independent reference: the exact conjugate
posterior, the same model written without the idiom (a shifted prior mean, the kept rows only,
duplicated rows), quadrature of the Pyro model's own log joint, or a dense computation.
"""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import Predictive
from scipy.integrate import trapezoid

import pyro_convexvb as pcv
from pyro_convexvb.gp.predict import gp_latent_predictive
from pyro_convexvb.infer.dual_vg import site_space_predictive
from pyro_convexvb.lgm.sites import gauss_hermite

D = torch.float64
ENGINES = ["dual_vg", "convex_relaxation", "laplace"]
OPTIONS = {"dual_vg": dict(gap_tol=1e-13),
           "convex_relaxation": dict(max_outer=60, gamma_tol=1e-9, phi_tol=1e-12, variance="exact", newton_tol=1e-12),
           "laplace": dict(grad_tol=1e-10, max_iter=2000)}
# Laplace's mode is found by L-BFGS to a relative gradient of 1e-10; the other two solve to ~1e-9
TOL = {"dual_vg": 1e-7, "convex_relaxation": 1e-5, "laplace": 1e-5}


def fit(model, *args, engine, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        return pcv.fit(model, *args, engine=engine, options=OPTIONS.get(engine, {}), progress=False, **kwargs)


def _kernel(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(n, 1, generator=g, dtype=D)
    return torch.exp(-0.5 * torch.cdist(Z, Z) ** 2 / 0.7**2) + 1e-4 * torch.eye(n, dtype=D), Z


def _labels(n, seed=1, p=0.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g, dtype=D) < p).to(D)


def _close(a, b, tol):
    return float((a - b).abs().max()) <= tol * (1 + float(b.abs().max()))


# ----------------------------------------------------------------------------------------- offsets
N_GP = 12
K_GP, Z_GP = _kernel(N_GP)
C_OFF = 0.7


def gp_offset(K, y=None):
    f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(K.shape[0], dtype=D), K))
    with pyro.plate("data", K.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=f + C_OFF), obs=y)


def gp_shifted(K, y=None):
    h = pyro.sample("f", dist.MultivariateNormal(torch.full((K.shape[0],), C_OFF, dtype=D), K))
    with pyro.plate("data", K.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=h), obs=y)


@pytest.mark.parametrize("engine", ENGINES)
def test_gp_constant_offset_gives_the_posterior_of_f(engine):
    """logits = f + c is the model h = f + c ~ N(c, K): the posterior of f is that of h shifted by -c."""
    y = _labels(N_GP)
    a = fit(gp_offset, K_GP, y=y, engine=engine)
    b = fit(gp_shifted, K_GP, y=y, engine=engine)
    assert _close(a.posterior.loc, b.posterior.loc - C_OFF, TOL[engine])
    assert _close(a.posterior.covariance(), b.posterior.covariance(), TOL[engine])
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-6)
    # the guide samples f, not f + c
    guide = a.posterior.as_guide()
    assert torch.allclose(guide.median(K_GP, y)["f"], a.posterior.loc, atol=1e-10)


@pytest.mark.parametrize("engine", ENGINES)
def test_gp_offset_with_gaussian_likelihood_is_exact(engine):
    g = torch.Generator().manual_seed(3)
    yr = torch.randn(N_GP, generator=g, dtype=D) + C_OFF
    s = 0.4

    def model(K, y=None):
        f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(K.shape[0], dtype=D), K))
        with pyro.plate("data", K.shape[0]):
            pyro.sample("y", dist.Normal(f + C_OFF, s), obs=y)

    S = K_GP + s**2 * torch.eye(N_GP, dtype=D)
    m = K_GP @ torch.linalg.solve(S, yr - C_OFF)
    V = K_GP - K_GP @ torch.linalg.solve(S, K_GP)
    logZ = float(dist.MultivariateNormal(torch.full((N_GP,), C_OFF, dtype=D), S).log_prob(yr))
    res = fit(model, K_GP, y=yr, engine=engine)
    assert _close(res.posterior.loc, m, TOL[engine])
    assert _close(res.posterior.covariance(), V, TOL[engine])
    assert res.log_evidence_bound == pytest.approx(logZ, abs=1e-6)


def poisson_exposure(K, E, y=None):
    f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(K.shape[0], dtype=D), K))
    with pyro.plate("data", K.shape[0]):
        pyro.sample("y", dist.Poisson(E * torch.exp(f)), obs=y)


def poisson_shifted(K, E, y=None):
    h = pyro.sample("f", dist.MultivariateNormal(torch.log(E), K))
    with pyro.plate("data", K.shape[0]):
        pyro.sample("y", dist.Poisson(torch.exp(h)), obs=y)


@pytest.mark.parametrize("engine", ENGINES)
def test_poisson_exposure_is_a_log_offset(engine):
    g = torch.Generator().manual_seed(4)
    E = 0.5 + 3 * torch.rand(N_GP, generator=g, dtype=D)
    y = torch.poisson(E * 1.3, generator=g)
    lgm = pcv.lgm_from_pyro(poisson_exposure, K_GP, E, y=y)
    assert torch.allclose(lgm.sites[0].offset, torch.log(E), atol=1e-12)
    if engine == "convex_relaxation":  # Poisson sites have no super-Gaussian form: refused, naming the site
        with pytest.raises(pcv.UnsupportedModelError, match="Poisson") as info:
            fit(poisson_exposure, K_GP, E, y=y, engine=engine)
        assert info.value.site == "y"
        return
    a = fit(poisson_exposure, K_GP, E, y=y, engine=engine)
    b = fit(poisson_shifted, K_GP, E, y=y, engine=engine)
    assert _close(a.posterior.loc, b.posterior.loc - torch.log(E), TOL[engine])
    assert _close(a.posterior.covariance(), b.posterior.covariance(), TOL[engine])
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_intercept_in_its_own_latent_site(engine):
    """logits = X @ w + b with b ~ Normal: exact against the conjugate posterior of [w; b] with design [X, 1]."""
    g = torch.Generator().manual_seed(5)
    X = torch.randn(20, 3, generator=g, dtype=D)
    yr = X @ torch.tensor([1.0, -0.5, 0.3], dtype=D) + 0.8 + 0.3 * torch.randn(20, generator=g, dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.2, dtype=D), 2.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w + b, 0.3), obs=y)

    A = torch.cat([X, torch.ones(20, 1, dtype=D)], 1)
    mu = torch.tensor([0, 0, 0, 0.2], dtype=D)
    S0 = torch.diag(torch.tensor([1, 1, 1, 4.0], dtype=D))
    P = torch.linalg.inv(S0) + A.T @ A / 0.09
    V = torch.linalg.inv(P)
    m = V @ (torch.linalg.solve(S0, mu) + A.T @ yr / 0.09)
    logZ = float(dist.MultivariateNormal(A @ mu, A @ S0 @ A.T + 0.09 * torch.eye(20, dtype=D)).log_prob(yr))
    res = fit(model, X, y=yr, engine=engine)
    assert _close(res.posterior.loc, m, TOL[engine])
    assert _close(res.posterior.covariance(), V, TOL[engine])
    assert res.log_evidence_bound == pytest.approx(logZ, abs=1e-6)


def test_site_space_predictive_and_latent_predictive_agree_with_an_offset():
    y = _labels(N_GP)
    Zt = torch.linspace(-2, 2, 7, dtype=D)[:, None]
    Kx = torch.exp(-0.5 * torch.cdist(Zt, Z_GP) ** 2 / 0.7**2)
    kd = torch.ones(7, dtype=D)
    a = fit(gp_offset, K_GP, y=y, engine="dual_vg")
    b = fit(gp_shifted, K_GP, y=y, engine="dual_vg")
    m1, v1 = site_space_predictive(a, Kx, kd, 0.0)
    m2, v2 = gp_latent_predictive(K_GP, Kx, kd, a.posterior)  # from the posterior of f itself
    m3, v3 = site_space_predictive(b, Kx, kd, C_OFF)  # h_* = f_* + c
    assert torch.allclose(m1, m2, atol=1e-8) and torch.allclose(v1, v2, atol=1e-8)
    assert torch.allclose(m1 + C_OFF, m3, atol=1e-8) and torch.allclose(v1, v3, atol=1e-8)


def test_gp_classifier_mean_equals_the_offset_model():
    gpytorch = pytest.importorskip("gpytorch")
    from pyro_convexvb.gp.classifier import GPClassifier

    g = torch.Generator().manual_seed(6)
    X = torch.randn(15, 2, generator=g, dtype=D)
    y = (X[:, 0] + 0.5 * torch.randn(15, generator=g, dtype=D) > 0).long()
    kern = gpytorch.kernels.RBFKernel().double()
    kern.lengthscale = 0.9
    clf = GPClassifier(kern, mean=C_OFF, jitter=1e-6, options={"gap_tol": 1e-11}).fit(X, y)
    K = torch.as_tensor(clf.K_train_)
    res = fit(gp_offset, K, y=y.to(D), engine="dual_vg")
    assert torch.allclose(torch.as_tensor(clf.posterior_.loc), res.posterior.loc + C_OFF, atol=1e-7)
    Xt = torch.randn(5, 2, generator=g, dtype=D)
    Kx = clf.kernel_(Xt, X).to_dense().detach()
    kd = clf.kernel_(Xt, diag=True).detach()
    m, v = map(torch.as_tensor, clf.predict_latent(Xt))
    m_ref, v_ref = site_space_predictive(res, Kx, kd, 0.0)
    assert torch.allclose(m, m_ref + C_OFF, atol=1e-7) and torch.allclose(v, v_ref, atol=1e-7)


# ----------------------------------------------------------------------------------------- masks
def _logreg_data(q=24, seed=7):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(q, 2, generator=g, dtype=D)
    y = (torch.rand(q, generator=g, dtype=D) < torch.sigmoid(X @ torch.tensor([1.0, -1.0], dtype=D))).to(D)
    return X, y


MASK = torch.arange(24) % 3 != 0


def logreg_masked(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]), poutine.mask(mask=MASK):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def logreg(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.mark.parametrize("engine", ENGINES)
def test_poutine_mask_rows_are_absent_from_the_likelihood(engine):
    X, y = _logreg_data()
    a = fit(logreg_masked, X, y=y, engine=engine)
    b = fit(logreg, X[MASK], y=y[MASK], engine=engine)
    assert _close(a.posterior.loc, b.posterior.loc, TOL[engine])
    assert _close(a.posterior.covariance(), b.posterior.covariance(), TOL[engine])
    # every engine's bound (Laplace's is the exact VG bound of its Gaussian on the extracted model)
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-6)


def test_masked_bound_of_the_baselines_is_the_bound_of_the_kept_rows():
    """The baselines' exact bound of a fixed q on the masked model equals a 2-D quadrature of Pyro's own
    log joint restricted to the kept rows (E_q[log p(y, w)] + H[q])."""
    X, y = _logreg_data()
    res = fit(logreg_masked, X, y=y, engine="laplace")
    q = res.posterior
    x, wts = gauss_hermite(40)
    L = torch.linalg.cholesky(q.covariance())
    Wg = torch.stack(torch.meshgrid(x, x, indexing="ij"), -1).reshape(-1, 2)
    pts = q.loc + Wg @ L.T
    ww = (wts[:, None] * wts[None, :]).reshape(-1)
    lj = torch.stack([poutine.trace(poutine.condition(logreg, data={"w": p})).get_trace(X[MASK], y[MASK]).log_prob_sum()
                      for p in pts])
    entropy = 0.5 * 2 * (1 + math.log(2 * math.pi)) + torch.log(torch.diagonal(L)).sum()
    assert res.log_evidence_bound == pytest.approx(float((ww * lj).sum() + entropy), abs=1e-9)


# ----------------------------------------------------------------------------------------- scales
def test_poutine_scale_on_a_gaussian_likelihood_is_exact():
    """N(y | eta, s^2)^w: exact posterior with variance s^2 / w; bound = 1-D quadrature of Pyro's scaled joint."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(10, generator=g, dtype=D)
    yr = 0.7 * x + 0.5 * torch.randn(10, generator=g, dtype=D)
    wts = torch.linspace(0.3, 2.5, 10, dtype=D)

    def model(x, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.1, dtype=D), 1.5))
        with pyro.plate("data", 10), poutine.scale(scale=wts):
            pyro.sample("y", dist.Normal(b * x, 0.5), obs=y)

    prec = 1 / 1.5**2 + (wts * x * x).sum() / 0.25
    m = (0.1 / 1.5**2 + (wts * x * yr).sum() / 0.25) / prec
    from scipy import integrate

    def joint(b):
        tr = poutine.trace(poutine.condition(model, data={"b": torch.tensor(b, dtype=D)})).get_trace(x, yr)
        return math.exp(float(tr.log_prob_sum()))

    Z, _ = integrate.quad(joint, float(m) - 12 / math.sqrt(float(prec)), float(m) + 12 / math.sqrt(float(prec)),
                          epsabs=0, epsrel=1e-12, limit=200)
    for engine in ENGINES:
        res = fit(model, x, y=yr, engine=engine)
        assert float(res.posterior.loc) == pytest.approx(float(m), abs=TOL[engine])
        assert float(res.posterior.covariance()) == pytest.approx(float(1 / prec), rel=TOL[engine])
        assert res.log_evidence_bound == pytest.approx(math.log(Z), abs=1e-7)


def logreg_scaled(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]), poutine.scale(scale=2.0):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.mark.parametrize("engine", ENGINES)
def test_poutine_scale_two_is_the_data_twice(engine):
    """A Bernoulli likelihood scaled by 2 is the same data observed twice: engines give that posterior
    and bound, or (when their site terms take no weights) refuse naming the site."""
    X, y = _logreg_data()
    try:
        a = fit(logreg_scaled, X, y=y, engine=engine)
    except pcv.UnsupportedModelError as e:
        assert engine != "laplace" and e.site == "y" and "weighted" in str(e)
        return
    b = fit(logreg, torch.cat([X, X]), y=torch.cat([y, y]), engine=engine)
    assert _close(a.posterior.loc, b.posterior.loc, TOL[engine])
    assert _close(a.posterior.covariance(), b.posterior.covariance(), TOL[engine])
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-6)


@pytest.mark.parametrize("engine", ["dual_vg", "laplace"])
def test_subsampled_plate_fits_the_full_data_without_its_scale(engine):
    X, y = _logreg_data()

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0], subsample_size=5) as idx:
            pyro.sample("y", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])

    lgm = pcv.lgm_from_pyro(model, X, y=y)
    assert lgm.sites[0].weight is None and lgm.sites[0].size == 24
    a = fit(model, X, y=y, engine=engine)
    b = fit(logreg, X, y=y, engine=engine)
    assert _close(a.posterior.loc, b.posterior.loc, TOL[engine])
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-6)


# ----------------------------------------------------------------------------------------- deterministic, factor
@pytest.mark.parametrize("engine", ENGINES)
def test_deterministic_site_is_a_record(engine):
    X, y = _logreg_data()

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        eta = pyro.deterministic("eta", X @ w)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=eta), obs=y)

    a = fit(model, X, y=y, engine=engine)
    b = fit(logreg, X, y=y, engine=engine)
    assert _close(a.posterior.loc, b.posterior.loc, TOL[engine])
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-6)
    pred = Predictive(model, guide=a.posterior.as_guide(), num_samples=3)(X)
    assert pred["eta"].shape[0] == 3 and pred["eta"].shape[-1] == 24


@pytest.mark.parametrize("engine", ENGINES)
def test_gaussian_factor_and_constant_factor(engine):
    """pyro.factor(Normal(X w + b, s).log_prob(y)) is the Gaussian likelihood; a constant factor joins the bound."""
    g = torch.Generator().manual_seed(9)
    X = torch.randn(15, 2, generator=g, dtype=D)
    yr = X @ torch.tensor([0.5, -1.0], dtype=D) + 0.3 * torch.randn(15, generator=g, dtype=D)

    def factor_model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        pyro.factor("lik", dist.Normal(X @ w + 0.2, 0.3).log_prob(y).sum())
        pyro.factor("const", torch.tensor(-1.25, dtype=D))

    def obs_model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w + 0.2, 0.3), obs=y)

    P = torch.eye(2, dtype=D) + X.T @ X / 0.09
    V = torch.linalg.inv(P)
    m = V @ X.T @ (yr - 0.2) / 0.09
    logZ = float(dist.MultivariateNormal(torch.full((15,), 0.2, dtype=D),
                                         X @ X.T + 0.09 * torch.eye(15, dtype=D)).log_prob(yr)) - 1.25
    res = fit(factor_model, X, yr, engine=engine)
    assert _close(res.posterior.loc, m, TOL[engine])
    assert _close(res.posterior.covariance(), V, TOL[engine])
    assert res.log_evidence_bound == pytest.approx(logZ, abs=1e-6)
    ref = fit(obs_model, X, yr, engine=engine)
    assert res.log_evidence_bound == pytest.approx(ref.log_evidence_bound - 1.25, abs=1e-6)


# ----------------------------------------------------------------------------------------- obs_mask
N_OM = 12
OBS = torch.arange(N_OM) % 3 != 0


def obs_mask_model(X, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", N_OM):
        # broadcasting form, so that Pyro's guides can add sample dimensions to w
        return pyro.sample("y", dist.Normal((w.unsqueeze(-2) * X).sum(-1) + 0.3, 0.5), obs=y, obs_mask=OBS)


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_obs_mask_imputes_the_missing_entries_by_the_predictive(engine):
    g = torch.Generator().manual_seed(10)
    X = torch.randn(N_OM, 2, generator=g, dtype=D)
    yr = torch.randn(N_OM, generator=g, dtype=D)
    yr[~OBS] = float("nan")  # missing entries may hold anything
    lgm = pcv.lgm_from_pyro(obs_mask_model, X, yr)
    assert lgm.layout.names == ["w"] and lgm.model_layout.names == ["w", "y_unobserved"]
    Xo, k = X[OBS], int(OBS.sum())
    V = torch.linalg.inv(torch.eye(2, dtype=D) + Xo.T @ Xo / 0.25)
    m = V @ Xo.T @ (yr[OBS] - 0.3) / 0.25
    logZ = float(dist.MultivariateNormal(torch.full((k,), 0.3, dtype=D),
                                         Xo @ Xo.T + 0.25 * torch.eye(k, dtype=D)).log_prob(yr[OBS]))
    res = fit(lgm, engine=engine)
    assert res.log_evidence_bound == pytest.approx(logZ, abs=1e-6)
    q = res.posterior  # the engine completes u's posterior with the imputed sites
    assert q.layout.names == ["w", "y_unobserved"] and q.n == 2 + N_OM
    q_model = pcv.fit(obs_mask_model, X, yr, engine=engine, progress=False).posterior  # the same from the model
    torch.testing.assert_close(q_model.loc, q.loc)
    assert _close(q.loc[:2], m, TOL[engine])
    assert _close(q.loc[2:], X @ m + 0.3, TOL[engine])
    C = q.covariance()
    assert _close(C[2:, 2:], X @ V @ X.T + 0.25 * torch.eye(N_OM, dtype=D), TOL[engine])
    assert _close(C[2:, :2], X @ V, TOL[engine])
    # the guide imputes: Predictive's y holds the data where observed and draws of the predictive elsewhere
    pyro.set_rng_seed(0)
    pred = Predictive(obs_mask_model, guide=q_model.as_guide(), num_samples=4000, parallel=True)(X, yr)
    assert torch.equal(pred["y"][:, OBS], yr[OBS].expand(4000, k))
    sd = torch.sqrt(torch.diagonal(C[2:, 2:]))[~OBS]
    assert ((pred["y"][:, ~OBS].mean(0) - (X @ m + 0.3)[~OBS]).abs() < 5 * sd / math.sqrt(4000)).all()


def test_obs_mask_on_a_discrete_site_is_refused():
    X, y = _logreg_data(q=N_OM)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", N_OM):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y, obs_mask=OBS)

    with pytest.raises(pcv.UnsupportedModelError, match="partially observed discrete site 'y'") as info:
        pcv.lgm_from_pyro(model, X, y)
    assert info.value.site == "y_unobserved"


# ----------------------------------------------------------------------------------------- several families, shapes, dtypes
def test_several_observed_families_in_one_model():
    """Bernoulli + Poisson + Normal on one 2-D latent: extraction equals Pyro's log joint; dual_vg's bound is the
    exact VG bound of its q (2-D Gauss-Hermite of Pyro's log joint) and lies below log p(y) (2-D quadrature)."""
    g = torch.Generator().manual_seed(11)
    X = torch.randn(8, 2, generator=g, dtype=D)
    yb = (torch.rand(8, generator=g, dtype=D) < 0.5).to(D)
    yc = torch.poisson(torch.full((8,), 1.5, dtype=D), generator=g)
    yg = torch.randn(8, generator=g, dtype=D)

    def model(X, yb, yc, yg):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        eta = X @ w
        with pyro.plate("data", 8):
            pyro.sample("yb", dist.Bernoulli(logits=eta), obs=yb)
            pyro.sample("yc", dist.Poisson(torch.exp(0.5 * eta - 0.2)), obs=yc)
            pyro.sample("yg", dist.Normal(eta + 1.0, 0.8), obs=yg)

    args = (X, yb, yc, yg)

    def log_joint(w):
        return float(poutine.trace(poutine.condition(model, data={"w": w})).get_trace(*args).log_prob_sum())

    def log_joint_batch(W):  # the same density written out by hand, vectorised over rows of W
        eta = W @ X.T
        return (dist.Normal(0.0, 1.0).log_prob(W).sum(-1) + dist.Bernoulli(logits=eta).log_prob(yb).sum(-1)
                + dist.Poisson(torch.exp(0.5 * eta - 0.2)).log_prob(yc).sum(-1)
                + dist.Normal(eta + 1.0, 0.8).log_prob(yg).sum(-1))

    lgm = pcv.lgm_from_pyro(model, *args)
    assert sorted(type(s.family).__name__ for s in lgm.sites) == ["BernoulliLogit", "Gaussian", "Poisson"]
    for seed in range(3):
        w = torch.randn(2, generator=torch.Generator().manual_seed(seed), dtype=D)
        assert float(lgm.log_joint(w)) == pytest.approx(log_joint(w), abs=1e-10)
        assert float(log_joint_batch(w[None])[0]) == pytest.approx(log_joint(w), abs=1e-10)
    res = fit(model, *args, engine="dual_vg")
    q = res.posterior
    x, wts = gauss_hermite(40)
    L = torch.linalg.cholesky(q.covariance())
    grid = torch.stack(torch.meshgrid(x, x, indexing="ij"), -1).reshape(-1, 2)
    ww = (wts[:, None] * wts[None, :]).reshape(-1)
    e_lj = float((ww * log_joint_batch(q.loc + grid @ L.T)).sum())
    entropy = (1 + math.log(2 * math.pi)) + float(torch.log(torch.diagonal(L)).sum())
    assert res.log_evidence_bound == pytest.approx(e_lj + entropy, abs=1e-8)
    # log p(y) by a dense 2-D grid around the posterior
    sd = torch.sqrt(torch.diagonal(q.covariance()))
    a = [torch.linspace(float(q.loc[i] - 9 * sd[i]), float(q.loc[i] + 9 * sd[i]), 401, dtype=D) for i in range(2)]
    vals = log_joint_batch(torch.stack(torch.meshgrid(a[0], a[1], indexing="ij"), -1).reshape(-1, 2)).reshape(401, 401)
    mx = float(vals.max())
    logZ = mx + math.log(trapezoid(trapezoid(np.exp((vals - mx).numpy()), a[1].numpy(), axis=1), a[0].numpy()))
    assert res.log_evidence_bound <= logZ and logZ - res.log_evidence_bound < 0.05
    # Laplace: its mode is a stationary point of Pyro's own log joint
    lap = fit(model, *args, engine="laplace")
    w = lap.posterior.loc.clone().requires_grad_(True)
    tr = poutine.trace(poutine.condition(model, data={"w": w})).get_trace(*args)
    grad = torch.autograd.grad(tr.log_prob_sum(), w)[0]
    assert float(grad.abs().max()) < 1e-6


def test_latent_sites_of_several_shapes():
    """Scalar, vector, matrix and plate-batched latents: layout, unflatten and the exact posterior."""
    g = torch.Generator().manual_seed(12)
    n = 30
    X = torch.randn(n, 3, generator=g, dtype=D)
    A = torch.randn(n, 2, 2, generator=g, dtype=D)
    grp = torch.arange(n) % 4
    yr = torch.randn(n, generator=g, dtype=D)

    def model(X, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.5, dtype=D), 2.0))
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        W = pyro.sample("W", dist.Normal(torch.zeros(2, 2, dtype=D), 0.5).to_event(2))
        with pyro.plate("groups", 4):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=D), 0.8))
        eta = b + X @ w + (A * W).sum((-1, -2)) + z[grp]
        with pyro.plate("data", n):
            pyro.sample("y", dist.Normal(eta, 0.4), obs=y)

    lgm = pcv.lgm_from_pyro(model, X, y=yr)
    assert [(blk.name, blk.shape) for blk in lgm.layout.blocks] == [("b", ()), ("w", (3,)), ("W", (2, 2)), ("z", (4,))]
    # hand-built design in trace order: b, w, W (row-major), z
    B = torch.cat([torch.ones(n, 1, dtype=D), X, A.reshape(n, 4), torch.nn.functional.one_hot(grp, 4).to(D)], 1)
    prior_sd = torch.tensor([2.0] + [1.0] * 3 + [0.5] * 4 + [0.8] * 4, dtype=D)
    mu = torch.zeros(12, dtype=D)
    mu[0] = 0.5
    P = torch.diag(prior_sd**-2) + B.T @ B / 0.16
    V = torch.linalg.inv(P)
    m = V @ (mu / prior_sd**2 + B.T @ yr / 0.16)
    res = fit(model, X, y=yr, engine="dual_vg")
    assert _close(res.posterior.loc, m, 1e-8) and _close(res.posterior.covariance(), V, 1e-8)
    vals = lgm.layout.unflatten(m)
    assert vals["b"].shape == () and vals["W"].shape == (2, 2) and vals["z"].shape == (4,)
    torch.testing.assert_close(vals["W"], m[4:8].reshape(2, 2))
    med = res.posterior.as_guide().median(X, yr)
    for name in ("b", "w", "W", "z"):
        torch.testing.assert_close(med[name], vals[name], atol=1e-10, rtol=0)
    u = torch.randn(12, generator=g, dtype=D)
    tr = poutine.trace(poutine.condition(model, data=lgm.layout.unflatten(u))).get_trace(X, yr)
    assert float(lgm.log_joint(u)) == pytest.approx(float(tr.log_prob_sum()), abs=1e-9)


def test_float32_labels_with_float64_parameters_fit_in_float64():
    X, y = _logreg_data()
    a = fit(logreg, X, y=y.float(), engine="dual_vg")
    b = fit(logreg, X, y=y, engine="dual_vg")
    assert a.posterior.loc.dtype == D
    assert _close(a.posterior.loc, b.posterior.loc, 1e-10)
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-9)


def test_float32_design_with_float64_parameters_is_a_clear_error():
    X, y = _logreg_data()
    with pytest.raises(pcv.UnsupportedModelError, match="different floating dtypes.*float32") as info:
        pcv.lgm_from_pyro(logreg, X.float(), y=y)
    assert info.value.site == "<model>" and "after site 'w'" in str(info.value) and "torch.as_tensor" in str(info.value)
