r"""The dual of Khan et al. 2013 for vector (``K``-logit) sites: ``Categorical(logits=W_i u + d_i)``.

Khan et al. 2013, Eqs. 14-20 with each observation's ``K`` predictor rows as one constraint block: the
Lagrangian pairs ``alpha_i`` ``(K,)`` with the block mean ``h_i`` and a ``K x K`` matrix ``Lambda_i`` with the block
covariance ``S_i`` (``tr(Lambda_i S_i) / 2``). With the block bounds of
:mod:`pyro_convexvb.lgm.families.categorical`, whose conjugate is ``H(kappa_i)`` on ``{Lambda_i <= ell(kappa_i)}``
(``kappa_i = alpha_i + e_{y_i}`` in the simplex), ``-log|B|`` decreases in every ``Lambda_i`` (PSD order), so the
optimum has ``Lambda_i = ell(kappa_i)`` and the reduced dual is over ``kappa`` alone:

.. math:: g(\kappa) = \tfrac12 r^T \Sigma r - \tilde\mu^T \alpha - \tfrac12 \log|I + \Sigma W^T \Lambda W|
          + \sum_i H(\kappa_i), \qquad r = W^T \alpha,

in the ``L x L`` form (``log|I + Sigma W^T Lambda W| = log|Sigma^{-1} + W^T Lambda W| + log|Sigma|``). The
posterior is ``m = mu - Sigma W^T alpha``, ``V = (Sigma^{-1} + W^T Lambda W)^{-1}`` (Eqs. 17-18); the duality gap
is the sum of the blocks' Fenchel-Young residuals. ``g`` is convex in ``kappa`` (``H`` is convex, ``ell`` is
matrix-concave and ``-log det`` is convex and decreasing); Newton's method runs on the first ``K - 1`` coordinates
of each ``kappa_i`` with a dense Hessian (autograd) and a fraction-to-the-boundary backtracking line search;
L-BFGS on ``kappa_i = softmax(z_i)``, ``z_{iK} = 0``, for many observations.
"""
import math
from dataclasses import dataclass

import torch

from ...errors import UnsupportedModelError
from ...lgm.families.categorical import MAX_QUADRATURE_CLASSES, QuadratureBudgetError
from ...posterior.gaussian import GaussianPosterior

__all__ = ["BlockDualProblem", "solve_block_dual", "NEWTON_MAX_VARIABLES"]

#: the largest number of free dual variables ``sum_i (K - 1)`` for which Newton forms the dense Hessian (its cross
#: term builds an ``n^2 K^3`` array: about 120 MB at ``n = 750``, ``K = 3``)
NEWTON_MAX_VARIABLES = 1500


