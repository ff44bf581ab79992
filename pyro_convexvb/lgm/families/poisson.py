"""Poisson sites with log link: the family and its exact local bound (not super-Gaussian)."""
import math

import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .base import SiteFamily, _check_values
from .bound import LocalBound

__all__ = ["Poisson", "PoissonBound"]


class Poisson(SiteFamily):
    """``t_i(eta) = Poisson(y_i | exp(eta))``, counts ``y_i >= 0``."""

    name = "poisson"
    distributions = (dist.Poisson, torch.distributions.Poisson)
    pyro_form = "Poisson(rate=exp(...))"
    no_potential = "Poisson sites are not super-Gaussian: y s - exp(s) has no even tilt (Nickisch & Seeger 2009, §2)"

    def __init__(self, y):
        _check_values("y", y, lambda v: v >= 0, "non-negative counts")
        super().__init__(y=y)

    def log_prob(self, eta):
        y = self.params["y"]
        return y * eta - torch.exp(eta) - torch.lgamma(y + 1)

    def expected_log_prob(self, mean, var, num_points=64):
        y = self.params["y"]
        return y * mean - torch.exp(mean + 0.5 * var) - torch.lgamma(y + 1)

    def predictive_mean(self, mean, var, num_points=64):
        return torch.exp(mean + 0.5 * var)

    def local_bound(self, kind="tight", xi=None):
        return PoissonBound(self)

    @classmethod
    def predictor(cls, dist):
        return torch.log(dist.rate) if isinstance(dist, cls.distributions) else None

    @classmethod
    def from_site(cls, site, y):
        if (y < 0).any():
            raise UnsupportedModelError(site, "Poisson counts must be nonnegative")
        if (y != torch.round(y)).any():
            raise UnsupportedModelError(site, "Poisson counts must be integers")
        return cls(y)


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

    def data_mean(self, h):
        return torch.log(self.y + 0.5).to(h)
