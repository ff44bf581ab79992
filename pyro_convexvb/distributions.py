r"""Pyro distributions for latent Gaussian models with sparse structure.

:class:`SparseGMRF` is a Gaussian Markov random field (Rue & Held 2005, §2.1) given by a sparse
precision matrix: a Pyro distribution that the engines of this package read without densifying
(:func:`pyro_convexvb.lgm_from_pyro` turns it into a prior block with a sparse precision operator)
and that Pyro's own inference (NUTS, SVI) runs with as any other distribution, except under torch.jit tracing
(``JitTrace_ELBO``, ``NUTS(jit_compile=True)``), which does not support sparse tensors and is refused.
"""
import math
import weakref

import torch
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import constraints

from .errors import NotPositiveDefiniteError
from .linalg.operators import SparseOperator, to_csr
from .linalg.sparse_cholesky import SparseCholesky

__all__ = ["SparseGMRF", "icar_precision", "rw_precision", "bym2_scaling", "bym2_precision", "sum_to_zero"]

# factorisations of precision objects shared by distribution instances built from the same object
# (a Pyro model builds a new instance at every execution): id -> (weakref, version, dtype, operator, factor)
_FACTORS = {}


def _forget(key):
    def callback(_):
        _FACTORS.pop(key, None)

    return callback


def _version(obj):
    try:
        return obj._version if torch.is_tensor(obj) else obj.matrix._version
    except (AttributeError, RuntimeError):
        return None


_INTRINSIC = {}


def _constraints_key(constraints, n):
    """The cache key of ``constraints``: the string, or the bytes of its float64 ``(k, n)`` matrix (the object's id
    would be reused by a later, different matrix once the first is freed)."""
    if isinstance(constraints, str):
        return constraints
    C = _constraint_matrix(constraints, n)
    return (C.shape, C.tobytes())


def _intrinsic_factor(precision, constraints, dtype, device):
    """``(SparseOperator, _IntrinsicFactor)`` of an intrinsic precision, cached per precision object and constraint
    values."""
    matrix = _precision_matrix(precision)
    n = int(matrix.shape[0])
    key = (id(precision), _constraints_key(constraints, n))
    hit = _INTRINSIC.get(key)
    if hit is not None:
        ref, version, dt, dev, op, fac = hit
        if ref() is precision and version == _version(precision) and dt == dtype and dev == device:
            return op, fac
    fac = _IntrinsicFactor(matrix.detach(), _constraint_matrix(constraints, n))
    csr = to_csr(matrix.detach())
    op = SparseOperator(torch.sparse_csr_tensor(csr.crow_indices(), csr.col_indices(), csr.values().to(dtype),
                                                size=csr.shape, check_invariants=False).to(device))
    try:
        _INTRINSIC[key] = (weakref.ref(precision, lambda _: _INTRINSIC.pop(key, None)), _version(precision), dtype,
                           device, op, fac)
    except TypeError:  # pragma: no cover
        pass
    return op, fac


def _precision_matrix(precision):
    """The torch sparse matrix of a ``precision`` argument (a torch sparse tensor or a SparseOperator), checked to be
    square and without gradient; raises naming the argument otherwise."""
    if isinstance(precision, SparseOperator):
        matrix = precision.matrix
    elif torch.is_tensor(precision):
        if precision.layout not in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc):
            raise TypeError("precision: expected a torch sparse tensor (COO/CSR/CSC) or a SparseOperator, got a dense "
                            "tensor; for a dense precision use "
                            "pyro.distributions.MultivariateNormal(precision_matrix=...)")
        matrix = precision
    else:
        raise TypeError(f"precision: expected a torch sparse tensor (COO/CSR/CSC) or a SparseOperator, "
                        f"got {type(precision).__name__}")
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"precision: must be a square matrix, got shape {tuple(matrix.shape)}")
    if matrix.requires_grad:
        raise ValueError("precision: the sparse precision is a fixed matrix (no gradient flows into its values); "
                         "give a learnable overall scale as precision_scale")
    return matrix


