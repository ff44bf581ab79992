r"""Minimisers of the dual VG objective that never leave the conjugates' domains and stop on the duality gap.

* :func:`solve_dual` -- the reduced dual in ``alpha`` (``lambda = ell(alpha)``): Newton with the
  closed-form Hessian (default; ``O(N^3)`` per step, a handful of steps) or L-BFGS preconditioned like
  Newton-CG (``O(N L^2 + L^3)`` per step in L-space).
  The components of a step that would leave the domain are cut to a fraction of their distance to its boundary
  (the whole step where that is no descent direction), then the step is backtracked
  (Armijo); the iteration stops when the duality gap ``g - ELBO_LVB = sum_n FY_n`` (a sum of
  per-site Fenchel-Young residuals; ``docs/dual_vg.md``, § Dual decomposition) is below ``gap_tol``.
* :func:`minimize_joint` -- the joint ``(alpha, lambda)`` dual for a
  :class:`~.bounds.GenericBound` whose conjugate comes from a 2-D inner maximisation; L-BFGS
  with ``+inf`` outside the effective domain (the line search backtracks), gradient by Danskin.
"""
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import NotPositiveDefiniteError, warn
from ...linalg.cg import cg
from ...linalg.lbfgs import LBFGSMemory
from ...linalg.linesearch import armijo, backtrack
from ..result import History
from .bounds import numerical_conjugate
from .objective import reduced_objective
from ...distributed import LOCAL, reduction_of

__all__ = ["DualSolution", "solve_dual", "minimize_joint", "initial_alpha", "default_gap_tol", "refine_exact"]


@dataclass
class DualSolution:
    """Result of a dual solve: the optimum, the gap and the iteration record."""

    alpha: torch.Tensor
    lam: torch.Tensor
    g: float
    gap: float
    m_tilde: torch.Tensor
    v_tilde: torch.Tensor
    iterations: int
    evaluations: int
    converged: bool
    history: Any = field(default_factory=History)
    cg_iterations: int = 0  # conjugate-gradient steps of the matrix-free Newton systems (L-space form)
    gap_tol: float = 0.0  # the tolerance the gap was held to: gap_tol, or the gap's rounding floor if larger
    stop_reason: str = ""  # "duality gap", "max_iter", or why the iteration stopped early without closing the gap


#: Newton stops, unconverged, once ``g`` no longer changes in float64 and the duality gap has not fallen below 99% of
#: its best value for this many steps (seen at counts ~1e6, where rounding in the site means holds the gap at 1-3x
#: its rounding floor; the steps up to the cap of 100 changed nothing)
STALL_STEPS = 10


def default_gap_tol(num_sites):
    """Default duality-gap tolerance in nats: ``1e-8 * max(1, N)`` (a relative accuracy far below Monte Carlo noise)."""
    return 1e-8 * max(1, num_sites)


#: why a dual start or iteration fails on some data, and what to do
FAR_START = ("Either the start at the prior marginals put the sites' predictors far out (e.g. Gamma or Poisson rates "
             "of exp(100) from covariates of large scale: standardise the covariates or tighten the prior, or use "
             "engine='laplace'), or the prior covariance is numerically singular (e.g. a MultivariateNormal "
             "scale_tril with a diagonal entry near 0, which a type-II search over it can reach: give it a floor)")


def initial_alpha(backend, bound):
    r"""Start ``alpha_n = df_n/dh`` at the prior marginals ``(mu_t, diag Sigma_t)``, or at the bound's data start
    (:meth:`~.bounds.LocalBound.data_alpha`) where that has the lower reduced dual objective.

    ``docs/dual_vg.md``, § Algorithm and recovery, step 1.

    Where the bound has a data start (sites of unbounded curvature, such as Poisson counts), a third candidate
    is the dual point at the Laplace approximation (:func:`_laplace_start`); the candidate with the lowest
    reduced dual objective is taken.
    """
    h, rho = backend.prior_marginals()
    a = _clip_into(bound.alpha_star(h, rho), bound)
    b = _clip_into(bound.data_alpha(h, rho), bound)
    if torch.equal(a, b):
        return a  # one candidate (an infeasible one fails in the solver, which says so)
    best, g_best = None, math.inf
    for cand in (a, b, None):
        if cand is None:  # the Laplace start, from the data start
            try:
                cand = _laplace_start(backend, bound, b, h=h)
            except (torch.linalg.LinAlgError, NotPositiveDefiniteError):
                cand = None
            if cand is None:
                continue
        g = _start_value(backend, bound, cand)
        if math.isfinite(g) and g < g_best:
            best, g_best = cand, g
    if best is None:
        raise NotPositiveDefiniteError("dual_vg: no starting point of the dual (prior marginals, data start, Laplace "
                                       f"start) has a positive definite posterior precision. {FAR_START}")
    return best


def _start_value(backend, bound, alpha):
    """The reduced dual objective at a candidate start, ``inf`` where the precision it implies is not positive
    definite (a start at the prior marginals with rates of ``exp(100)`` is one)."""
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # a far candidate overflows; it is rejected, not reported
            g = reduced_objective(backend, bound, alpha, gradient=False).g
    except (torch.linalg.LinAlgError, NotPositiveDefiniteError):
        return math.inf
    return float(g) if torch.isfinite(g) else math.inf


