r"""Affine Gaussian chains: latent Gaussian sites whose mean is affine in other latent Gaussian sites.

A Pyro model that writes ``mu ~ N(m0, s0)``, ``alpha_j ~ N(mu, sigma)`` (a centred hierarchy) or
``h_t ~ N(phi h_{t-1}, s)`` (an AR(1) loop) has latent values ``x`` with

.. math:: x = A x + b + e, \qquad e \sim N(0, S) \text{ block-diagonal},

``A`` strictly block-lower-triangular in trace order (a site's mean reads only sites sampled before it,
and ``A`` has as many nonzeros as the means read). The joint prior is Gaussian with the sparse precision
``Q = (I - A)^T S^{-1} (I - A)`` and mean ``(I - A)^{-1} b`` (Rue & Held 2005, §2.1.1 for the AR(1) case;
Papaspiliopoulos et al. 2007 for centred and non-centred parametrisations). The extraction represents each
connected component of the chain (the sites linked by the entries of ``A``) in one of two exact forms, chosen
structurally by the fill-in of ``(I - A)^{-1}`` (:func:`filling_components`, :data:`FILL_FACTOR`):

* **Innovation form** (components that do not fill in: one-level hierarchies, where ``(I - A)^{-1} = I + A`` has
  the nonzeros of ``I - A``, and shallow hierarchies). The latent vector ``u`` of the
  :class:`~pyro_convexvb.LatentGaussianModel` holds ``u = (I - A) x`` (the innovation plus the constant part of
  the mean, a block-diagonal prior ``N(b, S)``) and every design becomes ``B (I - A)^{-1}``, a sparse product
  (``(I - A)^{-1} = I + A + A^2 + ...``, a finite sum since ``A`` is nilpotent). The change of variables has unit
  Jacobian, so the evidence and every Gaussian variational optimum are those of the centred model; the fitted
  posterior over ``u`` is mapped back to the model's sites by :meth:`AffineChain.to_model`.
* **Model coordinates** (components that fill in: an AR loop of ``T`` scalar sites, whose ``(I - A)^{-1}`` is
  dense lower-triangular, ``T (T + 1) / 2`` nonzeros against ``2 T - 1``). ``u`` holds the model's sites ``x``
  themselves; the run of blocks from the component's first site to its last is one prior block with the
  sparse precision ``Q`` above, the mean ``(I - A)^{-1} b`` by a sparse triangular solve and
  ``log |Q^{-1}| = log |S|`` (:func:`joint_prior`): the representation of a ``SparseGMRF`` site, which the
  engines use as they use one (``dual_vg`` takes its banded or sparse latent form). Designs stay ``B``. Every
  stored object has ``O(nnz(A) + n)`` entries, as for the same prior written as one ``SparseGMRF``
  (:func:`model_coordinate_spans`). Posteriors are over the model's sites already: no map back.

Both forms give the same evidence and posteriors (to rounding): they are the same Gaussian prior, parametrised
with unit Jacobian. Cases that keep the innovation form even where it fills in (correct, with its
``O(nnz((I - A)^{-1}))`` designs), as :func:`model_coordinate_spans` and the extraction decide:

* a component whose run of blocks holds an intrinsic ``SparseGMRF`` (``constraints=``: its ``u``-part is the
  constrained coordinates ``w`` with ``x = loc + phi(Pi w)``, and its pivot coordinates are ``dummy`` coordinates
  the model does not read), a flat block (a Laplace prior, turned into sites) or a block without an explicit
  precision;
* extractions that keep the autograd graph to the model's params (``keep_graph``: type-II gradients), whose
  prior blocks carry that graph while the joint precision is assembled in SciPy.
"""
import numpy as np
import scipy.sparse as sp
import torch

from ..errors import UnsupportedModelError
from ..linalg.operators import (
    BlockDiagonalOperator,
    ComposedOperator,
    DenseOperator,
    DiagonalOperator,
    EmbedColumnsOperator,
    SparseOperator,
    StackedOperator,
    SumOperator,
)

__all__ = ["AffineChain"]

#: largest latent dimension for which a posterior form without an exact sparse map (diagonal, low rank plus
#: diagonal, matrix-free precision) is mapped to the model's coordinates through its dense covariance
DENSE_MAP_LIMIT = 10_000


