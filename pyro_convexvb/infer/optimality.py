r"""Optimality measures of Gaussian variational families: the natural-gradient decrement.

A stochastic optimiser (SVI with Adam) has no duality gap; its honest optimality measure is how much
the evidence bound could still rise. For a Gaussian ``q = N(m, S)`` and a bound ``F(m, S)`` with
gradients ``g = dF/dm`` and ``G = dF/dS`` (symmetric), the quadratic model of ``F`` in the Fisher
metric of ``q`` (``dm^T S^{-1} dm + (1/2) tr(S^{-1} dS S^{-1} dS)``) predicts the gain of one
natural-gradient step

.. math:: \delta = \tfrac12\, g^\top S g + \mathrm{tr}(G S G S) \quad\text{nats},

the *natural-gradient decrement* (the analogue of Newton's decrement, Boyd & Vandenberghe 2004,
§9.5.1, in the Fisher metric of Amari 1998). It is zero exactly at a stationary point of ``F``, is
invariant to reparametrisations of ``q``, and is exact for conjugate Gaussian models near the
optimum (``F`` is then quadratic in ``m`` and ``delta_S = (1/4) sum (1 - lambda_i)^2`` matches
``(1/2) sum (lambda_i - 1 - log lambda_i)`` to second order, ``lambda`` the eigenvalues of
``S Sigma_post^{-1}``). Restricted families use the Fisher metric restricted to their tangent space:
mean-field ``S = diag(v)`` gives ``(1/2) sum g_i^2 v_i + sum (G_ii v_i)^2``; low-rank plus diagonal
``S = W W^T + diag(d)`` solves the restricted system by conjugate gradients; a uniform mixture of
``K`` diagonal Gaussians sums ``K`` times its components' decrements (the block-diagonal part of
the mixture's Fisher matrix, each component weighing ``1/K``).

The bound ``F`` is the exact variational-Gaussian bound of a latent Gaussian model when the model is
one (quadrature site expectations), else a Monte Carlo estimate with fixed draws; with Monte Carlo
gradients the decrement is biased *upwards* by their noise, so it never reports convergence early.
"""
import math

import torch

__all__ = [
    "decrement_full",
    "decrement_diagonal",
    "decrement_lowrank",
    "gaussian_decrement",
    "mixture_decrement",
]


def _sym(A):
    return 0.5 * (A + A.transpose(-1, -2))


def decrement_full(g, G, S):
    """``(1/2) g^T S g + tr(G S G S)`` for a full-covariance Gaussian.

    :param torch.Tensor g: ``(n,)`` gradient with respect to the mean.
    :param torch.Tensor G: ``(n, n)`` symmetric gradient with respect to the covariance.
    :param torch.Tensor S: ``(n, n)`` covariance.
    """
    GS = G @ S
    return float(0.5 * g @ (S @ g) + (GS * GS.transpose(0, 1)).sum())


def decrement_diagonal(g, gv, v):
    """``(1/2) sum g_i^2 v_i + sum (gv_i v_i)^2`` for ``S = diag(v)``; ``gv = dF/dv``."""
    return float(0.5 * (g * g * v).sum() + ((gv * v) ** 2).sum())


def decrement_lowrank(g, G, W, d, max_iter=200, rtol=1e-10):
    r"""Decrement of ``S = W W^T + diag(d)`` restricted to the family's tangent space.

    The tangent map ``J(dW, dd) = dW W^T + W dW^T + diag(dd)`` and the Fisher metric
    ``(1/2) tr(S^{-1} dS S^{-1} dS)`` give the system ``J^T F J x = J^T G``, solved by CG (the
    system is singular along rotations of ``W``; CG stays in the range). Returns
    ``(1/2) g^T S g + (1/2) (J^T G)^T x``.
    """
    n, r = W.shape
    S = W @ W.transpose(0, 1) + torch.diag(d)
    L = torch.linalg.cholesky(S)

    def Sinv(M):
        return torch.cholesky_solve(M, L)

    def J(x):
        dW, dd = x[: n * r].reshape(n, r), x[n * r:]
        M = dW @ W.transpose(0, 1)
        return M + M.transpose(0, 1) + torch.diag(dd)

    def Jt(H):
        return torch.cat([(2 * H @ W).reshape(-1), torch.diagonal(H)])

    def F(x):
        dS = J(x)
        return Jt(0.5 * Sinv(Sinv(dS).transpose(0, 1)))  # (1/2) S^-1 dS S^-1 (symmetric)

    b = Jt(_sym(G))
    x = torch.zeros_like(b)
    res = b.clone()
    p = res.clone()
    rr = float(res @ res)
    b2 = rr
    for _ in range(max_iter):
        if rr <= rtol**2 * b2 or b2 == 0:
            break
        Fp = F(p)
        pFp = float(p @ Fp)
        if pFp <= 0:
            break
        a = rr / pFp
        x = x + a * p
        res = res - a * Fp
        rr_new = float(res @ res)
        p = res + (rr_new / rr) * p
        rr = rr_new
    return float(0.5 * g @ (S @ g) + 0.5 * (b @ x))


