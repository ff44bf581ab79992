"""A small linear-operator protocol: every algorithm asks only for products.

An operator ``A`` of shape ``(m, n)`` provides

* ``A.mv(v)``: ``A @ v`` for ``v`` of shape ``(n,)`` or ``(n, k)``;
* ``A.rmv(u)``: ``A.T @ u`` for ``u`` of shape ``(m,)`` or ``(m, k)``;
* ``A.squared()``: the operator of elementwise squares ``|A_ij|^2`` when it is cheap
  (dense, sparse, diagonal, stacks of those), else ``None``.  It gives
  ``diag(A.T diag(w) A) = A.squared().rmv(w)`` (Jacobi preconditioners) and
  ``diag(A diag(w) A.T) = A.squared().mv(w)`` without densifying anything;
* ``A.to_dense()``: the dense matrix, for tests and small problems only.

Sparse matrices keep their transpose as a second CSR matrix because a transposed
sparse product in torch is 60-75x slower than a plain one; :func:`sparse_matvec`
gives the product a custom backward that uses the stored transpose, so autograd
(and hence Pyro's SVI) through ``X @ w`` stays fast.

Device and dtype follow the wrapped tensors.
"""
import warnings

import torch


def _consume_torch_sparse_notices():
    """torch warns once per process, when the first sparse CSR tensor is built, that CSR support is in beta and
    that invariant checks are off. The package builds CSR tensors for its own operators (svmlight loads, sparse
    designs); the notice says nothing about the user's code, so it is taken here, once, instead of surfacing
    at a user's first sparse load. No warning filter is installed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1.0]), size=(1, 1)).to_dense()


_consume_torch_sparse_notices()

__all__ = [
    "LinearOperator",
    "DenseOperator",
    "SparseOperator",
    "DiagonalOperator",
    "IdentityOperator",
    "ZeroOperator",
    "StackedOperator",
    "BlockDiagonalOperator",
    "ComposedOperator",
    "SumOperator",
    "TransposedOperator",
    "FunctionOperator",
    "EmbedColumnsOperator",
    "as_operator",
    "sparse_matvec",
    "to_csr",
    "compact_indices",
]


def _check_vec(v, n, what):
    if v.shape[0] != n:
        raise ValueError(f"{what}: expected leading dimension {n}, got shape {tuple(v.shape)}")


#: largest ``n`` for which an ``n x n`` operator without a structured answer is made dense (its diagonal, its
#: Cholesky factor, an exact bound that needs ``log|A|``): 5000 doubles squared are 200 MB
DENSE_LIMIT = 5000


class LinearOperator:
    """Base class. Subclasses implement ``_mv``, ``_rmv`` and set ``shape``, ``dtype``, ``device``."""

    shape = (0, 0)
    dtype = torch.float64
    device = torch.device("cpu")

    def mv(self, v):
        """``A @ v`` for ``v`` of shape ``(n,)`` or ``(n, k)``."""
        _check_vec(v, self.shape[1], type(self).__name__ + ".mv")
        return self._mv(v)

    def rmv(self, u):
        """``A.T @ u`` for ``u`` of shape ``(m,)`` or ``(m, k)``."""
        _check_vec(u, self.shape[0], type(self).__name__ + ".rmv")
        return self._rmv(u)

    def _mv(self, v):  # pragma: no cover - abstract
        raise NotImplementedError

    def _rmv(self, u):  # pragma: no cover - abstract
        raise NotImplementedError

    def squared(self):
        """Operator of elementwise squares, or ``None`` if not available cheaply."""
        return None

    def to_dense(self):
        """Dense ``(m, n)`` matrix (by probing with the identity unless overridden)."""
        eye = torch.eye(self.shape[1], dtype=self.dtype, device=self.device)
        return self._mv(eye)

    def diagonal(self, dense_limit=DENSE_LIMIT):
        """Diagonal ``(n,)`` of a square operator without densifying a large one: from the structure where the
        class knows it, else from :meth:`to_dense` if ``n <= dense_limit``, else ``None``.

        Example::

            >>> import torch
            >>> A = StackedOperator([DiagonalOperator(torch.tensor([2.0, 3.0], dtype=torch.float64))])
            >>> A.diagonal().tolist(), A.diagonal(dense_limit=0), A.flops()
            ([2.0, 3.0], None, 2.0)
        """
        return torch.diagonal(self.to_dense()).clone() if self.shape[0] <= dense_limit else None

    def flops(self):
        """Floating-point operations of one product with one vector: ``2 m n`` unless the structure needs fewer
        (``2 nnz`` for a sparse matrix, ``n`` for a diagonal, the parts' sum for a stack or a product)."""
        return 2.0 * self.shape[0] * self.shape[1]

    def sqrt_factor(self, dense_limit=DENSE_LIMIT):
        """An operator ``R`` with ``R^T R = self`` for an SPD operator: from the structure (diagonal, block
        diagonal, a sparse Cholesky factor), else the dense Cholesky factor if ``n <= dense_limit``, else ``None``."""
        if self.shape[0] > dense_limit:
            return None
        return DenseOperator(torch.linalg.cholesky(self.to_dense()).transpose(0, 1).contiguous())

    @property
    def T(self):
        return TransposedOperator(self)

    def __matmul__(self, v):
        if isinstance(v, LinearOperator):
            return ComposedOperator(self, v)
        return self.mv(v)

    def __repr__(self):
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"

    def diag_congruence(self, C):
        """``diag(A C A^T)`` (length ``m``) for a dense ``(n, n)`` matrix ``C``: ``rowsum((A C) * A)``, no
        factorisation of ``C`` (small problems: ``A`` is densified)."""
        return (self.mv(C) * self.to_dense()).sum(-1)

    # --- conveniences built on squared() ---
    def diag_gram(self, weights=None):
        """``diag(A.T diag(w) A)`` (length ``n``); ``None`` if ``squared()`` is unavailable."""
        sq = self.squared()
        if sq is None:
            return None
        if weights is None:
            weights = torch.ones(self.shape[0], dtype=self.dtype, device=self.device)
        return sq.rmv(weights)

    def weighted_gram(self, weights=None, chunk=256):
        """Dense ``(n, n)`` matrix ``A.T diag(w) A`` (``w`` of length ``m``, ones if ``None``).

        For small ``n`` only (it is dense). The default probes with identity columns, ``chunk`` at a time;
        dense, sparse, diagonal and stacked operators override it with a direct product (for a sparse ``A``
        a sparse-sparse product, ``sum_i nnz_i^2`` multiply-adds instead of ``2 n nnz``).
        """
        w = self._gram_weights(weights)
        n = self.shape[1]
        G = torch.empty(n, n, dtype=self.dtype, device=self.device)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            E = torch.zeros(n, stop - start, dtype=self.dtype, device=self.device)
            E[torch.arange(start, stop), torch.arange(stop - start)] = 1
            G[:, start:stop] = self._rmv(w.unsqueeze(-1) * self._mv(E))
        return G

    def _gram_weights(self, weights):
        if weights is None:
            return torch.ones(self.shape[0], dtype=self.dtype, device=self.device)
        w = torch.as_tensor(weights, dtype=self.dtype, device=self.device)
        return w.expand(self.shape[0]) if w.dim() == 0 else w

    def gram_symbol(self, weights=None):
        """Symbol of T. Chan's optimal 2-D circulant approximation of ``A.T diag(w) A`` (a
        :class:`~.circulant.CirculantSymbol`), or ``None`` when the operator does not know it (the default).
        Operators on images whose rows are Fourier modes or translates of a few patterns (convolutions,
        wavelet subbands) provide it; it gives the convex relaxation a Fourier preconditioner."""
        return None

    def gram_tiles(self, weights, tile):
        """Diagonal blocks of ``A.T diag(w) A`` over the aligned ``tile x tile`` pixel tiles of an image (a
        :class:`~.tiles.TileBlocks`), or ``None`` when the operator does not know them (the default).
        Image operators provide them; they give the convex relaxation a block-Jacobi preconditioner."""
        return None

    def row_sq_norms(self, weights=None):
        """``diag(A diag(w) A.T)`` (length ``m``); ``None`` if ``squared()`` is unavailable."""
        sq = self.squared()
        if sq is None:
            return None
        if weights is None:
            weights = torch.ones(self.shape[1], dtype=self.dtype, device=self.device)
        return sq.mv(weights)


class DenseOperator(LinearOperator):
    """A dense ``(m, n)`` tensor."""

    def __init__(self, matrix):
        if matrix.dim() != 2:
            raise ValueError(f"DenseOperator needs a 2-D tensor, got shape {tuple(matrix.shape)}")
        self.matrix = matrix
        self.shape = tuple(matrix.shape)
        self.dtype = matrix.dtype
        self.device = matrix.device

    def _mv(self, v):
        return self.matrix @ v

    def _rmv(self, u):
        return self.matrix.transpose(-1, -2) @ u

    def squared(self):
        M = self.matrix
        return DenseOperator(M.abs() ** 2 if M.is_complex() else M * M)  # |A_ij|^2

    def weighted_gram(self, weights=None, chunk=256):
        w = self._gram_weights(weights)
        return self.matrix.transpose(0, 1) @ (w.unsqueeze(-1) * self.matrix)

    def diagonal(self, dense_limit=DENSE_LIMIT):
        return torch.diagonal(self.matrix).clone()

    def to_dense(self):
        return self.matrix


def to_csr(matrix):
    """Convert a torch sparse COO/CSR/CSC tensor (or scipy sparse matrix) to torch CSR, in canonical form (sorted,
    duplicate entries summed: entrywise maps such as :meth:`SparseOperator.squared` see each entry once)."""
    if not isinstance(matrix, torch.Tensor):
        try:
            import scipy.sparse as sp
        except ImportError:  # pragma: no cover
            sp = None
        if sp is not None and sp.issparse(matrix):
            m = matrix.tocsr()
            if not m.has_canonical_format:  # unsorted or duplicate entries: squared() must see their sums
                m = m.copy()  # never reorder the caller's matrix in place
                m.sum_duplicates()
            return torch.sparse_csr_tensor(
                torch.from_numpy(m.indptr.astype("int64")),
                torch.from_numpy(m.indices.astype("int64")),
                torch.from_numpy(m.data),
                size=m.shape,
                check_invariants=False,
            )
        raise TypeError(f"cannot convert {type(matrix).__name__} to a sparse CSR tensor")
    if matrix.layout == torch.sparse_csr:
        crow, col = matrix.crow_indices(), matrix.col_indices()
        rows = torch.repeat_interleave(torch.arange(matrix.shape[0], device=col.device), (crow[1:] - crow[:-1]).long())
        keys = rows * matrix.shape[1] + col.long()
        if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):  # unsorted or duplicate entries: summed
            return matrix.to_sparse_coo().coalesce().to_sparse_csr()
        return matrix
    if matrix.layout in (torch.sparse_coo, torch.sparse_csc):
        return matrix.coalesce().to_sparse_csr() if matrix.layout == torch.sparse_coo else matrix.to_sparse_csr()
    raise TypeError(f"expected a sparse tensor, got layout {matrix.layout}")