def _scipy_csr(op):
    """``op`` as a SciPy CSR matrix, or ``None`` for operators that are not explicit matrices."""
    if isinstance(op, SparseOperator):
        A = op.matrix
        return sp.csr_matrix((A.values().detach().cpu().numpy(), A.col_indices().cpu().numpy().astype(np.int64),
                              A.crow_indices().cpu().numpy().astype(np.int64)), shape=op.shape)
    if isinstance(op, DiagonalOperator):
        return sp.diags(op.diag.detach().cpu().numpy(), shape=op.shape).tocsr()
    if isinstance(op, DenseOperator):
        return sp.csr_matrix(op.matrix.detach().cpu().numpy())
    if isinstance(op, EmbedColumnsOperator):
        base = _scipy_csr(op.base)
        if base is None:
            return None
        base = base.tocoo()
        return sp.csr_matrix((base.data, (base.row, base.col + op.start)), shape=op.shape)
    if isinstance(op, SumOperator):
        parts = [_scipy_csr(o) for o in op.operators]
        if any(p is None for p in parts):
            return None
        return sum(c * p for c, p in zip(op.coefficients, parts)).tocsr()
    if isinstance(op, BlockDiagonalOperator):  # e.g. the precisions of a plate of MultivariateNormal sites
        parts = [_scipy_csr(o) for o in op.operators]
        if any(p is None for p in parts):
            return None
        return sp.block_diag(parts, format="csr")
    if isinstance(op, StackedOperator):  # e.g. a precision factor [R_Q; W^{1/2} B] of the relaxation
        parts = [_scipy_csr(o) for o in op.operators]
        if any(p is None for p in parts):
            return None
        return sp.vstack(parts, format="csr")
    if isinstance(op, ComposedOperator):
        left, right = _scipy_csr(op.left), _scipy_csr(op.right)
        if left is None or right is None:
            return None
        return (left @ right).tocsr()
    return None


def _torch_csr(m, dtype, device):
    m = sp.csr_matrix(m)
    m.sort_indices()
    return torch.sparse_csr_tensor(torch.as_tensor(m.indptr, dtype=torch.int64), torch.as_tensor(m.indices, dtype=torch.int64),
                                   torch.as_tensor(m.data, dtype=dtype), size=m.shape).to(device)


