r"""Pareto-smoothed importance sampling (Vehtari, Simpson, Gelman, Yao & Gabry 2024).

Given log importance ratios ``log r_s = log p(x_s) - log q(x_s)`` of ``S`` draws ``x_s ~ q``, the ``M``
largest ratios (``M = ceil(min(S / 5, 3 sqrt(S)))``, Vehtari et al. 2024, §3) are replaced by the expected
order statistics of a generalised Pareto distribution fitted to them (the empirical-Bayes estimate of
Zhang & Stephens 2009, §2, with the weakly informative prior on the shape of Vehtari et al. 2024,
Appendix C), truncated at the largest raw ratio. The fitted shape ``k_hat`` is the diagnostic: the
importance-sampling estimate is reliable when ``k_hat`` is below ``min(1 - 1 / log10 S, 0.7)``
(Vehtari et al. 2024, §3.2.4); above 0.7 the variance is effectively infinite and no number of draws helps.
"""
import math

import numpy as np

from ..posterior.empirical import weighted_quantiles as _quantiles

__all__ = ["gpd_fit", "pareto_tail_k", "psis_smooth", "psis", "pareto_k_threshold", "importance_ess", "weighted_quantiles",
           "weighted_moments"]


def gpd_fit(x, prior_weight=10.0):
    """Fit a generalised Pareto distribution ``GPD(0, sigma, k)`` to exceedances ``x > 0``.

    The posterior-mean estimate of Zhang & Stephens (2009, §2) over a grid of ``theta = -k / sigma``
    values, followed by the weakly informative shrinkage of ``k`` toward 0.5 with ``prior_weight``
    pseudo-observations (Vehtari et al. 2024, Appendix C).

    :param x: ``(M,)`` exceedances over the threshold (any order, positive).
    :param float prior_weight: pseudo-observations of the shape prior (0 disables it).
    :returns: ``(k, sigma)``.

    Example::

        >>> rng = np.random.default_rng(0)
        >>> u = rng.uniform(size=20000)
        >>> k, sigma = gpd_fit(2.0 * (u ** -0.5 - 1) / 0.5, prior_weight=0)   # GPD(k=0.5, sigma=2)
        >>> round(k, 1), round(sigma, 1)
        (0.5, 2.0)
    """
    x = np.sort(np.asarray(x, dtype=np.float64))
    n = x.shape[0]
    m = 30 + int(math.floor(math.sqrt(n)))
    j = np.arange(1, m + 1, dtype=np.float64)
    # candidate theta (Zhang & Stephens 2009, eq. 4 with their prior quartile 3)
    x_q = x[max(int(math.floor(n / 4.0 + 0.5)) - 1, 0)]
    theta = 1.0 / x[-1] + (1.0 - np.sqrt(m / (j - 0.5))) / (3.0 * x_q)
    # profile log likelihood at each theta: k(theta) = -mean log(1 - theta x)
    kk = -np.mean(np.log1p(-theta[:, None] * x[None, :]), axis=1)
    ll = n * (np.log(theta / kk) + kk - 1.0)
    w = np.exp(ll - np.logaddexp.reduce(ll))  # posterior weights of the theta grid
    keep = w >= 10 * np.finfo(np.float64).eps
    w, theta = w[keep] / w[keep].sum(), theta[keep]
    theta_hat = float((theta * w).sum())
    k = float(np.mean(np.log1p(-theta_hat * x)))  # the GPD shape (positive for heavy tails)
    sigma = -k / theta_hat if theta_hat != 0 else float(np.mean(x))
    if prior_weight > 0:
        k = (n * k + prior_weight * 0.5) / (n + prior_weight)
    return k, sigma


def _gpd_quantile(p, k, sigma):
    if abs(k) < 1e-12:
        return -sigma * np.log1p(-p)
    return sigma * np.expm1(-k * np.log1p(-p)) / k


