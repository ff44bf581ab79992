"""Pyro's own inference engines as registry baselines: swap them for ours with one word.

``svi_autonormal``, ``svi_automvn``, ``svi_lowrank`` (SVI + Adam with a plateau stopping rule),
``laplace`` (AutoLaplaceApproximation: MAP by L-BFGS, then the Hessian) and ``nuts`` (MCMC).
Each returns a :class:`~pyro_convexvb.GaussianPosterior` over the model's flat (unconstrained)
latent vector. Where the model is a latent Gaussian model, ``log_evidence_bound`` is the exact
variational-Gaussian bound of the engine's Gaussian (Gauss-Hermite site expectations), a real
lower bound on ``log p(y)``; otherwise it is ``None`` and ``info["elbo_estimate"]`` holds Pyro's
stochastic ELBO estimate.
"""
import math
import warnings

import pyro
import pyro.optim
import torch
from pyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from pyro.infer.autoguide import (
    AutoLaplaceApproximation,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)

from ..errors import ConvergenceWarning, UnsupportedModelError
from .posterior import GaussianPosterior
from .registry import register_engine
from .result import History, InferenceResult

__all__ = ["run_svi", "run_laplace", "run_nuts"]


def _progress(iterable, enabled, desc):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, leave=False)


def _exact_bound(model, args, kwargs, posterior):
    """Exact VG bound of ``posterior`` if the model is a latent Gaussian model, else None."""
    from ..lgm.extract import lgm_from_pyro

    try:
        lgm = lgm_from_pyro(model, *args, **kwargs)
    except (UnsupportedModelError, RuntimeError, ValueError, TypeError):
        return None, None
    if lgm.n != posterior.n or lgm.n > 5000:
        return None, lgm
    loc = posterior.loc.detach().to(lgm.dtype)
    cov = posterior.covariance().detach().to(lgm.dtype)
    return float(lgm.evidence_lower_bound(loc, cov)), lgm


def _latent_dtype(model, args, kwargs):
    tr = pyro.poutine.trace(model).get_trace(*args, **kwargs)
    for site in tr.nodes.values():
        if site["type"] == "sample" and not site["is_observed"] and type(site["fn"]).__name__ != "_Subsample":
            return site["value"].dtype
    return torch.get_default_dtype()


def svi_until_plateau(svi, optim, args, kwargs, *, max_steps, min_steps, window, rtol, lr_decay=True,
                      progress=True, desc="SVI", callback=None):
    """Run ``svi.step`` until the windowed mean loss plateaus; shared by every SVI-based engine.

    Every ``window`` steps (after ``min_steps``) the mean loss of the last window is compared with the
    previous one; a decrease below ``rtol * (|mean| + 1)`` first divides the learning rate by 5 (when
    ``lr_decay``) and stops the second time. Warns :class:`ConvergenceWarning` at ``max_steps``.

    :returns: ``(history, losses, converged)``.
    """
    history = History()
    losses, prev, converged, decayed = [], None, False, False
    for step in _progress(range(max_steps), progress, desc):
        loss = svi.step(*args, **kwargs)
        if not math.isfinite(loss):
            lr = [g["lr"] for opt in optim.optim_objs.values() for g in opt.param_groups][:1]
            raise FloatingPointError(f"{desc}: SVI loss became {loss} at step {step}; lower the learning rate "
                                     f"(now {lr[0] if lr else 'n/a'})")
        losses.append(loss)
        if callback is not None:
            callback(step, loss)
        if (step + 1) % window == 0:
            cur = sum(losses[-window:]) / window
            history.record(objective=-cur, step=step + 1)
            if prev is not None and step + 1 >= min_steps and prev - cur < rtol * (abs(cur) + 1):
                if lr_decay and not decayed:
                    decayed = True
                    for opt in optim.optim_objs.values():
                        for g in opt.param_groups:
                            g["lr"] *= 0.2
                else:
                    converged = True
                    break
            prev = cur
    if not converged:
        warnings.warn(f"{desc}: SVI did not plateau within {max_steps} steps", ConvergenceWarning)
    return history, losses, converged


def run_svi(model, args, kwargs, guide_cls, *, lr=0.02, max_steps=20000, min_steps=500, window=250, rtol=2e-4,
            num_particles=1, vectorize_particles=False, rank=None, init_scale=0.1, seed=0, progress=True,
            lr_decay=True):
    """SVI with Adam on a Pyro autoguide, stopped when the windowed mean loss plateaus.

    Stopping rule: after ``min_steps``, every ``window`` steps compare the mean loss of the last window
    with the previous one; stop when the decrease is below ``rtol * (|mean| + 1)`` (per window,
    and the learning rate is then divided by 5 once before stopping for good when ``lr_decay``).

    :returns: :class:`InferenceResult` with a dense :class:`GaussianPosterior`.
    """
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    if guide_cls is AutoLowRankMultivariateNormal:
        guide = guide_cls(model, rank=rank, init_scale=init_scale)
    else:
        guide = guide_cls(model, init_scale=init_scale)
    optim = pyro.optim.ClippedAdam({"lr": lr, "betas": (0.9, 0.999), "clip_norm": 100.0})
    svi = SVI(model, guide, optim, Trace_ELBO(num_particles=num_particles, vectorize_particles=vectorize_particles))
    history, losses, converged = svi_until_plateau(
        svi, optim, args, kwargs, max_steps=max_steps, min_steps=min_steps, window=window, rtol=rtol,
        lr_decay=lr_decay, progress=progress, desc=guide_cls.__name__)
    with torch.no_grad():
        if isinstance(guide, AutoNormal):
            locs, scales = [], []
            for name, site in guide.prototype_trace.iter_stochastic_nodes():
                loc, scale = guide._get_loc_and_scale(name)
                locs.append(loc.reshape(-1))
                scales.append(scale.reshape(-1))
            loc = torch.cat(locs).detach().clone()
            posterior = GaussianPosterior(loc, torch.cat(scales).detach() ** 2)
        else:
            q = guide.get_posterior()
            posterior = GaussianPosterior(q.loc.detach().clone(), covariance=q.covariance_matrix.detach().clone())
    bound, lgm = _exact_bound(model, args, kwargs, posterior)
    info = {"elbo_estimate": -sum(losses[-window:]) / min(window, len(losses)), "steps": len(losses), "guide": guide}
    return InferenceResult(posterior, bound, history, converged, info=info, lgm=lgm)


