"""Experiment 1 of Nickisch & Seeger 2009 (Figure 2 protocol): Bayesian active learning on the convex relaxation.

Start from a few random training cases, all remaining training cases are candidates; include cases
sequentially by classifier uncertainty (S_CU), information gain (S_IG) or at random, refitting the
posterior every ``refit_every`` inclusions (Nickisch & Seeger 2009 §3's blocks), and track the test
error of the posterior mean classifier. The error of the relaxation fitted on the full training set is
the reference line. Logistic regression (bias as a constant feature),
prior N(0, 1) per weight (sigma^2 = 1, tau = 1 as in Nickisch & Seeger 2009), and a Laplace-prior variant on a9a.

Usage::

    python benchmarks/active_learning.py --quick      # a9a (3000-case pool) + spambase, ~1 minute
    python benchmarks/active_learning.py              # a9a 16000 (Gaussian and Laplace), spambase, magic

Writes ``benchmarks/results/active_learning[_quick].json`` and ``docs/figures/active_learning[_quick].png``.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402
from _common import make_parser, markdown_table, parse_args, save_figure, write_json  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402
from pyro_convexvb.datasets import load_a9a, load_keel  # noqa: E402
from pyro_convexvb.design import ActiveLearner  # noqa: E402
from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation  # noqa: E402

D = torch.float64


def gauss_model(X, y):
    u = pyro.sample("u", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, u)), obs=y)


def laplace_model(X, y):
    u = pyro.sample("u", dist.Laplace(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, u)), obs=y)


def with_bias(X):
    """Append a constant feature (CSR stays CSR)."""
    if X.layout == torch.strided:
        return torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], 1)
    import scipy.sparse as sp

    S = sp.csr_matrix((X.values().numpy(), X.col_indices().numpy(), X.crow_indices().numpy()), shape=tuple(X.shape))
    S = sp.hstack([S, np.ones((S.shape[0], 1))], format="csr")
    S.sort_indices()
    return torch.sparse_csr_tensor(torch.from_numpy(S.indptr.astype(np.int64)), torch.from_numpy(S.indices.astype(np.int64)),
                                   torch.from_numpy(S.data).to(X.dtype), size=S.shape, check_invariants=False)


def error_of(result, X, y):
    eta = pcv.linear(X, result.posterior.loc)
    return float(((eta > 0).to(y.dtype) != y).double().mean())


def run_case(name, model, Xtr, ytr, Xte, yte, *, init_size, num, refit_every, lanczos_rank, seeds, scores):
    t0 = time.perf_counter()
    full = ConvexVariationalRelaxation(model, lanczos_rank=lanczos_rank, max_outer=5, progress=False).run(Xtr, ytr)
    full_err, full_s = error_of(full, Xte, yte), time.perf_counter() - t0
    curves = {}
    rows = []
    for score in scores:
        for seed in seeds:
            rng = np.random.default_rng(seed)
            init = torch.from_numpy(rng.choice(Xtr.shape[0], init_size, replace=False))
            learner = ActiveLearner(model, Xtr, lambda i: ytr[i], score=score, refit_every=refit_every,
                                    lanczos_rank=lanczos_rank, seed=seed, progress=False)
            h = learner.run(num, init=init, X_test=Xte, y_test=yte)
            curves.setdefault(score, []).append(dict(num_included=h.num_included, test_error=h.test_error,
                                                     seconds=h.seconds, dropped=h.dropped))
        errs = np.array([c["test_error"] for c in curves[score]])
        rows.append(dict(case=name, score=score, n_start=init_size, n_end=init_size + num,
                         err_start=float(errs[:, 0].mean()), err_mid=float(errs[:, errs.shape[1] // 2].mean()),
                         err_end=float(errs[:, -1].mean()), err_mean_curve=float(errs.mean()),
                         full_train_err=full_err,
                         seconds=float(np.mean([c["seconds"][-1] for c in curves[score]]))))
    return dict(name=name, full_error=full_err, full_seconds=full_s, n_train=int(Xtr.shape[0]),
                n_features=int(Xtr.shape[1]), refit_every=refit_every, lanczos_rank=lanczos_rank,
                init_size=init_size, seeds=list(seeds), curves=curves), rows


def main():
    p = make_parser(__doc__.splitlines()[0])
    p.add_argument("--refit-every", type=int, default=None,
                   help="inclusions between refits (default: 3 for a9a, 20 for keel; quick: 5)")
    p.add_argument("--num", type=int, default=None, help="inclusions per run")
    args = parse_args(parser=p)
    torch.manual_seed(args.seed)
    quick = args.quick
    seeds = [args.seed] if quick else [args.seed, args.seed + 1]
    scores = ("cu", "ig", "random")
    cases, rows = [], []

    a9a = load_a9a(train_size=3000 if quick else 16000, seed=args.seed)
    Xa, ya, Xa_te, ya_te = a9a
    if quick:
        Xa_te, ya_te = _head(Xa_te, 4000), ya_te[:4000]
    Xa, Xa_te = with_bias(Xa), with_bias(Xa_te)
    spec = [("a9a", gauss_model, Xa, ya, Xa_te, ya_te, 100, 3, 80)]
    if not quick:
        spec.append(("a9a-laplace", laplace_model, Xa, ya, Xa_te, ya_te, 100, 3, 80))
    for kname in (["spambase"] if quick else ["spambase", "magic"]):
        ds = load_keel(kname, test_size=0.3, seed=args.seed)
        spec.append((kname, gauss_model, with_bias(ds.X_train), ds.y_train, with_bias(ds.X_test), ds.y_test,
                     100 if kname == "spambase" else 500, 20, 40))
    for name, model, Xtr, ytr, Xte, yte, init_size, refit_every, lanczos_rank in spec:
        refit_every = args.refit_every or (5 if quick else refit_every)
        num = args.num or (90 if quick else (300 if name.startswith("a9a") else 400))
        t = time.perf_counter()
        case, r = run_case(name, model, Xtr, ytr, Xte, yte, init_size=init_size, num=num, refit_every=refit_every,
                           lanczos_rank=lanczos_rank, seeds=seeds, scores=scores)
        print(f"[{name}] {time.perf_counter() - t:.1f}s", file=sys.stderr)
        cases.append(case)
        rows += r

    table = markdown_table(rows, ["case", "score", "n_start", "n_end", "err_start", "err_mid", "err_end",
                                  "err_mean_curve", "full_train_err", "seconds"], floatfmt=".4f")
    print(table)
    # ratios S_CU / random and S_IG / random of the mean error along the curve, same run
    ratio_rows = []
    for case in cases:
        base = np.mean([np.mean(c["test_error"]) for c in case["curves"]["random"]])
        ratio_rows.append(dict(case=case["name"], **{f"{s}/random": float(np.mean([np.mean(c["test_error"])
                                                                                 for c in case["curves"][s]]) / base)
                                                    for s in ("cu", "ig")}))
    print()
    print(markdown_table(ratio_rows, floatfmt=".3f"))
    stem = "active_learning_quick" if quick else "active_learning"
    write_json(stem, dict(quick=quick, cases=cases, table=rows, ratios=ratio_rows))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        for score, color in (("cu", "C0"), ("ig", "C1"), ("random", "C2")):
            cs = case["curves"][score]
            x = cs[0]["num_included"]
            e = np.mean([c["test_error"] for c in cs], 0)
            ax.plot(x, e, color=color, label={"cu": "S_CU", "ig": "S_IG", "random": "random"}[score])
        ax.axhline(case["full_error"], color="k", ls="--", lw=1, label="full training set")
        ax.set_title(f"{case['name']} (refit_every={case['refit_every']}, lanczos_rank={case['lanczos_rank']})",
                     fontsize=9)
        ax.set_xlabel("training cases")
        ax.set_ylabel("test error")
    axes[0][0].legend()
    fig.tight_layout()
    save_figure(fig, stem)


def _head(X, m):
    if X.layout == torch.strided:
        return X[:m]
    crow = X.crow_indices()[: m + 1]
    nnz = int(crow[-1])
    return torch.sparse_csr_tensor(crow, X.col_indices()[:nnz], X.values()[:nnz], size=(m, X.shape[1]),
                                   check_invariants=False)


if __name__ == "__main__":
    main()
