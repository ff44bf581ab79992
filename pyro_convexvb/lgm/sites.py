"""Per-row site families ``t_i(s_i)`` of a latent Gaussian model (they live in :mod:`pyro_convexvb.lgm.families`)."""
from .families import *  # noqa: F401,F403
from .families import __all__  # noqa: F401
