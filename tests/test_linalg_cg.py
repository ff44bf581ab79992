"""Preconditioned CG against torch.linalg.solve (float64)."""
import warnings

import pytest
import torch

from pyro_convexvb.errors import ConvergenceError, ConvergenceWarning
from pyro_convexvb.linalg import (
    DenseOperator,
    NotPositiveDefiniteError,
    SparseOperator,
    cg,
    default_max_iter,
)

DT = torch.float64


def _spd(n, cond, seed=0):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    ev = torch.logspace(0, torch.log10(torch.tensor(float(cond))).item(), n, dtype=DT)
    return (U * ev) @ U.T


def _sparse_spd(side=20, seed=0, scale_range=0.0):
    """2-D grid Laplacian + 0.01 I (n = side^2), optionally with a badly scaled diagonal D A D."""
    n = side * side
    idx = torch.arange(n).reshape(side, side)
    rows, cols = [idx.flatten()], [idx.flatten()]
    vals = [torch.full((n,), 4.01, dtype=DT)]
    for a, b in ((idx[:, :-1], idx[:, 1:]), (idx[:-1, :], idx[1:, :])):
        rows += [a.flatten(), b.flatten()]
        cols += [b.flatten(), a.flatten()]
        vals += [torch.full((a.numel(),), -1.0, dtype=DT)] * 2
    index = torch.stack([torch.cat(rows), torch.cat(cols)])
    A = torch.sparse_coo_tensor(index, torch.cat(vals), (n, n), check_invariants=False).coalesce()
    if scale_range:
        g = torch.Generator().manual_seed(seed)
        d = 10 ** (scale_range * torch.rand(n, generator=g, dtype=DT))
        i, j = A.indices()
        A = torch.sparse_coo_tensor(A.indices(), A.values() * d[i] * d[j], (n, n), check_invariants=False).coalesce()
    return A


def _rel_res(A, x, b):
    return torch.linalg.vector_norm(b - A @ x, dim=0) / torch.linalg.vector_norm(b, dim=0)


@pytest.mark.parametrize("cond", [1e2, 1e4, 1e6])
def test_dense_matches_solve(cond):
    n = 60
    A = _spd(n, cond, seed=1)
    b = torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=DT)
    res = cg(A, b, rtol=1e-10)
    assert res.converged
    x_ref = torch.linalg.solve(A, b)
    # forward error <= cond * backward error
    err = torch.linalg.vector_norm(res.x - x_ref) / torch.linalg.vector_norm(x_ref)
    assert err <= cond * 1e-10 * 10
    assert float(res.residual_norm) <= 1e-10
    torch.testing.assert_close(res.residual_norm, _rel_res(A, res.x, b), rtol=1e-6, atol=1e-18)
    assert res.residual_norm.dim() == 0
    assert len(res.residual_history) == res.iterations + 1
    assert res.residual_history[-1] == pytest.approx(float(res.residual_norm))
    # one product per iteration plus one true-residual check per (re)start
    assert 1 <= res.num_mvm - res.iterations <= 6
    if cond <= 1e4:
        assert res.num_mvm == res.iterations + 1


@pytest.mark.parametrize("form", ["csr_tensor", "coo_tensor", "operator", "callable"])
def test_sparse_matches_solve(form):
    A = _sparse_spd(side=20)
    Ad = A.to_dense()
    b = torch.randn(A.shape[0], generator=torch.Generator().manual_seed(3), dtype=DT)
    if form == "csr_tensor":
        mat = A.to_sparse_csr()
    elif form == "coo_tensor":
        mat = A
    elif form == "operator":
        mat = SparseOperator(A)
    else:
        op = SparseOperator(A)
        mat = lambda v: op.mv(v)  # noqa: E731
    res = cg(mat, b, rtol=1e-11)
    assert res.converged
    torch.testing.assert_close(res.x, torch.linalg.solve(Ad, b), rtol=1e-8, atol=1e-8)
    assert float(_rel_res(Ad, res.x, b)) <= 1e-11


