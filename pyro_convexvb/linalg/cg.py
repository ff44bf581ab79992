"""Preconditioned conjugate gradients for SPD systems, with batched right-hand sides.

:func:`cg` solves ``A x = b`` for a symmetric positive definite ``A`` that is only available
through products ``v -> A v``.  All columns of a batched right-hand side ``(n, k)`` share one
product per iteration; each column stops updating as soon as its own relative residual
``||b_j - A x_j|| / ||b_j||`` reaches ``rtol`` (or its absolute residual reaches ``atol``), and
later products only involve the columns still running.

Why not :func:`linear_operator.utils.linear_cg`?  It is fast and accepts any closure, but (measured
in ``benchmarks/linalg.py``, see ``docs/linalg.md``) with its default ``eps=1e-10`` guard it
cannot reach relative residuals below about ``1e-5``: it silently degrades to steepest descent
(2,000 iterations instead of 27 on a 20k sparse system); it stops on the *mean* residual over
columns, so single columns end above the tolerance; it returns no iteration count, residuals or
convergence flag; and a non-SPD operator only yields a generic warning and a wrong answer.
This implementation fixes those points and reports everything in :class:`CGResult`.

With ``on_negative_curvature="truncate"`` a non-positive curvature ``p^T A p <= 0`` does not raise
but ends that column Steihaug-style (Steihaug 1983, without the trust region; the termination rule of
Nocedal & Wright 2006, Algorithm 7.1, line-search Newton-CG): the iterate before the offending
direction is returned, or the preconditioned residual step ``x0 + M^{-1} r0`` when it is met at the
first iteration.  This is the inexact (truncated) Newton-CG step for a Hessian that is only positive
semidefinite in floating point.

With ``reduction=`` the vectors are the local rows of a system spread over processes (row-sharded sites):
every inner product and norm is the local one summed by ``reduction.sum`` (an all-reduce), so all ranks take
the same steps and stop together.
"""
from dataclasses import dataclass, field
import math

import torch

from ..errors import ConvergenceError, NotPositiveDefiniteError, warn
from .operators import LinearOperator, as_operator

__all__ = ["CGResult", "cg", "NotPositiveDefiniteError", "default_max_iter"]


@dataclass
class CGResult:
    """Outcome of :func:`cg`.

    :ivar x: solution, same shape as the right-hand side ``(n,)`` or ``(n, k)``.
    :ivar iterations: number of CG iterations (batched products with ``A``).
    :ivar residual_norm: final relative residual ``||b - A x|| / ||b||`` per column, shape ``(k,)``
        (a 0-d tensor for a 1-D right-hand side).  Columns with ``b = 0`` report the absolute
        residual.  Computed from the true residual ``b - A x`` unless ``true_residual=False``.
    :ivar converged: ``True`` if every column met its tolerance.
    :ivar num_mvm: number of matrix-vector products, counting one per column per product
        (initial residual of a warm start and the final residual check included).
    :ivar residual_history: largest relative residual over all columns after every iteration
        (the first entry is the starting residual).
    :ivar truncated: boolean tensor, shape ``(k,)`` (0-d for a 1-D right-hand side): ``True`` for the
        columns that ``on_negative_curvature="truncate"`` stopped at a direction of non-positive
        curvature (always ``False`` with ``"raise"``).  ``converged`` still compares their residual
        with the tolerance.
    """

    x: torch.Tensor
    iterations: int
    residual_norm: torch.Tensor
    converged: bool
    num_mvm: int
    residual_history: list = field(default_factory=list)
    truncated: torch.Tensor = None


def default_max_iter(n):
    """Default CG iteration cap: ``10 n``, but no more than ``max(n, 10_000)``.

    In exact arithmetic CG needs at most ``n`` iterations; in floating point ill-conditioned
    small systems may need a few times more, while for large ``n`` an iteration count near
    ``n`` already means the system needs a better preconditioner.
    """
    return int(min(10 * n, max(n, 10_000)))


