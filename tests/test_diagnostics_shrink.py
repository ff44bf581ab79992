"""James-Stein shrinkage of a field's importance corrections: the estimator against its risk theory, the flat-weight
baselines against a direct computation, and corrected field marginals against per-coordinate quadrature."""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import stats

import pyro_convexvb as pcv
from pyro_convexvb.diagnostics.control_variates import (SHRINK_MIN_COORDINATES, CoordinateControls, cv_moments,
                                                        cv_quantiles, james_stein)
from pyro_convexvb.diagnostics.importance import correct
from pyro_convexvb.diagnostics.psis import psis_smooth, weighted_quantiles

D = torch.float64
PROBS = (0.05, 0.5, 0.95)


def test_james_stein_keeps_a_shared_correction_and_removes_noise():
    rng = np.random.default_rng(0)
    k, se = 300, np.full(300, 0.1)
    base = rng.normal(size=k)
    # pure noise around the baseline: pulled back to it (factor 0), reported error not zero
    est, se_out, c = james_stein(base + se * rng.normal(size=k), base, se)
    assert c == 0.0 and np.abs(est - base).max() == 0.0
    assert 0 < se_out[0] < se[0]
    # a correction of 10 errors shared by the field: kept
    theta = np.full(k, 1.0)
    est, se_out, c = james_stein(base + theta + se * rng.normal(size=k), base, se)
    assert c > 0.99 and np.abs(est - base - theta).max() < 5 * se[0]
    np.testing.assert_allclose(se_out, se)  # the risk estimate is capped at the unshrunk error
    # too few coordinates, or exact ones (zero error): left as they are
    d = rng.normal(size=SHRINK_MIN_COORDINATES - 1)
    est, se_out, c = james_stein(d, np.zeros_like(d), np.ones_like(d))
    assert c == 1.0 and np.array_equal(est, d)
    est, _, _ = james_stein(np.r_[5.0, 0.01 * rng.normal(size=k)], np.zeros(k + 1), np.r_[0.0, np.full(k, 0.01)])
    assert est[0] == 5.0


def test_james_stein_risk_and_reported_errors_over_seeds():
    """Corrections theta_i ~ N(0, tau^2) seen with unit noise (tau = 0.5, 1, 3): the shrunk estimate's mean squared
    error is below the unshrunk one's (Stein's theorem: about tau^2 / (1 + tau^2) of it, plus 2 / k), and the
    reported errors are not too small (mean squared z-score at most 1.3)."""
    k = 200
    for tau in (0.5, 1.0, 3.0):
        mse_shrunk, z2 = [], []
        for seed in range(200):
            rng = np.random.default_rng(seed)
            se = rng.uniform(0.5, 2.0, size=k)
            theta = tau * se * rng.normal(size=k)
            est, se_out, c = james_stein(theta + se * rng.normal(size=k), np.zeros(k), se)
            mse_shrunk.append(np.mean(((est - theta) / se) ** 2))
            z2.append(np.mean(((est - theta) / se_out) ** 2))
        ratio = float(np.mean(mse_shrunk))
        assert ratio < min(1.0, tau**2 / (1 + tau**2) + 2 / k + 0.02), (tau, ratio)
        assert float(np.mean(z2)) < 1.3, (tau, float(np.mean(z2)))


def test_flat_weight_baselines_are_the_flat_weight_estimates():
    """The baselines returned alongside the weighted estimates (same draws and controls) equal the estimates with
    flat weights (moments exactly; quantiles by Newton steps from the weighted ones)."""
    rng = np.random.default_rng(2)
    S, p = 2000, 30
    m, s = rng.normal(size=p), rng.uniform(0.5, 2.0, size=p)
    x = m + s * rng.normal(size=(S, p))
    lw, _ = psis_smooth(stats.norm(0.1, 1.1).logpdf((x[:, 0] - m[0]) / s[0]) - stats.norm.logpdf((x[:, 0] - m[0])
                                                                                                  / s[0]))
    w = np.exp(lw)
    flat = np.full(S, 1.0 / S)
    ctl = CoordinateControls(np.broadcast_to(m, (S, p)), np.broadcast_to(s, (S, p)), np.full(S, np.inf))
    *_, mb, sb = cv_moments(x, w, ctl, baseline=True)
    mf, sf, _, _ = cv_moments(x, flat, ctl)
    np.testing.assert_allclose(mb, mf, atol=1e-12)
    np.testing.assert_allclose(sb, sf, atol=1e-3)  # the second moment about the weighted mean: second order
    np.testing.assert_allclose(mf, m, atol=1e-8)  # flat weights: the proposal's own moments
    q0, _ = weighted_quantiles(x, w, PROBS)
    _, _, qb = cv_quantiles(x, w, ctl, PROBS, q0, baseline=True)
    qf, _ = cv_quantiles(x, flat, ctl, PROBS, weighted_quantiles(x, flat, PROBS)[0])
    np.testing.assert_allclose(qb, qf, atol=1e-4)  # both are three Newton steps
    np.testing.assert_allclose(qf, m + s * stats.norm.ppf(np.array(PROBS))[:, None], atol=1e-6)


