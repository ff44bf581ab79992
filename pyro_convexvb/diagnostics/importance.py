r"""Is the approximation good enough? PSIS diagnostics and importance-corrected posteriors.

With draws ``x_s ~ q`` from the fitted posterior (in Pyro's unconstrained coordinates) and the model's log joint
evaluated through the Pyro model as written, the ratios ``r_s = p(y, x_s) / q(x_s)`` (every constant kept) give

* the Pareto shape ``k_hat`` of their upper tail (Yao, Vehtari, Simpson & Gelman 2018, §2: ``k_hat`` above
  0.7 means ``q`` misses mass of the posterior and expectations under ``q`` are unreliable; Vehtari et al. 2024,
  §3.2.4, for the sample-size dependent threshold ``min(1 - 1/log10 S, 0.7)``);
* the importance effective sample size ``1 / sum_s w_s^2`` of the Pareto-smoothed normalised weights;
* an importance-sampling estimate of ``log p(y)`` (``log mean_s r_s``, raw ratios), to set against the bound;
* self-normalised, Pareto-smoothed estimates of posterior means, sds and quantiles with Monte Carlo errors
  (:func:`correct`).
"""
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np
import torch

from ..errors import ApproximationWarning
from ..posterior.empirical import weighted_quantiles as start_quantiles
from .constrained import log_jacobian, proposal_posterior
from .logjoint import ModelLogJoint, model_of
from .modes import check_modes, mode_proposal
from .proposals import AdaptedProposal, FieldCovariance, Proposal, make_proposal
from .psis import importance_ess, pareto_k_threshold, psis_smooth, weighted_moments, weighted_quantiles

__all__ = ["ApproximationWarning", "ImportanceDiagnostics", "CorrectedPosterior", "diagnose", "correct",
           "DIAGNOSTIC_DRAWS", "CORRECTION_DRAWS"]

#: draws of the diagnostic computed on first access of ``InferenceResult.diagnostics``
DIAGNOSTIC_DRAWS = 500
#: default draws of :func:`correct`
CORRECTION_DRAWS = 2000


def check_seed(seed):
    """Refuse a ``seed`` that is not an integer (a float or a bool was truncated to another seed silently)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed: expected an integer, got {seed!r}")


#: fewest draws a PSIS diagnostic, correction or LOO accepts (Pareto smoothing fits the largest ratios of the draws)
MIN_DRAWS = 10


def whole_number_at_least(value, minimum):
    """Whether ``value`` is an integer (a NumPy integer or an integral float too; not a bool) of at least
    ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, float)):
        return False
    return (not isinstance(value, float) or value.is_integer()) and value >= minimum


def check_draws(num_draws, minimum=MIN_DRAWS, default=None):
    """Refuse a ``num_draws`` that is not an integer of at least ``minimum`` (a float was truncated silently)."""
    if not whole_number_at_least(num_draws, minimum):
        dflt = "" if default is None else f"; default {default}"
        raise ValueError(f"num_draws: expected an integer >= {minimum} (Pareto smoothing fits the largest ratios of "
                         f"the draws{dflt}), got {num_draws!r}")


def _log_joint(result):
    lj = result.__dict__.get("_log_joint_evaluator")
    if lj is None:
        lj = ModelLogJoint(*model_of(result), masked=result.posterior.masked_entries)
        lj.offset = log_jacobian(result)  # the density of the proposals' coordinates (constrained fields: free ones)
        result.__dict__["_log_joint_evaluator"] = lj
    return lj


@dataclass
class ImportanceDiagnostics:
    """PSIS diagnostic of a fitted posterior.

    :ivar k_hat: Pareto shape of the importance ratios' tail (reliable below :attr:`threshold`).
    :ivar ess: importance effective sample size of the smoothed weights (out of :attr:`num_draws`).
    :ivar num_draws: ``S``, the draws from the proposal.
    :ivar threshold: ``min(1 - 1/log10 S, 0.7)``.
    :ivar proposal: the proposal the draws came from (``"fitted"``, ``"widened"``, ``"student_t"``, ``"affine"``,
        ``"modes"``).
    :ivar tried: ``{proposal: k_hat}`` of every proposal tried.
    :ivar log_evidence: importance-sampling estimate of ``log p(y)`` (``None`` when the proposal does not cover
        the hyper-latents, ``hyper="map"``).
    :ivar log_evidence_bound: the engine's bound, for comparison (``None`` if it has none).
    :ivar conditional_on: hyper-latent values held fixed (``hyper="map"`` results), else ``None``.
    :ivar mean_shift: the largest ``|weighted mean - mean|`` over the unconstrained coordinates, in sds of the
        draws, among coordinates where it exceeds 2 Monte Carlo errors (0 if none).
    :ivar sd_ratio: ``(min, max)`` of ``weighted sd / sd`` over the coordinates where it differs from 1 by more
        than 2 Monte Carlo errors (a ratio above 1 says ``q`` is too narrow there; an importance estimate from a
        too narrow ``q`` is itself biased toward ``q``, so the true ratio is larger).
    :ivar log_ratios: ``(S,)`` raw ``log p(y, x_s) - log q(x_s)``; ``log_weights`` the smoothed normalised ones.
    :ivar draws: ``{site: (S, *unconstrained shape)}`` the draws.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(40, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> y = (X[:, 0] > 0).double()
        >>> res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
        >>> d = res.diagnostics
        >>> d.k_hat < d.threshold, d.num_draws, d.proposal
        (True, 500, 'fitted')
    """

    k_hat: float
    ess: float
    num_draws: int
    threshold: float
    proposal: str
    tried: Dict[str, float]
    log_evidence: Optional[float]
    log_evidence_bound: Optional[float]
    conditional_on: Any
    mean_shift: float
    sd_ratio: tuple
    log_ratios: np.ndarray = field(repr=False)
    log_weights: np.ndarray = field(repr=False)
    draws: Dict[str, torch.Tensor] = field(repr=False)
    #: the proposal object the draws came from, and its per-draw conditional moments of these draws (they feed
    #: the control variates)
    proposal_object: Any = field(default=None, repr=False)
    conditional: Any = field(default=None, repr=False)
    #: ``(S,)`` ``log q`` of the draws (the pooled rounds' mixture density for ``"affine"``)
    log_q: Any = field(default=None, repr=False)
    #: pooled adaptive rounds: ``(S, n)`` the draws' whitened field coordinates in the base frame, ``(S,)`` the
    #: round each came from, and the rounds' maps (:mod:`~pyro_convexvb.diagnostics.whitened`); else ``None``
    eps: Any = field(default=None, repr=False)
    own: Any = field(default=None, repr=False)
    maps: Any = field(default=None, repr=False)
    #: ``(S,)`` boolean: the draws made by a defensive component (:data:`~.whitened.DEFENSIVE_WEIGHT`), or ``None``
    defensive: Any = field(default=None, repr=False)
    #: a correction of hyper-latents integrated over: the check of the field's proposal against refits away from
    #: the design points (:class:`~pyro_convexvb.diagnostics.field_check.FieldCheck`), else ``None``
    field_check: Any = field(default=None, repr=False)
    #: a model with sites that are not log-concave: the search for other posterior modes
    #: (:class:`~pyro_convexvb.diagnostics.modes.ModeCheck`), else ``None``
    modes: Any = field(default=None, repr=False)
    #: hyper-latents integrated over: whether the design reaches their posterior's mass
    #: (:class:`~pyro_convexvb.diagnostics.hyper_reach.ReachCheck`), else ``None``
    reach: Any = field(default=None, repr=False)
    #: the result diagnosed is a Gaussian summary of a sampler's draws (``info["samples"]``): its advice does not
    #: send it to a sampler
    of_draws: bool = field(default=False, repr=False)

    @property
    def fallback(self):
        """What to do when importance sampling cannot repair the approximation."""
        if self.of_draws:
            return ("run NUTS longer (num_samples, warmup_steps) and use its draws (res.info['samples']), which this "
                    "Gaussian summary of them approximates")
        return "use engine='nuts'"

    @property
    def reliable(self):
        """``k_hat <= threshold``, the field's proposal away from the design points of hyper-latents integrated
        over did not fail its check (:attr:`field_check`), and no posterior mode the proposal does not cover was found
        (:attr:`modes`): importance-sampling estimates (and the approximation) can be trusted."""
        return bool(self.k_hat <= self.threshold) and self._field_ok and self._modes_ok and self._reach_ok

    @property
    def _field_ok(self):
        return self.field_check is None or self.field_check.passed is not False

    @property
    def _reach_ok(self):
        return self.reach is None or self.reach.passed

    @property
    def _modes_ok(self):
        return self.modes is None or not self.modes.found or self.proposal == "modes"

    @property
    def moments_agree(self):
        """The importance-weighted means and sds agree with the draws' own: no mean moved by more than 0.1 sds and
        no sd by more than 10% (among departures beyond 2 Monte Carlo errors). A cheap complement of ``k_hat``, whose
        estimate is noisy at a few hundred draws when ``q`` is too narrow in a few directions."""
        return bool(self.mean_shift <= AGREE_SHIFT and AGREE_SD_LOW <= self.sd_ratio[0]
                    and self.sd_ratio[1] <= AGREE_SD_HIGH)

    @property
    def ok(self):
        """``reliable and moments_agree``: nothing says the approximation is off."""
        return self.reliable and self.moments_agree

    @property
    def message(self):
        """One sentence: what ``k_hat`` says and what to do."""
        if not self._field_ok:
            return f"PSIS k_hat = {self.k_hat:.2f} ({self.num_draws} draws), but {self.field_check.note}"
        if not self._modes_ok:
            return f"PSIS k_hat = {self.k_hat:.2f} ({self.num_draws} draws), but {self.modes.message}"
        if not self._reach_ok:
            return f"PSIS k_hat = {self.k_hat:.2f} ({self.num_draws} draws), but {self.reach.note}"
        unsearched = "" if self.modes is None or self.modes.checked else \
            f" ({self.modes.note}: a site that is not log-concave may give modes no draw reaches)"
        if self.reliable and not self.moments_agree:
            return (f"PSIS k_hat = {self.k_hat:.2f} ({self.num_draws} draws, importance ESS {self.ess:.0f}), but the "
                    f"importance-weighted moments differ from the approximation's (sd ratio {self.sd_ratio[0]:.2f}–"
                    f"{self.sd_ratio[1]:.2f}, mean shift {self.mean_shift:.2f} sds): its sds or means are off. Call "
                    "res.corrected() (or fit with correct='psis') for corrected summaries with Monte Carlo errors"
                    + unsearched)
        if self.reliable:
            return (f"PSIS k_hat = {self.k_hat:.2f} <= {self.threshold:.2f} ({self.num_draws} draws, proposal "
                    f"{self.proposal!r}): the approximation is close to the posterior in the sense of Yao et al. "
                    f"(2018); importance ESS {self.ess:.0f}" + unsearched)
        return (f"PSIS k_hat = {self.k_hat:.2f} > {self.threshold:.2f} ({self.num_draws} draws, proposal "
                f"{self.proposal!r}, importance ESS {self.ess:.0f}): the Gaussian approximation misses part of the "
                "posterior, so its sds and tail quantiles may be off. Call res.corrected() (tries wider proposals and "
                f"reports its own k_hat and Monte Carlo errors) or fit with correct='psis'; if k_hat stays above 0.7 "
                f"{self.fallback}")

    def __repr__(self):
        ev = "None" if self.log_evidence is None else f"{self.log_evidence:.6g}"
        return (f"ImportanceDiagnostics(k_hat={self.k_hat:.3f}, ess={self.ess:.1f}, num_draws={self.num_draws}, "
                f"reliable={self.reliable}, sd_ratio=({self.sd_ratio[0]:.2f}, {self.sd_ratio[1]:.2f}), "
                f"mean_shift={self.mean_shift:.2f}, proposal={self.proposal!r}, log_evidence={ev})")


