"""Online sparse Bayesian logistic and probit regression (Shamir & Szpankowski 2021, Shamir & Szpankowski).

* :class:`OnlineBayesLogistic` -- Algorithm 1 (marginalised closed-form updates);
* baselines in the same API: :class:`OnlineADF`, :class:`OnlineDimGauss`,
  :class:`OnlineMarginalVB`, :class:`OnlineAdaGradLogistic`;
* streams: :func:`make_online_stream`, :func:`iter_svmlight`, :func:`iter_csv`,
  :func:`iter_criteo`, :func:`hash_features`, :func:`progressive_regret`;
* row-sharded streams: :class:`ShardedOnline` (periodic merging in natural parameters over
  ``torch.distributed`` ranks, an approximation of the sequential algorithm), :func:`simulate_sharded`.

The numba kernels (``pip install 'pyro_convexvb[fast]'``) are used when available; the NumPy
reference path in :mod:`pyro_convexvb.online.equations` works without them.
"""
from .baselines import OnlineADF, OnlineAdaGradLogistic, OnlineDimGauss, OnlineMarginalVB
from .sharded import ShardedOnline, simulate_sharded
from .bayes_logistic import OnlineBayesLogistic
from .streams import (DEFAULT_CHUNK_ROWS, FIRST_CHUNK_ROWS, OnlineStream, hash_features, iter_criteo, iter_csv,
                      iter_svmlight, make_online_stream, progressive_regret)

__all__ = [
    "OnlineBayesLogistic",
    "OnlineADF",
    "OnlineDimGauss",
    "OnlineMarginalVB",
    "OnlineAdaGradLogistic",
    "OnlineStream",
    "make_online_stream",
    "hash_features",
    "iter_svmlight",
    "iter_csv",
    "iter_criteo",
    "DEFAULT_CHUNK_ROWS",
    "FIRST_CHUNK_ROWS",
    "progressive_regret",
    "ShardedOnline",
    "simulate_sharded",
]