class AffineChain:
    r"""The change of variables ``u = (I - A) x`` of an affine Gaussian chain (see the module docstring).

    :param A: SciPy sparse ``(n, n)`` strictly lower-triangular matrix: row block of a child site, columns
        of the latent sites its mean reads (``loc = A x + b``).
    :param list children: names of the child sites (the sites whose mean reads other latents).
    :param dtype: dtype of the latent Gaussian model.
    :param device: its device.
    :param intrinsic: ``[(slice, factor, loc)]`` of intrinsic ``SparseGMRF`` blocks (``x = loc + phi(Pi w)``).

    Example (``mu`` then three intercepts ``alpha_j ~ N(mu, s)``)::

        >>> import scipy.sparse as sp
        >>> A = sp.csr_matrix(([1.0, 1.0, 1.0], ([1, 2, 3], [0, 0, 0])), shape=(4, 4))
        >>> chain = AffineChain(A, ["alpha"])
        >>> chain.M.toarray()[:, 0]  # x = M u: every alpha reads mu
        array([1., 1., 1., 1.])
        >>> lgm_design = chain.design(SparseOperator(torch.eye(4, dtype=torch.float64).to_sparse_csr()))
        >>> lgm_design.nnz
        7
    """

    def __init__(self, A, children, dtype=torch.float64, device=None, intrinsic=()):
        n = A.shape[0]
        A = sp.csr_matrix(A)
        A.eliminate_zeros()
        if sp.triu(A).nnz:
            raise ValueError("AffineChain: A must be strictly lower triangular (a site's mean reads earlier sites)")
        self.A, self.children, self.dtype, self.device = A, list(children), dtype, device
        self.intrinsic = list(intrinsic)
        eye = sp.identity(n, format="csr")
        # intrinsic GMRF blocks: x_b = loc_b + phi(Pi w_b) (D and c0), their u-part w_b = Pi psi(x_b - loc_b) (Dinv)
        D, Dinv, c0 = sp.lil_matrix((n, n)), sp.lil_matrix((n, n)), np.zeros(n)
        plain = np.ones(n, dtype=bool)
        self.dummy = np.zeros(n, dtype=bool)
        for sl, fac, loc in self.intrinsic:
            plain[sl] = False
            idx = np.arange(sl.start, sl.stop)
            Pi = np.eye(fac.n)
            Pi[fac.P, fac.P] = 0.0
            Phi = np.eye(fac.n) - fac.NK @ fac.C
            N = fac.C.T
            Psi = np.eye(fac.n) - N @ np.linalg.solve(N[fac.P], np.eye(fac.n)[fac.P])
            D[np.ix_(idx, idx)] = Phi @ Pi
            Dinv[np.ix_(idx, idx)] = Pi @ Psi
            c0[idx] = loc
            self.dummy[idx[fac.P]] = True
        D, Dinv = D.tocsr(), Dinv.tocsr()
        D = D + sp.diags(plain.astype(np.float64))
        Dinv = Dinv + sp.diags(plain.astype(np.float64))
        terms, term = [eye.tocoo()], eye.copy()
        for _ in range(n + 1):  # (I - A)^{-1} = sum_k A^k; A is nilpotent (strictly lower triangular)
            term = (A @ term).tocsr()
            term.eliminate_zeros()
            if term.nnz == 0:
                break
            terms.append(term.tocoo())
        # summed once (duplicates added by the conversion), not power by power: a chain of depth T (an AR loop) has
        # T powers, and adding each to the growing sum cost O(T^3)
        Minv = sp.csr_matrix((np.concatenate([t.data for t in terms]),
                              (np.concatenate([t.row for t in terms]), np.concatenate([t.col for t in terms]))),
                             shape=(n, n))  # (I - A)^{-1}
        self.M = (Minv @ D).tocsr()  # x = M u + c
        self.c = Minv @ c0
        self.T = (Dinv @ (eye - A)).tocsr()  # u = T x - t on the range of M
        self.t = Dinv @ c0

    @property
    def has_intrinsic(self):
        return bool(self.intrinsic)

    def offset(self, op, offset):
        """The offset of a design ``B`` (acting on ``x``) in ``u`` coordinates: ``offset + B c``."""
        if not self.c.any():
            return offset
        return offset + op.mv(torch.as_tensor(self.c, dtype=offset.dtype).to(offset.device))

    @property
    def n(self):
        return self.A.shape[0]

    def design(self, op):
        """The design ``B (I - A)^{-1}`` acting on ``u`` of a design ``B`` acting on ``x`` (sparse when ``B`` is)."""
        B = _scipy_csr(op)
        if B is None:
            return ComposedOperator(op, SparseOperator(_torch_csr(self.M, op.dtype, op.device)))
        out = (B @ self.M).tocsr()
        if isinstance(op, DenseOperator):
            return DenseOperator(torch.as_tensor(out.toarray(), dtype=op.dtype).to(op.device))
        return SparseOperator(_torch_csr(out, op.dtype, op.device))

    def _dense(self, m, like):
        return torch.as_tensor(m.toarray(), dtype=like.dtype).to(like.device)

    @staticmethod
    def _sparse(m, like):
        m = sp.coo_matrix(m)
        idx = torch.as_tensor(np.vstack([m.row, m.col]), dtype=torch.int64)
        return torch.sparse_coo_tensor(idx, torch.as_tensor(m.data, dtype=like.dtype), m.shape).coalesce().to(like.device)

    def _congruence(self, S, X):
        """``S X S^T`` for a SciPy sparse ``S`` and a dense symmetric ``X`` (two sparse-dense products)."""
        St = self._sparse(S, X)
        Y = torch.sparse.mm(St, X)  # S X
        Z = torch.sparse.mm(St, Y.transpose(0, 1).contiguous())  # S (S X)^T = S X S^T
        return 0.5 * (Z + Z.transpose(0, 1))

    def to_model(self, posterior, layout=None):
        """The posterior over the model's sites ``x = (I - A)^{-1} u`` of a posterior over ``u``.

        Exact for every representation: dense covariance, scale_tril and precision are mapped as matrices
        (``M C M^T``, ``M L``, ``T^T P T``); the others through their dense covariance up to
        :data:`DENSE_MAP_LIMIT` coordinates.

        :raises UnsupportedModelError: a matrix-free, low-rank or diagonal posterior above the limit.
        """
        from ..posterior.gaussian import GaussianPosterior

        kind = posterior.kind
        loc = posterior.loc
        mean = torch.as_tensor(self.M @ loc.detach().cpu().numpy() + self.c, dtype=loc.dtype).to(loc.device)
        layout = posterior.layout if layout is None else layout
        if self.has_intrinsic and kind in ("precision", "scale_tril"):
            kind = "covariance"  # M is singular on an intrinsic block: the posterior over its field is degenerate
        sparse = None
        if kind == "precision_operator" and not self.has_intrinsic and posterior.precision_factor is not None:
            sparse = self._sparse_precision_to_model(posterior, mean, layout)
        if sparse is not None:
            out = sparse
        elif kind == "precision":
            out = GaussianPosterior(mean, precision=self._congruence(self.T.T, posterior._precision), layout=layout)
        elif kind == "scale_tril":
            out = GaussianPosterior(mean, scale_tril=self._dense(self.M, loc) @ posterior._scale_tril, layout=layout)
        elif posterior.n <= DENSE_MAP_LIMIT and kind != "low_rank":
            out = GaussianPosterior(mean, covariance=self._congruence(self.M, posterior.covariance(force=True)),
                                    layout=layout)
        else:
            raise UnsupportedModelError(
                self.children[0], f"a {kind} posterior over {posterior.n} coordinates cannot be mapped exactly from "
                                  "the chain's innovations to its sites (affine Gaussian chain); fit with an engine "
                                  "whose posterior is a dense covariance or precision, or write the model non-centred")
        out.coordinates = "model"
        return out

    def _sparse_precision_to_model(self, posterior, mean, layout):
        """A sparse-precision posterior over ``u`` mapped to ``x = (I - A)^{-1} u`` without densifying: precision
        ``T^T P T`` and factor ``J T`` (``T = I - A``), marginal variances by selected inversion of ``T^T P T``
        (times the posterior's ``precision_scale``). A matrix-free ``P`` with an explicit factor ``J`` (stacked,
        composed, diagonal and sparse parts: ``convex_relaxation``'s ``[R_Q; Gamma^{-1/2} B]``) is ``J^T J``.
        ``None`` when the factor is matrix-free."""
        from ..linalg.sparse_cholesky import SparseCholesky
        from ..posterior.gaussian import GaussianPosterior

        J = _scipy_csr(posterior.precision_factor)
        if J is None:  # a matrix-free factor: mapped through the dense covariance (or refused)
            return None
        P = _scipy_csr(posterior.precision_operator)
        if P is None:  # a matrix-free precision (the relaxation's A v) with an explicit factor: A = J^T J
            P = (J.T @ J).tocsr()
        Px = (self.T.T @ P @ self.T).tocsr()
        Px = 0.5 * (Px + Px.T)
        Jx = (J @ self.T).tocsr()
        scale = posterior.precision_scale  # the covariance is scale * A^{-1}
        var = scale * SparseCholesky(Px.tocsc(), name="posterior precision over the chain's sites").diag_inverse()
        like = posterior.loc
        return GaussianPosterior(mean, torch.as_tensor(var, dtype=like.dtype).to(like.device),
                                 precision_operator=SparseOperator(_torch_csr(Px, like.dtype, like.device)),
                                 precision_factor=SparseOperator(_torch_csr(Jx, like.dtype, like.device)),
                                 precision_scale=scale, layout=layout)

    def latent_moments(self, loc, cov=None, *, variance=None):
        """Mean ``(n,)`` and dense covariance ``(n, n)`` over ``u = T x - t`` of a Gaussian over the model's sites
        ``x`` given by ``loc`` and ``cov`` ``(n, n)`` or ``variance`` ``(n,)``: differentiable in both (dense ``T``,
        for the small models whose evidence bound is evaluated densely), as :meth:`to_latent` maps a posterior.
        """
        T = self.__dict__.get("_T_dense")
        if T is None or T.dtype != loc.dtype or T.device != loc.device:
            T = self.__dict__["_T_dense"] = self._dense(self.T, loc)
        mean = T @ loc - torch.as_tensor(self.t, dtype=loc.dtype).to(loc.device)
        C = (T * variance) @ T.transpose(0, 1) if variance is not None else T @ cov @ T.transpose(0, 1)
        C = 0.5 * (C + C.transpose(0, 1))
        if self.dummy.any():  # the pivot coordinates of intrinsic blocks: not read by the model, N(0, 1)
            C = C + torch.diag(torch.as_tensor(self.dummy, device=C.device).to(C.dtype))
        return mean, C

    def to_latent(self, posterior, layout=None):
        """The inverse of :meth:`to_model`: a posterior over the model's sites as one over ``u = (I - A) x``."""
        from ..posterior.gaussian import GaussianPosterior

        loc = posterior.loc
        mean = torch.as_tensor(self.T @ loc.detach().cpu().numpy() - self.t, dtype=loc.dtype).to(loc.device)
        C = self._congruence(self.T, posterior.covariance(force=True))
        if self.dummy.any():  # the pivot coordinates of intrinsic blocks: not read by the model, N(0, 1)
            d = torch.as_tensor(self.dummy, device=C.device)
            C = C + torch.diag(d.to(C.dtype))
        return GaussianPosterior(mean, covariance=C, layout=posterior.layout if layout is None else layout)