def _draw(result, q, num_draws, seed, progress):
    """One round of draws from ``q``: ``(values, log_q (S,), log_joint (S,), conditional snapshot)``."""
    lj = _log_joint(result)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    with torch.no_grad():
        values, log_q = q.sample(int(num_draws), gen)
    cond = q.conditional()
    out = lj.evaluate(values, progress=progress)
    return values, log_q.double().cpu().numpy(), out["log_joint"], cond


def _weigh(result, q, values, log_q, log_joint, cond, name=None, check=True):
    """:class:`ImportanceDiagnostics` of draws ``values`` with densities ``log_q`` under the proposal ``q``; without
    ``check``, the moment check is left to the caller (``mean_shift = 0``, ``sd_ratio = (1, 1)`` until it sets
    them)."""
    bad = np.isnan(log_joint) | (log_joint == np.inf)
    if bad.any():
        raise ValueError(f"the model's log joint density is NaN or +inf at {int(bad.sum())} of {bad.size} draws from "
                         f"the {name or q.name!r} proposal: importance weights need it finite (or -inf where the "
                         "model gives those values probability zero); check the model's densities at extreme values "
                         "of its latent sites (e.g. a covariance that stops being positive definite)")
    if not np.all(np.isfinite(log_q)):
        raise RuntimeError(f"the {name or q.name!r} proposal's log density is not finite at "
                           f"{int((~np.isfinite(log_q)).sum())} of its own draws: a defect of the proposal, please "
                           "report it")
    lr = log_joint - log_q
    lw, k = psis_smooth(lr)
    shift, ratio = _moment_check(values, lw) if check else (0.0, (1.0, 1.0))
    S = int(lr.shape[0])
    finite = lr[np.isfinite(lr)]
    log_ev = float(np.logaddexp.reduce(finite) - math.log(S)) if q.covers_hyper and finite.size else None
    name = name or q.name
    return ImportanceDiagnostics(
        k_hat=float(k), ess=importance_ess(lw), num_draws=S, threshold=pareto_k_threshold(S), proposal=name,
        tried={name: float(k)}, log_evidence=log_ev, log_evidence_bound=result.log_evidence_bound,
        conditional_on=q.fixed, mean_shift=shift, sd_ratio=ratio, log_ratios=lr, log_weights=lw, draws=values,
        proposal_object=q, conditional=cond, log_q=log_q, defensive=getattr(q, "defensive_draws", None))


def _importance(result, num_draws, seed, proposal, progress):
    model_of(result)  # a result without its model or data: say so before anything runs the model
    if proposal == "interpolated" and not _integrates_hyper(result):
        raise ValueError("proposal='interpolated' moves the field's Gaussian between the design points of "
                         "hyper-latents integrated over; this fit has none (it would be the 'fitted' proposal): use "
                         "proposal='fitted'")
    q = proposal if isinstance(proposal, Proposal) else make_proposal(proposal_posterior(result), proposal)
    return _weigh(result, q, *_draw(result, q, num_draws, seed, progress))


def _moment_check(values, log_weights):
    x = np.concatenate([v.reshape(v.shape[0], -1).double().cpu().numpy() for v in values.values()], 1)
    m0, sd0, _, _ = weighted_moments(x, np.full(x.shape[0], 1.0 / x.shape[0]))
    # a constant column (a hyper-latent fixed at its mode) has an sd of rounding noise, whose ratios are noise too
    live = sd0 > 1e-9 * np.abs(m0)
    if not live.any():
        return 0.0, (1.0, 1.0)
    if not live.all():
        x, m0, sd0 = x[:, live], m0[live], sd0[live]
    m, s, m_se, s_se = weighted_moments(x, np.exp(log_weights))
    # only departures that are significant (beyond 2 Monte Carlo errors) count
    shift = np.abs(m - m0)
    shift = np.where(shift > 2 * m_se, shift / sd0, 0.0)
    r = s / sd0
    r = np.where(np.abs(r - 1) > 2 * s_se / sd0, r, 1.0)
    return float(shift.max()), (float(min(r.min(), 1.0)), float(max(r.max(), 1.0)))


