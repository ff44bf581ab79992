"""Sparse Cholesky libraries on lattice GMRF precisions, and the dual_vg GMRF fits built on the default one.

Part 1 (libraries). Precisions ``Q = kappa I + graph Laplacian`` of a 2-D lattice (4- and 8-neighbour)
with 10^3, 10^4 and 10^5 nodes. Every repetition of every library runs in its own fresh process
(the peers cannot share one), alternating between libraries; medians of the repetitions:

* ``factor_s``  -- ordering + symbolic analysis + numeric factorisation (through
  :class:`pyro_convexvb.linalg.SparseCholesky` for the libraries behind it: the factor is also
  copied into the arrays the selected inversion reads);
* ``refactor_s`` -- numeric factorisation of ``Q + diag(d)`` reusing the analysis (what every dual
  evaluation pays; a full factorisation where the library cannot reuse it);
* ``logdet_s``, ``solve_s`` (one right-hand side) and ``selinv_s``: ``diag(Q^{-1})`` by the Takahashi
  recursion on the library's factor (libraries that hand out no factor: ``-``);
* ``nnz_L`` (stored entries of the factor, diagonal included) and ``peak_mb`` (growth of the peak
  resident memory over factor + log-determinant + solve + selected inversion + refactorisation, above
  the baseline after the imports and the matrix);
* ``logdet_err`` and ``selinv_err``: relative differences to the default backend (to dense NumPy at
  10^3 nodes).

Libraries: ``qdldl`` (QDLDL, AMD ordering), ``cholmod`` (SuiteSparse CHOLMOD through ``cvxopt``),
``splu`` (SciPy SuperLU, symmetric mode), and the solve-only ``cholespy`` and ``sksparse_minimal``
(no log-determinant, no factor). ``scikit-sparse`` is not compared: it has no wheel (it builds against
a system SuiteSparse). Missing optional libraries are skipped with a note; install them with
``pip install cvxopt cholespy sksparse-minimal``.

Part 2 (dual_vg). Poisson counts on the lattice GMRF (``kappa = 0.2``, offset 0.5), fitted through
``pcv.fit(model, y=y, engine="dual_vg")`` from a Pyro model with a ``SparseGMRF`` prior (the engine's
Newton-CG; seconds include the model extraction), and by Newton with the matrix-free Hessian and
preconditioned CG called directly on the same backend: iterations, evaluations, CG steps,
seconds, duality gap.

Prints markdown tables, writes ``benchmarks/results/sparse_cholesky[_quick].json`` and
``docs/figures/sparse_cholesky[_quick].png``. ``--quick`` runs small sizes only (to check the script).
"""
import gc
import os
import statistics
import sys
import time
import warnings

import numpy as np
import scipy.sparse as sp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import make_parser, markdown_table, parse_args, peak_rss_in_subprocess, save_figure, write_json  # noqa: E402

LAYER = ("qdldl", "cholmod", "splu")
SOLVE_ONLY = ("cholespy", "sksparse_minimal")
ALL = LAYER + SOLVE_ONLY


# ----------------------------------------------------------------------------- problems
def lattice(k, kappa=0.5, eight=False):
    """``kappa I + graph Laplacian`` of a k x k lattice (4- or 8-neighbour), CSC."""
    n = k * k
    idx = np.arange(n).reshape(k, k)
    pairs = [(idx[:, :-1], idx[:, 1:]), (idx[:-1, :], idx[1:, :])]
    if eight:
        pairs += [(idx[:-1, :-1], idx[1:, 1:]), (idx[:-1, 1:], idx[1:, :-1])]
    r = np.concatenate([a.ravel() for a, _ in pairs])
    c = np.concatenate([b.ravel() for _, b in pairs])
    A = sp.csc_matrix((np.ones(len(r)), (r, c)), shape=(n, n))
    A = A + A.T
    Q = (sp.diags(np.asarray(A.sum(1)).ravel() + kappa) - A).tocsc()
    Q.sort_indices()
    return Q


def available(lib):
    """Whether ``lib`` imports (checked in a fresh process: cholespy and sksparse_minimal ship the same
    compiled module and cannot be imported into one process, so every measurement runs in its own)."""
    import subprocess

    mod = {"cholmod": "cvxopt.cholmod", "splu": "scipy.sparse.linalg"}.get(lib, lib)
    return subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True).returncode == 0