def _resolve_matmul(matmul, name="matmul"):
    """Return ``(apply, n_or_None, dtype_or_None, device_or_None)`` for an operator-like argument."""
    if isinstance(matmul, torch.Tensor):
        matmul = as_operator(matmul)
    if isinstance(matmul, LinearOperator):
        if matmul.shape[0] != matmul.shape[1]:
            raise ValueError(f"{name}: the operator must be square, got shape {tuple(matmul.shape)}")
        return matmul.mv, matmul.shape[0], matmul.dtype, matmul.device
    if callable(matmul):
        return matmul, None, None, None
    raise TypeError(f"{name}: expected a callable v -> A v, a LinearOperator or a tensor, got {type(matmul).__name__}")


def _check_finite(t, name):
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or inf")


def _resolve_precond(precond, n, like):
    """Return a callable ``R (n, k) -> M^{-1} R`` or ``None``."""
    if precond is None:
        return None
    if isinstance(precond, torch.Tensor):
        d = precond
        if d.shape != (n,):
            raise ValueError(f"precond: a Jacobi diagonal must have shape ({n},), got {tuple(d.shape)}")
        d = d.to(dtype=like.dtype, device=like.device)
        if not bool(torch.isfinite(d).all()) or not bool((d > 0).all()):
            raise ValueError("precond: the Jacobi diagonal must be finite and strictly positive")
        dinv = (1.0 / d).unsqueeze(-1)
        return lambda R: R * dinv
    if isinstance(precond, LinearOperator):
        return precond.mv
    if callable(precond):
        return precond
    raise TypeError(f"precond: expected None, a tensor (Jacobi diagonal) or a callable, got {type(precond).__name__}")


def _checked_arguments(matmul, rhs, rtol, atol, max_iter, on_fail, on_negative_curvature, reduction):
    """Validate :func:`cg`'s arguments. :returns: ``(v -> A v, n, max_iter)``."""
    apply_a, n_op, dtype_op, _ = _resolve_matmul(matmul)
    if not isinstance(rhs, torch.Tensor):
        raise TypeError(f"rhs: expected a tensor, got {type(rhs).__name__}")
    if rhs.dim() not in (1, 2):
        raise ValueError(f"rhs: expected shape (n,) or (n, k), got {tuple(rhs.shape)}")
    if not rhs.is_floating_point():
        raise TypeError(f"rhs: expected a floating point tensor, got {rhs.dtype}")
    if dtype_op is not None and rhs.dtype != dtype_op:
        raise TypeError(f"rhs: dtype {rhs.dtype} differs from the operator's {dtype_op}; convert one of them")
    n = rhs.shape[0]
    if n_op is not None and n_op != n:
        raise ValueError(f"rhs: operator has size {n_op} but rhs has shape {tuple(rhs.shape)}")
    if reduction is None:  # with a reduction the summed norm is checked, so that every rank raises together
        _check_finite(rhs, "rhs")
    if on_fail not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_fail: expected 'warn', 'raise' or 'ignore', got {on_fail!r}")
    if on_negative_curvature not in ("raise", "truncate"):
        raise ValueError(f"on_negative_curvature: expected 'raise' or 'truncate', got {on_negative_curvature!r}")
    if not (rtol >= 0 and atol >= 0):
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    max_iter = default_max_iter(n) if max_iter is None else int(max_iter)
    if max_iter < 0:
        raise ValueError(f"max_iter: must be >= 0, got {max_iter}")
    return apply_a, n, max_iter


