r"""The dual VG objective (Khan et al. 2013, Eq. 20) in three storage forms, with gradient, Hessian and gap.

For ``N`` sites ``eta = W z + d`` of a prior ``z ~ N(mu, Sigma)`` (``L`` latents), with
``Sigma_t = W Sigma W^T`` and ``mu_t = W mu + d``:

.. math::

    g(\alpha, \lambda) = \tfrac12 \alpha^T \tilde\Sigma \alpha - \tilde\mu^T \alpha
        - \tfrac12 \log|I + \Lambda^{1/2} \tilde\Sigma \Lambda^{1/2}| + \sum_n f_n^*(\alpha_n, \lambda_n).

The three *backends* compute the prior-dependent part (everything except ``sum f*``):

* :class:`SiteSpaceBackend` -- the ``N x N`` form (``docs/dual_vg.md``, § Dual decomposition,
  "Evaluation with N x N matrices"): Cholesky of ``B = I + Lambda^{1/2} Sigma_t Lambda^{1/2}``;
  ``O(N^3)``; never inverts ``Sigma`` (GP classification with an ill-conditioned kernel matrix is safe).
* :class:`LatentSpaceBackend` -- the ``L x L`` form for ``L < N`` (e.g. random features or
  Bayesian logistic regression): ``A = Sigma^{-1} + W^T Lambda W``; ``O(N L^2 + L^3)``.
* :class:`SparsePrecisionBackend` (also named ``BandedPrecisionBackend``) -- a latent GMRF given by a
  sparse precision ``Q``: sparse Cholesky of ``A = Q + W^T Lambda W`` with a fill-reducing ordering
  and the symbolic analysis reused, Takahashi's selected inversion for ``diag(A^{-1})``, and a
  matrix-free Hessian; memory ``O(nnz)`` of the factors; no dense inverse anywhere.

:func:`reduced_objective` evaluates the reduced dual ``g(alpha) = g(alpha, ell(alpha))`` with its
gradient and (optionally) Hessian; :func:`dual_vg_objective` is the public joint form.
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ...errors import NotPositiveDefiniteError
from ..posterior import GaussianPosterior
from ...linalg.operators import SparseOperator, as_operator
from ...distributed import reduction_of

__all__ = [
    "SiteSpaceBackend",
    "LatentSpaceBackend",
    "LatentSpaceHessian",
    "BandedPrecisionBackend",
    "SparsePrecisionBackend",
    "SparsePrecisionHessian",
    "DualValue",
    "dual_vg_objective",
    "reduced_objective",
    "exact_elbo",
    "lvb_elbo",
]


def _same(a, b):
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


def _chol(M, what):
    L, info = torch.linalg.cholesky_ex(M)
    if int(info) != 0:
        raise torch.linalg.LinAlgError(f"{what} is not positive definite (Cholesky failed at column {int(info)})")
    return L


def _prior_chol(M, what):
    """:func:`_chol` of the prior's covariance or precision: a failure is the model's prior (numerically singular),
    not the dual's iterate, and says so."""
    try:
        return _chol(M, what)
    except torch.linalg.LinAlgError as err:
        raise NotPositiveDefiniteError(f"dual_vg: the model's {err}: its prior covariance is numerically singular "
                                       "(e.g. a MultivariateNormal scale_tril with a diagonal entry near 0); give a "
                                       "positive definite prior") from None


#: ``lam_n Sigma_nn`` below which a site's variance is computed from its column of ``V_t``: the relative error of
#: ``(1 - (B^{-1})_nn) / lam_n`` grows like ``eps / (lam_n Sigma_nn)`` (measured 3e-12 at 1e-4 on keel GPs)
SMALL_PRECISION = 1e-4


@dataclass
class PriorTerms:
    """What a backend returns at ``lambda`` (and ``alpha``)."""

    m_tilde: torch.Tensor  # (N,) site means  mu_t - Sigma_t alpha
    v_tilde: Optional[torch.Tensor]  # (N,) site variances diag(W V W^T) (None: evaluate(..., variances=False))
    logdet_B: torch.Tensor  # log|I + Lam^1/2 Sigma_t Lam^1/2|
    quad: torch.Tensor  # alpha^T Sigma_t alpha
    V_tilde: Optional[torch.Tensor] = None  # (N, N) W V W^T (only when a Hessian is requested)
    Sigma_tilde: Optional[torch.Tensor] = None  # (N, N) (only when a Hessian is requested)


