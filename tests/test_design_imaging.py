"""Imaging operators: adjoint consistency, Haar orthonormality, phase-encode scores vs dense design scores."""
import pytest
import torch

from pyro_convexvb.design.imaging import (
    difference_operator,
    fourier_columns_operator,
    haar_operator,
    phase_encode_scores,
)
from pyro_convexvb.design.scores import design_score

D = torch.float64


def _adjoint_check(B, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B.shape[1], k, generator=g, dtype=D)
    y = torch.randn(B.shape[0], k, generator=g, dtype=D)
    lhs = (B.mv(x) * y).sum(0)
    rhs = (x * B.rmv(y)).sum(0)
    assert torch.allclose(lhs, rhs, atol=1e-12, rtol=1e-12)
    # 1-D and batched products agree
    assert torch.allclose(B.mv(x[:, 1]), B.mv(x)[:, 1], atol=1e-14)
    assert torch.allclose(B.rmv(y[:, 2]), B.rmv(y)[:, 2], atol=1e-14)


@pytest.mark.parametrize("H,W", [(8, 8), (4, 16)])
def test_haar_orthonormal_and_adjoint(H, W):
    B = haar_operator(H, W)
    M = B.mv(torch.eye(H * W, dtype=D))
    assert torch.allclose(M.T @ M, torch.eye(H * W, dtype=D), atol=1e-12)
    _adjoint_check(B)
    # a constant image lives on the low-pass corner only
    L = min(H, W).bit_length() - 1
    h0, w0 = H >> L, W >> L
    c = B.mv(torch.ones(H * W, dtype=D)).reshape(H, W)
    assert torch.allclose(c[:h0, :w0], torch.full((h0, w0), (H * W / (h0 * w0)) ** 0.5, dtype=D), atol=1e-12)
    c[:h0, :w0] = 0
    assert float(c.abs().max()) < 1e-12
    B1 = haar_operator(H, W, levels=1)
    _adjoint_check(B1)


def test_differences_adjoint_and_values():
    H, W = 5, 7
    B = difference_operator(H, W)
    _adjoint_check(B)
    u = torch.arange(H * W, dtype=D)
    d = B.mv(u)
    assert torch.allclose(d[: H * (W - 1)], torch.ones(H * (W - 1), dtype=D))
    assert torch.allclose(d[H * (W - 1):], torch.full(((H - 1) * W,), float(W), dtype=D))


def test_fourier_columns_adjoint_and_dense():
    H, W = 6, 8
    cols = [0, 3, 5]
    B = fourier_columns_operator(H, W, cols)
    _adjoint_check(B)
    u = torch.randn(H, W, dtype=D)
    K = torch.fft.fft2(u, norm="ortho")[:, cols]
    ref = torch.cat([K.real.T.reshape(-1), K.imag.T.reshape(-1)])
    assert torch.allclose(B.mv(u.reshape(-1)), ref, atol=1e-13)


@pytest.mark.parametrize("H", [5, 6])
def test_fourier_columns_half_spectrum_path(H):
    """Columns within 0..W/2 use real FFTs (rfft2 / irfft2): values and adjoint as the full-FFT definition."""
    W = 8
    cols = [0, 2, 4, 1]
    B = fourier_columns_operator(H, W, cols)
    _adjoint_check(B)
    u = torch.randn(H, W, dtype=D)
    K = torch.fft.fft2(u, norm="ortho")[:, cols]
    ref = torch.cat([K.real.T.reshape(-1), K.imag.T.reshape(-1)])
    assert torch.allclose(B.mv(u.reshape(-1)), ref, atol=1e-13)
    r = torch.randn(2 * H * len(cols), 3, dtype=D)
    Kr = torch.zeros(3, H, W, dtype=torch.complex128)
    m = len(cols)
    re, im = (part.T.reshape(3, m, H).transpose(1, 2) for part in (r[:H * m], r[H * m:]))
    Kr[:, :, cols] = torch.complex(re, im)
    ref_adj = torch.fft.ifft2(Kr, norm="ortho").real.reshape(3, -1).T
    assert torch.allclose(B.rmv(r), ref_adj, atol=1e-13)


