r"""Other posterior modes of a model whose likelihood is not log-concave.

With a Gaussian prior and log-concave sites (Bernoulli, Poisson, Binomial, negative binomial, Gamma, Laplace, ...)
the posterior of the latent field is log-concave, so it has one mode. A Student-t site is not log-concave: an
observation far from the others pulls the posterior toward a second mode where its predictor meets it
(``eta_i = y_i``). A Gaussian approximation sits on one mode, and importance weights of draws from it cannot see a
mode it never reaches: the diagnostic's ``k_hat`` stays low while sds are too small.

:func:`check_modes` searches for them. From the fitted Gaussian's moments ``m``, ``S`` (of the field ``u``), each
outlying site of a family that is not log-concave (its peak ``t_i`` more than :data:`OUTLYING` sds of
``eta_i = a_i^T u`` from its mean) gives one start, the Gaussian's conditional mean given ``eta_i = t_i``,

.. math:: u_0 = m + S a_i \,(t_i - a_i^T m) / (a_i^T S a_i),

from which damped Newton steps (:func:`_climb`) climb ``log p(y, u)`` of the latent Gaussian model (every constant
kept). Each mode reached (gradient below tolerance, negative definite Hessian ``-H``) is a new one when it lies more
than one sd (in its own metric ``H``) from every mode found before; its mass is the Laplace estimate

.. math:: \log Z_k = \log p(y, u_k) + \tfrac{n}{2} \log 2\pi - \tfrac12 \log\det H_k .

Starts from pairs of the most outlying sites reach modes where the predictor meets two observations at once, and a
start where the log joint lies far above the first mode's Laplace Gaussian is a *shoulder*: mass the Gaussian misses
without a mode of its own (:data:`SHOULDER_GAP`). When the modes other than the one the fit's mean climbs to hold
at least :data:`MODE_MASS` of the total (or :data:`MODE_IMPACT` weighted by their squared distances), or shoulders
hold :data:`SHOULDER_MASS`, the diagnostic is unreliable and the correction draws from :class:`ModeProposal`: a
share per mode and shoulder (half by Laplace mass, half equal), each a Gaussian at the mode with its Laplace
covariance (a shoulder: the first mode's) and, for the tails, the same Gaussian widened (the defensive mixtures of
Hesterberg 1995, one per component). Its weights are exact importance weights of the model as written, so
``k_hat`` judges it as any other proposal.

With hyper-latents (a Student-t scale with a prior) the field is searched with them fixed: at the fit's mean when
they are coordinates of the fitted Gaussian or mixture (the field's Gaussian is then the fit's conditional one, and
each field mode joins the hyper-latents as fitted in :class:`ModeProposal`), at their heaviest design point when
they are integrated over (the diagnostic is flagged, but the correction cannot add the modes).
"""
import math
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import pyro.poutine as poutine
import torch

from .logjoint import model_of
from .proposals import Proposal

__all__ = ["ModeCheck", "ModeProposal", "check_modes", "MODE_MASS"]

#: other modes holding at least this share of the Laplace mass make the diagnostic unreliable. Small, because the
#: Laplace masses understate a heavy-tailed mode several times over and a mode far away moves the variance by its
#: share times its squared distance: with the Student-t scale at the fit's mean, a Laplace fit's other mode held
#: 0.83% by this measure while its correction without the mode had one sd 11% short
MODE_MASS = 1e-3
#: ... or whose squared distances from the first mode (in its metric ``H``), weighted by their shares, sum to at
#: least this: two groups of modes holding 0.09% of the mass 14-18 sds away put a corrected sd 13% short
MODE_IMPACT = 0.02
#: a site's peak this many sds (of its predictor under the fitted Gaussian) from the predictor's mean is a start
OUTLYING = 3.0
#: starts at most from single sites (the most outlying first), and the most outlying sites whose pairs give starts
#: too (a mode where the predictor meets two observations at once is not reached from either alone)
MAX_STARTS = 40
PAIR_SITES = 6
#: a start where the log joint exceeds the Laplace Gaussian at the first mode by more than ``SHOULDER_GAP`` nats
#: (relative to the mode, where they agree), at most ``SHOULDER_FLOOR`` nats below the mode, is a shoulder: mass the
#: Gaussian misses without a mode of its own (a Student-t posterior whose sds are 1.5-2 times the Laplace ones)
SHOULDER_GAP = 5.0
SHOULDER_FLOOR = 12.0
#: shoulders holding at least this share (by the first mode's volume, which understates a ridge by orders of
#: magnitude: one at 6e-5 by this measure left a correction without it 9% short in an sd) make the diagnostic
#: unreliable
SHOULDER_MASS = 1e-5
#: latent coordinates and design entries at most for the search (dense Hessians)
MAX_LATENTS = 400
MAX_DESIGN = 4_000_000
#: modes kept (the heaviest); Newton steps per climb, their first largest length in whitened coordinates, and the
#: gradient (whitened, relative to ``1 + |log p|``) at which a point with a positive definite ``H`` is a mode
MAX_MODES = 6
MAX_ITER = 100
STEP_BOUND = 3.0
GRAD_TOL = 1e-9
#: the share of each mode's draws from its widened Gaussian, and the widening of its scales
WIDE_SHARE = 0.3
WIDE = 2.0