def _precision_and_factor(precision, dtype, device):
    """``(SparseOperator, SparseCholesky)`` of ``precision`` in ``dtype``, cached per precision object."""
    key = id(precision)
    hit = _FACTORS.get(key)
    if hit is not None:
        ref, version, dt, dev, op, chol = hit
        if ref() is precision and version == _version(precision) and dt == dtype and dev == device:
            return op, chol
    matrix = _precision_matrix(precision)
    try:
        chol = SparseCholesky(matrix, name="precision")  # checks symmetry and positive definiteness
    except NotPositiveDefiniteError as err:
        raise NotPositiveDefiniteError(f"{err}; an intrinsic precision (singular, e.g. rw_precision or "
                                       "icar_precision) needs constraints=, e.g. 'sum_to_zero'") from None
    csr = to_csr(matrix.detach())
    csr = torch.sparse_csr_tensor(csr.crow_indices(), csr.col_indices(), csr.values().to(dtype), size=csr.shape,
                                  check_invariants=False).to(device)
    op = SparseOperator(csr)
    try:
        ref = weakref.ref(precision, _forget(key))
    except TypeError:  # pragma: no cover - objects without weak references are not cached
        return op, chol
    _FACTORS[key] = (ref, _version(precision), dtype, device, op, chol)
    return op, chol


def sum_to_zero(n, dtype=torch.float64):
    """The ``(1, n)`` constraint matrix of ``sum(x) = 0``."""
    return torch.ones(1, n, dtype=dtype)


class _IntrinsicFactor:
    r"""Factorisation of an intrinsic (rank-deficient) precision ``Q_0`` whose null space the rows of ``C`` span.

    ``k`` pivot coordinates ``P`` with ``C_P`` invertible are chosen (pivoted QR of ``C``); ``Q_RR`` (the rest)
    is then positive definite and factored sparsely. With ``N = C^T``:

    * ``log|Q_0|* = log|Q_RR| + log|N^T N| - 2 log|det N_P|`` (the generalised determinant, the product of the
      nonzero eigenvalues; Rue & Held 2005, §3.1);
    * a draw of the constrained field is ``phi(z)``, ``z = (Q_RR^{-1/2} eps on R, 0 on P)``, with
      ``phi(x) = x - N (C N)^{-1} C x``: ``phi`` maps ``{x_P = 0}`` linearly onto ``{C x = 0}`` along the null
      space, leaving ``x^T Q_0 x`` unchanged (the pinned and the constrained fields are the same Gaussian on two
      complements of the null space; Rue & Held 2005, §2.3.3 for conditioning by kriging);
    * the constrained covariance is ``Phi S Phi^T`` with ``S = Q_RR^{-1}`` embedded in ``R``.
    """

    def __init__(self, matrix, C):
        import numpy as np
        import scipy.linalg

        from .errors import NotPositiveDefiniteError
        from .linalg.sparse_cholesky import _check_symmetric, as_scipy_csc

        Q = as_scipy_csc(matrix, "precision")
        _check_symmetric(Q, "precision")  # the factor below sees Q_RR only: the rows and columns of P too
        n = Q.shape[0]
        C = np.asarray(C, dtype=np.float64).reshape(-1, n)
        k = C.shape[0]
        if k == 0 or k >= n:
            raise ValueError(f"constraints: expected a (k, {n}) matrix with 0 < k < {n}, got {C.shape}")
        _, Rq, piv = scipy.linalg.qr(C, mode="economic", pivoting=True)
        if abs(Rq[k - 1, k - 1]) <= 1e-10 * abs(Rq[0, 0]):
            raise ValueError("constraints: the constraint rows are linearly dependent")
        P = np.sort(piv[:k])
        keep = np.ones(n, dtype=bool)
        keep[P] = False
        R = np.nonzero(keep)[0]
        QC = Q @ C.T
        if np.abs(QC).max() > 1e-9 * float(abs(Q).sum(1).max()) * float(np.abs(C).max()):
            raise ValueError("constraints: an intrinsic SparseGMRF needs constraint rows that span the null space of "
                             f"the precision (Q c = 0 for each row c; |Q C^T| = {np.abs(QC).max():.3g}): e.g. "
                             "sum-to-zero for an ICAR field on a connected graph or a first-order random walk, "
                             "the constant and the linear trend for a second-order random walk")
        try:
            self.chol = SparseCholesky(Q[R][:, R], name="precision")
            pivots = np.asarray(self.chol.D)
            if pivots.min() <= 1e-10 * pivots.max():  # a pivot at rounding level: a null direction left
                raise NotPositiveDefiniteError("near-zero pivot")
        except NotPositiveDefiniteError:
            raise NotPositiveDefiniteError(
                f"precision: positive semi-definite with more than {k} zero eigenvalues (or indefinite): give one "
                "constraint per null direction (one sum-to-zero per connected component of an ICAR graph; the "
                "constant and the linear trend of a second-order random walk)") from None
        N = C.T
        self.n, self.k, self.P, self.R, self.C = n, k, P, R, C
        self.NK = N @ np.linalg.inv(C @ N)  # (n, k): phi(x) = x - NK C x
        self.NP_inv = np.linalg.inv(N[P])
        # log sqrt(det(G^T G)) = log|det N_P| - 1/2 log det(N^T N), G = phi on {x_P = 0} (Sylvester's identity): the
        # area factor between the pinned field's density and the constrained field's density on {C x = 0}
        self.log_area = float(np.linalg.slogdet(N[P])[1] - 0.5 * np.linalg.slogdet(N.T @ N)[1])
        self.logdet_star = float(self.chol.logdet() - 2 * self.log_area)
        self._diag = None

    def project(self, x):
        """``phi(x) = x - N (C N)^{-1} C x`` for ``x`` of shape ``(n, B)`` (NumPy)."""
        return x - self.NK @ (self.C @ x)

    def pinned(self, x):
        """The inverse of :meth:`project` on ``{x_P = 0}``: the coordinates ``z_R`` ``(n - k, B)`` of the pinned
        field with ``phi(z) = x``, ``z = psi(x) = x - N N_P^{-1} x_P``, for ``x`` ``(n, B)`` on ``{C x = 0}``
        (NumPy)."""
        return (x - self.C.T @ (self.NP_inv @ x[self.P]))[self.R]

    def sample(self, eps):
        """Constrained draws ``(n, B)`` of ``N(0, Q_0^+)`` on ``{C x = 0}`` from ``eps`` of shape ``(n - k, B)``."""
        import numpy as np

        z = np.zeros((self.n, eps.shape[1]))
        z[self.R] = self.chol.solve_Lt(eps)
        return self.project(z)

    def diag_covariance(self):
        """``diag(Phi S Phi^T)``: the marginal variances of the constrained field (``(n,)``, NumPy)."""
        import numpy as np

        if self._diag is None:
            S_diag = np.zeros(self.n)
            S_diag[self.R] = self.chol.diag_inverse()
            SCt = np.zeros((self.n, self.k))
            SCt[self.R] = self.chol.solve(np.ascontiguousarray(self.C[:, self.R].T))
            CSCt = self.C @ SCt
            self._diag = S_diag - 2 * (self.NK * SCt).sum(1) + ((self.NK @ CSCt) * self.NK).sum(1)
        return self._diag


