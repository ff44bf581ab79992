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

Potentials provided:

* :class:`LaplacePotential` -- ``t(s) = exp(-|s|/b) / (2b)``: ``h(gamma) = gamma / b^2``
  (``tau^2 gamma`` with ``tau = 1/b``), ``h^*(s) = sqrt(z + s^2) / b`` (Nickisch & Seeger 2009, §2.2);
* :class:`LogisticPotential` -- Bernoulli-logit ``t(s) = sigmoid(c tau s)``, ``c = +-1``:
  ``beta = c tau / 2``, ``g(x) = -log cosh(v) - log 2``, ``v = tau sqrt(x) / 2``, with series
  expansions at ``x ~ 0``, ``gamma_0 = 1/(2C)``, ``xi_0 = 3/(2C)``, ``C = tau^2/8`` (appendix);
* :class:`StudentTPotential` -- Student-t observations; super-Gaussian but *not* log-concave
  (the relaxation is then not convex, Nickisch & Seeger 2009 Theorem 2, and a
  :class:`~pyro_convexvb.errors.NonConvexWarning` is issued);
* :class:`GenericPotential` -- any user site given ``g, g', g''`` (log-concavity is checked on a
  grid unless declared);
* :class:`WeightedPotential` -- tempered sites ``t(s)^w`` of any of these (a likelihood under
  ``poutine.scale``): ``w log t = w kappa + w beta s + w g(s^2)`` is super-Gaussian again, with
  ``h_w(gamma) = w h(w gamma)``.