@dataclass
class ModeCheck:
    """The search for posterior modes (:func:`check_modes`).

    :ivar checked: whether the search ran (``False``: see :attr:`note`).
    :ivar note: why it did not run, or what it searched.
    :ivar locs: ``[(n,)]`` the modes in the proposal's flat coordinates, the one the fit's mean climbs to first.
    :ivar covs: ``[(n, n)]`` their Laplace covariances ``H_k^{-1}``.
    :ivar log_masses: ``(K,)`` their Laplace log masses.
    :ivar starts: ``[(site, row)]`` for each other mode, of the starts that reached it, the site whose predictor is
        nearest its peak there (``None`` for the first).
    :ivar conditional_on: ``{hyper-latent: value}`` where the model has hyper-latents: the search ran on the field
        with them there (at their heaviest design point when integrated over, at the fit's mean when they are
        coordinates of the fitted Gaussian or mixture); else ``None``.
    :ivar correctable: :class:`ModeProposal` covers the modes (:attr:`locs`, :attr:`covs` over every coordinate of
        the fit; for hyper-latents as coordinates, each field mode with the hyper-latents as fitted and the field's
        regression on them kept; for ``hyper="map"``, the field's alone). ``False`` for hyper-latents integrated
        over: the correction follows the design points' Gaussians.
    :ivar fixed: the hyper-latents are fixed at a mode (``hyper="map"``).
    """

    checked: bool
    note: str
    locs: List[torch.Tensor] = field(default_factory=list, repr=False)
    covs: List[torch.Tensor] = field(default_factory=list, repr=False)
    log_masses: np.ndarray = field(default_factory=lambda: np.zeros(0))
    starts: list = field(default_factory=list)
    conditional_on: Optional[dict] = None
    correctable: bool = True
    fixed: bool = False
    shoulders: List[torch.Tensor] = field(default_factory=list, repr=False)
    shoulder_starts: list = field(default_factory=list)
    shoulder_log_masses: np.ndarray = field(default_factory=lambda: np.zeros(0))
    dist2: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    def _weights(self):
        """``(K,)`` the modes' Laplace mass shares."""
        return np.exp(self.log_masses - np.logaddexp.reduce(self.log_masses))

    @property
    def impact(self):
        """``sum_k share_k d_k^2`` over the other modes, ``d_k`` their distance from the first in its metric ``H``:
        about how much of the variance in the modes' direction the first mode's Gaussian misses."""
        return float((self._weights()[1:] * self.dist2[1:]).sum()) if len(self.log_masses) > 1 else 0.0

    @property
    def share(self):
        """The Laplace mass share of the modes other than the first (0 without any)."""
        return float(1.0 - self._weights()[0]) if len(self.log_masses) > 1 else 0.0

    @property
    def _other_modes_count(self):
        return self.share >= MODE_MASS or self.impact >= MODE_IMPACT

    @property
    def shoulder_share(self):
        """The shoulders' share of the mass, each taken as its density times the first mode's Laplace volume (an
        underestimate: a shoulder is a ridge wider than the mode)."""
        if not len(self.shoulder_log_masses):
            return 0.0
        every = np.concatenate([self.log_masses, self.shoulder_log_masses])
        return float(np.exp(np.logaddexp.reduce(self.shoulder_log_masses) - np.logaddexp.reduce(every)))

    @property
    def found(self):
        """Other modes hold at least :data:`MODE_MASS` of the mass or move the variance by :data:`MODE_IMPACT`, or
        shoulders (mass a Gaussian at the first mode misses) hold at least :data:`SHOULDER_MASS`."""
        return self.checked and (self._other_modes_count or self.shoulder_share >= SHOULDER_MASS)

    @property
    def corrects(self):
        """The correction (and LOO) should draw from :class:`ModeProposal`: :attr:`found` and :attr:`correctable`."""
        return self.found and self.correctable

    @property
    def message(self):
        parts = []
        if self._other_modes_count:
            where = ", ".join(f"site {s!r} row {r}" for s, r in self.starts[1:])
            parts.append(f"the posterior has {len(self.locs) - 1} other mode(s), reached from {where} (where the "
                         f"predictor meets the observation), holding about {100 * self.share:.2g}% of its mass by "
                         f"Laplace estimates, at squared distances summing to {self.impact:.2g} weighted by it")
        if self.shoulder_share >= SHOULDER_MASS:
            where = ", ".join(_where(st) for st in self.shoulder_starts)
            parts.append(f"at {len(self.shoulders)} point(s) where predictors meet observations ({where}) the "
                         f"posterior's density exceeds the Laplace Gaussian's at its mode by more than "
                         f"e^{SHOULDER_GAP:g}, and they hold at least {100 * self.shoulder_share:.2g}% of the mass "
                         "(likely far more): its tails are far heavier than a Gaussian's")
        text = "; and ".join(parts)
        if self.conditional_on is not None:
            at = ", ".join(f"{n}={_show(v)}" for n, v in self.conditional_on.items())
            where = ("at the hyper-latents' fixed value (hyper='map')" if self.fixed else
                     "at the hyper-latents' heaviest design point" if not self.correctable else
                     "with the hyper-latents at the fit's mean")
            text = f"{where} ({at}) {text}"
        if not self.correctable:
            return (text + "; each design point's Gaussian covers one mode and importance weights of its draws cannot "
                    "see the rest, whatever k_hat says, and the correction cannot add it with hyper-latents "
                    "integrated over: use a sampler (engine='nuts')")
        return (text + "; the approximation misses that mass and importance weights of its draws cannot see it, "
                "whatever k_hat says. Call res.corrected() (its proposal then has a Gaussian at every mode and "
                "shoulder) or use a sampler (engine='nuts')")


