"""Engines against their peers under one protocol: alternating repetitions, medians, first fits in fresh processes.

Cases (each ``--only`` name writes ``benchmarks/results/floor_<case>.json``; ``--quick`` shrinks them):

* ``a9a``: ``convex_relaxation`` with default options on real a9a (16,000 training rows, a constant
  feature appended), fitted through the Pyro model ``y ~ Bernoulli(logits = X w)``, ``w ~ N(0, I)``, as a
  user writes it, against scikit-learn's liblinear MAP (``C = 1``, same design). *First fit*: each method
  in its own fresh process (imports and data loading not timed, the fit call is), alternating; *warm*:
  repeated fits in one process, alternating.
* ``realsim``: ``convex_relaxation`` on data shaped like real-sim (``make_sparse_classification``),
  ``k = 750`` block Lanczos (block 8), one outer iteration, **one** torch thread, against liblinear.
* ``gp``: ``dual_vg`` GP classification (RBF, hyperparameters learned once by ``dual_vg``'s type-II and
  then fixed) on keel ionosphere, sonar, wdbc and pima against scikit-learn's
  ``GaussianProcessClassifier(optimizer=None)`` (Laplace), one BLAS thread for both; and the exact
  variational-Gaussian optimum: ``dual_vg`` with ``refine=True`` against the CVI natural-gradient
  fixed point (Khan & Lin 2017), each timed to a bound within 1e-3 nats of the best bound either reaches.
* ``gp5000``: the same on 5,000 magic training cases (all threads).
* ``glm``: ``diag_mixture`` (K = 1, 4; its default optimiser, natural-gradient steps on the exact bound)
  against Pyro's ``AutoNormal`` (Adam, lr 0.02, the plateau rule of ``benchmarks/glm.py``) and revrand 1.0.0 (K = 1; side virtual environment ``--revrand-python``) on keel
  spambase and magic, Bayesian logistic regression with prior N(0, 1).
* ``demo``: ``python -m pyro_convexvb demo`` end to end in a fresh process.
* ``rates``: this machine's dense Cholesky / triangular-solve / GEMM rates and a9a's sparse product times,
  the units in which the floors on the benchmarks page are counted.

Every table row holds the median of the repetitions and all of them (``seconds_all``); ratios are
medians of same-run times.

Usage::

    python benchmarks/floor.py                 # every case (about 20 minutes; run on a quiet machine)
    python benchmarks/floor.py --only a9a,gp   # some cases
    python benchmarks/floor.py --quick         # smoke run
"""
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from _common import default_figures_dir, make_parser, markdown_table, parse_args, write_json  # noqa: E402

D = torch.float64
CASES = ["rates", "a9a", "realsim", "gp", "gp5000", "glm", "demo"]


def _median(xs):
    return statistics.median(xs) if xs else None


def _row(case, method, times, **extra):
    return dict(case=case, method=method, seconds=_median(times), seconds_all=list(times), reps=len(times), **extra)


# ----------------------------------------------------------------------------- a9a
def _a9a_data(quick):
    from convex_relaxation import add_bias

    from pyro_convexvb.datasets import load_a9a

    ds = load_a9a(train_size=2000 if quick else 16000, seed=0)
    Xb, S = add_bias(ds.X_train)
    return Xb, S, ds.y_train


def _a9a_model():
    import pyro
    import pyro.distributions as dist

    import pyro_convexvb as pcv

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)

    return model


def _a9a_fitters(quick):
    from sklearn.linear_model import LogisticRegression

    import pyro_convexvb as pcv

    Xb, S, y = _a9a_data(quick)
    model, yn = _a9a_model(), y.numpy().astype(int)

    def ours():
        return pcv.fit(model, Xb, y=y, engine="convex_relaxation", progress=False)

    def liblinear():
        return LogisticRegression(C=1.0, solver="liblinear", fit_intercept=False, tol=1e-4).fit(S, yn)

    return {"convex_relaxation (defaults)": ours, "MAP liblinear (l2, C=1)": liblinear}


def first_fit_child(method, quick):
    """Run in a fresh process: time the first fit of ``method`` (imports and data not timed)."""
    warnings.simplefilter("ignore")
    f = _a9a_fitters(quick)[method]
    t = time.perf_counter()
    res = f()
    secs = time.perf_counter() - t
    conv = bool(getattr(res, "converged", True))
    print(json.dumps({"seconds": secs, "converged": conv}))


