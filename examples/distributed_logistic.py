"""Bayesian logistic regression on row-sharded data with ``torch.distributed``: every rank holds its own rows.

Each process loads only its rows, wraps them with ``pcv.distributed.row_sharded`` and fits the unchanged Pyro
model; every rank gets the posterior, variances and bound of the single-process fit on all rows.

    python -m torch.distributed.run --standalone --nproc_per_node=2 examples/distributed_logistic.py
    python examples/distributed_logistic.py                       # one process, same answer
    python -m torch.distributed.run --standalone --nproc_per_node=2 examples/distributed_logistic.py --a9a

Data: by default a generated problem of the rcv1 shape (Nickisch & Seeger 2009: 677,399 x 42,736, 49.6M
nonzeros) scaled down to ``--scale`` of its rows and nonzeros (``make_sparse_classification(shard=...)``
generates this rank's rows only); with ``--a9a`` the real a9a (``pcv.datasets.a9a_path()``) written once to an
svmlight file that each rank reads its byte range of (``load_svmlight(shard=...)``).
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402


def model(X, y, prior_scale=1.0):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=torch.float64), prior_scale).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)


def load(args, rank, world):
    if not args.a9a:
        X, y, _ = pcv.datasets.make_sparse_classification(args.shape, scale=args.scale, seed=args.seed,
                                                          shard=(rank, world))
        return X, y
    path = os.path.join(tempfile.gettempdir(), "pcv_a9a.svm")
    if rank == 0 and not os.path.isfile(path):
        X, y = pcv.datasets.load_a9a(train_size=None)
        pcv.datasets.save_svmlight(path + ".part", X, 2 * y - 1)
        os.replace(path + ".part", path)
    if pcv.distributed.is_active():
        torch.distributed.barrier()
    X, y = pcv.datasets.load_svmlight(path, n_features=123, zero_based=False, shard=(rank, world))
    return X, pcv.datasets.labels01(y)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="rcv1", help="shape of the generated data (a9a, real-sim, rcv1)")
    p.add_argument("--scale", type=float, default=0.01, help="fraction of the shape's rows and nonzeros")
    p.add_argument("--a9a", action="store_true", help="real a9a, read from an svmlight file by byte ranges")
    p.add_argument("--engine", default="convex_relaxation", help="convex_relaxation, laplace, dual_vg, ...")
    p.add_argument("--k", type=int, default=50, help="Lanczos steps (convex_relaxation)")
    p.add_argument("--max-outer", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = pcv.distributed.init()
    X, y = load(args, rank, world)
    Xs = pcv.distributed.row_sharded(X)
    options = {}
    if args.engine == "convex_relaxation":
        options = {"variance": "lanczos", "lanczos_rank": args.k, "max_outer": args.max_outer}
    pcv.distributed.reset_stats()
    t0 = time.perf_counter()
    res = pcv.fit(model, Xs, y, engine=args.engine, options=options, progress=False)
    seconds = time.perf_counter() - t0
    comm = pcv.distributed.stats()
    if rank == 0:
        print(f"{world} process(es); rows {Xs.global_rows} ({X.shape[0]} on rank 0), features {X.shape[1]}")
        print(f"engine {args.engine}: {seconds:.2f} s, bound {res.log_evidence_bound}, converged {res.converged}")
        print(f"posterior mean[:5] {res.posterior.loc[:5].tolist()}")
        print(f"posterior var[:5]  {res.posterior.variance[:5].tolist()}")
        print(f"all-reduces {comm['calls']}, {comm['bytes'] / 2**20:.2f} MiB, {comm['seconds']:.2f} s")
    return res


if __name__ == "__main__":
    main()
    if pcv.distributed.is_active():
        torch.distributed.destroy_process_group()