# ----------------------------------------------------------------------------- one library, one matrix
class Adapter:
    """Uniform calls: ``factor``, ``refactor``, ``logdet``, ``solve``, ``selinv``, ``nnz`` (``None``: unsupported)."""

    def __init__(self, lib):
        self.lib = lib

    def factor(self, Q):
        if self.lib in LAYER:
            from pyro_convexvb.linalg import SparseCholesky

            return SparseCholesky(Q, backend=self.lib)
        if self.lib == "cholespy":
            import cholespy

            return cholespy.CholeskySolverD(Q.shape[0], Q.indptr.astype(np.int32), Q.indices.astype(np.int32),
                                            Q.data.astype(np.float64), cholespy.MatrixType.CSC)
        if self.lib == "sksparse_minimal":
            from sksparse_minimal import SparseCholesky as SKM

            return SKM(Q)
        raise ValueError(self.lib)

    def refactor(self, obj, Q):
        if self.lib in LAYER:
            return obj.update(Q)
        return self.factor(Q)  # no reuse of the analysis

    def logdet(self, obj):
        return obj.logdet() if self.lib in LAYER else None

    def solve(self, obj, b):
        if self.lib in LAYER:
            return obj.solve(b)
        if self.lib == "cholespy":
            x = np.zeros_like(b)
            obj.solve(np.ascontiguousarray(b), x)
            return x
        return obj.solve_A(b)

    def selinv(self, obj):
        if self.lib not in LAYER:
            return None
        obj._selinv = None  # time the recursion, not a cached result
        return obj.diag_inverse()

    def nnz(self, obj):
        return obj.nnz if self.lib in LAYER else None


def _timed(f):
    gc.collect()
    t = time.perf_counter()
    out = f()
    return time.perf_counter() - t, out


def measure(lib, k, kappa, eight, ref_logdet, ref_diag):
    """One repetition for one library and one matrix, in a fresh process (run by :func:`peak_rss_in_subprocess`).

    Returns the timings, errors and ``peak_mb``: the growth of the process's peak resident memory
    over factor, log-determinant, solve, selected inversion and refactorisation (its baseline is taken
    after the imports, a warm-up on a 4 x 4 lattice and building the matrix).
    """
    from _common import peak_rss_mb

    ad = Adapter(lib)
    warm = lattice(4, kappa, eight)
    obj = ad.factor(warm)  # imports, compiled kernels
    ad.solve(obj, np.ones(16))
    ad.selinv(obj)
    del obj
    Q = lattice(k, kappa, eight)
    n = Q.shape[0]
    rng = np.random.default_rng(0)
    b = rng.standard_normal(n)
    Q2 = (Q + sp.diags(rng.uniform(0.1, 1.0, n))).tocsc()
    gc.collect()
    base = peak_rss_mb()
    out = {}
    out["factor_s"], obj = _timed(lambda: ad.factor(Q))
    if ad.logdet(obj) is not None:
        out["logdet_s"], ld = _timed(lambda: ad.logdet(obj))
        out["logdet_err"] = abs(ld - ref_logdet) / abs(ref_logdet)
    out["solve_s"], x = _timed(lambda: ad.solve(obj, b))
    out["solve_residual"] = float(np.linalg.norm(Q @ x - b) / np.linalg.norm(b))
    if lib in LAYER:
        out["selinv_s"], z = _timed(lambda: ad.selinv(obj))
        out["selinv_err"] = float(np.max(np.abs(z - ref_diag) / ref_diag))
    out["nnz_L"] = ad.nnz(obj)
    out["refactor_s"], obj = _timed(lambda: ad.refactor(obj, Q2))
    out["peak_mb"] = peak_rss_mb() - base
    return out


