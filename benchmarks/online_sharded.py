"""Regret cost of sharded online learning (pyro_convexvb.online.ShardedOnline) against the sequential Algorithm 1.

P ranks, each with ``blocks`` generation blocks (2^14 rows) of the block-cyclic shard of the d = 200, d_t = 20 stream
(Shamir & Szpankowski 2021, Figure 1 setting), merging every ``merge_every`` local rows in natural parameters
(``merge="natural"``) or by precision-averaged means (``"average"``), simulated in one process
(:func:`~pyro_convexvb.online.simulate_sharded`, the arithmetic of the all-reduce). The sequential algorithm runs
on the same rows in global order. Prints a markdown table of the extra progressive log-loss and writes it to
``benchmarks/results/online_sharded.json`` (``online_sharded_quick.json`` with ``--quick``).

    python benchmarks/online_sharded.py              # P = 2, 4, 8; merge_every = 10, 100, 1000; one block a rank
    python benchmarks/online_sharded.py --quick      # P = 2, merge_every = 10, 1000 rows a rank
"""
import argparse

import numpy as np
import scipy.sparse as sp

from pyro_convexvb.online import OnlineBayesLogistic, make_online_stream, simulate_sharded
from pyro_convexvb.online.streams import _BLOCK

from _common import write_json


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--merge-every", default="10,100,1000")
    ap.add_argument("--merges", default="natural,average")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    d, dt = 200, 20
    ranks = [2] if args.quick else [int(v) for v in args.ranks.split(",")]
    every = [10] if args.quick else [int(v) for v in args.merge_every.split(",")]
    rows = 1000 if args.quick else _BLOCK
    print("| P | merge_every | merge | rows | sequential log-loss | sharded log-loss | extra |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    out = []
    for P in ranks:
        g = make_online_stream(d=d, d_t=dt, seed=0)
        blocks = [g.global_block(b) for b in range(P)]
        X = sp.vstack([b[0][:rows] for b in blocks], format="csr")
        y = np.concatenate([b[1][:rows] for b in blocks])
        seq = OnlineBayesLogistic(d, prior_var=1.0).partial_fit(X, y, return_log_loss=True).sum()
        shards = [make_online_stream(d=d, d_t=dt, seed=0, shard=(r, P)).take(rows) for r in range(P)]
        for merge in args.merges.split(","):
            for m in every:
                ests = [OnlineBayesLogistic(d, prior_var=1.0) for _ in range(P)]
                loss = sum(ll.sum() for ll in simulate_sharded(ests, shards, m,
                                                               merge))
                print(f"| {P} | {m} | {merge} | {P * rows} | {seq:.1f} | {loss:.1f} | {(loss - seq) / seq:+.2%} |",
                      flush=True)
                out.append({"ranks": P, "merge_every": m, "merge": merge, "rows": P * rows,
                            "sequential_log_loss": float(seq), "sharded_log_loss": float(loss),
                            "extra": float((loss - seq) / seq)})
    write_json("online_sharded" + ("_quick" if args.quick else ""), {"rows": out, "quick": args.quick})


if __name__ == "__main__":
    main()
