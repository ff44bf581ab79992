"""GP classification on the banana data with the dual VG engine: decision boundary and predictive uncertainty.

    python examples/gp_banana.py            # fixed kernel hyperparameters
    python examples/gp_banana.py --learn    # hyperparameters learned by maximising the dual VG bound

Writes ``docs/figures/dual_vg_banana.png`` (or ``dual_vg_banana_hyper.png``) and prints the bound,
test accuracy and NLPD.
"""
import argparse
import os
import time

import gpytorch
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pyro_convexvb.datasets import load_keel  # noqa: E402
from pyro_convexvb.gp.classifier import GPClassifier  # noqa: E402

FIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "figures")


def main(learn=False, n_train=400, seed=0):
    torch.set_num_threads(1)
    X, y, Xt, yt = load_keel("banana", test_size=0.3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    i = torch.randperm(X.shape[0], generator=g)[:n_train]
    X, y = X[i], y[i]
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale = 1.0 if learn else 0.5
    kernel.outputscale = 1.0 if learn else 4.0
    t0 = time.perf_counter()
    clf = GPClassifier(kernel, engine="dual_vg", learn_hyperparameters=learn).fit(X, y)
    secs = time.perf_counter() - t0
    acc, nlpd = clf.score(Xt, yt), clf.nlpd(Xt, yt)
    ls, os_ = float(clf.kernel_.base_kernel.lengthscale.detach()), float(clf.kernel_.outputscale.detach())
    print(f"{'learned' if learn else 'fixed'} hyperparameters: lengthscale {ls:.3f}, outputscale {os_:.3f}, "
          f"mean {clf.mean_:.3f}")
    print(f"fit {secs:.2f} s, exact VG bound {clf.log_evidence_bound_:.3f}, test accuracy {acc:.3f}, NLPD {nlpd:.3f}")

    lo, hi = X.min(0).values - 0.5, X.max(0).values + 0.5
    gx, gy = torch.meshgrid(torch.linspace(lo[0], hi[0], 120, dtype=X.dtype),
                            torch.linspace(lo[1], hi[1], 120, dtype=X.dtype), indexing="xy")
    grid = torch.stack([gx.reshape(-1), gy.reshape(-1)], -1)
    p = clf.predict_proba(grid)[:, 1].reshape(gx.shape)
    _, var = clf.predict_latent(grid)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    c0 = axes[0].contourf(gx, gy, p, levels=20, cmap="RdBu_r", vmin=0, vmax=1)
    axes[0].contour(gx, gy, p, levels=[0.5], colors="k", linewidths=1.5)
    fig.colorbar(c0, ax=axes[0], label="P(y = 1)")
    c1 = axes[1].contourf(gx, gy, np.sqrt(var).reshape(gx.shape), levels=20, cmap="viridis")
    axes[1].contour(gx, gy, p, levels=[0.5], colors="w", linewidths=1.0)
    fig.colorbar(c1, ax=axes[1], label="latent predictive std")
    for ax in axes:
        ax.scatter(X[:, 0], X[:, 1], c=y, cmap="bwr", s=8, edgecolors="k", linewidths=0.2)
        ax.set_xlim(lo[0], hi[0]); ax.set_ylim(lo[1], hi[1])
    axes[0].set_title(f"DualVG GP classifier ({'learned' if learn else 'fixed'} kernel): acc {acc:.3f}, NLPD {nlpd:.3f}",
                      fontsize=9)
    axes[1].set_title(f"predictive uncertainty; bound {clf.log_evidence_bound_:.1f} nats", fontsize=9)
    fig.tight_layout()
    os.makedirs(FIG_DIR, exist_ok=True)
    path = os.path.join(FIG_DIR, "dual_vg_banana_hyper.png" if learn else "dual_vg_banana.png")
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")
    return clf


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learn", action="store_true", help="learn kernel hyperparameters and mean")
    ap.add_argument("--n-train", type=int, default=400)
    a = ap.parse_args()
    main(learn=a.learn, n_train=a.n_train)
