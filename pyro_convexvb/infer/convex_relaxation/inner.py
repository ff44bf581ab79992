r"""Inner loop: minimise ``phi_z`` over ``(u, gamma)`` for fixed ``z`` (Nickisch & Seeger 2009, §2.2).

For fixed ``z``, ``min_gamma phi_z = ||y~ - X u||^2 + 2 sum_i h_i^*(s_i)`` (+ terms free of ``u``),
a penalised least-squares problem in ``u``.  We minimise

.. math:: \Psi(u) = \tfrac12 \|\tilde y - X u\|^2 + \sum_i h_i^*(s_i), \qquad s = B u + o,

by Newton's method (IRLS): each step solves ``(X^T X + B^T diag(e) B) d = -grad`` with
``e = (h^*)''(s)`` by preconditioned CG (Jacobi, ``diag(X^T X + B^T diag(e) B)`` from the sparse rows,
``op.diag_gram(e)``, or for image models a Fourier preconditioner, :meth:`.problem.RelaxationProblem.preconditioner`),
then a backtracking (Armijo) line search that costs no extra products: along
``u + t d`` the quadratic part is an exact parabola and the site part only needs ``B d``.  Where a
non-log-concave site makes ``(h^*)'' < 0`` its weight is replaced by the IRLS weight
``1/gamma_* > 0`` (a majorisation step), so the system stays positive definite.  ``gamma`` follows in
closed form, ``gamma_i = -1/(2 g_i'(z_i + s_i^2))`` (see :func:`.potentials.h_star`).

When the outer loop holds a dense Cholesky factor of ``A(gamma_t)`` (small ``n``), it preconditions CG
instead (``A(gamma_t)`` and the Newton matrix share ``X^T X`` and the rows of ``B``).

The CG tolerance follows an Eisenstat-Walker forcing sequence ``min(0.1, sqrt(||g_k|| / ||g_0||))``,
floored at ``cg_tol``: early Newton steps are solved loosely, the last ones to ``cg_tol``.
"""
from dataclasses import dataclass, field

import torch

from ...linalg.cg import cg
from ...linalg.linesearch import backtrack


@dataclass
class InnerResult:
    """Outcome of :func:`inner_loop`.

    :ivar u: minimiser ``u_*`` (the mean of ``Q(u|D)``), ``(n,)``.
    :ivar s: ``B u_* + o``, ``(q,)``.
    :ivar gamma: ``gamma_*(z, s)``, ``(q,)``.
    :ivar objective: ``Psi(u_*)``.
    :ivar newton_steps: Newton iterations done.
    :ivar cg_iterations: CG iterations per Newton step.
    :ivar num_mvm: products with the Newton system matrices (CG, including residual checks).
    :ivar converged: whether the Newton decrement test was met.
    :ivar decrement: final Newton decrement ``-grad^T d / 2``.
    """

    u: torch.Tensor
    s: torch.Tensor
    gamma: torch.Tensor
    objective: float
    newton_steps: int
    cg_iterations: list = field(default_factory=list)
    num_mvm: int = 0
    converged: bool = False
    decrement: float = float("nan")


def _site_value(prob, s, z):
    if not prob.q:
        return s.new_zeros(())
    return prob.site_sum(prob.pot.h_star(s, z, derivatives=0)[0].sum())


