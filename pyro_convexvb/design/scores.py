r"""Design scores and rank-one marginal updates on the convex relaxation (Nickisch & Seeger 2009 §3 and appendix
"Active learning scores"; Seeger 2010 §2.2).

All scores take the current Gaussian marginals ``Q(s_i) = N(mu_i, rho_i)`` of candidate sites
``s_i = b_i^T u + o_i`` (``sigma^2 = 1``, the convention of
:mod:`pyro_convexvb.infer.convex_relaxation.problem`) and are vectorised over candidates (tensors of
shape ``(N,)``); no candidate loop in Python.

* :func:`predictive_probability`, :func:`classifier_uncertainty` -- ``Q(c_i = +1) = E_Q[t_i(s_i; +1)]``
  by Gauss-Hermite quadrature and ``S_CU = -|Q(c_i = +1) - 1/2|`` (Nickisch & Seeger 2009 §3).
* :func:`site_phi`, :func:`minimize_site_phi`, :func:`tilted_kl`, :func:`information_gain` -- the
  information gain ``S_IG = sum_c Q(c) D[Q'(s_i; c) || Q(s_i)]`` (Nickisch & Seeger 2009, appendix).
* :func:`design_score`, :func:`lanczos_covariance_factor` -- ``Delta(X_*) = log|I + X_* Cov X_*^T|``
  (Seeger 2010 §2.2) from any factor ``Cov = F F^T`` (dense Cholesky or K-Lanczos ``Q T^{-1} Q^T``).
* :func:`rank_one_include` -- the marginal updates of Nickisch & Seeger 2009 §3 when a site is included.
"""
import math
import numbers
from collections import namedtuple

import torch

from ..infer.convex_relaxation import LogisticPotential
from ..lgm.families.logit import predictive_log_probs
from ..lgm.sites import gaussian_expectation
from ..linalg import LinearOperator, as_operator

__all__ = [
    "predictive_probability",
    "classifier_uncertainty",
    "site_phi",
    "minimize_site_phi",
    "tilted_kl",
    "information_gain",
    "lanczos_covariance_factor",
    "design_score",
    "RankOneUpdate",
    "rank_one_include",
]


def _check_marginals(mean, var, name_mean="mean", name_var="var"):
    if not torch.is_tensor(mean) or not torch.is_tensor(var):
        raise TypeError(f"{name_mean}, {name_var}: expected tensors")
    if mean.shape != var.shape or mean.dim() != 1:
        raise ValueError(f"{name_mean}, {name_var}: expected equal shapes (N,), got {tuple(mean.shape)} and "
                         f"{tuple(var.shape)}")
    if not bool(torch.isfinite(mean).all()):
        raise ValueError(f"{name_mean}: contains NaN/inf")
    if not bool(torch.isfinite(var).all()) or bool((var < 0).any()):
        raise ValueError(f"{name_var}: must be finite and nonnegative")


def _check_like(mean, **tensors):
    """Each keyword tensor of the shape of ``mean`` (``(N,)``) and free of NaN (``inf`` is left to the caller)."""
    for name, t in tensors.items():
        if not torch.is_tensor(t):
            raise TypeError(f"{name}: expected a tensor of shape {tuple(mean.shape)}, got {type(t).__name__}")
        if t.shape != mean.shape:
            raise ValueError(f"{name}: expected shape {tuple(mean.shape)} (that of mean), got {tuple(t.shape)}")
        if bool(torch.isnan(t).any()):
            raise ValueError(f"{name}: contains NaN")


def _check_widths(gamma, name="gamma"):
    """Refuse site widths that are not ``> 0`` (``inf``, a site without its quadratic term, is allowed)."""
    if not bool((gamma > 0).all()):
        raise ValueError(f"{name}: site widths must be > 0, got {float(gamma[~(gamma > 0)][0])}")


