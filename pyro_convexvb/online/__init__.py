"""Online sparse Bayesian logistic and probit regression (seed 003, Shamir & Szpankowski)."""
from .baselines import OnlineADF, OnlineAdaGradLogistic, OnlineDimGauss, OnlineMarginalVB
from .logistic import OnlineBayesLogistic

__all__ = [
    "OnlineBayesLogistic",
    "OnlineADF",
    "OnlineDimGauss",
    "OnlineMarginalVB",
    "OnlineAdaGradLogistic",
]
