"""Accuracy of the importance-corrected answers on the cases of ``hierarchical.py`` against their long NUTS references.

One ``dual_vg`` fit per case (hyper-latents integrated, the default), then ``res.corrected()`` with several seeds
for each estimator / proposal variant:

* ``uncorrected``: the fit as it is (with the PSIS ``k_hat`` of its posterior);
* ``snis-fitted``: plain self-normalised importance sampling from the engine's posterior (nearest design point's
  Gaussian for the field) -- the correction before control variates;
* ``cv-diagonal``: control variates, the interpolated proposal and one round adapted by a shift and scale per
  coordinate (``adaptation="diagonal"``) -- the correction before the whitened affine adaptation;
* ``snis-affine``: plain self-normalised estimates from the default proposal (the interpolated field Gaussian,
  then rounds adapted by an affine map of the whitened field, pooled);
* ``cv-affine-unshrunk``: control variates from the proposal's known moments and CDFs on the same;
* ``cv-affine``: the same with each field statistic's corrections shrunk together toward the proposal's own answer
  (positive-part James-Stein, ``shrink=True``; the default of ``correct``).

Reported per case and variant, the median over ``--seeds`` seeds: the hyper-latent's 5/50/95% quantile errors
relative to the reference (``rel_err_q50``, ``rel_err_tails``), the field's largest mean error in reference sds
(``field_err_sd``), the range of its sds relative to the reference sds, ``k_hat``, the importance ESS, the draws
(model evaluations) behind the answer and the wall seconds of the fit (uncorrected row) and of the correction
(rough, from whatever machine it ran on: accuracy, not time, is what this script measures; the time against
NumPyro is ``hierarchical.py``'s job).

Usage::

    python benchmarks/correction_accuracy.py --quick
    python benchmarks/correction_accuracy.py --seeds 3
    python benchmarks/correction_accuracy.py --cases logistic-sonar --variants cv-diagonal,cv-affine --seeds 3
"""
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from _common import Timer, make_parser, markdown_table, parse_args, write_json  # noqa: E402

import hierarchical as H  # noqa: E402
import pyro_convexvb as pcv  # noqa: E402
from pyro_convexvb.diagnostics.importance import correct  # noqa: E402

D = torch.float64
VARIANTS = {"snis-fitted": dict(estimator="snis", proposal="fitted"),
            "cv-diagonal": dict(estimator="cv", proposal="auto", adaptation="diagonal"),
            "snis-affine": dict(estimator="snis", proposal="auto", adaptation="affine"),
            "cv-affine-unshrunk": dict(estimator="cv", proposal="auto", adaptation="affine", shrink=False),
            "cv-affine": dict(estimator="cv", proposal="auto", adaptation="affine")}


def metrics(q, fmean, fsd, ref):
    rq = ref["hyper_q"]
    fm, rs = torch.tensor(ref["field_mean"], dtype=D), torch.tensor(ref["field_sd"], dtype=D)
    ratio = fsd.reshape(-1) / rs
    return {"rel_err_q50": abs(q[1] - rq[1]) / rq[1],
            "rel_err_tails": max(abs(q[0] - rq[0]) / rq[0], abs(q[2] - rq[2]) / rq[2]),
            "field_err_sd": float(((fmean.reshape(-1) - fm).abs() / rs).max()),
            "field_sd_ratio_min": float(ratio.min()), "field_sd_ratio_max": float(ratio.max())}


def main():
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(H.CASES), help="comma list of cases")
    parser.add_argument("--seeds", type=int, default=3, help="correction seeds per variant (median reported)")
    parser.add_argument("--draws", type=int, default=None, help="draws per proposal (default: correct()'s, 2000)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    parser.add_argument("--adapt", type=int, default=2, help="adaptation rounds at most (correct(adapt=...))")
    args = parse_args(parser=parser)
    torch.set_default_dtype(D)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}")
    draws = args.draws or (500 if args.quick else 2000)
    seeds = 1 if args.quick else args.seeds
    rows = []
    for name in args.cases.split(","):
        model, margs, mkw, hyper, field = H.CASES[name](args.quick)
        ref = H.nuts_reference(name, model, margs, mkw, hyper, field, args.quick)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Timer() as t_fit:
                res = pcv.fit(model, *margs, engine="dual_vg", progress=False, **mkw)
            d = res.diagnostics
        sl = res.posterior.layout[field].slice
        q = [float(v) for v in res.hyper["marginals"][hyper]["quantiles"].values()]
        m0 = metrics(q, res.posterior.loc[sl], res.posterior.scale[sl], ref)
        rows.append({"case": name, "variant": "uncorrected", **m0, "k_hat": d.k_hat, "ess": d.ess,
                     "draws": d.num_draws, "seconds": t_fit.seconds})
        print(f"[{name}] uncorrected: {rows[-1]}", flush=True)
        for v in variants:
            per_seed = []
            for seed in range(seeds):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with Timer() as t:
                        rounds = {"adapt": args.adapt} if VARIANTS[v]["proposal"] == "auto" else {}  # fixed: none
                        c = correct(res, draws, seed, **rounds, **VARIANTS[v])
                s_h, s_f = c.sites[hyper], c.sites[field]
                qh = [float(s_h["quantiles"][p]) for p in (0.05, 0.5, 0.95)]
                m = metrics(qh, s_f["mean"], s_f["sd"], ref)
                m.update(k_hat=c.k_hat, ess=c.ess, draws=c.diagnostics.num_draws, seconds=t.seconds,
                         proposal=c.diagnostics.proposal,
                         mcse_field_mean_max=float((s_f["mean_mcse"].reshape(-1)
                                                    / torch.tensor(ref["field_sd"], dtype=D)).max()))
                per_seed.append(m)
            row = {"case": name, "variant": v, "proposal": per_seed[0]["proposal"]}
            for k in per_seed[0]:
                if k != "proposal":
                    row[k] = statistics.median(p[k] for p in per_seed)
            rows.append(row)
            print(f"[{name}] {v}: {row}", flush=True)
    print()
    print(markdown_table(rows, floatfmt=".3g"))
    tag = ("_quick" if args.quick else "") + ("" if set(args.cases.split(",")) == set(H.CASES)
                                              else "_" + "_".join(args.cases.split(",")))
    tag += ("" if set(variants) == set(VARIANTS) else "_" + "_".join(variants)) + \
        ("" if args.adapt == 2 else f"_adapt{args.adapt}")
    write_json(f"correction_accuracy{tag}", {"rows": rows, "seeds": seeds, "draws": draws, "adapt": args.adapt,
                                              "note": "seconds are rough (machine load not controlled)"})


if __name__ == "__main__":
    main()
