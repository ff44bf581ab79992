"""How a flat latent vector ``u`` maps to the latent sites of a Pyro model."""
from dataclasses import dataclass, field
from typing import List, Tuple

import torch


@dataclass
class LatentBlock:
    """One latent Pyro site occupying ``u[start:start + size]`` (row-major flattening of ``shape``)."""

    name: str
    shape: Tuple[int, ...]
    start: int
    event_dim: int = 0

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def slice(self):
        return slice(self.start, self.start + self.size)


@dataclass
class LatentLayout:
    """Ordered latent blocks; ``flatten``/``unflatten`` convert between dicts of site values and ``u``.

    :param blocks: the latent sites in model order.

    Example::

        >>> layout = LatentLayout.from_shapes([("w", (3,)), ("b", ())])
        >>> layout.size
        4
        >>> sorted(layout.unflatten(torch.arange(4.)).keys())
        ['b', 'w']
    """

    blocks: List[LatentBlock] = field(default_factory=list)

    @classmethod
    def from_shapes(cls, named_shapes, event_dims=None):
        blocks, start = [], 0
        for i, (name, shape) in enumerate(named_shapes):
            ev = 0 if event_dims is None else event_dims[i]
            b = LatentBlock(name, tuple(int(s) for s in shape), start, ev)
            blocks.append(b)
            start += b.size
        return cls(blocks)

    @property
    def size(self):
        return sum(b.size for b in self.blocks)

    @property
    def names(self):
        return [b.name for b in self.blocks]

    def __getitem__(self, name):
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(name)

    def blocks_at(self, mask):
        """The blocks, in layout order, holding a ``True`` coordinate of the boolean ``mask`` ``(n,)`` (one pass over
        its nonzeros, not one test per block).

        Example::

            >>> layout = LatentLayout.from_shapes([("a", (2,)), ("b", ()), ("c", (3,))])
            >>> [b.name for b in layout.blocks_at(torch.tensor([False, False, False, False, True, True]))]
            ['c']
        """
        owner = self.__dict__.get("_owner")
        last = self.blocks[-1] if self.blocks else None
        if owner is None or owner.shape[0] != (last.start + last.size if last else 0):  # kept for the next call
            owner = torch.repeat_interleave(torch.arange(len(self.blocks)),
                                            torch.tensor([b.size for b in self.blocks], dtype=torch.int64))
            self.__dict__["_owner"] = owner
        hit = torch.unique(owner[torch.nonzero(mask.reshape(-1).cpu()).reshape(-1)])
        return [self.blocks[int(k)] for k in hit]

    def unflatten(self, u):
        """Split ``u`` of shape ``(..., n)`` into ``{site: tensor of shape (..., *site_shape)}``."""
        batch = u.shape[:-1]
        return {b.name: u[..., b.slice].reshape(batch + b.shape) for b in self.blocks}

    def flatten(self, values):
        """Concatenate ``{site: tensor (..., *site_shape)}`` into ``u`` of shape ``(..., n)``."""
        parts = []
        for b in self.blocks:
            v = values[b.name]
            batch = v.shape[: v.dim() - len(b.shape)]
            parts.append(v.reshape(batch + (b.size,)))
        return torch.cat(parts, -1)
