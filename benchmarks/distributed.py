"""Row-sharded convex_relaxation on the rcv1 shape with P = 1 and 2 processes (torch.distributed, gloo, 1 thread each).

The rcv1 shape of Nickisch & Seeger 2009 (677,399 x 42,736, 49.6M nonzeros; ``make_sparse_classification``,
90% of the rows for training as in ``benchmarks/convex_relaxation.py``), Gaussian prior, Bernoulli-logit sites,
``k = 750`` Lanczos steps, one outer update. Each P runs as a ``torchrun`` launch of this script (``--worker``);
P = 1 and P = 2 alternate, and the table gives medians over the repetitions: wall time of the fit, per-process
peak memory (``VmHWM``, including the interpreter and the rank's rows), all-reduce calls, bytes and seconds,
and per Lanczos step the all-reduced bytes and time (the ``n``-vector of ``Bᵀ(w ⊙ B q)``).

    python benchmarks/distributed.py --quick          # ~1% of the rows, k = 20, one repetition (seconds)
    python benchmarks/distributed.py                  # full rcv1 shape (heavy: run alone, ~GBs, minutes)
    python benchmarks/distributed.py --scale 0.25 --reps 3

Writes ``benchmarks/results/distributed[_quick].json`` and prints a markdown table.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import ROOT, make_parser, markdown_table, parse_args, peak_rss_mb, write_json  # noqa: E402


def worker(args):
    import pyro
    import pyro.distributions as dist
    import torch

    import pyro_convexvb as pcv

    torch.set_num_threads(1)
    rank, world = pcv.distributed.init()

    def model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)

    t0 = time.perf_counter()
    # the training rows (90% of the shape, as benchmarks/convex_relaxation.py), this rank's share
    X, y, _ = pcv.datasets.make_sparse_classification("rcv1", scale=args.scale, seed=args.seed, shard=(rank, world))
    gen_seconds = time.perf_counter() - t0
    rss_data = peak_rss_mb()
    Xs = pcv.distributed.row_sharded(X)
    if pcv.distributed.is_active():
        torch.distributed.barrier()
    pcv.distributed.reset_stats()
    t0 = time.perf_counter()
    res = pcv.fit(model, Xs, y, engine="convex_relaxation", progress=False,
                  options={"variance": "lanczos", "lanczos_rank": args.k, "max_outer": args.max_outer})
    seconds = time.perf_counter() - t0
    st = pcv.distributed.stats()
    n = X.shape[1]
    lanczos_steps = sum(res.info["mvm"]["lanczos_steps"])
    per_n = st["by_numel"].get(n, [0, 0.0])
    out = dict(rank=rank, world=world, rows=X.shape[0], global_rows=Xs.global_rows, n=n,
               nnz=int(X.values().numel()), seconds=seconds, generate_seconds=gen_seconds,
               outer_seconds=res.info["mvm"]["seconds"]["outer"], inner_seconds=res.info["mvm"]["seconds"]["inner"],
               peak_rss_mb=peak_rss_mb(), rss_after_data_mb=rss_data, allreduce_calls=st["calls"],
               allreduce_bytes=st["bytes"], allreduce_seconds=st["seconds"], allreduce_n_calls=per_n[0],
               allreduce_n_seconds=per_n[1], lanczos_steps=lanczos_steps, bound=res.log_evidence_bound,
               mean_head=res.posterior.loc[:5].tolist())
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if pcv.distributed.is_active():  # leave the process group before exit (a live one can abort a rank at teardown)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def launch(P, args, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={P}", __file__,
           "--worker", "--out", out, "--scale", str(args.scale), "--k", str(args.k), "--max-outer",
           str(args.max_outer), "--seed", str(args.seed)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"P = {P} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    ranks = []
    for r in range(P):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return dict(P=P, launch_seconds=time.perf_counter() - t0, ranks=ranks)


def summarize(runs, P):
    mine = [r for r in runs if r["P"] == P]
    med = lambda f: statistics.median(f(r) for r in mine)  # noqa: E731
    r0 = mine[0]["ranks"][0]
    steps = max(1, r0["lanczos_steps"])
    return {
        "P": P,
        "fit s": med(lambda r: max(x["seconds"] for x in r["ranks"])),
        "outer s": med(lambda r: max(x["outer_seconds"] for x in r["ranks"])),
        "inner s": med(lambda r: max(x["inner_seconds"] for x in r["ranks"])),
        "peak MiB / process": med(lambda r: max(x["peak_rss_mb"] for x in r["ranks"])),
        "rows / process": max(x["rows"] for x in mine[0]["ranks"]),
        "all-reduces": r0["allreduce_calls"],
        "all-reduce MiB": r0["allreduce_bytes"] / 2**20,
        "all-reduce s": med(lambda r: max(x["allreduce_seconds"] for x in r["ranks"])),
        "Lanczos steps": r0["lanczos_steps"],
        "KiB / Lanczos step": r0["n"] * 8 / 1024 if P > 1 else 0.0,
        "ms all-reduce / n-vector": 1e3 * med(lambda r: max(x["allreduce_n_seconds"] / max(1, x["allreduce_n_calls"])
                                                          for x in r["ranks"])) if P > 1 else 0.0,
        "ms outer / Lanczos step": 1e3 * med(lambda r: max(x["outer_seconds"] for x in r["ranks"])) / steps,
        "bound": r0["bound"],
    }


#: parameters of the cost model (docs/distributed.md): seconds per nonzero per sparse product and thread (rcv1 full
#: shape, benchmarks/results/convex_relaxation_rcv1_size1.json: 189.5 s of outer loop for 1,500 products with
#: B and Bᵀ, 50.2M nonzeros, 2 threads -> 2.5 ns; an upper bound, it includes the reorthogonalisation),
#: memory bandwidth per process (bytes/s), all-reduce latency (s) and the network bandwidths (bytes/s) tabulated
COST = dict(c_nz=2.5e-9, mem_bw=10e9, alpha=20e-6, betas={"10 Gb/s": 1.25e9, "100 Gb/s": 12.5e9})


def cost_model(rows=4.4e9, nnz_per_row=39, features=(1e6, 1e7), k=750, inner_products=40,
               procs=(8, 16, 32, 64, 128, 256, 512), c_nz=COST["c_nz"], mem_bw=COST["mem_bw"], alpha=COST["alpha"],
               betas=COST["betas"]):
    """Per-rank memory and time of one outer update of row-sharded convex_relaxation (docs/distributed.md).

    Per product with ``A = XᵀX + Bᵀ diag(w) B``: the local sparse products ``B q`` and ``Bᵀ u`` on ``nnz / P``
    nonzeros (``2 c nnz / P``), one all-reduce of an ``n``-vector (ring: ``2 * 8 n / beta``; latency
    ``2 log2(P) alpha``), and the replicated Lanczos work: full reorthogonalisation reads the ``j`` stored vectors
    twice (``2 * 8 j n / mem_bw`` at step ``j``, ``8 k^2 n / mem_bw`` over ``k`` steps), not divided by ``P``.
    Memory per rank: the rows as CSR plus its CSR transpose (values 8 B, 32-bit indices 4 B: 24 B a nonzero),
    ``80 B`` of site vectors a row, and the replicated ``k`` Lanczos vectors plus ~20 latent vectors (``8 (k + 20) n``).

    :returns: list of dict rows (one per ``(n, P)``), including ``P*`` where the sharded products cost what the
        replicated per-step work costs (beyond it more ranks do not help).
    """
    import math

    nnz = rows * nnz_per_row
    out = []
    for n in features:
        repl_mem = 8 * (k + 20) * n
        steps = k + inner_products
        reorth = 8 * k * k * n / mem_bw
        for P in procs:
            row = {"n": f"{n:.0e}", "P": P,
                   "GB / rank (rows)": (24 * nnz + 80 * rows) / P / 1e9,
                   "GB / rank (replicated)": repl_mem / 1e9,
                   "MB all-reduced / step": 8 * n / 1e6}
            spmv = 2 * c_nz * nnz / P
            for label, beta in betas.items():
                comm = 2 * 8 * n / beta + 2 * math.log2(P) * alpha
                row[f"s / outer ({label})"] = steps * (spmv + comm) + reorth
            row["of which reorth s"] = reorth
            out.append(row)
    stops = {}
    for n in features:
        for label, beta in betas.items():
            per_step = 2 * 8 * n / beta + 8 * k * n / mem_bw  # all-reduce + average reorthogonalisation per step
            stops[(f"{n:.0e}", label)] = 2 * c_nz * nnz / per_step
    return out, stops


def main():
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--cost-model", action="store_true", help="print the Criteo-1TB cost model table and exit")
    parser.add_argument("--worker", action="store_true", help=argparse_hidden())
    parser.add_argument("--out", default=None, help=argparse_hidden())
    parser.add_argument("--scale", type=float, default=None, help="fraction of rcv1's rows and nonzeros "
                                                                 "(default 0.9: the training rows; --quick 0.01)")
    parser.add_argument("--k", type=int, default=None, help="Lanczos steps (default 750; --quick 20)")
    parser.add_argument("--max-outer", type=int, default=1, help="outer updates (default 1)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of each P (default 3; --quick 1)")
    parser.add_argument("--procs", default="1,2", help="process counts, alternated (default 1,2)")
    args = parse_args(parser=parser)
    if args.scale is None:
        args.scale = 0.01 if args.quick else 0.9
    if args.k is None:
        args.k = 20 if args.quick else 750
    if args.worker:
        return worker(args)
    if args.cost_model:
        rows, stops = cost_model()
        print(markdown_table(rows, floatfmt=".3g"))
        for (n, label), P in stops.items():
            print(f"n = {n}, {label}: sharded products cost the replicated per-step work at P* = {P:.0f}")
        return None
    reps = args.reps or (1 if args.quick else 3)
    procs = [int(p) for p in args.procs.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for P in (procs if rep % 2 == 0 else procs[::-1]):  # alternate the order
                out = os.path.join(tmp, f"r{rep}p{P}")
                os.makedirs(out)
                runs.append(launch(P, args, out))
                print(f"rep {rep} P = {P}: fit {max(x['seconds'] for x in runs[-1]['ranks']):.2f} s", flush=True)
    rows = [summarize(runs, P) for P in procs]
    print(markdown_table(rows))
    name = "distributed_quick" if args.quick else "distributed"
    path = write_json(name, {"settings": dict(scale=args.scale, k=args.k, max_outer=args.max_outer, reps=reps,
                                              procs=procs, threads_per_process=1), "table": rows, "runs": runs})
    print(f"wrote {path}")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
