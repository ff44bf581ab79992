"""The negative-binomial (Gamma-Poisson) site family: its density against torch, expectations, super-Gaussian
potential and local bounds against scipy quadrature in float64, and end-to-end fits against the exact posterior by
2-D quadrature (the log joint written with ``scipy.stats.nbinom``, independently of the family)."""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import integrate, special, stats

import pyro_convexvb as pcv
from pyro_convexvb.infer.convex_relaxation.potentials import gaussian_lower_bound, h_implicit, potential_for
from pyro_convexvb.infer.dual_vg.bounds import LOGIT_BOUNDS, make_bound
from pyro_convexvb.lgm.families import NegativeBinomial

D = torch.float64
Y = torch.tensor([0.0, 1.0, 3.0, 7.0, 12.0, 2.0], dtype=D)
R = torch.tensor([0.5, 4.0, 3.0, 1.7, 10.0, 25.0], dtype=D)


def _quad(fn, m, v):
    sd = math.sqrt(v)
    val, _ = integrate.quad(lambda e: fn(m + sd * e) * math.exp(-0.5 * e * e) / math.sqrt(2 * math.pi),
                            -12, 12, epsabs=1e-13, epsrel=1e-13, limit=200)
    return val


def _site_log_prob(i):
    """``log NB(y | r, mean r e^eta)``: scipy's ``nbinom(n=r, p=1 / (1 + e^eta))`` pmf written with ``log_expit``
    (``nbinom.logpmf`` rounds ``p`` to 1 far in the tails)."""
    y, r = float(Y[i]), float(R[i])
    c = special.gammaln(y + r) - special.gammaln(r) - special.gammaln(y + 1)
    assert abs(c + r * special.log_expit(-0.3) + y * special.log_expit(0.3)
               - stats.nbinom.logpmf(y, r, 1 / (1 + math.exp(0.3)))) < 1e-12
    return lambda e: float(c + r * special.log_expit(-e) + y * special.log_expit(e))


def test_log_prob_is_torch_negative_binomial_and_expectation_matches_quadrature():
    fam = NegativeBinomial(Y, R)
    eta = torch.linspace(-3, 3, 6, dtype=D)
    ref = torch.distributions.NegativeBinomial(R, logits=eta).log_prob(Y)
    torch.testing.assert_close(fam.log_prob(eta), ref, rtol=1e-13, atol=1e-13)
    # the Gamma-Poisson form: rate b = e^{-eta}
    ref = dist.GammaPoisson(R, torch.exp(-eta)).log_prob(Y)
    torch.testing.assert_close(fam.log_prob(eta), ref, rtol=1e-12, atol=1e-12)
    mean = torch.tensor([-2.0, -0.5, 0.0, 0.7, 1.5, 3.0], dtype=D)
    var = torch.tensor([0.01, 0.5, 2.0, 1.0, 0.3, 0.2], dtype=D)
    ref = torch.tensor([_quad(_site_log_prob(i), float(mean[i]), float(var[i])) for i in range(6)], dtype=D)
    torch.testing.assert_close(fam.expected_log_prob(mean, var), ref, rtol=1e-10, atol=1e-10)
    pm = torch.tensor([_quad(lambda e, i=i: float(R[i]) * math.exp(e), float(mean[i]), float(var[i]))
                       for i in range(6)], dtype=D)
    torch.testing.assert_close(fam.predictive_mean(mean, var), pm, rtol=1e-10, atol=1e-10)


