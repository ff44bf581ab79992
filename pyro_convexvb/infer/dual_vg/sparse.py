r"""The sparse latent form of the dual VG objective: a sparse prior precision and a sparse design.

A latent Gaussian model whose prior precision ``Q`` (``L x L``) and design ``W`` (``N x L``) are both sparse --
a random-intercept model with ``10^4`` groups, whose centred hierarchy :mod:`pyro_convexvb.lgm.chains` turns into
a diagonal prior and a design ``B (I - A)^{-1}`` with a handful of nonzeros per row -- needs no dense ``L x L``
matrix. The dual (Khan et al. 2013, Eq. 20) reads the prior through

* ``A = Q + W^T Lambda W`` (sparse: the pattern of ``Q`` and of ``W^T W``), factored by the sparse Cholesky
  layer (:class:`~pyro_convexvb.linalg.SparseCholesky`; fill-reducing ordering, symbolic analysis kept across
  ``lambda``): ``log|B| = log|A| - log|Q|``;
* the site variances ``v_n = w_n^T A^{-1} w_n``, which read ``A^{-1}`` only on the pairs of latents one site
  reads together -- entries of ``A``'s pattern, hence of the selected inverse on the factor's pattern
  (Takahashi et al. 1973; Rue & Held 2005, §2.3.1);
* ``alpha^T W Q^{-1} W^T alpha`` by one solve with ``Q``.

The reduced-dual Hessian is matrix-free: its Hadamard term ``(V_t \circ V_t) x = diag(V_t diag(x) V_t)`` is
``-d/ds v(A + s W^T diag(x) W)``, the forward-mode derivative of the selected inversion along a perturbation on
``A``'s own pattern (:meth:`~pyro_convexvb.linalg.SparseCholesky.selected_values_jvp`). Newton-CG uses it with
the Woodbury preconditioner of :class:`~.objective.SparsePrecisionHessian` (one more factorisation on the same
pattern). Memory is ``O(nnz)`` of the factors and of the site pairs; ``docs/dual_vg.md`` (§ Storage forms)
says when ``form='auto'`` picks it.
"""
import numpy as np
import torch

from ..posterior import GaussianPosterior
from .objective import PriorTerms, SparsePrecisionHessian, _SparseAForm, _sparse_op, _to_scipy

__all__ = ["SparseLatentBackend", "SparseLatentHessian", "MAX_SITE_PAIRS"]

#: largest number of (site, latent, latent) pairs ``sum_n r_n (r_n + 1) / 2`` (``r_n`` nonzeros in row ``n`` of
#: the design) the sparse latent form accepts: a design with dense rows belongs to the ``L x L`` form
MAX_SITE_PAIRS = 50_000_000


