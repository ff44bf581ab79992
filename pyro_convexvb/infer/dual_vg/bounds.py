r"""Local variational bounds (LVBs) and their Fenchel conjugates for the dual VG method.

Khan et al. 2013 (Khan, Aravkin, Friedlander & Seeger 2013), Eqs. (10) and (19); conventions and
derivations in ``docs/dual_vg.md``, § Fenchel conjugates of the local bounds. A local bound of one
site is a closed convex function
``f(h, rho) >= -E_{N(eta | h, rho)}[log p(y | eta)]`` of the site marginal mean ``h`` and variance
``rho >= 0``. Here every normalising constant of ``log p`` is kept inside ``f`` (so the primal
``-KL - sum_n f_n`` is directly a lower bound on ``log p(y)``, ``c_y = 0``). Its conjugate in the
paper's pairing is

.. math:: f^*(\alpha, \lambda) = \sup_{h,\ \rho \ge 0}\ \alpha h + \tfrac12 \lambda \rho - f(h, \rho).

Every bound shipped here has a conjugate of the *half-space* form

.. math:: f^*(\alpha, \lambda) = \psi(\alpha) \quad \text{on}\ \{\lambda \le \ell(\alpha),\ \alpha \in (a_{lo}, a_{hi})\},

with ``psi`` convex and ``ell`` concave and nonnegative. Because the dual objective strictly
decreases in every ``lambda_n`` (its gradient there is ``-v_n / 2 < 0``), the dual optimum sits on
``lambda = ell(alpha)`` and the dual reduces to ``N`` variables ``alpha`` (``docs/dual_vg.md``,
§ Dual decomposition; for affine ``ell`` this is the paper's line form in ``lambda``). The reduced
dual is convex: it is a convex, decreasing function of ``lambda`` composed with the concave
``ell`` plus convex terms.

==================  =========================================  ======================  ===================
bound               ``f(h, rho)``                              ``ell(alpha)``          ``psi(alpha)``
==================  =========================================  ======================  ===================
Poisson (exact)     ``e^{h+rho/2} - y h + log y!``             ``kappa = alpha + y``   ``kappa log kappa - kappa - log y!``
SV (exact)          ``(h + y^2 e^{-h+rho/2} + log 2 pi)/2``    ``kappa = 1/2 - alpha`` ``kappa log(2 kappa / y^2) - kappa - log(2 pi)/2``
Gaussian (exact)    ``((y-h)^2 + rho)/(2 s^2) + log s + c``    ``1/s^2``               quadratic
logit "jensen"      ``log(1 + e^{h+rho/2}) - y h``             ``kappa = alpha + y``   ``H(kappa)``
logit "bohning"     ``log(1 + e^h) + rho/8 - y h``             ``1/4``                 ``H(kappa)``
logit "jaakkola"    ``lambda_xi (h^2 + rho - xi^2) + ...``     ``2 lambda_xi``         quadratic
logit "tight"       ``sup_k k h + k(1-k) rho/2 - H(k) - y h``  ``kappa (1 - kappa)``   ``H(kappa)``
probit (tight)      ``sup_p p c h + G(p) rho/2 - psi(p)``      ``G = 1 / psi''``       ``sup_x p x + log Phi(x)``
==================  =========================================  ======================  ===================

(``H(k) = k log k + (1-k) log(1-k)``.) The ``tight`` logit bound is this package's default; it
is convex by construction (a supremum of affine functions of ``(h, rho)``), exact to second order
in ``rho`` for every ``h``, and valid: ``F(h, rho) = E softplus(h + sqrt(rho) eps)`` solves the heat
equation ``F_rho = F_hh / 2`` with ``F_hh = E[s(1-s)] <= E[s](1 - E[s]) = F_h (1 - F_h)``
(``s = sigmoid(eta)``, a variance is nonnegative), so ``F`` is a subsolution of the Hamilton-Jacobi
equation ``U_rho = U_h (1 - U_h) / 2`` whose Hopf-formula solution from ``U(., 0) = softplus`` is the
bound; comparison gives ``F <= U``. Its conjugate domain ``lambda <= kappa (1 - kappa)`` lies inside
those of the Jensen (``lambda <= kappa``) and Böhning (``lambda <= 1/4``) bounds, so it is tighter
than both everywhere. ``docs/dual_vg.md`` records the checks and the measured gaps.

The probit bound (:class:`ProbitTightBound`) is the same construction for ``-log Phi(c eta)``
(``c = 2 y - 1``): with ``psi`` the conjugate of ``-log Phi`` and ``G = 1 / psi''`` its curvature
``r (x + r)`` (``r = phi / Phi``, the Mills-ratio reciprocal) written as a function of the slope, ``G``
is concave, so ``E[G(.)] <= G(E[.])`` makes the exact expectation a subsolution of
``U_rho = G(U_h) / 2`` and the Hopf formula gives a valid, convex bound. The exact probit
expectation itself is not jointly convex (``docs/dual_vg.md``, § The probit bound).

Weighted (tempered) sites ``p(y | eta)^w`` -- a likelihood under ``poutine.scale`` -- take ``w f`` for
any of these bounds (:class:`WeightedBound`): its conjugate ``w f*(alpha / w, lambda / w)`` has the
same half-space form, with ``psi_w(alpha) = w psi(alpha / w)``, ``ell_w(alpha) = w ell(alpha / w)``
and the ``alpha`` domain scaled by ``w`` (``docs/dual_vg.md``, § Weighted sites).

Bounds without a closed-form conjugate (:class:`GenericBound`, e.g. :class:`PiecewiseQuadraticBound`)
are conjugated by a small 2-D convex inner maximisation per site (:func:`numerical_conjugate`).
"""
import math

import numpy as np
import torch

from ...lgm.sites import BernoulliLogit, BernoulliProbit, Gaussian, Poisson, StochasticVolatility, Weighted
from ...lgm.stack import GroupStack

__all__ = [
    "LocalBound",
    "PoissonBound",
    "StochasticVolatilityBound",
    "GaussianBound",
    "LogitJensenBound",
    "LogitBohningBound",
    "LogitJaakkolaBound",
    "LogitTightBound",
    "ProbitTightBound",
    "StackedBound",
    "WeightedBound",
    "GenericBound",
    "PiecewiseQuadraticBound",
    "StochasticVolatility",
    "numerical_conjugate",
    "make_bound",
    "LOGIT_BOUNDS",
]