class SiteSpaceBackend:
    """``N x N`` form of the dual (Khan et al. 2013, Eq. 20).

    ``docs/dual_vg.md``, § Dual decomposition, "Evaluation with N x N matrices".

    :param torch.Tensor Sigma_tilde: ``(N, N)`` ``W Sigma W^T`` (e.g. a GP kernel matrix ``K``).
    :param torch.Tensor mu_tilde: ``(N,)`` ``W mu + d``.
    :param latent: ``(W Sigma, mu, Sigma)`` for a general design ``W`` (``None``: ``W = I``, the latent is
        ``eta - d``), for :meth:`posterior`.
    :param torch.Tensor site_offset: ``(N,)`` offsets ``d`` (``None``: zero).

    Example::

        >>> import torch
        >>> be = SiteSpaceBackend(torch.eye(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
        >>> t = be.evaluate(torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        >>> round(float(t.logdet_B), 6)  # 3 log 2
        2.079442
    """

    kind = "site"

    def __init__(self, Sigma_tilde, mu_tilde, latent=None, site_offset=None):
        N = mu_tilde.shape[0]
        self.latent, self.site_offset = latent, site_offset
        if tuple(Sigma_tilde.shape) != (N, N):
            raise ValueError(f"Sigma_tilde: expected shape ({N}, {N}), got {tuple(Sigma_tilde.shape)}")
        if not torch.isfinite(Sigma_tilde).all() or not torch.isfinite(mu_tilde).all():
            raise ValueError("Sigma_tilde / mu_tilde contain NaN or inf")
        self.St = Sigma_tilde
        self.mu_t = mu_tilde
        self.diag_St = torch.diagonal(Sigma_tilde).clone()
        self.N = N
        self._cache = None

    def prior_marginals(self):
        return self.mu_t, self.diag_St

    def factor(self, lam):
        """``(R, s)``: ``R R^T = B = I + Lam^1/2 Sigma_t Lam^1/2``, ``s = Lam^1/2`` (cached per ``lam``)."""
        if self._cache is None or not _same(self._cache[0], lam):
            s = lam.clamp_min(0).sqrt()
            B = self.St * s[:, None]
            B *= s[None, :]
            B.diagonal().add_(1.0)
            R = _chol(B, "I + Lam^1/2 Sigma_t Lam^1/2")
            self._cache = [lam, (R, s), None]  # lam, (R, s), B^{-1} (formed on first use)
        return self._cache[1]

    def _binv(self, lam):
        R, _ = self.factor(lam)
        if self._cache[2] is None:
            self._cache[2] = torch.cholesky_inverse(R)
        return self._cache[2]

    def _weak_sites(self, lam):
        """Sites with ``lam_n Sigma_nn < SMALL_PRECISION``: their variances take the triangular-solve route."""
        return torch.nonzero(lam * self.diag_St < SMALL_PRECISION).reshape(-1)

    def _weak_columns(self, lam, weak):
        """``V_t[:, weak] = Sigma_t[:, weak] - Sigma_t Lam^1/2 B^{-1} Lam^1/2 Sigma_t[:, weak]``."""
        _, s = self.factor(lam)
        Y = self._binv(lam) @ (s[:, None] * self.St[:, weak])
        return self.St[:, weak] - self.St @ (s[:, None] * Y)

    def site_variances(self, lam):
        """``diag(V_t)`` (``N``): ``(1 - (B^{-1})_nn) / lam_n``, the weak sites from their columns."""
        Binv = self._binv(lam)
        v = (1.0 - Binv.diagonal()) / lam.clamp_min(torch.finfo(lam.dtype).tiny)
        weak = self._weak_sites(lam)
        if weak.numel():
            v[weak] = self._weak_columns(lam, weak)[weak, torch.arange(weak.numel(), device=weak.device)]
        return v

    def evaluate(self, alpha, lam, hessian=False, variances=True):
        R, _ = self.factor(lam)
        St_a = self.St @ alpha
        if hessian:
            V = self.site_covariance(lam)
            v = V.diagonal().clone()
        else:
            v = self.site_variances(lam) if variances else None
        terms = PriorTerms(self.mu_t - St_a, None if v is None else v.clamp_min(0),
                           2 * torch.log(torch.diagonal(R)).sum(), alpha @ St_a)
        if hessian:
            terms.V_tilde = V
            terms.Sigma_tilde = self.St
        return terms

    def working_means(self, lam, b):
        r"""Site means of the Gaussian that multiplies the prior by site potentials ``exp(b_n h_n - lam_n h_n^2 / 2)``.

        ``m = mu_t + (Sigma_t^{-1} + Lam)^{-1} r`` with ``r = b - Lam mu_t``, evaluated as
        ``Sigma_t r - Sigma_t Lam^1/2 B^{-1} Lam^1/2 Sigma_t r`` with the Cholesky factor of ``B`` (shared with
        :meth:`evaluate` at the same ``lam``): no inverse and no variances. This is one step of iteratively
        reweighted least squares (:func:`~.optim.initial_alpha`'s Laplace start).

        :param torch.Tensor lam: ``(N,)`` non-negative site precisions.
        :param torch.Tensor b: ``(N,)`` linear coefficients.
        :returns: ``(N,)`` site means.
        """
        R, s = self.factor(lam)
        u = self.St @ (b - lam * self.mu_t)
        y = torch.cholesky_solve((s * u)[:, None], R).squeeze(-1)
        return self.mu_t + u - self.St @ (s * y)

    def site_covariance(self, lam):
        """``V_t = W V W^T = Sigma_t - Sigma_t Lam^1/2 B^{-1} Lam^1/2 Sigma_t`` (``N x N``).

        Entrywise ``(V_t)_nk = (delta_nk - (B^{-1})_nk) / (s_n s_k)`` (``s = Lam^1/2``; from
        ``C - C B^{-1} C = I - B^{-1}`` for ``C = Lam^1/2 Sigma_t Lam^1/2 = B - I``): one ``cholesky_inverse``
        (``2N^3/3`` flops) instead of a triangular solve and a Gram product (``3N^3``). Rows and columns of weak
        sites (``lam_n Sigma_nn < SMALL_PRECISION``, where ``1 - (B^{-1})_nn`` would cancel) come from
        ``Sigma_t - Sigma_t Lam^1/2 B^{-1} Lam^1/2 Sigma_t`` directly.
        """
        _, s = self.factor(lam)
        Binv = self._binv(lam)
        weak = self._weak_sites(lam)
        inv_s = torch.where(s > 0, 1.0 / s.clamp_min(torch.finfo(s.dtype).tiny), torch.zeros_like(s))
        V = Binv * inv_s[:, None]
        V *= -inv_s[None, :]
        V.diagonal().copy_((1.0 - Binv.diagonal()) * inv_s * inv_s)
        if weak.numel():
            cols = self._weak_columns(lam, weak)
            V[:, weak] = cols
            V[weak, :] = cols.transpose(0, 1)
        return V

    def posterior(self, alpha, lam, prior=None):
        """``q(z)`` over the latent ``z`` (Khan et al. 2013, Eqs. 17-18): with a general design ``W``,
        ``m = mu - Sigma W^T alpha``, ``V = Sigma - Sigma W^T Lam^1/2 B^{-1} Lam^1/2 W Sigma``; with ``W = I`` the
        Gaussian over the sites ``eta`` (``m = mu_t - Sigma_t alpha``; GP latent values ``f``) shifted back by the
        offset, ``z = eta - d``."""
        if self.latent is not None:
            WS, mu, S = self.latent  # WS = W Sigma  (N, L)
            R, s = self.factor(lam)
            T = torch.linalg.solve_triangular(R, s[:, None] * WS, upper=False)  # R^{-1} Lam^1/2 W Sigma  (N, L)
            V = S - T.transpose(0, 1) @ T
            return GaussianPosterior(mu - WS.transpose(0, 1) @ alpha, covariance=0.5 * (V + V.transpose(0, 1)))
        V = self.site_covariance(lam)
        d = self.site_offset if self.site_offset is not None else torch.zeros_like(self.mu_t)
        return GaussianPosterior(self.mu_t - self.St @ alpha - d, covariance=0.5 * (V + V.transpose(0, 1)))


