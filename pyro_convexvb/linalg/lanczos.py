"""Lanczos tridiagonalisation with full reorthogonalisation, and Gaussian variance estimators.

``k`` Lanczos steps on a symmetric operator ``A`` (``n x n``) give an orthonormal ``Q`` (``n x k``)
and ``T = Q^T A Q``.  Single-vector Lanczos (:func:`lanczos`) is block Lanczos (:func:`block_lanczos`)
with block size 1; both return one :class:`LanczosResult`, whose ``T`` is tridiagonal (block size 1)
or block tridiagonal with lower bandwidth ``b``.  The extremal eigenvalues of ``A`` are approximated
by the Ritz values (eigenvalues of ``T``), and ``A^{-1}`` by ``Q T^{-1} Q^T``.

Variance estimators (symbols of Nickisch & Seeger 2009 §2.3 and Seeger 2010 §3):

* :func:`lanczos_variances`, :meth:`LanczosResult.variances` -- *K-Lanczos*:
  ``z_k = diag(B Q T^{-1} Q^T B^T)``, accumulated through the banded Cholesky factor of ``T``;
* :func:`pca_variances` -- *L-PCA*: ``diag(B U_L Lambda_L^{-1} U_L^T B^T)`` with the ``L``
  smallest eigenpairs of ``A`` obtained as converged Ritz pairs.

Both are lower bounds on the exact ``diag(B A^{-1} B^T)`` in every component and nondecreasing in
``k`` (resp. ``L``) (Seeger 2010 §4.1): ``Q T^{-1} Q^T`` and ``U Lambda^{-1} U^T`` are
``A^{-1}`` compressed to a subspace, hence ``<= A^{-1}`` in the Loewner order.

Why not :func:`linear_operator.utils.lanczos.lanczos_tridiag`?  It reorthogonalises with
elementwise products over a ``(k, n, 1)`` buffer (10x slower than BLAS matrix-vector products at
``k = 200, n = 20,000``, see ``docs/linalg.md``), declares breakdown when ``beta < 1e-6`` in
absolute terms (it stops after two steps on a matrix scaled by ``1e-8``), and returns neither the
Lanczos coefficients, the number of products nor Ritz residuals.
"""
from dataclasses import dataclass, field
import math

import torch

from ..errors import warn
from .cg import NotPositiveDefiniteError, _check_finite, _resolve_matmul
from .operators import as_operator

__all__ = ["LanczosResult", "lanczos", "block_lanczos", "banded_lanczos_z", "lanczos_variances", "pca_variances",
           "tridiagonal_cholesky"]


def tridiagonal_cholesky(alpha, beta):
    """Bidiagonal Cholesky factor of the SPD tridiagonal ``T = L L^T``.

    ``L`` is lower bidiagonal with diagonal ``e`` and subdiagonal ``d`` (Nickisch & Seeger 2009 §2.3 writes
    ``e_k`` for the diagonal and ``d_{k-1}`` for the subdiagonal):
    ``e_1 = sqrt(alpha_1)``, ``d_{j-1} = beta_{j-1} / e_{j-1}``, ``e_j = sqrt(alpha_j - d_{j-1}^2)``.
    Computed in float64 on the CPU (``k`` scalar steps).

    :param alpha: diagonal of ``T``, shape ``(k,)``.
    :param beta: off-diagonal of ``T``, shape ``(k-1,)``.
    :returns: ``(e, d)`` as float64 CPU tensors of shapes ``(k,)`` and ``(k-1,)``.
    :raises NotPositiveDefiniteError: if a pivot ``alpha_j - d_{j-1}^2`` is ``<= 0``.

    Example::

        >>> import torch
        >>> e, d = tridiagonal_cholesky(torch.tensor([2.0, 2.0]), torch.tensor([1.0]))
        >>> torch.allclose(e, torch.tensor([2.0 ** 0.5, 1.5 ** 0.5], dtype=torch.float64))
        True
    """
    a = alpha.detach().double().cpu().tolist()
    b = beta.detach().double().cpu().tolist()
    e, d = [], []
    prev = None
    for j, aj in enumerate(a):
        if j == 0:
            piv = aj
        else:
            dj = b[j - 1] / prev
            d.append(dj)
            piv = aj - dj * dj
        if not piv > 0:
            raise NotPositiveDefiniteError(
                f"the Lanczos matrix T is not positive definite (pivot {piv:.3e} at step {j + 1}); "
                "the operator is not SPD or too ill-conditioned for its dtype"
            )
        prev = math.sqrt(piv)
        e.append(prev)
    return torch.tensor(e, dtype=torch.float64), torch.tensor(d, dtype=torch.float64)



