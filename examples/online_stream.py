"""Stream an svmlight file through Algorithm 1 in constant memory, checkpoint, and resume.

A synthetic Figure-1 stream (d = 200, E[d_t] = 20) is written to a temporary svmlight file,
read back in chunks, learned online with progressive validation, checkpointed half way with
``state_dict`` (to a pickle) and resumed in a fresh estimator.  Prints a table of the
progressive log-loss, regret against the true weights and the per-example predictive
uncertainty of a few rows.

    python examples/online_stream.py
"""
import os
import pickle
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pyro_convexvb.online import OnlineBayesLogistic, iter_svmlight, make_online_stream  # noqa: E402


def write_svmlight(path, X, y):
    with open(path, "w") as fh:
        for t in range(X.shape[0]):
            row = X[t]
            feats = " ".join(f"{j + 1}:{v:g}" for j, v in zip(row.indices, row.data))
            fh.write(f"{int(y[t])} {feats}\n")


def main(T=100_000, chunk_size=10_000):
    stream = make_online_stream(d=200, d_t=20, weight_std=1.0, seed=0)
    X, y = stream.take(T)
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "stream.svm")
    write_svmlight(path, X, y)

    model = OnlineBayesLogistic(200, prior_var=1.0)
    losses = []
    checkpoint = os.path.join(tmp, "state.pkl")
    for k, (Xc, yc) in enumerate(iter_svmlight(path, chunk_size=chunk_size, num_features=200)):
        losses.append(model.partial_fit(Xc, yc, return_log_loss=True))
        if (k + 1) * chunk_size == T // 2:  # checkpoint, drop the model, resume from disk
            with open(checkpoint, "wb") as fh:
                pickle.dump(model.state_dict(), fh)
            del model
            with open(checkpoint, "rb") as fh:
                model = OnlineBayesLogistic.from_state_dict(pickle.load(fh))
    ll = np.concatenate(losses)
    comp = np.logaddexp(0.0, -y * (X @ stream.theta))
    print(f"{T:,} rows from {os.path.basename(path)} in chunks of {chunk_size:,}, resumed after {T // 2:,}\n")
    print("| rows | average progressive log-loss | true-weight log-loss | R_t / log t |")
    print("|---:|---:|---:|---:|")
    for t in [1_000, 10_000, T // 2, T]:
        R = float(np.sum(ll[:t] - comp[:t]))
        print(f"| {t:,} | {ll[:t].mean():.4f} | {comp[:t].mean():.4f} | {R / np.log(t):.1f} |")
    mu_t, s2_t = model.score_moments(X[:5])
    p = model.predict_proba(X[:5])[:, 1]
    print("\n| row | score mean | score std | P(y = 1) | true P(y = 1) |")
    print("|---:|---:|---:|---:|---:|")
    true_p = 1 / (1 + np.exp(-(X[:5] @ stream.theta)))
    for t in range(5):
        print(f"| {t} | {mu_t[t]:+.3f} | {np.sqrt(s2_t[t]):.3f} | {p[t]:.3f} | {true_p[t]:.3f} |")
    print(f"\nmax |coef_ - theta| = {np.abs(model.coef_ - stream.theta).max():.3f}, "
          f"mean posterior std = {np.sqrt(model.coef_var_).mean():.4f}")


if __name__ == "__main__":
    main()