def _where(start):
    """``"site 'y' row 1"``, ``"site 'y' rows 1 and 7"`` or ``"site 'a' row 1 and site 'b' row 2"``."""
    if len(start) == 2 and start[0][0] == start[1][0]:
        return f"site {start[0][0]!r} rows {start[0][1]} and {start[1][1]}"
    return " and ".join(f"site {s!r} row {r}" for s, r in start)


def _show(v):
    v = torch.as_tensor(v)
    return f"{float(v):.3g}" if v.numel() == 1 else str([round(float(t), 3) for t in v.reshape(-1)])


#: priors log-concave in the unconstrained coordinates of their support (``biject_to``: the real line as it is, a
#: positive support through ``log``, an interval through ``logit``, a simplex by stick-breaking), by class name; a
#: latent site with any other prior (``StudentT``, ``Cauchy``, a mixture) may give the posterior modes of its own
LOG_CONCAVE_PRIORS = frozenset({
    "Normal", "MultivariateNormal", "LowRankMultivariateNormal", "SparseGMRF", "Laplace", "Gumbel", "Uniform", "Beta",
    "Gamma", "InverseGamma", "LogNormal", "HalfNormal", "HalfCauchy", "Exponential", "Weibull", "Chi2", "Dirichlet",
    "Delta"})


