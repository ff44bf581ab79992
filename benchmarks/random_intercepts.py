"""Centred random-intercept logistic regression: time and peak memory of ``dual_vg`` against the number of groups.

The model, written as textbooks write it (a centred hierarchy, an affine Gaussian chain of
:mod:`pyro_convexvb.lgm.chains`)::

    mu ~ N(0, 2^2),  b ~ N(0, I_p),  alpha_j ~ N(mu, 0.7^2)  (j = 1..J),
    y_i ~ Bernoulli(logits = alpha[g_i] + x_i^T b)           (i = 1..N)

with the group indicator applied by ``pcv.linear`` on a sparse ``(N, J)`` matrix. Data are generated like a
real hierarchical data set (school or hospital outcomes): group sizes drawn from a log-normal (a few large
groups, many small ones, every group at least 2 rows), ``p = 5`` standardised covariates, true intercepts
``N(-0.5, 0.7^2)``.

Cases: ``J`` groups with ``N = 10 J`` rows, ``J`` in ``(10^3, 10^4)`` (quick: ``(50, 200)``). Per case the
fit runs in a fresh process (``peak_rss_in_subprocess``): reported are the extraction and fit seconds,
the peak resident memory of the process over its baseline after the imports (MiB), the Python-allocation peak
(``tracemalloc``, MiB) and the peak per group, whose constancy across ``J`` is linear memory. The fit's
convergence and the largest posterior sd of the intercepts are reported as a sanity check.

Usage::

    python benchmarks/random_intercepts.py --quick
    python benchmarks/random_intercepts.py            # J = 1e3, 1e4 (N = 1e4, 1e5)

Writes ``benchmarks/results/random_intercepts.json`` (``random_intercepts_quick.json`` with ``--quick``).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import markdown_table, parse_args, peak_rss_in_subprocess, write_json  # noqa: E402

P = 5


def make_data(J, rows_per_group=10, seed=0):
    """``(G, X, y)``: sparse CSR group indicator ``(N, J)``, covariates ``(N, P)``, labels ``(N,)`` (float64)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    N = rows_per_group * J
    sizes = torch.exp(torch.randn(J, generator=gen, dtype=torch.float64))
    sizes = 2 + torch.floor(sizes / sizes.sum() * (N - 2 * J)).long()
    sizes[: N - int(sizes.sum())] += 1  # exactly N rows
    g = torch.repeat_interleave(torch.arange(J), sizes)
    G = torch.sparse_coo_tensor(torch.stack([torch.arange(N), g]), torch.ones(N, dtype=torch.float64),
                                (N, J)).to_sparse_csr()
    X = torch.randn(N, P, generator=gen, dtype=torch.float64)
    alpha = -0.5 + 0.7 * torch.randn(J, generator=gen, dtype=torch.float64)
    beta = torch.linspace(-1.0, 1.0, P, dtype=torch.float64)
    y = (torch.rand(N, generator=gen, dtype=torch.float64) < torch.sigmoid(alpha[g] + X @ beta)).double()
    return G, X, y


def model(G, X, y=None):
    import pyro
    import pyro.distributions as dist
    import torch

    import pyro_convexvb as pcv

    J = G.shape[1]
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=X.dtype), 2.0))
    b = pyro.sample("b", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("groups", J):
        alpha = pyro.sample("alpha", dist.Normal(mu, 0.7))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(G, alpha) + X @ b), obs=y)


def run_case(J, seed):
    """Extract and fit one case (in a fresh process); returns the timings and the Python-allocation peak."""
    import time
    import tracemalloc

    import torch

    import pyro_convexvb as pcv

    torch.set_num_threads(1)
    G, X, y = make_data(J, seed=seed)
    tracemalloc.start()
    t0 = time.perf_counter()
    lgm = pcv.lgm_from_pyro(model, G, X, y=y)
    t1 = time.perf_counter()
    res = pcv.fit(lgm, engine="dual_vg", progress=False)
    t2 = time.perf_counter()
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    sd = res.posterior.variance.sqrt()
    return {"extract_s": t1 - t0, "fit_s": t2 - t1, "tracemalloc_peak_mb": py_peak / 2**20,
            "converged": bool(res.converged), "max_alpha_sd": float(sd[1 + P:].max()),
            "posterior_kind": res.posterior.kind}


def main():
    args = parse_args(__doc__.splitlines()[0])
    sizes = (50, 200) if args.quick else (1_000, 10_000)
    rows = []
    for J in sizes:
        r = peak_rss_in_subprocess(run_case, J, args.seed, return_result=True)
        out = r["result"]
        rows.append({"groups": J, "rows": 10 * J, "extract_s": out["extract_s"], "fit_s": out["fit_s"],
                     "rss_delta_mb": r["delta_mb"], "rss_per_group_kb": 1024 * r["delta_mb"] / J,
                     "tracemalloc_peak_mb": out["tracemalloc_peak_mb"], "converged": out["converged"],
                     "max_alpha_sd": out["max_alpha_sd"], "posterior": out["posterior_kind"]})
        print(f"J = {J}: done", flush=True)
    print(markdown_table(rows))
    write_json("random_intercepts_quick" if args.quick else "random_intercepts",
               {"cases": rows, "quick": args.quick, "seed": args.seed})


if __name__ == "__main__":
    main()
