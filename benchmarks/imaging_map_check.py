"""MAP reconstructions of the compressive-sensing benchmark: ADMM (``imaging_map``) against the Newton/IRLS path
(``laplace_map``) on one image and design.

For one test image (default ``camera``, the benchmark's crop and resize, its fixed noise draw) and the design
``pairs 0..S/8`` plus every 4th pair above (the ad hoc design of the benchmark's tau stage), it solves

* ``newton``: ``laplace_map`` on the benchmark's smoothing path (``MAP_OPTS``, ``z = 1e-4 -> 1e-5``, ``block4``),
* ``newton-tight``: ``laplace_map`` down to ``z = 1e-12`` (only with ``--tight``; slow at 256),
* ``admm``: ``imaging_map`` at the benchmark's tolerance (``ADMM_OPTS``) and at ``tol = 1e-8`` (reference),

and reports per solver the reconstruction error ``||u - u_true||``, its relative difference to the ADMM
reference's, the objective ``Psi_0(u)``, the work (ADMM iterations, i.e. FFT solves with 3 products with ``B~``
each; Newton steps and CG iterations, each CG iteration one product with ``A``) and seconds. Counts do not depend
on the machine's load; seconds do.

Usage::

    python benchmarks/imaging_map_check.py --quick           # 64 x 64, seconds
    python benchmarks/imaging_map_check.py --size 256 --threads 2 [--tight]
"""
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import make_parser, markdown_table, parse_args, write_json  # noqa: E402

import compressive_sensing as cs  # noqa: E402
from pyro_convexvb.design import compressive_sensing_model, imaging_map, laplace_map  # noqa: E402
from pyro_convexvb.design.sequential import known_columns, lowpass_pairs, pair_candidates  # noqa: E402
from pyro_convexvb.errors import ConvergenceWarning  # noqa: E402


def main(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="image side (power of 2)")
    parser.add_argument("--image", default="camera", help="image of the benchmark's pool")
    parser.add_argument("--tight", action="store_true", help="also laplace_map down to z = 1e-12")
    args = parse_args(parser=parser, argv=argv)
    S = 64 if args.quick else args.size
    pool = cs.load_pool(S)
    names = sorted(pool)
    meas = cs.Measurements(pool[args.image][0], args.seed * 7919 + names.index(args.image))
    start = lowpass_pairs(S, S // 8)
    pairs = start + [c for c in pair_candidates(S) if c > start[-1] and c % 4 == 0]
    lgm = compressive_sensing_model(meas(pairs), S, S, list(pairs), cs.NOISE_VAR, *cs.TAU_PAPER)
    rows = []

    def record(name, fn):
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always", ConvergenceWarning)
            u, info = fn()
        secs = time.perf_counter() - t0
        row = dict(solver=name, error=meas.error(u), objective=info["objective"], seconds=secs,
                   warnings=len(w))
        if "iterations" in info:
            row.update(iterations=info["iterations"], products=info["products"], cg_iterations=0,
                       newton_steps=0, converged=info["converged"])
        else:
            row.update(iterations=0, products=0, newton_steps=sum(info["newton_steps"]),
                       cg_iterations=sum(sum(c) for c in info["cg_iterations"]), converged=info["converged"])
        rows.append(row)
        print(f"{name}: {row}", flush=True)
        return u

    record(f"admm tol={cs.ADMM_OPTS['tol']:g}", lambda: imaging_map(lgm, progress=False, **cs.ADMM_OPTS))
    record("newton (benchmark path)", lambda: laplace_map(lgm, preconditioner=cs.MAP_PRECONDITIONER, **cs.MAP_OPTS))
    u_ref = record("admm tol=1e-8", lambda: imaging_map(lgm, tol=1e-8, max_iter=50000, progress=False))
    if args.tight:
        record("newton tight (z -> 1e-12)", lambda: laplace_map(lgm, preconditioner=cs.MAP_PRECONDITIONER,
                                                                 z_start=1e-4, z_factor=1e-2, z_final=1e-12))
    e_ref = meas.error(u_ref)
    for r in rows:
        r["error_rel_diff_vs_admm_ref"] = abs(r["error"] - e_ref) / e_ref
    print(f"\n{S} x {S} '{args.image}', {known_columns(pairs, S)} columns; ADMM iteration = one FFT solve and 3 "
          "products with B~, Newton CG iteration = one product with A (machine load: see the JSON)\n")
    print(markdown_table(rows, floatfmt=".4g"))
    write_json("imaging_map_check" + ("_quick" if args.quick else f"_{S}"),
               dict(size=S, image=args.image, pairs=pairs, columns=known_columns(pairs, S), rows=rows,
                    admm_options=cs.ADMM_OPTS, newton_options=dict(cs.MAP_OPTS, preconditioner=cs.MAP_PRECONDITIONER)))


if __name__ == "__main__":
    main()