def test_potential_is_the_site_with_every_constant_and_its_gaussian_bounds_touch_it():
    fam = NegativeBinomial(Y, R)
    pot = potential_for(fam)
    assert pot.log_concave
    s = torch.tensor([-2.5, -0.3, 0.4, 1.1, 2.0, -1.0], dtype=D)
    torch.testing.assert_close(pot.log_prob(s), fam.log_prob(s), rtol=1e-13, atol=1e-13)
    for gamma in torch.logspace(-3, 2, 11, dtype=D):  # every width bounds the site from below ...
        assert bool((gaussian_lower_bound(pot, s, gamma.expand(6)) <= fam.log_prob(s) + 1e-11).all())
    gamma_star = -0.5 / pot.dg(s * s)  # ... and the width of x_*(gamma) = s^2 touches it
    torch.testing.assert_close(gaussian_lower_bound(pot, s, gamma_star), fam.log_prob(s), rtol=1e-11, atol=1e-11)
    gamma = torch.tensor([0.3, 1.0, 2.0, 5.0, 0.05, 10.0], dtype=D)
    x = torch.cat([torch.zeros(1, dtype=D), torch.logspace(-8, 6, 400001, dtype=D)])[:, None].expand(-1, 6)
    brute = (-(x / gamma + 2 * pot.g(x))).max(0).values
    torch.testing.assert_close(h_implicit(pot, gamma)[0], brute, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", LOGIT_BOUNDS)
def test_local_bound_is_valid_keeps_every_constant_and_fenchel_young_vanishes_at_alpha_star(kind):
    h = torch.linspace(-4, 4, 9, dtype=D)
    rho = torch.logspace(-3, 1, 6, dtype=D)
    H, Rh = (a.reshape(-1) for a in torch.meshgrid(h, rho, indexing="ij"))
    rows = torch.arange(H.numel()) % len(Y)
    sub = NegativeBinomial(Y[rows], R[rows])
    b = make_bound(sub, kind, xi=torch.ones(H.numel(), dtype=D) if kind == "jaakkola" else None)
    ref = torch.tensor([_quad(_site_log_prob(int(r)), float(H[j]), float(Rh[j])) for j, r in enumerate(rows.tolist())],
                       dtype=D)
    assert bool((b.f(H, Rh) >= -ref - 1e-9).all())  # f >= -E log p, constants in both
    narrow = Rh <= 1
    ex = b.exact_expected_log_prob(H, Rh)
    torch.testing.assert_close(ex[narrow], ref[narrow], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ex[~narrow], ref[~narrow], rtol=1e-4, atol=0)
    a = b.alpha_star(H, Rh)
    lo, hi = b.alpha_domain(H)
    inside = (a > lo) & (a < hi)
    res = b.fenchel_young_residual(a, H, Rh)
    assert bool((res[inside] > -1e-9).all())
    if kind in ("tight", "jensen", "bohning"):
        torch.testing.assert_close(res[inside], torch.zeros_like(res[inside]), rtol=0, atol=1e-8)
    if kind == "tight":  # exact at rho = 0, constant included
        rows = torch.arange(h.numel()) % len(Y)
        fam = NegativeBinomial(Y[rows], R[rows])
        torch.testing.assert_close(make_bound(fam).f(h, torch.zeros_like(h)), -fam.log_prob(h), rtol=1e-12, atol=1e-12)


def nb_data(m=25, r=3.0, seed=3):
    g = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.ones(m, 1, dtype=D), 0.8 * torch.randn(m, 1, generator=g, dtype=D)], 1)
    mu = torch.exp(X @ torch.tensor([1.0, -0.7], dtype=D))
    y = torch.distributions.NegativeBinomial(torch.tensor(r, dtype=D), logits=torch.log(mu / r)).sample()
    return X, y


