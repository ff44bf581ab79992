"""Throughput of the online estimators of Shamir & Szpankowski 2021 (examples per second, one thread).

Stream: d = 200 binary features, d_t = 20 active per row on average, true weights N(0, 1)
(the Figure 1 / Table 1 setting).  Every method sees the same pre-generated CSR chunks; the
time is spent in ``partial_fit`` (input checks included, stream generation excluded).  In
the same run: the NumPy reference path of Algorithm 1 (a plain per-row NumPy loop) and
scikit-learn's ``SGDClassifier(loss="log_loss").partial_fit``, both per chunk and per row.
Rates are reported per second of process CPU time (stable on a shared machine) and of wall
time; the ratios use CPU time.

    python benchmarks/online.py            # T = 10^6
    python benchmarks/online.py --quick    # T = 2 * 10^5, fewer repeats (< 1 minute)
"""
import argparse
import json
import os
import platform
import sys
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import default_figures_dir, default_results_dir  # noqa: E402
from pyro_convexvb.online import (OnlineADF, OnlineAdaGradLogistic, OnlineBayesLogistic,  # noqa: E402
                                  OnlineDimGauss, OnlineMarginalVB, make_online_stream)

PAPER_RATE = 110_000  # examples/s of the paper's C++ implementation (Table 1: 1M examples in 9 s)


def _timed(fn, repeats):
    """Best (wall, CPU) examples/s over ``repeats`` calls of ``fn() -> rows processed``."""
    wall = cpu = 0.0
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        n = fn()
        w1, c1 = time.perf_counter(), time.process_time()
        wall = max(wall, n / (w1 - w0))
        cpu = max(cpu, n / max(c1 - c0, 1e-9))
    return wall, cpu


def _stream_through(make, chunks, n_rows):
    def run():
        model = make()
        done = 0
        for X, y in chunks:
            if done >= n_rows:
                break
            m = min(X.shape[0], n_rows - done)
            model.partial_fit(X[:m] if m < X.shape[0] else X, y[:m])
            done += m
        return done
    return run


