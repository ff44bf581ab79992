"""PSIS (Pareto k, smoothing, ESS, weighted summaries) and LOO from log-likelihoods, against known weights and ArviZ."""
import math
import warnings

import numpy as np
import pytest
from scipy import stats

from pyro_convexvb.diagnostics.loo import loo_from_log_lik
from pyro_convexvb.diagnostics.psis import (gpd_fit, importance_ess, pareto_k_threshold, psis, psis_smooth,
                                            weighted_moments, weighted_quantiles)


def _arviz():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("arviz")


def test_gpd_fit_recovers_known_parameters():
    rng = np.random.default_rng(0)
    for k, sigma in [(0.3, 1.0), (0.8, 2.5), (-0.2, 0.5)]:
        x = stats.genpareto(k, scale=sigma).rvs(size=20000, random_state=rng)
        kh, sh = gpd_fit(x, prior_weight=0)
        assert kh == pytest.approx(k, abs=0.03)
        assert sh == pytest.approx(sigma, rel=0.05)


@pytest.mark.parametrize("sd_p, k_true", [(2.0, 0.75), (1.25, 0.36)])
def test_pareto_k_of_normal_ratios_is_the_known_tail_index(sd_p, k_true):
    """q = N(0, 1), p = N(0, sd_p^2): P(r > t) ~ t^{-1/k} with k = 1 - 1/sd_p^2 (the ratio's exact tail)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=20000)
    lr = stats.norm(0, sd_p).logpdf(x) - stats.norm.logpdf(x)
    _, k = psis_smooth(lr)
    assert k == pytest.approx(k_true, abs=0.1)


def test_self_normalised_moments_with_known_weights_and_their_errors():
    """p = N(0.3, 1.2^2) from q = N(0, 1) (k = 0.31): mean, sd and quantiles within 4 Monte Carlo errors."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=8000)
    lr = stats.norm(0.3, 1.2).logpdf(x) - stats.norm.logpdf(x) + 17.0  # any constant
    lw, k = psis_smooth(lr)
    assert k < 0.5 and np.exp(lw).sum() == pytest.approx(1.0)
    w = np.exp(lw)
    m, s, m_se, s_se = weighted_moments(x, w)
    assert abs(m - 0.3) < 4 * m_se and abs(s - 1.2) < 4 * s_se
    assert 0.005 < m_se < 0.05
    probs = (0.05, 0.5, 0.95)
    q, q_se = weighted_quantiles(x, w, probs)
    for p, qi, se in zip(probs, q, q_se):
        assert abs(qi - stats.norm(0.3, 1.2).ppf(p)) < 4 * se
    # Kong's ESS is S / E_q[r^2] with E_q[r^2] = exp(b^2 / 2a - mu^2 / s^2) / (s^2 sqrt(a)), a = 2/s^2 - 1, b = 2 mu/s^2
    a, b = 2 / 1.2**2 - 1, 2 * 0.3 / 1.2**2
    e_r2 = math.exp(b**2 / (2 * a) - 0.3**2 / 1.2**2) / (1.2**2 * math.sqrt(a))
    assert importance_ess(lr) == pytest.approx(8000 / e_r2, rel=0.1)


def test_pareto_k_threshold():
    assert pareto_k_threshold(100) == pytest.approx(0.5)
    assert pareto_k_threshold(10**6) == pytest.approx(0.7)


def test_psis_matches_arviz_psislw():
    az = _arviz()
    rng = np.random.default_rng(3)
    for S, scale in [(100, 0.5), (500, 1.0), (3000, 2.0)]:
        lr = rng.standard_t(4, size=S) * scale
        lw, k = psis_smooth(lr)
        lw_az, k_az = az.psislw(lr.copy())
        np.testing.assert_allclose(lw, lw_az, atol=1e-10)
        assert k == pytest.approx(float(k_az), abs=1e-10)
    lr = rng.normal(size=(400, 7)) * 1.5
    lw, ks = psis(lr, axis=0)
    lw_az, ks_az = az.psislw(lr.T.copy())
    np.testing.assert_allclose(lw, lw_az.T, atol=1e-10)
    np.testing.assert_allclose(ks, ks_az, atol=1e-10)


def test_loo_from_exact_draws_matches_az_loo():
    """With exact posterior draws (ratios 1) our PSIS-LOO and WAIC are ArviZ's on the same log-likelihood."""
    az = _arviz()
    rng = np.random.default_rng(4)
    mu = rng.normal(0.1, 0.2, size=(4, 500))
    y = np.concatenate([rng.normal(size=30), [4.0]])  # one outlier: a larger k
    ll = stats.norm.logpdf(y[None, None, :], mu[..., None], 1.0)
    idata = az.from_dict(posterior={"mu": mu}, log_likelihood={"y": ll})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = az.loo(idata, pointwise=True, reff=1.0)  # independent draws
        ref_w = az.waic(idata)
    ours = loo_from_log_lik(np.zeros(2000), ll.reshape(2000, -1))
    assert ours.elpd_loo == pytest.approx(ref.elpd_loo, abs=1e-8)
    assert ours.se == pytest.approx(ref.se, abs=1e-8)
    assert ours.p_loo == pytest.approx(ref.p_loo, abs=1e-8)
    np.testing.assert_allclose(ours.pareto_k, ref.pareto_k.values, atol=1e-8)
    assert ours.elpd_waic == pytest.approx(ref_w.elpd_waic, abs=1e-8)
    assert ours.p_waic == pytest.approx(ref_w.p_waic, abs=1e-8)
    assert ours.lpml == pytest.approx(ours.elpd_loo)


@pytest.mark.parametrize("index", [1.5, 3.0, 6.0])
def test_pareto_tail_k_of_a_lomax_sample_is_its_inverse_tail_index(index):
    from pyro_convexvb.diagnostics.psis import pareto_tail_k

    x = np.random.default_rng(1).pareto(index, size=200_000)
    assert abs(pareto_tail_k(x) - 1.0 / index) < 0.04
    # the square's tail (moments of order index / 2), slower to reach its limit: 0.43 for 1/3 at index 6
    assert abs(pareto_tail_k(x**2) - 2.0 / index) < (0.06 if index <= 3 else 0.12)

