"""Linear algebra benchmark: CG, Lanczos, variance estimators and scalar solvers against peers.

Same-run comparison (float64, one thread by default):

* CG: ours vs ``linear_operator.utils.linear_cg`` (default ``eps`` and tuned ``eps``) vs
  ``scipy.sparse.linalg.cg`` vs dense ``torch.linalg.solve`` (where feasible), on
  - ``glm``: ``A = I + X^T diag(w) X`` with a sparse ``X`` (12 nonzeros per row, 2n rows),
    applied matrix-free through torch sparse CSR products (the convex relaxation's Newton systems);
  - ``gmrf``: an explicit sparse CSR precision, a 2-D grid Laplacian + 1e-3 I, badly scaled by a
    diagonal over 1.5 decades (Jacobi preconditioning matters);
  plus batched right-hand sides.
Every solver of a problem runs ``--repeat`` times (3 by default), alternating (the order reverses each
round), and the median is reported.

* Lanczos: ours vs ``linear_operator.utils.lanczos.lanczos_tridiag`` (time, orthogonality, ``Q^T A Q - T``,
  steps on a matrix scaled by 1e-8).
* Variances: K-Lanczos and L-PCA against exact ``diag(X A^{-1} X^T)`` (Seeger 2010 §3-4).
* Scalar: :func:`newton_bisect_root` on many problems vs a ``scipy.optimize.brentq`` loop.

Prints markdown tables, writes ``benchmarks/results/linalg.json`` and ``docs/figures/linalg.png``.
Run ``python benchmarks/linalg.py --quick`` for a version under a minute.
"""
import argparse
import json
import math
import os
import platform
import sys
import time
import warnings

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pyro_convexvb.linalg import (  # noqa: E402
    SparseOperator,
    cg,
    lanczos,
    lanczos_variances,
    newton_bisect_root,
    pca_variances,
)

DT = torch.float64


def glm_problem(n, nnz_row=12, seed=0):
    """``A = I + X^T diag(w) X`` (matrix-free) with ``X`` of shape (2n, n); returns (apply, X_scipy, w, diag)."""
    rng = np.random.default_rng(seed)
    m = 2 * n
    rows = np.repeat(np.arange(m), nnz_row)
    cols = rng.integers(0, n, m * nnz_row)
    vals = rng.standard_normal(m * nnz_row)
    X = sp.csr_matrix((vals, (rows, cols)), shape=(m, n))
    X.sum_duplicates()
    w = torch.from_numpy(rng.uniform(0.05, 0.25, m))
    Xop = SparseOperator(X)

    def apply(v):
        u = Xop.mv(v)
        u = u * w if u.dim() == 1 else u * w.unsqueeze(-1)
        return Xop.rmv(u) + v

    diag = torch.from_numpy(np.asarray(X.multiply(X).T @ w.numpy()).ravel() + 1.0)
    return apply, X, w, diag, Xop


def gmrf_problem(side, seed=0, decades=1.5, shift=1e-3):
    """Explicit CSR precision ``D (L + shift I) D`` on a side x side grid."""
    n = side * side
    lap1 = sp.diags([-np.ones(side - 1), 2 * np.ones(side), -np.ones(side - 1)], [-1, 0, 1])
    eye = sp.eye(side)
    L = sp.kron(lap1, eye) + sp.kron(eye, lap1) + shift * sp.eye(n)
    d = 10 ** (decades * np.random.default_rng(seed).random(n))
    A = (sp.diags(d) @ L @ sp.diags(d)).tocsr()
    A.sort_indices()
    return A


class Counter:
    def __init__(self, f):
        self.f, self.calls, self.cols = f, 0, 0

    def __call__(self, v):
        self.calls += 1
        self.cols += 1 if v.dim() == 1 else v.shape[-1]
        return self.f(v)


def rel_res(apply, x, b):
    r = b - apply(x)
    return (torch.linalg.vector_norm(r, dim=0) / torch.linalg.vector_norm(b, dim=0)).max().item()


CPU = {}


def timed(fn, repeat=1):
    """Best wall time of ``repeat`` runs; the matching process CPU time is left in ``CPU['last']``.

    With one thread, CPU time is the compute time even when other jobs load the machine.
    """
    best, out = math.inf, None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        wall = time.perf_counter() - t
        if wall < best:
            best, CPU["last"] = wall, time.process_time() - c
    return best, out