def _site_pairs(Ws):
    """``(site, j, k, w_j w_k)`` for every pair of nonzeros ``j <= k`` in each row of the CSR design ``Ws``."""
    indptr, cols, vals = Ws.indptr, Ws.indices.astype(np.int64), Ws.data.astype(np.float64)
    lengths = np.diff(indptr)
    total = int((lengths * (lengths + 1) // 2).sum())
    if total > MAX_SITE_PAIRS:
        raise ValueError(f"the design has {total} (site, latent, latent) pairs (rows with many nonzeros), more than "
                         f"MAX_SITE_PAIRS = {MAX_SITE_PAIRS}; use form='latent'")
    row_of = np.repeat(np.arange(Ws.shape[0], dtype=np.int64), lengths)
    end = indptr[1:][row_of]
    pos = np.arange(len(cols), dtype=np.int64)
    site, j, k, w = [], [], [], []
    for off in range(int(lengths.max()) if len(lengths) else 0):
        p = pos[pos + off < end]
        site.append(row_of[p])
        j.append(cols[p])
        k.append(cols[p + off])
        w.append(vals[p] * vals[p + off])
    if not site:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, np.zeros(0)
    return np.concatenate(site), np.concatenate(j), np.concatenate(k), np.concatenate(w)


class SparseLatentBackend(_SparseAForm):
    r"""Sparse latent form of the dual: ``A = Q + W^T Lambda W`` by sparse Cholesky (see the module docstring).

    :param Q: ``(L, L)`` sparse (SciPy, torch sparse or :class:`~pyro_convexvb.linalg.SparseOperator`)
        symmetric positive definite prior precision.
    :param torch.Tensor mu: ``(L,)`` prior mean.
    :param W: ``(N, L)`` design (sparse or dense; a dense one is converted, so give it sparse).
    :param torch.Tensor offset: ``(N,)`` (``None``: zero).
    :param str cholesky_backend: backend of :class:`~pyro_convexvb.linalg.SparseCholesky` (default: its default).
    :raises ValueError: a design with more than :data:`MAX_SITE_PAIRS` site pairs.

    Runs in NumPy/SciPy on the CPU; results come back on the device and dtype of ``mu``.

    Example (two sites reading two latents each; the site variances against the dense formula)::

        >>> import torch
        >>> Q = torch.diag(torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64))
        >>> W = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, -1.0]], dtype=torch.float64)
        >>> be = SparseLatentBackend(Q.to_sparse_csr(), torch.zeros(3, dtype=torch.float64), W.to_sparse_csr())
        >>> lam = torch.tensor([0.5, 1.5], dtype=torch.float64)
        >>> t = be.evaluate(torch.zeros(2, dtype=torch.float64), lam)
        >>> V = torch.linalg.inv(Q + W.T @ torch.diag(lam) @ W)
        >>> bool(torch.allclose(t.v_tilde, torch.diagonal(W @ V @ W.T)))
        True
    """

    kind = "sparse"

    def __init__(self, Q, mu, W, offset=None, cholesky_backend=None):
        import scipy.sparse as sp

        Qs, Ws = _checked(Q, mu, W)
        L = Qs.shape[0]
        self.L, self.N, self.Ws = L, Ws.shape[0], Ws
        self.cholesky_backend = cholesky_backend
        site, j, k, w = _site_pairs(Ws)
        self._site, self._pw = site, w  # w_j w_k of each pair
        self._vcoef = np.where(j == k, w, 2.0 * w)  # v_n = sum over pairs of vcoef * Z_jk
        # the pattern of A: upper triangles of Q and of W^T W, every diagonal entry, explicit zeros kept
        Qc = Qs.tocoo()
        up = Qc.row <= Qc.col
        rows = np.concatenate([Qc.row[up], j, np.arange(L)])
        cols = np.concatenate([Qc.col[up], k, np.arange(L)])
        U = sp.csc_matrix((np.zeros(len(rows)), (rows, cols)), shape=(L, L))
        U.sum_duplicates()
        U.sort_indices()
        col_of = np.repeat(np.arange(L, dtype=np.int64), np.diff(U.indptr))
        keys = col_of * L + U.indices
        self._Qupper = np.zeros(U.nnz)
        np.add.at(self._Qupper, np.searchsorted(keys, Qc.col[up].astype(np.int64) * L + Qc.row[up]), Qc.data[up])
        self._pair_upos = np.searchsorted(keys, k * L + j)  # position of each pair in the pattern of A
        self._pattern = (U.indptr, U.indices)
        self._keys = keys
        self._chol = {}
        self._set_prior(Qs, mu, offset)

    def _set_prior(self, Qs, mu, offset):
        """The prior's values (``Q``, ``mu``) and the offset; ``self._Qupper`` already on the pattern of ``A``."""
        self.dtype, self.device = mu.dtype, mu.device
        self.mu = mu.detach().cpu().numpy().astype(np.float64)
        self.d = np.zeros(self.N) if offset is None else offset.detach().cpu().numpy().astype(np.float64)
        self._cache = None
        self._cholQ = None
        self.logdet_S = -self.cholQ.logdet()
        self._Qs = Qs
        self.mu_t = self._t(self.Ws @ self.mu + self.d)

    @property
    def cholQ(self):
        """The sparse Cholesky factor of ``Q`` (refactored on demand after :meth:`reuse` took this one's)."""
        if self._cholQ is None:
            self._cholQ = self._factor_values("Q", self._Qupper)
        return self._cholQ

    @classmethod
    def reuse(cls, prev, Q, mu, W, offset=None):
        """The backend of ``(Q, mu, W, offset)`` built from ``prev``'s structure, or ``None`` when it does not apply.

        When ``W`` equals ``prev``'s design (same pattern and values) and ``Q``'s pattern lies in that of ``prev``'s
        ``A``, the site pairs, the pattern of ``A``, the fill-reducing orderings, symbolic factorisations and
        selected-inverse positions are ``prev``'s, and only the numeric factorisations are redone (the points of a
        hyper-latent that enters only the prior: a group scale ``sigma`` of random intercepts). The factors are
        moved, not shared: ``prev`` refactors its own on its next use, so both stay correct. The result equals a
        fresh ``SparseLatentBackend(Q, mu, W, offset)`` to rounding (the same ordering, hence the same arithmetic).
        """
        if not isinstance(prev, cls):
            return None
        Qs, Ws = _checked(Q, mu, W)
        P = prev.Ws
        if Ws.shape != P.shape or not (np.array_equal(Ws.indptr, P.indptr) and np.array_equal(Ws.indices, P.indices)
                                       and np.array_equal(Ws.data, P.data)):
            return None
        L = Qs.shape[0]
        Qc = Qs.tocoo()
        up = Qc.row <= Qc.col
        want = Qc.col[up].astype(np.int64) * L + Qc.row[up]
        pos = np.searchsorted(prev._keys, want)
        if len(want) and (pos.max() >= len(prev._keys) or not np.array_equal(prev._keys[pos], want)):
            return None  # Q reads entries outside the pattern of A: a fresh analysis
        new = cls.__new__(cls)
        for name in ("L", "N", "Ws", "cholesky_backend", "_site", "_pw", "_vcoef", "_pair_upos", "_pattern", "_keys"):
            setattr(new, name, getattr(prev, name))
        new._Qupper = np.zeros(len(prev._keys))
        np.add.at(new._Qupper, pos, Qc.data[up])
        new._chol, prev._chol = prev._chol, {}
        prev._cholQ, prev._cache = None, None
        new._set_prior(Qs, mu, offset)
        return new

    # ------------------------------------------------------------------ helpers
    def _t(self, x):
        return torch.as_tensor(x, dtype=self.dtype, device=self.device)

    def _np(self, x):
        return x.detach().cpu().numpy().astype(np.float64) if torch.is_tensor(x) else np.asarray(x, dtype=np.float64)

    def _Wt(self, a):
        return self.Ws.T @ a

    def _W(self, z):
        return self.Ws @ z

    def _gram_upper(self, site_weights):
        """Values of ``Q + W^T diag(site_weights) W`` on the pattern of ``A`` (upper triangle)."""
        return self._Qupper + np.bincount(self._pair_upos, weights=self._pw * site_weights[self._site],
                                          minlength=len(self._Qupper))

    def _factor_values(self, key, data):
        """:class:`SparseCholesky` of the matrix with upper-triangle values ``data`` on the pattern of ``A`` (the
        ordering and symbolic analysis made once per ``key``), with the pair positions in its selected inverse."""
        import scipy.sparse as sp

        from ...linalg.sparse_cholesky import SparseCholesky

        cur = self._chol.get(key)
        if cur is not None and np.array_equal(cur[1], data):
            return cur[0]
        if cur is not None and not np.array_equal(cur[0].pattern[1], self._pattern[1]):
            cur = None
        if cur is None:
            U = sp.csc_matrix((data, self._pattern[1], self._pattern[0]), shape=(self.L, self.L))
            chol = SparseCholesky(_symmetric_from_upper(U), self.cholesky_backend, name=f"{key} (sparse latent form)")
        else:
            chol = cur[0].update_values(data)
        key_now = getattr(chol, "_pair_key", None)
        if key_now is None or key_now[0] is not chol.Lp or key_now[1] is not chol.Li:
            chol._pair_pos = chol.entry_positions(self._pairs_jk()[0], self._pairs_jk()[1])
            chol._pair_key = (chol.Lp, chol.Li)
        self._chol[key] = (chol, data.copy())
        return chol

    def _pairs_jk(self):
        rows, cols = self._pattern[1], np.repeat(np.arange(self.L, dtype=np.int64), np.diff(self._pattern[0]))
        return rows[self._pair_upos], cols[self._pair_upos]

    def _pair_quad(self, chol, values):
        """``sum over each site's pairs of vcoef * values[pair position]`` (``(N,)``)."""
        return np.bincount(self._site, weights=self._vcoef * values[chol._pair_pos], minlength=self.N)

    # ------------------------------------------------------------------ backend protocol
    def prior_marginals(self):
        return self.mu_t, self._t(self._pair_quad(self.cholQ, self.cholQ.selected_values()))

    def _refactor_A(self, lam_np):
        return self._factor_values("A", self._gram_upper(lam_np))

    def _selected_of(self, chol):
        return self._pair_quad(chol, chol.selected_values())  # the site variances

    def evaluate(self, alpha, lam, hessian=False, variances=True):
        if hessian:
            raise NotImplementedError("the sparse latent form has no dense Hessian: use its matrix-free "
                                      "hessian_operator (Newton with newton_solver='cg' or 'auto') or method='lbfgs'")
        logdet_A, v = self._factor(lam, variances)
        Wa = self._Wt(self._np(alpha))
        SWa = self.cholQ.solve(Wa)
        m = self.mu - SWa
        return PriorTerms(self._t(self._W(m) + self.d), None if v is None else self._t(v),
                          self._t(logdet_A + self.logdet_S), self._t(Wa @ SWa))

    def hessian_operator(self, lam, dl, diag):
        """The reduced-dual Hessian at ``lambda`` as a :class:`SparseLatentHessian` (matrix-free, never ``N x N``)."""
        self._factor(lam)
        return SparseLatentHessian(self, lam, dl, diag)

    def posterior(self, alpha, lam, prior=None):
        """Gaussian over the latent: mean ``mu - Q^{-1} W^T alpha``, sparse precision ``A`` (Khan et al. 2013,
        Eqs. 17-18) with the factor ``J = [R_Q; Lam^1/2 W]`` (``J^T J = A``) for perturb-and-solve sampling and
        the marginal variances ``diag(A^{-1})`` by selected inversion."""
        import scipy.sparse as sp

        self._factor(lam)
        chol = self._chol["A"][0]
        m = self.mu - self.cholQ.solve(self._Wt(self._np(alpha)))
        lam_np = np.clip(self._np(lam), 0, None)
        A = (self._Qs + self.Ws.T @ sp.diags(lam_np) @ self.Ws).tocsr()
        J = sp.vstack([self.cholQ.factor_matrix(), sp.diags(np.sqrt(lam_np)) @ self.Ws]).tocsr()
        return GaussianPosterior(self._t(m), self._t(chol.diag_inverse()),
                                 precision_operator=_sparse_op(A, self.dtype, self.device),
                                 precision_factor=_sparse_op(J, self.dtype, self.device))


def _checked(Q, mu, W):
    """``(Q, W)`` as SciPy CSC and canonical CSR (float64, duplicates summed, zeros dropped, sorted), checked
    against ``mu``'s length."""
    from ...linalg.sparse_cholesky import as_scipy_csc

    Qs = as_scipy_csc(Q, "Q")
    L = Qs.shape[0]
    if tuple(mu.shape) != (L,):
        raise ValueError(f"mu: expected shape ({L},), got {tuple(mu.shape)}")
    Ws = _to_scipy(W).tocsr().astype(np.float64)
    Ws.sum_duplicates()
    Ws.eliminate_zeros()
    Ws.sort_indices()
    if Ws.shape[1] != L:
        raise ValueError(f"W: expected {L} columns, got {Ws.shape[1]}")
    return Qs, Ws


def _symmetric_from_upper(U):
    """The symmetric CSC matrix of an upper triangle ``U`` (diagonal included), explicit zeros kept."""
    import scipy.sparse as sp

    C = U.tocoo()
    off = C.row != C.col
    rows = np.concatenate([C.row, C.col[off]])
    cols = np.concatenate([C.col, C.row[off]])
    M = sp.csc_matrix((np.concatenate([C.data, C.data[off]]), (rows, cols)), shape=U.shape)
    M.sort_indices()
    return M


class SparseLatentHessian(SparsePrecisionHessian):
    r"""Matrix-free reduced-dual Hessian of the sparse latent form, with a Woodbury preconditioner.

    ``H = Sigma_t + diag(l') (V_t \circ V_t) diag(l') / 2 + diag(psi'' - l'' v_t / 2)`` with
    ``Sigma_t = W Q^{-1} W^T`` and ``V_t = W A^{-1} W^T`` (``docs/dual_vg.md``, § Dual decomposition). A product
    costs one solve with ``Q`` and one forward-mode selected inversion of ``A`` along ``W^T diag(l' x) W``. The
    preconditioner is that of :class:`~.objective.SparsePrecisionHessian`, ``P = Sigma_t + D_p`` applied by the
    Woodbury identity with a factorisation of ``Q + W^T D_p^{-1} W`` on the pattern of ``A``.
    """

    def _hadamard(self, v):
        """``(V_t \\circ V_t) v`` along ``W^T diag(v) W`` (the product of the base class uses it)."""
        be = self.backend
        chol = self._chol_A()
        dZ = chol.selected_values_jvp(chol._pair_pos, be._pw * v[be._site])
        return -be._pair_quad(chol, dZ)

    def precondition(self, r):
        """``P^{-1} r`` (Woodbury; see the class docstring)."""
        be = self.backend
        if self._pre is None:
            Dp = self._site_diagonal()
            floor = 1e-12 * max(float(np.abs(Dp).max()), 1e-300)
            Dinv = 1.0 / np.clip(Dp, floor, None)
            self._pre = (Dinv, be._gram_upper(Dinv))
        Dinv, data = self._pre
        chol = be._factor_values("K", data)
        rn = be._np(r)
        y = Dinv * rn
        z = chol.solve(be._Wt(y))
        return be._t(y - Dinv * be._W(z))

    def _site_diagonal(self):
        be = self.backend
        _, v = be._factor(self.lam)
        return self.diag + 0.5 * (self.dl * v) ** 2

    def to_dense(self):
        """The ``N x N`` matrix (tests and small problems only)."""
        be = self.backend
        Wd = be.Ws.toarray()
        Qd = be._Qs.toarray()
        lam_np = be._np(self.lam)
        V = Wd @ np.linalg.inv(Qd + (Wd.T * lam_np) @ Wd) @ Wd.T
        H = Wd @ np.linalg.inv(Qd) @ Wd.T + 0.5 * self.dl[:, None] * (V * V) * self.dl[None, :] + np.diag(self.diag)
        return be._t(H)
