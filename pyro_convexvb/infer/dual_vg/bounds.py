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

Each site family owns its bound (:meth:`~pyro_convexvb.lgm.families.SiteFamily.local_bound`, in its module of
:mod:`pyro_convexvb.lgm.families`); the table of ``f``, ``ell`` and ``psi`` for every family is in
``docs/dual_vg.md``, § Fenchel conjugates of the local bounds.

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

import torch

from ...lgm.families import StochasticVolatility
from ...lgm.families.bound import LocalBound, WeightedBound, _entropy_terms  # noqa: F401  (re-exported)
from ...lgm.families.gaussian import GaussianBound
from ...lgm.families.logit import (LOGIT_BOUNDS, LogitBohningBound, LogitJaakkolaBound, LogitJensenBound,
                                   LogitTightBound)
from ...lgm.families.poisson import PoissonBound
from ...lgm.families.probit import ProbitTightBound, mills_inverse, probit_curvature  # noqa: F401  (re-exported)
from ...lgm.families.stochastic_volatility import StochasticVolatilityBound
from ...lgm.stack import Stacked

#: local bounds of several site groups laid end to end (a :class:`~pyro_convexvb.lgm.stack.Stacked`)
StackedBound = Stacked

__all__ = ["LocalBound", "PoissonBound", "StochasticVolatilityBound", "GaussianBound", "LogitJensenBound",
           "LogitBohningBound", "LogitJaakkolaBound", "LogitTightBound", "ProbitTightBound", "StackedBound",
           "WeightedBound", "GenericBound", "PiecewiseQuadraticBound", "StochasticVolatility", "numerical_conjugate",
           "make_bound", "LOGIT_BOUNDS"]


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
    """The local bound of a site family: ``family.local_bound(bound, xi)``.

    :param family: a :class:`~pyro_convexvb.lgm.families.SiteFamily`; a
        :class:`~pyro_convexvb.lgm.families.Weighted` one (tempered sites ``p(y | eta)^w``, e.g. under
        ``poutine.scale``) gets the :class:`WeightedBound` of its base family's bound.
    :param str bound: for Bernoulli-logit sites one of ``"tight"`` (default), ``"jensen"``,
        ``"bohning"``, ``"jaakkola"``; ignored for the exact families. Bernoulli-probit sites always
        get :class:`ProbitTightBound` (the other logit bounds have no probit counterpart here).
    :param xi: fixed ``xi`` of the Jaakkola bound (``None``: from the prior marginals).
    :raises UnsupportedModelError: (a ``ValueError``) for a family without a convex local bound, with the reason.

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
    return family.local_bound(bound, xi)
