"""Operator protocol: every operator's mv/rmv/squared/to_dense against dense references (float64)."""
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from pyro_convexvb.linalg import (
    BlockDiagonalOperator,
    ComposedOperator,
    DenseOperator,
    DiagonalOperator,
    EmbedColumnsOperator,
    FunctionOperator,
    IdentityOperator,
    LinearOperator,
    SparseOperator,
    StackedOperator,
    SumOperator,
    TransposedOperator,
    ZeroOperator,
    as_operator,
    sparse_matvec,
    to_csr,
)
from pyro_convexvb.linalg.operators import _csr_transpose

DT = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _sparse_dense(m, n, density, seed=0, empty_rows=(), empty_cols=()):
    g = _gen(seed)
    dense = torch.randn(m, n, generator=g, dtype=DT)
    mask = torch.rand(m, n, generator=g, dtype=DT) < density
    dense = dense * mask
    for i in empty_rows:
        dense[i] = 0
    for j in empty_cols:
        dense[:, j] = 0
    return dense


def _cases():
    g = _gen(1)
    M = torch.randn(7, 5, generator=g, dtype=DT)
    S = _sparse_dense(7, 5, 0.4, seed=2, empty_rows=(3,), empty_cols=(1,))
    d = torch.randn(5, generator=g, dtype=DT)
    d7 = torch.rand(7, generator=g, dtype=DT) + 0.5
    M2 = torch.randn(4, 5, generator=g, dtype=DT)
    M3 = torch.randn(3, 2, generator=g, dtype=DT)
    P = torch.randn(5, 6, generator=g, dtype=DT)
    cases = {
        "dense": (DenseOperator(M), M, True),
        "sparse_coo": (SparseOperator(S.to_sparse()), S, True),
        "sparse_csr": (SparseOperator(S.to_sparse_csr()), S, True),
        "sparse_csc": (SparseOperator(S.to_sparse_csc()), S, True),
        "sparse_scipy": (as_operator(sp.csr_matrix(S.numpy())), S, True),
        "diagonal": (DiagonalOperator(d), torch.diag(d), True),
        "identity": (IdentityOperator(5, dtype=DT), torch.eye(5, dtype=DT), True),
        "zero": (ZeroOperator(4, 5, dtype=DT), torch.zeros(4, 5, dtype=DT), True),
        "stacked": (StackedOperator([M, S.to_sparse_csr(), DiagonalOperator(d)]), torch.cat([M, S, torch.diag(d)]), True),
        "blockdiag": (BlockDiagonalOperator([M2, S.to_sparse(), M3]), torch.block_diag(M2, S, M3), True),
        "composed": (ComposedOperator(M, P), M @ P, False),
        "composed_diag_left": (ComposedOperator(DiagonalOperator(d7), S.to_sparse()), torch.diag(d7) @ S, True),
        "composed_diag_right": (ComposedOperator(M, DiagonalOperator(d)), M @ torch.diag(d), True),
        "sum": (SumOperator([M, S.to_sparse_csr()], [2.0, -0.5]), 2.0 * M - 0.5 * S, False),
        "transposed_dense": (TransposedOperator(DenseOperator(M)), M.T, True),
        "transposed_sparse": (SparseOperator(S.to_sparse()).T, S.T, True),
        "function": (FunctionOperator(lambda v: M @ v, lambda u: M.T @ u, (7, 5), dtype=DT), M, False),
        "function_batched": (
            FunctionOperator(lambda v: M @ v, lambda u: M.T @ u, (7, 5), dtype=DT, batched=True, squared=DenseOperator(M * M)),
            M,
            True,
        ),
        "matmul_compose": (DenseOperator(M) @ DenseOperator(P), M @ P, False),
        "embed_columns_dense": (EmbedColumnsOperator(M2, 3, 9), torch.cat([torch.zeros(4, 3, dtype=DT), M2, torch.zeros(4, 1, dtype=DT)], 1), True),
        "embed_columns_sparse": (EmbedColumnsOperator(S.to_sparse_csr(), 0, 5), S, True),
        "embed_columns_function": (
            EmbedColumnsOperator(FunctionOperator(lambda v: M3 @ v, lambda u: M3.T @ u, (3, 2), dtype=DT), 1, 4),
            torch.cat([torch.zeros(3, 1, dtype=DT), M3, torch.zeros(3, 1, dtype=DT)], 1),
            False,
        ),
    }
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_mv_rmv_to_dense(name):
    op, ref, _ = CASES[name]
    m, n = ref.shape
    assert tuple(op.shape) == (m, n)
    g = _gen(3)
    v, V = torch.randn(n, generator=g, dtype=DT), torch.randn(n, 3, generator=g, dtype=DT)
    u, U = torch.randn(m, generator=g, dtype=DT), torch.randn(m, 4, generator=g, dtype=DT)
    torch.testing.assert_close(op.mv(v), ref @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.mv(V), ref @ V, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.rmv(u), ref.T @ u, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.rmv(U), ref.T @ U, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.to_dense(), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.T.to_dense(), ref.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op @ v, ref @ v, rtol=1e-12, atol=1e-12)
    assert op.mv(v).dtype == DT