def _constraint_matrix(constraints, n):
    import numpy as np

    if isinstance(constraints, str):
        if constraints != "sum_to_zero":
            raise ValueError(f"constraints: expected 'sum_to_zero' or a (k, n) matrix, got {constraints!r}")
        return np.ones((1, n))
    C = constraints.detach().cpu().numpy() if torch.is_tensor(constraints) else np.asarray(constraints)
    C = np.asarray(C, dtype=np.float64)
    if C.ndim > 2 or C.size == 0 or C.size % n or (C.ndim == 2 and C.shape[1] != n):
        raise ValueError(f"constraints: expected 'sum_to_zero' or a (k, n) matrix with n = {n} columns (one per "
                         f"entry of the field), got shape {tuple(C.shape)}")
    if not np.all(np.isfinite(C)):
        raise ValueError("constraints: the matrix has non-finite entries")
    return C.reshape(-1, n)


def icar_precision(adjacency, dtype=torch.float64):
    r"""``Q_0 = D - W`` of the intrinsic CAR model (Besag, York & Mollié 1991) on a graph given by its symmetric 0/1
    adjacency ``W`` (``D = diag(W 1)``, the number of neighbours): a sparse CSR precision of rank ``n - c`` for ``c``
    connected components. Use with ``SparseGMRF(..., constraints="sum_to_zero")`` on a connected graph.

    :param adjacency: ``(n, n)`` dense or sparse (torch or SciPy) symmetric adjacency.
    :returns: ``(n, n)`` torch sparse CSR tensor.

    Example::

        >>> W = torch.tensor([[0., 1, 0], [1, 0, 1], [0, 1, 0]])
        >>> icar_precision(W).to_dense()
        tensor([[ 1., -1.,  0.],
                [-1.,  2., -1.],
                [ 0., -1.,  1.]], dtype=torch.float64)
    """
    import numpy as np
    import scipy.sparse as sp

    if torch.is_tensor(adjacency) and adjacency.layout != torch.strided:  # sparse stays sparse
        A = adjacency.detach().cpu().to_sparse_coo().coalesce()
        i, j = A.indices().numpy()
        W = sp.coo_matrix((A.values().numpy(), (i, j)), shape=tuple(A.shape))
    elif torch.is_tensor(adjacency):
        W = adjacency.detach().cpu().numpy()
    else:
        W = adjacency
    if not sp.issparse(W):
        W = np.asarray(W)
        if W.ndim != 2:
            raise ValueError(f"adjacency: expected an (n, n) matrix, got shape {W.shape}")
    if W.shape[0] != W.shape[1]:
        raise ValueError(f"adjacency: expected a square (n, n) matrix, got shape {W.shape}")
    W = sp.csr_matrix(W, dtype=np.float64)
    W.setdiag(0)  # a node is no neighbour of itself
    W.eliminate_zeros()
    if not np.all(W.data == 1.0):
        bad = W.data[W.data != 1.0][:3]
        raise ValueError(f"adjacency: expected 0/1 entries, found {bad.tolist()} (a weighted or non-finite graph; "
                         "the ICAR precision D - W counts neighbours)")
    if (W != W.T).nnz:
        raise ValueError("adjacency: must be symmetric")
    return _to_torch_csr(sp.diags(np.asarray(W.sum(1)).ravel()) - W, dtype)