LOGIT_BOUNDS = ("tight", "jensen", "bohning", "jaakkola")
#: site families with a local bound (each also weighted, as ``"weighted_" + name``)
_BOUND_FAMILIES = ("poisson", "bernoulli_logit", "bernoulli_probit", "gaussian", "stochastic_volatility")


def _entropy_terms(kappa, kappa0=None):
    """``H(k) = k log k + (1-k) log(1-k)`` with its first two derivatives (``0 log 0 = 0``).

    ``kappa0 = 1 - kappa`` may be passed separately, computed without cancellation.
    """
    k0 = 1 - kappa if kappa0 is None else kappa0
    H = torch.special.xlogy(kappa, kappa) + torch.special.xlogy(k0, k0)
    return H, torch.log(kappa) - torch.log(k0), 1.0 / kappa + 1.0 / k0


def _kappas(alpha, y):
    """``(kappa, 1 - kappa)`` with ``kappa = alpha + y`` for labels ``y in {0, 1}``, both without cancellation."""
    return alpha + y, (1 - y) - alpha


class LocalBound:
    """A vectorised local variational bound over ``q`` sites (half-space conjugate form).

    Subclasses implement :meth:`f` (the primal bound), :meth:`psi` and :meth:`ell` (the conjugate,
    with derivatives), :meth:`alpha_domain` and :meth:`alpha_star` (``df/dh``, used to start the dual).
    """

    name = "base"
    #: the bound equals ``-E log p`` exactly (Poisson, SV, Gaussian)
    exact = False

    def __init__(self, family):
        self.family = family

    def __len__(self):
        return len(self.family)

    def f(self, h, rho):
        """Primal bound ``f(h, rho) >= -E_{N(h, rho)} log p(y | eta)``, shape ``(q,)``."""
        raise NotImplementedError

    def psi(self, alpha):
        """``(psi, psi', psi'')`` of the conjugate on its boundary curve, each ``(q,)``."""
        raise NotImplementedError

    def ell(self, alpha):
        """``(ell, ell', ell'')``: the largest admissible ``lambda`` as a function of ``alpha``."""
        raise NotImplementedError

    def alpha_domain(self, like):
        """Open interval ``(lo, hi)`` of admissible ``alpha`` (tensors ``(q,)``, may be infinite)."""
        raise NotImplementedError

    def alpha_star(self, h, rho):
        """``df/dh (h, rho)``: the ``alpha`` at which the dual is optimal for marginals ``(h, rho)``."""
        raise NotImplementedError

    def data_alpha(self, h, rho):
        """A second starting ``alpha`` taken from the data rather than from the prior marginals ``(h, rho)``;
        by default the prior-marginal one, :meth:`alpha_star`. :func:`~.optim.initial_alpha` starts from the
        one with the lower dual objective."""
        return self.alpha_star(h, rho)

    def conjugate(self, alpha, lam):
        """Joint-form conjugate ``f*(alpha, lambda)``: ``psi(alpha)`` where ``lambda <= ell(alpha)``, else ``+inf``.

        Khan et al. 2013, Eq. (19) in the pairing ``alpha h + lambda rho / 2`` (with ``rho >= 0``).
        """
        lo, hi = self.alpha_domain(alpha)
        inside = (alpha > lo) & (alpha < hi)
        a = torch.where(inside, alpha, 0.5 * (torch.where(torch.isfinite(lo), lo, hi - 1) +
                                              torch.where(torch.isfinite(hi), hi, lo + 1)))
        a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
        val = self.psi(a)[0]
        ok = inside & (lam <= self.ell(a)[0] * (1 + 1e-12) + 1e-300)
        return torch.where(ok, val, torch.full_like(val, math.inf))

    def exact_expected_log_prob(self, h, rho):
        """``E_{N(h, rho)} log p(y | eta)`` (closed form or Gauss-Hermite), shape ``(q,)``."""
        return self.family.expected_log_prob(h, rho)

    def fenchel_young_residual(self, alpha, h, rho):
        """Per-site ``f(h, rho) + f*(alpha, ell(alpha)) - alpha h - ell(alpha) rho / 2 >= 0``.

        The Fenchel-Young residual of one site; the duality gap is their sum
        (``docs/dual_vg.md``, § Dual decomposition).
        """
        lam = self.ell(alpha)[0]
        return self.f(h, rho) + self.psi(alpha)[0] - alpha * h - 0.5 * lam * rho

    def split(self):
        return [self]


class PoissonBound(LocalBound):
    """Poisson with exponential link (exact: ``f = -E log p``).

    ``docs/dual_vg.md``, § Fenchel conjugates of the local bounds, Poisson row.
    """

    name = "poisson"
    exact = True

    def __init__(self, family):
        super().__init__(family)
        self.y = family.params["y"]
        self.c = torch.lgamma(self.y + 1)

    def f(self, h, rho):
        return torch.exp(h + 0.5 * rho) - self.y * h + self.c

    def psi(self, alpha):
        k = alpha + self.y
        return torch.special.xlogy(k, k) - k - self.c, torch.log(k), 1.0 / k

    def ell(self, alpha):
        one = torch.ones_like(alpha)
        return alpha + self.y, one, torch.zeros_like(alpha)

    def alpha_domain(self, like):
        return -self.y.to(like), torch.full_like(like, math.inf)

    def alpha_star(self, h, rho):
        return torch.exp(h + 0.5 * rho) - self.y

    def data_alpha(self, h, rho):
        """``alpha = 1/2``: site precision ``lambda = y + 1/2``, the curvature of ``-log p`` at ``eta = log(y + 1/2)``
        (the usual start of Poisson IRLS, McCullagh & Nelder 1989, §2.5). Where the prior marginals are wide
        (``rho`` of tens), ``exp(h + rho / 2)`` starts the dual at rates of ``e^25`` and beyond."""
        return torch.full_like(h, 0.5)


class StochasticVolatilityBound(LocalBound):
    """Stochastic volatility ``N(y | 0, e^eta)`` (exact); ``alpha = 1/2 - kappa``, ``lambda <= kappa``."""

    name = "stochastic_volatility"
    exact = True

    def __init__(self, family):
        super().__init__(family)
        self.y2 = family.params["y"] ** 2

    def f(self, h, rho):
        return 0.5 * math.log(2 * math.pi) + 0.5 * h + 0.5 * self.y2 * torch.exp(-h + 0.5 * rho)

    def psi(self, alpha):
        k = 0.5 - alpha
        val = torch.special.xlogy(k, 2 * k / self.y2) - k - 0.5 * math.log(2 * math.pi)
        return val, -torch.log(2 * k / self.y2), 1.0 / k

    def ell(self, alpha):
        return 0.5 - alpha, -torch.ones_like(alpha), torch.zeros_like(alpha)

    def alpha_domain(self, like):
        return torch.full_like(like, -math.inf), torch.full_like(like, 0.5)

    def alpha_star(self, h, rho):
        return 0.5 - 0.5 * self.y2 * torch.exp(-h + 0.5 * rho)


