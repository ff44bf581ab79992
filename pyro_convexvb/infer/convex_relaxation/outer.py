r"""Outer loop: variance updates ``z <- diag(B A^{-1} B^T)`` and the double loop (Nickisch & Seeger 2009, §2.2-2.3).

``log|A|`` is concave in ``gamma^{-1}``, so ``log|A| <= z^T gamma^{-1} - g^*(z)`` with equality at
``z = diag(B A^{-1} B^T)``; the double loop alternates this tangent (outer) update with the inner
loop minimisation of the upper bound ``phi_z`` (Nickisch & Seeger 2009, §2.2).  With exact ``z`` every outer
iteration decreases ``phi`` (a CCCP/majorisation argument; Nickisch & Seeger 2009 §2.2, Seeger 2010 §4.2).

Variance estimators (``variance=``):

* ``"lanczos"`` -- *K-Lanczos* (Nickisch & Seeger 2009 §2.3; Seeger 2010 §3): ``z_k = diag(B Q T^{-1} Q^T B^T)``
  after ``k`` steps with full reorthogonalisation; every component ``<=`` the exact variance and
  nondecreasing in ``k`` (Seeger 2010 §4.1).  The underestimation strengthens the penalty in
  ``h^*`` (Seeger 2010 §4.1: "selective shrinkage is strengthened").
* ``"pca"`` -- *L-PCA* (Seeger 2010 §3-4): the ``L`` smallest eigenpairs of ``A`` (converged Ritz
  pairs); with it the double loop provably converges, but on a modified criterion (Seeger 2010 Thm 1).
* ``"exact"`` -- dense Cholesky of ``A`` (small ``n``): the reference.

``log|A|`` for ``phi`` and the bound: exact (Cholesky) when ``n <= dense_logdet_max``; otherwise a
rigorous *upper* bound (so the evidence bound stays a lower bound), the smaller of Hadamard's
``sum_j log A_jj`` and, with the Lanczos basis ``Q`` completed to ``[Q, Q_perp]``, Fischer's
inequality plus AM-GM on the complement: ``log|A| <= log|T_k| + (n-k) log((tr A - tr T_k)/(n-k))``.
"""
from dataclasses import dataclass
import math
import time

import torch

from ...linalg.cg import cg
from ...linalg.lanczos import block_lanczos, pca_variances
from .inner import inner_loop

__all__ = ["VarianceStep", "variance_step", "logdet_upper_bound", "h_value", "phi_value", "double_loop"]


@dataclass
class VarianceStep:
    """One outer-loop variance computation at fixed ``gamma``.

    :ivar z: ``(q,)`` estimated ``diag(B A^{-1} B^T)`` (= ``Var_Q[s]`` with ``sigma^2 = 1``).
    :ivar var_u: ``(n,)`` estimated ``diag(A^{-1})`` (= ``Var_Q[u]``).
    :ivar logdet: ``log|A|`` (exact) or a rigorous upper bound.
    :ivar logdet_method: ``"cholesky"``, ``"fischer"`` or ``"hadamard"`` (``"unavailable"`` if neither bound applies).
    :ivar num_mvm: products with ``A`` (Lanczos steps, or ``n`` identity probes for the dense route).
    :ivar lanczos: the :class:`~pyro_convexvb.linalg.LanczosResult` (``None`` for ``"exact"``).
    :ivar chol: dense Cholesky factor of ``A`` (exact route or dense log-det), else ``None``.
    """

    z: torch.Tensor
    var_u: torch.Tensor
    logdet: float
    logdet_method: str
    num_mvm: int
    lanczos: object = None
    chol: torch.Tensor = None


def _exact_z(prob, L, chunk=256):
    """``diag(B A^{-1} B^T)`` and ``diag(A^{-1})`` from ``A = L L^T`` (``z_i = ||L^{-1} b_i||^2``)."""
    n = prob.n
    Linv = torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device), upper=False)
    var_u = (Linv * Linv).sum(0)
    z = torch.zeros(prob.q, dtype=L.dtype, device=L.device)
    if prob.q:
        LinvT = Linv.transpose(0, 1)
        for start in range(0, n, chunk):
            W = prob.B.mv(LinvT[:, start:start + chunk].contiguous())
            z += (W * W).sum(1)
    return z, var_u