def _csr_transpose(csr):
    """Transpose of a CSR tensor, as CSR (built once, via CSC, no densification)."""
    m, n = csr.shape
    crow, col, val = csr.crow_indices(), csr.col_indices(), csr.values()
    # CSR of A.T has the CSC structure of A.
    rows = torch.repeat_interleave(torch.arange(m, device=csr.device), (crow[1:] - crow[:-1]).long())
    order = torch.argsort(col.long() * m + rows)
    counts = torch.bincount(col, minlength=n)
    tcrow = torch.zeros(n + 1, dtype=crow.dtype, device=csr.device)
    tcrow[1:] = torch.cumsum(counts, 0)
    return torch.sparse_csr_tensor(tcrow, rows[order].to(col.dtype), val[order], size=(n, m), check_invariants=False)


def compact_indices(csr):
    """The same CSR with 32-bit ``crow``/``col`` indices when they fit (else unchanged).

    Sparse products are memory-bound; 32-bit indices cut the bytes per nonzero from 16 to 12 (float64)
    and halve the time of ``torch.mv`` on CSR matrices (measured in ``docs/linalg.md``).
    """
    if csr.crow_indices().dtype == torch.int32:
        return csr
    if max(csr.values().numel(), *csr.shape) >= 2**31 - 1:
        return csr
    return torch.sparse_csr_tensor(csr.crow_indices().to(torch.int32), csr.col_indices().to(torch.int32),
                                   csr.values(), size=csr.shape, check_invariants=False)