class _QuadraticBound(LocalBound):
    """``f = a (h^2 + rho) / 2 - b h + c``; ``f* = (alpha + b)^2 / (2 a) - c`` on ``lambda <= a``."""

    def _abc(self):
        raise NotImplementedError

    def f(self, h, rho):
        a, b, c = self._abc()
        return 0.5 * a * (h * h + rho) - b * h + c

    def psi(self, alpha):
        a, b, c = self._abc()
        return (alpha + b) ** 2 / (2 * a) - c, (alpha + b) / a, (1.0 / a).expand_as(alpha)

    def ell(self, alpha):
        a, _, _ = self._abc()
        z = torch.zeros_like(alpha)
        return a.expand_as(alpha) + z, z, z

    def alpha_domain(self, like):
        return torch.full_like(like, -math.inf), torch.full_like(like, math.inf)

    def alpha_star(self, h, rho):
        a, b, _ = self._abc()
        return a * h - b


class GaussianBound(_QuadraticBound):
    """Gaussian observations ``N(y | eta, s^2)`` (exact; ``lambda = 1 / s^2`` is pinned)."""

    name = "gaussian"
    exact = True

    def __init__(self, family):
        super().__init__(family)
        y, s = family.params["y"], family.params["scale"]
        self._coef = (1.0 / s**2, y / s**2, 0.5 * y**2 / s**2 + torch.log(s) + 0.5 * math.log(2 * math.pi))

    def _abc(self):
        return self._coef


class LogitJensenBound(LocalBound):
    """Bernoulli-logit "log" (Jensen) bound ``log(1 + e^{h + rho/2}) - y h``.

    ``docs/dual_vg.md``, § Fenchel conjugates of the local bounds, ``"jensen"`` row.

    The bound of the paper's Table 2 as reimplemented elsewhere: fastest, but loose, and its
    ``lambda = sigmoid(m + v/2)`` overstates the site precisions.
    """

    name = "jensen"

    def __init__(self, family):
        super().__init__(family)
        self.y = family.params["y"]

    def f(self, h, rho):
        return torch.nn.functional.softplus(h + 0.5 * rho) - self.y * h

    def psi(self, alpha):
        return _entropy_terms(*_kappas(alpha, self.y))

    def ell(self, alpha):
        return alpha + self.y, torch.ones_like(alpha), torch.zeros_like(alpha)

    def alpha_domain(self, like):
        return -self.y.to(like), 1 - self.y.to(like)

    def alpha_star(self, h, rho):
        return torch.sigmoid(h + 0.5 * rho) - self.y


class LogitBohningBound(LocalBound):
    """Böhning's bound with its centre optimised: ``log(1 + e^h) + rho / 8 - y h`` (``lambda = 1/4`` pinned)."""

    name = "bohning"

    def __init__(self, family):
        super().__init__(family)
        self.y = family.params["y"]

    def f(self, h, rho):
        return torch.nn.functional.softplus(h) + rho / 8 - self.y * h

    def psi(self, alpha):
        return _entropy_terms(*_kappas(alpha, self.y))

    def ell(self, alpha):
        z = torch.zeros_like(alpha)
        return z + 0.25, z, z

    def alpha_domain(self, like):
        return -self.y.to(like), 1 - self.y.to(like)

    def alpha_star(self, h, rho):
        return torch.sigmoid(h) - self.y


class LogitJaakkolaBound(_QuadraticBound):
    r"""Jaakkola-Jordan bound with fixed ``xi``: ``lambda_xi (h^2 + rho - xi^2) + (h - xi)/2 + log(1 + e^xi) - y h``.

    ``lambda_xi = tanh(xi/2) / (4 xi)``. With ``xi`` optimised the bound is not jointly convex
    (``docs/dual_vg.md``, § Primal variational-Gaussian problem), so ``xi`` stays fixed;
    ``xi=None`` sets ``xi_n = sqrt(h_n^2 + rho_n)`` at the prior marginals once (:meth:`set_xi`).
    """

    name = "jaakkola"

    def __init__(self, family, xi=None):
        super().__init__(family)
        self.y = family.params["y"]
        self.xi = None
        if xi is not None:
            self.set_xi(torch.as_tensor(xi, dtype=self.y.dtype, device=self.y.device).expand_as(self.y))

    def set_xi(self, xi):
        xi = xi.abs().clamp_min(1e-6)
        self.xi = xi
        lam_xi = torch.tanh(0.5 * xi) / (4 * xi)
        self._coef = (2 * lam_xi, self.y - 0.5,
                      -lam_xi * xi**2 - 0.5 * xi + torch.nn.functional.softplus(xi))

    def _abc(self):
        if self.xi is None:
            raise RuntimeError("jaakkola bound: xi is not set (call set_xi or pass xi=...)")
        return self._coef


def _tight_kappa(h, rho, iters=200):
    """``kappa*(h, rho) = argmax_k k h + k (1 - k) rho / 2 - H(k)`` by safeguarded Newton in ``z = logit(k)``.

    Root of the decreasing ``F(z) = h + rho (1 - 2 sigmoid(z)) / 2 - z``, bracketed by
    ``[h - rho/2, h + rho/2]``. A Newton step that leaves the bracket, or that is not at most half the
    step before it, is replaced by bisection (as in Numerical Recipes' ``rtsafe``): for large ``rho``
    plain Newton can cycle between the ends of the bracket.
    """
    lo, hi = h - 0.5 * rho, h + 0.5 * rho
    z = h.clone()
    prev = (hi - lo).abs()
    for _ in range(iters):
        s = torch.sigmoid(z)
        F = h + 0.5 * rho * (1 - 2 * s) - z
        lo = torch.where(F > 0, z, lo)
        hi = torch.where(F <= 0, z, hi)
        step = F / (rho * s * (1 - s) + 1)
        zn = z + step
        bad = (zn < lo) | (zn > hi) | (2 * step.abs() > prev)
        zn = torch.where(bad, 0.5 * (lo + hi), zn)
        zn = torch.where(F == 0, z, zn)
        change = (zn - z).abs()
        prev = torch.where(bad, 0.5 * (hi - lo).abs(), step.abs())
        z = zn
        if bool(((change <= 1e-15 * (1 + z.abs())) | ((hi - lo).abs() <= 1e-15 * (1 + z.abs()))).all()):
            break
    return torch.sigmoid(z), z


