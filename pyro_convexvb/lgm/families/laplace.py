"""Laplace (sparsity) sites: the family and its super-Gaussian potential."""
import math

import torch

from .base import SiteFamily
from .potential import SuperGaussianPotential

__all__ = ["Laplace", "LaplacePotential"]


def _normal_abs_moment(mean, var):
    """``E|eta|`` for ``eta ~ N(mean, var)``."""
    sd = var.clamp_min(1e-300).sqrt()
    z = mean / sd
    return sd * math.sqrt(2 / math.pi) * torch.exp(-0.5 * z * z) + mean * torch.erf(z / math.sqrt(2))


class Laplace(SiteFamily):
    """``t_i(eta) = exp(-|eta| / scale_i) / (2 scale_i)`` (a sparsity potential; a location goes in the offset).

    In Nickisch & Seeger's (2009) notation (Eq. 2) ``tau_i / sigma = 1 / scale_i``.
    """

    name = "laplace"

    def __init__(self, scale):
        super().__init__(scale=scale)

    def log_prob(self, eta):
        b = self.params["scale"]
        return -eta.abs() / b - torch.log(2 * b)

    def expected_log_prob(self, mean, var, num_points=64):
        b = self.params["scale"]
        return -_normal_abs_moment(mean, var) / b - torch.log(2 * b)

    def predictive_mean(self, mean, var, num_points=64):
        return mean

    def super_gaussian(self):
        return LaplacePotential(self.params["scale"])


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
