r"""The row-sharded dual problem's design (``torch.distributed``): this rank's rows and the reduction over sites.

In the ``L``-space form of the dual (Khan et al. 2013, Eq. 20 with ``A = Sigma^{-1} + W^T Lambda W``)
every rank holds its own rows of the design ``W`` and the dual variables ``alpha``, ``lambda`` of its
own sites; latent-sized quantities (``W^T alpha``, ``W^T Lambda W``, the posterior over ``z``) are
all-reduced and so replicated. What stays to reduce are the sums over sites: the ``sum f*`` and
``alpha^T m`` terms of the objective, the duality gap, inner products of site vectors in the Newton-CG
and L-BFGS iterations, and the fraction-to-boundary step (a minimum over sites). They go through the
backend's :class:`~pyro_convexvb.distributed.Communicator` (:func:`~pyro_convexvb.distributed.reduction_of`;
:data:`~pyro_convexvb.distributed.LOCAL` on one process, no communication).

Every convergence and line-search decision is taken from reduced values, which ``all_reduce``
makes identical on every rank, so all ranks take the same branches.
"""
# the former names of the reductions, now pyro_convexvb.distributed's
from ...distributed import LOCAL, reduction_of as site_reduction, Communicator as SiteReduction  # noqa: F401

__all__ = ["sharded_design", "local_operator"]


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
    """``(local operator, communicator)`` for a row-sharded design under an active process group (the
    :class:`~pyro_convexvb.distributed.Communicator` its sums over sites go through), else ``(W, None)``.

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
    return local_operator(W), comm
