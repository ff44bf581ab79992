"""Site families: one module per likelihood/prior family, each answering every engine's question about it.

A family (:class:`~.base.SiteFamily`) holds the rows' data and parameters and owns its log-density, its Gaussian
expectations, its super-Gaussian potential (``convex_relaxation``), its local variational bound (``dual_vg``) and
how it is read from a Pyro site. Adding a family is one module here plus one entry of :data:`LIKELIHOODS`
(``docs/architecture_families.md``).
"""
from .base import SiteFamily, Weighted, gauss_hermite, gaussian_expectation, tempered
from .binomial import Binomial
from .categorical import Categorical
from .gamma import GammaLog
from .gaussian import Gaussian
from .laplace import Laplace
from .logit import BernoulliLogit
from .negative_binomial import NegativeBinomial
from .poisson import Poisson
from .probit import BernoulliProbit
from .stochastic_volatility import StochasticVolatility
from .student_t import StudentT

__all__ = ["SiteFamily", "BernoulliLogit", "BernoulliProbit", "Binomial", "NegativeBinomial", "GammaLog", "Poisson",
           "Gaussian", "Laplace", "StudentT", "Categorical", "StochasticVolatility", "Weighted", "tempered", "gauss_hermite", "gaussian_expectation",
           "LIKELIHOODS"]

#: the families extraction reads from observed Pyro sites, asked in this order (:meth:`~.base.SiteFamily.predictor`;
#: probit before logit: both read a ``Bernoulli``; stochastic volatility before Gaussian: both read a ``Normal``)
LIKELIHOODS = (BernoulliProbit, BernoulliLogit, Binomial, NegativeBinomial, Poisson, StochasticVolatility, Gaussian,
               StudentT, Laplace, GammaLog, Categorical)