@dataclass
class LanczosResult:
    r"""Outcome of :func:`lanczos` and :func:`block_lanczos` (single-vector Lanczos is block size 1).

    The run satisfies ``A Q = Q T + W C`` with ``Q^T Q = I``, ``T = Q^T A Q`` (block) tridiagonal and a
    residual ``W C`` whose orthonormal ``W`` (``n x r``) is orthogonal to ``Q``; for block size 1 it is
    ``beta_k q_{k+1} e_k^T``.  Only ``C`` is kept: it gives the Ritz residuals.

    :ivar Q: orthonormal Lanczos vectors, shape ``(n, k)`` (a transposed view of a row-major buffer).
    :ivar T_matrix: ``T = Q^T A Q``, shape ``(k, k)``: tridiagonal for block size 1, else block
        tridiagonal with lower bandwidth ``block_size``.
    :ivar int block_size: lower bandwidth of ``T`` (the block size ``b``; larger after a deflated block).
    :ivar int num_mvm: columns multiplied by ``A``.
    :ivar bool breakdown: ``True`` if a new block was (numerically) linearly dependent on the previous
        ones: the run either stopped (the Krylov space is invariant, so the Ritz values are exact
        eigenvalues of ``A``) or went on with the independent directions only (a deflated block).
    :ivar residual_coeffs: ``C``, shape ``(r, k)`` with ``r <= b`` (``r = 0`` at breakdown or ``k = n``).
    :ivar projected_variances: with :func:`block_lanczos`'s ``project``: the list of
        ``diag(P_i Q T^{-1} Q^T P_i^T)``, one ``(m_i,)`` tensor per projection; else ``None``.
    """

    Q: torch.Tensor
    T_matrix: torch.Tensor
    block_size: int
    num_mvm: int
    breakdown: bool
    residual_coeffs: torch.Tensor = None
    projected_variances: list = None
    _eigh: tuple = field(default=None, repr=False)
    _L: torch.Tensor = field(default=None, repr=False)

    @property
    def k(self):
        """Number of Lanczos vectors."""
        return self.T_matrix.shape[0]

    @property
    def alpha(self):
        """Diagonal of ``T``, shape ``(k,)`` (``alpha.sum() = tr T``)."""
        return torch.diagonal(self.T_matrix)

    @property
    def beta(self):
        """First subdiagonal of ``T``, shape ``(k-1,)``: the Lanczos ``beta_1..beta_{k-1}`` for block size 1."""
        return torch.diagonal(self.T_matrix, -1)

    @property
    def beta_next(self):
        """``||C||_2`` as a 0-d tensor: ``beta_k``, the norm of the last residual, for block size 1."""
        C = self.residual_coeffs
        if C is None or C.numel() == 0:
            return self.T_matrix.new_zeros(())
        return torch.linalg.matrix_norm(C, 2)

    def _ritz(self):
        if self._eigh is None:
            self._eigh = torch.linalg.eigh(self.T_matrix)
        return self._eigh

    @property
    def ritz_values(self):
        """Eigenvalues ``theta_i`` of ``T`` in ascending order, shape ``(k,)`` (computed on first use)."""
        return self._ritz()[0]

    @property
    def ritz_vectors_T(self):
        """Eigenvectors ``S`` of ``T`` (columns), shape ``(k, k)`` (computed on first use)."""
        return self._ritz()[1]

    @property
    def ritz_residuals(self):
        """``||A y_i - theta_i y_i|| = ||C s_i||`` for the Ritz pairs ``(theta_i, y_i = Q s_i)``, shape ``(k,)``
        (``|beta_k s_{k,i}|`` for block size 1); some eigenvalue of ``A`` lies within it of ``theta_i``."""
        C = self.residual_coeffs
        if C is None or C.numel() == 0:
            return torch.zeros_like(self.ritz_values)
        return torch.linalg.vector_norm(C @ self.ritz_vectors_T, dim=0)

    def T(self):
        """The dense ``(k, k)`` matrix ``T = Q^T A Q``."""
        return self.T_matrix

    def cholesky_L(self):
        """Lower Cholesky factor of ``T`` (lower bandwidth ``block_size``), shape ``(k, k)``.

        :raises NotPositiveDefiniteError: if ``T`` is not positive definite (``A`` is not SPD).
        """
        if self._L is None:
            L, info = torch.linalg.cholesky_ex(self.T_matrix)
            if int(info) != 0:
                raise NotPositiveDefiniteError(
                    f"the Lanczos matrix T is not positive definite (pivot {int(info)}); "
                    "the operator is not SPD or too ill-conditioned for its dtype")
            self._L = L
        return self._L

    def logdet_T(self):
        """``log|T| = 2 sum_j log L_jj`` as a 0-d tensor; at ``k = n`` it equals ``log|A|``.

        Seeger 2010 §4.2: ``log|T_k|`` replaces ``log|A|`` in the K-Lanczos approximation.
        """
        return 2.0 * torch.log(torch.diagonal(self.cholesky_L())).sum()

    def ritz_vectors(self, index=None):
        """Ritz vectors ``Q S[:, index]``, shape ``(n, len(index))`` (all ``k`` if ``index`` is None)."""
        S = self.ritz_vectors_T if index is None else self.ritz_vectors_T[:, index]
        return self.Q @ S

    def apply_inverse(self, v):
        """``Q T^{-1} Q^T v`` for ``v`` of shape ``(n,)`` or ``(n, m)`` (the low-rank ``A^{-1}``)."""
        rhs = (self.Q.transpose(0, 1) @ v).reshape(self.k, -1)
        return self.Q @ torch.cholesky_solve(rhs, self.cholesky_L()).reshape((self.k,) + tuple(v.shape[1:]))

    def variances(self, B=None, chunk_size=None):
        """K-Lanczos variances ``diag(B Q T^{-1} Q^T B^T)`` of this run (Nickisch & Seeger 2009 §2.3).

        Forward substitution with the banded Cholesky factor of ``T`` (:func:`banded_lanczos_z`); for
        block size 1 it is the recursion ``z_j = z_{j-1} + v_j^2``, ``v_j = (B q_j - d_{j-1} v_{j-1}) / e_j``.
        ``B q_j`` is computed ``chunk_size`` Lanczos vectors at a time, so ``B Q`` is never formed whole.
        Each component is ``<=`` the exact ``diag(B A^{-1} B^T)`` (Seeger 2010 §4.1).

        :param B: ``(q, n)`` operator or tensor; ``None`` means the identity (``diag(A^{-1})``).
        :param chunk_size: Lanczos vectors per product with ``B`` (default ``4 * block_size``).
        :returns: ``z`` of shape ``(q,)``.
        """
        return banded_lanczos_z(self.cholesky_L(), self.block_size, _design_rows(self.Q, B), self.k, chunk_size)

    def covariance_factor(self):
        """``F = Q L^{-T}`` (``T = L L^T``), shape ``(n, k)``: ``F F^T = Q T^{-1} Q^T``, the K-Lanczos covariance
        (Seeger 2010 §3)."""
        return torch.linalg.solve_triangular(self.cholesky_L(), self.Q.transpose(0, 1), upper=False).transpose(0, 1)


