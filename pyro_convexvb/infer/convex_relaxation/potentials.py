r"""Super-Gaussian site representations (Nickisch & Seeger 2009, §2 and appendix).

A site ``t(s)`` is *super-Gaussian* (Nickisch & Seeger 2009, §2) if, for some ``beta`` and a constant
``kappa``,

.. math::  \log t(s) = \kappa + \beta s + g(x), \qquad x = s^2 / \sigma^2,

with ``g`` convex and decreasing in ``x``.  Every potential here uses the global scale
``sigma^2 = 1`` (see :mod:`pyro_convexvb.infer.convex_relaxation.problem` for why this loses
nothing), so ``x = s^2``.  By Legendre-Fenchel duality

.. math::  g(x) = \max_{\gamma>0} \; -\frac{x}{2\gamma} - \frac{h(\gamma)}{2}, \qquad
           h(\gamma) = -\min_{x\ge 0} \big(x/\gamma + 2 g(x)\big),

so every site is bounded below by scaled Gaussians of any width ``gamma``, touching it at
``x_*(gamma)`` (Nickisch & Seeger 2009, §2, text after Eq. (3)):

.. math::  t(s) \ge \exp\big(\kappa + \beta s - s^2/(2\gamma) - h(\gamma)/2\big).

The inner loop needs ``h^*(s) = \tfrac12 \min_\gamma ((z + s^2)/\gamma + h(\gamma)) - \beta s``
and its first two derivatives (Nickisch & Seeger 2009, §2.2).  The appendix ("Implicit computation of h_i and
h_i^*") computes both by nested scalar minimisations; its own identities
``gamma^2 h'(gamma) = x_*(gamma)`` and ``1/gamma + 2 g'(x_*) = 0`` collapse the outer one:

.. math::  \gamma_* = -\frac{1}{2 g'(z + s^2)}, \qquad h^*(s) = -g(z + s^2) - \beta s,

    (h^*)'(s) = -2 s\, g'(z + s^2) - \beta, \qquad
    (h^*)''(s) = c(z + s^2) + 4 z\, g''(z + s^2),

where ``c(x) = -(2 g'(x) + 4 x g''(x)) = -\partial_s^2 g(s^2)|_{s^2 = x}`` is the curvature of the
site's even part (``>= 0`` iff the site is log-concave).  This is what the engine uses: a
vectorised closed form, no root finding inside the Newton loop.  The appendix's implicit route is
implemented too (:func:`h_implicit`, :func:`h_star_implicit`) -- it is needed for ``h(gamma)`` at an
arbitrary ``gamma`` (the objective ``phi(gamma)`` and the bound) and the tests check that both
routes agree.

Each site family owns its potential (:meth:`~pyro_convexvb.lgm.families.SiteFamily.super_gaussian`, in its
module of :mod:`pyro_convexvb.lgm.families`: Laplace, Bernoulli-logit, binomial, Student-t, weighted sites);
:class:`GenericPotential` takes any user site given ``g, g', g''``. Probit and Poisson sites are **not**
super-Gaussian (no ``beta`` makes ``log t(s) - beta s`` even): their families refuse with that reason.
"""
import torch

from ...errors import NonConvexWarning, warn
from ...lgm.families import StudentT
from ...lgm.families.laplace import LaplacePotential
from ...lgm.families.logit import LogisticPotential
from ...lgm.families.potential import SuperGaussianPotential, WeightedPotential, _t, h_implicit
from ...lgm.families.student_t import StudentTPotential
from ...lgm.stack import Stacked
from ...linalg.scalar import newton_bisect_root, expand_bracket

__all__ = ["SuperGaussianPotential", "LaplacePotential", "LogisticPotential", "StudentTPotential", "GenericPotential",
           "WeightedPotential", "PotentialStack", "StudentT", "potential_for", "h_star", "h_implicit",
           "h_star_implicit", "gaussian_lower_bound"]

#: the potentials of several site groups laid end to end (a :class:`~pyro_convexvb.lgm.stack.Stacked`)
PotentialStack = Stacked


def potential_for(family):
    """The super-Gaussian potential of a site family: ``family.super_gaussian()`` (``s = eta - potential.shift``).

    :param family: a :class:`~pyro_convexvb.lgm.families.SiteFamily`; a
        :class:`~pyro_convexvb.lgm.families.Weighted` one (a likelihood under ``poutine.scale``) gives the
        :class:`WeightedPotential` of its base family's potential.
    :raises UnsupportedModelError: for families without a super-Gaussian representation, with the reason.
    """
    pot = family.super_gaussian()
    if not isinstance(pot, SuperGaussianPotential):
        raise TypeError(f"{type(family).__name__}.super_gaussian() must return a SuperGaussianPotential")
    return pot


