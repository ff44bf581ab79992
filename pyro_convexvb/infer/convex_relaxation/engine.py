"""``ConvexVariationalRelaxation``: the registered engine ``convex_relaxation``."""
import math
import typing
from dataclasses import dataclass

import torch

from ...errors import UnsupportedModelError, warn
from ..engine import Criterion, Engine, LGMEngineOptions, Optimality, Solution, option
from ..posterior import GaussianPosterior
from .outer import double_loop
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
                                    "Nickisch & Seeger 2009)", min=1)
    max_outer: int = option(5, "outer-loop variance updates (each followed by one inner loop)", min=0)
    max_newton: int = option(20, "Newton steps per inner loop", min=1)
    cg_tol: float = option(1e-6, "relative CG residual of the final Newton systems", gt=0)
    variance: typing.Literal["auto", "lanczos", "exact", "pca"] = option(
        "auto", "variance method: exact (dense Cholesky) when cheaper than K-Lanczos ('auto'), K-Lanczos, exact, "
                "or L-PCA (Seeger 2010)")
    lanczos_block_size: int = option(1, "block size b of block Lanczos (1: Nickisch & Seeger's Lanczos)", min=1)
    lanczos_estimator: typing.Literal["auto", "k-lanczos", "whitened"] = option(
        "auto", "Lanczos variance estimator: K-Lanczos lower bounds on the precision (sparse designs), the "
                "whitened covariance form (GP-type dense prior covariances), or chosen by the model ('auto')")
    pca_rank: typing.Optional[int] = option(None, "L of L-PCA (default lanczos_rank // 6)", min=1)
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
    seed: int = option(0, "seed of the Lanczos start vectors")

    def check(self):
        if self.z_init is not None and self.gamma_init is None:
            raise ValueError("option 'z_init' needs 'gamma_init' (the widths the variances belong to)")
        if self.z_init is not None and self.max_outer < 1:
            raise ValueError("option 'z_init' needs 'max_outer' >= 1 (the warm start replaces the first variance "
                             "step only)")


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
    and ``info`` (site marginals, ``gamma``, ``z``, Lanczos ``(Q, T)``, MVM counts per phase, ...).

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
    optimality_measure = ("relative change of gamma <= gamma_tol and of phi <= phi_tol between the last two outer "
                          "iterations")

    @classmethod
    def applies(cls, lgm):
        return applies(lgm)

    def warm_start_options(self, result):
        g = result.info.get("gamma_all")
        return {"gamma_init": g} if g is not None and g.numel() and bool((g > 0).all()) else {}

    def precise_options(self):
        return {"gamma_tol": 1e-7, "phi_tol": 1e-11, "max_outer": max(self.options.max_outer, 100)}

    # ------------------------------------------------------------------ type-II maximum likelihood
    def bound_at(self, lgm, result):
        """``C(theta) - phi(gamma*, u*; theta)/2`` of the fitted ``(gamma*, u*)`` on ``lgm`` (other hyperparameters)."""
        from .outer import phi_value

        if lgm.n > self.options.dense_logdet_max:
            raise ValueError(f"engine '{self.name}': learn_params needs the exact log|A| (n = {lgm.n} > "
                             f"dense_logdet_max = {self.options.dense_logdet_max}); raise dense_logdet_max or pass "
                             "learn_params=False")
        prob = RelaxationProblem(lgm)
        gamma = result.info["gamma_all"]
        q = result.posterior if result.posterior.n == lgm.n and getattr(result.posterior, "coordinates", None) \
            != "model" else lgm.latent_marginal(result.posterior)
        u = q.loc
        A = prob.dense_a(1.0 / gamma if prob.q else None)
        logdet = 2 * torch.log(torch.diagonal(torch.linalg.cholesky(A))).sum()
        return prob.log_const() - 0.5 * phi_value(prob, gamma, u.to(prob.dtype), logdet)

    def type2_gradient(self, params, x, result, args, kwargs, h):
        """Envelope theorem: ``d/dtheta [C - phi/2]`` at the fixed optimum ``(gamma*, u*)`` of ``phi``."""
        from ..type2 import envelope_gradient

        return envelope_gradient(params, x, self.model, args, kwargs, lambda lgm: self.bound_at(lgm, result), h)

    def solve(self, lgm, run):
        o = self.options
        if o.variance == "exact" and lgm.n > o.exact_max:
            raise ValueError(f"engine '{self.name}': variance='exact' with n = {lgm.n} > exact_max = {o.exact_max}; "
                             "use variance='lanczos' or 'auto'")
        prob = RelaxationProblem(lgm)
        warn_if_not_log_concave(prob.pot)
        gen = torch.Generator(device=prob.device).manual_seed(int(o.seed))
        bar = run.bar(total=o.max_outer + 1, unit="outer")
        out = double_loop(prob, generator=gen, history=run.history, progress=bar, k=o.lanczos_rank,
                          block_size=o.lanczos_block_size, max_outer=o.max_outer, max_newton=o.max_newton,
                          cg_tol=o.cg_tol, variance=o.variance, pca_rank=o.pca_rank, newton_tol=o.newton_tol,
                          gamma_tol=o.gamma_tol, phi_tol=o.phi_tol, z_min=o.z_min, gamma_init=o.gamma_init,
                          dense_logdet_max=o.dense_logdet_max, cg_max_iter=o.cg_max_iter, z_init=o.z_init,
                          u_init=o.u_init, logdet_init=o.logdet_init, lanczos_estimator=o.lanczos_estimator,
                          exact_max=o.exact_max)
        step = out["step"]
        u, gamma = out["u"], out["gamma"]
        C = prob.log_const()
        phi = out["best_phi"]
        if step.logdet_method == "unavailable":
            warn(
                "convex_relaxation: no evidence bound (log_evidence_bound=None) and no phi-based stopping: "
                f"n = {lgm.n} > dense_logdet_max = {o.dense_logdet_max} and diag(A) is not available "
                "for the rigorous log|A| bound, because a design operator has no entrywise square (give "
                "FunctionOperators a `squared` operator, or raise dense_logdet_max)", RuntimeWarning)
        bound = C - 0.5 * phi if math.isfinite(phi) else None
        w = 1.0 / gamma if prob.q else torch.zeros(0, dtype=prob.dtype, device=prob.device)
        posterior = GaussianPosterior(
            u, step.var_u.clamp_min(0), precision_operator=prob.precision_operator(w),
            precision_factor=prob.factor(w), precision_scale=1.0, layout=lgm.layout)
        info = self._info(prob, out, C, phi)
        optimality, reason = self._optimality(prob, out)
        return Solution(posterior, bound, optimality, reason, info)

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

    def _info(self, prob, out, C, phi):
        step, u, gamma = out["step"], out["u"], out["gamma"]
        s = prob.s(u) if prob.q else None
        marg, gam, zz = {}, {}, {}
        for g, sl in zip(prob.groups, prob.group_slices):
            mean = s[sl] + prob.pot.shift[sl]  # eta = B u + offset
            marg[g.name] = (mean, step.z[sl])
            gam[g.name] = gamma[sl]
            zz[g.name] = step.z[sl]
        lanczos = None
        if step.lanczos is not None and out.get("variance_estimator") != "whitened":
            lanczos = (step.lanczos.Q, step.lanczos.T())
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
            "gamma_all": gamma,
            "z_all": step.z,
            "lanczos": lanczos,
            "lanczos_result": step.lanczos,
            "cholesky": step.chol,
            "phi": phi,
            "phi_history": out["phi"],
            "best_outer_index": out["best_index"],
            "log_det": step.logdet,
            "log_det_method": step.logdet_method,
            "log_det_history": out["logdet"],
            "log_const": C,
            "rel_gamma_history": out["rel_gamma"],
            "inner_converged": out["inner_converged"],
            "mvm": mvm,
            "variance_method": out.get("variance_method", o.variance),
            "variance_estimator": out.get("variance_estimator"),
            "variances_are_lower_bounds": out.get("variances_are_lower_bounds"),
            "lanczos_rank": o.lanczos_rank,
            "lanczos_block_size": o.lanczos_block_size,
            "sigma2": 1.0,
        }