class BlockDualProblem:
    """The reduced block dual of a model whose likelihood sites are all vector sites (dense ``L x L`` form).

    :param lgm: the :class:`~pyro_convexvb.LatentGaussianModel`.
    :param str bound: ``"tight"`` or ``"bohning"`` (the family's :meth:`local_bound` kind).
    :raises UnsupportedModelError: if a site group is not a vector site.
    """

    def __init__(self, lgm, bound="tight"):
        for g in lgm.sites:
            if not g.family.vector_site:
                raise UnsupportedModelError(g.name, "dual_vg fits vector (Categorical) sites only in models whose "
                                                    "likelihood sites are all vector sites; this model mixes them "
                                                    f"with the scalar '{g.family.name}' site '{g.name}'")
        self.lgm = lgm
        self.bounds = [g.family.local_bound(bound) for g in lgm.sites]
        self.groups = list(lgm.sites)
        dtype, device = lgm.dtype, lgm.device
        self.Ks = [g.family.block_size for g in self.groups]
        self.ns = [g.family.num_obs for g in self.groups]
        self.W = [g.design.to_dense().to(dtype).reshape(n, K, -1) for g, n, K in zip(self.groups, self.ns, self.Ks)]
        self.d = [g.offset.to(dtype).reshape(n, K) for g, n, K in zip(self.groups, self.ns, self.Ks)]
        self.Y = [b.onehot(w) for b, w in zip(self.bounds, self.d)]
        self.mu = lgm.prior_loc.to(dtype)
        self.S = lgm.dense_prior_cov().to(dtype)
        self.P = lgm.dense_prior_prec().to(dtype)
        self.logdet_S = float(lgm.prior_logdet_cov())
        self.mu_t = [W @ self.mu + d for W, d in zip(self.W, self.d)]
        self.num_free = sum(n * (K - 1) for n, K in zip(self.ns, self.Ks))
        self.num_rows = sum(n * K for n, K in zip(self.ns, self.Ks))
        self.dtype, self.device = dtype, device

    # ---------------------------------------------------------------- parametrisations of kappa
    def split_free(self, x):
        """Per group ``kappa`` ``(n, K)`` from the free coordinates ``x`` (the first ``K - 1`` of every row)."""
        out, start = [], 0
        for n, K in zip(self.ns, self.Ks):
            a = x[start:start + n * (K - 1)].reshape(n, K - 1)
            out.append(torch.cat([a, 1 - a.sum(-1, keepdim=True)], -1))
            start += n * (K - 1)
        return out

    @staticmethod
    def free(kappas):
        return torch.cat([k[:, :-1].reshape(-1) for k in kappas])

    def from_alpha(self, alpha):
        """``kappa`` of a flat ``alpha`` ``(sum n K,)`` (a warm start), moved strictly inside the simplex."""
        out, start = [], 0
        for n, K, Y in zip(self.ns, self.Ks, self.Y):
            k = alpha[start:start + n * K].reshape(n, K) + Y
            k = k.clamp_min(1e-8)
            out.append(k / k.sum(-1, keepdim=True))
            start += n * K
        return out

    # ---------------------------------------------------------------- the dual
    def precision(self, kappas):
        """``A = Sigma^{-1} + sum_i W_i^T ell(kappa_i) W_i`` ``(L, L)`` and the blocks ``ell(kappa_i)``."""
        A, lams = self.P, []
        for b, W, k in zip(self.bounds, self.W, kappas):
            lam = b.ell(k)
            lams.append(lam)
            A = A + torch.einsum("nkl,nkj,njm->lm", W, lam, W)
        return 0.5 * (A + A.transpose(0, 1)), lams

    def objective(self, kappas):
        """``g(kappa)`` (0-d; ``+inf`` outside the simplex), differentiable."""
        if any(bool((k <= 0).any()) for k in kappas):
            return torch.tensor(math.inf, dtype=self.dtype, device=self.device)
        r = sum(torch.einsum("nkl,nk->l", W, k - Y) for W, k, Y in zip(self.W, kappas, self.Y))
        lin = sum(((k - Y) * mt).sum() for k, Y, mt in zip(kappas, self.Y, self.mu_t))
        A, _ = self.precision(kappas)
        R = torch.linalg.cholesky(A)
        logdet = 2 * torch.log(torch.diagonal(R)).sum() + self.logdet_S
        ent = sum(b.psi(k).sum() for b, k in zip(self.bounds, kappas))
        return 0.5 * r @ (self.S @ r) - lin - 0.5 * logdet + ent

    def recover(self, kappas):
        """``(m, A, [(h_i, S_i)], alpha_flat, lam blocks)``: the posterior (Khan et al. 2013, Eqs. 17-18) and the
        block marginals of every group."""
        with torch.no_grad():
            A, lams = self.precision(kappas)
            alphas = [k - Y for k, Y in zip(kappas, self.Y)]
            r = sum(torch.einsum("nkl,nk->l", W, a) for W, a in zip(self.W, alphas))
            m = self.mu - self.S @ r
            R = torch.linalg.cholesky(A)
            marg = []
            for W, d in zip(self.W, self.d):
                h = W @ m + d
                G = torch.linalg.solve_triangular(R, W.reshape(-1, W.shape[-1]).transpose(0, 1), upper=False)
                G = G.transpose(0, 1).reshape(W.shape)  # rows of W R^{-T}
                S = torch.einsum("nkl,njl->nkj", G, G)
                marg.append((h, 0.5 * (S + S.transpose(-1, -2))))
        return m, A, marg, torch.cat([a.reshape(-1) for a in alphas]), lams

    def gap(self, kappas, marg):
        """Duality gap: the sum of the blocks' Fenchel-Young residuals (``>= 0``)."""
        with torch.no_grad():
            return float(sum(b.fenchel_young_residual(k, h, S).sum()
                             for b, k, (h, S) in zip(self.bounds, kappas, marg)))

    def initial(self):
        """``kappa`` at the prior marginals (``kappa*`` of the bound there) or from the data (``(e_y + 1/K) / 2``),
        whichever has the lower dual objective."""
        with torch.no_grad():
            prior = []
            for b, W, mt in zip(self.bounds, self.W, self.mu_t):
                S = torch.einsum("nkl,lm,njm->nkj", W, self.S, W)
                k = b.kappa_star(mt, S).clamp_min(1e-6)
                prior.append(k / k.sum(-1, keepdim=True))
            data = [0.5 * Y + 0.5 / K for Y, K in zip(self.Y, self.Ks)]
            return min((prior, data), key=lambda ks: float(self.objective(ks)))

    def derivatives(self, kappas):
        r"""``(g, gradient, Hessian)`` in the free coordinates (the first ``K - 1`` entries of every ``kappa_i``), in
        closed form (one ``K`` for all groups).

        In ``kappa`` (``kappa_K`` free too) the gradient of block ``i`` is ``-m~_i + log kappa_i + 1`` plus, for the
        tight bound (``ell = C(kappa)``), ``S_i kappa_i - diag(S_i) / 2``; the Hessian is
        ``W Sigma W^T + blockdiag(diag(1 / kappa_i))`` plus, for the tight bound, ``blockdiag(S_i)`` and
        ``tr(V~_ji D_ik V~_ij D_jl) / 2`` with ``V~ = W A^{-1} W^T`` and ``D_ik = d C / d kappa_ik``. The free
        coordinates are ``kappa_i = T x_i + e_K``, ``T = [I; -1^T]``.
        """
        K = self.Ks[0]
        W, k = torch.cat(self.W), torch.cat(kappas)
        n, L = W.shape[0], W.shape[-1]
        tight = self.bounds[0].name == "tight"
        with torch.no_grad():
            val = float(self.objective(kappas))
            A, _ = self.precision(kappas)
            R = torch.linalg.cholesky(A)
            m, _, marg, _, _ = self.recover(kappas)
            mt = torch.cat([h for h, _ in marg])
            S = torch.cat([s for _, s in marg])
            Wf = W.reshape(n * K, L)
            grad = -mt + torch.log(k) + 1
            H = Wf @ self.S @ Wf.transpose(0, 1)
            H = H.reshape(n, K, n, K)
            idx = torch.arange(n, device=k.device)
            H[idx, :, idx, :] += torch.diag_embed(1.0 / k)
            if tight:
                grad = grad + torch.einsum("nkj,nj->nk", S, k) - 0.5 * torch.diagonal(S, dim1=-2, dim2=-1)
                G = torch.linalg.solve_triangular(R, Wf.transpose(0, 1), upper=False)
                Vt = (G.transpose(0, 1) @ G).reshape(n, K, n, K)
                eye = torch.eye(K, dtype=k.dtype, device=k.device)
                # D[i, k, a, b] = d C(kappa_i)_{ab} / d kappa_ik
                D = torch.einsum("ka,kb->kab", eye, eye).unsqueeze(0) - eye[None, :, :, None] * k[:, None, None, :] \
                    - k[:, None, :, None] * eye[None, :, None, :]
                X = torch.einsum("jcia,ikab->ikbjc", Vt, D)
                H = H + 0.5 * torch.einsum("ikbjc,ibjd,jldc->ikjl", X, Vt, D)
                H[idx, :, idx, :] += S
            T = torch.cat([torch.eye(K - 1, dtype=k.dtype, device=k.device),
                           -torch.ones(1, K - 1, dtype=k.dtype, device=k.device)])
            gfree = (grad @ T).reshape(-1)
            Hfree = torch.einsum("ka,ikjl,lb->iajb", T, H, T).reshape(n * (K - 1), n * (K - 1))
        return val, gfree, 0.5 * (Hfree + Hfree.transpose(0, 1)), marg


