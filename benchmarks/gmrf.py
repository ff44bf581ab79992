"""Poisson counts on a 2-D lattice GMRF: ``dual_vg`` on a sparse precision at 10^3-10^5 nodes.

Model: ``f ~ SparseGMRF(0, kappa (D - 0.99 W))`` (4-neighbour lattice, ``kappa = 2`` fixed), counts
``y_i ~ Poisson(E_i exp(f_i))`` with exposures ``E_i``, written as an ordinary Pyro model with
``pcv.distributions.SparseGMRF`` and fitted by ``pcv.fit(model, E, y=y, engine="dual_vg")``: extraction
keeps the precision sparse, and the dual's GMRF form factorises ``Q + Lambda`` with a sparse Cholesky
factorisation (QDLDL, symbolic analysis reused) and takes Newton-CG steps; site variances come from
selected inversion (Takahashi et al. 1973).

Peers in the same run:

* the same model written with ``MultivariateNormal(precision_matrix=Q)`` (a dense ``n x n`` precision:
  what a Pyro user writes without a sparse distribution), fitted by ``dual_vg`` (small ``n`` only);
* Pyro's ``svi_autonormal`` on the ``SparseGMRF`` model (5,000 steps), its evidence bound compared.

Reports wall seconds (median of ``--repeats`` alternating runs), the peak resident memory of the fit
(in a fresh process), the nonzeros of the Cholesky factor, the duality gap and the evidence bound;
draws ``docs/figures/gmrf[_quick].png`` (seconds and memory against the number of nodes).
Targets: 10^4 nodes in under 5 s, 10^5 nodes in under 2 minutes, memory of the order of the factor.

Usage::

    python benchmarks/gmrf.py --quick      # 30 x 30 and 60 x 60
    python benchmarks/gmrf.py              # 45 x 45 (with the dense peer), 100 x 100, 317 x 317
"""
import math
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402
from _common import Timer, lattice_precision, make_parser, markdown_table, parse_args, peak_rss_in_subprocess, save_figure, write_json  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402

D = torch.float64


def data(m, seed=0, kappa=2.0):
    Q = lattice_precision(m) * kappa
    g = torch.Generator().manual_seed(seed)
    from pyro_convexvb.linalg import SparseCholesky

    chol = SparseCholesky(Q.to_sparse_csr())
    f = chol.solve_Lt(torch.randn(m * m, generator=g, dtype=D))
    E = 5.0 + 20.0 * torch.rand(m * m, generator=g, dtype=D)
    y = torch.poisson(E * torch.exp(f), generator=g)
    return Q, E, y


def sparse_model(Q):
    n = Q.shape[0]

    def model(E, y=None):
        f = pyro.sample("f", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Q))
        with pyro.plate("areas", n):
            pyro.sample("y", dist.Poisson(E * torch.exp(f)), obs=y)

    return model


def dense_model(Q):
    n = Q.shape[0]
    P = Q.to_dense()

    def model(E, y=None):
        f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(n, dtype=D), precision_matrix=P))
        with pyro.plate("areas", n):
            pyro.sample("y", dist.Poisson(E * torch.exp(f)), obs=y)

    return model


def fit_once(kind, m, seed=0):
    """One fit in this process: ``(seconds, result summary)``."""
    torch.set_default_dtype(D)
    Q, E, y = data(m, seed)
    model = sparse_model(Q) if kind != "dense" else dense_model(Q)
    engine = "svi_autonormal" if kind == "svi" else "dual_vg"
    opts = dict(max_steps=5000, lr=0.05) if kind == "svi" else {}
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Timer() as t:
            res = pcv.fit(model, E, y=y, engine=engine, options=opts, progress=False)
    out = {"seconds": t.seconds, "bound": res.log_evidence_bound, "converged": bool(res.converged)}
    if engine == "dual_vg":
        out["gap"] = float(res.info["gap"])
        out["form"] = res.info["form"]
        backend = res.state.backend
        chol = getattr(backend, "cholQ", None)
        out["factor_nnz"] = int(chol.nnz) if chol is not None else None
    return t.seconds, out


def _memory(kind, m):
    return fit_once(kind, m)[1]


def figure(rows, name):
    """Seconds and fit memory against the number of nodes, per method (log-log)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        n = [r["nodes"] for r in rs]
        axes[0].plot(n, [r["seconds"] for r in rs], "o-", label=method)
        axes[1].plot(n, [r["fit_delta_mb"] for r in rs], "o-", label=method)
    for ax, label in zip(axes, ["seconds (median)", "fit memory (MiB, peak RSS growth)"]):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("lattice nodes")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title("Poisson counts on a lattice GMRF", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, name)


def main():
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="alternating repetitions (default 3, quick 1)")
    args = parse_args(parser=parser)
    torch.set_default_dtype(D)
    repeats = args.repeats or (1 if args.quick else 3)
    sizes = [30, 60] if args.quick else [45, 100, 317]
    rows = []
    for m in sizes:
        n = m * m
        kinds = ["sparse"] + (["dense"] if n <= 2500 else []) + (["svi"] if n <= 10_000 else [])
        times = {k: [] for k in kinds}
        last = {}
        for rep in range(repeats):
            for k in (kinds if rep % 2 == 0 else kinds[::-1]):
                sec, out = fit_once(k, m)
                times[k].append(sec)
                last[k] = out
                print(f"[{n} nodes] {k}: {sec:.2f} s", flush=True)
        for k in kinds:
            mem = peak_rss_in_subprocess(_memory, k, m)
            rows.append({"nodes": n, "method": {"sparse": "dual_vg, SparseGMRF", "dense": "dual_vg, dense MVN precision",
                                                "svi": "svi_autonormal, SparseGMRF"}[k],
                         "seconds": statistics.median(times[k]),
                         "fit_delta_mb": mem["delta_mb"], "peak_mb": mem["peak_mb"],
                         "factor_nnz": last[k].get("factor_nnz"), "gap": last[k].get("gap"),
                         "bound": last[k]["bound"], "converged": last[k]["converged"]})
        ref = statistics.median(times["sparse"])
        for r in rows:
            if r["nodes"] == n:
                r["vs_sparse"] = r["seconds"] / ref
    print()
    print(markdown_table(rows, floatfmt=".4g"))
    name = f"gmrf{'_quick' if args.quick else ''}"
    write_json(name, {"rows": rows, "repeats": repeats})
    print(f"wrote {figure(rows, name)}")


if __name__ == "__main__":
    main()
