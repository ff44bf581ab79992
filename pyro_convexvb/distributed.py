r"""Row-sharded data on ``torch.distributed``: every rank holds its own rows, all get the same answer.

SPMD data parallelism (one process per rank, launched by ``torchrun``; gloo on CPU, NCCL on GPU).
Each rank loads its own rows of the design and wraps them with :func:`row_sharded`; the result is a
:class:`~pyro_convexvb.linalg.LinearOperator` over the *global* rows whose products follow one rule:

* latent-sized vectors (weights, the posterior over them, Lanczos vectors in latent space) are
  **replicated**, identical on every rank;
* site-sized vectors (one entry per data row) stay **local**;
* every sum over sites goes through one reduction, :func:`all_reduce_sum` (or a
  :class:`Communicator`'s ``sum``/``dot``), so ``X.rmv(u) = X_globalᵀ u_global`` is replicated.

This module owns every collective of the package: the reductions (:func:`all_reduce_sum`, ``_max``, ``_min``,
:func:`broadcast`, :func:`all_gather_object`, :func:`all_reduce_grads`), the autograd-aware pair
:func:`sum_over_ranks` / :func:`enter_local`, and the :class:`Communicator` through which engines sum over sites
(:data:`LOCAL` is the single-process one).

Without an initialised process group (or with one of size 1) nothing communicates and every function
here is the identity. Importing this module does not import ``torch.distributed``'s collectives beyond
what ``import torch`` already does.

Example (a single process: the sharded operator is the local one)::

    >>> import torch, pyro_convexvb as pcv
    >>> X = torch.eye(3, dtype=torch.float64)
    >>> Xs = pcv.distributed.row_sharded(X)
    >>> Xs.shape, Xs.global_rows
    ((3, 3), 3)
    >>> Xs.rmv(torch.ones(3, dtype=torch.float64)).tolist()
    [1.0, 1.0, 1.0]
"""
import atexit
import contextlib
import math
import os
import time

import torch

from .linalg.operators import DenseOperator, LinearOperator, as_operator

__all__ = [
    "init",
    "is_active",
    "local_only",
    "rank",
    "world_size",
    "all_reduce_sum",
    "all_reduce_max",
    "all_reduce_min",
    "all_reduce_grads",
    "sum_over_ranks",
    "enter_local",
    "broadcast",
    "row_sharded",
    "RowShardedOperator",
    "LocalOnlyOperator",
    "shard_sites",
    "Communicator",
    "LOCAL",
    "reduction_of",
    "comm_of",
    "find_comm",
    "reduce_sites",
    "shard_range",
    "all_gather_object",
    "sharded_estimator",
    "stats",
    "reset_stats",
]

_STATS = {"calls": 0, "bytes": 0, "seconds": 0.0, "by_numel": {}}


def _dist():
    import torch.distributed as dist

    return dist


def init(backend=None):
    """Initialise the default process group from ``torchrun``'s environment, if not done yet.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by ``torchrun``).
    Without them (a plain ``python`` run) nothing is initialised and ``(0, 1)`` is returned.  A group made here
    is destroyed at the interpreter's exit unless the script did so (with gloo, a group left to the exit aborted
    one rank in about a third of two-rank runs, after the fit).

    :param str backend: ``"gloo"`` or ``"nccl"``; default ``"nccl"`` when CUDA is available, else
        ``"gloo"``.
    :returns: ``(rank, world_size)``.

    Example::

        >>> import pyro_convexvb as pcv
        >>> pcv.distributed.init() if "WORLD_SIZE" not in __import__("os").environ else (0, 1)
        (0, 1)
    """
    dist = _dist()
    if not dist.is_available():
        return 0, 1
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return 0, 1
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        atexit.register(_destroy)  # a group left to the interpreter's exit may abort a rank as its threads stop
    return rank(), world_size()


