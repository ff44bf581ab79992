r"""Sparse Cholesky factorisation of a symmetric positive definite matrix, with selected inversion.

:class:`SparseCholesky` factors ``Q`` once, with a fill-reducing ordering, as

.. math:: Q_{pp} = L D L^T, \qquad Q_{pp} = Q[p][:, p],

(``L`` unit lower triangular and sparse, ``D`` diagonal and positive), and offers what latent
Gaussian Markov random fields need (Rue & Held 2005, §2.4 and §2.3.1):

* :meth:`~SparseCholesky.logdet` -- ``log|Q| = sum_i log D_i``;
* :meth:`~SparseCholesky.solve` -- ``Q^{-1} b`` by two sparse triangular solves;
* :meth:`~SparseCholesky.solve_Lt` -- ``x = P^T L^{-T} D^{-1/2} eps``, so that ``x ~ N(0, Q^{-1})``
  for ``eps ~ N(0, I)`` (Rue & Held 2005, Algorithm 2.4);
* :meth:`~SparseCholesky.diag_inverse` -- ``diag(Q^{-1})`` by the Takahashi recursion (Takahashi et
  al. 1973; Rue & Held 2005, §2.3.1), which computes ``Z = Q^{-1}`` only on the pattern of ``L``:
  ``Z_ij = -sum_k L_kj Z_ki`` and ``Z_jj = 1/D_j - sum_k L_kj Z_kj`` over ``k`` in the pattern of
  column ``j``, for ``j = n-1, ..., 0``. No dense inverse is formed; the work is that of the
  factorisation and the memory ``O(nnz(L))``;
* :meth:`~SparseCholesky.diag_inverse_jvp` -- the directional derivative of ``diag(Q^{-1})`` when the
  diagonal of ``Q`` moves, ``-(Q^{-1} \circ Q^{-1}) \delta``, by forward-mode differentiation of the
  factorisation and of the recursion (the Hessian-vector products of ``log|Q + diag(d)|``);
* :meth:`~SparseCholesky.update` -- a new numeric factorisation for a matrix with the same pattern,
  reusing the ordering and the symbolic analysis (a new analysis when the pattern changed);
* :meth:`~SparseCholesky.factor_matrix` -- ``R = D^{1/2} L^T P`` with ``R^T R = Q``, sparse.

Backends (``backend=``), all with an approximate-minimum-degree type ordering:

* ``"qdldl"`` (default) -- QDLDL (Stellato et al. 2020), a simplicial ``L D L^T`` with AMD ordering
  (Amestoy, Davis & Duff 1996); exposes the factor and refactors numerically with the symbolic
  analysis kept. Installed with the package.
* ``"cholmod"`` -- SuiteSparse CHOLMOD (Chen, Davis, Hager & Rajamanickam 2008), supernodal, through
  the ``cvxopt`` package (optional; GPL). cvxopt hands out the factor only by converting it in place,
  so every factorisation repeats the symbolic analysis.
* ``"splu"`` -- SciPy's SuperLU in symmetric mode without pivoting (no extra dependency; an ``L U``
  factorisation, so twice the memory, and no reuse of the symbolic analysis).

``docs/linalg.md``, § "Sparse Cholesky", records the comparison that chose the default.

The selected inversion and the triangular solves run on the factor in compiled loops (numba, the
``fast`` extra); without numba the same loops run in Python (correct, much slower).
"""

import numpy as np
import scipy.sparse as sp

from ..errors import NotPositiveDefiniteError

__all__ = ["SparseCholesky", "BACKENDS", "DEFAULT_BACKEND", "available_backends", "as_scipy_csc"]

#: backend names accepted by :class:`SparseCholesky`
BACKENDS = ("qdldl", "cholmod", "splu")
#: the backend used when none is given (chosen in ``docs/linalg.md``, § "Sparse Cholesky")
DEFAULT_BACKEND = "qdldl"

_SYMMETRY_RTOL = 1e-10

try:  # numba is optional (the ``fast`` extra)
    import numba

    _jit = numba.njit(cache=True, nogil=True)
    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only without numba
    HAVE_NUMBA = False

    def _jit(f):
        return f


def available_backends():
    """Names of the backends that can be imported here, default first."""
    out = []
    for name in BACKENDS:
        try:
            if name == "qdldl":
                import qdldl  # noqa: F401
            elif name == "cholmod":
                from cvxopt import cholmod  # noqa: F401
        except ImportError:
            continue
        out.append(name)
    return out


