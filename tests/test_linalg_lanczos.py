"""Lanczos, K-Lanczos and L-PCA variances against dense eigendecompositions and solves (float64)."""
import math
import warnings

import pytest
import torch

from pyro_convexvb.errors import ConvergenceWarning
from pyro_convexvb.linalg import (
    LanczosResult,
    NotPositiveDefiniteError,
    SparseOperator,
    banded_lanczos_z,
    block_lanczos,
    lanczos,
    lanczos_variances,
    pca_variances,
    tridiagonal_cholesky,
)

DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _spd_from_eigs(ev, seed=0):
    n = ev.shape[0]
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(seed), dtype=DT))
    return (U * ev) @ U.T


def _spd(n, cond, seed=0):
    return _spd_from_eigs(torch.logspace(0, math.log10(cond), n, dtype=DT), seed)


def _exact_var(A, B):
    return torch.diagonal(B @ torch.linalg.solve(A, B.T))


def _sparse_precision(n=120, m=300, seed=0):
    """A = I + X^T diag(w) X with a sparse X, as a sparse COO tensor."""
    g = _gen(seed)
    X = torch.randn(m, n, generator=g, dtype=DT) * (torch.rand(m, n, generator=g, dtype=DT) < 0.05)
    w = torch.rand(m, generator=g, dtype=DT) + 0.1
    A = torch.eye(n, dtype=DT) + X.T @ (w[:, None] * X)
    return A.to_sparse(), A, X


@pytest.mark.parametrize("form", ["dense", "sparse"])
def test_q_orthonormal_and_tridiagonal(form):
    if form == "dense":
        A = _spd(100, 1e4, seed=1)
        mat = A
    else:
        As, A, _ = _sparse_precision(100, 250, seed=2)
        mat = SparseOperator(As)
    res = lanczos(mat, 100, 40, generator=_gen(3))
    assert res.k == 40 and res.num_mvm == 40 and not res.breakdown
    Q = res.Q
    assert Q.shape == (100, 40)
    torch.testing.assert_close(Q.T @ Q, torch.eye(40, dtype=DT), rtol=0, atol=1e-13)
    T = res.T()
    torch.testing.assert_close(Q.T @ A @ Q, T, rtol=0, atol=1e-12 * float(torch.linalg.matrix_norm(A, 2)))
    assert res.alpha.shape == (40,) and res.beta.shape == (39,)
    assert torch.equal(T, T.T) and torch.count_nonzero(torch.triu(T, 2)) == 0
    # three-term relation A Q = Q T + beta_k q_{k+1} e_k^T: the residual lives in the last column only
    R = A @ Q - Q @ T
    assert float(R[:, :-1].abs().max()) < 1e-12 * float(torch.linalg.matrix_norm(A, 2))
    torch.testing.assert_close(torch.linalg.vector_norm(R[:, -1]), res.beta_next, rtol=1e-10, atol=1e-12)


def test_ritz_values_converge_to_extreme_eigenvalues():
    g = _gen(4)
    inner = 1.0 + 9.0 * torch.rand(196, generator=g, dtype=DT)
    ev = torch.cat([torch.tensor([0.01, 0.1], dtype=DT), inner, torch.tensor([50.0, 100.0], dtype=DT)])
    A = _spd_from_eigs(ev, seed=5)
    lam = torch.linalg.eigvalsh(A)
    res = lanczos(A, 200, 40, generator=_gen(6))
    theta, rr = res.ritz_values, res.ritz_residuals
    assert bool((theta[1:] >= theta[:-1]).all())
    for i, j in ((0, 0), (1, 1), (-1, -1), (-2, -2)):
        assert abs(float(theta[i] - lam[j])) <= 1e-8 * float(lam[j]) + 1e-12
        assert float(rr[i]) < 1e-6
    # every Ritz value lies within its residual of some eigenvalue, and the residuals are the true ones
    dist = (theta[:, None] - lam[None, :]).abs().min(1).values
    assert bool((dist <= rr + 1e-10).all())
    Y = res.ritz_vectors()
    true_rr = torch.linalg.vector_norm(A @ Y - Y * theta, dim=0)
    torch.testing.assert_close(rr, true_rr, rtol=1e-6, atol=1e-10)
    # Ritz values interlace the spectrum: inside [lambda_min, lambda_max]
    assert float(theta[0]) >= float(lam[0]) - 1e-12 and float(theta[-1]) <= float(lam[-1]) + 1e-12