def _sklearn_runs(chunks, n_rows, n_rows_single):
    from sklearn.linear_model import SGDClassifier

    classes = np.array([-1.0, 1.0])

    def per_chunk():
        clf = SGDClassifier(loss="log_loss")
        done = 0
        for X, y in chunks:
            if done >= n_rows:
                break
            clf.partial_fit(X, y, classes=classes)
            done += X.shape[0]
        return done

    def per_row():
        X, y = chunks[0]
        clf = SGDClassifier(loss="log_loss").partial_fit(X[0], y[:1], classes=classes)
        for t in range(1, n_rows_single):
            clf.predict_proba(X[t])  # progressive validation: predict, then update
            clf.partial_fit(X[t], y[t:t + 1])
        return n_rows_single - 1

    return per_chunk, per_row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = 2e5, one repeat")
    ap.add_argument("--T", type=float, default=None, help="rows per run (default 1e6, quick 2e5)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/online[_quick].json)")
    ap.add_argument("--fig", default=None, help="figure path (default docs/figures/online[_quick].png)")
    args = ap.parse_args(argv)
    stem = "online_quick" if args.quick else "online"
    args.out = args.out or os.path.join(default_results_dir(), f"{stem}.json")
    args.fig = args.fig or os.path.join(default_figures_dir(), f"{stem}.png")
    T = int(args.T or (2e5 if args.quick else 1e6))
    repeats = args.repeats or (1 if args.quick else 3)
    slow_rows = min(T, 20_000 if args.quick else 50_000)  # reference path, VB
    d, d_t = 200, 20
    stream = make_online_stream(d=d, d_t=d_t, weight_std=1.0, seed=0)
    chunks = list(stream.chunks(T, chunk_size=100_000))

    # compile the kernels once before timing
    for make in (lambda: OnlineBayesLogistic(d), lambda: OnlineBayesLogistic(d, prior_var=1.0),
                 lambda: OnlineAdaGradLogistic(d)):
        make().partial_fit(chunks[0][0][:50], chunks[0][1][:50])

    methods = [
        ("Algorithm 1, Taylor (17) + Laplace (19)", lambda: OnlineBayesLogistic(d, prior_var=1.0), T),
        ("Algorithm 1, prior_var='auto' (3 priors, Occam's window)", lambda: OnlineBayesLogistic(d), T),
        ("Algorithm 1, Taylor (17) + value (18)",
         lambda: OnlineBayesLogistic(d, prior_var=1.0, variance_update="value"), T),
        ("Algorithm 1, Newton (15) + Laplace (19)",
         lambda: OnlineBayesLogistic(d, prior_var=1.0, mean_update="newton"), T),
        ("Algorithm 1, Newton (15) + value (18)",
         lambda: OnlineBayesLogistic(d, prior_var=1.0, mean_update="newton", variance_update="value"), T),
        ("Algorithm 1 probit, Taylor (30) + Laplace (31)",
         lambda: OnlineBayesLogistic(d, prior_var=1.0, link="probit"), T),
        ("Algorithm 1, mini-batch 100", lambda: OnlineBayesLogistic(d, prior_var=1.0, batch_size=100), T),
        ("ADF (D.2)", lambda: OnlineADF(d), T),
        ("DimGauss, Taylor (D.1)", lambda: OnlineDimGauss(d, mean_update="taylor"), T),
        ("DimGauss, Newton (D.1)", lambda: OnlineDimGauss(d, mean_update="newton"), T),
        ("marginalised VB, N = 100 (D.3)", lambda: OnlineMarginalVB(d, num_samples=100), slow_rows // 5),
        ("SGD + AdaGrad", lambda: OnlineAdaGradLogistic(d, learning_rate=0.1), T),
        ("Algorithm 1, NumPy reference loop", lambda: OnlineBayesLogistic(d, prior_var=1.0, fast=False), slow_rows),
    ]
    rows = []
    for name, make, n in methods:
        wall, cpu = _timed(_stream_through(make, chunks, n), repeats if n == T else 1)
        rows.append({"method": name, "rows": n, "examples_per_s_wall": wall, "examples_per_s_cpu": cpu})
        print(f"  {name}: {wall:,.0f}/s wall, {cpu:,.0f}/s CPU", file=sys.stderr)
    try:
        per_chunk, per_row = _sklearn_runs(chunks, T, min(T, 5_000 if args.quick else 20_000))
    except ImportError:  # pragma: no cover
        per_chunk = None
    if per_chunk is not None:
        for name, fn, n, rep in [
                ("scikit-learn SGDClassifier.partial_fit, 10^5-row chunks", per_chunk, T, repeats),
                ("scikit-learn SGDClassifier predict_proba + partial_fit, per row", per_row,
                 min(T, 5_000 if args.quick else 20_000), 1)]:
            wall, cpu = _timed(fn, rep)
            rows.append({"method": name, "rows": n, "examples_per_s_wall": wall, "examples_per_s_cpu": cpu})
    ref = rows[0]["examples_per_s_cpu"]
    for r in rows:
        r["ratio_to_algorithm1"] = r["examples_per_s_cpu"] / ref
        r["ratio_to_paper_cpp"] = r["examples_per_s_cpu"] / PAPER_RATE
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    print(f"\n### Online throughput: d = {d}, d_t = {d_t}, T = {T:,} rows, best of {repeats}, one thread "
          f"(load average {load:.1f} on {os.cpu_count()} cores)\n")
    print("| method | rows timed | examples/s (CPU time) | examples/s (wall) | vs Algorithm 1 (Taylor) "
          "| vs paper's C++ (110k/s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['rows']:,} | {r['examples_per_s_cpu']:,.0f} | {r['examples_per_s_wall']:,.0f} "
              f"| {r['ratio_to_algorithm1']:.3f} | {r['ratio_to_paper_cpp']:.2f} |")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"setting": {"d": d, "d_t": d_t, "T": T, "repeats": repeats, "quick": args.quick,
                               "machine": platform.processor() or platform.machine(), "load_average": load,
                               "python": platform.python_version()},
                   "results": rows}, fh, indent=2)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return rows
    fig, ax = plt.subplots(figsize=(8, 5))
    names = [r["method"] for r in rows][::-1]
    vals = [r["examples_per_s_cpu"] for r in rows][::-1]
    ax.barh(range(len(vals)), vals, color=["C1" if "scikit" in n or "NumPy" in n else "C0" for n in names])
    ax.axvline(PAPER_RATE, color="k", ls="--", lw=1, label="paper's C++ (110k/s)")
    ax.axvline(200_000, color="C3", ls=":", lw=1, label="target 200k/s")
    ax.set_yticks(range(len(vals)), names, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("examples per second of CPU time (log scale)")
    ax.set_title(f"Online throughput, d={d}, d_t={d_t}, one thread")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.fig), exist_ok=True)
    fig.savefig(args.fig, dpi=120)
    return rows


if __name__ == "__main__":
    main()
