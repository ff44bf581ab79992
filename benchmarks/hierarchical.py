"""Hierarchical latent Gaussian models: hyper-latents integrated over (INLA-style) against Pyro's engines.

Cases (float64):

* ``logistic-sonar``: Bayesian logistic regression on keel *sonar* (146 training rows, 60 standardised
  features and an intercept) with a shrinkage scale ``tau ~ HalfCauchy(1)``, ``w ~ N(0, tau^2 I)``;
* ``poisson-gmrf``: disease mapping on an ``m x m`` lattice: counts ``y_i ~ Poisson(E_i exp(f_i))`` with
  exposures ``E_i`` and a spatial field ``f ~ SparseGMRF(0, kappa (D - 0.99 W))`` (``W`` the 4-neighbour
  adjacency), precision ``kappa ~ Gamma(1, 0.1)``;
* ``gp-lengthscale``: GP classification on keel *ionosphere* (the first 100 training rows) with an RBF
  kernel of outputscale 4 and lengthscale ``ell ~ LogNormal(log 4, 0.5)``;
* ``bym``: BYM disease mapping on an ``8 x 8`` lattice (quick: ``5 x 5``): a proper CAR field of precision
  ``kappa (D - 0.99 W)`` plus iid effects of scale ``sigma_v``, two hyper-latents (reported: ``sigma_v`` and the
  iid effects).

Methods, alternating in the same run: ``dual_vg`` with the hyper-latents integrated over (grid, the
default) and at their mode (``hyper="map"``), ``convex_relaxation`` (logistic case), and Pyro's
``nuts`` (one chain, 1,000 samples after 500 warm-up steps), ``laplace`` and ``svi_automvn`` on the
full model (hyper-latents included, in unconstrained coordinates). The reference is a long NUTS run
(the GP case in whitened coordinates ``f = L(ell) v``, the same posterior)
(4 chains of 3,000 samples after 1,500 warm-up steps by default, ``--reference`` sets the size; split R-hat and
ESS reported; the full-size ``bym`` reference, and a ``logistic-sonar`` one of more than 5,000 draws per chain, with
NumPyro's NUTS on the non-centred models of ``tests/references/numpyro_models.py``, where Pyro's takes hours),
computed once and cached
in ``benchmarks/results/hierarchical_reference*.json``.

With ``+ psis`` an engine's result is importance-corrected (``res.corrected()``: 2,000 draws, and when their
importance ESS is below 80% of them 2,000 more from the adapted proposal, pooled; ``pyro_convexvb.diagnostics``;
the time includes the correction), and every uncorrected result of our engines
reports the PSIS ``k_hat`` of its posterior (``res.diagnostics``, 500 draws, not timed). When NumPyro is installed
(the ``bench`` extra) ``numpyro nuts`` runs each case written independently in NumPyro
(``_numpyro_models.py``): 4 chains of 1,000 warm-up steps and 1,000 draws, run sequentially (quick: 2 x 200 +
200); its time includes JIT compilation on the first repeat (``seconds_compile``) and not on the others:
NumPyro's ``MCMC.run`` wraps its sampling loop in a new ``jax.jit`` on every call, so each chain of each run
would compile it again (about 1.6-2 s a chain here), and XLA's compiled programs are kept in a temporary persistent
cache from which later chains and runs load them (still traced and lowered, about 0.2 s a chain);
``--numpyro-compile-cache off`` times the recompilations (the protocol before 2026-11-28 evening, whose NumPyro
times, and so our ratios against them, included one compilation per chain).
ESS/s is the smallest bulk ESS over the hyper-latent and the field per second for the samplers, the importance
ESS per second for corrected results.

Accuracy: the hyper-latent's 5%, 50%, 95% quantiles relative to the reference (targets 15% for the
median, 25% for the tails) and the latent field's means in reference posterior standard deviations
(target 0.25) and their sds relative to the reference sds (range over the field). Time: median wall seconds over ``--repeats`` alternating runs; the ratio to NUTS. Our engines run with one torch
thread and one BLAS thread (``--threads``); NumPyro with JAX's defaults.

The results file (``hierarchical.json``, or ``hierarchical_<cases>.json`` for ``--cases``) is rewritten after
every case with ``cases_done`` and ``complete``, so a run stopped partway keeps the cases it finished.

Usage::

    python benchmarks/hierarchical.py --quick      # small sizes, short NUTS reference
    python benchmarks/hierarchical.py              # the cases above (run on a quiet machine)
"""
import math
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.references

