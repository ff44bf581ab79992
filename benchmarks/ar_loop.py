"""An AR(1) prior written as a Pyro loop against the same prior as one ``SparseGMRF``: ``dual_vg`` time and memory.

The model, a binary time series with a latent AR(1) log-odds (``phi = 0.8``, innovation sd ``s = 0.5``, stationary
start)::

    h_0 ~ N(0, s^2 / (1 - phi^2)),  h_t ~ N(phi h_{t-1}, s^2)  (t = 1..T-1),   y_t ~ Bernoulli(logits = h_t)

in two variants: ``loop`` (``T`` scalar sample sites in a ``pyro.markov`` loop, as a user writes it first: an affine
Gaussian chain of :mod:`pyro_convexvb.lgm.chains`, whose map ``(I - A)^{-1}`` is dense lower-triangular, ``T (T + 1)
/ 2`` nonzeros, and whose extraction probes the predictor through a graph of ``T`` sites) and ``gmrf`` (one
``SparseGMRF`` site with the tridiagonal precision ``Q = (I - A)^T S^{-1} (I - A)`` of the same prior, sparse at
any length). Since the chain fills in, the extraction now takes the ``loop`` variant in the model's coordinates as
one prior block of that same sparse ``Q`` (the ``SparseGMRF`` representation; designs stay the identity), so from
``T = 1000`` on (below, the extraction stores the predictor's identity Jacobian densely, as for any model of fewer
than ``PROBE_MIN_LATENTS`` latents, and ``dual_vg`` may pick another form) both variants reach ``dual_vg`` as the
same latent Gaussian model and differ in extraction only; the results stored in
``benchmarks/results/ar_loop.json`` and docs/benchmarks.md were measured before, when the loop was taken in the
innovation form ``u = (I - A) x`` with designs ``(I - A)^{-1}``.

Per case a fresh process (``peak_rss_in_subprocess``): extraction and fit seconds, the storage form
``dual_vg`` chose, the peak resident memory over the process's baseline after imports, convergence; and the largest
gap between the two variants' posterior means and sds (in posterior sds), which are the same model.

Cases: ``T`` in ``(250, 500, 1000, 2000)`` (quick: ``(100, 250)``); the ``gmrf`` variant also at ``10^4`` and
``10^5`` steps.

Usage::

    python benchmarks/ar_loop.py --quick
    python benchmarks/ar_loop.py

Writes ``benchmarks/results/ar_loop.json`` (``ar_loop_quick.json``) and ``docs/figures/ar_loop.png``.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (make_parser, markdown_table, parse_args, peak_rss_in_subprocess, save_figure,  # noqa: E402
                     write_json)

# imported here, so that a spawned child has them loaded before its baseline memory is taken
import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402

D = torch.float64
PHI, S = 0.8, 0.5


def make_data(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.zeros(T, dtype=D)
    h[0] = S / math.sqrt(1 - PHI**2) * torch.randn((), generator=g, dtype=D)
    for t in range(1, T):
        h[t] = PHI * h[t - 1] + S * torch.randn((), generator=g, dtype=D)
    return torch.bernoulli(torch.sigmoid(h), generator=g)


def model_loop(T, y=None):
    h = pyro.sample("h_0", dist.Normal(torch.tensor(0.0, dtype=D), S / math.sqrt(1 - PHI**2)))
    hs = [h]
    for t in pyro.markov(range(1, T)):
        h = pyro.sample(f"h_{t}", dist.Normal(PHI * h, S))
        hs.append(h)
    pyro.sample("y", dist.Bernoulli(logits=torch.stack(hs)).to_event(1), obs=y)


def ar1_precision(T):
    """The tridiagonal precision ``(I - A)^T S^{-1} (I - A)`` of the AR(1) prior above (stationary start)."""
    import scipy.sparse as sp

    off = -PHI / S**2 * torch.ones(T - 1, dtype=D)
    diag = torch.full((T,), (1 + PHI**2) / S**2, dtype=D)
    diag[0] = diag[-1] = 1 / S**2
    Q = sp.diags([off.numpy(), diag.numpy(), off.numpy()], [-1, 0, 1], format="csr")
    return torch.sparse_csr_tensor(torch.as_tensor(Q.indptr), torch.as_tensor(Q.indices),
                                   torch.as_tensor(Q.data, dtype=D), size=Q.shape)


def model_gmrf(T, y=None, Q=None):
    h = pyro.sample("h", pcv.distributions.SparseGMRF(torch.zeros(T, dtype=D), Q))
    pyro.sample("y", dist.Bernoulli(logits=h).to_event(1), obs=y)


def run_case(T, seed, variant):
    """Extract and fit one case (in a fresh process)."""
    import time

    torch.set_num_threads(1)
    y = make_data(T, seed)
    kwargs = {"y": y} if variant == "loop" else {"y": y, "Q": ar1_precision(T)}
    fn = model_loop if variant == "loop" else model_gmrf
    t0 = time.perf_counter()
    lgm = pcv.lgm_from_pyro(fn, T, **kwargs)
    t1 = time.perf_counter()
    res = pcv.fit(lgm, engine="dual_vg", progress=False)
    t2 = time.perf_counter()
    return {"extract_s": t1 - t0, "fit_s": t2 - t1, "converged": bool(res.converged),
            "form": res.info.get("form", ""), "mean": res.posterior.loc.detach().numpy(),
            "sd": res.posterior.variance.detach().sqrt().numpy()}


def plot(rows, name):
    """Time and peak memory against ``T`` for both variants (``docs/figures/<name>.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5), constrained_layout=True)
    for variant, mark in (("loop", "o-"), ("gmrf", "s-")):
        rs = [r for r in rows if r["variant"] == variant]
        ax[0].loglog([r["steps"] for r in rs], [r["total_s"] for r in rs], mark, label=variant)
        ax[1].loglog([r["steps"] for r in rs], [max(r["rss_over_baseline_mb"], 1.0) for r in rs], mark, label=variant)
    ax[0].set(xlabel="steps T", ylabel="extract + fit (s)", title="dual_vg on an AR(1) prior")
    ax[1].set(xlabel="steps T", ylabel="peak RSS over baseline (MiB)")
    ax[0].legend()
    save_figure(fig, name)