class GenericPotential(SuperGaussianPotential):
    r"""A user site given ``g(x)``, ``g'(x)``, ``g''(x)`` (elementwise callables on ``(q,)`` tensors).

    ``log t(s) = kappa + beta s + g(s^2)`` with ``g`` strictly convex and decreasing (``g' < 0``,
    ``g'' > 0``).  Log-concavity (``c(x) = -(2 g' + 4 x g'') >= 0``, Nickisch & Seeger 2009 Theorem 2) is checked
    on a log grid of ``x`` unless ``log_concave`` is given; a non-log-concave site warns with
    :class:`~pyro_convexvb.errors.NonConvexWarning` when the engine uses it.

    :param g: callable ``x -> g(x)``.
    :param dg: callable ``x -> g'(x)``.
    :param d2g: callable ``x -> g''(x)``.
    :param beta: ``(q,)`` tensor.
    :param kappa: ``(q,)`` tensor or number (default 0).
    :param shift: ``(q,)`` tensor or number (default 0).
    :param log_concave: ``True``/``False``, or ``None`` to check numerically.

    Example (a Laplace site written generically)::

        >>> import torch
        >>> b = torch.ones(3, dtype=torch.float64)
        >>> pot = GenericPotential(lambda x: -x.sqrt(), lambda x: -0.5 / x.sqrt(), lambda x: 0.25 * x ** -1.5,
        ...                        beta=torch.zeros(3, dtype=torch.float64), kappa=-torch.log(2 * b))
        >>> pot.log_concave
        True
    """

    name = "generic"

    def __init__(self, g, dg, d2g, beta, kappa=0.0, shift=0.0, log_concave=None):
        self._g, self._dg, self._d2g = g, dg, d2g
        super().__init__(beta, _t(kappa, beta).expand_as(beta).clone(), _t(shift, beta).expand_as(beta).clone())
        if log_concave is None:
            grid = torch.logspace(-6, 6, 121, dtype=beta.dtype, device=beta.device)
            ok = True
            for x in grid:
                xs = x.expand_as(beta)
                c = self.curv(xs)
                if bool((c < -1e-10 * (2 * self._dg(xs)).abs()).any()):
                    ok = False
                    break
            log_concave = ok
        self.log_concave = bool(log_concave)

    def g(self, x):
        return self._g(x)

    def dg(self, x):
        return self._dg(x)

    def d2g(self, x):
        return self._d2g(x)


def h_star(pot, s, z, derivatives=2):
    r"""``h^*(s)``, its derivatives and the minimising ``gamma_*`` in closed form (Nickisch & Seeger 2009, §2.2 and
    appendix): :meth:`SuperGaussianPotential.h_star <pyro_convexvb.lgm.families.potential.SuperGaussianPotential.h_star>`
    of ``pot`` (a potential or a :class:`~pyro_convexvb.lgm.stack.Stacked` of them).

    :returns: ``(h_star, d1, d2, gamma_star)`` (``None`` for derivatives not requested).
    """
    return pot.h_star(s, z, derivatives)


def h_star_implicit(pot, s, z, xtol=1e-13):
    r"""``h^*(s)`` and derivatives by the appendix's nested route (reference for :func:`h_star`).

    ``gamma_* = argmin_gamma k(x, gamma)``, ``k = (z + x)/gamma + h(gamma)``, found as the root of
    ``gamma^2 k_gamma = x_*(gamma) - (z + x)`` (bracket, then Newton/bisection; each evaluation solves
    for ``x_*(gamma)`` implicitly).  Then ``h^* = k(x, gamma_*)/2 - beta s``,
    ``(h^*)' = s/gamma_* - beta``, ``(h^*)'' = gamma_*^{-1} (1 - 2 x/(gamma_*^3 k_{gamma gamma}))`` with
    ``gamma^3 k_{gamma gamma} = 2 (z + x) + gamma^3 h''(gamma)``.

    :returns: ``(h_star, d1, d2, gamma_star)``.
    """
    x = s * s
    target = z + x

    def fun_full(gam):
        # d/dgamma x_*(gamma) = d/dgamma (gamma^2 h') = 2 gamma h' + gamma^2 h''
        _, dh, d2h, xs = h_implicit(pot, gam)
        return xs - target, gam**2 * d2h + 2 * gam * dh

    g0 = pot.gamma0()
    start = torch.where(g0 > 0, 2 * g0, torch.ones_like(g0))
    lo, hi = expand_bracket(lambda gam: fun_full(gam)[0], start, lower=0.0, max_iter=200)
    gam, ok = newton_bisect_root(fun_full, lo, hi, xtol=xtol, max_iter=300, check_bracket=False)
    h, dh, d2h, _ = h_implicit(pot, gam)
    k = target / gam + h
    value = 0.5 * k - pot.beta * s
    d1 = s / gam - pot.beta
    g3k = 2 * target + gam**3 * d2h
    d2 = (1 - 2 * x / g3k) / gam
    return value, d1, d2, gam


def gaussian_lower_bound(pot, s, gamma):
    r"""``log`` of the Gaussian lower bound ``kappa + beta s - s^2/(2 gamma) - h(gamma)/2 <= log t(s)`` (Nickisch & Seeger 2009, §2)."""
    return pot.kappa + pot.beta * s - s * s / (2 * gamma) - 0.5 * pot.h(gamma)


def warn_if_not_log_concave(stack):
    """Issue :class:`NonConvexWarning` for every potential that is not log-concave (Nickisch & Seeger 2009, Theorem 2)."""
    for p in stack.split():
        if not p.log_concave:
            warn(f"site potential '{p.name}' is not log-concave: h(gamma) is not convex (Nickisch & Seeger 2009, "
                 "Theorem 2), so the relaxation is not a convex problem; the double loop still decreases phi but may "
                 "stop at a local optimum", NonConvexWarning)
