"""Bayesian active learning and experimental design on the convex relaxation (Nickisch & Seeger 2009 §3; Seeger 2010 §2.2).

* :mod:`.scores` -- classifier uncertainty, information gain, ``Delta(X_*) = log|I + X_* Cov X_*^T|``,
  rank-one marginal updates.
* :mod:`.imaging` -- matrix-free Haar, difference and Fourier-column operators, phase-encode scores,
  the compressive-sensing model of Seeger 2010 §5 and its exact MAP.
* :mod:`.imaging_map` -- :func:`imaging_map`, the fast exact MAP of that model (ADMM whose linear step is one FFT
  solve).
* :mod:`.sequential` -- :class:`SequentialPhaseEncodeDesign`, the warm-started sequential design of k-space
  column pairs of Seeger 2010 §5, and the conjugate-pair bookkeeping (:func:`pair_candidates`,
  :func:`known_columns`, :func:`lowpass_pairs`).
* :mod:`.active` -- :class:`ActiveLearner`, sequential inclusion with a joint refit every ``refit_every``
  inclusions.

Everything here is built on the public API of :mod:`pyro_convexvb.infer.convex_relaxation`
(the engine, :func:`~pyro_convexvb.infer.convex_relaxation.predictive_marginals`,
:func:`~pyro_convexvb.infer.convex_relaxation.site_designs`,
:func:`~pyro_convexvb.infer.convex_relaxation.laplace_map`) and of :mod:`pyro_convexvb.linalg`.
"""
from .active import ActiveHistory, ActiveLearner
from .imaging import (
    compressive_sensing_model,
    covariance_factor,
    difference_operator,
    fourier_columns_operator,
    haar_operator,
    laplace_map,
    phase_encode_scores,
)
from .imaging_map import imaging_map
from .sequential import (
    DesignHistory,
    SequentialPhaseEncodeDesign,
    known_columns,
    lowpass_pairs,
    pair_candidates,
)
from .scores import (
    RankOneUpdate,
    classifier_uncertainty,
    design_score,
    information_gain,
    lanczos_covariance_factor,
    minimize_site_phi,
    predictive_probability,
    rank_one_include,
    site_phi,
    tilted_kl,
)

__all__ = [
    "ActiveLearner",
    "ActiveHistory",
    "haar_operator",
    "difference_operator",
    "fourier_columns_operator",
    "phase_encode_scores",
    "compressive_sensing_model",
    "laplace_map",
    "imaging_map",
    "covariance_factor",
    "SequentialPhaseEncodeDesign",
    "DesignHistory",
    "pair_candidates",
    "known_columns",
    "lowpass_pairs",
    "RankOneUpdate",
    "classifier_uncertainty",
    "design_score",
    "information_gain",
    "lanczos_covariance_factor",
    "minimize_site_phi",
    "predictive_probability",
    "rank_one_include",
    "site_phi",
    "tilted_kl",
]