def main():
    parser = make_parser(__doc__.splitlines()[0])
    args = parse_args(parser=parser)
    steps = (100, 250) if args.quick else (250, 500, 1000, 2000)
    extra = () if args.quick else (10_000, 100_000)
    rows, answers = [], {}
    for T in steps + extra:
        for variant in ("loop", "gmrf"):
            if variant == "loop" and T in extra:
                continue
            r = peak_rss_in_subprocess(run_case, T, args.seed, variant, return_result=True)
            out = r["result"]
            answers[(T, variant)] = (out.pop("mean"), out.pop("sd"))
            rows.append({"variant": variant, "steps": T, **out, "total_s": out["extract_s"] + out["fit_s"],
                         "rss_over_baseline_mb": r["delta_mb"]})
            print(f"  {variant} T={T}: {rows[-1]['total_s']:.2f} s, {r['delta_mb']:.0f} MiB", flush=True)
    for row in rows:
        T = row["steps"]
        if (T, "loop") in answers:
            (m1, s1), (m2, s2) = answers[(T, "loop")], answers[(T, "gmrf")]
            row["max_mean_gap_sd"] = float((abs(m1 - m2) / s2).max())
            row["max_sd_gap"] = float((abs(s1 / s2 - 1)).max())
    cols = ["variant", "steps", "form", "extract_s", "fit_s", "total_s", "rss_over_baseline_mb", "converged",
            "max_mean_gap_sd", "max_sd_gap"]
    print(markdown_table(rows, cols))
    plot(rows, "ar_loop" + ("_quick" if args.quick else ""))
    write_json("ar_loop" + ("_quick" if args.quick else ""), {"rows": rows, "phi": PHI, "s": S})


if __name__ == "__main__":
    main()