#: the innovation form ``u = (I - A) x`` is kept for a component of the chain while ``(I - A)^{-1}`` has at most this
#: many times the structural nonzeros of ``I - A`` there (a one-level hierarchy has exactly as many, a hierarchy of
#: depth ``d`` fewer than ``d`` times as many); a component above it (an AR loop of ``T`` steps: ``T (T + 1) / 2``
#: against ``2 T - 1``) is extracted in the model's coordinates with its joint sparse precision
#: (:func:`model_coordinate_spans`, :func:`joint_prior`)
FILL_FACTOR = 4


def _block_components(A, starts):
    """``(block component (nb,), coordinate component (n,), ncomp)`` of the graph whose nodes are the layout's blocks
    (``starts``: ``(nb + 1,)`` block boundaries) and whose edges are the entries of ``A``."""
    from scipy.sparse.csgraph import connected_components

    n, nb = A.shape[0], len(starts) - 1
    block_of = np.repeat(np.arange(nb), np.diff(starts))
    coo = A.tocoo()
    G = sp.coo_matrix((np.ones(coo.nnz), (block_of[coo.row], block_of[coo.col])), shape=(nb, nb))
    ncomp, comp = connected_components(G, directed=False)
    return comp, comp[block_of] if n else np.zeros(0, np.int64), ncomp