class LatentSpaceBackend:
    """``L x L`` form (``A = Sigma^{-1} + W^T Lambda W``): ``O(N L^2 + L^3)`` per evaluation.

    :param W: ``(N, L)`` dense tensor, torch sparse tensor or operator.
    :param torch.Tensor prior_cov: ``(L, L)`` prior covariance ``Sigma`` (or pass ``prior_prec``).
    :param torch.Tensor prior_prec: ``(L, L)`` prior precision ``Sigma^{-1}``.
    :param torch.Tensor mu: ``(L,)`` prior mean.
    :param torch.Tensor offset: ``(N,)`` fixed offset ``d``.
    :param comm: ``None`` (one process) or a :class:`~pyro_convexvb.distributed.Communicator`: then ``W`` and
        ``offset`` are this rank's rows of the design (``N`` is the local number of sites) and the
        latent-space products ``W^T u`` and ``W^T Lambda W`` are all-reduced, so ``A``, its Cholesky
        factor and the posterior are replicated while every site-sized vector stays local.
    """

    kind = "latent"

    def __init__(self, W, mu, offset=None, prior_cov=None, prior_prec=None, prior_logdet_cov=None, comm=None):
        op = as_operator(W)
        self.N, self.L = op.shape
        self.comm = comm
        self.N_global = self.N if comm is None else comm.count(self.N)
        self.mu = mu
        self.d = torch.zeros(self.N, dtype=mu.dtype, device=mu.device) if offset is None else offset
        if prior_prec is None and prior_cov is None:
            raise ValueError("prior_cov or prior_prec is required")
        if prior_prec is None:
            prior_prec = torch.cholesky_inverse(_prior_chol(prior_cov, "prior covariance"))
        if prior_cov is None:
            prior_cov = torch.cholesky_inverse(_prior_chol(prior_prec, "prior precision"))
        self.P, self.S = prior_prec, prior_cov
        if prior_logdet_cov is None:
            prior_logdet_cov = -2 * torch.log(torch.diagonal(_prior_chol(prior_prec, "prior precision"))).sum()
        self.logdet_S = torch.as_tensor(prior_logdet_cov, dtype=mu.dtype, device=mu.device)
        if isinstance(op, SparseOperator):
            import scipy.sparse as sp

            A = op.matrix
            self._W_sp = sp.csr_matrix((A.values().cpu().numpy(), A.col_indices().cpu().numpy(),
                                        A.crow_indices().cpu().numpy()), shape=(self.N, self.L))
            self.Wd = None
        else:
            self._W_sp = None
            self.Wd = op.to_dense()
        self.op = op
        self.mu_t = op.mv(mu) + self.d
        self._cache = None

    def prior_marginals(self):
        G = torch.linalg.solve_triangular(_prior_chol(self.P, "prior precision"), self._Wt_dense(), upper=False)
        return self.mu_t, (G * G).sum(0)

    def _Wt_dense(self):
        if self.Wd is not None:
            return self.Wd.transpose(0, 1)
        return torch.as_tensor(self._W_sp.T.toarray(), dtype=self.mu.dtype, device=self.mu.device)

    def _rmv(self, u):
        """``W^T u`` over all sites (all-reduced when row-sharded)."""
        r = self.op.rmv(u)
        return r if self.comm is None else self.comm.sum(r)

    def _gram(self, lam):
        if self.Wd is not None:
            G = self.Wd.transpose(0, 1) @ (lam[:, None] * self.Wd)
        else:
            import scipy.sparse as sp

            G = (self._W_sp.T @ sp.diags(lam.detach().cpu().numpy()) @ self._W_sp).toarray()
            G = torch.as_tensor(G, dtype=self.mu.dtype, device=self.mu.device)
        return G if self.comm is None else self.comm.sum(G)

    def _factor(self, lam):
        hit = self._cache is not None and _same(self._cache[0], lam)
        if self.comm is not None:
            hit = self.comm.all(hit)  # every rank must join the all-reduce of the Gram matrix
        if hit:
            return self._cache[1]
        A = self.P + self._gram(lam)
        R = _chol(0.5 * (A + A.transpose(0, 1)), "Sigma^{-1} + W^T Lam W")
        G = torch.linalg.solve_triangular(R, self._Wt_dense(), upper=False)  # R^{-1} W^T  (L, N)
        out = (A, R, G)
        self._cache = (lam, out)
        return out

    def evaluate(self, alpha, lam, hessian=False, variances=True):
        A, R, G = self._factor(lam)
        Wa = self._rmv(alpha)
        SWa = self.S @ Wa
        m = self.mu - SWa
        v = (G * G).sum(0) if variances or hessian else None
        logdet_B = 2 * torch.log(torch.diagonal(R)).sum() + self.logdet_S
        terms = PriorTerms(self.op.mv(m) + self.d, v, logdet_B, Wa @ SWa)
        if hessian:
            if self.comm is not None:
                raise ValueError("dual_vg: the dense N x N Hessian is not available on row-sharded sites; use the "
                                 "matrix-free one (newton_solver='cg' or 'auto')")
            terms.V_tilde = G.transpose(0, 1) @ G
            Wt = self._Wt_dense()
            terms.Sigma_tilde = Wt.transpose(0, 1) @ (self.S @ Wt)
        return terms

    def working_means(self, lam, b):
        r"""Site means of the Gaussian that multiplies the prior by site potentials ``exp(b_n h_n - lam_n h_n^2 / 2)``:
        ``W z + d`` with ``z = mu + A^{-1} W^T (b - Lam mu_t)`` by the Cholesky factor of ``A`` (shared with
        :meth:`evaluate` at the same ``lam``; all-reduced when row-sharded), without variances.

        :param torch.Tensor lam: ``(N,)`` non-negative site precisions (this rank's sites when row-sharded).
        :param torch.Tensor b: ``(N,)`` linear coefficients.
        :returns: ``(N,)`` site means.
        """
        A, R, G = self._factor(lam)
        z = self.mu + torch.cholesky_solve(self._rmv(b - lam * self.mu_t)[:, None], R).squeeze(-1)
        return self.op.mv(z) + self.d

    def hessian_operator(self, lam, dl, diag):
        """The reduced-dual Hessian at ``lambda`` as a :class:`LatentSpaceHessian` (never ``N x N``)."""
        A, R, G = self._factor(lam)
        return LatentSpaceHessian(self, G, dl, diag)

    def posterior(self, alpha, lam, prior=None):
        """Gaussian over ``z``: ``m = mu - Sigma W^T alpha``, precision ``A`` (Khan et al. 2013, Eqs. 17-18)."""
        A, R, G = self._factor(lam)
        m = self.mu - self.S @ self._rmv(alpha)
        return GaussianPosterior(m, precision=0.5 * (A + A.transpose(0, 1)))


