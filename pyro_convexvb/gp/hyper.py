r"""GP hyperparameter learning through the dual VG bound (Khan et al. 2013, Eq. 20; envelope theorem).

The derivation is in ``docs/dual_vg.md``, § Algorithm and recovery ("Hyperparameter gradients").

The bound ``max_q ELBO_LVB(q; theta) = min_alpha g(alpha; theta)`` is maximised over the kernel
hyperparameters ``theta`` (and a constant prior mean). At the dual optimum ``alpha*`` the
gradient is the partial derivative of ``g`` at fixed ``alpha*`` (envelope theorem):

.. math::

    \frac{d \min g}{d\theta} = \mathrm{tr}\big[(\tfrac12 \alpha\alpha^T - \tfrac12 \Lambda^{1/2} B^{-1} \Lambda^{1/2})
        \frac{\partial K}{\partial\theta}\big] - \alpha^T \frac{\partial \mu}{\partial\theta},

obtained here by back-propagating through ``g(alpha*, ell(alpha*); K(theta), mu(theta))`` with
``alpha*`` held fixed. Every outer step warm-starts the dual at the previous ``alpha*``.
"""
import warnings

import torch

from ..errors import ConvergenceWarning
from ..infer.dual_vg import SiteSpaceBackend, solve_dual
from ..infer.result import History

__all__ = ["envelope_objective", "learn_hyperparameters"]


def envelope_objective(K, mu, bound, alpha, lam=None):
    r"""``g(alpha, lambda; K, mu)`` differentiable in ``K`` and ``mu`` at fixed ``(alpha, lambda)`` (Khan et al. 2013, Eq. 20).

    :param torch.Tensor K: ``(N, N)`` kernel matrix (with grad).
    :param torch.Tensor mu: ``(N,)`` prior mean (with grad).
    :param bound: the local bound (its conjugate does not depend on ``theta``).
    :param torch.Tensor alpha: ``(N,)`` dual optimum (no grad).
    """
    alpha = alpha.detach()
    lam = bound.ell(alpha)[0].detach() if lam is None else lam.detach()
    s = lam.clamp_min(0).sqrt()
    B = s[:, None] * K * s[None, :] + torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
    R = torch.linalg.cholesky(B)
    return 0.5 * alpha @ (K @ alpha) - mu @ alpha - torch.log(torch.diagonal(R)).sum() + bound.psi(alpha)[0].sum()


def learn_hyperparameters(kernel_matrix_fn, params, mean_fn, bound, *, max_iter=50, tol=1e-5, lr=1.0,
                          alpha0=None, gap_tol=None, history=None):
    r"""Maximise the dual VG bound over hyperparameters with L-BFGS (strong Wolfe), envelope gradients.

    Convergence: the largest gradient entry of the bound is at most ``tol * (1 + |bound|)`` at the
    returned hyperparameters (a :class:`~pyro_convexvb.ConvergenceWarning` otherwise).

    :param callable kernel_matrix_fn: ``() -> K (N, N)`` differentiable in ``params``.
    :param list params: the torch parameters to learn (kernel raw parameters, a mean constant, ...).
    :param callable mean_fn: ``() -> mu (N,)`` differentiable in ``params``.
    :param bound: the local bound of the sites.
    :param int max_iter: L-BFGS iterations.
    :param float tol: relative gradient tolerance.
    :param float gap_tol: duality gap of the inner solves (default ``1e-12 N`` nats): the envelope gradient
        is exact only at the dual optimum (its error grows like the square root of the gap).
    :returns: ``(alpha*, history, converged)``; ``params`` are updated in place.
    """
    from ..linalg.lbfgs import minimize_lbfgs

    history = History() if history is None else history
    state = {"alpha": alpha0}

    def loss_fn():
        K = kernel_matrix_fn()
        mu = mean_fn()
        if not torch.isfinite(K).all():
            raise FloatingPointError("kernel matrix became non-finite during hyperparameter learning")
        with torch.no_grad():
            backend = SiteSpaceBackend(0.5 * (K + K.transpose(0, 1)).detach(), mu.detach())
            tol_gap = 1e-12 * max(1, K.shape[0]) if gap_tol is None else gap_tol
            sol = solve_dual(backend, bound, state["alpha"], gap_tol=tol_gap, on_fail="warn")
        state["alpha"] = sol.alpha
        g = envelope_objective(K, mu, bound, sol.alpha, sol.lam)
        history.record(objective=float(g.detach()), gap=sol.gap, newton_iterations=sol.iterations)
        return -g  # maximise min_alpha g = max ELBO_LVB

    res = minimize_lbfgs(params, loss_fn, max_iter=max_iter, grad_tol=0.0, change_tol=1e-10, history_size=20,
                         lr=lr, name="hyperparameter learning")
    converged = res.grad_norm <= tol * (1 + abs(res.value))
    if not converged:
        warnings.warn(f"hyperparameter learning stopped ({res.stop_reason}) after {res.evaluations} evaluations with "
                      f"gradient {res.grad_norm:.3g} > tol * (1 + |bound|) = {tol * (1 + abs(res.value)):.3g}",
                      ConvergenceWarning)
    return state["alpha"], history, converged