def filling_components(A, coord_comp, ncomp, factor=None):
    """Boolean ``(ncomp,)``: the components whose ``(I - A)^{-1}`` has more than ``factor`` (default
    :data:`FILL_FACTOR`) times the structural nonzeros of ``I - A`` on their rows.

    Structural: the pattern of ``(I - A)^{-1} = I + A + A^2 + ...`` (``A`` nilpotent) is the union of the patterns
    of ``|A|^k`` (a path of length ``k`` in the graph of the means), accumulated power by power and per component
    until the component passes its budget; a component that does is dropped from the next powers, so the count
    never stores more than ``factor`` times ``nnz(I - A)`` entries (no ``T^2`` object for an AR loop of ``T``
    steps).

    :param A: SciPy sparse ``(n, n)`` strictly lower-triangular.
    :param coord_comp: ``(n,)`` component of each coordinate (rows and columns of an entry share it).
    :returns: boolean ``(ncomp,)``.
    """
    factor = FILL_FACTOR if factor is None else factor
    n = A.shape[0]
    absA = abs(sp.csr_matrix(A))
    absA.eliminate_zeros()
    base = np.bincount(coord_comp, minlength=ncomp) + np.bincount(coord_comp[absA.tocoo().row], minlength=ncomp)
    budget = factor * base
    over = np.zeros(ncomp, dtype=bool)
    pattern = sp.identity(n, format="csr")
    term = pattern.copy()
    for _ in range(n + 1):
        term = (absA @ term).tocsr()
        term.eliminate_zeros()
        if term.nnz == 0:
            break
        pattern = (pattern + term).tocsr()
        counts = np.bincount(coord_comp[pattern.tocoo().row], minlength=ncomp)
        new = (counts > budget) & ~over
        if new.any():
            over |= new
            keep = sp.diags((~over[coord_comp]).astype(np.float64))
            term, pattern = (keep @ term).tocsr(), (keep @ pattern).tocsr()
            term.eliminate_zeros()
            pattern.eliminate_zeros()
    return over


def model_coordinate_spans(A, starts, excluded, factor=None):
    """The runs of layout blocks ``[(first, stop)]`` whose chain is extracted in the model's coordinates ``x``.

    The components of the chain (blocks linked by the entries of ``A``) that fill in
    (:func:`filling_components`) are taken with every block between their first and last block: a run must be
    contiguous in ``u`` to be one prior block. A component of the chain inside a run joins it (the model
    coordinates are exact for any chain; a one-level hierarchy alone keeps the innovation form). A run holding an
    ``excluded`` block (a flat block, whose prior is sites; an intrinsic GMRF, whose ``u``-part is its constrained
    coordinates; a prior without an explicit precision) keeps the innovation form for its components.

    :param A: SciPy sparse ``(n, n)`` strictly lower-triangular.
    :param starts: ``(nb + 1,)`` block boundaries in ``u``.
    :param excluded: boolean ``(nb,)``, blocks that cannot be part of a joint prior block.
    :returns: ``list`` of ``(first block, stop block)``, in order, disjoint.
    """
    starts = np.asarray(starts)
    comp, coord_comp, ncomp = _block_components(A, starts)
    fill = filling_components(A, coord_comp, ncomp, factor)
    if not fill.any():
        return []
    in_chain = np.zeros(ncomp, dtype=bool)
    in_chain[coord_comp[A.tocoo().row]] = True
    first = np.full(ncomp, len(comp))
    last = np.full(ncomp, -1)
    np.minimum.at(first, comp, np.arange(len(comp)))
    np.maximum.at(last, comp, np.arange(len(comp)))
    banned = np.zeros(ncomp, dtype=bool)
    while True:
        chosen = fill & ~banned
        while True:
            spans = _merged_runs([(first[c], last[c] + 1) for c in np.flatnonzero(chosen)])
            inside = np.zeros(ncomp, dtype=bool)
            for a, b in spans:
                inside[comp[a:b]] = True
            grow = inside & in_chain & ~chosen
            if not grow.any():
                break
            chosen |= grow
        bad = [(a, b) for a, b in spans if excluded[a:b].any()]
        if not bad:
            return spans
        for a, b in bad:
            banned[comp[a:b]] = True


def joins_a_joint_prior(prior):
    """Whether a :class:`~pyro_convexvb.lgm.model.PriorBlock` can be part of a :func:`joint_prior`: Gaussian, with an
    explicit precision (diagonal, sparse, dense, or block-diagonal of those) and its ``log |Sigma|``."""
    def explicit(op):
        if isinstance(op, BlockDiagonalOperator):
            return all(explicit(o) for o in op.operators)
        return isinstance(op, (DiagonalOperator, SparseOperator, DenseOperator))

    return not prior.flat and prior.prec is not None and prior.logdet_cov is not None and explicit(prior.prec)