class LogitTightBound(LocalBound):
    r"""Default Bernoulli-logit bound: ``f(h, rho) = sup_k [k h + k (1 - k) rho / 2 - H(k)] - y h``.

    The conjugate is ``H(kappa)`` on ``{lambda <= kappa (1 - kappa)}``, ``kappa = alpha + y``: the
    site precision at the optimum, ``kappa (1 - kappa)``, is that of the tangent logistic at the
    optimal ``kappa``, exactly like the exact VG fixed point ``lambda = E[sigmoid']`` to second order.
    Convex (a supremum of affine functions), valid (see the module docstring) and tighter than
    the Jensen and Böhning bounds. ``f`` is evaluated by a 1-D safeguarded Newton solve.
    """

    name = "tight"

    def __init__(self, family):
        super().__init__(family)
        self.y = family.params["y"]

    def f(self, h, rho):
        # kappa* is detached: by the envelope theorem the first derivatives of f stay exact under autograd
        k, z = _tight_kappa(h.detach(), rho.detach())
        H = _entropy_terms(k)[0]
        return k * h + 0.5 * k * (1 - k) * rho - H - self.y * h

    def psi(self, alpha):
        return _entropy_terms(*_kappas(alpha, self.y))

    def ell(self, alpha):
        k1, k0 = _kappas(alpha, self.y)
        return k1 * k0, k0 - k1, torch.full_like(alpha, -2.0)

    def alpha_domain(self, like):
        return -self.y.to(like), 1 - self.y.to(like)

    def alpha_star(self, h, rho):
        return _tight_kappa(h, rho)[0] - self.y


# ----------------------------------------------------------------------------- probit
#: below ``x = -_CF_SWITCH`` the probit curvature comes from Laplace's continued fraction
_CF_SWITCH = 3.0
_CF_TERMS = 64
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _mills(x):
    """``r(x) = phi(x) / Phi(x)`` without under- or overflow (``erfcx`` for ``x < 0``, ``log_ndtr`` above)."""
    neg = x < 0
    xn = torch.where(neg, x, torch.zeros_like(x))
    xp = torch.where(neg, torch.zeros_like(x), x)
    r_neg = math.sqrt(2 / math.pi) / torch.special.erfcx(-xn / math.sqrt(2))
    r_pos = torch.exp(-0.5 * xp * xp - _LOG_SQRT_2PI - torch.special.log_ndtr(xp))
    return torch.where(neg, r_neg, r_pos)


def _mills_cf(u):
    """Laplace's continued fraction at ``u >= _CF_SWITCH``: ``c = r(-u) - u = 1/(u + 2/(u + 3/(u + ...)))`` and
    ``d = 2/(u + 3/(u + ...))`` (so ``c = 1/(u + d)``), each with its first two derivatives in ``u``.

    64 terms give full double precision for ``u >= 3``; no term cancels.
    """
    T, T1, T2 = u.clone(), torch.ones_like(u), torch.zeros_like(u)
    d = d1 = d2 = None
    for k in range(_CF_TERMS - 1, 0, -1):
        n = k + 1
        iT = 1.0 / T
        if k == 1:  # T is T_2 here
            d, d1, d2 = 2 * iT, -2 * T1 * iT * iT, -2 * T2 * iT * iT + 4 * T1 * T1 * iT ** 3
        T, T1, T2 = u + n * iT, 1 - n * T1 * iT * iT, -n * (T2 * iT * iT - 2 * T1 * T1 * iT ** 3)
    iT = 1.0 / T
    return iT, -T1 * iT * iT, -T2 * iT * iT + 2 * T1 * T1 * iT ** 3, d, d1, d2


def probit_curvature(x):
    r"""Curvature of ``phi(x) = -log Phi(x)`` and its log-derivatives, without cancellation.

    Returns ``(r, c, G, w, a, L2)`` with ``r = phi(x)/Phi(x) = -phi'(x)``, ``c = x + r``,
    ``G = phi''(x) = r c`` (in ``(0, 1)``; ``1 - G`` is the variance of ``Z ~ N(0, 1)`` given ``Z < x``),
    ``w = 1 - G``, ``a = (log G)'`` and ``L2 = (log G)''``. For ``x >= -3`` these come from ``r`` directly
    (``a = -c + w / c``, ``L2 = -w - G a / c - (w / c)^2``); below, where ``x + r`` and ``1 - G`` cancel,
    from Laplace's continued fraction for the Mills ratio and its derivatives
    (``c = 1/(u + d)``, ``w = c (d - c)``, ``u = -x``).
    """
    far = x < -_CF_SWITCH
    xa = torch.where(far, torch.full_like(x, -_CF_SWITCH), x)
    r = _mills(xa)
    c = xa + r
    G = r * c
    w = 1 - G
    a = -c + w / c
    L2 = -w - G * a / c - (w / c) ** 2
    if not bool(far.any()):
        return r, c, G, w, a, L2
    u = torch.where(far, -x, torch.full_like(x, 2 * _CF_SWITCH))
    cb, cb1, cb2, db, db1, db2 = _mills_cf(u)
    wb = cb * (db - cb)
    wb1 = cb1 * db + cb * db1 - 2 * cb * cb1
    wb2 = cb2 * db + 2 * cb1 * db1 + cb * db2 - 2 * cb1 * cb1 - 2 * cb * cb2
    Gb = 1 - wb
    ab = wb1 / Gb  # d/dx = -d/du, and dG/du = -dw/du
    L2b = -(wb2 * Gb + wb1 * wb1) / (Gb * Gb)

    def pick(near_value, far_value):
        return torch.where(far, far_value, near_value)

    return pick(r, u + cb), pick(c, cb), pick(G, Gb), pick(w, wb), pick(a, ab), pick(L2, L2b)


