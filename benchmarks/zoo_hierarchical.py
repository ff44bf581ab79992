"""The hierarchical models of the test zoo: our engines, uncorrected and importance-corrected, against NumPyro's NUTS.

The models are those of ``tests/zoo/models.py`` in the group ``hierarchical`` (``hier_logistic_halfcauchy``,
``hier_gmrf_gamma``, ``hier_gp_lengthscale``, ``linear_latent_noise``, ``negbin_latent_concentration``,
``student_t_latent_scale``), with their data and their stored references (``tests/zoo/references.json``; a model
whose data no longer match the reference's fingerprint is refused). Methods, alternating in each repetition:

* ``ours``: ``pcv.fit(model, *args, engine=E, progress=False, **kwargs)``, ``E`` the first of ``dual_vg``,
  ``convex_relaxation``, ``laplace`` in ``pcv.engines_that_fit`` (as ``tests/test_diagnostics_zoo.py`` chooses it),
  uncorrected; its PSIS ``k_hat`` (``res.diagnostics``, 500 draws, computed on first access) is timed separately
  (``diag_seconds``, not in ``seconds``);
* ``ours + psis``: the same fit followed by ``res.corrected()`` with its defaults (the time of both);
  ours run with one torch thread and one BLAS thread (``--threads``);
* ``numpyro nuts``: each model written independently in NumPyro (``_numpyro_models.py``, ``zoo_*``; float64; the
  GMRF field non-centred and the GP field whitened, recorded as ``numpyro.deterministic`` sites), 4 chains of 1,000
  warm-up steps and 1,000 draws run sequentially (quick: 2 x 200 + 200).

NumPyro's time leaves out JIT compilation as in ``hierarchical.py``: the first repetition compiles (its time is
``seconds_compile``) and is not among the timed ones, unless ``--repeats 1``. In addition, because NumPyro's
``MCMC.run`` wraps its sampling loop in a new ``jax.jit`` on every call (so each chain of each run would compile the
loop again), XLA's compiled programs are kept in a temporary persistent compilation cache
(``--numpyro-compile-cache off`` to time the recompilations as ``hierarchical.py`` does); later runs still trace and
lower the loop, and load it from the cache.

Errors, in Pyro's UNCONSTRAINED coordinates (``biject_to(support).inv``: ``log`` of the positive hyper-latents),
where the references are stored, over every coordinate of every latent site: ``mean_err`` the largest
``|mean - ref mean| / ref sd``, ``sd_ratio_min`` / ``sd_ratio_max`` the range of ``sd / ref sd``. What the references
store: the three ``nuts`` references (``hier_*``; 4 chains x 2,000 draws of Pyro's NUTS after 1,000 warm-up steps,
split R-hat < 1.01) store means, sds and 5/50/95% quantiles of every coordinate; the three ``quadrature`` references
store means and sds only. Where the reference has quantiles, the hyper-latent's 5/50/95% quantiles are compared in
its constrained coordinates (the reference's quantiles mapped by ``biject_to``, which is monotone): ``q_err`` is the
largest ``|q / q_ref - 1|``. For ``ours`` the hyper-latent's means and sds come from 20,000 draws of the integrated
posterior (``tests/zoo/harness.py``) and its quantiles from ``res.hyper["marginals"]``; for ``ours + psis`` from the
corrected summaries (``c.unconstrained``, ``c.sites``); for NumPyro from its draws (mapped to the unconstrained
coordinates; quantiles of the constrained draws). Errors are those of the last timed run.

The project's promise, checked in ``promise`` for ``ours + psis``: ``mean_err <= 0.1``, ``sd / ref sd`` within 10%,
``q_err <= 0.05`` (where the reference has quantiles), at least 10x faster than NumPyro in the same run.

Time: median wall seconds over ``--repeats`` (default 3, quick 1) alternating repetitions; ``vs_numpyro`` is
NumPyro's median over the method's (how many times faster). torch runs on one thread, NumPyro on one CPU device.
The figure (``docs/figures/zoo_hierarchical*.png``) shows the seconds and the mean errors. The results file
(``zoo_hierarchical.json``, ``_quick`` under ``--quick``, ``_<models>`` for ``--models``) is rewritten after every
model.

Usage::

    python benchmarks/zoo_hierarchical.py --quick --repeats 1   # short NumPyro chains, checks that it runs
    python benchmarks/zoo_hierarchical.py                       # the comparison (run on a quiet machine)
"""
import json
import math
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.zoo

import _numpyro_models  # noqa: E402
import pyro  # noqa: E402
import torch  # noqa: E402
from _common import Timer, make_parser, markdown_table, parse_args, save_figure, write_json  # noqa: E402
from torch.distributions import biject_to  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402
from pyro_convexvb.lgm.extract import latent_sites  # noqa: E402
from tests.zoo.harness import REFERENCES, data_fingerprint, posterior_summary  # noqa: E402
from tests.zoo.models import ZOO  # noqa: E402