def _log_concavity(model, args, kwargs):
    """``(likelihood, priors)`` from one trace of ``model``: whether an observed site is not known to be log-concave in
    its predictor (read by a family that is not, or by none, e.g. a ``Cauchy`` likelihood, which extraction refuses:
    the search then says it could not run, rather than nothing), and the latent sites whose prior is not in
    :data:`LOG_CONCAVE_PRIORS`."""
    from ..lgm.extract import _is_subsample, _unwrap, full_data_plates, likelihood_family

    with torch.no_grad(), full_data_plates():
        tr = poutine.trace(model).get_trace(*args, **kwargs)
    sites = [s for s in tr.nodes.values() if s["type"] == "sample" and not _is_subsample(s)]
    families = [likelihood_family(s["fn"]) for s in sites if s["is_observed"]]
    priors = [f"{s['name']} ({type(_unwrap(s['fn'])[0]).__name__})" for s in sites
              if not s["is_observed"] and type(_unwrap(s["fn"])[0]).__name__ not in LOG_CONCAVE_PRIORS]
    return any(f is None or not f.log_concave for f in families), priors


def check_modes(result):
    """:class:`ModeCheck` of ``result`` (cached on it), or ``None`` when every likelihood site is log-concave (one
    mode). ``result.diagnostics.modes`` holds it.

    Example (an observation at -5.2 pulls the posterior toward a second mode)::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> X = torch.stack([torch.ones(10), torch.linspace(-1, 1, 10)], 1).double()
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 2.0).to_event(1))
        ...     with pyro.plate("data", 10):
        ...         pyro.sample("y", dist.StudentT(0.5, X @ w, 1.0), obs=y)
        >>> y = torch.tensor([-0.5, -5.2, 0.0, -3.2, 0.7, 1.5, -91.5, -0.1, 1.5, 3.5], dtype=torch.float64)
        >>> mc = check_modes(pcv.fit(model, X, y=y, engine="laplace", progress=False))
        >>> mc.checked, len(mc.locs), mc.starts, mc.found
        (True, 2, [None, ('y', 3)], True)
    """
    if "_mode_check" not in result.__dict__:
        result.__dict__["_mode_check"] = _check(result)
    return result.__dict__["_mode_check"]


def _moments(post):
    """Mean ``(n,)`` and covariance ``(n, n)`` of a fitted posterior (a mixture's by its components)."""
    if hasattr(post, "covariance"):
        return post.loc.detach(), post.covariance().detach()
    locs, var = post.locs.detach(), post.variances.detach()
    m = locs.mean(0)
    d = locs - m
    return m, torch.diag(var.mean(0)) + d.T @ d / locs.shape[0]


def _check(result):
    model, args, kwargs = model_of(result)
    likelihood, priors = _log_concavity(model, args, kwargs)
    if not likelihood and not priors:
        return None
    skip = lambda why: ModeCheck(False, "posterior modes not searched: " + why)  # noqa: E731
    prior_note = (f"the prior of {', '.join(priors)} is not known to be log-concave, and the search follows only the "
                  "peaks of likelihood sites")
    if not likelihood:
        return skip(prior_note)
    check = _check_likelihood(result, model, args, kwargs, skip)
    if priors:
        check.note = f"{check.note}; {prior_note}"
    return check


