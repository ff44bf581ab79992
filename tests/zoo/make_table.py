"""Write ``docs/supported_models.md``: every zoo model through every registered engine, measured.

Usage (from the repository root; runs every cell with the CI budgets, the slow ones included: about
half an hour on one core)::

    python tests/zoo/make_table.py            # one process
    python tests/zoo/make_table.py --jobs 2   # cells spread over two processes

The numbers vary from machine to machine in their last digits (the stochastic engines run with fixed
seeds); the test of the page checks only that it lists every model and every engine.
"""
import argparse
import datetime
import multiprocessing
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402
from tests.zoo.harness import (  # noqa: E402
    DIAG_MIXTURE_EXACT,
    ENGINE_OPTIONS,
    EXACT_ENGINES,
    EXACT_TOLERANCE,
    KNOWN_LISTING,
    KNOWN_MISSES,
    TOLERANCES,
    NUTS_IN_CI,
    SVI_IN_CI,
    is_slow,
    load_references,
    refusal_reason,
    run_cell,
)
from tests.zoo.models import ZOO  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "supported_models.md")

#: short labels of refusal reasons for the table cells (the full reasons are listed under the table)
SHORT = [
    (r"not super-Gaussian", "not super-Gaussian"),
    (r"not log-concave", "not log-concave"),
    (r"Categorical \(softmax\)", "Categorical likelihood"),
    (r"not an affine function", "non-affine predictor"),
    (r"unsupported likelihood (\w+)", r"\1 likelihood"),
    (r"discrete latent", "discrete latent"),
    (r"no Gaussian prior", "Laplace prior"),
    (r"unsupported prior (\w+)", r"\1 prior"),
    (r"an intrinsic SparseGMRF", "intrinsic GMRF"),
]


def short_reason(reason):
    for pattern, label in SHORT:
        m = re.search(pattern, reason)
        if m:
            return m.expand(label)
    return reason[:40]


def record(model, engine):
    """One cell as plain data (picklable across processes)."""
    torch.set_num_threads(1)
    c = run_cell(model, engine, load_references())
    out = {"model": model, "engine": engine, "status": c.status, "listed": c.listed, "mean_err": c.mean_err,
           "sd_err": c.sd_err, "worst": c.worst, "converged": c.converged, "seconds": c.seconds,
           "passed": c.passed if c.status == "fit" else None}
    if c.status == "refused":
        out["reason"] = refusal_reason(c.error)
    elif c.status == "error":
        out["reason"] = f"{type(c.error).__name__}: {str(c.error).splitlines()[0]}"
    return out


def _record_star(pair):
    return record(*pair)


def cell_text(r, tol):
    if r["status"] == "refused":
        return f"— {short_reason(r['reason'])}"
    if r["status"] == "error":
        return f"✗ error ({r['reason'].split(':')[0]})"
    mark = "✓" if r["passed"] else "✗"
    sd = f" / {r['sd_err']:.2g}" if tol.sd is not None else ""
    return f"{mark} {r['mean_err']:.2g}{sd}"


def tolerance_of(model, engine):
    return EXACT_TOLERANCE if ZOO[model].gaussian and engine in EXACT_ENGINES else TOLERANCES[engine]