D = torch.float64
MODELS = [n for n, m in ZOO.items() if m.group == "hierarchical"]
#: the hyper-latent of each model (checked against ``res.hyper["names"]`` of the fit)
HYPER = {"hier_logistic_halfcauchy": "tau", "hier_gmrf_gamma": "tau", "hier_gp_lengthscale": "ell",
         "linear_latent_noise": "sigma", "negbin_latent_concentration": "r", "student_t_latent_scale": "s"}
PROBS = (0.05, 0.5, 0.95)
METHODS = ["ours", "ours + psis", "numpyro nuts"]
#: the promise for the importance-corrected answer
PROMISE = {"mean_err": 0.1, "sd_rel": 0.1, "q_err": 0.05, "vs_numpyro": 10.0}


# ----------------------------------------------------------------------------- cases
def load_case(name, refs):
    """The zoo model ``name`` with its engine, latent supports, hyper-latent and reference sites."""
    if name not in refs:
        raise KeyError(f"model '{name}': no stored reference in {REFERENCES}")
    model, args, kwargs = ZOO[name].builder()
    fp, ref_fp = data_fingerprint(args, kwargs), refs[name]["fingerprint"]
    if not math.isclose(fp, ref_fp, rel_tol=1e-9, abs_tol=1e-9):
        raise ValueError(f"model '{name}': its data fingerprint {fp!r} differs from the stored reference's {ref_fp!r}"
                         "; regenerate the reference (tests/zoo/generate_references.py) before comparing")
    fits = pcv.engines_that_fit(model, *args, **kwargs)
    engine = next((e for e in ("dual_vg", "convex_relaxation", "laplace") if e in fits), None)
    if engine is None:
        raise ValueError(f"model '{name}': none of dual_vg, convex_relaxation, laplace fits it (fits: {fits})")
    supports = {n: s["fn"].support for n, s in latent_sites(model, args, kwargs)}
    ref_sites = refs[name]["sites"]
    if set(ref_sites) != set(supports):
        raise ValueError(f"model '{name}': reference sites {sorted(ref_sites)} differ from the model's latent sites "
                         f"{sorted(supports)}")
    return {"name": name, "model": model, "args": args, "kwargs": kwargs, "engine": engine, "supports": supports,
            "hyper": HYPER[name], "ref": ref_sites, "ref_method": refs[name]["method"]}


# ----------------------------------------------------------------------------- errors
def errors(case, summary, hyper_q):
    """Errors of ``summary`` (``{site: (mean, sd)}``, flat, unconstrained) and of the hyper-latent's constrained
    quantiles ``hyper_q`` (``{p: value}`` or ``None``) against the reference."""
    mean_err, worst, lo, hi = 0.0, "", math.inf, -math.inf
    for site, r in case["ref"].items():
        m, s = summary[site]
        rm, rs = torch.tensor(r["mean"], dtype=D), torch.tensor(r["sd"], dtype=D)
        em = (m.to(D).reshape(-1) - rm).abs() / rs
        ratio = s.to(D).reshape(-1) / rs
        if float(em.max()) > mean_err:
            mean_err, worst = float(em.max()), f"{site}[{int(em.argmax())}]" if rm.numel() > 1 else site
        lo, hi = min(lo, float(ratio.min())), max(hi, float(ratio.max()))
    out = {"mean_err": mean_err, "detail": {"worst": worst}, "sd_ratio_min": lo, "sd_ratio_max": hi}
    h = case["hyper"]
    rh = case["ref"][h]
    if "q05" in rh and hyper_q is not None:
        to = biject_to(case["supports"][h])
        for p, key in zip(PROBS, ("q05", "q50", "q95")):
            rq = float(to(torch.tensor(rh[key][0], dtype=D)))
            out[f"{h}_{key}"] = float(hyper_q[p])
            out[f"q_err_{key}"] = abs(float(hyper_q[p]) / rq - 1.0)
        out["q_err"] = max(out[f"q_err_{k}"] for k in ("q05", "q50", "q95"))
    return out