# ----------------------------------------------------------------------------- input conversion
def as_scipy_csc(Q, name="Q"):
    """``Q`` as a SciPy CSC matrix (float64, sorted indices, duplicates summed), never densified.

    :param Q: a SciPy sparse matrix, a torch sparse tensor (COO/CSR/CSC), a
        :class:`~pyro_convexvb.linalg.SparseOperator`, or a dense tensor/array (converted to sparse).
    :param str name: the argument's name, for error messages.
    """
    import torch

    from .operators import SparseOperator

    if isinstance(Q, SparseOperator):
        Q = Q.matrix
    if (torch.is_tensor(Q) and Q.is_complex()) or (sp.issparse(Q) and np.iscomplexobj(Q.data)) \
            or (isinstance(Q, np.ndarray) and np.iscomplexobj(Q)):
        raise TypeError(f"{name}: a complex matrix; the sparse Cholesky layer factorises real symmetric matrices")
    if sp.issparse(Q):
        M = Q.tocsc()
    elif torch.is_tensor(Q):
        if Q.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {tuple(Q.shape)}")
        Q = Q.detach()
        if Q.layout == torch.sparse_csr:
            M = sp.csr_matrix((Q.values().cpu().double().numpy(), Q.col_indices().cpu().numpy(),
                               Q.crow_indices().cpu().numpy()), shape=tuple(Q.shape)).tocsc()
        elif Q.layout == torch.sparse_csc:
            M = sp.csc_matrix((Q.values().cpu().double().numpy(), Q.row_indices().cpu().numpy(),
                               Q.ccol_indices().cpu().numpy()), shape=tuple(Q.shape))
        elif Q.layout == torch.sparse_coo:
            Q = Q.coalesce()
            idx = Q.indices().cpu().numpy()
            M = sp.csc_matrix((Q.values().cpu().double().numpy(), (idx[0], idx[1])), shape=tuple(Q.shape))
        elif Q.layout == torch.strided:
            M = sp.csc_matrix(Q.cpu().double().numpy())
        else:
            raise TypeError(f"{name}: unsupported tensor layout {Q.layout}")
    elif isinstance(Q, np.ndarray):
        if Q.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {Q.shape}")
        M = sp.csc_matrix(Q)
    else:
        raise TypeError(f"{name}: expected a sparse matrix (SciPy, torch sparse or SparseOperator), "
                        f"got {type(Q).__name__}")
    if M.shape[0] != M.shape[1]:
        raise ValueError(f"{name}: must be square, got shape {M.shape}")
    M = M.astype(np.float64)
    M.sum_duplicates()
    M.sort_indices()
    if not np.isfinite(M.data).all():
        raise ValueError(f"{name}: contains NaN or inf")
    return M


def _upper_with_diagonal(M):
    """Upper triangle of ``M`` (CSC, sorted) with every diagonal entry stored, explicit zeros kept."""
    n = M.shape[0]
    C = M.tocoo()
    keep = C.row <= C.col
    rows = np.concatenate([C.row[keep], np.arange(n)])
    cols = np.concatenate([C.col[keep], np.arange(n)])
    vals = np.concatenate([C.data[keep], np.zeros(n)])
    U = sp.csc_matrix((vals, (rows, cols)), shape=(n, n))  # sums the duplicate diagonal, keeps zeros
    U.sort_indices()
    return U


def _check_symmetric(M, name):
    scale = float(np.abs(M.data).max()) if M.nnz else 0.0
    diff = M - M.T
    asym = float(np.abs(diff.data).max()) if diff.nnz else 0.0
    if asym > _SYMMETRY_RTOL * max(scale, 1e-300):
        raise ValueError(f"{name}: the matrix is not symmetric (max |Q - Q^T| = {asym:.3g}, max |Q| = {scale:.3g})")


# ----------------------------------------------------------------------------- compiled kernels
@_jit
def _ldl_solve(n, Lp, Li, Lx, D, X):
    """In place: ``X <- (L D L^T)^{-1} X`` for ``X`` of shape ``(n, m)`` (permuted order)."""
    m = X.shape[1]
    for j in range(n):
        for q in range(Lp[j], Lp[j + 1]):
            i = Li[q]
            lx = Lx[q]
            for c in range(m):
                X[i, c] -= lx * X[j, c]
    for j in range(n):
        dj = D[j]
        for c in range(m):
            X[j, c] /= dj
    for j in range(n - 1, -1, -1):
        for q in range(Lp[j], Lp[j + 1]):
            i = Li[q]
            lx = Lx[q]
            for c in range(m):
                X[j, c] -= lx * X[i, c]