def gaussian_decrement(objective, loc, *, covariance=None, variance=None, cov_factor=None, cov_diag=None):
    """Natural-gradient decrement of ``objective`` at a Gaussian given in one of three forms.

    :param callable objective: ``objective(m, S)`` with ``S`` a dense ``(n, n)`` covariance (full
        and low-rank forms) or ``(n,)`` variances (diagonal form); differentiable.
    :param torch.Tensor loc: ``(n,)``.
    :param covariance: ``(n, n)`` for the full family.
    :param variance: ``(n,)`` for the mean-field family.
    :param cov_factor: ``(n, r)`` ``W`` with ``cov_diag`` ``(n,)`` for the low-rank family.
    :returns: ``(decrement, objective value)`` as floats.

    Example (a conjugate Gaussian: the decrement is the exact gain to second order)::

        >>> import torch
        >>> P = torch.tensor([[2., .5], [.5, 1.]], dtype=torch.float64)
        >>> def F(m, S):
        ...     return -0.5 * m @ P @ m - 0.5 * (P * S).sum() + 0.5 * torch.logdet(S)
        >>> m = torch.tensor([0.1, -0.1], dtype=torch.float64)
        >>> dec, _ = gaussian_decrement(F, m, covariance=torch.linalg.inv(P))
        >>> round(dec, 6), round(float(0.5 * m @ P @ m), 6)
        (0.01, 0.01)
    """
    m = loc.detach().clone().requires_grad_(True)
    if covariance is not None:
        C = covariance.detach().clone().requires_grad_(True)
        val = objective(m, _sym(C))
        g, G = torch.autograd.grad(val, (m, C))
        return decrement_full(g.detach(), _sym(G).detach(), covariance.detach()), float(val.detach())
    if variance is not None:
        v = variance.detach().clone().requires_grad_(True)
        val = objective(m, v)
        g, gv = torch.autograd.grad(val, (m, v))
        return decrement_diagonal(g.detach(), gv.detach(), variance.detach()), float(val.detach())
    if cov_factor is not None and cov_diag is not None:
        W, d = cov_factor.detach(), cov_diag.detach()
        C = (W @ W.transpose(0, 1) + torch.diag(d)).requires_grad_(True)
        val = objective(m, _sym(C))
        g, G = torch.autograd.grad(val, (m, C))
        return decrement_lowrank(g.detach(), _sym(G).detach(), W, d), float(val.detach())
    raise ValueError("gaussian_decrement: give covariance, variance, or cov_factor with cov_diag")


def mixture_decrement(objective, locs, variances):
    """Decrement of ``objective(locs, variances)`` for a uniform mixture of ``K`` diagonal Gaussians.

    Uses the block-diagonal part of the mixture's Fisher matrix (component ``k`` weighs ``1/K``):
    ``K sum_k [(1/2) sum g_k^2 v_k + sum (gv_k v_k)^2]``.

    :param torch.Tensor locs: ``(K, n)``.
    :param torch.Tensor variances: ``(K, n)``.
    :returns: ``(decrement, objective value)``.
    """
    M = locs.detach().clone().requires_grad_(True)
    V = variances.detach().clone().requires_grad_(True)
    val = objective(M, V)
    g, gv = torch.autograd.grad(val, (M, V))
    K = locs.shape[0]
    dec = K * float((0.5 * g * g * variances).sum() + ((gv * variances) ** 2).sum())
    return dec, float(val.detach())


def monte_carlo_objective(log_joint, n, num_samples, dtype, device, seed=0):
    """``F(m, S) = mean_s log_joint(m + L eps_s) + H[N(m, S)]`` with fixed draws ``eps_s`` (``S`` dense or variances).

    :param callable log_joint: ``(s, n) -> (s,)`` log joint density of the model in unconstrained
        coordinates (log-Jacobians of the constraining transforms included).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    eps = torch.randn(num_samples, n, generator=gen, dtype=dtype).to(device)

    def objective(m, S):
        if S.dim() == 1:
            u = m + eps * S.sqrt()
            ent = 0.5 * torch.log(S).sum()
        else:
            L = torch.linalg.cholesky(S)
            u = m + eps @ L.transpose(0, 1)
            ent = torch.log(torch.diagonal(L)).sum()
        return log_joint(u).mean() + ent + 0.5 * n * (1 + math.log(2 * math.pi))

    return objective