def test_jacobi_preconditioning_helps_ill_conditioned_sparse():
    A = _sparse_spd(side=16, scale_range=3.0, seed=4)  # D L D with D over 3 decades
    Ad = A.to_dense()
    cond = torch.linalg.cond(Ad).item()
    assert cond > 1e6
    op = SparseOperator(A)
    b = torch.randn(A.shape[0], generator=torch.Generator().manual_seed(5), dtype=DT)
    x_ref = torch.linalg.solve(Ad, b)
    plain = cg(op, b, rtol=1e-10, on_fail="ignore")
    jac = cg(op, b, rtol=1e-10, precond=torch.diagonal(Ad).clone())
    assert jac.converged
    assert jac.iterations < 0.25 * plain.iterations
    torch.testing.assert_close(jac.x, x_ref, rtol=1e-5, atol=1e-9 * x_ref.abs().max().item())
    # a callable preconditioner gives the same iterates as the Jacobi tensor
    d = torch.diagonal(Ad).clone()
    jac_c = cg(op, b, rtol=1e-10, precond=lambda r: r / d.unsqueeze(-1))
    assert jac_c.iterations == jac.iterations
    torch.testing.assert_close(jac_c.x, jac.x, rtol=1e-10, atol=1e-14)


def test_batched_columns_converge_independently():
    n = 50
    A = _spd(n, 1e3, seed=6)
    g = torch.Generator().manual_seed(7)
    evals, evecs = torch.linalg.eigh(A)
    B = torch.stack(
        [
            torch.randn(n, generator=g, dtype=DT),
            1e-8 * torch.randn(n, generator=g, dtype=DT),  # tiny scale: relative tolerance
            torch.zeros(n, dtype=DT),  # zero column
            evecs[:, 3],  # eigenvector: one iteration
            1e5 * torch.randn(n, generator=g, dtype=DT),
        ],
        1,
    )
    res = cg(A, B, rtol=1e-10)
    assert res.converged
    assert res.x.shape == B.shape and res.residual_norm.shape == (5,)
    x_ref = torch.linalg.solve(A, B)
    for j in range(5):
        scale = max(float(x_ref[:, j].abs().max()), 1e-300)
        torch.testing.assert_close(res.x[:, j], x_ref[:, j], rtol=1e-6, atol=1e-6 * scale)
    assert torch.equal(res.x[:, 2], torch.zeros(n, dtype=DT))
    rr = _rel_res(A, res.x, B)
    assert bool((rr[[0, 1, 3, 4]] <= 1e-10).all())
    # each column matches a separate 1-D solve
    for j in (0, 1, 4):
        single = cg(A, B[:, j], rtol=1e-10)
        torch.testing.assert_close(res.x[:, j], single.x, rtol=1e-9, atol=0.0)
    # converged columns stop consuming products: fewer than iterations * columns
    assert res.num_mvm < res.iterations * 5