def alternated(solvers, repeat):
    """Run every ``(label, fn)`` of ``solvers`` ``repeat`` times, round by round, in an order that reverses from
    one round to the next; returns ``{label: (median wall seconds, median CPU seconds, last output)}``.

    Alternating spreads this machine's speed drift over every solver instead of charging it to whichever ran
    first (the first solver of a single pass also paid the cold caches)."""
    walls = {label: [] for label, _ in solvers}
    cpus = {label: [] for label, _ in solvers}
    outs = {}
    for rnd in range(repeat):
        for label, fn in (solvers if rnd % 2 == 0 else solvers[::-1]):
            t, c = time.perf_counter(), time.process_time()
            outs[label] = fn()
            walls[label].append(time.perf_counter() - t)
            cpus[label].append(time.process_time() - c)
    return {label: (float(np.median(walls[label])), float(np.median(cpus[label])), outs[label])
            for label, _ in solvers}


def run_cg_peers(name, apply, b, rtol, diag=None, scipy_A=None, max_iter=None, lo_default_cap=None, dense=None,
                 repeat=3, extra=()):
    """One row per solver: iterations, products, median seconds (alternated, :func:`alternated`), final true
    relative residual. ``extra``: more ``(label, fn)`` solvers, ``fn`` returning ``(iters, mvm, x, note)``."""
    from linear_operator.utils.linear_cg import linear_cg

    n = b.shape[0]
    cap = max_iter or 10 * n
    solvers = []

    def ours(pre):
        def fn():
            c = Counter(apply)
            res = cg(c, b, rtol=rtol, precond=pre, max_iter=cap, on_fail="ignore")
            return res.iterations, res.num_mvm, res.x, "" if res.converged else "not converged"
        return fn

    for pre, label in ((None, "ours"), (diag, "ours+jacobi")):
        if label.endswith("jacobi") and diag is None:
            continue
        solvers.append((label, ours(pre)))

    # linear_operator: its default eps=1e-10 guard, then a tuned one
    def lo(eps, lim, pre):
        kw = dict(tolerance=rtol, max_iter=lim, eps=eps)
        if eps != 1e-10:
            kw["stop_updating_after"] = 0.0
        if pre is not None:
            dinv = (1.0 / pre).unsqueeze(-1)
            kw["preconditioner"] = lambda r: r * dinv

        def fn():
            c = Counter(apply)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                x = linear_cg(c, b, **kw)
            return c.calls, c.cols, x, f"max_iter={lim}"
        return fn

    for eps, label in ((1e-10, "linear_cg (default eps)"), (1e-300, "linear_cg (eps=1e-300)")):
        lim = lo_default_cap if (eps == 1e-10 and lo_default_cap) else cap
        solvers.append((label, lo(eps, lim, None)))
        if diag is not None:
            solvers.append((label + "+jacobi", lo(eps, lim, diag)))
    # scipy
    if b.dim() == 1:
        bn = b.numpy()
        if scipy_A is None:
            Aop = spla.LinearOperator((n, n), matvec=lambda v: apply(torch.from_numpy(v)).numpy(), dtype=np.float64)
        else:
            Aop = scipy_A

        def sc(Mop):
            def fn():
                it = [0]

                def cb(xk):
                    it[0] += 1

                x, info = spla.cg(Aop, bn, rtol=rtol, atol=0.0, maxiter=cap, M=Mop, callback=cb)
                return it[0], it[0] + 1, torch.from_numpy(x), "" if info == 0 else f"info={info}"
            return fn

        solvers.append(("scipy cg", sc(None)))
        if diag is not None:
            solvers.append(("scipy cg+jacobi", sc(sp.diags(1.0 / diag.numpy()))))
    if dense is not None:
        solvers.append(("torch.linalg.solve (dense)", lambda: (0, 0, torch.linalg.solve(dense, b), "")))
        bb = b.unsqueeze(-1) if b.dim() == 1 else b

        def chol():
            x = torch.cholesky_solve(bb, torch.linalg.cholesky(dense))
            return 0, 0, x.squeeze(-1) if b.dim() == 1 else x, ""
        solvers.append(("torch cholesky (dense)", chol))
    solvers += list(extra)
    out = alternated(solvers, repeat)
    rows = []
    for label, _ in solvers:
        wall, cpu, (iters, mvm, x, note) = out[label]
        rows.append(dict(problem=name, rtol=rtol, solver=label, seconds=wall, cpu_seconds=cpu, iterations=iters,
                         mvm=mvm, rel_residual=None if x is None else rel_res(apply, x, b), note=note))
    return rows


