r"""Super-Gaussian potentials ``log t(s) = kappa + beta s + g(s^2)`` (Nickisch & Seeger 2009, §2 and appendix).

The base class, its implicit ``h``/``x_*`` (:func:`h_implicit`) and tempered sites (:class:`WeightedPotential`);
the theory, ``h^*`` and the engine are in :mod:`pyro_convexvb.infer.convex_relaxation.potentials`. Each
family's own potential lives in its family module.
"""
import math

import torch

from ...linalg.scalar import minimize_convex_scalar

__all__ = ["SuperGaussianPotential", "WeightedPotential", "h_implicit"]


def check_weight(weight, size):
    """``weight``, checked to be ``(size,)`` positive finite per-site weights of tempered sites ``t^w``."""
    if weight.dim() != 1 or weight.shape[0] != size:
        raise ValueError(f"weight: expected shape ({size},), got {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()) or not bool((weight > 0).all()):
        raise ValueError("weight: site weights must be positive and finite")
    return weight


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

    def h_star(self, s, z, derivatives=2):
        r"""``h^*(s)``, its derivatives and the minimising ``gamma_*`` in closed form.

        Nickisch & Seeger 2009, §2.2 defines ``h^*(s) = (1/2) min_gamma ((z + s^2)/gamma + h(gamma)) - beta s`` and the
        appendix characterises the minimiser by ``gamma_*^2 h'(gamma_*) = x_*(gamma_*) = z + s^2``; with
        ``l_x = 0``, i.e. ``1/gamma + 2 g'(x_*) = 0``, this gives (``x = z + s^2``)

        ``gamma_* = -1/(2 g'(x))``, ``h^* = -g(x) - beta s``, ``(h^*)' = s/gamma_* - beta`` (appendix),
        ``(h^*)'' = gamma_*^{-1} (1 - 2 s^2 / (gamma_*^3 k_{gamma gamma})) = c(x) + 4 z g''(x)``.

        :param s: ``(q,)`` site variables (``eta - shift``).
        :param z: ``(q,)`` outer-loop variances, ``> 0``.
        :param derivatives: 0, 1 or 2: how many derivatives to return.
        :returns: ``(h_star, d1, d2, gamma_star)`` (``None`` for derivatives not requested).
        """
        x = z + s * s
        dg = self.dg(x)
        value = -self.g(x) - self.beta * s
        d1 = d2 = None
        if derivatives >= 1:
            d1 = -2 * s * dg - self.beta
        if derivatives >= 2:
            d2 = self.curv(x) + 4 * z * self.d2g(x)
        return value, d1, d2, -0.5 / dg


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
    :param log_const: ``(q,)`` constants ``c`` of sites ``t(s)^w e^c`` (default none), added to ``kappa``.

    Example::

        >>> import torch
        >>> from pyro_convexvb.lgm.families.laplace import LaplacePotential
        >>> base = LaplacePotential(torch.tensor([2.0], dtype=torch.float64))
        >>> pot = WeightedPotential(base, torch.tensor([3.0], dtype=torch.float64))
        >>> s = torch.tensor([0.7], dtype=torch.float64)
        >>> bool(torch.allclose(pot.log_prob(s), 3 * base.log_prob(s)))
        True
    """

    def __init__(self, base, weight, log_const=None):
        weight = check_weight(_t(weight, base.beta), len(base))
        self.base = base
        self.weight = weight
        self.name = "weighted_" + base.name
        self.log_concave = base.log_concave
        kappa = weight * base.kappa if log_const is None else weight * base.kappa + log_const
        super().__init__(weight * base.beta, kappa, base.shift)

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
