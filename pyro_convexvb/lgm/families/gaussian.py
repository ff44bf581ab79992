"""Gaussian observation sites: the family and its exact local bound."""
import math

import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .base import SiteFamily
from .bound import QuadraticBound
from .potential import check_weight

__all__ = ["Gaussian", "GaussianBound"]


class Gaussian(SiteFamily):
    """``t_i(eta) = N(y_i | eta, scale_i^2)`` (the Gaussian part of the model).

    :param torch.Tensor y: ``(q,)`` observations.
    :param torch.Tensor scale: ``(q,)`` noise standard deviations (fixed).
    """

    name = "gaussian"
    distributions = (dist.Normal, torch.distributions.Normal)
    pyro_form = "Normal"

    def __init__(self, y, scale):
        super().__init__(y=y, scale=scale)

    def log_prob(self, eta):
        y, s = self.params["y"], self.params["scale"]
        return -0.5 * ((y - eta) / s) ** 2 - torch.log(s) - 0.5 * math.log(2 * math.pi)

    def expected_log_prob(self, mean, var, num_points=64):
        y, s = self.params["y"], self.params["scale"]
        return -0.5 * ((y - mean) ** 2 + var) / s**2 - torch.log(s) - 0.5 * math.log(2 * math.pi)

    def predictive_mean(self, mean, var, num_points=64):
        return mean

    def super_gaussian(self):
        raise UnsupportedModelError(self.name, "Gaussian sites are not potentials of the relaxation: the engine takes "
                                               "them exactly (a Gaussian weighted by poutine.scale is a Gaussian of "
                                               "variance s^2 / w, which lgm.sites.tempered gives exactly)")

    def local_bound(self, kind="tight", xi=None):
        return GaussianBound(self)

    @classmethod
    def predictor(cls, dist):
        return dist.loc if isinstance(dist, cls.distributions) else None

    @classmethod
    def fixed_params(cls, dist):
        return {"scale": (dist.scale, "noise scale (a Normal(m, exp(eta / 2)) whose mean m is free of latents is read "
                                      "as a stochastic-volatility site; with a latent mean it is outside the class)")}

    @classmethod
    def from_site(cls, site, y, scale):
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise UnsupportedModelError(site, "the noise scale must be positive and finite")
        return cls(y, scale)

    def tempered(self, weight):
        """``N(y | eta, s^2)^w = N(y | eta, s^2 / w)`` times ``-(w - 1) log s - log(w) / 2 - (w - 1) log(2 pi) / 2``."""
        y, s = self.params["y"], self.params["scale"]
        check_weight(weight, len(self))
        const = -(weight - 1) * torch.log(s) - 0.5 * torch.log(weight) - 0.5 * (weight - 1) * math.log(2 * math.pi)
        return Gaussian(y, s / weight.sqrt()), float(const.sum())


class GaussianBound(QuadraticBound):
    """Gaussian observations ``N(y | eta, s^2)`` (exact; ``lambda = 1 / s^2`` is pinned)."""

    name = "gaussian"
    exact = True

    def __init__(self, family):
        super().__init__(family)
        y, s = family.params["y"], family.params["scale"]
        self._coef = (1.0 / s**2, y / s**2, 0.5 * y**2 / s**2 + torch.log(s) + 0.5 * math.log(2 * math.pi))

    def _abc(self):
        return self._coef
