"""``ConvexVariationalRelaxation``: the registered engine ``convex_relaxation``."""
import math
import typing
from dataclasses import dataclass

import torch

from ...errors import UnsupportedModelError, warn
from ..engine import Criterion, Engine, LGMEngineOptions, Optimality, Solution, option
from ..posterior import GaussianPosterior
from ..result import WorkReport
from .outer import _OPTION_NAMES, RelaxationState, double_loop
from .potentials import potential_for, warn_if_not_log_concave
from .problem import RelaxationProblem

__all__ = ["ConvexVariationalRelaxation", "ConvexRelaxationOptions", "applies", "predictive_marginals"]


def applies(lgm):
    """``None`` if every non-Gaussian site family of ``lgm`` has a super-Gaussian representation, else the
    :class:`~pyro_convexvb.UnsupportedModelError` naming the first site without one and why."""
    for g in lgm.nongaussian_groups:
        try:
            potential_for(g.family)
        except UnsupportedModelError as e:
            return UnsupportedModelError(g.name, e.reason)
    return None


@dataclass(frozen=True)
class ConvexRelaxationOptions(LGMEngineOptions):
    lanczos_rank: int = option(80, "Lanczos steps k per variance update (80 for a9a, 750 for real-sim/rcv1 in "
                                    "Nickisch & Seeger 2009); a value other than the default is refused with "
                                    "variance='exact' (unused there)",
                               min=1)
    max_outer: int = option(10, "outer-loop variance updates (each followed by one inner loop); the loop stops "
                                "earlier once gamma_tol and phi_tol are met", min=0)
    max_newton: int = option(20, "Newton steps per inner loop", min=1)
    cg_tol: float = option(1e-6, "relative CG residual of the final Newton systems", gt=0)
    variance: typing.Literal["auto", "lanczos", "exact", "pca"] = option(
        "auto", "variance method: exact (dense Cholesky) when cheaper than K-Lanczos ('auto'), K-Lanczos, exact, "
                "or L-PCA (Seeger 2010)")
    lanczos_block_size: int = option(1, "block size b <= lanczos_rank of block Lanczos (1: Nickisch & Seeger's "
                                        "Lanczos); a value other than the default is refused with variance='exact' or "
                                        "'pca' (unused there)", min=1)
    lanczos_estimator: typing.Literal["auto", "k-lanczos", "whitened"] = option(
        "auto", "Lanczos variance estimator: K-Lanczos lower bounds on the precision (sparse designs), the "
                "whitened covariance form (GP-type dense prior covariances), or chosen by the model ('auto'); with "
                "variance='lanczos', or 'auto' (the Lanczos step it weighs against an exact one); refused with "
                "'exact' or 'pca' unless left at its default")
    pca_rank: typing.Optional[int] = option(None, "L of L-PCA (default lanczos_rank // 6); only with "
                                                  "variance='pca' ('auto' never chooses L-PCA: refused otherwise)",
                                            min=1)
    newton_tol: float = option(1e-8, "Newton decrement tolerance (relative to |Psi|)", gt=0)
    gamma_tol: float = option(1e-3, "convergence: relative change of gamma between outer iterations", min=0)
    phi_tol: float = option(1e-6, "convergence: relative change of phi between outer iterations", min=0)
    z_min: float = option(1e-10, "floor on the site variances z fed to the inner loop", gt=0)
    gamma_init: typing.Any = option(None, "initial gamma (number or (q,) tensor); default: Gaussians touching each "
                                          "site at 1 + s_0^2")
    z_init: typing.Any = option(None, "warm start: (q,) site variances valid at gamma_init (skips the first "
                                      "variance step)")
    u_init: typing.Any = option(None, "warm start: (n,) mean valid at gamma_init (with z_init)")
    logdet_init: typing.Optional[float] = option(None, "warm start: log|A| at gamma_init (with z_init)")
    dense_logdet_max: int = option(2000, "largest n with an exact log|A| (dense Cholesky) in the Lanczos/PCA modes",
                                   min=0)
    exact_max: int = option(5000, "largest n accepted by variance='exact'", min=1)
    cg_max_iter: typing.Optional[int] = option(None, "CG iteration cap (default: n)", min=1)
    preconditioner: typing.Literal["jacobi", "fourier", "circulant", "block2", "block4", "block8"] = option(
        "jacobi", "CG preconditioner of the inner loop's Newton systems and the mean solves: Jacobi, or for image "
                  "models whose operators offer the structure the Jacobi-scaled circulant ('fourier'), T. Chan's "
                  "optimal circulant ('circulant') or block Jacobi on 2 x 2 / 4 x 4 / 8 x 8 pixel tiles ('block2', "
                  "'block4', 'block8'); a dense Cholesky factor of the outer loop replaces it")
    seed: int = option(0, "seed of the Lanczos start vectors", min=0)

    def check(self):
        self._check_variance_options()
        for name in ("u_init", "logdet_init"):  # they complete z_init's warm start; alone they were ignored
            if getattr(self, name) is not None and self.z_init is None:
                raise ValueError(f"{name}: a {'mean' if name == 'u_init' else 'log|A|'} needs the site variances "
                                 "z_init valid at gamma_init: it completes their warm start of the first variance "
                                 "step (alone it would be ignored)")
        if self.z_init is not None and self.gamma_init is None:
            raise ValueError("option 'z_init' needs 'gamma_init' (the widths the variances belong to)")
        if self.z_init is not None and self.max_outer < 1:
            raise ValueError("option 'z_init' needs 'max_outer' >= 1 (the warm start replaces the first variance "
                             "step only)")

    def _check_variance_options(self):
        """Refuse the variance options the chosen ``variance`` would not use (each names the option, why, and the fix).

        ``variance="auto"`` weighs an exact step against the Lanczos step that ``lanczos_rank``,
        ``lanczos_block_size`` and ``lanczos_estimator`` describe, so those take effect under it (in the choice, and
        in the step when Lanczos is chosen); it never chooses L-PCA, so ``pca_rank`` needs ``variance="pca"``.
        """
        v = self.variance
        if self.pca_rank is not None and v != "pca":
            why = ("variance='auto' chooses between exact and Lanczos variances and never L-PCA" if v == "auto"
                   else f"variance='{v}' does not run L-PCA")
            raise ValueError(f"option 'pca_rank' is the number L of eigenpairs of L-PCA and {why}; pass "
                             "variance='pca' to use it, or leave pca_rank unset")
        unused = {"exact": ("lanczos_rank", "lanczos_block_size", "lanczos_estimator"),
                  "pca": ("lanczos_block_size", "lanczos_estimator")}.get(v, ())
        for name in unused:
            if self.is_set(name):
                how = ("computes exact variances from a dense Cholesky factor and runs no Lanczos" if v == "exact"
                       else "runs single-vector Lanczos for the L-PCA eigenpairs")
                raise ValueError(f"option '{name}' configures the Lanczos variance step, but variance='{v}' {how}; "
                                 f"pass variance='lanczos' (or 'auto', which weighs Lanczos against an exact step) "
                                 f"to use it, or leave {name} unset")
        if self.lanczos_block_size > self.lanczos_rank:
            raise ValueError(f"option 'lanczos_block_size' ({self.lanczos_block_size}) exceeds 'lanczos_rank' "
                             f"({self.lanczos_rank}): a run of k = {self.lanczos_rank} Lanczos vectors is one block of "
                             "k random start vectors, so a block size above k has no effect; set "
                             "lanczos_block_size <= lanczos_rank")