def _check_potential(pot, mean):
    if not hasattr(pot, "beta") or not hasattr(pot, "h"):
        raise TypeError(f"pot: expected a SuperGaussianPotential (e.g. LogisticPotential), got {type(pot).__name__}")
    if pot.beta.shape != mean.shape:
        raise ValueError(f"pot, mean: the potential has {tuple(pot.beta.shape)} sites, the marginals "
                         f"{tuple(mean.shape)}")


def _check_quadrature(tau, num_points):
    """Refuse a logistic scale ``tau`` that is not a positive finite number and a ``num_points`` that is not an
    integer >= 1, naming them."""
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau: expected a positive finite number, got {tau!r}")
    if isinstance(num_points, bool) or not isinstance(num_points, numbers.Integral) or num_points < 1:
        raise ValueError(f"num_points: expected an integer >= 1 (quadrature nodes), got {num_points!r}")


def predictive_probability(mean, var, tau=1.0, num_points=32):
    r"""``Q(c_i = +1) = E_{N(s | mu_i, rho_i)}[sigmoid(tau s)]`` by Gauss-Hermite quadrature (Nickisch & Seeger
    2009 §3).

    Wide marginals, ``tau sqrt(rho_i) >`` :data:`WIDE_SD` ``= 1``, are not integrated with ``num_points`` nodes:
    there the sigmoid is a step on the Gaussian's scale and falls between the nodes, so their probabilities come
    from :func:`~pyro_convexvb.lgm.families.logit.predictive_log_probs` at ``(tau mu_i, tau^2 rho_i)``: its own 64
    Gauss-Hermite nodes summed in log space up to ``tau^2 rho_i = 4``, above that the step at ``0`` split off in
    closed form and the smooth rest integrated on panels (within ``1e-12`` of adaptive quadrature at any variance).
    ``num_points`` applies to the candidates with ``tau sqrt(rho_i) <= 1`` only.

    :param torch.Tensor mean: ``(N,)`` marginal means ``mu_i``.
    :param torch.Tensor var: ``(N,)`` marginal variances ``rho_i >= 0``.
    :param float tau: logistic scale (Nickisch & Seeger 2009 Eq. (3); ``1`` for ``BernoulliLogit``).
    :param int num_points: Gauss-Hermite nodes for the candidates with ``tau sqrt(rho_i) <= 1`` (see above).
    :returns: ``(N,)`` probabilities.

    Example::

        >>> import torch
        >>> p = predictive_probability(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
        >>> torch.allclose(p, torch.full_like(p, 0.5))
        True
    """
    _check_marginals(mean, var)
    _check_quadrature(tau, num_points)
    p = gaussian_expectation(lambda s: torch.sigmoid(tau * s), mean, var, num_points)
    wide = tau * var.sqrt() > WIDE_SD
    if bool(wide.any()):  # the sigmoid is a step on the Gaussian's scale: Gauss-Hermite nodes straddle it
        p = torch.where(wide, predictive_log_probs(tau * mean, tau * tau * var)[1].exp(), p)
    return p


#: ``tau sd`` above which :func:`predictive_probability` takes the classifiers' predictive probabilities
#: (:func:`~pyro_convexvb.lgm.families.logit.predictive_log_probs`: the step split off; Gauss-Hermite's 32 nodes were
#: 7e-3 off at variance 100 and gave 0.5000000 for 0.5004 at variance 1e4)
WIDE_SD = 1.0


def classifier_uncertainty(mean, var, tau=1.0, num_points=32):
    r"""Classifier uncertainty ``S_CU = -|Q(c_i = +1) - 1/2|`` (Nickisch & Seeger 2009 §3); larger is more
    informative.

    ``Q(c_i = +1)`` is :func:`predictive_probability`: ``num_points`` Gauss-Hermite nodes where
    ``tau sqrt(rho_i) <= 1``; wider marginals use
    :func:`~pyro_convexvb.lgm.families.logit.predictive_log_probs` (the sigmoid's step split off above
    ``tau^2 rho_i = 4``) and ``num_points`` does not apply to them.

    :param torch.Tensor mean: ``(N,)``.
    :param torch.Tensor var: ``(N,)``.
    :param float tau: logistic scale; :param int num_points: as in :func:`predictive_probability`.
    :returns: ``(N,)`` scores in ``[-1/2, 0]``.

    Example::

        >>> import torch
        >>> one = torch.ones(2, dtype=torch.float64)
        >>> s = classifier_uncertainty(torch.tensor([0.0, 3.0], dtype=torch.float64), one)
        >>> bool(s[0] > s[1])
        True
    """
    return -(predictive_probability(mean, var, tau, num_points) - 0.5).abs()


