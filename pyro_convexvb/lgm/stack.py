"""Per-group objects laid end to end along the site axis.

A latent Gaussian model's sites come in groups (one :class:`~pyro_convexvb.lgm.sites.SiteFamily`
each); engines attach one object per group (a super-Gaussian potential, a local variational
bound, ...) and act on the concatenated site vector of length ``q = q_1 + ... + q_G``.
:class:`GroupStack` holds the bookkeeping shared by all such stacks: the group sizes and slices,
splitting a site vector into its groups and concatenating per-group outputs.
"""
import torch

__all__ = ["GroupStack", "Stacked"]


class GroupStack:
    """Objects of several site groups acting on consecutive slices of one site vector.

    :param groups: sequence of objects with ``len(group) = q_g`` (their number of sites).
    :ivar list groups: the objects, in order.
    :ivar list sizes: ``[q_1, ..., q_G]``.
    :ivar list slices: ``slice(q_1 + ... + q_{g-1}, q_1 + ... + q_g)`` per group.
    :ivar int total: ``q = sum(sizes)``.

    Example::

        >>> import torch
        >>> stack = GroupStack([[0, 0], [0, 0, 0]])
        >>> stack.sizes, stack.total
        ([2, 3], 5)
        >>> [t.tolist() for t in stack.split(torch.arange(5.0))]
        [[0.0, 1.0], [2.0, 3.0, 4.0]]
    """

    def __init__(self, groups):
        self.groups = list(groups)
        self.sizes = [len(g) for g in self.groups]
        self.slices, start = [], 0
        for size in self.sizes:
            self.slices.append(slice(start, start + size))
            start += size
        self.total = start

    def __len__(self):
        return self.total

    def split(self, x, name="x"):
        """Views of ``x`` for each group along the first axis.

        :param torch.Tensor x: ``(q, ...)``.
        :returns: list of ``(q_g, ...)`` tensors.
        :raises ValueError: if ``x`` is not a tensor whose first dimension is ``q``.
        """
        if not torch.is_tensor(x) or x.dim() == 0 or x.shape[0] != self.total:
            got = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
            raise ValueError(f"{name}: expected a tensor with first dimension {self.total} (the number of sites of "
                             f"groups of sizes {self.sizes}), got {got}")
        return list(x.split(self.sizes))

    def concat(self, parts):
        """Concatenate per-group outputs along the first axis.

        :param parts: one output per group: tensors ``(q_g, ...)``, or equal-length tuples of them.
        :returns: a ``(q, ...)`` tensor, or a tuple of them (componentwise) for tuple outputs.
        """
        parts = list(parts)
        if len(parts) != len(self.groups):
            raise ValueError(f"parts: expected one output per group ({len(self.groups)}), got {len(parts)}")
        if parts and isinstance(parts[0], tuple):
            return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))
        return torch.cat(parts)

    def concat_attribute(self, name):
        """``concat([group.<name> for group in groups])`` (``None`` for an empty stack)."""
        if not self.groups:
            return None
        return self.concat([getattr(g, name) for g in self.groups])

    def map(self, method, *tensors, **kwargs):
        """Call ``group.<method>(*pieces)`` on each group's slice of ``tensors`` and concatenate.

        With a single group the (checked) arguments are passed on whole and its output is returned as is.

        :param str method: method name.
        :param tensors: ``(q,)`` (or ``(q, ...)``) tensors, split by :meth:`split`.
        :param kwargs: passed to every group unchanged.
        :returns: as :meth:`concat` (a ``None`` component of tuple outputs stays ``None``).
        :raises ValueError: if an argument's first dimension is not ``q`` (named by method and position).
        """
        pieces = [self.split(t, f"{method}: argument {i}") for i, t in enumerate(tensors)]
        if len(self.groups) == 1:
            return getattr(self.groups[0], method)(*tensors, **kwargs)
        args = list(zip(*pieces)) if pieces else [()] * len(self.groups)
        return self.concat([getattr(g, method)(*a, **kwargs) for g, a in zip(self.groups, args)])


class Stacked:
    """Per-group engine objects (super-Gaussian potentials, local bounds) acting as one on the site vector.

    Every method of the groups is available on the stack: ``stack.<method>(*tensors, **kwargs)`` calls it on each
    group's slice of the ``(q, ...)`` tensors and concatenates (:meth:`GroupStack.map`); a tensor attribute is the
    concatenation of the groups' (e.g. a potential's ``beta``), a ``bool`` attribute holds when it holds for every
    group (e.g. ``log_concave``, ``exact``); every attribute of an empty stack is ``None``. :meth:`split` gives
    the groups.

    :param groups: sequence of objects of ``len(group) = q_g`` sites each.

    Example::

        >>> import torch
        >>> from pyro_convexvb.lgm.families import BernoulliLogit, Laplace
        >>> y, b = torch.ones(2, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        >>> pot = Stacked([BernoulliLogit(y).super_gaussian(), Laplace(b).super_gaussian()])
        >>> len(pot), pot.beta.tolist(), pot.log_concave
        (5, [0.5, 0.5, 0.0, 0.0, 0.0], True)
    """

    name = "stacked"

    def __init__(self, groups):
        self._stack = GroupStack(groups)
        self.groups = self._stack.groups
        self.sizes = self._stack.sizes
        self.slices = self._stack.slices

    def __len__(self):
        return self._stack.total

    def split(self):
        """The per-group objects."""
        return self.groups

    def __getattr__(self, name):
        groups = self.__dict__.get("groups")
        if groups is None or name.startswith("_"):
            raise AttributeError(name)
        if not groups:
            return None
        first = getattr(groups[0], name)
        if callable(first):
            return lambda *tensors, **kwargs: self._stack.map(name, *tensors, **kwargs)
        if isinstance(first, bool):
            value = all(getattr(g, name) for g in groups)
        elif torch.is_tensor(first):
            value = self._stack.concat_attribute(name)
        else:
            raise AttributeError(f"{type(groups[0]).__name__}.{name} is neither a method, a bool nor a tensor")
        setattr(self, name, value)
        return value