def case_a9a(args):
    torch.set_num_threads(1)
    reps = args.repeats
    methods = list(_a9a_fitters(args.quick))
    first = {m: [] for m in methods}
    for rep in range(reps):
        for m in methods:
            cmd = [sys.executable, os.path.abspath(__file__), "--first-fit", m] + (["--quick"] if args.quick else [])
            env = dict(os.environ, OMP_NUM_THREADS="1")
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            first[m].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    fitters = _a9a_fitters(args.quick)
    warm = {m: [] for m in methods}
    conv = None
    for m in methods:
        fitters[m]()  # warm-up
    for rep in range(reps):
        for m in methods:
            t = time.perf_counter()
            res = fitters[m]()
            warm[m].append(time.perf_counter() - t)
            if m.startswith("convex"):
                conv = bool(res.converged)
    rows = []
    for m in methods:
        rows.append(_row("a9a first fit", m, first[m]))
        rows.append(_row("a9a warm fit", m, warm[m], converged=conv if m.startswith("convex") else None))
    _ratios(rows, "MAP liblinear")
    return rows


# ----------------------------------------------------------------------------- real-sim
def case_realsim(args):
    from convex_relaxation import run_case, synthetic
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    with threadpool_limits(1):
        data = synthetic("real-sim", 0.05 if args.quick else 1.0, 0)
        vb, mp = run_case("real-sim", *data, k=100 if args.quick else 750, max_outer=1, block_size=8,
                          repeats=args.repeats, map_repeats=args.repeats)
    rows = [_row("real-sim k=750, 1 thread", "convex_relaxation (block 8)", vb["seconds_all"], converged=vb["converged"],
                 q=vb["q"], n=vb["n"], nnz=vb["nnz"], inner_seconds=vb["inner_seconds"],
                 outer_seconds=vb["outer_seconds"]),
            _row("real-sim k=750, 1 thread", mp["method"], mp["seconds_all"])]
    _ratios(rows, "MAP liblinear")
    return rows


