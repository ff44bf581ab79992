"""Gamma (log link) and exponential responses: density against torch, expectations and the local bound against
scipy quadrature in float64 (valid, exact, Fenchel-Young residual zero at alpha*), and ``dual_vg`` fits against the
exact posterior by 2-D quadrature with its bound below the exact log evidence."""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import integrate, stats

import pyro_convexvb as pcv
from pyro_convexvb.infer.dual_vg.bounds import make_bound
from pyro_convexvb.lgm.families import GammaLog
from _grid_quadrature import grid_posterior_2d

D = torch.float64
Y = torch.tensor([0.05, 1.0, 3.0, 0.7, 12.0, 2.0], dtype=D)
K = torch.tensor([0.5, 1.0, 3.0, 1.7, 10.0, 1.0], dtype=D)


def _site(i):
    y, k = float(Y[i]), float(K[i])
    return lambda e: float(stats.gamma.logpdf(y, k, scale=math.exp(e) / k))


def _quad(fn, m, v):
    sd = math.sqrt(v)
    val, _ = integrate.quad(lambda e: fn(m + sd * e) * math.exp(-0.5 * e * e) / math.sqrt(2 * math.pi),
                            -10, 10, epsabs=1e-12, epsrel=1e-12, limit=200)
    return val


def test_log_prob_is_torch_gamma_and_expectation_matches_quadrature():
    fam = GammaLog(Y, K)
    eta = torch.linspace(-2, 2, 6, dtype=D)
    ref = torch.distributions.Gamma(K, K * torch.exp(-eta)).log_prob(Y)
    torch.testing.assert_close(fam.log_prob(eta), ref, rtol=1e-13, atol=1e-13)
    one = GammaLog(Y, torch.ones_like(Y))
    torch.testing.assert_close(one.log_prob(eta), torch.distributions.Exponential(torch.exp(-eta)).log_prob(Y),
                               rtol=1e-13, atol=1e-13)
    mean = torch.tensor([-2.0, -0.5, 0.0, 0.7, 1.5, 1.0], dtype=D)
    var = torch.tensor([0.01, 0.5, 2.0, 1.0, 0.3, 0.2], dtype=D)
    ref = torch.tensor([_quad(_site(i), float(mean[i]), float(var[i])) for i in range(6)], dtype=D)
    torch.testing.assert_close(fam.expected_log_prob(mean, var), ref, rtol=1e-10, atol=1e-10)
    pm = torch.tensor([_quad(math.exp, float(mean[i]), float(var[i])) for i in range(6)], dtype=D)
    torch.testing.assert_close(fam.predictive_mean(mean, var), pm, rtol=1e-10, atol=1e-10)


def test_local_bound_is_exact_keeps_every_constant_and_fenchel_young_vanishes_at_alpha_star():
    h = torch.linspace(-3, 3, 7, dtype=D)
    rho = torch.logspace(-3, 0.5, 5, dtype=D)
    H, R = (a.reshape(-1) for a in torch.meshgrid(h, rho, indexing="ij"))
    rows = torch.arange(H.numel()) % len(Y)
    b = make_bound(GammaLog(Y[rows], K[rows]))
    assert b.exact
    ref = torch.tensor([_quad(_site(int(r)), float(H[j]), float(R[j])) for j, r in enumerate(rows.tolist())], dtype=D)
    torch.testing.assert_close(b.f(H, R), -ref, rtol=1e-10, atol=1e-10)  # exact: f = -E log p, constants included
    torch.testing.assert_close(b.exact_expected_log_prob(H, R), ref, rtol=1e-10, atol=1e-10)
    a = b.alpha_star(H, R)
    lo, hi = b.alpha_domain(H)
    assert bool(((a > lo) & (a < hi)).all())
    res = b.fenchel_young_residual(a, H, R)
    torch.testing.assert_close(res, torch.zeros_like(res), rtol=0, atol=1e-9)
    other = b.fenchel_young_residual(a + 0.3 * torch.sign(hi - a - 1) * torch.minimum((hi - a) / 2, torch.ones_like(a)),
                                     H, R)
    assert bool((other > 0).all())  # positive away from alpha*
    with pytest.raises(pcv.UnsupportedModelError, match="not super-Gaussian"):
        GammaLog(Y, K).super_gaussian()