def site_phi(pot, gamma, mean, var):
    r"""``phi_i(gamma_i) = h_i(gamma_i) + log kappa_i - (mu_i + rho_i beta_i)^2 / (rho_i kappa_i)``,
    ``kappa_i = 1 + rho_i / gamma_i`` (Nickisch & Seeger 2009, appendix "Active learning scores", ``sigma^2 = 1``).

    ``exp(-phi_i/2)`` is, up to a constant, the lower bound on ``P(D ∪ {site i})`` when the new site
    has width ``gamma_i``.

    :param pot: a :class:`~pyro_convexvb.infer.convex_relaxation.SuperGaussianPotential` of ``N`` sites.
    :param gamma: ``(N,)`` widths.
    :param mean: ``(N,)`` ``mu_i``; :param var: ``(N,)`` ``rho_i > 0``.
    :returns: ``(N,)``.
    :raises ValueError: naming the argument, for shapes that differ from ``mean``'s or from the potential's
        number of sites, NaN or inf means, variances that are not ``> 0``, or widths that are not ``> 0``.

    Example::

        >>> import torch
        >>> from pyro_convexvb.infer.convex_relaxation import LogisticPotential
        >>> one = torch.ones(1, dtype=torch.float64)
        >>> pot = LogisticPotential(one)
        >>> g = minimize_site_phi(pot, 0 * one, one)
        >>> bool(site_phi(pot, g, 0 * one, one) <= site_phi(pot, 2 * g, 0 * one, one))
        True
    """
    _check_marginals(mean, var)
    if bool((var <= 0).any()):
        raise ValueError("var: site_phi needs strictly positive variances")
    _check_potential(pot, mean)
    _check_like(mean, gamma=gamma)
    _check_widths(gamma)
    kappa = 1 + var / gamma
    return pot.h(gamma) + torch.log(kappa) - (mean + var * pot.beta) ** 2 / (var * kappa)


def minimize_site_phi(pot, mean, var, *, rtol=1e-13, max_iter=400):
    r"""``gamma_i = argmin_{gamma > 0} phi_i(gamma)`` for all candidates at once (Nickisch & Seeger 2009, appendix).

    Stationarity, with ``gamma^2 h'(gamma) = x_*(gamma)`` (appendix), reads
    ``G = x_*(gamma) - E_{Q'}[s_i^2] = 0``: the Gaussian bound touches the site where the tilted
    marginal ``Q' ∝ Q(s_i) exp(beta_i s_i - s_i^2/(2 gamma_i))`` has its second moment. The root lies
    where ``x_* > 0``, so we parametrise by ``x``: ``gamma(x) = -1/(2 g'(x))`` (increasing), and
    bisect ``G(x) = x - rho gamma/(gamma + rho) - gamma^2 (mu + rho beta)^2 / (gamma + rho)^2`` on the
    bracket ``(0, rho + (mu + rho beta)^2]`` (``G < 0`` at ``0+``, ``G > 0`` at the upper end; one sign
    change since ``phi_i`` is convex for log-concave sites, Nickisch & Seeger 2009 Theorem 2). Bisection is
    geometric while the bracket spans more than a factor 4, so tiny roots cost ``O(log)`` steps.

    :param pot: potential of ``N`` sites (its ``beta`` fixes the label of each candidate).
    :param torch.Tensor mean: ``(N,)``; :param torch.Tensor var: ``(N,)``, ``> 0``.
    :param float rtol: relative bracket width at which to stop.
    :returns: ``gamma`` ``(N,)``.
    :raises ValueError: for nonpositive variances.

    Example::

        >>> import torch
        >>> from pyro_convexvb.infer.convex_relaxation import LogisticPotential
        >>> pot = LogisticPotential(torch.ones(1, dtype=torch.float64))
        >>> g = minimize_site_phi(pot, torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64))
        >>> bool(g > pot.gamma0())
        True
    """
    _check_marginals(mean, var)
    if bool((var <= 0).any()):
        raise ValueError("var: the tilted-site minimisation needs strictly positive variances")
    _check_potential(pot, mean)
    r = mean + var * pot.beta

    def gam(x):
        return -0.5 / pot.dg(x)

    def G(x):
        g = gam(x)
        return x - var * g / (g + var) - (g * r / (g + var)) ** 2

    lo = torch.zeros_like(mean)
    hi = var + r * r
    for _ in range(max_iter):
        mid = torch.where(lo <= 0, hi / 8, torch.where(hi > 4 * lo, torch.sqrt(lo * hi.clamp_min(0)), 0.5 * (lo + hi)))
        pos = G(mid) > 0
        hi = torch.where(pos, mid, hi)
        lo = torch.where(pos, lo, mid)
        if bool(((hi - lo) <= rtol * hi).all()):
            break
    return gam(0.5 * (lo + hi))


