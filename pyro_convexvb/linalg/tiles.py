r"""Block diagonals on image tiles: ``blockdiag`` of an ``n x n`` matrix over aligned ``t x t`` pixel tiles.

Vectors of length ``n = H W`` are row-major ``(H, W)`` images; tile ``k`` holds the pixels ``(i, j)`` with
``(i // t) (W / t) + j // t = k``, its offset ``o = (i % t) t + j % t``. :class:`TileBlocks` stores the
``(H W / t^2, t^2, t^2)`` diagonal blocks and solves with them (block Jacobi). Operators on images report the
tile blocks of ``B^T diag(w) B`` through ``op.gram_tiles(w, t)``
(:meth:`~.operators.LinearOperator.gram_tiles`); :func:`rows_in_tiles_blocks` computes them for rows that each lie
inside one tile, by ``t^2`` products with "comb" vectors.
"""
from dataclasses import dataclass

import torch

__all__ = ["TileBlocks", "tile_layout", "rows_in_tiles_blocks"]


def tile_layout(H, W, t, device=None):
    """``(tile, offset)`` of every pixel, two ``(H W,)`` long tensors; ``t`` must divide ``H`` and ``W``."""
    if t < 1 or H % t or W % t:
        raise ValueError(f"tile: expected a tile side dividing the image sides {H} x {W}, got {t}")
    i = torch.arange(H, device=device).view(H, 1).expand(H, W)
    j = torch.arange(W, device=device).view(1, W).expand(H, W)
    return ((i // t) * (W // t) + j // t).reshape(-1), ((i % t) * t + j % t).reshape(-1)


@dataclass
class TileBlocks:
    r"""The diagonal blocks of a symmetric matrix over the ``t x t`` tiles of an ``(H, W)`` image.

    :ivar grid: ``(H, W)``; :ivar tile: ``t``.
    :ivar blocks: ``(H W / t^2, t^2, t^2)``.

    Example::

        >>> import torch
        >>> tb = TileBlocks((2, 2), 2, 3 * torch.eye(4, dtype=torch.float64).unsqueeze(0))
        >>> torch.allclose(tb.solve(torch.ones(4, dtype=torch.float64)), torch.full((4,), 1 / 3, dtype=torch.float64))
        True
    """

    grid: tuple
    tile: int
    blocks: torch.Tensor

    def __post_init__(self):
        H, W = (int(x) for x in self.grid)
        self.grid, self.tile = (H, W), int(self.tile)
        t = self.tile
        if self.blocks.shape != ((H // t) * (W // t), t * t, t * t):
            raise ValueError(f"blocks: expected shape {((H // t) * (W // t), t * t, t * t)}, got "
                             f"{tuple(self.blocks.shape)}")
        self._chol = None

    def __add__(self, other):
        if not isinstance(other, TileBlocks):
            return NotImplemented
        if other.grid != self.grid or other.tile != self.tile:
            raise ValueError(f"cannot add tile blocks on {self.grid}/{self.tile} and {other.grid}/{other.tile}")
        return TileBlocks(self.grid, self.tile, self.blocks + other.blocks)

    def _gather(self, r):
        H, W = self.grid
        tile, off = tile_layout(H, W, self.tile, r.device)
        one = r.dim() == 1
        R = r.unsqueeze(-1) if one else r
        G = torch.empty(self.blocks.shape[0], self.tile ** 2, R.shape[1], dtype=R.dtype, device=R.device)
        G[tile, off] = R
        return G, tile, off, one

    def mv(self, r):
        """``blockdiag(blocks) r`` for ``r`` of shape ``(n,)`` or ``(n, k)``."""
        G, tile, off, one = self._gather(r)
        out = (self.blocks @ G)[tile, off]
        return out[:, 0] if one else out

    def cholesky(self):
        """Batched Cholesky factors of the blocks (computed once); :raises ValueError: if a block is not
        positive definite, naming its tile."""
        if self._chol is None:
            L, info = torch.linalg.cholesky_ex(self.blocks)
            bad = torch.nonzero(info).reshape(-1)
            if bad.numel():
                raise ValueError(f"tile blocks: block of tile {int(bad[0])} is not positive definite "
                                 f"({bad.numel()} such tiles)")
            self._chol = L
        return self._chol

    def solve(self, r):
        """``blockdiag(blocks)^{-1} r`` for ``r`` of shape ``(n,)`` or ``(n, k)``."""
        G, tile, off, one = self._gather(r)
        out = torch.cholesky_solve(G, self.cholesky())[tile, off]
        return out[:, 0] if one else out


def rows_in_tiles_blocks(op, w, grid, t, rows, chunk=None):
    r"""Tile blocks of ``sum_{j in rows} w_j b_j b_j^T`` for rows ``b_j`` of ``op`` that each lie inside one tile.

    ``t^2`` products with the comb vectors ``c_o`` (``1`` at offset ``o`` of every tile) give ``(op c_o)_j``,
    the entry of row ``j`` at offset ``o`` of its tile; the row's tile comes from ``op.squared()`` applied to the
    pixels' tile numbers. Memory ``O(q t^2 + chunk t^4)``, ``chunk`` rows at a time (default ``2^22 / t^4``).

    :param op: :class:`~.operators.LinearOperator` ``(q, H W)`` with ``squared()``.
    :param w: ``(q,)`` weights.
    :param grid: ``(H, W)``; :param int t: tile side.
    :param rows: ``(q,)`` boolean mask of the rows to include (each must lie inside one tile: the caller's promise).
    :returns: :class:`TileBlocks`.
    """
    H, W = (int(x) for x in grid)
    tile, off = tile_layout(H, W, t, op.device)
    n, t2 = H * W, t * t
    combs = torch.zeros(n, t2, dtype=op.dtype, device=op.device)
    combs[torch.arange(n, device=op.device), off] = 1
    P = op.mv(combs)  # (q, t^2)
    sq = op.squared()
    norms = sq.mv(torch.ones(n, dtype=op.dtype, device=op.device))
    row_tile = torch.round(sq.mv(tile.to(op.dtype)) / norms.clamp_min(torch.finfo(op.dtype).tiny)).long()
    idx = torch.nonzero(rows).reshape(-1)
    chunk = max(1, (1 << 22) // (t2 * t2)) if chunk is None else int(chunk)
    blocks = torch.zeros((H // t) * (W // t), t2, t2, dtype=op.dtype, device=op.device)
    for s in range(0, idx.numel(), chunk):
        j = idx[s:s + chunk]
        Pj = P[j]
        blocks.index_add_(0, row_tile[j], w[j].view(-1, 1, 1) * Pj.unsqueeze(2) * Pj.unsqueeze(1))
    return TileBlocks((H, W), t, blocks)