def diagnose(result, num_draws=DIAGNOSTIC_DRAWS, seed=0, *, proposal="fitted", warn=True, progress=False):
    """PSIS diagnostic of ``result``'s posterior (what ``result.diagnostics`` computes on first access).

    :param result: an :class:`~pyro_convexvb.InferenceResult` fitted on a Pyro model.
    :param int num_draws: draws from the proposal (one model evaluation each).
    :param int seed: seed of the draws.
    :param str proposal: ``"fitted"`` (the posterior itself; the diagnostic of the approximation), ``"widened"``
        or ``"student_t"`` (:mod:`~pyro_convexvb.diagnostics.proposals`).
    :param bool warn: warn (:class:`ApproximationWarning`) when ``k_hat`` exceeds the threshold.
    :returns: :class:`ImportanceDiagnostics`.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
        >>> X = torch.randn(20, 2, dtype=torch.float64); y = X @ torch.tensor([1., -1.], dtype=torch.float64)
        >>> res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
        >>> d = diagnose(res, num_draws=200)
        >>> d.k_hat < 0.5 and abs(d.log_evidence - res.log_evidence_bound) < 1e-6   # exact for a Gaussian model
        True
    """
    check_draws(num_draws, default=DIAGNOSTIC_DRAWS)
    check_seed(seed)
    d = _importance(result, num_draws, seed, proposal, progress)
    _checks_of(d, result)
    if warn and not d.ok:
        warnings.warn(d.message, ApproximationWarning, stacklevel=3)
    return d


def _summary(x, w, probs):
    mean, sd, mean_se, sd_se = weighted_moments(x, w)
    q, q_se = weighted_quantiles(x, w, probs)
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
    return {"mean": t(mean), "sd": t(sd), "quantiles": {p: t(q[i]) for i, p in enumerate(probs)},
            "mean_mcse": t(mean_se), "sd_mcse": t(sd_se), "quantile_mcse": {p: t(q_se[i]) for i, p in enumerate(probs)}}


def _settled(d, sd_ratio=None, shift=None):
    """The weighted draws have not moved far from the proposal they came from: no coordinate's weighted sd above
    ``sd_ratio`` times the proposal's own (it is too narrow there) and no weighted mean more than ``shift`` of its
    sds away (beyond 2 Monte Carlo errors each; defaults :data:`NARROW_SD_RATIO`, :data:`BIASED_SHIFT`). Importance
    estimates from a proposal that misses this way are biased toward it, whatever ``k_hat`` says. The sd test does not
    apply to the ``"student_t"`` proposal: its polynomial tails bound the weights of any target with lighter tails
    (``k_hat`` judges it), and its draws' own sd is no measure of its reach. Nor does either test apply to the
    ``"modes"`` proposal (:class:`~pyro_convexvb.diagnostics.modes.ModeProposal`): it gives every mode an equal share
    whatever its mass, so its weighted draws move away from its own by design, and it covers every mode found."""
    if d.proposal == "modes":
        return True
    sd_ratio = NARROW_SD_RATIO if sd_ratio is None else sd_ratio
    shift = BIASED_SHIFT if shift is None else shift
    narrow = d.proposal != "student_t" and d.sd_ratio[1] > sd_ratio
    return bool(not narrow and d.mean_shift <= shift)


def _rank(d, settled=False):
    """Order of preference among proposals: a reliable ``k_hat`` first, then (with ``settled``, among the final
    candidates) a settled one (:func:`_settled`: a too narrow proposal's own ESS is biased upward), then the largest
    importance ESS; among unreliable ones the smallest ``k_hat``. The adaptive rounds are kept by ESS alone: a
    round on its way to the posterior need not have settled yet."""
    return (d.reliable, settled and d.reliable and _settled(d), d.ess if d.reliable else -d.k_hat)


def _funnel_note(result):
    """A warning when the proposal treats a scale of a field site's prior as one more coordinate of a joint
    Gaussian (or mixture) with the field (a centred hierarchy fitted by an engine on the Pyro model), else ``""``.

    As the scale nears 0 the field's conditional posterior narrows toward its mean: a neck the joint proposal
    reaches too rarely for its weights, or ``k_hat``, to show the mass it misses.  On a centred binomial hierarchy
    of six groups an ``svi_automvn`` fit corrected to a 5% quantile of the scale of 0.32 +- 0.03 against an exact
    0.054, with ``k_hat`` 0.63; the fits that integrate the scale over a design (:func:`_integrates_hyper`, checked
    by :func:`~.field_check.check_field`) were within 2.2 Monte Carlo errors."""
    from ..infer.hyper import field_scale_sites

    model, args, kwargs = model_of(result)
    scales = field_scale_sites(model, args, kwargs)
    if not scales:
        return ""
    field, sources = next(iter(scales.items()))
    names = sorted({n for found in scales.values() for n in found})
    return (f"corrected posterior: the proposal is one Gaussian (or mixture) over the field and the scale(s) "
            f"{names} of its prior (the scale of site {field!r} reads {sorted(sources)}). As such a scale nears 0 the "
            "field's conditional posterior narrows toward its mean (a centred hierarchy's funnel), a region this "
            "proposal reaches too rarely for the importance weights, or k_hat, to show what it misses: the "
            f"corrected marginals of {names}, above all their lower tails, may be off. To be sure, fit with the "
            "scales integrated over a design (engine='dual_vg' does so by default, for a model that is a latent "
            "Gaussian model given them) and correct that fit, or write the hierarchy non-centred")


def _checks_of(d, result):
    """Attach to the diagnostic ``d`` of ``result`` what its weights cannot show: other modes, the hyper-latent
    design's reach, and whether the result summarises a sampler's draws (its advice)."""
    d.modes, d.reach, d.of_draws = check_modes(result), _reach(result), result.from_draws


def _reach(result):
    """:func:`~pyro_convexvb.diagnostics.hyper_reach.check_reach` of a result with hyper-latents integrated over
    (cached on it), else ``None``."""
    if "_reach_check" not in result.__dict__:
        from .hyper_reach import check_reach

        post = result.posterior
        result.__dict__["_reach_check"] = check_reach(post) if type(post).__name__ == "HyperPosterior" else None
    return result.__dict__["_reach_check"]


def _integrates_hyper(result):
    """The posterior is a mixture over hyper-latent design points that covers the hyper-latents."""
    dens = getattr(result.posterior, "density", None)
    return getattr(result.posterior, "components", None) is not None and getattr(dens, "kind", "point") != "point"


def _elementwise(transform, x):
    """``+1`` / ``-1``: ``transform`` acts elementwise and is increasing / decreasing; ``0``: neither."""
    if getattr(getattr(transform, "domain", None), "event_dim", 1) != 0:
        return 0
    a = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64)
    with torch.no_grad():
        v = transform(a)
    if v.shape != a.shape:
        return 0
    dv = torch.diff(v)
    return 1 if bool((dv > 0).all()) else (-1 if bool((dv < 0).all()) else 0)


#: a control-variate quantile whose weighted draws put their CDF more than this many binomial errors from its
#: level (on the arcsine scale, where they are ``1 / (2 sqrt(ESS))``) is replaced by the self-normalised one
#: (:func:`_supported_quantiles`)
SUPPORT_SE = 4.0


def _supported_quantiles(x, w, probs, q, se):
    """``(q, se)``, with the control-variate quantiles that the weighted draws do not support replaced by the
    self-normalised ones and their errors: where the weighted CDF ``F`` at ``q`` is more than :data:`SUPPORT_SE`
    binomial errors from its level ``p``, ``|asin(sqrt(F)) - asin(sqrt(p))| > SUPPORT_SE / (2 sqrt(ESS))`` (the
    arcsine scale keeps the errors of small ``p`` honest). The regression can place a quantile where the weighted
    draws carry no mass (extrapolating from the proposal's own CDF, when a few heavy weights sit elsewhere), and its
    error then comes out near zero: 3e-11 at a 5% quantile with one draw below it, 1.1 sds from the exact one. A
    supported quantile fails the check by chance in about one coordinate in 16,000."""
    w = np.asarray(w, dtype=np.float64)
    ess = 1.0 / float(np.sum(w**2))
    p = np.asarray(probs, dtype=np.float64)
    F = np.clip(np.stack([w @ (x <= q[i]) for i in range(len(p))]), 0.0, 1.0)
    bad = np.abs(np.arcsin(np.sqrt(F)) - np.arcsin(np.sqrt(p))[:, None]) > SUPPORT_SE / (2.0 * math.sqrt(ess))
    if not bad.any():
        return q, se
    qs, ses = weighted_quantiles(x, w, probs)
    return np.where(bad, qs, q), np.where(bad, ses, se)