def logdet_upper_bound(prob, w, lanczos_result=None):
    """Rigorous upper bound on ``log|A|``, ``A = X^T X + B^T diag(w) B`` (module docstring).

    :returns: ``(value, method)``; ``(inf, "unavailable")`` if ``diag(A)`` is not available cheaply.
    """
    d = prob.diag_a(w)
    if d is None or not bool((d > 0).all()):
        return math.inf, "unavailable"
    best, method = float(torch.log(d).sum()), "hadamard"
    if lanczos_result is not None:
        k, n = lanczos_result.k, prob.n
        logdet_t = float(lanczos_result.logdet_T())
        rest = float(d.sum()) - float(lanczos_result.alpha.sum())
        if k >= n:
            val = logdet_t
        elif rest > 0:
            val = logdet_t + (n - k) * math.log(rest / (n - k))
        else:
            val = math.inf
        if val < best:
            best, method = val, "fischer"
    return best, method


def _k_lanczos(prob, w, k, generator, block_size=1):
    """K-Lanczos run on ``A`` with ``z`` and ``diag(A^{-1})`` accumulated block by block (Nickisch & Seeger 2009 §2.3).

    ``A Q_j = X^T X Q_j + B^T (w * (B Q_j))`` computes ``B Q_j`` anyway; the run's ``project`` hook hands
    that product (and ``Q_j`` itself, for ``Var_Q[u]``) to the recursion of
    :func:`~pyro_convexvb.linalg.block_lanczos`, so the variances cost no extra product with ``B`` and no
    ``k x q`` buffer.  ``block_size = 1`` is Nickisch & Seeger's (2009) single-vector Lanczos.

    :returns: ``(result, z, var_u)``.
    """
    B, stash = prob.B, {}
    wcol = w.unsqueeze(-1)

    def matmul(V):  # (n, b_j): keeps B V for the projection of the same block
        if B is None:
            return prob.xtx_mv(V)
        BV = B.mv(V)
        stash["BV"] = BV
        return prob.xtx_mv(V) + B.rmv(BV * wcol)

    def project(V):
        return [V] if B is None else [stash.pop("BV"), V]

    res = block_lanczos(matmul, prob.n, k, block_size, generator=generator, dtype=prob.dtype, device=prob.device,
                        project=project)
    if B is None:
        return res, torch.zeros(0, dtype=prob.dtype, device=prob.device), res.projected_variances[0]
    z, var_u = res.projected_variances
    return res, z, var_u


