"""Shared factories of the estimator tests: every scikit-learn estimator of the package at quick settings, and
small binary problems (imported as ``from _estimators import ...``; a module of its own, since ``conftest`` names
more than one file in this tree)."""

#: GLM trains by SVI; scikit-learn's checks fit it ~40 times, so the factories give it a small (sufficient) budget
GLM_QUICK = dict(max_iter=60, min_steps=60, window=20, lr=0.1)


def estimator_factories():
    """``{name: () -> estimator}``: every scikit-learn estimator of the package, at settings that fit in well under
    a second on the checks' data (``tests/test_sklearn_contract.py``, ``tests/test_estimator_base.py``)."""
    import pyro_convexvb as pcv
    from pyro_convexvb.gp import GPClassifier
    from pyro_convexvb.online import (OnlineADF, OnlineAdaGradLogistic, OnlineBayesLogistic, OnlineDimGauss,
                                      OnlineMarginalVB)

    return {"logistic": lambda: pcv.BayesianLogisticRegression(),
            "logistic_auto": lambda: pcv.BayesianLogisticRegression(prior_scale="auto"),
            "glm_bernoulli": lambda: pcv.GLM("bernoulli", **GLM_QUICK),
            "glm_gaussian": lambda: pcv.GLM("gaussian", **GLM_QUICK),
            "blr": lambda: pcv.BayesianLinearRegression(fit_intercept=True),
            "gp": lambda: GPClassifier(),
            "online_bayes": lambda: OnlineBayesLogistic(),
            "online_adf": lambda: OnlineADF(),
            "online_dimgauss": lambda: OnlineDimGauss(),
            "online_marginal_vb": lambda: OnlineMarginalVB(num_samples=16),
            "online_adagrad": lambda: OnlineAdaGradLogistic()}


def binary_problem(n=80, d=3, seed=0):
    """A float64 logistic-regression problem ``(X (n, d), y (n,) in {0, 1})`` with weights ``(1.5, -1, 0.5, ...)``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    w = np.resize([1.5, -1.0, 0.5], d)
    return X, (rng.random(n) < 1 / (1 + np.exp(-X @ w))).astype(np.int64)


def cancer_problem(n=150, d=6, seed=0):
    """``n`` random rows and the first ``d`` features of scikit-learn's breast-cancer data ``(X, y in {0, 1})``."""
    import numpy as np
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    idx = np.random.default_rng(seed).permutation(X.shape[0])[:n]
    return X[idx, :d], y[idx]