def _cv_site(transform, x, w, ctl, probs, baseline=False, base_rows=None):
    """Control-variate summaries of one site: ``(unconstrained, constrained)`` dicts (see :func:`correct`); with
    ``baseline``, also ``(unconstrained, constrained)`` dicts of the same estimates with flat weights (the
    proposal's own answer from the same draws, over ``base_rows`` if given: the draws of its Gaussians without
    their defensive share; ``None`` for a site without a monotone elementwise transform)."""
    from .control_variates import cv_moments, cv_quantiles

    t = lambda a, shape: torch.as_tensor(np.asarray(a), dtype=torch.float64).reshape(shape)  # noqa: E731
    S = x.shape[0]
    ushape = tuple(x.shape[1:])
    xf = x.reshape(S, -1).numpy()
    m, s_, mse, sse, *mb = cv_moments(xf, w, ctl, baseline=baseline, base_rows=base_rows)
    unc = {"mean": t(m, ushape), "sd": t(s_, ushape), "mean_mcse": t(mse, ushape), "sd_mcse": t(sse, ushape)}
    base_unc = {"mean": t(mb[0], ushape), "sd": t(mb[1], ushape)} if baseline else None
    with torch.no_grad():
        head = transform(x[:4])
    identity = head.shape == x[:4].shape and torch.equal(head.double(), x[:4])
    sign = 1 if identity else _elementwise(transform, x)
    if sign == 0:  # e.g. a simplex: plain self-normalised summaries of the constrained values
        with torch.no_grad():
            v = transform(x).numpy()
        return unc, _summary(v, w, probs), base_unc, None
    # quantiles of the unconstrained coordinates, mapped through the monotone transform
    uprobs = probs if sign > 0 else tuple(1.0 - p for p in probs)
    q0 = start_quantiles(xf, w, uprobs)  # the self-normalised ones (their errors are not needed)
    qu, qse, *qb = cv_quantiles(xf, w, ctl, uprobs, q0, baseline=baseline, base_rows=base_rows)
    qu, qse = _supported_quantiles(xf, w, uprobs, qu, qse)
    with torch.no_grad():
        T = lambda a: transform(torch.as_tensor(a, dtype=torch.float64)).numpy()  # noqa: E731
        qc = T(qu)
        qc_se = 0.5 * np.abs(T(qu + qse) - T(qu - qse))
        if identity:
            cm, cs, cmse, csse, cmb = m, s_, mse, sse, mb
        else:
            cm, cs, cmse, csse, *cmb = cv_moments(xf, w, ctl, transform=T, baseline=baseline, base_rows=base_rows)
        qcb = T(qb[0]) if baseline else None
    shape = tuple(transform(x[:1]).shape[1:])
    out = {"mean": t(cm, shape), "sd": t(cs, shape), "quantiles": {p: t(qc[i], shape) for i, p in enumerate(probs)},
           "mean_mcse": t(cmse, shape), "sd_mcse": t(csse, shape),
           "quantile_mcse": {p: t(qc_se[i], shape) for i, p in enumerate(probs)}}
    base = None if not baseline else {"mean": t(cmb[0], shape), "sd": t(cmb[1], shape),
                                      "quantiles": {p: t(qcb[i], shape) for i, p in enumerate(probs)}}
    return unc, out, base_unc, base


@dataclass
class CorrectedPosterior:
    """Importance-corrected posterior summaries of a fit (:func:`correct`, ``res.corrected()``).

    :ivar sites: ``{site: {"mean", "sd", "quantiles": {p: ...}, "mean_mcse", "sd_mcse", "quantile_mcse": {p: ...}}}``
        in the model's constrained coordinates (tensors of the site's shape).
    :ivar hyper: the same for the hyper-latents only (``None`` when the result has none, or they were fixed).
    :ivar unconstrained: ``{site: {"mean", "sd", "mean_mcse", "sd_mcse"}}`` in Pyro's unconstrained coordinates
        (``log`` of a positive site), where the posteriors live.
    :ivar loc: ``(n,)`` corrected mean of the flat latent vector the posterior is over (unconstrained
        coordinates), ``scale`` its corrected sd; ``loc_mcse`` and ``scale_mcse`` their Monte Carlo errors.
    :ivar diagnostics: the :class:`ImportanceDiagnostics` of the proposal used (its ``k_hat`` says whether
        these numbers can be trusted; ``tried`` lists every proposal tried).
    :ivar probs: the quantile levels.
    :ivar shrinkage: the James-Stein factor of each statistic of each shrunk site (see :func:`correct`).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(40, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> y = (X[:, 0] > 0).double()
        >>> res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
        >>> c = res.corrected(num_draws=400, seed=0)
        >>> c.sites["w"]["mean"].shape, c.sites["w"]["sd_mcse"].shape, sorted(c.sites["w"]["quantiles"])
        (torch.Size([2]), torch.Size([2]), [0.05, 0.5, 0.95])
    """

    sites: Dict[str, Dict[str, Any]]
    hyper: Optional[Dict[str, Dict[str, Any]]]
    loc: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    loc_mcse: Optional[torch.Tensor]
    scale_mcse: Optional[torch.Tensor]
    diagnostics: ImportanceDiagnostics
    probs: tuple
    unconstrained: Dict[str, Dict[str, Any]] = field(default_factory=dict, repr=False)
    _lj: Any = field(default=None, repr=False)
    #: ``{site: {"mean": c, "sd": c, p: c, ...}}`` the James-Stein factors applied to the corrections of each
    #: statistic of the sites that were shrunk (``shrink=True``); 1 keeps the correction, 0 the proposal's answer
    shrinkage: Dict[str, Dict[Any, float]] = field(default_factory=dict)
    #: the fit these summaries correct when it is not the one passed in: hyper-latents refitted on a grid because
    #: the correction of their central composite design was unreliable, or because the grid's reach check found
    #: mass it left out (``regrid``), else ``None``. Its ``hyper["marginals"]`` and posterior are the ones to use:
    #: the first fit's (its ``hyper``, ``posterior`` and ``as_guide()``) stay those of the first design
    refit: Any = None
    #: the :class:`ImportanceDiagnostics` of that unreliable first correction, else ``None``
    replaced: Any = field(default=None, repr=False)
    #: ``{hyper-latent: k}`` the Pareto tail shape of ``(x - mean)^2`` under the proposal (tensors of the site's
    #: shape); above :data:`SD_TAIL_K` the site's fourth moment is infinite and its ``sd_mcse`` is ``inf``
    sd_tail_k: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def k_hat(self):
        return self.diagnostics.k_hat

    @property
    def ess(self):
        return self.diagnostics.ess

    @property
    def weights(self):
        """``(S,)`` normalised Pareto-smoothed importance weights of the draws."""
        return np.exp(self.diagnostics.log_weights)

    def resample(self, num_samples=None, seed=0, constrained=True):
        """Draws resampled by the importance weights (multinomial, with replacement).

        :param int num_samples: how many (default: the number of draws).
        :returns: ``{site: (num_samples, *shape)}`` (constrained values by default).
        """
        d = self.diagnostics
        m = d.num_draws if num_samples is None else int(num_samples)
        gen = torch.Generator().manual_seed(int(seed))
        idx = torch.multinomial(torch.as_tensor(self.weights), m, replacement=True, generator=gen)
        out = {}
        for n, v in d.draws.items():
            v = v[idx]
            out[n] = self._lj.constrain(n, v) if constrained else v
        return out

    def __repr__(self):
        grid = "" if self.refit is None else ", refit='grid'"
        return (f"CorrectedPosterior(k_hat={self.k_hat:.3f}, ess={self.ess:.1f}, proposal="
                f"{self.diagnostics.proposal!r}{grid}, sites={list(self.sites)})")