def cg(
    matmul,
    rhs,
    *,
    precond=None,
    x0=None,
    rtol=1e-6,
    atol=0.0,
    max_iter=None,
    on_fail="warn",
    true_residual=True,
    max_restarts=5,
    on_negative_curvature="raise",
    reduction=None,
):
    """Solve ``A x = b`` by preconditioned conjugate gradients.

    Over 80 lines: most of it is this docstring (the solver's contract); the body is the restart loop around
    :func:`_cg_iterate` and the report.

    Column ``j`` stops when ``||b_j - A x_j|| <= max(rtol * ||b_j||, atol)``.  With
    ``true_residual=True`` (default) the final residual is recomputed as ``b - A x`` (one extra
    product); if rounding made the recursively updated residual drift below the tolerance
    while the true one is not, CG restarts from the current iterate with the true residual
    (at most ``max_restarts`` times, within ``max_iter``).  The reported residuals are therefore
    the real ones.  The routine runs under :func:`torch.no_grad` and is not differentiable.

    :param matmul: the SPD operator: a callable ``v -> A v`` accepting ``(n,)`` and ``(n, k)``
        (only ``(n,)`` is used for a 1-D ``rhs``), a :class:`~pyro_convexvb.linalg.LinearOperator`
        (its ``mv``), or a dense/sparse tensor.
    :param rhs: right-hand side ``b``, shape ``(n,)`` or ``(n, k)``.
    :param precond: ``None``; a positive tensor ``d`` of shape ``(n,)`` (Jacobi: ``M^{-1} r = r / d``);
        or a callable ``R -> M^{-1} R`` (SPD) accepting ``(n, k)``.
    :param x0: warm start, same shape as ``rhs``.
    :param rtol: relative residual tolerance per column.
    :param atol: absolute residual tolerance per column.
    :param max_iter: iteration cap; default :func:`default_max_iter` ``(n)`` = ``min(10 n, max(n, 10000))``.
    :param on_fail: ``"warn"`` (:class:`~pyro_convexvb.errors.ConvergenceWarning`), ``"raise"``
        (:class:`~pyro_convexvb.errors.ConvergenceError` carrying the residual and iteration count)
        or ``"ignore"`` when some column misses its tolerance.
    :param true_residual: recompute the final residual as ``b - A x`` (see above).
    :param max_restarts: restarts allowed after residual drift.
    :param on_negative_curvature: ``"raise"`` (default): a curvature ``p^T A p <= 0`` raises
        :class:`NotPositiveDefiniteError`.  ``"truncate"``: the column stops there (Steihaug 1983;
        Nocedal & Wright 2006, Algorithm 7.1) and keeps its current iterate -- at the first iteration
        of the solve, the step ``x0 + M^{-1} r0`` along the preconditioned residual -- and
        ``CGResult.truncated`` flags it; a truncated column is neither restarted nor counted as a
        failure for ``on_fail``.
    :param reduction: ``None`` (every row in this process), or an object whose ``sum(t)`` sums a tensor over
        the processes that hold the other rows (e.g. a :class:`~pyro_convexvb.distributed.Communicator`):
        ``matmul``, ``precond``, ``rhs`` and ``x0`` then act on this process's rows, and inner products and
        norms are summed over processes.
    :returns: :class:`CGResult`.
    :raises NotPositiveDefiniteError: if ``r^T M^{-1} r <= 0`` (preconditioner not SPD) is met, or a
        curvature ``p^T A p <= 0`` (``A`` not SPD) with ``on_negative_curvature="raise"``.
    :raises ValueError: on NaN/inf input or output of ``matmul``, or on shape mismatches.

    Example::

        >>> import torch
        >>> from pyro_convexvb.linalg import cg
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> res = cg(A, torch.tensor([1.0, 2.0], dtype=torch.float64), rtol=1e-12)
        >>> res.converged, torch.allclose(A @ res.x, torch.tensor([1.0, 2.0], dtype=torch.float64))
        (True, True)
    """
    apply_a, n, max_iter = _checked_arguments(matmul, rhs, rtol, atol, max_iter, on_fail, on_negative_curvature,
                                               reduction)
    dot, norm = _inner_products(reduction)

    vector = rhs.dim() == 1
    if vector:

        def mat(P):
            return apply_a(P.squeeze(-1)).unsqueeze(-1)

    else:
        mat = apply_a

    with torch.no_grad():
        b = rhs.detach().unsqueeze(-1) if vector else rhs.detach()
        prec = _resolve_precond(precond, n, b)
        k = b.shape[1]

        def product(P):
            out = mat(P)
            if not isinstance(out, torch.Tensor) or out.shape != P.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"matmul: expected an output of shape {tuple(P.shape)}, got {got}")
            return out

        if x0 is None:
            x = torch.zeros_like(b)
            r = b.clone()
            num_mvm = 0
        else:
            if x0.shape != rhs.shape:
                raise ValueError(f"x0: expected shape {tuple(rhs.shape)}, got {tuple(x0.shape)}")
            _check_finite(x0, "x0")
            x = x0.detach().to(dtype=b.dtype, device=b.device).reshape(b.shape).clone()
            r = b - product(x)
            num_mvm = k
        bnorm = norm(b)
        if reduction is not None:
            _check_finite(bnorm, "rhs")
        zero = bnorm == 0
        if x0 is not None and bool(zero.any()):  # A x = 0 has the exact solution 0 (a relative residual has no scale)
            x[..., zero] = 0.0
            r[..., zero] = 0.0
        scale = torch.where(bnorm > 0, bnorm, torch.ones_like(bnorm))
        tol = torch.clamp(rtol * bnorm, min=atol)
        rnorm = norm(r)
        _check_finite(rnorm, "matmul(x0) (the initial residual)")
        history = [float((rnorm / scale).max())] if k > 0 else [0.0]
        truncated = torch.zeros(k, dtype=torch.bool, device=b.device)
        trunc = truncated if on_negative_curvature == "truncate" else None
        iterations = 0
        restarts = 0
        while True:
            iterations, num_mvm = _cg_iterate(
                product, prec, x, r, rnorm, tol, scale, max_iter, iterations, num_mvm, history, trunc, dot, norm
            )
            if not true_residual or k == 0 or iterations == 0:
                break  # with no iteration, r is exactly b - A x0
            r = b - product(x)
            num_mvm += k
            rnorm = norm(r)
            _check_finite(rnorm, "matmul output")
            history[-1] = float((rnorm / scale).max())
            if not bool(((rnorm > tol) & ~truncated).any()) or iterations >= max_iter or restarts >= max_restarts:
                break
            restarts += 1

        rel = rnorm / scale
        converged = not bool((rnorm > tol).any())
        failed = (rnorm > tol) & ~truncated  # truncated columns stopped by design, not for lack of iterations
        x_out = x.squeeze(-1) if vector else x
        rel_out = rel.squeeze(-1) if vector else rel
        trunc_out = truncated.squeeze(-1) if vector else truncated
    if bool(failed.any()) and on_fail != "ignore":
        worst = float(rel.max())
        msg = (
            f"cg did not converge in {iterations} iterations: {int(failed.sum())} of {k} column(s) above "
            f"tolerance, largest relative residual {worst:.3e} (rtol={rtol:g}, atol={atol:g})"
        )
        if on_fail == "raise":
            raise ConvergenceError(msg, residual=rel_out, iterations=iterations)
        warn(msg)
    return CGResult(
        x=x_out,
        iterations=iterations,
        residual_norm=rel_out,
        converged=converged,
        num_mvm=num_mvm,
        residual_history=history,
        truncated=trunc_out,
    )


