r"""Pyro's own inference engines as registry baselines: swap them for ours with one word.

``svi_autonormal``, ``svi_automvn``, ``svi_lowrank`` (SVI with clipped Adam until the windowed ELBO
plateaus), ``laplace`` (``AutoLaplaceApproximation``: MAP by Newton steps or L-BFGS, then the Hessian) and ``nuts``
(MCMC). Every posterior is a :class:`~pyro_convexvb.GaussianPosterior` over the model's flat latent
vector in Pyro's unconstrained coordinates (the space of every other engine and of
:class:`~pyro.infer.autoguide.AutoContinuous` guides), so a ``HalfCauchy`` scale is summarised by
the Gaussian of its logarithm.

Evidence bounds: where the model is a latent Gaussian model, ``log_evidence_bound`` is the exact
variational-Gaussian bound of the engine's Gaussian (Gauss-Hermite site expectations), a real lower
bound on ``log p(y)``; otherwise ``None``, and ``info["elbo_estimate"]`` holds Pyro's stochastic
ELBO estimate.

Optimality measures (``converged``): SVI engines, the natural-gradient decrement of the evidence
bound (:mod:`~pyro_convexvb.infer.optimality`; exact bound for latent Gaussian models, a Monte Carlo
estimate otherwise); ``laplace``, the largest gradient entry of the log joint at the mode;
``nuts``, the largest split R-hat over all latent coordinates and the smallest effective sample size
(both must pass: a few draws can have a small R-hat by chance).

Engines that fit all data at once (``laplace``, ``nuts``) run the model with every subsampled
``pyro.plate`` at full size; the SVI engines keep Pyro's mini-batches (that is what SVI is for).
"""
import contextlib
import itertools
import math
import re
import typing
import warnings
from dataclasses import dataclass

