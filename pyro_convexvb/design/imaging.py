r"""Matrix-free imaging operators for sparse linear models and Fourier design (Seeger 2010 §2, §5).

Images ``u`` of shape ``(H, W)`` are vectorised row-major (``n = H W``). Every operator is a
:class:`~pyro_convexvb.linalg.operators.FunctionOperator` with batched products (``(n, k)`` inputs),
so Lanczos and CG never see a dense ``n x n`` matrix.

* :func:`haar_operator` -- orthonormal 2-D Haar wavelet transform ``B_a`` (``B_a^T B_a = I``).
* :func:`difference_operator` -- horizontal and vertical first differences ``B_r``.
* :func:`fourier_columns_operator` -- real and imaginary parts of the orthonormal 2-D DFT restricted
  to a set of k-space columns ("phase encodes").
* :func:`phase_encode_scores` -- ``Delta(X_*) = log|I + X_* Cov X_*^T / sigma^2|`` for every candidate
  k-space column at once, from a covariance factor ``F`` by one FFT of its columns (Seeger 2010 §2.2).
* :func:`compressive_sensing_model` -- the sparse linear model of Seeger 2010 §5 (Eq. (1)) as a
  :class:`~pyro_convexvb.LatentGaussianModel`: flat prior on ``u``, Gaussian Fourier-column measurements,
  Laplace sites on ``s = [B_a; B_r] u``.
* :func:`laplace_map` -- the MAP estimate of such a model (the reconstruction Seeger 2010 §5 evaluates);
  :func:`pyro_convexvb.infer.convex_relaxation.laplace_map`, re-exported here.
* :func:`covariance_factor` -- ``F`` with ``F F^T ≈ Cov_Q[u]`` from a convex-relaxation fit (exact,
  K-Lanczos or L-PCA), the input of :func:`phase_encode_scores`.

Each operator also carries its entrywise square (``op.squared()``), so ``diag(B^T diag(w) B)`` (the
Jacobi preconditioner of the engine's CG and its ``log|A|`` bound) never needs a dense matrix either.
"""
import math

import torch

from ..infer.convex_relaxation import laplace_map
from ..linalg import (
    CirculantSymbol,
    FunctionOperator,
    TileBlocks,
    rows_in_tiles_blocks,
    shift_class_symbol,
    tile_layout,
)
from .scores import _logdet_eye_plus, check_noise_var, lanczos_covariance_factor, positive_number

__all__ = [
    "haar_operator",
    "difference_operator",
    "fourier_columns_operator",
    "phase_encode_scores",
    "compressive_sensing_model",
    "laplace_map",
    "covariance_factor",
]


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


def _haar_level(X, h, w, squared=False):
    """One separable Haar level on the corner ``X[:, :h, :w]`` (in place): rows then columns of each 2 x 2 block
    ``[[a, b], [c, d]]`` become the quadrants ``(a+b+c+d)/2`` (low-low, top left), ``(a-b+c-d)/2`` (top right),
    ``(a+b-c-d)/2`` (bottom left), ``(a-b-c+d)/2`` (bottom right); with ``squared`` the step with squared
    entries, ``(a+b+c+d)/4`` in every quadrant."""
    k, h2, w2 = X.shape[0], h // 2, w // 2
    blk = X[:, :h, :w].reshape(k, h2, 2, w2, 2)
    a, b, c, d = blk[:, :, 0, :, 0], blk[:, :, 0, :, 1], blk[:, :, 1, :, 0], blk[:, :, 1, :, 1]
    if squared:
        m = 0.25 * (a + b + c + d)
        quads = (m, m, m, m)
    else:
        ab, cd, amb, cmd = a + b, c + d, a - b, c - d
        quads = (0.5 * (ab + cd), 0.5 * (amb + cmd), 0.5 * (ab - cd), 0.5 * (amb - cmd))
    X[:, :h2, :w2], X[:, :h2, w2:w], X[:, h2:h, :w2], X[:, h2:h, w2:w] = quads