def _as_design(B, n, name="B"):
    if B is None:
        return None
    op = as_operator(B)
    if op.shape[1] != n:
        raise ValueError(f"{name}: expected {n} columns (the size of A), got shape {tuple(op.shape)}")
    return op


def _design_rows(Q, B):
    """``(s, t) -> (B Q[:, s:t])^T``, the row blocks :func:`banded_lanczos_z` reads (``B = None``: ``Q^T``)."""
    op = _as_design(B, Q.shape[0])

    def rows(s, t):
        return Q[:, s:t].transpose(0, 1) if op is None else op.mv(Q[:, s:t].contiguous()).transpose(0, 1)

    return rows


class _BlockVarianceAccumulator:
    r"""``z = diag(P Q T^{-1} Q^T P^T)`` accumulated one Lanczos block at a time (Nickisch & Seeger 2009 §2.3, blocked).

    ``T = Q^T A Q`` is block tridiagonal, so its Cholesky factor ``L`` is block bidiagonal and can be
    extended as the blocks arrive: ``L_{j,j-1} = T_{j,j-1} L_{j-1,j-1}^{-T}`` and
    ``L_{jj} L_{jj}^T = T_{jj} - L_{j,j-1} L_{j,j-1}^T``.  With ``V = L^{-1} (P Q)^T`` and ``z = sum_j V_j^2``,
    block row ``j`` of ``V`` is ``L_{jj}^{-1} ((P Q_j)^T - L_{j,j-1} V_{j-1})``: only the previous block of
    ``V`` is kept, so the memory is ``O(b m)`` per projection instead of the ``O(k m)`` of ``B Q``.  For
    ``b = 1`` this is Nickisch & Seeger 2009 §2.3's recursion ``v_k = (B q_k - d_{k-1} v_{k-1}) / e_k``.
    """

    def __init__(self, k, dtype, device):
        self.L = torch.zeros(k, k, dtype=dtype, device=device)
        self.z, self.prev, self.Ldiag = None, None, None

    def add(self, s, Tjj, Tsub, projections):
        """Block ``[s, s + b_j)``: ``Tjj = T_{jj}``, ``Tsub = T_{j,j-1}`` (``None`` for the first block) and
        the products ``P_i Q_j`` (shape ``(m_i, b_j)``); raises if ``T`` is not positive definite."""
        bj = Tjj.shape[0]
        if s + bj > self.L.shape[0]:  # the run was extended
            L = self.L.new_zeros((s + bj, s + bj))
            L[:s, :s] = self.L[:s, :s]
            self.L = L
        if Tsub is not None:
            Lsub = torch.linalg.solve_triangular(self.Ldiag.transpose(0, 1), Tsub, upper=True, left=False)
            S = Tjj - Lsub @ Lsub.transpose(0, 1)
            self.L[s:s + bj, s - Tsub.shape[1]:s] = Lsub
        else:
            Lsub, S = None, Tjj
        Ljj, info = torch.linalg.cholesky_ex(S)
        if int(info) != 0:
            raise NotPositiveDefiniteError(
                f"the block Lanczos matrix T is not positive definite (pivot {s + int(info)}); "
                "the operator is not SPD or too ill-conditioned for its dtype")
        self.L[s:s + bj, s:s + bj] = Ljj
        LjjT = Ljj.transpose(0, 1)
        V = []
        for i, P in enumerate(projections):
            if Lsub is not None:
                P = P - self.prev[i] @ Lsub.transpose(0, 1)
            Vi = torch.linalg.solve_triangular(LjjT, P, upper=True, left=False)  # (m_i, b_j): rows of V^T
            V.append(Vi)
        sq = [torch.square(Vi).sum(1) for Vi in V]
        self.z = sq if self.z is None else [zi.add_(si) for zi, si in zip(self.z, sq)]
        self.prev, self.Ldiag = V, Ljj