def test_warm_start_reduces_iterations():
    A = _sparse_spd(side=20)
    op = SparseOperator(A)
    g = torch.Generator().manual_seed(8)
    b = torch.randn(A.shape[0], generator=g, dtype=DT)
    cold = cg(op, b, rtol=1e-10)
    b2 = b + 1e-6 * torch.randn(A.shape[0], generator=g, dtype=DT)
    cold2 = cg(op, b2, rtol=1e-10)
    warm2 = cg(op, b2, rtol=1e-10, x0=cold.x)
    assert warm2.converged
    assert warm2.iterations < 0.7 * cold2.iterations
    x_ref = torch.linalg.solve(A.to_dense(), b2)  # cond(A) ~ 800: forward error <= 800 * 1e-10
    torch.testing.assert_close(warm2.x, x_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(cold2.x, x_ref, rtol=1e-6, atol=1e-7)
    # exact warm start: no iteration at all, one product for the initial residual
    exact = cg(op, b, rtol=1e-6, x0=cold.x)
    assert exact.iterations == 0 and exact.num_mvm == 1 and exact.converged


def test_zero_rhs_column_with_a_warm_start_is_exactly_zero():
    """A x = 0 is solved by x = 0 whatever the warm start: the column's relative residual has no scale, so the warm
    start is dropped there (it used to iterate to max_iter and warn), the other columns keep theirs."""
    A = _spd(30, 1e2, seed=4)
    b = torch.stack([torch.zeros(30, dtype=DT), torch.ones(30, dtype=DT)], dim=1)
    x0 = torch.ones(30, 2, dtype=DT)
    res = cg(A, b, rtol=1e-10, x0=x0, on_fail="raise")
    assert res.converged and float(res.x[:, 0].abs().max()) == 0.0
    torch.testing.assert_close(res.x[:, 1], torch.linalg.solve(A, b[:, 1]), rtol=1e-7, atol=1e-9)
    vec = cg(A, b[:, 0], x0=x0[:, 0], on_fail="raise")
    assert vec.converged and vec.iterations == 0 and float(vec.x.abs().max()) == 0.0


def test_nonconvergence_warns_raises_or_ignores():
    A = _spd(40, 1e4, seed=9)
    b = torch.randn(40, generator=torch.Generator().manual_seed(10), dtype=DT)
    with pytest.warns(ConvergenceWarning, match="relative residual"):
        res = cg(A, b, rtol=1e-12, max_iter=3)
    assert not res.converged and res.iterations == 3
    assert float(res.residual_norm) > 1e-12
    torch.testing.assert_close(res.residual_norm, _rel_res(A, res.x, b), rtol=1e-8, atol=0.0)
    with pytest.raises(ConvergenceError) as info:
        cg(A, b, rtol=1e-12, max_iter=3, on_fail="raise")
    assert info.value.iterations == 3
    torch.testing.assert_close(info.value.residual, res.residual_norm)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = cg(A, b, rtol=1e-12, max_iter=3, on_fail="ignore")
    assert not quiet.converged


def test_atol_stops_early():
    A = _spd(40, 1e3, seed=11)
    b = torch.randn(40, generator=torch.Generator().manual_seed(12), dtype=DT)
    res = cg(A, b, rtol=0.0, atol=1e-3 * float(torch.linalg.vector_norm(b)))
    assert res.converged
    assert float(res.residual_norm) <= 1e-3
    assert res.iterations < cg(A, b, rtol=1e-10).iterations


def test_not_spd_is_detected():
    A = _spd(30, 10.0, seed=13)
    evals, evecs = torch.linalg.eigh(A)
    indefinite = (evecs * torch.linspace(-1, 1, 30, dtype=DT)) @ evecs.T
    b = torch.randn(30, generator=torch.Generator().manual_seed(14), dtype=DT)
    with pytest.raises(NotPositiveDefiniteError, match="curvature"):
        cg(indefinite, b, rtol=1e-10)
    with pytest.raises(NotPositiveDefiniteError):
        cg(-A, b, rtol=1e-10)
    with pytest.raises(NotPositiveDefiniteError, match="precond"):
        cg(A, b, rtol=1e-10, precond=lambda r: -r)
    with pytest.raises(ValueError, match="precond"):
        cg(A, b, precond=-torch.ones(30, dtype=DT))
    with pytest.raises(ValueError, match="precond"):
        cg(A, b, precond=torch.ones(29, dtype=DT))


def test_bad_inputs_are_named():
    A = _spd(10, 10.0)
    b = torch.randn(10, dtype=DT)
    with pytest.raises(ValueError, match="rhs"):
        cg(A, torch.full((10,), float("nan"), dtype=DT))
    with pytest.raises(ValueError, match="rhs"):
        cg(A, torch.randn(9, dtype=DT))
    with pytest.raises(ValueError, match="rhs"):
        cg(A, torch.randn(10, 2, 2, dtype=DT))
    with pytest.raises(ValueError, match="x0"):
        cg(A, b, x0=torch.zeros(10, 1, dtype=DT))
    with pytest.raises(ValueError, match="on_fail"):
        cg(A, b, on_fail="loud")
    with pytest.raises(ValueError, match="square"):
        cg(DenseOperator(torch.randn(10, 9, dtype=DT)), b)
    with pytest.raises(ValueError, match="matmul"):
        cg(lambda v: v[:-1], b)
    with pytest.raises(ValueError, match="NaN"):
        cg(lambda v: v * float("nan"), b)
    with pytest.raises(TypeError, match="matmul"):
        cg("A", b)


def test_true_residual_restart_after_drift():
    """At cond 1e6 the recursive residual drifts below the true one; the reported residual is the true one."""
    A = _spd(60, 1e6, seed=3)
    b = torch.randn(60, generator=torch.Generator().manual_seed(2), dtype=DT)
    res = cg(A, b, rtol=1e-10)
    assert res.converged
    true_rr = float(_rel_res(A, res.x, b))
    assert true_rr <= 1e-10
    assert float(res.residual_norm) == pytest.approx(true_rr, rel=1e-6)
    fast = cg(A, b, rtol=1e-10, true_residual=False, on_fail="ignore")
    assert fast.num_mvm == fast.iterations
    fast_true = float(_rel_res(A, fast.x, b))
    if fast_true > 1e-10:  # drift happened (it does on x86-64 BLAS): the default run restarted
        assert fast.converged and float(fast.residual_norm) <= 1e-10
        assert res.num_mvm - res.iterations >= 2


def test_float32_and_default_max_iter():
    A = _spd(20, 10.0).float()
    b = torch.randn(20)
    res = cg(A, b, rtol=1e-5)
    assert res.x.dtype == torch.float32 and res.converged
    assert default_max_iter(50) == 500
    assert default_max_iter(5000) == 10_000
    assert default_max_iter(10**6) == 10**6


def test_no_grad_and_detached():
    A = _spd(15, 10.0)
    b = torch.randn(15, dtype=DT, requires_grad=True)
    res = cg(A, b, rtol=1e-10)
    assert not res.x.requires_grad


# ----------------------------------------------------------------------------- truncation at non-positive curvature
def _rotation(n, seed):
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=DT))
    return U


