r"""Independent references for the dual VG method: direct primal optimisation and the exact VG fixed point.

* :func:`primal_optimum` -- maximise ``-KL(N(m, V) || N(mu, Sigma)) - sum_n f_n(w_n^T m + d_n, w_n^T V w_n)``
  (a local bound) or ``... + sum_n E log p`` (the exact VG bound) directly over ``(m, Cholesky of V)``
  with L-BFGS and autograd (Khan et al. 2013, Eqs. 11-12). Dense, for small problems and tests.
* :func:`cvi_fixed_point` -- the exact VG optimum of a GP-type model (``W = I``) by the
  natural-gradient fixed point of Khan & Lin (2017, "CVI"): damped updates of the site natural
  parameters ``lambda_n <- (1-b) lambda_n - 2 b dE/dv_n``, ``nu_n <- (1-b) nu_n + b (dE/dm_n - 2 m_n dE/dv_n)``
  with ``q(f) ∝ p(f) prod_n exp(nu_n f_n - lambda_n f_n^2 / 2)``; ``O(N^3)`` per iteration, no
  ``Sigma^{-1}``.
"""
import math
import time

import torch

from ...linalg.lbfgs import minimize_lbfgs

from ..result import History

__all__ = ["primal_optimum", "cvi_fixed_point", "site_elbo_terms"]


def primal_optimum(Sigma, mu, W, d, site_term, max_iter=5000, tol=1e-12, m0=None, L0=None):
    r"""Maximise ``-KL(N(m, V) || N(mu, Sigma)) + sum_n site_term(h_n, rho_n)`` over ``(m, chol V)``.

    :param torch.Tensor Sigma: ``(L, L)``.
    :param torch.Tensor mu: ``(L,)``.
    :param torch.Tensor W: ``(N, L)`` dense.
    :param torch.Tensor d: ``(N,)``.
    :param callable site_term: ``(h, rho) -> (N,)``, e.g. ``-bound.f`` or ``family.expected_log_prob``.
    :returns: ``(value, m, V)``.
    """
    Lsz = mu.shape[0]
    LS = torch.linalg.cholesky(Sigma)
    logdet_S = 2 * torch.log(torch.diagonal(LS)).sum()
    m = (mu.clone() if m0 is None else m0.clone()).requires_grad_(True)
    if L0 is None:
        L0 = LS * 0.5
    raw = L0.tril(-1) + torch.diag(torch.log(torch.diagonal(L0)))
    idx = torch.tril_indices(Lsz, Lsz)
    p = raw[idx[0], idx[1]].clone().requires_grad_(True)

    def unpack(p):
        M = torch.zeros(Lsz, Lsz, dtype=mu.dtype, device=mu.device)
        M = M.index_put((idx[0], idx[1]), p)
        return M.tril(-1) + torch.diag(torch.exp(torch.diagonal(M)))

    def value(m, p):
        Lv = unpack(p)
        V = Lv @ Lv.T
        A = torch.cholesky_solve(V, LS)
        r = torch.cholesky_solve((m - mu)[:, None], LS)[:, 0]
        neg_kl = 0.5 * (2 * torch.log(torch.diagonal(Lv)).sum() - logdet_S - torch.trace(A) - (m - mu) @ r + Lsz)
        h = W @ m + d
        rho = ((W @ Lv) ** 2).sum(-1)
        return neg_kl + site_term(h, rho).sum()

    minimize_lbfgs([m, p], lambda: -value(m, p), max_iter=max_iter, grad_tol=tol, change_tol=1e-16,
                   history_size=100, name="reference VG optimum")
    with torch.no_grad():
        Lv = unpack(p)
        return float(value(m, p)), m.detach().clone(), (Lv @ Lv.T).detach()


def site_elbo_terms(family, h, rho, num_points=32):
    """``E log p`` and its derivatives ``dE/dh``, ``dE/drho`` at the site marginals ``N(h, rho)``
    (:meth:`~pyro_convexvb.lgm.families.SiteFamily.expected_log_prob_terms`: Gauss-Hermite, Price/Bonnet, or the
    family's closed forms)."""
    return family.expected_log_prob_terms(h, rho, num_points)


def cvi_fixed_point(K, mu, family, *, step=1.0, max_iter=500, tol=1e-9, lam0=None, nu0=None, num_points=32,
                    history=None, time_limit=None):
    r"""Exact variational-Gaussian optimum of ``f ~ N(mu, K)``, ``y_n ~ p(y_n | f_n)`` by the CVI fixed point.

    :param torch.Tensor K: ``(N, N)`` prior covariance of the sites.
    :param torch.Tensor mu: ``(N,)``.
    :param family: site family (log-concave for convergence guarantees).
    :param float step: damping ``b`` in ``(0, 1]``.
    :param float tol: stop when the exact ELBO changes by less than ``tol * (1 + |ELBO|)`` and the
        natural parameters by less than ``sqrt(tol)``.
    :returns: dict with ``elbo`` (exact VG bound), ``loc`` ``(N,)``, ``cov`` ``(N, N)``, ``lam``, ``nu``,
        ``iterations``, ``converged``, ``history``.
    """
    history = History() if history is None else history
    lam = torch.full_like(mu, 0.25) if lam0 is None else lam0.clone()
    nu = torch.zeros_like(mu) if nu0 is None else nu0.clone()
    prev, delta, converged, t0 = None, None, False, time.perf_counter()
    out = {}
    for it in range(max_iter):
        s = lam.clamp_min(0).sqrt()
        B = s[:, None] * K * s[None, :]
        B.diagonal().add_(1.0)
        R = torch.linalg.cholesky(B)
        T = torch.linalg.solve_triangular(R, s[:, None] * K, upper=False)
        r = nu - lam * mu
        Vr = K @ r - T.transpose(0, 1) @ (T @ r)
        m = mu + Vr
        v = (torch.diagonal(K) - (T * T).sum(0)).clamp_min(0)
        logdet_B = 2 * torch.log(torch.diagonal(R)).sum()
        quad = r @ Vr - (Vr * lam) @ Vr
        E, gm, gv = site_elbo_terms(family, m, v, num_points)
        elbo = float(0.5 * (lam @ v - quad - logdet_B) + E.sum())
        history.record(objective=elbo)
        out = dict(elbo=elbo, loc=m, lam=lam, nu=nu, R=R, T=T, iterations=it)
        if prev is not None and abs(elbo - prev) <= tol * (1 + abs(elbo)) and bool(
                (delta.abs().max() <= math.sqrt(tol))):
            converged = True
            break
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
        prev = elbo
        lam_new = (1 - step) * lam + step * (-2 * gv)
        nu_new = (1 - step) * nu + step * (gm - 2 * gv * m)
        delta = torch.cat([lam_new - lam, nu_new - nu])
        lam, nu = lam_new.clamp_min(0), nu_new
    out["converged"] = converged
    out["history"] = history
    return out