class LatentSpaceHessian:
    r"""Matrix-free reduced-dual Hessian of the ``L x L`` form, with a Woodbury preconditioner.

    The Hessian of the reduced dual (Khan et al. 2013, Eq. 20 with ``lambda = ell(alpha)``;
    ``docs/dual_vg.md``, § Dual decomposition, "Half-space conjugates and the reduced dual")

    .. math:: H = \tilde\Sigma + \tfrac12\,\mathrm{diag}(\ell')\,(\tilde V\circ\tilde V)\,\mathrm{diag}(\ell')
              + \mathrm{diag}(\psi'' - \tfrac12 \ell''\,\tilde v)

    is ``N x N`` and dense, but with ``\tilde\Sigma = W \Sigma W^T`` and ``\tilde V = G^T G``
    (``G = R^{-1} W^T``, ``R R^T = A = \Sigma^{-1} + W^T \Lambda W``) a product ``H x`` costs
    ``O(N L^2)``: ``(\tilde V\circ\tilde V) u = \mathrm{colsum}(G \circ (G\,\mathrm{diag}(u)\,G^T) G)``.
    The preconditioner keeps the low-rank prior part exactly and the diagonal of the rest,
    ``P = \tilde\Sigma + D_p`` with ``D_p = \mathrm{diag}(\psi'' - \tfrac12\ell''\tilde v + \tfrac12\ell'^2\tilde v^2)``,
    and is applied by the Woodbury identity
    ``P^{-1} = D_p^{-1} - D_p^{-1} W (\Sigma^{-1} + W^T D_p^{-1} W)^{-1} W^T D_p^{-1}`` (one ``L x L``
    Cholesky, ``O(N L^2)`` to set up, ``O(N L)`` per application).

    :param backend: the :class:`LatentSpaceBackend`.
    :param torch.Tensor G: ``(L, N)`` ``R^{-1} W^T`` at the current ``lambda``.
    :param torch.Tensor dl: ``(N,)`` ``ell'(alpha)``.
    :param torch.Tensor diag: ``(N,)`` ``psi''(alpha) - ell''(alpha) v_t / 2``.

    Example::

        >>> import torch
        >>> from pyro_convexvb.lgm.sites import BernoulliLogit
        >>> from pyro_convexvb.infer.dual_vg import make_bound, reduced_objective
        >>> W = torch.randn(40, 3, dtype=torch.float64)
        >>> be = LatentSpaceBackend(W, torch.zeros(3, dtype=torch.float64), prior_cov=torch.eye(3, dtype=torch.float64))
        >>> b = make_bound(BernoulliLogit((W[:, 0] > 0).double()))
        >>> alpha = torch.where(W[:, 0] > 0, -0.5, 0.5).double()
        >>> H = reduced_objective(be, b, alpha, hessian="operator").hessian
        >>> dense = reduced_objective(be, b, alpha, hessian=True).hessian
        >>> x = torch.randn(40, dtype=torch.float64)
        >>> bool(torch.allclose(H.mv(x), dense @ x))
        True
    """

    def __init__(self, backend, G, dl, diag):
        self.backend, self.G, self.dl, self.diag = backend, G, dl, diag
        self.shape = (G.shape[1], G.shape[1])
        self._pre = None

    def mv(self, x):
        """``H x`` in ``O(N L^2)``."""
        be, G = self.backend, self.G
        St_x = be.op.mv(be.S @ be._rmv(x))
        M = (G * (self.dl * x)) @ G.transpose(0, 1)  # G diag(l' x) G^T  (L, L)
        if be.comm is not None:
            M = be.comm.sum(M)  # a sum over sites: all ranks' columns of G
        had = ((M @ G) * G).sum(0)  # (V_t o V_t)(l' x)
        return St_x + self.diag * x + 0.5 * self.dl * had

    def precondition(self, r):
        """``P^{-1} r`` (Woodbury; see the class docstring)."""
        if self._pre is None:
            be = self.backend
            Dp = self._site_diagonal()
            floor = 1e-12 * float(Dp.abs().max().clamp_min(1e-300))
            Dinv = 1.0 / Dp.clamp_min(floor)
            K = be.P + be._gram(Dinv)
            self._pre = (Dinv, _chol(0.5 * (K + K.transpose(0, 1)), "Sigma^{-1} + W^T D^{-1} W"))
        Dinv, RK = self._pre
        y = Dinv * r
        z = torch.cholesky_solve(self.backend._rmv(y)[:, None], RK)[:, 0]
        return y - Dinv * self.backend.op.mv(z)

    def precondition_diagonal(self, r):
        """``r / diag(P)``: the Jacobi form of the preconditioner, positive definite in any arithmetic.

        The Woodbury form subtracts two nearly equal terms when ``D_p`` spans many orders of magnitude (sites
        far out in the tails of the prior, counts of 10^6, a design entry of 1e30), and rounding can then make
        ``r^T P^{-1} r <= 0``; Newton-CG falls back to this form for that step."""
        return r / (self._site_diagonal() + self.backend.prior_marginals()[1]).clamp_min(torch.finfo(r.dtype).tiny)

    def _site_diagonal(self):
        """``D_p = diag(psi'' - l'' v_t / 2 + l'^2 v_t^2 / 2)`` with ``v_t = diag(V_t)`` (the class docstring)."""
        v = (self.G * self.G).sum(0)
        return self.diag + 0.5 * (self.dl * v) ** 2

    def to_dense(self):
        """The ``N x N`` matrix (tests and small problems only; one process)."""
        be, G = self.backend, self.G
        if be.comm is not None:
            raise ValueError("LatentSpaceHessian.to_dense: not available on row-sharded sites")
        Wt = be._Wt_dense()
        V = G.transpose(0, 1) @ G
        H = Wt.transpose(0, 1) @ (be.S @ Wt) + 0.5 * self.dl[:, None] * (V * V) * self.dl[None, :]
        H.diagonal().add_(self.diag)
        return H


