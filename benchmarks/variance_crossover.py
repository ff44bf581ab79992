"""Exact (dense Cholesky) against Lanczos variance steps of the convex relaxation: the crossover ``n``, and
the constants of the cost model behind ``variance="auto"``.

One outer-loop variance step of the convex relaxation (Nickisch & Seeger 2009 §2.3) computes
``z = diag(B A^{-1} B^T)`` either exactly, from a dense Cholesky factor of ``A`` (``variance="exact"``), or
from ``k`` Lanczos steps (``variance="lanczos"``: Nickisch & Seeger's K-Lanczos on sparse and dense designs,
the whitened estimator on Gaussian-process priors).  ``variance="auto"`` picks the one its cost model
(``pyro_convexvb.infer.convex_relaxation.outer.variance_costs``) predicts to be cheaper.  This script
measures both over ``n``, design density and ``k`` (the paper's ``k = 80`` and ``k = 750``), and fits the
model's constants.

Cases (float64, ``q = rows_per_col * n`` logistic sites at the engine's initial ``gamma``):

* ``dense``: dense design, Gaussian prior ``N(0, I)``;
* ``sparse-1%``, ``sparse-0.1%``: CSR designs with that density (at least 3 nonzeros per row);
* ``gp``: Gaussian-process classification, RBF kernel on 2-D inputs (``B = I``, ``q = n``).

Per ``(case, n, k)`` with ``k < n`` it times, alternating their order over ``--repeats`` repetitions
(median reported): one exact step (form ``A`` from ``n`` products, Cholesky, triangular inverse, ``z``), one
Lanczos step without a dense ``log|A|`` (``dense_logdet_max = 0``), and the dense ``log|A|`` (form ``A``
and factorise) that the Lanczos route adds when ``n <= dense_logdet_max`` (2000 by default).

Reports the measured crossover ``n`` (smallest ``n`` at which Lanczos is faster, interpolated in
``log n``) with and without the dense ``log|A|``, the crossover the current constants predict, and the
constants refitted by nonnegative least squares on relative errors (paste them into ``outer.py``).

Usage::

    python benchmarks/variance_crossover.py --quick     # small n, k = 20, 80; under a minute
    python benchmarks/variance_crossover.py             # n = 100 .. 3200, k = 80, 750 (run on a quiet machine)
    python benchmarks/variance_crossover.py --ns 200,400,800,1600,3200,6400 --cases sparse-0.1%,gp
"""
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import Timer, make_parser, markdown_table, parse_args, write_json  # noqa: E402

from pyro_convexvb.gp.classifier import gp_classification_lgm  # noqa: E402
from pyro_convexvb.infer.convex_relaxation import ConvexRelaxationOptions, outer  # noqa: E402
from pyro_convexvb.infer.convex_relaxation.outer import variance_costs, variance_step  # noqa: E402
from pyro_convexvb.infer.convex_relaxation.problem import RelaxationProblem  # noqa: E402
from pyro_convexvb.lgm.model import LatentGaussianModel  # noqa: E402
from pyro_convexvb.lgm.sites import BernoulliLogit  # noqa: E402

D = torch.float64
CASES = ("dense", "sparse-1%", "sparse-0.1%", "gp")
CONSTANTS = ("EXACT_CUBIC_SECONDS", "FORM_FLOP_SECONDS", "MVM_FLOP_SECONDS", "ORTH_FLOP_SECONDS", "STEP_SECONDS")


def make_problem(case, n, rows_per_col, seed):
    """The case's :class:`RelaxationProblem` and the engine's initial ``gamma`` (at ``u = 0``)."""
    g = torch.Generator().manual_seed(seed)
    if case == "gp":
        X = torch.randn(n, 2, generator=g, dtype=D)
        K = 2.0 * torch.exp(-0.5 * torch.cdist(X, X) ** 2 / 0.8**2) + 1e-6 * torch.eye(n, dtype=D)
        f = torch.linalg.cholesky(K) @ torch.randn(n, generator=g, dtype=D)
        y = (torch.rand(n, generator=g, dtype=D) < torch.sigmoid(f)).to(D)
        lgm = gp_classification_lgm(K, y)
    else:
        q = rows_per_col * n
        if case == "dense":
            X = torch.randn(q, n, generator=g, dtype=D) / math.sqrt(n)
            design = X
        else:
            density = {"sparse-1%": 0.01, "sparse-0.1%": 0.001}[case]
            per_row = max(3, int(round(density * n)))
            rows = torch.arange(q).repeat_interleave(per_row)
            cols = torch.randint(0, n, (q * per_row,), generator=g)
            vals = torch.randn(q * per_row, generator=g, dtype=D) / math.sqrt(per_row)
            design = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (q, n)).coalesce().to_sparse_csr()
            X = design
        w = torch.randn(n, generator=g, dtype=D)
        eta = X @ w if case == "dense" else torch.mv(design, w)
        y = (torch.rand(q, generator=g, dtype=D) < torch.sigmoid(eta)).to(D)
        lgm = LatentGaussianModel.from_design(design, BernoulliLogit(y), prior_scale=1.0)
    prob = RelaxationProblem(lgm)
    gamma = prob.pot.gamma_init(prob.s(torch.zeros(prob.n, dtype=D)))
    return prob, gamma


