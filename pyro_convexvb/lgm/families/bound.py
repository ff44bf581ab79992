r"""Local variational bounds of the dual VG method: the base class and tempered sites.

A local bound ``f(h, rho) >= -E_{N(eta | h, rho)}[log p(y | eta)]`` with a conjugate of the half-space form
``psi(alpha)`` on ``{lambda <= ell(alpha)}`` (Khan et al. 2013, Eqs. (10) and (19); the table of bounds and the
engine are in :mod:`pyro_convexvb.infer.dual_vg.bounds`). Each family's own bound lives in its family module.
"""
import math

import torch

from .potential import check_weight

__all__ = ["LocalBound", "QuadraticBound", "WeightedBound"]


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
    #: the bound is only a starting point: no local bound of the family is exact where it matters (Laplace sites), so
    #: ``dual_vg`` refines the dual's Gaussian to the exact variational-Gaussian optimum (option ``refine``)
    surrogate = False

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

    def data_mean(self, h):
        """``(q,)`` the site means the data start :meth:`data_alpha` linearises at: each site's own maximum-likelihood
        predictor, where :meth:`data_alpha` is the curvature there; for a bound without a data start the prior means
        ``h`` ``(q,)``."""
        return h

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

    def weighted(self, weight, family=None, log_const=None):
        """The bound ``w f - c`` of the sites ``p(y | eta)^w e^c`` (:class:`WeightedBound`)."""
        return WeightedBound(self, weight, family, log_const)


class QuadraticBound(LocalBound):
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
    :param log_const: ``(q,)`` constants ``c`` of sites ``p(y | eta)^w e^c`` (default none): ``f`` becomes
        ``w f - c`` and ``f*`` gains ``+ c`` (e.g. the binomial coefficient of
        :class:`~pyro_convexvb.lgm.families.Binomial`).
    :param family: the weighted site family (for the exact expectations; default: ``base.family``
        with the weights applied to its expectations).

    Example::

        >>> import torch
        >>> from pyro_convexvb.lgm.families.poisson import Poisson, PoissonBound
        >>> y = torch.tensor([3.], dtype=torch.float64)
        >>> base, w = PoissonBound(Poisson(y)), torch.tensor([2.], dtype=torch.float64)
        >>> wb = WeightedBound(base, w)
        >>> a = torch.tensor([0.7], dtype=torch.float64)
        >>> bool(torch.allclose(wb.psi(a)[0], w * base.psi(a / w)[0]))
        True
    """

    def __init__(self, base, weight, family=None, log_const=None):
        weight = check_weight(torch.as_tensor(weight), len(base))
        self.base = base
        self.weight = weight
        self.family = family
        self.log_const = torch.zeros_like(weight) if log_const is None else log_const
        self.name = "weighted_" + base.name
        self.exact = base.exact
        self.surrogate = base.surrogate
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
        return self.weight * self.base.f(h, rho) - self.log_const

    def psi(self, alpha):
        w = self.weight.to(alpha)
        p, dp, d2p = self.base.psi(self._scaled(alpha))
        return w * p + self.log_const.to(alpha), dp, d2p / w

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

    def data_mean(self, h):
        return self.base.data_mean(h)

    def conjugate(self, alpha, lam):
        w = self.weight.to(alpha)
        return w * self.base.conjugate(self._scaled(alpha), lam / w) + self.log_const.to(alpha)

    def exact_expected_log_prob(self, h, rho):
        if self.family is not None:
            return self.family.expected_log_prob(h, rho)
        return self.weight * self.base.exact_expected_log_prob(h, rho) + self.log_const

    def fenchel_young_residual(self, alpha, h, rho):
        return self.weight * self.base.fenchel_young_residual(self._scaled(alpha), h, rho)
