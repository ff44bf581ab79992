"""Fits composed around one engine fit: type-II learning of ``pyro.param`` sites and hyper-latent integration.

:meth:`Engine.run <pyro_convexvb.infer.engine.Engine.run>` hands every run to :func:`run`, which routes it:

* the model reads ``pyro.param`` sites and the engine learns them in an outer loop (``type2 = "outer"`` and
  ``learn_params``): :func:`run_type2`, an L-BFGS-B loop over the params whose every step is one fit
  (:mod:`~pyro_convexvb.infer.type2`);
* the model is outside the latent Gaussian class but is one given a few hyper-latents, and the engine integrates
  over them (``integrates_hyper``): :func:`run_hyper`, one fit per design point
  (:mod:`~pyro_convexvb.infer.hyper`);
* otherwise one fit, :meth:`Engine.run_once <pyro_convexvb.infer.engine.Engine.run_once>`.

The engine itself only extracts, solves and assembles; this module knows nothing of any engine's internals.
"""
import time

from ..errors import UnsupportedModelError, warn
from ..lgm.extract import latent_sites, lgm_from_pyro
from ..lgm.model import LatentGaussianModel
from .hyper import conditioned_model, find_hyper_sites, integrate_hyper
from .result import Criterion, Optimality, RunContext, Solution
from .type2 import maximize_bound, model_params

__all__ = ["run", "hyper_check", "hyper_latents", "type2_params", "run_type2", "run_hyper"]


def run(engine, args, kwargs):
    """Fit ``engine``'s model to ``(*args, **kwargs)``, routed as the module docstring says (inside the run's
    forked random streams, :meth:`Engine.run <pyro_convexvb.infer.engine.Engine.run>`)."""
    t0 = time.perf_counter()
    engine.check_data(args, kwargs)
    names = type2_params(engine, args, kwargs)
    if names:
        if engine.integrates_hyper and _hyper_options_set(engine) and not find_hyper_sites(engine.model, args, kwargs):
            _warn_unused_hyper_options(engine)
        return run_type2(engine, names, args, kwargs, t0)
    _warn_unused_type2_options(engine)
    if not engine.integrates_hyper:
        return engine.run_once(args, kwargs, t0)
    try:
        lgm = engine.extract(*args, **kwargs)
    except UnsupportedModelError:
        # a model outside the class may be a latent Gaussian model given a few hyper-latents
        hyper, err = hyper_check(type(engine), engine.model, args, kwargs)
        if err is not None:  # it is, but not one this engine fits: say why
            raise engine.refusal(err, args, kwargs) from None
        if not hyper:
            raise
    else:
        _warn_unused_hyper_options(engine)
        return engine.run_once(args, kwargs, t0, lgm)
    # outside the handler: an error of the integration is not shown as raised while handling the extraction's
    return run_hyper(engine, hyper, args, kwargs, t0)


#: the options of hyper-latent integration (they have no effect on a model without hyper-latents)
_HYPER_OPTIONS = ("hyper", "hyper_strategy", "hyper_probe")


def _warn_unused_hyper_options(engine):
    """Say that hyper-latent options set away from their defaults have no effect on a model without hyper-latents;
    not for an inner engine (``data_checked``: a design point's fit of the model conditioned on the hyper-latents)."""
    if engine.data_checked:
        return
    o = engine.options
    unused = [f"{k}={getattr(o, k)!r}" for k in _HYPER_OPTIONS if o.is_set(k)]
    if unused:
        warn(f"engine '{engine.name}': option {' and '.join(unused)} has no effect: the model has no hyper-latents "
             "(every latent site is part of its latent Gaussian field); drop the option", UserWarning)


def _hyper_options_set(engine):
    """Whether the caller set a hyper-latent option."""
    return any(engine.options.is_set(k) for k in _HYPER_OPTIONS)


