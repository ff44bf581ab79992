"""Random-intercept logistic regression with ``dual_vg``: time and peak memory against the number of groups.

The model, written as textbooks write it (a centred hierarchy, an affine Gaussian chain of
:mod:`pyro_convexvb.lgm.chains`)::

    mu ~ N(0, 2^2),  b ~ N(0, I_p),  alpha_j ~ N(mu, sigma^2)  (j = 1..J),
    y_i ~ Bernoulli(logits = alpha[g_i] + x_i^T b)             (i = 1..N)

in four variants: ``centred`` (``sigma = 0.7`` fixed, the group indicator applied by ``pcv.linear`` on a
sparse ``(N, J)`` matrix), ``noncentred`` (``alpha = mu + sigma z``, ``z_j ~ N(0, 1)``, indexed as
``(mu + sigma * z)[g]`` with no ``pcv.linear``: the extraction probes the design's sparse structure),
``hyper`` (centred, ``sigma ~ HalfNormal(1)`` a hyper-latent, integrated over as ``dual_vg`` does: each design
point's model is built from the first extraction's affine maps, :mod:`pyro_convexvb.lgm.template`) and
``hyper_fresh`` (the same with every design point extracted afresh, ``hyper.REUSE_EXTRACTION = False``: the
cost the template removes). Data are
generated like a real hierarchical data set (school or hospital outcomes): group sizes drawn from a log-normal
(a few large groups, many small ones, every group at least 2 rows), ``p = 5`` standardised covariates, true
intercepts ``N(-0.5, 0.7^2)``.

Cases: ``J`` groups with ``N = 10 J`` rows, ``J`` in ``(10^3, 3 10^3, 10^4)`` for every variant (quick: ``(50, 200)``).
Per case the fit runs in a fresh process (``peak_rss_in_subprocess``): reported are the extraction and fit seconds
(``hyper``: the whole integration, every design point's extraction included), the storage form ``dual_vg`` chose
(``hyper``: at the mode), the peak resident memory of the process over its baseline before the call, after the
imports of torch, Pyro and the package (MiB, ``resource.getrusage``), the Python-allocation peak (``tracemalloc``,
MiB: NumPy/SciPy arrays, not torch tensors) and the peak per group, whose constancy across ``J`` is linear memory.
The fit's convergence and the largest posterior sd of the intercepts are reported as a sanity check; for ``hyper``
also the number of inner fits, the runs of the model per inner fit (whole fit, fixed overhead included), the
extractions that reused every affine map, the posterior median and 90% interval of ``sigma``, and the fit's
seconds per inner fit (constant in ``J`` per group when time is linear). Then the speed ratio to NUTS on a small
case (``J = 100``, ``N = 1000``; quick: ``J = 20``): Pyro NUTS (``engine="nuts"``, one chain, 1000 samples after
500 warm-up steps; quick: 100 and 100) against ``dual_vg`` on the same centred model, and the largest gap
between their posterior means in NUTS sds.

Usage::

    python benchmarks/random_intercepts.py --quick
    python benchmarks/random_intercepts.py            # J = 1e3, 3e3, 1e4 (N = 1e4, 3e4, 1e5)
    python benchmarks/random_intercepts.py --variants hyper,hyper_fresh   # the hyper-latent variants alone

Writes ``benchmarks/results/random_intercepts.json`` (``random_intercepts_quick.json`` with ``--quick``; a subset of
``--variants`` writes ``random_intercepts_<variants>.json``, e.g. ``random_intercepts_hyper.json``).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import make_parser, markdown_table, parse_args, peak_rss_in_subprocess, write_json  # noqa: E402

# imported here, so that a spawned child has them loaded before its baseline memory is taken
import pyro  # noqa: E402, F401
import torch  # noqa: E402, F401

import pyro_convexvb  # noqa: E402, F401

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
    """Centred, ``sigma = 0.7``, ``pcv.linear`` on the group indicator."""
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


def model_noncentred(g, J, X, y=None):
    """Non-centred, indexing ``(mu + sigma z)[g]`` (no ``pcv.linear``)."""
    import pyro
    import pyro.distributions as dist
    import torch

    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=X.dtype), 2.0))
    b = pyro.sample("b", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("groups", J):
        z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=X.dtype), 1.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=(mu + 0.7 * z)[g] + X @ b), obs=y)


def model_hyper(G, X, y=None):
    """Centred with ``sigma ~ HalfNormal(1)`` a hyper-latent."""
    import pyro
    import pyro.distributions as dist
    import torch

    import pyro_convexvb as pcv

    J = G.shape[1]
    sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0, dtype=X.dtype)))
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=X.dtype), 2.0))
    b = pyro.sample("b", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("groups", J):
        alpha = pyro.sample("alpha", dist.Normal(mu, sigma))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(G, alpha) + X @ b), obs=y)


def _model_and_args(variant, G, X, y):
    if variant == "centred":
        return model, (G, X), {"y": y}
    if variant in ("hyper", "hyper_fresh"):
        return model_hyper, (G, X), {"y": y}
    g = G.to_sparse_coo().coalesce().indices()[1]
    return model_noncentred, (g, G.shape[1], X), {"y": y}


def run_case(J, seed, variant="centred"):
    """Extract and fit one case (in a fresh process); returns the timings and the Python-allocation peak."""
    import time
    import tracemalloc

    import torch

    import pyro_convexvb as pcv

    from pyro_convexvb.infer import hyper

    torch.set_num_threads(1)
    G, X, y = make_data(J, seed=seed)
    fn, args, kwargs = _model_and_args(variant, G, X, y)
    hyper_variant = variant in ("hyper", "hyper_fresh")
    hyper.REUSE_EXTRACTION = variant != "hyper_fresh"
    runs = []
    if hyper_variant:
        model_fn = fn

        def fn(*a, **k):  # counts the runs of the model
            runs.append(1)
            return model_fn(*a, **k)

    tracemalloc.start()
    t0 = time.perf_counter()
    if hyper_variant:  # the hyper-latent is integrated over: extraction happens per point, inside the fit
        res = pcv.fit(fn, *args, engine="dual_vg", progress=False, **kwargs)
        t1 = t0
    else:
        lgm = pcv.lgm_from_pyro(fn, *args, **kwargs)
        t1 = time.perf_counter()
        res = pcv.fit(lgm, engine="dual_vg", progress=False)
    t2 = time.perf_counter()
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    sd = res.posterior.variance.sqrt()
    out = {"extract_s": t1 - t0, "fit_s": t2 - t1, "tracemalloc_peak_mb": py_peak / 2**20,
           "converged": bool(res.converged), "max_alpha_sd": float(sd[-J:].max()), "form": res.info.get("form", ""),
           "posterior_kind": getattr(res.posterior, "kind", type(res.posterior).__name__)}
    if hyper_variant:
        q = res.hyper["marginals"]["sigma"]["quantiles"]
        fits = res.info["hyper_details"]["fits"]
        out.update(form=res.info["mode_result"].info.get("form", ""), hyper_fits=fits,
                   seconds_per_fit=(t2 - t1) / fits, design_points=res.posterior.num_points,
                   model_runs_per_fit=len(runs) / fits, reused_extractions=res.hyper["extraction"]["reused"],
                   sigma_q05=float(q[0.05]), sigma_q50=float(q[0.5]), sigma_q95=float(q[0.95]))
    return out


def run_nuts_ratio(J, seed, quick):
    """Pyro NUTS and ``dual_vg`` on the same small centred case: seconds, ratio and the largest mean gap."""
    import time

    import torch

    import pyro_convexvb as pcv

    torch.set_num_threads(1)
    G, X, y = make_data(J, seed=seed)
    t0 = time.perf_counter()
    vg = pcv.fit(model, G, X, y=y, engine="dual_vg", progress=False)
    t1 = time.perf_counter()
    n = 100 if quick else 1000
    nuts = pcv.fit(model, G, X, y=y, engine="nuts", progress=False,
                   options=dict(num_samples=n, warmup_steps=100 if quick else 500))
    t2 = time.perf_counter()
    gap = ((vg.posterior.loc - nuts.posterior.loc).abs() / nuts.posterior.variance.sqrt()).max()
    return {"groups": J, "rows": 10 * J, "dual_vg_s": t1 - t0, "nuts_s": t2 - t1, "speedup": (t2 - t1) / (t1 - t0),
            "max_mean_gap_nuts_sd": float(gap), "nuts_samples": n}


VARIANTS = ("centred", "noncentred", "hyper", "hyper_fresh")


def main():
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    parser.add_argument("--groups", default=None, help="comma list of group counts (default 1000,3000,10000)")
    args = parse_args(parser=parser)
    sizes = (50, 200) if args.quick else (1_000, 3_000, 10_000)
    if args.groups:
        sizes = tuple(int(g) for g in args.groups.split(","))
    rows, hyper_rows = [], []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"--variants: unknown {variant!r}; choose from {VARIANTS}")
        for J in sizes:
            r = peak_rss_in_subprocess(run_case, J, args.seed, variant, return_result=True)
            out = r["result"]
            row = {"variant": variant, "groups": J, "rows": 10 * J, "form": out["form"],
                   "extract_s": out["extract_s"], "fit_s": out["fit_s"], "rss_delta_mb": r["delta_mb"],
                   "rss_per_group_kb": 1024 * r["delta_mb"] / J,
                   "tracemalloc_peak_mb": out["tracemalloc_peak_mb"], "converged": out["converged"],
                   "max_alpha_sd": out["max_alpha_sd"], "posterior": out["posterior_kind"]}
            hyper_variant = variant in ("hyper", "hyper_fresh")
            (hyper_rows if hyper_variant else rows).append(row)
            if hyper_variant:
                row.update({k: out[k] for k in ("hyper_fits", "design_points", "seconds_per_fit", "model_runs_per_fit",
                                                "reused_extractions", "sigma_q05", "sigma_q50", "sigma_q95")})
                row["us_per_fit_per_group"] = 1e6 * out["seconds_per_fit"] / J
            print(f"{variant}, J = {J}: done", flush=True)
    if rows:
        print(markdown_table(rows))
    if hyper_rows:
        print()
        print(markdown_table(hyper_rows, ["variant", "groups", "rows", "form", "fit_s", "hyper_fits", "design_points",
                                          "seconds_per_fit", ("us_per_fit_per_group", "µs per fit per group"),
                                          "model_runs_per_fit", "reused_extractions",
                                          "rss_delta_mb", "rss_per_group_kb", "tracemalloc_peak_mb", "converged",
                                          "sigma_q05", "sigma_q50", "sigma_q95", "max_alpha_sd"]))
    ratio = peak_rss_in_subprocess(run_nuts_ratio, 20 if args.quick else 100, args.seed, args.quick,
                                   return_result=True)["result"]
    print()
    print(markdown_table([ratio]))
    variants = args.variants.split(",")
    name = "random_intercepts" + ("" if tuple(variants) == VARIANTS else "_" + "_".join(variants))
    write_json(name + ("_quick" if args.quick else ""),  # a subset of variants does not overwrite the full results
               {"cases": rows + hyper_rows, "nuts": ratio, "quick": args.quick, "seed": args.seed})


if __name__ == "__main__":
    main()
