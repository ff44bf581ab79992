"""The equations of Algorithm 1 (Shamir & Szpankowski 2021, Shamir & Szpankowski) as small NumPy functions.

This is the *reference path*: each function implements one equation of the paper, in the
paper's symbols, vectorised over the nonzero features of one example ``x_t``.  The compiled
kernels in :mod:`pyro_convexvb.online._kernels` compute the same quantities and are tested
against these functions.

Symbols (Shamir & Szpankowski 2021, §3): ``mu_i``/``s2_i`` are the per-feature mean and variance
``mu_{i,t}``, ``sigma^2_{i,t}``; ``mu_t``/``s2_t`` the score moments of Eq. (6);
``mu_minus``/``s2_minus`` the self-excluding moments of Eq. (7); ``y`` is ``y_t`` in
``{-1, +1}``; ``x`` is the vector of nonzero values ``x_{i,t}``.

Both links share one form.  With ``F`` the link CDF (``Sigma`` for ``"logit"``, ``Phi`` for
``"probit"``) and the shrinkage ``c(v) = sqrt(1 + a v)`` (``a = pi/8`` for logit by Eq. (5),
``a = 1`` for probit, Appendix B) the marginalised likelihood of feature ``i`` is
``F(y (mu_minus + x w_i) / c(s2_minus))`` (Eqs. (11), (25)).  The first two derivatives of
``-log F(z)`` are ``-psi1(z)`` and ``psi2(z)``:

* logit:  ``psi1 = 1 - Sigma(z)``, ``psi2 = Sigma(z) (1 - Sigma(z))`` (Eqs. (15), (19));
* probit: ``psi1 = phi(z)/Phi(z)``, ``psi2 = psi1 (z + psi1)`` (Eqs. (28), (31)).
"""
import math

import numpy as np
from scipy.special import erfc

__all__ = [
    "LINKS",
    "link_cdf",
    "log_link_cdf",
    "psi1",
    "psi2",
    "shrinkage",
    "score_moments",
    "self_excluding_moments",
    "predict_proba",
    "p_plus",
    "p_i",
    "taylor_mean",
    "newton_mean",
    "value_variance",
    "laplace_variance",
]

LINKS = ("logit", "probit")
_SQRT2 = math.sqrt(2.0)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# Below this probit score the Mills-ratio asymptotic series replaces phi/Phi (both underflow
# near -38).  The same threshold and series are used by the compiled kernels.
_PROBIT_TAIL = -35.0


def _check_link(link):
    if link not in LINKS:
        raise ValueError(f"link: expected one of {LINKS}, got {link!r}")


def _a(link):
    """The shrinkage constant ``a`` in ``c(v) = sqrt(1 + a v)``: ``pi/8`` (Eq. (5)) or 1 (Eq. (24))."""
    return math.pi / 8.0 if link == "logit" else 1.0


def _sigmoid(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softplus(z):
    z = np.asarray(z, dtype=np.float64)
    return np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z)))


def _inv_mills(z):
    """``phi(z) / Phi(z)``, stable for very negative ``z``."""
    z = np.asarray(z, dtype=np.float64)
    zc = np.maximum(z, _PROBIT_TAIL)
    direct = np.exp(-0.5 * zc * zc) * _INV_SQRT_2PI / (0.5 * erfc(-zc / _SQRT2))
    x = np.maximum(-z, -_PROBIT_TAIL)
    u = 1.0 / (x * x)
    # Phi(-x)/phi(x) ~ (1/x)(1 - 1/x^2 + 3/x^4 - 15/x^6 + 105/x^8)
    series = x / (1.0 - u * (1.0 - u * (3.0 - u * (15.0 - 105.0 * u))))
    return np.where(z < _PROBIT_TAIL, series, direct)


def link_cdf(z, link):
    """The link CDF ``F(z)``: ``Sigma(z)`` (Eq. (2)) or ``Phi(z)`` (Eq. (23)).

    :param z: scores, any shape.
    :param str link: ``"logit"`` or ``"probit"``.
    :returns: ``F(z)``, same shape.
    """
    _check_link(link)
    if link == "logit":
        return _sigmoid(z)
    return 0.5 * erfc(-np.asarray(z, dtype=np.float64) / _SQRT2)


def log_link_cdf(z, link):
    """``log F(z)`` without underflow (the log-loss of a prediction is ``-log_link_cdf``)."""
    _check_link(link)
    z = np.asarray(z, dtype=np.float64)
    if link == "logit":
        return -_softplus(-z)
    zc = np.maximum(z, _PROBIT_TAIL)
    with np.errstate(divide="ignore"):  # both branches are evaluated; only the finite one is kept
        direct = np.where(zc > 0, np.log1p(-0.5 * erfc(zc / _SQRT2)), np.log(0.5 * erfc(-zc / _SQRT2)))
    tail = -0.5 * z * z - _LOG_SQRT_2PI - np.log(_inv_mills(z))
    return np.where(z < _PROBIT_TAIL, tail, direct)