def bench_libraries(sizes, reps, libs, eight_sizes, kappa=0.5):
    """Every (library, matrix, repetition) in its own process, alternating libraries; medians."""
    rows, notes = [], []
    from pyro_convexvb.linalg import SparseCholesky

    keys = ("factor_s", "refactor_s", "logdet_s", "solve_s", "selinv_s", "peak_mb")
    for eight in (False, True):
        for k in (eight_sizes if eight else sizes):
            Q = lattice(k, kappa, eight)
            n = Q.shape[0]
            if n <= 2000:
                Qd = Q.toarray()
                ref_logdet = np.linalg.slogdet(Qd)[1]
                ref_diag = np.diag(np.linalg.inv(Qd))
            else:
                r = SparseCholesky(Q)
                ref_logdet, ref_diag = r.logdet(), r.diag_inverse()
            runs = {lib: [] for lib in libs}
            errors = {}
            for rep in range(reps):
                order = libs[rep % len(libs):] + libs[:rep % len(libs)]  # alternate who goes first
                for lib in order:
                    if lib in errors:
                        continue
                    try:
                        res = peak_rss_in_subprocess(measure, lib, k, kappa, eight, ref_logdet, ref_diag,
                                                     return_result=True)
                    except RuntimeError as err:  # a library that cannot factor this matrix
                        errors[lib] = str(err)
                        notes.append(f"{lib} at n={n} ({'8-nb' if eight else '4-nb'}): {err}")
                        continue
                    runs[lib].append(res["result"])
            for lib in libs:
                row = dict(graph="8-nb" if eight else "4-nb", n=n, library=lib)
                rs = runs[lib]
                for key in keys:
                    vals = [r[key] for r in rs if r.get(key) is not None]
                    row[key] = statistics.median(vals) if vals else None
                for key in ("nnz_L", "logdet_err", "selinv_err", "solve_residual"):
                    vals = [r[key] for r in rs if r.get(key) is not None]
                    row[key] = max(vals) if vals else None
                row["reps"] = len(rs)
                rows.append(row)
                print(f"  {row['graph']} n={n:>6} {lib:>16}: factor {row['factor_s']}, selinv {row.get('selinv_s')}",
                      flush=True)
    return rows, notes


# ----------------------------------------------------------------------------- dual_vg on a lattice GMRF
def bench_dual_vg(sides, kappa=0.2, offset=0.5, seed=0):
    import pyro
    import pyro.distributions as dist
    import torch

    import pyro_convexvb as pcv
    from pyro_convexvb.infer.dual_vg.bounds import make_bound
    from pyro_convexvb.infer.dual_vg.objective import SparsePrecisionBackend
    from pyro_convexvb.infer.dual_vg.optim import _newton, default_gap_tol, initial_alpha
    from pyro_convexvb.infer.result import History
    from pyro_convexvb.lgm.sites import Poisson
    from pyro_convexvb.linalg import SparseCholesky

    rows = []
    for warm, k in [(True, 6)] + [(False, k) for k in sides]:  # the first fit loads Pyro and the kernels
        Q = lattice(k, kappa)
        n = Q.shape[0]
        rng = np.random.default_rng(seed)
        z = SparseCholesky(Q).solve_Lt(rng.standard_normal(n))
        y = torch.as_tensor(rng.poisson(np.exp(z + offset)), dtype=torch.float64)
        Qc = Q.tocsr()
        Qt = torch.sparse_csr_tensor(torch.as_tensor(Qc.indptr), torch.as_tensor(Qc.indices), torch.as_tensor(Qc.data),
                                     size=Q.shape, check_invariants=True)

        def model(y=None):
            f = pyro.sample("f", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=torch.float64), Qt))
            pyro.sample("y", dist.Poisson(torch.exp(f + offset)).to_event(1), obs=y)

        gc.collect()
        t = time.perf_counter()
        res = pcv.fit(model, y=y, engine="dual_vg", progress=False)
        sec = time.perf_counter() - t
        if warm:
            continue
        rows.append(dict(n=n, method="pcv.fit (engine: newton-cg)", iterations=res.info["iterations"],
                         evaluations=res.info["evaluations"], cg_steps=None, seconds=sec, gap=res.info["gap"],
                         gap_tol=default_gap_tol(n), converged=res.converged))
        bound = make_bound(Poisson(y))
        mu = torch.zeros(n, dtype=torch.float64)
        d = torch.full((n,), offset, dtype=torch.float64)
        gc.collect()
        t = time.perf_counter()
        be = SparsePrecisionBackend(Qt, mu, None, d)
        sol = _newton(be, bound, initial_alpha(be, bound), default_gap_tol(n), 100, 20, History(), "ignore", None,
                      newton_solver="cg")
        sec = time.perf_counter() - t
        rows.append(dict(n=n, method="newton-cg (backend)", iterations=sol.iterations, evaluations=sol.evaluations,
                         cg_steps=sol.cg_iterations, seconds=sec, gap=sol.gap, gap_tol=default_gap_tol(n),
                         converged=sol.converged))
        print(f"  dual_vg n={n}: pcv.fit {rows[-2]['seconds']:.3g}s ({rows[-2]['iterations']} it), "
              f"newton {rows[-1]['seconds']:.3g}s ({rows[-1]['iterations']} it, {rows[-1]['cg_steps']} CG)", flush=True)
    return rows


