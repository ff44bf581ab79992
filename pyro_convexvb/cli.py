"""Command line: ``python -m pyro_convexvb demo`` and ``python -m pyro_convexvb bench``.

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

    kernel = NUTS(potential_fn=preconditioned_potential(loc_v, C, shift, M, y),
                  target_accept_prob=target_accept_prob)
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps,
                initial_params={"z": torch.zeros_like(loc_v)}, disable_progbar=not progress)
    mcmc.run()
    z = mcmc.get_samples()["z"]
    rhat = float(split_gelman_rubin(z.unsqueeze(0)).max())
    ess = float(effective_sample_size(z.unsqueeze(0)).min())
    summary = types.SimpleNamespace(
        converged=rhat <= max_rhat, log_evidence_bound=None, r_hat=rhat, min_ess=ess,
        optimality=f"largest split R-hat = {rhat:.3g} (tol {max_rhat:g}), smallest ESS {ess:.0f}")
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
    from .gp.predict import gp_latent_predictive
    from .lgm.sites import gaussian_expectation

    mean, var = gp_latent_predictive(K, K_cross, k_diag, posterior)
    return gaussian_expectation(torch.sigmoid, mean, var, 64).clamp(1e-12, 1 - 1e-12)


def run_demo(dataset="ionosphere", engines=None, lengthscale=4.0, outputscale=4.0, out=None, progress=True,
             seed=0, learn_hyperparameters=True):
    """Fit GP classification on a keel data set with every applicable engine; return the table rows.

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

    if "nuts" in names:
        names.remove("nuts")
        pyro.set_rng_seed(seed)
        L = torch.linalg.cholesky(K)
        t0 = time.perf_counter()
        pre = fit(gp_classification_model, K, y=ytr, engine="dual_vg", progress=False)  # the preconditioner
        loc_v, C, shift, M = preconditioner(L, pre.posterior)
        f, res = reference_nuts(loc_v, C, shift, M, ytr, progress=progress, **REFERENCE_NUTS)
        secs = time.perf_counter() - t0
        with torch.no_grad():
            p = reference_probs(K, Kx, kd, f)
        add_row("nuts (reference)", res, p, secs,
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
    b = sub.add_parser("bench", help="run the benchmark scripts (source checkout)")
    b.add_argument("--full", action="store_true", help="full sizes instead of --quick")
    b.add_argument("--only", default=None, help="substring of the script names to run")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        run_demo(args.dataset, args.engines, out=args.out, progress=not args.no_progress,
                 learn_hyperparameters=not args.fixed_hyperparameters)
        return 0
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
