"""Regret of the online methods of Shamir & Szpankowski 2021 (Table 1, Figure 1, Figure 2 left).

Settings (true weights drawn once per setting, comparator w* = true weights, progressive
validation, R_t of Eq. (4), r_T = R_T / log T):

* ``dt20`` / ``dt40``: d = 200 random binary features, E[d_t] = 20 / 40, weights N(0, 1),
  prior N(0, 1) for Algorithm 1 (Figure 1, Table 1);
* ``longtail``: 22 categories of 2^j features (j = 1..22, 8.4M features), one Zipf(1.75)
  draw per category, weights N(0, 4), prior N(0, 4) for Algorithm 1 (Figure 2, left).

Methods: Algorithm 1 with Newton (15) or Taylor (17) means and Laplace (19) or value (18)
variances, ADF (D.2), DimGauss (D.1, Newton form) and SGD with AdaGrad.  As in §4 of the paper the
baselines' hyper-parameters (prior variance, learning rate) are picked from a grid in
hindsight; Algorithm 1 uses the true prior.  The mini-batch mode (natural-parameter sums) is
measured for several batch sizes, and marginalised VB with N = 100 samples on a shorter prefix.
All models of a setting share one pass over the stream.

    python benchmarks/online_regret.py                 # T = 10^6, all settings
    python benchmarks/online_regret.py --T 1e7 --settings dt20 --grid small
    python benchmarks/online_regret.py --quick         # T = 5 * 10^4, smaller long-tail model
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
                                  OnlineDimGauss, OnlineMarginalVB, make_online_stream, progressive_regret)

# Table 1 of Shamir & Szpankowski 2021: r_T at T = 10^6 and 10^7 for d_t = 20 and 40.
PAPER = {
    ("dt20", 10**6): {"SGD": 117.6, "ADF": 190.3, "DimGauss": 78.02, "Gauss": 77.66, "ApproxG": 77.66,
                      "VB-100": 144.22, "VB-1000": 85.07},
    ("dt20", 10**7): {"SGD": 135.9, "ADF": 540.3, "DimGauss": 82.54, "Gauss": 93.85, "ApproxG": 93.85,
                      "VB-100": 649.57},
    ("dt40", 10**6): {"SGD": 246.3, "ADF": 178.6, "DimGauss": 97.52, "Gauss": 91.5, "ApproxG": 91.5,
                      "VB-100": 202.9, "VB-1000": 104.31},
    ("dt40", 10**7): {"SGD": 219.88, "ADF": 388.51, "DimGauss": 109.16, "Gauss": 144.28, "ApproxG": 144.28,
                      "VB-100": 1125.3},
}


def make_setting(name, quick):
    if name == "dt20":
        return make_online_stream(d=200, d_t=20, weight_std=1.0, seed=20), 1.0
    if name == "dt40":
        return make_online_stream(d=200, d_t=40, weight_std=1.0, seed=40), 1.0
    if name == "longtail":
        top = 14 if quick else 22
        sizes = [2**j for j in range(1, top + 1)]
        return make_online_stream(d=None, d_t=None, weight_std=2.0, categorical=sizes, zipf=1.75, seed=22), 4.0
    raise ValueError(f"--settings: unknown setting {name!r}")


def build_models(d, prior_var, emp_var, grid):
    """``{label: (family, hyper-parameter, estimator)}``."""
    models = {
        "Gauss-L (Newton 15, Laplace 19)": ("Algorithm 1", None, OnlineBayesLogistic(
            d, prior_var=prior_var, mean_update="newton", variance_update="laplace")),
        "Gauss-G (Newton 15, value 18)": ("Algorithm 1", None, OnlineBayesLogistic(
            d, prior_var=prior_var, mean_update="newton", variance_update="value")),
        "ApproxL (Taylor 17, Laplace 19)": ("Algorithm 1", None, OnlineBayesLogistic(d, prior_var=prior_var)),
        "ApproxG (Taylor 17, value 18)": ("Algorithm 1", None, OnlineBayesLogistic(
            d, prior_var=prior_var, variance_update="value")),
        f"ApproxG, prior var = empirical {emp_var:.3f}": ("Algorithm 1 (empirical prior)", None, OnlineBayesLogistic(
            d, prior_var=emp_var, variance_update="value")),
    }
    scale = prior_var
    if grid == "full":
        adf_grid = [0.25, 0.5, 1.0, 2.0, 4.0]
        dim_grid = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
        lr_grid = [0.1, 0.2, 0.3, 0.5, 1.0]
        batches = [10, 100, 1000]
    else:  # the neighbourhood of the best values of the full grid at T = 10^6
        adf_grid = [1.0]
        dim_grid = [8.0]
        lr_grid = [0.2, 0.3]
        batches = [10]
    for g in adf_grid:
        models[f"ADF, prior var {g * scale:g}"] = ("ADF", g * scale, OnlineADF(d, prior_var=g * scale))
    for g in dim_grid:  # the Newton form (37)-(40); the Taylor form (42)-(46) overshoots for large priors
        models[f"DimGauss, prior var {g * scale:g}"] = ("DimGauss", g * scale, OnlineDimGauss(
            d, prior_var=g * scale, mean_update="newton"))
    for lr in lr_grid:
        models[f"SGD AdaGrad, eta {lr:g}"] = ("SGD AdaGrad", lr, OnlineAdaGradLogistic(d, learning_rate=lr))
    for b in batches:
        models[f"ApproxL, mini-batch {b}"] = (f"mini-batch {b}", b, OnlineBayesLogistic(d, prior_var=prior_var,
                                                                                        batch_size=b))
    return models


def run_setting(name, T, quick, grid, vb_T, chunk_size):
    stream, prior_var = make_setting(name, quick)
    d = stream.num_features
    emp_var = float(np.var(stream.theta))
    models = build_models(d, prior_var, emp_var, grid)
    w0 = time.perf_counter()
    res = progressive_regret({k: v[2] for k, v in models.items()}, stream, T, chunk_size=chunk_size)
    wall = time.perf_counter() - w0
    out = {"T": T, "d": d, "prior_var": prior_var, "empirical_weight_var": emp_var, "wall_seconds": wall,
           "methods": {}}
    for k, (family, hyper, _) in models.items():
        r = res[k]
        out["methods"][k] = {"family": family, "hyper": hyper, "r_T": r["r_T"], "R_T": r["R_T"],
                             "seconds": r["seconds"], "t": r["t"].tolist(), "regret": r["regret"].tolist()}
    if vb_T:
        vb = {"VB-100 (D.3)": OnlineMarginalVB(d, prior_var=prior_var, num_samples=100, random_state=0),
              "ApproxL (Taylor 17, Laplace 19)": OnlineBayesLogistic(d, prior_var=prior_var),
              "Gauss-L (Newton 15, Laplace 19)": OnlineBayesLogistic(d, prior_var=prior_var, mean_update="newton")}
        rv = progressive_regret(vb, stream, vb_T, chunk_size=min(chunk_size, 10_000))
        out["vb"] = {"T": vb_T, "methods": {k: {"r_T": v["r_T"], "R_T": v["R_T"], "seconds": v["seconds"]}
                                            for k, v in rv.items()}}
    return out


def best_per_family(setting):
    best = {}
    for k, m in setting["methods"].items():
        f = m["family"]
        if f == "Algorithm 1":
            best[k] = m
        elif f not in best or m["r_T"] < best[f]["r_T"]:
            best[f] = dict(m, label=k)
    return best


def paper_key(label):
    for key, name in (("Gauss-", "Gauss"), ("ApproxG (", "ApproxG"), ("ADF", "ADF"), ("DimGauss", "DimGauss"),
                      ("SGD", "SGD")):
        if label.startswith(key):
            return name
    return None


def print_tables(results, T):
    names = list(results)
    print(f"\n### Regret coefficients r_T = R_T / log T at T = {T:,} (Shamir & Szpankowski 2021, Table 1 / Figures 1-2)\n")
    head = "| method | " + " | ".join(f"{n}: r_T | {n}: time (s)" for n in names) + " |"
    print(head)
    print("|---|" + "---:|---:|" * len(names))
    per = {n: best_per_family(results[n]) for n in names}
    labels = []
    for n in names:
        for k in per[n]:
            if k not in labels:
                labels.append(k)
    for k in labels:
        cells = []
        for n in names:
            m = per[n].get(k)
            if m is None:
                cells += ["", ""]
                continue
            tag = f" ({m['label'].split(', ', 1)[1]})" if "label" in m and not k.startswith("mini-batch") else ""
            cells += [f"{m['r_T']:.2f}{tag}", f"{m['seconds']:.1f}"]
        print(f"| {k} | " + " | ".join(cells) + " |")
    paper_cols = [n for n in names if (n, T) in PAPER]
    if paper_cols:
        print(f"\nShamir & Szpankowski 2021, Table 1 at T = {T:,} for comparison (their draw of the weights, their C++):\n")
        print("| method | " + " | ".join(f"{n}: r_T (paper)" for n in paper_cols) + " |")
        print("|---|" + "---:|" * len(paper_cols))
        for key in ["Gauss", "ApproxG", "DimGauss", "ADF", "SGD", "VB-100", "VB-1000"]:
            vals = [PAPER[(n, T)].get(key) for n in paper_cols]
            print(f"| {key} | " + " | ".join("" if v is None else f"{v}" for v in vals) + " |")
    if any("vb" in results[n] for n in names):
        print("\n### Marginalised VB (N = 100 samples) on a prefix of the same streams\n")
        print("| setting | T | method | r_T | time (s) |")
        print("|---|---:|---|---:|---:|")
        for n in names:
            if "vb" in results[n]:
                v = results[n]["vb"]
                for k, m in v["methods"].items():
                    print(f"| {n} | {v['T']:,} | {k} | {m['r_T']:.2f} | {m['seconds']:.1f} |")
    print("\n### Regret cost of the mini-batch mode (ApproxL, natural-parameter sums)\n")
    print("| setting | batch size | r_T | r_T - r_T(sequential) |")
    print("|---|---:|---:|---:|")
    for n in names:
        seq = results[n]["methods"]["ApproxL (Taylor 17, Laplace 19)"]["r_T"]
        print(f"| {n} | 1 | {seq:.2f} | 0 |")
        for k, m in results[n]["methods"].items():
            if m["family"].startswith("mini-batch"):
                print(f"| {n} | {m['hyper']} | {m['r_T']:.2f} | {m['r_T'] - seq:+.2f} |")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(2, len(names), figsize=(5.2 * len(names), 8.0), squeeze=False)
    titles = {"dt20": "d=200, E[d_t]=20, std 1", "dt40": "d=200, E[d_t]=40, std 1",
              "longtail": "22 Zipf(1.75) categories, std 2"}
    for col, n in enumerate(names):
        best = best_per_family(results[n])
        ax, bx = axes[0, col], axes[1, col]
        top = 0.0
        for i, (k, m) in enumerate(best.items()):
            t = np.asarray(m["t"], dtype=float)
            r = np.asarray(m["regret"])
            sel = t >= 100
            lab = k if "label" not in m else m["label"]
            curve = r[sel] / np.log(t[sel])
            if m["family"].startswith("mini-batch"):
                bx.plot(t[sel], curve, "--", lw=1.3, label=lab)
                continue
            ls = "-" if m["family"].startswith("Algorithm 1") else "--"
            ax.plot(t[sel], curve, ls, lw=1.3, label=lab, color=f"C{i % 10}")
            if m["family"].startswith("Algorithm 1"):
                top = max(top, float(np.max(curve)))
            if k.startswith("ApproxL ("):
                bx.plot(t[sel], curve, "-", lw=1.6, color="k", label=k + ", sequential")
        ax.set_ylim(0, 3.5 * top)
        ax.set_title(titles.get(n, n), fontsize=10)
        bx.set_yscale("log")
        bx.set_title(f"{titles.get(n, n)}: mini-batch mode", fontsize=10)
        for a in (ax, bx):
            a.set_xscale("log")
            a.set_xlabel("round t")
            a.set_ylabel("R_t / log t")
            a.grid(alpha=0.3)
            a.legend(fontsize=6.5)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = 5e4, small long-tail model, small grid")
    ap.add_argument("--T", type=float, default=None, help="stream length (default 1e6)")
    ap.add_argument("--settings", default="dt20,dt40,longtail")
    ap.add_argument("--grid", choices=["full", "small"], default=None)
    ap.add_argument("--vb-T", type=float, default=None, help="prefix for VB-100 (default 1e5, quick 5e3, 0: skip)")
    ap.add_argument("--chunk-size", type=int, default=100_000)
    ap.add_argument("--name", default=None, help="output name (default online_regret, or online_regret_T<T>)")
    ap.add_argument("--replot", default=None, help="reprint the tables and redraw the figure from a results JSON")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as fh:
            saved = json.load(fh)
        stem = os.path.splitext(os.path.basename(args.replot))[0]
        print_tables(saved["settings"], saved["T"])
        plot(saved["settings"], os.path.join(default_figures_dir(), f"{stem}.png"))
        return saved
    T = int(args.T or (5e4 if args.quick else 1e6))
    grid = args.grid or ("small" if args.quick else "full")
    vb_T = int(args.vb_T if args.vb_T is not None else (5e3 if args.quick else 1e5))
    vb_T = min(vb_T, T)
    name = args.name or ("online_regret" if T == 10**6 or args.quick else f"online_regret_T{T:.0e}".replace("+", ""))
    if args.quick and args.name is None:
        name = "online_regret_quick"
    results = {}
    for s in args.settings.split(","):
        t0 = time.perf_counter()
        results[s] = run_setting(s, T, args.quick, grid, vb_T, args.chunk_size)
        print(f"  {s}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print_tables(results, T)
    out = os.path.join(default_results_dir(), f"{name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump({"T": T, "grid": grid, "quick": args.quick, "python": platform.python_version(),
                   "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                   "settings": results}, fh)
    plot(results, os.path.join(default_figures_dir(), f"{name}.png"))
    return results


if __name__ == "__main__":
    main()
