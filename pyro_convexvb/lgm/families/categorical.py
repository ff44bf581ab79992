r"""Categorical (multinomial-logit, softmax) likelihoods: recognised and refused with the reason.

``y_i ~ Categorical(logits=eta_i)`` with ``eta_i = W^T x_i`` a ``K``-vector per row. Böhning's bound (Böhning 1992,
*Multinomial logistic regression algorithm*; a local bound of the kind Khan et al. 2013, Eq. 10 take) majorises
``-log softmax_y(eta)`` by the quadratic
``eta^T A eta / 2 - b(psi)^T eta + c(psi)`` with ``A = (I - 1 1^T / K) / 2``; its expectation needs the ``K x K``
posterior covariance block of each row's ``eta_i``, whereas every site of this package is a scalar function of one
linear predictor whose engines see only the marginal means and variances ``(h_n, rho_n)`` (``dual_vg``: one
``(alpha_n, lambda_n)`` pair per site; ``convex_relaxation``: one width ``gamma_n``). Fitting it needs vector sites
in the engines: per-row ``K x K`` blocks of ``Var[eta_i]`` (selected inverse of the posterior precision on the rows'
predictor blocks), a ``K x K`` dual variable per row in ``dual_vg`` (or an outer loop on Böhning's expansion point
``psi_i`` with the Gaussian pseudo-observations ``L^T eta_i``, ``A = L L^T``), and block-diagonal site precisions in
the linear algebra. Until then extraction refuses the site, naming it.
"""
import pyro.distributions as dist
import torch

from .base import SiteFamily

__all__ = ["Categorical"]


class Categorical(SiteFamily):
    """Placeholder family of ``Categorical(logits=...)`` / ``OneHotCategorical`` sites: extraction refuses them with
    :attr:`refusal_reason` (see the module docstring for what fitting them needs)."""

    name = "categorical_logit"
    distributions = (dist.Categorical, torch.distributions.Categorical, dist.OneHotCategorical,
                     torch.distributions.OneHotCategorical)
    no_potential = no_bound = refusal_reason = (
        "Categorical (softmax) likelihoods are not supported: each row's K logits form a vector site, and Böhning's "
        "bound (Böhning 1992) needs the K x K posterior covariance of each row's logits, which the engines' scalar "
        "sites (one mean and variance per linear predictor) do not provide; a binary model is Bernoulli(logits=...)")

    @classmethod
    def predictor(cls, d):
        return d.logits if isinstance(d, cls.distributions) else None

    @classmethod
    def refusal(cls, d):
        return cls.refusal_reason