#: adapt while the importance ESS is below this fraction of the draws
ADAPT_BELOW = 0.8
ADAPTATIONS = ("affine", "diagonal")
#: ``adapt="auto"``: adapted rounds at most, and the rounds after which the adaptation stops once it has settled
AUTO_ROUNDS, AUTO_MIN_ROUNDS = 8, 2
#: the adaptation has settled when no coordinate's importance-weighted sd exceeds the last proposal's own by more
#: than this factor (beyond 2 Monte Carlo errors: :attr:`ImportanceDiagnostics.sd_ratio`)
SETTLED_SD_RATIO = 1.1
#: ... and no weighted mean is more than this many of its sds from the last proposal's
SETTLED_SHIFT = 0.3
#: a correction whose last proposal is narrower than its weighted draws by more than this factor is reported as
#: not settled (its estimates are biased toward that proposal)
NARROW_SD_RATIO = 1.2
#: ... or whose weighted means moved more than this many sds from it
BIASED_SHIFT = 0.5
#: :attr:`ImportanceDiagnostics.moments_agree`: no weighted mean more than this many sds from the draws' own, and
#: no sd ratio below ``AGREE_SD_LOW`` nor above ``AGREE_SD_HIGH``
AGREE_SHIFT, AGREE_SD_LOW, AGREE_SD_HIGH = 0.1, 0.9, 1.1


def _pool(result, rounds, maps, q, kernels=None):
    """The rounds' draws pooled, weighted against the equal-weight mixture of their proposals (balance
    heuristic); ``rounds``: ``[(values, log_q, log_joint, conditional, eps)]``, round ``j`` drawn with ``maps[j]``;
    ``kernels``: a dict kept across the calls of one adaptation (:func:`~.whitened.mixture_log_q_rounds`)."""
    from .whitened import PooledProposal, mixture_log_q_rounds

    q = PooledProposal(q.base, q.layout, maps)  # what the pooled draws come from (loo() draws afresh from it)
    own = np.concatenate([np.full(r[1].shape[0], j) for j, r in enumerate(rounds)])
    log_q = mixture_log_q_rounds([r[1] for r in rounds], [r[4] for r in rounds], maps,
                                 {} if kernels is None else kernels)
    # the pooled draws and their conditional moments are gathered only for the rounds' final answer (_gather); the
    # pooled whitened coordinates only when asked (_pooled_eps: the next round's fit, the final answer)
    d = _weigh(result, q, None, log_q, np.concatenate([r[2] for r in rounds]), None, name="affine", check=False)
    d.eps, d.own, d.maps, d.rounds = None, own, list(maps), list(rounds)
    d.defensive = np.concatenate([np.zeros(r[1].shape[0], dtype=bool) if r[5] is None else r[5] for r in rounds])
    # the moment check asks whether the last proposal agrees with the weighted moments: its own draws
    last = own == len(rounds) - 1
    lw = d.log_weights[last]
    d.mean_shift, d.sd_ratio = _moment_check(rounds[-1][0], lw - np.logaddexp.reduce(lw))
    return d


def _pooled_eps(d):
    """``(N, n)`` the whitened coordinates of a :func:`_pool` result's draws (concatenated on first use)."""
    if d.eps is None:
        d.eps = np.concatenate([r[4] for r in d.rounds])
    return d.eps


def _gather(d):
    """The pooled draws and their conditional moments of a :func:`_pool` result, in place (once)."""
    rounds = getattr(d, "rounds", None)
    if rounds is None or d.draws is not None:
        return d
    _pooled_eps(d)
    d.draws = {n: torch.cat([r[0][n] for r in rounds]) for n in rounds[0][0]}
    cond = tuple(np.concatenate([np.broadcast_to(r[3][i], (r[1].shape[0],) + np.shape(r[3][i])[1:])
                                 for r in rounds]) for i in range(3))
    d.conditional = cond + (FieldCovariance.pool([r[3][3] for r in rounds], [r[1].shape[0] for r in rounds],
                                                 d.eps.shape[1]),)
    d.rounds = None
    return d


def _adapt_affine(result, q1, num_draws, seed, progress, adapt, tried):
    """Adaptive importance sampling from the plain proposal ``q1``: each round fits an affine map of the whitened
    field (:func:`~pyro_convexvb.diagnostics.whitened.fit_affine_map`) to the pooled weighted draws so far, draws
    ``num_draws`` more, and pools every round (:func:`_pool`); it stops when the importance ESS reaches
    :data:`ADAPT_BELOW` of the draws or a round does not improve it. A round that raises the ESS but not the ESS per
    draw is kept (its draws are paid for) and ends the rounds: its map was no better than the last, so another
    round would add draws, not a better proposal (more draws are what ``num_draws`` is for). With
    ``adapt="auto"`` the rounds also stop after :data:`AUTO_MIN_ROUNDS` adapted ones once the last proposal is
    nowhere narrower than the weighted draws (:data:`SETTLED_SD_RATIO`) and its means are near theirs
    (:data:`SETTLED_SHIFT`), and after :data:`AUTO_ROUNDS` at most."""
    from .whitened import DEFENSIVE_WEIGHT, AffineMap, WhitenedProposal, fit_affine_map

    auto = adapt == "auto"
    rounds_max = AUTO_ROUNDS if auto else int(adapt)
    post = proposal_posterior(result)
    layout = post.layout
    q = WhitenedProposal(q1, layout, AffineMap.identity(post.n))
    values, lq, ljv, cond = _draw(result, q, num_draws, seed, progress)
    d = _weigh(result, q, values, lq, ljv, cond)
    tried[d.proposal] = d.k_hat
    rounds, maps = [(values, lq, ljv, cond, None, None)], [q.amap]
    own = np.zeros(lq.shape[0], dtype=np.int64)
    kernels = {}  # the mixture's kernels of each round's draws under each map (_pool)
    for r in range(rounds_max):
        if not np.isfinite(d.k_hat):
            break
        if d.ess >= ADAPT_BELOW * d.num_draws and not (auto and r == 0 and not _settled(d, SETTLED_SD_RATIO,
                                                                                          SETTLED_SHIFT)):
            break  # (a plain proposal narrower than its weighted draws adapts whatever its ESS: its own is biased)
        if auto and r >= AUTO_MIN_ROUNDS and _settled(d, SETTLED_SD_RATIO, SETTLED_SHIFT):
            break
        if r == 0:  # whitened only when adapting
            eps = q.last_eps
            rounds[0] = rounds[0][:4] + (eps, None)
        if r > 0:
            eps = _pooled_eps(d)
        amap = fit_affine_map(eps, np.exp(d.log_weights), own, maps, seed=seed + r)
        if amap.is_identity:
            break
        amap = amap.defended(DEFENSIVE_WEIGHT)
        q2 = WhitenedProposal(q1, layout, amap)
        values, lq, ljv, cond = _draw(result, q2, num_draws, seed + 101 + r, progress)
        rounds.append((values, lq, ljv, cond, q2.last_eps, q2.defensive_draws))
        maps.append(amap)
        d2 = _pool(result, rounds, maps, q2, kernels)
        tried["affine" if r == 0 else f"affine{r + 1}"] = d2.k_hat
        if _rank(d2) <= _rank(d):
            break
        sharper = d2.ess / d2.num_draws > d.ess / d.num_draws
        d, own = d2, d2.own
        if not sharper:  # more draws, no better proposal: another round would only add draws
            break
    return _gather(d)


def _adapt_diagonal(result, d, num_draws, seed, progress, adapt, tried):
    """Rounds of :class:`~pyro_convexvb.diagnostics.proposals.AdaptedProposal` (a shift and a scale per
    coordinate, the last round only), kept while they improve the importance ESS."""
    layout = getattr(proposal_posterior(result), "layout", None)
    for r in range(AUTO_MIN_ROUNDS if adapt == "auto" else int(adapt)):
        if layout is None or d.ess >= ADAPT_BELOW * d.num_draws or not np.isfinite(d.k_hat):
            break
        q2 = AdaptedProposal.from_draws(d.proposal_object, layout, d.draws, d.log_weights, d.conditional)
        if q2 is None:
            break
        d2 = _importance(result, num_draws, seed + 101 + r, q2, progress)
        tried["adapted" if r == 0 else f"adapted{r + 1}"] = d2.k_hat
        if _rank(d2) <= _rank(d):
            break
        d = d2
    return d