class _LanczosRun:
    """Block Lanczos with full reorthogonalisation that can be extended (block size 1: single-vector Lanczos).

    Each step multiplies ``A`` with the current block (``b_j`` rows of length ``n``, the layout of the stored
    ``Q^T``), subtracts ``Q_j T_jj + Q_{j-1} T_{j-1,j}``, reorthogonalises against all stored vectors by
    classical Gram-Schmidt as matrix products (a second pass only if a vector lost more than 30% of its
    norm, the Daniel-Gragg-Kaufman-Stewart criterion) and factorises the residual (QR; a norm for one
    vector) into the next block and the coupling ``R_j = T_{j+1,j}``.  A pivot of ``R_j`` below
    ``breakdown_tol * ||T||`` deflates the block by an SVD to the directions that are really new; with
    none left the run stops (``breakdown``).  The residual after the last product is always formed, so the
    run can be extended and the Ritz residuals are known.
    """

    def __init__(self, apply_a, V0, *, breakdown_tol=None, reorthogonalize=True, project=None):
        n, b = V0.shape
        self.apply_a, self.n, self.reorthogonalize, self.project = apply_a, n, reorthogonalize, project
        self.tol = float(breakdown_tol) if breakdown_tol is not None else torch.finfo(V0.dtype).eps ** (2.0 / 3.0)
        Qn, R0 = _orthonormalise(V0.transpose(0, 1))
        if not bool((torch.diagonal(R0).abs() > 0).all()):
            raise ValueError("n_or_V0: the starting block must have full column rank")
        self.pending = Qn  # the next block, (b_j, n) rows
        self.Qr = V0.new_empty((0, n))
        self.Tb = V0.new_zeros((b, b))  # T, with room for the coupling of the pending block
        self.filled, self.prev, self.num_mvm, self.band, self.anorm = 0, None, 0, 1, 0.0
        self.breakdown, self.closed, self.truncated = False, False, False
        self.C = V0.new_zeros((0, 0))
        self.acc = _BlockVarianceAccumulator(b, V0.dtype, V0.device) if project is not None else None

    def _grow(self, k):
        b = self.pending.shape[0] if self.pending is not None else 0
        if k > self.Qr.shape[0]:
            Qr = self.Qr.new_empty((k, self.n))
            Qr[: self.filled] = self.Qr[: self.filled]
            self.Qr = Qr
        self._grow_T(k + b)

    def _grow_T(self, m):
        if m > self.Tb.shape[0]:
            Tb = self.Tb.new_zeros((m, m))
            old = self.Tb.shape[0]
            Tb[:old, :old] = self.Tb
            self.Tb = Tb

    def run(self, k):
        """Extend to ``k`` Lanczos vectors in total (fewer on breakdown; at most ``n``).

        Over 80 lines: block Lanczos with reorthogonalisation, breakdown handling and the projections shares its
        state at every step of one loop.
        """
        k = min(int(k), self.n)
        if self.truncated and k > self.filled:
            raise RuntimeError("Lanczos: a run whose last block was truncated cannot be extended")
        if self.closed or k <= self.filled:
            return self
        self._grow(k)
        T = self.Tb
        dropped = None
        with torch.no_grad():
            while self.filled < k:
                s, Qt = self.filled, self.pending
                if s + Qt.shape[0] > k:  # truncate the last block to reach exactly k vectors (no extension later)
                    # the dropped directions carry part of the residual of the previous block, if there is one
                    dropped, Qt = (Qt[k - s:] if self.prev is not None else None), Qt[:k - s]
                    self.closed = self.truncated = True
                bj = Qt.shape[0]
                e = s + bj
                self.Qr[s:e] = Qt
                V = Qt.transpose(0, 1).contiguous()
                W = self.apply_a(V)
                if not isinstance(W, torch.Tensor) or W.shape != V.shape:
                    got = tuple(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
                    raise ValueError(f"matmul: expected an output of shape {tuple(V.shape)}, got {got}")
                self.num_mvm += bj
                Wt = W.detach().transpose(0, 1).contiguous()  # (b_j, n)
                Aj = Wt @ V
                if not bool(torch.isfinite(Aj).all()):
                    raise ValueError("matmul returned NaN or inf during Lanczos")
                Aj = 0.5 * (Aj + Aj.transpose(0, 1))
                T[s:e, s:e] = Aj
                self.anorm = max(self.anorm, float(torch.linalg.matrix_norm(T[s:e, :e], 1)))
                self.band = max(self.band, bj - 1)
                prev = self.prev
                if self.acc is not None:
                    Tsub = T[s:e, prev[0]:s] if prev is not None else None
                    self.acc.add(s, Aj, Tsub, _projections(self.project, V, self.acc))
                self.filled, self.prev = e, (s, bj)
                if dropped is not None:  # A Q_{j-1} keeps a component along the dropped directions
                    R_drop = T[k:k + dropped.shape[0], prev[0]:s].clone()
                if e >= self.n:  # Q spans everything: the residual is rounding only
                    self.pending, self.closed, self.C, dropped = None, True, V.new_zeros((0, e)), None
                    break
                Wt.sub_(Aj @ Qt)
                if prev is not None:
                    ps, pb = prev
                    Wt.sub_(T[s:e, ps:ps + pb] @ self.Qr[ps:ps + pb])
                if self.reorthogonalize:
                    Qall = self.Qr[:e]
                    before = torch.linalg.vector_norm(Wt, dim=1)
                    for _ in range(2):
                        Wt.sub_((Wt @ Qall.transpose(0, 1)) @ Qall)
                        after = torch.linalg.vector_norm(Wt, dim=1)
                        if bool((after > 0.7071 * before).all()):
                            break
                        before = after
                thresh = self.tol * max(self.anorm, 1e-300)
                if bj == 1:  # one vector: its norm, no QR
                    nrm = torch.linalg.vector_norm(Wt)
                    ok = float(nrm) > thresh
                    Qn, Rj = (Wt / nrm, nrm.reshape(1, 1)) if ok else (None, None)
                else:
                    Qn, Rj = _orthonormalise(Wt)
                    ok = float(torch.diagonal(Rj).abs().min()) > thresh
                if not ok:
                    # (numerically) rank-deficient block: deflate to the directions that are really new
                    U, S, Vh = torch.linalg.svd(Wt.transpose(0, 1), full_matrices=False)
                    r = int((S > thresh).sum())
                    Qn, Rj = U[:, :r].transpose(0, 1).contiguous(), S[:r, None] * Vh[:r]
                    self.breakdown = True  # the Krylov space lost dimensions: report it
                    if r == 0:
                        self.pending, self.closed, self.C = None, True, V.new_zeros((0, e))
                        break
                    self.band = max(self.band, bj + r - 1)
                else:
                    self.band = max(self.band, bj)
                r = Qn.shape[0]
                if e + r > T.shape[0]:
                    self._grow_T(e + r)
                    T = self.Tb
                T[e:e + r, s:e] = Rj
                T[s:e, e:e + r] = Rj.transpose(0, 1)
                self.pending = Qn
            if self.pending is not None:  # residual coefficients of A Q - Q T = Q_next C
                s, bj = self.prev
                r = self.pending.shape[0]
                self.C = T.new_zeros((r, self.filled))
                self.C[:, s:self.filled] = T[self.filled:self.filled + r, s:self.filled]
        if dropped is not None:
            # residual A Q - Q T = [Q_drop, Q_next] [C_drop; C_next]; orthonormalise the two parts together
            C_drop = R_drop.new_zeros((dropped.shape[0], self.filled))
            C_drop[:, self.prev[0] - R_drop.shape[1]:self.prev[0]] = R_drop
            Wd = dropped if self.pending is None else torch.cat([dropped, self.pending], 0)
            Cd = C_drop if self.pending is None else torch.cat([C_drop, self.C], 0)
            _, Rw = torch.linalg.qr(Wd.transpose(0, 1))
            self.C = Rw @ Cd
            self.pending = None
        return self

    def result(self):
        k = self.filled
        res = LanczosResult(Q=self.Qr[:k].transpose(0, 1), T_matrix=self.Tb[:k, :k].clone(), block_size=self.band,
                            num_mvm=self.num_mvm, breakdown=self.breakdown, residual_coeffs=self.C)
        if self.acc is not None:
            for i, zi in enumerate(self.acc.z):
                if not bool(torch.isfinite(zi).all()):
                    raise ValueError(f"project: output {i} contains NaN or inf")
            res._L = self.acc.L[:k, :k].clone()
            res.projected_variances = [zi.clone() for zi in self.acc.z]
        return res


def _orthonormalise(Wt):
    """QR factorisation of the rows of ``Wt`` (``(b, n)``): orthonormal rows ``Qn`` (``(b, n)``) and an upper
    triangular ``R`` (``(b, b)``) with ``Wt^T = Qn^T R``; for one row, its norm."""
    if Wt.shape[0] == 1:
        nrm = torch.linalg.vector_norm(Wt)
        R = nrm.reshape(1, 1)
        return (Wt / nrm if float(nrm) > 0 else Wt.clone()), R
    Qm, R = torch.linalg.qr(Wt.transpose(0, 1))
    return Qm.transpose(0, 1).contiguous(), R


def _start_vector(n_or_v0, apply_n, op_dtype, op_device, dtype, device, generator):
    if isinstance(n_or_v0, torch.Tensor):
        v0 = n_or_v0
        if v0.dim() != 1:
            raise ValueError(f"v0: expected a 1-D starting vector, got shape {tuple(v0.shape)}")
        if apply_n is not None and v0.shape[0] != apply_n:
            raise ValueError(f"v0: operator has size {apply_n} but v0 has shape {tuple(v0.shape)}")
        _check_finite(v0, "v0")
        if dtype is not None or device is not None:
            v0 = v0.to(dtype=dtype or v0.dtype, device=device or v0.device)
        return v0.detach()
    n = int(n_or_v0)
    if apply_n is not None and n != apply_n:
        raise ValueError(f"n_or_v0: operator has size {apply_n}, got n={n}")
    if n < 1:
        raise ValueError(f"n_or_v0: n must be >= 1, got {n}")
    dtype = dtype or op_dtype or torch.get_default_dtype()
    device = device or op_device or (generator.device if generator is not None else None)
    return torch.randn(n, dtype=dtype, device=device, generator=generator)



def _vector_matmul(apply_a, n):
    """A callable on ``(n,)`` vectors as the ``(n, 1)``-block product the Lanczos run calls."""

    def apply(V):
        w = apply_a(V[:, 0])
        if not isinstance(w, torch.Tensor) or w.shape != (n,):
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"matmul: expected an output of shape ({n},), got {got}")
        return w.unsqueeze(-1)

    return apply