def gamma_data(m=20, k=2.0, seed=7):
    g = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.ones(m, 1, dtype=D), torch.randn(m, 1, generator=g, dtype=D)], 1)
    mu = torch.exp(X @ torch.tensor([0.5, -0.8], dtype=D))
    y = torch.distributions.Gamma(torch.full((m,), k, dtype=D), k / mu).sample()
    return X, y.clamp_min(1e-6)


def gamma_model(X, y=None, k=2.0, form="gamma"):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        mu = torch.exp(X @ w)
        d = dist.Exponential(1.0 / mu) if form == "exponential" else dist.Gamma(torch.tensor(k, dtype=D), k / mu)
        pyro.sample("y", d, obs=y)


def _reference(X, y, k, n=401):
    def log_lik(W):
        mu = np.exp(W @ X.numpy().T)
        return stats.gamma.logpdf(y.numpy()[None], k, scale=mu / k).sum(1)

    return grid_posterior_2d(log_lik, [-2.0, -3.0], [3.0, 2.0], n)


@pytest.mark.parametrize("form, k", [("gamma", 2.0), ("exponential", 1.0)])
def test_dual_vg_fits_the_exact_posterior_and_its_bound_is_below_the_evidence(form, k):
    X, y = gamma_data(k=k)
    mean, sd, log_ev = _reference(X, y, k)
    lgm = pcv.lgm_from_pyro(gamma_model, X, y=y, k=k, form=form)
    (g,) = lgm.sites
    assert isinstance(g.family, GammaLog)
    torch.testing.assert_close(g.design.to_dense(), X, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g.offset, torch.zeros_like(y), rtol=0, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(gamma_model, X, y=y, k=k, form=form, engine="dual_vg", progress=False)
    assert res.converged
    assert (np.abs(res.posterior.loc.numpy() - mean) / sd).max() < 0.1
    assert np.abs(res.posterior.covariance().diagonal().sqrt().numpy() / sd - 1).max() < 0.1
    assert log_ev - 0.1 < res.log_evidence_bound <= log_ev
    fitting = pcv.engines_that_fit(gamma_model, X, y=y, k=k, form=form)
    assert "dual_vg" in fitting and "convex_relaxation" not in fitting


def test_refusals_name_the_site():
    X, y = gamma_data()
    with pyro.validation_enabled(False), pytest.raises(pcv.UnsupportedModelError, match="must be positive") as err:
        pcv.lgm_from_pyro(gamma_model, X, y=torch.where(y > 1, y, -y))
    assert err.value.site == "y"


@pytest.mark.parametrize("family", ["gamma", "exponential", "stochastic_volatility"])
def test_dual_vg_under_a_wide_prior_starts_from_the_data(family):
    """``b, w ~ N(0, 30^2)``: the dual's start at the prior marginals puts ``E exp(-eta)`` at ``exp(450)``. It
    diverged (means 1e34-1e43, a bound of -1e80) from a prior sd of 7-10, and raised an error about an 'alpha0'
    nobody passed at 30; the data start (``kappa = 1/2`` at ``eta = log y^2``, as Poisson's ``log(y + 1/2)``) fits
    it, against 2-D quadrature."""
    ps, n = 30.0, 30
    rng = np.random.default_rng(19)
    x = np.linspace(-1, 1, n)
    e0 = 0.3 + 0.5 * x
    if family == "gamma":
        y = rng.gamma(2.0, np.exp(e0) / 2)
        site = lambda e: dist.Gamma(2.0, 2.0 * torch.exp(-e))  # noqa: E731
        ll = lambda e: stats.gamma.logpdf(y, 2.0, scale=np.exp(e) / 2)  # noqa: E731
    elif family == "exponential":
        y = rng.exponential(np.exp(e0))
        site, ll = (lambda e: dist.Exponential(torch.exp(-e))), (lambda e: stats.expon.logpdf(y, scale=np.exp(e)))
    else:
        y = np.exp(e0 / 2) * rng.normal(size=n)
        site, ll = (lambda e: dist.Normal(0.0, torch.exp(e / 2))), (lambda e: stats.norm.logpdf(y, 0, np.exp(e / 2)))

    def model(x, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), ps))
        w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=D), ps))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", site(b + w * x), obs=y)

    # quadrature in v = (b, w) / ps, whose prior is N(0, I)
    mean, sd, log_ev = grid_posterior_2d(lambda V: ll(ps * V[:, :1] + ps * V[:, 1:] * x).sum(1), [-0.1, -0.1],
                                         [0.1, 0.1], n=301, rounds=4)
    res = pcv.fit(model, torch.tensor(x, dtype=D), y=torch.tensor(y, dtype=D), engine="dual_vg", progress=False)
    assert res.converged
    np.testing.assert_allclose(res.posterior.loc.numpy(), ps * mean, atol=0.01 * ps * sd.max())
    np.testing.assert_allclose(res.posterior.scale.numpy(), ps * sd, rtol=0.05)
    assert -0.05 < res.log_evidence_bound - log_ev <= 1e-9