def pareto_k_threshold(num_draws):
    """The sample-size dependent reliability threshold ``min(1 - 1 / log10 S, 0.7)`` (Vehtari et al. 2024, §3.2.4).

    Example::

        >>> from pyro_convexvb.diagnostics import pareto_k_threshold
        >>> pareto_k_threshold(100), pareto_k_threshold(10_000)
        (0.5, 0.7)
    """
    return min(1.0 - 1.0 / math.log10(max(num_draws, 11)), 0.7)


def pareto_tail_k(x):
    """The generalised Pareto shape of the right tail of a sample ``x (S,)``: fitted (:func:`gpd_fit`) to the
    exceedances of its ``ceil(min(S / 5, 3 sqrt(S)))`` largest values over the next one, as :func:`psis_smooth` fits
    the ratios. A shape ``k`` says that moments of order ``1 / k`` and above are infinite. ``nan`` when fewer than 5
    tail values exceed the threshold.

    Example::

        >>> rng = np.random.default_rng(0)
        >>> round(pareto_tail_k(rng.pareto(2.0, size=200_000)), 1)   # Lomax with tail index 2: k = 1/2
        0.5
    """
    x = np.sort(np.asarray(x, dtype=np.float64))
    S = x.shape[0]
    M = int(math.ceil(min(0.2 * S, 3.0 * math.sqrt(S))))
    if S <= M:
        return math.nan
    exc = x[-M:] - x[-M - 1]
    exc = exc[exc > 0]
    if exc.size < 5:
        return math.nan
    return float(gpd_fit(exc / exc.max())[0])


def psis_smooth(log_ratios, tail_len=None):
    """Pareto-smooth one vector of log importance ratios.

    :param log_ratios: ``(S,)`` array of ``log p - log q`` (any additive constant).
    :param int tail_len: number of tail draws fitted (default ``ceil(min(S / 5, 3 sqrt(S)))``).
    :returns: ``(log_weights (S,), k_hat)`` -- the smoothed log weights, normalised so that
        ``logsumexp(log_weights) = 0``, and the fitted Pareto shape (``inf`` when the tail is too short
        to fit: fewer than 5 distinct tail draws; ``-inf`` when the largest ratios are equal to within ``1e-9``
        relative, i.e. the proposal is the target up to rounding).

    Example::

        >>> rng = np.random.default_rng(1)
        >>> lw, k = psis_smooth(rng.normal(size=1000))   # log-normal ratios: a light tail
        >>> bool(k < 0.5), round(float(np.exp(lw).sum()), 6)
        (True, 1.0)
    """
    lr = np.asarray(log_ratios, dtype=np.float64).copy()
    S = lr.shape[0]
    if not np.all(np.isfinite(lr) | (lr == -np.inf)) or np.all(lr == -np.inf):
        raise ValueError("log_ratios: every entry must be finite or -inf, and at least one finite")
    lr -= lr.max()
    M = tail_len if tail_len is not None else int(math.ceil(min(0.2 * S, 3.0 * math.sqrt(S))))
    k = math.inf
    if M >= 5 and S > M:
        order = np.argsort(lr)
        tail_idx = order[-M:]
        cutoff = lr[order[-M - 1]]
        if np.isfinite(cutoff) and -cutoff <= 1e-9:
            k = -math.inf  # the tail is flat to rounding: the ratios are constant, q is the target
        elif np.isfinite(cutoff) and lr[tail_idx].max() > cutoff:
            exc = np.exp(lr[tail_idx]) - np.exp(cutoff)
            if np.count_nonzero(exc > 0) >= 5:
                k, sigma = gpd_fit(exc[exc > 0])
                if np.isfinite(k):
                    p = (np.arange(1, M + 1) - 0.5) / M
                    smoothed = np.log(np.exp(cutoff) + _gpd_quantile(p, k, sigma))
                    smoothed = np.minimum(smoothed, 0.0)  # truncated at the largest raw ratio (0 after the shift)
                    lr[tail_idx] = smoothed  # tail_idx is in increasing order of the raw ratios
    lse = np.logaddexp.reduce(lr)
    return lr - lse, float(k)