def page(results, engines, seconds):
    by = {(r["model"], r["engine"]): r for r in results}
    L = []
    L.append("# Supported models\n")
    L.append("Every model of the test zoo (`tests/zoo/`, ordinary Pyro models with data from fixed seeds) run "
             "through every registered engine with `pcv.fit(model, *args, engine=name, options=...)` and compared "
             "with an independent reference posterior. The table is written by `python tests/zoo/make_table.py`; "
             "`pytest tests/zoo` checks the same cells (the slow ones with `-m slow`).\n")
    L.append("Each cell shows:\n")
    L.append("* `✓ a / b`: the engine fits the model, and its posterior is within the engine's tolerance of the "
             "reference: `a` = max over latent coordinates of |mean − reference mean| / reference sd, `b` = max "
             "|sd / reference sd − 1| (only `a` where the engine's sd is not checked);")
    L.append("* `✗ a / b`: the engine fits the model but misses its tolerance (a known miss, see below);")
    L.append("* `— reason`: the engine refuses the model with an `UnsupportedModelError` naming the site (the full "
             "reasons are listed under the table); the refusal lists the engines that fit the model, and each "
             "of them runs in its own cell.\n")
    L.append("Errors are measured in the model's unconstrained coordinates (a `HalfCauchy` scale as its "
             "logarithm), where every engine's posterior lives. For engines that integrate over hyper-latents "
             "(`dual_vg`, `convex_relaxation` on hierarchical models) the field is read from the mixture "
             "posterior and the hyper-latents from draws of their density.\n")
    L.append("| model | " + " | ".join(f"`{e}`" for e in engines) + " |")
    L.append("|---|" + "---|" * len(engines))
    for m in ZOO:
        cells = [cell_text(by[(m, e)], tolerance_of(m, e)) for e in engines]
        L.append(f"| `{m}` | " + " | ".join(cells) + " |")
    L.append("")
    reasons = {}
    for r in results:
        if r["status"] == "refused":
            reasons.setdefault(short_reason(r["reason"]), set()).add(r["reason"])
    L.append("### Refusal reasons\n")
    for label in sorted(reasons):
        for full in sorted(reasons[label]):
            L.append(f"* **{label}**: {full}")
    L.append("")

    L.append("## The models\n")
    L.append("| model | group | reference | description |")
    L.append("|---|---|---|---|")
    for m, zm in ZOO.items():
        L.append(f"| `{m}` | {zm.group} | {zm.reference} | {zm.description} |")
    L.append("")

    L.append("## References\n")
    L.append("* **exact**: the conjugate posterior of linear-Gaussian models (with `poutine.scale` weights; the "
             "observed rows of an `obs_mask` site), and the two-component closed form of the discrete mixture.")
    L.append("* **quadrature**: the exact posterior density, written out independently of the Pyro model, "
             "integrated on a tensor grid (8001 points in 1-D, 401 x 401 in 2-D) re-centred on the mean ± 10 sd "
             "(± 20 sd for `student_t_latent_scale`, whose Student-t likelihood gives the posterior of `w` "
             "polynomial tails); "
             "for the latent noise scale of a linear regression, 1-D quadrature over log σ of the exact marginal "
             "likelihood with the weights integrated out in closed form.")
    L.append("* **nuts**: long NUTS runs made once by `tests/zoo/generate_references.py` and stored in "
             "`tests/zoo/references.json` with their split R-hat and effective sample size: 4 chains of 2000 "
             "draws after 1000 warm-up steps (target acceptance 0.9), more draws until the split R-hat of every "
             "coordinate is below 1.01. GP and GMRF models are sampled in whitened coordinates (`f = L v` with "
             "`K = L Lᵀ`; `x = L⁻ᵀ v / √τ` with `Q₀ = L Lᵀ`, a dense factor independent of `SparseGMRF`), "
             "the same posterior in coordinates NUTS mixes well in.\n")
    refs = load_references()
    L.append("| model | reference | split R-hat | min ESS |")
    L.append("|---|---|---|---|")
    for m in ZOO:
        r = refs[m]
        if r["method"] == "nuts":
            L.append(f"| `{m}` | nuts ({r['chains']} x {r['num_samples']}) | {r['max_split_rhat']:.4f} | "
                     f"{r['min_ess']:.0f} |")
    L.append("")

    L.append("## Tolerances\n")
    L.append("Errors in units of the reference posterior sd; `—`: the sd is not checked. On linear-Gaussian "
             f"models `dual_vg`, `convex_relaxation` and `laplace` are exact and held to {EXACT_TOLERANCE.mean:g}. "
             "Budgets in CI and for this table:\n")
    L.append("| engine | mean | sd | options | why |")
    L.append("|---|---|---|---|---|")
    for e in engines:
        t = TOLERANCES[e]
        opts = ", ".join(f"{k}={v}" for k, v in ENGINE_OPTIONS.get(e, {}).items()) or "defaults"
        if e == "diag_mixture":
            exact = ", ".join(f"{k}={v}" for k, v in DIAG_MIXTURE_EXACT.items())
            opts = f"{exact} (latent Gaussian models); {opts} (others)"
        L.append(f"| `{e}` | {t.mean:g} | {'—' if t.sd is None else f'{t.sd:g}'} | {opts} | {t.why} |")
    L.append("")

    L.append("## Known misses\n")
    L.append("Cells where an engine fits a model but misses its reference, or fails, are kept as strict expected "
             "failures in the tests (with the numbers measured when they were recorded):\n")
    for (m, e), why in KNOWN_MISSES.items():
        L.append(f"* `{m}` × `{e}`: {why}")
    L.append("")
    if KNOWN_LISTING:
        L.append("`pcv.engines_that_fit` disagrees with what runs on these models:\n")
        for m, why in KNOWN_LISTING.items():
            L.append(f"* `{m}`: {why}")
    else:
        L.append("On every zoo model, `pcv.engines_that_fit` lists exactly the engines that run.")
    L.append("")
    slow = [(m, e) for m in ZOO for e in engines if is_slow(m, e)]
    L.append(f"## Run time\n\n{len(ZOO) * len(engines) - len(slow)} of the {len(ZOO) * len(engines)} cells run in CI "
             f"(NUTS on {len(NUTS_IN_CI)} models and the full- and low-rank SVI guides on {len(SVI_IN_CI)}, `SVI_IN_CI` "
             f"in `tests/zoo/harness.py`; `svi_autonormal`, the same wrapper, runs on all); "
             f"the others are marked `slow` (`pytest -m slow tests/zoo`). This table took {seconds / 60:.0f} "
             f"minutes to make ({datetime.date.today().isoformat()}).\n")
    return "\n".join(L)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    engines = sorted(pcv.engines())
    pairs = [(m, e) for m in ZOO for e in engines]
    t0 = datetime.datetime.now()
    if args.jobs > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            results = pool.map(_record_star, pairs, chunksize=1)
    else:
        results = [record(m, e) for m, e in pairs]
    for r in results:
        status = (f"{r['mean_err']:.3g} / {r['sd_err']:.3g}{'' if r['passed'] else ' MISS'}" if r["status"] == "fit"
                  else f"{r['status']}: {r.get('reason', '')[:80]}")
        print(f"{r['model']:28s} {r['engine']:18s} {status} ({r['seconds']:.1f}s)")
    seconds = (datetime.datetime.now() - t0).total_seconds()
    with open(PAGE, "w") as f:
        f.write(page(results, engines, seconds))
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