def _inner_products(reduction):
    """``(dot, norm)`` over the rows of ``(n, k)`` blocks, column by column; summed by ``reduction.sum`` if given.

    Column reductions of the ``(n, k)`` block also for one column: ``torch.dot`` on the column is about twice as
    fast but is MKL's ``ddot``, whose rounding depends on the thread count, and the Lanczos variances built on CG
    amplify that into answers that differ between machines (26% in a variance on the real-sim shape,
    ``tests/reliability/test_thread_count.py``)."""
    if reduction is None:
        return (lambda a, b: torch.linalg.vecdot(a, b, dim=0)), (lambda a: torch.linalg.vector_norm(a, dim=0))

    def dot(a, b):
        return reduction.sum(torch.linalg.vecdot(a, b, dim=0))

    return dot, (lambda a: dot(a, a).clamp_min(0).sqrt())


_LOCAL_DOT, _LOCAL_NORM = _inner_products(None)


def _cg_iterate(product, prec, x, r, rnorm, tol, scale, max_iter, iterations, num_mvm, history, trunc=None,
                dot=_LOCAL_DOT, norm=_LOCAL_NORM):
    """Run CG on the columns with ``rnorm > tol``, updating ``x``, ``r`` and ``rnorm`` in place.

    ``trunc``: ``None`` (non-positive curvature raises) or a boolean ``(k,)`` mask, updated in place,
    of the columns stopped at non-positive curvature (those already set are skipped).  One host
    synchronisation per iteration: curvature, preconditioner inner product, stopping test and
    history are reduced into one small tensor.
    """
    active = rnorm > tol
    if trunc is not None:
        active &= ~trunc
    idx = active.nonzero().squeeze(-1)
    if idx.numel() == 0 or iterations >= max_iter:
        return iterations, num_mvm
    rest = rnorm / scale
    rest[idx] = 0
    rest_max = float(rest.max())  # largest relative residual among the columns not iterated
    xa, ra, tola, sca = x[:, idx], r[:, idx], tol[idx], scale[idx]
    z = prec(ra) if prec is not None else ra
    rz = dot(ra, z)
    p = z.clone()  # a preconditioner may return its input
    first = iterations == 0  # the iterate is still the starting point x0
    neg = None
    while True:
        Ap = product(p)
        num_mvm += p.shape[1]
        iterations += 1
        pAp = dot(p, Ap)
        alpha = rz / pAp
        if trunc is not None:
            # non-positive curvature: keep the iterate (step 0), or take the step p = M^{-1} r0 at the start
            neg = ~(pAp > 0)
            alpha = torch.where(neg, torch.full_like(alpha, 1.0 if first else 0.0), alpha)
        xa.addcmul_(p, alpha)
        ra.addcmul_(Ap, alpha, value=-1.0)
        rn = norm(ra)
        rn_minus_tol = rn - tola
        if neg is not None:
            rn_minus_tol = torch.where(neg, torch.full_like(rn_minus_tol, -math.inf), rn_minus_tol)
        min_pap, margin, rel = _reduce_and_check(pAp, rz, rn_minus_tol, rn / sca, iterations, trunc is None)
        history.append(max(rel, rest_max))
        if neg is not None and min_pap <= 0:
            trunc[idx[neg]] = True
        if margin <= 0 or iterations >= max_iter:
            x[:, idx], r[:, idx], rnorm[idx] = xa, ra, rn
            return iterations, num_mvm
        done = rn <= tola
        if neg is not None:
            done = done | neg
        if p.shape[1] > 1 and bool(done.any()):
            x[:, idx], r[:, idx], rnorm[idx] = xa, ra, rn
            rest_max = max(rest_max, float((rn[done] / sca[done]).max()))
            keep = ~done
            idx, xa, ra, p, rz, tola, sca, rn = (idx[keep], xa[:, keep], ra[:, keep], p[:, keep], rz[keep], tola[keep],
                                                 sca[keep], rn[keep])
        if prec is not None:
            z = prec(ra)
            rz_new = dot(ra, z)
        else:  # r^T r is the squared residual norm just computed
            z = ra
            rz_new = rn * rn
        beta = rz_new / rz
        rz = rz_new
        p = torch.addcmul(z, p, beta)
        first = False