def _to_torch_csr(M, dtype):
    import scipy.sparse as sp

    M = sp.csr_matrix(M)
    M.sort_indices()
    return torch.sparse_csr_tensor(torch.as_tensor(M.indptr, dtype=torch.int64), torch.as_tensor(M.indices, dtype=torch.int64),
                                   torch.as_tensor(M.data, dtype=dtype), size=M.shape)


def rw_precision(n, order=1, dtype=torch.float64):
    r"""``Q_0 = D^T D`` of a random walk of order 1 or 2 on ``n`` equally spaced points (Rue & Held 2005, §3.3.1 and
    §3.4.1; ``D`` the ``(n - order, n)`` difference matrix): rank ``n - order``. Constrain an RW1 to sum to zero and
    an RW2 by its null space ``[1, t]`` (``constraints=torch.stack([torch.ones(n), torch.arange(n)])``).

    Example::

        >>> rw_precision(4).to_dense()
        tensor([[ 1., -1.,  0.,  0.],
                [-1.,  2., -1.,  0.],
                [ 0., -1.,  2., -1.],
                [ 0.,  0., -1.,  1.]], dtype=torch.float64)
    """
    import numpy as np
    import scipy.sparse as sp

    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n: expected an integer number of points, got {n!r}")
    if order not in (1, 2):
        raise ValueError(f"order: expected 1 or 2, got {order}")
    if n <= order:
        raise ValueError(f"n: a random walk of order {order} needs more than {order} points, got {n}")
    D = sp.diags([-1.0, 1.0], [0, 1], shape=(n - 1, n))
    if order == 2:
        D = sp.diags([1.0, -2.0, 1.0], [0, 1, 2], shape=(n - 2, n))
    return _to_torch_csr(D.T @ D, dtype)