@dataclass
class BlockSolution:
    kappas: list
    g: float
    gap: float
    gap_tol: float
    iterations: int
    evaluations: int
    converged: bool


def _newton(prob, kappas, gap_tol, max_iter, callback, history):
    x = prob.free(kappas).clone()
    evals, it = 0, 0

    def g_of(x):
        return prob.objective(prob.split_free(x))

    for it in range(max_iter + 1):
        kap = prob.split_free(x)
        m, A, marg, _, _ = prob.recover(kap)
        gap = prob.gap(kap, marg)
        val = float(g_of(x))
        evals += 1
        if history is not None:
            history.record(dual_objective=val, gap=gap)
        if callback is not None:
            callback(val, gap)
        if gap <= gap_tol or it == max_iter:
            return BlockSolution(kap, val, gap, gap_tol, it, evals, gap <= gap_tol)
        if len(set(prob.Ks)) == 1:
            _, grad, H, _ = prob.derivatives(kap)
        else:  # groups of different K: autograd
            xg = x.detach().requires_grad_(True)
            with torch.enable_grad():
                grad = torch.autograd.grad(g_of(xg), xg)[0]
            H = torch.autograd.functional.hessian(g_of, x.detach(), vectorize=True)
            H = 0.5 * (H + H.transpose(0, 1))
        try:
            step = -torch.cholesky_solve(grad[:, None], torch.linalg.cholesky(H))[:, 0]
        except RuntimeError:  # numerically indefinite far from the optimum: a scaled gradient step
            step = -grad / (grad.norm() + 1e-300)
        slope = float(grad @ step)
        t = 1.0
        for _ in range(60):
            new = x + t * step
            gv = float(g_of(new))
            evals += 1
            if math.isfinite(gv) and gv <= val + 1e-4 * t * slope:
                break
            t *= 0.5
        else:
            return BlockSolution(kap, val, gap, gap_tol, it, evals, False)
        x = new.detach()
    raise AssertionError("unreachable")