def test_phase_encode_scores_equal_dense_design_scores():
    H, W = 4, 8
    n = H * W
    g = torch.Generator().manual_seed(3)
    G = torch.randn(n, n, generator=g, dtype=D)
    cov = G @ G.T / n + 0.1 * torch.eye(n, dtype=D)
    F = torch.linalg.cholesky(cov)
    got = phase_encode_scores(F, H, W, noise_var=0.5)
    Xs = torch.stack([fourier_columns_operator(H, W, [c]).mv(torch.eye(n, dtype=D)) for c in range(W)])
    ref = torch.stack([torch.logdet(torch.eye(2 * H, dtype=D) + Xs[c] @ cov @ Xs[c].T / 0.5) for c in range(W)])
    assert torch.allclose(got, ref, atol=1e-10)
    assert torch.allclose(design_score(Xs, F, noise_var=0.5), ref, atol=1e-10)
    # low-rank factor: k < 2H branch
    got_lr = phase_encode_scores(F[:, :5], H, W, candidates=[1, 2])
    cov_lr = F[:, :5] @ F[:, :5].T
    for j, c in enumerate([1, 2]):
        r = torch.logdet(torch.eye(2 * H, dtype=D) + Xs[c] @ cov_lr @ Xs[c].T)
        assert abs(float(got_lr[j]) - float(r)) < 1e-10


def test_validation():
    with pytest.raises(ValueError, match="power of 2"):
        haar_operator(6, 8)
    with pytest.raises(ValueError, match="columns"):
        fourier_columns_operator(4, 4, [1, 1])
    with pytest.raises(ValueError, match="factor"):
        phase_encode_scores(torch.zeros(5, 2, dtype=D), 4, 4)
    # non-integral indices and levels were truncated (levels=2.7 built levels=2; column 1.7 was column 1)
    with pytest.raises(ValueError, match="levels"):
        haar_operator(8, 8, levels=2.7)
    with pytest.raises(ValueError, match="columns: expected integer"):
        fourier_columns_operator(4, 4, [1.7])
    with pytest.raises(ValueError, match="columns: expected a sequence"):
        fourier_columns_operator(4, 4, 2)
    with pytest.raises(ValueError, match="candidates: expected integer"):
        phase_encode_scores(torch.zeros(16, 2, dtype=D), 4, 4, candidates=[1.5])


# ----------------------------------------------------------------------------- squared operators
@pytest.mark.parametrize("make", [
    lambda: haar_operator(8, 8), lambda: haar_operator(4, 16, levels=1), lambda: difference_operator(5, 7),
    lambda: fourier_columns_operator(6, 8, [0, 3, 4, 5]), lambda: fourier_columns_operator(8, 8, [0, 1, 2, 4, 7]),
])
def test_squared_operators_equal_dense_entrywise_squares(make):
    B = make()
    M = B.mv(torch.eye(B.shape[1], dtype=D))
    S = B.squared()
    assert torch.allclose(S.mv(torch.eye(B.shape[1], dtype=D)), M * M, atol=1e-14)
    assert torch.allclose(S.rmv(torch.eye(B.shape[0], dtype=D)), (M * M).T, atol=1e-14)
    w = torch.rand(B.shape[0], dtype=D)
    assert torch.allclose(B.diag_gram(w), torch.diagonal(M.T @ torch.diag(w) @ M), atol=1e-13)


# ----------------------------------------------------------------------------- the compressive-sensing model
import math  # noqa: E402

import numpy as np  # noqa: E402

from pyro_convexvb.design.imaging import compressive_sensing_model, covariance_factor, laplace_map  # noqa: E402
from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation  # noqa: E402
from pyro_convexvb.infer.convex_relaxation.problem import RelaxationProblem  # noqa: E402

H8, COLS, SIG2, TA, TR = 8, [0, 1, 3], 1e-2, 0.3, 0.6


