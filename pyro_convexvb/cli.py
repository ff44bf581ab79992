"""Command line: ``python -m pyro_convexvb demo``, ``online`` and ``bench``.

``online FILE --format criteo|csv|svmlight`` learns :class:`~pyro_convexvb.online.OnlineBayesLogistic` from a
text file in one progressive pass (see :func:`run_online`).

``demo`` runs GP classification on the real keel *ionosphere* data set (RBF kernel from
GPyTorch, hyperparameters learned by type-II maximum likelihood, then fixed) with every registered
engine that applies, prints a table (engine, seconds, log-evidence bound, test accuracy, test NLPD,
converged) and writes a PNG comparing them. The reference is exact Bayes approximated by NUTS on the
whitened parametrisation ``f = L v``, ``v ~ N(0, I)`` (``K = L L^T``), in coordinates where
``dual_vg``'s Gaussian is standard (:func:`preconditioned_gp_classification_model`), with its split
R-hat reported; its test predictions average the GP predictive over the posterior samples of ``f``.
"""
import argparse
import math
import os
import subprocess
import sys
import time
import warnings

import torch

#: Engine options used by the demo: Pyro's stochastic engines get step caps so the demo stays short
#: (they report, and the table shows, that they stopped before converging).
DEMO_OPTIONS = {
    "svi_autonormal": dict(lr=0.05, max_steps=300, min_steps=100, window=50),
    "svi_automvn": dict(lr=0.05, max_steps=300, min_steps=100, window=50),
    "svi_lowrank": dict(lr=0.05, max_steps=300, min_steps=100, window=50, rank=10),
    "diag_mixture": dict(max_steps=300),
    "laplace": dict(max_iter=200),
}

#: The reference run: Pyro's NUTS on the whitened model, preconditioned by dual_vg's Gaussian (see
#: :func:`preconditioned_gp_classification_model`), long enough for a split R-hat below 1.01.
REFERENCE_NUTS = dict(num_samples=500, warmup_steps=300, max_rhat=1.01, target_accept_prob=0.8)
#: the registry engine whose row the reference run takes (the demo's table compares every engine with it)
REFERENCE_ENGINE = "nuts"


def whitened_gp_classification_model(L, y=None, mean=0.0):
    """GP classification in the whitened parametrisation: ``v ~ N(0, I)``, ``f = mean + L v``, ``y ~ Bernoulli(sigmoid(f))``.

    :param torch.Tensor L: ``(n, n)`` Cholesky factor of the training kernel matrix.
    """
    import pyro
    import pyro.distributions as dist

    n = L.shape[0]
    v = pyro.sample("v", dist.Normal(torch.zeros(n, dtype=L.dtype, device=L.device), 1.0).to_event(1))
    f = pyro.deterministic("f", mean + L @ v)
    with pyro.plate("data", n):
        return pyro.sample("y", dist.Bernoulli(logits=f), obs=y)


def preconditioner(L, posterior):
    """Affine map ``v = loc_v + C z`` that makes a Gaussian approximation ``N(m, V)`` of ``f = L v`` standard.

    :param torch.Tensor L: ``(n, n)`` Cholesky factor of the kernel matrix.
    :param posterior: Gaussian over ``f`` with ``.loc`` ``(n,)`` and ``.covariance()`` ``(n, n)`` (a :class:`~pyro_convexvb.GaussianPosterior`).
    :returns: ``(loc_v, C, shift, M)``: ``loc_v = L^{-1} m``, ``C = chol(L^{-1} V L^{-T})``, and the
        map to ``f``: ``f = shift + M z`` with ``shift = m``, ``M = L C``.
    """
    m = posterior.loc
    loc_v = torch.linalg.solve_triangular(L, m.unsqueeze(-1), upper=False).squeeze(-1)
    Li_V = torch.linalg.solve_triangular(L, posterior.covariance(), upper=False)
    S = torch.linalg.solve_triangular(L, Li_V.transpose(0, 1), upper=False)
    S = 0.5 * (S + S.transpose(0, 1))
    C = torch.linalg.cholesky(S + 1e-10 * torch.eye(S.shape[0], dtype=S.dtype, device=S.device) * S.diagonal().mean())
    return loc_v, C, m, L @ C


