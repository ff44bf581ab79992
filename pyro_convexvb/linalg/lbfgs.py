"""One L-BFGS driver for every smooth minimisation of the package (torch's L-BFGS, strong Wolfe).

``torch.optim.LBFGS`` stops silently on a gradient tolerance, a change tolerance or an evaluation
cap, and its last closure call may be a line-search trial point. :func:`minimize_lbfgs` wraps it:
the closure records the history and refuses non-finite losses, the gradient is re-evaluated at the
returned point, and the result says which rule stopped the run and whether the gradient test (the
optimality measure) is met.
"""
import math
from dataclasses import dataclass

import torch

__all__ = ["LBFGSResult", "minimize_lbfgs"]


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


def minimize_lbfgs(params, loss_fn, *, max_iter=500, grad_tol=1e-8, change_tol=1e-14, history_size=50, lr=1.0,
                   history=None, bar=None, name="L-BFGS"):
    """Minimise ``loss_fn()`` over the tensors ``params`` (updated in place) by L-BFGS with strong Wolfe.

    :param list params: leaf tensors with ``requires_grad``.
    :param callable loss_fn: ``() -> scalar tensor`` differentiable in ``params``.
    :param int max_iter: L-BFGS iterations (torch allows ``1.25 max_iter`` evaluations).
    :param float grad_tol: the optimality test ``max |grad| <= grad_tol``.
    :param history: a :class:`~pyro_convexvb.infer.result.History` receiving ``objective`` (= ``-loss``)
        per evaluation, or ``None``.
    :param bar: a progress bar with ``update()``, or ``None``.
    :returns: :class:`LBFGSResult`.

    Example::

        >>> import torch
        >>> x = torch.tensor([3.0, -1.0], dtype=torch.float64, requires_grad=True)
        >>> res = minimize_lbfgs([x], lambda: ((x - 1) ** 2).sum() + x.prod())
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

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{name}: the loss became {float(loss)} after {count[0]} evaluations")
        loss.backward()
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
    opt.zero_grad()
    return LBFGSResult(float(loss.detach()), gnorm, count[0], converged, reason)