@_jit
def _lt_solve(n, Lp, Li, Lx, X):
    """In place: ``X <- L^{-T} X`` (unit lower ``L``), ``X`` of shape ``(n, m)``."""
    m = X.shape[1]
    for j in range(n - 1, -1, -1):
        for q in range(Lp[j], Lp[j + 1]):
            i = Li[q]
            lx = Lx[q]
            for c in range(m):
                X[j, c] -= lx * X[i, c]


@_jit
def _takahashi(n, Lp, Li, Lx, D):
    """Selected inverse ``Z = (L D L^T)^{-1}`` on the pattern of ``L`` (Takahashi et al. 1973).

    Returns ``(Zd, Zx, status)``: ``Zd`` the diagonal, ``Zx[q]`` the entry at the position ``q`` of
    ``L``'s storage; ``status`` is 0, or 1 if the pattern of ``L`` is not closed under fill (some
    needed entry is missing, so the recursion cannot be evaluated on it).
    """
    Zd = np.zeros(n)
    Zx = np.zeros(Lx.shape[0])
    acc = np.zeros(n)
    wl = np.zeros(n)
    mark = np.full(n, -1, dtype=np.int64)
    for j in range(n - 1, -1, -1):
        p0 = Lp[j]
        p1 = Lp[j + 1]
        for q in range(p0, p1):
            i = Li[q]
            wl[i] = Lx[q]
            acc[i] = 0.0
            mark[i] = j
        for q in range(p0, p1):
            k = Li[q]
            lk = Lx[q]
            acc[k] += lk * Zd[k]
            need = p1 - q - 1
            t = Lp[k]
            tend = Lp[k + 1]
            while need > 0 and t < tend:
                r = Li[t]
                if mark[r] == j:
                    z = Zx[t]
                    acc[r] += lk * z
                    acc[k] += wl[r] * z
                    need -= 1
                t += 1
            if need > 0:
                return Zd, Zx, 1
        s = 0.0
        for q in range(p0, p1):
            z = -acc[Li[q]]
            Zx[q] = z
            s += Lx[q] * z
        Zd[j] = 1.0 / D[j] - s
    return Zd, Zx, 0


@_jit
def _row_structure(n, Lp, Li):
    """Rows of the strict lower pattern: for row ``j`` the columns ``k < j`` with ``L_jk != 0``
    (``Rk[Rp[j]:Rp[j+1]]``, increasing) and the storage position of ``L_jk`` (``Rpos``)."""
    nnz = Lp[n]
    counts = np.zeros(n + 1, dtype=np.int64)
    for q in range(nnz):
        counts[Li[q] + 1] += 1
    Rp = np.zeros(n + 1, dtype=np.int64)
    for j in range(n):
        Rp[j + 1] = Rp[j] + counts[j + 1]
    fill = Rp[:n].copy()
    Rk = np.empty(nnz, dtype=np.int64)
    Rpos = np.empty(nnz, dtype=np.int64)
    for k in range(n):
        for q in range(Lp[k], Lp[k + 1]):
            i = Li[q]
            f = fill[i]
            Rk[f] = k
            Rpos[f] = q
            fill[i] = f + 1
    return Rp, Rk, Rpos


@_jit
def _takahashi_jvp(n, Lp, Li, Lx, D, Zd, Zx, dLx, dD):
    """Forward-mode derivative of the Takahashi recursion: ``d diag(Z)`` given ``(dL, dD)``."""
    dZd = np.zeros(n)
    dZx = np.zeros(Lx.shape[0])
    acc = np.zeros(n)
    wl = np.zeros(n)
    dwl = np.zeros(n)
    mark = np.full(n, -1, dtype=np.int64)
    for j in range(n - 1, -1, -1):
        p0 = Lp[j]
        p1 = Lp[j + 1]
        for q in range(p0, p1):
            i = Li[q]
            wl[i] = Lx[q]
            dwl[i] = dLx[q]
            acc[i] = 0.0
            mark[i] = j
        for q in range(p0, p1):
            k = Li[q]
            lk = Lx[q]
            dlk = dLx[q]
            acc[k] += lk * dZd[k] + dlk * Zd[k]
            need = p1 - q - 1
            t = Lp[k]
            tend = Lp[k + 1]
            while need > 0 and t < tend:
                r = Li[t]
                if mark[r] == j:
                    z = Zx[t]
                    dz = dZx[t]
                    acc[r] += lk * dz + dlk * z
                    acc[k] += wl[r] * dz + dwl[r] * z
                    need -= 1
                t += 1
        s = 0.0
        for q in range(p0, p1):
            dz = -acc[Li[q]]
            dZx[q] = dz
            s += Lx[q] * dz + dLx[q] * Zx[q]
        dZd[j] = -dD[j] / (D[j] * D[j]) - s
    return dZd, dZx


