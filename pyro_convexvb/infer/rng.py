"""Random numbers of a fit: every run works on a seeded fork of the global generators."""
import contextlib
import random

import numpy as np
import torch

__all__ = ["draw_seed", "forked_rng", "cuda_in_use"]


def draw_seed():
    """A seed drawn from the caller's global torch stream (advancing it by one draw, as a Pyro fit would)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def cuda_in_use():
    """Whether CUDA is initialised (then a fit forks the CUDA generators too)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextlib.contextmanager
def forked_rng(seed=None, cuda=False):
    """Run a block on a fork of the global random number generators, seeded; the caller's streams are restored.

    ``seed=None`` draws the seed from the caller's torch stream first (:func:`draw_seed`): results then follow
    ``pyro.set_rng_seed``, two consecutive blocks differ, and a re-seeded session reproduces them, as with
    Pyro's own inference, while the caller's stream only moves on by that one draw. Forked: torch's CPU
    generator (and the CUDA generators when ``cuda``), NumPy's global ``RandomState`` and Python's ``random``,
    all seeded as :func:`pyro.set_rng_seed` does.

    :param seed: an integer, or ``None``.
    :yields: the seed used.

    Example::

        >>> import torch
        >>> _ = torch.manual_seed(1); a = torch.rand(1)
        >>> _ = torch.manual_seed(1)
        >>> with forked_rng(5):
        ...     _ = torch.rand(100)
        >>> bool(torch.rand(1) == a)
        True
    """
    if seed is None:
        seed = draw_seed()
    seed = int(seed)
    np_state, py_state = np.random.get_state(), random.getstate()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with torch.random.fork_rng(devices=devices):
        try:
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed_all(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)
            yield seed
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)