def _site_derivatives(bound, h):
    """``(f'(h, 0), f''(h, 0))`` per site by automatic differentiation (each ``f_n`` depends on ``h_n`` only)."""
    h = h.detach().requires_grad_(True)
    with torch.enable_grad():
        d1, = torch.autograd.grad(bound.f(h, torch.zeros_like(h)).sum(), h, create_graph=True)
        d2, = torch.autograd.grad(d1.sum(), h)
    return d1.detach(), d2.detach()


#: the Laplace start's IRLS stops once a step lowers the log joint by at most this many nats per site: it is a
#: starting point for the dual Newton iteration, which converges from there (on Poisson lattices the next step
#: would gain ~1e-10 nats per site; counts of 1e6 take the steps they need, which gain 10^2-10^8 nats)
LAPLACE_START_TOL = 1e-4


def _laplace_start(backend, bound, alpha0, max_newton=50, h=None):
    r"""The dual point at the Laplace approximation: ``alpha = df/dh`` at its site means and variances.

    Damped Newton on the log joint (iteratively reweighted least squares, McCullagh & Nelder 1989, §2.5),
    written in the dual coordinates of the site means, ``m(a) = mu_t - Sigma_t a``, where the negative log
    joint is ``Phi(a) = sum_n f_n(m_n(a), 0) + a^T (mu_t - m(a)) / 2``. At site means ``h`` the likelihood is
    replaced by Gaussian pseudo-observations of precision ``w = f''(h, 0)`` and target ``h - f'(h, 0) / w``,
    i.e. site potentials ``exp(b h - w h^2 / 2)`` with ``b = w h - f'(h, 0)``; the backend's ``working_means``
    gives the means of that Gaussian (one factorisation and solve, no variances), and its dual point is
    ``a = w m - b``. The step to it is halved until ``Phi`` decreases, and the iteration stops once a step
    gains at most :data:`LAPLACE_START_TOL` nats per site. The site variances are computed once, at the end,
    with the precisions of the last accepted step. The first linearisation is at the bound's data start, its
    sites' own maximum-likelihood predictors (:meth:`~pyro_convexvb.lgm.families.bound.LocalBound.data_mean`: for
    counts ``eta = log(y + 1/2)``, for Gamma responses ``log y``). Returns ``None`` where the iteration produces no
    finite point. ``h``: the prior marginals' means, the linearisation point of sites without a data start.
    """
    red = reduction_of(backend)

    def phi(a, m):
        return float(red.sum(bound.f(m, torch.zeros_like(m)).sum() + 0.5 * (a * (backend.mu_t - m)).sum()))

    def working_solution(h):
        """``(w, a, m)``: site precisions, dual point and site means of the Gaussian step at site means ``h``."""
        d1, d2 = _site_derivatives(bound, h)
        if not red.all(bool(torch.isfinite(d1).all() and torch.isfinite(d2).all())):
            return None
        w = d2.clamp_min(-1e-12 * red.min(-float(d2.abs().max())) + torch.finfo(d2.dtype).tiny)
        b = w * h - d1
        m = backend.working_means(w, b)
        if not red.all(bool(torch.isfinite(m).all())):
            return None
        return w, w * m - b, m

    num_sites = max(1, red.count(alpha0.shape[0]))  # over every rank, as f is
    if h is None:
        h, _ = backend.prior_marginals()
    sol = working_solution(bound.data_mean(h).to(alpha0))
    if sol is None:
        return None
    w, a, m = sol
    f = phi(a, m)
    for _ in range(max_newton):
        sol = working_solution(m)
        if sol is None or not math.isfinite(f):
            break
        w_new, a_new, m_new = sol

        def trial(t, a_new=a_new, m_new=m_new, a=a, m=m, f=f):
            a_t, m_t = a + t * (a_new - a), m + t * (m_new - m)
            f_t = phi(a_t, m_t)
            return (a_t, m_t, f_t) if math.isfinite(f_t) and f_t <= f else None

        _, accepted = backtrack(trial, max_trials=40)
        if accepted is None:
            break
        a_t, m_t, f_t = accepted
        done = f - f_t <= max(LAPLACE_START_TOL * num_sites, 1e-12 * max(1.0, abs(f)))
        a, m, w, f = a_t, m_t, w_new, f_t
        if done:
            break
    v = backend.evaluate(a, w).v_tilde
    cand = _clip_into(bound.alpha_star(m, v), bound)
    return cand if red.all(bool(torch.isfinite(cand).all())) else None


def _clip_into(a, bound, margin=1e-10):
    """Move entries of ``a`` that are not strictly inside the domain just inside it (others are kept)."""
    lo, hi = bound.alpha_domain(a)
    width = torch.where(torch.isfinite(hi - lo), hi - lo, torch.ones_like(a))
    a = torch.where(torch.isfinite(lo) & (a <= lo), lo + margin * width, a)
    a = torch.where(torch.isfinite(hi) & (a >= hi), hi - margin * width, a)
    return a


def _max_step(alpha, d, bound, fraction=0.995, red=LOCAL):
    lo, hi = bound.alpha_domain(alpha)
    big = torch.full_like(alpha, math.inf)
    up = torch.where((d > 0) & torch.isfinite(hi), (hi - alpha) / d, big)
    dn = torch.where((d < 0) & torch.isfinite(lo), (lo - alpha) / d, big)
    t = red.min(float(torch.minimum(up, dn).min()) if alpha.numel() else math.inf)
    return min(1.0, fraction * t)