def mills_inverse(s, iters=100):
    """The ``x`` with ``phi(x) / Phi(x) = s`` (``s > 0``), elementwise.

    ``log r`` is concave and decreasing, so Newton's method from the right end of the bracket
    ``r(x) <= 2 phi(x)`` converges monotonically; for ``s > r(-3)`` Newton on ``u + c(u) = s``
    (``x = -u``, continued fraction) instead.
    """
    s_switch = float(_mills(torch.tensor(-_CF_SWITCH, dtype=torch.float64)))
    far = s > s_switch
    ls = torch.log(torch.where(far, torch.ones_like(s), s))
    x = torch.sqrt((-2 * (ls + _LOG_SQRT_2PI - math.log(2))).clamp_min(0))
    x = torch.where(far, torch.zeros_like(s), x)
    for _ in range(iters):
        r = _mills(x)
        step = (torch.log(r) - ls) / (x + r)  # Newton step on log r(x) - log s; (log r)' = -(x + r)
        step = torch.where(far, torch.zeros_like(step), step)
        x = x + step
        if bool((step.abs() <= 1e-15 * (1 + x.abs())).all()):
            break
    if not bool(far.any()):
        return x
    u = torch.where(far, s - 1 / s, torch.full_like(s, 2 * _CF_SWITCH)).clamp_min(_CF_SWITCH)
    for _ in range(iters):
        c, c1 = _mills_cf(u)[:2]
        step = torch.where(far, (u + c - s) / (1 + c1), torch.zeros_like(u))
        u = (u - step).clamp_min(_CF_SWITCH)
        if bool((step.abs() <= 1e-15 * u).all()):
            break
    return torch.where(far, -u, x)


def _probit_tight_x(th, rho, iters=100):
    """Maximiser of the probit Hopf formula in the variable ``x``: the root of ``th + rho a(x) / 2 - x``.

    The function decreases (``a' = L2 < 0``) and its root lies in ``[th + rho a(th) / 2, th]``
    (``a < 0`` and decreasing); safeguarded Newton on that bracket.
    """
    lo = th + 0.5 * rho * probit_curvature(th)[4]
    hi = th.clone()
    x = hi.clone()
    for _ in range(iters):
        _, _, _, _, a, L2 = probit_curvature(x)
        F = th + 0.5 * rho * a - x
        lo = torch.where(F > 0, x, lo)
        hi = torch.where(F <= 0, x, hi)
        xn = x + F / (1 - 0.5 * rho * L2)
        xn = torch.where((xn < lo) | (xn > hi), 0.5 * (lo + hi), xn)
        xn = torch.where(F == 0, x, xn)
        done = (xn - x).abs() <= 1e-15 * (1 + x.abs())
        x = xn
        if bool(done.all()):
            break
    return x


class ProbitTightBound(LocalBound):
    r"""Bernoulli-probit bound ``f(h, rho) = sup_p [p c h + G(p) rho / 2 - psi(p)]`` (``c = 2 y - 1``).

    ``psi(p) = sup_x [p x + log Phi(x)]`` is the conjugate of ``-log Phi`` (slopes ``p = -r(x) < 0``,
    ``r = phi/Phi``) and ``G(p) = 1 / psi''(p) = r (x + r)`` is the curvature of ``-log Phi`` at the
    point of slope ``p``. ``G`` is concave, so ``F(h, rho) = E_{N(h, rho)}[-log Phi(c eta)]``, which solves
    ``F_rho = F_hh / 2`` with ``F_hh = E[G(slope)] <= G(E[slope]) = G(F_h)``, is a subsolution of
    ``U_rho = G(U_h) / 2``; ``f`` is that equation's Hopf-formula solution from ``U(., 0) = -log Phi(c .)``,
    so ``f >= F`` (the argument of the tight logit bound, module docstring). ``f`` is convex (a
    supremum of affine functions; its Hessian is ``G / (1 - rho L2 / 2) v v^T`` with
    ``v = (c, a / 2)``), exact at ``rho = 0`` and to first order in ``rho``, and below the Böhning-type
    bound ``-log Phi(c h) + rho / 2`` (``G < 1``). ``docs/dual_vg.md``, § The probit bound.

    Conjugate: ``f*(alpha, lambda) = psi(c alpha)`` on ``{lambda <= G(c alpha)}``; in terms of the root
    ``x`` of ``r(x) = s = -c alpha > 0``: ``psi = -s x + log Phi(x)``, ``psi' = c x``, ``psi'' = 1 / G``,
    ``ell = G``, ``ell' = c a``, ``ell'' = L2 / G`` (:func:`probit_curvature`). The ``alpha`` domain is
    ``(-inf, 0)`` for ``y = 1`` and ``(0, inf)`` for ``y = 0``; ``psi' = c x`` diverges at ``alpha = 0``.
    """

    name = "probit"

    def __init__(self, family):
        super().__init__(family)
        self.y = family.params["y"]
        self.c = 2 * self.y - 1
        self._last = None

    def _x_of_alpha(self, alpha):
        """Root ``x`` of ``r(x) = -c alpha``; the last one is reused (``psi`` and ``ell`` see the same ``alpha``)."""
        last = self._last
        if last is not None and last[0] is alpha and last[1] == alpha._version:
            return last[2]
        x = mills_inverse(-self.c * alpha)
        self._last = (alpha, alpha._version, x)
        return x

    def f(self, h, rho):
        # the maximiser is detached: the value is formed without cancellation, and the linear terms
        # (zero in value) give the exact first derivatives (alpha*, G*/2) under autograd (envelope theorem)
        hd, rd = h.detach(), rho.detach()
        x = _probit_tight_x(self.c * hd, rd)
        r, c, G, w, _, _ = probit_curvature(x)
        value = 0.5 * rd * r * w / c - torch.special.log_ndtr(x)
        return value + (-self.c * r) * (h - hd) + 0.5 * G * (rho - rd)

    def psi(self, alpha):
        s = -self.c * alpha
        x = self._x_of_alpha(alpha)
        G = probit_curvature(x)[2]
        return -s * x + torch.special.log_ndtr(x), self.c * x, 1.0 / G

    def ell(self, alpha):
        x = self._x_of_alpha(alpha)
        _, _, G, _, a, L2 = probit_curvature(x)
        return G, self.c * a, L2 / G

    def alpha_domain(self, like):
        pos = self.y.to(like) == 1
        inf = torch.full_like(like, math.inf)
        zero = torch.zeros_like(like)
        return torch.where(pos, -inf, zero), torch.where(pos, zero, inf)

    def alpha_star(self, h, rho):
        x = _probit_tight_x(self.c * h, rho)
        return -self.c * _mills(x)