def tilted_kl(mean, var, beta, gamma):
    r"""``D[Q' || Q] = (1/2)(log kappa + (rho/kappa)((beta - mu/gamma)^2 / kappa - 1/gamma))``,
    ``kappa = 1 + rho/gamma`` (Nickisch & Seeger 2009, appendix "Active learning scores", ``sigma^2 = 1``), where
    ``Q = N(mu, rho)`` and ``Q' ∝ Q(s) exp(beta s - s^2/(2 gamma))``. All arguments ``(N,)``.

    :param torch.Tensor mean: ``(N,)`` ``mu``, finite; :param torch.Tensor var: ``(N,)`` ``rho >= 0``.
    :param torch.Tensor beta: ``(N,)`` linear terms; :param torch.Tensor gamma: ``(N,)`` widths ``> 0`` (``inf``:
        no quadratic term, ``D = rho beta^2 / 2``).
    :returns: ``(N,)`` divergences ``>= 0``.
    :raises ValueError: naming the argument, for a shape other than ``mean``'s, NaN, an infinite ``mean`` or
        ``beta``, negative variances, or widths that are not ``> 0``.

    Example::

        >>> import torch
        >>> z, one = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
        >>> tilted_kl(z, one, one, torch.full_like(one, float("inf")))  # Q' = N(1, 1): D = 1/2
        tensor([0.5000], dtype=torch.float64)
    """
    _check_marginals(mean, var)
    _check_like(mean, beta=beta, gamma=gamma)
    if not bool(torch.isfinite(beta).all()):
        raise ValueError("beta: contains inf")
    _check_widths(gamma)
    kappa = 1 + var / gamma
    return 0.5 * (torch.log(kappa) + (var / kappa) * ((beta - mean / gamma) ** 2 / kappa - 1 / gamma))