class ConvexVariationalRelaxation(Engine):
    r"""Convex variational relaxation for super-Gaussian sites, solved by the double loop (Nickisch & Seeger 2009).

    Fits ``Q(u|D) = N(u_*, sigma^2 A^{-1})``, ``A = X^T X + B^T Gamma^{-1} B``, by minimising the convex
    (for log-concave sites, Nickisch & Seeger 2009, Theorems 1-2) criterion
    ``phi(gamma) = log|A| + h(gamma) + min_u R(u, gamma)`` (§2.1) with the double loop of §2.2:
    inner Newton/IRLS loops with preconditioned CG on sparse products, outer variance updates
    ``z <- diag(B A^{-1} B^T)`` by K-Lanczos (§2.3), L-PCA (Seeger 2010, §3) or exactly.

    Site families: Bernoulli-logit, Laplace (likelihood sites and Laplace priors extracted from a Pyro
    model), Student-t (:class:`~pyro_convexvb.lgm.sites.StudentT`), Gaussian observations (exact, in
    ``X``), and any family with a ``super_gaussian()`` method returning a potential; see
    :mod:`~pyro_convexvb.infer.convex_relaxation.potentials`.

    Convergence: the relative change of ``gamma`` (``<= gamma_tol``) and of ``phi`` (``<= phi_tol``)
    between the last two outer iterations; ``stop_reason`` is ``"gamma and phi converged"``,
    ``"max_outer"`` or ``"Gaussian model"`` (no non-Gaussian sites: exact in one step).

    :param model: a Pyro model (traced by :func:`~pyro_convexvb.lgm_from_pyro` in :meth:`run`) or a
        :class:`~pyro_convexvb.LatentGaussianModel`.
    :param bool progress: tqdm progress bar over outer iterations.
    :param options: the fields of :class:`ConvexRelaxationOptions` (``lanczos_rank``, ``max_outer``,
        ``variance``, ...; listed with their meaning in the docs' engine page).

    :meth:`run` returns an :class:`~pyro_convexvb.InferenceResult` with ``posterior`` over ``u``
    (``loc = u_*``, ``variance = Var_Q[u]``, matrix-free ``precision_operator = A``,
    ``precision_factor = J``, ``precision_scale = sigma^2 = 1``), ``log_evidence_bound = C - phi(gamma)/2``
    ``state`` (a :class:`~.outer.RelaxationState`: ``gamma``, ``u``, ``z``, ``logdet``, the Cholesky or Lanczos
    factor; ``init=`` resumes from it) and ``info`` (site marginals, ``gamma`` and ``z`` per group, phi and MVM
    counts per phase, ...).

    Example::

        >>> import torch, pyro_convexvb as pcv
        >>> from pyro_convexvb.lgm.sites import BernoulliLogit
        >>> X = torch.randn(50, 3, dtype=torch.float64)
        >>> y = (X[:, 0] > 0).double()
        >>> lgm = pcv.LatentGaussianModel.from_design(X, BernoulliLogit(y), prior_scale=1.0)
        >>> res = ConvexVariationalRelaxation(lgm, variance="exact", max_outer=20, progress=False).run()
        >>> res.posterior.loc.shape, res.log_evidence_bound < 0, res.converged
        (torch.Size([3]), True, True)
    """

    name = "convex_relaxation"
    distributed = True
    description = ("convex variational relaxation for super-Gaussian sites (double loop: IRLS+CG inner, Lanczos "
                   "outer; Nickisch & Seeger 2009)")
    Options = ConvexRelaxationOptions
    State = RelaxationState
    type2 = "outer"
    integrates_hyper = True
    optimality_measure = ("relative change of gamma <= gamma_tol and of phi <= phi_tol between the last two outer "
                          "iterations")

    @classmethod
    def applies(cls, lgm):
        return applies(lgm)

    def precise_options(self):
        return {"gamma_tol": 1e-7, "phi_tol": 1e-11, "max_outer": max(self.options.max_outer, 100)}

    # ------------------------------------------------------------------ type-II maximum likelihood
    def type2_gradient(self, params, x, result, args, kwargs, h):
        """Envelope theorem: ``d/dtheta [C - phi/2]`` at the fixed optimum ``(gamma*, u*)`` of ``phi``
        (:meth:`~.outer.RelaxationState.bound_at`, with the exact ``log|A|``)."""
        from ..type2 import envelope_gradient

        n = result.state.u.shape[0]
        if n > self.options.dense_logdet_max:
            raise ValueError(f"engine '{self.name}': learn_params needs the exact log|A| (n = {n} > "
                             f"dense_logdet_max = {self.options.dense_logdet_max}); raise dense_logdet_max or pass "
                             "learn_params=False")
        method, lanczos = result.state.variance_method, result.state.lanczos
        if method != "exact" and (lanczos is None or lanczos.k < n):
            raise ValueError(f"engine '{self.name}': learn_params needs the relaxation's optimum, which Lanczos "
                             f"variances (variance='{method}', {getattr(lanczos, 'k', 0)} steps for n = {n}) move "
                             "gamma off, so the envelope gradient is not the bound's (its sign can flip); use "
                             f"variance='exact' or 'auto' (n <= exact_max = {self.options.exact_max}), or "
                             f"lanczos_rank >= {n}")
        return envelope_gradient(params, x, self.model, args, kwargs, result.state.bound_at, h)

    def initial_state(self):
        """The state the fit starts from: ``init``, else the warm-start options (``gamma_init``, ...), else ``None``."""
        o = self.options
        if o.gamma_init is None:
            return self.init
        if self.init is not None:
            raise ValueError(f"engine '{self.name}': give init or option 'gamma_init' (with z_init, ...), not both")
        return RelaxationState(o.gamma_init, o.u_init, o.z_init, o.logdet_init)

    def solve(self, lgm, run):
        o = self.options
        if o.variance == "exact" and lgm.n > o.exact_max:
            raise ValueError(f"engine '{self.name}': variance='exact' with n = {lgm.n} > exact_max = {o.exact_max}; "
                             "use variance='lanczos' or 'auto'")
        prob = RelaxationProblem(lgm)
        if o.preconditioner != "jacobi":  # refuse a model without a circulant symbol before any work
            prob.preconditioner(torch.ones(prob.q, dtype=prob.dtype, device=prob.device), o.preconditioner)
        warn_if_not_log_concave(prob.pot)
        state, out = double_loop(prob, o, self.initial_state(), run,
                                 state_names=_OPTION_NAMES if self.init is None else None)
        step = out["step"]
        C = prob.log_const()
        phi = out["best_phi"]
        if step.logdet_method == "unavailable":
            warn(
                "convex_relaxation: no evidence bound (log_evidence_bound=None) and no phi-based stopping: "
                f"n = {lgm.n} > dense_logdet_max = {o.dense_logdet_max} and diag(A) is not available "
                "for the rigorous log|A| bound, because a design operator has no entrywise square (give "
                "FunctionOperators a `squared` operator, or raise dense_logdet_max)", RuntimeWarning)
        bound = C - 0.5 * phi if math.isfinite(phi) else None
        w = 1.0 / state.gamma if prob.q else torch.zeros(0, dtype=prob.dtype, device=prob.device)
        posterior = GaussianPosterior(
            state.u, step.var_u.clamp_min(0), precision_operator=prob.precision_operator(w),
            precision_factor=prob.factor(w), precision_scale=1.0, layout=lgm.layout,
            precision_cholesky=state.cholesky, lanczos=None if state.cholesky is not None else state.lanczos)
        info = self._info(prob, state, out, C, phi)
        optimality, reason = self._optimality(prob, out)
        return Solution(posterior, bound, optimality, reason, info, state=state)

    def _optimality(self, prob, out):
        o = self.options
        if not prob.q:
            return Optimality.exact("Gaussian model: the posterior is exact after one step"), "Gaussian model"
        rel_gamma = out["rel_gamma"][-1] if out["rel_gamma"] else math.inf
        phis = out["phi"]
        rel_phi = (abs(phis[-1] - phis[-2]) / max(1.0, abs(phis[-1]))) if len(phis) >= 2 else math.inf
        if not math.isfinite(rel_phi):
            rel_phi = math.inf
        crit = (Criterion("relative change of gamma", rel_gamma, o.gamma_tol),
                Criterion("relative change of phi", rel_phi, o.phi_tol))
        opt = Optimality(crit)
        return opt, ("gamma and phi converged" if opt.converged else "max_outer")

    def _info(self, prob, state, out, C, phi):
        step, u, gamma = out["step"], state.u, state.gamma
        s = prob.s(u) if prob.q else None
        marg, gam, zz = {}, {}, {}
        for g, sl in zip(prob.groups, prob.group_slices):
            mean = s[sl] + prob.pot.shift[sl]  # eta = B u + offset
            marg[g.name] = (mean, step.z[sl])
            gam[g.name] = gamma[sl]
            zz[g.name] = step.z[sl]
        newton = out["newton_steps"]
        cg_its = out["cg_iterations"]
        mvm = dict(out["mvm"])
        mvm["per_outer"] = [
            {"newton_steps": nw, "cg_iterations": its, "inner_mvm": im, "N_Newt*N_CG": nw * (sum(its) / max(1, len(its)))}
            for nw, its, im in zip(newton, cg_its, out["inner_mvm"])
        ]
        mvm["lanczos_steps"] = out["lanczos_steps"]
        mvm["outer_per_update"] = out["outer_mvm"]
        o = self.options
        return {
            "site_marginals": marg,
            "gamma": gam,
            "z": zz,
            "phi": phi,
            "phi_history": out["phi"],
            "iterations": max(len(out["phi"]) - 1, 0),  # outer variance updates (the first inner loop is not one)
            "best_outer_index": out["best_index"],
            "log_det_method": step.logdet_method,
            "log_det_history": out["logdet"],
            "log_const": C,
            "rel_gamma_history": out["rel_gamma"],
            "inner_converged": out["inner_converged"],
            "mvm": mvm,
            "work": WorkReport(sum(p["newton_steps"] for p in mvm["per_outer"]),
                               sum(sum(p["cg_iterations"]) for p in mvm["per_outer"]),
                               float(mvm["seconds"]["inner"]), float(mvm["seconds"]["outer"])),
            "variance_method": step.method,
            "variance_estimator": step.estimator,
            "variances_are_lower_bounds": step.lower_bounds,
            "lanczos_rank": o.lanczos_rank,
            "lanczos_block_size": o.lanczos_block_size,
            "sigma2": 1.0,
        }


def predictive_marginals(result, design, offset=None):
    """``result.posterior.marginals(design, offset)``: means and variances ``(m,)`` of ``eta = design @ u + offset``
    from the engine's own covariance factor (exact Cholesky, or the Lanczos estimate of the last variance step)."""
    return result.posterior.marginals(design, offset)