def bym2_scaling(precision, constraints="sum_to_zero"):
    r"""The factor ``c`` that scales an intrinsic precision to unit generalised variance: ``c Q_0`` has marginal
    variances (under its constraints) of geometric mean one (Sørbye & Rue 2014; the scaling of the BYM2 model,
    Riebler et al. 2016, §3). ``c`` is the geometric mean of the marginal variances of ``Q_0``'s constrained field.

    :param precision: ``(n, n)`` sparse intrinsic precision (torch sparse or :class:`~pyro_convexvb.linalg.SparseOperator`).
    :param constraints: ``"sum_to_zero"`` or a ``(k, n)`` matrix whose rows span the null space of ``precision``.
    :returns: float ``c``; use ``SparseGMRF(loc, precision, precision_scale=c * tau, constraints=...)``.

    Example::

        >>> Q = rw_precision(5)
        >>> c = bym2_scaling(Q)
        >>> v = SparseGMRF(torch.zeros(5, dtype=torch.float64), Q, c, constraints="sum_to_zero").variance
        >>> round(float(v.log().mean().exp()), 12)
        1.0
    """
    import numpy as np

    from .linalg.sparse_cholesky import as_scipy_csc

    matrix = precision.matrix if isinstance(precision, SparseOperator) else precision
    if not torch.is_tensor(matrix) or matrix.dim() != 2:
        raise TypeError(f"precision: expected an (n, n) torch sparse tensor or a SparseOperator, got "
                        f"{type(precision).__name__}")
    n = int(matrix.shape[0])
    labels, sizes = _graph_components(as_scipy_csc(matrix, "precision"))
    if len(sizes) > 1:
        raise ValueError(
            f"precision: its graph has {len(sizes)} connected components (sizes {_sizes_text(sizes)}), and one factor "
            "cannot give each of them unit generalised variance; BYM2 on a disconnected graph scales every component "
            "on its own and gives islands unit variance (Freni-Sterrantino, Ventrucci & Rue 2018): use "
            "bym2_precision(adjacency), which returns that precision and its constraints")
    variance = _IntrinsicFactor(matrix, _constraint_matrix(constraints, n)).diag_covariance()
    if not np.all(variance > 0):
        raise ValueError(f"constraints: they leave node(s) {np.flatnonzero(variance <= 0)[:5].tolist()} with zero "
                         "variance, so the generalised variance is zero")
    return float(np.exp(np.mean(np.log(variance))))


def _graph_components(Q):
    """``(labels (n,), sizes (ncomp,))`` of the connected components of the graph of a sparse ``Q`` (SciPy)."""
    import numpy as np
    from scipy.sparse.csgraph import connected_components

    _, labels = connected_components(Q, directed=False)
    return labels, np.bincount(labels)


def _sizes_text(sizes):
    shown = sorted(sizes.tolist(), reverse=True)
    return ", ".join(map(str, shown[:6])) + (", ..." if len(shown) > 6 else "")


def bym2_precision(adjacency, dtype=torch.float64):
    r"""The scaled structured precision of the BYM2 model on any graph, and its constraints: ``(Q, C)``.

    Every connected component of two or more nodes gets its ICAR precision ``D - W`` scaled to unit generalised
    variance (:func:`bym2_scaling` of the component) and a sum-to-zero constraint; an island (a node without
    neighbours) gets precision 1, an iid effect of unit variance, and no constraint (Freni-Sterrantino, Ventrucci &
    Rue 2018, who show that a single scaling factor or a single sum-to-zero constraint over a disconnected graph
    changes the meaning of the BYM2 mixing weight from component to component). On a connected graph ``Q`` is
    ``bym2_scaling(icar_precision(W)) * icar_precision(W)`` and ``C`` the row of ones.

    :param adjacency: ``(n, n)`` symmetric 0/1 adjacency, as for :func:`icar_precision`.
    :returns: ``Q``, an ``(n, n)`` torch sparse CSR tensor, and ``C``, a ``(k, n)`` tensor with one indicator row per
        component of two or more nodes (``None`` when every node is an island: ``Q`` is then the identity). Use
        ``SparseGMRF(loc, Q, precision_scale=tau, constraints=C)``.

    Example (a path of three nodes, a pair and an island)::

        >>> W = torch.zeros(6, 6)
        >>> for a, b in [(0, 1), (1, 2), (3, 4)]:
        ...     W[a, b] = W[b, a] = 1.0
        >>> Q, C = bym2_precision(W)
        >>> C
        tensor([[1., 1., 1., 0., 0., 0.],
                [0., 0., 0., 1., 1., 0.]], dtype=torch.float64)
        >>> v = SparseGMRF(torch.zeros(6, dtype=torch.float64), Q, constraints=C).variance
        >>> [round(float(v[s].log().mean().exp()), 12) for s in (slice(0, 3), slice(3, 5), slice(5, 6))]
        [1.0, 1.0, 1.0]
    """
    import numpy as np
    import scipy.sparse as sp

    from .linalg.sparse_cholesky import as_scipy_csc

    if not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating point dtype (the scaling factors are fractions), got {dtype}")
    Q0 = as_scipy_csc(icar_precision(adjacency), "adjacency").tocsr()
    labels, sizes = _graph_components(Q0)
    scale = np.ones(Q0.shape[0])
    rows = []
    for comp in np.flatnonzero(sizes > 1):
        idx = np.flatnonzero(labels == comp)
        variance = _IntrinsicFactor(Q0[idx][:, idx], np.ones((1, len(idx)))).diag_covariance()
        scale[idx] = np.exp(np.mean(np.log(variance)))
        row = np.zeros(Q0.shape[0])
        row[idx] = 1.0
        rows.append(row)
    island = (sizes == 1)[labels]
    Q = sp.diags(scale) @ Q0 + sp.diags(island.astype(np.float64))
    C = torch.as_tensor(np.stack(rows), dtype=dtype) if rows else None
    return _to_torch_csr(Q, dtype), C