def information_gain(mean, var, tau=1.0, num_points=32, return_parts=False):
    r"""Information gain ``S_IG(b_i) = sum_{c = +-1} Q(c_i = c) D[Q'(s_i; c) || Q(s_i)]`` (Nickisch & Seeger 2009
    §3 and appendix) for Bernoulli-logit candidate sites ``t(s; c) = sigmoid(c tau s)``.

    For each candidate and label, ``gamma_i(c)`` minimises :func:`site_phi` (:func:`minimize_site_phi`),
    the tilted ``Q'`` is formed at that width and its divergence from ``Q`` taken in closed form
    (:func:`tilted_kl`); ``Q(c_i)`` is :func:`predictive_probability`. ``num_points`` enters only there, and only
    for candidates with ``tau sqrt(rho_i) <= 1``: wider ones use
    :func:`~pyro_convexvb.lgm.families.logit.predictive_log_probs` (the sigmoid's step split off above
    ``tau^2 rho_i = 4``), whatever ``num_points``.

    :param torch.Tensor mean: ``(N,)``; :param torch.Tensor var: ``(N,)`` (``> 0``).
    :param float tau: logistic scale; :param int num_points: as in :func:`predictive_probability`.
    :param bool return_parts: also return ``dict(p_plus, gamma_plus, gamma_minus, kl_plus, kl_minus)``.
    :returns: ``(N,)`` scores ``>= 0`` (and the parts).

    Example::

        >>> import torch
        >>> s = information_gain(torch.tensor([0.0, 4.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64))
        >>> bool(s[0] > s[1] > 0)
        True
    """
    _check_marginals(mean, var)
    p = predictive_probability(mean, var, tau, num_points)
    parts = {"p_plus": p}
    total = torch.zeros_like(mean)
    for c, weight in ((1, p), (-1, 1 - p)):
        pot = LogisticPotential(torch.full_like(mean, (c + 1) // 2), tau)
        gamma = minimize_site_phi(pot, mean, var)
        kl = tilted_kl(mean, var, pot.beta, gamma)
        key = "plus" if c == 1 else "minus"
        parts["gamma_" + key], parts["kl_" + key] = gamma, kl
        total = total + weight * kl
    return (total, parts) if return_parts else total


def lanczos_covariance_factor(lanczos):
    r"""``F = Q_k L^{-T}`` with ``T_k = L L^T``, so that ``F F^T = Q_k T_k^{-1} Q_k^T`` (the K-Lanczos
    covariance, Seeger 2010 §3); shape ``(n, k)``.

    :param lanczos: a :class:`~pyro_convexvb.linalg.LanczosResult` (``state.lanczos`` of the convex relaxation),
        or any result with a ``covariance_factor()`` method (for the engine's whitened estimator of a
        Gaussian-process prior, :class:`~pyro_convexvb.infer.convex_relaxation.outer.WhitenedLanczos`, ``F`` has
        ``n + k`` columns).
    """
    if not hasattr(lanczos, "covariance_factor"):
        raise TypeError(f"lanczos: expected a LanczosResult (e.g. result.state.lanczos), got {type(lanczos).__name__}")
    return lanczos.covariance_factor()


def positive_number(value, name):
    """``value`` as a float: a positive finite real number (Python, NumPy or one-element real torch; not a bool),
    else a ValueError naming ``name``."""
    if torch.is_tensor(value) and value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool:
        value = value.item()
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (ok and math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return float(value)


def check_noise_var(noise_var):
    """``noise_var`` as a float: a positive finite real number (Python, NumPy or 0-d torch; not a bool)."""
    return positive_number(noise_var, "noise_var")


def design_score(X_star, factor, noise_var=1.0, chunk_size=1024):
    r"""``Delta(X_*) = log|I + X_* Cov X_*^H / noise_var|`` for many candidates at once (Seeger 2010 §2.2).

    ``Cov = F F^H`` is given by a factor ``F`` (``(n, k)``): ``torch.linalg.cholesky(Cov)`` for the
    exact covariance, :func:`lanczos_covariance_factor` for K-Lanczos. With ``W = X_* F`` (``(r, k)``
    per candidate), ``Delta = log|I_r + W W^H / noise_var| = log|I_k + W^H W / noise_var|``; the smaller
    of the two is factorised.

    :param X_star: candidates: ``(N, n)`` rows (dense, sparse or an operator; one row per candidate,
        ``Delta = log(1 + ||w||^2/noise_var)``) or a dense ``(N, r, n)`` tensor (``r`` rows per
        candidate, e.g. a k-space column), real or complex.
    :param torch.Tensor factor: ``(n, k)``, real or complex (``Cov = F F^H``; real candidates then give complex
        ``W``), computed in the candidates' precision.
    :param float noise_var: measurement noise variance ``sigma^2`` of the new rows.
    :param int chunk_size: for ``(N, r, n)`` candidates, candidates per batch (memory ``chunk_size * r * k``); for
        ``(N, n)`` rows, columns of ``F`` per batch (memory ``N * chunk_size``).
    :returns: ``(N,)`` real scores.

    Example::

        >>> import torch
        >>> C = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
        >>> X = torch.eye(2, dtype=torch.float64)
        >>> d = design_score(X, torch.linalg.cholesky(C))
        >>> torch.allclose(d, torch.log1p(torch.diagonal(C)))
        True
    """
    noise_var = check_noise_var(noise_var)
    if not torch.is_tensor(factor) or factor.dim() != 2:
        raise ValueError(f"factor: expected an (n, k) tensor, got "
                         f"{tuple(factor.shape) if torch.is_tensor(factor) else type(factor).__name__}")
    if not bool(torch.isfinite(factor).all()):
        raise ValueError("factor: contains NaN/inf")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    if torch.is_tensor(X_star):
        vals = X_star.values() if X_star.layout != torch.strided else X_star  # sparse: its stored entries
        if not bool(torch.isfinite(vals).all()):
            raise ValueError("X_star: contains NaN/inf")
    if isinstance(X_star, LinearOperator) or (torch.is_tensor(X_star) and X_star.dim() == 2):
        op = as_operator(X_star)
        if op.shape[1] != factor.shape[0]:
            raise ValueError(f"X_star: {op.shape[1]} columns but factor has {factor.shape[0]} rows")
        # a complex factor of real rows: ||X_* F||^2 = ||X_* Re F||^2 + ||X_* Im F||^2 (products stay real)
        parts = ((factor.real, factor.imag) if factor.is_complex() and not op.dtype.is_complex else (factor,))
        parts = [P.to(op.dtype) for P in parts]
        sq = torch.zeros(op.shape[0], dtype=parts[0].real.dtype, device=factor.device)
        for P in parts:
            for start in range(0, P.shape[1], chunk_size):  # chunk_size columns of F at once
                sq = sq + (op.mv(P[:, start:start + chunk_size]).abs() ** 2).sum(-1)
        return torch.log1p(sq / noise_var)
    if not torch.is_tensor(X_star) or X_star.dim() != 3:
        raise ValueError("X_star: expected (N, n) rows / operator or a dense (N, r, n) tensor")
    if X_star.shape[-1] != factor.shape[0]:
        raise ValueError(f"X_star: {X_star.shape[-1]} columns but factor has {factor.shape[0]} rows")
    if X_star.shape[0] == 0:
        return torch.zeros(0, dtype=factor.real.dtype if factor.is_complex() else factor.dtype, device=factor.device)
    dt = X_star.dtype
    if factor.is_complex() and not dt.is_complex:  # real candidates, complex factor: W = X_* F is complex
        dt = (torch.zeros((), dtype=dt) * 1j).dtype
    F = factor.to(dt)
    return torch.cat([_logdet_eye_plus(X_star[start:start + chunk_size].to(dt) @ F, noise_var)
                      for start in range(0, X_star.shape[0], chunk_size)])


def _logdet_eye_plus(W, noise_var):
    """``log|I + W W^H / noise_var|`` for a batch ``W`` of shape ``(N, r, k)`` (smaller side factorised)."""
    r, k = W.shape[-2:]
    M = W @ W.conj().transpose(-1, -2) if r <= k else W.conj().transpose(-1, -2) @ W
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    L = torch.linalg.cholesky(eye + M / noise_var)
    return 2 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1).real).sum(-1)


def _scalar(name, v):
    """``v`` if it is a real number or a one-element real tensor, else a ValueError naming ``name``."""
    if torch.is_tensor(v):
        if v.numel() != 1 or v.dtype.is_complex or v.dtype == torch.bool:
            raise ValueError(f"{name}: expected a real scalar, got a {v.dtype} tensor of shape {tuple(v.shape)}")
        return v.reshape(())
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name}: expected a real scalar, got {v!r}")
    return v