import _numpyro_models  # noqa: E402
import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402
from _common import (RESULTS_DIR, Timer, default_results_dir, lattice_precision, make_parser,  # noqa: E402
                     markdown_table, parse_args, save_figure, write_json)
from torch.distributions import biject_to  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402

D = torch.float64


# ----------------------------------------------------------------------------- cases
def logistic_sonar(quick):
    Xtr, ytr, _, _ = pcv.datasets.load_keel("sonar", seed=0)
    Xtr = Xtr.to(D)
    if quick:
        Xtr = Xtr[:, :10]
    X = torch.cat([Xtr, torch.ones(Xtr.shape[0], 1, dtype=D)], 1)
    y = ytr.to(D)

    def model(X, y=None):
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(1.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), tau).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X,), {"y": y}, "tau", "w"


def poisson_gmrf(quick):
    m = 12 if quick else 30
    Q0 = lattice_precision(m)
    g = torch.Generator().manual_seed(3)
    kappa_true = 2.0
    L = torch.linalg.cholesky(kappa_true * Q0.to_dense())
    f_true = torch.linalg.solve_triangular(L.T, torch.randn(m * m, 1, generator=g, dtype=D), upper=True)[:, 0]
    E = 5.0 + 20.0 * torch.rand(m * m, generator=g, dtype=D)
    y = torch.poisson(E * torch.exp(f_true), generator=g)

    def model(E, y=None):
        kappa = pyro.sample("kappa", dist.Gamma(torch.tensor(1.0, dtype=D), torch.tensor(0.1, dtype=D)))
        f = pyro.sample("f", pcv.distributions.SparseGMRF(torch.zeros(m * m, dtype=D), Q0, precision_scale=kappa))
        with pyro.plate("areas", m * m):
            pyro.sample("y", dist.Poisson(E * torch.exp(f)), obs=y)

    return model, (E,), {"y": y}, "kappa", "f"


def gp_lengthscale(quick):
    Xtr, ytr, _, _ = pcv.datasets.load_keel("ionosphere", seed=0)
    n = 40 if quick else 100
    X, y = Xtr[:n].to(D), ytr[:n].to(D)
    d2 = torch.cdist(X, X) ** 2

    def model(d2, y=None):
        ell = pyro.sample("ell", dist.LogNormal(torch.tensor(math.log(4.0), dtype=D), torch.tensor(0.5, dtype=D)))
        K = 4.0 * torch.exp(-0.5 * d2 / ell**2) + 1e-6 * torch.eye(d2.shape[0], dtype=D)
        f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(d2.shape[0], dtype=D), covariance_matrix=K))
        with pyro.plate("data", d2.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

    return model, (d2,), {"y": y}, "ell", "f"


def bym(quick):
    """BYM disease mapping (Besag, York & Mollie 1991): proper CAR field ``phi`` of precision ``kappa (D - 0.99 W)``
    plus iid effects ``v ~ N(0, sigma_v^2)``; two hyper-latents, ``kappa ~ Gamma(2, 1)``, ``sigma_v ~ HalfNormal(0.5)``.
    Reported: ``sigma_v`` (weakly identified beside the spatial field) and the iid effects ``v``."""
    m = 5 if quick else 8
    Q0 = lattice_precision(m)
    g = torch.Generator().manual_seed(4)
    L = torch.linalg.cholesky(2.0 * Q0.to_dense())
    phi = torch.linalg.solve_triangular(L.T, torch.randn(m * m, 1, generator=g, dtype=D), upper=True)[:, 0]
    v = 0.3 * torch.randn(m * m, generator=g, dtype=D)
    E = 5.0 + 10.0 * torch.rand(m * m, generator=g, dtype=D)
    y = torch.poisson(E * torch.exp(phi + v), generator=g)

    def model(E, y=None):
        kappa = pyro.sample("kappa", dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)))
        sigma_v = pyro.sample("sigma_v", dist.HalfNormal(torch.tensor(0.5, dtype=D)))
        phi = pyro.sample("phi", pcv.distributions.SparseGMRF(torch.zeros(m * m, dtype=D), Q0, precision_scale=kappa))
        v = pyro.sample("v", dist.Normal(torch.zeros(m * m, dtype=D), sigma_v).to_event(1))
        with pyro.plate("areas", m * m):
            pyro.sample("y", dist.Poisson(E * torch.exp(phi + v)), obs=y)

    return model, (E,), {"y": y}, "sigma_v", "v"