@pytest.mark.parametrize("name", sorted(CASES))
def test_squared_and_diagonals(name):
    op, ref, has_squared = CASES[name]
    sq = op.squared()
    if not has_squared:
        assert sq is None
        assert op.diag_gram() is None and op.row_sq_norms() is None
        return
    torch.testing.assert_close(sq.to_dense(), ref * ref, rtol=1e-12, atol=1e-12)
    m, n = ref.shape
    g = _gen(4)
    w_rows = torch.rand(m, generator=g, dtype=DT)
    w_cols = torch.rand(n, generator=g, dtype=DT)
    # diag(A^T diag(w) A) and diag(A diag(w) A^T) without densifying
    torch.testing.assert_close(op.diag_gram(w_rows), torch.diagonal(ref.T @ torch.diag(w_rows) @ ref), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.row_sq_norms(w_cols), torch.diagonal(ref @ torch.diag(w_cols) @ ref.T), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.diag_gram(), (ref * ref).sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.row_sq_norms(), (ref * ref).sum(1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,density", [((30, 20), 0.1), ((1, 9), 0.5), ((50, 3), 0.3), ((12, 12), 0.0)])
def test_csr_transpose(shape, density):
    S = _sparse_dense(*shape, density, seed=5, empty_rows=(0,), empty_cols=(shape[1] - 1,))
    csr = S.to_sparse_csr()
    t = _csr_transpose(csr)
    assert t.layout == torch.sparse_csr and tuple(t.shape) == (shape[1], shape[0])
    torch.testing.assert_close(t.to_dense(), S.T)
    # column indices of every row of the transpose are sorted (valid CSR)
    crow, col = t.crow_indices(), t.col_indices()
    for i in range(shape[1]):
        c = col[crow[i] : crow[i + 1]]
        assert bool((c[1:] > c[:-1]).all())
    op = SparseOperator(csr)
    torch.testing.assert_close(op.matrix_t.to_dense(), S.T)
    assert op.nnz == int((S != 0).sum())


def test_sparse_rows_subset():
    S = _sparse_dense(20, 8, 0.3, seed=6, empty_rows=(4,))
    op = SparseOperator(S.to_sparse_csr())
    idx = [4, 0, 19, 7, 7]
    sub = op.rows(idx)
    torch.testing.assert_close(sub.to_dense(), S[idx])
    u = torch.randn(5, dtype=DT)
    torch.testing.assert_close(sub.rmv(u), S[idx].T @ u)


@pytest.mark.parametrize("batched", [False, True])
def test_sparse_matvec_backward_matches_dense(batched):
    S = _sparse_dense(40, 25, 0.2, seed=7, empty_rows=(1,), empty_cols=(2,))
    op = SparseOperator(S.to_sparse())
    g = _gen(8)
    shape = (25, 3) if batched else (25,)
    v0 = torch.randn(*shape, generator=g, dtype=DT)
    w = torch.randn(40, *shape[1:], generator=g, dtype=DT)

    v = v0.clone().requires_grad_(True)
    loss = (torch.sin(op.mv(v)) * w).sum()
    (grad,) = torch.autograd.grad(loss, v)

    vd = v0.clone().requires_grad_(True)
    loss_d = (torch.sin(S @ vd) * w).sum()
    (grad_d,) = torch.autograd.grad(loss_d, vd)
    torch.testing.assert_close(loss, loss_d, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_d, rtol=1e-12, atol=1e-12)

    # rmv backward uses the forward matrix
    u = torch.randn(40, *shape[1:], generator=g, dtype=DT).requires_grad_(True)
    (gu,) = torch.autograd.grad((op.rmv(u) ** 2).sum(), u)
    ud = u.detach().clone().requires_grad_(True)
    (gud,) = torch.autograd.grad(((S.T @ ud) ** 2).sum(), ud)
    torch.testing.assert_close(gu, gud, rtol=1e-12, atol=1e-12)

    # second order: gradcheck of the custom Function
    vv = torch.randn(*shape, generator=g, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: sparse_matvec(op.matrix, op.matrix_t, x), (vv,))


def test_sparse_matvec_without_grad_is_plain_product():
    S = _sparse_dense(10, 6, 0.4, seed=9)
    op = SparseOperator(S.to_sparse())
    v = torch.randn(6, dtype=DT)
    out = sparse_matvec(op.matrix, op.matrix_t, v)
    assert not out.requires_grad
    torch.testing.assert_close(out, S @ v)


def test_dtype_follows_inputs_float32():
    M = torch.randn(6, 4, dtype=torch.float32)
    S = SparseOperator(M.to_sparse())
    assert S.dtype == torch.float32 and DenseOperator(M).dtype == torch.float32
    v = torch.randn(4, dtype=torch.float32)
    assert S.mv(v).dtype == torch.float32
    torch.testing.assert_close(S.mv(v), M @ v, rtol=1e-5, atol=1e-5)
    assert StackedOperator([M, S]).dtype == torch.float32


def test_to_csr_inputs():
    S = _sparse_dense(9, 7, 0.3, seed=10)
    for x in (S.to_sparse(), S.to_sparse_csr(), S.to_sparse_csc(), sp.csr_matrix(S.numpy()), sp.coo_matrix(S.numpy())):
        csr = to_csr(x)
        assert csr.layout == torch.sparse_csr
        torch.testing.assert_close(csr.to_dense(), S)
    # a scipy matrix with unsorted column indices is converted correctly and left untouched
    u = sp.csr_matrix((np.array([1.0, 2.0, 3.0]), np.array([2, 0, 1]), np.array([0, 2, 3])), shape=(2, 3))
    assert not u.has_sorted_indices
    torch.testing.assert_close(to_csr(u).to_dense(), torch.from_numpy(u.toarray()))
    assert list(u.indices) == [2, 0, 1]
    with pytest.raises(TypeError):
        to_csr(S)  # dense tensor
    with pytest.raises(TypeError):
        to_csr(np.zeros((2, 2)))


def test_as_operator():
    M = torch.randn(3, 2, dtype=DT)
    assert isinstance(as_operator(M), DenseOperator)
    assert isinstance(as_operator(M.to_sparse()), SparseOperator)
    op = DenseOperator(M)
    assert as_operator(op) is op
    with pytest.raises(TypeError):
        as_operator([[1.0, 2.0]])


def test_shape_errors_name_the_operator():
    op = DenseOperator(torch.randn(4, 3, dtype=DT))
    with pytest.raises(ValueError, match="DenseOperator.mv"):
        op.mv(torch.randn(4, dtype=DT))
    with pytest.raises(ValueError, match="DenseOperator.rmv"):
        op.rmv(torch.randn(3, dtype=DT))
    sop = SparseOperator(torch.randn(4, 3, dtype=DT).to_sparse())
    with pytest.raises(ValueError, match="SparseOperator.mv"):
        sop.mv(torch.randn(5, 2, dtype=DT))
    with pytest.raises(ValueError, match="columns"):
        StackedOperator([torch.randn(2, 3, dtype=DT), torch.randn(2, 4, dtype=DT)])
    with pytest.raises(ValueError):
        StackedOperator([])
    with pytest.raises(ValueError, match="compose"):
        ComposedOperator(torch.randn(2, 3, dtype=DT), torch.randn(4, 2, dtype=DT))
    with pytest.raises(ValueError, match="add"):
        SumOperator([torch.randn(2, 3, dtype=DT), torch.randn(3, 2, dtype=DT)])
    with pytest.raises(ValueError, match="2-D"):
        DenseOperator(torch.randn(3, dtype=DT))
    with pytest.raises(ValueError, match="1-D"):
        DiagonalOperator(torch.randn(3, 3, dtype=DT))
    with pytest.raises(ValueError, match="EmbedColumnsOperator"):
        EmbedColumnsOperator(torch.randn(2, 3, dtype=DT), 2, 4)


def test_function_operator_column_loop_matches_batched():
    M = torch.randn(5, 4, dtype=DT)
    calls = []

    def f(v):
        calls.append(v.shape)
        assert v.dim() == 1
        return M @ v

    op = FunctionOperator(f, lambda u: M.T @ u, (5, 4), dtype=DT)
    V = torch.randn(4, 3, dtype=DT)
    torch.testing.assert_close(op.mv(V), M @ V)
    assert calls == [(4,)] * 3
    assert op.squared() is None


def test_repr_and_base_class():
    op = DenseOperator(torch.randn(2, 2, dtype=DT))
    assert "DenseOperator" in repr(op) and "(2, 2)" in repr(op)
    assert isinstance(op, LinearOperator)


def test_sparse_operator_uses_32bit_indices_and_keeps_products():
    from pyro_convexvb.linalg.operators import compact_indices

    g = torch.Generator().manual_seed(0)
    M = torch.randn(40, 25, generator=g, dtype=torch.float64) * (torch.rand(40, 25, generator=g) < 0.2)
    op = SparseOperator(M.to_sparse_csr())
    assert op.matrix.crow_indices().dtype == torch.int32 and op.matrix_t.col_indices().dtype == torch.int32
    v, u = torch.randn(25, 3, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    torch.testing.assert_close(op.mv(v), M @ v)
    torch.testing.assert_close(op.rmv(u), M.T @ u)
    torch.testing.assert_close(op.rows([3, 0, 7]).to_dense(), M[[3, 0, 7]])
    torch.testing.assert_close(op.T.to_dense(), M.T)
    c = compact_indices(M.to_sparse_csr())
    assert compact_indices(c) is c


def test_weighted_gram_matches_dense_reference_for_every_operator_kind():
    from pyro_convexvb.linalg.operators import EmbedColumnsOperator, FunctionOperator

    g = torch.Generator().manual_seed(0)
    M = torch.randn(30, 7, dtype=torch.float64, generator=g) * (torch.rand(30, 7, generator=g) < 0.3)
    w = torch.rand(30, dtype=torch.float64, generator=g)
    ref = M.T @ (w[:, None] * M)
    ops = [DenseOperator(M), SparseOperator(M.to_sparse_csr()), SparseOperator(M.to_sparse()),
           StackedOperator([SparseOperator(M[:10].to_sparse_csr()), DenseOperator(M[10:])]),
           FunctionOperator(lambda v: M @ v, lambda u: M.T @ u, (30, 7), batched=True)]
    for op in ops:
        assert torch.allclose(op.weighted_gram(w), ref, atol=1e-13), type(op).__name__
        assert torch.allclose(op.weighted_gram(), M.T @ M, atol=1e-13), type(op).__name__
        assert torch.allclose(op.weighted_gram(torch.tensor(2.0, dtype=torch.float64)), 2 * M.T @ M, atol=1e-13)
    d = torch.rand(7, dtype=torch.float64, generator=g)
    assert torch.allclose(DiagonalOperator(d).weighted_gram(w[:7]), torch.diag(d * d * w[:7]))
    e = EmbedColumnsOperator(DenseOperator(M), 2, 12)
    E = e.to_dense()
    assert torch.allclose(e.weighted_gram(w), E.T @ (w[:, None] * E), atol=1e-13)


# ----------------------------------------------------------------------------- diagonal, flops, sqrt_factor
def _expected_flops(name, ref):
    """Flops of one product by counting: ``2 nnz`` per stored sparse entry, ``n`` per diagonal, ``2 m n`` dense."""
    m, n = ref.shape
    S = CASES["sparse_csr"][1]
    nnz_s = int((S != 0).sum())
    dense = {"dense": 2 * 35, "function": 2 * 35, "function_batched": 2 * 35, "composed": 2 * 35 + 2 * 30,
             "matmul_compose": 2 * 35 + 2 * 30, "sum": 2 * 35 + 2 * nnz_s, "transposed_dense": 2 * 35,
             "diagonal": 5, "identity": 0, "zero": 0, "stacked": 2 * 35 + 2 * nnz_s + 5,
             "blockdiag": 2 * 20 + 2 * nnz_s + 2 * 6, "composed_diag_left": 7 + 2 * nnz_s,
             "composed_diag_right": 2 * 35 + 5, "transposed_sparse": 2 * nnz_s, "embed_columns_dense": 2 * 20,
             "embed_columns_sparse": 2 * nnz_s, "embed_columns_function": 2 * 6}
    return dense.get(name, 2 * nnz_s if name.startswith("sparse") else None)


@pytest.mark.parametrize("name", sorted(CASES))
def test_flops_count_the_stored_structure(name):
    op, ref, _ = CASES[name]
    assert op.flops() == _expected_flops(name, ref)


def _spd_cases():
    g = _gen(5)
    Q = torch.randn(4, 4, generator=g, dtype=DT)
    A = Q @ Q.T + 4 * torch.eye(4, dtype=DT)
    d = torch.rand(3, generator=g, dtype=DT) + 0.5
    T = torch.diag(torch.full((5,), 2.5, dtype=DT)) - torch.diag(torch.ones(4, dtype=DT), 1) - torch.diag(torch.ones(4, dtype=DT), -1)
    return {
        "dense": (DenseOperator(A), A),
        "diagonal": (DiagonalOperator(d), torch.diag(d)),
        "identity": (IdentityOperator(3, dtype=DT), torch.eye(3, dtype=DT)),
        "sparse": (SparseOperator(T.to_sparse_csr()), T),
        "blockdiag": (BlockDiagonalOperator([DenseOperator(A), DiagonalOperator(d), SparseOperator(T.to_sparse_csr())]),
                      torch.block_diag(A, torch.diag(d), T)),
        "function": (FunctionOperator(lambda v: A @ v, lambda u: A @ u, (4, 4), dtype=DT, batched=True), A),
    }


@pytest.mark.parametrize("name", sorted(_spd_cases()))
def test_diagonal_and_sqrt_factor_against_dense(name):
    op, ref = _spd_cases()[name]
    torch.testing.assert_close(op.diagonal(dense_limit=10), torch.diagonal(ref), rtol=0, atol=1e-14)
    R = op.sqrt_factor(dense_limit=10)
    Rd = R.to_dense()
    torch.testing.assert_close(Rd.T @ Rd, ref, rtol=1e-12, atol=1e-12)
    # never densifying (dense_limit=0): a stored matrix still has its diagonal, a diagonal or sparse operator its
    # factor; an opaque product (or a block of one) has neither, and a dense block no factor
    assert (op.diagonal(dense_limit=0) is not None) == (name != "function")
    assert (op.sqrt_factor(dense_limit=0) is not None) == (name in ("diagonal", "identity", "sparse"))


def test_duplicate_entries_are_summed_before_entrywise_maps():
    """A SciPy (or unsorted torch CSR) matrix holding (i, j) twice: products were right, but squared() squared each
    stored value, a^2 + b^2 for (a + b)^2, and so did row_sq_norms, diag_gram and the Jacobi diagonals."""
    A = sp.csr_matrix((np.array([1.0, 2.0, 3.0]), np.array([0, 0, 1]), np.array([0, 2, 3])), shape=(2, 2))
    assert not A.has_canonical_format
    op = SparseOperator(A)
    assert torch.equal(op.squared().to_dense(), torch.tensor([[9.0, 0.0], [0.0, 9.0]], dtype=DT))
    assert torch.equal(op.row_sq_norms(), torch.tensor([9.0, 9.0], dtype=DT))
    assert A.data.tolist() == [1.0, 2.0, 3.0]  # the caller's matrix is left as it was


def test_gradient_reaches_the_values_of_a_sparse_design_whatever_requires_grad():
    vals = torch.tensor([1.0, 2.0, 3.0], dtype=DT, requires_grad=True)
    A = torch.sparse_csr_tensor(torch.tensor([0, 2, 3]), torch.tensor([0, 1, 1]), vals, size=(2, 2))
    v = torch.tensor([1.0, 2.0], dtype=DT, requires_grad=True)
    SparseOperator(A).mv(v).sum().backward()
    assert vals.grad is not None and vals.grad.tolist() == [1.0, 2.0, 2.0]  # d/dA_ij of sum(A v) = v_j
    assert v.grad.tolist() == [1.0, 5.0]


def test_sum_operator_refuses_mismatched_coefficients():
    eye = torch.eye(2, dtype=DT)
    with pytest.raises(ValueError, match="1 coefficients for 2 operators"):
        SumOperator([eye, 5 * eye], [3.0])
    with pytest.raises(ValueError, match="at least one operator"):
        SumOperator([])


def test_sparse_cholesky_refuses_complex_input_and_names_the_splu_limit():
    from pyro_convexvb.linalg.sparse_cholesky import SparseCholesky

    with pytest.raises(TypeError, match="complex matrix"):
        SparseCholesky(sp.csc_matrix(np.array([[2.0, 1j], [-1j, 2.0]])))
    chol = SparseCholesky(sp.csc_matrix(np.array([[2.0, 1.0], [1.0, 2.0]])))
    with pytest.raises(TypeError, match="complex right-hand side"):
        chol.solve(np.array([1.0 + 1j, 0.0]))
    # a precision R^T R whose factor has a cancelling entry: SuperLU drops it, selected inversion needs it
    Q = sp.csc_matrix(np.array([[1.0, 1.0, 1.0], [1.0, 2.0, 1.0], [1.0, 1.0, 2.0]]))
    assert np.allclose(SparseCholesky(Q).diag_inverse(), np.diag(np.linalg.inv(Q.toarray())))
    try:
        splu = SparseCholesky(Q, backend="splu")
        splu.diag_inverse()
    except RuntimeError as e:
        assert "backend='qdldl'" in str(e)


@pytest.mark.parametrize("backend", ["qdldl", "splu"])
def test_sparse_cholesky_names_singular_empty_and_non_finite_inputs(backend):
    from pyro_convexvb.errors import NotPositiveDefiniteError
    from pyro_convexvb.linalg.sparse_cholesky import SparseCholesky

    singular = sp.csc_matrix(np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 2.0]]))
    with pytest.raises(NotPositiveDefiniteError, match="Q: the matrix is"):
        SparseCholesky(singular, backend=backend)
    with pytest.raises(ValueError, match="empty"):
        SparseCholesky(sp.csc_matrix((0, 0)), backend=backend)
    chol = SparseCholesky(sp.csc_matrix(np.array([[2.0, 1.0], [1.0, 2.0]])), backend=backend)
    with pytest.raises(ValueError, match="NaN or inf"):
        chol.update_values(np.array([2.0, np.nan, 2.0]))