class _SparseMatvec(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, A, At):
        ctx.A, ctx.At = A, At
        return _spmm(A, v)

    @staticmethod
    def backward(ctx, grad):
        # Going through the Function again keeps double backward (jvp probes) on stored CSRs.
        return sparse_matvec(ctx.At, ctx.A, grad), None, None


def _spmm(A, v):
    if v.dim() == 1:
        return torch.mv(A, v) if A.layout == torch.sparse_csr else (A @ v.unsqueeze(-1)).squeeze(-1)
    if v.shape[1] == 1 and A.layout == torch.sparse_csr:
        # torch.mv: about 1.5x faster than CSR @ (n, 1)
        return torch.mv(A, v[:, 0]).unsqueeze(-1)
    return A @ v


def sparse_matvec(A, At, v):
    """``A @ v`` for CSR ``A`` with a backward that uses the stored CSR transpose ``At`` (for ``v``; a matrix whose
    values require grad, e.g. a learned sparse design, goes through torch's own product, which differentiates in
    both)."""
    if v.requires_grad and torch.is_grad_enabled() and not A.requires_grad:
        return _SparseMatvec.apply(v, A, At)
    return _spmm(A, v)


class SparseOperator(LinearOperator):
    """A torch sparse matrix (CSR, or COO/CSC converted once) with its transpose kept as CSR.

    Memory is ``2 * nnz`` values and indices (32-bit indices whenever they fit, see
    :func:`compact_indices`); nothing is densified.
    """

    def __init__(self, matrix, transpose=None):
        self.matrix = compact_indices(to_csr(matrix))
        self.matrix_t = compact_indices(to_csr(transpose) if transpose is not None else _csr_transpose(self.matrix))
        self.shape = tuple(self.matrix.shape)
        self.dtype = self.matrix.dtype
        self.device = self.matrix.device

    @property
    def nnz(self):
        return self.matrix.values().numel()

    def _mv(self, v):
        return sparse_matvec(self.matrix, self.matrix_t, v)

    def _rmv(self, u):
        return sparse_matvec(self.matrix_t, self.matrix, u)

    def weighted_gram(self, weights=None, chunk=256):
        w = self._gram_weights(weights)
        A = self.matrix
        crow = A.crow_indices()
        scaled = torch.sparse_csr_tensor(crow, A.col_indices(), A.values() * torch.repeat_interleave(w, crow.diff().long()),
                                         size=A.shape, check_invariants=False)
        return (self.matrix_t @ scaled).to_dense()

    @property
    def T(self):
        return SparseOperator(self.matrix_t, transpose=self.matrix)

    def squared(self):
        A, At = self.matrix, self.matrix_t
        v, vt = (A.values().abs(), At.values().abs()) if A.values().is_complex() else (A.values(), At.values())
        sq = torch.sparse_csr_tensor(A.crow_indices(), A.col_indices(), v ** 2, size=A.shape, check_invariants=False)
        sqt = torch.sparse_csr_tensor(At.crow_indices(), At.col_indices(), vt ** 2, size=At.shape,
                                      check_invariants=False)
        return SparseOperator(sq, transpose=sqt)

    def diagonal(self, dense_limit=DENSE_LIMIT):
        """Diagonal of a square CSR matrix from its stored entries (never densified)."""
        A = self.matrix
        n = A.shape[0]
        crow, col, val = A.crow_indices(), A.col_indices(), A.values()
        rows = torch.repeat_interleave(torch.arange(n, device=A.device), (crow[1:] - crow[:-1]).long())
        on = rows == col.long()
        return torch.zeros(n, dtype=A.dtype, device=A.device).index_add_(0, rows[on], val[on])

    def flops(self):
        return 2.0 * self.nnz

    def sqrt_factor(self, dense_limit=DENSE_LIMIT):
        """The sparse Cholesky factor ``R = D^{1/2} L^T P`` of an SPD sparse matrix (fill-reducing ordering;
        Rue & Held 2005, §2.4), of any size and never densified."""
        from .sparse_cholesky import SparseCholesky

        R = SparseCholesky(self, name="prior precision").factor_matrix()
        csr = torch.sparse_csr_tensor(torch.as_tensor(R.indptr, dtype=torch.int64),
                                      torch.as_tensor(R.indices, dtype=torch.int64),
                                      torch.as_tensor(R.data, dtype=self.dtype), size=R.shape,
                                      check_invariants=False).to(self.device)
        return SparseOperator(csr)

    def to_dense(self):
        return self.matrix.to_dense()

    def rows(self, index):
        """Sub-operator of the given rows (a new CSR, still sparse)."""
        index = torch.as_tensor(index, device=self.device, dtype=torch.long)
        A = self.matrix
        crow, col, val = A.crow_indices(), A.col_indices(), A.values()
        starts, ends = crow[index], crow[index + 1]
        lengths = ends - starts
        new_crow = torch.zeros(len(index) + 1, dtype=crow.dtype, device=self.device)
        new_crow[1:] = torch.cumsum(lengths, 0)
        gather = torch.repeat_interleave(starts - new_crow[:-1], lengths) + torch.arange(
            int(new_crow[-1]), device=self.device
        )
        sub = torch.sparse_csr_tensor(new_crow, col[gather], val[gather], size=(len(index), self.shape[1]), check_invariants=False)
        return SparseOperator(sub)