def test_full_run_recovers_spectrum_and_logdet():
    A = _spd(50, 1e6, seed=7)
    res = lanczos(A, 50, 50, generator=_gen(8))
    assert res.k == 50
    torch.testing.assert_close(res.ritz_values, torch.linalg.eigvalsh(A), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(res.logdet_T(), torch.logdet(A), rtol=1e-11, atol=1e-9)
    b = torch.randn(50, generator=_gen(9), dtype=DT)
    torch.testing.assert_close(res.apply_inverse(b), torch.linalg.solve(A, b), rtol=1e-7, atol=1e-9)
    B = torch.randn(50, 3, generator=_gen(10), dtype=DT)
    torch.testing.assert_close(res.apply_inverse(B), torch.linalg.solve(A, B), rtol=1e-7, atol=1e-9)


def test_logdet_T_equals_log_of_det_of_T():
    A = _spd(40, 1e3, seed=11)
    res = lanczos(A, 40, 12, generator=_gen(12))
    torch.testing.assert_close(res.logdet_T(), torch.logdet(res.T()), rtol=1e-12, atol=1e-12)
    e, d = tridiagonal_cholesky(res.alpha, res.beta)
    Lf = torch.diag(e) + torch.diag(d, -1)
    torch.testing.assert_close(Lf @ Lf.T, res.T(), rtol=1e-12, atol=1e-12)


def test_breakdown_on_invariant_subspace_and_exact_variances():
    """A = I + X^T X with rank-5 X: the Krylov space has dimension 6, Lanczos stops there.

    The rows of X lie in the Krylov space, so their variances are exact at breakdown
    (Nickisch & Seeger 2009 §2.4: "the Lanczos variance estimation is exact for q < k").
    """
    n = 80
    X = torch.randn(5, n, generator=_gen(13), dtype=DT)
    A = torch.eye(n, dtype=DT) + X.T @ X
    z, res = lanczos_variances(A, X, 30, generator=_gen(14), return_result=True)
    assert res.breakdown and res.k == 6 and res.num_mvm == 6
    assert float(res.beta_next) == 0.0 and float(res.ritz_residuals.max()) == 0.0
    lam = torch.linalg.eigvalsh(A)
    top = lam[-5:]
    torch.testing.assert_close(res.ritz_values[-5:], top, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(res.ritz_values[0], torch.tensor(1.0, dtype=DT), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(z, _exact_var(A, X), rtol=1e-10, atol=0)
    # scaling A by 1e-8 changes nothing about where the run stops (relative breakdown test)
    res_s = lanczos(1e-8 * A, 80, 30, generator=_gen(14))
    assert res_s.k == 6 and res_s.breakdown
    res_big = lanczos(1e8 * _spd(40, 1e2, seed=15), 40, 20, generator=_gen(16))
    assert res_big.k == 20 and not res_big.breakdown


@pytest.mark.parametrize("form", ["dense", "sparse", "identity"])
def test_lanczos_variances_exact_at_full_k(form):
    if form == "sparse":
        As, A, X = _sparse_precision(90, 200, seed=17)
        mat, B, Bd = SparseOperator(As), SparseOperator(X.to_sparse()), X
    elif form == "dense":
        A = _spd(90, 1e5, seed=18)
        Bd = torch.randn(40, 90, generator=_gen(19), dtype=DT)
        mat, B = A, Bd
    else:
        A = _spd(90, 1e3, seed=20)
        mat, B, Bd = A, None, torch.eye(90, dtype=DT)
    z_exact = _exact_var(A, Bd)
    z, res = lanczos_variances(mat, B, 90, generator=_gen(21), return_result=True)
    assert res.k == 90 and not res.breakdown
    torch.testing.assert_close(z, z_exact, rtol=1e-8, atol=0)
    torch.testing.assert_close(res.logdet_T(), torch.logdet(A), rtol=1e-11, atol=1e-9)


def test_lanczos_variances_monotone_and_lower_bounds():
    """Seeger 2010 §4.1: every component of z_k is nondecreasing in k and <= the exact variance."""
    n = 70
    A = _spd(n, 1e4, seed=22)
    B = torch.randn(25, n, generator=_gen(23), dtype=DT)
    z_exact = _exact_var(A, B)
    v0 = torch.randn(n, generator=_gen(24), dtype=DT)
    prev = torch.zeros(25, dtype=DT)
    for k in range(1, n + 1):
        z = lanczos_variances(A, B, k, v0=v0)
        assert bool((z >= prev - 1e-12 * z_exact).all()), k
        assert bool((z <= z_exact * (1 + 1e-9)).all()), k
        prev = z
    torch.testing.assert_close(prev, z_exact, rtol=1e-8, atol=0)
    # intermediate k: strictly below for most components (the estimate is an underestimate)
    z10 = lanczos_variances(A, B, 10, v0=v0)
    assert float((z10 / z_exact).mean()) < 0.99


def test_recursion_matches_direct_formula_and_chunking():
    n = 60
    A = _spd(n, 1e3, seed=25)
    B = torch.randn(30, n, generator=_gen(26), dtype=DT)
    z, res = lanczos_variances(A, B, 15, generator=_gen(27), return_result=True, chunk_size=4)
    Q, T = res.Q, res.T()
    direct = torch.diagonal(B @ Q @ torch.linalg.solve(T, Q.T @ B.T))
    torch.testing.assert_close(z, direct, rtol=1e-11, atol=0)
    torch.testing.assert_close(res.variances(B, chunk_size=1), z, rtol=1e-13, atol=0)
    torch.testing.assert_close(res.variances(B.to_sparse(), chunk_size=100), z, rtol=1e-13, atol=0)
    torch.testing.assert_close(res.variances(None), torch.diagonal(Q @ torch.linalg.solve(T, Q.T)), rtol=1e-11, atol=0)


def test_pca_variances_bounds_and_exactness():
    n = 60
    ev = torch.cat([torch.linspace(0.05, 0.5, 10, dtype=DT), torch.linspace(2.0, 20.0, n - 10, dtype=DT)])
    A = _spd_from_eigs(ev, seed=28)
    B = torch.randn(20, n, generator=_gen(29), dtype=DT)
    z_exact = _exact_var(A, B)
    lam, U = torch.linalg.eigh(A)
    prev = torch.zeros(20, dtype=DT)
    for L in (1, 3, 5, 10):
        z, res = pca_variances(A, B, L, generator=_gen(30), return_result=True, tol=1e-10)
        ref = ((B @ U[:, :L]) ** 2 / lam[:L]).sum(1)
        torch.testing.assert_close(z, ref, rtol=1e-8, atol=0)
        assert bool((z <= z_exact * (1 + 1e-10)).all())
        assert bool((z >= prev * (1 - 1e-10)).all())
        prev = z
    z_full = pca_variances(A, B, n, generator=_gen(31))
    torch.testing.assert_close(z_full, z_exact, rtol=1e-8, atol=0)
    z_id = pca_variances(A, None, n, generator=_gen(31))
    torch.testing.assert_close(z_id, torch.diagonal(torch.linalg.inv(A)), rtol=1e-8, atol=0)


def test_pca_unconverged_warns_and_is_still_a_lower_bound():
    n = 200
    A = _spd(n, 1e6, seed=32)  # log-spaced spectrum: the small end converges slowly
    B = torch.randn(10, n, generator=_gen(33), dtype=DT)
    z_exact = _exact_var(A, B)
    with pytest.warns(ConvergenceWarning, match="did not converge"):
        z = pca_variances(A, B, 20, num_steps=25, max_steps=30, generator=_gen(34))
    assert bool((z <= z_exact * (1 + 1e-10)).all())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pca_variances(A, B, 20, num_steps=25, max_steps=30, generator=_gen(34), on_fail="ignore")


def test_k_lanczos_dominates_l_pca_at_equal_steps():
    """With the same K steps, K-Lanczos uses all of span(Q) while L-PCA keeps L < K directions."""
    n = 80
    A = _spd(n, 1e4, seed=35)
    B = torch.randn(15, n, generator=_gen(36), dtype=DT)
    v0 = torch.randn(n, generator=_gen(37), dtype=DT)
    zk = lanczos_variances(A, B, 30, v0=v0)
    zp = pca_variances(A, B, 10, num_steps=30, max_steps=30, v0=v0, on_fail="ignore")
    assert bool((zp <= zk * (1 + 1e-10)).all())


def test_not_spd_and_bad_inputs():
    A = _spd(30, 10.0, seed=38)
    lam, U = torch.linalg.eigh(A)
    indefinite = (U * torch.linspace(-1, 1, 30, dtype=DT)) @ U.T
    B = torch.randn(5, 30, dtype=DT)
    with pytest.raises(NotPositiveDefiniteError):
        lanczos_variances(indefinite, B, 30, generator=_gen(39))
    # lanczos itself works for symmetric indefinite operators
    res = lanczos(indefinite, 30, 30, generator=_gen(39))
    torch.testing.assert_close(res.ritz_values, torch.linalg.eigvalsh(indefinite), rtol=1e-9, atol=1e-9)
    with pytest.raises(NotPositiveDefiniteError):
        res.logdet_T()
    with pytest.raises(ValueError, match="v0"):
        lanczos(A, torch.zeros(30, dtype=DT), 5)
    with pytest.raises(ValueError, match="v0"):
        lanczos(A, torch.ones(29, dtype=DT), 5)
    with pytest.raises(ValueError, match="v0"):
        lanczos(A, torch.full((30,), float("nan"), dtype=DT), 5)
    with pytest.raises(ValueError, match="k"):
        lanczos(A, 30, 0)
    with pytest.raises(ValueError, match="B"):
        lanczos_variances(A, torch.randn(5, 31, dtype=DT), 5)
    with pytest.raises(ValueError, match="L"):
        pca_variances(A, B, 31)
    with pytest.raises(ValueError, match="matmul"):
        lanczos(lambda v: v[:-1], 30, 5)
    with pytest.raises(ValueError, match="NaN"):
        lanczos(lambda v: v * float("nan"), 30, 5)


def test_k_larger_than_n_is_capped_and_dtype_follows():
    A = _spd(12, 10.0, seed=40)
    res = lanczos(A, 12, 50, generator=_gen(41))
    assert res.k == 12
    r32 = lanczos(A.float(), 12, 5, generator=_gen(41))
    assert r32.Q.dtype == torch.float32 and r32.alpha.dtype == torch.float32
    z = lanczos_variances(lambda v: A @ v, None, 12, v0=torch.randn(12, dtype=DT))
    torch.testing.assert_close(z, torch.diagonal(torch.linalg.inv(A)), rtol=1e-9, atol=0)


def test_without_reorthogonalisation_orthogonality_is_lost():
    """Seeger 2010 §3: reorthogonalisation cannot be skipped once Ritz values converge."""
    ev = torch.cat([torch.logspace(-3, 0, 95, dtype=DT), torch.tensor([10.0, 30, 100, 300, 1000], dtype=DT)])
    A = _spd_from_eigs(ev, seed=42)
    v0 = torch.randn(100, generator=_gen(43), dtype=DT)
    plain = lanczos(A, v0, 60, reorthogonalize=False)
    full = lanczos(A, v0, 60)
    I = torch.eye(60, dtype=DT)
    assert float((full.Q.T @ full.Q - I).abs().max()) < 1e-13
    assert float((plain.Q.T @ plain.Q - I).abs().max()) > 1e-3
    # the first steps agree
    torch.testing.assert_close(plain.alpha[:5], full.alpha[:5], rtol=1e-10, atol=0)


# ------------------------------------------------------------------------------------------ block Lanczos
@pytest.mark.parametrize("b", [1, 3, 4, 7])
def test_block_lanczos_orthonormal_projection_and_banded(b):
    A = _spd(50, 1e3, seed=1)
    res = block_lanczos(A, 50, 30, b, generator=_gen(2))
    Q, T = res.Q, res.T()
    assert res.k == 30 and res.num_mvm == 30 and Q.shape == (50, 30)
    torch.testing.assert_close(Q.T @ Q, torch.eye(30, dtype=DT), atol=1e-13, rtol=0)
    torch.testing.assert_close(T, Q.T @ A @ Q, atol=1e-11, rtol=0)
    i, j = torch.meshgrid(torch.arange(30), torch.arange(30), indexing="ij")
    assert float(T[(i - j) > res.block_size].abs().max()) == 0.0  # bandwidth b
    assert res.block_size == b
    torch.testing.assert_close(res.ritz_values, torch.linalg.eigvalsh(T))


@pytest.mark.parametrize("b", [2, 5, 7])
def test_block_lanczos_full_run_exact_variances_and_logdet(b):
    """k = n (n not a multiple of b: the last block is deflated/truncated): exact spectrum, log|A|, variances."""
    A = _spd(23, 1e4, seed=3)
    B = torch.randn(9, 23, generator=_gen(4), dtype=DT)
    res = block_lanczos(A, 23, 23, b, generator=_gen(5))
    assert res.k == 23
    torch.testing.assert_close(res.ritz_values, torch.linalg.eigvalsh(A), rtol=1e-9, atol=1e-9)
    assert float(res.logdet_T()) == pytest.approx(float(torch.logdet(A)), abs=1e-8)
    torch.testing.assert_close(res.variances(B), _exact_var(A, B), rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(res.variances(None), torch.diagonal(torch.linalg.inv(A)), rtol=1e-8, atol=1e-12)
    v = torch.randn(23, 2, generator=_gen(6), dtype=DT)
    torch.testing.assert_close(res.apply_inverse(v), torch.linalg.solve(A, v), rtol=1e-8, atol=1e-10)


def test_block_lanczos_variances_lower_bounds_nondecreasing_in_k():
    A, B = _spd(40, 1e3, seed=7), torch.randn(15, 40, generator=_gen(8), dtype=DT)
    exact = _exact_var(A, B)
    V0 = torch.randn(40, 4, generator=_gen(9), dtype=DT)
    prev = torch.zeros_like(exact)
    for k in range(1, 41, 3):
        z = block_lanczos(A, V0, k, 4).variances(B, chunk_size=5)
        assert bool((z <= exact * (1 + 1e-10) + 1e-14).all())
        assert bool((z >= prev - 1e-12).all())
        prev = z
    # the banded substitution equals the dense formula diag(B Q T^{-1} Q^T B^T)
    res = block_lanczos(A, V0, 22, 4)
    direct = torch.diagonal(B @ res.Q @ torch.linalg.solve(res.T(), res.Q.T @ B.T))
    for chunk in (1, 4, 9, 64):
        torch.testing.assert_close(res.variances(B, chunk_size=chunk), direct, rtol=1e-10, atol=1e-14)


def test_banded_z_with_band_one_is_seed000_recursion():
    A, B = _spd(30, 1e2, seed=10), torch.randn(7, 30, generator=_gen(11), dtype=DT)
    res = lanczos(A, 30, 12, generator=_gen(12))
    L = torch.linalg.cholesky(res.T())
    BQ = (B @ res.Q).T
    z = banded_lanczos_z(L, 1, lambda s, e: BQ[s:e], 12, chunk_size=5)
    torch.testing.assert_close(z, res.variances(B), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("b", [1, 3, 4, 7])
def test_block_lanczos_projected_variances_equal_dense_formula(b):
    """Variances accumulated during the run (incremental block Cholesky of T) equal
    diag(P Q T^-1 Q^T P^T) formed densely and the post-hoc banded recursion; the incremental L is chol(T)."""
    A = _spd(40, 1e3, seed=12)
    P1 = torch.randn(9, 40, generator=_gen(13), dtype=DT)
    for k in (1, b, 17, 29):  # 17, 29: a truncated last block for every b > 1
        res = block_lanczos(A, 40, k, b, generator=_gen(14), project=lambda V: [P1 @ V, V])
        Q, T = res.Q, res.T()
        C = Q @ torch.linalg.solve(T, Q.T)
        z, zu = res.projected_variances
        torch.testing.assert_close(z, torch.diagonal(P1 @ C @ P1.T), rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(zu, torch.diagonal(C), rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(z, res.variances(P1), rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(res.cholesky_L(), torch.linalg.cholesky(T), rtol=1e-10, atol=1e-12)
        assert float(res.logdet_T()) == pytest.approx(float(torch.logdet(T)), rel=1e-12)


@pytest.mark.parametrize("b", [1, 4])
def test_block_lanczos_projected_variances_bound_monotone_and_exact(b):
    """Seeger 2010 §4.1 for the accumulated estimate: below the exact variances, nondecreasing in k, exact at k = n."""
    A, P = _spd(36, 1e4, seed=15), torch.randn(11, 36, generator=_gen(16), dtype=DT)
    exact = _exact_var(A, P)
    V0 = torch.randn(36, b, generator=_gen(17), dtype=DT)
    prev = torch.zeros_like(exact)
    for k in range(1, 37, 5):
        z = block_lanczos(A, V0, k, b, project=lambda V: [P @ V]).projected_variances[0]
        assert bool((z <= exact * (1 + 1e-10) + 1e-14).all())
        assert bool((z >= prev - 1e-12).all())
        prev = z
    z = block_lanczos(A, V0, 36, b, project=lambda V: [P @ V]).projected_variances[0]
    torch.testing.assert_close(z, exact, rtol=1e-8, atol=1e-12)


def test_block_lanczos_projected_variances_after_deflation():
    """An invariant starting block: the run stops early and the accumulated variances are those of Q T^-1 Q^T."""
    ev = torch.arange(1.0, 21.0, dtype=DT)
    A = torch.diag(ev)
    V0 = torch.zeros(20, 2, dtype=DT)
    V0[:3, 0], V0[3:6, 1] = 1.0, 1.0  # Krylov space = span(e_1..e_6)
    P = torch.randn(5, 20, generator=_gen(18), dtype=DT)
    res = block_lanczos(A, V0, 12, 2, project=lambda V: [P @ V])
    assert res.breakdown and res.k == 6
    expected = torch.diagonal(P[:, :6] @ torch.diag(1.0 / ev[:6]) @ P[:, :6].T)
    torch.testing.assert_close(res.projected_variances[0], expected, rtol=1e-10, atol=1e-13)


def test_block_lanczos_project_rejects_indefinite_operator_and_bad_projections():
    A = _spd(10, 10.0)
    with pytest.raises(NotPositiveDefiniteError, match="not positive definite"):
        block_lanczos(-A, 10, 6, 2, generator=_gen(0), project=lambda V: [V])
    P = torch.randn(3, 10, generator=_gen(1), dtype=DT)
    with pytest.raises(ValueError, match="project: expected a non-empty list"):
        block_lanczos(A, 10, 6, 2, generator=_gen(0), project=lambda V: P @ V)
    with pytest.raises(ValueError, match=r"project: output 1 must have shape \(m, 2\)"):
        block_lanczos(A, 10, 6, 2, generator=_gen(0), project=lambda V: [P @ V, V.T])
    sizes = iter([3, 2, 2])
    with pytest.raises(ValueError, match="project: output sizes changed"):
        block_lanczos(A, 10, 6, 2, generator=_gen(0), project=lambda V: [(P @ V)[:next(sizes)]])
    with pytest.raises(ValueError, match="project: output 0 contains NaN"):
        block_lanczos(A, 10, 6, 2, generator=_gen(0), project=lambda V: [torch.full((3, V.shape[1]), float("nan"),
                                                                                    dtype=DT)])


def test_block_lanczos_invariant_start_breaks_down_exactly():
    ev = torch.arange(1.0, 21.0, dtype=DT)
    A = torch.diag(ev)
    V0 = torch.zeros(20, 2, dtype=DT)
    V0[:3, 0], V0[3:6, 1] = 1.0, 1.0  # Krylov space = span(e_1..e_6)
    res = block_lanczos(A, V0, 12, 2)
    assert res.breakdown and res.k == 6
    torch.testing.assert_close(res.ritz_values, ev[:6], rtol=1e-10, atol=1e-10)


def test_block_lanczos_bad_inputs():
    A = _spd(10, 10.0)
    with pytest.raises(ValueError, match="block_size"):
        block_lanczos(A, 10, 5, 0)
    with pytest.raises(ValueError, match="n_or_V0"):
        block_lanczos(A, torch.randn(10, 3, dtype=DT), 5, 2)
    with pytest.raises(ValueError, match="n_or_V0"):
        block_lanczos(A, torch.full((10, 2), float("nan"), dtype=DT), 5, 2)
    with pytest.raises(ValueError, match="matmul"):
        block_lanczos(lambda V: V[:-1], 10, 5, 2, dtype=DT)
    with pytest.raises(NotPositiveDefiniteError):
        block_lanczos(-A, 10, 6, 2, generator=_gen(0)).variances(None)


# ------------------------------------------------------------------------------------------ one result type
def test_lanczos_is_block_lanczos_with_block_size_one():
    """Single-vector Lanczos and block Lanczos with b = 1 are the same run and return the same type."""
    A = _spd(40, 1e3, seed=50)
    v0 = torch.randn(40, generator=_gen(51), dtype=DT)
    one = lanczos(A, v0, 15)
    blk = block_lanczos(A, v0[:, None], 15, 1)
    assert type(one) is type(blk) is LanczosResult
    torch.testing.assert_close(one.Q, blk.Q, rtol=0, atol=0)
    torch.testing.assert_close(one.T(), blk.T(), rtol=0, atol=0)
    assert one.block_size == blk.block_size == 1
    # the tridiagonal coefficients and the bidiagonal Cholesky factor agree with the dense ones
    e, d = tridiagonal_cholesky(one.alpha, one.beta)
    torch.testing.assert_close(torch.diag(e) + torch.diag(d, -1), one.cholesky_L(), rtol=1e-12, atol=1e-14)
    # a callable on (n,) vectors works as before; the same random start as the operator form
    res = lanczos(lambda v: A @ v, 40, 15, generator=_gen(52), dtype=DT)
    ref = block_lanczos(A, 40, 15, 1, generator=_gen(52))
    torch.testing.assert_close(res.Q, ref.Q, rtol=0, atol=0)


@pytest.mark.parametrize("b,k", [(1, 12), (3, 18), (3, 17), (4, 30), (4, 1)])
def test_ritz_residuals_and_residual_of_every_block_size(b, k):
    """A Q - Q T = W C with orthonormal W: ||A y_i - theta_i y_i|| = ||C s_i|| (also after the last block
    was truncated to reach k), and ||A Q - Q T||_F = ||C||_F."""
    A = _spd(45, 1e3, seed=53)
    res = block_lanczos(A, 45, k, b, generator=_gen(54))
    assert res.k == k
    Q, T = res.Q, res.T()
    R = A @ Q - Q @ T
    C = res.residual_coeffs
    assert C.shape[1] == k and C.shape[0] <= b + b
    torch.testing.assert_close(torch.linalg.matrix_norm(R), torch.linalg.matrix_norm(C), rtol=1e-9, atol=1e-12)
    Y, theta = res.ritz_vectors(), res.ritz_values
    true_rr = torch.linalg.vector_norm(A @ Y - Y * theta, dim=0)
    torch.testing.assert_close(res.ritz_residuals, true_rr, rtol=1e-8, atol=1e-11)
    lam = torch.linalg.eigvalsh(A)
    dist = (theta[:, None] - lam[None, :]).abs().min(1).values
    assert bool((dist <= res.ritz_residuals + 1e-10).all())
    if b == 1:
        torch.testing.assert_close(res.beta_next, torch.linalg.vector_norm(R[:, -1]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("b", [1, 3])
def test_covariance_factor_and_apply_inverse(b):
    A = _spd(30, 1e2, seed=55)
    res = block_lanczos(A, 30, 13, b, generator=_gen(56))
    Q, T = res.Q, res.T()
    C = Q @ torch.linalg.solve(T, Q.T)
    F = res.covariance_factor()
    assert F.shape == (30, 13)
    torch.testing.assert_close(F @ F.T, C, rtol=1e-10, atol=1e-13)
    v = torch.randn(30, 2, generator=_gen(57), dtype=DT)
    torch.testing.assert_close(res.apply_inverse(v), C @ v, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(res.apply_inverse(v[:, 0]), C @ v[:, 0], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(res.variances(None), torch.diagonal(C), rtol=1e-10, atol=1e-13)


def test_extended_run_equals_a_direct_run():
    """L-PCA extends one run step by step; the extended run is the run of the final length."""
    import importlib

    lz = importlib.import_module("pyro_convexvb.linalg.lanczos")
    A = _spd(50, 1e3, seed=58)
    v0 = torch.randn(50, generator=_gen(59), dtype=DT)
    run = lz._vector_run(A, v0, 10, True, None, None, None, None)
    first = run.run(10).result()
    ext = run.run(24).result()
    direct = lanczos(A, v0, 24)
    assert first.k == 10 and ext.k == 24 and ext.num_mvm == 24
    torch.testing.assert_close(ext.Q, direct.Q, rtol=0, atol=1e-13)
    torch.testing.assert_close(ext.T(), direct.T(), rtol=0, atol=1e-12)
    torch.testing.assert_close(ext.ritz_residuals, direct.ritz_residuals, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(first.T(), direct.T()[:10, :10], rtol=0, atol=1e-12)