@_jit
def _ldl_jvp(n, Lp, Li, Lx, D, Rp, Rk, Rpos, dAd, dAx):
    """Forward-mode derivative ``(dL, dD)`` of ``L D L^T`` when the (permuted) matrix moves by ``dA``: its
    diagonal ``dAd`` and its strict lower triangle ``dAx`` on the storage positions of ``L`` (``dAx = 0`` for a move
    of the diagonal only).

    Left-looking differentiation of ``D_j = A_jj - sum_k L_jk^2 D_k`` and
    ``L_ij D_j = A_ij - sum_k L_ik L_jk D_k`` (``k < j`` in the pattern of row ``j``).
    """
    dLx = np.zeros(Lx.shape[0])
    dD = np.zeros(n)
    c = np.zeros(n)
    for j in range(n):
        for q in range(Lp[j], Lp[j + 1]):
            c[Li[q]] = dAx[q]
        cj = dAd[j]
        for t in range(Rp[j], Rp[j + 1]):
            k = Rk[t]
            p = Rpos[t]
            a = Lx[p]
            da = dLx[p]
            dk = D[k]
            ddk = dD[k]
            cj -= 2.0 * a * da * dk + a * a * ddk
            c1 = a * dk
            c2 = da * dk + a * ddk
            for q in range(p + 1, Lp[k + 1]):
                c[Li[q]] -= dLx[q] * c1 + Lx[q] * c2
        dD[j] = cj
        dj = D[j]
        for q in range(Lp[j], Lp[j + 1]):
            dLx[q] = (c[Li[q]] - Lx[q] * cj) / dj
    return dLx, dD


# ----------------------------------------------------------------------------- backends
class _QDLDL:
    name = "qdldl"

    def __init__(self, U):
        import qdldl

        self._qdldl = qdldl
        self.solver = self._run(lambda: qdldl.Solver(U, upper=True))

    @staticmethod
    def _run(f):
        try:
            return f()
        except RuntimeError as err:  # QDLDL: a zero pivot ("not quasi-definite")
            raise NotPositiveDefiniteError(f"the matrix is not positive definite (a zero pivot in the "
                                           f"L D L^T factorisation: {err})") from None

    def factors(self):
        L, D, perm = self.solver.factors()
        return L, np.asarray(D, dtype=np.float64), np.asarray(perm, dtype=np.int64)

    def refactor(self, U):
        self._run(lambda: self.solver.update(U, upper=True))


class _CHOLMOD:
    name = "cholmod"

    def __init__(self, U):
        try:
            from cvxopt import cholmod
        except ImportError:
            raise ImportError("backend='cholmod' needs the cvxopt package (pip install cvxopt); the default backend "
                              "'qdldl' needs nothing more") from None

        self.cholmod = cholmod
        self.n = U.shape[0]
        self._numeric(self._lower(U))

    @staticmethod
    def _lower(U):
        from cvxopt import matrix, spmatrix

        C = U.T.tocoo()  # lower triangle
        return spmatrix(matrix(np.ascontiguousarray(C.data, dtype=np.float64)),
                        matrix(np.ascontiguousarray(C.row, dtype=np.int64)),
                        matrix(np.ascontiguousarray(C.col, dtype=np.int64)), C.shape)

    def _numeric(self, A):
        from cvxopt import matrix

        cm = self.cholmod
        with _cholmod_options(cm):
            # cvxopt's getfactor() consumes the numeric factor (a later numeric() on it is wrong), so
            # every factorisation makes its own symbolic analysis
            self.F = cm.symbolic(A, uplo="L")
            try:
                cm.numeric(A, self.F)
            except ArithmeticError as err:
                raise NotPositiveDefiniteError(f"Q: the matrix is not positive definite (CHOLMOD failed at column "
                                               f"{err.args[0] if err.args else '?'})") from None
            p = matrix(np.arange(self.n, dtype=np.float64))
            cm.solve(self.F, p, sys=7)
            self._perm = np.asarray(p, dtype=np.float64).ravel().round().astype(np.int64)
            Lc = cm.getfactor(self.F)
        colptr, rowind, vals = Lc.CCS
        L = sp.csc_matrix((np.asarray(vals, dtype=np.float64).ravel(), np.asarray(rowind, dtype=np.int64).ravel(),
                           np.asarray(colptr, dtype=np.int64).ravel()), shape=(self.n, self.n))
        L.sort_indices()
        self._L = L

    def factors(self):
        d = self._L.diagonal()
        return _unit_lower(self._L), d * d, self._perm

    def refactor(self, U):
        self._numeric(self._lower(U))