def test_obs_mask_on_a_gamma_likelihood_fits_with_the_engines_on_the_pyro_model():
    """The missing entries of ``obs_mask`` get a proper filler density; for a Gamma site the filler's support was
    ``GreaterThan(0)`` against the site's ``GreaterThanEq(0)``, so the mixture's support became a
    ``MaskedConstraint`` and every engine that ``engines_that_fit`` listed (laplace, diag_mixture, nuts, SVI) crashed
    in Pyro ("Cannot transform MaskedConstraint constraints"). Now laplace fits it: its ``(b, w)`` mode equals that of
    the observed rows alone (for a log-link Gamma the missing entries' joint mode does not depend on ``b, w``)."""
    rng = np.random.default_rng(11)
    n = 30
    x = torch.tensor(rng.normal(size=n), dtype=D)
    y = torch.tensor(rng.gamma(2.0, np.exp(0.3 + 0.8 * x.numpy()) / 2.0), dtype=D)
    keep = torch.arange(n) % 3 != 0
    y_missing = torch.where(keep, y, torch.full_like(y, float("nan")))

    def model(x, keep=None, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Gamma(2.0, 2.0 * torch.exp(-(b + w * x))), obs=y, obs_mask=keep)

    assert "laplace" in pcv.engines_that_fit(model, x, keep, y=y_missing)
    res = pcv.fit(model, x, keep, y=y_missing, engine="laplace", progress=False)
    sub = pcv.fit(model, x[keep], y=y[keep], engine="laplace", progress=False)
    assert res.converged
    np.testing.assert_allclose(res.posterior.loc[:2].numpy(), sub.posterior.loc.numpy(), atol=1e-6)


def test_a_latent_site_without_an_unconstrained_transform_is_refused_by_the_model_engines():
    """A latent site whose support Pyro cannot transform is refused by name (it crashed inside Pyro's guide)."""
    from pyro.distributions.constraints import positive, real
    from pyro.distributions.mixture import MaskedConstraint

    class Odd(dist.Normal):
        support = MaskedConstraint(torch.tensor([True]), real, positive)

    def model():
        pyro.sample("odd", Odd(torch.zeros(1, dtype=D), 1.0).to_event(1))

    err = pcv.get_engine("laplace").fits(model)
    assert err is not None and "site 'odd'" in str(err) and "no transform to unconstrained" in str(err)