class _SparseAForm:
    """What the two sparse forms (:class:`SparsePrecisionBackend`, :class:`~.sparse.SparseLatentBackend`) share:
    the cached factorisation of ``A = Q + W^T Lambda W`` at ``lam`` with its selected inverse on demand, and the
    working means. A form supplies ``_refactor_A(lam_np)`` (the factor of ``A``, stored as ``self._chol["A"]``)
    and ``_selected_of(chol)`` (what its evaluations read from the selected inverse)."""

    def _factor(self, lam, variances=True):
        """``(log|A|, self._selected_of(factor) or None)`` at ``lam``; the selected inversion only when
        ``variances``. While the cache holds a ``lam``, ``self._chol["A"]`` is that ``lam``'s factor."""
        if self._cache is not None and _same(self._cache[0], lam):
            logdet, sel = self._cache[1]
            if sel is not None or not variances:
                return self._cache[1]
            chol = self._chol["A"][0]
        else:
            chol = self._refactor_A(self._np(lam))
            logdet = chol.logdet()
        out = (logdet, self._selected_of(chol) if variances else None)
        self._cache = (lam, out)
        return out

    def working_means(self, lam, b):
        r"""Site means of the Gaussian that multiplies the prior by site potentials ``exp(b_n h_n - lam_n h_n^2 / 2)``:
        ``W z + d`` with ``z = mu + A^{-1} W^T (b - Lam mu_t)``. One numeric factorisation of ``A`` (ordering and
        symbolic analysis reused) and one solve; no selected inversion.

        :param torch.Tensor lam: ``(N,)`` non-negative site precisions.
        :param torch.Tensor b: ``(N,)`` linear coefficients.
        :returns: ``(N,)`` site means.
        """
        lam_np = self._np(lam)
        if self._cache is not None and not _same(self._cache[0], lam):
            self._cache = None  # the factor of A is refactored below: the cached variances belong to another lam
        chol = self._refactor_A(lam_np)
        z = self.mu + chol.solve(self._Wt(self._np(b) - lam_np * self._np(self.mu_t)))
        return self._t(self._W(z) + self.d)


class SparsePrecisionBackend(_SparseAForm):
    r"""Latent GMRF form: sparse prior precision ``Q``; sites ``eta_n = w_n z_{j(n)} + d_n``.

    Every site reads one latent coordinate (``W`` has one nonzero per row, e.g. counts observed
    on the cells of a lattice), so ``W^T Lambda W`` is diagonal and ``A = Q + W^T Lambda W`` keeps
    the pattern of ``Q``. With the sparse Cholesky layer (:class:`~pyro_convexvb.linalg.SparseCholesky`,
    fill-reducing ordering; Rue & Held 2005, §2.4):

    * ``Q`` is factored once: ``log|Sigma| = -log|Q|``, the prior marginals ``diag(Q^{-1})`` by
      selected inversion, and ``alpha^T Sigma_t alpha = (W^T alpha)^T Q^{-1} (W^T alpha)`` by one solve;
    * per ``lambda``: a numeric factorisation of ``A`` that reuses the symbolic analysis,
      ``log|B| = log|A| - log|Q|`` (``docs/dual_vg.md``, § Dual decomposition) and the site variances
      ``v_t = w^2 diag(A^{-1})`` by Takahashi's selected inversion (Takahashi et al. 1973).

    Memory is ``O(nnz)`` of the two factors; no dense matrix is formed.

    The reduced-dual Hessian (``docs/dual_vg.md``, § Dual decomposition) is available as a
    matrix-free operator (:meth:`hessian_operator`): ``Sigma_t x`` by one solve with ``Q``, and the
    Hadamard term ``(V_t \circ V_t) u = w^2 (A^{-1} \circ A^{-1}) (W^T (w u))`` by forward-mode
    differentiation of the selected inversion
    (:meth:`~pyro_convexvb.linalg.SparseCholesky.diag_inverse_jvp`), preconditioned by
    ``Sigma_t + D_p`` through the Woodbury identity and one more factorisation with the same pattern.
    There is no dense Hessian (``evaluate(..., hessian=True)`` raises).

    Runs in NumPy/SciPy on the CPU; results come back on the input device.

    :param Q: ``(L, L)`` sparse (torch, SciPy or :class:`~pyro_convexvb.linalg.SparseOperator`) symmetric
        positive definite precision.
    :param torch.Tensor mu: ``(L,)`` prior mean.
    :param W: ``(N, L)`` sparse/dense with exactly one nonzero per row (``None``: identity).
    :param torch.Tensor offset: ``(N,)``.
    :param str cholesky_backend: backend of :class:`~pyro_convexvb.linalg.SparseCholesky` (default: its default).

    Example::

        >>> import torch
        >>> n = 5
        >>> Q = (2.5 * torch.eye(n, dtype=torch.float64) - torch.diag(torch.ones(n - 1, dtype=torch.float64), 1)
        ...      - torch.diag(torch.ones(n - 1, dtype=torch.float64), -1)).to_sparse_csr()
        >>> be = SparsePrecisionBackend(Q, torch.zeros(n, dtype=torch.float64))
        >>> t = be.evaluate(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64))
        >>> Qd = Q.to_dense()
        >>> bool(torch.allclose(t.v_tilde, torch.diagonal(torch.linalg.inv(Qd + torch.eye(n, dtype=torch.float64)))))
        True
    """

    kind = "banded"

    def __init__(self, Q, mu, W=None, offset=None, cholesky_backend=None):
        import scipy.sparse as sp

        from ...linalg.sparse_cholesky import SparseCholesky, _upper_with_diagonal, as_scipy_csc

        self.dtype, self.device = mu.dtype, mu.device
        Qs = as_scipy_csc(Q, "Q")
        Lsz = Qs.shape[0]
        self.L = Lsz
        if tuple(mu.shape) != (Lsz,):
            raise ValueError(f"mu: expected shape ({Lsz},), got {tuple(mu.shape)}")
        if W is None:
            Ws = sp.identity(Lsz, format="csr")
        else:
            Ws = _to_scipy(W).tocsr()
        Ws.eliminate_zeros()
        if Ws.shape[1] != Lsz:
            raise ValueError(f"W: expected {Lsz} columns, got {Ws.shape[1]}")
        if not np.all(np.diff(Ws.indptr) == 1):
            raise ValueError("W: the sparse-precision GMRF backend needs exactly one nonzero per row (a site reads "
                             "one latent)")
        self.N = Ws.shape[0]
        self.col = Ws.indices.astype(np.int64)
        self.w = Ws.data.astype(np.float64)
        self.Ws = Ws
        self.mu = mu.detach().cpu().numpy().astype(np.float64)
        self.d = np.zeros(self.N) if offset is None else offset.detach().cpu().numpy().astype(np.float64)
        self.cholesky_backend = cholesky_backend
        self.cholQ = SparseCholesky(Qs, cholesky_backend, name="Q")
        self.logdet_S = -self.cholQ.logdet()
        U = _upper_with_diagonal(Qs)
        self._Qupper = U.data.copy()
        self._indptr, self._indices = U.indptr, U.indices
        self._diag_pos = U.indptr[1:] - 1  # sorted upper-triangle columns end with their diagonal entry
        self._Qs = Qs
        self.mu_t = self._t(self.w * self.mu[self.col] + self.d)
        self._chol = {}  # "A" and "K" (preconditioner): SparseCholesky on the pattern of Q, with their diagonals
        self._cache = None

    def _t(self, x):
        return torch.as_tensor(x, dtype=self.dtype, device=self.device)

    def _np(self, x):
        return x.detach().cpu().numpy().astype(np.float64) if torch.is_tensor(x) else np.asarray(x, dtype=np.float64)

    def _Wt(self, a):  # W^T a
        return np.bincount(self.col, weights=self.w * a, minlength=self.L)

    def _W(self, z):  # W z
        return self.w * z[self.col]

    def prior_marginals(self):
        return self.mu_t, self._t(self.w**2 * self.cholQ.diag_inverse()[self.col])

    def _factor_with_diagonal(self, key, extra):
        """:class:`SparseCholesky` of ``Q + diag(extra)`` (same pattern every time: symbolic analysis reused)."""
        import scipy.sparse as sp

        from ...linalg.sparse_cholesky import SparseCholesky

        cur = self._chol.get(key)
        if cur is not None and np.array_equal(cur[1], extra):
            return cur[0]
        data = self._Qupper.copy()
        data[self._diag_pos] += extra
        if cur is None:
            chol = SparseCholesky((self._Qs + sp.diags(extra)).tocsc(), self.cholesky_backend, name="Q + W^T Lam W")
        else:
            chol = cur[0].update_values(data)
        self._chol[key] = (chol, extra.copy())
        return chol

    def _refactor_A(self, lam_np):
        return self._factor_with_diagonal("A", np.bincount(self.col, weights=self.w**2 * lam_np, minlength=self.L))

    def _selected_of(self, chol):
        return chol.diag_inverse()  # diag(A^{-1}) over the latents; site variances w^2 Zd[col]

    def evaluate(self, alpha, lam, hessian=False, variances=True):
        if hessian:
            raise NotImplementedError("the sparse-precision GMRF backend has no dense Hessian: use its matrix-free "
                                      "hessian_operator (Newton with newton_solver='cg') or method='lbfgs'")
        logdet_A, Zd = self._factor(lam, variances)
        Wa = self._Wt(self._np(alpha))
        SWa = self.cholQ.solve(Wa)
        m = self.mu - SWa
        v = self.w**2 * Zd[self.col] if variances else None
        logdet_B = logdet_A + self.logdet_S
        return PriorTerms(self._t(self._W(m) + self.d), None if v is None else self._t(v), self._t(logdet_B),
                          self._t(Wa @ SWa))

    def hessian_operator(self, lam, dl, diag):
        """The reduced-dual Hessian at ``lambda`` as a :class:`SparsePrecisionHessian` (matrix-free, never ``N x N``)."""
        self._factor(lam)
        return SparsePrecisionHessian(self, lam, dl, diag)

    def posterior(self, alpha, lam, prior=None):
        """Gaussian over the field: mean ``mu - Q^{-1} W^T alpha``, sparse precision ``A`` (matrix-free sampling).

        Samples are exact by perturb-and-solve with the factor ``J = [R_Q; Lam^1/2 W]``
        (``J^T J = A``), ``R_Q`` the sparse Cholesky factor of ``Q`` (``R_Q^T R_Q = Q``).
        """
        import scipy.sparse as sp

        _, Zd = self._factor(lam)
        m = self.mu - self.cholQ.solve(self._Wt(self._np(alpha)))
        lam_np = self._np(lam)
        A = (self._Qs + sp.diags(np.bincount(self.col, weights=self.w**2 * lam_np, minlength=self.L))).tocsr()
        J = sp.vstack([self.cholQ.factor_matrix(), sp.diags(np.sqrt(np.clip(lam_np, 0, None))) @ self.Ws]).tocsr()
        return GaussianPosterior(self._t(m), self._t(Zd), precision_operator=_sparse_op(A, self.dtype, self.device),
                                 precision_factor=_sparse_op(J, self.dtype, self.device))


