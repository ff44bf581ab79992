r"""Model criticism from a fit: PSIS-LOO, WAIC, CPO and PIT.

The draws come from the approximate posterior ``q``, not from the posterior, so the leave-one-out ratios of
observation ``i`` are ``p(y, x_s) / (q(x_s) p(y_i | x_s))``, Pareto-smoothed per observation (Magnusson, Andersen,
Jonasson & Vehtari 2019, §3; Vehtari, Gelman & Gabry 2017, §2.1 for PSIS-LOO):

.. math:: \widehat{\mathrm{elpd}}_i = \log \sum_s \tilde w_{is}\, p(y_i \mid x_s), \qquad
          \tilde w_{is} \propto \mathrm{PSIS}\!\left(\frac{p(y, x_s)}{q(x_s)\, p(y_i \mid x_s)}\right),

with standard error ``sqrt(N var_i elpd_i)`` and ``p_loo = lpd - elpd_loo``; the per-observation ``k_hat`` is
that of the smoothed ratios (it includes the approximation's own error: a high ``k_hat`` for every observation
points at ``q``, a few high ones at influential observations). WAIC (Watanabe 2010; Vehtari et al. 2017, §2.2)
uses the importance-weighted posterior ``sum_s w_s delta_{x_s}`` (the weights of the full-data ratios).
``CPO_i = p(y_i | y_{-i}) = exp(elpd_i)`` and ``PIT_i = P(y_i^{rep} <= y_i | y_{-i})`` (the mid-point
``P(Y < y) + P(Y = y) / 2`` for discrete observations) as in R-INLA (Held, Schrödle & Rue 2010, §2).
"""
import math
from dataclasses import dataclass, field
from typing import Dict

import numpy as np
import torch

from .importance import _log_joint, check_draws, check_seed
from .modes import check_modes, mode_proposal
from .constrained import proposal_posterior
from .proposals import PROPOSALS, make_proposal
from .psis import pareto_k_threshold, psis, psis_smooth

__all__ = ["LOOResult", "loo", "loo_from_log_lik"]

#: default draws of :func:`loo`
LOO_DRAWS = 1000
#: fewest draws of :func:`loo` (the tail of ten draws is the least a Pareto fit takes)
MIN_LOO_DRAWS = 10


@dataclass
class LOOResult:
    """Pointwise predictive criticism of a fit.

    :ivar elpd_loo: PSIS-LOO expected log pointwise predictive density; ``se`` its standard error.
    :ivar p_loo: effective number of parameters ``lpd - elpd_loo``.
    :ivar pareto_k: ``(N,)`` per-observation ``k_hat``; ``threshold`` the reliability threshold.
    :ivar elpd_i: ``(N,)`` pointwise ``elpd``; ``cpo`` ``(N,)`` = ``exp(elpd_i)``; ``pit`` ``(N,)`` (NaN for
        sites without a CDF here: vector observations and families beyond those of
        :meth:`~pyro_convexvb.diagnostics.logjoint.ModelLogJoint.evaluate`).
    :ivar elpd_waic, se_waic, p_waic: WAIC on the same draws.
    :ivar sites: ``{observed site: slice of the N observations}``.
    :ivar k_hat: the full-data ``k_hat`` of the draws (the approximation's diagnostic).

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
        >>> r = res.loo(num_draws=300, seed=0)
        >>> r.pareto_k.shape, r.cpo.shape, r.elpd_loo < 0
        ((40,), (40,), True)
    """

    elpd_loo: float
    se: float
    p_loo: float
    pareto_k: np.ndarray = field(repr=False)
    threshold: float = 0.7
    elpd_i: np.ndarray = field(repr=False, default=None)
    cpo: np.ndarray = field(repr=False, default=None)
    pit: np.ndarray = field(repr=False, default=None)
    elpd_waic: float = math.nan
    se_waic: float = math.nan
    p_waic: float = math.nan
    sites: Dict[str, slice] = field(default_factory=dict)
    k_hat: float = math.nan
    num_draws: int = 0
    proposal: str = "fitted"

    @property
    def num_high_k(self):
        """Observations whose ``k_hat`` is above the threshold (their ``elpd_i`` is unreliable)."""
        return int(np.sum(self.pareto_k > self.threshold))

    @property
    def lpml(self):
        """Log pseudo-marginal likelihood ``sum_i log CPO_i`` (= ``elpd_loo``)."""
        return float(np.sum(np.log(self.cpo)))


