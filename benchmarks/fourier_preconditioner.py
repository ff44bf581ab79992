"""CG iterations per Newton system of the compressive-sensing model (Seeger 2010 §5): Jacobi vs Fourier and block preconditioners.

For each image side ``S`` (one design image, the benchmark's start design: pairs ``0 .. 16``, 33 k-space columns;
``tau = (0.08, 0.16)``, ``sigma^2 = 1e-3``), the same work is run once per preconditioner
(``ConvexVariationalRelaxation(preconditioner=...)`` / ``laplace_map(preconditioner=...)``):

* ``fit``: the cold fit of a design run (K-Lanczos, ``K`` steps, the benchmark's refit settings: at most 8 Newton
  steps per inner loop, CG to ``1e-5`` with the Eisenstat-Walker forcing of the inner loop), ``--outer`` outer
  iterations;
* ``map``: a cold MAP reconstruction with the benchmark's smoothing path (``z = 1e-4 -> 1e-5``), at most
  ``--map-newton`` Newton steps per ``z``.

Counts are of CG iterations (products with the Newton matrix), not seconds: they do not depend on the load of the
machine, so this script may run anywhere. Each run records its own trajectory (the Newton iterates differ by the
CG tolerance between preconditioners, so per-system counts are compared as means over the run).

Usage::

    python benchmarks/fourier_preconditioner.py --quick                # 32 and 64, seconds
    python benchmarks/fourier_preconditioner.py                        # 64, 128, 256 (tens of minutes)
    python benchmarks/fourier_preconditioner.py --sizes 256 --kinds jacobi,block4 --tag block
"""
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from _common import make_parser, markdown_table, parse_args, write_json  # noqa: E402
from compressive_sensing import MAP_OPTS, NOISE_VAR, TAU_PAPER, Measurements, load_pool  # noqa: E402

from pyro_convexvb.design.imaging import compressive_sensing_model, laplace_map  # noqa: E402
from pyro_convexvb.design.sequential import lowpass_pairs  # noqa: E402
from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation  # noqa: E402
from pyro_convexvb.infer.convex_relaxation.problem import PRECONDITIONERS  # noqa: E402

KINDS = PRECONDITIONERS


def _stats(counts):
    c = np.asarray(counts, dtype=float)
    return dict(systems=int(c.size), cg_mean=float(c.mean()) if c.size else float("nan"),
                cg_median=float(np.median(c)) if c.size else float("nan"), cg_max=int(c.max()) if c.size else 0,
                cg_total=int(c.sum()))


def run_size(size, kinds, image, k, outer, map_newton, seed):
    pool = load_pool(size)
    meas = Measurements(pool[image][0], seed)
    pairs = lowpass_pairs(size, 32)
    lgm = compressive_sensing_model(meas(pairs), size, size, pairs, NOISE_VAR, *TAU_PAPER)
    rows = []
    for kind in kinds:
        eng = ConvexVariationalRelaxation(lgm, variance="lanczos", lanczos_rank=k, max_outer=outer, max_newton=8,
                                          cg_tol=1e-5, preconditioner=kind, seed=seed, progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = eng.run()
        counts = [c for p in res.info["mvm"]["per_outer"] for c in p["cg_iterations"]]
        rows.append(dict(size=size, kind=kind, phase="fit", counts=counts, **_stats(counts)))
        print(f"S={size} {kind} fit: {rows[-1]['systems']} systems, mean CG {rows[-1]['cg_mean']:.1f}", flush=True)
        opts = dict(MAP_OPTS, max_newton=map_newton)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, info = laplace_map(lgm, None, preconditioner=kind, **opts)
        counts = [c for per_z in info["cg_iterations"] for c in per_z]
        rows.append(dict(size=size, kind=kind, phase="map", counts=counts, **_stats(counts)))
        print(f"S={size} {kind} map: {rows[-1]['systems']} systems, mean CG {rows[-1]['cg_mean']:.1f}", flush=True)
    return rows


def main(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="comma-separated image sides (default 64,128,256)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated preconditioners")
    parser.add_argument("--image", default="camera", help="design image of the pool (default camera)")
    parser.add_argument("--k", type=int, default=50, help="Lanczos steps of the fit (default 50)")
    parser.add_argument("--outer", type=int, default=1, help="outer iterations of the fit (default 1)")
    parser.add_argument("--map-newton", type=int, default=10, help="Newton steps per z of the MAP (default 10)")
    parser.add_argument("--tag", default=None, help="suffix of the results name (e.g. one set of kinds)")
    args = parse_args(parser=parser, argv=argv)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else ([32, 64] if args.quick else [64, 128, 256])
    kinds = args.kinds.split(",")
    for kd in kinds:
        if kd not in KINDS:
            parser.error(f"--kinds: unknown preconditioner {kd!r} (expected {', '.join(KINDS)})")
    if args.quick:
        args.k, args.outer, args.map_newton = min(args.k, 20), 1, min(args.map_newton, 3)
    name = "fourier_preconditioner" + ("_quick" if args.quick else "") + ("_" + args.tag if args.tag else "")
    settings = dict(sizes=sizes, kinds=kinds, image=args.image, k=args.k, outer=args.outer, map_newton=args.map_newton,
                    seed=args.seed, map_options=MAP_OPTS, fit=dict(max_newton=8, cg_tol=1e-5))
    rows = []
    for size in sizes:
        for kind in kinds:  # the JSON is rewritten after every (size, kind): a stopped run keeps what it did
            rows += run_size(size, [kind], args.image, args.k, args.outer, args.map_newton, args.seed)
            write_json(name, dict(settings=settings, rows=rows,
                                  note="CG iteration counts (load-independent); no wall times are recorded"))
    cols = ["size", "phase", "kind", "systems", "cg_mean", "cg_median", "cg_max", "cg_total"]
    print("\nCG iterations per Newton system (one design image, start design pairs 0..16):\n")
    print(markdown_table([{c: r[c] for c in cols} for r in rows], columns=cols, floatfmt=".1f"))


if __name__ == "__main__":
    main()