def lanczos(
    matmul,
    n_or_v0,
    k,
    *,
    reorthogonalize=True,
    breakdown_tol=None,
    generator=None,
    dtype=None,
    device=None,
):
    """``k`` Lanczos steps with full reorthogonalisation on a symmetric operator ``A``: :func:`block_lanczos`
    with block size 1.

    Each step costs one product with ``A`` and, with ``reorthogonalize=True``, one or two classical
    Gram-Schmidt passes against all previous vectors (``O(n j)`` BLAS matrix-vector work; the second
    pass is done only if the first one removed more than 30% of the norm).  The run stops early
    (``breakdown=True``) when ``beta_j <= breakdown_tol * ||T||_est``, i.e. when the Krylov space is
    numerically invariant.  Memory: ``Q`` of ``n k`` numbers.

    :param matmul: callable ``v -> A v`` on ``(n,)`` vectors, a LinearOperator or a tensor.
    :param n_or_v0: starting vector ``(n,)``, or ``n`` for a standard normal start drawn with ``generator``.
    :param k: number of steps (at most ``n``).
    :param reorthogonalize: full reorthogonalisation (strongly recommended; without it Ritz values
        repeat and ``Q`` loses orthogonality, Seeger 2010 §3).
    :param breakdown_tol: relative breakdown threshold on ``beta_j / ||T||``; default ``eps**(2/3)``
        (``3.7e-11`` in float64, ``2.4e-5`` in float32).  Rounding leaves ``beta ~ 1e-17..1e-13``
        at a true invariant subspace in float64; continuing past a missed breakdown is harmless
        (the next vector is orthogonalised against ``Q`` and ``T`` stays exact).
    :param generator: :class:`torch.Generator` for the random start.
    :param dtype: dtype of a random start (default: the operator's, else torch's default).
    :param device: device of a random start (default: the operator's).
    :returns: :class:`LanczosResult` with a tridiagonal ``T`` (``alpha``, ``beta``, ``beta_next``).

    Example::

        >>> import torch
        >>> A = torch.diag(torch.arange(1.0, 11.0, dtype=torch.float64))
        >>> res = lanczos(A, 10, 10, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(res.ritz_values, torch.arange(1.0, 11.0, dtype=torch.float64))
        True
    """
    run = _vector_run(matmul, n_or_v0, k, reorthogonalize, breakdown_tol, generator, dtype, device)
    return run.run(k).result()


def _vector_run(matmul, n_or_v0, k, reorthogonalize, breakdown_tol, generator, dtype, device):
    """A single-vector :class:`_LanczosRun` from :func:`lanczos`'s arguments (validated)."""
    apply_a, n_op, op_dtype, op_device = _resolve_matmul(matmul)
    v0 = _start_vector(n_or_v0, n_op, op_dtype, op_device, dtype, device, generator)
    if int(k) < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    if not float(torch.linalg.vector_norm(v0)) > 0:
        raise ValueError("v0: the starting vector must be nonzero")
    if n_op is None:
        apply_a = _vector_matmul(apply_a, v0.shape[0])
    return _LanczosRun(apply_a, v0.unsqueeze(-1), breakdown_tol=breakdown_tol, reorthogonalize=reorthogonalize)