def test_truncate_returns_iterate_before_negative_curvature():
    """A = U diag(3, 1, -2) U^T, b = U (1, 1, 1): b^T A b = 2 > 0, so the first step is taken; the
    Krylov space span{b, A b} has Gram matrix [[2, 14], [14, 20]] (det < 0, indefinite), so the second
    direction, A-conjugate to b, has p^T A p < 0.  The returned iterate must be the first CG iterate,
    the minimiser of x^T A x / 2 - b^T x on span{b}: x1 = (b^T b / b^T A b) b = 1.5 b."""
    U = _rotation(3, 31)
    A = U @ torch.diag(torch.tensor([3.0, 1.0, -2.0], dtype=DT)) @ U.T
    b = U @ torch.ones(3, dtype=DT)
    K = torch.stack([b, A @ b], 1)
    gram = K.T @ A @ K
    assert float(b @ A @ b) == pytest.approx(2.0, rel=1e-12) and float(torch.linalg.det(gram)) < 0
    with pytest.raises(NotPositiveDefiniteError, match="curvature"):
        cg(A, b, rtol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a truncated column is not a convergence failure
        res = cg(A, b, rtol=1e-12, on_negative_curvature="truncate")
    torch.testing.assert_close(res.x, 1.5 * b, rtol=1e-13, atol=1e-13)
    assert res.iterations == 2 and res.num_mvm == 3  # two CG products and the true-residual check
    assert res.truncated.dim() == 0 and bool(res.truncated)
    assert not res.converged
    # the reported residual is the true one at the returned iterate: ||b - 1.5 A b|| / ||b||
    expected = float(torch.linalg.vector_norm(b - 1.5 * (A @ b)) / torch.linalg.vector_norm(b))
    assert float(res.residual_norm) == pytest.approx(expected, rel=1e-12)
    assert float(res.residual_norm) == pytest.approx(float(torch.tensor([1 - 4.5, 1 - 1.5, 1 + 3.0], dtype=DT).norm() / 3**0.5),
                                                     rel=1e-12)


def test_truncate_at_first_iteration_returns_preconditioned_residual():
    """A = diag(1, -3), Jacobi M = diag(4, 1): z = M^{-1} b = (0.25, 1) has z^T A z = 0.0625 - 3 < 0 at the
    first iteration, so the result is the step along the preconditioned residual, x0 + M^{-1} (b - A x0)."""
    A = torch.diag(torch.tensor([1.0, -3.0], dtype=DT))
    b = torch.tensor([1.0, 1.0], dtype=DT)
    d = torch.tensor([4.0, 1.0], dtype=DT)
    res = cg(A, b, precond=d, on_negative_curvature="truncate")
    torch.testing.assert_close(res.x, torch.tensor([0.25, 1.0], dtype=DT), rtol=0, atol=0)
    assert res.iterations == 1 and bool(res.truncated)
    # without a preconditioner: b^T A b = -2 < 0, the result is b itself (the steepest-descent direction)
    res = cg(A, b, on_negative_curvature="truncate", true_residual=False)
    torch.testing.assert_close(res.x, b, rtol=0, atol=0)
    assert res.num_mvm == 1 and bool(res.truncated)
    # warm start: x0 + M^{-1} (b - A x0) with b - A x0 = (1 - 0.5, 1 - 6) = (0.5, -5), curvature 1/64 - 75 < 0
    x0 = torch.tensor([0.5, -2.0], dtype=DT)
    res = cg(A, b, precond=d, x0=x0, on_negative_curvature="truncate")
    torch.testing.assert_close(res.x, torch.tensor([0.5 + 0.125, -2.0 - 5.0], dtype=DT), rtol=0, atol=1e-15)
    assert res.iterations == 1 and bool(res.truncated)


def test_truncate_batched_columns_are_independent():
    """Column 0 lies in the positive eigenspace (exact solve in 2 steps); column 1 is the indefinite case above."""
    U = _rotation(3, 32)
    ev = torch.tensor([3.0, 1.0, -2.0], dtype=DT)
    A = U @ torch.diag(ev) @ U.T
    B = U @ torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]], dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = cg(A, B, rtol=1e-12, on_negative_curvature="truncate")
    assert res.truncated.tolist() == [False, True]
    torch.testing.assert_close(res.x[:, 0], U @ torch.tensor([1 / 3, 1.0, 0.0], dtype=DT), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(res.x[:, 1], 1.5 * B[:, 1], rtol=1e-13, atol=1e-13)
    assert float(res.residual_norm[0]) <= 1e-12 and float(res.residual_norm[1]) > 0.1
    assert not res.converged and res.iterations == 2
    # a column that runs out of iterations still warns, a truncated one does not: column 1 = U e_3 has
    # b^T A b = -2 at the first iteration and is returned unchanged (x = b)
    B2 = U @ torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]], dtype=DT)
    with pytest.warns(ConvergenceWarning, match="1 of 2"):
        res = cg(A, B2, rtol=1e-12, max_iter=1, on_negative_curvature="truncate")
    assert res.truncated.tolist() == [False, True] and res.iterations == 1
    torch.testing.assert_close(res.x[:, 1], B2[:, 1], rtol=0, atol=0)


