r"""Block diagonals on image tiles: ``blockdiag`` of an ``n x n`` matrix over aligned ``t x t`` pixel tiles.

Vectors of length ``n = H W`` are row-major ``(H, W)`` images; tile ``k`` holds the pixels ``(i, j)`` with
``(i // t) (W / t) + j // t = k``, its offset ``o = (i % t) t + j % t``. :class:`TileBlocks` stores the
``(H W / t^2, t^2, t^2)`` diagonal blocks and solves with them (block Jacobi). Operators on images report the
tile blocks of ``B^T diag(w) B`` through ``op.gram_tiles(w, t)``
(:meth:`~.operators.LinearOperator.gram_tiles`); :func:`rows_in_tiles_blocks` computes them for rows that each lie
inside one tile, from ``t^2`` products with "comb" vectors done once.
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
        self._chol = self._inv = None

    def __add__(self, other):
        if not isinstance(other, TileBlocks):
            return NotImplemented
        if other.grid != self.grid or other.tile != self.tile:
            raise ValueError(f"cannot add tile blocks on {self.grid}/{self.tile} and {other.grid}/{other.tile}")
        return TileBlocks(self.grid, self.tile, self.blocks + other.blocks)

    def _to_tiles(self, r):
        """``(n,)`` or ``(n, k)`` -> ``(tiles, t^2, k)`` by a reshape and a permutation (no index gather)."""
        H, W = self.grid
        t = self.tile
        one = r.dim() == 1
        R = r.unsqueeze(-1) if one else r
        k = R.shape[1]
        G = R.reshape(H // t, t, W // t, t, k).permute(0, 2, 1, 3, 4).reshape(-1, t * t, k)
        return G, one

    def _from_tiles(self, G, one):
        H, W = self.grid
        t = self.tile
        k = G.shape[2]
        out = G.reshape(H // t, W // t, t, t, k).permute(0, 2, 1, 3, 4).reshape(H * W, k)
        return out[:, 0] if one else out

    def mv(self, r):
        """``blockdiag(blocks) r`` for ``r`` of shape ``(n,)`` or ``(n, k)``."""
        G, one = self._to_tiles(r)
        return self._from_tiles(self.blocks @ G, one)

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

    def inverse(self):
        """The inverse blocks ``(tiles, t^2, t^2)`` from the Cholesky factors, symmetrised (computed once)."""
        if self._inv is None:
            inv = torch.cholesky_inverse(self.cholesky())
            self._inv = 0.5 * (inv + inv.transpose(1, 2))
        return self._inv

    def solve(self, r):
        """``blockdiag(blocks)^{-1} r`` for ``r`` of shape ``(n,)`` or ``(n, k)``: one batched product with the
        inverse blocks (:meth:`inverse`)."""
        G, one = self._to_tiles(r)
        return self._from_tiles(self.inverse() @ G, one)


def rows_in_tiles_blocks(op, grid, t, rows):
    r"""``w -> `` the tile blocks of ``sum_{j in rows} w_j b_j b_j^T`` for rows ``b_j`` of ``op`` that each lie inside
    one tile.

    Done once here: ``t^2`` products with the comb vectors ``c_o`` (``1`` at offset ``o`` of every tile) give
    ``(op c_o)_j``, the entry of row ``j`` at offset ``o`` of its tile, and ``op.squared()`` applied to the pixels'
    tile numbers gives each row's tile; the rows are then packed per tile into ``P`` (``(tiles, r, t^2)``, ``r`` the
    most rows of one tile, zero padded). Each call is one batched product ``P^T diag(w) P``. Memory
    ``O(tiles r t^2)``.

    :param op: :class:`~.operators.LinearOperator` ``(q, H W)`` with ``squared()``.
    :param grid: ``(H, W)``; :param int t: tile side.
    :param rows: ``(q,)`` boolean mask of the rows to include (each must lie inside one tile: the caller's promise).
    :returns: callable ``w`` (``(q,)``) ``->`` :class:`TileBlocks`.
    """
    H, W = (int(x) for x in grid)
    tile, off = tile_layout(H, W, t, op.device)
    n, t2, nt = H * W, t * t, (H // t) * (W // t)
    combs = torch.zeros(n, t2, dtype=op.dtype, device=op.device)
    combs[torch.arange(n, device=op.device), off] = 1
    idx = torch.nonzero(torch.as_tensor(rows, device=op.device)).reshape(-1)
    P = op.mv(combs)[idx]  # (m, t^2)
    sq = op.squared()
    norms = sq.mv(torch.ones(n, dtype=op.dtype, device=op.device))[idx]
    row_tile = torch.round(sq.mv(tile.to(op.dtype))[idx] / norms.clamp_min(torch.finfo(op.dtype).tiny)).long()
    order = torch.argsort(row_tile, stable=True)
    idx, P, row_tile = idx[order], P[order], row_tile[order]
    counts = torch.bincount(row_tile, minlength=nt)
    r = int(counts.max()) if counts.numel() else 0
    first = torch.cumsum(counts, 0) - counts
    slot = torch.arange(idx.numel(), device=op.device) - first[row_tile]
    packed = torch.zeros(nt, r, t2, dtype=op.dtype, device=op.device)
    packed[row_tile, slot] = P
    where = torch.full((nt, r), -1, dtype=torch.long, device=op.device)
    where[row_tile, slot] = idx
    pad = where < 0
    where = where.clamp_min(0)

    def blocks(w):
        wp = torch.where(pad, torch.zeros((), dtype=w.dtype, device=w.device), w[where])  # (tiles, r)
        return TileBlocks((H, W), t, packed.transpose(1, 2) @ (wp.unsqueeze(-1) * packed))

    return blocks