class DiagonalOperator(LinearOperator):
    """``diag(d)`` of shape ``(n, n)``."""

    def __init__(self, diag):
        if diag.dim() != 1:
            raise ValueError("DiagonalOperator needs a 1-D tensor")
        self.diag = diag
        n = diag.shape[0]
        self.shape = (n, n)
        self.dtype = diag.dtype
        self.device = diag.device

    def _mv(self, v):
        return self.diag * v if v.dim() == 1 else self.diag.unsqueeze(-1) * v

    _rmv = _mv

    def squared(self):
        return DiagonalOperator(self.diag * self.diag)

    def weighted_gram(self, weights=None, chunk=256):
        return torch.diag(self.diag * self.diag * self._gram_weights(weights))

    def diagonal(self, dense_limit=DENSE_LIMIT):
        return self.diag

    def flops(self):
        return float(self.shape[0])

    def sqrt_factor(self, dense_limit=DENSE_LIMIT):
        return DiagonalOperator(torch.sqrt(self.diag))

    def to_dense(self):
        return torch.diag(self.diag)


class IdentityOperator(DiagonalOperator):
    """The ``n x n`` identity."""

    def __init__(self, n, dtype=torch.float64, device=None):
        super().__init__(torch.ones(n, dtype=dtype, device=device))

    def _mv(self, v):
        return v

    _rmv = _mv

    def squared(self):
        return self

    def diagonal(self, dense_limit=DENSE_LIMIT):
        return torch.ones(self.shape[0], dtype=self.dtype, device=self.device)

    def flops(self):
        return 0.0

    def sqrt_factor(self, dense_limit=DENSE_LIMIT):
        return self