def loo_from_log_lik(log_ratios, log_lik, cdf=None, *, observation=None):
    """PSIS-LOO, WAIC, CPO and PIT from importance ratios and a pointwise log-likelihood.

    :param log_ratios: ``(S,)`` ``log p(y, x_s) - log q(x_s)`` (zeros for exact posterior draws).
    :param log_lik: ``(S, N)`` ``log p(y_i | x_s)``.
    :param cdf: optional ``((S, N), (S, N))`` of ``P(Y_i < y_i | x_s)`` and ``P(Y_i = y_i | x_s)`` for PIT.
    :param observation: ``j -> str`` naming column ``j`` in the error for a non-finite log-likelihood (default
        ``"observation j"``).
    :returns: :class:`LOOResult`.

    Example (exact posterior draws, as ``az.loo`` takes them)::

        >>> rng = np.random.default_rng(0)
        >>> mu = rng.normal(0.1, 0.2, size=2000)
        >>> y = rng.normal(size=30)
        >>> ll = -0.5 * (y[None, :] - mu[:, None]) ** 2 - 0.5 * np.log(2 * np.pi)
        >>> r = loo_from_log_lik(np.zeros(2000), ll)
        >>> bool(r.p_loo > 0), r.pareto_k.shape
        (True, (30,))
    """
    lr = np.asarray(log_ratios, dtype=np.float64)
    ll = np.asarray(log_lik, dtype=np.float64)
    S, N = ll.shape
    _check_log_lik(ll, observation or (lambda j: f"observation {j}"))
    lw_full, k_full = psis_smooth(lr)
    lw_loo, ks = psis(lr[:, None] - ll, axis=0)
    elpd_i = np.logaddexp.reduce(lw_loo + ll, axis=0)
    lpd_i = np.logaddexp.reduce(lw_full[:, None] + ll, axis=0)
    w = np.exp(lw_full)[:, None]
    mean_ll = (w * ll).sum(0)
    p_waic_i = (w * (ll - mean_ll) ** 2).sum(0)
    waic_i = lpd_i - p_waic_i
    pit = np.full(N, np.nan)
    if cdf is not None:
        below, at = (np.asarray(a, dtype=np.float64) for a in cdf)
        pit = (np.exp(lw_loo) * (below + 0.5 * at)).sum(0)
    return LOOResult(
        elpd_loo=float(elpd_i.sum()), se=_se(elpd_i), p_loo=float(lpd_i.sum() - elpd_i.sum()),
        pareto_k=ks, threshold=pareto_k_threshold(S), elpd_i=elpd_i, cpo=np.exp(elpd_i), pit=pit,
        elpd_waic=float(waic_i.sum()), se_waic=_se(waic_i), p_waic=float(p_waic_i.sum()),
        k_hat=float(k_full), num_draws=S)


def _se(pointwise):
    """Standard error of a sum of ``N`` pointwise terms, ``sqrt(N var)``; NaN for one term (there is no spread to
    estimate it from: 0 would claim an exact answer)."""
    n = pointwise.shape[0]
    return float(math.sqrt(n * np.var(pointwise))) if n > 1 else float("nan")


def _check_log_lik(ll, where):
    """Refuse a pointwise log-likelihood that is not finite: at a draw where ``p(y_i | x_s) = 0`` the full-data log
    joint is ``-inf`` too, so the leave-one-out ratio ``p(y_{-i}, x_s) / q(x_s)`` cannot be recovered from it (it was
    ``-inf - (-inf)``, NaN, and the Pareto fit refused the column without saying which observation)."""
    bad = ~np.isfinite(ll)
    if bad.any():
        s, j = (int(a[0]) for a in np.nonzero(bad))
        raise ValueError(
            f"log_lik: {where(j)} has log-likelihood {ll[s, j]} at draw {s} ({int(bad[:, j].sum())} of "
            f"{ll.shape[0]} draws; {int(bad.any(0).sum())} observations affected). PSIS-LOO needs p(y_i | x) > 0 and "
            "finite wherever the draws' distribution puts mass: a likelihood whose support depends on a latent "
            "(Uniform(0, theta), a truncated family) or a rate that underflows gives zero density there. Give the "
            "likelihood full support (or parameterise it so that it cannot vanish) before calling loo")