def _clip_direction(alpha, d, bound, fraction=0.995):
    """Per-coordinate fraction-to-boundary: shorten only the components of ``d`` that would leave the domain.

    A single site close to its boundary then no longer limits the step of all the others (the
    global rule of :func:`_max_step` would); used when it is still a descent direction.
    """
    lo, hi = bound.alpha_domain(alpha)
    up = torch.where(torch.isfinite(hi), fraction * (hi - alpha), torch.full_like(alpha, math.inf))
    dn = torch.where(torch.isfinite(lo), fraction * (lo - alpha), torch.full_like(alpha, -math.inf))
    return torch.minimum(torch.maximum(d, dn), up)


def _fraction_to_boundary(alpha, d, val, bound, red=LOCAL):
    """The search direction and first step of a line search from ``alpha`` along ``d`` that stays in the domain.

    The components of ``d`` that would leave the domain are shortened (:func:`_clip_direction`) and the full step
    is tried, as long as that is still a descent direction; otherwise the whole step is cut to a fraction of the
    distance to the boundary (:func:`_max_step`). The global rule alone jams wherever one site's own descent
    heads for its boundary: each step then covers 99.5% of that site's remaining distance and the step of every
    other site shrinks with it, geometrically (a logistic dual started at ``kappa = 1 - 8e-8`` whose conditional
    optimum sits at ``1 - 1e-25`` moved no site by more than ``1e-9`` in 20000 iterations).

    :returns: ``(d, t)``.
    """
    dc = _clip_direction(alpha, d, bound)
    if red.dot(val.grad, dc) < 0:
        return dc, 1.0
    return d, _max_step(alpha, d, bound, red=red)


def _gap(bound, alpha, val, red=LOCAL):
    return float(red.sum(bound.fenchel_young_residual(alpha, val.m_tilde, val.v_tilde).sum()))


def gap_rounding_floor(bound, alpha, val, red=LOCAL):
    r"""How small a duality gap float arithmetic can certify at this iterate: below it, the computed gap is
    indistinguishable from zero.

    The gap is a sum of ``N`` Fenchel-Young residuals ``f + psi - alpha h - lambda rho / 2``, each a difference
    of terms of magnitude ``T_n = |f| + |psi| + |alpha h| + |lambda rho| / 2``. With a few operations per term
    and pairwise summation, the rounding error of the computed sum is at most
    ``(6 + ceil(log2 N)) eps sum_n T_n`` (Higham 2002, *Accuracy and Stability of Numerical Algorithms*, §4.2).
    For sites with large counts (``y ~ 1e6``: each term ``~ 1e7`` nats) this exceeds the default ``1e-8 N``.
    """
    h, rho = val.m_tilde, val.v_tilde
    lam = bound.ell(alpha)[0]
    T = bound.f(h, rho).abs() + bound.psi(alpha)[0].abs() + (alpha * h).abs() + 0.5 * (lam * rho).abs()
    n = red.count(alpha.shape[0])
    return (6 + math.ceil(math.log2(max(n, 2)))) * torch.finfo(alpha.dtype).eps * float(red.sum(T.sum()))


def solve_dual(backend, bound, alpha0=None, *, method="newton", gap_tol=None, max_iter=None, memory=20,
               history=None, on_fail="warn", callback=None, newton_solver="auto"):
    r"""Minimise the reduced dual ``g(alpha)`` (Khan et al. 2013, Eq. 20 with ``lambda = ell(alpha)``).

    :param backend: :class:`~.objective.SiteSpaceBackend`, :class:`~.objective.LatentSpaceBackend` or
        :class:`~.objective.BandedPrecisionBackend`.
    :param bound: a :class:`~.bounds.LocalBound` over the ``N`` sites.
    :param torch.Tensor alpha0: ``(N,)`` warm start (clipped into the domain); default :func:`initial_alpha`.
    :param str method: ``"newton"`` or ``"lbfgs"``.
    :param float gap_tol: stop when the duality gap (nats) is below it (default :func:`default_gap_tol`).
    :param int max_iter: iteration cap (default 100 for Newton, 2000 for L-BFGS).
    :param str on_fail: ``"warn"`` (:class:`~pyro_convexvb.ConvergenceWarning`), ``"raise"``, or ``"ignore"``
        (the caller reports ``converged`` itself, as the engines do).
    :param str newton_solver: how a Newton step is solved: ``"dense"`` (Cholesky of the ``N x N``
        Hessian), ``"cg"`` (matrix-free preconditioned CG, ``O(N L^2)`` per product; L-space form only,
        see :class:`~.objective.LatentSpaceHessian`) or ``"auto"`` (the cheaper of the two by a flop count).
    :returns: :class:`DualSolution`.

    Example::

        >>> import torch
        >>> from pyro_convexvb.lgm.sites import BernoulliLogit
        >>> from pyro_convexvb.infer.dual_vg import SiteSpaceBackend, make_bound
        >>> X = torch.linspace(-2, 2, 6, dtype=torch.float64)[:, None]
        >>> K = torch.exp(-0.5 * (X - X.T) ** 2)
        >>> y = (X[:, 0] > 0).double()
        >>> sol = solve_dual(SiteSpaceBackend(K, torch.zeros(6, dtype=torch.float64)), make_bound(BernoulliLogit(y)))
        >>> sol.converged, sol.gap < 1e-7
        (True, True)
    """
    if method not in ("newton", "lbfgs"):
        raise ValueError(f"method: expected 'newton' or 'lbfgs', got {method!r}")
    if method == "newton" and getattr(backend, "kind", "") == "banded" and not hasattr(backend, "hessian_operator"):
        method = "lbfgs"
    red = reduction_of(backend)
    N = red.count(len(bound))
    gap_tol = default_gap_tol(N) if gap_tol is None else float(gap_tol)
    max_iter = (100 if method == "newton" else 2000) if max_iter is None else int(max_iter)
    history = History() if history is None else history
    alpha = initial_alpha(backend, bound) if alpha0 is None else _clip_into(alpha0.detach().clone(), bound)
    if not red.all(bool(torch.isfinite(alpha).all())):
        raise ValueError("alpha0: the starting point contains NaN or inf")
    if method == "newton":
        return _newton(backend, bound, alpha, gap_tol, max_iter, memory, history, on_fail, callback, newton_solver)
    return _lbfgs(backend, bound, alpha, gap_tol, max_iter, memory, history, on_fail, callback)