def _merged_runs(runs):
    """Overlapping half-open runs ``[(a, b)]`` merged, in order."""
    out = []
    for a, b in sorted(runs):
        if out and a < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def joint_prior(A, priors, start, name, dtype, device):
    r"""The joint Gaussian prior, over the model's coordinates ``x``, of a run of blocks of an affine Gaussian chain:
    the representation of a ``SparseGMRF`` site (a :class:`~pyro_convexvb.lgm.model.PriorBlock` with a sparse
    precision and ``log |Sigma|``).

    With ``v = (I - A) x ~ N(b, P^{-1})`` (``b`` and ``P`` the blocks' means and precisions: the constant part and
    the innovation precision of a child, the prior of a root), ``x`` has precision
    ``Q = (I - A)^T P (I - A)``, mean ``(I - A)^{-1} b`` (a sparse triangular solve) and, since
    ``det(I - A) = 1``, ``log |Q^{-1}| = log |P^{-1}|`` (Rue & Held 2005, §2.1.1 and §2.3).

    :param A: SciPy sparse ``(n, n)``; the rows of the run read only columns of the run.
    :param list priors: the :class:`~pyro_convexvb.lgm.model.PriorBlock` of each block of the run (each with an
        explicit precision and ``logdet_cov``).
    :param int start: the run's first coordinate in ``u``.
    :param str name: the prior block's name.
    :returns: a :class:`~pyro_convexvb.lgm.model.PriorBlock` of size ``sum(p.size for p in priors)``.
    """
    from scipy.sparse.linalg import spsolve_triangular

    from .model import PriorBlock

    m = sum(p.size for p in priors)
    rows = sp.csr_matrix(A)[start:start + m]
    if rows[:, :start].nnz or rows[:, start + m:].nnz:
        raise ValueError(f"joint_prior: the rows of '{name}' read latents outside it")
    Ts = (sp.identity(m, format="csr") - rows[:, start:start + m]).tocsr()
    if all(type(p.prec) is DiagonalOperator for p in priors):  # scalar or Normal sites (an AR loop): one diagonal
        P = sp.diags(np.concatenate([p.prec.diag.detach().cpu().numpy().reshape(-1) for p in priors])).tocsr()
    else:
        P = sp.block_diag([_scipy_csr(p.prec) for p in priors], format="csr")
    b = np.concatenate([p.loc.detach().cpu().double().numpy() for p in priors])
    Q = (Ts.T @ P @ Ts).tocsr()
    Q = (0.5 * (Q + Q.T)).tocsr()
    Q.eliminate_zeros()
    mean = spsolve_triangular(Ts, b, lower=True) if Ts.nnz > m else b
    logdet = float(sum(p.logdet_cov for p in priors))
    return PriorBlock(name, torch.as_tensor(mean, dtype=dtype).to(device),
                      prec=SparseOperator(_torch_csr(Q, dtype, device)), logdet_cov=logdet)


#: largest block of latents that :func:`probe_sparse_jacobian` probes one coordinate at a time (larger blocks are
#: probed as "one nonzero per row", the structure of gathers ``x[g]``, broadcasts and lags, with four products)
PROBE_COLUMNS = 64
#: products per vectorised batch of :func:`probe_sparse_jacobian` (memory: this many latent-sized vectors)
PROBE_BATCH = 256