RankOneUpdate = namedtuple("RankOneUpdate", ["mean", "var", "u", "log_det", "kappa"])
RankOneUpdate.__doc__ = """Marginals after including one site: ``mean (|J|,)``, ``var (|J|,)``, ``u (n,)``,
``log_det`` (``log|A'|``) and ``kappa = 1 + rho_i/gamma_i``."""


def rank_one_include(mean_J, var_J, w, d, u, log_det, *, mean_i, var_i, beta_i, gamma_i):
    r"""Include site ``i`` (row ``b_i``, width ``gamma_i``, linear term ``beta_i``) into ``Q``: Nickisch & Seeger
    2009 §3.

    With ``A' = A + b_i b_i^T / gamma_i``, ``d = A^{-1} b_i``, ``w = B_J d``, ``rho_i = b_i^T d``,
    ``kappa_i = 1 + rho_i/gamma_i`` (Sherman-Morrison):

    .. math:: \rho'_J = \rho_J - \frac{w^2}{\rho_i + \gamma_i},\quad
              \mu'_J = \mu_J + \frac{\beta_i - \mu_i/\gamma_i}{\kappa_i} w,\quad
              u'_* = u_* + \frac{\beta_i - \mu_i/\gamma_i}{\kappa_i} d,\quad
              \log|A'| = \log|A| + \log\kappa_i.

    ``mean_i`` is ``mu_i = b_i^T u_* + o_i`` (``o_i`` the site offset). Variances that turn negative
    (possible with underestimated Lanczos variances) are returned as they are; the caller drops them.

    :param mean_J: ``(|J|,)``; :param var_J: ``(|J|,)``; :param w: ``(|J|,)``; :param d: ``(n,)``;
    :param u: ``(n,)``; :param log_det: number or 0-d tensor (``None`` is passed through).
    :param mean_i, var_i, beta_i, gamma_i: scalars (numbers or 0-d tensors) of the included site.
    :returns: :class:`RankOneUpdate`.
    :raises ValueError: naming the argument: a non-scalar or NaN/inf ``mean_i``, ``var_i``, ``beta_i``,
        ``gamma_i <= 0``, ``var_i < 0``, NaN/inf or non-1-D ``mean_J``, ``var_J``, ``w``, ``d``, ``u``, or
        unequal shapes.
    """
    mean_i, var_i, beta_i, gamma_i = (_scalar(name, v) for name, v in (
        ("mean_i", mean_i), ("var_i", var_i), ("beta_i", beta_i), ("gamma_i", gamma_i)))
    for name, v in (("mean_i", mean_i), ("var_i", var_i), ("beta_i", beta_i)):
        if not math.isfinite(float(v)):
            raise ValueError(f"{name}: expected a finite number, got {float(v)}")
    if not float(gamma_i) > 0 or not float(var_i) >= 0:
        raise ValueError(f"gamma_i, var_i: expected gamma_i > 0 and var_i >= 0, got {float(gamma_i)}, {float(var_i)}")
    for name, t in (("mean_J", mean_J), ("var_J", var_J), ("w", w), ("d", d), ("u", u)):
        if not torch.is_tensor(t) or t.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got "
                             f"{tuple(t.shape) if torch.is_tensor(t) else type(t).__name__}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: contains NaN/inf")
    if not (mean_J.shape == var_J.shape == w.shape and d.shape == u.shape):
        raise ValueError(f"mean_J, var_J, w: expected equal shapes (|J|,), got {tuple(mean_J.shape)}, "
                         f"{tuple(var_J.shape)}, {tuple(w.shape)}; d, u: equal shapes (n,), got {tuple(d.shape)}, "
                         f"{tuple(u.shape)}")
    kappa = 1 + var_i / gamma_i
    step = (beta_i - mean_i / gamma_i) / kappa
    var_new = var_J - w * w / (var_i + gamma_i)
    mean_new = mean_J + step * w
    u_new = u + step * d
    ld = None if log_det is None else log_det + math.log(float(kappa))
    return RankOneUpdate(mean_new, var_new, u_new, ld, kappa)
