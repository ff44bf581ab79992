"""The ``diag_mixture`` engine: SVI (or natural-gradient steps on the exact bound) with
:class:`~pyro_convexvb.posterior.mixture.AutoDiagMixture` (Steinberg et al. 2017, §1.3)."""
import math
import typing
from dataclasses import dataclass

import pyro.poutine as poutine
import torch
from pyro.nn import PyroParam

from ...errors import UnsupportedModelError, warn
from ...linalg.linesearch import backtrack
from ...linalg.operators import DENSE_LIMIT
from ...posterior.gaussian import _write_guide_params
from ...posterior.mixture import (_ENTROPY_BOUNDS, AutoDiagMixture, DiagMixturePosterior, _entropy_fn,
                                  mixture_evidence_bound)
from ..optimality import mixture_decrement, monte_carlo_objective
from ..options import option
from ..pyro_engines import SVIEngine, SVIOptions, flat_log_joint, model_param_values, try_lgm
from ..result import Criterion, Optimality, Solution
from ...distributed import find_comm
from ...lgm.extract import subsampled_frame
from ..sharded_svi import reshard_lgm
from .elbo import DiagMixtureELBO

__all__ = ["DiagMixtureOptions", "SVI_ONLY_OPTIONS", "DiagMixtureEngine", "MixtureState"]


@dataclass(frozen=True)
class DiagMixtureOptions(SVIOptions):
    num_components: int = option(1, "K, the number of diagonal Gaussian components", min=1)
    entropy: typing.Literal["eq24", "bhattacharyya"] = option(
        "eq24", "entropy lower bound in the training objective (Steinberg et al. 2017, Eq. 24, or Bhattacharyya)")
    init_spread: typing.Optional[float] = option(None, "spread of the initial component means", gt=0)
    callback: typing.Optional[typing.Callable] = option(None, "called as callback(step, loss, guide) after each step")
    optimizer: typing.Literal["auto", "svi", "natural_gradient"] = option(
        "auto", "'natural_gradient': natural-gradient (CVI) steps on the exact mixture bound (latent Gaussian "
                "models, full data); 'svi': stochastic ELBO with clipped Adam; 'auto': natural_gradient when it "
                "applies and no SVI-only option is set")

    def check(self):
        # min_steps is an SVI option (SVIOptions.check: an unset one is capped at max_steps)
        if self.optimizer != "natural_gradient":
            super().check()
        if self.num_components == 1:  # one component: no spread of means; the entropy bounds differ by a constant
            unused = [k for k in ("init_spread", "entropy") if self.is_set(k)]
            if unused:
                warn(f"engine 'diag_mixture': option {' and '.join(unused)} has no effect with num_components=1 "
                     "(one component has no spread of means, and the entropy bounds differ by a constant there, so "
                     "the fit is the same); drop it or raise num_components", UserWarning)


#: name of the natural-gradient ascent's second criterion
REMAINING_NAME = "gain still to come of the natural-gradient ascent, from its last two gains (nats)"

#: options that only the stochastic optimiser uses ('auto' picks SVI when one differs from its default)
SVI_ONLY_OPTIONS = ("lr", "min_steps", "window", "rtol", "lr_decay", "lr_cuts", "num_particles",
                    "vectorize_particles", "clip_norm", "callback")


def _natural_gradient_refusal(call, lgm, n_guide, learn_params):
    """Why natural gradients on the exact bound do not apply to this model (``None`` when they do)."""
    if lgm is None:
        return "the model is not a latent Gaussian model that pyro_convexvb can extract"
    if lgm.n != n_guide or getattr(lgm, "chain", None) is not None:
        return "the guide's latent vector is not the latent Gaussian model's (constrained or extra latents, or a " \
               "reparametrised affine Gaussian chain or intrinsic GMRF)"
    if lgm.n > DENSE_LIMIT:
        return (f"its natural-gradient steps solve a dense {lgm.n} x {lgm.n} system per component (at most "
                f"{DENSE_LIMIT})")
    if any(g.family.vector_site for g in lgm.sites):
        return "the model has vector (Categorical) sites, whose natural-gradient steps would need each row's K x K " \
               "covariance blocks"
    if learn_params and model_param_values(call):
        return "the model has pyro.param sites to learn jointly (learn_params=True), which only SVI does"
    plate = _subsampled_plate(call)
    if plate is not None:
        return f"plate '{plate}' is subsampled (mini-batches), and natural-gradient steps take all the data"
    return None