def _check_converged(converged, gap, it, on_fail, gap_tol, method, reason=None):
    """Raise, warn or stay silent (``on_fail``) when the gap was not closed."""
    if converged or on_fail == "ignore":
        return
    msg = f"dual_vg ({method}) stopped after {it} iterations with duality gap {gap:.3g} > gap_tol {gap_tol:.3g}"
    if reason:
        msg += f": {reason}"
    if on_fail == "raise":
        from ...errors import ConvergenceError

        raise ConvergenceError(msg, residual=gap, iterations=it)
    warn(msg)


def _finish(alpha, val, gap, it, nev, converged, history, on_fail, gap_tol, method, reason=None):
    _check_converged(converged, gap, it, on_fail, gap_tol, method, reason)
    stop = "duality gap" if converged else (reason or "max_iter")
    return DualSolution(alpha, val.lam, float(val.g), gap, val.m_tilde, val.v_tilde, it, nev, converged, history,
                        gap_tol=gap_tol, stop_reason=stop)


def _use_operator_hessian(backend, newton_solver):
    """Dense ``N x N`` Newton system or matrix-free PCG (``"auto"``: PCG when it is the cheaper one)."""
    if newton_solver not in ("auto", "dense", "cg"):
        raise ValueError(f"newton_solver: expected 'auto', 'dense' or 'cg', got {newton_solver!r}")
    if getattr(backend, "comm", None) is not None:  # row-sharded sites: no N x N matrix anywhere
        if newton_solver == "dense":
            raise ValueError("dual_vg: option newton_solver='dense' needs every site in one process; with row-sharded "
                             "data use newton_solver='cg' or 'auto' (matrix-free Newton-CG)")
        return True
    sparse_form = getattr(backend, "kind", "") in ("banded", "sparse")  # sparse precision forms: no dense Hessian
    if newton_solver == "dense" and sparse_form:
        raise ValueError(f"dual_vg: option newton_solver='dense' needs the N x N Hessian, which the "
                         f"{backend.kind} form (a sparse precision) never forms; use newton_solver='cg' or 'auto' "
                         "(matrix-free Newton-CG), or method='lbfgs'")
    if not hasattr(backend, "hessian_operator") and newton_solver == "cg":
        raise ValueError(f"dual_vg: option newton_solver='cg' needs a matrix-free Hessian, which the "
                         f"{getattr(backend, 'kind', type(backend).__name__)} form does not have (its Newton step "
                         "is a Cholesky of the N x N system); use newton_solver='auto' or 'dense', or a form with "
                         "Newton-CG: form='latent', 'banded' or 'sparse'")
    if not hasattr(backend, "hessian_operator") or newton_solver == "dense":
        return False
    if newton_solver == "cg" or sparse_form:
        return True
    N, L = backend.N, backend.L
    # dense: Cholesky of H (N^3/3) and forming V_t, Sigma_t (2 N^2 L). PCG: a preconditioner set-up
    # and a few products of 4 N L^2 each (the Woodbury preconditioner leaves out only the off-diagonal
    # Hadamard term, and 1-3 CG steps per Newton step are typical); budget 5 products.
    return N ** 3 / 3 + 2 * N ** 2 * L > 20 * N * L ** 2


def _newton_cg_step(H, grad, cg_max_iter, red):
    """Inexact Newton direction ``H d = -grad`` by preconditioned CG on a matrix-free Hessian: truncated at
    non-positive curvature (Steihaug 1983), from ``x0 = 0``, relative tolerance ``min(0.1, sqrt|grad|)``.

    The Woodbury preconditioner is tried first; where rounding makes it indefinite (its two terms cancel when
    the site curvatures span many orders of magnitude), the step is solved again with its diagonal (Jacobi)
    form, which is positive definite in any arithmetic. Row-sharded sites sum CG's inner products over ranks
    (``cg(reduction=)``). :returns: ``(d, cg_iterations)``."""
    from ...errors import NotPositiveDefiniteError

    def solve(precond):
        res = cg(H.mv, -grad, precond=lambda R: precond(R[:, 0])[:, None], rtol=min(0.1, math.sqrt(red.norm(grad))),
                 max_iter=cg_max_iter, on_fail="ignore", true_residual=False, on_negative_curvature="truncate",
                 reduction=red if red.active else None)
        return res.x, res.iterations

    try:
        return solve(H.precondition)
    except NotPositiveDefiniteError:
        return solve(H.precondition_diagonal)