def time_case(case, n, ks, block_size, rows_per_col, repeats, seed):
    """Median seconds of the exact step, the Lanczos step (each k) and the dense log|A|, alternated."""
    prob, gamma = make_problem(case, n, rows_per_col, seed)
    w = 1.0 / gamma
    ks = [k for k in ks if k < n]

    def exact():
        return variance_step(prob, gamma, ConvexRelaxationOptions(variance="exact"))

    def logdet():
        return torch.linalg.cholesky(prob.dense_a(w))

    def lanczos(k):
        opts = ConvexRelaxationOptions(variance="lanczos", lanczos_rank=k, lanczos_block_size=block_size,
                                       dense_logdet_max=0)
        return lambda: variance_step(prob, gamma, opts, torch.Generator().manual_seed(seed))

    jobs = [("exact", exact), ("logdet", logdet)] + [(f"lanczos{k}", lanczos(k)) for k in ks]
    prob.covariance_form()  # one-time setup of the whitened estimator, cached by the problem (not timed)
    times = {name: [] for name, _ in jobs}
    for r in range(repeats):
        for name, fn in (jobs if r % 2 == 0 else jobs[::-1]):
            with Timer() as t:
                fn()
            times[name].append(t.seconds)
    med = {name: statistics.median(v) for name, v in times.items()}
    f_a = prob.mvm_flops()
    f_b = prob.B.flops() if prob.B is not None else 0.0
    est = outer.choose_lanczos_estimator(prob)
    f_lz = prob.mvm_flops(whitened=True) if est == "whitened" else f_a
    nnz = int(prob.B.base.nnz) if hasattr(prob.B.base, "nnz") else int(prob.B.shape[0] * prob.B.shape[1])
    rows = []
    for k in ks:
        opts = ConvexRelaxationOptions(lanczos_rank=k, lanczos_block_size=block_size, dense_logdet_max=0)
        pred = variance_costs(prob, opts)
        rows.append(dict(case=case, n=n, q=prob.q, nnz=nnz if case != "gp" else n * n, k=k, b=block_size,
                         estimator=est, exact_s=med["exact"], lanczos_s=med[f"lanczos{k}"], logdet_s=med["logdet"],
                         lanczos_over_exact=med[f"lanczos{k}"] / med["exact"],
                         lanczos_dense_logdet_over_exact=(med[f"lanczos{k}"] + med["logdet"]) / med["exact"],
                         model_exact_s=pred["exact"], model_lanczos_s=pred["lanczos"],
                         choice_now=outer.choose_variance_method(
                             prob, ConvexRelaxationOptions(lanczos_rank=k, lanczos_block_size=block_size)),
                         f_a=f_a, f_b=f_b, f_lanczos=f_lz, times=times))
    if not ks:  # no k below n: keep the exact time for the fit
        rows.append(dict(case=case, n=n, q=prob.q, k=None, b=block_size, estimator=est, exact_s=med["exact"],
                         logdet_s=med["logdet"], f_a=f_a, f_b=f_b, f_lanczos=f_lz, times=times))
    return rows


def features(row):
    """Design rows of the least-squares fit (columns in the order of ``CONSTANTS``) and their targets."""
    n = row["n"]
    out = [([n**3, n * (row["f_a"] + row["f_b"]), 0, 0, 0], row["exact_s"]),
           ([0.25 * n**3, n * row["f_a"], 0, 0, 0], row["logdet_s"])]
    if row.get("k"):
        k, b = row["k"], row["b"]
        s = min(b, outer.BLOCK_SPEEDUP_MAX)
        out.append(([0, 0, k * row["f_lanczos"] / s, 2.0 * n * k * k / s, math.ceil(k / b)], row["lanczos_s"]))
    return out


def fit_constants(rows):
    """Nonnegative least squares on relative errors: ``min ||(F c - t) / t||``, ``c >= 0``."""
    from scipy.optimize import nnls

    F, t = [], []
    for r in rows:
        for f, y in features(r):
            F.append([fi / y for fi in f])
            t.append(1.0)
    F = np.asarray(F)
    scale = np.maximum(np.abs(F).max(0), 1e-300)
    c, _ = nnls(F / scale, np.asarray(t))
    return dict(zip(CONSTANTS, (c / scale).tolist()))


def model_seconds(row, consts):
    """``(exact, dense log|A|, Lanczos)`` seconds of ``row`` under the constants ``consts``."""
    c = [consts[name] for name in CONSTANTS]
    return tuple(float(np.dot(f, c)) for f, _ in features(row))