def preconditioned_gp_classification_model(loc_v, C, shift, M, y=None):
    """The whitened model :func:`whitened_gp_classification_model` written in ``z``, ``v = loc_v + C z``.

    ``z`` carries the sample statement ``N(0, I)`` and the factor ``log N(v; 0, I) - log N(z; 0, I)``
    turns its density into that of ``v`` under the model (the map is affine, so its Jacobian is a
    constant): the posterior of ``v`` is exactly the model's, whatever ``loc_v`` and ``C``. Chosen from a
    Gaussian approximation of the posterior (:func:`preconditioner`), they make the posterior of ``z``
    close to standard, which NUTS explores with long steps and shallow trees; the sampler's R-hat and
    effective sample size still judge the chains on their own. ``f = shift + M z`` equals ``L v``.
    """
    import pyro
    import pyro.distributions as dist

    n = loc_v.shape[0]
    z = pyro.sample("z", dist.Normal(torch.zeros(n, dtype=C.dtype, device=C.device), 1.0).to_event(1))
    v = loc_v + C @ z
    pyro.factor("whitened_prior", -0.5 * (v @ v) + 0.5 * (z @ z))
    f = pyro.deterministic("f", shift + M @ z)
    with pyro.plate("data", n):
        return pyro.sample("y", dist.Bernoulli(logits=f), obs=y)


class _PreconditionedPotential(torch.autograd.Function):
    """``U(z) = |v|^2 / 2 - sum_n [y_n f_n - softplus(f_n)]``, ``v = loc_v + C z``, ``f = shift + M z``, with
    its gradient ``C^T v - M^T (y - sigmoid(f))`` from the same pass (differentiable once)."""

    @staticmethod
    def forward(ctx, z, loc_v, C, shift, M, y):
        v = loc_v + C @ z
        f = shift + M @ z
        sp = torch.nn.functional.softplus(f)
        ctx.save_for_backward(C.transpose(0, 1) @ v - M.transpose(0, 1) @ (y - torch.exp(f - sp)))
        return 0.5 * (v @ v) - (y @ f - sp.sum())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return grad * ctx.saved_tensors[0], None, None, None, None, None


def preconditioned_potential(loc_v, C, shift, M, y):
    """The potential energy of :func:`preconditioned_gp_classification_model` for Pyro's ``NUTS(potential_fn=)``:
    ``params -> U(params["z"])``, the model's negative log joint in ``z`` up to a constant."""
    return lambda params: _PreconditionedPotential.apply(params["z"], loc_v, C, shift, M, y)


def reference_nuts(loc_v, C, shift, M, y, *, num_samples=500, warmup_steps=300, max_rhat=1.01,
                   target_accept_prob=0.8, progress=True):
    """Exact-Bayes draws of ``f`` by Pyro's NUTS on :func:`preconditioned_potential` (one chain).

    :returns: ``(f draws (num_samples, n), summary)`` with ``summary.converged`` (largest split R-hat
        ``<= max_rhat``), ``summary.optimality`` (text), ``summary.log_evidence_bound = None``.
    """
    import types

    from pyro.infer import MCMC, NUTS
    from pyro.ops.stats import effective_sample_size, split_gelman_rubin

    from .infer.result import Optimality

    kernel = NUTS(potential_fn=preconditioned_potential(loc_v, C, shift, M, y),
                  target_accept_prob=target_accept_prob)
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps,
                initial_params={"z": torch.zeros_like(loc_v)}, disable_progbar=not progress)
    mcmc.run()
    z = mcmc.get_samples()["z"]
    rhat = float(split_gelman_rubin(z.unsqueeze(0)).max())
    ess = float(effective_sample_size(z.unsqueeze(0)).min())
    crit = Optimality.single("largest split R-hat", rhat, max_rhat)
    summary = types.SimpleNamespace(converged=crit.converged, log_evidence_bound=None, r_hat=rhat, min_ess=ess,
                                    optimality=f"{crit}, smallest ESS {ess:.0f}")
    return shift + z @ M.transpose(0, 1), summary


def reference_probs(K, K_cross, k_diag, f_samples, num_points=32):
    """Exact-Bayes test probabilities from posterior samples of ``f``: the mean over samples of
    ``E[sigmoid(f*) | f]`` with ``f* | f ~ N(A f, k** - diag(A K_n*))``, ``A = K_*n K^{-1}``."""
    from .lgm.sites import gaussian_expectation

    L = torch.linalg.cholesky(K)
    A = torch.cholesky_solve(K_cross.transpose(0, 1), L).transpose(0, 1)
    var = (k_diag - (A * K_cross).sum(-1)).clamp_min(0)
    means = f_samples @ A.transpose(0, 1)  # (S, m)
    p = gaussian_expectation(torch.sigmoid, means, var.expand_as(means), num_points)
    return p.mean(0).clamp(1e-12, 1 - 1e-12)


def _predictive_probs(posterior, K, K_cross, k_diag):
    """``p(y* = 1 | y)`` ``(m,)``: the logistic link's expectation under the latent predictive, averaged over the
    components of a mixture posterior (the moment-matched Gaussian of a mixture has other probabilities)."""
    from .estimator_base import mixture_log_probs
    from .gp.predict import gp_latent_predictive

    mean, var = gp_latent_predictive(K, K_cross, k_diag, posterior, components=True)
    return mixture_log_probs(mean, var, 64)[1].exp().clamp(1e-12, 1 - 1e-12)