def _check_likelihood(result, model, args, kwargs, skip):
    """:func:`_check` for a likelihood that is not log-concave."""
    from ..errors import UnsupportedModelError
    from ..infer.hyper import conditioned_model, find_hyper_sites, theta_space
    from ..lgm.extract import lgm_from_pyro
    from .constrained import proposal_posterior

    post = proposal_posterior(result)
    lgm, at, lift, refused = result.lgm, None, None, None
    point = False
    if type(post).__name__ == "HyperPosterior":  # the field at the hyper-latents' heaviest design point
        k = int(torch.argmax(post.weights))
        at, _ = post.space.unpack(post.z[k])
        point = post.density.kind == "point"  # hyper="map": theta fixed there, the proposal is the field's alone
        model, post, lgm = conditioned_model(model, at), post.components[k], None
    elif lgm is None:
        try:
            lgm = lgm_from_pyro(model, *args, **kwargs)
        except UnsupportedModelError as e:
            refused = e
        layout = getattr(post, "layout", None)
        hyper = [] if lgm is not None or layout is None else \
            [n for n in find_hyper_sites(model, args, kwargs) if n in layout.names]
        if refused is not None and not (hyper and len(hyper) < len(layout.names)):
            return skip(f"the model is no latent Gaussian model ({refused})")
        if hyper:  # hyper-latents as coordinates: the field given them
            try:
                at, post, lift = _given_mean(post, theta_space(model, args, kwargs, hyper))
            except UnsupportedModelError as e:
                return skip(f"the model's hyper-latents cannot be fixed at the fit's mean ({e})")
            model = conditioned_model(model, at)
    if lgm is None:
        try:
            lgm = lgm_from_pyro(model, *args, **kwargs)
        except UnsupportedModelError as e:
            return skip(f"the model is no latent Gaussian model ({refused or e})")
    layout = getattr(post, "layout", None)
    if layout is None or sorted(layout.names) != sorted(lgm.layout.names) or lgm.imputed or lgm.chain is not None:
        return skip("the posterior's coordinates are not those of the latent Gaussian model")
    if lgm.n > MAX_LATENTS or sum(g.size for g in lgm.sites) * lgm.n > MAX_DESIGN:
        return skip(f"{lgm.n} latent coordinates and {sum(g.size for g in lgm.sites)} sites (at most {MAX_LATENTS} "
                    f"and {MAX_DESIGN} design entries)")
    idx = torch.cat([torch.arange(layout[b.name].start, layout[b.name].start + b.size) for b in lgm.layout.blocks])
    m, S = _moments(post)
    m, S = m[idx].to(lgm.dtype), S[idx][:, idx].to(lgm.dtype)
    check = _search(lgm, m, S, idx)
    if at is not None:
        check.conditional_on = {n: v.detach().cpu() for n, v in at.items()}
        check.correctable = lift is not None or point
        check.fixed = point
    if lift is not None and check.checked:
        check.shoulders = [lift(u, check.covs[0])[0] for u in check.shoulders]
        check.locs, check.covs = (list(t) for t in zip(*[lift(u, C) for u, C in zip(check.locs, check.covs)]))
    return check


def _given_mean(post, space):
    """``(values, Gaussian, lift)``: the hyper-latents of ``space`` at the fitted posterior's mean (constrained), the
    Gaussian of the other coordinates given them there (``S_ff - S_fh S_hh^{-1} S_hf``, mean ``m_f``), and the map of
    a field mode back to a Gaussian over all coordinates."""
    from ..lgm.layout import LatentLayout
    from ..posterior.gaussian import GaussianPosterior

    layout = post.layout
    h = torch.cat([torch.arange(layout[n].start, layout[n].start + layout[n].size) for n in space.names])
    field_blocks = [b for b in layout.blocks if b.name not in space.names]
    f = torch.cat([torch.arange(b.start, b.start + b.size) for b in field_blocks])
    m, S = _moments(post)
    at, _ = space.unpack(m[h])
    S_fh = S[f][:, h]
    explained = S_fh @ torch.linalg.solve(S[h][:, h], S_fh.T)
    cond = S[f][:, f] - explained
    sub = LatentLayout.from_shapes([(b.name, b.shape) for b in field_blocks],
                                   event_dims=[b.event_dim for b in field_blocks])

    def lift(u, C):
        """A field mode ``u`` with covariance ``C`` as a Gaussian over every coordinate: the hyper-latents as
        fitted, the field's regression on them kept."""
        mean, cov = m.clone(), S.clone()
        mean[f] = u.to(m)
        cov[f.unsqueeze(1), f] = C.to(S) + explained
        return mean, cov

    return at, GaussianPosterior(m[f], covariance=0.5 * (cond + cond.T), layout=sub), lift


def _dense(group):
    B = group.design
    return B.to_dense() if hasattr(B, "to_dense") else torch.as_tensor(B)