def _subsampled_plate(call):
    """The name of a plate of the model that subsamples its rows (``subsample_size`` or ``subsample``), or
    ``None``: one trace of the model, its random draws in a forked stream."""
    from ..rng import forked_rng

    with forked_rng(0), torch.no_grad():
        tr = poutine.trace(call.model).get_trace(*call.args, **call.kwargs)
    return next((f.name for f in map(subsampled_frame, tr.nodes.values()) if f is not None), None)


@dataclass(frozen=True)
class MixtureState:
    """The fitted mixture (``locs``, ``variances``: ``(K, D)`` over the unconstrained latents) after ``steps`` of
    ``optimizer`` (``"svi"`` or ``"natural_gradient"``); ``init=`` resumes from it (Steinberg et al. 2017, §1.3)."""

    engine: typing.ClassVar[str] = "diag_mixture"
    options: typing.ClassVar[tuple] = ()

    locs: torch.Tensor
    variances: torch.Tensor
    steps: int = 0
    optimizer: str = "svi"

    def warm_start(self):
        return self


class DiagMixtureEngine(SVIEngine):
    """SVI with :class:`AutoDiagMixture` and :class:`DiagMixtureELBO` (Steinberg et al. 2017, §1.3).

    Stopping rule of the SVI engines (windowed plateau or ``max_steps``); convergence is judged by the
    natural-gradient decrement of the mixture's evidence bound (exact site expectations for latent
    Gaussian models, the larger of the Eq. 24 and Bhattacharyya entropy bounds) in the block-diagonal
    Fisher metric of the components (:func:`~pyro_convexvb.infer.optimality.mixture_decrement`).

    On row-sharded data the ELBO's gradients and loss are all-reduced over ranks (see
    :class:`DiagMixtureELBO`'s ``reduction``), which gives the single-process fit.

    ``log_evidence_bound`` is :func:`mixture_evidence_bound` with ``entropy="best"`` for latent
    Gaussian models (``info["bound_eq24"]`` with Eq. 24 alone: it sits ``(D/2)(1 - log 2)`` below the
    entropy at ``K = 1``), else ``None``; ``info["elbo_estimate"]`` is the last window's stochastic
    ELBO (the training objective).
    """

    name = "diag_mixture"
    mini_batched_locals = False  # its guide packs every latent into one vector
    description = "SVI with AutoDiagMixture (mixture of K diagonal Gaussians, closed-form entropy bound, revrand)"
    Options = DiagMixtureOptions
    State = MixtureState
    optimality_measure = ("natural-gradient decrement of the mixture's evidence bound (block-diagonal Fisher) <= "
                          "decrement_tol; stops at an ELBO plateau or max_steps")

    def make_guide(self, model):
        o = self.options
        start = None
        if self.init is not None:
            if self.init.locs.shape[0] != o.num_components:
                raise ValueError(f"init: the state has {self.init.locs.shape[0]} mixture components, option "
                                 f"num_components = {o.num_components}")
            start = DiagMixturePosterior(self.init.locs, self.init.variances)
        return AutoDiagMixture(model, num_components=o.num_components, init_scale=o.init_scale,
                               init_spread=o.init_spread, posterior=start)

    def _use_natural_gradient(self, call, lgm, guide, reduction=None):
        """Whether this run optimises the exact bound by natural gradients (``optimizer`` option); raises when
        asked for ``'natural_gradient'`` on a model it does not apply to."""
        o = self.options
        if o.optimizer == "svi":
            return False
        n_guide = guide.locs.shape[-1]
        why = _natural_gradient_refusal(call, lgm, n_guide, o.learn_params)
        if why is None and reduction is not None:
            why = "the data are row-sharded over processes, which only the SVI optimiser reduces"
        set_svi = [k for k in SVI_ONLY_OPTIONS if o.is_set(k)]
        if o.optimizer == "natural_gradient":
            if why is not None:
                raise UnsupportedModelError("optimizer", f"engine 'diag_mixture' with optimizer='natural_gradient': "
                                                         f"{why}; use optimizer='svi'")
            if set_svi:
                raise ValueError(f"engine 'diag_mixture': option(s) {', '.join(set_svi)} only apply to "
                                 "optimizer='svi'; with optimizer='natural_gradient' leave them at their defaults")
            return True
        return why is None and not set_svi

    def _fit_natural_gradient(self, guide, lgm, run):
        """:func:`_natural_gradient_ascent` from the guide's parameters; the optimum is written back into them.

        :returns: ``(F, iterations, stop reason)``.
        """
        o = self.options
        with torch.no_grad():
            locs0, scales0 = guide._mixture_params()
        M = locs0.detach().to(lgm.dtype).clone()
        V = scales0.detach().to(lgm.dtype).clone() ** 2
        M, V, val, it, reason, remaining = _natural_gradient_ascent(lgm, M, V, _entropy_fn(o.entropy),
                                                                   max_steps=o.max_steps,
                                                                   decrement_tol=o.decrement_tol, run=run)
        _write_guide_params(guide, {"locs": torch.nn.Parameter(M.to(locs0.dtype).clone()),
                                    "scales": PyroParam(V.sqrt().to(scales0.dtype).clone(), guide.scale_constraint)})
        return val, it, reason, remaining

    def solve(self, call, run):
        o = self.options
        model, guide = self.model_and_guide(call)
        red = find_comm(call.args, call.kwargs)
        lgm = None if o.optimizer == "svi" else try_lgm(call.source, call.args, call.kwargs)
        with poutine.block(), torch.no_grad():
            try:
                guide(*call.args, **call.kwargs)  # builds the prototype and the initial parameters
            except ValueError as e:  # an init state of another model
                raise (e if self.init is None else ValueError(f"init: {e}")) from None
        if self._use_natural_gradient(call, lgm, guide, red):
            value, steps, reason, remaining = self._fit_natural_gradient(guide, lgm, run)
            info_opt = {"optimizer": "natural_gradient", "elbo_estimate": value, "steps": steps,
                        "remaining_gain": remaining}
        else:
            loss = DiagMixtureELBO(num_particles=o.num_particles, entropy=o.entropy,
                                   vectorize_particles=o.vectorize_particles, reduction=red)
            cb = None if o.callback is None else (lambda step, value: o.callback(step, value, guide))
            losses, reason, estimate = self.run_svi(model, guide, loss, call, run, callback=cb,
                                                    name=f"AutoDiagMixture(K={o.num_components})")
            info_opt = {"optimizer": "svi", "elbo_estimate": estimate, "steps": len(losses)}
        with torch.no_grad(), guide._pyro_context:
            locs, scales = guide._mixture_params()
            posterior = DiagMixturePosterior(locs.detach().clone(), scales.detach().clone() ** 2)
        learned = model_param_values(call) if o.learn_params else None
        if lgm is None or learned:
            # SVI moved the model's pyro.param sites: the model extracted before it (at their initial values) is not
            # the fitted model, whose bound and decrement are reported
            lgm = try_lgm(call.source, call.args, call.kwargs)
        lgm = reshard_lgm(lgm, call.args, call.kwargs)
        exact = lgm is not None and lgm.n == posterior.n and lgm.model_bijective
        if exact and o.is_set("check_particles"):
            warn("engine 'diag_mixture': option check_particles has no effect: the model is a latent Gaussian model, "
                 "whose optimality is measured on the exact bound (Monte Carlo draws only for other models)",
                 UserWarning)
        info = dict(info_opt, guide=guide, entropy=o.entropy, hyperparameters=model_param_values(call))
        best = "best"
        with torch.no_grad():
            H = {k: float(_entropy_fn(k)(posterior.locs, posterior.variances)) for k in sorted(_ENTROPY_BOUNDS)}
            best = max(H, key=H.get)
        # the deterministic optimiser is judged on the objective it maximises (entropy bound ``entropy``); the
        # reported bound is still the larger of the two entropy bounds (both are lower bounds)
        measured = o.entropy if info["optimizer"] == "natural_gradient" else best
        if exact:
            posterior.layout = lgm.layout

            def objective(M, V):
                e = torch.stack([lgm.model_expected_log_joint(m, variance=v) for m, v in zip(M, V)]).mean()
                return e + _entropy_fn(measured)(M, V)

            name = "natural-gradient decrement of the exact mixture evidence bound (nats)"
            if measured != best:
                name = f"natural-gradient decrement of the exact mixture evidence bound, {measured} entropy (nats)"
        else:  # check_particles: the Monte Carlo check of a model that is not a latent Gaussian model
            log_joint, n = flat_log_joint(call.model, call.args, call.kwargs, red)
            mc = [monte_carlo_objective(log_joint, n, o.check_particles, locs.dtype, locs.device, self.run_seed + k)
                  for k in range(o.num_components)]
            const = 0.5 * n * (1 + math.log(2 * math.pi))

            def objective(M, V):
                e = torch.stack([f(m, v) - 0.5 * torch.log(v).sum() - const for f, m, v in zip(mc, M, V)]).mean()
                return e + _entropy_fn(best)(M, V)

            name = f"natural-gradient decrement of a {o.check_particles}-draw Monte Carlo mixture ELBO (nats)"
        with torch.enable_grad():
            dec, value = mixture_decrement(objective, posterior.locs.to(lgm.dtype if exact else locs.dtype),
                                           posterior.variances.to(lgm.dtype if exact else locs.dtype))
        bound = None
        if exact:
            bound = value if measured == best else mixture_evidence_bound(lgm, posterior, best)
            info["bound_eq24"] = mixture_evidence_bound(lgm, posterior, "eq24")
        state = MixtureState(posterior.locs, posterior.variances, info["steps"], info["optimizer"])
        opt = Optimality.single(name, dec, o.decrement_tol)
        if "remaining_gain" in info:  # the ascent's own estimate of what its linear convergence has left
            opt = Optimality(opt.criteria + (Criterion(REMAINING_NAME, info["remaining_gain"], o.decrement_tol),))
        return Solution(posterior, bound, opt, reason, info, lgm=lgm if exact else None, state=state)