def _newton_direction(val, cg_max_iter, red):
    """Newton direction ``H d = -grad`` at ``val``: Cholesky of the dense Hessian (jittered until positive
    definite in floating point) or :func:`_newton_cg_step` on the matrix-free one. :returns: ``(d, cg_its)``."""
    H = val.hessian
    if not torch.is_tensor(H):
        return _newton_cg_step(H, val.grad, cg_max_iter, red)
    Lh, info = torch.linalg.cholesky_ex(H)
    jitter = 1e-12 * float(H.diagonal().abs().max())
    while int(info) != 0:
        jitter *= 10
        Lh, info = torch.linalg.cholesky_ex(H + jitter * torch.eye(H.shape[0], dtype=H.dtype, device=H.device))
    return -torch.cholesky_solve(val.grad[:, None], Lh)[:, 0], 0


def _record(bound, alpha, val, red, history, evaluations, callback):
    """Record an iterate (objective, duality gap, ELBO) and pass it to ``callback``. :returns: the gap."""
    gap = _gap(bound, alpha, val, red)
    history.record(objective=float(val.g), gap=gap, elbo=float(val.g) - gap, evaluations=evaluations)
    if callback is not None:
        callback(alpha, val, gap)
    return gap


def _line_search(backend, bound, alpha, d, val, t, red, **objective_options):
    """Backtrack from step ``t`` along ``d`` until the reduced dual decreases enough (Armijo).

    :returns: ``((alpha + t d, its objective) or None, objective evaluations)``.
    """
    slope, evaluations = red.dot(val.grad, d), 0

    def trial(t):
        nonlocal evaluations
        cand = alpha + t * d
        new = reduced_objective(backend, bound, cand, **objective_options)
        evaluations += 1
        return (cand, new) if armijo(float(new.g), float(val.g), t, slope) else None

    return backtrack(trial, t)[1], evaluations


def _newton(backend, bound, alpha, gap_tol, max_iter, memory, history, on_fail, callback, newton_solver="auto",
            cg_max_iter=200):
    mode = "operator" if _use_operator_hessian(backend, newton_solver) else True
    # "auto" may switch from Newton-CG to the dense system when CG steps no longer change g (inexact directions
    # at the limit of float resolution; seen with counts ~1e6), where the dense Hessian exists and fits in memory
    can_densify = (newton_solver == "auto" and mode == "operator" and getattr(backend, "comm", None) is None
                   and getattr(backend, "kind", "") not in ("banded", "sparse") and backend.N <= 8000)
    red = reduction_of(backend)
    unchanged, tol, reason = 0, gap_tol, None
    best_gap, since_best = math.inf, 0
    cg_iterations = 0
    val = reduced_objective(backend, bound, alpha, hessian=mode)
    if not torch.isfinite(val.g):
        raise ValueError("the starting alpha lies outside the conjugate's domain")
    nev, converged, it = 1, False, 0
    for it in range(max_iter + 1):
        gap = _record(bound, alpha, val, red, history, nev, callback)
        if gap <= gap_tol:
            converged = True
            break
        best_gap, since_best = (gap, 0) if gap < 0.99 * best_gap else (best_gap, since_best + 1)
        if unchanged >= 2 or it == max_iter:  # g no longer changes: is the gap within float64's resolution?
            floor = gap_rounding_floor(bound, alpha, val, red)
            if gap <= floor:
                converged, tol = True, floor
                break
            if unchanged >= 2 and since_best >= STALL_STEPS and not can_densify:
                reason = (f"no progress at float64 resolution: g constant and the gap not lower for {since_best} "
                          f"steps, {gap / floor:.2g}x its rounding floor {floor:.2g}")
                break
        if it == max_iter:
            break
        d, its = _newton_direction(val, cg_max_iter, red)
        cg_iterations += its
        d, t = _fraction_to_boundary(alpha, d, val, bound, red)
        accepted, evaluations = _line_search(backend, bound, alpha, d, val, t, red, gradient=False)
        nev += evaluations
        if accepted is None:  # at machine precision: no decrease possible any more
            floor = gap_rounding_floor(bound, alpha, val, red)
            converged, tol = (True, floor) if gap <= floor else (False, tol)
            reason = None if converged else f"no decrease along the Newton direction (gap rounding floor {floor:.2g})"
            break
        cand, new = accepted
        unchanged = unchanged + 1 if float(new.g) == float(val.g) else 0
        if can_densify and unchanged >= 3:
            mode, can_densify, unchanged = True, False, 0
        alpha = cand
        val = reduced_objective(backend, bound, alpha, hessian=mode)  # reuses the factorisation of the trial
    sol = _finish(alpha, val, gap, it, nev, converged, history, on_fail, tol, "newton", reason)
    sol.cg_iterations = cg_iterations
    return sol


