"""L-BFGS for the package: the two-loop recursion over a curvature memory, and a driver for torch parameters.

* :class:`LBFGSMemory` -- the two-loop product with inner products by a ``dot`` callable (an all-reduce for
  row-sharded sites), for minimisers with their own domain-aware backtracking (the dual VG objective);
* :func:`minimize_lbfgs` -- ``torch.optim.LBFGS`` (strong Wolfe) over autograd parameters.

The type-II and hyper-latent searches keep SciPy's L-BFGS-B (values from inner fits; a box for the hyper-latents).

``torch.optim.LBFGS`` stops silently on a gradient tolerance, a change tolerance or an evaluation
cap, and its last closure call may be a line-search trial point. :func:`minimize_lbfgs` wraps it:
the closure records the history, refuses a non-finite loss at the starting point, and reports a
non-finite loss at a line-search trial point as ``+inf`` with a NaN gradient, which the strong-Wolfe
search reads as "too far" (the trial closes its bracket and, the cubic fit being undefined, the next
trial bisects it), so a step into a region where the loss is ``+inf`` or NaN (a log barrier, an
overflowed ``exp``) is shortened instead of ending the run. The gradient is re-evaluated at the
returned point, and the result says which rule stopped the run and whether the gradient test (the
optimality measure) is met.
"""
import math
from dataclasses import dataclass

import torch

__all__ = ["LBFGSResult", "LBFGSMemory", "minimize_lbfgs"]


def _dot(a, b):
    return float(a @ b)


class LBFGSMemory:
    r"""The last ``memory`` curvature pairs ``(s, y)`` and the two-loop product ``H g`` (Nocedal & Wright 2006,
    Algorithm 7.4, with the initial scaling ``s^T y / y^T y`` of their Eq. 7.20).

    :param int memory: pairs kept.
    :param callable dot: ``(a, b) -> float`` inner product (default ``float(a @ b)``; a sum over ranks for
        vectors spread over processes).

    Example::

        >>> import torch
        >>> A = torch.diag(torch.tensor([3.0, 2.0], dtype=torch.float64))
        >>> mem = LBFGSMemory(5)
        >>> for s in torch.eye(2, dtype=torch.float64):
        ...     mem.update(s, A @ s)
        >>> g = torch.tensor([1.0, -1.0], dtype=torch.float64)
        >>> torch.allclose(mem.direction(g), -torch.linalg.solve(A, g))
        True
    """

    def __init__(self, memory, dot=_dot):
        self.memory, self.dot = int(memory), dot
        self.S, self.Y = [], []

    def __len__(self):
        return len(self.S)

    def reset(self):
        """Forget every pair."""
        self.S, self.Y = [], []

    def update(self, s, y):
        """Store the pair ``(s, y)`` if its curvature ``s^T y > 1e-12 y^T y``; drop the oldest beyond ``memory``."""
        if self.dot(s, y) > 1e-12 * self.dot(y, y):
            self.S.append(s)
            self.Y.append(y)
            if len(self.S) > self.memory:
                self.S.pop(0)
                self.Y.pop(0)

    def direction(self, grad):
        """``-H grad``; where that is not a descent direction the memory is reset and ``-grad`` returned."""
        d = -self._two_loop(grad)
        if self.dot(grad, d) >= 0:
            self.reset()
            d = -grad
        return d

    def initial(self, q):
        """``H^0 q``, the initial inverse Hessian of the two-loop recursion: the scalar ``s^T y / y^T y`` of the
        newest pair (Nocedal & Wright 2006, Eq. 7.20); a subclass may take any positive definite ``H^0``."""
        if self.S:
            q = q * (self.dot(self.S[-1], self.Y[-1]) / self.dot(self.Y[-1], self.Y[-1]))
        return q

    def _two_loop(self, grad):
        S, Y, dot = self.S, self.Y, self.dot
        q = grad.clone()
        rhos, alphas = [], []
        for s, y in zip(reversed(S), reversed(Y)):
            rho = 1.0 / dot(y, s)
            a = rho * dot(s, q)
            q = q - a * y
            rhos.append(rho)
            alphas.append(a)
        q = self.initial(q)
        for (s, y), rho, a in zip(zip(S, Y), reversed(rhos), reversed(alphas)):
            b = rho * dot(y, q)
            q = q + (a - b) * s
        return q