def test_baselines_over_the_gaussian_draws_exclude_the_defensive_ones():
    """Draws of a proposal with a defensive share (a fifth of them with every scale times r, r^2 = 5 / chi2_5, and
    controls given r): the baseline over the other draws (``base_rows``) is the Gaussian's own mean and sd exactly
    (moments) or to the Newton steps' precision (quantiles); over all draws it is the wider mixture's."""
    rng = np.random.default_rng(4)
    S, p = 4000, 25
    m, s = rng.normal(size=p), rng.uniform(0.5, 2.0, size=p)
    r = np.where(rng.uniform(size=S) < 0.2, np.sqrt(5.0 / rng.chisquare(5, size=S)), 1.0)
    sd = s * r[:, None]
    x = m + sd * rng.normal(size=(S, p))
    w = rng.uniform(0.5, 1.5, size=S)
    w /= w.sum()
    ctl = CoordinateControls(np.broadcast_to(m, (S, p)), sd, np.full(S, np.inf))
    rows = r == 1.0
    *_, mb, sb = cv_moments(x, w, ctl, baseline=True, base_rows=rows)
    np.testing.assert_allclose(mb, m, atol=1e-8)
    np.testing.assert_allclose(sb, s, rtol=2e-3)  # about the weighted mean: second order in its offset
    *_, sb_all = cv_moments(x, w, ctl, baseline=True)
    assert float(np.median(sb_all / s)) > 1.03  # the mixture's spread (1 + 0.2 * 2/3 in variance)
    q0, _ = weighted_quantiles(x, w, PROBS)
    _, _, qb = cv_quantiles(x, w, ctl, PROBS, q0, baseline=True, base_rows=rows)
    np.testing.assert_allclose(qb, m + s * stats.norm.ppf(np.array(PROBS))[:, None], atol=1e-4)


J, PER = 40, 4


def _groups():
    g = torch.Generator().manual_seed(5)
    grp = torch.arange(J).repeat_interleave(PER)
    a = 1.5 * torch.randn(J, generator=g, dtype=D)
    y = (torch.rand(J * PER, generator=g, dtype=D) < torch.sigmoid(a[grp])).to(D)
    return grp, y


def _model(grp, y=None):
    with pyro.plate("groups", J):
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=D), 1.5))
    with pyro.plate("data", grp.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=a[grp]), obs=y)


def _quadrature(grp, y):
    """Each group's intercept has its own posterior (the groups are independent): mean, sd and quantiles on a
    grid."""
    t = np.linspace(-12, 12, 12001)
    out = []
    for j in range(J):
        yj = y[grp == j].numpy()
        logp = stats.norm(0, 1.5).logpdf(t) + sum(-np.logaddexp(0, -t) if v else -np.logaddexp(0, t) for v in yj)
        p = np.exp(logp - logp.max())
        p /= np.trapezoid(p, t)
        mean = np.trapezoid(p * t, t)
        sd = math.sqrt(np.trapezoid(p * (t - mean) ** 2, t))
        cdf = np.concatenate([[0.0], np.cumsum(0.5 * (p[1:] + p[:-1]) * np.diff(t))])
        out.append((mean, sd, [float(np.interp(q, cdf / cdf[-1], t)) for q in PROBS]))
    return out


@pytest.mark.parametrize("engine", ["laplace", "dual_vg"])
def test_shrunk_field_corrections_match_quadrature(engine):
    """40 independent group intercepts with 4 Bernoulli observations each (skewed posteriors). The mode-based Laplace
    Gaussian's means are off by up to 0.16 sd, toward zero in every group: that shared correction survives the
    shrinkage. ``dual_vg``'s means are right (its mean correction is shrunk away). Shrunk answers are within 0.1 sd
    in mean, 10% in sd and 0.1 sd in quantiles of quadrature, with errors no larger than the unshrunk ones' on the
    whole field, and honest reported errors."""
    grp, y = _groups()
    res = pcv.fit(_model, grp, y=y, engine=engine, progress=False)
    ref = _quadrature(grp, y)
    rm = np.array([r[0] for r in ref])
    rs = np.array([r[1] for r in ref])
    rq = np.array([r[2] for r in ref]).T
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cs = res.corrected(seed=1)
        cu = res.corrected(seed=1, shrink=False)
    assert set(cs.shrinkage) == {"a"} and cu.shrinkage == {}
    err = {}
    for name, c in (("shrunk", cs), ("unshrunk", cu)):
        s = c.sites["a"]
        e_mean = (s["mean"].numpy() - rm) / rs
        e_sd = s["sd"].numpy() / rs - 1
        e_q = np.stack([(s["quantiles"][p].numpy() - rq[i]) / rs for i, p in enumerate(PROBS)])
        err[name] = (e_mean, e_sd, e_q)
        if name == "shrunk":
            assert np.abs(e_mean).max() < 0.1 and np.abs(e_sd).max() < 0.1 and np.abs(e_q).max() < 0.1, \
                (engine, np.abs(e_mean).max(), np.abs(e_sd).max(), np.abs(e_q).max())
            z2 = ((s["mean"].numpy() - rm) / s["mean_mcse"].numpy()) ** 2
            assert z2.mean() < 3.0, (engine, z2.mean())
    total = {k: sum(float(np.mean(e**2)) for e in v) for k, v in err.items()}
    assert total["shrunk"] <= 1.1 * total["unshrunk"], (engine, total)
    if engine == "laplace":
        assert np.abs(res.posterior.loc.numpy() - rm).max() / rs.min() > 0.1  # the uncorrected means need it
        assert cs.shrinkage["a"]["mean"] > 0.5  # a real, shared correction is kept
    # loc/scale of the flat latent vector follow the shrunk unconstrained summaries
    np.testing.assert_allclose(cs.loc.numpy(), cs.unconstrained["a"]["mean"].numpy())


def test_shrink_options():
    grp, y = _groups()
    res = pcv.fit(_model, grp, y=y, engine="dual_vg", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="shrink=True needs estimator='cv'"):
            correct(res, 300, estimator="snis", shrink=True)
        with pytest.raises(ValueError, match="shrink: expected"):
            correct(res, 300, shrink="yes")
        c = res.corrected(num_draws=300, estimator="snis", adapt=0)  # res.corrected passes every option on
    assert c.shrinkage == {} and c.diagnostics.num_draws == 300
