"""Laplace sites: sparsity priors on ``B u`` and robust-regression likelihoods; the family and its potential.

An observed ``y ~ Laplace(loc=eta, scale=b)`` (least absolute deviations) is the same potential at
``s = eta - y`` (``shift = y``), log-concave and super-Gaussian (Nickisch & Seeger 2009, Eq. (2) and §2.3), so
``convex_relaxation`` takes it with the closed forms ``h(gamma) = gamma / b^2``, ``h^*(s) = sqrt(z + s^2) / b``.
``dual_vg`` refuses it: ``E|eta - y|`` grows like ``sqrt(rho)`` in the marginal variance ``rho`` at ``h = y``, and a
function that is jointly convex in ``(h, rho)`` cannot bound it with the slack vanishing at ``rho -> 0`` (a convex
``f(y, rho) >= sqrt(2 rho / pi) / b + f(y, 0)`` would need an infinite slope at ``rho = 0``), so there is no local
bound of Khan et al. 2013 (Eq. 10) that is exact at ``rho = 0``; a bound with a fixed width (the Gaussian lower
bound at one ``gamma``) is convex but its slack is not tightened by the dual.
"""
import math

import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .base import SiteFamily
from .potential import SuperGaussianPotential

__all__ = ["Laplace", "LaplacePotential"]


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
    no_bound = ("Laplace sites (likelihoods or sparsity priors) have no local bound of dual_vg: E|eta - y| grows "
                "like sqrt(rho) in the marginal variance rho at h = y, which no function jointly convex in (h, rho) "
                "and exact at rho = 0 bounds (the dual of Khan et al. 2013, Eq. 10 needs one); they are log-concave "
                "super-Gaussian sites of the relaxation (Nickisch & Seeger 2009, §2.3)")

    def __init__(self, scale, y=None):
        super().__init__(scale=scale, y=torch.zeros_like(scale) if y is None else y)

    def log_prob(self, eta):
        b, y = self.params["scale"], self.params["y"]
        return -(eta - y).abs() / b - torch.log(2 * b)

    def expected_log_prob(self, mean, var, num_points=64):
        b, y = self.params["scale"], self.params["y"]
        return -_normal_abs_moment(mean - y, var) / b - torch.log(2 * b)

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