class ZeroOperator(LinearOperator):
    """The ``m x n`` zero matrix (e.g. an absent Gaussian part)."""

    def __init__(self, m, n, dtype=torch.float64, device=None):
        self.shape = (m, n)
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)

    def _mv(self, v):
        return v.new_zeros((self.shape[0],) + tuple(v.shape[1:]))

    def _rmv(self, u):
        return u.new_zeros((self.shape[1],) + tuple(u.shape[1:]))

    def squared(self):
        return self

    def flops(self):
        return 0.0

    def to_dense(self):
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


class TransposedOperator(LinearOperator):
    """``A.T`` for any operator ``A``."""

    def __init__(self, base):
        self.base = base
        self.shape = (base.shape[1], base.shape[0])
        self.dtype = base.dtype
        self.device = base.device

    def _mv(self, v):
        return self.base._rmv(v)

    def _rmv(self, u):
        return self.base._mv(u)

    @property
    def T(self):
        return self.base

    def squared(self):
        sq = self.base.squared()
        return None if sq is None else sq.T

    def flops(self):
        return self.base.flops()

    def to_dense(self):
        return self.base.to_dense().transpose(-1, -2)


class StackedOperator(LinearOperator):
    """Vertical stack ``[A_1; A_2; ...]`` of operators with equal column counts."""

    def __init__(self, operators):
        operators = [as_operator(op) for op in operators]
        if not operators:
            raise ValueError("StackedOperator needs at least one operator")
        n = operators[0].shape[1]
        for op in operators:
            if op.shape[1] != n:
                raise ValueError(f"cannot stack operators with {op.shape[1]} and {n} columns")
        self.operators = operators
        self.sizes = [op.shape[0] for op in operators]
        self.shape = (sum(self.sizes), n)
        self.dtype = operators[0].dtype
        self.device = operators[0].device

    def _mv(self, v):
        return torch.cat([op._mv(v) for op in self.operators], 0)

    def _rmv(self, u):
        parts = torch.split(u, self.sizes, 0)
        out = None
        for op, p in zip(self.operators, parts):
            r = op._rmv(p)
            out = r if out is None else out + r
        return out

    def squared(self):
        sqs = [op.squared() for op in self.operators]
        return None if any(s is None for s in sqs) else StackedOperator(sqs)

    def weighted_gram(self, weights=None, chunk=256):
        parts = torch.split(self._gram_weights(weights), self.sizes, 0)
        return sum(op.weighted_gram(p, chunk) for op, p in zip(self.operators, parts))

    def gram_symbol(self, weights=None):
        parts = torch.split(self._gram_weights(weights), self.sizes, 0)
        out = None
        for op, p in zip(self.operators, parts):
            s = op.gram_symbol(p)
            if s is None:
                return None
            out = s if out is None else out + s
        return out

    def gram_tiles(self, weights, tile):
        parts = torch.split(self._gram_weights(weights), self.sizes, 0)
        out = None
        for op, p in zip(self.operators, parts):
            b = op.gram_tiles(p, tile)
            if b is None:
                return None
            out = b if out is None else out + b
        return out

    def flops(self):
        return float(sum(op.flops() for op in self.operators))

    def to_dense(self):
        return torch.cat([op.to_dense() for op in self.operators], 0)


