"""Backtracking, the one step-halving line search of every damped iteration of the package (Nocedal & Wright
2006, Algorithm 3.1, contraction 1/2). What a trial computes and accepts is the caller's ``trial`` callable."""

import math

__all__ = ["backtrack", "armijo"]


def armijo(new, old, t, slope, c=1e-4):
    """Armijo's sufficient-decrease test ``new <= old + c t slope`` (``slope = grad^T d < 0``) on finite floats.

    ``new`` may be ``nan`` or ``+-inf`` (a trial point outside the domain): the test is then ``False``.

    Example::

        >>> armijo(0.5, 1.0, 1.0, -1.0), armijo(float("inf"), 1.0, 1.0, -1.0)
        (True, False)
    """
    return math.isfinite(new) and new <= old + c * t * slope


def backtrack(trial, t=1.0, *, max_trials=60):
    """Halve the step ``t`` until ``trial(t)`` accepts it.

    :param callable trial: ``t -> payload`` or ``None``: the trial at step ``t``, ``None`` to refuse it.
    :param float t: the first step tried.
    :param int max_trials: most trials (``t, t/2, ..., t/2^(max_trials-1)``).
    :returns: ``(t, payload)`` of the first accepted trial, or ``(t / 2^max_trials, None)`` when every trial was
        refused (no decrease at working precision).

    Example::

        >>> f = lambda x: (x - 0.3) ** 2
        >>> backtrack(lambda t: f(t) if f(t) <= f(0.0) else None)
        (0.5, 0.04000000000000001)
    """
    for _ in range(int(max_trials)):
        out = trial(t)
        if out is not None:
            return t, out
        t *= 0.5
    return t, None
