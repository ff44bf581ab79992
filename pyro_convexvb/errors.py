"""Exceptions and warnings raised by pyro_convexvb."""
import contextlib
import os
import sys
import warnings

from sklearn.exceptions import ConvergenceWarning as _SklearnConvergenceWarning

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKLEARN_FIT_CONTEXT = os.path.join("sklearn", "base.py")  # scikit-learn's _fit_context wraps estimators' fit


class UnsupportedModelError(ValueError):
    """A Pyro model (or one of its sites) lies outside the latent Gaussian model class.

    The message always names the offending site and the reason.
    """

    def __init__(self, site, reason):
        self.site = site
        self.reason = reason
        super().__init__(f"site '{site}': {reason}")


class ConvergenceError(RuntimeError):
    """An iterative solver did not reach its tolerance.

    ``residual`` holds the final (relative) residual or gap, ``iterations`` the work done.
    """

    def __init__(self, message, residual=None, iterations=None):
        self.residual = residual
        self.iterations = iterations
        super().__init__(message)


class ConvergenceWarning(_SklearnConvergenceWarning):
    """An iterative solver stopped before reaching its tolerance (``on_fail='warn'``).

    A subclass of scikit-learn's :class:`sklearn.exceptions.ConvergenceWarning` (itself a ``UserWarning``), so
    ``warnings.filterwarnings("ignore", category=sklearn.exceptions.ConvergenceWarning)`` silences it too.
    """


class NonConvexWarning(UserWarning):
    """A site is not log-concave, so the convex relaxation loses its convexity guarantee."""


class ApproximationWarning(UserWarning):
    """The approximate posterior is unreliable: the Pareto ``k_hat`` of its importance ratios says so
    (:mod:`pyro_convexvb.diagnostics`), or the fit itself found it degenerate (a Laplace mode at a centred
    hierarchy's funnel neck)."""


class NotPositiveDefiniteError(ValueError):
    """An operator (or preconditioner) that must be positive definite is not.

    Raised by CG and Lanczos when a curvature ``p^T A p`` (or a Lanczos pivot) is ``<= 0``, which
    cannot happen for a symmetric positive definite operator in exact arithmetic.
    """


def warn(message, category=ConvergenceWarning):
    """Issue a warning attributed to the caller's own line: the first stack frame outside ``pyro_convexvb``.

    :param str message: the text (what happened, the measure's value, what to do).
    :param type category: a ``Warning`` subclass.

    Example::

        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     warn("not converged")
        >>> w[0].category.__name__, w[0].filename.endswith("errors.py")
        ('ConvergenceWarning', False)
    """
    level, frame = 2, sys._getframe(1)
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR)
                                 or frame.f_code.co_filename.endswith(_SKLEARN_FIT_CONTEXT)):  # fit's validation
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


class WarningsOnce:
    """The warnings of repeated inner fits (the design points of a hyper-latent integration, the refits of a type-II
    loop), each distinct one (category and text) issued once, as its first fit issued it.

    Every inner fit would repeat the same engine warning (e.g. a non-convex site potential), and a
    ``warnings.catch_warnings`` block around each fit resets Python's once-per-location memory, so even the
    ``"default"`` filter repeated it. The caller's filters apply when a warning is passed on (``"error"`` raises).

    :param tuple drop: categories left out (e.g. ``ConvergenceWarning`` where the outer fit reports convergence).

    Example::

        >>> import warnings
        >>> once = WarningsOnce()
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     for _ in range(3):
        ...         with once.collect():
        ...             warnings.warn("the same", NonConvexWarning)
        >>> len(w)
        1
    """

    def __init__(self, drop=()):
        self.drop = tuple(drop)
        self.issued = set()

    @contextlib.contextmanager
    def collect(self):
        """Record the warnings issued inside (all of them), then pass on those not issued before."""
        record = warnings.catch_warnings(record=True)
        caught = record.__enter__()
        warnings.simplefilter("always")
        try:
            yield
        finally:
            record.__exit__(None, None, None)
            for w in caught:
                key = (w.category, str(w.message))
                if issubclass(w.category, self.drop) or key in self.issued:
                    continue
                self.issued.add(key)
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