class BlockDiagonalOperator(LinearOperator):
    """``blockdiag(A_1, A_2, ...)``."""

    def __init__(self, operators):
        self.operators = [as_operator(op) for op in operators]
        if not self.operators:
            raise ValueError("operators: a block-diagonal operator needs at least one block")
        self.rows = [op.shape[0] for op in self.operators]
        self.cols = [op.shape[1] for op in self.operators]
        self.shape = (sum(self.rows), sum(self.cols))
        self.dtype = self.operators[0].dtype
        self.device = self.operators[0].device

    def _mv(self, v):
        return torch.cat([op._mv(p) for op, p in zip(self.operators, torch.split(v, self.cols, 0))], 0)

    def _rmv(self, u):
        return torch.cat([op._rmv(p) for op, p in zip(self.operators, torch.split(u, self.rows, 0))], 0)

    def squared(self):
        sqs = [op.squared() for op in self.operators]
        return None if any(s is None for s in sqs) else BlockDiagonalOperator(sqs)

    def flops(self):
        return float(sum(op.flops() for op in self.operators))

    def diagonal(self, dense_limit=DENSE_LIMIT):
        parts = [op.diagonal(dense_limit) for op in self.operators]
        return None if any(p is None for p in parts) else torch.cat(parts)

    def sqrt_factor(self, dense_limit=DENSE_LIMIT):
        parts = [op.sqrt_factor(dense_limit) for op in self.operators]
        return None if any(p is None for p in parts) else BlockDiagonalOperator(parts)

    def to_dense(self):
        return torch.block_diag(*[op.to_dense() for op in self.operators])