# ----------------------------------------------------------------------------- GP classification
def _gp_problem(name, n_train, seed=0):
    import dual_vg as B

    X, y, Xt, yt = B.load(name, n_train, 1000, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ls, os_, mean, _ = B.learn_hypers(X, y, seed=seed)
    k = B.make_kernel(ls, os_)
    with torch.no_grad():
        K = k(X).to_dense() + B.JITTER * torch.eye(X.shape[0], dtype=D)
    return X, y, K, ls, os_


def _gp_rows(case, name, X, y, K, ls, os_, reps, threads, refine=True):
    import dual_vg as B
    from threadpoolctl import threadpool_limits

    from pyro_convexvb.gp.classifier import gp_classification_lgm
    from pyro_convexvb.infer.dual_vg import fit_dual_vg
    from pyro_convexvb.infer.dual_vg.reference import cvi_fixed_point
    from pyro_convexvb.lgm.sites import BernoulliLogit

    N = X.shape[0]
    lgm = gp_classification_lgm(K, y, 0.0)
    fit_dual_vg(gp_classification_lgm(K[:20, :20], y[:20], 0.0), progress=False)  # warm-up
    t_dual, t_sk, t_ref, t_cvi, cvi_hist = [], [], [], [], []
    with threadpool_limits(threads):
        for rep in range(reps):
            t = time.perf_counter()
            r = fit_dual_vg(lgm, progress=False)
            t_dual.append(time.perf_counter() - t)
            sk = B.run_sklearn(X, y, ls, os_, 0.0, K)
            t_sk.append(sk["seconds"])
            if refine:
                t = time.perf_counter()
                rr = fit_dual_vg(lgm, progress=False, refine=True)
                t_ref.append(time.perf_counter() - t)
                t = time.perf_counter()
                out = cvi_fixed_point(K, torch.zeros(N, dtype=D), BernoulliLogit(y), tol=1e-12, max_iter=300)
                t_cvi.append(time.perf_counter() - t)
                cvi_hist.append(out["history"])
    rows = [_row(case, "dual_vg", t_dual, N=N, bound=r.log_evidence_bound, converged=bool(r.converged)),
            _row(case, "sklearn Laplace", t_sk, N=N, bound=sk["bound"])]
    if refine:
        best = max(rr.log_evidence_bound, out["elbo"])
        target = best - 1e-3
        reach = [next((s for s, o in zip(h["seconds"], h["objective"]) if o >= target), None) for h in cvi_hist]
        reach_ok = [s for s in reach if s is not None]
        rows.append(_row(case, "dual_vg + refine (exact VG)", t_ref, N=N, bound=rr.log_evidence_bound,
                         gap_to_exact_vg=best - rr.log_evidence_bound))
        rows.append(_row(case, "CVI fixed point, to 1e-3 nats of the exact VG optimum", reach_ok, N=N,
                         bound=out["elbo"], gap_to_exact_vg=best - out["elbo"], full_run_seconds=_median(t_cvi),
                         reached=len(reach_ok)))
    for row in rows:
        row["dataset"] = name
    _ratios(rows[:2], "sklearn Laplace")
    if refine:
        _ratios(rows[2:], "CVI fixed point")
    return rows


def case_gp(args):
    rows = []
    for name in (["ionosphere", "sonar"] if args.quick else ["ionosphere", "sonar", "wdbc", "pima"]):
        X, y, K, ls, os_ = _gp_problem(name, 1000)
        torch.set_num_threads(1)
        rows += _gp_rows(f"gp {name}", name, X, y, K, ls, os_, args.repeats, 1)
        print(markdown_table(rows[-4:], ["case", "method", "N", "seconds", "ratio", "bound"]), flush=True)
    return rows


def case_gp5000(args):
    n = 1000 if args.quick else 5000
    X, y, K, ls, os_ = _gp_problem("magic", n)
    torch.set_num_threads(os.cpu_count() or 1)
    reps = max(1, min(args.repeats, 3))
    return _gp_rows(f"gp magic N={n}", "magic", X, y, K, ls, os_, reps, os.cpu_count() or 1, refine=False)


# ----------------------------------------------------------------------------- GLM
def case_glm(args):
    import glm as G
    import pyro

    import pyro_convexvb as pcv
    from pyro_convexvb.datasets import load_keel

    torch.set_num_threads(1)
    rows = []
    for name in ["spambase", "magic"]:
        data = load_keel(name, seed=0)
        Xtr, ytr = G.add_ones(data.X_train), data.y_train
        if args.quick:
            keep = torch.randperm(Xtr.shape[0], generator=torch.Generator().manual_seed(0))[:2000]
            Xtr, ytr = Xtr[keep], ytr[keep]
            data.X_train, data.y_train = data.X_train[keep], data.y_train[keep]
        lgm = pcv.lgm_from_pyro(G.logistic_model, Xtr, y=ytr)
        svi = dict(lr=0.02, max_steps=1000 if args.quick else 20000, min_steps=500, window=250, rtol=2e-4)
        methods = [("diag_mixture K=1", "diag_mixture", dict(num_components=1)),
                   ("diag_mixture K=4", "diag_mixture", dict(num_components=4)),
                   ("Pyro AutoNormal", "svi_autonormal", dict(svi))]
        times = {m[0]: [] for m in methods}
        times["revrand 1.0.0 K=1"] = []
        elbo, conv, note = {}, {}, None
        for rep in range(args.repeats):
            for label, engine, opts in methods:
                pyro.clear_param_store()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t = time.perf_counter()
                    res = pcv.fit(G.logistic_model, Xtr, y=ytr, engine=engine, options=opts, progress=False)
                    times[label].append(time.perf_counter() - t)
                elbo[label] = G.bounds(lgm, res.posterior)[1]
                conv[label] = bool(res.converged)
            rr, why = G.run_revrand(args.revrand_python, data, [1], 500 if args.quick else 3000, 100)
            if rr is None:
                note = why
            else:
                times["revrand 1.0.0 K=1"].append(rr[1][0])
        for label, ts in times.items():
            if ts:
                rows.append(_row(f"glm {name}", label, ts, dataset=name, elbo=elbo.get(label),
                                 converged=conv.get(label)))
            else:
                rows.append(dict(case=f"glm {name}", method=label, dataset=name, note=note))
        sub = [r for r in rows if r["case"] == f"glm {name}"]
        _ratios(sub, "Pyro AutoNormal")
        k1 = next(r for r in sub if r["method"] == "diag_mixture K=1")
        for r in sub:
            if r.get("seconds"):
                r["vs_diag_mixture_k1"] = r["seconds"] / k1["seconds"]
        print(markdown_table(sub, ["case", "method", "seconds", "ratio", "vs_diag_mixture_k1", "elbo"]), flush=True)
    return rows


# ----------------------------------------------------------------------------- machine rates
def case_rates(args):
    """This machine's rates for the operations the floors are counted in (one thread unless stated)."""
    from pyro_convexvb.linalg.operators import SparseOperator

    def med(f, reps=7):
        f()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    rows = []
    for threads in (1, os.cpu_count() or 1):
        torch.set_num_threads(threads)
        for N in ([246, 538] if threads == 1 else [5000]):
            g = torch.Generator().manual_seed(0)
            A = torch.randn(N, N, dtype=D, generator=g)
            A = A @ A.T / N + torch.eye(N, dtype=D)
            R = torch.linalg.cholesky(A)
            tc = med(lambda: torch.linalg.cholesky(A), 3 if N > 1000 else 7)
            tt = med(lambda: torch.linalg.solve_triangular(R, A, upper=False), 3 if N > 1000 else 7)
            tg = med(lambda: A.T @ A, 3 if N > 1000 else 7)
            rows.append(dict(case="rates", method=f"dense N={N}, {threads} thread(s)", cholesky_s=tc,
                             cholesky_gflops=N**3 / 3 / tc / 1e9, trsm_s=tt, trsm_gflops=N**3 / tt / 1e9,
                             gemm_s=tg, gemm_gflops=2 * N**3 / tg / 1e9))
    torch.set_num_threads(1)
    Xb, S, _ = _a9a_data(args.quick)
    op = SparseOperator(Xb)
    v = torch.randn(Xb.shape[1], dtype=D)
    u = torch.randn(Xb.shape[0], dtype=D)
    V = torch.randn(Xb.shape[1], Xb.shape[1], dtype=D)
    w = torch.rand(Xb.shape[0], dtype=D)
    rows.append(dict(case="rates", method=f"a9a CSR {tuple(Xb.shape)}, nnz {op.nnz}", spmv_s=med(lambda: op.mv(v), 51),
                     spmv_t_s=med(lambda: op.rmv(u), 51), spmm_n_cols_s=med(lambda: op.mv(V)),
                     weighted_gram_s=med(lambda: op.weighted_gram(w)),
                     scipy_spmv_s=med(lambda: S @ v.numpy(), 51)))
    for r in rows:
        print({k: (f"{x:.4g}" if isinstance(x, float) else x) for k, x in r.items()}, flush=True)
    return rows


# ----------------------------------------------------------------------------- demo
def case_demo(args):
    times = []
    root = os.path.dirname(HERE)
    for rep in range(max(1, min(args.repeats, 3))):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pyro_convexvb", "demo", "--no-progress", "--out",
                        os.path.join(default_figures_dir(), "demo_engines.png")], check=True, cwd=root,
                       env=dict(os.environ, MPLBACKEND="Agg"), stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return [_row("demo", "python -m pyro_convexvb demo (end to end)", times)]