def run_demo(dataset="ionosphere", engines=None, lengthscale=4.0, outputscale=4.0, out=None, progress=True,
             seed=0, learn_hyperparameters=True):
    """Fit GP classification on a keel data set with every applicable engine; return the table rows.

    Over 80 lines: a command-line script: argument handling, the run and its printed report in sequence.

    With ``learn_hyperparameters`` the kernel's lengthscale and outputscale are first learned by type-II
    maximum likelihood on ``dual_vg``'s bound (from ``lengthscale``, ``outputscale``); every engine and
    the NUTS reference then run on the learned kernel.
    """
    import gpytorch
    import pyro

    from . import datasets
    from .gp.predict import gp_classification_model, kernel_matrix
    from .infer.registry import engines as list_engines
    from .infer.registry import fit, get_engine

    torch.set_default_dtype(torch.float64)
    data = datasets.load_keel(dataset, seed=seed)
    Xtr, ytr, Xte, yte = data
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale = lengthscale
    kernel.outputscale = outputscale
    print(f"GP classification on keel '{dataset}': {Xtr.shape[0]} train / {Xte.shape[0]} test cases, "
          f"{Xtr.shape[1]} features; RBF kernel, initial lengthscale {lengthscale}, outputscale {outputscale}",
          flush=True)
    if learn_hyperparameters:  # type-II maximum likelihood through dual_vg's bound, as GP users do
        from .gp.classifier import GPClassifier

        t0 = time.perf_counter()
        clf = GPClassifier(kernel, engine="dual_vg", learn_hyperparameters=True, learn_mean=False).fit(Xtr, ytr)
        secs = time.perf_counter() - t0
        kernel = clf.kernel_
        ls, os_ = float(kernel.base_kernel.lengthscale.detach()), float(kernel.outputscale.detach())
        print(f"  kernel hyperparameters by type-II maximum likelihood (dual_vg bound): lengthscale {ls:.3g}, "
              f"outputscale {os_:.3g}, bound {clf.log_evidence_bound_:.3f}, {secs:.2f} s, "
              f"{'converged' if clf.hyper_converged_ else 'NOT converged'}", flush=True)
    with torch.no_grad():
        K = kernel_matrix(kernel, Xtr, jitter=1e-6)
        Kx = kernel_matrix(kernel, Xte, Xtr)
        kd = kernel_matrix(kernel, Xte, diag=True)
    names = list(list_engines()) if engines is None else list(engines)
    rows = []

    def add_row(name, res, p, secs, description):
        acc = float(((p > 0.5).double() == yte).double().mean())
        nlpd = float(-(yte * torch.log(p) + (1 - yte) * torch.log1p(-p)).mean())
        rows.append(dict(engine=name, seconds=secs, bound=res.log_evidence_bound, accuracy=acc, nlpd=nlpd,
                         converged=res.converged, measure=str(res.optimality), description=description))
        print(f"  {name}: {secs:.2f} s, {'converged' if res.converged else 'NOT converged'} ({res.optimality})",
              flush=True)

    if REFERENCE_ENGINE in names:
        names.remove(REFERENCE_ENGINE)
        pyro.set_rng_seed(seed)
        L = torch.linalg.cholesky(K)
        t0 = time.perf_counter()
        pre = fit(gp_classification_model, K, y=ytr, engine="dual_vg", progress=False)  # the preconditioner
        loc_v, C, shift, M = preconditioner(L, pre.posterior)
        f, res = reference_nuts(loc_v, C, shift, M, ytr, progress=progress, **REFERENCE_NUTS)
        secs = time.perf_counter() - t0
        with torch.no_grad():
            p = reference_probs(K, Kx, kd, f)
        add_row(f"{REFERENCE_ENGINE} (reference)", res, p, secs,
                "exact Bayes by Pyro's NUTS on the whitened model f = L v, preconditioned by dual_vg's Gaussian")
    for name in names:
        spec = get_engine(name)
        if name.endswith("_test"):
            continue
        pyro.set_rng_seed(seed)
        opts = DEMO_OPTIONS.get(name, {})
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = fit(gp_classification_model, K, y=ytr, engine=name, options=opts, progress=progress)
        except (ValueError, NotImplementedError) as e:  # engine does not apply to this model
            print(f"  {name}: skipped ({e})")
            continue
        secs = time.perf_counter() - t0
        with torch.no_grad():
            p = _predictive_probs(res.posterior, K, Kx, kd)
        add_row(name, res, p, secs, spec.description)
    print()
    print(format_table(rows))
    if out is not None:
        plot_demo(rows, out, dataset)
        print(f"\nfigure written to {out}")
    return rows


