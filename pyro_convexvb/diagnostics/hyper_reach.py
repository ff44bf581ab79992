r"""Does the integration design over hyper-latents reach all of their posterior's mass?

The design (a grid or a central composite design, :mod:`~pyro_convexvb.infer.hyper`) grows from the mode of the
hyper-latents' objective ``log p(theta) + B(theta)`` until it has fallen far enough. A second mode beyond a deep
valley is never evaluated: its mass is lost, ``k_hat`` of draws from the design's mixture cannot see it, and the
correction inherits the miss (a scale with a two-component prior, 12% of the posterior in the far component, came
out with its 95% quantile 0.08 against 2.8).

:func:`check_reach` refits the field at the prior's quantiles of each hyper-latent (:data:`LEVELS`, the others at
their mode) that lie outside the design's range, and fails when the objective there is within
:func:`~pyro_convexvb.diagnostics.field_check.drop_max` nats of the mode's: mass the design leaves out. It runs for
at most :data:`MAX_DIM` hyper-latent dimensions (up to ``len(LEVELS)`` fits each).
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..infer.hyper import PROBE_LEVELS, probe_drops, probe_points

__all__ = ["ReachCheck", "check_reach"]

#: the prior's quantiles of each hyper-latent at which the objective is probed (those of the integration's own probes)
LEVELS = PROBE_LEVELS
#: the dimensions checked at most
MAX_DIM = 2


@dataclass
class ReachCheck:
    """What :func:`check_reach` found.

    :ivar theta: ``(K, d)`` the unconstrained hyper-latent values probed (outside the design's range).
    :ivar drop: ``(K,)`` the objective's drop from the mode there (nats; NaN where the refit failed).
    :ivar passed: ``False`` when a probe lies within the allowed drop of the mode.
    :ivar note: one sentence.
    """

    theta: np.ndarray
    drop: np.ndarray
    passed: bool
    note: str


def check_reach(hp, seed=0) -> Optional[ReachCheck]:
    """:class:`ReachCheck` of a :class:`~pyro_convexvb.posterior.hyper.HyperPosterior` ``hp`` integrated over (see
    the module docstring), or ``None`` where it does not apply (hyper-latents fixed, more than :data:`MAX_DIM`
    dimensions, no model or no engine to refit with)."""
    from .field_check import drop_max

    refit = getattr(hp, "refit", None)
    d = hp.space.dim
    if refit is None or not refit.available or hp.density.kind == "point" or d > MAX_DIM or hp.model is None:
        return None
    top = int(torch.argmax(hp.log_post))
    centre, f_top = hp.z[top].double().cpu(), float(hp.log_post[top])
    args, kwargs = hp.model_args
    probes = probe_points(hp.model, args, kwargs, hp.space, hp.z, centre, seed=seed)
    if not probes.shape[0]:
        return ReachCheck(np.zeros((0, d)), np.zeros(0), True, "every prior quantile probed lies inside the design")

    def fit(z):
        f, _, converged = refit(z)
        return f, converged

    drops = probe_drops(probes, f_top, fit)
    refit.release()
    theta, drop = probes.numpy(), drops.numpy()
    limit = drop_max(d)
    bad = np.nonzero(drop < limit)[0]
    if not bad.size:
        return ReachCheck(theta, drop, True, f"{len(probes)} prior quantile(s) outside the design, every one more "
                                             f"than {limit:.1f} nats below the mode")
    k = int(bad[np.argmin(drop[bad])])
    values, _ = hp.space.unpack(torch.as_tensor(theta[k]))
    at = ", ".join(f"{n}={float(torch.as_tensor(v).reshape(-1)[0]):.3g}" for n, v in values.items())
    return ReachCheck(theta, drop, False,
                      f"the hyper-latents' objective at {at}, a prior quantile outside the integration design, is "
                      f"only {drop[k]:.2f} nats below the mode's: the design leaves out mass there (another mode of "
                      "the hyper-latents' posterior); res.corrected() refits with the grid grown on to it "
                      "(options={'hyper_probe': True}, which a fit can also take), or use engine='nuts'")