def lanczos_variances(
    matmul,
    B,
    k,
    *,
    v0=None,
    return_result=False,
    reorthogonalize=True,
    breakdown_tol=None,
    generator=None,
    chunk_size=64,
):
    """K-Lanczos variance estimate ``z_k = diag(B Q T^{-1} Q^T B^T) ~ diag(B A^{-1} B^T)``.

    Nickisch & Seeger 2009 §2.3: with ``T = L L^T``, ``L`` bidiagonal (diagonal ``e``,
    subdiagonal ``d``), ``z_k = z_{k-1} + v_k^2``, ``v_k = (B q_k - d_{k-1} v_{k-1}) / e_k``.  Each
    component of ``z_k`` is nondecreasing in ``k`` and ``<=`` the exact variance (Seeger 2010 §4.1),
    with equality at ``k = n``, and whenever the rows of ``B`` lie in the Krylov space (e.g. at
    breakdown).  Cost: ``k`` products with ``A``, ``k`` columns of products with ``B`` (taken
    ``chunk_size`` at a time), ``O(n k^2)`` reorthogonalisation; memory ``Q`` (``n k``) plus
    ``O(q * chunk_size)``.  ``B Q`` is never formed whole.

    :param matmul: the SPD precision ``A`` (``n x n``): callable, LinearOperator or tensor.
    :param B: ``(q, n)`` LinearOperator or tensor (dense or sparse); ``None`` for the identity.
    :param k: number of Lanczos steps.
    :param v0: starting vector ``(n,)``; default standard normal from ``generator``.
    :param return_result: also return the :class:`LanczosResult` (``Q``, ``T``, ``log|T|``, ...).
    :param reorthogonalize: see :func:`lanczos`.
    :param breakdown_tol: see :func:`lanczos`.
    :param generator: :class:`torch.Generator` for the random start.
    :param chunk_size: Lanczos vectors per product with ``B``.
    :returns: ``z`` of shape ``(q,)``, or ``(z, result)``.
    :raises NotPositiveDefiniteError: if ``T`` is not positive definite (``A`` not SPD).

    Example::

        >>> import torch
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> z = lanczos_variances(A, torch.eye(2, dtype=torch.float64), 2, v0=torch.tensor([1.0, 0.0], dtype=torch.float64))
        >>> torch.allclose(z, torch.linalg.inv(A).diagonal())
        True
    """
    apply_a, n_op, op_dtype, op_device = _resolve_matmul(matmul)
    if v0 is None:
        n = n_op if n_op is not None else as_operator(B).shape[1] if B is not None else None
        if n is None:
            raise ValueError("lanczos_variances: pass v0 (or an operator with a known size) to fix n")
        start = n
        dt = op_dtype or (as_operator(B).dtype if B is not None else None)
        dev = op_device or (as_operator(B).device if B is not None else None)
    else:
        start, dt, dev = v0, None, None
    res = lanczos(
        matmul,
        start,
        k,
        reorthogonalize=reorthogonalize,
        breakdown_tol=breakdown_tol,
        generator=generator,
        dtype=dt,
        device=dev,
    )
    z = res.variances(B, chunk_size=chunk_size)
    return (z, res) if return_result else z