def _warn_unused_type2_options(engine):
    """Say that type-II options set away from their defaults have no effect: on a model without ``pyro.param``
    sites, or with ``learn_params=False`` (not for an inner engine of an integration)."""
    o = engine.options
    if engine.data_checked or engine.type2 != "outer":
        return
    unused = [f"{k}={getattr(o, k)!r}" for k in ("type2_max_iter", "type2_gtol") if hasattr(o, k) and o.is_set(k)]
    if unused:
        why = ("the model has no pyro.param sites to learn" if getattr(o, "learn_params", False)
               else "learn_params=False keeps the params as they are")
        warn(f"engine '{engine.name}': option {' and '.join(unused)} has no effect: {why}; drop the option",
             UserWarning)


def hyper_latents(engine_cls, model, args, kwargs):
    """The hyper-latent sites ``engine_cls`` integrates over for ``model`` (see :mod:`~pyro_convexvb.infer.hyper`),
    or ``[]`` when it does not handle the model that way.

    Non-empty only for engines with ``integrates_hyper`` (engines on a latent Gaussian model), when every
    hyper-latent is continuous, a latent Gaussian field is left, and the model conditioned on the hyper-latents'
    current values is one the engine applies to.
    """
    return hyper_check(engine_cls, model, args, kwargs)[0]


def hyper_check(engine_cls, model, args, kwargs):
    """``(hyper, refusal)``: the hyper-latents ``engine_cls`` integrates over (else ``[]``), and the
    :class:`~pyro_convexvb.UnsupportedModelError` when the model given its hyper-latents is outside the engine's
    class (else ``None``)."""
    if isinstance(model, LatentGaussianModel) or not engine_cls.integrates_hyper:
        return [], None
    try:
        sites = dict(latent_sites(model, args, kwargs))
        hyper = find_hyper_sites(model, args, kwargs)
    except UnsupportedModelError:
        return [], None
    if not hyper or len(hyper) == len(sites):
        return [], None  # nothing to integrate over, or no latent Gaussian field would be left
    if any(getattr(sites[n]["fn"].support, "is_discrete", False) for n in hyper):
        return [], None  # a discrete latent: the extraction's refusal names it
    values = {n: sites[n]["value"].detach() for n in hyper}
    try:
        lgm = lgm_from_pyro(conditioned_model(model, values), *args, **kwargs)
    except UnsupportedModelError as e:
        return [], e
    err = engine_cls.applies(lgm)
    return (hyper, None) if err is None else ([], err)


def type2_params(engine, args, kwargs):
    """The model's ``pyro.param`` sites when ``engine`` learns them in an outer type-II loop, else ``[]``."""
    if engine.type2 != "outer" or not engine.options.learn_params or isinstance(engine.model, LatentGaussianModel):
        return []
    return model_params(engine.model, args, kwargs)


def run_type2(engine, names, args, kwargs, t0):
    """Type-II maximum likelihood over the ``pyro.param`` sites ``names`` (:func:`~.type2.maximize_bound`)."""
    try:
        hyper = hyper_latents(type(engine), engine.model, args, kwargs)
    except UnsupportedModelError:
        hyper = []
    if hyper:
        raise UnsupportedModelError(names[0], f"engine '{engine.name}': the model has pyro.param hyperparameters "
                                              "and hyper-latents; give the params priors (hyper-latents) or pass "
                                              "learn_params=False to keep them fixed")
    run = RunContext(engine.name, engine.progress)
    try:
        o = engine.options
        res, info = maximize_bound(engine, names, args, kwargs, run=run, max_iter=o.type2_max_iter,
                                   gtol=o.type2_gtol)
    finally:
        run.close()
    crit = Criterion("type-II gradient max |dB/dz| over the params", info["grad_norm"], info["gtol"])
    sol = Solution(res.posterior, res.log_evidence_bound, Optimality(res.optimality.criteria + (crit,)),
                   f"type-II over {', '.join(names)}; {res.stop_reason}", dict(res.info, type2=info),
                   state=res.state)
    out = engine.assemble(sol, run, res.lgm, args, kwargs, t0)
    out.hyperparameters = info["learned"]
    return out


#: an integration's mode is also converged when the Newton step to it is below this many posterior sds of the
#: hyper-latents (the design is laid out in those units), whatever the gradient in the unconstrained coordinates
MODE_STEP_SD = 1e-3


