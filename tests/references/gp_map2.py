"""The type-II maximum a posteriori of a GP classifier with a GPyTorch kernel prior, by direct search, stored as JSON.

The objective over ``z = (mean, log outputscale, log lengthscale)`` is the one ``GPClassifier(learn_hyperparameters=
True)`` maximises: the ``dual_vg`` evidence bound of the GP classification model at fixed hyperparameters (each
value a separate fit at a fixed kernel, ``gap_tol=1e-12``) plus the log density of the lengthscale's prior at the
lengthscale (GPyTorch's convention: no Jacobian). It is maximised by Powell's derivative-free method from the
type-II loop's start, independent of the envelope-theorem gradients and the L-BFGS-B loop under test. About 1,300
fits (~15 s), so it is computed once and stored in ``gp_map2.json``; the test recomputes the objective at the stored
optimum live to show the stored value is this function's.

Usage (from the repository root)::

    python tests/references/gp_map2.py     # rewrites gp_map2.json
"""
import json
import math
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "gp_map2.json")

#: the lengthscale prior: Gamma(concentration, rate), mode (a - 1) / b = 4.99, sd 0.22
PRIOR = (500.0, 100.0)


def data():
    """60 points in 2-D with labels from a logistic model of ``2 sin(2 x_1) + x_2`` (seed 0)."""
    from scipy.special import expit

    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    y = (rng.random(60) < expit(2 * np.sin(2 * X[:, 0]) + X[:, 1])).astype(int)
    return X, y


def negative_objective(z, X, y):
    """``-(B(mean, outputscale, lengthscale) + log p(lengthscale))`` at ``z = (mean, log os, log ls)``."""
    import gpytorch
    import torch

    from pyro_convexvb.gp import GPClassifier

    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.outputscale = math.exp(z[1])
    k.base_kernel.lengthscale = math.exp(z[2])
    fit = GPClassifier(kernel=k, mean=float(z[0]), options={"gap_tol": 1e-12}).fit(X, y)
    prior = gpytorch.priors.GammaPrior(*PRIOR)
    return -(fit.log_evidence_bound_ + float(prior.log_prob(torch.tensor(math.exp(z[2]), dtype=torch.float64))))


def reference():
    """Powell's method from the type-II loop's start (mean 0, GPyTorch's initial outputscale and lengthscale,
    softplus(0) = log 2 each)."""
    import scipy.optimize

    X, y = data()
    z0 = np.array([0.0, math.log(math.log(2.0)), math.log(math.log(2.0))])
    res = scipy.optimize.minimize(negative_objective, z0, args=(X, y), method="Powell",
                                  options=dict(xtol=1e-6, ftol=1e-12, maxfev=5000))
    return {"z": res.x.tolist(), "negative_objective": float(res.fun), "evaluations": int(res.nfev),
            "message": str(res.message)}


def load():
    with open(PATH) as f:
        return json.load(f)


if __name__ == "__main__":
    out = {"description": __doc__.splitlines()[0], "prior": list(PRIOR), **reference()}
    with open(PATH, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(out)