def _starts(lgm, m, S):
    """``[(z, [(site, row), ...], u0)]``: the starts from single outlying sites, most outlying first, then from
    pairs of the :data:`PAIR_SITES` most outlying (the Gaussian's conditional mean given both predictors at their
    peaks)."""
    single = []
    for g in lgm.sites:
        fam = g.base_family
        if fam.log_concave:
            continue
        B = _dense(g)
        peak = fam.peaks()
        eta = B @ m + g.offset
        s2 = ((B @ S) * B).sum(1).clamp_min(1e-300)
        z = (peak - eta).abs() / s2.sqrt()
        for i in torch.nonzero(z > OUTLYING).reshape(-1).tolist():
            single.append((float(z[i]), g.name, i, B[i], float(peak[i] - g.offset[i])))
    single.sort(key=lambda t: -t[0])
    out = [(z, [(site, i)], m + S @ a * (t - a @ m) / (a @ S @ a)) for z, site, i, a, t in single[:MAX_STARTS]]
    top = single[:PAIR_SITES]
    for j in range(len(top)):
        for k in range(j + 1, len(top)):
            A = torch.stack([top[j][3], top[k][3]], 1)  # (n, 2)
            M = A.T @ S @ A
            if float(torch.linalg.det(M)) <= 1e-10 * float(torch.diagonal(M).prod()):
                continue  # the two predictors move together: no point meets both
            t = torch.tensor([top[j][4], top[k][4]], dtype=m.dtype, device=m.device)
            out.append((top[j][0] + top[k][0], [top[j][1:3], top[k][1:3]],
                        m + S @ A @ torch.linalg.solve(M, t - A.T @ m)))
    return out


class _Surface:
    """``log p(y, u)`` of a latent Gaussian model, its gradient and its dense negative Hessian ``H``, and the
    fitted Gaussian's whitening (``u = m + W z``, ``W W^T = S``, metric ``P = S^{-1}``), in whose coordinates the
    Newton steps' damping and step bound are the same in every direction."""

    def __init__(self, lgm, m, S):
        self.lgm, self.m = lgm, m
        self.designs = [_dense(g) for g in lgm.sites]
        self.prec = lgm.dense_prior_prec().to(m.dtype)
        W, info = torch.linalg.cholesky_ex(0.5 * (S + S.T))
        self.W = W if int(info) == 0 else torch.diag(torch.diagonal(S).clamp_min(1e-300).sqrt())
        self.P = torch.cholesky_inverse(self.W)  # S^{-1}, the whitened coordinates' metric

    def value_grad(self, u):
        """``(log p(y, u), d/du)``."""
        u = u.detach().clone().requires_grad_(True)
        f = self.lgm.log_joint(u)
        g, = torch.autograd.grad(f, u)
        return float(f.detach()), g

    def hessian(self, u):
        """``H = -d2 log p(y, u) / du2``: the prior precision plus ``B^T diag(-d2 log t) B`` per group."""
        H = self.prec.clone()
        for g, B in zip(self.lgm.sites, self.designs):
            eta = g.eta(u).detach().requires_grad_(True)
            d1, = torch.autograd.grad(g.family.log_prob(eta).sum(), eta, create_graph=True)
            d2, = torch.autograd.grad(d1.sum(), eta)  # elementwise: the diagonal of the sites' Hessian
            H = H - B.T @ (d2[:, None] * B)
        return 0.5 * (H + H.T)