def psis(log_ratios, axis=0):
    """:func:`psis_smooth` along ``axis`` of an array (e.g. ``(S, N)`` ratios of N leave-one-out problems).

    :returns: ``(log_weights, k_hat)`` with ``log_weights`` of the input's shape (normalised along ``axis``)
        and ``k_hat`` of the shape with ``axis`` removed.

    Example::

        >>> import numpy as np
        >>> from pyro_convexvb.diagnostics import psis
        >>> log_w, k_hat = psis(np.random.default_rng(0).normal(size=(1000, 3)))
        >>> log_w.shape, k_hat.shape, bool(np.allclose(np.exp(log_w).sum(0), 1.0)), bool((k_hat < 0.5).all())
        ((1000, 3), (3,), True, True)
    """
    a = np.moveaxis(np.asarray(log_ratios, dtype=np.float64), axis, -1)
    flat = a.reshape(-1, a.shape[-1])
    out = np.empty_like(flat)
    ks = np.empty(flat.shape[0])
    for i in range(flat.shape[0]):
        out[i], ks[i] = psis_smooth(flat[i])
    return np.moveaxis(out.reshape(a.shape), -1, axis), ks.reshape(a.shape[:-1])


def importance_ess(log_weights):
    """Importance-sampling effective sample size ``1 / sum w_s^2`` of normalised weights (Kong 1992).

    :param log_weights: ``(S,)`` log weights (any additive constant).

    Example::

        >>> import torch
        >>> from pyro_convexvb.diagnostics import importance_ess
        >>> round(float(importance_ess(torch.zeros(100))), 6), float(importance_ess(torch.tensor([0.0, -50.0, -50.0])))
        (100.0, 1.0)
    """
    lw = np.asarray(log_weights, dtype=np.float64)
    w = np.exp(lw - np.logaddexp.reduce(lw))
    return float(1.0 / np.sum(w**2))


def weighted_moments(x, w):
    """Self-normalised importance-sampling mean and sd of ``x`` ``(S, ...)`` with their Monte Carlo errors.

    The Monte Carlo standard error of a self-normalised estimate ``sum_s w_s h(x_s)`` is
    ``sqrt(sum_s w_s^2 (h(x_s) - E h)^2)`` (the delta method, Owen 2013, §9.2); the sd's error is that of the
    second central moment, propagated through the square root.

    :param x: ``(S, ...)`` draws; ``w``: ``(S,)`` normalised weights.
    :returns: ``(mean, sd, mean_mcse, sd_mcse)``, each of shape ``x.shape[1:]``.
    """
    x = np.asarray(x, dtype=np.float64)
    shape = x.shape[1:]
    x = x.reshape(x.shape[0], -1)
    w = np.asarray(w, dtype=np.float64).reshape(-1)
    w2 = w * w
    mean = w @ x
    d2 = x - mean
    d2 *= d2
    var = w @ d2
    sd = np.sqrt(var)
    mean_se = np.sqrt(w2 @ d2)
    d2 -= var
    d2 *= d2
    var_se = np.sqrt(w2 @ d2)
    sd_se = var_se / (2 * np.maximum(sd, 1e-300))
    return mean.reshape(shape), sd.reshape(shape), mean_se.reshape(shape), sd_se.reshape(shape)


def weighted_quantiles(x, w, probs):
    """Weighted quantiles of ``x`` ``(S, ...)`` and their Monte Carlo errors.

    The quantile at ``p`` interpolates the weighted empirical CDF at the draws' mid-points; its Monte Carlo error
    is read off the CDF (:mod:`~pyro_convexvb.posterior.empirical`).

    :returns: ``(quantiles, mcse)`` of shape ``(len(probs),) + x.shape[1:]``.
    """
    x = np.asarray(x, dtype=np.float64)
    q, se = _quantiles(x.reshape(x.shape[0], -1), w, probs, mcse=True)
    shape = (len(probs),) + x.shape[1:]
    return q.reshape(shape), se.reshape(shape)