CASES = {"logistic-sonar": logistic_sonar, "poisson-gmrf": poisson_gmrf, "gp-lengthscale": gp_lengthscale,
         "bym": bym}


def _gp_kernel(d2, ell):
    return 4.0 * torch.exp(-0.5 * d2 / ell**2) + 1e-6 * torch.eye(d2.shape[0], dtype=D)


def _gp_whitened(d2, y=None):
    """The gp-lengthscale model in whitened coordinates, ``f = L(ell) v`` with ``v ~ N(0, I)``: the same
    posterior, in coordinates NUTS mixes well in (in f-space the prior is badly conditioned)."""
    ell = pyro.sample("ell", dist.LogNormal(torch.tensor(math.log(4.0), dtype=D), torch.tensor(0.5, dtype=D)))
    v = pyro.sample("v", dist.Normal(torch.zeros(d2.shape[0], dtype=D), 1.0).to_event(1))
    f = torch.linalg.cholesky(_gp_kernel(d2, ell)) @ v
    with pyro.plate("data", d2.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=f), obs=y)


def _gp_field(samples, d2):
    ell, v = samples["ell"], samples["v"]
    return torch.stack([torch.linalg.cholesky(_gp_kernel(d2, e)) @ vi for e, vi in zip(ell, v)])


def _bym_noncentred(E, y=None):
    """The BYM model in non-centred coordinates (``phi = L0^{-T} z / sqrt(kappa)``, ``v = sigma_v e``)."""
    n = E.shape[0]
    L0 = torch.linalg.cholesky(lattice_precision(int(round(math.sqrt(n)))).to_dense())
    kappa = pyro.sample("kappa", dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)))
    sigma_v = pyro.sample("sigma_v", dist.HalfNormal(torch.tensor(0.5, dtype=D)))
    z = pyro.sample("z", dist.Normal(torch.zeros(n, dtype=D), 1.0).to_event(1))
    e = pyro.sample("e", dist.Normal(torch.zeros(n, dtype=D), 1.0).to_event(1))
    phi = torch.linalg.solve_triangular(L0.T, z.unsqueeze(-1), upper=True).squeeze(-1) / kappa.sqrt()
    with pyro.plate("areas", n):
        pyro.sample("y", dist.Poisson(E * torch.exp(phi + sigma_v * e)), obs=y)


def _bym_field(samples, E):
    return samples["e"] * samples["sigma_v"].reshape(-1, 1)


#: reference models in better-mixing coordinates: (model, samples -> field draws)
REFERENCE_MODELS = {"gp-lengthscale": (_gp_whitened, _gp_field), "bym": (_bym_noncentred, _bym_field)}


