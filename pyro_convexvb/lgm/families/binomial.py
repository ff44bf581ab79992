r"""Binomial sites with logit link: ``Binomial(total_count=n, logits=eta)`` (and ``probs=sigmoid(eta)``).

``log t(eta) = k eta - n softplus(eta) + log C(n, k) = n [y eta - softplus(eta)] + log C(n, k)``, ``y = k / n``:
``n`` copies of a Bernoulli-logit site of fractional label ``y`` times the binomial coefficient. So every engine
question is answered by the Bernoulli-logit family's answer, tempered by ``n`` (the machinery of
:class:`~pyro_convexvb.lgm.families.Weighted`), with ``log C(n, k)`` kept in every bound:

* the super-Gaussian potential (Nickisch & Seeger 2009, §2): ``beta = k - n / 2``, ``kappa = log C(n, k)``,
  ``g(x) = n g_logit(x)``, log-concave;
* the local bound (Khan et al. 2013, Eq. 10): ``n f_logit(h, rho; y) - log C(n, k)``, any of the logit bounds
  (``f_logit`` is affine in the label, so each stays a valid convex bound at a fractional ``y``);
* the Gaussian expectation ``k mean - n E softplus(eta) + log C(n, k)`` (Gauss-Hermite for the softplus).
"""
import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .base import _check_values
from .logit import CountLogit

__all__ = ["Binomial"]


class Binomial(CountLogit):
    r"""``t_i(eta) = C(n_i, k_i) sigmoid(eta)^{k_i} sigmoid(-eta)^{n_i - k_i}``, counts ``0 <= k_i <= n_i``, ``n_i >= 1``.

    :param torch.Tensor y: ``(q,)`` successes ``k_i``.
    :param torch.Tensor total_count: ``(q,)`` trials ``n_i``.

    Example::

        >>> import math, torch
        >>> fam = Binomial(torch.tensor([2.], dtype=torch.float64), torch.tensor([5.], dtype=torch.float64))
        >>> eta = torch.zeros(1, dtype=torch.float64)
        >>> round(float(fam.log_prob(eta)), 12) == round(math.log(10 / 32), 12)  # C(5, 2) / 2^5
        True
    """

    name = "binomial_logit"
    distributions = (dist.Binomial, torch.distributions.Binomial)
    pyro_form = "Binomial(total_count, logits=...)"

    def __init__(self, y, total_count):
        if torch.is_tensor(y) and torch.is_tensor(total_count):
            _check_values("y", y, lambda v: (v >= 0) & (v <= total_count), "counts in [0, total_count]")
        super().__init__(y=y, total_count=total_count)

    def _n(self):
        return self.params["total_count"]

    def log_norm(self):
        """``log C(n, k)``, ``(q,)``."""
        k, n = self.params["y"], self.params["total_count"]
        return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)

    def predictive_mean(self, mean, var, num_points=64):
        """The predictive mean count ``n E[sigmoid(eta)]``."""
        return self.params["total_count"] * self._rate().predictive_mean(mean, var, num_points)

    @classmethod
    def predictor(cls, dist):
        return dist.logits if isinstance(dist, cls.distributions) else None

    @classmethod
    def fixed_params(cls, dist):
        return {"total_count": (dist.total_count, "total count")}

    @classmethod
    def from_site(cls, site, y, total_count):
        n = total_count
        if not bool(((n >= 1) & (n == torch.round(n))).all()):
            raise UnsupportedModelError(site, "Binomial total_count must be a positive integer in every row (drop rows "
                                              "with total_count 0: they carry no information)")
        if not bool(((y >= 0) & (y <= n) & (y == torch.round(y))).all()):
            raise UnsupportedModelError(site, "Binomial counts must be integers in [0, total_count]")
        return cls(y, n)
