"""Bernoulli-probit sites: the family and its tight local bound (not super-Gaussian)."""
import math

import pyro.distributions as dist
import torch

from .base import SiteFamily, gaussian_expectation, normal_panels
from ..linear import normal_cdf_argument
from .bound import LocalBound
from .logit import LOGIT_BOUNDS, check_labels

__all__ = ["BernoulliProbit", "ProbitTightBound", "probit_curvature", "mills_inverse"]


class BernoulliProbit(SiteFamily):
    """``t_i(eta) = Phi(eta)^{y_i} Phi(-eta)^{1 - y_i}``, ``y_i in {0, 1}``.

    ``log_prob`` is ``log_ndtr(c eta)`` with ``c = 2 y - 1``, accurate in both tails.
    ``expected_log_prob(mean, var)`` is ``E_{N(eta | mean, var)} log Phi(c eta)``: Gauss-Hermite with
    ``num_points`` nodes where ``var <= 1`` (the integrand varies on the scale of the spread there),
    and otherwise a composite Gauss-Legendre rule in the standardised variable ``e = (eta - mean) / sd``
    on ``|e| <= 12``, with unit panels and panels graded geometrically (ratio 2.5) away from the point
    ``c eta = 0`` where ``log Phi`` turns from quadratic to flat; 12 nodes per panel. With the default
    ``num_points`` both agree with adaptive 20-digit quadrature to about 1e-15 relative for
    ``|mean| <= 40``, ``var <= 1e6`` (``tests/test_probit.py``; 64-point Gauss-Hermite alone is off by
    3e-3 nats at ``var = 100``). The panel ends are held fixed under autograd, so gradients are those
    of the same rule applied to the derivative.

    :param torch.Tensor y: ``(q,)`` labels in {0, 1}.

    Example::

        >>> import torch
        >>> fam = BernoulliProbit(torch.tensor([1.], dtype=torch.float64))
        >>> m, v = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
        >>> round(float(fam.expected_log_prob(m, v)), 12)  # E log Phi(eta), eta ~ N(0, 1), is exactly -1
        -1.0
    """

    name = "bernoulli_probit"
    distributions = (dist.Bernoulli, torch.distributions.Bernoulli)
    no_potential = ("probit sites are not super-Gaussian: log Phi(s) - log Phi(-s) grows like s^2/2, so no beta makes "
                    "log t(s) - beta s even (Nickisch & Seeger 2009, §2); a logit link (Bernoulli(logits=...)) is "
                    "super-Gaussian")
    _PANEL_NODES = 12
    _HALF_WIDTH = 12.0
    _GRADING = 2.5
    _CHUNK = 2048

    def __init__(self, y):
        super().__init__(y=y)

    def log_prob(self, eta):
        c = 2 * self.params["y"] - 1
        return torch.special.log_ndtr(c * eta)

    def expected_log_prob(self, mean, var, num_points=64):
        c = 2 * self.params["y"] - 1
        m = c * mean
        sd = var.clamp_min(0).sqrt()
        out = gaussian_expectation(torch.special.log_ndtr, m, var.clamp_min(0), num_points)
        wide = torch.nonzero(sd.detach() > 1.0).reshape(-1)
        if wide.numel() == 0:
            return out
        parts = [self._composite(m[idx], sd[idx]) for idx in wide.split(self._CHUNK)]
        return out.index_put((wide,), torch.cat(parts))

    def expected_log_prob_terms(self, mean, var, num_points=32):
        """``E log Phi`` and its derivatives in ``mean`` and ``var``: those of :meth:`expected_log_prob`'s own value
        (its composite rule at site sds above 1), by autograd, so that ``refine`` meets the maximum of the bound it
        reports (quadratures of ``d log Phi`` parted from it by 1e-2 at site variances of 30 and more)."""
        m = mean.detach().requires_grad_(True)
        v = var.detach().requires_grad_(True)
        with torch.enable_grad():
            value = self.expected_log_prob(m, v, max(num_points, 64))
            d_mean, d_var = torch.autograd.grad(value.sum(), [m, v])
        return value.detach(), d_mean, d_var

    @classmethod
    def _composite(cls, m, sd):
        """``E log Phi(m + sd e)``, ``e ~ N(0, 1)``, by the graded composite Gauss-Legendre rule (``sd > 0``)."""
        dtype, device = m.dtype, m.device
        E, ratio = cls._HALF_WIDTH, cls._GRADING
        s_det = sd.detach()
        # panel ends at e0 +- 0.5 * 2.5^j / sd (e0: where c eta = 0), out to beyond |e| = 2E for the widest site
        k = max(1, math.ceil(math.log(4 * E * float(s_det.max())) / math.log(ratio)) + 1)
        grade = 0.5 * ratio ** torch.arange(k + 1, dtype=dtype, device=device)
        uniform = torch.linspace(-E, E, int(2 * E) + 1, dtype=dtype, device=device)
        e0 = (-m.detach() / s_det)[:, None]
        ends = torch.cat([uniform.expand(m.shape[0], -1), e0, e0 + grade / s_det[:, None],
                          e0 - grade / s_det[:, None]], 1).clamp(-E, E)
        e, w = normal_panels(torch.sort(ends, 1).values, cls._PANEL_NODES)
        return (w * torch.special.log_ndtr(m[:, None] + sd[:, None] * e)).sum(-1)

    def predictive_mean(self, mean, var, num_points=64):
        return torch.special.ndtr(mean / torch.sqrt(1 + var))

    def local_bound(self, kind="tight", xi=None):
        """:class:`ProbitTightBound` for every ``kind`` (the other logit bounds have no probit counterpart here)."""
        y = self.params["y"]
        if not bool(((y == 0) | (y == 1)).all()):
            raise ValueError("y: Bernoulli-probit labels must be in {0, 1}")
        if kind not in LOGIT_BOUNDS:
            raise ValueError(f"bound: unknown local bound {kind!r}; choose one of {LOGIT_BOUNDS}")
        return ProbitTightBound(self)

    @classmethod
    def predictor(cls, dist):
        """``(eta - loc) / scale`` of ``Bernoulli(probs=Normal(loc, scale).cdf(eta))`` (recorded while tracing)."""
        if not isinstance(dist, cls.distributions) or "probs" not in dist.__dict__:
            return None
        return normal_cdf_argument(dist.probs)

    @classmethod
    def from_site(cls, site, y):
        check_labels(site, y)
        return cls(y)


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