def _destroy():
    """Tear the default process group down (at exit, when :func:`init` made it and it is still there)."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _initialised():
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


_DISABLED = [0]


def is_active():
    """``True`` when ``torch.distributed`` is available, initialised and has more than one rank (and not
    inside :func:`local_only`)."""
    return not _DISABLED[0] and _initialised() and _dist().get_world_size() > 1


@contextlib.contextmanager
def local_only():
    """Inside the block this process behaves as if no process group were active (no communication):
    e.g. to fit the full data on one rank as a single-process reference.

    Example::

        >>> with local_only():
        ...     is_active()
        False
    """
    _DISABLED[0] += 1
    try:
        yield
    finally:
        _DISABLED[0] -= 1


def rank():
    """This process's rank (0 without a process group, or inside :func:`local_only`)."""
    return _dist().get_rank() if _initialised() and not _DISABLED[0] else 0


def world_size():
    """Number of ranks (1 without a process group, or inside :func:`local_only`)."""
    return _dist().get_world_size() if _initialised() and not _DISABLED[0] else 1


def stats():
    """Counters of the reductions done so far on this rank: ``{"calls", "bytes", "seconds", "by_numel"}``,
    ``by_numel`` mapping a tensor size to ``[calls, seconds]`` (e.g. the ``n``-vectors of Lanczos steps)."""
    out = dict(_STATS)
    out["by_numel"] = {k: list(v) for k, v in _STATS["by_numel"].items()}
    return out


def reset_stats():
    """Zero the reduction counters of :func:`stats`."""
    _STATS.update(calls=0, bytes=0, seconds=0.0, by_numel={})