def probe_sparse_jacobian(jvp, slices, q, n, dtype, device=None, jvp_many=None):
    r"""The sparse Jacobian ``(rows, cols, vals)`` of a linear map ``v -> J v`` (``q x n``) restricted to the column
    ``slices``, from a few products, or ``None`` when its structure is not one this probing recovers exactly.

    Over 80 lines: most of it is this docstring; the body is under 80.

    Per block of columns: a random product tells whether the map reads the block at all; a block of at most
    :data:`PROBE_COLUMNS` coordinates is probed column by column; a larger one is decoded as *one nonzero per
    row* (a gather ``x[g]``, a broadcast ``mu.expand(J)``, a lag ``h[t - 1]``): with ``c = J 1`` and
    ``s = J (1, 2, ..., size)`` the row ``i`` has its nonzero ``c_i`` in column ``s_i / c_i - 1``, and two random
    products must equal ``c_i v_{j_i}`` exactly (a row with two nonzeros, even cancelling ones, fails this
    check and the whole probe returns ``None``, so the caller falls back to one product per coordinate). This
    is a column compression of the Jacobian (Curtis, Powell & Reid 1974) whose coloring is read off the
    products themselves. Each nonzero is one product term, so the values equal those of per-coordinate
    products exactly.

    :param jvp: ``v (n,) -> J v (q,)`` (torch tensors).
    :param slices: column slices of the blocks to probe.
    :param jvp_many: optional ``V (B, n) -> J V^T`` as ``(B, q)``: the products of each round (one per block, then
        one per column of the small blocks, then three per large block) in batches, e.g. one vectorised backward
        pass (:meth:`~pyro_convexvb.lgm.extract._AutogradJacobian.jvp_many`) instead of one per product.
    :returns: ``(rows, cols, vals)`` NumPy arrays (int64, int64, float64), or ``None``.
    """
    gen = torch.Generator().manual_seed(3)
    rows, cols, vals = [], [], []
    tol = 64 * torch.finfo(dtype).eps  # a product of a few factors, rounded in another order

    step = PROBE_BATCH if jvp_many is not None else 1

    def products(pairs):
        """``J v`` for each ``(slice, block vector)`` of ``pairs`` (``v`` zero off the slice): ``(len, q)``, CPU."""
        out = []
        for a in range(0, len(pairs), step):
            chunk = pairs[a:a + step]
            V = torch.zeros(len(chunk), n, dtype=dtype, device=device)
            for k, (sl, vb) in enumerate(chunk):
                V[k, sl] = vb.to(device=device, dtype=dtype)
            got = jvp_many(V) if jvp_many is not None else jvp(V[0]).reshape(1, -1)
            out.append(got.detach().reshape(len(chunk), -1).cpu())
        return torch.cat(out) if out else torch.zeros(0, q, dtype=dtype)

    def add_column(col, j):
        """The nonzeros of the Jacobian's column ``j``."""
        nz = torch.nonzero(col).reshape(-1)
        rows.append(nz)
        cols.append(torch.full((nz.numel(),), j, dtype=torch.long))
        vals.append(col[nz])

    # a one-coordinate block's first product, with weight 1, is its column: it is not probed again
    r1s = [torch.rand(sl.stop - sl.start, generator=gen, dtype=dtype) + 0.5 if sl.stop - sl.start > 1
           else torch.ones(1, dtype=dtype) for sl in slices]
    y1s = products(list(zip(slices, r1s)))
    if not bool(torch.isfinite(y1s).all()):
        return None
    read = [k for k in range(len(slices)) if bool((y1s[k] != 0).any())]
    for k in read:
        if slices[k].stop - slices[k].start == 1:
            add_column(y1s[k], slices[k].start)
    read = [k for k in read if slices[k].stop - slices[k].start > 1]
    small = [k for k in read if slices[k].stop - slices[k].start <= PROBE_COLUMNS]
    large = [k for k in read if slices[k].stop - slices[k].start > PROBE_COLUMNS]
    unit = [(slices[k], j) for k in small for j in range(slices[k].stop - slices[k].start)]
    cols_out = products([(sl, torch.nn.functional.one_hot(torch.tensor(j), sl.stop - sl.start).to(dtype))
                         for sl, j in unit])
    for (sl, j), col in zip(unit, cols_out):
        add_column(col, sl.start + j)
    checks = [torch.randn(slices[k].stop - slices[k].start, generator=gen, dtype=dtype) for k in large]
    pairs = []
    for k, v in zip(large, checks):
        size = slices[k].stop - slices[k].start
        pairs += [(slices[k], torch.ones(size, dtype=dtype)), (slices[k], torch.arange(1, size + 1, dtype=dtype)),
                  (slices[k], v)]
    outs = products(pairs)
    for i, (k, v2) in enumerate(zip(large, checks)):
        sl, size = slices[k], slices[k].stop - slices[k].start
        c, s_, y2 = outs[3 * i], outs[3 * i + 1], outs[3 * i + 2]
        has = c != 0
        ratio = torch.where(has, s_ / torch.where(has, c, torch.ones_like(c)), torch.ones_like(c))
        idx = ratio.round()
        if not bool(((idx >= 1) & (idx <= size) & ((ratio - idx).abs() <= 0.25)).all()):
            return None
        idx = idx.long() - 1
        for v, y in ((r1s[k], y1s[k]), (v2, y2)):
            pred = torch.where(has, c * v[idx], torch.zeros_like(c))
            if not bool(((y - pred).abs() <= tol * (y.abs() + pred.abs())).all()):
                return None
        nz = torch.nonzero(has).reshape(-1)
        rows.append(nz)
        cols.append(sl.start + idx[nz])
        vals.append(c[nz])
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    return (torch.cat(rows).numpy().astype(np.int64), torch.cat(cols).numpy().astype(np.int64),
            torch.cat(vals).to(torch.float64).numpy())


#: moduli ``K`` tried in turn by :func:`probe_by_residues` (a row may read at most one coordinate of each residue
#: class ``j mod K``: ``K = 1`` one coordinate per row, ``K = 2`` two neighbours, ``K = 8`` a window of eight)
PROBE_MODULI = (1, 2, 4, 8)