def _climb(surface, u0, start=None):
    """The mode damped Newton steps reach from ``u0``: ``(u, H, Laplace log mass, covariance H^{-1}, log p)``, or
    ``None`` where they stop short of one (``start``: ``(log p, gradient)`` at ``u0`` if already known). Each step
    solves ``(H + lam P) du = g`` with ``P = S^{-1}`` (Levenberg-Marquardt
    damping in the fitted Gaussian's whitened coordinates, one Cholesky factorisation a trial): ``lam`` 0 where
    ``H`` is positive definite, else raised until it is and the log joint increases, the step at most a radius
    long in those coordinates (:data:`STEP_BOUND` at first, doubled after each bounded step taken as it came)."""
    W, P, u, radius = surface.W, surface.P, u0.detach().clone(), STEP_BOUND
    eps = torch.finfo(u.dtype).eps
    tol = max(GRAD_TOL, 100 * eps)  # float32: its rounding of the gradient
    f, g = surface.value_grad(u) if start is None else start
    for _ in range(MAX_ITER):
        if not math.isfinite(f):
            return None
        H = surface.hessian(u)
        L, info = torch.linalg.cholesky_ex(H)
        if int(info) == 0 and float((W.T @ g).abs().max()) <= tol * (1.0 + abs(f)):
            log_mass = f + 0.5 * u.shape[0] * math.log(2 * math.pi) - float(torch.log(torch.diagonal(L)).sum())
            return u, H, log_mass, torch.cholesky_inverse(L), f
        lam = 0.0 if int(info) == 0 else 1e-3
        for tries in range(80):
            if lam > 0:
                L, info = torch.linalg.cholesky_ex(H + lam * P)
                if int(info) != 0:
                    lam *= 4.0
                    continue
            du = torch.cholesky_solve(g.unsqueeze(1), L).squeeze(1)
            length = float(du @ P @ du) ** 0.5
            clipped = length > radius
            if clipped:
                du = du * (radius / length)
            f_new, g_new = surface.value_grad(u + du)
            if math.isfinite(f_new) and f_new >= f - 10 * eps * abs(f):
                break
            lam = max(4.0 * lam, 1e-3)
        else:
            return None
        if clipped and not tries:  # a full bounded step taken as it came: far from the mode, go further
            radius = min(2.0 * radius, 1e8)
        if f_new - f <= 1e-15 * (1.0 + abs(f)) and length < 1e-12:
            return None  # no progress at a point that is no mode
        u, f, g = u + du, f_new, g_new
    return None


def _search(lgm, m, S, idx):
    surface = _Surface(lgm, m, S)
    first = _climb(surface, m)
    if first is None:
        return ModeCheck(False, "posterior modes not searched: the climb from the fit's mean found no mode")
    modes, starts, failed, shoulders = [first], [None], 0, []
    cand = _starts(lgm, m, S)
    groups = {g.name: (g, surface.designs[i]) for i, g in enumerate(lgm.sites)}

    def miss(start, u):  # how far a site's predictor is from its peak at u
        g, B = groups[start[0]]
        return abs(float(B[start[1]] @ u + g.offset[start[1]] - g.base_family.peaks()[start[1]]))

    u1, H1, f1 = first[0], first[1], first[4]
    for _, where, u0 in cand:
        f0, g0 = surface.value_grad(u0)  # a shoulder: far more density than the first mode's Gaussian gives
        if f0 - f1 > -SHOULDER_FLOOR and f0 - f1 + 0.5 * float((u0 - u1) @ H1 @ (u0 - u1)) > SHOULDER_GAP:
            shoulders.append((f0, u0, where))
        got = _climb(surface, u0, (f0, g0))
        if got is None:
            failed += 1
            continue
        u = got[0]
        same = [k for k, mode in enumerate(modes) if float((u - mode[0]) @ mode[1] @ (u - mode[0])) <= 1.0]
        near = min(where, key=lambda st: miss(st, u))
        if not same:
            modes.append(got)
            starts.append(near)
        elif same[0] > 0 and miss(near, modes[same[0]][0]) < miss(starts[same[0]], modes[same[0]][0]):
            starts[same[0]] = near  # the site whose predictor meets its observation at that mode
    order = [0] + sorted(range(1, len(modes)), key=lambda k: -modes[k][2])[:MAX_MODES - 1]
    kept = []
    for f0, u0, where in sorted(shoulders, key=lambda t: -t[0]):  # one per region, the highest, none at a mode
        if all(float((u0 - v) @ H1 @ (u0 - v)) > 1.0 for v in [modes[k][0] for k in order] + [t[1] for t in kept]):
            kept.append((f0, u0, where))
    kept = kept[:MAX_MODES]
    back = torch.empty_like(idx)
    back[idx] = torch.arange(idx.shape[0])  # the model's coordinates back to the proposal's order
    note = (f"{len(cand)} start(s) from outlying sites, {len(modes)} mode(s), {len(kept)} shoulder(s)"
            + (f", {failed} climb(s) stopped short of a mode" if failed else ""))
    locs = [modes[k][0][back] for k in order]
    covs = [modes[k][3][back][:, back] for k in order]
    dist2 = np.array([float((modes[k][0] - u1) @ H1 @ (modes[k][0] - u1)) for k in order])
    return ModeCheck(True, note, locs, covs, np.array([modes[k][2] for k in order]), [starts[k] for k in order],
                     shoulders=[t[1][back] for t in kept], shoulder_starts=[t[2] for t in kept], dist2=dist2,
                     shoulder_log_masses=np.array([first[2] + t[0] - f1 for t in kept]))


