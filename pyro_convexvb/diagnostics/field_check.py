r"""Is the field's proposal right away from the design points of an integration over hyper-latents?

Importance weights ``p(y, u, theta) / q(u, theta)`` correct a proposal only where it draws. Between and beyond the
design points the field's proposal at ``theta`` is a design point's Gaussian moved to interpolated locations and
scales (:class:`~pyro_convexvb.diagnostics.proposals.HyperProposal`). Where the field's conditional posterior
changes its shape with ``theta`` (a centred hierarchy whose scale nears zero: its members collapse onto their mean,
and their correlation with it nears one), that Gaussian is far too wide there. The weights of typical draws do not
show it: ``log w ~ log p(y, theta) - KL(q(u | theta) || p(u | y, theta))`` for a typical draw, so a region of
``theta`` where that divergence is large is underweighted by about ``exp(-KL)`` while ``k_hat``, estimated from the
draws' own weights, stays small. The draws that would show it (those near the narrow conditional) are too rare to
be drawn.

:func:`check_field` refits the field at a few hyper-latent values that the proposal draws but no design point is
near (farthest-point sampling of the proposal's draws of ``theta``, away from the design points; on a grid, among
the draws beyond half a core cell's diagonal from every design point, and as many again among the draws inside its
cells, :func:`_split`) and estimates
``KL(q(u | theta) || q_theta(u))`` against the refit ``q_theta`` by Monte Carlo. A point whose objective
``log p(theta) + B(theta)`` (the integration's, in the unconstrained coordinates) lies within :func:`drop_max` nats of
the mode's, or beyond which the fitted hyper-latent density still holds :data:`MASS_MIN` of its mass, and whose
divergence exceeds :data:`KL_MAX` nats fails the check.
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..errors import ConvergenceError, NotPositiveDefiniteError, UnsupportedModelError
from .proposals import _GaussianParts, _with_density

__all__ = ["FieldCheck", "check_field"]

#: candidate hyper-latent draws from the proposal among which the points are chosen
CANDIDATES = 400
#: field draws per point for the divergence
KL_DRAWS = 128
#: divergence (nats) above which a point fails: the draws that carry its region's weight are then about
#: ``exp(-KL)`` rare (7e-3 at 5 nats) among the few hundred a correction puts there. On 26 models with exact
#: hyper-posteriors it flagged every one whose corrected quantiles were off by more than 15% of an sd, and none on a
#: grid design, whose quantiles were all within 2%; inside a grid's cells (:func:`_split`) the right grid designs came
#: to at most 1.3 nats, and 10-23 nats for a Gaussian process whose corrected length-scale quantile was biased
KL_MAX = 5.0
#: draws of the fitted hyper-latent density that measure the mass beyond a point (:func:`_mass_beyond`)
MASS_DRAWS = 20_000
#: a point beyond which the fitted density still holds this much of its mass is relevant whatever its drop (a scale's
#: tail that falls only exponentially: on a grid, 1-8% of the mass lay beyond points 7-9 nats below the mode, where a
#: noise scale's corrected 5% quantile came out 10-20% high)
MASS_MIN = 0.01
#: points beyond the region that a Gaussian hyper-posterior gives all but this mass carry too little to matter: a
#: region this light, however misweighted, moves a 5% or 95% quantile by a tenth of its level at most
#: (:func:`drop_max`)
TAIL_MASS = 5e-3


def drop_max(d):
    """The drop (nats) of a ``d``-dimensional Gaussian's log density from its mode at the edge of its central region
    of mass ``1 -`` :data:`TAIL_MASS`: half the chi-square quantile (3.9 for ``d = 1``, 5.3 for 2, 6.4 for 3)."""
    from scipy.stats import chi2

    return 0.5 * float(chi2.ppf(1.0 - TAIL_MASS, d))


def check_points(d):
    """Points refitted for ``d`` hyper-latent dimensions: four per dimension, at most 16."""
    return min(4 * d, 16)


@dataclass
class FieldCheck:
    """What :func:`check_field` found.

    :ivar theta: ``(K, d)`` the unconstrained hyper-latent values checked.
    :ivar drop: ``(K,)`` the objective's drop from the mode there (nats; NaN where the refit failed or did not
        converge: that point is not checked).
    :ivar kl: ``(K,)`` the estimated ``KL(q(u | theta) || q_theta(u))`` (nats; NaN likewise).
    :ivar passed: ``False`` when a point within :func:`drop_max` of the mode has a divergence above
        :data:`KL_MAX`; ``None`` when the check could not run (:attr:`note` says why).
    :ivar note: one sentence.
    """

    theta: np.ndarray
    drop: np.ndarray
    kl: np.ndarray
    passed: Optional[bool]
    note: str


def _split(hp, cand):
    """``(beyond, inside)``: the rows of ``cand (M, d)`` that no design point anchors, and the rest. For a grid design
    the rows farther than half a core cell's diagonal (``step sqrt(d) / 2`` in the standardised coordinates) from
    every design point are beyond, the others inside its cells; for a central composite design every row is beyond
    (``inside`` is ``(0, d)``).

    A region with no design point in it is underweighted as a whole. Inside a cell the field's proposal is a design
    point's at most half a cell away: where the field's conditional changes within a cell as fast as a Gaussian
    process's with its length-scale, it is tens of nats (KL) from a refit there, and the cells' periodic
    underweighting did not average out: a 3-hyper-latent GP's corrected 5% quantile of its length-scale came out 2
    reported errors high on average over 12 seeds (4.8 at worst) with k_hat below its threshold; inside the cells of
    the other grid designs checked against exact hyper-posteriors the divergence was at most 1.3 nats. So both are
    checked, as many points each."""
    density = hp.density
    if density.kind != "surface":
        return cand, cand[:0]
    reach = 0.5 * density.warp.step * math.sqrt(cand.shape[1]) + 1e-9
    # in the standardised coordinates: past the core the cells grow, and a cell's points are as far apart as any
    far = torch.cdist(cand, hp.x).min(1).values > reach
    return cand[far], cand[~far]


def _mass_beyond(density, x, gen, num=MASS_DRAWS):
    """``(K,)`` the fitted hyper-latent density's mass where it is no higher than at each of ``x (K, d)``, from
    ``num`` of its draws: how much of the hyper-posterior lies as far out as each point (for a grid's surface,
    whose tails may fall only exponentially, more than a Gaussian's :func:`drop_max` allows)."""
    ref = density.log_prob_x(density.sample_x(num, gen))
    at = density.log_prob_x(x)
    return (ref[None, :] <= at[:, None]).double().mean(1).numpy()


def _farthest(cand, fixed, k):
    """``k`` rows of ``cand (M, d)`` by farthest-point sampling away from ``fixed (K, d)``."""
    dist = torch.cdist(cand, fixed).min(1).values
    out = []
    for _ in range(min(k, cand.shape[0])):
        i = int(dist.argmax())
        out.append(cand[i])
        dist = torch.minimum(dist, (cand - cand[i]).norm(dim=1))
    return torch.stack(out)


def check_field(hp, q, seed=0):
    """Check the field's proposal ``q`` (a plain :class:`~pyro_convexvb.diagnostics.proposals.HyperProposal` of the
    :class:`~pyro_convexvb.posterior.hyper.HyperPosterior` ``hp``, the one the proposals are built from: over the free
    coordinates of constrained fields) against refits away from the design points (see the module docstring).
    Costs :func:`check_points` fits of the field (twice as many on a grid: as many again inside its cells).

    :returns: :class:`FieldCheck`.
    """
    names = hp.space.names
    empty = np.zeros(0)
    refit = getattr(hp, "refit", None)
    if refit is None or not refit.available:
        return FieldCheck(np.zeros((0, hp.space.dim)), empty, empty, None,
                          "the field away from the design points was not checked: this posterior has no engine to "
                          "refit it (a pickled or copied result)")
    gen = torch.Generator().manual_seed(int(seed) + 4099)
    draws = q.density.sample_x(CANDIDATES, gen)
    cand, inner = _split(hp, draws)
    k = check_points(hp.space.dim)
    x = torch.cat([_farthest(c, hp.x, k) for c in (cand, inner) if c.shape[0] > 0])
    n_out = min(k, cand.shape[0])  # the points beyond the cells come first
    # the points inside the cells draw from their own stream: those beyond (and the mass beyond them, drawn after
    # them from gen) are checked exactly as without them
    gen_inner = torch.Generator().manual_seed(int(seed) + 4100)
    z = q.density.to_z(x)
    f_mode = float(hp.log_post.max())
    free = getattr(hp.layout, "free_gaussian", None)  # constrained fields: the proposal's free coordinates
    drop, kl = np.full(len(x), np.nan), np.full(len(x), np.nan)
    try:
        for j in range(len(x)):
            try:
                f, post, converged = refit(z[j])
            except (UnsupportedModelError, ConvergenceError, NotPositiveDefiniteError, torch.linalg.LinAlgError):
                converged = False  # a fit that fails far out: that point is not checked
            if not converged:  # nor one that did not converge (its divergence would mean nothing)
                continue
            post = post if free is None else free(post)
            u, lq = q.field_conditional(x[j], KL_DRAWS, gen if j < n_out else gen_inner)
            try:
                lr = _GaussianParts(_with_density(post)).log_prob(u.to(post.loc.dtype)).double()
            except NotImplementedError as e:
                return FieldCheck(z.numpy(), empty, empty, None,
                                  f"the field away from the design points was not checked: {e}")
            drop[j], kl[j] = f_mode - f, float((lq - lr).mean())
    finally:
        refit.release()
    limit = drop_max(hp.space.dim)
    relevant = (drop <= limit) | (_mass_beyond(hp.density, x, gen) >= MASS_MIN)
    bad = relevant & (kl > KL_MAX)  # False where a point was not checked (NaN)
    done = int(np.isfinite(kl).sum())
    if not bad.any() and done == 0:
        return FieldCheck(z.numpy(), drop, kl, None, f"the field away from the design points was not checked: its "
                                                     f"refits at all {len(x)} points failed or did not converge")
    if not bad.any():
        skipped = f" ({len(x) - done} more whose refits failed or did not converge are not counted)" \
            if done < len(x) else ""
        return FieldCheck(z.numpy(), drop, kl, True,
                          f"the field's proposal at {done} hyper-latent values away from the design points is within "
                          f"{KL_MAX:g} nats (KL) of refits there, or their density is more than {limit:.1f} nats "
                          f"below the mode's{skipped}")
    j = int(np.argmax(np.where(bad, kl, -np.inf)))
    theta = ", ".join(f"{n} = {v}" for n, v in zip(names, _constrained(hp, z[j])))
    where = "between" if j >= n_out else "away from"
    return FieldCheck(z.numpy(), drop, kl, False,
                      f"the field's proposal at hyper-latent values {where} the design points is far from a refit "
                      f"there (KL {kl[j]:.1f} nats at {theta}, where the hyper-posterior's density is "
                      f"{drop[j]:.1f} nats below its mode's): the importance weights cannot show the mass it misses, "
                      "so the corrected marginals (above all the hyper-latents' tails) may be wrong whatever k_hat "
                      f"says; {_remedy(hp)}")


def _remedy(hp):
    """What to do instead: a grid design where one is possible, else NUTS."""
    from ..infer.hyper import GRID_MAX_DIM

    if hp.density.kind != "surface" and hp.space.dim <= GRID_MAX_DIM:
        return ("integrate on a grid instead, options={'hyper_strategy': 'grid'} (1,000-2,200 fits), "
                "or use engine='nuts'")
    return "use engine='nuts' for them"


def _constrained(hp, z):
    """The constrained values of the unconstrained ``z (d,)`` as text, one entry per hyper-latent (every coordinate
    of a vector-valued one)."""
    values, _ = hp.space.unpack(z)
    out = []
    for n in hp.space.names:
        v = torch.as_tensor(values[n]).reshape(-1).tolist()
        out.append(f"{v[0]:.3g}" if len(v) == 1 else "[" + ", ".join(f"{a:.3g}" for a in v) + "]")
    return out