#: the former name of :class:`SparsePrecisionBackend` (a banded ``Q`` is one sparse ``Q``)
BandedPrecisionBackend = SparsePrecisionBackend


class SparsePrecisionHessian:
    r"""Matrix-free reduced-dual Hessian of the sparse-precision GMRF form, with a Woodbury preconditioner.

    ``H = Sigma_t + diag(l') (V_t \circ V_t) diag(l') / 2 + diag(psi'' - l'' v_t / 2)``
    (``docs/dual_vg.md``, § Dual decomposition, "Half-space conjugates and the reduced dual") with
    ``Sigma_t = W Q^{-1} W^T`` and ``V_t = W A^{-1} W^T``. A product costs one solve with ``Q`` and one
    forward-mode selected inversion of ``A`` (:meth:`~pyro_convexvb.linalg.SparseCholesky.diag_inverse_jvp`,
    ``(A^{-1} \circ A^{-1}) t = -d diag((A + s diag(t))^{-1})/ds``). The preconditioner keeps the prior
    part exactly, ``P = Sigma_t + D_p``, ``D_p = diag(psi'' - l'' v_t / 2 + l'^2 v_t^2 / 2)``, and applies
    ``P^{-1} = D_p^{-1} - D_p^{-1} W (Q + W^T D_p^{-1} W)^{-1} W^T D_p^{-1}`` with a sparse factorisation
    on the pattern of ``Q``.

    :param backend: the :class:`SparsePrecisionBackend` (factored at ``lam``).
    :param torch.Tensor lam: ``(N,)``.
    :param torch.Tensor dl: ``(N,)`` ``ell'(alpha)``.
    :param torch.Tensor diag: ``(N,)`` ``psi''(alpha) - ell''(alpha) v_t / 2``.
    """

    def __init__(self, backend, lam, dl, diag):
        self.backend, self.lam = backend, lam
        self.dl, self.diag = backend._np(dl), backend._np(diag)
        self.shape = (backend.N, backend.N)
        self._pre = None

    def _chol_A(self):
        be = self.backend
        be._factor(self.lam, variances=False)
        return be._chol["A"][0]

    def mv(self, x):
        """``H x`` for ``x`` of shape ``(N,)`` (tensor in, tensor out)."""
        be = self.backend
        xn = be._np(x)
        out = be._W(be.cholQ.solve(be._Wt(xn))) + self.diag * xn
        if self.dl.any():  # a quadratic bound (lambda constant) has no V_t o V_t term: no selected inversion
            out = out + 0.5 * self.dl * self._hadamard(self.dl * xn)
        return be._t(out)

    def _hadamard(self, v):
        """``(V_t \\circ V_t) v`` (NumPy ``(N,)``), by one forward-mode selected inversion of ``A``."""
        be = self.backend
        t = np.bincount(be.col, weights=be.w**2 * v, minlength=be.L)
        return -be.w**2 * self._chol_A().diag_inverse_jvp(t)[be.col]

    def precondition(self, r):
        """``P^{-1} r`` (Woodbury; see the class docstring)."""
        be = self.backend
        if self._pre is None:
            Dp = self._site_diagonal()
            floor = 1e-12 * max(float(np.abs(Dp).max()), 1e-300)
            Dinv = 1.0 / np.clip(Dp, floor, None)
            extra = np.bincount(be.col, weights=be.w**2 * Dinv, minlength=be.L)
            self._pre = (Dinv, extra)
        Dinv, extra = self._pre
        chol = be._factor_with_diagonal("K", extra)
        rn = be._np(r)
        y = Dinv * rn
        z = chol.solve(be._Wt(y))
        return be._t(y - Dinv * be._W(z))

    def precondition_diagonal(self, r):
        """``r / diag(P)``: the Jacobi form, positive definite in any arithmetic (see
        :meth:`LatentSpaceHessian.precondition_diagonal`)."""
        be = self.backend
        d = self._site_diagonal() + be._np(be.prior_marginals()[1])
        return be._t(be._np(r) / np.clip(d, np.finfo(np.float64).tiny, None))

    def _site_diagonal(self):
        """``D_p = diag(psi'' - l'' v_t / 2 + l'^2 v_t^2 / 2)`` with ``v_t = diag(V_t)`` (the class docstring)."""
        be = self.backend
        _, Zd = be._factor(self.lam)
        return self.diag + 0.5 * (self.dl * be.w**2 * Zd[be.col]) ** 2

    def to_dense(self):
        """The ``N x N`` matrix (tests and small problems only)."""
        be = self.backend
        Wd = be.Ws.toarray()
        Qi = np.linalg.inv(be._Qs.toarray())
        lam_np = be._np(self.lam)
        Ai = np.linalg.inv(be._Qs.toarray() + (Wd.T * lam_np) @ Wd)
        V = Wd @ Ai @ Wd.T
        H = Wd @ Qi @ Wd.T + 0.5 * self.dl[:, None] * (V * V) * self.dl[None, :] + np.diag(self.diag)
        return be._t(H)