class ModeProposal(Proposal):
    """The mixture over the modes and shoulders of a :class:`ModeCheck`: each a share of half its Laplace mass share
    plus half an equal share, of which ``1 - WIDE_SHARE`` from ``N(u_k, H_k^{-1})`` (a shoulder: the first mode's
    covariance) and :data:`WIDE_SHARE` from the same Gaussian with scales times :data:`WIDE`."""

    name = "modes"

    def __init__(self, check, layout, dtype=torch.float64, device=None, fixed=None):
        self.layout = layout
        # hyper="map": ``(space, z)`` of the hyper-latents held at their mode; the draws cover the field only
        self._fixed = fixed
        if fixed is not None:
            self.covers_hyper, self.fixed = False, fixed[0].unpack(fixed[1])[0]
        self.locs = [u.to(dtype=dtype, device=device) for u in list(check.locs) + list(check.shoulders)]
        covs = list(check.covs) + [check.covs[0]] * len(check.shoulders)
        self.chols = [torch.linalg.cholesky(0.5 * (C + C.T)).to(dtype=dtype, device=device) for C in covs]
        K = len(self.locs)
        # shares: half in proportion to the Laplace masses (a shoulder's: its density times the first mode's
        # volume), half equal, so no region the search found is left with few draws
        log_mass = np.concatenate([np.asarray(check.log_masses, dtype=float),
                                   np.asarray(check.shoulder_log_masses, dtype=float)])
        share = 0.5 * np.exp(log_mass - np.logaddexp.reduce(log_mass)) + 0.5 / K
        # components: (centre, scale factor, log weight)
        self.components = [(k, f, math.log(share[k] * w)) for k in range(K)
                           for f, w in ((1.0, 1.0 - WIDE_SHARE), (WIDE, WIDE_SHARE))]

    def _log_component(self, u, k, f):
        L = self.chols[k] * f
        z = torch.linalg.solve_triangular(L, (u - self.locs[k]).T, upper=False)
        n = u.shape[1]
        return -0.5 * (z**2).sum(0) - torch.log(torch.diagonal(L)).sum() - 0.5 * n * math.log(2 * math.pi)

    def sample(self, S, generator=None):
        w = torch.tensor([math.exp(c[2]) for c in self.components], dtype=torch.float64)
        pick = torch.multinomial(w, S, replacement=True, generator=generator)
        n = self.locs[0].shape[0]
        eps = torch.randn((S, n), generator=generator, dtype=torch.float64).to(self.locs[0])
        u = torch.empty_like(eps)
        for c, (k, f, _) in enumerate(self.components):
            rows = pick == c
            if bool(rows.any()):
                u[rows] = self.locs[k] + f * eps[rows] @ self.chols[k].T
        lq = torch.logsumexp(torch.stack([lw + self._log_component(u, k, f) for k, f, lw in self.components]), 0)
        values = dict(self.layout.unflatten(u))
        if self._fixed is not None:
            space, z = self._fixed
            start = 0
            for name, shape, size in zip(space.names, space.ushapes, space.sizes):
                values[name] = z[start:start + size].reshape((1,) + tuple(shape)).expand((S,) + tuple(shape))
                start += size
        return values, lq.double()


def mode_proposal(result, check):
    """The :class:`ModeProposal` of ``result``'s modes, in the coordinates of its proposals."""
    from .constrained import proposal_posterior

    post = proposal_posterior(result)
    if check.fixed:  # hyper="map": the field's proposal, the hyper-latents at their mode
        field = post.components[0]
        return ModeProposal(check, field.layout, dtype=field.loc.dtype, device=field.loc.device,
                            fixed=(post.space, post.z[0]))
    return ModeProposal(check, post.layout, dtype=post.loc.dtype, device=post.loc.device)