@pytest.mark.parametrize("precond", [False, True])
def test_truncate_mode_leaves_spd_solves_unchanged(precond):
    A = _sparse_spd(side=12, scale_range=2.0, seed=4).to_dense()
    B = torch.randn(A.shape[0], 3, generator=torch.Generator().manual_seed(5), dtype=DT)
    kw = dict(rtol=1e-10, precond=A.diagonal() if precond else None)
    ref = cg(A, B, **kw)
    res = cg(A, B, on_negative_curvature="truncate", **kw)
    assert ref.converged and res.converged
    assert torch.equal(res.x, ref.x) and res.iterations == ref.iterations and res.num_mvm == ref.num_mvm
    assert torch.equal(res.residual_norm, ref.residual_norm) and res.residual_history == ref.residual_history
    assert res.truncated.tolist() == [False] * 3 and ref.truncated.tolist() == [False] * 3
    x_ref = torch.linalg.solve(A, B)
    torch.testing.assert_close(res.x, x_ref, rtol=1e-7, atol=1e-9)


def test_truncate_mode_checks_its_argument_and_still_rejects_nan():
    A = _spd(10, 10.0)
    b = torch.randn(10, dtype=DT)
    with pytest.raises(ValueError, match="on_negative_curvature"):
        cg(A, b, on_negative_curvature="ignore")
    with pytest.raises(ValueError, match="NaN"):
        cg(lambda v: v * float("nan"), b, on_negative_curvature="truncate")
    with pytest.raises(NotPositiveDefiniteError, match="precond"):
        cg(A, b, precond=lambda r: -r, on_negative_curvature="truncate")