def run_lanczos_peers(apply, n, ks, seed=0, repeat=3):
    from linear_operator.utils.lanczos import lanczos_tridiag

    rows = []
    v0 = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=DT)
    for k in ks:
        out = alternated([("ours", lambda: lanczos(apply, v0, k)),
                          ("lanczos_tridiag", lambda: lanczos_tridiag(apply, k, DT, torch.device("cpu"), (n, n),
                                                                      init_vecs=v0.unsqueeze(-1)))], repeat)
        s, c, res = out["ours"]
        Q, T = res.Q, res.T()
        rows.append(dict(solver="ours", k=k, seconds=s, cpu_seconds=c, steps=res.k,
                         orth_err=(Q.T @ Q - torch.eye(res.k, dtype=DT)).abs().max().item(),
                         tri_err=(Q.T @ apply(Q.contiguous()) - T).abs().max().item()))
        s, c, (Ql, Tl) = out["lanczos_tridiag"]
        kk = Ql.shape[-1]
        rows.append(dict(solver="lanczos_tridiag", k=k, seconds=s, cpu_seconds=c, steps=kk,
                         orth_err=(Ql.T @ Ql - torch.eye(kk, dtype=DT)).abs().max().item(),
                         tri_err=(Ql.T @ apply(Ql.contiguous()) - Tl).abs().max().item()))
    # relative breakdown: the same operator scaled by 1e-8
    small = lambda v: 1e-8 * apply(v)  # noqa: E731
    k = ks[0]
    res = lanczos(small, v0, k)
    Ql, _ = lanczos_tridiag(small, k, DT, torch.device("cpu"), (n, n), init_vecs=v0.unsqueeze(-1))
    scaled = dict(k=k, ours_steps=res.k, lanczos_tridiag_steps=Ql.shape[-1])
    return rows, scaled


def run_variances(n, ks, Ls, seed=0):
    """K-Lanczos and L-PCA site variances vs the exact diag(X A^{-1} X^T) (dense reference)."""
    apply, X, w, diag, Xop = glm_problem(n, seed=seed)
    Xd = torch.from_numpy(X.toarray())
    A = torch.eye(n, dtype=DT) + Xd.T @ (w.unsqueeze(-1) * Xd)
    t_exact, z_exact = timed(lambda: (torch.linalg.solve_triangular(torch.linalg.cholesky(A), Xd.T, upper=False) ** 2).sum(0))
    rows = [dict(method="exact (dense Cholesky)", param=None, seconds=t_exact, cpu_seconds=CPU["last"], mvm=0,
                 median_ratio=1.0, min_ratio=1.0, max_ratio=1.0)]
    curves = {}
    v0 = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1), dtype=DT)
    for k in ks:
        s, (z, res) = timed(lambda: lanczos_variances(apply, Xop, k, v0=v0, return_result=True))
        ratio = z / z_exact
        curves[f"K-Lanczos k={k}"] = ratio
        rows.append(dict(method="K-Lanczos", param=k, seconds=s, cpu_seconds=CPU["last"], mvm=res.num_mvm, median_ratio=ratio.median().item(),
                         min_ratio=ratio.min().item(), max_ratio=ratio.max().item()))
    for L in Ls:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s, (z, res) = timed(lambda: pca_variances(apply, Xop, L, v0=v0, return_result=True, tol=1e-6))
        ratio = z / z_exact
        rows.append(dict(method="L-PCA", param=L, seconds=s, cpu_seconds=CPU["last"], mvm=res.num_mvm, median_ratio=ratio.median().item(),
                         min_ratio=ratio.min().item(), max_ratio=ratio.max().item()))
    return rows, z_exact, curves


