"""Likelihood families (binomial, negative binomial, Gamma, stochastic volatility, Laplace, Student-t, softmax): our
engines against Pyro's NUTS on the zoo's models, each against the zoo's reference (exact 2-D quadrature; long NUTS
runs for the AR(1) and softmax models).

Cases: the zoo models ``binomial_beetles`` (Bliss 1935), ``binomial_bioassay`` (Gelman et al. 2013, §3.7), ``negbin``, ``negbin_latent_concentration`` (hyper-latent ``r ~ Gamma``, integrated over),
``gamma_regression``, ``heteroscedastic`` (``Normal(0.3, exp(X w / 2))``: the stochastic-volatility site),
``stochastic_volatility`` (an AR(1) ``SparseGMRF`` log-volatility, 40 steps; a long NUTS reference),
``laplace_regression``, ``laplace_latent_scale``, ``student_t``, ``student_t_latent_scale``, and softmax
regression on iris, ``softmax_iris`` (``Categorical(logits=X @ W)``, ``W`` 5 x 3) and
``softmax_iris_reference_class`` (the last class's logit fixed at 0; long NUTS references)
(``tests/zoo/models.py``, references in ``tests/zoo/references.json``). Methods, alternating in the same run:
``dual_vg`` where it fits (the log-concave families with a local bound), ``convex_relaxation`` (the super-Gaussian
families: negative binomial, Laplace, Student-t), and Pyro's ``nuts`` (one chain, 1,000 draws after 500 warm-up
steps; quick: 100 + 100). Accuracy: the largest |mean - reference mean| / reference sd and |sd / reference sd - 1|
over the latent coordinates (unconstrained coordinates for hyper-latents). Time: median wall seconds over
``--repeats`` runs, and the ratio of NUTS's time to each engine's. Also ``<engine> + psis`` for the first engine
that fits (``dual_vg``, else ``convex_relaxation``): the same fit with ``correct="psis"``, measured on the
importance-corrected means and sds, its time including the correction. Any zoo model can be named in ``--cases``
(e.g. the affine chains ``ri_centred_logistic,eight_schools_centred,ar1_loop,rw1_intrinsic,bym_icar``).

Usage::

    python benchmarks/likelihood_families.py --quick   # one repeat, short NUTS
    python benchmarks/likelihood_families.py           # on a quiet machine
    python benchmarks/likelihood_families.py --cases laplace_regression,student_t   # a subset: writes
                                                       # likelihood_families_laplace_regression_student_t.json
"""
import os
import statistics
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import make_parser, markdown_table, parse_args, write_json  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402
from tests.zoo.harness import load_references, run_cell, run_corrected_cell  # noqa: E402
from tests.zoo.models import ZOO  # noqa: E402

CASES = ("binomial_beetles", "binomial_bioassay", "negbin", "negbin_latent_concentration", "gamma_regression", "heteroscedastic", "stochastic_volatility",
         "laplace_regression", "laplace_latent_scale", "student_t", "student_t_latent_scale", "softmax_iris",
         "softmax_iris_reference_class")


def main(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per method (quick: 1)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated zoo model names")
    args = parse_args(parser=parser, argv=argv)
    repeats = 1 if args.quick else args.repeats
    nuts = dict(num_samples=100, warmup_steps=100) if args.quick else dict(num_samples=1000, warmup_steps=500)
    refs = load_references()
    rows = []
    for name in args.cases.split(","):
        model, margs, mkw = ZOO[name].builder()
        fitting = pcv.engines_that_fit(model, *margs, **mkw)
        ours = [e for e in ("dual_vg", "convex_relaxation") if e in fitting]
        methods = [(e, {}) for e in ours] + [(f"{e} + psis", {}) for e in ours[:1]] + [("nuts", nuts)]
        times = {m: [] for m, _ in methods}
        cells = {}
        for _ in range(repeats):
            for engine, opts in methods:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if engine.endswith(" + psis"):
                        cell = run_corrected_cell(name, engine.split(" + ")[0], refs)
                    else:
                        cell = run_cell(name, engine, refs, options=dict(opts, seed=args.seed) if engine == "nuts"
                                        else opts)
                times[engine].append(cell.seconds)  # the fit alone (run_cell times pcv.fit)
                cells[engine] = cell
        # a ratio only between two fits: the time NUTS takes to refuse a model (intrinsic fields) is no peer time
        t_nuts = statistics.median(times["nuts"]) if cells["nuts"].status == "fit" else None
        for engine, _ in methods:
            c = cells[engine]
            sec = statistics.median(times[engine])
            ratio = t_nuts / sec if t_nuts is not None and c.status == "fit" and sec > 0 else None
            rows.append({"model": name, "engine": engine, "status": c.status, "mean_err": c.mean_err,
                         "sd_err": c.sd_err, "converged": c.converged, "seconds": sec, "nuts_over_engine": ratio})
    cols = ["model", "engine", "status", ("mean_err", "mean err (sd)"), ("sd_err", "sd err"), "converged",
            "seconds", ("nuts_over_engine", "NUTS time / time")]
    print(markdown_table(rows, cols, ".3g"))
    cases = args.cases.split(",")
    stem = "likelihood_families" + ("" if tuple(cases) == CASES else "_" + "_".join(cases))
    write_json(stem + "_quick" if args.quick else stem,
               {"rows": rows, "nuts": nuts, "repeats": repeats})


if __name__ == "__main__":
    main()