Probit (``Phi(c s)``) and Poisson sites are **not** super-Gaussian: ``log Phi(s) - log Phi(-s)``
is not linear in ``s`` (its tails grow like ``s^2/2``), so no ``beta`` makes ``log t(s) - beta s``
even; :func:`potential_for` rejects them with that reason.
"""
import math

import torch

from ...errors import NonConvexWarning, UnsupportedModelError, warn
from ...lgm.sites import Gaussian, StudentT, Weighted  # noqa: F401  (StudentT re-exported: the family lives in lgm.sites)
from ...lgm.stack import GroupStack
from ...linalg.scalar import minimize_convex_scalar, newton_bisect_root, expand_bracket

__all__ = [
    "SuperGaussianPotential",
    "LaplacePotential",
    "LogisticPotential",
    "StudentTPotential",
    "GenericPotential",
    "WeightedPotential",
    "PotentialStack",
    "StudentT",
    "potential_for",
    "h_star",
    "h_implicit",
    "h_star_implicit",
    "gaussian_lower_bound",
]


def _t(x, like):
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


class SuperGaussianPotential:
    r"""Base class: ``log t(s) = kappa + beta s + g(s^2)`` for ``q`` sites (all tensors ``(q,)``).

    Symbols of Nickisch & Seeger 2009, §2 (``sigma^2 = 1``).  Subclasses implement :meth:`g`, :meth:`dg`,
    :meth:`d2g` (elementwise, ``x >= 0``) and may override :meth:`curv` for a cancellation-free
    ``-(2 g' + 4 x g'')``.

    :param beta: ``(q,)`` linear coefficients ``beta_i``.
    :param kappa: ``(q,)`` constants (normalisers of the site densities).
    :param shift: ``(q,)`` location: the site variable is ``s = eta - shift`` (e.g. Student-t
        observations ``y``); zero for sites that are super-Gaussian in ``eta`` itself.
    """

    log_concave = True
    name = "super_gaussian"

    def __init__(self, beta, kappa, shift=None):
        self.beta = beta
        self.kappa = kappa
        self.shift = torch.zeros_like(beta) if shift is None else shift

    def __len__(self):
        return int(self.beta.shape[0])

    # --- the site ---------------------------------------------------------------------------
    def g(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def dg(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def d2g(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def curv(self, x):
        """``-(2 g'(x) + 4 x g''(x))``: minus the second derivative of ``g(s^2)`` in ``s`` at ``s^2 = x``."""
        return -(2 * self.dg(x) + 4 * x * self.d2g(x))

    def log_prob(self, s):
        """``log t(s)`` with every constant (``s = eta - shift``)."""
        return self.kappa + self.beta * s + self.g(s * s)

    # --- appendix quantities -------------------------------------------------------------------
    def gamma0(self):
        r"""``gamma_0 = -1 / (2 g'(0))``: ``x_*(gamma) = 0`` iff ``gamma <= gamma_0`` (Nickisch & Seeger 2009, appendix)."""
        d0 = self.dg(torch.zeros_like(self.beta))
        return -1.0 / (2.0 * d0)

    def xi0(self):
        r"""``xi_0 = -g'(0) / g''(0)``: ``x_*(gamma) ~ xi_0 (log gamma - log gamma_0)`` just above ``gamma_0``."""
        zero = torch.zeros_like(self.beta)
        return -self.dg(zero) / self.d2g(zero)

    def x_star(self, gamma):
        """``x_*(gamma) = argmin_x x/gamma + 2 g(x)`` (implicit; closed form in subclasses when known)."""
        return h_implicit(self, gamma)[3]

    def h(self, gamma):
        """``h(gamma)`` (see :func:`h_implicit`)."""
        return h_implicit(self, gamma)[0]

    def gamma_init(self, s):
        """Starting ``gamma``: the width touching the site at ``x = 1 + s^2``."""
        return -1.0 / (2.0 * self.dg(1.0 + s * s))


class LaplacePotential(SuperGaussianPotential):
    r"""Laplace sites ``t(s) = exp(-|s|/b) / (2 b)`` (Nickisch & Seeger 2009, Eq. (2) with ``tau/sigma = 1/b``).

    ``beta = 0``, ``kappa = -log(2b)``, ``g(x) = -sqrt(x)/b``; closed forms
    ``h(gamma) = tau^2 gamma = gamma / b^2`` and ``h^*(s) = tau sqrt(z + s^2)`` (Nickisch & Seeger 2009, §2.2).

    :param scale: ``(q,)`` Laplace scales ``b > 0``.
    :param shift: ``(q,)`` location (default 0).

    Example::

        >>> import torch
        >>> pot = LaplacePotential(torch.tensor([2.0], dtype=torch.float64))
        >>> float(pot.h(torch.tensor([3.0], dtype=torch.float64)))
        0.75
    """

    name = "laplace"

    def __init__(self, scale, shift=None):
        self.scale = scale
        super().__init__(torch.zeros_like(scale), -torch.log(2 * scale), shift)

    def g(self, x):
        return -torch.sqrt(x) / self.scale

    def dg(self, x):
        return -0.5 / (self.scale * torch.sqrt(x))

    def d2g(self, x):
        return 0.25 / (self.scale * x * torch.sqrt(x))

    def curv(self, x):
        return torch.zeros_like(x)

    def x_star(self, gamma):
        return (gamma / self.scale) ** 2

    def h(self, gamma):
        return gamma / self.scale**2

    def gamma_init(self, s):
        return self.scale * torch.sqrt(self.scale**2 + s * s)


# series of tanh(v)/v and (tanh(v)/v + tanh(v)^2 - 1)/v^2 at v = 0 (exact rational coefficients)
_TANH_OVER_V = (1.0, -1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835)
_F_SERIES = (2.0 / 3, -8.0 / 15, 34.0 / 105, -496.0 / 2835, 2764.0 / 31185)
_SMALL_V = 0.05


def _poly(coefs, w):
    out = torch.full_like(w, coefs[-1])
    for c in reversed(coefs[:-1]):
        out = out * w + c
    return out


class LogisticPotential(SuperGaussianPotential):
    r"""Bernoulli (logistic) sites ``t(s) = (1 + exp(-c tau s))^{-1}``, ``c in {-1, +1}`` (Nickisch & Seeger 2009, Eq. (3)).

    Appendix of Nickisch & Seeger 2009: ``beta = c tau / 2``, ``g(x) = -log cosh(v) - log 2`` with
    ``v = tau sqrt(x) / 2``, ``g'(x) = -C tanh(v)/v``, ``g''(x) = (C/2) x^{-1} (tanh(v)/v + tanh(v)^2 - 1)``,
    ``C = tau^2/8``, ``gamma_0 = 1/(2C)``, ``xi_0 = 3/(2C)``.  For ``v < 0.05`` the ratios are
    evaluated by their Taylor series (the direct formula cancels catastrophically at ``x ~ 0``).

    :param y: ``(q,)`` labels in ``{0, 1}`` (``c = 2 y - 1``).
    :param tau: scale ``tau`` (the LGM's ``BernoulliLogit`` has ``tau = 1``).

    Example::

        >>> import torch
        >>> pot = LogisticPotential(torch.tensor([1.0, 0.0], dtype=torch.float64))
        >>> pot.gamma0(), pot.xi0()
        (tensor([4., 4.], dtype=torch.float64), tensor([12., 12.], dtype=torch.float64))
    """

    name = "bernoulli_logit"

    def __init__(self, y, tau=1.0):
        c = 2 * y - 1
        self.tau = float(tau)
        self.C = self.tau**2 / 8
        super().__init__(0.5 * self.tau * c, torch.zeros_like(y))

    def _v(self, x):
        return 0.5 * self.tau * torch.sqrt(x)

    def g(self, x):
        v = self._v(x)
        return -(v + torch.log1p(torch.exp(-2 * v)))

    def dg(self, x):
        v = self._v(x)
        small = v < _SMALL_V
        vs = torch.where(small, torch.ones_like(v), v)
        ratio = torch.where(small, _poly(_TANH_OVER_V, v * v), torch.tanh(vs) / vs)
        return -self.C * ratio

    def d2g(self, x):
        v = self._v(x)
        small = v < _SMALL_V
        vs = torch.where(small, torch.ones_like(v), v)
        th = torch.tanh(vs)
        direct = (th / vs + th * th - 1) / (vs * vs)
        f = torch.where(small, _poly(_F_SERIES, v * v), direct)
        # g'' = (C/2) x^{-1} (...) = (C tau^2 / 8) f(v) with x = 4 v^2 / tau^2
        return (self.C * self.tau**2 / 8) * f

    def curv(self, x):
        # -(d^2/ds^2) g(s^2) = (tau^2/4) sech^2(v), written without overflow
        e = torch.exp(-2 * self._v(x))
        return (self.tau**2 / 4) * 4 * e / (1 + e) ** 2

    def gamma_init(self, s):
        return -1.0 / (2.0 * self.dg(1.0 + s * s))


class StudentTPotential(SuperGaussianPotential):
    r"""Student-t observations ``t(eta) = St(y | eta, b, nu)``, super-Gaussian in ``s = eta - y``.

    ``log t = kappa + g(s^2)``, ``g(x) = -(nu+1)/2 log(1 + x/(nu b^2))``,
    ``kappa = log Gamma((nu+1)/2) - log Gamma(nu/2) - log(sqrt(nu pi) b)``.  ``g`` is convex and
    decreasing, but ``s -> log t`` is not concave (for ``s^2 > nu b^2``): by Nickisch & Seeger 2009 Theorem 2 the
    relaxation is not convex, so using it warns with :class:`~pyro_convexvb.errors.NonConvexWarning`.

    :param y: ``(q,)`` observations.
    :param df: degrees of freedom ``nu > 0`` (number or ``(q,)``).
    :param scale: ``b > 0`` (number or ``(q,)``).
    """

    name = "student_t"
    log_concave = False

    def __init__(self, y, df, scale):
        self.df = _t(df, y).expand_as(y)
        self.scale = _t(scale, y).expand_as(y)
        nu, b = self.df, self.scale
        kappa = torch.lgamma((nu + 1) / 2) - torch.lgamma(nu / 2) - 0.5 * torch.log(nu * math.pi) - torch.log(b)
        super().__init__(torch.zeros_like(y), kappa, shift=y)

    def g(self, x):
        nu, b = self.df, self.scale
        return -0.5 * (nu + 1) * torch.log1p(x / (nu * b * b))

    def dg(self, x):
        nu, b = self.df, self.scale
        return -0.5 * (nu + 1) / (nu * b * b + x)

    def d2g(self, x):
        nu, b = self.df, self.scale
        return 0.5 * (nu + 1) / (nu * b * b + x) ** 2

    def curv(self, x):
        nu, b = self.df, self.scale
        a = nu * b * b
        return (nu + 1) * (a - x) / (a + x) ** 2


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


class WeightedPotential(SuperGaussianPotential):
    r"""Tempered sites ``t(s)^w`` of a super-Gaussian potential, per-site weights ``w > 0``.

    A likelihood under ``poutine.scale(scale=w)`` contributes ``w log t(s)`` to the log joint. With
    ``log t = kappa + beta s + g(s^2)`` (Nickisch & Seeger 2009, §2),

    .. math:: w \log t(s) = w\kappa + w\beta\, s + w\, g(s^2),

    and ``w g`` is convex and decreasing whenever ``g`` is, so ``t^w`` is super-Gaussian, and
    log-concave exactly when ``t`` is. Its quantities follow from the base potential's:
    ``beta_w = w beta``, ``kappa_w = w kappa``, ``g_w = w g`` (and ``g'``, ``g''``, ``c`` times ``w``);
    ``x_*^w(gamma) = argmin_x x/gamma + 2 w g(x) = x_*(w gamma)``, hence
    ``h_w(gamma) = w h(w gamma)`` and ``gamma_0^w = gamma_0 / w``; ``xi_0`` is unchanged;
    the Gaussian lower bound of width ``gamma`` is ``w`` times the base site's of width ``w gamma``,
    so ``gamma_init`` is the base one divided by ``w`` (the bound touching at the same point).
    ``h^*`` and its derivatives come from these through :func:`h_star` unchanged
    (``h^*_w(s) = -w g(z + s^2) - w beta s``, ``gamma_* = -1 / (2 w g'(z + s^2))``).

    :param SuperGaussianPotential base: the potential of the unweighted sites.
    :param torch.Tensor weight: ``(q,)`` positive weights.

    Example::

        >>> import torch
        >>> base = LaplacePotential(torch.tensor([2.0], dtype=torch.float64))
        >>> pot = WeightedPotential(base, torch.tensor([3.0], dtype=torch.float64))
        >>> s = torch.tensor([0.7], dtype=torch.float64)
        >>> bool(torch.allclose(pot.log_prob(s), 3 * base.log_prob(s)))
        True
    """

    def __init__(self, base, weight):
        weight = _t(weight, base.beta)
        if weight.dim() != 1 or weight.shape[0] != len(base):
            raise ValueError(f"weight: expected shape ({len(base)},), got {tuple(weight.shape)}")
        if not bool(torch.isfinite(weight).all()) or not bool((weight > 0).all()):
            raise ValueError("weight: site weights must be positive and finite")
        self.base = base
        self.weight = weight
        self.name = "weighted_" + base.name
        self.log_concave = base.log_concave
        super().__init__(weight * base.beta, weight * base.kappa, base.shift)

    def g(self, x):
        return self.weight * self.base.g(x)

    def dg(self, x):
        return self.weight * self.base.dg(x)

    def d2g(self, x):
        return self.weight * self.base.d2g(x)

    def curv(self, x):
        return self.weight * self.base.curv(x)

    def gamma0(self):
        return self.base.gamma0() / self.weight

    def xi0(self):
        return self.base.xi0()

    def x_star(self, gamma):
        return self.base.x_star(self.weight * gamma)

    def h(self, gamma):
        return self.weight * self.base.h(self.weight * gamma)

    def gamma_init(self, s):
        return self.base.gamma_init(s) / self.weight


_NOT_SUPER_GAUSSIAN = {
    "bernoulli_probit": "probit sites are not super-Gaussian: log Phi(s) - log Phi(-s) grows like s^2/2, so no "
                        "beta makes log t(s) - beta s even (Nickisch & Seeger 2009, §2); a logit link "
                        "(Bernoulli(logits=...)) is super-Gaussian",
    "poisson": "Poisson sites are not super-Gaussian: y s - exp(s) has no even tilt (Nickisch & Seeger 2009, §2)",
}


def potential_for(family):
    """The super-Gaussian potential of a site family (``s = eta - potential.shift``).

    :param family: a :class:`~pyro_convexvb.lgm.sites.SiteFamily` (``BernoulliLogit``, ``Laplace``,
        ``StudentT``, or any family with a ``super_gaussian()`` method returning a
        :class:`SuperGaussianPotential`), or a :class:`~pyro_convexvb.lgm.sites.Weighted` family of one
        of these (a likelihood under ``poutine.scale``): its :class:`WeightedPotential`.
    :raises UnsupportedModelError: for families without a super-Gaussian representation, with the reason.
    """
    if isinstance(family, Weighted):
        if isinstance(family.base, Gaussian):
            raise UnsupportedModelError(family.name, "a Gaussian site weighted by poutine.scale is a Gaussian of "
                                                     "variance s^2 / w; give it as that Gaussian (lgm.sites.tempered "
                                                     "does so exactly) rather than as a weighted site")
        try:
            base = potential_for(family.base)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(family.name, f"the site is weighted by poutine.scale and {e.reason}; "
                                                     "t(s)^w is super-Gaussian exactly when t(s) is") from None
        return WeightedPotential(base, family.weight)
    if hasattr(family, "super_gaussian"):
        pot = family.super_gaussian()
        if not isinstance(pot, SuperGaussianPotential):
            raise TypeError(f"{type(family).__name__}.super_gaussian() must return a SuperGaussianPotential")
        return pot
    if family.name == "bernoulli_logit":
        return LogisticPotential(family.params["y"])
    if family.name == "laplace":
        return LaplacePotential(family.params["scale"])
    if family.name == "student_t":
        p = family.params
        return StudentTPotential(p["y"], p["df"], p["scale"])
    reason = _NOT_SUPER_GAUSSIAN.get(family.name, f"site family '{family.name}' has no super-Gaussian representation "
                                                  "(give it a super_gaussian() method returning a potential)")
    raise UnsupportedModelError(family.name, reason)


class PotentialStack:
    """Potentials of several site groups laid end to end (one slice of ``s`` per group).

    The bookkeeping is a :class:`~pyro_convexvb.lgm.stack.GroupStack`; ``beta``, ``kappa`` and
    ``shift`` are the concatenated ``(q,)`` parameters (``None`` without potentials).

    :param potentials: sequence of :class:`SuperGaussianPotential`.
    """

    def __init__(self, potentials):
        self._stack = GroupStack(potentials)
        self.potentials = self._stack.groups
        self.slices = self._stack.slices
        self.q = self._stack.total
        self.beta = self._stack.concat_attribute("beta")
        self.kappa = self._stack.concat_attribute("kappa")
        self.shift = self._stack.concat_attribute("shift")
        self.log_concave = all(p.log_concave for p in self.potentials)

    def __len__(self):
        return self.q

    def _map(self, method, *tensors):
        return self._stack.map(method, *tensors)

    def g(self, x):
        return self._map("g", x)

    def dg(self, x):
        return self._map("dg", x)

    def d2g(self, x):
        return self._map("d2g", x)

    def curv(self, x):
        return self._map("curv", x)

    def h(self, gamma):
        return self._map("h", gamma)

    def x_star(self, gamma):
        return self._map("x_star", gamma)

    def gamma_init(self, s):
        return self._map("gamma_init", s)

    def log_prob(self, s):
        return self._map("log_prob", s)

    def h_star(self, s, z, derivatives=2):
        return h_star(self, s, z, derivatives)


def h_star(pot, s, z, derivatives=2):
    r"""``h^*(s)``, its derivatives and the minimising ``gamma_*`` in closed form.

    Nickisch & Seeger 2009, §2.2 defines ``h^*(s) = (1/2) min_gamma ((z + s^2)/gamma + h(gamma)) - beta s`` and the
    appendix characterises the minimiser by ``gamma_*^2 h'(gamma_*) = x_*(gamma_*) = z + s^2``; with
    ``l_x = 0``, i.e. ``1/gamma + 2 g'(x_*) = 0``, this gives (``x = z + s^2``)

    ``gamma_* = -1/(2 g'(x))``, ``h^* = -g(x) - beta s``, ``(h^*)' = s/gamma_* - beta`` (appendix),
    ``(h^*)'' = gamma_*^{-1} (1 - 2 s^2 / (gamma_*^3 k_{gamma gamma})) = c(x) + 4 z g''(x)``.

    :param pot: a :class:`SuperGaussianPotential` or :class:`PotentialStack`.
    :param s: ``(q,)`` site variables (``eta - shift``).
    :param z: ``(q,)`` outer-loop variances, ``> 0``.
    :param derivatives: 0, 1 or 2: how many derivatives to return.
    :returns: ``(h_star, d1, d2, gamma_star)`` (``None`` for derivatives not requested).
    """
    x = z + s * s
    dg = pot.dg(x)
    value = -pot.g(x) - pot.beta * s
    d1 = d2 = None
    if derivatives >= 1:
        d1 = -2 * s * dg - pot.beta
    if derivatives >= 2:
        d2 = pot.curv(x) + 4 * z * pot.d2g(x)
    return value, d1, d2, -0.5 / dg


def h_implicit(pot, gamma, xtol=1e-14):
    r"""``h(gamma)``, ``h'(gamma)``, ``h''(gamma)`` and ``x_*(gamma)`` from ``g`` alone (Nickisch & Seeger 2009, appendix).

    ``x_* = argmin_{x >= 0} gamma l(x, gamma)``, ``l = x/gamma + 2 g(x)``: ``x_* = 0`` iff
    ``gamma <= gamma_0 = -1/(2 g'(0))`` (checked up front); otherwise the root of
    ``1 + 2 gamma g'(x)`` by bracketing and safeguarded Newton/bisection (vectorised over sites),
    started at ``xi_0 (log gamma - log gamma_0)`` and replaced by that approximation when
    ``gamma / gamma_0 - 1 < 1e-9``.  Then ``gamma h = -x_* - 2 gamma g(x_*)``,
    ``gamma^2 h' = x_*``, ``gamma^3 h'' = (2 gamma g''(x_*))^{-1} - 2 x_*`` (``h'' = 0`` where ``x_* = 0``).

    :param pot: potential (any :class:`SuperGaussianPotential`).
    :param gamma: ``(q,)`` positive widths.
    :returns: ``(h, dh, d2h, x_star)``, each ``(q,)``.
    """
    if not bool((gamma > 0).all()):
        raise ValueError("gamma: must be positive")
    gamma0 = pot.gamma0()
    above = gamma > gamma0
    x = torch.zeros_like(gamma)
    if bool(above.any()):
        ga = torch.where(above, gamma, gamma0 + 1.0)
        xi0 = pot.xi0()
        finite0 = torch.isfinite(xi0) & (gamma0 > 0)
        lg = torch.log(ga / torch.where(finite0, gamma0, torch.ones_like(gamma0)))
        near = above & finite0 & (lg < 1e-9)
        start = torch.where(finite0 & (lg < 1.0), (xi0 * lg).clamp_min(1e-300), torch.ones_like(ga))
        start = torch.where(finite0 & (lg >= 1.0), (xi0 * lg), start)
        solve = above & ~near

        def dfun(xx):
            xp = xx.clamp_min(0)
            return 1 + 2 * ga * pot.dg(xp), 2 * ga * pot.d2g(xp)

        if bool(solve.any()):
            root, ok = minimize_convex_scalar(dfun, 0.0, math.inf, x0=start, closed=False, xtol=xtol,
                                              max_iter=200, max_expand=200)
            if not bool(ok[solve].all()):
                raise RuntimeError("h_implicit: the scalar problem x_*(gamma) did not converge")
            x = torch.where(solve, root, x)
        x = torch.where(near, xi0 * lg, x)
    g_at = pot.g(x)
    h = -(x / gamma + 2 * g_at)
    dh = x / gamma**2
    pos = x > 0
    xs = torch.where(pos, x, torch.ones_like(x))
    d2h = torch.where(pos, (1.0 / (2 * gamma * pot.d2g(xs)) - 2 * xs) / gamma**3, torch.zeros_like(x))
    return h, dh, d2h, x


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
    for p in stack.potentials:
        if not p.log_concave:
            warn(f"site potential '{p.name}' is not log-concave: h(gamma) is not convex (Nickisch & Seeger 2009, "
                 "Theorem 2), so the relaxation is not a convex problem; the double loop still decreases phi but may "
                 "stop at a local optimum", NonConvexWarning)