def _unit_lower(L):
    """``L diag(L)^{-1}`` without its diagonal (CSC, sorted), explicit zeros of ``L`` kept."""
    n = L.shape[0]
    C = L.tocoo()
    keep = C.row > C.col
    d = L.diagonal()
    out = sp.csc_matrix((C.data[keep] / d[C.col[keep]], (C.row[keep], C.col[keep])), shape=(n, n))
    out.sort_indices()
    return out


class _cholmod_options:
    """Supernodal ``L L^T`` for the duration of a call (cvxopt's options are module-global)."""

    def __init__(self, cm):
        self.cm = cm

    def __enter__(self):
        self.saved = dict(self.cm.options)
        self.cm.options["supernodal"] = 2

    def __exit__(self, *exc):
        self.cm.options.clear()
        self.cm.options.update(self.saved)
        return False


def _splu(A, permc_spec):
    """SuperLU's symmetric-mode factorisation of ``A``; an exactly singular matrix is not positive definite."""
    import scipy.sparse.linalg as spla

    try:
        return spla.splu(A, permc_spec=permc_spec, diag_pivot_thresh=0.0, options=dict(SymmetricMode=True))
    except RuntimeError as err:
        if "singular" not in str(err):
            raise
        raise NotPositiveDefiniteError("the matrix is exactly singular (SuperLU found a zero pivot), so not "
                                       "positive definite") from None


class _SuperLU:
    name = "splu"

    def __init__(self, U):
        self.perm = None
        self.refactor(U)

    def refactor(self, U):
        A = (U + sp.triu(U, k=1).T).tocsc()
        if self.perm is None:
            lu = _splu(A, "MMD_AT_PLUS_A")
            if not np.array_equal(lu.perm_r, lu.perm_c):
                raise NotPositiveDefiniteError("SuperLU pivoted off the diagonal (the matrix is not positive "
                                               "definite or is badly scaled)")
            self.perm = np.argsort(lu.perm_c).astype(np.int64)
        Ap = A[self.perm][:, self.perm].tocsc()
        lu = _splu(Ap, "NATURAL")
        if not (np.array_equal(lu.perm_r, np.arange(A.shape[0])) and np.array_equal(lu.perm_c, np.arange(A.shape[0]))):
            raise NotPositiveDefiniteError("SuperLU pivoted off the diagonal (the matrix is not positive "
                                           "definite or is badly scaled)")
        self.lu = lu

    def factors(self):
        L = sp.tril(self.lu.L, k=-1, format="csc")
        L.sort_indices()
        return L, self.lu.U.diagonal().astype(np.float64), self.perm


_BACKEND_CLASSES = {"qdldl": _QDLDL, "cholmod": _CHOLMOD, "splu": _SuperLU}