class StackedBound(LocalBound):
    """Several bounds (one per site group) acting on consecutive slices of ``alpha``."""

    name = "stacked"

    def __init__(self, bounds):
        self._stack = GroupStack(bounds)
        self.bounds = self._stack.groups
        self.sizes = self._stack.sizes
        self.exact = all(b.exact for b in self.bounds)

    def __len__(self):
        return self._stack.total

    def _map(self, method, *args):
        return self._stack.map(method, *args)

    def f(self, h, rho):
        return self._map("f", h, rho)

    def psi(self, alpha):
        return self._map("psi", alpha)

    def ell(self, alpha):
        return self._map("ell", alpha)

    def alpha_domain(self, like):
        return self._map("alpha_domain", like)

    def alpha_star(self, h, rho):
        return self._map("alpha_star", h, rho)

    def data_alpha(self, h, rho):
        return self._map("data_alpha", h, rho)

    def conjugate(self, alpha, lam):
        return self._map("conjugate", alpha, lam)

    def exact_expected_log_prob(self, h, rho):
        return self._map("exact_expected_log_prob", h, rho)

    def split(self):
        return self.bounds


# ----------------------------------------------------------------------------- weighted sites
class WeightedBound(LocalBound):
    r"""The local bound of tempered sites ``p(y_n | eta)^{w_n}``: ``w_n f_n(h, rho)``, for any half-space bound ``f_n``.

    A site under ``poutine.scale(scale=w)`` contributes ``w log p(y | eta)`` to the log joint
    (:class:`~pyro_convexvb.lgm.sites.Weighted`). If ``f >= -E log p`` is closed and jointly convex,
    so is ``w f >= -E[w log p]`` (``w > 0``), and its conjugate in the pairing ``alpha h + lambda rho / 2``
    is the scaled conjugate (Rockafellar 1970, §16)

    .. math:: (w f)^*(\alpha, \lambda) = w\, f^*(\alpha / w, \lambda / w).

    For the half-space form ``f* = psi(alpha)`` on ``{lambda <= ell(alpha)}`` this gives
    ``psi_w(alpha) = w psi(alpha / w)`` and ``ell_w(alpha) = w ell(alpha / w)`` (perspectives, so
    ``psi_w`` stays convex and ``ell_w`` concave), first derivatives ``psi'(alpha / w)`` and
    ``ell'(alpha / w)``, second derivatives ``psi''(alpha / w) / w`` and ``ell''(alpha / w) / w``, and the
    ``alpha`` domain ``(w a_lo, w a_hi)``; ``alpha_star``, the exact expectation and ``f`` scale by ``w``.
    The reduced dual of ``docs/dual_vg.md`` (§ Dual decomposition) applies unchanged. For an integer
    ``w`` the dual optimum is that of the same site repeated ``w`` times, with its ``alpha`` summed
    over the copies.

    :param LocalBound base: the bound of the unweighted sites (``len(base)`` sites).
    :param torch.Tensor weight: ``(q,)`` positive weights.
    :param family: the weighted site family (for the exact expectations; default: ``base.family``
        with the weights applied to its expectations).

    Example::

        >>> import torch
        >>> from pyro_convexvb.lgm.sites import Poisson
        >>> y = torch.tensor([3.], dtype=torch.float64)
        >>> base, w = PoissonBound(Poisson(y)), torch.tensor([2.], dtype=torch.float64)
        >>> wb = WeightedBound(base, w)
        >>> a = torch.tensor([0.7], dtype=torch.float64)
        >>> bool(torch.allclose(wb.psi(a)[0], w * base.psi(a / w)[0]))
        True
    """

    def __init__(self, base, weight, family=None):
        weight = torch.as_tensor(weight)
        if weight.dim() != 1 or weight.shape[0] != len(base):
            raise ValueError(f"weight: expected shape ({len(base)},), got {tuple(weight.shape)}")
        if not bool(torch.isfinite(weight).all()) or not bool((weight > 0).all()):
            raise ValueError("weight: site weights must be positive and finite")
        self.base = base
        self.weight = weight
        self.family = family
        self.name = "weighted_" + base.name
        self.exact = base.exact
        self._last = None

    def __len__(self):
        return len(self.base)

    def _scaled(self, alpha):
        """``alpha / w``; the same tensor for the same ``alpha`` (so a base bound's per-``alpha`` cache is hit)."""
        last = self._last
        if last is not None and last[0] is alpha and last[1] == alpha._version:
            return last[2]
        a = alpha / self.weight.to(alpha)
        self._last = (alpha, alpha._version, a)
        return a

    def f(self, h, rho):
        return self.weight * self.base.f(h, rho)

    def psi(self, alpha):
        w = self.weight.to(alpha)
        p, dp, d2p = self.base.psi(self._scaled(alpha))
        return w * p, dp, d2p / w

    def ell(self, alpha):
        w = self.weight.to(alpha)
        e, de, d2e = self.base.ell(self._scaled(alpha))
        return w * e, de, d2e / w

    def alpha_domain(self, like):
        lo, hi = self.base.alpha_domain(like)
        w = self.weight.to(like)
        return w * lo, w * hi

    def alpha_star(self, h, rho):
        return self.weight * self.base.alpha_star(h, rho)

    def data_alpha(self, h, rho):
        return self.weight * self.base.data_alpha(h, rho)

    def conjugate(self, alpha, lam):
        w = self.weight.to(alpha)
        return w * self.base.conjugate(self._scaled(alpha), lam / w)

    def exact_expected_log_prob(self, h, rho):
        if self.family is not None:
            return self.family.expected_log_prob(h, rho)
        return self.weight * self.base.exact_expected_log_prob(h, rho)

    def fenchel_young_residual(self, alpha, h, rho):
        return self.weight * self.base.fenchel_young_residual(self._scaled(alpha), h, rho)


class _WeightedJaakkolaBound(WeightedBound, LogitJaakkolaBound):
    """:class:`WeightedBound` of a Jaakkola bound; ``xi`` belongs to the base bound (the tangent point of
    ``w f`` optimal for given marginals is that of ``f``), so the prior-marginal default applies unchanged."""

    @property
    def xi(self):
        return self.base.xi

    @xi.setter
    def xi(self, value):  # LogitJaakkolaBound's attribute; kept on the base bound
        if value is not None:
            self.base.set_xi(value)

    def set_xi(self, xi):
        self.base.set_xi(xi)