def probe_by_residues(jvp, q, n, dtype, device=None, moduli=PROBE_MODULI):
    r"""The sparse Jacobian ``(rows, cols, vals)`` of a linear map ``v -> J v`` (``q x n``) from ``O(K)`` products,
    whatever the latent blocks, when every row reads at most one coordinate of each residue class ``j mod K`` for
    some ``K`` of ``moduli`` (its nonzeros lie within ``K`` consecutive coordinates: the one parent of an AR(1) mean or
    of a hierarchy's intercept, ``h_{t-1}`` and ``h_{t-2}`` of an AR(2) mean, a predictor ``x_t`` read from a loop of
    ``T`` scalar sites); else ``None``.

    For each ``K`` in turn, the coordinates are permuted so that each residue class is contiguous and the map is
    probed by :func:`probe_sparse_jacobian` with one column block per class: a class of more than
    :data:`PROBE_COLUMNS` coordinates is decoded as one nonzero per row with its exact checks, which reject the
    grouping when a row reads two coordinates of one class (then the next ``K`` is tried). This is the column
    compression of Curtis, Powell & Reid (1974) with the coloring ``j mod K``, which is valid for banded rows; it
    costs ``4 K`` products per ``K`` tried (one per class that tells whether the map reads it, three to decode it),
    against one per latent block for per-block probing, and gives the same values (each nonzero is one product
    term). Moduli whose classes would have :data:`PROBE_COLUMNS`
    coordinates or fewer are skipped, but ``K = 1``, which is then probed coordinate by coordinate (exact for any
    structure).

    :param jvp: ``v (n,) -> J v (q,)`` (torch tensors).
    :param moduli: the ``K`` to try, in order.
    :returns: ``(rows, cols, vals)`` NumPy arrays (int64, int64, float64), or ``None``.
    """
    for K in moduli:
        if K > 1 and n // K <= PROBE_COLUMNS:
            break
        perm = torch.cat([torch.arange(r, n, K, device=device) for r in range(K)])
        bounds = np.cumsum([0] + [len(range(r, n, K)) for r in range(K)])
        slices = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

        def permuted(v, perm=perm):
            w = torch.zeros_like(v)
            w[perm] = v  # v's k-th entry is coordinate perm[k]
            return jvp(w)

        got = probe_sparse_jacobian(permuted if K > 1 else jvp, slices, q, n, dtype, device)
        if got is not None:
            r, c, v = got
            return r, (perm.cpu().numpy()[c] if K > 1 else c), v
    return None


def chain_jacobian(name, loc, u0, parents, dtype):
    """Sparse rows ``(rows, cols, vals)`` of ``d loc / d u`` restricted to the ``parents`` slices of ``u``.

    By :func:`probe_sparse_jacobian` (a few products per parent block); when the structure is not one it
    recovers, by one product per coordinate (:func:`chain_jacobian_by_coordinates`).
    """
    q = loc.shape[0]
    if parents:
        w = torch.zeros_like(loc, requires_grad=True)
        g = torch.autograd.grad((loc * w).sum(), u0, create_graph=True, allow_unused=True)[0]
        if g is not None and g.requires_grad:
            def jvp(v):
                out = torch.autograd.grad((g * v).sum(), w, retain_graph=True, allow_unused=True)[0]
                return torch.zeros_like(loc) if out is None else out

            got = probe_sparse_jacobian(jvp, parents, q, u0.shape[0], loc.dtype, loc.device)
            if got is not None:
                if not np.isfinite(got[2]).all():
                    raise UnsupportedModelError(name, "the mean of the latent site is not finite in the latents it reads")
                return got
    return chain_jacobian_by_coordinates(name, loc, u0, parents, dtype)


def chain_jacobian_by_coordinates(name, loc, u0, parents, dtype):
    """:func:`chain_jacobian` by one autograd product per coordinate: forward products over the parents'
    coordinates when they are fewer than the rows, else backward products over the rows (the reference the
    probing is tested against)."""
    q = loc.shape[0]
    cols_all = torch.cat([torch.arange(s.start, s.stop) for s in parents]) if parents else torch.zeros(0, dtype=torch.long)
    rows, cols, vals = [], [], []
    if cols_all.numel() <= q:
        w = torch.zeros_like(loc, requires_grad=True)
        g = torch.autograd.grad((loc * w).sum(), u0, create_graph=True, allow_unused=True)[0]
        for j in cols_all.tolist():
            col = torch.autograd.grad(g[j], w, retain_graph=True, allow_unused=True)[0] if g is not None \
                and g.requires_grad else None
            if col is None:
                continue
            col = col.detach()
            nz = torch.nonzero(col).reshape(-1)
            rows.append(nz.cpu())
            cols.append(torch.full((nz.numel(),), j, dtype=torch.long))
            vals.append(col[nz].cpu())
    else:
        for i in range(q):
            r = torch.autograd.grad(loc[i], u0, retain_graph=True, allow_unused=True)[0]
            if r is None:
                continue
            r = r.detach()[cols_all.to(r.device)]
            nz = torch.nonzero(r).reshape(-1)
            rows.append(torch.full((nz.numel(),), i, dtype=torch.long))
            cols.append(cols_all[nz.cpu()])
            vals.append(r[nz].cpu())
    if not rows:
        return (np.zeros(0, np.int64),) * 2 + (np.zeros(0),)
    r, c, v = torch.cat(rows), torch.cat(cols), torch.cat(vals)
    if not bool(torch.isfinite(v).all()):
        raise UnsupportedModelError(name, "the mean of the latent site is not finite in the latents it reads")
    return r.numpy(), c.numpy(), v.to(torch.float64).numpy()