def _reduce(t, op):
    dist = _dist()
    scalar = not torch.is_tensor(t)
    x = torch.tensor(float(t), dtype=torch.float64) if scalar else t.detach().clone().contiguous()
    start = time.perf_counter()
    dist.all_reduce(x, op=op)
    sec = time.perf_counter() - start
    _STATS["seconds"] += sec
    _STATS["calls"] += 1
    _STATS["bytes"] += x.numel() * x.element_size()
    entry = _STATS["by_numel"].setdefault(x.numel(), [0, 0.0])
    entry[0] += 1
    entry[1] += sec
    return float(x) if scalar else x


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward; backward :class:`_EnterLocal` (the replicated gradient passes to each rank)."""

    @staticmethod
    def forward(ctx, t):
        return _reduce(t, _dist().ReduceOp.SUM)

    @staticmethod
    def backward(ctx, grad):
        return _EnterLocal.apply(grad)


class _EnterLocal(torch.autograd.Function):
    """Identity forward; backward :class:`_SumOverRanks` (each rank's gradient of a replicated input, summed)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return _SumOverRanks.apply(grad)


def sum_over_ranks(t):
    """Sum of a rank's local contribution ``t`` over ranks, differentiable: the backward passes the (replicated)
    gradient to every rank's ``t`` unchanged, and is itself differentiable (:func:`enter_local`), so Hessians of a
    replicated total work too. The identity without an active process group.

    Pair it with :func:`enter_local` on the replicated inputs the local contributions are computed from:
    ``F(z) = sum_over_ranks(f_r(enter_local(z)))`` has the gradient ``sum_r f_r'(z)`` on every rank.

    Example::

        >>> import torch
        >>> sum_over_ranks(torch.ones(2)).tolist()   # one process: unchanged
        [1.0, 1.0]
    """
    return _SumOverRanks.apply(t) if is_active() else t


def enter_local(t):
    """A replicated tensor ``t`` about to feed this rank's local computation: the identity forward; the backward
    sums the ranks' gradients (so every rank gets the gradient of the global total). The identity without an
    active process group.

    Example::

        >>> import torch
        >>> enter_local(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return _EnterLocal.apply(t) if is_active() else t


def all_reduce_sum(t):
    """Sum of ``t`` over ranks (a new tensor, replicated on every rank; ``t`` is not modified).

    Differentiable (:func:`sum_over_ranks`): the backward of the sum is the identity on each rank, which with the
    all-reduced backward of :class:`RowShardedOperator` products gives replicated latents the gradient of the global
    sum (a log-likelihood of the local rows, summed with this function, has the gradient of all rows' likelihood).

    :param t: tensor of any shape (the same on every rank) or a Python number.
    :returns: the sum, of ``t``'s shape and dtype (a float for a number); ``t`` itself when no process
        group is active.

    Example::

        >>> import torch, pyro_convexvb as pcv
        >>> pcv.distributed.all_reduce_sum(torch.ones(2)).tolist()   # one process: unchanged
        [1.0, 1.0]
    """
    if not is_active():
        return t
    if torch.is_tensor(t) and t.requires_grad and torch.is_grad_enabled():
        return _SumOverRanks.apply(t)
    return _reduce(t, _dist().ReduceOp.SUM)


def all_reduce_max(t):
    """Maximum of ``t`` over ranks (elementwise; ``t`` itself without an active process group)."""
    if not is_active():
        return t
    return _reduce(t, _dist().ReduceOp.MAX)


def all_reduce_min(t):
    """Minimum of ``t`` over ranks (elementwise; ``t`` itself without an active process group)."""
    if not is_active():
        return t
    return _reduce(t, _dist().ReduceOp.MIN)


def all_reduce_grads(params):
    """Sum the gradients of ``params`` over ranks in one all-reduce (as ``DistributedDataParallel``).

    A parameter whose gradient is ``None`` on every rank keeps ``None`` (an optimiser skips it, as in one process);
    otherwise a missing gradient counts as zeros. Every rank must pass the same parameters in the same order.
    Nothing happens without an active process group.

    :param params: a sequence of tensors (leaf parameters).

    Example::

        >>> import torch
        >>> p = torch.ones(2, requires_grad=True); p.sum().backward(); all_reduce_grads([p]); p.grad.tolist()
        [1.0, 1.0]
    """
    params = list(params)
    if not params or not is_active():
        return
    device = params[0].device
    flat = []
    for p in params:  # each gradient, then a flag: 1 when this rank has it
        g = p.grad
        flat.append(torch.zeros(p.numel() + 1, dtype=torch.float64, device=device) if g is None else
                    torch.cat([g.detach().reshape(-1).to(torch.float64), torch.ones(1, dtype=torch.float64,
                                                                                  device=device)]))
    buf = all_reduce_sum(torch.cat(flat))
    start = 0
    for p in params:
        k = p.numel()
        if float(buf[start + k]) > 0:
            p.grad = buf[start:start + k].reshape(p.shape).to(p.dtype)
        start += k + 1


def broadcast(t, src=0):
    """``t`` of rank ``src`` on every rank (a new tensor; ``t`` itself without an active process group)."""
    if not is_active():
        return t
    x = t.detach().clone().contiguous()
    _dist().broadcast(x, src=src)
    return x


def all_gather_object(obj):
    """``[obj of rank 0, obj of rank 1, ...]`` (picklable objects; ``[obj]`` without an active process group)."""
    if not is_active():
        return [obj]
    out = [None] * world_size()
    _dist().all_gather_object(out, obj)
    return out


def sharded_estimator(flag, name):
    """Whether an estimator given ``distributed=flag`` fits row-sharded data: ``True`` only when ``flag`` is
    ``True`` and a process group of more than one rank is active (``False`` runs as one process on the rows
    given). Raises a ``TypeError`` naming the estimator for a non-bool ``flag``."""
    if not isinstance(flag, bool):
        raise TypeError(f"{name}: distributed expects a bool, got {flag!r}")
    return flag and is_active()


def shard_range(n, rank_, world):
    """Rows ``[start, stop)`` of rank ``rank_`` when ``n`` rows are split in ``world`` contiguous, balanced
    parts (the first ``n % world`` ranks get one row more).

    Example::

        >>> shard_range(10, 1, 3)
        (4, 7)
    """
    rank_, world = int(rank_), int(world)
    if world < 1 or not 0 <= rank_ < world:
        raise ValueError(f"shard=({rank_}, {world}): need 0 <= rank < world_size")
    base, extra = divmod(int(n), world)
    start = rank_ * base + min(rank_, extra)
    return start, start + base + (1 if rank_ < extra else 0)


class Communicator:
    """Sums over the sites of all ranks: the one reduction engines use for site-indexed quantities.

    ``sum(t)`` returns the sum over ranks of a tensor or number; ``dot(a, b)`` the global inner product of two
    site vectors (``a @ b`` summed); ``norm(a)`` its root; ``max``/``min``/``all`` the global extremum /
    conjunction of per-rank values; ``count(n)`` the global number of sites. ``active`` is ``True``: its values
    come from all ranks (:data:`LOCAL`, the single-process reduction, has ``active = False``). With one rank
    every method returns the local value. All ranks must call the same methods in the same order (the results
    are identical on every rank, so branches taken on them agree).

    Example::

        >>> import torch
        >>> c = Communicator()
        >>> c.dot(torch.ones(3), torch.ones(3))
        3.0
    """

    active = True

    def sum(self, t):
        return all_reduce_sum(t)

    def dot(self, a, b):
        return float(self.sum(a @ b))

    def norm(self, a):
        return math.sqrt(max(self.dot(a, a), 0.0))

    def max(self, x):
        return all_reduce_max(x)

    def min(self, x):
        return all_reduce_min(x)

    def all(self, flag):
        return bool(all_reduce_min(1.0 if flag else 0.0) > 0.5)

    def count(self, n):
        return int(round(float(self.sum(float(n)))))

    @property
    def rank(self):
        return rank()

    @property
    def world_size(self):
        return world_size()

    def __repr__(self):
        return f"Communicator(rank={self.rank}, world_size={self.world_size})"


class _Local(Communicator):
    """The sites of one process: every method on the local values, no communication."""

    active = False

    def sum(self, t):
        return t

    def dot(self, a, b):
        return float(a @ b)

    def norm(self, a):
        return float(a.norm())

    def max(self, x):
        return x

    def min(self, x):
        return x

    def all(self, flag):
        return bool(flag)

    def count(self, n):
        return int(n)

    rank, world_size = 0, 1


#: the communicator of the default process group
WORLD = Communicator()
#: the reduction over the sites of one process (no communication)
LOCAL = _Local()


def reduction_of(obj):
    """The reduction ``obj`` (e.g. a dual backend) carries in its ``comm`` attribute, or :data:`LOCAL` when it has
    none (its sites are all the sites).

    Example::

        >>> reduction_of(object()) is LOCAL
        True
    """
    comm = getattr(obj, "comm", None)
    return LOCAL if comm is None else comm


class _ShardedMatvec(torch.autograd.Function):
    """``X_local v`` whose backward is ``X_globalᵀ g`` (all-reduced): the gradient of a replicated latent."""

    @staticmethod
    def forward(ctx, v, op):
        ctx.op = op
        return op.local._mv(v)

    @staticmethod
    def backward(ctx, grad):
        return _sharded_rmv(ctx.op, grad), None


class _ShardedRmatvec(torch.autograd.Function):
    """``X_globalᵀ u`` (all-reduced) whose backward is the local ``X_local c``."""

    @staticmethod
    def forward(ctx, u, op):
        ctx.op = op
        return all_reduce_sum(op.local._rmv(u))

    @staticmethod
    def backward(ctx, grad):
        return _sharded_mv(ctx.op, grad), None


def _sharded_mv(op, v):
    if torch.is_grad_enabled() and v.requires_grad:
        return _ShardedMatvec.apply(v, op)
    return op.local._mv(v)


def _sharded_rmv(op, u):
    if torch.is_grad_enabled() and u.requires_grad:
        return _ShardedRmatvec.apply(u, op)
    return all_reduce_sum(op.local._rmv(u))


class RowShardedOperator(LinearOperator):
    """This rank's rows of a design whose rows are spread over the ranks of the process group.

    :param local: the local rows, any operator or tensor accepted by
        :func:`~pyro_convexvb.linalg.as_operator` (dense, torch sparse, scipy sparse), shape
        ``(m_local, n)``; ``n`` must agree on every rank.

    * ``shape == (m_local, n)``; ``mv(v)`` gives the local rows of ``X v`` (no communication);
    * ``rmv(u_local)`` gives ``X_globalᵀ u_global``, replicated (local product, then one ``all_reduce``);
    * under autograd the product is differentiable with the same rule: the gradient of a replicated
      latent ``v`` through ``mv`` is summed over ranks, so a log-likelihood written with
      ``pcv.linear(Xs, w)`` has the gradient (and Hessian) of the global data;
    * ``squared()`` is the row-sharded operator of elementwise squares; ``local`` the wrapped operator;
      ``global_rows`` the number of rows over all ranks; ``row_offset`` the index of the first local row
      in the global order (ranks in rank order).

    Example::

        >>> import torch
        >>> Xs = RowShardedOperator(torch.ones(2, 3, dtype=torch.float64))
        >>> Xs.mv(torch.ones(3, dtype=torch.float64)).tolist()
        [3.0, 3.0]
    """

    def __init__(self, local, *, _counts=None):
        self.local = as_operator(local)
        self.shape = tuple(self.local.shape)
        self.dtype = self.local.dtype
        self.device = self.local.device
        if _counts is None:
            P = world_size() if is_active() else 1
            if P > 1:
                # rows per rank, then the number of columns and the dtype's size, each with its square: equal on
                # all ranks exactly when the mean of the squares is the square of the mean (every rank decides alike)
                counts = torch.zeros(P + 4, dtype=torch.float64)
                counts[rank()] = self.shape[0]
                item = float(torch.empty(0, dtype=self.dtype).element_size() + 100 * self.dtype.is_complex)
                counts[P:] = torch.tensor([self.shape[1], self.shape[1] ** 2, item, item ** 2], dtype=torch.float64)
                counts = all_reduce_sum(counts)
                mean = counts[P:] / P
                if float(mean[1]) != float(mean[0]) ** 2:
                    raise ValueError(
                        f"row_sharded: the local rows have {self.shape[1]} columns on rank {rank()} but the ranks "
                        "disagree on the number of columns (give n_features to the loader)")
                if float(mean[3]) != float(mean[2]) ** 2:
                    raise ValueError(f"row_sharded: the local rows are {self.dtype} on rank {rank()} but the ranks "
                                     "hold different dtypes; convert every shard to the same dtype")
                _counts = [int(c) for c in counts[:P].tolist()]
                if min(_counts) == 0:
                    raise ValueError(f"row_sharded: rank {_counts.index(0)} holds no rows; every rank needs at least "
                                     f"one row (rows per rank: {_counts})")
            else:
                _counts = [self.shape[0]]
        self.counts = list(_counts)
        self.global_rows = int(sum(self.counts))
        self.row_offset = int(sum(self.counts[:rank() if len(self.counts) > 1 else 0]))
        self.comm = WORLD

    def _mv(self, v):
        return _sharded_mv(self, v)

    def _rmv(self, u):
        return _sharded_rmv(self, u)

    def __matmul__(self, v):
        from .lgm.linear import linear

        return linear(self, v)

    def squared(self):
        """The row-sharded operator of elementwise squares; a local operator without one (a sum of probed parts, on
        a rank with few rows) is squared densely here, so products with it keep the sharded backward (a dense
        square outside would give a gradient of this rank's rows only, and the ranks different collectives)."""
        sq = self.local.squared()
        if sq is None:
            sq = DenseOperator(self.local.to_dense() ** 2)
        return RowShardedOperator(sq, _counts=self.counts)

    def to_dense(self):
        """The dense local rows ``(m_local, n)``."""
        return self.local.to_dense()

    def flops(self):
        """Flops of the local product (the rows this rank multiplies)."""
        return self.local.flops()

    def __repr__(self):
        return f"RowShardedOperator(local={tuple(self.shape)}, global_rows={self.global_rows}, ranks={len(self.counts)})"


class LocalOnlyOperator(LinearOperator):
    """An operator whose products run inside :func:`local_only` (no reduction anywhere inside): the local rows of a
    design that extraction probed on this rank's rows, to be wrapped by :class:`RowShardedOperator`."""

    def __init__(self, base):
        self.base = as_operator(base)
        self.shape, self.dtype, self.device = tuple(self.base.shape), self.base.dtype, self.base.device

    def _mv(self, v):
        with local_only():
            return self.base.mv(v)

    def _rmv(self, u):
        with local_only():
            return self.base.rmv(u)

    def squared(self):
        with local_only():
            sq = self.base.squared()
        return None if sq is None else LocalOnlyOperator(sq)

    def to_dense(self):
        with local_only():
            return self.base.to_dense()


def _pure_sharded(op):
    from .linalg.operators import EmbedColumnsOperator

    while isinstance(op, EmbedColumnsOperator):
        op = op.base
    return isinstance(op, RowShardedOperator)


def shard_sites(lgm):
    """Mark the site groups of a latent Gaussian model extracted (inside :func:`local_only`) from a model of
    row-sharded data as this rank's rows: every design that is not a row-sharded operator itself (one a
    predictor such as ``pcv.linear(Xs, w) + b`` made extraction probe on the local rows) becomes a
    :class:`RowShardedOperator` of its local rows, so ``Bᵀ u`` is all-reduced and site sums are reduced.
    Every observed site of a rank's model holds that rank's rows. Collective (one all-reduce a wrapped group).

    :raises UnsupportedModelError: for sites that belong to no rank's rows (a Laplace prior's sites, replicated;
        an observed site whose rows are the same on every rank) and for imputed (``obs_mask``) blocks.
    """
    from .errors import UnsupportedModelError

    if getattr(lgm, "imputed", None):
        raise UnsupportedModelError(lgm.imputed[0].name, "imputed (obs_mask) entries are not supported with "
                                                         "row-sharded data (pcv.distributed.row_sharded)")
    for g in lgm.sites:
        if getattr(g, "from_prior", False):
            raise UnsupportedModelError(g.name, "a Laplace prior's sites are replicated, not rows of the data; "
                                                "with row-sharded data use a Gaussian prior or fit on one process")
    replicated = _replicated_groups(lgm.sites)
    if replicated:
        raise UnsupportedModelError(replicated[0], "this observed site holds the same rows on every rank, so a "
                                                   "fit would count them once per rank: with row-sharded data every "
                                                   "observed site must hold this rank's share of its rows (give rank "
                                                   "0 the side observations and the other ranks none, or fit on one "
                                                   "process)")
    for g in lgm.sites:
        if not _pure_sharded(g.design):
            g.design = RowShardedOperator(LocalOnlyOperator(g.design))
    return lgm


def _replicated_groups(groups):
    """Names of the site groups whose rows are identical on every rank (number of rows, observations and design
    probed along a fixed direction): :func:`replicated_names`. Collective; ``[]`` on one process."""
    if not is_active() or not groups:
        return []
    prints = []
    for g in groups:
        rows = g.design.shape[0]
        v = torch.cos(torch.arange(1, g.design.shape[1] + 1, dtype=torch.float64)).to(g.design.dtype)
        local = g.design.local if isinstance(g.design, RowShardedOperator) else g.design
        obs = [t for t in g.family.params.values() if torch.is_tensor(t) and t.dim() >= 1 and t.shape[0] == rows]
        prints.append((g.name, [local.mv(v.to(local.device))] + obs[:2]))
    return replicated_names(prints)


def replicated_names(prints):
    """The names among ``prints`` (``[(name, [tensor, ...])]``, each tensor's leading dimension the site's rows)
    whose tensors are the same on every rank: fingerprints (row count, a fixed weighting of each tensor's rows) and
    their squares are all-reduced once, and a fingerprint is equal on all ranks exactly when its variance over ranks
    is zero (to rounding). Collective: every rank passes the same names in the same order; ``[]`` on one process."""
    if not is_active() or not prints:
        return []
    width = 1 + max(len(ts) for _, ts in prints)
    f = torch.zeros(len(prints), width, dtype=torch.float64)
    for i, (_, tensors) in enumerate(prints):
        rows = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0
        f[i, 0] = rows
        c = torch.sin(torch.arange(1, rows + 1, dtype=torch.float64))  # a fixed weighting of the rows
        for j, t in enumerate(tensors, 1):
            f[i, j] = float(c @ t.detach().double().reshape(rows, -1).sum(1).cpu()) if rows else 0.0
    total = all_reduce_sum(torch.cat([f, f * f], 1))
    P = world_size()
    mean, mean_sq = total[:, :width] / P, total[:, width:] / P
    same = ((mean_sq - mean * mean).abs() <= 1e-13 * (1 + mean_sq.abs())).all(1) & (mean[:, 0] > 0)
    return [name for (name, _), s_ in zip(prints, same.tolist()) if s_]


def agree_on_errors(fn):
    """``fn()`` on every rank, with a failure on one rank raised on all of them: the ranks all-reduce which of them
    failed, the failing ranks re-raise their own error and the others one of the same kind (a refusal, a
    ``ValueError``, else a ``RuntimeError``) naming those ranks (a rank that raised alone left the others waiting in
    their next collective). Collective (one all-reduce); on one process just ``fn()``."""
    from .errors import UnsupportedModelError

    if not is_active():
        return fn()
    err, out = None, None
    try:
        out = fn()
    except Exception as e:  # re-raised below, on every rank
        err = e
    failed = torch.zeros(world_size(), dtype=torch.float64)  # 0 fine, 1 an error, 2 a ValueError, 3 a refusal
    if err is not None:
        failed[rank()] = 3.0 if isinstance(err, UnsupportedModelError) else 2.0 if isinstance(err, ValueError) else 1.0
    failed = all_reduce_sum(failed)
    if err is not None:
        raise err
    if bool(failed.any()):  # the same kind of error as the failing ranks', so every rank takes the same path on
        ranks = [int(r) for r in torch.nonzero(failed).reshape(-1)]  # (e.g. pcv.fit's list of the engines that fit)
        why = f"refused on the rows of rank(s) {ranks} (see the error there); this rank stops with them"
        code = float(failed.max())
        raise (UnsupportedModelError(f"<rank {ranks[0]}>", why) if code == 3.0 else
               ValueError(why) if code == 2.0 else RuntimeError(why))
    return out


def row_sharded(X_local):
    """Wrap this rank's rows of the design as a :class:`RowShardedOperator` over the global rows.

    Collective: every rank must call it (once, at construction, the row counts are all-reduced).

    :param X_local: ``(m_local, n)`` dense or sparse tensor, scipy sparse matrix or operator.
    :returns: :class:`RowShardedOperator` of shape ``(m_local, n)``.

    Example::

        >>> import torch, pyro_convexvb as pcv
        >>> pcv.distributed.row_sharded(torch.zeros(4, 2, dtype=torch.float64)).global_rows
        4
    """
    if isinstance(X_local, RowShardedOperator):
        return X_local
    return RowShardedOperator(X_local)


def _walk(obj, seen):
    if obj is None or id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, RowShardedOperator):
        return
    for attr in ("sites", "imputed", "groups", "site_groups", "operators", "base", "left", "right", "design", "full_design",
                 "lgm", "inner"):
        child = getattr(obj, attr, None)
        if child is None:
            continue
        if isinstance(child, (list, tuple)):
            for c in child:
                yield from _walk(c, seen)
        else:
            yield from _walk(child, seen)


def comm_of(obj):
    """The :class:`Communicator` a model's designs carry, or ``None`` when none of them is row-sharded.

    :param obj: a :class:`~pyro_convexvb.LatentGaussianModel`, a site group or an operator.
    :returns: the communicator when some design is a :class:`RowShardedOperator` and a process group with
        more than one rank is active, else ``None`` (engines then sum over their local sites only, which
        are all the sites).

    Example::

        >>> import torch
        >>> comm_of(torch.eye(2)) is None
        True
    """
    explicit = getattr(obj, "comm", None)
    if isinstance(explicit, Communicator):
        return explicit if is_active() else None
    for node in _walk(obj, set()):
        if isinstance(node, RowShardedOperator):
            return node.comm if is_active() else None
    return None


def find_comm(*objs):
    """The communicator of the first :class:`RowShardedOperator` among ``objs``, searched two levels into lists,
    tuples and dicts (e.g. ``find_comm(args, kwargs)`` finds a model's row-sharded argument, also inside a list,
    tuple or dict argument), or ``None`` (also without an active process group).

    Example::

        >>> import torch
        >>> find_comm((torch.eye(2),), {"y": torch.ones(2)}) is None
        True
    """
    for obj in objs:
        for x in _items(obj):
            for leaf in _items(x):
                if isinstance(leaf, RowShardedOperator):
                    return leaf.comm if is_active() else None
    return None


def _items(obj):
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return [obj]


def reduce_sites(comm, t):
    """Sum over ranks of a site sum ``t`` (a tensor or number) when ``comm`` is a communicator; else ``t``.

    The one reduction engines use for site-indexed sums (bounds, gradients, line-search criteria, inner
    products of site vectors).

    Example::

        >>> reduce_sites(None, 2.5)
        2.5
    """
    return t if comm is None else comm.sum(t)
