"""Is the approximation good enough? PSIS diagnostics, importance-corrected marginals, PSIS-LOO/WAIC/CPO/PIT
and ArviZ export of fitted results (see ``docs/diagnostics.md``)."""
from .importance import (ApproximationWarning, CorrectedPosterior, ImportanceDiagnostics, correct,  # noqa: F401
                         diagnose)
from .psis import gpd_fit, importance_ess, pareto_k_threshold, psis, psis_smooth  # noqa: F401
from .logjoint import ModelLogJoint  # noqa: F401

__all__ = ["ApproximationWarning", "CorrectedPosterior", "ImportanceDiagnostics", "correct", "diagnose",
           "gpd_fit", "importance_ess", "pareto_k_threshold", "psis", "psis_smooth", "ModelLogJoint"]
from .loo import LOOResult, loo, loo_from_log_lik  # noqa: E402,F401
from .export import to_arviz  # noqa: E402,F401

__all__ += ["LOOResult", "loo", "loo_from_log_lik", "to_arviz"]