def nb_model(X, y=None, r=3.0, form="nb"):
    """Log-link negative-binomial regression: mean ``exp(X @ w)``, concentration ``r``."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    r = torch.as_tensor(r, dtype=D)
    with pyro.plate("data", X.shape[0]):
        mu = torch.exp(X @ w)
        d = dist.GammaPoisson(r, r / mu) if form == "gp" else dist.NegativeBinomial(r, logits=torch.log(mu / r))
        pyro.sample("y", d, obs=y)


def _reference(X, y, r=3.0, n=301):
    """Posterior mean and sd of ``w`` by a 2-D tensor-grid quadrature of the exact density (scipy's nbinom)."""
    lo, hi = np.array([-0.5, -2.5]), np.array([2.5, 1.5])
    for it in range(3):
        a = [np.linspace(lo[k], hi[k], n) for k in range(2)]
        W = np.stack(np.meshgrid(*a, indexing="ij"), -1).reshape(-1, 2)
        mu = np.exp(W @ X.numpy().T)
        lp = stats.norm.logpdf(W).sum(1) + stats.nbinom.logpmf(y.numpy()[None], r, r / (r + mu)).sum(1)
        p = np.exp(lp - lp.max())
        p /= p.sum()
        mean = p @ W
        sd = np.sqrt(p @ (W - mean) ** 2)
        lo, hi = mean - 9 * sd, mean + 9 * sd
    return mean, sd


@pytest.mark.parametrize("engine, form, mtol, stol", [
    ("dual_vg", "nb", 0.1, 0.1),
    ("dual_vg", "gp", 0.1, 0.1),
    ("convex_relaxation", "nb", 0.2, None),  # the relaxation's variances bound the posterior's from below
])
def test_fit_matches_the_exact_posterior_by_quadrature(engine, form, mtol, stol):
    X, y = nb_data()
    mean, sd = _reference(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(nb_model, X, y=y, form=form, engine=engine, progress=False)
    assert res.converged
    got_m = res.posterior.loc.numpy()
    got_s = res.posterior.covariance().diagonal().sqrt().numpy()
    assert np.abs(got_m - mean).max() / sd.min() < mtol
    if stol is not None:
        assert np.abs(got_s / sd - 1).max() < stol


def test_extraction_reads_both_forms_with_the_log_link_offset_and_every_engine_fits():
    X, y = nb_data()
    for form in ("nb", "gp"):
        lgm = pcv.lgm_from_pyro(nb_model, X, y=y, form=form)
        (g,) = lgm.sites
        assert isinstance(g.family, NegativeBinomial)
        torch.testing.assert_close(g.design.to_dense(), X, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(g.offset, torch.full((X.shape[0],), -math.log(3.0), dtype=D))
        torch.testing.assert_close(g.family.params["total_count"], torch.full((X.shape[0],), 3.0, dtype=D))
    assert pcv.engines_that_fit(nb_model, X, y=y) == list(pcv.engines())


def test_dual_vg_bound_is_below_the_exact_evidence():
    """The reported bound is a lower bound on log p(y), every constant included (2-D quadrature of the evidence)."""
    X, y = nb_data(m=12)
    a = [np.linspace(-6, 6, 601)] * 2
    W = np.stack(np.meshgrid(*a, indexing="ij"), -1).reshape(-1, 2)
    mu = np.exp(W @ X.numpy().T)
    lp = stats.norm.logpdf(W).sum(1) + stats.nbinom.logpmf(y.numpy()[None], 3.0, 3.0 / (3.0 + mu)).sum(1)
    log_ev = float(np.log(np.exp(lp - lp.max()).sum() * (12 / 600) ** 2) + lp.max())
    for engine in ("dual_vg", "convex_relaxation"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = pcv.fit(nb_model, X, y=y, engine=engine, progress=False)
        assert res.log_evidence_bound <= log_ev
        assert res.log_evidence_bound > log_ev - 0.1  # and close: a nearly Gaussian posterior


def test_refusals_name_the_site_and_the_reason():
    X, y = nb_data()
    with pytest.raises(pcv.UnsupportedModelError, match="counts must be nonnegative integers") as err:
        pcv.lgm_from_pyro(nb_model, X, y=y + 0.5)
    assert err.value.site == "y"
    with pytest.raises(pcv.UnsupportedModelError, match="concentration"):
        pcv.lgm_from_pyro(nb_model, X, y=y, r=torch.where(y > 2, 3.0, 0.0).to(D))


def test_weighted_negative_binomial_is_the_site_repeated():
    from pyro_convexvb.lgm.families import Weighted

    fam, w = NegativeBinomial(Y, R), torch.full((len(Y),), 2.0, dtype=D)
    h, rho = torch.linspace(-2, 2, len(Y), dtype=D), torch.linspace(0.1, 3, len(Y), dtype=D)
    torch.testing.assert_close(make_bound(Weighted(fam, w)).f(h, rho), 2 * make_bound(fam).f(h, rho), rtol=1e-12,
                               atol=1e-12)
    s = torch.linspace(-2, 2, len(Y), dtype=D)
    torch.testing.assert_close(potential_for(Weighted(fam, w)).log_prob(s), 2 * fam.log_prob(s), rtol=1e-12,
                               atol=1e-12)
