"""Stochastic-volatility sites ``N(y | 0, e^eta)`` (Khan et al. 2013, §5): the family and its exact bound.

Read from an observed Pyro site ``Normal(m, exp(eta / 2))`` (stochastic volatility, heteroscedastic noise) whose
scale depends on the latents and whose mean ``m`` does not: the predictor is ``eta = 2 log scale`` (an affine
function of the latents, else the site is refused as non-affine) and the data ``y - m``. A mean that depends on the
latents as well is outside the class (the site is no longer a function of one linear predictor) and is refused.
"""
import math

import pyro.distributions as dist
import torch

from .base import SiteFamily
from .bound import LocalBound

__all__ = ["StochasticVolatility", "StochasticVolatilityBound"]


class StochasticVolatility(SiteFamily):
    """Stochastic-volatility sites ``t_n(eta) = N(y_n | 0, e^{eta})`` (Khan et al. 2013, §5).

    :param torch.Tensor y: ``(q,)`` observations (exact zeros are replaced by ``zero_jitter``,
        since ``log(1/y^2)`` enters the conjugate of its local bound).
    :param float zero_jitter: the magnitude that replaces ``|y_n| < zero_jitter``.
    :raises ValueError: if ``y`` contains NaN or inf.

    Example::

        >>> import torch
        >>> fam = StochasticVolatility(torch.tensor([0.3, -1.2], dtype=torch.float64))
        >>> fam.expected_log_prob(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)).shape
        torch.Size([2])
    """

    name = "stochastic_volatility"
    distributions = (dist.Normal, torch.distributions.Normal)
    no_potential = ("stochastic-volatility sites are not super-Gaussian: -eta / 2 - y^2 exp(-eta) / 2 has no even "
                    "tilt (Nickisch & Seeger 2009, §2)")

    def __init__(self, y, zero_jitter=1e-8):
        y = torch.as_tensor(y)
        if not torch.isfinite(y).all():
            raise ValueError("y: stochastic-volatility observations contain NaN or inf")
        y = torch.where(y.abs() < zero_jitter, torch.full_like(y, zero_jitter), y)
        super().__init__(y=y)

    def log_prob(self, eta):
        y = self.params["y"]
        return -0.5 * math.log(2 * math.pi) - 0.5 * eta - 0.5 * y**2 * torch.exp(-eta)

    def expected_log_prob(self, mean, var, num_points=64):
        y = self.params["y"]
        return -0.5 * math.log(2 * math.pi) - 0.5 * mean - 0.5 * y**2 * torch.exp(-mean + 0.5 * var)

    def predictive_mean(self, mean, var, num_points=64):
        """Mean of ``y`` (zero); the predictive variance of ``y`` is ``exp(mean + var / 2)``."""
        return torch.zeros_like(mean)

    def local_bound(self, kind="tight", xi=None):
        return StochasticVolatilityBound(self)

    @classmethod
    def predictor(cls, d):
        """``2 log scale`` of a ``Normal`` whose scale depends on the latents (its value carries an autograd graph
        during extraction) and whose mean does not; otherwise ``None`` (a Gaussian site)."""
        if not isinstance(d, cls.distributions):
            return None
        scale, loc = d.scale, d.loc
        if torch.is_tensor(scale) and scale.requires_grad and not (torch.is_tensor(loc) and loc.requires_grad):
            return 2 * torch.log(scale)
        return None

    @classmethod
    def fixed_params(cls, d):
        return {"loc": (torch.as_tensor(d.loc), "mean of the stochastic-volatility site Normal(m, exp(eta / 2))")}

    @classmethod
    def from_site(cls, site, y, loc):
        return cls(y - loc)


class StochasticVolatilityBound(LocalBound):
    """Stochastic volatility ``N(y | 0, e^eta)`` (exact); ``alpha = 1/2 - kappa``, ``lambda <= kappa``."""

    name = "stochastic_volatility"
    exact = True

    def __init__(self, family):
        super().__init__(family)
        self.y2 = family.params["y"] ** 2

    def f(self, h, rho):
        return 0.5 * math.log(2 * math.pi) + 0.5 * h + 0.5 * self.y2 * torch.exp(-h + 0.5 * rho)

    def psi(self, alpha):
        k = 0.5 - alpha
        val = torch.special.xlogy(k, 2 * k / self.y2) - k - 0.5 * math.log(2 * math.pi)
        return val, -torch.log(2 * k / self.y2), 1.0 / k

    def ell(self, alpha):
        return 0.5 - alpha, -torch.ones_like(alpha), torch.zeros_like(alpha)

    def alpha_domain(self, like):
        return torch.full_like(like, -math.inf), torch.full_like(like, 0.5)

    def alpha_star(self, h, rho):
        return 0.5 - 0.5 * self.y2 * torch.exp(-h + 0.5 * rho)

    def data_alpha(self, h, rho):
        """``alpha = 0``: site precision ``kappa = 1/2``, the curvature of ``-log p`` at its maximiser
        ``eta = log y^2`` (for Gamma sites, through the weighting, ``k`` at ``eta = log y``). Where the prior
        marginals are wide (``rho`` of tens), ``y^2 exp(-h + rho / 2)`` starts the dual at precisions of ``e^25``
        and beyond, and at ``rho`` of hundreds at infinity."""
        return torch.zeros_like(h)

    def data_mean(self, h):
        return torch.log(self.y2).to(h)
