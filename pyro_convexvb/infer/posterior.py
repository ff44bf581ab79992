"""Moved to :mod:`pyro_convexvb.posterior.gaussian`; re-exported here for old import paths and pickles."""
from ..posterior.gaussian import *  # noqa: F401,F403
from ..posterior.gaussian import __all__, _apply_name_prefix, _write_guide_params  # noqa: F401
