r"""Two-dimensional circulant matrices in the Fourier basis, and T. Chan's optimal circulant approximation.

Vectors of length ``n = H W`` are images of shape ``(H, W)``, row-major. A (doubly) circulant matrix is
``C = F^H diag(lambda) F`` with ``F`` the unitary 2-D DFT (``torch.fft.fft2(., norm="ortho")``); a real
symmetric one has a real symbol with ``lambda(omega) = lambda(-omega)``, so the half spectrum of
``torch.fft.rfft2`` (``(H, W // 2 + 1)``) holds all of it and products and solves are two real FFTs.

T. Chan's optimal circulant approximation of a matrix ``A`` (Chan 1988, "An optimal circulant preconditioner
for Toeplitz systems", SIAM J. Sci. Stat. Comput. 9(4)) is ``c(A) = argmin_{C circulant} ||C - A||_F``, with symbol
``lambda(omega) = (F A F^H)_{omega omega}``. For ``A = B^T diag(w) B`` this is
``lambda(omega) = sum_j w_j |(F b_j)(omega)|^2`` (``b_j`` the rows of ``B``), and when the rows fall into
*classes of translates* (every row of a class is a shift of one representative ``b_t``, e.g. the rows of a
convolution, or the coefficients of one wavelet subband) ``|F b_j|^2 = |F b_t|^2`` within a class, so

.. math:: \lambda(\omega) = \sum_t \Big(\sum_{j \in t} w_j\Big) \, |(F b_t)(\omega)|^2 ,

one small matrix product with the ``T`` precomputed spectra (:func:`shift_class_symbol`). Operators report
this symbol through ``op.gram_symbol(w)`` (:meth:`~.operators.LinearOperator.gram_symbol`).
"""
from dataclasses import dataclass

import torch

__all__ = ["CirculantSymbol", "shift_class_symbol"]