@dataclass
class LBFGSResult:
    """Outcome of :func:`minimize_lbfgs`.

    :ivar value: loss at the returned parameters.
    :ivar grad_norm: largest absolute gradient entry there (the optimality measure).
    :ivar evaluations: loss evaluations (closure calls, excluding the final check).
    :ivar converged: ``grad_norm <= grad_tol``.
    :ivar stop_reason: ``"gradient"``, ``"max_iter"`` or ``"no progress"`` (torch's change tolerance).
    """

    value: float
    grad_norm: float
    evaluations: int
    converged: bool
    stop_reason: str
    #: L-BFGS iterations (each takes one or more evaluations in its line search)
    iterations: int = 0


def minimize_lbfgs(params, loss_fn, *, max_iter=500, grad_tol=1e-8, change_tol=1e-14, history_size=50, lr=1.0,
                   history=None, bar=None, name="L-BFGS"):
    """Minimise ``loss_fn()`` over the tensors ``params`` (updated in place) by L-BFGS with strong Wolfe.

    Over 80 lines: most of it is this docstring; the body is under 80.

    :param list params: leaf tensors with ``requires_grad``.
    :param callable loss_fn: ``() -> scalar tensor`` differentiable in ``params``.
    :param int max_iter: L-BFGS iterations (torch allows ``1.25 max_iter`` evaluations).
    :param float grad_tol: the optimality test ``max |grad| <= grad_tol``.
    :param history: a :class:`~pyro_convexvb.infer.result.History` receiving ``objective`` (= ``-loss``)
        per evaluation, or ``None``.
    :param bar: a progress bar with ``update()``, or ``None``.
    :returns: :class:`LBFGSResult`.
    :raises FloatingPointError: if the loss or its gradient is not finite at the starting point, or if a line
        search, shortening its step on non-finite trial losses, finds no finite point before the run stops.

    A non-finite loss (or gradient) at a line-search trial point is treated as "step too long": the search bisects
    back towards the last finite point (a log barrier or an overflowed ``exp`` beyond the first step is fine).

    Example::

        >>> import torch
        >>> x = torch.tensor([3.0, -1.0], dtype=torch.float64, requires_grad=True)
        >>> res = minimize_lbfgs([x], lambda: ((x - 1) ** 2).sum() + x.prod(), grad_tol=1e-6)
        >>> res.converged, res.stop_reason
        (True, 'gradient')
    """
    params = list(params)
    if not params:
        raise ValueError(f"{name}: no parameters to optimise")
    opt = torch.optim.LBFGS(params, lr=lr, max_iter=int(max_iter), tolerance_grad=float(grad_tol),
                            tolerance_change=float(change_tol), history_size=int(history_size),
                            line_search_fn="strong_wolfe")
    count = [0]
    bad = {"streak": 0, "value": None}  # trial points in a row with a non-finite loss or gradient

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        finite = bool(torch.isfinite(loss))
        if finite:
            loss.backward()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
        if not finite:
            value = float(loss.detach())
            what = f"the loss is {value}" if not math.isfinite(value) else "the gradient is not finite"
            if count[0] == 0:
                raise FloatingPointError(f"{name}: {what} at the starting point; start from a point where the "
                                         "loss and its gradient are finite")
            # a trial point of the line search: "too far" (+inf loss, NaN gradient, so the bracket is bisected)
            bad["streak"] += 1
            bad["value"] = what
            count[0] += 1
            if bar is not None:
                bar.update(1)
            for p in params:
                p.grad = torch.full_like(p, math.nan)
            return torch.tensor(math.inf, dtype=loss.dtype)
        bad["streak"] = 0
        count[0] += 1
        if history is not None:
            history.record(objective=-float(loss.detach()))
        if bar is not None:
            bar.update(1)
        return loss

    opt.step(closure)
    opt.zero_grad()
    loss = loss_fn()
    loss.backward()
    grads = [p.grad for p in params if p.grad is not None]
    gnorm = max((float(g.abs().max()) for g in grads), default=0.0)
    converged = math.isfinite(gnorm) and gnorm <= grad_tol
    n_iter = opt.state[opt._params[0]].get("n_iter", count[0])
    if converged:
        reason = "gradient"
    elif n_iter >= max_iter or count[0] >= int(max_iter * 1.25):
        reason = "max_iter"
    else:
        reason = "no progress"
        if bad["streak"]:
            raise FloatingPointError(
                f"{name}: the line search found no point with a finite loss along its direction ({bad['value']} at "
                f"its last {bad['streak']} trial points, down to steps near zero) after {count[0]} evaluations "
                f"and {int(n_iter)} iterations; the loss is not finite arbitrarily close to the current point (its "
                f"value there is {float(loss.detach())}, largest gradient entry {gnorm:.3g}): check the model "
                "for an overflow or a domain boundary at the optimum")
    opt.zero_grad()
    return LBFGSResult(float(loss.detach()), gnorm, count[0], converged, reason, int(n_iter))