class SparseGMRF(TorchDistribution):
    r"""Gaussian Markov random field ``x ~ N(loc, Q^{-1})`` with a sparse precision ``Q = s Q_0``.

    The density (Rue & Held 2005, Eq. 2.5) is

    .. math:: \log p(x) = -\tfrac n2 \log 2\pi + \tfrac12 (n \log s + \log|Q_0|)
              - \tfrac s2 (x - \mu)^T Q_0 (x - \mu).

    ``Q_0`` is factored once (sparse Cholesky with a fill-reducing ordering,
    :class:`~pyro_convexvb.linalg.SparseCholesky`; the factorisation is shared by every instance built
    from the same precision object, so a model that builds the distribution at each execution
    factors once). ``log|Q_0|`` comes from the factor, the quadratic form from sparse products that
    autograd differentiates, samples from ``x = loc + s^{-1/2} P^T L^{-T} D^{-1/2} eps``
    (Rue & Held 2005, Algorithm 2.4) and :attr:`variance` from selected inversion of the factor
    (Takahashi et al. 1973). Nothing of size ``n x n`` is formed.

    ``log_prob`` is differentiable in the value, ``loc`` and ``precision_scale``; ``rsample`` is
    reparameterised in ``loc`` and ``precision_scale``. The values of ``Q_0`` are fixed (put a prior
    on the overall scale through ``precision_scale``, e.g. a Gamma).

    Shapes: ``event_shape = (n,)`` and ``batch_shape = ()``. Parameters with batch dimensions are
    not supported and raise; ``expand(batch_shape)`` (and Pyro plates) give independent copies
    through Pyro's :class:`~pyro.distributions.ExpandedDistribution`.

    :param torch.Tensor loc: ``(n,)`` mean (or a scalar, broadcast to ``(n,)``).
    :param precision: ``(n, n)`` symmetric positive definite ``Q_0``: a torch sparse tensor (COO, CSR or
        CSC) or a :class:`~pyro_convexvb.linalg.SparseOperator`. Converted to the dtype of ``loc``.
    :param torch.Tensor precision_scale: optional positive scalar ``s`` (``Q = s Q_0``); default 1.
    :param constraints: for an *intrinsic* field (Rue & Held 2005, ch. 3: ICAR, RW1, RW2; ``Q_0`` positive
        semi-definite of rank ``n - k``): ``"sum_to_zero"`` or a ``(k, n)`` matrix ``C`` whose rows span the null
        space of ``Q_0`` (checked: ``Q_0 C^T = 0``), and the field lives on ``{C (x - loc) = 0}``. Its density there
        is ``log p(x) = -(n-k)/2 log 2 pi + 1/2 log|Q|* - 1/2 (x - loc)^T Q (x - loc)`` with the generalised
        determinant ``|Q|*`` (the product of the nonzero eigenvalues; Rue & Held 2005, Eq. 3.18), the density
        with respect to the Lebesgue measure of that ``(n - k)``-dimensional subspace; ``log_prob`` evaluates this
        formula, which ignores the component of ``x - loc`` in the null space. Samples satisfy the constraints
        exactly (:class:`_IntrinsicFactor`). Helpers: :func:`icar_precision`, :func:`rw_precision`,
        :func:`bym2_scaling`. Default ``None``: ``Q_0`` must be positive definite.
    :raises TypeError: ``precision`` is dense or of an unknown type.
    :raises ValueError: shapes that do not match, a non-symmetric ``precision``, batch dimensions,
        a non-positive ``precision_scale``.
    :raises pyro_convexvb.NotPositiveDefiniteError: ``precision`` is not positive definite.

    Example (a first-order random walk with a small ridge, sampled and scored)::

        >>> import torch, pyro
        >>> import pyro_convexvb as pcv
        >>> n = 6
        >>> i = torch.arange(n)
        >>> rows = torch.cat([i, i[:-1], i[1:]]); cols = torch.cat([i, i[1:], i[:-1]])
        >>> deg = torch.full((n,), 2.0, dtype=torch.float64); deg[[0, -1]] = 1.0
        >>> vals = torch.cat([deg + 0.1, -torch.ones(2 * (n - 1), dtype=torch.float64)])
        >>> Q = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (n, n))
        >>> d = pcv.distributions.SparseGMRF(torch.zeros(n, dtype=torch.float64), Q, torch.tensor(2.0, dtype=torch.float64))
        >>> x = d.rsample((3,))
        >>> x.shape, d.log_prob(x).shape, d.variance.shape
        (torch.Size([3, 6]), torch.Size([3]), torch.Size([6]))
        >>> ref = pyro.distributions.MultivariateNormal(torch.zeros(n, dtype=torch.float64),
        ...                                             precision_matrix=2.0 * Q.to_dense())
        >>> bool(torch.allclose(d.log_prob(x), ref.log_prob(x)))
        True
    """

    arg_constraints = {"loc": constraints.real_vector, "precision_scale": constraints.positive}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc, precision, precision_scale=None, validate_args=None, constraints=None):
        if torch._C._get_tracing_state():
            raise NotImplementedError("SparseGMRF: torch.jit tracing does not support sparse tensors, so models with "
                                      "a SparseGMRF site cannot be JIT-compiled; use Trace_ELBO instead of "
                                      "JitTrace_ELBO, or NUTS(..., jit_compile=False) (engine='nuts' with "
                                      "options=dict(jit_compile=False))")
        if not torch.is_tensor(loc):
            loc = torch.as_tensor(loc, dtype=torch.get_default_dtype())
        if not loc.is_floating_point():
            raise ValueError(f"loc: expected a floating-point tensor, got dtype {loc.dtype}")
        shape = precision.shape if isinstance(precision, SparseOperator) else getattr(precision, "shape", None)
        if shape is None or len(shape) != 2:
            raise TypeError(f"precision: expected a torch sparse tensor (COO/CSR/CSC) or a SparseOperator, "
                            f"got {type(precision).__name__}")
        n = int(shape[0])
        if loc.dim() == 0:
            loc = loc.expand(n)
        if loc.dim() != 1 or loc.shape[0] != n:
            raise ValueError(f"loc: expected shape ({n},) to match precision {tuple(shape)}, got {tuple(loc.shape)} "
                             "(SparseGMRF has batch_shape (); batched parameters are not supported)")
        if precision_scale is None:
            precision_scale = torch.ones((), dtype=loc.dtype, device=loc.device)
        else:
            precision_scale = torch.as_tensor(precision_scale, dtype=loc.dtype, device=loc.device)
            if precision_scale.numel() != 1 or precision_scale.dim() > 1:
                raise ValueError(f"precision_scale: expected a scalar, got shape {tuple(precision_scale.shape)} "
                                 "(SparseGMRF has batch_shape (); batched parameters are not supported)")
            precision_scale = precision_scale.reshape(())
            validate = self._validate_args if validate_args is None else validate_args
            # negative or NaN scales are errors here; a scale of 0 (an MCMC proposal exp(z), z < -745) is refused by
            # torch's check of arg_constraints (positive) under validation, and gives log_prob = -inf without it
            if validate and not bool(precision_scale.detach() >= 0):
                raise ValueError(f"precision_scale: must be positive, got {float(precision_scale.detach()):.6g}")
        self.loc = loc
        self.precision_scale = precision_scale
        self._precision_obj = precision
        self.constraints = constraints
        if constraints is None:
            self.precision, self._chol = _precision_and_factor(precision, loc.dtype, loc.device)
            self._intrinsic = None
            self._logdet0 = self._chol.logdet()
            self.rank = n
        else:
            self.precision, self._intrinsic = _intrinsic_factor(precision, constraints, loc.dtype, loc.device)
            self._chol = None
            self._logdet0 = self._intrinsic.logdet_star
            self.rank = n - self._intrinsic.k
        super().__init__(torch.Size(), torch.Size([n]), validate_args=validate_args)

    # ------------------------------------------------------------------ torch.distributions API
    def __deepcopy__(self, memo):
        """A deep copy by pickling (torch cannot deepcopy the sparse CSR precision; its pickle holds the same data)."""
        import pickle

        new = pickle.loads(pickle.dumps(self))
        memo[id(self)] = new
        return new

    @property
    def n(self):
        return self.event_shape[0]

    @property
    def mean(self):
        return self.loc

    @property
    def mode(self):
        return self.loc

    @property
    def variance(self):
        """``diag(Q^{-1}) = diag(Q_0^{-1}) / s`` by selected inversion (``(n,)``; differentiable in ``s``); for an
        intrinsic field the marginal variances of the constrained field, ``diag(Q^+)`` (every basis of the null
        space gives the same constrained field)."""
        if self._intrinsic is not None:
            z = torch.as_tensor(self._intrinsic.diag_covariance(), dtype=self.loc.dtype, device=self.loc.device)
        else:
            z = torch.as_tensor(self._chol.diag_inverse(), dtype=self.loc.dtype, device=self.loc.device)
        return z / self.precision_scale

    @property
    def is_intrinsic(self):
        """Whether the precision is rank-deficient (``constraints`` given)."""
        return self._intrinsic is not None

    @property
    def constraint_factor(self):
        """For an intrinsic field, the factorisation of ``Q_0`` with its constraints (:class:`_IntrinsicFactor`:
        the ``(k, n)`` constraint matrix ``C``, the pivot coordinates ``P`` and the others ``R``); ``None`` for a
        proper field."""
        return self._intrinsic

    def log_det_precision(self):
        """``log|Q| = n log s + log|Q_0|`` as a tensor (differentiable in ``s``); for an intrinsic field the
        generalised determinant ``log|Q|* = (n - k) log s + log|Q_0|*`` (Rue & Held 2005, §3.1)."""
        return self.rank * torch.log(self.precision_scale) + self._logdet0

    def scaled_precision(self, keep_graph=False):
        """``Q = s Q_0`` as a :class:`~pyro_convexvb.linalg.SparseOperator`: detached values, or with ``keep_graph``
        values carrying the autograd graph of ``precision_scale`` (for envelope gradients)."""
        s = float(self.precision_scale.detach())
        if keep_graph and torch.is_tensor(self.precision_scale) and self.precision_scale.requires_grad:
            s = self.precision_scale.reshape(())
        elif s == 1.0:
            return self.precision
        A = self.precision.matrix
        csr = torch.sparse_csr_tensor(A.crow_indices(), A.col_indices(), A.values() * s, size=A.shape,
                                      check_invariants=False)
        return SparseOperator(csr)

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        n = self.n
        r = (value - self.loc).to(self.loc.dtype)  # a value of another dtype is evaluated in the distribution's, as
        batch = r.shape[:-1]  # torch's MultivariateNormal does
        flat = r.reshape(-1, n).transpose(0, 1)  # (n, B)
        quad = (flat * self.precision.mv(flat.contiguous())).sum(0).reshape(batch)
        lp = (-0.5 * self.rank * math.log(2 * math.pi) + 0.5 * self.log_det_precision()
              - 0.5 * self.precision_scale * quad)
        # a precision scale overflowed to inf (an MCMC proposal exp(z), z > 709) is a point mass at loc, as torch's
        # Normal with scale 0 (inf - inf was NaN); elementwise, without a Python branch, so torch.func.vmap runs it
        point = torch.where(quad > 0, torch.full_like(lp, -math.inf), torch.full_like(lp, math.inf))
        return torch.where(torch.isinf(self.precision_scale.detach()), point, lp)

    def rsample(self, sample_shape=torch.Size()):
        shape = self._extended_shape(sample_shape)
        n = self.n
        if self._intrinsic is not None:
            B = int(math.prod(shape[:-1])) if len(shape) > 1 else 1
            eps = torch.randn(self.rank, B, dtype=torch.float64)
            z = torch.as_tensor(self._intrinsic.sample(eps.numpy()), dtype=self.loc.dtype, device=self.loc.device)
            return self.loc + z.transpose(0, 1).reshape(shape) * torch.rsqrt(self.precision_scale)
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        z = self._chol.solve_Lt(eps.reshape(-1, n).transpose(0, 1).detach())  # (n, B): z ~ N(0, Q_0^{-1})
        z = z.transpose(0, 1).reshape(shape)
        return self.loc + z * torch.rsqrt(self.precision_scale)

    def entropy(self):
        return 0.5 * self.rank * (1.0 + math.log(2 * math.pi)) - 0.5 * self.log_det_precision()

    def __repr__(self):
        return f"SparseGMRF(n={self.n}, nnz(Q)={self.precision.nnz}, dtype={self.loc.dtype})"
