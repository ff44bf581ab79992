"""Pyro's process-wide runtime state around a fit: an interrupted fit leaves it as the caller had it."""
import contextlib

from pyro.poutine.runtime import _DIM_ALLOCATOR, _PYRO_STACK

__all__ = ["pyro_runtime_restored"]


@contextlib.contextmanager
def pyro_runtime_restored():
    """Run a block; if it raises (``KeyboardInterrupt`` included), put Pyro's handler stack and its plate
    dimension allocator back as they were on entry, then re-raise.

    Pyro unwinds both itself when an exception passes through a ``with pyro.plate(...)`` block, but not when the
    exception (in practice a Ctrl-C) lands inside a plate's ``__enter__`` between allocating the plate's
    dimension and pushing the plate on the stack: the plate's name then stays allocated and every later trace
    of the model fails with ``ValueError: duplicate plate``. The block's own state is discarded; nothing is
    changed when the block ends normally.

    Example::

        >>> import pyro
        >>> from pyro.poutine.runtime import _DIM_ALLOCATOR
        >>> try:
        ...     with pyro_runtime_restored():
        ...         _ = _DIM_ALLOCATOR.allocate("data", None)  # an interrupted plate's allocation
        ...         raise KeyboardInterrupt
        ... except KeyboardInterrupt:
        ...     pass
        >>> with pyro.plate("data", 3):  # the name is free again
        ...     pass
    """
    stack, dims = list(_PYRO_STACK), list(_DIM_ALLOCATOR._stack)
    try:
        yield
    except BaseException:
        _PYRO_STACK[:] = stack
        _DIM_ALLOCATOR._stack[:] = dims
        raise