def loo(result, num_draws=None, seed=0, *, proposal=None, progress=False):
    """PSIS-LOO, WAIC, CPO and PIT of a fitted result (see the module docstring).

    :param result: an :class:`~pyro_convexvb.InferenceResult` fitted on a Pyro model.
    :param int num_draws: draws from the proposal (default 1000).
    :param str proposal: the proposal of the draws (default: the one of ``result.correction`` when the result
        was corrected, else the mixture over the posterior's modes when the search for them found others
        (:mod:`~pyro_convexvb.diagnostics.modes`), else ``"fitted"``).
    :returns: :class:`LOOResult` (observations of every observed site, in trace order, masked entries dropped).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(40, 2, dtype=torch.float64); y = (X[:, 0] > 0).double()
        >>> r = pcv.fit(model, X, y=y, engine="dual_vg", progress=False).loo(num_draws=300)
        >>> r.pareto_k.shape, bool(r.elpd_loo < 0)
        ((40,), True)
    """
    lj = _log_joint(result)
    q = None
    if proposal is None:
        c = result.__dict__.get("_correction")
        modes = check_modes(result) if c is None else None
        proposal = c.diagnostics.proposal if c is not None else "fitted"
        if proposal not in PROPOSALS:  # an adapted proposal: the correction's last one, drawn afresh
            q = c.diagnostics.proposal_object
        elif modes is not None and modes.corrects:
            proposal, q = "modes", mode_proposal(result, modes)
    if q is None:
        q = make_proposal(proposal_posterior(result), proposal)
    S = LOO_DRAWS if num_draws is None else num_draws
    check_draws(S, MIN_LOO_DRAWS, LOO_DRAWS)
    check_seed(seed)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        values, log_q = q.sample(int(S), gen)
    out = lj.evaluate(values, pointwise=True, pit=True, progress=progress)
    lr = out["log_joint"] - log_q.double().cpu().numpy()
    names = list(out["log_lik"])
    ll = np.concatenate([out["log_lik"][n] for n in names], 1)
    sites, start = {}, 0
    for n in names:
        m = out["log_lik"][n].shape[1]
        sites[n] = slice(start, start + m)
        start += m
    cdf = None
    if out.get("cdf"):  # sites without a CDF here get NaN (0 * NaN stays NaN in the PIT sum)
        nan = {n: np.full(out["log_lik"][n].shape, np.nan) for n in names if n not in out["cdf"]}
        cdf = tuple(np.concatenate([out["cdf"][n][j] if n in out["cdf"] else nan[n] for n in names], 1)
                    for j in range(2))
    r = loo_from_log_lik(lr, ll, cdf, observation=lambda j: next(
        f"site '{n}', observation {j - sl.start} (flat index, masked entries dropped)"
        for n, sl in sites.items() if sl.start <= j < sl.stop))
    r.sites, r.proposal = sites, proposal
    if ll.shape[1] == 1:
        import warnings

        warnings.warn(f"PSIS-LOO over one observation (site '{names[0]}'): the model's likelihood is one term, so LOO "
                      "leaves all the data out at once and its standard errors are NaN. A site whose rows are one "
                      "event (.to_event(1)) is one observation: put its rows in a pyro.plate to leave one row out at "
                      "a time", UserWarning, stacklevel=3)
    _warn_unreliable(r, lr)
    return r


def _warn_unreliable(r, log_ratios):
    """Warn (:class:`~.importance.ApproximationWarning`) when the draws' own ``k_hat`` or observations' ``k_hat`` are
    above the threshold, as ``az.loo`` does: the estimates then rest on draws that miss part of the posterior."""
    import warnings

    from .importance import ApproximationWarning

    _, k_all = psis_smooth(np.asarray(log_ratios, dtype=np.float64))
    parts = []
    if k_all > r.threshold:  # inf (too few distinct tail draws to fit) too
        parts.append(f"the proposal's k_hat over all observations is {k_all:.2f}")
    if r.num_high_k:
        parts.append(f"{r.num_high_k} of {len(r.pareto_k)} observations have their own k_hat above the threshold")
    if parts:
        warnings.warn(f"PSIS-LOO may be unreliable: {'; '.join(parts)} (the k_hat threshold at {r.num_draws} draws "
                      f"is {r.threshold:.2f}). Call "
                      "res.corrected() first (loo then uses its proposal), or use more draws (num_draws)",
                      ApproximationWarning, stacklevel=3)