def _mixture_bound(lgm, entropy_fn, M, V):
    """``F``, ``dF/dM``, ``dF/dV`` and, per component and site group, ``dE/drho`` of the sites."""
    K = M.shape[0]
    Mg, Vg = M.clone().requires_grad_(True), V.clone().requires_grad_(True)
    with torch.enable_grad():
        total, rhos = 0.0, []
        for m, v in zip(Mg, Vg):
            e = lgm.expected_log_prior(m, variance=v) + lgm.log_const
            for g in lgm.sites:
                rho = lgm.diag_marginal_var(g, v)
                rhos.append(rho)
                e = e + g.family.expected_log_prob(g.eta(m), rho).sum()
            total = total + e
        val = total / K + entropy_fn(Mg, Vg)
        grads = torch.autograd.grad(val, [Mg, Vg] + rhos)
    # dE_k/drho = K dF/drho (F weighs component k by 1/K)
    d = [K * t for t in grads[2:]]
    return float(val.detach()), grads[0], grads[1], d


def _newton_directions(lgm, P, g, d):
    """``K A_k^{-1} dF/dm_k`` per component, ``A_k = P + sum_i b_i b_i^T (-2 dE_i/drho_i)``."""
    K, groups = g.shape[0], list(lgm.sites)
    out = torch.empty_like(g)
    for k in range(K):
        A = P.clone()
        for j, grp in enumerate(groups):
            A = A + grp.design.weighted_gram((-2 * d[k * len(groups) + j]).clamp_min(0))
        A.diagonal().add_(1e-12 * float(A.diagonal().abs().max()) + 1e-300)
        out[k] = K * torch.cholesky_solve(g[k].unsqueeze(-1), torch.linalg.cholesky(A)).squeeze(-1)
    return out