class ComposedOperator(LinearOperator):
    """``A @ B`` for operators ``A`` (m x p) and ``B`` (p x n)."""

    def __init__(self, left, right):
        left, right = as_operator(left), as_operator(right)
        if left.shape[1] != right.shape[0]:
            raise ValueError(f"cannot compose shapes {left.shape} and {right.shape}")
        self.left, self.right = left, right
        self.shape = (left.shape[0], right.shape[1])
        self.dtype = left.dtype
        self.device = left.device

    def _mv(self, v):
        return self.left._mv(self.right._mv(v))

    def _rmv(self, u):
        return self.right._rmv(self.left._rmv(u))

    def flops(self):
        return self.left.flops() + self.right.flops()

    def squared(self):
        # |(D A)_ij|^2 = d_i^2 |A_ij|^2 and likewise on the right: exact only for diagonal factors.
        if isinstance(self.left, DiagonalOperator):
            sq = self.right.squared()
            return None if sq is None else ComposedOperator(self.left.squared(), sq)
        if isinstance(self.right, DiagonalOperator):
            sq = self.left.squared()
            return None if sq is None else ComposedOperator(sq, self.right.squared())
        return None


class SumOperator(LinearOperator):
    """``sum_k c_k A_k`` for operators of equal shape and scalar coefficients."""

    def __init__(self, operators, coefficients=None):
        self.operators = [as_operator(op) for op in operators]
        if not self.operators:
            raise ValueError("SumOperator: expected at least one operator")
        if coefficients is not None and len(list(coefficients)) != len(self.operators):
            raise ValueError(f"SumOperator: {len(list(coefficients))} coefficients for {len(self.operators)} operators")
        shape = self.operators[0].shape
        for op in self.operators:
            if op.shape != shape:
                raise ValueError(f"cannot add operators of shapes {op.shape} and {shape}")
        self.coefficients = [1.0] * len(self.operators) if coefficients is None else list(coefficients)
        self.shape = shape
        self.dtype = self.operators[0].dtype
        self.device = self.operators[0].device

    def _mv(self, v):
        return sum(c * op._mv(v) for c, op in zip(self.coefficients, self.operators))

    def _rmv(self, u):
        return sum(c * op._rmv(u) for c, op in zip(self.coefficients, self.operators))

    def flops(self):
        return float(sum(op.flops() for op in self.operators))

    def to_dense(self):
        return sum(c * op.to_dense() for c, op in zip(self.coefficients, self.operators))

    def squared(self):
        """The entrywise squares ``sum_k c_k^2 |A_k|^2``: exact when the terms occupy disjoint columns (each an
        :class:`EmbedColumnsOperator` of its own block, as extraction builds ``pcv.linear(X, w) + b``), so that no
        entry has two terms; else ``None``."""
        if not all(isinstance(op, EmbedColumnsOperator) for op in self.operators):
            return None
        spans = sorted((op.start, op.start + op.base.shape[1]) for op in self.operators)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):  # overlapping columns
            return None
        squares = [op.squared() for op in self.operators]
        if any(sq is None for sq in squares):
            return None
        return SumOperator(squares, [c * c for c in self.coefficients])