def crossover(points):
    """Smallest ``n`` with ratio < 1, interpolated in ``log n`` against ``log ratio``; ``(value, note)``."""
    pts = sorted(points)
    if not pts:
        return None, "no data"
    if pts[0][1] < 1:
        return None, f"< {pts[0][0]}"
    for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
        if r1 < 1 <= r0:
            t = math.log(r0) / (math.log(r0) - math.log(r1))
            return math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0))), ""
    return None, f"> {pts[-1][0]}"


def crossover_rows(rows, fitted, dense_logdet_max):
    now = {name: getattr(outer, name) for name in CONSTANTS}
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        for k in sorted({r["k"] for r in rows if r["case"] == case and r.get("k")}):
            sel = [r for r in rows if r["case"] == case and r.get("k") == k]
            entry = dict(case=case, k=k)
            for label, with_ld in (("", False), ("_dense_logdet", True)):
                meas = [(r["n"], (r["lanczos_s"] + (r["logdet_s"] if with_ld and r["n"] <= dense_logdet_max else 0))
                         / r["exact_s"]) for r in sel]
                val, note = crossover(meas)
                entry[f"measured{label}"] = round(val) if val else note
                for tag, consts in (("model_now", now), ("model_fitted", fitted)):
                    pts = []
                    for r in sel:
                        e, ld, lz = model_seconds(r, consts)
                        extra = ld if with_ld and r["n"] <= dense_logdet_max else 0.0
                        pts.append((r["n"], (lz + extra) / max(e, 1e-300)))
                    val, note = crossover(pts)
                    entry[f"{tag}{label}"] = round(val) if val else note
            out.append(entry)
    return out


def main():
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--ns", default=None, help="comma list of n (default 100,...,3200; --quick: 50,100,200)")
    parser.add_argument("--ks", default=None, help="comma list of Lanczos steps k (default 80,750; --quick: 20,80)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of cases: {','.join(CASES)}")
    parser.add_argument("--block-size", type=int, default=1, help="Lanczos block size b (default 1)")
    parser.add_argument("--rows-per-col", type=int, default=4, help="sites per latent coordinate, q = this * n")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per timing (median; default 5, quick 3)")
    parser.add_argument("--dense-logdet-max", type=int, default=2000,
                        help="n up to which the Lanczos route also computes a dense log|A| (the engine's default)")
    args = parse_args(parser=parser)
    ns = [int(x) for x in args.ns.split(",")] if args.ns else ([50, 100, 200] if args.quick else
                                                                [100, 200, 400, 800, 1600, 3200])
    ks = [int(x) for x in args.ks.split(",")] if args.ks else ([20, 80] if args.quick else [80, 750])
    repeats = args.repeats or (3 if args.quick else 5)
    cases = args.cases.split(",")
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; choose from {CASES}")
    time_case("gp", 40, [10], args.block_size, args.rows_per_col, 1, args.seed)  # warm-up, not reported
    time_case("sparse-1%", 40, [10], args.block_size, args.rows_per_col, 1, args.seed)
    rows = []
    for case in cases:
        for n in ns:
            with Timer() as t:
                rows += time_case(case, n, ks, args.block_size, args.rows_per_col, repeats, args.seed)
            print(f"[{case} n={n}] {t.seconds:.1f}s", file=sys.stderr, flush=True)
    fitted = fit_constants(rows)
    cross = crossover_rows(rows, fitted, args.dense_logdet_max)
    timed = [r for r in rows if r.get("k")]
    print(markdown_table(timed, ["case", "n", "q", "k", "b", "estimator", "exact_s", "lanczos_s", "logdet_s",
                                 "lanczos_over_exact", "lanczos_dense_logdet_over_exact", "model_exact_s",
                                 "model_lanczos_s", "choice_now"]))
    print()
    print(f"Crossover n (Lanczos faster above it); `_dense_logdet`: the Lanczos route also factorises A for "
          f"log|A| when n <= {args.dense_logdet_max}")
    print()
    print(markdown_table(cross, ["case", "k", "measured", "model_now", "model_fitted", "measured_dense_logdet",
                                 "model_now_dense_logdet", "model_fitted_dense_logdet"]))
    print()
    print("Constants (outer.py): current -> refitted")
    print()
    print(markdown_table([dict(constant=c, current=getattr(outer, c), fitted=fitted[c]) for c in CONSTANTS],
                         ["constant", "current", "fitted"], ".3g"))
    name = "variance_crossover_quick" if args.quick else "variance_crossover"
    path = write_json(name, {"rows": rows, "crossover": cross, "fitted_constants": fitted,
                             "current_constants": {c: getattr(outer, c) for c in CONSTANTS}, "args": vars(args)})
    print(f"\nwrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