def format_table(rows):
    ref = next((r for r in rows if r["engine"].endswith("(reference)")), None)
    head = "| engine | seconds | log-evidence bound | test accuracy | test NLPD | NLPD − reference | converged |"
    lines = [head, "|---|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        b = "n/a" if r["bound"] is None else f"{r['bound']:.3f}"
        d = "–" if ref is None or r is ref else f"{r['nlpd'] - ref['nlpd']:+.4f}"
        lines.append(f"| {r['engine']} | {r['seconds']:.2f} | {b} | {r['accuracy']:.3f} | {r['nlpd']:.4f} | {d} | "
                     f"{'yes' if r['converged'] else 'no'} |")
    return "\n".join(lines)


def plot_demo(rows, path, dataset):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["engine"] + ("" if r["converged"] else " (not converged)") for r in rows]
    ref = next((r for r in rows if r["engine"].endswith("(reference)")), None)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].barh(names, [r["seconds"] for r in rows], color="tab:blue")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("wall seconds (log scale)")
    bounds = [r["bound"] if r["bound"] is not None else math.nan for r in rows]
    best = max((b for b in bounds if not math.isnan(b)), default=0.0)
    axes[1].barh(names, [best - b if not math.isnan(b) else 0 for b in bounds], color="tab:orange")
    axes[1].set_xlabel("nats below the best log-evidence bound")
    for i, b in enumerate(bounds):
        if math.isnan(b):
            axes[1].text(0, i, " no bound", va="center")
    axes[2].barh(names, [r["nlpd"] for r in rows], color="tab:green")
    if ref is not None:
        axes[2].axvline(ref["nlpd"], color="k", ls="--", lw=1, label="exact Bayes (NUTS)")
        axes[2].legend(loc="lower right", fontsize=8)
    axes[2].set_xlabel("test NLPD (lower is better)")
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle(f"GP classification, keel {dataset}: engines compared with exact Bayes (NUTS, whitened)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


ENGINES_PAGE_INTRO = """# Engines and their options

Every engine is an `Engine` subclass with one typed options dataclass. Options are passed as
`pcv.fit(model, *args, engine=name, options={...}, **model_kwargs)` or as keyword arguments of the
engine class (`pcv.get_engine(name)(model, **options).run(*args, **kwargs)`). They are validated
once, when the engine is built: an unknown name or a wrong type raises `TypeError`, a value out of
range `ValueError`, each naming the option.

`res.converged` is true only when the engine's optimality measure (below, per engine) is within its
tolerance; `res.optimality` holds the measure's value and tolerance, `res.stop_reason` the rule that
stopped the run. An unconverged fit warns once (`ConvergenceWarning`, with the measure's value), or
raises `ConvergenceError` with `on_fail="raise"`.

**Random numbers.** As in Pyro, an engine without an explicit `seed` option (`seed=None`, the default
of the stochastic engines) draws its seed from the global torch generator: results follow
`pyro.set_rng_seed`, two consecutive fits differ, and a re-seeded session reproduces them. An integer
`seed` makes a fit reproducible whatever the global state. Either way every fit runs on a fork of the
global generators (torch, NumPy, Python's `random`, and CUDA's when in use), seeded with that seed: the
caller's streams are never reset, and a fit without a seed moves the torch stream on by one draw only.
The inner fits of a run (type-II refits, hyper-latent design points) all use the run's seed.
`convex_relaxation`'s `seed` (default 0) seeds only its private generator of Lanczos start vectors.

This page is generated from the engines' dataclasses by `python -m pyro_convexvb engines --markdown`.
"""


def engines_page():
    """Markdown of every built-in engine: description, optimality measure, options table."""
    from .infer.engine import options_table
    from .infer.registry import BUILTIN_ENGINES, get_engine

    parts = [ENGINES_PAGE_INTRO]
    for name in sorted(BUILTIN_ENGINES):
        cls = get_engine(name)
        parts.append(f"## `{name}`\n\n{cls.description}.\n\n"
                     f"Class `{cls.__module__}.{cls.__qualname__}`; runs on "
                     f"{'the latent Gaussian model extracted from the Pyro model' if cls.takes == 'lgm' else 'the Pyro model itself'}.\n\n"
                     f"**Converged when:** {cls.optimality_measure}.\n\n{options_table(cls)}\n")
    return "\n".join(parts)


def run_bench(quick=True, only=None):
    """Run every ``benchmarks/*.py`` script of a source checkout (``--quick`` by default)."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if not os.path.isdir(root):
        raise SystemExit("benchmarks/ not found: run `bench` from a source checkout")
    status = 0
    for fn in sorted(os.listdir(root)):
        if not fn.endswith(".py") or fn.startswith("_") or (only and only not in fn):
            continue
        cmd = [sys.executable, os.path.join(root, fn)] + (["--quick"] if quick else [])
        print(f"\n## {fn}\n", flush=True)
        status |= subprocess.call(cmd)
    return status


def _int_list(text):
    """argparse type of a comma-separated list of column numbers."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip()) if text else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated column numbers, got {text!r}") from None


