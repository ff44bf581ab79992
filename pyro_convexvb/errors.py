"""Exceptions and warnings raised by pyro_convexvb."""


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


class ConvergenceWarning(UserWarning):
    """An iterative solver stopped before reaching its tolerance (``on_fail='warn'``)."""


class NonConvexWarning(UserWarning):
    """A site is not log-concave, so the convex relaxation loses its convexity guarantee."""


class NotPositiveDefiniteError(ValueError):
    """An operator (or preconditioner) that must be positive definite is not.

    Raised by CG and Lanczos when a curvature ``p^T A p`` (or a Lanczos pivot) is ``<= 0``, which
    cannot happen for a symmetric positive definite operator in exact arithmetic.
    """