# ----------------------------------------------------------------------------- driver
def _ratios(rows, peer_prefix):
    """Each row's time over the time of the row of the same case whose method starts with ``peer_prefix``."""
    for case in dict.fromkeys(r["case"] for r in rows):
        group = [r for r in rows if r["case"] == case]
        peer = next((r for r in group if r["method"].startswith(peer_prefix) and r.get("seconds")), None)
        if peer is None:
            continue
        for r in group:
            if r is not peer and r.get("seconds"):
                r["ratio"] = r["seconds"] / peer["seconds"]
                r["ratio_to"] = peer["method"]


def main():
    if "--first-fit" in sys.argv:
        i = sys.argv.index("--first-fit")
        first_fit_child(sys.argv[i + 1], "--quick" in sys.argv)
        return
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma list of cases: " + ",".join(CASES))
    parser.add_argument("--repeats", type=int, default=5, help="alternating repetitions per case (median reported)")
    parser.add_argument("--revrand-python", default="/tmp/revrand-venv/bin/python")
    args = parse_args(parser=parser)
    cases = args.only.split(",") if args.only else CASES
    for case in cases:
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; choose from {CASES}")
        t0 = time.perf_counter()
        rows = globals()["case_" + case](args)
        print(f"\n## {case} ({time.perf_counter() - t0:.0f} s)\n", flush=True)
        print(markdown_table(rows, ["case", "method", "reps", "seconds", "ratio", "ratio_to"]), flush=True)
        write_json(f"floor_{case}" + ("_quick" if args.quick else ""), {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