def _lbfgs(prob, kappas, gap_tol, max_iter, callback, history):
    z = [torch.log(k[:, :-1] / k[:, -1:]).detach() for k in kappas]
    zf = torch.cat([t.reshape(-1) for t in z]).requires_grad_(True)

    def kap_of(zf):
        out, start = [], 0
        for n, K in zip(prob.ns, prob.Ks):
            zz = zf[start:start + n * (K - 1)].reshape(n, K - 1)
            out.append(torch.softmax(torch.cat([zz, torch.zeros(n, 1, dtype=zf.dtype, device=zf.device)], -1), -1))
            start += n * (K - 1)
        return out

    opt = torch.optim.LBFGS([zf], lr=1, max_iter=20, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=0, tolerance_change=0)
    evals = [0]

    def closure():
        opt.zero_grad()
        v = prob.objective(kap_of(zf))
        v.backward()
        evals[0] += 1
        return v

    it = 0
    while True:
        kap = [k.detach() for k in kap_of(zf)]
        _, _, marg, _, _ = prob.recover(kap)
        gap = prob.gap(kap, marg)
        val = float(prob.objective(kap))
        if history is not None:
            history.record(dual_objective=val, gap=gap)
        if callback is not None:
            callback(val, gap)
        if gap <= gap_tol or evals[0] >= max_iter:
            return BlockSolution(kap, val, gap, gap_tol, it, evals[0], gap <= gap_tol)
        with torch.enable_grad():
            opt.step(closure)
        it += 1