def _choose(result, num_draws, seed, progress, adapt, adaptation):
    """``proposal="auto"``: the plain proposal, adapted, then the defensive mixtures when it is not ``ok``; the
    :class:`ImportanceDiagnostics` of the one used, ``tried`` filled in."""
    first = "interpolated" if _integrates_hyper(result) else "fitted"
    post = proposal_posterior(result)
    q1 = make_proposal(post, first)
    tried = {}
    if adapt and adaptation == "affine" and q1.frame_posteriors is not None \
            and getattr(post, "layout", None) is not None:
        d = _adapt_affine(result, q1, num_draws, seed, progress, adapt, tried)
    else:
        d = _importance(result, num_draws, seed, q1, progress)
        tried[first] = d.k_hat
        d = _adapt_diagonal(result, d, num_draws, seed, progress, adapt, tried)
    # the pooled adaptive rounds were fitted to the weighted moments: the defensive mixtures only when k_hat says
    # they are unreliable or they have not settled; otherwise also when the (stricter) moment check fails
    if not (d.reliable and _settled(d) if d.proposal == "affine" else d.ok):
        for i, kind in enumerate(("widened", "student_t")):
            try:
                d2 = _importance(result, num_draws, seed + 1 + i, kind, progress)
            except NotImplementedError:  # e.g. a mixture posterior: no Gaussian to widen
                break
            tried[kind] = d2.k_hat
            # a reliable k_hat first, then a settled proposal, then the largest importance ESS (smallest Monte
            # Carlo errors); among unreliable ones the smallest k_hat
            if _rank(d2, settled=True) > _rank(d, settled=True):
                d = d2
    modes = check_modes(result)
    if modes is not None and modes.corrects:  # the proposals above are blind to them
        d = _importance(result, num_draws, seed + 3, mode_proposal(result, modes), progress)
        tried["modes"] = d.k_hat
    d.tried = tried
    return d


#: a hyper-latent whose ``(x - mean)^2`` has a Pareto tail shape above this under the proposal (in the model's
#: constrained coordinates) is taken to have an infinite fourth moment: the Monte Carlo error of its sd is unbounded
#: (:func:`_sd_tail_k`). Above 0.5, not 0.5 itself: the proposal's density of the hyper-latents reaches further out
#: than their posterior, and its shape came out 0.07-0.14 above the posterior's on five models with exact posteriors
#: (a LogNormal-prior scale, all of whose moments are finite: 0.556 against 0.446)
SD_TAIL_K = 0.6


def _sd_tail_k(transform, reference, shape):
    """``(p,)`` the Pareto tail shape of ``(x - mean)^2`` of each coordinate of a site in the model's coordinates,
    from the proposal's reference draws ``(M, p)`` of its unconstrained coordinates (``shape``: the site's
    unconstrained shape). Above :data:`SD_TAIL_K` the fourth moment is taken to be infinite, so any estimate of the
    sd from draws has an unbounded error, which the draws themselves understate: an InverseGamma variance of three
    groups (its posterior falling off like ``v^-4.5``, k 0.74) came out 10% of an sd low on average over 20 seeds,
    with errors of up to 6.7 reported Monte Carlo errors."""
    from .psis import pareto_tail_k

    R = torch.as_tensor(np.asarray(reference), dtype=torch.float64)
    with torch.no_grad():
        v = transform(R.reshape(R.shape[0], *shape)).reshape(R.shape[0], -1).numpy()
    h = (v - v.mean(0)) ** 2
    return np.array([pareto_tail_k(h[:, j]) for j in range(h.shape[1])])


def _summaries(result, d, estimator, probs, seed, hyper, baseline=False):
    """``(sites, unconstrained, baselines, tails)`` summaries of every latent site from the weighted draws of ``d``;
    ``baselines``: ``{site: (unconstrained, constrained)}`` the same control-variate estimates with flat weights
    (with ``baseline``, for the sites with controls); ``tails``: ``{hyper-latent: (p,)}`` :func:`_sd_tail_k` of the
    hyper-latents integrated over (``hyper``: their names, or ``None``)."""
    lj = _log_joint(result)
    w = np.exp(d.log_weights)
    q = d.proposal_object
    layout = getattr(proposal_posterior(result), "layout", None)
    sites, unc, bases, tails = {}, {}, {}, {}
    # the proposal's own answer (the shrinkage's baseline) is that of its Gaussians, without the defensive draws
    base_rows = None if d.defensive is None or not d.defensive.any() else ~d.defensive
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
    for n in lj.names:
        x = d.draws[n].double().cpu()
        ctl = None
        if estimator == "cv" and q is not None:
            ctl = q.controls(n, layout, seed=seed, conditional=d.conditional)
        if hyper and n in hyper and q is not None:
            ref = ctl if ctl is not None else q.controls(n, layout, seed=seed, conditional=d.conditional)
            if ref is not None and not ref.conditional:
                tails[n] = _sd_tail_k(lj.transforms[n], ref.reference, tuple(x.shape[1:]))
        if ctl is None:
            v = lj.constrain(n, d.draws[n]).double().cpu().numpy()
            sites[n] = _summary(v, w, probs)
            m, s_, mse, sse = weighted_moments(x.numpy(), w)
            unc[n] = {"mean": t(m), "sd": t(s_), "mean_mcse": t(mse), "sd_mcse": t(sse)}
            continue
        unc[n], sites[n], bu, bs = _cv_site(lj.transforms[n], x, w, ctl, probs, baseline=baseline,
                                            base_rows=base_rows)
        if hyper and n in hyper and d.k_hat > CV_ERRORS_KHAT:
            _at_least_plain_errors(unc[n], x.numpy(), w)
            with torch.no_grad():
                _at_least_plain_errors(sites[n], lj.constrain(n, x).double().cpu().numpy(), w)
        if baseline:
            bases[n] = (bu, bs)
    return sites, unc, bases, tails


#: above this ``k_hat`` the importance ratios have an infinite variance, and the hyper-latents' control-variate
#: errors of means and sds are raised to the plain self-normalised ones where those are larger
#: (:func:`_at_least_plain_errors`)
CV_ERRORS_KHAT = 0.5


def _at_least_plain_errors(summary, v, w):
    """The ``mean_mcse`` and ``sd_mcse`` of ``summary`` raised, in place, to the self-normalised errors of the draws
    ``v`` ``(S, ...)`` under the weights ``w`` where those are larger. At ``k_hat`` 0.55-0.65 on central composite
    designs the control-variate sd errors of scales were 0.55-0.76 of the plain ones and three sds came out 3.6-4.6
    of them from the exact values (2.0-3.2 plain errors); over 37 hyper-latent marginals with ``k_hat`` above 0.5 the
    errors grew by a median factor of 1.12."""
    _, _, mean_se, sd_se = weighted_moments(v, w)
    for key, plain in (("mean_mcse", mean_se), ("sd_mcse", sd_se)):
        cur = summary[key]
        summary[key] = torch.maximum(cur, torch.as_tensor(plain, dtype=cur.dtype).reshape(cur.shape))


def _unbounded_sds(sites, tails, warn):
    """The sd errors of hyper-latents with an infinite fourth moment (:func:`_sd_tail_k`) set to ``inf``, in place,
    with a warning naming them; returns ``{site: tail shapes}`` as tensors of the site's shape."""
    out = {}
    for n, k in tails.items():
        shape = sites[n]["sd"].shape
        out[n] = torch.as_tensor(k, dtype=torch.float64).reshape(shape)
        heavy = k > SD_TAIL_K
        if not heavy.any():
            continue
        se = sites[n]["sd_mcse"].reshape(-1).clone()
        se[torch.as_tensor(heavy)] = math.inf
        sites[n]["sd_mcse"] = se.reshape(shape)
        if warn:
            warnings.warn(f"corrected posterior: the sd of {n!r} cannot be estimated from draws: its tail is so heavy "
                          f"that (x - mean)^2 has a Pareto shape of {float(np.nanmax(k)):.2f} > {SD_TAIL_K} under the "
                          "proposal (an infinite fourth moment), so the sd's Monte Carlo error is unbounded and the "
                          "draws understate it (its sd_mcse is inf; such estimates mostly come out low); read its "
                          "quantiles, or the sd of its unconstrained value (corrected.unconstrained)",
                          ApproximationWarning, stacklevel=4)
    return out