def run_hyper(engine, hyper, args, kwargs, t0):
    """Integrate over (or maximise) the hyper-latents ``hyper``; each design point is one fit of ``engine``'s class."""
    o = engine.options
    if engine.init is not None:
        raise ValueError(f"init: engine '{engine.name}' integrates over the hyper-latents "
                         f"{', '.join(repr(n) for n in hyper)}, one fit per design point, each warm-started from the "
                         "nearest point already fitted; a state of one fit cannot start them, so init would be "
                         "ignored; drop init (or fix the hyper-latents with pyro.condition to resume that model)")
    if o.hyper == "map" and o.hyper_strategy != "auto":
        raise ValueError(f"options: hyper='map' keeps only the hyper-latents' mode, so hyper_strategy="
                         f"{o.hyper_strategy!r} (a design to integrate over {', '.join(repr(n) for n in hyper)}) "
                         "would be ignored; drop hyper_strategy, or pass hyper='integrate' to use it")
    if o.hyper == "map" and o.hyper_probe:
        raise ValueError(f"options: hyper='map' keeps only the hyper-latents' mode, so hyper_probe=True (which grows "
                         f"the design to integrate over {', '.join(repr(n) for n in hyper)}) would be ignored; drop "
                         "hyper_probe, or pass hyper='integrate' to use it")
    strategy = "map" if o.hyper == "map" else o.hyper_strategy
    run = RunContext(engine.name, engine.progress)
    try:
        post, mode_res, info = integrate_hyper(engine, hyper, args, kwargs, strategy=strategy, run=run,
                                               probe=o.hyper_probe)
    finally:
        run.close()
    inner = [mode_res] + list(info.get("results", []))
    unconverged = sum(not r.converged for r in inner)
    if "mode_step_sd" in info:  # integrated: the gradient's tolerance, or a Newton step to the mode of 1e-3 sd
        mode = Criterion("hyper-mode gradient max |d log p(theta, y)/dz| over its tolerance, or the Newton step to the "
                         f"mode over {MODE_STEP_SD:g} posterior sd, whichever is smaller",
                         min(info["mode_grad_norm"] / info["mode_gtol"], info["mode_step_sd"] / MODE_STEP_SD), 1.0)
    else:
        mode = Criterion("hyper-mode gradient max |d log p(theta, y)/dz|", info["mode_grad_norm"], info["mode_gtol"])
    crit = (mode, Criterion("design-point fits not converged", float(unconverged), 0.0))
    if info.get("strategy") == "grid":  # a central composite design has no rim
        crit += (Criterion("grid rim within the pruning threshold at the largest radius",
                           float(info.get("truncated", False)), 0.0),)
        if "reach" in info:
            crit += (Criterion("probed prior quantiles within the pruning threshold beyond the grid's largest radius",
                               float(info["reach"].get("unreached", 0)), 0.0),)
    if o.hyper == "map":  # the field's posterior at the mode, theta fixed there
        marg, reason = None, "hyper-latent mode"
    else:
        marg = post.theta_marginals()
        reason = f"hyper-latents integrated ({info['strategy']}, {post.num_points} points)"
    extraction = info["extraction"]
    if extraction.get("structure_changes"):  # the model's structure read the hyper-latents: say where it was re-extracted
        reason += (f"; the model's structure changed with the hyper-latents at {extraction['structure_changes']} "
                   "design points, extracted afresh there")
    hyper_info = {"names": info["space"].names, "mode": info["mode_theta"], "marginals": marg,
                  "log_post_mode": info["log_post_mode"], "evaluations": info["evaluations"],
                  "strategy": "map" if o.hyper == "map" else info["strategy"], "extraction": extraction}
    if "reach" in info:
        hyper_info["reach"] = info["reach"]
    sol = Solution(post, None, Optimality(crit), reason,
                   {"hyper": hyper_info, "mode_result": mode_res, "hyper_details": info})
    res = engine.assemble(sol, run, mode_res.lgm, args, kwargs, t0)
    res.hyper = hyper_info
    return res