def solve_block_dual(prob, kappas=None, method="newton", gap_tol=None, max_iter=None, callback=None, history=None):
    """Minimise the reduced block dual of ``prob`` (:class:`BlockDualProblem`) to a duality gap ``<= gap_tol``.

    :param kappas: starting ``kappa`` per group (default :meth:`BlockDualProblem.initial`).
    :param str method: ``"newton"`` (dense Hessian, at most :data:`NEWTON_MAX_VARIABLES` free variables) or
        ``"lbfgs"``.
    :param float gap_tol: default ``1e-8`` times the number of design rows.
    :param int max_iter: default 100 Newton steps / 2000 L-BFGS evaluations.
    :raises ValueError: for ``method="newton"`` on more than :data:`NEWTON_MAX_VARIABLES` free variables.
    :returns: a :class:`BlockSolution` (``kappas``, per group ``(n, K)``; ``g``, ``gap``, ``converged``, ...).

    Example::

        >>> import torch
        >>> from pyro_convexvb import LatentGaussianModel
        >>> from pyro_convexvb.lgm.families import Categorical
        >>> X = torch.tensor([[1., 0., 0.5, 0., 0., 0.], [0., 1., 0., 0.5, 0., 0.], [0., 0., 0., 0., 0., 0.],
        ...                   [1., 0., -1., 0., 0., 0.], [0., 1., 0., -1., 0., 0.], [0., 0., 0., 0., 0., 0.]],
        ...                  dtype=torch.float64)  # 2 observations x 3 classes, 4 weights (last class at 0)
        >>> lgm = LatentGaussianModel.from_design(X[:, :4], Categorical(torch.tensor([0., 2.], dtype=torch.float64), 3))
        >>> sol = solve_block_dual(BlockDualProblem(lgm))
        >>> sol.converged, [tuple(k.shape) for k in sol.kappas]
        (True, [(2, 3)])
    """
    gap_tol = 1e-8 * prob.num_rows if gap_tol is None else gap_tol
    kappas = prob.initial() if kappas is None else kappas
    if method == "newton":
        if prob.num_free > NEWTON_MAX_VARIABLES:
            raise ValueError(f"method: Newton's method on the Categorical dual forms a dense Hessian of {prob.num_free} "
                             f"free dual variables (more than {NEWTON_MAX_VARIABLES}); use method='lbfgs'")
        return _newton(prob, kappas, gap_tol, 100 if max_iter is None else max_iter, callback, history)
    if method == "lbfgs":
        return _lbfgs(prob, kappas, gap_tol, 2000 if max_iter is None else max_iter, callback, history)
    raise ValueError(f"method: expected 'newton' or 'lbfgs', got {method!r}")


def block_solution(prob, sol):
    """``(posterior, (exact bound or None, why not), lvb ELBO, (alpha, lam))`` of a solved block dual: the exact
    variational-Gaussian bound of ``q`` (:func:`~pyro_convexvb.lgm.families.categorical.expected_lse`, ``K <= 5``)
    or ``None`` where that quadrature is not computed (more classes, or rows too wide for its node budget)."""
    m, A, marg, alpha, lams = prob.recover(sol.kappas)
    posterior = GaussianPosterior(m, precision=A)
    V = torch.cholesky_inverse(torch.linalg.cholesky(A))
    exact, why = None, f"K > {MAX_QUADRATURE_CLASSES}: no exact quadrature"
    if max(prob.Ks) <= MAX_QUADRATURE_CLASSES:
        try:
            with torch.no_grad():
                exact = float(prob.lgm.evidence_lower_bound(m, 0.5 * (V + V.transpose(0, 1))))
        except QuadratureBudgetError as err:
            why = str(err).split(": ", 1)[-1]
    lam = torch.cat([lam.reshape(-1) for lam in lams])  # the groups' (n, K, K) blocks, flat: their K may differ
    return posterior, (exact, why), sol.g - sol.gap + prob.lgm.log_const, (alpha, lam)