def _shrink(sites, unc, bases):
    """Shrink each statistic's corrections over a site's coordinates toward the proposal's own answer from the same
    draws (``bases``), positive-part James-Stein (:func:`~.control_variates.james_stein`); in place. Returns
    ``{site: {statistic: factor}}`` for the sites shrunk."""
    from .control_variates import SHRINK_MIN_COORDINATES, james_stein

    def shrink(vals, key, base, ses, se_key):
        """Shrink the estimates ``vals[key]`` toward ``base``; their errors ``ses[se_key]`` become the shrunk ones."""
        v = vals[key]
        new, se, c = james_stein(v.numpy(), base.numpy(), ses[se_key].numpy())
        vals[key] = torch.as_tensor(new, dtype=v.dtype).reshape(v.shape)
        ses[se_key] = torch.as_tensor(se, dtype=v.dtype).reshape(v.shape)
        return c

    factors = {}
    for n, (base_unc, base_sites) in bases.items():
        if unc[n]["mean"].numel() < SHRINK_MIN_COORDINATES:
            continue
        f = {}
        for out, base in ((unc[n], base_unc), (sites[n], base_sites)):
            if base is None:  # no monotone elementwise transform: the constrained summaries are plain ones
                continue
            f["mean"] = shrink(out, "mean", base["mean"], out, "mean_mcse")
            f["sd"] = shrink(out, "sd", base["sd"], out, "sd_mcse")
            for p in out.get("quantiles", {}):
                f[p] = shrink(out["quantiles"], p, base["quantiles"][p], out["quantile_mcse"], p)
        factors[n] = f
    return factors


def _unsettled_message(d, adapt):
    """The warning of a correction whose weighted draws moved far from the proposal they came from."""
    how = []
    if d.sd_ratio[1] > NARROW_SD_RATIO:
        how.append(f"the importance-weighted sd of some coordinate is {d.sd_ratio[1]:.2f} times the proposal's own "
                   "(the proposal is still too narrow there)")
    if d.mean_shift > BIASED_SHIFT:
        how.append(f"a weighted mean lies {d.mean_shift:.2f} of its sds from the proposal's")
    more = f"adapt={AUTO_ROUNDS}, " if adapt != "auto" and adapt < AUTO_ROUNDS else ""
    return (f"corrected posterior: PSIS k_hat = {d.k_hat:.2f} ({d.num_draws} draws, proposal {d.proposal!r}), but "
            f"{' and '.join(how)}: importance estimates from a proposal that misses the posterior this way are biased "
            f"toward it. Call res.corrected() with {more}more draws (num_draws) or another seed, or {d.fallback}")


def _check_options(adapt, estimator, adaptation, probs):
    if adapt != "auto" and (isinstance(adapt, (bool, str)) or not isinstance(adapt, (int, np.integer, float))
                            or (isinstance(adapt, float) and not adapt.is_integer()) or adapt < 0):
        raise ValueError(f"adapt: expected 'auto' or a number of adaptation rounds >= 0, got {adapt!r}")
    if estimator not in ("cv", "snis"):
        raise ValueError(f"estimator: expected 'cv' (control variates from the proposal's known moments) or 'snis' "
                         f"(plain self-normalised importance sampling), got {estimator!r}")
    if adaptation not in ADAPTATIONS:
        raise ValueError(f"adaptation: expected 'affine' (a moment-matched affine map of the whitened field, rounds "
                         f"pooled) or 'diagonal' (a shift and scale per coordinate), got {adaptation!r}")
    try:
        probs = tuple(float(p) for p in probs)
    except TypeError:
        raise ValueError(f"probs: expected a sequence of quantile levels in (0, 1), e.g. (0.05, 0.5, 0.95), got "
                         f"{probs!r}") from None
    if not all(0 < p < 1 for p in probs):
        raise ValueError(f"probs: quantile levels must lie in (0, 1), got {probs}")
    return probs


def _grid_refit(result, d, regrid, progress):
    """With ``regrid``, when the correction ``d`` of at most :data:`~pyro_convexvb.infer.hyper.GRID_MAX_DIM`
    hyper-latent dimensions is unreliable and the engine is at hand, the fit again on a grid grown on to the prior's
    quantiles it leaves out (:meth:`~pyro_convexvb.infer.hyper.FieldRefit.on_grid`): for a central composite design,
    and for a grid whose reach check found such mass (``d.reach``) and that was not grown so already; else ``None``."""
    from ..infer.hyper import GRID_MAX_DIM

    if not regrid or d.reliable or not _integrates_hyper(result):
        return None
    hp = result.posterior
    refit = getattr(hp, "refit", None)
    if hp.space.dim > GRID_MAX_DIM or refit is None or not refit.available:
        return None
    if hp.density.kind == "surface" and (d.reach is None or d.reach.passed or refit.probed):
        return None
    return refit.on_grid(progress)