# ----------------------------------------------------------------------------- the factorisation
class SparseCholesky:
    r"""Sparse ``L D L^T`` factorisation of a symmetric positive definite matrix, with selected inversion.

    ``Q[p][:, p] = L D L^T`` with a fill-reducing permutation ``p`` (see the module docstring for
    the backends and the algorithms; Rue & Held 2005, §2.4; Takahashi et al. 1973). Memory is
    ``O(nnz(L))``; nothing is densified.

    :param Q: ``(n, n)`` symmetric positive definite matrix: SciPy sparse, torch sparse (COO/CSR/CSC),
        a :class:`~pyro_convexvb.linalg.SparseOperator`, or dense (converted to sparse). Both
        triangles must be given (the symmetry is checked).
    :param str backend: ``"qdldl"``, ``"cholmod"`` or ``"splu"`` (default :data:`DEFAULT_BACKEND`).
    :param str name: the argument's name in error messages.
    :raises ValueError: ``Q`` not square, not symmetric, or with NaN/inf entries.
    :raises NotPositiveDefiniteError: ``Q`` is not positive definite (a pivot ``D_i <= 0``).

    Example::

        >>> import numpy as np, scipy.sparse as sp
        >>> Q = sp.diags([-np.ones(3), 2.5 * np.ones(4), -np.ones(3)], [-1, 0, 1], format="csc")
        >>> chol = SparseCholesky(Q)
        >>> bool(np.isclose(chol.logdet(), np.linalg.slogdet(Q.toarray())[1]))
        True
        >>> bool(np.allclose(chol.diag_inverse(), np.diag(np.linalg.inv(Q.toarray()))))
        True
        >>> x = chol.solve(np.ones(4)); bool(np.allclose(Q @ x, 1.0))
        True
    """

    def __init__(self, Q, backend=None, name="Q"):
        backend = DEFAULT_BACKEND if backend is None else backend
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        self.name = name
        M = as_scipy_csc(Q, name)
        _check_symmetric(M, name)
        self.n = M.shape[0]
        if self.n == 0:
            raise ValueError(f"{name}: an empty (0 x 0) matrix has nothing to factorise")
        U = _upper_with_diagonal(M)
        self._pattern = (U.indptr.copy(), U.indices.copy())
        self.backend, self._impl = backend, None
        self._factor(U)
        self._symbolic = None
        self._load()

    # ------------------------------------------------------------------ state
    def __getstate__(self):
        """Pickled without the backend's numeric object (an extension type; the factor itself is in the arrays):
        the first refactorisation after unpickling makes a new one."""
        state = self.__dict__.copy()
        state["_impl"] = None
        return state

    def _factor(self, U):
        """Factorise the upper triangle ``U``: a new analysis when there is no backend object (a new pattern, or
        after unpickling), else a refactorisation on the stored one; a failure names the matrix."""
        try:
            if self._impl is None:
                self._impl = _BACKEND_CLASSES[self.backend](U)
            else:
                self._impl.refactor(U)
        except NotPositiveDefiniteError as err:
            raise NotPositiveDefiniteError(f"{self.name}: {err}") from None

    def _load(self):
        L, D, perm = self._impl.factors()
        if not np.isfinite(D).all() or (D <= 0).any():
            i = int(np.argmin(np.where(np.isfinite(D), D, -np.inf)))
            raise NotPositiveDefiniteError(f"{self.name}: the matrix is not positive definite (pivot {i} of the "
                                           f"L D L^T factorisation is {D[i]:.3g})")
        indptr = np.ascontiguousarray(L.indptr, dtype=np.int64)
        indices = np.ascontiguousarray(L.indices, dtype=np.int64)
        if self._symbolic is not None and np.array_equal(indptr, self._symbolic[0]) \
                and np.array_equal(indices, self._symbolic[1]):
            indptr, indices = self._symbolic[0], self._symbolic[1]
        else:
            self._symbolic = (indptr, indices)
            self._rows = None
        self.Lp, self.Li = indptr, indices
        self.Lx = np.ascontiguousarray(L.data, dtype=np.float64)
        self.D = np.ascontiguousarray(D, dtype=np.float64)
        self.perm = np.ascontiguousarray(perm, dtype=np.int64)
        self._selinv = None

    @property
    def nnz(self):
        """Nonzeros of the Cholesky factor, diagonal included (``nnz(L) + n``)."""
        return int(self.Li.shape[0]) + self.n

    def update(self, Q):
        """Refactor for a new matrix; the ordering and symbolic analysis are reused when the pattern
        (after adding the diagonal) is the same as before, else a new analysis is made.

        :param Q: ``(n, n)`` symmetric positive definite matrix of any accepted type.
        :returns: ``self``.
        """
        M = as_scipy_csc(Q, self.name)
        if M.shape[0] != self.n:
            raise ValueError(f"{self.name}: expected shape ({self.n}, {self.n}), got {M.shape}")
        _check_symmetric(M, self.name)
        U = _upper_with_diagonal(M)
        if not (np.array_equal(U.indptr, self._pattern[0]) and np.array_equal(U.indices, self._pattern[1])):
            self._pattern, self._impl = (U.indptr.copy(), U.indices.copy()), None  # a new analysis
        self._factor(U)
        self._load()
        return self

    def update_values(self, upper_data):
        """Refactor for new values on the stored pattern (no checks of the pattern; internal fast path).

        :param numpy.ndarray upper_data: values of the upper triangle, diagonal included, in the CSC order
            of :attr:`pattern`.
        """
        data = np.asarray(upper_data, dtype=np.float64)
        if not np.isfinite(data).all():
            raise ValueError(f"{self.name}: the new values contain NaN or inf")
        U = sp.csc_matrix((data, self._pattern[1], self._pattern[0]), shape=(self.n, self.n))
        self._factor(U)
        self._load()
        return self

    @property
    def pattern(self):
        """``(indptr, indices)`` of the stored upper triangle (CSC, every diagonal entry present)."""
        return self._pattern

    # ------------------------------------------------------------------ products
    def logdet(self):
        """``log|Q|`` (float)."""
        return float(np.log(self.D).sum())

    def _rhs(self, b):
        import torch

        is_torch = torch.is_tensor(b)
        if (b.is_complex() if is_torch else np.iscomplexobj(b)):
            raise TypeError("b: a complex right-hand side; the factorisation is real (solve its real and imaginary "
                            "parts apart)")
        arr = b.detach().cpu().double().numpy() if is_torch else np.asarray(b, dtype=np.float64)
        if arr.ndim not in (1, 2) or arr.shape[0] != self.n:
            raise ValueError(f"b: expected shape ({self.n},) or ({self.n}, k), got {tuple(arr.shape)}")
        return arr, is_torch, (b.dtype, b.device) if is_torch else None

    @staticmethod
    def _out(x, is_torch, meta):
        if not is_torch:
            return x
        import torch

        return torch.as_tensor(x, dtype=meta[0], device=meta[1])

    def solve(self, b):
        """``Q^{-1} b`` for ``b`` of shape ``(n,)`` or ``(n, k)`` (NumPy or torch; returned in kind)."""
        arr, is_torch, meta = self._rhs(b)
        X = np.ascontiguousarray(arr[self.perm].reshape(self.n, -1))
        _ldl_solve(self.n, self.Lp, self.Li, self.Lx, self.D, X)
        out = np.empty_like(X)
        out[self.perm] = X
        return self._out(out.reshape(arr.shape), is_torch, meta)

    def solve_Lt(self, eps):
        """``x = P^T L^{-T} D^{-1/2} eps``: for ``eps ~ N(0, I)``, ``x ~ N(0, Q^{-1})`` (Rue & Held 2005, Alg. 2.4).

        :param eps: ``(n,)`` or ``(n, k)`` (NumPy or torch; returned in kind).
        """
        arr, is_torch, meta = self._rhs(eps)
        X = np.ascontiguousarray((arr.reshape(self.n, -1) / np.sqrt(self.D)[:, None]))
        _lt_solve(self.n, self.Lp, self.Li, self.Lx, X)
        out = np.empty_like(X)
        out[self.perm] = X
        return self._out(out.reshape(arr.shape), is_torch, meta)

    def factor_matrix(self):
        """``R = D^{1/2} L^T P`` as a SciPy CSR matrix, with ``R^T R = Q`` (a sparse square root)."""
        n = self.n
        Lfull = sp.csc_matrix((self.Lx, self.Li, self.Lp), shape=(n, n)) + sp.identity(n, format="csc")
        R = sp.diags(np.sqrt(self.D)) @ Lfull.T.tocsr()
        inv = np.empty(n, dtype=np.int64)
        inv[self.perm] = np.arange(n)
        R = R[:, inv].tocsr()
        R.sort_indices()
        return R

    # ------------------------------------------------------------------ selected inversion
    def _selected(self):
        if self._selinv is None:
            Zd, Zx, status = _takahashi(self.n, self.Lp, self.Li, self.Lx, self.D)
            if status != 0:
                raise RuntimeError(f"{self.name}: the factor's pattern from backend '{self.backend}' is not closed "
                                   "under fill (SuperLU drops entries of L that come out exactly zero, e.g. explicit "
                                   "zeros or fill that cancels, as in a precision R^T R); the selected inversion "
                                   "needs the symbolic Cholesky pattern: use backend='qdldl' (the default) or "
                                   "'cholmod'")
            self._selinv = (Zd, Zx)
        return self._selinv

    def diag_inverse(self):
        """``diag(Q^{-1})`` (``(n,)`` NumPy array) by selected inversion (Takahashi et al. 1973)."""
        Zd, _ = self._selected()
        out = np.empty(self.n)
        out[self.perm] = Zd
        return out

    def selected_inverse(self):
        """``Q^{-1}`` on the pattern of the factor (and its transpose), as a SciPy CSC matrix in the
        original order. Entries outside that pattern are *not* those of ``Q^{-1}`` (they are absent)."""
        Zd, Zx = self._selected()
        n = self.n
        Z = sp.csc_matrix((Zx, self.Li, self.Lp), shape=(n, n))
        Z = (Z + Z.T + sp.diags(Zd)).tocsc()
        inv = np.empty(n, dtype=np.int64)
        inv[self.perm] = np.arange(n)
        return Z[inv][:, inv].tocsc()

    def diag_inverse_jvp(self, delta):
        r"""Directional derivative of ``diag(Q^{-1})`` along ``Q + t diag(delta)``: ``-(Q^{-1} \circ Q^{-1}) delta``.

        Forward-mode differentiation of the factorisation and of the Takahashi recursion; costs about
        two selected inversions and never forms ``Q^{-1}``. It is the Hessian-vector product of
        ``log|Q + diag(d)|`` in ``d`` (whose gradient is ``diag(Q^{-1})``).

        :param delta: ``(n,)`` NumPy array or tensor.
        :returns: ``(n,)`` NumPy array.
        """
        import torch

        d = delta.detach().cpu().double().numpy() if torch.is_tensor(delta) else np.asarray(delta, dtype=np.float64)
        if d.shape != (self.n,):
            raise ValueError(f"delta: expected shape ({self.n},), got {d.shape}")
        Zd, Zx = self._selected()
        if self._rows is None:
            self._rows = _row_structure(self.n, self.Lp, self.Li)
        Rp, Rk, Rpos = self._rows
        dLx, dD = _ldl_jvp(self.n, self.Lp, self.Li, self.Lx, self.D, Rp, Rk, Rpos,
                           np.ascontiguousarray(d[self.perm]), np.zeros(self.Lx.shape[0]))
        dZd = _takahashi_jvp(self.n, self.Lp, self.Li, self.Lx, self.D, Zd, Zx, dLx, dD)[0]
        out = np.empty(self.n)
        out[self.perm] = dZd
        return out

    # ------------------------------------------------------------------ entries of the selected inverse
    def entry_positions(self, rows, cols):
        """Positions of the symmetric entries ``(rows[i], cols[i])`` (original order) in the packed selected
        inverse of :meth:`selected_values`: ``[diag(Z) (permuted order), Z on the storage of L]``.

        :param numpy.ndarray rows: ``(m,)`` int.
        :param numpy.ndarray cols: ``(m,)`` int.
        :returns: ``(m,)`` int64 positions.
        :raises ValueError: an entry outside the pattern of the factor (give those entries, even as explicit
            zeros, in the matrix that was factored).
        """
        iperm = np.empty(self.n, dtype=np.int64)
        iperm[self.perm] = np.arange(self.n)
        pi, pj = iperm[np.asarray(rows, dtype=np.int64)], iperm[np.asarray(cols, dtype=np.int64)]
        lo, hi = np.minimum(pi, pj), np.maximum(pi, pj)
        out = lo.copy()
        off = lo != hi
        if off.any():
            col_of = np.repeat(np.arange(self.n, dtype=np.int64), np.diff(self.Lp))
            keys = col_of * self.n + self.Li
            order = np.argsort(keys, kind="stable")
            want = lo[off] * self.n + hi[off]
            at = np.searchsorted(keys[order], want)
            at = np.minimum(at, max(len(keys) - 1, 0))
            if len(keys) == 0 or not np.array_equal(keys[order][at], want):
                raise ValueError(f"{self.name}: an entry is outside the pattern of the Cholesky factor; give every "
                                 "needed entry (an explicit zero will do) in the factored matrix")
            out[off] = self.n + order[at]
        return out

    def selected_values(self):
        """The packed selected inverse ``[diag(Z) (permuted order), Z on the storage of L]`` (``(n + nnz(L),)``),
        indexed by :meth:`entry_positions`."""
        Zd, Zx = self._selected()
        return np.concatenate([Zd, Zx])

    def selected_values_jvp(self, positions, values):
        r"""Directional derivative of :meth:`selected_values` along ``Q + t dQ``: ``-(Z dQ Z)`` on the factor's pattern.

        :param numpy.ndarray positions: ``(m,)`` positions (:meth:`entry_positions`) of the entries of the
            symmetric perturbation ``dQ`` (each symmetric pair once; repeated positions add up).
        :param numpy.ndarray values: ``(m,)`` their values.
        :returns: ``(n + nnz(L),)`` NumPy array.
        """
        Zd, Zx = self._selected()
        if self._rows is None:
            self._rows = _row_structure(self.n, self.Lp, self.Li)
        Rp, Rk, Rpos = self._rows
        d = np.bincount(positions, weights=values, minlength=self.n + len(self.Li))
        dLx, dD = _ldl_jvp(self.n, self.Lp, self.Li, self.Lx, self.D, Rp, Rk, Rpos,
                           np.ascontiguousarray(d[:self.n]), np.ascontiguousarray(d[self.n:]))
        dZd, dZx = _takahashi_jvp(self.n, self.Lp, self.Li, self.Lx, self.D, Zd, Zx, dLx, dD)
        return np.concatenate([dZd, dZx])

    def __repr__(self):
        return f"SparseCholesky(n={self.n}, nnz(L)={self.nnz}, backend={self.backend!r})"
