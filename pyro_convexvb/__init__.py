"""pyro_convexvb: fast convex variational inference engines for latent Gaussian models in Pyro."""
from .errors import ConvergenceError, ConvergenceWarning, NonConvexWarning, UnsupportedModelError

__version__ = "0.1.0"
