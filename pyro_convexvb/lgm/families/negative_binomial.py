r"""Negative-binomial (Gamma-Poisson) count sites: ``NegativeBinomial(total_count=r, logits=eta)`` and
``GammaPoisson(concentration=r, rate=b)`` (``eta = -log b``).

With the mean ``mu = r e^eta`` (so a log link ``log mu = x^T w`` is the predictor ``eta = x^T w - log r``, an
affine function with the offset ``-log r``) and ``y`` counts,

.. math:: \log t(\eta) = y \eta - (y + r)\,\mathrm{softplus}(\eta) + \log\frac{\Gamma(y + r)}{\Gamma(r)\, y!},

which is ``n = y + r`` copies of a Bernoulli-logit site of fractional label ``y / (y + r)`` times the constant
``c = log Gamma(y + r) - log Gamma(r) - log y!`` (the same algebra as
:class:`~pyro_convexvb.lgm.families.Binomial`, with a real ``n``). So every engine question is the logit family's
answer tempered by ``n``, with ``c`` kept in every bound:

* log-concave in ``eta`` (``softplus`` is convex, ``y + r > 0``);
* the super-Gaussian potential (Nickisch & Seeger 2009, §2 and Eq. (3)): ``beta = (y - r) / 2``, ``kappa = c``,
  ``g(x) = (y + r) g_logit(x)``: ``convex_relaxation`` takes it, and the relaxation stays convex;
* the local bound (Khan et al. 2013, Eq. 10): ``(y + r) f_logit(h, rho; y / (y + r)) - c``, any of the logit bounds
  (``f_logit`` is affine in the label, so each stays valid at a fractional label);
* the Gaussian expectation ``y mean - (y + r) E softplus(eta) + c`` (Gauss-Hermite for the softplus).

A concentration ``r`` that is a hyper-latent (``r ~ Gamma(...)``) is integrated over like any other hyper-latent
(``docs/hyperparameters.md``): given ``r`` the site is this family.
"""
import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .logit import CountLogit

__all__ = ["NegativeBinomial"]


class NegativeBinomial(CountLogit):
    r"""``t_i(eta) = NegativeBinomial(y_i | total_count=r_i, logits=eta)``: counts ``y_i >= 0``, ``r_i > 0``.

    The mean count is ``r_i e^{eta}``; ``Var y = mu + mu^2 / r``. Pyro's ``GammaPoisson(concentration=r, rate=b)``
    is the same site with ``eta = -log b``.

    :param torch.Tensor y: ``(q,)`` counts.
    :param torch.Tensor total_count: ``(q,)`` concentrations ``r`` (positive reals).

    Example::

        >>> import torch
        >>> y, r = torch.tensor([3.], dtype=torch.float64), torch.tensor([2.5], dtype=torch.float64)
        >>> fam = NegativeBinomial(y, r)
        >>> eta = torch.tensor([0.4], dtype=torch.float64)
        >>> ref = torch.distributions.NegativeBinomial(r, logits=eta).log_prob(y)
        >>> bool(torch.allclose(fam.log_prob(eta), ref))
        True
    """

    name = "negative_binomial"
    distributions = (dist.NegativeBinomial, torch.distributions.NegativeBinomial, dist.GammaPoisson)
    pyro_form = "NegativeBinomial(total_count, logits=...) / GammaPoisson(concentration, rate=exp(...))"

    def __init__(self, y, total_count):
        super().__init__(y=y, total_count=total_count)

    def _n(self):
        return self.params["y"] + self.params["total_count"]

    def log_norm(self):
        """``log Gamma(y + r) - log Gamma(r) - log y!``, ``(q,)``."""
        y, r = self.params["y"], self.params["total_count"]
        return torch.lgamma(y + r) - torch.lgamma(r) - torch.lgamma(y + 1)

    def predictive_mean(self, mean, var, num_points=64):
        """The predictive mean count ``r E[e^eta] = r exp(mean + var / 2)``."""
        return self.params["total_count"] * torch.exp(mean + 0.5 * var)

    @classmethod
    def predictor(cls, d):
        if isinstance(d, dist.GammaPoisson):
            return -torch.log(d.rate)
        return d.logits if isinstance(d, cls.distributions) else None

    @classmethod
    def fixed_params(cls, d):
        if isinstance(d, dist.GammaPoisson):
            return {"total_count": (d.concentration, "GammaPoisson concentration")}
        return {"total_count": (d.total_count, "NegativeBinomial total_count")}

    @classmethod
    def from_site(cls, site, y, total_count):
        r = total_count
        if not bool(torch.isfinite(r).all()) or not bool((r > 0).all()):
            raise UnsupportedModelError(site, "the negative-binomial concentration (total_count) must be positive and "
                                              "finite in every row")
        if not bool(((y >= 0) & (y == torch.round(y))).all()):
            raise UnsupportedModelError(site, "negative-binomial counts must be nonnegative integers")
        return cls(y, r)