def correct(result, num_draws=CORRECTION_DRAWS, seed=0, *, proposal="auto", probs=(0.05, 0.5, 0.95), warn=True,
            progress=False, estimator="cv", adapt="auto", adaptation="affine", shrink=None, regrid=True):
    """Importance-corrected means, sds and quantiles of every latent site, with Monte Carlo errors.

    Over 80 lines: most of it is this docstring; the body is under 80.

    Draws from a proposal built from the fitted posterior are weighted by ``p(y, x) / q(x)`` (Pareto-smoothed,
    self-normalised). With ``proposal="auto"`` the fitted posterior is tried first (for hyper-latents integrated
    over, ``"interpolated"``: the field's Gaussian moved to the locations and scales interpolated between design
    points); if its importance ESS is below 80% of the draws (with ``adapt="auto"``, also when its weighted draws
    are wider than it or off its means: :data:`SETTLED_SD_RATIO`, :data:`SETTLED_SHIFT`), up to ``adapt`` further
    rounds draw from the proposal
    adapted to the weighted draws so far: with ``adaptation="affine"`` (default) an affine map of the field's
    whitened coordinates moment-matched to them (a shift, scales and a few directions, each shrunk by its Monte
    Carlo noise; :mod:`~pyro_convexvb.diagnostics.whitened`; a fifth of each adapted round's draws Student-t
    through the same map, a defensive share that keeps the weights bounded in tails the Gaussian misses), every
    round's draws pooled against the mixture of the rounds' proposals (proposal ``"affine"``); with ``"diagonal"`` a
    shift and scale per coordinate
    (:class:`~pyro_convexvb.diagnostics.proposals.AdaptedProposal`, the last round's draws only). Rounds are kept
    while they improve the importance ESS, and the affine rounds go on while they also improve the ESS per draw;
    with ``adapt="auto"`` (default) they stop after two adapted rounds once the last proposal is nowhere narrower
    than the weighted draws and centred on them (no coordinate's weighted sd above 1.1 times the proposal's own, no
    weighted mean 0.3 sds from its own, beyond 2 Monte Carlo errors), else after at most eight (each round may halve
    or double a whitened coordinate's scale, so a posterior several times wider than the Gaussian is reached).
    If the proposal's ``k_hat`` is above the threshold or its weighted moments disagree with its own
    (:attr:`ImportanceDiagnostics.ok`), the defensive mixtures ``"widened"`` (scales times 1.5) and ``"student_t"``
    (5 degrees of freedom) are tried with fresh draws (also when the adapted proposal has not settled, below), and
    the proposal used is a reliable one (``k_hat`` below the threshold), among those a settled one, then the one
    with the largest importance ESS, or, if none is reliable, the one with the smallest ``k_hat``. When the search
    for posterior modes of a model with sites that are not log-concave found other modes holding at least 0.1% of
    the mass (:mod:`~pyro_convexvb.diagnostics.modes`), all of these are blind to them and the mixture over the
    modes (proposal ``"modes"``) is used instead. A warning
    (:class:`ApproximationWarning`) says when even that one is unreliable, or when it has not settled: its weighted
    draws are wider than the proposal by more than 20% in some coordinate or their means moved more than 0.5 sds
    from its own (importance estimates from such a proposal are biased toward it, whatever ``k_hat`` says).

    The summaries are control-variate (regression) estimates by default (``estimator="cv"``,
    :mod:`~pyro_convexvb.diagnostics.control_variates`): the proposal's exactly known conditional moments and CDFs
    remove the Monte Carlo noise of the draws themselves (exact when the weights are flat), at no extra model
    evaluation; ``estimator="snis"`` gives the plain self-normalised estimates.

    On a site with many coordinates (a field: at least
    :data:`~pyro_convexvb.diagnostics.control_variates.SHRINK_MIN_COORDINATES`) the corrections of each statistic
    (means, sds, each quantile level), relative to the proposal's own answer from the same draws, are shrunk
    together by a positive-part James-Stein factor computed from their Monte Carlo errors
    (:func:`~pyro_convexvb.diagnostics.control_variates.james_stein`; ``shrink=True``, the default with
    ``estimator="cv"``): corrections that are noise are pulled back, a correction shared by the field is kept
    (factor near 1). The factors are in :attr:`CorrectedPosterior.shrinkage`, and the reported errors include the
    shrinkage's estimated risk.

    :param result: an :class:`~pyro_convexvb.InferenceResult` fitted on a Pyro model.
    :param int num_draws: draws per proposal tried (per round).
    :param str proposal: ``"auto"``, ``"fitted"``, ``"interpolated"``, ``"widened"`` or ``"student_t"``.
    :param probs: quantile levels.
    :param str estimator: ``"cv"`` or ``"snis"``.
    :param adapt: ``"auto"`` or the number of adaptation rounds at most (``proposal="auto"`` only; 0 for none;
        ``"auto"`` is 2 for ``adaptation="diagonal"``), ``num_draws`` model
        evaluations each.
    :param str adaptation: ``"affine"`` or ``"diagonal"`` (``proposal="auto"`` only).
    :param bool shrink: shrink the corrections of fields (default: with ``estimator="cv"``; the plain estimator's
        own answer from flat weights carries the draws' noise, so ``shrink=True`` with ``"snis"`` is refused).
    :param bool regrid: when the correction of at most three hyper-latents integrated by a central composite design
        (the default design for three) is unreliable (``k_hat`` above its threshold or a failed field check), or
        that of a grid whose reach check found mass beyond it (``ImportanceDiagnostics.reach``; a grid not grown so
        already), fit the model again with them on a grid grown on to the prior's quantiles it leaves out
        (``options={"hyper_strategy": "grid", "hyper_probe": True}``, every other option kept; 1,000-2,200 fits in
        three dimensions, tens in one) and correct that fit instead: :attr:`CorrectedPosterior.refit` holds it,
        :attr:`CorrectedPosterior.replaced` the first correction's diagnostics, and a warning says so. ``False``
        reports the first correction as unreliable. Nothing happens for other results, four or more hyper-latents,
        or a copied result without its engine.
    :returns: :class:`CorrectedPosterior`.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(y=None):
        ...     s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64)))
        ...     with pyro.plate("data", 5):
        ...         pyro.sample("y", dist.Normal(torch.tensor(0.0, dtype=torch.float64), s), obs=y)
        >>> res = pcv.fit(model, y=torch.tensor([0.3, -0.5, 1.2, 0.1, -0.8], dtype=torch.float64),
        ...               engine="laplace", progress=False)
        >>> c = correct(res, num_draws=1000)
        >>> sorted(c.sites["s"])[:3], c.sites["s"]["mean"].shape
        (['mean', 'mean_mcse', 'quantile_mcse'], torch.Size([]))
    """
    probs = _check_options(adapt, estimator, adaptation, probs)
    if proposal != "auto" and (adapt != "auto" or adaptation != "affine"):
        raise ValueError(f"adapt and adaptation apply to proposal='auto' only (its rounds adapt the fitted proposal); "
                         f"proposal={proposal!r} draws from that proposal alone: leave them at their defaults")
    check_draws(num_draws, default=CORRECTION_DRAWS)
    check_seed(seed)
    if regrid not in (True, False):
        raise ValueError(f"regrid: expected True or False, got {regrid!r}")
    if shrink is None:
        shrink = estimator == "cv"
    elif shrink not in (True, False):
        raise ValueError(f"shrink: expected True, False or None (True with estimator='cv'), got {shrink!r}")
    elif shrink and estimator != "cv":
        raise ValueError("shrink=True needs estimator='cv': the corrections are shrunk toward the proposal's answer "
                         "from the same draws, which only the control-variate estimates give without the draws' "
                         "own noise")
    if proposal == "auto":
        d = _choose(result, num_draws, seed, progress, adapt, adaptation)
    else:
        d = _importance(result, num_draws, seed, proposal, progress)
    _checks_of(d, result)
    if _integrates_hyper(result):
        from .field_check import check_field

        plain = proposal if proposal in ("fitted", "interpolated") else "interpolated"
        post = proposal_posterior(result)
        d.field_check = check_field(post, make_proposal(post, plain), seed)
        if warn and d.field_check.passed is None:
            warnings.warn(f"corrected posterior: {d.field_check.note}; k_hat alone cannot see a region the field's "
                          "proposal misses", ApproximationWarning, stacklevel=2)
    elif warn and d.conditional_on is None:
        note = _funnel_note(result)
        if note:
            warnings.warn(note, ApproximationWarning, stacklevel=2)
    grid = _grid_refit(result, d, regrid, progress)
    if grid is not None:
        c = correct(grid, num_draws, seed, proposal=proposal, probs=probs, warn=warn, progress=progress,
                    estimator=estimator, adapt=adapt, adaptation=adaptation, shrink=shrink, regrid=False)
        c.refit, c.replaced = grid, d
        if warn:
            design = ("the grid's reach check found mass it leaves out" if result.posterior.density.kind == "surface"
                      else "the central composite design's correction was unreliable")
            warnings.warn(f"corrected posterior: {design} ({d.message}"
                          f"); refitted with the hyper-latents on a grid grown on to the prior's quantiles it left out "
                          f"(hyper_probe=True; {grid.hyper['evaluations']} fits, "
                          f"{grid.seconds:.1f} s) and corrected that fit, k_hat {c.k_hat:.2f}: the result's own "
                          "hyper-latent marginals may be off, the refit's are in corrected.refit.hyper",
                          ApproximationWarning, stacklevel=3)
        return c
    if warn and not d.reliable:
        warnings.warn("corrected posterior: " + d.message, ApproximationWarning, stacklevel=3)
    elif warn and not _settled(d):
        warnings.warn(_unsettled_message(d, adapt), ApproximationWarning, stacklevel=3)
    hyper_names = getattr(getattr(result.posterior, "space", None), "names", None) if d.conditional_on is None else None
    sites, unc, bases, tails = _summaries(result, d, estimator, probs, seed, hyper_names, baseline=shrink)
    factors = _shrink(sites, unc, bases) if shrink else {}
    tails = _unbounded_sds(sites, tails, warn)
    hyper = {n: sites[n] for n in hyper_names} if hyper_names else None
    loc = scale = loc_se = scale_se = None
    layout = getattr(result.posterior, "layout", None)
    if layout is not None:
        names = [b.name for b in layout.blocks]
        cat = lambda key: layout.flatten({b: unc[b][key].reshape(unc[b][key].shape) for b in names})  # noqa: E731
        loc, scale, loc_se, scale_se = (cat(k).double() for k in ("mean", "sd", "mean_mcse", "sd_mcse"))
    return CorrectedPosterior(sites, hyper, loc, scale, loc_se, scale_se, d, probs, unc, _log_joint(result), factors,
                              sd_tail_k=tails)