class PreconditionedLBFGSMemory(LBFGSMemory):
    r"""L-BFGS whose initial inverse Hessian ``H_k^0`` is a preconditioner of the reduced dual Hessian taken afresh
    at every iterate, instead of the scalar ``s^T y / y^T y`` (Nocedal & Wright 2006, §7.2 and §9.1: any positive
    definite ``H_k^0``, which may change from one iteration to the next).

    The conjugate's curvature ``psi''(alpha_n)`` is ``1 / lambda_n`` for Poisson sites (``alpha = lambda - y``),
    so the diagonal of the dual Hessian spans as many orders of magnitude as the site rates, and on a latent
    form the prior part ``Sigma_t = W Sigma W^T`` has rank ``L``: one scalar scales neither (with it the
    iteration was still ``1e-4`` nats from closing the gap after 2000 steps on 36 Poisson sites with rates from
    ``1e-5`` to ``400``). :func:`_preconditioner` gives the Woodbury preconditioner ``(Sigma_t + D_p)^{-1}`` of
    Newton-CG where the form has a matrix-free Hessian (:class:`~.objective.LatentSpaceHessian`, ``O(N L^2)`` per
    iterate; :class:`~.objective.SparsePrecisionHessian` and :class:`~.sparse.SparseLatentHessian`, one sparse
    factorisation per iterate), and the ``N x N`` site form the inverse of the Hessian's diagonal (Jacobi), ``O(N)``.
    """

    def direction(self, grad, precondition, diagonal):
        """``-H grad`` with ``H^0 = precondition``; where that is not a descent direction the memory is reset and
        ``-precondition(grad)`` is taken, or, where rounding makes that one no descent direction either (the
        Woodbury form subtracts nearly equal terms when the site curvatures span many orders of magnitude),
        ``-diagonal(grad)`` (division by the Hessian's positive diagonal: a descent direction in any arithmetic)."""
        self._pre = precondition
        d = -self._two_loop(grad)
        if self.dot(grad, d) >= 0:
            self.reset()
            d = -precondition(grad)
            if self.dot(grad, d) >= 0:
                d = -diagonal(grad)
        return d

    def initial(self, q):
        """``H^0 q``: the preconditioner of the current iterate."""
        return self._pre(q)


def _preconditioner(backend, bound, alpha, val, prior_var):
    r"""``(precondition, diagonal)``: two approximations ``r -> P^{-1} r`` of the inverse reduced dual Hessian at
    ``alpha`` (:func:`~.objective.reduced_objective`), the second by its diagonal
    ``diag(Sigma_t) + ell'^2 v_t^2 / 2 + psi'' - ell'' v_t / 2``, which is positive (each term is nonnegative,
    and ``psi''``, the curvature of a strictly convex conjugate, is positive inside the domain).

    Where the backend has a matrix-free Hessian (the latent, banded and sparse forms), ``precondition`` is its
    Woodbury preconditioner (it keeps the prior part ``Sigma_t`` exactly) and ``diagonal`` its Jacobi form; on the
    site form both are the diagonal, from ``prior_var()`` (the prior site variances ``diag(Sigma_t)``, computed
    once) and the site variances ``v_t`` of the iterate.
    """
    _, dl, d2l = bound.ell(alpha)
    d2psi = bound.psi(alpha)[2]
    v = val.v_tilde
    site = d2psi - 0.5 * d2l * v
    if hasattr(backend, "hessian_operator"):
        H = backend.hessian_operator(val.lam, dl, site)
        return H.precondition, H.precondition_diagonal
    diagonal = (prior_var() + 0.5 * dl * dl * v * v + site).clamp_min(torch.finfo(v.dtype).tiny)

    def jacobi(r):
        return r / diagonal
    return jacobi, jacobi


def _lbfgs(backend, bound, alpha, gap_tol, max_iter, memory, history, on_fail, callback):
    red = reduction_of(backend)
    val = reduced_objective(backend, bound, alpha)
    if not torch.isfinite(val.g):
        raise ValueError("the starting alpha lies outside the conjugate's domain")
    mem = PreconditionedLBFGSMemory(memory, red.dot)
    cache = {}

    def prior_var():
        if "v" not in cache:
            cache["v"] = backend.prior_marginals()[1]
        return cache["v"]

    nev, converged, it = 1, False, 0
    for it in range(max_iter + 1):
        gap = _record(bound, alpha, val, red, history, nev, callback)
        if gap <= gap_tol:
            converged = True
            break
        if it == max_iter:
            break
        d = mem.direction(val.grad, *_preconditioner(backend, bound, alpha, val, prior_var))
        d, t = _fraction_to_boundary(alpha, d, val, bound, red)
        accepted, evaluations = _line_search(backend, bound, alpha, d, val, t, red)
        nev += evaluations
        if accepted is None:
            if len(mem):
                mem.reset()
                continue
            break
        cand, new = accepted
        mem.update(cand - alpha, new.grad - val.grad)
        alpha, val = cand, new
    return _finish(alpha, val, gap, it, nev, converged, history, on_fail, gap_tol, "lbfgs")


