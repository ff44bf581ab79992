"""Mixtures of diagonal Gaussians as Pyro guides, with the closed-form entropy lower bound (Steinberg et al.
2017, revrand technical report, §1.3).

* :mod:`~pyro_convexvb.infer.diag_mixture.elbo`: :class:`DiagMixtureELBO`, the loss, usable as
  ``SVI(model, guide, optim, loss=DiagMixtureELBO())``;
* :mod:`~pyro_convexvb.infer.diag_mixture.engine`: the registry engine ``diag_mixture``.

The posterior, the guides (:class:`AutoDiagMixture`, :class:`DiagMixtureGuide`) and the entropy bounds
(:func:`entropy_lower_bound`, Eq. 24, and :func:`bhattacharyya_entropy_lower_bound`) live below the model layer
in :mod:`pyro_convexvb.posterior.mixture`; they are re-exported here.
"""
from ...posterior.mixture import (AutoDiagMixture, DiagMixtureGuide, DiagMixturePosterior, DiagNormalMixture,
                                  bhattacharyya_entropy_lower_bound, entropy_lower_bound, mixture_evidence_bound,
                                  mixture_quantiles)
from .elbo import DiagMixtureELBO
from .engine import SVI_ONLY_OPTIONS, DiagMixtureEngine, DiagMixtureOptions, MixtureState

__all__ = [
    "entropy_lower_bound",
    "bhattacharyya_entropy_lower_bound",
    "mixture_quantiles",
    "DiagNormalMixture",
    "AutoDiagMixture",
    "DiagMixtureGuide",
    "DiagMixtureELBO",
    "DiagMixturePosterior",
    "DiagMixtureOptions",
    "DiagMixtureEngine",
    "MixtureState",
    "SVI_ONLY_OPTIONS",
    "mixture_evidence_bound",
]