def predictive_marginals(result, design, offset=None):
    """Means and variances of ``eta = design @ u + offset`` under a fitted ``Q(u|D)`` (e.g. test rows).

    Uses the engine's own covariance representation: the dense Cholesky factor when it was computed
    (exact variances), else the Lanczos factors of the last variance step: K-Lanczos
    ``diag(D Q T^{-1} Q^T D^T)``, a lower bound (Seeger 2010, §4.1), or the whitened covariance-form
    estimate for models with dense prior covariances (``result.info["variance_estimator"]`` says which,
    ``result.info["variances_are_lower_bounds"]`` whether they are lower bounds).

    :param result: an :class:`~pyro_convexvb.InferenceResult` of this engine.
    :param design: ``(m, n)`` dense/sparse tensor or operator.
    :param offset: ``(m,)`` or ``None``.
    :returns: ``(mean (m,), var (m,))``.
    """
    from ...linalg.operators import as_operator

    D = as_operator(design)
    mean = D.mv(result.posterior.loc)
    if offset is not None:
        mean = mean + offset
    L = result.info.get("cholesky")
    if L is not None:
        n = L.shape[0]
        Linv = torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device), upper=False)
        W = D.mv(Linv.transpose(0, 1).contiguous())
        return mean, (W * W).sum(1)
    res = result.info.get("lanczos_result")
    if res is None:
        raise ValueError("the result holds neither a Cholesky factor nor Lanczos factors")
    return mean, res.variances(D)