def _to_scipy(M):
    import scipy.sparse as sp

    if sp.issparse(M):
        return M
    if isinstance(M, SparseOperator):
        M = M.matrix
    if torch.is_tensor(M):
        if M.layout == torch.sparse_csr:
            return sp.csr_matrix((M.values().cpu().numpy(), M.col_indices().cpu().numpy(),
                                  M.crow_indices().cpu().numpy()), shape=tuple(M.shape))
        if M.is_sparse:
            M = M.coalesce()
            idx = M.indices().cpu().numpy()
            return sp.csr_matrix((M.values().cpu().numpy(), (idx[0], idx[1])), shape=tuple(M.shape))
        return sp.csr_matrix(M.detach().cpu().numpy())
    if hasattr(M, "to_dense"):
        return sp.csr_matrix(M.to_dense().detach().cpu().numpy())
    return sp.csr_matrix(np.asarray(M))


def _sparse_op(M, dtype, device):
    M = M.tocsr()
    M.sum_duplicates()  # sorted, distinct column indices per row
    t = torch.sparse_csr_tensor(torch.as_tensor(M.indptr, dtype=torch.int64), torch.as_tensor(M.indices, dtype=torch.int64),
                                torch.as_tensor(M.data, dtype=dtype), size=M.shape,
                                check_invariants=True).to(device)
    return SparseOperator(t)


# ----------------------------------------------------------------------------- objective
@dataclass
class DualValue:
    """Value of the dual objective and the quantities around it at one iterate."""

    g: torch.Tensor
    grad: torch.Tensor  # reduced gradient dg/dalpha, or joint (dg/dalpha, dg/dlambda)
    m_tilde: torch.Tensor
    v_tilde: torch.Tensor
    lam: torch.Tensor
    hessian: Optional[torch.Tensor] = None
    grad_lam: Optional[torch.Tensor] = None


