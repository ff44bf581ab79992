r"""Gamma and exponential responses with log link: ``Gamma(concentration=k, rate=k e^{-eta})`` (mean ``e^eta``) and
``Exponential(rate=e^{-eta})`` (``k = 1``).

.. math:: \log t(\eta) = -k \eta - k y e^{-\eta} + c, \qquad
          c = k \log k - \log\Gamma(k) + (k - 1) \log y,

``2k`` copies of the stochastic-volatility site ``N(sqrt(y) | 0, e^eta)`` of Khan et al. 2013, §5 (whose log density
is ``-eta / 2 - y e^{-eta} / 2 - log(2 pi) / 2``) times ``e^{c + k log(2 pi)}``. So the family is log-concave in
``eta`` and its local bound is that site's exact bound tempered by ``2k`` with the constant kept
(:class:`~pyro_convexvb.lgm.families.bound.WeightedBound`): ``f = 2k f_SV(h, rho; sqrt(y)) - c - k log(2 pi)``,
equal to ``-E log t``, with the closed-form conjugate of the stochastic-volatility row of ``docs/dual_vg.md``.
It is not super-Gaussian (``-k eta - k y e^{-eta}`` has no even tilt, Nickisch & Seeger 2009, §2), so
``convex_relaxation`` refuses it.
"""
import math

import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .base import SiteFamily
from .stochastic_volatility import StochasticVolatility, StochasticVolatilityBound

__all__ = ["GammaLog"]


class GammaLog(SiteFamily):
    r"""``t_i(eta) = Gamma(y_i | concentration=k_i, rate=k_i e^{-eta})``: positive responses ``y_i``, mean ``e^eta``.

    :param torch.Tensor y: ``(q,)`` positive responses.
    :param torch.Tensor concentration: ``(q,)`` shapes ``k_i > 0`` (one for exponential responses).

    Example::

        >>> import torch
        >>> y, k = torch.tensor([0.7], dtype=torch.float64), torch.tensor([2.5], dtype=torch.float64)
        >>> eta = torch.tensor([0.3], dtype=torch.float64)
        >>> ref = torch.distributions.Gamma(k, k * torch.exp(-eta)).log_prob(y)
        >>> bool(torch.allclose(GammaLog(y, k).log_prob(eta), ref))
        True
    """

    name = "gamma_log"
    distributions = (dist.Gamma, torch.distributions.Gamma, dist.Exponential, torch.distributions.Exponential)
    pyro_form = "Gamma(concentration, rate=concentration * exp(-...)) / Exponential(rate=exp(-...))"
    no_potential = ("Gamma and exponential sites are not super-Gaussian: -k eta - k y exp(-eta) has no even tilt "
                    "(Nickisch & Seeger 2009, §2)")

    def __init__(self, y, concentration):
        super().__init__(y=y, concentration=concentration)

    def log_norm(self):
        """``c = k log k - log Gamma(k) + (k - 1) log y``, ``(q,)``."""
        y, k = self.params["y"], self.params["concentration"]
        return torch.special.xlogy(k, k) - torch.lgamma(k) + (k - 1) * torch.log(y)

    def log_prob(self, eta):
        y, k = self.params["y"], self.params["concentration"]
        return -k * eta - k * y * torch.exp(-eta) + self.log_norm()

    def expected_log_prob(self, mean, var, num_points=64):
        y, k = self.params["y"], self.params["concentration"]
        return -k * mean - k * y * torch.exp(-mean + 0.5 * var) + self.log_norm()

    def predictive_mean(self, mean, var, num_points=64):
        """``E[e^eta] = exp(mean + var / 2)``."""
        return torch.exp(mean + 0.5 * var)

    def local_bound(self, kind="tight", xi=None):
        k = self.params["concentration"]
        base = StochasticVolatilityBound(StochasticVolatility(torch.sqrt(self.params["y"]), zero_jitter=0.0))
        return base.weighted(2 * k, self, self.log_norm() + k * math.log(2 * math.pi))

    @classmethod
    def predictor(cls, d):
        if isinstance(d, (dist.Exponential, torch.distributions.Exponential)):
            return -torch.log(d.rate)
        if isinstance(d, (dist.Gamma, torch.distributions.Gamma)):
            return torch.log(d.concentration) - torch.log(d.rate)
        return None

    @classmethod
    def fixed_params(cls, d):
        if isinstance(d, (dist.Exponential, torch.distributions.Exponential)):
            return {"concentration": (torch.ones_like(d.rate.detach()), "exponential shape")}
        return {"concentration": (d.concentration, "Gamma concentration")}

    @classmethod
    def from_site(cls, site, y, concentration):
        k = concentration
        if not bool(torch.isfinite(k).all()) or not bool((k > 0).all()):
            raise UnsupportedModelError(site, "the Gamma concentration must be positive and finite in every row")
        if not bool((y > 0).all()):
            raise UnsupportedModelError(site, "Gamma / exponential responses must be positive")
        return cls(y, k)
