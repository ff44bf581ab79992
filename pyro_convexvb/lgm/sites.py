"""Per-row site families ``t_i(s_i)`` of a latent Gaussian model (they live in :mod:`pyro_convexvb.lgm.families`)."""
from .families import (  # noqa: F401
    BernoulliLogit,
    BernoulliProbit,
    Gaussian,
    Laplace,
    Poisson,
    SiteFamily,
    StochasticVolatility,
    StudentT,
    Weighted,
    gauss_hermite,
    gaussian_expectation,
    tempered,
)

__all__ = ["SiteFamily", "BernoulliLogit", "BernoulliProbit", "Poisson", "Gaussian", "Laplace", "StudentT",
           "StochasticVolatility", "Weighted", "tempered", "gauss_hermite", "gaussian_expectation"]