def _two_labels(text):
    """argparse type of two numeric labels ``A,B`` (sorted: the larger is the positive class)."""
    try:
        labels = tuple(float(v) for v in text.split(","))
    except ValueError:
        labels = ()
    if len(labels) != 2 or labels[0] == labels[1]:
        raise argparse.ArgumentTypeError(f"expected two different numeric labels A,B, got {text!r}")
    return tuple(sorted(labels))


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _prior_var(text):
    """``--prior-var``: ``"auto"`` or a positive finite number (a usage error before any row is read)."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive number, got {text!r}")
    return value


def _check_writable(state_path):
    """Refuse a state path that cannot be written before any row is learned (not after the whole pass)."""
    folder = os.path.dirname(os.path.abspath(state_path))
    if os.path.isdir(state_path):
        raise ValueError(f"--state: {state_path!r} is a folder; give a file path")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--state: no folder {folder!r} for the state file {state_path!r}")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--state: the folder {folder!r} is not writable")


def _save_state_atomically(state, path):
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


#: how run_online reads a file when an option is not given (and the state holds none): the settings a resumed
#: run must share with the state's
READING_DEFAULTS = {"hash_seed": 0, "label_column": 0, "integer_columns": (), "categorical_columns": (),
                    "delimiter": ",", "header": False, "zero_based": False}


def _reading_settings(fmt, saved, given):
    """The reading settings of a run: those ``given`` (not ``None``), else the resumed state's, else the defaults;
    a given setting that differs from the state's raises (the state's features were hashed or indexed that way)."""
    relevant = {"criteo": ("hash_seed",), "csv": ("hash_seed", "label_column", "integer_columns",
                                                  "categorical_columns", "delimiter", "header"),
                "svmlight": ("zero_based",)}[fmt]
    for key, value in given.items():
        if value is not None and key not in relevant:
            raise ValueError(f"--{key.replace('_', '-')}: does not apply to --format {fmt}")
    out = {}
    for key in relevant:
        value = given.get(key)
        value = tuple(value) if isinstance(value, list) else value
        if saved is not None and key in saved:
            have = tuple(saved[key]) if isinstance(saved[key], list) else saved[key]
            if value is not None and value != have:
                raise ValueError(f"--resume: --{key.replace('_', '-')} {value!r} differs from the state's "
                                 f"{have!r} (its model was learned from features read that way); leave it "
                                 "out or give the state's value")
            value = have
        out[key] = READING_DEFAULTS[key] if value is None else value
    return out


def _load_state(state_path, fmt):
    """The estimator and the dict of a state written by :func:`run_online` for ``--resume``; ``ValueError`` for a
    file that is not one, of another format, or whose estimator has learned another number of rows than the state
    records (``n_seen_before_file + file_rows``; states without ``n_seen_before_file``: at least ``file_rows``)."""
    from .online import OnlineBayesLogistic

    if not os.path.isfile(state_path):
        raise FileNotFoundError(f"--resume: no state file {state_path!r}; run once without --resume")
    try:
        saved = torch.load(state_path)
        est = OnlineBayesLogistic.from_state_dict(saved["estimator"])
        n_seen, file_rows = int(est.n_seen_), int(saved.get("file_rows", 0))
        before = saved.get("n_seen_before_file")
        before = None if before is None else int(before)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"--resume: {state_path!r} is not a state written by this command ({type(e).__name__}: "
                         f"{e})") from None
    if saved.get("format") != fmt:
        raise ValueError(f"--resume: the state was learned from {saved.get('format')!r} input, not {fmt!r}")
    if n_seen < file_rows if before is None else n_seen != before + file_rows:
        had = f"{before} rows before its file and " if before is not None else ""
        raise ValueError(f"--resume: {state_path!r} is inconsistent: its model has learned {n_seen} rows, but the "
                         f"state records {had}{file_rows} rows of {saved.get('file')!r}; resuming would skip or "
                         "repeat rows: start again without --resume (or give another --state)")
    return est, saved


def run_online(path, fmt, state_path=None, resume=False, num_features=None, chunk_size=None, prior_var=None,
               hash_seed=None, label_column=None, integer_columns=None, categorical_columns=None, delimiter=None,
               header=None, zero_based=None, progress=True, save_every=60.0, out=None, classes=None):
    """Learn :class:`~pyro_convexvb.online.OnlineBayesLogistic` from a text file, one progressive pass.

    Over 80 lines: a command-line script: argument handling, the run and its printed report in sequence.

    Every row is predicted, then learned (progressive validation); the progress bar shows rows/s and the
    running progressive log loss.  Every ``save_every`` seconds (after a whole chunk), at the end and on an
    interrupt, the state -- the estimator's ``state_dict()``, the file, the number of its rows learned
    (``file_rows``) and the estimator's row count before it (``n_seen_before_file``) -- is written atomically to
    ``state_path`` (``torch.save`` to a temporary file, then renamed; it loads with ``torch.load``'s default
    ``weights_only=True``).  With ``resume`` the estimator is restored from it; on the same file the rows already
    learned are skipped, on another file learning continues from its first row; a file shorter than the rows its
    state has learned raises ``ValueError`` (it is not the file learned from), and so does a state whose
    estimator has learned another number of rows than ``n_seen_before_file + file_rows``.
    An interrupt (Ctrl-C) keeps every chunk learned: the row count written is the estimator's own, which
    ``partial_fit`` advances in the same step as it applies a chunk (a chunk it does not finish is undone), so the
    state never records fewer or more rows than its model learned, wherever the interrupt lands.  A run that has
    learned no row writes no state (a resumed state stays as it was).

    :param path: the file (``.gz`` allowed).
    :param str fmt: ``"criteo"`` (tab-separated label, 13 integer, 26 categorical columns), ``"csv"`` (columns
        given by ``label_column``, ``integer_columns``, ``categorical_columns``, ``delimiter``, ``header``) or
        ``"svmlight"``.
    :param num_features: hash buckets (criteo/csv; default ``2^22``), or the number of columns (svmlight;
        required).
    :param prior_var: ``"auto"`` (default) or a positive number.
    :param classes: the two labels (``classes_``, sorted: the larger is the positive class), e.g. ``(1, 2)`` for
        LIBSVM's coding; by default the estimator infers ``{0, 1}`` or ``{-1, +1}`` from the stream (a first chunk
        of label 1 only leaves the negative label open), and a stream of other labels needs them given (a resumed
        run keeps the state's).
    :param float save_every: seconds between state saves (0: after every chunk).

    The reading settings (``hash_seed``, the csv columns, ``delimiter``, ``header``, ``zero_based``) and
    ``num_features``, ``prior_var`` are stored in the state. A resumed run takes them from it; one given that
    differs raises ``ValueError`` (features hashed with another seed, or read from other columns, are other
    features). Options that do not apply to ``fmt`` raise too.
    :returns: dict with ``rows`` (learned by this call), ``total_rows``, ``seconds``, ``rows_per_s``,
        ``log_loss`` (progressive, per row, over this call's rows), ``state_path`` (``None`` when there is no
        state: a new run that learned no row) and ``interrupted``.

    Example::

        >>> run_online("day_0.gz", "criteo", state_path="day_0.state.pt")   # doctest: +SKIP
    """

    from .online import OnlineBayesLogistic, iter_criteo, iter_csv, iter_svmlight
    from .online._base import AUTO_PRIOR_VARS

    if fmt not in ("criteo", "csv", "svmlight"):
        raise ValueError(f"format: expected 'criteo', 'csv' or 'svmlight', got {fmt!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"FILE: no such file {str(path)!r}")
    state_path = state_path or f"{path}.state.pt"
    _check_writable(state_path)
    given = dict(hash_seed=hash_seed, label_column=label_column, integer_columns=integer_columns,
                 categorical_columns=categorical_columns, delimiter=delimiter, header=header, zero_based=zero_based)
    skip = 0
    if resume:
        est, saved = _load_state(state_path, fmt)
        for key, value in (("num_features", num_features), ("prior_var", prior_var)):
            have = est._num_features if key == "num_features" else est.prior_var
            if value is not None and value != have:
                raise ValueError(f"--resume: --{key.replace('_', '-')} {value!r} differs from the state's {have!r}; "
                                 "leave it out or give the state's value")
        num_features = est._num_features
        reading = _reading_settings(fmt, saved.get("reading"), given)
        # the estimator's row count when this run's file started: the state's (same file), else now (another file)
        before_file = int(est.n_seen_)
        if os.path.abspath(saved.get("file", "")) == os.path.abspath(str(path)):
            skip = int(saved.get("file_rows", 0))
            before_file -= skip
    else:
        if fmt == "svmlight" and num_features is None:
            raise ValueError("--num-features: needed with --format svmlight (the number of columns)")
        reading = _reading_settings(fmt, None, given)
        num_features = int(2 ** 22 if num_features is None else num_features)
        if num_features < 1:
            raise ValueError(f"--num-features: expected a positive number, got {num_features}")
        est = OnlineBayesLogistic(num_features, prior_var="auto" if prior_var is None else prior_var)
        before_file = 0
    if fmt == "criteo":
        chunks = iter_criteo(path, chunk_size=chunk_size, num_features=num_features, seed=reading["hash_seed"])
    elif fmt == "csv":
        chunks = iter_csv(path, chunk_size=chunk_size, num_features=num_features, seed=reading["hash_seed"],
                          label_column=reading["label_column"], integer_columns=reading["integer_columns"],
                          categorical_columns=reading["categorical_columns"], delimiter=reading["delimiter"],
                          header=reading["header"])
    else:
        chunks = iter_svmlight(path, chunk_size=chunk_size, num_features=num_features,
                               zero_based=reading["zero_based"])
    from tqdm.auto import tqdm

    bar = tqdm(unit=" rows", unit_scale=True, disable=not progress, desc=os.path.basename(str(path)), file=out)
    # The rows learned are the estimator's own count: partial_fit applies a chunk and counts its rows in one step
    # (a chunk it does not finish is undone), so a Ctrl-C at any point -- also just after it returned -- leaves
    # the count and the model in agreement, and the state written records exactly the rows its model learned.
    n0, c0 = int(getattr(est, "n_seen_", 0)), float(getattr(est, "cumulative_log_loss_", 0.0))

    def learned():  # rows learned by this run
        return int(getattr(est, "n_seen_", 0)) - n0

    passed = 0  # rows of the file passed over by this run (those its resumed state had learned)
    t0 = last_save = time.perf_counter()
    interrupted = False

    def save():
        _save_state_atomically({"estimator": est.state_dict(), "file": os.path.abspath(str(path)),
                                "file_rows": int(est.n_seen_) - before_file, "n_seen_before_file": before_file,
                                "format": fmt,
                                "reading": {k: list(v) if isinstance(v, tuple) else v for k, v in reading.items()}},
                               state_path)
    try:
        for X, y in chunks:
            if skip:
                k = min(skip, X.shape[0])
                X, y, skip, passed = X[k:], y[k:], skip - k, passed + k
                if X.shape[0] == 0:
                    continue
            done = int(getattr(est, "n_seen_", 0)) - before_file  # rows of the file learned before this chunk
            # the estimator infers the coding {0, 1} or {-1, +1} from the stream (a first chunk of label 1 only
            # leaves the negative label open); other codings (LIBSVM's {1, 2}) come with classes=
            try:
                est.partial_fit(X, y, classes=classes)
            except (ValueError, FloatingPointError) as e:  # bad values or labels: the file and its rows named
                raise ValueError(f"{path}: the chunk of data rows {done + 1} to {done + X.shape[0]} (rows "
                                 f"as read: comment and blank lines not counted) was not learned: {e}") from e
            bar.update(X.shape[0])
            bar.set_postfix(log_loss=f"{(est.cumulative_log_loss_ - c0) / max(learned(), 1):.4f}", refresh=False)
            if time.perf_counter() - last_save >= save_every:
                save()
                last_save = time.perf_counter()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
        bar.close()
    if skip and not interrupted:  # learning from the rows past the end would mix two files' rows in one state
        raise ValueError(f"--resume: the state has learned {passed + skip} rows of {path}, but the file has only "
                         f"{passed}: it changed since; start again without --resume (or give another --state)")
    rows = learned()
    if rows:  # (nothing learned: a resumed state stays as it was, and a new run writes none)
        save()
    seconds = time.perf_counter() - t0  # including the final save
    loss = float(getattr(est, "cumulative_log_loss_", 0.0)) - c0
    res = {"rows": rows, "total_rows": int(getattr(est, "n_seen_", 0)), "seconds": seconds,
           "rows_per_s": rows / seconds if seconds > 0 else float("nan"),
           "log_loss": loss / rows if rows else float("nan"), "state_path": state_path if rows or resume else None,
           "interrupted": interrupted}
    if hasattr(est, "prior_var_weights_") and est.prior_var == "auto" and rows:
        res["prior_var_weights"] = dict(zip(AUTO_PRIOR_VARS, est.prior_var_weights_.round(4).tolist()))
    return res


def _print_online_report(res, path):
    """The ``online`` command's summary of a :func:`run_online` result (and, after an interrupt, how to go on)."""
    if res["rows"] == 0 and res["interrupted"] and res["state_path"] is None:
        print("interrupted before the first chunk was learned: nothing learned, no state written; run again "
              "without --resume")
        return
    if res["rows"] == 0 and res["interrupted"]:
        print(f"interrupted before a new row was learned: the state is as it was, {res['total_rows']} rows learned "
              f"in all; state: {res['state_path']}")
    elif res["rows"] == 0 and res["total_rows"] == 0:
        print(f"0 rows: {path} holds no data rows; no state written")
    elif res["rows"] == 0:
        print(f"0 new rows: the state had already learned every row of {path}; {res['total_rows']} rows learned in "
              f"all; state: {res['state_path']}")
    else:
        print(f"{res['rows']} rows in {res['seconds']:.2f} s ({res['rows_per_s']:,.0f} rows/s), progressive log "
              f"loss {res['log_loss']:.4f}; {res['total_rows']} rows learned in all; state: {res['state_path']}")
    if "prior_var_weights" in res:
        print(f"prior variance weights: {res['prior_var_weights']}")
    if res["interrupted"]:
        print("interrupted: the state holds every whole chunk learned; continue with --resume")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pyro_convexvb")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="GP classification on keel ionosphere with every engine")
    d.add_argument("--dataset", default="ionosphere")
    d.add_argument("--engines", nargs="*", default=None, help="engine names (default: all registered)")
    d.add_argument("--out", default="demo_engines.png", help="PNG comparing the engines")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--fixed-hyperparameters", action="store_true",
                   help="keep the kernel at lengthscale 4, outputscale 4 instead of learning it (type-II)")
    e = sub.add_parser("engines", help="list the registered engines")
    e.add_argument("--markdown", action="store_true", help="the docs page of engines and their options")
    o = sub.add_parser("online", help="learn OnlineBayesLogistic from a text file (progressive, resumable)")
    o.add_argument("file", help="criteo / csv / svmlight text file (.gz allowed)")
    o.add_argument("--format", required=True, choices=["criteo", "csv", "svmlight"])
    o.add_argument("--state", default=None, help="state file (default FILE.state.pt), written every --save-every "
                   "seconds (after a whole chunk), at the end and on Ctrl-C")
    o.add_argument("--resume", action="store_true", help="continue from --state (skips the rows it learned)")
    o.add_argument("--num-features", type=_positive_int, default=None,
                   help="hash buckets (criteo/csv, default 2^22) or columns (svmlight, required); a resumed run "
                        "takes it from the state")
    o.add_argument("--chunk-size", type=_positive_int, default=None,
                   help="rows per chunk (default: 4,096 doubling chunk by chunk to 50,000)")
    o.add_argument("--prior-var", type=_prior_var, default=None, help="'auto' (default) or a positive number")
    o.add_argument("--classes", type=_two_labels, default=None,
                   help="the file's two labels A,B (the larger is the positive class), e.g. 1,2 for LIBSVM's "
                        "coding (default: {0, 1} or {-1, +1}, inferred from the stream)")
    o.add_argument("--hash-seed", type=int, default=None, help="criteo/csv (default 0)")
    o.add_argument("--label-column", type=int, default=None, help="csv (default 0)")
    o.add_argument("--integer-columns", type=_int_list, default=None, help="csv: comma-separated column numbers")
    o.add_argument("--categorical-columns", type=_int_list, default=None,
                   help="csv: comma-separated column numbers")
    o.add_argument("--delimiter", default=None, help="csv (default ',')")
    o.add_argument("--header", action="store_const", const=True, default=None, help="csv: skip a header line")
    o.add_argument("--zero-based", action="store_const", const=True, default=None,
                   help="svmlight: indices start at 0")
    o.add_argument("--save-every", type=_seconds, default=60.0, help="seconds between state saves (default 60)")
    o.add_argument("--no-progress", action="store_true")
    b = sub.add_parser("bench", help="run the benchmark scripts (source checkout)")
    b.add_argument("--full", action="store_true", help="full sizes instead of --quick")
    b.add_argument("--only", default=None, help="substring of the script names to run")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        run_demo(args.dataset, args.engines, out=args.out, progress=not args.no_progress,
                 learn_hyperparameters=not args.fixed_hyperparameters)
        return 0
    if args.cmd == "online":
        try:
            res = run_online(args.file, args.format, state_path=args.state, resume=args.resume,
                             num_features=args.num_features, chunk_size=args.chunk_size, prior_var=args.prior_var,
                             hash_seed=args.hash_seed, label_column=args.label_column,
                             integer_columns=args.integer_columns,
                             categorical_columns=args.categorical_columns, delimiter=args.delimiter,
                             header=args.header, zero_based=args.zero_based, progress=not args.no_progress,
                             save_every=args.save_every, classes=args.classes)
        except (ValueError, OSError, EOFError) as err:  # bad input, state or file (a corrupt .gz: BadGzipFile)
            print(f"error: {type(err).__name__ + ': ' if isinstance(err, (OSError, EOFError)) else ''}{err}",
                  file=sys.stderr)
            return 2
        _print_online_report(res, args.file)
        return 130 if res["interrupted"] else 0
    if args.cmd == "engines":
        if args.markdown:
            print(engines_page(), end="")
        else:
            from .infer.registry import engines as list_engines

            for name, desc in list_engines().items():
                print(f"{name:20s} {desc}")
        return 0
    return run_bench(quick=not args.full, only=args.only)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