def pca_variances(
    matmul,
    B,
    L,
    *,
    num_steps=None,
    max_steps=None,
    tol=1e-6,
    v0=None,
    generator=None,
    return_result=False,
    on_fail="warn",
    chunk_size=64,
):
    """L-PCA variance estimate ``diag(B U_L Lambda_L^{-1} U_L^T B^T)`` (Seeger 2010 §3, ``rho^(L)``).

    Over 80 lines: most of it is this docstring; the body is under 80.

    ``(Lambda_L, U_L)`` are the ``L`` smallest eigenpairs of ``A``, computed as Ritz pairs of a
    Lanczos run with full reorthogonalisation that starts with ``num_steps`` steps and is extended
    (by ``max(L, K/2)`` steps at a time) until the ``L`` smallest Ritz values satisfy
    ``ritz_residual <= tol * theta`` or ``max_steps`` is reached (then a ConvergenceWarning).
    Because ``U^T A U = Lambda`` holds for Ritz pairs, the estimate is ``<=`` the exact variances
    in every component even before convergence, nondecreasing in ``L``, and exact at ``L = n``.

    Cost: ``K`` products with ``A`` (``K`` the final number of steps), ``O(n K^2)``
    reorthogonalisation, one ``K x K`` eigendecomposition per convergence check, ``O(n K L)`` to
    form ``U_L`` and ``L`` columns of products with ``B`` (``chunk_size`` at a time).  Memory
    ``n K`` for ``Q``.  Lanczos finds the smallest eigenvalues only as fast as the spectrum allows
    (gaps at the low end); ``K`` several times ``L`` is typical.

    :param matmul: the SPD precision ``A``.
    :param B: ``(q, n)`` operator or tensor, ``None`` for the identity.
    :param L: number of eigenpairs (``1 <= L <= n``).
    :param num_steps: initial number of Lanczos steps; default ``min(n, max(2 L, L + 20))``.
    :param max_steps: cap on Lanczos steps; default ``min(n, max(4 L, L + 100))``.
    :param tol: relative Ritz residual tolerance of the ``L`` smallest pairs.
    :param v0: starting vector; default standard normal from ``generator``.
    :param return_result: also return the :class:`LanczosResult`.
    :param on_fail: ``"warn"`` or ``"ignore"`` if the ``L`` pairs did not converge.
    :param chunk_size: eigenvectors per product with ``B``.
    :returns: ``z`` of shape ``(q,)``, or ``(z, result)``.
    """
    apply_a, n_op, op_dtype, op_device = _resolve_matmul(matmul)
    if v0 is None:
        n = n_op if n_op is not None else (as_operator(B).shape[1] if B is not None else None)
        if n is None:
            raise ValueError("pca_variances: pass v0 (or an operator with a known size) to fix n")
        dt = op_dtype or (as_operator(B).dtype if B is not None else None)
        dev = op_device or (as_operator(B).device if B is not None else None)
        v0 = _start_vector(n, n_op, dt, dev, None, None, generator)
    else:
        v0 = _start_vector(v0, n_op, None, None, None, None, None)
    n = v0.shape[0]
    op = _as_design(B, n)
    L = int(L)
    if not 1 <= L <= n:
        raise ValueError(f"L: must be in [1, {n}], got {L}")
    if on_fail not in ("warn", "ignore"):
        raise ValueError(f"on_fail: expected 'warn' or 'ignore', got {on_fail!r}")
    K = min(n, max(2 * L, L + 20)) if num_steps is None else min(n, int(num_steps))
    max_steps = min(n, max(4 * L, L + 100)) if max_steps is None else min(n, int(max_steps))
    K = max(L, min(K, max_steps))
    proc = _vector_run(matmul, v0, K, True, None, None, None, None)
    while True:
        proc.run(K)
        res = proc.result()
        if res.k < L:
            raise ValueError(
                f"pca_variances: Lanczos broke down after {res.k} < L={L} steps (the Krylov space of v0 is "
                "invariant); use another v0 or a smaller L"
            )
        theta, rr = res.ritz_values[:L], res.ritz_residuals[:L]
        if not bool((theta > 0).all()):
            raise NotPositiveDefiniteError("pca_variances: A has a nonpositive Ritz value; A is not SPD")
        ok = bool((rr <= tol * theta).all())
        if ok or res.breakdown or K >= max_steps:
            break
        K = min(max_steps, K + max(L, K // 2))
    if not ok and on_fail == "warn":
        worst = float((rr / theta).max())
        warn(f"pca_variances: the {L} smallest Ritz pairs did not converge in {res.k} Lanczos steps "
             f"(largest relative Ritz residual {worst:.2e} > tol={tol:g}); the estimate is still a lower bound")
    Q = res.Q
    q_rows = n if op is None else op.shape[0]
    z = torch.zeros(q_rows, dtype=Q.dtype, device=Q.device)
    inv_theta = 1.0 / theta
    with torch.no_grad():
        for start in range(0, L, max(1, int(chunk_size))):
            stop = min(L, start + max(1, int(chunk_size)))
            U = Q @ res.ritz_vectors_T[:, start:stop]
            W = U if op is None else op.mv(U)
            z.add_((W * W) @ inv_theta[start:stop])
    return (z, res) if return_result else z


# ---------------------------------------------------------------------------------------------------
# Banded K-Lanczos substitution and block Lanczos
# ---------------------------------------------------------------------------------------------------
def banded_lanczos_z(L, band, rows, k, chunk_size=None):
    r"""``z = diag(R^T T^{-1} R)`` for ``T = L L^T`` banded and ``R = (B Q)^T`` given by row blocks.

    With ``V = L^{-1} R`` (``k x q``), ``z = sum_j V_j^2``.  ``L`` (Cholesky of a (block) tridiagonal
    ``T``) has lower bandwidth ``band``, so row block ``[s, e)`` of ``V`` is
    ``L_{ss}^{-1} (R_{[s,e)} - L_{[s,e), [s-band, s)} V_{[s-band, s)})``: forward substitution in
    chunks, ``O(k band q)`` work and ``O(chunk q)`` memory.  For ``band = 1`` this is Nickisch & Seeger 2009 §2.3's
    recursion ``v_k = (B q_k - d_{k-1} v_{k-1}) / e_k``.

    :param L: ``(k, k)`` lower-triangular Cholesky factor of ``T``.
    :param int band: lower bandwidth of ``L`` (the block size of the Lanczos run).
    :param rows: callable ``(s, e) -> (e - s, q)`` tensor, the rows ``s..e-1`` of ``(B Q)^T``.
    :param int k: number of rows of ``R`` (Lanczos vectors).
    :param int chunk_size: rows per substitution block (raised to ``band`` if smaller); default
        ``4 * band``, which balances the ``chunk^2 q`` triangular solves against the per-chunk overhead.
    :returns: ``z`` of shape ``(q,)``.
    """
    chunk = max(int(chunk_size) if chunk_size is not None else 4 * int(band), int(band), 1)
    z, tail, tail_start = None, None, 0
    if band == 1:  # bidiagonal L: the scalar recursion, no triangular solves
        e_diag, d_sub = torch.diagonal(L).tolist(), torch.diagonal(L, -1).tolist()
    with torch.no_grad():
        for s in range(0, k, chunk):
            e = min(k, s + chunk)
            R = rows(s, e)
            if band == 1:
                for j in range(s, e):
                    tail = R[j - s] / e_diag[j] if j == 0 else (R[j - s] - d_sub[j - 1] * tail) / e_diag[j]
                    z = tail * tail if z is None else z.add_(tail * tail)
                continue
            if tail is not None:
                lo = max(0, s - band)
                R = R - L[s:e, lo:s] @ tail[lo - tail_start:]
            V = torch.linalg.solve_triangular(L[s:e, s:e], R, upper=False)
            z = (V * V).sum(0) if z is None else z.add_((V * V).sum(0))
            tail, tail_start = V, s
    return z



def block_lanczos(matmul, n_or_V0, k, block_size, *, breakdown_tol=None, generator=None, dtype=None, device=None,
                  project=None):
    r"""Block Lanczos with full reorthogonalisation: ``k`` orthonormal vectors in blocks of ``b``.

    Each block step multiplies ``A`` with ``b`` vectors at once (one sparse-times-dense product
    instead of ``b`` sparse matrix-vector products) and reorthogonalises the new block against all
    previous vectors by classical Gram-Schmidt as matrix-matrix products (a second pass when the
    DGKS criterion asks for it), so ``Q`` is read ``b`` times less often than with single vectors.
    ``T = Q^T A Q`` is block tridiagonal with bandwidth ``b``; the K-Lanczos variance estimate ``diag(B Q T^{-1} Q^T B^T)`` keeps the
    properties of Seeger 2010 §4.1 (a lower bound on the exact variances, nondecreasing in ``k``:
    ``Q T^{-1} Q^T`` is ``A^{-1}`` compressed to ``span Q``).  For the same ``k`` the block Krylov
    space has lower polynomial degree, so the estimate can be less accurate than with ``b = 1``
    (``docs/convex_relaxation.md`` measures it); ``b = 1`` is plain Lanczos (:func:`lanczos`).

    The working block is kept as ``b`` contiguous rows of length ``n`` (the layout of the stored ``Q^T``),
    so both Gram-Schmidt products stream ``Q`` in its memory order.

    With ``project``, K-Lanczos variances are accumulated while the run goes (Nickisch & Seeger 2009 §2.3): after the
    product with block ``Q_j``, ``project(Q_j)`` returns products ``P_i Q_j`` (shapes ``(m_i, b_j)``) and
    ``diag(P_i Q T^{-1} Q^T P_i^T)`` is updated through the block-bidiagonal Cholesky factor of ``T``, which
    is extended block by block (``_BlockVarianceAccumulator``).  ``P_i Q`` is never stored
    (``O(b m_i)`` memory); ``project`` may return a product its ``matmul`` already computed (e.g.
    ``B Q_j`` inside ``A Q_j = X^T X Q_j + B^T W B Q_j``), so the variances cost no extra product.

    :param matmul: SPD operator; a callable must accept ``(n, b)`` inputs.
    :param n_or_V0: starting block ``(n, b)``, or ``n`` for a Gaussian random start.
    :param int k: number of Lanczos vectors (at most ``n``); the last block is truncated to reach ``k``.
    :param int block_size: ``b >= 1``.
    :param breakdown_tol: relative threshold on the diagonal of the block QR factor, default ``eps**(2/3)``.
    :param generator: :class:`torch.Generator` for the random start.
    :param dtype: dtype of a random start (default: the operator's, else torch's default).
    :param device: device of a random start (default: the operator's).
    :param project: optional callable ``(n, b_j) block -> sequence of (m_i, b_j) tensors``; its variances
        are returned in ``projected_variances`` (then ``T`` must be positive definite:
        :class:`~pyro_convexvb.errors.NotPositiveDefiniteError` otherwise).
    :returns: :class:`LanczosResult`.

    Example::

        >>> import torch
        >>> A = torch.diag(torch.arange(1.0, 13.0, dtype=torch.float64))
        >>> res = block_lanczos(A, 12, 12, 3, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(res.ritz_values, torch.arange(1.0, 13.0, dtype=torch.float64))
        True
        >>> B = torch.ones(1, 12, dtype=torch.float64)
        >>> res = block_lanczos(A, 12, 12, 3, generator=torch.Generator().manual_seed(0), project=lambda V: [B @ V])
        >>> z = res.projected_variances[0]  # 1^T A^{-1} 1, exact at k = n
        >>> abs(float(z) - float((1.0 / torch.arange(1.0, 13.0, dtype=torch.float64)).sum())) < 1e-12
        True
    """
    apply_a, n_op, op_dtype, op_device = _resolve_matmul(matmul)
    b = int(block_size)
    if b < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    if isinstance(n_or_V0, torch.Tensor):
        V0 = n_or_V0.detach()
        if V0.dim() != 2 or V0.shape[1] != b:
            raise ValueError(f"n_or_V0: expected a starting block of shape (n, {b}), got {tuple(V0.shape)}")
        if n_op is not None and V0.shape[0] != n_op:
            raise ValueError(f"n_or_V0: operator has size {n_op} but the block has {V0.shape[0]} rows")
        _check_finite(V0, "n_or_V0")
    else:
        n = int(n_or_V0)
        if n_op is not None and n != n_op:
            raise ValueError(f"n_or_V0: operator has size {n_op}, got n={n}")
        dt = dtype or op_dtype or torch.get_default_dtype()
        dev = device or op_device or (generator.device if generator is not None else None)
        V0 = torch.randn(n, b, dtype=dt, device=dev, generator=generator)
    n = V0.shape[0]
    if int(k) < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    k = min(int(k), n)
    V0 = V0[:, :min(b, k)]
    run = _LanczosRun(apply_a, V0, breakdown_tol=breakdown_tol, project=project)
    return run.run(k).result()


def _projections(project, V, acc):
    """``project(V)`` checked: a non-empty sequence of ``(m_i, b_j)`` tensors, as many as for earlier blocks."""
    P = project(V)
    if isinstance(P, torch.Tensor) or not isinstance(P, (list, tuple)) or not P:
        raise ValueError(f"project: expected a non-empty list of tensors, got {type(P).__name__}")
    for i, Pi in enumerate(P):
        if not isinstance(Pi, torch.Tensor) or Pi.dim() != 2 or Pi.shape[1] != V.shape[1]:
            got = tuple(Pi.shape) if isinstance(Pi, torch.Tensor) else type(Pi).__name__
            raise ValueError(f"project: output {i} must have shape (m, {V.shape[1]}) for a block of "
                             f"{V.shape[1]} vectors, got {got}")
    if acc.z is not None and [len(z) for z in acc.z] != [Pi.shape[0] for Pi in P]:
        raise ValueError(f"project: output sizes changed between blocks: {[len(z) for z in acc.z]} -> "
                         f"{[Pi.shape[0] for Pi in P]}")
    return P