# ----------------------------------------------------------------------------- methods
def run_ours(case, correct):
    """``(seconds, errors, extras)`` of the engine's fit (and its correction when ``correct``)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, args, kwargs, h = case["model"], case["args"], case["kwargs"], case["hyper"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Timer() as t:
            res = pcv.fit(model, *args, engine=case["engine"], progress=False, **kwargs)
            c = res.corrected() if correct else None
    names = (res.hyper or {}).get("names")
    if names is None or h not in names:
        raise RuntimeError(f"model '{case['name']}': engine {case['engine']} did not treat '{h}' as a hyper-latent "
                           f"(hyper-latents: {names}); update HYPER")
    if correct:
        summary = {s: (c.unconstrained[s]["mean"], c.unconstrained[s]["sd"]) for s in case["ref"]}
        q = {p: c.sites[h]["quantiles"][p] for p in PROBS}
        extras = {"k_hat": float(c.k_hat), "reliable": bool(c.diagnostics.reliable),
                  "proposal": c.diagnostics.proposal, "correction_draws": c.diagnostics.num_draws}
        return t.seconds, errors(case, summary, q), extras
    summary = posterior_summary(res, list(case["ref"]), case["supports"])
    marg = res.hyper["marginals"]
    q = None if marg is None else {p: marg[h]["quantiles"][p] for p in PROBS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the diagnostic's own warning; k_hat is reported
        with Timer() as td:
            d = res.diagnostics
    extras = {"k_hat": float(d.k_hat), "diag_ok": bool(d.ok), "diag_seconds": td.seconds}
    return t.seconds, errors(case, summary, q), extras


def numpyro_size(quick):
    return dict(chains=2, warmup=200, samples=200) if quick else dict(chains=4, warmup=1000, samples=1000)


def run_numpyro(case, quick, seed):
    """``(seconds, errors, extras)`` of NumPyro's NUTS on the model written in NumPyro; its draws mapped to Pyro's
    unconstrained coordinates."""
    import _numpyro_models as npm
    import numpy as np
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin

    model, kw, sites = npm.build_zoo(case["name"], case["args"], case["kwargs"])
    if set(sites) != set(case["ref"]):
        raise RuntimeError(f"model '{case['name']}': NumPyro records {sorted(sites)}, the reference has "
                           f"{sorted(case['ref'])}")
    size = numpyro_size(quick)
    draws, sec, divergent = npm.run_nuts_counting_divergences(model, kw, seed=seed, **size)
    summary, rhat, ess, h = {}, 0.0, math.inf, case["hyper"]
    q = None
    for s in sites:
        x = torch.as_tensor(np.array(draws[s]), dtype=D).reshape(size["chains"], size["samples"], -1)
        u = biject_to(case["supports"][s]).inv(x)
        flat = u.reshape(-1, u.shape[-1])
        summary[s] = (flat.mean(0), flat.std(0))
        rhat = max(rhat, float(np.max(split_gelman_rubin(u.numpy()))))
        ess = min(ess, float(np.min(effective_sample_size(u.numpy()))))
        if s == h:
            qs = torch.quantile(x.reshape(-1), torch.tensor(PROBS, dtype=D))
            q = {p: float(v) for p, v in zip(PROBS, qs)}
    extras = {"split_rhat": rhat, "min_ess": ess, "divergences": divergent}
    return sec, errors(case, summary, q), extras


def run_method(method, case, quick, seed):
    if method == "numpyro nuts":
        return run_numpyro(case, quick, seed)
    return run_ours(case, correct=method == "ours + psis")


def promise_met(row):
    ok = row["mean_err"] <= PROMISE["mean_err"] and abs(row["sd_ratio_min"] - 1) <= PROMISE["sd_rel"] \
        and abs(row["sd_ratio_max"] - 1) <= PROMISE["sd_rel"]
    if row.get("q_err") is not None:
        ok = ok and row["q_err"] <= PROMISE["q_err"]
    return bool(ok and row["vs_numpyro"] >= PROMISE["vs_numpyro"])


# ----------------------------------------------------------------------------- main
def main():
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="alternating repetitions (default 3, quick 1)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of zoo models (default: all six)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of methods (default: {METHODS})")
    _numpyro_models.add_compile_cache_option(parser)
    args = parse_args(parser=parser)  # torch: one thread unless --threads
    from threadpoolctl import threadpool_limits

    # NumPy's BLAS as torch (--threads): its default of one thread a core spun both cores on the corrections' small
    # dense products (1.5-3 s of CPU for 1.3 s of work on the GMRF case)
    threadpool_limits(args.threads)
    repeats = args.repeats or (1 if args.quick else 3)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    models = args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; choose from {MODELS}")
    methods = [m for m in METHODS if m in args.methods.split(",")]
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {METHODS}")
    cache_dir = None
    if "numpyro nuts" in methods:
        if not _numpyro_models.available():
            print("numpyro not installed (pip install 'pyro_convexvb[bench]'): the numpyro nuts rows are left out, "
                  "and vs_numpyro with them", flush=True)
            methods.remove("numpyro nuts")
        elif args.numpyro_compile_cache == "on":
            cache_dir = _numpyro_models.use_temporary_compile_cache("zoo_hierarchical_xla_")
    with open(REFERENCES) as f:
        refs = json.load(f)
    tag = ("_quick" if args.quick else "") + ("" if set(models) == set(MODELS) else "_" + "_".join(models))
    size = numpyro_size(args.quick)
    rows, done = [], []
    for name in models:
        case = load_case(name, refs)
        print(f"[{name}] engine {case['engine']}, hyper-latent {case['hyper']}, reference {case['ref_method']}",
              flush=True)
        times = {m: [] for m in methods}
        out, failed, compile_s = {}, {}, None
        for rep in range(repeats):
            for m in (methods if rep % 2 == 0 else methods[::-1]):
                try:
                    sec, err, extras = run_method(m, case, args.quick, seed=rep)
                except Exception as e:  # a method that fails on a model is reported, not hidden
                    failed[m] = f"{type(e).__name__}: {str(e)[:160]}"
                    print(f"  {m}: failed ({failed[m]})", flush=True)
                    continue
                if m == "numpyro nuts" and compile_s is None:
                    compile_s = sec  # the first run includes JIT compilation
                    if repeats > 1:
                        print(f"  {m}: {sec:.2f} s (with JIT compilation, not timed)", flush=True)
                        continue
                times[m].append(sec)
                out[m] = (err, extras)
                print(f"  {m}: {sec:.2f} s, mean err {err['mean_err']:.3f} sd", flush=True)
        np_t = statistics.median(times["numpyro nuts"]) if times.get("numpyro nuts") else math.nan
        for m in methods:
            # every row of a model carries the same identifying fields (model, our_engine): benchmarks/check.py
            # groups rows that differ only in their method
            row = {"model": name, "our_engine": case["engine"], "method": m}
            if m not in out:
                row.update(seconds=math.nan, vs_numpyro=math.nan, failed=failed.get(m, "no timed run"))
                rows.append(row)
                continue
            err, extras = out[m]
            med = statistics.median(times[m])
            row.update(seconds=med, vs_numpyro=np_t / med, **err, **extras)
            row["detail"]["timed_runs"] = len(times[m])
            if m == "numpyro nuts":
                row.update(seconds_compile=compile_s, includes_compile=repeats == 1)
            if m == "ours + psis":
                row["promise"] = promise_met(row) if not math.isnan(np_t) else None
            rows.append(row)
        done.append(name)
        write_json(f"zoo_hierarchical{tag}", {
            "rows": rows, "repeats": repeats, "quick": args.quick, "numpyro": size if "numpyro nuts" in methods
            else None, "numpyro_compile_cache": cache_dir is not None, "promise": PROMISE,
            "references": {n: {"method": refs[n]["method"], "quantiles": "q05" in next(iter(refs[n]["sites"].values()))}
                           for n in done},
            "models_done": done, "complete": len(done) == len(models)})
    print()
    table = [{**r, **r.get("detail", {}), "engine": r["our_engine"] if r["method"] != "numpyro nuts" else "-"}
             for r in rows]
    cols = ["model", "engine", "method", ("seconds", "seconds"), ("vs_numpyro", "x NumPyro"),
            ("mean_err", "mean err (ref sd)"), "worst", ("sd_ratio_min", "sd/ref min"), ("sd_ratio_max", "sd/ref max"),
            ("q_err", "hyper q err"), "k_hat", ("diag_seconds", "k_hat s"), "promise"]
    print(markdown_table(table, cols, floatfmt=".3g"))
    np_rows = [r for r in rows if r["method"] == "numpyro nuts" and "split_rhat" in r]
    if np_rows:
        print()
        print(f"NumPyro NUTS: {size['chains']} chains x {size['warmup']} warm-up + {size['samples']} draws, "
              f"sequential; compile cache {'on' if cache_dir else 'off'}")
        print(markdown_table(np_rows, ["model", "seconds", "seconds_compile", "includes_compile", "split_rhat",
                                       "min_ess", "divergences"], floatfmt=".3g"))
    q_rows = [r for r in rows if r.get("q_err") is not None]
    if q_rows:
        print()
        print("hyper-latent quantiles (constrained) relative to the nuts references' (quadrature references store "
              "none):")
        print(markdown_table(q_rows, ["model", "method", "q_err_q05", "q_err_q50", "q_err_q95"], floatfmt=".3g"))
    plot(rows, f"zoo_hierarchical{tag}")


def plot(rows, name):
    """Seconds (log scale) and the largest mean error per model and method, the promise's 0.1 sds marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["model"], r["method"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(models))]
        for ax, key in zip(axes, ("seconds", "mean_err")):
            ax.bar(xs, [by.get((mo, m), {}).get(key, math.nan) for mo in models], width, label=m)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("seconds (median)")
    axes[1].axhline(PROMISE["mean_err"], color="k", lw=0.8, ls="--")
    axes[1].set_ylabel("largest |mean - ref| / ref sd")
    for ax in axes:
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, rotation=30, ha="right", fontsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, name)


if __name__ == "__main__":
    main()