def test_block_diagonal_operator_needs_a_block_and_cg_a_matching_dtype():
    from pyro_convexvb.linalg import cg

    with pytest.raises(ValueError, match="at least one block"):
        BlockDiagonalOperator([])
    with pytest.raises(TypeError, match="rhs: dtype torch.float32"):
        cg(torch.eye(3, dtype=DT), torch.ones(3))


def test_squares_of_complex_entries_are_their_squared_moduli():
    """``squared()`` promises |A_ij|^2 (A * A gave -3+4j for 1+2j)."""
    A = torch.tensor([[1 + 2j, 0.5j], [0.0, -3.0]], dtype=torch.complex128)
    assert torch.equal(DenseOperator(A).squared().to_dense(), (A.abs() ** 2))
    assert torch.allclose(SparseOperator(A.to_sparse_csr()).squared().to_dense(), A.abs() ** 2)


def test_a_sum_of_embedded_blocks_has_its_squares_and_keeps_the_relaxation_bound():
    """``pcv.linear(X, w) + b`` is extracted as a sum of two embedded blocks, which had no entrywise squares: above
    the dense log-determinant limit convex_relaxation had no bound (the Hadamard bound needs them), never met its
    stopping rule and said converged=False, and diag_mixture densified the whole design for its site variances.
    The squares are exact for terms in disjoint columns (and refused for overlapping ones), and the fit gives the
    bound of the design with the intercept folded in."""
    import math

    import pyro
    import pyro.distributions as dist

    import pyro_convexvb as pcv
    from pyro_convexvb.linalg.operators import EmbedColumnsOperator, SumOperator

    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randn(7, 2, generator=g, dtype=torch.float64)
    S = SumOperator([EmbedColumnsOperator(A, 0, 6), EmbedColumnsOperator(B, 3, 6)], [2.0, -1.0])
    torch.testing.assert_close(S.squared().to_dense(), S.to_dense() ** 2, rtol=0, atol=1e-14)
    assert SumOperator([EmbedColumnsOperator(A, 0, 6), EmbedColumnsOperator(B, 2, 6)]).squared() is None
    rng = np.random.default_rng(0)
    N, P = 300, 40
    X = sp.random(N, P, density=0.2, random_state=1, format="csr") / math.sqrt(8)
    y = torch.as_tensor((rng.random(N) < 1 / (1 + np.exp(-(X @ rng.standard_normal(P))))).astype(np.float64))
    csr = lambda M: torch.sparse_csr_tensor(torch.as_tensor(M.indptr), torch.as_tensor(M.indices),  # noqa: E731
                                            torch.as_tensor(M.data), size=M.shape)
    Xt, X1 = csr(X), csr(sp.hstack([X, np.ones((N, 1))]).tocsr())

    def summed(y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(P, dtype=torch.float64), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 10.0))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Bernoulli(logits=pcv.linear(Xt, w) + b), obs=y)

    def folded(y=None):
        scale = torch.ones(P + 1, dtype=torch.float64)
        scale[-1] = 10.0
        w = pyro.sample("w", dist.Normal(torch.zeros(P + 1, dtype=torch.float64), scale).to_event(1))
        with pyro.plate("data", N):
            pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X1, w)), obs=y)

    opts = {"variance": "lanczos", "dense_logdet_max": 0}  # the rigorous bound of large designs
    a, b = (pcv.fit(m, y=y, engine="convex_relaxation", progress=False, options=opts) for m in (summed, folded))
    assert a.converged and a.info["log_det_method"] in ("hadamard", "fischer")
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, rel=1e-10)