# ----------------------------------------------------------------------------- generic bounds
class GenericBound:
    """A convex local bound given only by its primal ``f(h, rho)`` (a torch function, elementwise).

    Its conjugate is evaluated by :func:`numerical_conjugate` (a 2-D projected Newton
    maximisation per site; derivatives by autograd). Used by the joint ``(alpha, lambda)`` dual
    (:func:`~pyro_convexvb.infer.dual_vg.optim.minimize_joint`).

    :param callable fn: ``fn(h, rho) -> (q,)``, jointly convex, twice differentiable.
    :param family: the site family (for exact expectations).
    """

    name = "generic"
    exact = False

    def __init__(self, fn, family=None, name=None):
        self.fn = fn
        self.family = family
        if name is not None:
            self.name = name

    def __len__(self):
        return len(self.family)

    def f(self, h, rho):
        return self.fn(h, rho)

    def derivatives(self, h, rho):
        """``f, f_h, f_rho, f_hh, f_hrho, f_rhorho`` elementwise (autograd; the sites are separable)."""
        with torch.enable_grad():
            h = h.detach().requires_grad_(True)
            rho = rho.detach().requires_grad_(True)
            val = self.fn(h, rho)
            gh, gr = torch.autograd.grad(val.sum(), (h, rho), create_graph=True)
            ghh, ghr = torch.autograd.grad(gh.sum(), (h, rho), retain_graph=True, allow_unused=True)
            grr = torch.autograd.grad(gr.sum(), rho, allow_unused=True)[0]
        z = torch.zeros_like(h)
        ghh = z if ghh is None else ghh
        ghr = z if ghr is None else ghr
        grr = z if grr is None else grr
        return val.detach(), gh.detach(), gr.detach(), ghh.detach(), ghr.detach(), grr.detach()

    def conjugate(self, alpha, lam):
        return numerical_conjugate(self, alpha, lam)[0]

    def exact_expected_log_prob(self, h, rho):
        return self.family.expected_log_prob(h, rho)


def numerical_conjugate(bound, alpha, lam, h0=None, rho0=None, max_iter=100, tol=1e-12, blowup=1e8):
    r"""``f*(alpha, lambda) = sup_{h, rho >= 0} alpha h + lambda rho / 2 - f(h, rho)`` per site (Khan et al. 2013, Eq. 19).

    A vectorised 2-D projected Newton ascent on the concave inner objective (active set
    ``rho = 0`` when the ``rho``-gradient pushes out), with backtracking. By Danskin,
    ``grad f* = (h*, rho*/2)``. Where the supremum is unbounded (``h`` or ``rho`` beyond ``blowup``),
    the value is ``+inf``.

    :param bound: a :class:`GenericBound` (or anything with ``f`` and ``derivatives``).
    :param torch.Tensor alpha: ``(q,)``.
    :param torch.Tensor lam: ``(q,)``.
    :returns: ``(value (q,), h* (q,), rho* (q,), converged mask (q,))``.
    """
    h = torch.zeros_like(alpha) if h0 is None else h0.clone()
    rho = torch.full_like(alpha, 1.0) if rho0 is None else rho0.clone().clamp_min(0)

    def J(h, rho):
        return alpha * h + 0.5 * lam * rho - bound.f(h, rho)

    cur = J(h, rho)
    done = torch.zeros_like(alpha, dtype=torch.bool)
    for _ in range(max_iter):
        _, fh, fr, fhh, fhr, frr = bound.derivatives(h, rho)
        gh, gr = alpha - fh, 0.5 * lam - fr  # ascent gradient
        active = (rho <= 0) & (gr <= 0)
        # Newton direction on -J (Hessian of f, PSD); solve the 2x2 system, or 1-D on the active set
        det = fhh * frr - fhr**2
        det_ok = det > 1e-300
        dh2 = torch.where(det_ok, (frr * gh - fhr * gr) / torch.where(det_ok, det, torch.ones_like(det)), gh)
        dr2 = torch.where(det_ok, (fhh * gr - fhr * gh) / torch.where(det_ok, det, torch.ones_like(det)), gr)
        dh1 = gh / fhh.clamp_min(1e-300)
        dh = torch.where(active, dh1, dh2)
        dr = torch.where(active, torch.zeros_like(dr2), dr2)
        dec = gh * dh + gr * dr
        done = done | (dec.abs() <= tol * (1 + cur.abs()))
        if bool(done.all()):
            break
        t = torch.ones_like(alpha)
        for _ls in range(60):
            hn = h + t * dh
            rn = (rho + t * dr).clamp_min(0)
            new = J(hn, rn)
            ok = ((new >= cur) & torch.isfinite(new)) | done  # ascent on the concave inner objective
            if bool(ok.all()):
                break
            t = torch.where(ok, t, 0.5 * t)
        upd = ~done & torch.isfinite(new) & (new >= cur - 1e-14 * (1 + cur.abs()))
        h = torch.where(upd, hn, h)
        rho = torch.where(upd, rn, rho)
        cur = torch.where(upd, new, cur)
        if bool(((h.abs() > blowup) | (rho > blowup)).all()):
            break
    unbounded = (h.abs() > blowup) | (rho > blowup)
    val = torch.where(unbounded, torch.full_like(cur, math.inf), cur)
    return val, h, rho, done & ~unbounded


# ----------------------------------------------------------------------------- piecewise bound
def _truncated_moments(h, rho, a, b):
    """``E[eta^k 1{a < eta < b}]`` for ``k = 0, 1, 2`` under ``N(h, rho)`` (a, b may be infinite)."""
    s = rho.clamp_min(1e-300).sqrt()

    def parts(t):
        z = (t - h) / s
        fin = torch.isfinite(z)
        zz = torch.where(fin, z, torch.zeros_like(z))
        phi = torch.where(fin, torch.exp(-0.5 * zz * zz) / math.sqrt(2 * math.pi), torch.zeros_like(z))
        Phi = torch.special.ndtr(z)
        return zz, phi, Phi

    za, pa, Pa = parts(a)
    zb, pb, Pb = parts(b)
    m0 = Pb - Pa
    m1 = h * m0 - s * (pb - pa)
    # E[(eta-h)^2 1] = s^2 (m0 - (zb pb - za pa))
    c2 = rho * (m0 - (zb * pb - za * pa))
    m2 = c2 + 2 * h * m1 - h * h * m0
    return m0, m1, m2