def psi1(z, link):
    """``d/dz log F(z)``: ``1 - Sigma(z)`` (logit) or ``phi(z)/Phi(z)`` (probit)."""
    _check_link(link)
    if link == "logit":
        return _sigmoid(-np.asarray(z, dtype=np.float64))
    return _inv_mills(z)


def psi2(z, link):
    """``-d^2/dz^2 log F(z)``: ``Sigma(z)(1 - Sigma(z))`` (logit) or ``r (z + r)``, ``r = phi/Phi`` (probit)."""
    _check_link(link)
    z = np.asarray(z, dtype=np.float64)
    if link == "logit":
        return _sigmoid(z) * _sigmoid(-z)
    r = _inv_mills(z)
    return r * (z + r)


def shrinkage(v, link):
    """``c(v) = sqrt(1 + (pi/8) v)`` (logit, Eq. (8)) or ``sqrt(1 + v)`` (probit, Eq. (24))."""
    _check_link(link)
    return np.sqrt(1.0 + _a(link) * np.asarray(v, dtype=np.float64))


def score_moments(x, mu_i, s2_i):
    """Shamir & Szpankowski 2021, Eq. (6): ``mu_t = sum_i x_i mu_i``, ``sigma^2_t = sum_i x_i^2 sigma^2_i``.

    :param x: ``(d_t,)`` nonzero values of ``x_t``.
    :param mu_i: ``(d_t,)`` means of those features.
    :param s2_i: ``(d_t,)`` variances of those features.
    :returns: ``(mu_t, s2_t)`` floats.

    Example::

        >>> score_moments(np.ones(2), np.array([0.5, -1.0]), np.ones(2))
        (-0.5, 2.0)
    """
    return float(np.dot(x, mu_i)), float(np.dot(x * x, s2_i))


def self_excluding_moments(x, mu_i, s2_i, mu_t, s2_t):
    """Shamir & Szpankowski 2021, Eq. (7): ``mu_{-i} = mu_t - x_i mu_i``, ``sigma^2_{-i} = sigma^2_t - x_i^2 sigma^2_i``.

    The variance is clipped at 0 against round-off (a row with a single feature).

    :returns: ``(mu_minus, s2_minus)``, each ``(d_t,)``.
    """
    return mu_t - x * mu_i, np.maximum(s2_t - x * x * s2_i, 0.0)


def predict_proba(mu_t, s2_t, link):
    """Shamir & Szpankowski 2021, Eq. (8) (logit) / Eq. (24) (probit): ``P(y_t = 1 | x_t) = F(mu_t / c(sigma^2_t))``.

    :param mu_t: score means, any shape.
    :param s2_t: score variances, same shape.
    :returns: probabilities of the label ``+1``.
    """
    return link_cdf(np.asarray(mu_t, dtype=np.float64) / shrinkage(s2_t, link), link)


def p_plus(y, x, mu_new, mu_minus, s2_minus, link):
    """Shamir & Szpankowski 2021, Eq. (14) (logit) / ``Phi(z_{i,t+})`` with Eq. (27) (probit).

    The probability of ``y_t`` when only feature ``i`` has moved to ``mu_new``, shrunk by the
    self-excluding variance.
    """
    return link_cdf(y * (mu_minus + x * mu_new) / shrinkage(s2_minus, link), link)


def p_i(y, mu_t, s2_minus, link):
    """Shamir & Szpankowski 2021, Eq. (16) (logit) / ``Phi(z_{i,t})`` with Eq. (29) (probit)."""
    return link_cdf(y * mu_t / shrinkage(s2_minus, link), link)


def taylor_mean(y, x, mu_i, s2_i, mu_t, s2_minus, link):
    """Shamir & Szpankowski 2021, Eq. (17) (logit) / Eq. (30) (probit): closed-form mean update.

    First-order Taylor expansion of Eq. (15) / (28) around the pre-update means::

        mu_{i,t+1} = mu_i + y x s2_i psi1(z_i) / (c [1 + x^2 s2_i psi2(z_i) / c^2]),

    ``z_i = y mu_t / c``, ``c = c(sigma^2_{-i,t})``; for logit ``psi1(z_i) = 1 - p_{i,t}`` and
    ``psi2(z_i) = p_{i,t}(1 - p_{i,t})`` with ``p_{i,t}`` of Eq. (16).

    :returns: ``(d_t,)`` updated means.
    """
    c = shrinkage(s2_minus, link)
    z = y * mu_t / c
    return mu_i + y * x * s2_i * psi1(z, link) / (c * (1.0 + x * x * s2_i * psi2(z, link) / (c * c)))