def reduced_objective(backend, bound, alpha, hessian=False, gradient=True):
    r"""Reduced dual ``g(alpha) = g(alpha, ell(alpha))`` with gradient and optional Hessian.

    Khan et al. 2013, Eq. (20) with ``lambda`` eliminated (``docs/dual_vg.md``, § Dual
    decomposition, and § Fenchel conjugates of the local bounds): with ``psi, ell`` of the bound,

    * ``g = -alpha^T (mu_t + m_t) / 2 - log|B| / 2 + sum psi(alpha)``;
    * ``dg/dalpha = -m_t - ell'(alpha) v_t / 2 + psi'(alpha)``;
    * ``d2g = Sigma_t + diag(ell') (V_t o V_t) diag(ell') / 2 + diag(psi'' - ell'' v_t / 2)``
      (chain rule through ``ell``; ``docs/dual_vg.md``, § Dual decomposition), positive definite.

    :param hessian: ``False``, ``True`` (dense ``N x N`` Hessian) or ``"operator"`` (a matrix-free
        :class:`LatentSpaceHessian` when the backend offers one, else dense).
    :param bool gradient: ``False``: the value ``g`` alone, without the site variances (no selected inversion on
        the sparse forms, no inverse of ``B`` on the site form); ``grad`` and ``v_tilde`` are then ``None``.
    :returns: :class:`DualValue` (``g = +inf`` outside the domain).
    """
    if not gradient and hessian:
        raise ValueError("reduced_objective: a Hessian needs the gradient (gradient=True)")
    red = reduction_of(backend)
    lo, hi = bound.alpha_domain(alpha)
    if not red.all(bool(((alpha > lo) & (alpha < hi)).all())):
        inf = torch.full((), math.inf, dtype=alpha.dtype, device=alpha.device)
        return DualValue(inf, None, None, None, None)
    lam, dl, d2l = bound.ell(alpha)
    psi, dpsi, d2psi = bound.psi(alpha)
    operator = hessian == "operator" and hasattr(backend, "hessian_operator")
    if gradient:
        t = backend.evaluate(alpha, lam, hessian=bool(hessian) and not operator)
    else:
        t = backend.evaluate(alpha, lam, variances=False)
    # the site sums (of all ranks, in one all_reduce; -0.5 * a_m is exact, so one process rounds as before)
    a_m, psi_sum = red.sum(torch.stack([alpha @ (backend.mu_t + t.m_tilde), psi.sum()]))
    g = -0.5 * a_m - 0.5 * t.logdet_B + psi_sum
    if not gradient:
        return DualValue(g, None, t.m_tilde, None, lam, None)
    grad = -t.m_tilde - 0.5 * dl * t.v_tilde + dpsi
    H = None
    if operator:
        H = backend.hessian_operator(lam, dl, d2psi - 0.5 * d2l * t.v_tilde)
    elif hessian:
        H = t.Sigma_tilde + 0.5 * dl[:, None] * (t.V_tilde * t.V_tilde) * dl[None, :]
        H.diagonal().add_(d2psi - 0.5 * d2l * t.v_tilde)
    return DualValue(g, grad, t.m_tilde, t.v_tilde, lam, H)


def dual_vg_objective(alpha, lam, Sigma_tilde=None, mu_tilde=None, bound=None, *, backend=None):
    r"""The dual VG objective ``g(alpha, lambda)`` of Khan et al. 2013, Eq. (20), with its gradient.

    .. math::

        g = \tfrac12 \alpha^T\tilde\Sigma\alpha - \tilde\mu^T\alpha
            - \tfrac12\log|I + \Lambda^{1/2}\tilde\Sigma\Lambda^{1/2}| + \sum_n f_n^*(\alpha_n, \lambda_n),

    ``dg/dalpha = -m_t + d_alpha f*`` and ``dg/dlambda = -v_t / 2 + d_lambda f*``
    (``docs/dual_vg.md``, § Dual decomposition); for the half-space conjugates of :mod:`.bounds` the ``f*`` gradient is ``(psi'(alpha), 0)`` inside the
    domain (``+inf`` value outside).

    :param torch.Tensor alpha: ``(N,)``.
    :param torch.Tensor lam: ``(N,)``, nonnegative.
    :param torch.Tensor Sigma_tilde: ``(N, N)`` ``W Sigma W^T`` (``N x N`` form), or give ``backend``.
    :param torch.Tensor mu_tilde: ``(N,)``.
    :param bound: a :class:`~.bounds.LocalBound` (``None``: the ``f*`` term is left out).
    :param backend: a :class:`SiteSpaceBackend`, :class:`LatentSpaceBackend` (``L``-space form) or
        :class:`BandedPrecisionBackend`.
    :returns: :class:`DualValue` with ``grad`` = ``dg/dalpha`` and ``grad_lam`` = ``dg/dlambda``.

    Example::

        >>> import torch
        >>> K = torch.tensor([[1., .5], [.5, 1.]], dtype=torch.float64)
        >>> a = torch.tensor([.1, -.2], dtype=torch.float64); l = torch.tensor([.3, .4], dtype=torch.float64)
        >>> val = dual_vg_objective(a, l, K, torch.zeros(2, dtype=torch.float64))
        >>> val.grad.shape, val.grad_lam.shape
        (torch.Size([2]), torch.Size([2]))
    """
    if backend is None:
        if Sigma_tilde is None or mu_tilde is None:
            raise ValueError("give Sigma_tilde and mu_tilde, or a backend")
        backend = SiteSpaceBackend(Sigma_tilde, mu_tilde)
    if (lam < 0).any() or not torch.isfinite(lam).all():
        raise ValueError("lam: must be finite and nonnegative")
    t = backend.evaluate(alpha, lam)
    g = -0.5 * alpha @ (backend.mu_t + t.m_tilde) - 0.5 * t.logdet_B
    ga, gl = -t.m_tilde, -0.5 * t.v_tilde
    if bound is not None:
        fstar = bound.conjugate(alpha, lam)
        g = g + fstar.sum()
        ga = ga + bound.psi(alpha)[1]
    return DualValue(g, ga, t.m_tilde, t.v_tilde, lam, grad_lam=gl)


def lvb_elbo(backend, bound, alpha, lam, terms=None):
    r"""Primal LVB objective at the recovered ``q``: ``(lam^T v - alpha^T Sigma_t alpha - log|B|)/2 - sum f``.

    Khan et al. 2013, Eq. (11) at ``(m*, V*)`` of Eqs. (17)-(18); ``docs/dual_vg.md``, § Dual
    decomposition ("Duality gap").

    A lower bound on ``log p(y)`` for every ``(alpha, lambda >= 0)``.
    """
    t = backend.evaluate(alpha, lam) if terms is None else terms
    lv, fs = reduction_of(backend).sum(torch.stack([lam @ t.v_tilde, bound.f(t.m_tilde, t.v_tilde).sum()]))
    return 0.5 * (lv - t.quad - t.logdet_B) - fs


def exact_elbo(backend, bound, alpha, lam, terms=None, log_const=0.0):
    r"""Exact VG bound of ``q = N(m*, V*)`` recovered from ``(alpha, lambda)``.

    ``docs/dual_vg.md``, § Dual decomposition and § Algorithm and recovery ("Reported bound").

    ``-KL(q || p) = (lam^T v - alpha^T Sigma_t alpha - log|B|) / 2`` plus the exact (closed-form or
    Gauss-Hermite) expected log-likelihoods at the site marginals; never inverts ``Sigma``.
    """
    t = backend.evaluate(alpha, lam) if terms is None else terms
    ex = bound.exact_expected_log_prob(t.m_tilde, t.v_tilde).sum()
    lv, ex = reduction_of(backend).sum(torch.stack([lam @ t.v_tilde, ex]))
    return 0.5 * (lv - t.quad - t.logdet_B) + ex + log_const
