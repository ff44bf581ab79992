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
