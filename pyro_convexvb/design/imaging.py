r"""Matrix-free imaging operators for sparse linear models and Fourier design (seed 001 §2, §5).

Images ``u`` of shape ``(H, W)`` are vectorised row-major (``n = H W``). Every operator is a
:class:`~pyro_convexvb.linalg.operators.FunctionOperator` with batched products (``(n, k)`` inputs),
so Lanczos and CG never see a dense ``n x n`` matrix.

* :func:`haar_operator` -- orthonormal 2-D Haar wavelet transform ``B_a`` (``B_a^T B_a = I``).
* :func:`difference_operator` -- horizontal and vertical first differences ``B_r``.
* :func:`fourier_columns_operator` -- real and imaginary parts of the orthonormal 2-D DFT restricted
  to a set of k-space columns ("phase encodes").
* :func:`phase_encode_scores` -- ``Delta(X_*) = log|I + X_* Cov X_*^T / sigma^2|`` for every candidate
  k-space column at once, from a covariance factor ``F`` by one FFT of its columns (seed 001 §2.2).
"""
import math

import torch

from ..linalg.operators import FunctionOperator
from .scores import _logdet_eye_plus

__all__ = ["haar_operator", "difference_operator", "fourier_columns_operator", "phase_encode_scores"]


def _check_shape(H, W, pow2=False):
    for name, v in (("H", H), ("W", W)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ValueError(f"{name}: expected an integer >= 2, got {v!r}")
        if pow2 and (v & (v - 1)):
            raise ValueError(f"{name}: the Haar transform needs a power of 2, got {v}")


def _images(v, H, W):
    """``(n,)`` or ``(n, k)`` -> ``(k, H, W)`` and a flag for 1-D input."""
    one = v.dim() == 1
    V = v.unsqueeze(-1) if one else v
    return V.transpose(0, 1).reshape(-1, H, W), one


def _vectors(imgs, one):
    out = imgs.reshape(imgs.shape[0], -1).transpose(0, 1)
    return out[:, 0] if one else out.contiguous()


def _haar_1d(x, dim, length):
    a = x.narrow(dim, 0, length)
    even, odd = a.narrow(dim, 0, length).unfold(dim, 2, 2).unbind(-1)
    s = math.sqrt(0.5)
    return torch.cat([(even + odd) * s, (even - odd) * s], dim)


def _ihaar_1d(x, dim, length):
    half = length // 2
    lo, hi = x.narrow(dim, 0, half), x.narrow(dim, half, half)
    s = math.sqrt(0.5)
    even, odd = (lo + hi) * s, (lo - hi) * s
    return torch.stack([even, odd], dim + 1 if dim >= 0 else dim).flatten(dim, dim + 1)


def haar_operator(H, W, levels=None, dtype=torch.float64, device=None):
    r"""Orthonormal 2-D Haar wavelet transform ``B_a`` (``n x n``), ``levels`` of separable steps
    on the low-pass corner (default: as many as both sides allow). ``B_a^T = B_a^{-1}``.

    :param int H: image height (power of 2); :param int W: width (power of 2).
    :returns: :class:`~pyro_convexvb.linalg.operators.FunctionOperator` of shape ``(H W, H W)``.

    Example::

        >>> import torch
        >>> B = haar_operator(4, 4)
        >>> x = torch.randn(16, dtype=torch.float64)
        >>> torch.allclose(B.rmv(B.mv(x)), x)
        True
    """
    _check_shape(H, W, pow2=True)
    max_levels = int(math.log2(min(H, W)))
    levels = max_levels if levels is None else int(levels)
    if not 1 <= levels <= max_levels:
        raise ValueError(f"levels: expected 1..{max_levels}, got {levels}")

    def fwd(v):
        X, one = _images(v, H, W)
        X = X.clone()
        h, w = H, W
        for _ in range(levels):
            blk = X[:, :h, :w]
            blk = _haar_1d(blk, 2, w)
            blk = _haar_1d(blk, 1, h)
            X[:, :h, :w] = blk
            h, w = h // 2, w // 2
        return _vectors(X, one)

    def inv(v):
        X, one = _images(v, H, W)
        X = X.clone()
        sizes = [(H >> j, W >> j) for j in range(levels)]
        for h, w in reversed(sizes):
            blk = X[:, :h, :w]
            blk = _ihaar_1d(blk, 1, h)
            blk = _ihaar_1d(blk, 2, w)
            X[:, :h, :w] = blk
        return _vectors(X, one)

    n = H * W
    return FunctionOperator(fwd, inv, (n, n), dtype=dtype, device=device, batched=True)


def difference_operator(H, W, dtype=torch.float64, device=None):
    r"""Horizontal and vertical first differences ``B_r`` of an ``(H, W)`` image:
    rows ``u[i, j+1] - u[i, j]`` (``H (W-1)`` of them) then ``u[i+1, j] - u[i, j]`` (``(H-1) W``).

    :returns: :class:`~pyro_convexvb.linalg.operators.FunctionOperator` of shape ``(H(W-1) + (H-1)W, HW)``.
    """
    _check_shape(H, W)
    nh, nv = H * (W - 1), (H - 1) * W

    def fwd(v):
        X, one = _images(v, H, W)
        dh = (X[:, :, 1:] - X[:, :, :-1]).reshape(X.shape[0], -1)
        dv = (X[:, 1:, :] - X[:, :-1, :]).reshape(X.shape[0], -1)
        out = torch.cat([dh, dv], 1).transpose(0, 1)
        return out[:, 0] if one else out.contiguous()

    def adj(r):
        one = r.dim() == 1
        R = (r.unsqueeze(-1) if one else r).transpose(0, 1)
        k = R.shape[0]
        dh = R[:, :nh].reshape(k, H, W - 1)
        dv = R[:, nh:].reshape(k, H - 1, W)
        X = torch.zeros(k, H, W, dtype=r.dtype, device=r.device)
        X[:, :, 1:] += dh
        X[:, :, :-1] -= dh
        X[:, 1:, :] += dv
        X[:, :-1, :] -= dv
        return _vectors(X, one)

    return FunctionOperator(fwd, adj, (nh + nv, H * W), dtype=dtype, device=device, batched=True)


def fourier_columns_operator(H, W, columns, dtype=torch.float64, device=None):
    r"""Real measurement operator of the k-space columns ``columns`` of the orthonormal 2-D DFT.

    Rows: ``Re(F u)[:, c]`` then ``Im(F u)[:, c]`` for each selected column ``c`` (``2 H |columns|`` rows),
    ``F`` = ``torch.fft.fft2(., norm="ortho")``. With Gaussian noise of variance ``sigma^2`` on the real
    and imaginary parts this is the Cartesian MRI-style design of seed 001 §5 for a real image.

    :param columns: sequence of distinct column indices in ``[0, W)``.
    """
    _check_shape(H, W)
    cols = torch.as_tensor(list(columns), dtype=torch.long, device=device)
    if cols.numel() == 0 or len(set(cols.tolist())) != cols.numel() or int(cols.min()) < 0 or int(cols.max()) >= W:
        raise ValueError(f"columns: expected distinct indices in [0, {W})")
    m = cols.numel()

    def fwd(v):
        X, one = _images(v, H, W)
        K = torch.fft.fft2(X, norm="ortho")[:, :, cols]  # (k, H, m)
        out = torch.cat([K.real.transpose(1, 2).reshape(X.shape[0], -1),
                         K.imag.transpose(1, 2).reshape(X.shape[0], -1)], 1).transpose(0, 1)
        return out[:, 0] if one else out.contiguous()

    def adj(r):
        one = r.dim() == 1
        R = (r.unsqueeze(-1) if one else r).transpose(0, 1)
        k = R.shape[0]
        re = R[:, : H * m].reshape(k, m, H).transpose(1, 2)
        im = R[:, H * m:].reshape(k, m, H).transpose(1, 2)
        K = torch.zeros(k, H, W, dtype=torch.complex128 if r.dtype == torch.float64 else torch.complex64,
                        device=r.device)
        K[:, :, cols] = torch.complex(re, im)
        # adjoint of u -> Re/Im of (F u) restricted: u = Re(F^H K) (F unitary, u real)
        X = torch.fft.ifft2(K, norm="ortho").real
        return _vectors(X.contiguous(), one)

    return FunctionOperator(fwd, adj, (2 * H * m, H * W), dtype=dtype, device=device, batched=True)


def phase_encode_scores(factor, H, W, noise_var=1.0, candidates=None):
    r"""``Delta_c = log|I + X_c Cov X_c^T / sigma^2|`` for candidate k-space columns ``c`` (seed 001 §2.2),
    ``X_c`` = :func:`fourier_columns_operator` of the single column ``c``, ``Cov = F F^T``.

    One batched FFT of the ``k`` columns of ``F`` gives ``X_c F`` for every ``c`` at once; each score is
    then a ``min(2H, k)``-sized log-determinant.

    :param torch.Tensor factor: ``(H W, k)`` covariance factor (exact Cholesky or
        :func:`~pyro_convexvb.design.scores.lanczos_covariance_factor`).
    :param candidates: column indices (default all ``W``).
    :returns: ``(len(candidates),)`` scores.
    """
    _check_shape(H, W)
    if not (isinstance(noise_var, (int, float)) and math.isfinite(noise_var) and noise_var > 0):
        raise ValueError(f"noise_var: expected a positive finite number, got {noise_var!r}")
    if factor.dim() != 2 or factor.shape[0] != H * W:
        raise ValueError(f"factor: expected shape ({H * W}, k), got {tuple(factor.shape)}")
    cand = torch.arange(W) if candidates is None else torch.as_tensor(list(candidates), dtype=torch.long)
    Kf = torch.fft.fft2(factor.transpose(0, 1).reshape(-1, H, W), norm="ortho")[:, :, cand]  # (k, H, N)
    Wc = torch.cat([Kf.real, Kf.imag], 1).permute(2, 1, 0)  # (N, 2H, k)
    return _logdet_eye_plus(Wc, noise_var)