def run_scalar(num):
    from scipy.optimize import brentq

    g = torch.Generator().manual_seed(0)
    c = torch.exp(-46 + 92 * torch.rand(num, generator=g, dtype=DT))
    newton_bisect_root(lambda x: (torch.log(x) - torch.log(c), 1 / x), 1e-30, 1e30)  # warm-up
    s, (x, ok) = timed(lambda: newton_bisect_root(lambda x: (torch.log(x) - torch.log(c), 1 / x), 1e-30, 1e30))
    s = CPU["last"]
    cl = c.tolist()
    nb = min(num, 20000)
    t = time.process_time()
    ref = [brentq(lambda xx, ci=ci: math.log(xx) - math.log(ci), 1e-30, 1e30, xtol=1e-300, rtol=1e-15, maxiter=500) for ci in cl[:nb]]
    sb = (time.process_time() - t) * num / nb
    ref = torch.tensor(ref, dtype=DT)
    err = ((x[:nb] - ref) / ref).abs().max().item()
    return dict(problems=num, ours_seconds=s, converged=bool(ok.all()), brentq_seconds=sb, brentq_extrapolated=nb < num,
                max_rel_diff=err, speedup=sb / s)


def md_table(rows, cols, fmt=None):
    fmt = fmt or {}
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if v is None:
                cells.append("")
            elif c in fmt:
                cells.append(fmt[c].format(v))
            elif isinstance(v, float):
                cells.append(f"{v:.3g}")
            else:
                cells.append(str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def make_figure(path, hist, z_exact, curves):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for label, h in hist.items():
        ax.semilogy(h, label=label)
    ax.set_xlabel("CG iteration")
    ax.set_ylabel("max relative residual")
    ax.set_title("CG on the gmrf problem")
    ax.legend()
    ax = axes[1]
    order = torch.argsort(z_exact)
    for label, ratio in curves.items():
        ax.semilogx(z_exact[order].numpy(), ratio[order].numpy(), ".", ms=2, label=label)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("exact variance of s_i")
    ax.set_ylabel("K-Lanczos / exact")
    ax.set_title("Lanczos variances are lower bounds (Seeger 2010 §4.1)")
    ax.legend(markerscale=5)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small version (< 1 minute)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3, help="alternated repetitions per solver (median reported)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/linalg[_quick].json)")
    p.add_argument("--figure", default=None, help="figure path (default docs/figures/linalg[_quick].png)")
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    from _common import default_figures_dir, default_results_dir

    stem = "linalg_quick" if args.quick else "linalg"
    args.out = args.out or os.path.join(default_results_dir(), f"{stem}.json")
    args.figure = args.figure or os.path.join(default_figures_dir(), f"{stem}.png")
    torch.set_num_threads(args.threads)
    try:  # numpy/scipy BLAS threads too: on a busy 2-core machine oversubscription costs 30x
        from threadpoolctl import threadpool_limits

        limits = threadpool_limits(args.threads)
    except ImportError:  # pragma: no cover
        limits = None
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    q = args.quick
    rep = args.repeat
    n_big = 5000 if q else 20000
    side = 70 if q else 141
    n_small = 1500 if q else 3000
    lo_cap = 300 if q else 1000
    results = dict(
        machine=dict(python=platform.python_version(), torch=torch.__version__, threads=args.threads, cpus=os.cpu_count(),
                     load_avg=os.getloadavg()[0], blas_threads_limited=limits is not None),
        quick=q,
    )
    g = torch.Generator().manual_seed(1)

    # --- CG ---
    cg_rows = []
    apply, X, w, diag, _ = glm_problem(n_big)
    b = torch.randn(n_big, generator=g, dtype=DT)
    for rtol in (1e-6, 1e-10):
        cg_rows += run_cg_peers(f"glm n={n_big}", apply, b, rtol, diag=diag, lo_default_cap=lo_cap, repeat=rep)
    A = gmrf_problem(side)
    Aop = SparseOperator(A)
    dA = torch.from_numpy(A.diagonal().copy())
    bg = torch.randn(A.shape[0], generator=g, dtype=DT)
    cg_rows += run_cg_peers(f"gmrf n={A.shape[0]}", Aop.mv, bg, 1e-8, diag=dA, scipy_A=A, lo_default_cap=lo_cap,
                            repeat=rep)
    apply_s, Xs, ws, diag_s, _ = glm_problem(n_small, seed=2)
    Xd = torch.from_numpy(Xs.toarray())
    dense = torch.eye(n_small, dtype=DT) + Xd.T @ (ws.unsqueeze(-1) * Xd)
    bs = torch.randn(n_small, generator=g, dtype=DT)
    cg_rows += run_cg_peers(f"glm n={n_small}", apply_s, bs, 1e-10, diag=diag_s, dense=dense, lo_default_cap=lo_cap,
                            repeat=rep)
    # batched right-hand sides
    Bm = torch.randn(n_big, 8, generator=g, dtype=DT) * torch.logspace(0, 3, 8, dtype=DT)
    def by_column():
        c = Counter(apply)
        for j in range(8):
            cg(c, Bm[:, j].contiguous(), rtol=1e-8)
        return c.calls, c.cols, None, ""

    cg_rows += run_cg_peers(f"glm n={n_big}, 8 rhs", apply, Bm, 1e-8, lo_default_cap=lo_cap, repeat=rep,
                            extra=[("ours, column by column", by_column)])
    hist = {}
    for pre, label in ((None, "plain"), (dA, "Jacobi")):
        hist[label] = cg(Aop, bg, rtol=1e-8, precond=pre, on_fail="ignore").residual_history
    results["cg"] = cg_rows

    # --- Lanczos ---
    ks = (50, 100) if q else (50, 200)
    lz_rows, scaled = run_lanczos_peers(apply, n_big, ks, repeat=rep)
    results["lanczos"] = lz_rows
    results["lanczos_scaled_1e-8"] = scaled

    # --- variances ---
    var_rows, z_exact, curves = run_variances(n_small, (20, 80, 320) if not q else (20, 80), (20, 80) if not q else (20,))
    results["variances"] = var_rows

    # --- scalar ---
    results["scalar"] = run_scalar(20000 if q else 200000)

    # --- output ---
    fmt = dict(seconds="{:.3f}", rel_residual="{:.1e}", orth_err="{:.1e}", tri_err="{:.1e}")
    print("## CG (float64, %d thread(s))\n" % args.threads)
    ref = {}
    for r in cg_rows:
        if r["solver"] == "ours":
            ref[(r["problem"], r["rtol"])] = r["cpu_seconds"]
    for r in cg_rows:
        base = ref.get((r["problem"], r["rtol"]))
        r["cpu_vs_ours"] = r["cpu_seconds"] / base if base else None
    print(md_table(cg_rows, ["problem", "rtol", "solver", "iterations", "mvm", "seconds", "cpu_seconds", "cpu_vs_ours",
                             "rel_residual", "note"], dict(fmt, cpu_seconds="{:.3f}", cpu_vs_ours="{:.2f}x")))
    print("\n## Lanczos (full reorthogonalisation)\n")
    print(md_table(lz_rows, ["solver", "k", "steps", "seconds", "cpu_seconds", "orth_err", "tri_err"],
                   dict(fmt, cpu_seconds="{:.3f}")))
    print(f"\nOperator scaled by 1e-8, k={scaled['k']}: ours ran {scaled['ours_steps']} steps, "
          f"lanczos_tridiag {scaled['lanczos_tridiag_steps']} (absolute breakdown threshold 1e-6).")
    print(f"\n## Site variances diag(X A^-1 X^T), n={n_small}, q={2 * n_small}: estimate / exact\n")
    print(md_table(var_rows, ["method", "param", "seconds", "cpu_seconds", "mvm", "median_ratio", "min_ratio", "max_ratio"],
                   dict(fmt, cpu_seconds="{:.3f}")))
    sc = results["scalar"]
    print("\n## Scalar roots (log scale over 60 decades, CPU seconds)\n")
    print(md_table([sc], ["problems", "ours_seconds", "brentq_seconds", "speedup", "max_rel_diff", "converged"],
                   dict(ours_seconds="{:.3f}", brentq_seconds="{:.2f}", speedup="{:.0f}x", max_rel_diff="{:.1e}")))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=float)
    make_figure(args.figure, hist, z_exact, curves)
    print(f"\nwrote {args.out} and {args.figure}")
    if limits is not None:
        limits.restore_original_limits()


if __name__ == "__main__":
    main()