def _dense_dft_rows(H, W, cols):
    """Re/Im rows of the orthonormal 2-D DFT on ``cols`` from the explicit formula (no FFT)."""
    p, q = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
    re, im = [], []
    for c in cols:
        for k in range(H):
            theta = 2 * np.pi * (k * p / H + c * q / W)
            re.append((np.cos(theta) / np.sqrt(H * W)).reshape(-1))
            im.append((-np.sin(theta) / np.sqrt(H * W)).reshape(-1))
    return torch.tensor(np.array(re + im), dtype=D)


def _dense_haar(H, W):
    """Orthonormal 2-D Haar matrix, all levels, by explicit recursion on 1-D averaging/differencing matrices."""
    def step(m):
        P = np.zeros((m, m))
        for i in range(m // 2):
            P[i, 2 * i] = P[i, 2 * i + 1] = np.sqrt(0.5)
            P[m // 2 + i, 2 * i], P[m // 2 + i, 2 * i + 1] = np.sqrt(0.5), -np.sqrt(0.5)
        return P
    M = np.eye(H * W)
    h, w = H, W
    while h >= 2 and w >= 2:
        S = np.eye(H * W)
        blk = np.kron(step(h), step(w))  # acts on the (h, w) corner, row-major
        idx = (np.arange(h)[:, None] * W + np.arange(w)[None, :]).reshape(-1)
        S[np.ix_(idx, idx)] = blk
        M = S @ M
        h, w = h // 2, w // 2
    return torch.tensor(M, dtype=D)


def _cs_problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(H8 * H8, generator=g, dtype=D)
    X = _dense_dft_rows(H8, H8, COLS)
    y = X @ u + math.sqrt(SIG2) * torch.randn(X.shape[0], generator=g, dtype=D)
    return u, y, X


def test_model_products_and_log_joint_match_dense_references():
    u, y, X = _cs_problem()
    lgm = compressive_sensing_model(y, H8, H8, COLS, SIG2, TA, TR)
    n = H8 * H8
    Ba, Br = _dense_haar(H8, H8), difference_operator(H8, H8).mv(torch.eye(n, dtype=D))
    # B_r by explicit differences
    img = torch.arange(n, dtype=D).reshape(H8, H8) ** 1.5
    assert torch.allclose(Br @ img.reshape(-1), torch.cat([(img[:, 1:] - img[:, :-1]).reshape(-1),
                                                           (img[1:] - img[:-1]).reshape(-1)]))
    B = torch.cat([Ba, Br])
    assert torch.allclose(lgm.design(lgm.nongaussian_groups).mv(torch.eye(n, dtype=D)), B, atol=1e-13)
    assert torch.allclose(lgm.sites[0].design.mv(torch.eye(n, dtype=D)), X, atol=1e-13)
    prob = RelaxationProblem(lgm)
    E = torch.eye(n, dtype=D)
    assert torch.allclose(prob.xtx_mv(E), X.T @ X / SIG2, atol=1e-10)
    assert torch.allclose(prob.xty(), X.T @ y / SIG2, atol=1e-10)
    w = torch.rand(B.shape[0], dtype=D)
    assert torch.allclose(prob.a_mv(E, w), X.T @ X / SIG2 + B.T @ torch.diag(w) @ B, atol=1e-10)
    assert torch.allclose(prob.jacobi(w), torch.diagonal(X.T @ X / SIG2 + B.T @ torch.diag(w) @ B), atol=1e-10)
    # Seeger 2010 Eq. (1) with every normaliser: N(y | X u, sigma^2 I) prod_j tau_j/(2 sigma) exp(-tau_j |s_j / sigma|)
    v = torch.randn(n, dtype=D)
    s, sig = B @ v, math.sqrt(SIG2)
    tau = torch.cat([torch.full((n,), TA, dtype=D), torch.full((B.shape[0] - n,), TR, dtype=D)])
    ref = (-0.5 * ((y - X @ v) ** 2).sum() / SIG2 - 0.5 * y.numel() * math.log(2 * math.pi * SIG2)
           + (torch.log(tau / (2 * sig)) - tau * s.abs() / sig).sum())
    assert abs(float(lgm.log_joint(v)) - float(ref)) < 1e-9 * abs(float(ref))


@pytest.mark.filterwarnings("ignore::pyro_convexvb.ConvergenceWarning")  # iterations capped on purpose
def test_delta_from_engine_factors_equals_dense_logdet():
    u, y, X = _cs_problem(1)
    n = H8 * H8
    lgm = compressive_sensing_model(y, H8, H8, COLS, SIG2, TA, TR)
    B = torch.cat([_dense_haar(H8, H8), difference_operator(H8, H8).mv(torch.eye(n, dtype=D))])
    res = ConvexVariationalRelaxation(lgm, variance="exact", max_outer=3, progress=False).run()
    gamma = res.state.gamma
    A = X.T @ X / SIG2 + B.T @ torch.diag(1 / gamma) @ B  # sigma^2 = 1 convention: Cov_Q = A^{-1}
    cov = torch.linalg.inv(A)
    cand = [2, 4]
    ref = torch.stack([torch.logdet(torch.eye(2 * H8, dtype=D) + Xc @ cov @ Xc.T / SIG2)
                       for Xc in (_dense_dft_rows(H8, H8, [c]) for c in cand)])
    F = covariance_factor(res)
    assert torch.allclose(F @ F.T, cov, rtol=1e-8, atol=1e-10)
    assert torch.allclose(phase_encode_scores(F, H8, H8, SIG2, candidates=cand), ref, rtol=1e-9, atol=1e-9)
    # K-Lanczos at K = n is exact; at K < n it is a lower bound (Seeger 2010 §4.3)
    lz = ConvexVariationalRelaxation(lgm, variance="lanczos", lanczos_rank=n, max_outer=0, gamma_init=gamma,
                                     progress=False).run()
    assert torch.allclose(phase_encode_scores(covariance_factor(lz), H8, H8, SIG2, candidates=cand), ref, rtol=1e-6)
    lz8 = ConvexVariationalRelaxation(lgm, variance="lanczos", lanczos_rank=8, max_outer=0, gamma_init=gamma,
                                      progress=False).run()
    assert bool((phase_encode_scores(covariance_factor(lz8), H8, H8, SIG2, candidates=cand) <= ref + 1e-9).all())
    # L-PCA with the L smallest eigenpairs of A, against a dense eigendecomposition
    pc = ConvexVariationalRelaxation(lgm, variance="pca", lanczos_rank=n, pca_rank=6, max_outer=0, gamma_init=gamma,
                                     progress=False).run()
    lam, V = torch.linalg.eigh(A)
    cov6 = V[:, :6] @ torch.diag(1 / lam[:6]) @ V[:, :6].T
    F6 = covariance_factor(pc, pca_rank=6)
    assert torch.allclose(F6 @ F6.T, cov6, atol=1e-8 * float(cov6.abs().max()))
    # options that do not apply, or out of range, are refused (pca_rank=0 gave 1 column, 100 every Ritz pair)
    for fit, kwargs, name in ((res, dict(pca_rank=5), "pca_rank"), (lz8, dict(pca_rank=5), "pca_rank"),
                              (lz8, dict(score_steps=9), "score_steps"), (pc, dict(pca_rank=0), "pca_rank"),
                              (pc, dict(pca_rank=2.7), "pca_rank"), (pc, dict(pca_rank=n + 1), "pca_rank")):
        with pytest.raises(ValueError, match=name):
            covariance_factor(fit, **kwargs)
    with pytest.raises(TypeError, match="result"):
        covariance_factor(F6)
    for bad in (torch.full_like(F, float("nan")), F.to(torch.complex128)):
        with pytest.raises(ValueError, match="factor"):
            phase_encode_scores(bad, H8, H8, SIG2, candidates=cand)


def test_laplace_map_equals_scipy_optimum():
    from scipy.optimize import minimize

    u, y, X = _cs_problem(2)
    n = H8 * H8
    B = torch.cat([_dense_haar(H8, H8), difference_operator(H8, H8).mv(torch.eye(n, dtype=D))]).numpy()
    q = B.shape[0]
    lam = np.concatenate([np.full(n, TA), np.full(q - n, TR)]) / math.sqrt(SIG2)  # 1/b_j = tau_j/sigma
    Xn, yn = X.numpy(), y.numpy()

    def psi0(v):
        r = yn - Xn @ v[:n]
        return 0.5 * r @ r / SIG2 + lam @ np.abs(B @ v[:n])

    # independent reference: the nonsmooth problem as a smooth one with -t <= B u <= t (SLSQP)
    C = np.vstack([np.hstack([-B, np.eye(q)]), np.hstack([B, np.eye(q)])])
    ref = minimize(lambda v: 0.5 * np.sum((yn - Xn @ v[:n]) ** 2) / SIG2 + lam @ v[n:], np.zeros(n + q),
                   jac=lambda v: np.concatenate([-Xn.T @ (yn - Xn @ v[:n]) / SIG2, lam]), method="SLSQP",
                   constraints=[{"type": "ineq", "fun": lambda v: C @ v, "jac": lambda v: C}],
                   options=dict(maxiter=1000, ftol=1e-15))
    u_ref = ref.x[:n]
    lgm = compressive_sensing_model(y, H8, H8, COLS, SIG2, TA, TR)
    z_final = 1e-10
    u_map, info = laplace_map(lgm, z_final=z_final)
    assert info["converged"]
    assert abs(info["objective"] - psi0(u_map.numpy())) < 1e-9 * psi0(u_ref)
    # Psi_0(u_map) - min Psi_0 <= sqrt(z) sum_j 1/b_j, and no point beats the reference optimum
    gap = info["objective"] - psi0(u_ref)
    assert -1e-7 < gap <= math.sqrt(z_final) * lam.sum()
    assert np.abs(u_map.numpy() - u_ref).max() < 1e-4


def test_model_and_map_validation():
    u, y, X = _cs_problem()
    with pytest.raises(ValueError, match="noise_var"):
        compressive_sensing_model(y, H8, H8, COLS, -1.0, TA, TR)
    with pytest.raises(ValueError, match="tau_r"):
        compressive_sensing_model(y, H8, H8, COLS, SIG2, TA, float("nan"))
    with pytest.raises(ValueError, match="y: expected 48"):
        compressive_sensing_model(y[:-1], H8, H8, COLS, SIG2, TA, TR)
    with pytest.raises(ValueError, match="y: expected finite"):
        compressive_sensing_model(torch.full_like(y, float("inf")), H8, H8, COLS, SIG2, TA, TR)
    with pytest.raises(ValueError, match="power of 2"):
        compressive_sensing_model(y, 6, 8, COLS, SIG2, TA, TR)
    lgm = compressive_sensing_model(y, H8, H8, COLS, SIG2, TA, TR)
    with pytest.raises(ValueError, match="u0"):
        laplace_map(lgm, torch.zeros(3, dtype=D))
    with pytest.raises(ValueError, match="z_final"):
        laplace_map(lgm, z_final=1.0, z_start=1e-3)
    with pytest.raises(ValueError, match="z_start"):
        laplace_map(lgm, z_start=float("nan"))
    with pytest.raises(ValueError, match="max_newton"):
        laplace_map(lgm, max_newton=0)
    with pytest.raises(TypeError, match="lgm"):
        laplace_map(X)
    from pyro_convexvb.lgm.model import LatentGaussianModel
    from pyro_convexvb.lgm.sites import BernoulliLogit

    logit = LatentGaussianModel.from_design(torch.randn(5, 2, dtype=D), BernoulliLogit(torch.ones(5, dtype=D)))
    with pytest.raises(ValueError, match="'y' is 'bernoulli_logit'"):
        laplace_map(logit)