def run_laplace(model, args, kwargs, *, max_iter=500, tol=1e-9, seed=0, progress=True):
    """MAP by L-BFGS (strong Wolfe) on Pyro's ``AutoLaplaceApproximation``, then its Laplace Gaussian."""
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    guide = AutoLaplaceApproximation(model)
    elbo = Trace_ELBO()
    elbo.differentiable_loss(model, guide, *args, **kwargs)  # create the parameters
    params = [p.unconstrained() for p in pyro.get_param_store().values()]
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=max_iter, tolerance_grad=tol, tolerance_change=tol * 1e-3,
                            history_size=50, line_search_fn="strong_wolfe")
    history = History()

    def closure():
        opt.zero_grad()
        loss = elbo.differentiable_loss(model, guide, *args, **kwargs)
        loss.backward()
        history.record(objective=-float(loss.detach()))
        return loss

    opt.step(closure)
    grad_norm = max(float(p.grad.abs().max()) for p in params)
    converged = grad_norm < 1e-5 * (1 + abs(history["objective"][-1]))
    if not converged:
        warnings.warn(f"laplace: L-BFGS stopped with gradient norm {grad_norm:.3g}", ConvergenceWarning)
    lap = guide.laplace_approximation(*args, **kwargs)
    q = lap.get_posterior()
    posterior = GaussianPosterior(q.loc.detach().clone(), covariance=q.covariance_matrix.detach().clone())
    bound, lgm = _exact_bound(model, args, kwargs, posterior)
    return InferenceResult(posterior, bound, history, converged, info={"map_grad_norm": grad_norm}, lgm=lgm)


def run_nuts(model, args, kwargs, *, num_samples=500, warmup_steps=300, seed=0, progress=True, max_rhat=1.05,
             target_accept_prob=0.8, max_tree_depth=8):
    """NUTS; the posterior is the Gaussian with the samples' mean and covariance, samples in ``info``."""
    pyro.set_rng_seed(seed)
    kernel = NUTS(model, target_accept_prob=target_accept_prob, max_tree_depth=max_tree_depth)
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=not progress)
    mcmc.run(*args, **kwargs)
    samples = mcmc.get_samples()
    tr = pyro.poutine.trace(model).get_trace(*args, **kwargs)
    names = [n for n, s in tr.nodes.items() if s["type"] == "sample" and not s["is_observed"]
             and type(s["fn"]).__name__ != "_Subsample"]
    flat = torch.cat([samples[n].reshape(num_samples, -1) for n in names], -1)
    loc = flat.mean(0)
    cov = torch.cov(flat.T).reshape(flat.shape[1], flat.shape[1])
    cov = cov + 1e-10 * torch.eye(cov.shape[0], dtype=cov.dtype) * cov.diagonal().mean()
    diag = mcmc.diagnostics()
    rhat = max(float(torch.as_tensor(diag[n]["r_hat"]).max()) for n in names)
    ess = min(float(torch.as_tensor(diag[n]["n_eff"]).min()) for n in names)
    converged = math.isfinite(rhat) and rhat < max_rhat
    if not converged:
        warnings.warn(f"nuts: max split r_hat = {rhat:.3f} >= {max_rhat}", ConvergenceWarning)
    history = History()
    history.record(objective=float("nan"))
    posterior = GaussianPosterior(loc, covariance=cov)
    info = {"samples": samples, "r_hat": rhat, "min_ess": ess}
    return InferenceResult(posterior, None, history, converged, info=info)


@register_engine("svi_autonormal", "Pyro SVI + AutoNormal (mean-field Gaussian), Adam until the ELBO plateaus",
                 takes="model")
def svi_autonormal(model, args, kwargs, progress=True, **options):
    return run_svi(model, args, kwargs, AutoNormal, progress=progress, **options)


@register_engine("svi_automvn", "Pyro SVI + AutoMultivariateNormal (full-rank Gaussian), Adam until the ELBO plateaus",
                 takes="model")
def svi_automvn(model, args, kwargs, progress=True, **options):
    return run_svi(model, args, kwargs, AutoMultivariateNormal, progress=progress, **options)


@register_engine("svi_lowrank", "Pyro SVI + AutoLowRankMultivariateNormal, Adam until the ELBO plateaus",
                 takes="model")
def svi_lowrank(model, args, kwargs, progress=True, **options):
    return run_svi(model, args, kwargs, AutoLowRankMultivariateNormal, progress=progress, **options)


@register_engine("laplace", "Pyro AutoLaplaceApproximation: MAP by L-BFGS, Gaussian from the Hessian", takes="model")
def laplace(model, args, kwargs, progress=True, **options):
    return run_laplace(model, args, kwargs, progress=progress, **options)


@register_engine("nuts", "Pyro NUTS (MCMC); Gaussian summary of the samples, no evidence bound", takes="model")
def nuts(model, args, kwargs, progress=True, **options):
    return run_nuts(model, args, kwargs, progress=progress, **options)