@dataclass
class CirculantSymbol:
    r"""A real symmetric 2-D circulant matrix ``C = F^H diag(lambda) F`` on ``(H, W)`` images.

    :ivar grid: ``(H, W)``.
    :ivar values: ``(H, W // 2 + 1)`` real half spectrum of ``lambda`` (the ``rfft2`` frequencies), with
        ``lambda(k, c) = lambda(-k, -c)`` (checked on the columns ``0`` and ``W/2``).

    Example::

        >>> import torch
        >>> lam = torch.full((4, 3), 2.0, dtype=torch.float64)  # C = 2 I on 4 x 4 images
        >>> C = CirculantSymbol((4, 4), lam)
        >>> r = torch.randn(16, dtype=torch.float64)
        >>> torch.allclose(C.solve(C.mv(r)), r), torch.allclose(C.mv(r), 2 * r)
        (True, True)
    """

    grid: tuple
    values: torch.Tensor

    def __post_init__(self):
        H, W = (int(x) for x in self.grid)
        self.grid = (H, W)
        if self.values.shape != (H, W // 2 + 1):
            raise ValueError(f"values: expected the half spectrum of shape {(H, W // 2 + 1)}, got "
                             f"{tuple(self.values.shape)}")
        # columns 0 and W/2 of the half spectrum hold both omega and -omega: they must agree
        v = self.values
        edge = v[:, [0, W // 2]] if W % 2 == 0 else v[:, :1]
        mirror = edge[(-torch.arange(H, device=v.device)) % H]
        scale = float(v.abs().max()) if v.numel() else 0.0
        if not torch.allclose(edge, mirror, rtol=1e-5, atol=1e-6 * scale):
            raise ValueError("values: not the symbol of a real symmetric circulant (lambda(k, c) != lambda(-k, -c) "
                             "on the columns c = 0 and W/2)")

    def __add__(self, other):
        if not isinstance(other, CirculantSymbol):
            return NotImplemented
        if other.grid != self.grid:
            raise ValueError(f"cannot add circulant symbols on grids {self.grid} and {other.grid}")
        return CirculantSymbol(self.grid, self.values + other.values)

    def _apply(self, r, f):
        H, W = self.grid
        one = r.dim() == 1
        R = (r.unsqueeze(-1) if one else r).transpose(0, 1).reshape(-1, H, W)
        out = torch.fft.irfft2(f(torch.fft.rfft2(R, norm="ortho")), s=(H, W), norm="ortho")
        out = out.reshape(out.shape[0], -1).transpose(0, 1)
        return out[:, 0] if one else out.contiguous()

    def mv(self, r):
        """``C r`` for ``r`` of shape ``(n,)`` or ``(n, k)`` (real)."""
        return self._apply(r, lambda K: K * self.values)

    def solve(self, r):
        """``C^{-1} r`` for ``r`` of shape ``(n,)`` or ``(n, k)`` (real); ``lambda`` must be nonzero."""
        return self._apply(r, lambda K: K / self.values)

    def full(self):
        """``lambda`` on all ``H x W`` frequencies (``fft2`` order)."""
        H, W = self.grid
        half = self.values
        k = (-torch.arange(H, device=half.device)) % H
        c = torch.arange(W // 2 + 1, W, device=half.device)
        rest = half[k][:, (W - c) % W]  # lambda(k, c) = lambda(-k, -c) for the columns above W / 2
        return torch.cat([half, rest], 1)

    def tile_block(self, t):
        """The ``(t^2, t^2)`` block of ``C`` on any aligned ``t x t`` tile (offsets ``o = (i % t) t + j % t``):
        ``C_{p p'} = c(p - p')`` with ``c = ifft2(lambda)`` the first column."""
        H, W = self.grid
        c = torch.fft.irfft2(self.values, s=(H, W))  # C e_0: (1/n) sum_omega lambda(omega) e^{i omega p}
        o = torch.arange(t * t, device=c.device)
        di = ((o // t).view(-1, 1) - (o // t).view(1, -1)) % H
        dj = ((o % t).view(-1, 1) - (o % t).view(1, -1)) % W
        return c[di, dj]

    def diagonal_value(self):
        """The (constant) diagonal entry of ``C``: the mean of ``lambda`` over all frequencies."""
        return self.full().mean()


def shift_class_symbol(op, classes, grid):
    r"""``w -> `` the symbol of T. Chan's optimal circulant approximation of ``op^T diag(w) op`` (module docstring),
    for an operator whose rows fall into classes of translates.

    The ``T`` spectra ``|F b_t|^2`` are computed once here (``T`` products with ``op^T``, one ``rfft2``); each call
    is then a ``bincount`` of ``w`` over the classes and a ``(T,) x (T, H (W/2+1))`` product.

    :param op: a :class:`~.operators.LinearOperator` of shape ``(q, H W)``.
    :param classes: ``(q,)`` integer class of each row, ``0 .. T-1``, every class non-empty; rows of a class must be
        (cyclic) translates of each other -- the caller's promise, which the symbol's exactness rests on.
    :param grid: ``(H, W)``.
    :returns: callable ``w`` (``(q,)``) ``->`` :class:`CirculantSymbol`.

    Example::

        >>> import torch
        >>> from pyro_convexvb.linalg import DenseOperator
        >>> B = DenseOperator(torch.eye(4, dtype=torch.float64))  # rows: the 4 shifts of a delta (one class)
        >>> sym = shift_class_symbol(B, torch.zeros(4, dtype=torch.long), (2, 2))
        >>> sym(torch.full((4,), 3.0, dtype=torch.float64)).values.tolist()  # c(3 I) = 3 I
        [[3.0, 3.0], [3.0, 3.0]]
    """
    H, W = (int(x) for x in grid)
    classes = torch.as_tensor(classes, dtype=torch.long, device=op.device)
    q = op.shape[0]
    if op.shape[1] != H * W or classes.shape != (q,):
        raise ValueError(f"shift_class_symbol: expected an operator with {H * W} columns and one class per row "
                         f"({q},), got shapes {tuple(op.shape)} and {tuple(classes.shape)}")
    T = int(classes.max()) + 1
    first = torch.full((T,), q, dtype=torch.long, device=classes.device)
    first.scatter_reduce_(0, classes, torch.arange(q, device=classes.device), reduce="amin")
    if bool((first == q).any()):
        raise ValueError("shift_class_symbol: classes must be 0 .. T-1 with every class non-empty")
    E = torch.zeros(q, T, dtype=op.dtype, device=op.device)
    E[first, torch.arange(T, device=op.device)] = 1
    reps = op.rmv(E).transpose(0, 1).reshape(T, H, W)  # row t's representative b_t as an image
    spectra = torch.fft.rfft2(reps, norm="ortho").abs().square().reshape(T, -1)  # (T, H (W/2+1))

    def symbol(w):
        w = torch.as_tensor(w, dtype=op.dtype, device=op.device)
        if w.dim() == 0:
            w = w.expand(q)
        sums = torch.zeros(T, dtype=op.dtype, device=op.device).index_add_(0, classes, w)
        return CirculantSymbol((H, W), (sums @ spectra).reshape(H, W // 2 + 1))

    return symbol