def inner_loop(prob, z, u0, *, max_newton, cg_tol, newton_tol, cg_max_iter=None, preconditioner="jacobi", chol=None,
               armijo=1e-4, max_backtrack=40):
    r"""Newton/IRLS minimisation of ``Psi(u) = ||y~ - X u||^2/2 + sum_i h_i^*(s_i)`` (Nickisch & Seeger 2009, §2.2).

    Over 80 lines: most of it is this docstring; the body is one Newton loop whose incremental updates of ``X u``
    and ``s`` share its state.

    :param prob: a :class:`~.problem.RelaxationProblem`.
    :param z: ``(q,)`` outer-loop variances (``> 0``).
    :param u0: ``(n,)`` warm start.
    :param max_newton: Newton steps (``N_Newt`` of Nickisch & Seeger 2009, §2.4); this and the two tolerances have
        their defaults in :class:`~.engine.ConvexRelaxationOptions`.
    :param cg_tol: final relative CG residual.
    :param newton_tol: stop when the Newton decrement ``-grad^T d / 2 <= newton_tol * max(1, |Psi|)``.
    :param cg_max_iter: CG iteration cap per system.
    :param preconditioner: ``"jacobi"``, ``"circulant"`` or ``"fourier"``
        (:meth:`~.problem.RelaxationProblem.preconditioner`, built afresh from each Newton system's weights ``e``),
        or ``None`` for plain CG.
    :param chol: optional dense Cholesky factor of ``A(gamma)`` from the outer loop (small ``n``); when
        given it preconditions CG instead of Jacobi (same solution, far fewer iterations).
    :returns: :class:`InnerResult`.
    """
    u = u0.clone()
    s = prob.s(u)
    xtxu = prob.xtx_mv(u)
    xty = prob.xty()
    quad = prob.quad(u)
    f = 0.5 * quad + _site_value(prob, s, z)
    g0norm = None
    res = InnerResult(u, s, None, float(f), 0)
    converged = False
    for it in range(int(max_newton)):
        if prob.q:
            _, d1, d2, gam = prob.pot.h_star(s, z)
            e = torch.where(d2 > 0, d2, 1.0 / gam)
            grad = xtxu - xty + prob.B.rmv(d1)
        else:
            e = None
            grad = xtxu - xty
        gnorm = float(torch.linalg.vector_norm(grad))
        if g0norm is None:
            g0norm = max(gnorm, 1e-300)
        if gnorm == 0.0:
            converged = True
            break
        rtol = max(cg_tol, min(0.1, (gnorm / g0norm) ** 0.5))
        precond = None
        if chol is not None:
            precond = lambda R, L=chol: torch.cholesky_solve(R, L)  # noqa: E731
        elif preconditioner is not None:
            precond = prob.preconditioner(e, preconditioner)
        if e is not None:
            matmul = lambda v, e=e: prob.a_mv(v, e)  # noqa: E731
        else:
            matmul = prob.xtx_mv
        sol = cg(matmul, -grad, precond=precond, rtol=rtol, max_iter=cg_max_iter, on_fail="ignore")
        d = sol.x
        res.cg_iterations.append(sol.iterations)
        res.num_mvm += sol.num_mvm
        slope = float(grad @ d)
        if not slope < 0:  # CG stopped too early to give a descent direction: steepest descent
            d = -grad
            slope = float(grad @ d)
        decrement = -0.5 * slope
        res.decrement = decrement
        # exact parabola for the quadratic part along u + t d
        xtxd = prob.xtx_mv(d)
        a1 = float((xtxu - xty) @ d)
        a2 = float(d @ xtxd)
        Bd = prob.B.mv(d) if prob.q else None

        def trial(t, Bd=Bd, a1=a1, a2=a2, f=f, slope=slope):
            site = _site_value(prob, s + t * Bd, z) if prob.q else 0.0
            f_new = 0.5 * float(quad) + t * a1 + 0.5 * t * t * a2 + float(site)
            return f_new if f_new <= float(f) + armijo * t * slope else None

        t, f_new = backtrack(trial, max_trials=max_backtrack)
        if f_new is None:
            break  # no decrease possible at working precision
        u = u + t * d
        xtxu = xtxu + t * xtxd
        quad = quad + 2 * t * a1 + t * t * a2
        if prob.q:
            s = s + t * Bd
        f_old, f = f, f_new
        res.newton_steps = it + 1
        if decrement <= newton_tol * max(1.0, abs(float(f))) or (abs(float(f_old) - f) <= 1e-15 * max(1.0, abs(f))):
            converged = True
            break
    # recompute from scratch to remove drift of the incremental updates
    s = prob.s(u)
    quad = prob.quad(u)
    f = 0.5 * quad + _site_value(prob, s, z)
    res.u, res.s, res.objective, res.converged = u, s, float(f), converged
    if prob.q:
        res.gamma = prob.pot.h_star(s, z, derivatives=0)[3]
    return res
