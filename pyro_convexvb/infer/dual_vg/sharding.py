r"""Reductions over the sites of a row-sharded dual problem (``torch.distributed``).

In the ``L``-space form of the dual (Khan et al. 2013, Eq. 20 with ``A = Sigma^{-1} + W^T Lambda W``)
every rank holds its own rows of the design ``W`` and the dual variables ``alpha``, ``lambda`` of its
own sites; latent-sized quantities (``W^T alpha``, ``W^T Lambda W``, the posterior over ``z``) are
all-reduced and so replicated. What stays to reduce are the sums over sites: the ``sum f*`` and
``alpha^T m`` terms of the objective, the duality gap, inner products of site vectors in the Newton-CG
and L-BFGS iterations, and the fraction-to-boundary step (a minimum over sites). :class:`SiteReduction`
does these; :data:`LOCAL` is the single-process one (no communication, bit-for-bit the former code path).

Every convergence and line-search decision is taken from reduced values, which ``all_reduce``
makes identical on every rank, so all ranks take the same branches.
"""
import math

__all__ = ["SiteReduction", "LOCAL", "site_reduction", "sharded_design", "local_operator"]


class _Local:
    """Sums over the sites of one process (no communication)."""

    active = False

    def sum(self, t):
        return t

    def dot(self, a, b):
        return float(a @ b)

    def norm(self, a):
        return float(a.norm())

    def min(self, x):
        return float(x)

    def all(self, flag):
        return bool(flag)

    def count(self, n):
        return int(n)


LOCAL = _Local()


class SiteReduction(_Local):
    """Sums over the sites of all ranks, through the process group's
    :class:`~pyro_convexvb.distributed.Communicator` (one ``all_reduce`` each).

    :param comm: the communicator (default: the world's).

    Example (one process: every reduction is the identity)::

        >>> import torch
        >>> SiteReduction().dot(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        3.0
    """

    active = True

    def __init__(self, comm=None):
        from ... import distributed

        self.comm = distributed.WORLD if comm is None else comm

    def sum(self, t):
        return self.comm.sum(t)

    def dot(self, a, b):
        return float(self.comm.sum(a @ b))

    def norm(self, a):
        return math.sqrt(max(self.dot(a, a), 0.0))

    def min(self, x):
        return float(self.comm.min(float(x)))

    def all(self, flag):
        return self.comm.all(flag)

    def count(self, n):
        return int(round(float(self.comm.sum(float(n)))))


def site_reduction(obj):
    """The reduction a backend (or any object with a ``comm`` attribute) carries; :data:`LOCAL` if none."""
    comm = getattr(obj, "comm", None)
    return LOCAL if comm is None else comm


def local_operator(W):
    """The operator of this rank's rows: ``W`` with every :class:`~pyro_convexvb.distributed.RowShardedOperator`
    replaced by its local rows (products without communication).

    :raises NotImplementedError: when a row-sharded design sits inside an operator other than a vertical
        stack (its local part cannot be separated).
    """
    from ...distributed import RowShardedOperator
    from ...linalg.operators import StackedOperator

    if isinstance(W, RowShardedOperator):
        return W.local
    if isinstance(W, StackedOperator):
        return StackedOperator([local_operator(op) for op in W.operators])
    from ...distributed import _walk

    if any(isinstance(node, RowShardedOperator) for node in _walk(W, set())):
        raise NotImplementedError(f"a row-sharded design inside {type(W).__name__} is not supported here; wrap the "
                                  "whole design of each likelihood with pcv.distributed.row_sharded")
    return W


def sharded_design(W):
    """``(local operator, SiteReduction)`` for a row-sharded design under an active process group, else
    ``(W, None)``.

    A vertical stack of site groups is sharded when every group is; a stack mixing row-sharded and
    replicated groups is refused (its replicated rows would be counted once per rank).

    :raises ValueError: for such a mixed stack.
    """
    from ...distributed import comm_of
    from ...linalg.operators import StackedOperator

    comm = comm_of(W)
    if comm is None:
        return W, None
    if isinstance(W, StackedOperator):
        flags = [comm_of(op) is not None for op in W.operators]
        if not all(flags):
            raise ValueError("dual_vg: the model mixes row-sharded designs (pcv.distributed.row_sharded) with "
                             "designs given in full on every rank; shard every likelihood's rows, or none")
    return local_operator(W), SiteReduction(comm)