class PiecewiseQuadraticBound(GenericBound):
    r"""A piecewise-quadratic upper bound on ``log(1 + e^x)`` after Marlin, Khan & Murphy (2011).

    On the interval ``[t_{r-1}, t_r)`` the bound is the Jaakkola-Jordan quadratic tangent at
    ``xi_r`` (each piece a global upper bound, so the piecewise function is one too);
    ``f(h, rho) = E_{N(h, rho)}[q(eta)] - y h`` in closed form by truncated-Gaussian moments.

    **Not jointly convex in (h, rho).** With ``F = E q``, the heat equation ``F_rho = F_hh / 2``
    makes the Hessian ``[[F_hh, F_hhh/2], [F_hhh/2, F_hhhh/4]]``, positive semidefinite iff ``F_hh``
    is log-convex in ``h``; a jump of ``q''`` at a breakpoint makes ``F_hhh^2 > F_hh F_hhhh`` there
    for small ``rho``. It is therefore not used by default (``docs/dual_vg.md`` shows the check).

    :param family: :class:`~pyro_convexvb.lgm.sites.BernoulliLogit`.
    :param breakpoints: interior breakpoints ``t_1 < ... < t_{R-1}``.
    :param xis: tangent points, one per piece.
    """

    name = "piecewise"

    def __init__(self, family, breakpoints=(-4.0, -1.5, 1.5, 4.0), xis=(6.0, 2.5, 0.75, 2.5, 6.0)):
        super().__init__(self._value, family)
        if len(xis) != len(breakpoints) + 1:
            raise ValueError("xis: one tangent point per piece (len(breakpoints) + 1)")
        self.y = family.params["y"]
        self.breakpoints = [-math.inf] + [float(t) for t in breakpoints] + [math.inf]
        self.coefs = []
        for xi in xis:
            xi = abs(float(xi))
            lx = math.tanh(xi / 2) / (4 * xi)
            self.coefs.append((lx, 0.5, -lx * xi * xi - xi / 2 + math.log1p(math.exp(xi))))  # a2 x^2 + a1 x + a0

    def q(self, x):
        """The piecewise quadratic ``q(x) >= log(1 + e^x)``."""
        out = torch.zeros_like(x)
        for (a2, a1, a0), lo, hi in zip(self.coefs, self.breakpoints[:-1], self.breakpoints[1:]):
            m = (x >= lo) & (x < hi)
            out = torch.where(m, a2 * x * x + a1 * x + a0, out)
        return out

    def _value(self, h, rho):
        tot = torch.zeros_like(h)
        for (a2, a1, a0), lo, hi in zip(self.coefs, self.breakpoints[:-1], self.breakpoints[1:]):
            m0, m1, m2 = _truncated_moments(h, rho, torch.full_like(h, lo), torch.full_like(h, hi))
            tot = tot + a2 * m2 + a1 * m1 + a0 * m0
        return tot - self.y * h


# ----------------------------------------------------------------------------- factory
def make_bound(family, bound="tight", xi=None):
    """The local bound of a site family.

    :param family: a :class:`~pyro_convexvb.lgm.sites.SiteFamily` (Poisson, Gaussian,
        Bernoulli-logit, Bernoulli-probit, :class:`StochasticVolatility`). A
        :class:`~pyro_convexvb.lgm.sites.Weighted` family of one of these (tempered sites
        ``p(y | eta)^w``, e.g. under ``poutine.scale``) gets the :class:`WeightedBound` of its base
        family's bound.
    :param str bound: for Bernoulli-logit sites one of ``"tight"`` (default), ``"jensen"``,
        ``"bohning"``, ``"jaakkola"``; ignored for the exact families. Bernoulli-probit sites always
        get :class:`ProbitTightBound` (the other logit bounds have no probit counterpart here).
    :param xi: fixed ``xi`` of the Jaakkola bound (``None``: from the prior marginals).
    :raises ValueError: for a family without a convex local bound (the message names it).

    Example::

        >>> import torch
        >>> from pyro_convexvb.lgm.sites import BernoulliLogit, Weighted
        >>> b = make_bound(BernoulliLogit(torch.tensor([0., 1.], dtype=torch.float64)))
        >>> b.name
        'tight'
        >>> make_bound(Weighted(BernoulliLogit(torch.tensor([1.], dtype=torch.float64)),
        ...                     torch.tensor([0.5], dtype=torch.float64))).name
        'weighted_tight'
    """
    if isinstance(family, Weighted):
        try:
            base = make_bound(family.base, bound, xi)
        except ValueError as e:
            if "no convex local variational bound" not in str(e):
                raise
            raise ValueError(f"dual_vg has no convex local variational bound for site family '{family.name}' "
                             f"(sites weighted by poutine.scale take the local bound of their base family, scaled "
                             f"by the weight, and '{family.base.name}' has none; supported: "
                             f"{', '.join(_BOUND_FAMILIES)})") from None
        cls = _WeightedJaakkolaBound if isinstance(base, LogitJaakkolaBound) else WeightedBound
        return cls(base, family.weight, family)
    if isinstance(family, Poisson):
        return PoissonBound(family)
    if isinstance(family, StochasticVolatility):
        return StochasticVolatilityBound(family)
    if isinstance(family, Gaussian):
        return GaussianBound(family)
    if isinstance(family, BernoulliLogit):
        y = family.params["y"]
        if not bool(((y == 0) | (y == 1)).all()):
            raise ValueError("y: Bernoulli-logit labels must be in {0, 1}")
        if bound == "tight":
            return LogitTightBound(family)
        if bound == "jensen":
            return LogitJensenBound(family)
        if bound == "bohning":
            return LogitBohningBound(family)
        if bound == "jaakkola":
            return LogitJaakkolaBound(family, xi)
        raise ValueError(f"bound: unknown Bernoulli-logit bound {bound!r}; choose one of {LOGIT_BOUNDS}")
    if isinstance(family, BernoulliProbit):
        y = family.params["y"]
        if not bool(((y == 0) | (y == 1)).all()):
            raise ValueError("y: Bernoulli-probit labels must be in {0, 1}")
        if bound not in LOGIT_BOUNDS:
            raise ValueError(f"bound: unknown local bound {bound!r}; choose one of {LOGIT_BOUNDS}")
        return ProbitTightBound(family)
    raise ValueError(f"dual_vg has no convex local variational bound for site family '{family.name}' "
                     f"(supported: {', '.join(_BOUND_FAMILIES)})")