# ----------------------------------------------------------------------------- joint form
def minimize_joint(backend, bound, alpha0, lam0, *, gap_tol=None, max_iter=500, memory=20, history=None,
                   on_fail="warn"):
    r"""Joint ``(alpha, lambda)`` dual for a :class:`~.bounds.GenericBound` (Khan et al. 2013, Eq. 20).

    ``f*`` by :func:`~.bounds.numerical_conjugate` (warm-started per site); gradient
    ``(-m_t + h*, -v_t/2 + rho*/2)`` by Danskin; L-BFGS whose line search backtracks from
    ``+inf`` (outside the effective domain or ``lambda < 0``). Stops on the duality gap.

    :returns: :class:`DualSolution`.
    """
    if getattr(backend, "comm", None) is not None:
        raise ValueError("dual_vg: the joint (alpha, lambda) dual of a generic bound does not run on row-sharded "
                         "sites; use a family with a closed-form bound (Bernoulli logit/probit, Poisson, Gaussian)")
    N = alpha0.shape[0]
    gap_tol = default_gap_tol(N) if gap_tol is None else float(gap_tol)
    history = History() if history is None else history
    state = {"h": None, "rho": None}

    def evaluate(x):
        a, l = x[:N], x[N:]
        if bool((l < 0).any()):
            return math.inf, None, None
        fs, h, rho, _ = numerical_conjugate(bound, a, l, state["h"], state["rho"])
        if not bool(torch.isfinite(fs).all()):
            return math.inf, None, None
        t = backend.evaluate(a, l)
        g = -0.5 * a @ (backend.mu_t + t.m_tilde) - 0.5 * t.logdet_B + fs.sum()
        grad = torch.cat([-t.m_tilde + h, -0.5 * t.v_tilde + 0.5 * rho])
        return float(g), grad, (t, h, rho, fs)

    x = torch.cat([alpha0, lam0]).clone()
    g, grad, extra = evaluate(x)
    if not math.isfinite(g):
        raise ValueError("(alpha0, lam0) lies outside the conjugate's effective domain")
    state["h"], state["rho"] = extra[1], extra[2]
    mem = LBFGSMemory(memory)
    converged, it, nev = False, 0, 1
    gap = math.inf
    for it in range(max_iter + 1):
        t_, h, rho, fs = extra
        a, l = x[:N], x[N:]
        gap = float((bound.f(t_.m_tilde, t_.v_tilde) + fs - a * t_.m_tilde - 0.5 * l * t_.v_tilde).sum())
        history.record(objective=g, gap=gap, elbo=g - gap, evaluations=nev)
        if gap <= gap_tol:
            converged = True
            break
        if it == max_iter:
            break
        d = mem.direction(grad)
        slope = float(grad @ d)

        def trial(t, d=d, g=g, slope=slope):
            nonlocal nev
            cand = x + t * d
            new = evaluate(cand)
            nev += 1
            return (cand,) + new if armijo(new[0], g, t, slope) else None

        _, accepted = backtrack(trial)
        if accepted is None:
            if len(mem):
                mem.reset()
                continue
            break
        cand, gn, gradn, extran = accepted
        mem.update(cand - x, gradn - grad)
        x, g, grad, extra = cand, gn, gradn, extran
        state["h"], state["rho"] = extra[1], extra[2]
    _check_converged(converged, gap, it, on_fail, gap_tol, "joint L-BFGS")
    return DualSolution(x[:N], x[N:], g, gap, extra[0].m_tilde, extra[0].v_tilde, it, nev, converged, history)


# ----------------------------------------------------------------------------- exact refinement
def _cvi_residual(lam, nu, lam_hat, nu_hat):
    """Largest change of a site natural parameter by a full CVI step, relative to ``1 + |parameter|``."""
    return max(float(((lam_hat - lam).abs() / (1 + lam.abs())).max()),
               float(((nu_hat - nu).abs() / (1 + nu.abs())).max()))


#: a residual-judged ``refine_exact`` run is still making progress while a step raises the exact bound by more than
#: this (relative): far from the optimum the CVI residual can stay put for many such steps
REFINE_RISE_RTOL = 1e-10


#: the CVI residual (a relative change) cannot be resolved below this: under it, its changes are rounding's, and a
#: residual-judged ``refine_exact`` run that only wobbles there has stalled
REFINE_RESIDUAL_FLOOR = 1e-13