def newton_mean(y, x, mu_i, s2_i, mu_minus, s2_minus, link, tol=1e-9, maxiter=50):
    """Shamir & Szpankowski 2021, Eq. (15) (logit) / Eq. (28) (probit) solved by Newton's method, Appendix C.

    Minimises ``(w - mu_i)^2 / (2 s2_i) - log F(y (mu_minus + x w) / c)`` (the negative log of
    the r.h.s. of Eq. (12) / (26)) starting from ``w = mu_i`` with the gradient Eq. (32), the
    curvature Eq. (33) and the step Eq. (34); it stops when a Newton step is below
    ``tol (1 + |w|)`` (the iteration converges quadratically, so the error is then far below
    ``tol``).  The first step is exactly the Taylor update (17).  The iteration is safeguarded
    as in ``rtsafe``: the root always lies in ``[mu_i, mu_i + y x s2_i psi1(z_i) / c]``, and a
    Newton step that leaves the current bracket, or is more than half the previous step, is
    replaced by bisection, so it cannot diverge or stall in oscillations.

    :returns: ``(mu_new, converged)``: ``(d_t,)`` means and a ``(d_t,)`` boolean mask.
    """
    x = np.asarray(x, dtype=np.float64)
    c = shrinkage(s2_minus, link)
    w = np.array(mu_i, dtype=np.float64, copy=True)
    far = mu_i + y * x * s2_i * psi1(y * (mu_minus + x * mu_i) / c, link) / c
    lo, hi = np.minimum(mu_i, far), np.maximum(mu_i, far)
    converged = np.zeros(w.shape, dtype=bool)
    dx_old = np.full(w.shape, np.inf)
    for _ in range(maxiter):
        z = y * (mu_minus + x * w) / c
        g = (w - mu_i) / s2_i - y * x / c * psi1(z, link)  # Eq. (32)
        h = 1.0 / s2_i + x * x / (c * c) * psi2(z, link)  # Eq. (33)
        hi = np.where(g > 0, w, hi)
        lo = np.where(g <= 0, w, lo)
        dx = g / h
        w_newton = w - dx  # Eq. (34)
        small = np.abs(dx) <= tol * (1.0 + np.abs(w))
        newton = small | ((w_newton >= lo) & (w_newton <= hi) & (np.abs(dx) <= 0.5 * np.abs(dx_old)))
        w_new = np.where(newton, w_newton, 0.5 * (lo + hi))
        dx_old = np.where(newton, dx, w - w_new)
        w = np.where(converged, w, w_new)
        converged |= small
        if converged.all():
            break
    return w, converged


def value_variance(log_p_t, y, x, mu_i, s2_i, mu_new, mu_minus, s2_minus, link):
    """Shamir & Szpankowski 2021, Eq. (18): match the *height* of the marginalised posterior at its peak.

    ``sigma_{i,t+1} = p_t sigma_i / p_{i,t+} * exp((mu_new - mu_i)^2 / (2 sigma^2_i))``, with
    ``p_t`` the prediction of the observed label (Eq. (8) / (24)), passed as ``log_p_t``, and
    ``p_{i,t+}`` of Eq. (14) (probit: ``Phi(z_{i,t+})``, the same construction applied to
    Eq. (26)).  Computed in logs.

    :returns: ``(d_t,)`` updated variances ``sigma^2_{i,t+1}``.
    """
    z_plus = y * (mu_minus + x * mu_new) / shrinkage(s2_minus, link)
    d = mu_new - mu_i
    return s2_i * np.exp(2.0 * (log_p_t - log_link_cdf(z_plus, link)) + d * d / s2_i)


def laplace_variance(y, x, s2_i, mu_new, mu_minus, s2_minus, link):
    """Shamir & Szpankowski 2021, Eq. (19) (logit) / Eq. (31) (probit): curvature of the posterior at its peak.

    ``1/sigma^2_{i,t+1} = 1/sigma^2_i + x^2 psi2(z_{i,t+}) / c^2``; for logit
    ``psi2 = p_{i,t+}(1 - p_{i,t+})``.

    :returns: ``(d_t,)`` updated variances.
    """
    c = shrinkage(s2_minus, link)
    z_plus = y * (mu_minus + x * mu_new) / c
    return 1.0 / (1.0 / s2_i + x * x / (c * c) * psi2(z_plus, link))