# ----------------------------------------------------------------------------- output
def figure(lib_rows, dual_rows, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    four = [r for r in lib_rows if r["graph"] == "4-nb"]
    colours = {lib: f"C{i}" for i, lib in enumerate(ALL)}
    for lib in ALL:
        rs = sorted((r for r in four if r["library"] == lib and r["factor_s"] is not None), key=lambda r: r["n"])
        if rs:
            axes[0].loglog([r["n"] for r in rs], [r["factor_s"] for r in rs], "o-", color=colours[lib], label=lib)
        rs2 = [r for r in rs if r.get("selinv_s") is not None]
        if rs2:
            axes[1].loglog([r["n"] for r in rs2], [r["refactor_s"] + r["selinv_s"] for r in rs2], "o-",
                           color=colours[lib], label=lib)
    axes[0].set(title="factorisation (4-neighbour lattice)", xlabel="n", ylabel="seconds")
    axes[1].set(title="refactor + selected inversion", xlabel="n", ylabel="seconds")
    for method in sorted({r["method"] for r in dual_rows}):
        rs = sorted((r for r in dual_rows if r["method"] == method), key=lambda r: r["n"])
        axes[2].loglog([r["n"] for r in rs], [r["seconds"] for r in rs], "o-", label=method)
    axes[2].set(title="dual_vg: Poisson lattice GMRF", xlabel="n", ylabel="seconds")
    fig.tight_layout()
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    return save_figure(fig, name)


def main(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="repetitions per library and size (median reported)")
    parser.add_argument("--libraries", default=",".join(ALL), help="comma-separated subset of " + ",".join(ALL))
    args = parse_args("sparse_cholesky", argv, parser)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
    wanted = [s.strip() for s in args.libraries.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in ALL]
    if unknown:
        parser.error(f"--libraries: unknown {unknown}; choose from {ALL}")
    libs = [lib for lib in wanted if available(lib)]
    notes = [f"{lib}: not installed, skipped" for lib in wanted if lib not in libs]
    notes.append("scikit-sparse: not compared (no wheel; it builds against a system SuiteSparse)")
    if args.quick:
        sizes, eight_sizes, reps, sides = [32, 64], [32], args.reps or 3, [30, 50]
    else:
        sizes, eight_sizes, reps, sides = [32, 100, 316], [100, 316], args.reps or 5, [32, 100, 316]
    print(f"libraries: {libs}; 4-neighbour sides {sizes}, 8-neighbour sides {eight_sizes}; reps {reps}", flush=True)
    lib_rows, lib_notes = bench_libraries(sizes, reps, libs, eight_sizes)
    notes += lib_notes
    print("dual_vg fits:", flush=True)
    dual_rows = bench_dual_vg(sides)
    cols = ["graph", "n", "library", ("factor_s", "factor s"), ("refactor_s", "refactor s"), ("logdet_s", "logdet s"),
            ("solve_s", "solve s"), ("selinv_s", "selinv s"), ("nnz_L", "nnz(L)"), ("peak_mb", "peak MiB"),
            ("logdet_err", "logdet rel err"), ("selinv_err", "selinv rel err")]
    print()
    print(markdown_table(lib_rows, cols, floatfmt={"logdet_err": ".1e", "selinv_err": ".1e", "peak_mb": ".1f"}))
    print()
    print(markdown_table(dual_rows, ["n", "method", "iterations", "evaluations", ("cg_steps", "CG steps"), "seconds",
                                     "gap", "gap_tol", "converged"], floatfmt={"gap": ".2e", "gap_tol": ".1e"}))
    for note in notes:
        print("note:", note)
    name = "sparse_cholesky_quick" if args.quick else "sparse_cholesky"
    path = write_json(name, dict(quick=args.quick, reps=reps, libraries=libs, kappa_libraries=0.5, kappa_dual=0.2,
                                 libraries_table=lib_rows, dual_vg_table=dual_rows, notes=notes))
    print("wrote", path)
    print("wrote", figure(lib_rows, dual_rows, name))


if __name__ == "__main__":
    main()