def refine_exact(backend, bound, alpha, lam, *, step=1.0, max_iter=100, tol=1e-10, num_points=64, history=None,
                 residual_tol=None, return_residual=False):
    r"""Polish a dual optimum into the *exact* VG optimum by the natural-gradient (CVI) fixed point.

    Over 80 lines: most of it is this docstring; the body is one damped fixed-point loop with its two stopping
    rules.

    The LVB optimum is a few nats from the exact VG optimum for Bernoulli-logit sites (its bound
    is an upper bound on ``-E log p``), and further for a surrogate bound (Laplace sites). Starting from it, damped
    CVI updates (Khan & Lin 2017) of the site natural parameters ``nu = lam * m_t - alpha`` and ``lam`` with the
    exact gradients (:meth:`~pyro_convexvb.lgm.families.SiteFamily.expected_log_prob_terms`: Gauss-Hermite on the
    ``num_points`` nodes of the reported bound's quadrature, or a family's closed forms),
    ``lam <- (1-b) lam - 2 b dE/dv``, ``nu <- (1-b) nu + b (dE/dm - 2 m_t dE/dv)``, reach
    the exact optimum (where ``alpha = -dE/dm`` and ``lam = -2 dE/dv``, the Opper-Archambeau conditions) in a few
    steps of one factorisation each. The new ``alpha = lam m_t - nu``, with ``m_t`` the site means of
    ``prior x prod_n exp(nu_n h_n - lam_n h_n^2 / 2)`` (the backend's ``working_means``: in the site form
    ``(I + Lam Sigma_t) alpha = Lam mu_t - nu`` by the Woodbury form of ``B``, in the latent and sparse forms one
    solve with ``A = Sigma^{-1} + W^T Lam W``). Every iterate is a Gaussian of the dual form, so the exact bound is
    evaluated as the dual's own terms are; steps that lower it are halved.

    :param backend: a site, latent or sparse backend of :mod:`.objective` (not row-sharded).
    :param bound: the local bound (only its families are used, for the exact expectations).
    :param residual_tol: if given, converged means the fixed-point residual (below) is at most this, and the
        run stops there, or (not converged) when five steps in a row have neither cut the residual by 10% (above
        :data:`REFINE_RESIDUAL_FLOOR`) nor raised the bound by more than :data:`REFINE_RISE_RTOL` (relative), or at
        ``max_iter``; the bound's relative change ``tol`` is not used then (near the optimum the bound is flat
        to rounding while the residual still falls).
    :param bool return_residual: also return the fixed-point residual at the result: the largest change a
        full CVI step would make to a site natural parameter ``lam_n`` or ``nu_n``, relative to ``1 + |parameter|``
        (zero at the optimum).
    :returns: ``(alpha, lam, exact_elbo, iterations, converged)`` (and the residual).
    """
    from .objective import exact_elbo
    from .reference import site_elbo_terms

    if getattr(backend, "comm", None) is not None:
        raise ValueError("refine_exact: the exact-VG refinement is not available on row-sharded sites")
    history = History() if history is None else history
    parts = bound.split()
    sizes = [len(b) for b in parts]

    def grads(h, rho):
        gm, gv = [], []
        for b, hh, rr in zip(parts, h.split(sizes), rho.split(sizes)):
            _, a, c = site_elbo_terms(b.family, hh, rr, num_points)
            gm.append(a)
            gv.append(c)
        return torch.cat(gm), torch.cat(gv)

    def value(a, l):
        t = backend.evaluate(a, l)
        return float(exact_elbo(backend, bound, a, l, t)), t

    def cvi_step(b, lam, nu, lam_hat, nu_hat, cur):
        """The damped CVI step ``b``: ``(alpha, lam, nu, site means, bound, backend terms)``, or ``None`` if it
        lowers the bound."""
        lam_new = (1 - b) * lam + b * lam_hat
        nu_new = (1 - b) * nu + b * nu_hat
        # q(nu, lam) = prior x prod_n exp(nu_n h_n - lam_n h_n^2 / 2) in the dual's parametrisation: its site means
        # (any storage form's working_means) give alpha = lam m_t - nu
        m_new = backend.working_means(lam_new, nu_new)
        alpha_new = lam_new * m_new - nu_new
        new, t_new = value(alpha_new, lam_new)
        return (alpha_new, lam_new, nu_new, m_new, new, t_new) if new >= cur - 1e-12 * (1 + abs(cur)) else None

    def targets(m, v):
        """``(lam_hat, nu_hat)``: the natural parameters of a full CVI step from site marginals ``(m, v)``."""
        gm, gv = grads(m, v)
        return (-2 * gv).clamp_min(0), gm - 2 * gv * m

    cur, t = value(alpha, lam)
    # the iteration carries (lam, nu) and the site means of q(nu, lam) from the working means: the means from
    # alpha (m_t = mu_t - Sigma_t alpha) lose digits to Sigma_t's norm, which grows with the number of sites, and
    # a site with a sharp likelihood (a Laplace kink) turns that into a noise floor of the residual (1e-7 at
    # 10^4 rows); the variances depend on lam alone
    m_t, v_t = t.m_tilde, t.v_tilde
    nu = lam * m_t - alpha
    history.record(objective=cur)
    converged, it, b = False, 0, float(step)
    best_residual, stalled, last_change = math.inf, 0, 0.0
    for it in range(1, max_iter + 1):
        lam_hat, nu_hat = targets(m_t, v_t)
        residual = _cvi_residual(lam, nu, lam_hat, nu_hat)
        if residual_tol is not None:
            if residual <= residual_tol:
                converged = True
                break
            # near the optimum the bound is flat to rounding (it moves by ~residual^2), so a stalled bound does
            # not stop a residual-judged run: the CVI steps go on while they still shrink the residual; far from
            # it the residual can stay put for many steps while the bound still rises, which does not stop it either
            rising = it > 1 and last_change > REFINE_RISE_RTOL * (1 + abs(cur))
            falling = REFINE_RESIDUAL_FLOOR < residual < 0.9 * best_residual  # below the floor: rounding's wobble
            stalled = 0 if falling or rising else stalled + 1
            best_residual = min(best_residual, residual)
            if stalled >= 5:
                break
        b, accepted = backtrack(lambda b: cvi_step(b, lam, nu, lam_hat, nu_hat, cur), b, max_trials=30)
        if accepted is None:
            break
        alpha, lam, nu, m_t, new, t = accepted
        v_t = t.v_tilde
        change = last_change = new - cur
        cur = new
        history.record(objective=cur)
        if residual_tol is None and abs(change) <= tol * (1 + abs(cur)):
            converged = True
            break
        b = min(float(step), 2 * b)
    if return_residual or residual_tol is not None:
        # optimality of the exact VG bound: the largest (relative) change a full CVI step would make to the site
        # natural parameters (zero exactly at the optimum, where alpha = -dE/dm and lam = -2 dE/dv)
        res = _cvi_residual(lam, nu, *targets(m_t, v_t))
        if residual_tol is not None:
            converged = res <= residual_tol
        if return_residual:
            return alpha, lam, cur, it, converged, res
    return alpha, lam, cur, it, converged