import numpy as np
import pyro
import pyro.optim
import pyro.poutine as poutine
import torch
from pyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from pyro.infer.autoguide import (
    AutoLaplaceApproximation,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from torch.distributions import biject_to

from ..errors import ApproximationWarning, UnsupportedModelError, warn
from ..linalg.operators import DENSE_LIMIT
from ..lgm.extract import _unwrap, full_data_plates, latent_sites, real_support
from .engine import ModelEngine
from .options import EngineOptions, Type2Options, option
from .optimality import gaussian_decrement, monte_carlo_objective
from .result import Criterion, Optimality, Solution
from .rng import forked_rng
from ..posterior.gaussian import GaussianPosterior, _apply_name_prefix
from ..distributed import enter_local, find_comm, rank, sum_over_ranks
from .sharded_svi import (ShardedTraceELBO, check_full_plates, check_sharded_rows, local_args, local_log_prob,
                          reshard_lgm)

__all__ = [
    "SVIOptions",
    "SVILowRankOptions",
    "LaplaceOptions",
    "LaplaceState",
    "NUTSOptions",
    "SVIEngine",
    "SVIAutoNormal",
    "SVIAutoMultivariateNormal",
    "SVILowRank",
    "LaplaceEngine",
    "NUTSEngine",
    "svi_until_plateau",
    "newton_map",
    "latent_sites",
    "flat_log_joint",
    "try_lgm",
    "variational_optimality",
]

#: default and documentation of the engines' ``seed`` option (see the "Random numbers" rule in docs/engines.md)
SEED_DOC = (None, "random seed; None: drawn from the global torch RNG (pyro.set_rng_seed), which is never reset")

#: largest latent dimension for which the exact bound and the decrement use a dense covariance.
EXACT_BOUND_MAX = DENSE_LIMIT


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------

def flat_log_joint(model, args, kwargs, reduction=None):
    """``log_joint(U)``: log density of the model at flat unconstrained points ``U`` ``(s, n)`` -> ``(s,)``.

    Latent sites are packed in trace order (as :class:`~pyro.infer.autoguide.AutoContinuous`
    does), mapped to their supports by ``biject_to`` with the log-Jacobian added, and every
    subsampled plate runs at full size. Differentiable in ``U``.

    With ``reduction`` (row-sharded data: the data's communicator, :func:`~pyro_convexvb.distributed.find_comm`)
    the replicated ``U`` enters each rank's model run through :func:`~pyro_convexvb.distributed.enter_local`, and
    the observed sites of all ranks plus the latent sites and log-Jacobians counted once (on rank 0) are summed
    by :func:`~pyro_convexvb.distributed.sum_over_ranks`: value and gradient are those of the full-data log
    joint.

    :returns: ``(log_joint, n)``.
    """
    sites = latent_sites(model, args, kwargs)
    parts = []
    for name, site in sites:
        t = biject_to(site["fn"].support)
        shape = t.inv(site["value"]).shape
        parts.append((name, t, shape, int(math.prod(shape))))
    n = sum(p[3] for p in parts)
    sharded = reduction is not None
    if sharded:
        first = rank() == 0
        args, kwargs = local_args(args, kwargs)

    def log_joint(U):
        out = []
        if sharded:
            U = enter_local(U)  # one collective in the backward, whatever the order autograd takes
        for u in U:
            vals, ld, start = {}, u.new_zeros(()), 0
            for name, t, shape, size in parts:
                x = u[start:start + size].reshape(shape)
                start += size
                v = t(x)
                ld = ld + t.log_abs_det_jacobian(x, v).sum()
                vals[name] = v
            with full_data_plates():
                tr = poutine.trace(poutine.condition(model, data=vals)).get_trace(*args, **kwargs)
            if sharded:
                tr.compute_log_prob()
                out.append(u.new_zeros(()) + local_log_prob(tr, first, vals) + (ld if first else 0.0))
                continue
            out.append(tr.log_prob_sum() + ld)
        return sum_over_ranks(torch.stack(out)) if sharded else torch.stack(out)

    return log_joint, n


def try_lgm(model, args, kwargs):
    """The model's :class:`~pyro_convexvb.LatentGaussianModel`, or ``None`` when it is not one."""
    from ..lgm.extract import lgm_from_pyro

    try:
        return lgm_from_pyro(model, *args, **kwargs)
    except (UnsupportedModelError, RuntimeError, ValueError, TypeError):
        return None


def variational_optimality(call, posterior, lgm, *, tol, check_particles=64, seed=0, reduction=None):
    """Bound and natural-gradient decrement of a Gaussian ``posterior`` of ``call.model``.

    Exact variational-Gaussian bound when ``lgm`` (the model's latent Gaussian model) is given and
    small enough for dense covariances, else a Monte Carlo estimate with ``check_particles`` fixed
    draws (its decrement is biased upwards by Monte Carlo noise; no bound is reported then).

    :returns: ``(bound or None, Optimality)``.
    """
    loc = posterior.loc.detach()
    # not where the model's sites map onto the LGM's latents through imputed sites or a constraint: the marginal's
    # bound below
    exact = lgm is not None and lgm.model_layout.size == posterior.n and posterior.n <= EXACT_BOUND_MAX \
        and lgm.model_exact  # (imputed blocks: the joint bound over u and them, in closed form)
    if exact:
        def objective(m, S):
            m = m.to(lgm.dtype)
            S = S.to(lgm.dtype)
            # the posterior is over the model's sites x (an affine chain's LGM is over its innovations u)
            if S.dim() == 1:
                return lgm.model_evidence_lower_bound(m, variance=S)
            return lgm.model_evidence_lower_bound(m, S)
        name = "natural-gradient decrement of the exact evidence bound (nats)"
    else:
        log_joint, n = flat_log_joint(call.model, call.args, call.kwargs, reduction)
        if n != posterior.n:
            raise ValueError(f"the model has {n} unconstrained latent dimensions, the posterior {posterior.n}")
        objective = monte_carlo_objective(log_joint, n, check_particles, loc.dtype, loc.device, seed)
        name = f"natural-gradient decrement of a {check_particles}-draw Monte Carlo ELBO (nats)"
    if lgm is not None and (getattr(lgm, "imputed", None) or getattr(lgm, "chain", None) is not None) \
            and posterior.n == lgm.model_layout.size:
        # latent sites integrated out of the LGM (obs_mask): the bound of the marginal over u
        with torch.no_grad():
            q = lgm.latent_marginal(posterior)
            marginal_bound = float(lgm.evidence_lower_bound(q.loc.to(lgm.dtype), q.covariance().to(lgm.dtype)))
    else:
        marginal_bound = None
    if posterior.kind == "diagonal":
        dec, value = gaussian_decrement(objective, loc, variance=posterior.variance)
    elif posterior.kind == "low_rank_diagonal":
        dec, value = gaussian_decrement(objective, loc, cov_factor=posterior.cov_factor, cov_diag=posterior.cov_diag)
    else:
        dec, value = gaussian_decrement(objective, loc, covariance=posterior.covariance())
    # where latents are integrated out, the marginal's bound is the larger valid one (the joint's minus the expected
    # KL of the imputed sites' conditionals)
    return (marginal_bound if marginal_bound is not None else value if exact else None), \
        Optimality.single(name, dec, tol)


def svi_until_plateau(svi, optim, args, kwargs, *, max_steps, min_steps, window, rtol, lr_decay, bar, history,
                      callback=None, name="SVI", cuts=1):
    """Run ``svi.step`` until the windowed mean loss plateaus; shared by every SVI-based engine.

    Every ``window`` steps (after ``min_steps``) the mean loss of the last window is compared with the
    previous one; a decrease below ``rtol * (|mean| + 1)`` divides the learning rate by 5 (when ``lr_decay``, the
    first ``cuts`` times) and stops the fit the next time. This is a *stopping* rule, not an optimality test: the
    engines judge convergence by the natural-gradient decrement afterwards.

    :returns: ``(losses, stop_reason)`` with ``stop_reason`` ``"plateau"`` or ``"max_steps"``.
    """
    losses, prev, decays = [], None, 0
    for step in range(max_steps):
        loss = svi.step(*args, **kwargs)
        if not math.isfinite(loss):
            lr = [g["lr"] for opt in optim.optim_objs.values() for g in opt.param_groups][:1]
            raise FloatingPointError(f"{name}: the SVI loss became {loss} at step {step}; lower the learning rate "
                                     f"(now {lr[0] if lr else 'n/a'})")
        losses.append(loss)
        bar.update(1)
        if callback is not None:
            callback(step, loss)
        if (step + 1) % window == 0:
            cur = sum(losses[-window:]) / window
            history.record(objective=-cur, step=step + 1)
            bar.set_postfix(elbo=f"{-cur:.6g}")
            if prev is not None and step + 1 >= min_steps and prev - cur < rtol * (abs(cur) + 1):
                if lr_decay and decays < cuts:
                    decays += 1
                    for opt in optim.optim_objs.values():
                        for g in opt.param_groups:
                            g["lr"] *= 0.2
                else:
                    return losses, "plateau"
            prev = cur
    return losses, "max_steps"


def model_param_values(call):
    """``{name: value}`` of the model's ``pyro.param`` sites (``None`` when it has none)."""
    from .type2 import model_params

    names = model_params(call.model, call.args, call.kwargs)
    return {n: pyro.param(n).detach().clone() for n in names} or None


def forget_params(prefix):
    """Remove the param-store entries of a guide named ``prefix`` (an earlier fit's), leaving others alone (the
    numbered guides results keep, ``"<prefix>.<k>.*"``, included)."""
    store = pyro.get_param_store()
    kept = re.compile(re.escape(prefix) + r"\.\d+\.")
    for key in [k for k in store.keys() if (k == prefix or k.startswith(prefix + ".")) and not kept.match(k)]:
        del store[key]


#: numbers of the guides results keep (:meth:`_PyroModelEngine.own_guide`)
_KEPT_GUIDES = itertools.count(1)


# ---------------------------------------------------------------------------------------------
# SVI engines
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SVIOptions(EngineOptions):
    lr: float = option(0.02, "Adam learning rate (clipped Adam)", gt=0)
    max_steps: int = option(20000, "SVI step cap", min=1)
    min_steps: int = option(500, "no plateau stop before this many steps (left at the default: at most max_steps)",
                           min=0)
    window: int = option(250, "steps per window of the plateau rule", min=1)
    rtol: float = option(2e-4, "plateau: windowed mean loss decreased by less than rtol (|mean| + 1)", min=0)
    lr_decay: bool = option(True, "divide the learning rate by 5 at a plateau instead of stopping (lr_cuts times)")
    lr_cuts: int = option(1, "with lr_decay: plateaus met by a cut of the learning rate before one stops the fit",
                          min=1)
    num_particles: int = option(1, "particles per ELBO estimate", min=1)
    vectorize_particles: bool = option(False, "vectorise the particles over a plate")
    init_scale: float = option(0.1, "initial posterior scale of the guide", gt=0)
    clip_norm: float = option(100.0, "gradient clipping norm of clipped Adam", gt=0)
    seed: typing.Optional[int] = option(SEED_DOC[0], SEED_DOC[1], min=0)
    decrement_tol: float = option(1e-2, "convergence: natural-gradient decrement of the evidence bound (nats)", gt=0)
    learn_params: bool = option(True, "optimise the model's pyro.param sites jointly with the guide (Pyro's SVI)")
    check_particles: int = option(64, "Monte Carlo draws of the decrement for models that are not LGMs", min=1)

    def check(self):
        if self.lr_cuts != 1 and not self.lr_decay:
            raise ValueError(f"option 'lr_cuts' ({self.lr_cuts}) counts the cuts of lr_decay=True; with "
                             "lr_decay=False the first plateau stops the fit")
        # left at its default, min_steps is capped at max_steps (max_steps alone budgets a fit); set explicitly
        # above max_steps it is an error
        if self.min_steps > self.max_steps and self.is_set("min_steps"):
            raise ValueError(f"option 'min_steps' ({self.min_steps}) exceeds 'max_steps' ({self.max_steps})")

    @property
    def plateau_min_steps(self):
        """``min_steps`` as the plateau rule uses it: an unset (default) ``min_steps`` capped at ``max_steps``."""
        return min(self.min_steps, self.max_steps)


@dataclass(frozen=True)
class SVILowRankOptions(SVIOptions):
    rank: typing.Optional[int] = option(None, "rank of the covariance factor (default: Pyro's sqrt(n))", min=1)


class _PyroModelEngine(ModelEngine):
    """Pyro's engines on the Pyro model itself: continuous latents, and observations valid for their
    likelihood as the latent Gaussian extraction checks them (Pyro's NUTS would accept Bernoulli labels 2 or -1);
    their guides' parameters live under a private prefix of Pyro's param store."""

    @property
    def param_prefix(self):
        """Prefix of the engine's own guide parameters in Pyro's param store (``"_pyro_convexvb.<engine>"``):
        private, so a fit never touches the user's entries (e.g. their own ``"AutoMultivariateNormal.loc"``)."""
        return f"_pyro_convexvb.{self.name}"

    def own_guide(self, guide, keep=False):
        """Give ``guide`` the engine's private parameter names. A guide the result hands out (``keep``:
        ``info["guide"]``) gets names of its own, ``"<param_prefix>.<k>"`` with ``k`` numbering this process's
        fits, so a later fit never rewrites an earlier result's guide; a working guide reuses the engine's names,
        an earlier fit's entries under them dropped."""
        if keep:
            _apply_name_prefix(guide, f"{self.param_prefix}.{next(_KEPT_GUIDES)}")
            return guide
        _apply_name_prefix(guide, self.param_prefix)
        forget_params(self.param_prefix)
        return guide


class SVIEngine(_PyroModelEngine):
    """Pyro SVI on an autoguide (subclasses set ``guide_cls``), then an honest optimality check.

    On row-sharded data (:func:`pyro_convexvb.distributed.row_sharded` under a process group) every rank
    draws the same particle, runs the model on its own rows, and the parameter gradients and the loss are
    all-reduced as in ``DistributedDataParallel`` (:class:`~.sharded_svi.ShardedTraceELBO`; observed sites
    counted on every rank, latent sites and the guide on rank 0): the fit equals the single-process fit on
    all rows up to the order of floating-point additions. Subsampled plates are refused there.
    """

    Options = SVIOptions
    guide_cls = None
    optimality_measure = ("natural-gradient decrement of the evidence bound <= decrement_tol (exact bound for latent "
                          "Gaussian models, Monte Carlo otherwise); stops at an ELBO plateau or max_steps")

    distributed = True  # row-sharded data: gradients all-reduced (sharded_svi)

    def make_guide(self, model):
        return self.guide_cls(model, init_scale=self.options.init_scale)

    type2 = "joint"

    def model_and_guide(self, call):
        """The model SVI trains (its ``pyro.param`` sites hidden unless ``learn_params``) and the engine's own
        guide for it (:meth:`make_guide`, with the engine's private parameter names)."""
        model = call.model if self.options.learn_params else poutine.block(call.model, hide_types=["param"])
        return model, self.own_guide(self.make_guide(model), keep=True)

    def run_svi(self, model, guide, loss, call, run, *, callback=None, name=None):
        """Clipped-Adam SVI on ``loss`` until the ELBO plateaus or ``max_steps`` (:func:`svi_until_plateau`).

        :returns: ``(losses, stop reason, mean ELBO of the last window)``.
        """
        o = self.options
        optim = pyro.optim.ClippedAdam({"lr": o.lr, "betas": (0.9, 0.999), "clip_norm": o.clip_norm})
        losses, reason = svi_until_plateau(SVI(model, guide, optim, loss), optim, call.args, call.kwargs,
                                           max_steps=o.max_steps, min_steps=o.plateau_min_steps, window=o.window,
                                           rtol=o.rtol, lr_decay=o.lr_decay, bar=run.bar(total=o.max_steps, unit="step"),
                                           history=run.history, callback=callback, name=name or self.name,
                                           cuts=o.lr_cuts)
        return losses, reason, -sum(losses[-o.window:]) / min(o.window, len(losses))

    def solve(self, call, run):
        o = self.options
        model, guide = self.model_and_guide(call)
        red = find_comm(call.args, call.kwargs)
        if red is None:
            elbo = Trace_ELBO(num_particles=o.num_particles, vectorize_particles=o.vectorize_particles)
        else:  # row-sharded data: local surrogate, gradients all-reduced (see sharded_svi)
            elbo = ShardedTraceELBO(red, num_particles=o.num_particles, vectorize_particles=o.vectorize_particles)
        try:
            losses, reason, elbo_estimate = self.run_svi(model, guide, elbo, call, run)
        except (RuntimeError, ValueError, IndexError) as e:
            if o.vectorize_particles and o.num_particles > 1:
                _blame_particle_plate(model, guide, call, e)
            raise
        posterior = self.posterior_of(guide)
        lgm = reshard_lgm(try_lgm(call.source, call.args, call.kwargs), call.args, call.kwargs)
        with torch.enable_grad():
            bound, opt = variational_optimality(call, posterior, lgm, tol=o.decrement_tol,
                                                check_particles=o.check_particles, seed=self.run_seed, reduction=red)
        info = {"elbo_estimate": elbo_estimate, "steps": len(losses), "guide": guide, "hyperparameters": model_param_values(call)}
        return Solution(posterior, bound, opt, reason, info, lgm=lgm)

    @staticmethod
    def posterior_of(guide):
        with torch.no_grad():
            if isinstance(guide, AutoNormal):
                locs, scales = [], []
                for name, _ in guide.prototype_trace.iter_stochastic_nodes():
                    loc, scale = guide._get_loc_and_scale(name)
                    locs.append(loc.reshape(-1))
                    scales.append(scale.reshape(-1))
                return GaussianPosterior(torch.cat(locs).clone(), torch.cat(scales) ** 2)
            q = guide.get_posterior()
            if isinstance(guide, AutoLowRankMultivariateNormal):
                return GaussianPosterior(q.loc.clone(), cov_factor=q.cov_factor.clone(), cov_diag=q.cov_diag.clone())
            return GaussianPosterior(q.loc.clone(), scale_tril=q.scale_tril.clone())


def _blame_particle_plate(model, guide, call, error):
    """The model failed under ``vectorize_particles=True``: when one unvectorised ELBO evaluation runs, the failure
    is the particle plate's, and a ``ValueError`` says so (the model's own error chained); else the caller re-raises
    the model's error."""
    try:
        with torch.no_grad(), poutine.block():
            Trace_ELBO().loss(model, guide, *call.args, **call.kwargs)
    except Exception:  # noqa: BLE001 - the model fails without the particle plate too: its own error stands
        return
    raise ValueError(
        f"option vectorize_particles=True: the model runs with one particle but fails inside Pyro's particle plate "
        f"({type(error).__name__}: {str(error).splitlines()[0][:200]}), so it does not broadcast over a leading "
        "particle dimension (e.g. a global vector latent of shape (P, 1, D) in 'X @ w'); use "
        "vectorize_particles=False, or write the predictor with pcv.linear(X, w)") from error


class SVIAutoNormal(SVIEngine):
    name = "svi_autonormal"
    description = "Pyro SVI + AutoNormal (mean-field Gaussian), Adam until the ELBO plateaus"
    guide_cls = AutoNormal


class SVIAutoMultivariateNormal(SVIEngine):
    name = "svi_automvn"
    mini_batched_locals = False  # one dense covariance over every latent
    description = "Pyro SVI + AutoMultivariateNormal (full-rank Gaussian), Adam until the ELBO plateaus"
    guide_cls = AutoMultivariateNormal


class SVILowRank(SVIEngine):
    name = "svi_lowrank"
    mini_batched_locals = False  # one low-rank covariance over every latent
    description = "Pyro SVI + AutoLowRankMultivariateNormal, Adam until the ELBO plateaus"
    guide_cls = AutoLowRankMultivariateNormal
    Options = SVILowRankOptions

    def make_guide(self, model):
        return AutoLowRankMultivariateNormal(model, rank=self.options.rank, init_scale=self.options.init_scale)


# ---------------------------------------------------------------------------------------------
# Laplace
# ---------------------------------------------------------------------------------------------
#: largest latent dimension for which ``method='auto'`` finds the mode by Newton steps (each forms the dense
#: ``n x n`` Hessian, ``n`` backward passes); above it, L-BFGS (the Hessian is then formed once, at the mode)
NEWTON_AUTO_MAX = 1000
#: :func:`newton_map`: damped retries of a step whose line search failed, and steps in a row found only by them,
#: before it stops with ``"no progress"`` (a loss that is not smooth at the mode, e.g. a Laplace likelihood's kinks,
#: otherwise makes it crawl: 500 steps of 500 loss evaluations each on 30 rows)
NEWTON_RETRIES = 3
#: a damped step lowering the loss by more than this share of ``1 + |loss|`` does not count towards that stop (from
#: a saturated start, 9 of 10 logistic fits with an intercept prior of scale 1e6 stopped far from their optimum)
STRUGGLE_SHARE = 1e-3
#: Hessian rows formed by one batched backward pass (:func:`loss_hessian`)
HESSIAN_BATCH = 64


@dataclass(frozen=True)
class LaplaceState:
    """The mode ``loc`` (the flat latent vector in Pyro's unconstrained coordinates) of a ``laplace`` fit;
    ``init=`` starts the next mode search there (type-II refits at nearby params are warm-started from it)."""

    engine: typing.ClassVar[str] = "laplace"
    #: options the state replaces (none: the start point has no option of its own)
    options: typing.ClassVar[tuple] = ()

    loc: torch.Tensor

    def warm_start(self):
        return self


@dataclass
class NewtonResult:
    """Outcome of :func:`newton_map` (the fields of :class:`~pyro_convexvb.linalg.lbfgs.LBFGSResult`, and the
    Hessian at the returned point)."""

    value: float
    grad_norm: float
    evaluations: int
    stop_reason: str
    iterations: int
    hessian: torch.Tensor


def loss_hessian(loss_fn, x, batched=True):
    """``(loss, gradient, Hessian)`` of ``loss_fn()`` in the leaf tensor ``x`` (1-D) by autograd: the Hessian's
    rows by batched backward passes (``is_grads_batched``, :data:`HESSIAN_BATCH` rows each) when ``batched`` and
    the model's operations allow it, else one backward pass per row (what Pyro's ``AutoLaplaceApproximation``
    does). Symmetrised."""
    loss = loss_fn()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    n = x.shape[0]
    if not g.requires_grad:  # the loss is linear in x
        return loss.detach(), g.detach(), x.new_zeros(n, n)
    H = None
    if batched:
        eye = torch.eye(n, dtype=x.dtype, device=x.device)
        try:  # HESSIAN_BATCH rows per backward pass: the batched pass holds that many copies of the graph's buffers
            H = torch.cat([torch.autograd.grad(g, x, grad_outputs=eye[i:i + HESSIAN_BATCH], retain_graph=True,
                                               is_grads_batched=True, allow_unused=True)[0]
                           for i in range(0, n, HESSIAN_BATCH)])
        except (RuntimeError, NotImplementedError, TypeError):  # an operation without a batching rule
            H = None
    if H is None:
        rows = [torch.autograd.grad(g[i], x, retain_graph=True, allow_unused=True)[0] for i in range(n)]
        H = torch.stack([x.new_zeros(n) if r is None else r for r in rows])
    return loss.detach(), g.detach(), (0.5 * (H + H.transpose(0, 1))).detach()


def newton_map(x, loss_fn, *, max_iter, grad_tol, history=None, bar=None, batched=True, name="Newton"):
    r"""Minimise ``loss_fn()`` over the 1-D leaf tensor ``x`` (updated in place) by a safeguarded Newton method.

    Over 80 lines: most of it is this docstring; the body is under 80.

    Each step solves ``(H + lam I) d = -g`` with the autograd Hessian ``H``: ``lam = 0`` when ``H`` is positive
    definite (the plain Newton step; for a latent Gaussian model with a log-concave likelihood it is the step of
    Rasmussen & Williams 2006, §3.4.1, Eq. 3.18), else the smallest of ``tau, 10 tau, 100 tau, ...`` (``tau``
    a ``1e-8`` share of the largest diagonal entry) that makes it so (Nocedal & Wright 2006, §3.4, Algorithm 3.3).
    A backtracking line search (Armijo, halving the step) makes every step descend; when it fails, ``lam`` grows
    to ``max(1e3 tau, 100 lam)`` and the step is tried again, at most :data:`NEWTON_RETRIES` times, so a
    non-convex loss still descends.

    Stops (``"gradient"``) when ``max |g| / (1 + |loss|) <= grad_tol`` and the next undamped Newton step is below
    ``1e3`` machine epsilons of ``1 + max |x|`` or no longer shrinks fourfold (rounding): the steps past the test,
    at most three, make the mode exact to rounding by quadratic convergence, which the finite differences of
    refits in a type-II loop need. Also stops when no step lowers the loss any more (``"gradient"`` if the test
    holds there, else ``"no progress"``; also after more than :data:`NEWTON_RETRIES` steps in a row found only by
    those retries that lower the loss by less than :data:`STRUGGLE_SHARE` of it, the sign of a loss that is not smooth
    there), or after ``max_iter`` steps (``"max_iter"``).

    :returns: :class:`NewtonResult` (the Hessian at the returned point included).
    """
    evals = [0]

    def value_at(point):  # a trial point of the line search: a non-finite loss there only shortens the step
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Encountered (NaN|[+-]?inf)")  # Pyro's warn_if_nan/warn_if_inf
            saved = x.detach().clone()
            x.copy_(point)
            try:
                v = float(loss_fn().detach())
            except ValueError:  # a distribution's argument check refused the point (e.g. an overflowed rate)
                v = math.inf
            finally:
                x.copy_(saved)
        evals[0] += 1
        return v

    reason, it, polished, last, struggling = "max_iter", 0, 0, math.inf, 0
    eps = torch.finfo(x.dtype).eps
    loss, g, H = loss_hessian(loss_fn, x, batched)
    evals[0] += 1
    while True:
        value = float(loss)
        if not math.isfinite(value) or not bool(torch.isfinite(g).all()):
            where = ("at the starting point: the model's log joint is not finite there (check the parameters of its "
                     "distributions, e.g. a non-finite loc or scale)" if it == 0 else f"after {it} steps")
            raise FloatingPointError(f"{name}: the loss or its gradient became {value} {where}")
        rel = float(g.abs().max()) / (1.0 + abs(value)) if g.numel() else 0.0
        if history is not None:
            history.record(objective=-value, grad_norm=float(g.abs().max()) if g.numel() else 0.0)
        if bar is not None:
            bar.update(1)
        if it >= max_iter:
            reason = "gradient" if rel <= grad_tol else "max_iter"
            break
        step_tol = 1e3 * eps * (1.0 + (float(x.detach().abs().max()) if x.numel() else 0.0))
        diag = H.diagonal().abs().max() if H.numel() else H.new_zeros(())
        tau = 1e-8 * float(diag) if float(diag) > 0 else 1e-8
        lam, step, accepted, retries = 0.0, None, False, 0
        for _ in range(40):  # damping: lam = 0, tau, 10 tau, ... until a descent step is found
            L, info = torch.linalg.cholesky_ex(H + lam * torch.eye(H.shape[0], dtype=H.dtype, device=H.device))
            if int(info) != 0:
                lam = tau if lam == 0.0 else 10.0 * lam
                continue
            d = -torch.cholesky_solve(g.unsqueeze(-1), L).squeeze(-1)
            dec = -float(g @ d)
            dmax = float(d.abs().max()) if d.numel() else 0.0
            if rel <= grad_tol and (polished >= 3 or lam == 0.0 and (dmax <= step_tol or dmax > 0.25 * last)):
                reason = "gradient"
                break
            t = 1.0
            for _ in range(30):  # Armijo backtracking
                trial = value_at(x.detach() + t * d)
                if math.isfinite(trial) and trial <= value - 1e-4 * t * dec:
                    step, accepted, drop = t * d, True, value - trial
                    break
                t *= 0.5
            if accepted or rel <= grad_tol or retries == NEWTON_RETRIES:  # past the test: rounding
                break
            retries += 1  # a descent direction that found no decrease: a shorter, more gradient-like step
            lam = max(1e3 * tau, 100.0 * lam)
        if reason == "gradient" and not accepted:
            break
        # a damped step that still lowers the loss by a share of it (a logistic intercept's saturated start, where
        # the quadratic model is poor but the loss smooth) is progress; only small ones count as crawling
        big = accepted and drop > STRUGGLE_SHARE * (1.0 + abs(value))
        struggling = struggling + 1 if accepted and retries and not big else 0
        if struggling > NEWTON_RETRIES:  # steps found only by damping, again and again: the loss is not smooth
            accepted = False
        if not accepted:  # no step lowers the loss: at the mode to rounding, or stuck
            reason = "gradient" if rel <= grad_tol else "no progress"
            break
        with torch.no_grad():
            x.add_(step)
        it += 1
        polished += rel <= grad_tol
        last = dmax if rel <= grad_tol else math.inf
        loss, g, H = loss_hessian(loss_fn, x, batched)
        evals[0] += 1
    return NewtonResult(float(loss), float(g.abs().max()) if g.numel() else 0.0, evals[0], reason, it, H)


@dataclass(frozen=True)
class LaplaceOptions(Type2Options):
    method: typing.Literal["auto", "newton", "lbfgs"] = option(
        "auto", "mode search: 'newton' (safeguarded Newton steps on the autograd Hessian), 'lbfgs' (L-BFGS on the "
                "gradient, the Hessian formed once at the mode), 'auto' (newton up to 1000 latent dimensions, lbfgs "
                "above)")
    max_iter: int = option(500, "Newton steps or L-BFGS iterations", min=1)
    learn_params: bool = option(True, "type-II: maximise the reported bound over the model's pyro.param sites "
                                      "(central differences of refits)")
    grad_tol: float = option(1e-6, "convergence: max |gradient| of the log joint at the mode / (1 + |log joint|), "
                                   "at least 100 machine epsilons of the latents' dtype (float32: 1.2e-5, where "
                                   "the gradient's rounding lies)", gt=0)
    seed: typing.Optional[int] = option(SEED_DOC[0], SEED_DOC[1], min=0)


class _FullDataEngine(_PyroModelEngine):
    """Pyro engines that fit all the data at once: the model runs with every subsampled plate at full size."""

    def full_data_model(self, call):
        """``call.model`` under :func:`~pyro_convexvb.lgm.extract.full_data_plates` (the run is seeded by
        :meth:`~pyro_convexvb.infer.engine.Engine.run`)."""
        return full_data_plates()(call.model)


class LaplaceEngine(_FullDataEngine):
    """Laplace approximation on the Pyro model: the mode of the log joint in Pyro's unconstrained coordinates and
    the Gaussian with the inverse Hessian there as covariance (Pyro's ``AutoLaplaceApproximation``).

    The mode is found by Newton steps (:func:`newton_map`; for GP classification, the iteration of Rasmussen &
    Williams 2006, §3.4.1, converging in a handful of steps however ill-conditioned the prior) or by L-BFGS
    (``method``; ``'auto'`` takes Newton up to :data:`NEWTON_AUTO_MAX` latent dimensions, where a dense Hessian
    per step is affordable). ``result.state`` (a :class:`LaplaceState`) holds the mode; ``init=`` starts there.
    """

    name = "laplace"
    distributed = True
    description = "Pyro AutoLaplaceApproximation: MAP by Newton steps or L-BFGS, Gaussian from the Hessian"
    Options = LaplaceOptions
    State = LaplaceState
    type2 = "outer"
    optimality_measure = "max |gradient| of the log joint at the mode, relative to 1 + |log joint|, <= grad_tol"

    def solve(self, call, run):
        from ..linalg.lbfgs import minimize_lbfgs

        o = self.options
        model = self.full_data_model(call)
        guide = AutoLaplaceApproximation(model)
        self.own_guide(guide)
        elbo = Trace_ELBO()
        elbo.differentiable_loss(model, guide, *call.args, **call.kwargs)  # creates the parameters
        loc = guide.loc
        if self.init is not None:
            start = self.init.loc
            if tuple(start.shape) != tuple(loc.shape):
                raise ValueError(f"init.loc: the model has {loc.shape[0]} unconstrained latent dimensions; the state "
                                 f"has shape {tuple(start.shape)}")
            with torch.no_grad():
                loc.copy_(start.to(dtype=loc.dtype, device=loc.device))
        sharded = find_comm(call.args, call.kwargs) is not None
        if not sharded:
            loss = lambda: elbo.differentiable_loss(model, guide, *call.args, **call.kwargs)  # noqa: E731
        else:  # row-sharded data: the likelihood of this rank's rows, summed over ranks; the prior once
            loss = lambda: _sharded_map_loss(model, guide, call.args, call.kwargs)  # noqa: E731
        method = o.method if o.method != "auto" else ("newton" if loc.shape[0] <= NEWTON_AUTO_MAX else "lbfgs")
        # a float32 gradient at the mode is rounding below ~1e-6 of the log joint: a tighter test is never met
        grad_tol = max(o.grad_tol, 100 * torch.finfo(loc.dtype).eps)
        H = None
        if method == "newton":
            # row-sharded data: one backward pass per Hessian row, so every rank issues the same collectives
            res = newton_map(loc, loss, max_iter=o.max_iter, grad_tol=grad_tol, history=run.history,
                             bar=run.bar(total=o.max_iter, unit="step"), batched=not sharded, name=self.name)
            H = res.hessian
        else:
            params = [p for name, p in pyro.get_param_store().named_parameters()
                      if name.startswith(guide._pyro_name + ".")]
            res = minimize_lbfgs(params, loss,
                                 max_iter=o.max_iter, grad_tol=0.0, history=run.history,
                                 bar=run.bar(total=int(1.25 * o.max_iter), unit="eval"), name=self.name)
        rel = res.grad_norm / (1.0 + abs(res.value))
        try:
            if H is not None:
                posterior = GaussianPosterior(loc.detach().clone(), covariance=_inverse_pd(H))
            elif sharded:
                m, cov = _sharded_laplace(model, guide, call.args, call.kwargs)
                posterior = GaussianPosterior(m, covariance=cov)
            else:
                q = guide.laplace_approximation(*call.args, **call.kwargs).get_posterior()
                posterior = GaussianPosterior(q.loc.detach().clone(), covariance=q.covariance_matrix.detach().clone())
        except torch.linalg.LinAlgError as e:
            from ..errors import NotPositiveDefiniteError

            if rel > grad_tol:  # stopped before a mode: the point is not one
                raise NotPositiveDefiniteError(
                    f"engine '{self.name}': {method} stopped ({res.stop_reason}) after {res.iterations} iterations "
                    f"before reaching a mode (relative gradient {rel:.3g} > {grad_tol:.3g}), at a point where the "
                    "Hessian of the negative log joint is not positive definite, so there is no Laplace "
                    "approximation there" + _no_mode_advice(guide, loc, res.stop_reason)) from e
            raise NotPositiveDefiniteError(
                f"engine '{self.name}': the Hessian of the negative log joint at the mode found by {method} is not "
                "positive definite, so the Laplace approximation does not exist there (a hierarchical model's "
                "mode often sits at the neck of its funnel, where a scale goes to 0)") from e
        if rel <= grad_tol and (collapsed := _collapsed_scale(call, guide)):
            warn(f"engine '{self.name}': {collapsed}", ApproximationWarning)
        lgm = try_lgm(call.source, call.args, call.kwargs)
        bound, note = _laplace_bound(lgm, posterior)
        reason = "gradient" if rel <= grad_tol else res.stop_reason
        opt = Optimality.single("max |gradient| of the log joint at the mode / (1 + |log joint|)", rel, grad_tol)
        info = {"map_grad_norm": res.grad_norm, "evaluations": res.evaluations, "iterations": res.iterations,
                "method": method, **({"bound_note": note} if note else {})}
        return Solution(posterior, bound, opt, reason, info,
                        lgm=lgm, state=LaplaceState(posterior.loc.detach().clone()),
                        advice=_no_mode_advice(guide, loc, res.stop_reason) if rel > grad_tol else "")


#: an unconstrained coordinate of a constrained site past this magnitude (a scale below e^-8, about 3e-4) where
#: the mode search stopped unconverged, at a Hessian that is not positive definite, is taken as running off to a
#: boundary (on a centred hierarchy of five groups, 500 Newton steps took log tau to -12.5)
RUNAWAY_LOG = 8.0


def _laplace_bound(lgm, posterior):
    """``(bound, note)``: the exact variational-Gaussian bound of the Laplace Gaussian on the model's latent Gaussian
    model ``lgm``, or ``None`` and why not (type-II learning, which maximises it, names the reason)."""
    if lgm is None:
        return None, "the model is no latent Gaussian model, whose bound it evaluates"
    q = posterior
    if (getattr(lgm, "imputed", None) or getattr(lgm, "chain", None) is not None) \
            and posterior.n == lgm.model_layout.size:
        q = lgm.latent_marginal(posterior)  # latent sites integrated out of the LGM (obs_mask)
    if lgm.n != q.n:
        return None, "its Gaussian is not over the coordinates of the model's latent Gaussian model"
    if q.n > EXACT_BOUND_MAX:
        return None, f"its {q.n} latent coordinates exceed the {EXACT_BOUND_MAX} of a dense bound"
    with torch.no_grad():
        return float(lgm.evidence_lower_bound(q.loc.to(lgm.dtype), q.covariance().to(lgm.dtype))), ""


#: a field prior's scale at the Laplace mode below this share of its prior median: the mode of a centred hierarchy
#: at its funnel's neck (complete pooling), where a Gaussian says nothing of the posterior
COLLAPSED_SCALE = 1e-3
#: prior draws of the hyper-latents for that median
COLLAPSED_PRIOR_DRAWS = 21


def _collapsed_scale(call, guide):
    """A sentence when the mode puts the prior scale of a centred field site (``theta ~ Normal(mu, tau)``, ``tau``
    a latent) below :data:`COLLAPSED_SCALE` of its prior median, else ``""``. A scale written as a positive site
    runs off to 0 and is refused (:func:`_no_mode_advice`); one written through a real site, ``tau =
    exp(log_tau)`` with ``log_tau ~ Normal``, has a finite mode there (``log_tau`` about ``-1 - G K`` for ``G K``
    field entries), which the mode search reaches and calls converged."""
    from .hyper import field_scale_sites

    model, args, kwargs = call.model, call.args, call.kwargs
    scales = field_scale_sites(model, args, kwargs)
    if not scales:
        return ""

    def typical(tr, name):
        scale = getattr(_unwrap(tr.nodes[name]["fn"])[0], "scale", None)
        return float(scale.detach().double().median()) if torch.is_tensor(scale) else None

    with torch.no_grad(), full_data_plates():
        mode = {site["name"]: biject_to(site["fn"].support)(v) for site, v in guide._unpack_latent(guide.loc.detach())}
        at = poutine.trace(poutine.condition(model, data=mode)).get_trace(*args, **kwargs)
        with forked_rng(0):
            prior = [poutine.trace(model).get_trace(*args, **kwargs) for _ in range(COLLAPSED_PRIOR_DRAWS)]
    for name, sources in scales.items():
        here, draws = typical(at, name), [typical(tr, name) for tr in prior]
        if here is None or None in draws:
            continue
        median = float(np.median(draws))
        if median > 0 and here < COLLAPSED_SCALE * median:
            return (f"the mode puts the prior scale of site {name!r} (set by {sorted(sources)}) at {here:.3g}, "
                    f"{here / median:.1g} of its prior median {median:.3g}: the joint mode of a centred hierarchy at "
                    "its funnel's neck (every effect pooled to its mean), where a Gaussian says nothing of the "
                    "posterior's spread; integrate the scale over (engine='dual_vg' does by default, for a model "
                    "that is a latent Gaussian model given it) or write the hierarchy non-centred")
    return ""


def _no_mode_advice(guide, loc, stop_reason):
    """What to do after a mode search stopped short: where a positive site's log value ran off (a centred
    hierarchy's scale heading to 0, where the log joint grows without bound: no mode exists), say so; after
    ``max_iter`` otherwise, raise it."""
    at = 0
    for name, shape in getattr(guide, "_unconstrained_shapes", {}).items():
        size = math.prod(shape)
        v = loc.detach()[at:at + size]
        at += size
        if size and not real_support(guide.prototype_trace.nodes[name]["fn"]) and float(v.abs().max()) > RUNAWAY_LOG:
            j = int(v.abs().argmax())
            return (f"; site {name!r} seems to run off to a boundary (unconstrained value {float(v[j]):.3g}): a scale "
                    "heading to 0 makes the log joint of a centred hierarchy grow without bound, so there is no mode "
                    "to find and raising max_iter does not help; integrate the scale over (engine='dual_vg' does by "
                    "default, for a model that is a latent Gaussian model given it) or write the hierarchy "
                    "non-centred")
    return "; raise max_iter (options=dict(max_iter=...))" if stop_reason == "max_iter" else ""


def _inverse_pd(H):
    """``H^{-1}`` of a symmetric positive definite ``H`` (raises ``LinAlgError`` when it is not)."""
    return torch.cholesky_inverse(torch.linalg.cholesky(H))


def _sharded_map_loss(model, guide, args, kwargs):
    """``-log p(y, u)`` at the guide's point with row-sharded data (``pcv.distributed``).

    The model runs on this rank's rows (row-sharded designs swapped for their local operator, no communication
    inside); the latent values enter it through ``enter_local`` (identity forward, all-reduced backward) and
    ``sum_over_ranks`` adds the observed sites of every rank and the latent sites of rank 0, so value, gradient
    and Hessian are those of the full-data log joint on every rank (the guide's own log density, replicated,
    is counted once outside the sum)."""
    largs, lkwargs = local_args(args, kwargs)
    guide_tr = poutine.trace(guide).get_trace(*largs, **lkwargs)
    latent = {name: site["value"] for name, site in guide_tr.nodes.items()
              if site["type"] == "sample" and not site["is_observed"]}
    # every latent enters through ONE enter_local, used on every rank (0 * its sum): each backward then issues the
    # same single all-reduce on all ranks, also for a latent that only the prior reads (counted on rank 0 only)
    flat = enter_local(torch.cat([v.reshape(-1) for v in latent.values()]))
    values, at = {}, 0
    for name, v in latent.items():
        values[name] = flat[at:at + v.numel()].reshape(v.shape)
        at += v.numel()
    model_tr = poutine.trace(poutine.condition(model, data=values)).get_trace(*largs, **lkwargs)
    check_full_plates(model_tr)
    if not guide.__dict__.get("_rows_checked"):  # once per fit (a collective)
        check_sharded_rows(model_tr, latent)
        guide.__dict__["_rows_checked"] = True
    model_tr.compute_log_prob()
    first = rank() == 0
    local = 0.0 * flat.sum()
    for name, site in model_tr.nodes.items():
        if site["type"] != "sample" or type(site["fn"]).__name__ == "_Subsample":
            continue
        if name not in latent or first:
            local = local + site["log_prob_sum"]
    return guide_tr.log_prob_sum() - sum_over_ranks(local)


def _sharded_laplace(model, guide, args, kwargs):
    """``(loc, covariance)`` of the Laplace approximation from the Hessian of :func:`_sharded_map_loss` (what
    ``AutoLaplaceApproximation.laplace_approximation`` computes on one process)."""
    loc = guide.loc
    # one backward pass per Hessian row, so every rank issues the same collectives
    H = loss_hessian(lambda: _sharded_map_loss(model, guide, args, kwargs), loc, batched=False)[2]
    return loc.detach().clone(), _inverse_pd(H)  # raises LinAlgError when not positive definite, as on one process


# ---------------------------------------------------------------------------------------------
# NUTS
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NUTSOptions(EngineOptions):
    num_samples: int = option(500, "samples kept after warm-up (split R-hat needs two halves of >= 2 draws)", min=4)
    warmup_steps: int = option(300, "warm-up (adaptation) steps", min=0)
    max_rhat: float = option(1.01, "convergence: largest split R-hat over all latent coordinates", gt=1.0)
    min_ess: float = option(100.0, "convergence: smallest effective sample size over all latent coordinates", gt=0)
    target_accept_prob: float = option(0.8, "NUTS step-size adaptation target", gt=0.0, max=1.0)
    max_tree_depth: int = option(8, "NUTS tree depth cap", min=1)
    jit_compile: bool = option(False, "JIT-compile the potential (Pyro's jit_compile)")
    seed: typing.Optional[int] = option(SEED_DOC[0], SEED_DOC[1], min=0)
    learn_params: bool = option(True, "NUTS samples latent sites and cannot learn pyro.param sites: a model with "
                                      "them is refused unless False, which samples with them held at their values "
                                      "in the param store")


def _latent_dtype(sites):
    """The one floating dtype of the latent ``sites`` (``(name, site)`` pairs), else ``None``."""
    dtypes = {s["value"].dtype for _, s in sites if s["value"].is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


@contextlib.contextmanager
def _default_dtype(dtype):
    """torch's default dtype set to ``dtype`` (unchanged for ``None``) inside the block, restored after: Pyro's NUTS
    builds its step size, mass matrix and momenta in the default dtype, so a float32 model under a float64 default
    (as these docs advise) failed on its first leapfrog step with a bare dtype error."""
    before = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class NUTSEngine(_FullDataEngine):
    name = "nuts"
    description = "Pyro NUTS (MCMC); Gaussian summary of the samples in unconstrained space, no evidence bound"
    Options = NUTSOptions
    optimality_measure = ("largest split R-hat over all unconstrained latent coordinates <= max_rhat, and smallest "
                          "effective sample size >= min_ess")
    subsampled_locals = True
    sequential_plates = True  # samples the log joint as written

    @classmethod
    def fits(cls, model, args=(), kwargs=None, lgm=None):
        """As :meth:`ModelEngine.fits <pyro_convexvb.infer.engine.ModelEngine.fits>`, and not a model with
        ``pyro.param`` sites, which NUTS refuses at its default ``learn_params=True`` (it cannot learn them)."""
        from .type2 import model_params

        err = super().fits(model, args, kwargs, lgm)
        if err is None:  # a Pyro model (a LatentGaussianModel is refused above)
            names = model_params(model, args, kwargs or {})
            if names:
                return UnsupportedModelError(names[0], "engine 'nuts' cannot learn pyro.param sites (it samples "
                                                       "latent sites; learn_params=False holds them)")
        return err

    def solve(self, call, run):
        from pyro.ops.stats import effective_sample_size, split_gelman_rubin

        o = self.options
        with forked_rng(0):  # the model's traces leave the sampler's stream as it was
            held = model_param_values(call)
            sites = latent_sites(call.model, call.args, call.kwargs)
        if held and o.learn_params:
            values = ", ".join(f"{n} = {float(v.reshape(-1)[0]):.4g}" + ("" if v.numel() == 1 else ", ...")
                               for n, v in held.items())
            raise UnsupportedModelError(next(iter(held)), f"engine 'nuts' samples latent sites and cannot learn the "
                                        f"model's pyro.param sites {', '.join(repr(n) for n in held)}, which every "
                                        "other engine learns by default; pass options={'learn_params': False} to "
                                        f"sample with them held at their values in the param store ({values}), "
                                        "learn them first with another engine (e.g. engine='dual_vg' or "
                                        "'laplace') and then sample so, or give them priors for NUTS to sample")
        model = self.full_data_model(call)
        kernel = NUTS(model, target_accept_prob=o.target_accept_prob, max_tree_depth=o.max_tree_depth,
                      jit_compile=o.jit_compile, ignore_jit_warnings=True)
        # Pyro's own MCMC bar switches itself off whenever a ``CI`` variable is set; the engine's bar
        # honours ``progress`` everywhere, fed by MCMC's per-step hook.
        bar = run.bar(total=o.warmup_steps + o.num_samples, unit="step", desc="nuts")

        def hook(kernel, params, stage, i):
            bar.update(1)

        mcmc = MCMC(kernel, num_samples=o.num_samples, warmup_steps=o.warmup_steps, disable_progbar=True,
                    hook_fn=hook)
        with _default_dtype(_latent_dtype(sites)):  # Pyro's NUTS makes its tensors in torch's default dtype
            mcmc.run(*call.args, **call.kwargs)
        samples = mcmc.get_samples()
        flat = []
        for name, site in sites:
            t = biject_to(site["fn"].support)
            flat.append(t.inv(samples[name]).reshape(o.num_samples, -1))
        flat = torch.cat(flat, -1)
        loc = flat.mean(0)
        cov = torch.cov(flat.T).reshape(flat.shape[1], flat.shape[1])
        # a relative jitter per coordinate keeps the summary positive definite without mixing scales
        d = cov.diagonal()
        cov = cov + torch.diag(1e-10 * d + torch.finfo(d.dtype).tiny ** 0.5)
        chains = flat.unsqueeze(0)
        rhat = float(split_gelman_rubin(chains).max())
        ess = float(effective_sample_size(chains).min())
        run.history.record(objective=float("nan"), r_hat=rhat, min_ess=ess)
        posterior = GaussianPosterior(loc, covariance=cov)
        info = {"samples": samples, "unconstrained_samples": flat, "r_hat": rhat, "min_ess": ess,
                "iterations": o.warmup_steps + o.num_samples}  # the chain's steps, warm-up included
        if held:
            info["held_params"] = held  # learn_params=False: sampled with the params at these values
        ess_short = max(0.0, o.min_ess - ess) if math.isfinite(ess) else math.inf
        opt = Optimality((Criterion("largest split R-hat", rhat if math.isfinite(rhat) else math.inf, o.max_rhat),
                          Criterion(f"smallest effective sample size: shortfall below min_ess = {o.min_ess:g} (draws)",
                                    ess_short, 0.0)))
        return Solution(posterior, None, opt, "num_samples", info)