# ----------------------------------------------------------------------------- reference
def nuts_reference(name, model, args, kwargs, hyper, field, quick, size=None):
    stem = f"hierarchical_reference{'_quick' if quick else ''}.json"
    path = os.path.join(default_results_dir(), stem)  # written here; read from here, else the committed one
    import json

    read = path if os.path.exists(path) else os.path.join(RESULTS_DIR, stem)
    refs = json.load(open(read)) if os.path.exists(read) else {}
    if name in refs and (size is None or (refs[name]["chains"], refs[name]["num_samples"],
                                            refs[name]["warmup_steps"]) == tuple(size)):
        return refs[name]
    from pyro.infer import MCMC, NUTS
    from pyro.ops.stats import effective_sample_size, split_gelman_rubin

    chains, ns, nw = size or ((2, 500, 300) if quick else (4, 3000, 1500))
    hs, fs = [], []
    with Timer() as t:
        if name == "bym" and not quick:  # Pyro's NUTS takes hours here; NumPyro's runs the same protocol in minutes
            hs, fs = _numpyro_bym_reference(args, kwargs, chains, ns, nw)
        elif name == "logistic-sonar" and not quick and ns > 5000:  # long runs: NumPyro, non-centred
            hs, fs = _numpyro_sonar_reference(args, kwargs, chains, ns, nw)
        for c in range(chains if not hs else 0):
            pyro.set_rng_seed(1000 + c)
            ref_model, to_field = REFERENCE_MODELS.get(name, (model, None))
            mcmc = MCMC(NUTS(ref_model, target_accept_prob=0.9), num_samples=ns, warmup_steps=nw,
                        disable_progbar=True)
            mcmc.run(*args, **kwargs)
            s = mcmc.get_samples()
            hs.append(s[hyper].reshape(ns, -1))
            fs.append((s[field] if to_field is None else to_field(s, *args)).reshape(ns, -1))
    H, F = torch.stack(hs), torch.stack(fs)
    both = torch.cat([torch.log(H), F], -1)
    rhat, ess = split_gelman_rubin, effective_sample_size
    if ns > 5000:  # Pyro's ESS takes O(samples^2) memory; NumPyro's (installed for these long runs) O(samples)
        from numpyro import diagnostics as nd

        rhat = lambda x: torch.as_tensor(nd.split_gelman_rubin(x.numpy()))  # noqa: E731
        ess = lambda x: torch.as_tensor(nd.effective_sample_size(x.numpy()))  # noqa: E731
    ref = {"hyper_q": torch.quantile(H.reshape(-1), torch.tensor([0.05, 0.5, 0.95], dtype=D)).tolist(),
           "hyper_samples": H.reshape(-1)[:: max(1, H.numel() // 4000)].tolist(),
           "field_mean": F.reshape(-1, F.shape[-1]).mean(0).tolist(),
           "field_sd": F.reshape(-1, F.shape[-1]).std(0).tolist(),
           "split_rhat": float(rhat(both).max()), "min_ess": float(ess(both).min()),
           "chains": chains, "num_samples": ns, "warmup_steps": nw, "seconds": t.seconds}
    refs[name] = ref
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(refs, fh)
    return ref


def _numpyro_reference(built, hyper, field, chains, ns, nw):
    """Per chain, the draws of ``hyper`` ``(ns, 1)`` and ``field`` ``(ns, n)`` from NumPyro's NUTS on ``built``, a
    ``(model, kwargs, to_sites)`` of ``tests/references/numpyro_models.py`` (the same posterior, written
    independently)."""
    import jax
    import numpy as np
    from numpyro.infer import MCMC as NMCMC
    from numpyro.infer import NUTS as NNUTS

    model, mkw, to_sites = built
    hs, fs = [], []
    for c in range(chains):
        mcmc = NMCMC(NNUTS(model, target_accept_prob=0.9), num_warmup=nw, num_samples=ns, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(1000 + c), **mkw)
        s = to_sites({k: np.array(v) for k, v in mcmc.get_samples().items()})
        hs.append(torch.as_tensor(s[hyper], dtype=D).reshape(ns, -1))
        fs.append(torch.as_tensor(s[field], dtype=D).reshape(ns, -1))
    return hs, fs


def _numpyro_bym_reference(args, kwargs, chains, ns, nw):
    """``sigma_v`` and the iid effects ``v`` of the non-centred BYM (:func:`_numpyro_reference`)."""
    from tests.references import numpyro_models

    numpyro_models.setup()
    (E,), y = args, kwargs["y"]
    built = numpyro_models.bym_noncentred(E, y, lattice_precision(int(round(math.sqrt(E.shape[0])))).to_dense().numpy())
    return _numpyro_reference(built, "sigma_v", "v", chains, ns, nw)


def _numpyro_sonar_reference(args, kwargs, chains, ns, nw):
    """``tau`` and ``w`` of the non-centred logistic regression (:func:`_numpyro_reference`)."""
    from tests.references import numpyro_models

    numpyro_models.setup()
    return _numpyro_reference(numpyro_models.sonar_noncentred(args[0], kwargs["y"]), "tau", "w", chains, ns, nw)


# ----------------------------------------------------------------------------- methods
def _hyper_quantiles_from_gaussian(res, hyper):
    """5/50/95% quantiles of a hyper-latent under a Gaussian posterior over the unconstrained latents."""
    post = res.posterior
    block = post.layout[hyper]
    z = post.loc[block.slice] + post.scale[block.slice] * torch.tensor([-1.6448536, 0.0, 1.6448536], dtype=D)
    site_support = {"tau": dist.constraints.positive, "kappa": dist.constraints.positive,
                    "ell": dist.constraints.positive, "sigma_v": dist.constraints.positive}[hyper]
    return biject_to(site_support)(z).tolist()


def _numpyro_case(name, margs, mkw):
    import _numpyro_models as npm

    extra = None
    if name in ("poisson-gmrf", "bym"):
        m = int(round(math.sqrt(margs[0].shape[0])))
        extra = lattice_precision(m).to_dense().numpy()
    return npm.build(name, margs, mkw, extra)


def run_numpyro(name, margs, mkw, hyper, field, quick, seed=0):
    import _numpyro_models as npm
    import numpy as np
    from numpyro.diagnostics import effective_sample_size

    model, kw, h, f = _numpyro_case(name, margs, mkw)
    size = dict(chains=2, warmup=200, samples=200) if quick else dict(chains=4, warmup=1000, samples=1000)
    samples, sec = npm.run_nuts(model, kw, seed=seed, **size)
    H = np.asarray(samples[h]).reshape(size["chains"], size["samples"], -1)
    F = np.asarray(samples[f]).reshape(size["chains"], size["samples"], -1)
    ess = float(min(effective_sample_size(np.log(H)).min(), effective_sample_size(F).min()))
    hs = torch.tensor(np.array(H.reshape(-1)), dtype=D)
    q = torch.quantile(hs, torch.tensor([0.05, 0.5, 0.95], dtype=D)).tolist()
    Ff = torch.tensor(np.array(F.reshape(-1, F.shape[-1])), dtype=D)
    return sec, q, Ff.mean(0), Ff.std(0), None, {"ess": ess}


def run_method(method, model, args, kwargs, hyper, field, quick, name=None, seed=0):
    """``(seconds, hyper quantiles, field mean, field sd, result, extras)`` of one method on one case."""
    if method == "numpyro nuts":
        return run_numpyro(name, args, kwargs, hyper, field, quick, seed=seed)
    correct = method.endswith(" + psis")
    base = method[:-len(" + psis")] if correct else method
    engine, opts = {
        "dual_vg (integrate)": ("dual_vg", {}),
        "dual_vg (map)": ("dual_vg", {"hyper": "map"}),
        "convex_relaxation (integrate)": ("convex_relaxation", {}),
        "nuts": ("nuts", dict(num_samples=300 if quick else 1000, warmup_steps=200 if quick else 500)),
        "laplace": ("laplace", {}),
        "svi_automvn": ("svi_automvn", dict(max_steps=1000 if quick else 5000, lr=0.02)),
    }[base]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    extras = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Timer() as t:
            res = pcv.fit(model, *args, engine=engine, options=opts, progress=False, **kwargs)
            c = res.corrected(seed=seed) if correct else None
    if c is not None:
        site_h, site_f = c.sites[hyper], c.sites[field]
        q = [float(site_h["quantiles"][p]) for p in (0.05, 0.5, 0.95)]
        extras.update(k_hat=c.k_hat, ess=c.ess, proposal=c.diagnostics.proposal, draws=c.diagnostics.num_draws)
        return t.seconds, q, site_f["mean"].reshape(-1), site_f["sd"].reshape(-1), res, extras
    if engine == "nuts":
        from pyro.ops.stats import effective_sample_size

        s = res.info["samples"][hyper].reshape(-1)
        q = torch.quantile(s, torch.tensor([0.05, 0.5, 0.95], dtype=D)).tolist()
        F = res.info["samples"][field].reshape(s.shape[0], -1)
        both = torch.cat([torch.log(s).reshape(1, -1, 1), F.reshape(1, s.shape[0], -1)], -1)
        extras["ess"] = float(effective_sample_size(both).min())
        return t.seconds, q, F.mean(0), F.std(0), res, extras
    if res.hyper is not None:
        if res.hyper["marginals"] is not None:
            q = [float(v) for v in res.hyper["marginals"][hyper]["quantiles"].values()]
        else:
            m = float(res.hyper["mode"][hyper])
            q = [m, m, m]
        sl = res.posterior.layout[field].slice  # the reported field among the latent sites (BYM has phi and v)
        field_mean, field_sd = res.posterior.loc[sl], res.posterior.scale[sl]
    else:
        q = _hyper_quantiles_from_gaussian(res, hyper)
        sl = res.posterior.layout[field].slice
        field_mean, field_sd = res.posterior.loc[sl], res.posterior.scale[sl]
    try:  # the PSIS diagnostic of the uncorrected answer (not timed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            d = res.diagnostics
        extras.update(k_hat=d.k_hat, diag_ok=d.ok)
    except (NotImplementedError, ValueError) as e:
        extras["k_hat_note"] = str(e)[:80]
    return t.seconds, q, field_mean.detach(), field_sd.detach(), res, extras


def main():
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="alternating repetitions (default 3, quick 1)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of cases")
    parser.add_argument("--methods", default=None,
                        help="comma list of methods to run (default: all); e.g. leave out Pyro's slow peers")
    parser.add_argument("--reference", default=None,
                        help="NUTS reference size 'chains,samples,warmup' (default 4,3000,1500; quick 2,500,300)")
    _numpyro_models.add_compile_cache_option(parser)
    args = parse_args(parser=parser)
    torch.set_default_dtype(D)
    from threadpoolctl import threadpool_limits

    # NumPy's BLAS as torch (--threads): its default of one thread a core spun both cores on the corrections' small
    # dense products (1.5-3 s of CPU for 1.3 s of work on the GMRF case)
    threadpool_limits(args.threads)
    repeats = args.repeats or (1 if args.quick else 3)
    methods = ["dual_vg (integrate)", "dual_vg (integrate) + psis", "dual_vg (map)", "dual_vg (map) + psis",
               "convex_relaxation (integrate)", "nuts", "laplace", "laplace + psis", "svi_automvn"]
    if _numpyro_models.available():
        methods.append("numpyro nuts")
    else:
        print("numpyro not installed (pip install 'pyro_convexvb[bench]'): numpyro nuts left out", flush=True)
    if args.methods:
        unknown = set(args.methods.split(",")) - set(methods)
        if unknown:
            parser.error(f"--methods: unknown {sorted(unknown)}; choose from {methods}")
        methods = [m for m in methods if m in args.methods.split(",")]
    if "numpyro nuts" in methods and args.numpyro_compile_cache == "on":
        _numpyro_models.use_temporary_compile_cache("hierarchical_xla_")
    rows, figs, ref_rows = [], {}, []
    cases = args.cases.split(",")
    # a run of some cases writes its own file (cases are run one at a time within the machine's quiet windows)
    tag = ("_quick" if args.quick else "") + ("" if set(cases) == set(CASES) else "_" + "_".join(cases))
    for name in cases:
        model, margs, mkw, hyper, field = CASES[name](args.quick)
        print(f"[{name}] reference ...", flush=True)
        size = tuple(int(v) for v in args.reference.split(",")) if args.reference else None
        ref = nuts_reference(name, model, margs, mkw, hyper, field, args.quick, size)
        case_methods = [m for m in methods if not (m.startswith("convex") and name != "logistic-sonar")]
        times = {m: [] for m in case_methods}
        compile_s = {}
        out, failed = {}, {}
        for rep in range(repeats):
            order = case_methods if rep % 2 == 0 else case_methods[::-1]
            for m in order:
                try:
                    sec, q, fmean, fsd_m, res, extras = run_method(m, model, margs, mkw, hyper, field, args.quick,
                                                                   name=name, seed=rep)
                except Exception as e:  # a peer that fails on a case is reported, not hidden
                    failed[m] = f"{type(e).__name__}: {str(e)[:120]}"
                    print(f"  {m}: failed ({failed[m]})", flush=True)
                    continue
                if m == "numpyro nuts" and m not in compile_s:
                    compile_s[m] = sec  # the first run includes JIT compilation
                    if repeats > 1:
                        continue
                times[m].append(sec)
                out[m] = (q, fmean, res, fsd_m, extras)
                print(f"  {m}: {sec:.2f} s", flush=True)
        rq = ref["hyper_q"]
        fm, fsd = torch.tensor(ref["field_mean"], dtype=D), torch.tensor(ref["field_sd"], dtype=D)
        nuts_t = statistics.median(times["nuts"]) if times.get("nuts") else math.nan
        np_t = statistics.median(times["numpyro nuts"]) if times.get("numpyro nuts") else math.nan
        for m in case_methods:
            if m in failed:
                rows.append({"case": name, "method": m, "seconds": math.nan, "vs_nuts": math.nan, "vs_numpyro": math.nan,
                             "rel_err_q50": math.nan, "rel_err_tails": math.nan, "field_err_sd": math.nan,
                             "evaluations": None, "failed": failed[m]})
                continue
            q, fmean, res, fsd_m, extras = out[m]
            med = statistics.median(times[m])
            ratio = fsd_m.reshape(-1) / fsd
            rows.append({"case": name, "method": m, "seconds": med, "vs_nuts": nuts_t / med, "vs_numpyro": np_t / med,
                         "seconds_compile": compile_s.get(m),
                         f"{hyper}_q05": q[0], f"{hyper}_q50": q[1], f"{hyper}_q95": q[2],
                         "rel_err_q50": abs(q[1] - rq[1]) / rq[1],
                         "rel_err_tails": max(abs(q[0] - rq[0]) / rq[0], abs(q[2] - rq[2]) / rq[2]),
                         "field_err_sd": float(((fmean - fm).abs() / fsd).max()),
                         "field_sd_ratio_min": float(ratio.min()), "field_sd_ratio_max": float(ratio.max()),
                         "k_hat": extras.get("k_hat"), "ess_per_s": (extras["ess"] / med) if "ess" in extras else None,
                         "proposal": extras.get("proposal"), "correction_draws": extras.get("draws"),
                         "evaluations": (res.hyper or {}).get("evaluations") if res is not None else None})
        figs[name] = (hyper, ref, {m: out[m][2] for m in case_methods
                                   if m in out and out[m][2] is not None and not m.endswith(" + psis")})
        ref_rows.append({"case": name, "reference": f"{ref['chains']} x {ref['num_samples']} NUTS",
                         "split_rhat": ref["split_rhat"], "min_ess": ref["min_ess"], "seconds": ref["seconds"]})
        # rewritten after every case: a run stopped partway keeps the cases it finished
        write_json(f"hierarchical{tag}", {"rows": rows, "references": ref_rows, "repeats": repeats,
                                          "numpyro_compile_cache": args.numpyro_compile_cache,
                                          "cases_done": list(figs), "complete": len(figs) == len(cases)})
    print()
    print(markdown_table([{k: v for k, v in r.items() if not k.startswith(("tau_", "kappa_", "ell_"))}
                          for r in rows], floatfmt=".3g"))
    print()
    print(markdown_table(ref_rows, floatfmt=".4g"))
    plot(figs, f"hierarchical{tag}")


def plot(figs, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figs), figsize=(5 * len(figs), 3.8))
    axes = [axes] if len(figs) == 1 else axes
    for ax, (case, (hyper, ref, results)) in zip(axes, figs.items()):
        s = torch.tensor(ref["hyper_samples"], dtype=D)
        ax.hist(s.numpy(), bins=60, density=True, color="0.8", label="NUTS (reference)")
        grid = torch.linspace(float(s.quantile(0.001)), float(s.quantile(0.999)), 400, dtype=D)
        for m, res in results.items():
            if res.hyper is not None and res.hyper["marginals"] is not None:
                z, _ = res.posterior.sample_z(20000, torch.Generator().manual_seed(0))
                v = res.posterior.space.unpack_batch(z)[hyper] if hasattr(res.posterior.space, "unpack_batch") else \
                    torch.stack([res.posterior.space.unpack(zz)[0][hyper] for zz in z[:4000]])
                kde = torch.exp(-0.5 * ((grid[:, None] - v.reshape(1, -1)) / (0.1 * float(v.std()))) ** 2).mean(1)
                kde = kde / (math.sqrt(2 * math.pi) * 0.1 * float(v.std()))
                ax.plot(grid.numpy(), kde.numpy(), label=m)
            elif m in ("laplace", "svi_automvn"):
                post = res.posterior
                b = post.layout[hyper]
                mu, sd = float(post.loc[b.slice]), float(post.scale[b.slice])
                lg = torch.log(grid)
                dens = torch.exp(-0.5 * ((lg - mu) / sd) ** 2) / (sd * math.sqrt(2 * math.pi) * grid)
                ax.plot(grid.numpy(), dens.numpy(), "--", label=m)
        ax.set_title(f"{case}: posterior of {hyper}")
        ax.set_xlabel(hyper)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, name)


if __name__ == "__main__":
    main()