class FunctionOperator(LinearOperator):
    """An operator given by two callables ``mv`` and ``rmv`` (e.g. FFTs, wavelets, autograd probes).

    Both callables must accept vectors ``(n,)``; batched inputs ``(n, k)`` are handled column
    by column unless ``batched=True`` says the callables accept them directly. ``squared`` is the operator of
    entrywise squares (:meth:`squared`), ``gram_symbol`` a callable ``w -> CirculantSymbol`` (:meth:`gram_symbol`),
    ``gram_tiles`` a callable ``(w, tile) -> TileBlocks or None`` (:meth:`gram_tiles`).
    """

    def __init__(self, mv, rmv, shape, dtype=torch.float64, device=None, batched=False, squared=None,
                 gram_symbol=None, gram_tiles=None):
        self._f, self._fr = mv, rmv
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.batched = batched
        self._squared = squared
        self._gram_symbol = gram_symbol
        self._gram_tiles = gram_tiles

    def _apply(self, f, v):
        if v.dim() == 1 or self.batched:
            return f(v)
        return torch.stack([f(v[:, j]) for j in range(v.shape[1])], -1)

    def _mv(self, v):
        return self._apply(self._f, v)

    def _rmv(self, u):
        return self._apply(self._fr, u)

    def squared(self):
        return self._squared

    def gram_symbol(self, weights=None):
        return None if self._gram_symbol is None else self._gram_symbol(self._gram_weights(weights))

    def gram_tiles(self, weights, tile):
        return None if self._gram_tiles is None else self._gram_tiles(self._gram_weights(weights), int(tile))


def as_operator(x):
    """Wrap a dense/sparse tensor, a scipy sparse matrix or an operator as a :class:`LinearOperator`."""
    if isinstance(x, LinearOperator):
        return x
    if isinstance(x, torch.Tensor):
        if x.layout == torch.strided:
            return DenseOperator(x)
        return SparseOperator(x)
    try:
        import scipy.sparse as sp

        if sp.issparse(x):
            return SparseOperator(to_csr(x))
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"cannot use an object of type {type(x).__name__} as a linear operator")


class EmbedColumnsOperator(LinearOperator):
    """``A`` acting on the columns ``start:start + A.shape[1]`` of a vector of length ``total``.

    Used to apply a block's design operator to the full latent vector ``u`` without forming
    a wider matrix.
    """

    def __init__(self, base, start, total):
        self.base = as_operator(base)
        self.start = int(start)
        self.total = int(total)
        if self.start < 0 or self.start + self.base.shape[1] > self.total:
            raise ValueError("EmbedColumnsOperator: block does not fit in the latent vector")
        self.shape = (self.base.shape[0], self.total)
        self.dtype = self.base.dtype
        self.device = self.base.device

    def _mv(self, v):
        return self.base._mv(v[self.start:self.start + self.base.shape[1]])

    def _rmv(self, u):
        part = self.base._rmv(u)
        out = part.new_zeros((self.total,) + tuple(part.shape[1:]))
        out[self.start:self.start + self.base.shape[1]] = part
        return out

    def squared(self):
        sq = self.base.squared()
        return None if sq is None else EmbedColumnsOperator(sq, self.start, self.total)

    def weighted_gram(self, weights=None, chunk=256):
        g = self.base.weighted_gram(self._gram_weights(weights), chunk)
        out = g.new_zeros((self.total, self.total))
        sl = slice(self.start, self.start + self.base.shape[1])
        out[sl, sl] = g
        return out

    def flops(self):
        return self.base.flops()

    def to_dense(self):
        d = self.base.to_dense()
        out = d.new_zeros((d.shape[0], self.total))
        out[:, self.start:self.start + d.shape[1]] = d
        return out
