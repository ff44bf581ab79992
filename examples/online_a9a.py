"""Online Bayesian logistic regression on a9a (UCI Adult, 32,561 rows, 123 binary features).

One pass in a random order, progressive validation: each row is predicted before it is
learned.  Prints the average progressive log-loss of Algorithm 1 (Shamir & Szpankowski 2021) and of the
baselines, and draws the running average (``docs/figures/online_a9a.png``).  The per-feature
posterior variances of Algorithm 1 are compared with the number of times each feature was
seen -- the paper's remark that uncertainty is mostly a function of the counts.

    python examples/online_a9a.py
"""
import os
import sys

import numpy as np
import scipy.sparse as sp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pyro_convexvb.online import (OnlineADF, OnlineAdaGradLogistic, OnlineBayesLogistic,  # noqa: E402
                                  OnlineDimGauss)

DATA = os.path.join(ROOT, "..", "shared", "data", "a9a")


def load_a9a():
    rows = open(os.path.join(DATA, "a9a_inputs.csv")).read().split("\n")
    rows = [r for r in rows if r.strip()]
    cols = [np.array(r.split(","), dtype=np.int64) for r in rows]
    indptr = np.concatenate([[0], np.cumsum([len(c) for c in cols])])
    X = sp.csr_matrix((np.ones(indptr[-1]), np.concatenate(cols), indptr), shape=(len(cols), 124))
    y = np.array(open(os.path.join(DATA, "a9a_targets.csv")).read().strip().split(","), dtype=float)
    X = sp.hstack([X, np.ones((X.shape[0], 1))], format="csr")  # a bias feature
    return X, y


def main():
    if not os.path.isdir(DATA):
        print(f"a9a not found at {DATA}; skipping")
        return
    X, y = load_a9a()
    order = np.random.default_rng(0).permutation(X.shape[0])
    X, y = X[order], y[order]
    d = X.shape[1]
    models = {
        "Algorithm 1 (Taylor, Laplace), prior var 1": OnlineBayesLogistic(d, prior_var=1.0),
        "Algorithm 1 (Newton, value), prior var 1": OnlineBayesLogistic(d, prior_var=1.0, mean_update="newton",
                                                                         variance_update="value"),
        "Algorithm 1 probit, prior var 1": OnlineBayesLogistic(d, prior_var=1.0, link="probit"),
        "ADF, prior var 1": OnlineADF(d),
        "DimGauss, prior var 1": OnlineDimGauss(d),
        "SGD AdaGrad, eta 0.1": OnlineAdaGradLogistic(d, learning_rate=0.1),
        "SGD AdaGrad, eta 0.5": OnlineAdaGradLogistic(d, learning_rate=0.5),
    }
    curves = {}
    print(f"a9a, {X.shape[0]:,} rows, {d} features, one pass, progressive validation\n")
    print("| method | average progressive log-loss |")
    print("|---|---:|")
    for name, m in models.items():
        ll = m.partial_fit(X, y, return_log_loss=True)
        curves[name] = np.cumsum(ll) / np.arange(1, len(ll) + 1)
        print(f"| {name} | {ll.mean():.4f} |")
    counts = np.asarray((X != 0).sum(0)).ravel()
    alg = models["Algorithm 1 (Taylor, Laplace), prior var 1"]
    seen = counts > 0
    rho = np.corrcoef(np.log(counts[seen]), np.log(alg.coef_var_[seen]))[0, 1]
    print(f"\ncorrelation of log(count) and log(posterior variance) over features: {rho:.3f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    t = np.arange(1, X.shape[0] + 1)
    for name, c in curves.items():
        a.plot(t[100:], c[100:], lw=1.2, label=name)
    a.set_xscale("log")
    a.set_xlabel("rows seen")
    a.set_ylabel("average progressive log-loss")
    a.set_title("a9a, one pass")
    a.legend(fontsize=7)
    b.loglog(counts[seen], alg.coef_var_[seen], ".", ms=4)
    b.set_xlabel("times the feature was seen")
    b.set_ylabel("posterior variance (Algorithm 1)")
    b.set_title("per-feature uncertainty vs counts")
    fig.tight_layout()
    out = os.path.join(ROOT, "docs", "figures", "online_a9a.png")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"figure: {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