def variance_step(prob, gamma, *, method="lanczos", k=80, pca_rank=None, generator=None,
                  dense_logdet_max=2000, block_size=1):
    """Estimate ``z = diag(B A^{-1} B^T)``, ``diag(A^{-1})`` and ``log|A|`` at ``gamma`` (Nickisch & Seeger 2009, §2.3).

    :param prob: :class:`~.problem.RelaxationProblem`.
    :param gamma: ``(q,)`` site widths.
    :param method: ``"lanczos"``, ``"pca"`` or ``"exact"``.
    :param k: Lanczos steps.
    :param pca_rank: ``L`` for ``"pca"``.
    :param generator: torch generator for the Lanczos start vector.
    :param dense_logdet_max: largest ``n`` for an exact (Cholesky) ``log|A|`` in the Lanczos/PCA modes.
    :param block_size: Lanczos block size ``b`` (``1``: Nickisch & Seeger's (2009) single-vector Lanczos; ``b > 1``:
        :func:`~pyro_convexvb.linalg.block_lanczos` with ``b`` vectors per product, used only while ``k < n``).
    :returns: :class:`VarianceStep`.
    """
    w = 1.0 / gamma if prob.q else torch.zeros(0, dtype=prob.dtype, device=prob.device)
    n = prob.n
    if method == "exact":
        A = prob.dense_a(w)
        L = torch.linalg.cholesky(A)
        z, var_u = _exact_z(prob, L)
        logdet = float(2 * torch.log(torch.diagonal(L)).sum())
        return VarianceStep(z, var_u, logdet, "cholesky", n, None, L)
    A_op = prob.precision_operator(w)
    B = prob.B
    k = min(int(k), n)
    if method == "lanczos":
        res, z, var_u = _k_lanczos(prob, w, k, generator, int(block_size) if k < n else 1)
    elif method == "pca":
        L_rank = max(1, min(n, int(pca_rank) if pca_rank is not None else max(1, k // 6)))
        zq, res = pca_variances(A_op, B, L_rank, num_steps=max(k, L_rank), max_steps=max(k, L_rank),
                                return_result=True, generator=generator, on_fail="ignore")
        U = res.ritz_vectors(torch.arange(L_rank))
        theta = res.ritz_values[:L_rank]
        var_u = (U * U) @ (1.0 / theta)
        z = zq if B is not None else torch.zeros(0, dtype=prob.dtype, device=prob.device)
    else:
        raise ValueError(f"variance: expected 'lanczos', 'exact' or 'pca', got {method!r}")
    num = res.num_mvm
    chol = None
    if n <= dense_logdet_max:
        chol = torch.linalg.cholesky(prob.dense_a(w))
        logdet, how = float(2 * torch.log(torch.diagonal(chol)).sum()), "cholesky"
        num += n
    else:
        logdet, how = logdet_upper_bound(prob, w, res)
    return VarianceStep(z, var_u, logdet, how, num, res, chol)


def h_value(prob, gamma, x_star=None):
    """``h(gamma) = sum_i h_i(gamma_i)``; closed form ``-(x_*/gamma + 2 g(x_*))`` when ``x_*(gamma)`` is known."""
    if not prob.q:
        return 0.0
    if x_star is None:
        return float(prob.pot.h(gamma).sum())
    return float((-(x_star / gamma + 2 * prob.pot.g(x_star))).sum())


def phi_value(prob, gamma, u, logdet, x_star=None):
    """``phi(gamma) = log|A| + h(gamma) + R(u, gamma)`` (Nickisch & Seeger 2009, §2.1), ``u`` a (near-)minimiser of ``R``."""
    return float(logdet) + h_value(prob, gamma, x_star) + float(prob.R(u, gamma))


def solve_mean(prob, gamma, u0=None, cg_tol=1e-10, cg_max_iter=None, chol=None):
    """``argmin_u R(u, gamma)``: ``A u = X^T y~ + B^T (beta - o/gamma)`` by Jacobi-preconditioned CG
    (or directly from a dense Cholesky factor ``chol`` of ``A``)."""
    w = 1.0 / gamma if prob.q else None
    rhs = prob.mean_rhs(gamma) if prob.q else prob.xty().clone()
    if chol is not None:
        return torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1), 0
    d = prob.jacobi(w) if prob.q else prob.diag_xtx().clone()
    d = torch.where(d > 0, d, torch.ones_like(d))
    res = cg((lambda v: prob.a_mv(v, w)) if prob.q else prob.xtx_mv, rhs, precond=d, x0=u0, rtol=cg_tol,
             max_iter=cg_max_iter, on_fail="warn")
    return res.x, res.num_mvm


def double_loop(prob, *, variance="lanczos", k=80, block_size=1, pca_rank=None, max_outer=5, max_newton=20, cg_tol=1e-6,
                newton_tol=1e-8, gamma_tol=1e-3, phi_tol=1e-6, z_min=1e-10, gamma_init=None, generator=None,
                dense_logdet_max=2000, cg_max_iter=None, history=None, progress=None, z_init=None, u_init=None,
                logdet_init=None):
    r"""The double-loop algorithm of Nickisch & Seeger 2009, §2.2.

    ``t = 0, 1, ...``: variance step at ``gamma_t`` (gives ``z_t`` and completes ``phi(gamma_t)``);
    stop if ``t = max_outer`` or (``t > 0``) ``||gamma_t - gamma_{t-1}|| <= gamma_tol ||gamma_{t-1}||`` and
    ``|phi_t - phi_{t-1}| <= phi_tol max(1, |phi_t|)``; otherwise an inner loop with
    ``z = max(z_t, z_min)`` gives ``(u_{t+1}, gamma_{t+1})``.  The last variance step is at the returned
    ``gamma``, so the posterior variances and the bound refer to the returned ``Q``.  With approximate
    variances ``phi`` may rise between updates (Seeger 2010 §4.2 proves descent only for exact variances and
    L-PCA); the iterate with the smallest ``phi`` (largest bound) is returned, ``best_index`` says which.

    :returns: dict with ``u``, ``gamma``, ``x_star``, ``step`` (last :class:`VarianceStep`), ``phi``
        (list), ``converged``, ``mvm`` (per phase) and per-iteration statistics.
    """
    n, q = prob.n, prob.q
    dt, dev = prob.dtype, prob.device
    counts0 = dict(prob.counts)
    if q:
        s0 = prob.s(torch.zeros(n, dtype=dt, device=dev))
        if gamma_init is None:
            gamma = prob.pot.gamma_init(s0)
        else:
            gamma = torch.as_tensor(gamma_init, dtype=dt, device=dev).expand(q).clone()
            if not bool((gamma > 0).all()) or not bool(torch.isfinite(gamma).all()):
                raise ValueError("gamma_init: must be positive and finite")
        x_star = None
    else:
        gamma = torch.zeros(0, dtype=dt, device=dev)
        x_star = None
    u, mvm_init = None, 0
    stats = dict(phi=[], logdet=[], logdet_method=[], newton_steps=[], cg_iterations=[], inner_converged=[],
                 rel_gamma=[], lanczos_steps=[], inner_mvm=[], outer_mvm=[])
    mvm = {"init": mvm_init, "inner": 0, "outer": 0}
    seconds = {"inner": 0.0, "outer": 0.0}
    b_counts = {"inner": 0, "outer": 0}
    converged = False
    rel_gamma = math.inf
    step = None
    best = None
    if z_init is not None:
        if gamma_init is None:
            raise ValueError("z_init: needs gamma_init (the widths the variances belong to)")
        if int(max_outer) < 1:
            raise ValueError("z_init: needs max_outer >= 1 (the warm start replaces the first variance step only)")
        z_init = torch.as_tensor(z_init, dtype=dt, device=dev)
        if z_init.shape != (q,) or not bool(torch.isfinite(z_init).all()):
            raise ValueError(f"z_init: expected {q} finite site variances, got shape {tuple(z_init.shape)}")
        if u_init is not None:
            u_init = torch.as_tensor(u_init, dtype=dt, device=dev)
            if u_init.shape != (n,) or not bool(torch.isfinite(u_init).all()):
                raise ValueError(f"u_init: expected a finite ({n},) mean, got shape {tuple(u_init.shape)}")
    for t in range(int(max_outer) + 1):
        c_before = prob.counts.get("B", 0)
        t_start = time.perf_counter()
        warm = z_init is not None and t == 0
        if warm:
            ld = float(logdet_init) if logdet_init is not None else math.nan
            step = VarianceStep(z_init, None, ld, "given", 0)
            if u_init is not None:
                u = u_init
        else:
            step = variance_step(prob, gamma, method=variance, k=k, pca_rank=pca_rank, generator=generator,
                                 dense_logdet_max=dense_logdet_max, block_size=block_size)
        b_counts["outer"] += prob.counts.get("B", 0) - c_before
        seconds["outer"] += time.perf_counter() - t_start
        mvm["outer"] += step.num_mvm
        if u is None:  # u_0 = argmin_u R(u, gamma_0): Cholesky if the step has one, else PCG
            u, mvm["init"] = solve_mean(prob, gamma, cg_tol=min(cg_tol, 1e-8), cg_max_iter=cg_max_iter, chol=step.chol)
        stats["outer_mvm"].append(step.num_mvm)
        stats["lanczos_steps"].append(step.lanczos.k if step.lanczos is not None else 0)
        phi = phi_value(prob, gamma, u, step.logdet, x_star)
        stats["phi"].append(phi)
        stats["logdet"].append(step.logdet)
        stats["logdet_method"].append(step.logdet_method)
        if not warm and (best is None or phi < best["phi"] or not math.isfinite(best["phi"])):
            best = dict(u=u, gamma=gamma, x_star=x_star, step=step, phi=phi, index=t)
        if history is not None:
            history.record(objective=phi, mvm=mvm["init"] + mvm["inner"] + mvm["outer"],
                           gap=rel_gamma if math.isfinite(rel_gamma) else float("nan"))
        if progress is not None:
            progress.update(1)
            progress.set_postfix(phi=f"{phi:.6g}", dgamma=f"{rel_gamma:.2e}")
        if t > 0 and rel_gamma <= gamma_tol and abs(stats["phi"][-1] - stats["phi"][-2]) <= phi_tol * max(1.0, abs(phi)):
            converged = True
            break
        if (t == int(max_outer) and not warm) or not q:
            converged = converged or not q
            break
        z = step.z.clamp_min(z_min)
        c_before = prob.counts.get("B", 0)
        t_start = time.perf_counter()
        inner = inner_loop(prob, z, u, max_newton=max_newton, cg_tol=cg_tol, newton_tol=newton_tol,
                           cg_max_iter=cg_max_iter, chol=step.chol)
        seconds["inner"] += time.perf_counter() - t_start
        b_counts["inner"] += prob.counts.get("B", 0) - c_before
        mvm["inner"] += inner.num_mvm
        stats["inner_mvm"].append(inner.num_mvm)
        stats["newton_steps"].append(inner.newton_steps)
        stats["cg_iterations"].append(list(inner.cg_iterations))
        stats["inner_converged"].append(inner.converged)
        rel_gamma = float(torch.linalg.vector_norm(inner.gamma - gamma) / torch.linalg.vector_norm(gamma))
        stats["rel_gamma"].append(rel_gamma)
        u, gamma = inner.u, inner.gamma
        x_star = z + inner.s * inner.s
    mvm["B_products"] = b_counts
    mvm["seconds"] = seconds
    mvm["total_B_products"] = prob.counts.get("B", 0) - counts0.get("B", 0)
    # with approximate variances phi need not decrease (Seeger 2010 §4.2): return the best iterate seen
    return dict(u=best["u"], gamma=best["gamma"], x_star=best["x_star"], step=best["step"], best_phi=best["phi"],
                best_index=best["index"], converged=converged, mvm=mvm, **stats)
