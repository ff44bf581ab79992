"""Posterior types over a latent vector, below the model layer (they import nothing from ``lgm`` or ``infer``).

* :mod:`~pyro_convexvb.posterior.gaussian`: :class:`GaussianPosterior` (every Gaussian engine's answer) and its
  Pyro guides;
* :mod:`~pyro_convexvb.posterior.mixture`: :class:`DiagMixturePosterior`, the mixture guides and the mixture
  entropy bounds;
* :mod:`~pyro_convexvb.posterior.hyper`: :class:`HyperPosterior`, the mixture over hyper-latent design points.

All of them are :class:`Posterior` objects: what they share is the protocol
:class:`~pyro_convexvb.posterior.base.Posterior`.
"""
from .base import Posterior
from .gaussian import GaussianPosterior
from .hyper import HyperPosterior
from .mixture import DiagMixturePosterior

__all__ = ["Posterior", "GaussianPosterior", "DiagMixturePosterior", "HyperPosterior"]