def _natural_gradient_ascent(lgm, M, V, entropy_fn, *, max_steps, decrement_tol, run):
    """Second-order ascent on the deterministic mixture bound (latent Gaussian models, full data).

    The objective is ``F = (1/K) sum_k E_{q_k} log p(y, u) + Hbound(q)`` with closed-form prior terms,
    Gauss-Hermite site expectations and the training entropy bound (option ``entropy``). Each step
    updates every component ``k``:

    * variances by the natural-gradient (conjugate-computation, Khan & Lin 2017) step in the metric
      of :func:`~pyro_convexvb.infer.optimality.mixture_decrement`:
      ``1/v_k <- 1/v_k - 2 K b dF/dv_k`` (``b = 1``: the stationarity condition of ``v_k``);
    * means by a Newton step with the expected curvature of the component's log joint,
      ``m_k <- m_k + K b A_k^{-1} dF/dm_k``, ``A_k = P + sum_i b_i b_i^T (-2 dE_i/drho_i)`` (prior
      precision ``P``, site rows ``b_i``, site variance ``rho_i``; by Price's theorem
      ``E[d^2 log t_i] = 2 dE_i/drho_i``), so correlated latents do not slow it down as a diagonal
      metric would.

    Steps that lower ``F`` (or leave a precision nonpositive) are halved. The means' and the variances' steps
    alternate in effect, so where they are strongly coupled (a GP prior's correlated latents) the ascent converges
    linearly, gaining a nearly constant fraction ``r`` less each step while each step's decrement is small: 0.01
    nats a step with 0.7 nats still to gain on a 60-point GP classification. The run therefore stops when the
    decrement and the last gain are below ``decrement_tol`` and so is the gain still to come by the geometric
    series of the last two gains, ``c r / (1 - r)`` with ``r = c_t / c_{t-1}`` (:func:`_remaining_gain`).

    :param M: ``(K, n)`` component means; :param V: ``(K, n)`` variances (the start).
    :param entropy_fn: the entropy bound ``(M, V) -> H``.
    :param run: the fit's :class:`~pyro_convexvb.infer.result.RunContext` (history and progress bar).
    :returns: ``(M, V, F, iterations, stop reason, remaining gain)``.
    """
    K = M.shape[0]
    gains = []
    P = lgm.dense_prior_prec()
    val, g, gv, d = _mixture_bound(lgm, entropy_fn, M, V)
    b, reason, it, last_change = 1.0, "max_steps", 0, math.inf
    bar = run.bar(total=max_steps, unit="iter")
    for it in range(1, max_steps + 1):
        dec = K * float((0.5 * g * g * V).sum() + ((gv * V) ** 2).sum())
        run.history.record(objective=val, decrement=dec)
        bar.update(1)
        if not math.isfinite(dec):
            raise FloatingPointError(f"diag_mixture: the natural-gradient decrement became {dec}")
        remaining = _remaining_gain(gains, val)
        if dec <= decrement_tol and last_change <= decrement_tol and remaining <= decrement_tol:
            reason = "decrement"
            break
        step_m = _newton_directions(lgm, P, g, d)

        def trial(b, M=M, V=V, gv=gv, val=val, step_m=step_m):
            prec = 1.0 / V - 2 * K * b * gv
            if not bool((prec > 0).all()):
                return None
            M_new, V_new = M + b * step_m, 1.0 / prec
            new = _mixture_bound(lgm, entropy_fn, M_new, V_new)
            return (M_new, V_new, new) if new[0] >= val - 1e-12 * (1 + abs(val)) else None

        b, accepted = backtrack(trial, b)
        if accepted is None:
            reason = "no ascent step"
            break
        M, V, new = accepted
        last_change = new[0] - val
        gains.append(float(last_change))
        val, g, gv, d = new
        b = min(1.0, 2 * b)
    return M, V, val, it, reason, _remaining_gain(gains, val)


def _remaining_gain(gains, value):
    """Gain still to come of a linearly converging ascent from its last two gains ``c_{t-1}, c_t``: the geometric
    series ``c_t r / (1 - r)``, ``r = c_t / c_{t-1}``; ``inf`` before two gains or while they do not shrink, 0 once
    the last gain is at rounding level."""
    if len(gains) < 2:
        return math.inf
    prev, last = gains[-2], gains[-1]
    if last <= 1e-12 * (1.0 + abs(value)):
        return 0.0
    r = last / prev if prev > 0 else math.inf
    return last * r / (1.0 - r) if r < 1.0 else math.inf
