"""Observation scales ``Normal(m, exp(eta / 2))`` read as the stochastic-volatility site of ``dual_vg`` (Khan et al.
2013, §5): extraction (predictor ``2 log scale``, data ``y - m``), the exact bound against scipy quadrature, a
heteroscedastic regression fitted against the exact posterior by 2-D quadrature, an AR(1) volatility whose latent
field stays a field (not hyper-latents), and the refusal of a latent mean."""
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
from pyro_convexvb.infer.hyper import find_hyper_sites
from pyro_convexvb.lgm.families import StochasticVolatility
from _grid_quadrature import grid_posterior_2d

D = torch.float64


def het_data(m=30, seed=11):
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(-1.5, 1.5, m, dtype=D)
    y = 0.3 + torch.exp((-0.5 + 1.2 * x) / 2) * torch.randn(m, generator=g, dtype=D)
    return x, y


def het_model(x, y=None, mean=0.3):
    """Heteroscedastic noise around a known mean: ``y_i ~ Normal(mean, exp((a + b x_i) / 2))``."""
    a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
    b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(mean, torch.exp((a + b * x) / 2)), obs=y)


def test_extraction_reads_the_scale_as_the_predictor_and_the_bound_is_exact():
    x, y = het_data()
    lgm = pcv.lgm_from_pyro(het_model, x, y=y)
    (g,) = lgm.sites
    assert isinstance(g.family, StochasticVolatility)
    torch.testing.assert_close(g.family.params["y"], y - 0.3)
    torch.testing.assert_close(g.design.to_dense(), torch.stack([torch.ones_like(x), x], 1), rtol=1e-10, atol=1e-10)
    assert find_hyper_sites(het_model, (x,), {"y": y}) == []  # a and b stay in the latent field
    # the bound equals -E log N(y - m | 0, e^eta) with every constant; Fenchel-Young vanishes at alpha*
    h = torch.linspace(-2, 2, 6, dtype=D)
    rho = torch.tensor([0.01, 0.1, 0.5, 1.0, 2.0, 0.3], dtype=D)
    fam = g.family.subset(torch.arange(6))
    b = make_bound(fam)
    ref = []
    for i in range(6):
        yi, sd = float(fam.params["y"][i]), math.sqrt(float(rho[i]))
        ref.append(integrate.quad(lambda e: stats.norm.logpdf(yi, 0.0, math.exp((float(h[i]) + sd * e) / 2))
                                  * stats.norm.pdf(e), -12, 12, epsabs=1e-12, epsrel=1e-12)[0])
    torch.testing.assert_close(b.f(h, rho), -torch.tensor(ref, dtype=D), rtol=1e-10, atol=1e-10)
    res = b.fenchel_young_residual(b.alpha_star(h, rho), h, rho)
    torch.testing.assert_close(res, torch.zeros_like(res), rtol=0, atol=1e-10)


def _reference(x, y, n=401):
    xn, r = x.numpy(), (y - 0.3).numpy()

    def log_lik(W):
        eta = W[:, :1] + W[:, 1:] * xn[None]
        return stats.norm.logpdf(r[None], 0.0, np.exp(eta / 2)).sum(1)

    return grid_posterior_2d(log_lik, [-3.0, -3.0], [3.0, 3.0], n)


def test_dual_vg_fits_the_exact_posterior_and_its_bound_is_below_the_evidence():
    x, y = het_data()
    mean, sd, log_ev = _reference(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(het_model, x, y=y, engine="dual_vg", progress=False)
    assert res.converged
    assert (np.abs(res.posterior.loc.numpy() - mean) / sd).max() < 0.1
    assert np.abs(res.posterior.covariance().diagonal().sqrt().numpy() / sd - 1).max() < 0.1
    assert log_ev - 0.2 < res.log_evidence_bound <= log_ev
    fitting = pcv.engines_that_fit(het_model, x, y=y)
    assert "dual_vg" in fitting and "convex_relaxation" not in fitting
    with pytest.raises(pcv.UnsupportedModelError, match="not super-Gaussian"):
        pcv.fit(het_model, x, y=y, engine="convex_relaxation", progress=False)


def test_ar1_volatility_field_is_one_latent_gaussian_field():
    T, phi, s = 30, 0.9, 0.4
    Q = torch.diag(torch.full((T,), (1 + phi ** 2) / s ** 2, dtype=D))
    Q[0, 0] = Q[-1, -1] = 1 / s ** 2
    i = torch.arange(T - 1)
    Q[i, i + 1] = Q[i + 1, i] = -phi / s ** 2
    y = torch.randn(T, dtype=D, generator=torch.Generator().manual_seed(2))

    def sv(y=None):
        h = pyro.sample("h", dist.MultivariateNormal(torch.zeros(T, dtype=D), precision_matrix=Q))
        with pyro.plate("t", T):
            pyro.sample("y", dist.Normal(0.0, torch.exp(h / 2)), obs=y)

    assert find_hyper_sites(sv, (), {"y": y}) == []
    (g,) = pcv.lgm_from_pyro(sv, y=y).sites
    assert isinstance(g.family, StochasticVolatility)
    torch.testing.assert_close(g.design.to_dense(), torch.eye(T, dtype=D))


def test_a_latent_mean_with_a_latent_scale_is_refused():
    x, y = het_data()

    def model(x, y=None):
        a = pyro.sample("a", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(a[0] * x, torch.exp((a[1] * x) / 2)), obs=y)

    with pytest.raises(pcv.UnsupportedModelError, match="noise scale .*depends on a latent site") as err:
        pcv.lgm_from_pyro(model, x, y=y)
    assert err.value.site == "y"


def test_categorical_softmax_fits_in_dual_vg_and_the_relaxation_refuses_with_the_reason():
    """Softmax sites are vector sites of dual_vg (tests/test_categorical.py checks the numbers); the relaxation's
    potentials are scalar super-Gaussian factors, so it refuses naming the site and the engines that fit."""
    X = torch.randn(10, 2, dtype=D, generator=torch.Generator().manual_seed(0))
    y = torch.arange(10) % 3

    def softmax(X, y=None):
        W = pyro.sample("W", dist.Normal(torch.zeros(2, 3, dtype=D), 1.0).to_event(2))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Categorical(logits=X @ W), obs=y)

    fitting = pcv.engines_that_fit(softmax, X, y=y)
    assert "dual_vg" in fitting and "convex_relaxation" not in fitting and "nuts" in fitting
    with pytest.raises(pcv.UnsupportedModelError, match="super-Gaussian") as err:
        pcv.fit(softmax, X, y=y, engine="convex_relaxation", progress=False)
    assert err.value.site == "y" and "dual_vg" in str(err.value)
