"""Laplace sites: sparsity priors on ``B u`` and robust-regression likelihoods; the family and its potential.

An observed ``y ~ Laplace(loc=eta, scale=b)`` (least absolute deviations) is the same potential at
``s = eta - y`` (``shift = y``), log-concave and super-Gaussian (Nickisch & Seeger 2009, Eq. (2) and §2.3), so
``convex_relaxation`` takes it with the closed forms ``h(gamma) = gamma / b^2``, ``h^*(s) = sqrt(z + s^2) / b``.

``dual_vg`` has no exact local bound for it: ``E|eta - y|`` grows like ``sqrt(rho)`` in the marginal variance
``rho`` at ``h = y``, and a function that is jointly convex in ``(h, rho)`` cannot bound it with the slack
vanishing at ``rho -> 0`` (a convex ``f(y, rho) >= sqrt(2 rho / pi) / b + f(y, 0)`` would need an infinite slope at
``rho = 0``), so no local bound of Khan et al. 2013 (Eq. 10) is exact. ``dual_vg`` therefore solves its dual with
the quadratic *surrogate* :class:`LaplaceQuadraticBound` (``|x| <= x^2 / (2 xi) + xi / 2`` at the fixed width
``xi = 2 b``: a valid but loose bound) and refines that Gaussian to the exact variational-Gaussian optimum by the
natural-gradient fixed point (Khan & Lin 2017) with the closed-form expectations of
:meth:`Laplace.expected_log_prob_terms`; the Laplace likelihood is log-concave, so the exact VG bound is concave in
the mean and Cholesky factor (Challis & Barber 2013) and its optimum unique.
"""
import math

import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .base import SiteFamily, _check_values
from .bound import QuadraticBound
from .potential import SuperGaussianPotential

__all__ = ["Laplace", "LaplaceQuadraticBound", "LaplacePotential"]


def _normal_abs_moment(mean, var):
    """``E|eta|`` for ``eta ~ N(mean, var)``."""
    sd = var.clamp_min(1e-300).sqrt()
    z = mean / sd
    return sd * math.sqrt(2 / math.pi) * torch.exp(-0.5 * z * z) + mean * torch.erf(z / math.sqrt(2))


class Laplace(SiteFamily):
    """``t_i(eta) = exp(-|eta - y_i| / scale_i) / (2 scale_i)``: a sparsity potential (``y = 0``; a prior's location
    goes in the offset) or a Laplace likelihood ``y_i ~ Laplace(loc=eta, scale_i)`` (robust regression).

    In Nickisch & Seeger's (2009) notation (Eq. 2) ``tau_i / sigma = 1 / scale_i``.

    :param torch.Tensor scale: ``(q,)`` scales ``b > 0``.
    :param torch.Tensor y: ``(q,)`` observations (default zeros: the sparsity potential).

    Example::

        >>> import math, torch
        >>> fam = Laplace(torch.tensor([2.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64))
        >>> round(float(fam.log_prob(torch.tensor([3.0], dtype=torch.float64))), 12) == round(-1 - math.log(4), 12)
        True
    """

    name = "laplace"
    distributions = (dist.Laplace, torch.distributions.Laplace)
    pyro_form = "Laplace(loc=..., scale)"
    def __init__(self, scale, y=None):
        _check_values("scale", scale, lambda v: torch.isfinite(v) & (v > 0), "positive finite scales")
        super().__init__(scale=scale, y=torch.zeros_like(scale) if y is None else y)

    def log_prob(self, eta):
        b, y = self.params["scale"], self.params["y"]
        return -(eta - y).abs() / b - torch.log(2 * b)

    def expected_log_prob(self, mean, var, num_points=64):
        b, y = self.params["scale"], self.params["y"]
        return -_normal_abs_moment(mean - y, var) / b - torch.log(2 * b)

    def expected_log_prob_terms(self, mean, var, num_points=32):
        """``E log p``, ``dE/dmean``, ``dE/dvar`` in closed form (the kink at ``eta = y`` has curvature
        ``2 delta(eta - y) / b``, which quadrature of the second derivative misses): with ``r = mean - y`` and
        ``sd = sqrt(var)``, ``dE/dmean = -erf(r / (sd sqrt 2)) / b`` and ``dE/dvar = -phi(r / sd) / (sd b)``."""
        b, y = self.params["scale"], self.params["y"]
        r = mean - y
        sd = var.clamp_min(1e-300).sqrt()
        z = r / sd
        dens = torch.exp(-0.5 * z * z) / (sd * math.sqrt(2 * math.pi))
        return (-_normal_abs_moment(r, var) / b - torch.log(2 * b), -torch.erf(z / math.sqrt(2)) / b, -dens / b)

    def local_bound(self, kind="tight", xi=None):
        """The quadratic surrogate :class:`LaplaceQuadraticBound` (module docstring): ``dual_vg`` refines its
        Gaussian to the exact variational-Gaussian optimum. ``kind`` and ``xi`` concern the logit families."""
        return LaplaceQuadraticBound(self)

    def predictive_mean(self, mean, var, num_points=64):
        return mean

    def super_gaussian(self):
        return LaplacePotential(self.params["scale"], shift=self.params["y"])

    @classmethod
    def predictor(cls, d):
        return d.loc if isinstance(d, cls.distributions) else None

    @classmethod
    def fixed_params(cls, d):
        return {"scale": (d.scale, "Laplace scale")}

    @classmethod
    def from_site(cls, site, y, scale):
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise UnsupportedModelError(site, "the Laplace scale must be positive and finite in every row")
        return cls(scale, y)


class LaplaceQuadraticBound(QuadraticBound):
    r"""``f(h, rho) = ((h - y)^2 + rho) / (2 xi b) + xi / (2 b) + log(2 b) >= E|eta - y| / b + log(2 b)`` at the width
    ``xi = 2 b`` (from ``|x| <= x^2 / (2 xi) + xi / 2``): a Gaussian site of variance ``2 b^2``, the Laplace
    likelihood's own variance. A surrogate (:attr:`surrogate`): valid, jointly convex, but loose; ``dual_vg`` starts
    the exact-VG refinement from its dual optimum."""

    name = "laplace_quadratic"
    surrogate = True

    def __init__(self, family):
        super().__init__(family)
        b, y = family.params["scale"], family.params["y"]
        a = 0.5 / b**2
        self._coef = (a, a * y, 0.5 * a * y**2 + 1.0 + torch.log(2 * b))

    def _abc(self):
        return self._coef


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