def _ihaar_level(X, h, w, squared=False):
    """Transpose of :func:`_haar_level` (its inverse when not ``squared``), in place."""
    k, h2, w2 = X.shape[0], h // 2, w // 2
    ll, lh, hl, hh = X[:, :h2, :w2], X[:, :h2, w2:w], X[:, h2:h, :w2], X[:, h2:h, w2:w]
    if squared:
        m = 0.25 * (ll + lh + hl + hh)
        a = b = c = d = m
    else:
        p, q, r, t = ll + lh, ll - lh, hl + hh, hl - hh
        a, b, c, d = 0.5 * (p + r), 0.5 * (q + t), 0.5 * (p - r), 0.5 * (q - t)
    blk = torch.stack([torch.stack([a, b], -1), torch.stack([c, d], -1)], 2)  # (k, h2, 2, w2, 2)
    X[:, :h, :w] = blk.reshape(k, h, w)


def _index_list(values, name):
    """``values`` as a list of Python ints; a non-integral entry (1.7 would be truncated to 1), a bool or a scalar
    instead of a sequence raises naming ``name``."""
    if torch.is_tensor(values):
        values = values.reshape(-1).tolist()
    try:
        values = list(values)
    except TypeError:
        raise ValueError(f"{name}: expected a sequence of indices, got {type(values).__name__}") from None
    out = []
    for c in values:
        c = c.item() if torch.is_tensor(c) and c.numel() == 1 else c
        if isinstance(c, bool) or not (isinstance(c, float) and c.is_integer() or hasattr(c, "__index__")):
            raise ValueError(f"{name}: expected integer indices, got {c!r}")
        out.append(int(c))
    return out


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
    if levels is not None and (isinstance(levels, bool) or not isinstance(levels, int)):
        raise ValueError(f"levels: expected an integer in 1..{max_levels}, got {levels!r}")
    levels = max_levels if levels is None else levels
    if not 1 <= levels <= max_levels:
        raise ValueError(f"levels: expected 1..{max_levels}, got {levels}")

    def fwd(v, squared=False):
        X, one = _images(v, H, W)
        X = X.clone()
        h, w = H, W
        for _ in range(levels):
            _haar_level(X, h, w, squared)
            h, w = h // 2, w // 2
        return _vectors(X, one)

    def inv(v, squared=False):
        X, one = _images(v, H, W)
        X = X.clone()
        sizes = [(H >> j, W >> j) for j in range(levels)]
        for h, w in reversed(sizes):
            _ihaar_level(X, h, w, squared)
        return _vectors(X, one)

    n = H * W
    # every entry of B_a is a single product along the cascade, so B_a∘B_a is the cascade of squared steps
    sq = FunctionOperator(lambda v: fwd(v, True), lambda v: inv(v, True), (n, n), dtype=dtype, device=device,
                          batched=True)
    op = FunctionOperator(fwd, inv, (n, n), dtype=dtype, device=device, batched=True, squared=sq)
    # the coefficients of one subband (level, orientation) are translates of one wavelet: 3 levels + 1 classes
    cls = torch.full((H, W), 3 * levels, dtype=torch.long, device=device)
    for j in range(levels):
        h, w = H >> j, W >> j
        cls[:h // 2, w // 2:w], cls[h // 2:h, :w // 2], cls[h // 2:h, w // 2:w] = 3 * j, 3 * j + 1, 3 * j + 2
    cls = cls.reshape(-1)
    op._gram_symbol = _lazy_symbol(op, cls, (H, W))

    fine_parts = {}  # t -> rows_in_tiles_blocks of the rows inside one tile (their comb products done once)

    def tiles(w, t):
        # levels j < log2(t) lie inside one tile; coarser wavelets and the scaling functions are constant on tiles,
        # so they add (sum_j w_j b_jp^2) 1 1^T to each tile's block
        L = t.bit_length() - 1
        if t < 2 or t != 1 << L or H % t or W % t:  # L > levels: every row lies inside one tile
            return None
        fine = cls < 3 * L
        if t not in fine_parts:
            fine_parts[t] = rows_in_tiles_blocks(op, (H, W), t, fine)
        out = fine_parts[t](w)
        coarse = sq.rmv(torch.where(fine, torch.zeros_like(w), w))
        tile, _ = tile_layout(H, W, t, w.device)
        per_tile = torch.zeros(out.blocks.shape[0], dtype=w.dtype, device=w.device).index_add_(0, tile, coarse)
        per_tile = per_tile / (t * t)
        return out + TileBlocks((H, W), t, per_tile.view(-1, 1, 1).expand_as(out.blocks).clone())

    op._gram_tiles = tiles
    return op


def _lazy_symbol(op, classes, grid):
    """``op.gram_symbol``: :func:`~pyro_convexvb.linalg.shift_class_symbol`, its spectra computed at the first call."""
    cache = []

    def symbol(w):
        if not cache:
            cache.append(shift_class_symbol(op, classes, grid))
        return cache[0](w)

    return symbol


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

    def adj(r, sign=-1.0):
        one = r.dim() == 1
        R = (r.unsqueeze(-1) if one else r).transpose(0, 1)
        k = R.shape[0]
        dh = R[:, :nh].reshape(k, H, W - 1)
        dv = R[:, nh:].reshape(k, H - 1, W)
        X = torch.zeros(k, H, W, dtype=r.dtype, device=r.device)
        X[:, :, 1:] += dh
        X[:, :, :-1] += sign * dh
        X[:, 1:, :] += dv
        X[:, :-1, :] += sign * dv
        return _vectors(X, one)

    def fwd_sq(v):  # |B_r| (entries squared are 1): sums of neighbours
        X, one = _images(v, H, W)
        out = torch.cat([(X[:, :, 1:] + X[:, :, :-1]).reshape(X.shape[0], -1),
                         (X[:, 1:, :] + X[:, :-1, :]).reshape(X.shape[0], -1)], 1).transpose(0, 1)
        return out[:, 0] if one else out.contiguous()

    shape = (nh + nv, H * W)
    sq = FunctionOperator(fwd_sq, lambda r: adj(r, 1.0), shape, dtype=dtype, device=device, batched=True)
    op = FunctionOperator(fwd, adj, shape, dtype=dtype, device=device, batched=True, squared=sq)
    # two classes of translates: the horizontal and the vertical differences
    cls = torch.cat([torch.zeros(nh, dtype=torch.long, device=device), torch.ones(nv, dtype=torch.long, device=device)])
    op._gram_symbol = _lazy_symbol(op, cls, (H, W))

    inside_parts = {}  # t -> (mask of the differences inside a tile, rows_in_tiles_blocks of them)

    def tiles(w, t):
        # differences inside a tile by comb probing; one crossing a tile border has one pixel in each of two tiles
        # and adds w_j to those two diagonal entries only
        if t < 2 or H % t or W % t:
            return None
        if t not in inside_parts:
            jh = torch.arange(W - 1, device=w.device).repeat(H)
            iv = torch.arange(H - 1, device=w.device).repeat_interleave(W)
            inside = torch.cat([jh % t != t - 1, iv % t != t - 1])
            inside_parts[t] = inside, rows_in_tiles_blocks(op, (H, W), t, inside)
        inside, part = inside_parts[t]
        out = part(w)
        diag = sq.rmv(torch.where(inside, torch.zeros_like(w), w))
        tile, off = tile_layout(H, W, t, w.device)
        extra = torch.zeros_like(out.blocks)
        extra[tile, off, off] = diag
        return out + TileBlocks((H, W), t, extra)

    op._gram_tiles = tiles
    return op


def fourier_columns_operator(H, W, columns, dtype=torch.float64, device=None):
    r"""Real measurement operator of the k-space columns ``columns`` of the orthonormal 2-D DFT.

    Rows: ``Re(F u)[:, c]`` then ``Im(F u)[:, c]`` for each selected column ``c`` (``2 H |columns|`` rows),
    ``F`` = ``torch.fft.fft2(., norm="ortho")``. With Gaussian noise of variance ``sigma^2`` on the real
    and imaginary parts this is the Cartesian MRI-style design of Seeger 2010 §5 for a real image.

    :param columns: sequence of distinct column indices in ``[0, W)``.

    Over 80 lines: besides the products it defines the operator's entrywise square, its circulant symbol
    (``gram_symbol``) and tile blocks (``gram_tiles``), each a few lines sharing the column bookkeeping.
    """
    _check_shape(H, W)
    cols = torch.as_tensor(_index_list(columns, "columns"), dtype=torch.long, device=device)
    if cols.numel() == 0 or len(set(cols.tolist())) != cols.numel() or int(cols.min()) < 0 or int(cols.max()) >= W:
        raise ValueError(f"columns: expected distinct indices in [0, {W})")
    m = cols.numel()

    def rows_out(re, im, one):  # (k, H, m) real and imaginary parts -> rows (2 H m,) or (2 H m, k)
        k = re.shape[0]
        out = torch.cat([re.transpose(1, 2).reshape(k, -1), im.transpose(1, 2).reshape(k, -1)], 1).transpose(0, 1)
        return out[:, 0] if one else out.contiguous()

    def rows_in(r):  # inverse of rows_out
        one = r.dim() == 1
        R = (r.unsqueeze(-1) if one else r).transpose(0, 1)
        k = R.shape[0]
        return R[:, : H * m].reshape(k, m, H).transpose(1, 2), R[:, H * m:].reshape(k, m, H).transpose(1, 2), one

    half = int(cols.max()) <= W // 2  # all columns in the half spectrum of a real image: real FFTs
    if half:
        # Re(ifft2(K)) for K supported on columns 0..W/2 equals irfft2 of K's half spectrum with the columns
        # 0 < c < W/2 halved (irfft2 adds their conjugate mirror; columns 0 and W/2 enter once)
        hscale = torch.where((cols == 0) | (2 * cols == W), 1.0, 0.5).to(device)

    def fwd(v):
        X, one = _images(v, H, W)
        K = (torch.fft.rfft2(X, norm="ortho") if half else torch.fft.fft2(X, norm="ortho"))[:, :, cols]  # (k, H, m)
        return rows_out(K.real, K.imag, one)

    def adj(r):
        re, im, one = rows_in(r)
        ct = torch.complex128 if r.dtype == torch.float64 else torch.complex64
        # adjoint of u -> Re/Im of (F u) restricted: u = Re(F^H K) (F unitary, u real)
        if half:
            K = torch.zeros(re.shape[0], H, W // 2 + 1, dtype=ct, device=r.device)
            K[:, :, cols] = torch.complex(re, im) * hscale.to(r.dtype)
            X = torch.fft.irfft2(K, s=(H, W), norm="ortho")
        else:
            K = torch.zeros(re.shape[0], H, W, dtype=ct, device=r.device)
            K[:, :, cols] = torch.complex(re, im)
            X = torch.fft.ifft2(K, norm="ortho").real
        return _vectors(X.contiguous(), one)

    # squared entries: cos^2(theta)/(HW) = (1 + cos 2 theta)/(2HW), sin^2 = (1 - cos 2 theta)/(2HW), so both
    # products of the squared operator are one FFT at the doubled frequencies (2k mod H, 2c mod W)
    k2 = (2 * torch.arange(H, device=device)) % H
    c2 = (2 * cols) % W

    def fwd_sq(v):
        X, one = _images(v, H, W)
        tot = X.sum((1, 2)).reshape(-1, 1, 1)
        C = torch.fft.fft2(X).real[:, k2][:, :, c2]  # (k, H, m): sum_pq v cos(2 theta)
        return rows_out((tot + C) / (2 * H * W), (tot - C) / (2 * H * W), one)

    def adj_sq(r):
        re, im, one = rows_in(r)
        k = re.shape[0]
        K = torch.zeros(k, H, W, dtype=r.dtype, device=r.device)
        idx = (torch.arange(k, device=r.device).view(k, 1, 1).expand(k, H, m), k2.view(1, H, 1).expand(k, H, m),
               c2.view(1, 1, m).expand(k, H, m))
        K.index_put_(idx, re - im, accumulate=True)
        # sum_kc a_kc cos(2 theta_kc(p, q)) = Re(H W ifft2(K))
        X = torch.fft.ifft2(K).real * (H * W) + (re + im).sum((1, 2)).reshape(k, 1, 1)
        return _vectors((X / (2 * H * W)).contiguous(), one)

    # circulant symbol of X^T diag(w) X: the row Re(F u)_{k,c} is <u, Re f>, f the Fourier mode of omega = (k, c), so
    # |F row|^2 is 1/4 at omega and at -omega (Im rows alike), or, when omega = -omega, 1 for Re and 0 for Im
    kk = torch.arange(H, device=device)
    nk, nc = (-kk) % H, (-cols) % W
    self_conj = (kk == nk).view(H, 1) & (cols == nc).view(1, m)  # (H, m)

    def symbol(w):
        wr, wi = w[:H * m].reshape(m, H).transpose(0, 1), w[H * m:].reshape(m, H).transpose(0, 1)
        a = 0.25 * (wr + wi)
        S = torch.zeros(H, W, dtype=w.dtype, device=w.device)
        S.index_put_((kk.view(H, 1).expand(H, m), cols.view(1, m).expand(H, m)), torch.where(self_conj, wr, a),
                     accumulate=True)
        S.index_put_((nk.view(H, 1).expand(H, m), nc.view(1, m).expand(H, m)),
                     torch.where(self_conj, torch.zeros_like(a), a), accumulate=True)
        return CirculantSymbol((H, W), S[:, : W // 2 + 1].contiguous())

    shape = (2 * H * m, H * W)
    sq = FunctionOperator(fwd_sq, adj_sq, shape, dtype=dtype, device=device, batched=True)
    def tiles(w, t):
        # X^T diag(w) X is circulant for one weight on every row: each tile's block is the symbol's tile block
        if t < 1 or H % t or W % t or not bool((w == w[0]).all()):
            return None
        blk = symbol(w).tile_block(t)
        return TileBlocks((H, W), t, blk.expand((H // t) * (W // t), t * t, t * t).clone())

    return FunctionOperator(fwd, adj, shape, dtype=dtype, device=device, batched=True, squared=sq,
                            gram_symbol=symbol, gram_tiles=tiles)


def phase_encode_scores(factor, H, W, noise_var=1.0, candidates=None, chunk_size=32):
    r"""``Delta_c = log|I + X_c Cov X_c^T / sigma^2|`` for candidate k-space columns ``c`` (Seeger 2010 §2.2),
    ``X_c`` = :func:`fourier_columns_operator` of the single column ``c``, ``Cov = F F^T``.

    Matrix-free and without a linear solve per candidate: the ``k`` columns of ``F``, read as images, go
    through one real 2-D FFT (``torch.fft.rfft2``, ``chunk_size`` at a time), which gives ``X_c F`` for every
    column ``c = 0 .. W/2`` at once; each score is then a ``min(2H, k)``-sized log-determinant of
    ``I + W_c^T W_c / sigma^2`` (``W_c = X_c F``, ``2H x k``). For a real image column ``W - c`` of the DFT
    is the complex conjugate of column ``c`` with its rows reversed (``X_{W-c} = P X_c``, ``P`` a signed
    permutation), so its score equals that of ``c``; candidates above ``W/2`` are scored as their mirror.

    Cost ``O(n k log n + N H k min(H, k))`` for ``N`` candidates, memory ``O(N H k) <= O(n k)`` besides ``F``.

    :param torch.Tensor factor: ``(H W, k)`` covariance factor (exact Cholesky,
        :func:`~pyro_convexvb.design.scores.lanczos_covariance_factor`, or :func:`covariance_factor`).
    :param int H: image height; :param int W: width.
    :param float noise_var: ``sigma^2`` of each real measurement of the new column.
    :param candidates: column indices in ``[0, W)`` (default all ``W``).
    :param int chunk_size: columns of ``F`` per FFT batch.
    :returns: ``(len(candidates),)`` scores (dtype and device of ``factor``).

    Example::

        >>> import math, torch
        >>> F = torch.eye(16, dtype=torch.float64)  # Cov = I; for 0 < c < W/2, X_c X_c^T = I/2 (2H = 8 rows)
        >>> d = phase_encode_scores(F, 4, 4, noise_var=1.0, candidates=[1, 3])
        >>> torch.allclose(d, torch.full_like(d, 8 * math.log(1.5)))
        True
    """
    _check_shape(H, W)
    noise_var = check_noise_var(noise_var)
    if not torch.is_tensor(factor) or factor.dim() != 2 or factor.shape[0] != H * W:
        raise ValueError(f"factor: expected a tensor of shape ({H * W}, k), got "
                         f"{tuple(factor.shape) if torch.is_tensor(factor) else type(factor).__name__}")
    if factor.is_complex() or not factor.is_floating_point() or not bool(torch.isfinite(factor).all()):
        raise ValueError("factor: expected a real floating-point tensor without NaN/inf")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")
    cand = torch.arange(W) if candidates is None else torch.as_tensor(_index_list(candidates, "candidates"),
                                                                      dtype=torch.long)
    if cand.dim() != 1 or cand.numel() == 0 or int(cand.min()) < 0 or int(cand.max()) >= W:
        raise ValueError(f"candidates: expected a non-empty list of column indices in [0, {W})")
    mirror = torch.minimum(cand, (W - cand) % W)
    uniq, inverse = torch.unique(mirror, return_inverse=True)
    uniq = uniq.to(factor.device)
    k, N = factor.shape[1], uniq.numel()
    Wc = factor.new_empty(N, 2 * H, k)
    for s in range(0, k, chunk_size):
        e = min(k, s + chunk_size)
        Kf = torch.fft.rfft2(factor[:, s:e].transpose(0, 1).reshape(e - s, H, W), norm="ortho")[:, :, uniq]
        Wc[:, :H, s:e] = Kf.real.permute(2, 1, 0)
        Wc[:, H:, s:e] = Kf.imag.permute(2, 1, 0)
    return _logdet_eye_plus(Wc, noise_var)[inverse.to(factor.device)]


def compressive_sensing_model(y, H, W, columns, noise_var, tau_a, tau_r, levels=None):
    r"""Sparse linear model of Seeger 2010 §5 for an ``(H, W)`` image from k-space columns, Eq. (1):

    .. math:: P(u | y) \propto N(y | X u, \sigma^2 I) \prod_{j} e^{-\tau_j |s_j / \sigma|}, \qquad
              s = B u = \begin{bmatrix} B_a \\ B_r \end{bmatrix} u,

    ``X`` = :func:`fourier_columns_operator` of ``columns``, ``B_a`` = :func:`haar_operator` (``tau_j = tau_a``),
    ``B_r`` = :func:`difference_operator` (``tau_j = tau_r``), and a flat (improper) prior on ``u``
    (``B_a`` is invertible, so the posterior is proper). The Laplace sites have scale ``b_j = sigma / tau_j``
    (:class:`~pyro_convexvb.lgm.sites.Laplace`). All three operators are matrix-free.

    Site groups, in order: ``"y"`` (Gaussian, ``2 H |columns|`` rows), ``"wavelet"`` (``H W`` Laplace sites),
    ``"differences"`` (``H(W-1) + (H-1)W`` Laplace sites).

    :param torch.Tensor y: ``(2 H |columns|,)`` measurements, ordered as :func:`fourier_columns_operator`'s rows.
    :param int H: image height (power of 2); :param int W: width (power of 2).
    :param columns: measured k-space columns.
    :param float noise_var: ``sigma^2`` of every real measurement.
    :param float tau_a: wavelet scale ``tau_a``; :param float tau_r: difference scale ``tau_r`` (Seeger 2010 §5 uses
        ``0.08``, ``0.16`` with ``sigma^2 = 10^{-3}`` on 256x256 images in ``[0, 1]``). Each a positive finite
        number: Python, NumPy or a one-element torch tensor.
    :param levels: Haar levels (default: all).
    :returns: :class:`~pyro_convexvb.LatentGaussianModel` with ``n = H W`` (dtype/device of ``y``).

    Example::

        >>> import torch
        >>> from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation
        >>> u = torch.rand(8, 8, dtype=torch.float64).reshape(-1)
        >>> y = fourier_columns_operator(8, 8, [0, 1]).mv(u)
        >>> lgm = compressive_sensing_model(y, 8, 8, [0, 1], noise_var=1e-3, tau_a=0.08, tau_r=0.16)
        >>> res = ConvexVariationalRelaxation(lgm, variance="exact", progress=False).run()
        >>> res.posterior.loc.shape
        torch.Size([64])
    """
    from ..lgm.layout import LatentLayout
    from ..lgm.model import LatentGaussianModel, PriorBlock, SiteGroup
    from ..lgm.sites import Gaussian, Laplace

    _check_shape(H, W, pow2=True)
    noise_var, tau_a, tau_r = (positive_number(v, name) for name, v in (("noise_var", noise_var), ("tau_a", tau_a),
                                                                        ("tau_r", tau_r)))
    if not torch.is_tensor(y) or y.dim() != 1:
        raise ValueError("y: expected a 1-D tensor of measurements")
    if not y.is_floating_point() or not bool(torch.isfinite(y).all()):
        raise ValueError("y: expected finite floating-point measurements")
    dt, dev = y.dtype, y.device
    X = fourier_columns_operator(H, W, columns, dtype=dt, device=dev)
    if y.shape[0] != X.shape[0]:
        raise ValueError(f"y: expected {X.shape[0]} measurements (2 H |columns|), got {y.shape[0]}")
    Ba = haar_operator(H, W, levels, dtype=dt, device=dev)
    Br = difference_operator(H, W, dtype=dt, device=dev)
    sigma = math.sqrt(noise_var)
    n = H * W

    def group(name, B, b):
        q = B.shape[0]
        return SiteGroup(name, Laplace(torch.full((q,), b, dtype=dt, device=dev)), B,
                         torch.zeros(q, dtype=dt, device=dev), (q,))

    obs = SiteGroup("y", Gaussian(y, torch.full_like(y, sigma)), X, torch.zeros_like(y), tuple(y.shape))
    layout = LatentLayout.from_shapes([("u", (n,))], [1])
    prior = PriorBlock("u", torch.zeros(n, dtype=dt, device=dev), flat=True)
    return LatentGaussianModel(layout, [prior], [obs, group("wavelet", Ba, sigma / tau_a),
                                                 group("differences", Br, sigma / tau_r)])


def covariance_factor(result, pca_rank=None, score_steps=None):
    r"""``F`` (``(n, k)``) with ``F F^T`` the posterior covariance ``Cov_Q[u] = A^{-1}`` of a
    :class:`~pyro_convexvb.infer.convex_relaxation.ConvexVariationalRelaxation` fit (``sigma^2 = 1``), in the
    representation its variances used (Seeger 2010 §3):

    * ``variance="exact"``: ``F = L^{-T}``, ``A = L L^T`` (``k = n``);
    * ``"lanczos"``: K-Lanczos ``F F^T = Q_K T_K^{-1} Q_K^T`` (:func:`~.scores.lanczos_covariance_factor`);
      with ``score_steps = K_s < K`` only the first ``K_s`` Lanczos vectors are used,
      ``F = Q_{K_s} L_{K_s}^{-T}`` with ``L_{K_s}`` the leading block of the Cholesky factor of ``T_K``
      (``T_{K_s}`` is the leading block of ``T_K``): the covariance of a ``K_s``-step run from the same start
      vector, the ``K_var / K_score`` split of Seeger 2010 §5 at no extra matrix-vector product;
    * ``"pca"``: L-PCA ``F = U_L Lambda_L^{-1/2}`` from the ``L`` smallest Ritz pairs of the run.

    :param result: the engine's :class:`~pyro_convexvb.InferenceResult`.
    :param pca_rank: ``L`` for ``"pca"`` fits, at most the run's number of Ritz pairs (default: the ``L`` of the
        fit, ``state.pca_rank``); refused for the other methods.
    :param score_steps: ``K_score <= K`` for ``"lanczos"`` fits of single-vector Lanczos (default: all ``K``
        steps); refused for the other methods.
    :returns: ``(n, k)`` tensor, for :func:`phase_encode_scores` or :func:`~.scores.design_score`.

    Example::

        >>> import torch
        >>> from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation
        >>> u = torch.rand(8, 8, dtype=torch.float64).reshape(-1)
        >>> y = fourier_columns_operator(8, 8, [0, 1]).mv(u)
        >>> lgm = compressive_sensing_model(y, 8, 8, [0, 1], 1e-3, 0.08, 0.16)
        >>> res = ConvexVariationalRelaxation(lgm, variance="lanczos", lanczos_rank=10, progress=False).run()
        >>> covariance_factor(res).shape
        torch.Size([64, 10])
    """
    st = getattr(result, "state", None)
    method = getattr(st, "variance_method", None)
    if method is None:
        raise TypeError(f"result: expected the InferenceResult of a convex_relaxation fit, got {type(result).__name__}")
    for name, v in (("score_steps", score_steps), ("pca_rank", pca_rank)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
    if score_steps is not None and method != "lanczos":
        raise ValueError(f"score_steps: only K-Lanczos fits can be truncated (this fit used {method!r})")
    if pca_rank is not None and method != "pca":
        raise ValueError(f"pca_rank: only L-PCA fits (variance='pca') have a PCA rank (this fit used {method!r})")
    if method == "exact":
        L = st.cholesky
        eye = torch.eye(L.shape[0], dtype=L.dtype, device=L.device)
        return torch.linalg.solve_triangular(L, eye, upper=False).transpose(0, 1)
    res = st.lanczos
    if res is None:
        raise ValueError("result: holds no Lanczos factors (was it fitted with max_outer >= 0 by this engine?)")
    if method == "lanczos":
        if score_steps is not None and score_steps > res.k:
            raise ValueError(f"score_steps: the fit ran {res.k} Lanczos steps, got {score_steps}")
        if score_steps is None or score_steps == res.k:
            return lanczos_covariance_factor(res)
        if getattr(res, "block_size", None) != 1 or not hasattr(res, "cholesky_L"):
            raise ValueError("score_steps: needs a single-vector K-Lanczos run (lanczos_block_size=1, K-Lanczos "
                             "estimator)")
        Ls = res.cholesky_L()[:score_steps, :score_steps]
        return torch.linalg.solve_triangular(Ls, res.Q[:, :score_steps].transpose(0, 1), upper=False).transpose(0, 1)
    if method == "pca":
        if pca_rank is not None and pca_rank > res.k:
            raise ValueError(f"pca_rank: the fit has {res.k} Ritz pairs, got {pca_rank}")
        L = min(pca_rank if pca_rank is not None else st.pca_rank, res.k)
        U = res.ritz_vectors(torch.arange(L, device=res.Q.device))
        return U / torch.sqrt(res.ritz_values[:L])
    raise ValueError(f"result: unknown variance method {method!r}")