def _reduce_and_check(pAp, rz, rn_minus_tol, rel, iterations, strict):
    """One CG iteration's reductions in one host copy (one synchronisation), and its checks.

    Returns ``(min p^T A p, max (||r|| - tol), max relative residual)`` over the active columns. Raises on a
    preconditioner that is not positive definite (``r^T z <= 0``), on NaN/inf, and, when ``strict``, on
    non-positive curvature (:class:`NotPositiveDefiniteError`)."""
    if pAp.shape[0] == 1:  # one column: its four numbers are the reductions
        min_pap, min_rz, margin, max_rel = torch.cat((pAp, rz, rn_minus_tol, rel)).tolist()
    else:
        min_pap, min_rz, margin, max_rel = torch.stack((pAp.min(), rz.min(), rn_minus_tol.max(), rel.max())).tolist()
    if not min_rz > 0:
        _raise_bad_preconditioner(min_rz)
    if not min_pap > 0:
        if not math.isfinite(min_pap):
            raise ValueError("matmul returned NaN or inf during CG")
        if strict:
            raise NotPositiveDefiniteError(
                f"matmul is not positive definite: curvature p^T A p <= 0 in {int((pAp <= 0).sum())} column(s) "
                f"at CG iteration {iterations} (min {min_pap:.3e})"
            )
    if not math.isfinite(max_rel):
        raise ValueError("matmul returned NaN or inf during CG")
    return min_pap, margin, max_rel


def _raise_bad_preconditioner(min_rz):
    if not math.isfinite(min_rz):
        raise ValueError("precond returned NaN or inf during CG")
    raise NotPositiveDefiniteError("precond is not positive definite: r^T M^{-1} r <= 0 during CG")
