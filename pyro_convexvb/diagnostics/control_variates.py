r"""Control variates for self-normalised importance sampling: the proposal's known moments and CDFs.

The draws ``x_s ~ q`` of :mod:`~pyro_convexvb.diagnostics.importance` come from a proposal whose moments are
known: every field coordinate is, given the draw's mixture component (and hyper-latent cell), Gaussian (or
Student-t) with a known location and scale; the few hyper-latent coordinates are drawn from a density that is
cheap to sample without evaluating the model. A function ``g`` of the draws with ``E_q[g] = 0`` is a control
variate (Owen 2013, §8.9): the regression estimator

.. math::

    \hat\mu_\beta = \sum_s w_s h(x_s) - \beta^\top \bar g, \qquad \bar g = \frac1S \sum_s g(x_s),

with ``w_s`` the self-normalised weights and ``beta`` the least-squares coefficient of the estimate's influence
``a_s = S w_s (h(x_s) - \hat\mu)`` on ``g(x_s)``, has Monte Carlo variance ``Var(a - beta^T g) / S`` (Owen 2013,
§9.10). With ``g = h - E_q[h]`` and ``beta = 1`` it is ``E_q[h] + sum_s (w_s - 1/S)(h(x_s) - E_q[h])``: it returns
the proposal's exact expectation when the weights are flat (target = proposal), whatever the draws.

Controls used per coordinate ``u`` (conditional mean ``m_s`` and variance ``v_s`` of ``u`` given the draw's
component, known exactly, so that ``E_q[g | component] = 0`` and hence ``E_q[g] = 0``):

* for means and second moments: ``u - m_s`` and ``(u - m_s)^2 - v_s``;
* for a CDF at ``t`` (quantiles): ``1[u <= t] - F_s(t)``, ``F_s`` the conditional normal (or Student-t) CDF.

For the hyper-latent coordinates (a grid surface or split normal of the integration design) the expectations
``E_q[g]`` are taken from ``M`` reference draws of the hyper-latents alone (no model evaluation; ``M = 200,000``
by default), whose own Monte Carlo error ``Var(beta^T g) / M`` is added to the reported one.
"""
import math

import numpy as np
import torch
from scipy import special

__all__ = ["regression_estimate", "cv_moments", "cv_quantiles", "CoordinateControls", "james_stein"]


def regression_estimate(h, w, G=None, G_ref=None):
    r"""Control-variate (regression) estimate of ``E_p[h]`` from self-normalised importance weights.

    :param h: ``(S, p)`` function values at the draws.
    :param w: ``(S,)`` normalised importance weights.
    :param G: ``(S, p, k)`` controls with ``E_q[g] = 0`` (``None`` or ``k = 0``: the plain self-normalised
        estimate).
    :param G_ref: ``(M, p, k)`` the controls at the reference draws whose mean made them centred (``None`` if
        they are centred exactly); adds the reference's Monte Carlo variance.
    :returns: ``(estimate (p,), mcse (p,), beta (p, k))``.

    Example (flat weights, a control equal to ``h - E_q h``: the proposal's expectation exactly)::

        >>> rng = np.random.default_rng(0)
        >>> x = rng.normal(size=(100, 1)); w = np.full(100, 0.01)
        >>> est, se, beta = regression_estimate(x, w, x[:, :, None] - 0.0)
        >>> float(abs(est[0])) < 1e-8, float(se[0]) < 1e-8
        (True, True)
    """
    return regression_estimates([h], w, G, G_ref)[0]


def regression_estimates(hs, w, G=None, G_ref=None):
    """:func:`regression_estimate` of several functions ``hs`` (a list of ``(S, p)`` arrays) with the same weights
    and controls: the controls' centring and normal-equation matrix are formed once. A list of
    ``(estimate, mcse, beta)``, the same numbers as one call each."""
    w = np.asarray(w, dtype=np.float64)
    k = 0 if G is None else G.shape[2]
    if k:
        # the k x k normal equations of each coordinate from column products (k is 1 or 2: a batched einsum over
        # (S, p, k) costs several times more)
        gm = G.mean(0)
        gs = [G[..., j] - gm[:, j] for j in range(k)]
        C = np.empty((G.shape[1], k, k))
        for i in range(k):
            for j in range(i + 1):
                C[:, i, j] = C[:, j, i] = np.einsum("sp,sp->p", gs[i], gs[j])
        scale = np.einsum("pkk->p", C) / k
        C = C + (1e-10 * scale + 1e-300)[:, None, None] * np.eye(k)
    out = []
    for h in hs:
        h = np.asarray(h, dtype=np.float64)
        S = h.shape[0]
        mu = w @ h
        a = h - mu
        a *= (S * w)[:, None]
        if not k:
            out.append((mu, np.sqrt(np.einsum("sp,sp->p", a, a)) / S, np.zeros(h.shape[1:] + (0,))))
            continue
        a -= a.mean(0)
        c = np.empty((h.shape[1], k))
        for i in range(k):
            c[:, i] = np.einsum("sp,sp->p", gs[i], a)
        beta = np.linalg.solve(C, c[..., None])[..., 0]
        est = mu - (beta * gm).sum(-1)
        r = a
        for j in range(k):
            r -= gs[j] * beta[:, j]
        var = np.einsum("sp,sp->p", r, r) / (S * max(S - 1 - k, 1))
        if G_ref is not None:
            comb = np.einsum("mpk,pk->mp", G_ref, beta)
            var = var + comb.var(0) / G_ref.shape[0]
        out.append((est, np.sqrt(var), beta))
    return out


def cdf_estimate(ind, F, w, rows=None):
    r""":func:`regression_estimate` of a CDF, ``h = ind`` with the one control ``g = ind - F``, from weighted sums.

    With ``n_s = S w_s``, ``a_s = n_s (ind_s - mu)`` and ``ind_s^2 = ind_s``, every product the normal equations and
    the residual variance need is a weighted sum over the draws of ``ind``, ``F``, ``F^2`` or ``F ind`` (one matrix
    product each), instead of the arrays of centred controls and residuals: the same estimate and error (to
    rounding) from about a third of the passes over the draws. The arrays are coordinate-major (one row per
    coordinate: the quantile solver works on row subsets).

    :param ind: ``(p, S)`` indicators ``x_s <= t`` (0/1, float64); ``F`` ``(p, S)`` the conditional CDFs at ``t``;
        ``w`` ``(S,)`` normalised weights.
    :param rows: ``(S,)`` boolean: the estimate from those draws only (``w`` zero elsewhere), as if the others
        were not there (``None``: all).
    :returns: ``(estimate (p,), mcse (p,))``.

    Example (the same numbers as the generic regression)::

        >>> rng = np.random.default_rng(0)
        >>> F = rng.uniform(size=(50, 3)); ind = (rng.uniform(size=(50, 3)) < F).astype(float)
        >>> w = rng.uniform(size=50); w /= w.sum()
        >>> est, se = cdf_estimate(ind.T, F.T, w)
        >>> est2, se2, _ = regression_estimate(ind, w, (ind - F)[..., None])
        >>> bool(np.allclose(est, est2, atol=1e-12) and np.allclose(se, se2, atol=1e-12))
        True
    """
    one = np.ones(ind.shape[1]) if rows is None else np.asarray(rows, dtype=np.float64)
    S = int(one.sum())  # every sum below runs over the rows (one and n are zero elsewhere)
    n = np.asarray(w, dtype=np.float64) * S
    FI = F * ind
    s_ind = ind @ np.stack([one, n, n * n], 1)  # (p, 3): sums of ind, n ind, n^2 ind
    s_F = F @ np.stack([one, n], 1)
    s_FI = FI @ np.stack([one, n], 1)
    np.multiply(F, F, out=FI)  # F^2, in the buffer of F ind
    s_F2 = FI @ one
    mu = s_ind[:, 1] / S
    a_bar = (s_ind[:, 1] - S * mu) / S
    g_bar = (s_ind[:, 0] - s_F[:, 0]) / S
    ga = (1.0 - mu) * s_ind[:, 1] - s_FI[:, 1] + mu * s_F[:, 1]  # sum of g a
    c = ga - S * g_bar * a_bar
    C = (s_ind[:, 0] - 2.0 * s_FI[:, 0] + s_F2) - S * g_bar**2
    A = s_ind[:, 2] * (1.0 - 2.0 * mu) + mu**2 * float(n @ n) - S * a_bar**2
    # regularised as in regression_estimate; the residual with the raw C.  A control that is 0 on every draw
    # (conditional CDFs of exactly 0 or 1 where the indicators are) leaves C and c at rounding, whose ratio could
    # be anything up to overflow: no control there
    live = C > 1e-12 * (s_ind[:, 0] + 2.0 * np.abs(s_FI[:, 0]) + s_F2 + S * g_bar**2)
    beta = np.where(live, c / np.where(live, C + 1e-10 * C + 1e-300, 1.0), 0.0)
    var = np.maximum(A - 2.0 * beta * c + beta**2 * C, 0.0) / (S * max(S - 2, 1))
    return mu - beta * g_bar, np.sqrt(var)


class CoordinateControls:
    """What the proposal knows about one block of unconstrained coordinates ``(S, p)``.

    Either ``conditional``: per draw a location ``loc (S, p)``, scale ``sd (S, p)`` and degrees of freedom
    ``df (S,)`` (``inf`` for a normal) of the coordinate's distribution given the draw's component; or
    ``reference``: ``(M, p)`` draws of the coordinates from the proposal (cheap, no model evaluations).

    Example::

        >>> ctl = CoordinateControls(reference=np.random.default_rng(0).normal(size=(1000, 2)))
        >>> ctl.conditional, ctl.cdf(np.zeros(2)).shape
        (False, (2,))
    """

    def __init__(self, loc=None, sd=None, df=None, reference=None):
        self.loc, self.sd, self.df, self.reference = loc, sd, df, reference
        self._T = None
        if reference is None and loc is None:
            raise ValueError("CoordinateControls needs a conditional location/scale or reference draws")

    @property
    def conditional(self):
        return self.reference is None

    def _t_rows(self):
        """``(S,)`` draws whose component is a Student-t (finite degrees of freedom)."""
        return np.isfinite(np.broadcast_to(np.asarray(self.df, dtype=np.float64), (self.loc.shape[0],)))

    def _var_factor(self):
        df = np.asarray(self.df, dtype=np.float64)
        fin = np.isfinite(df)
        safe = np.where(fin, df, 3.0)
        return np.where(fin, safe / (safe - 2.0), 1.0)[:, None]

    def moment_controls(self, x, transform=None):
        """``(G (S, p, 2), G_ref)``: controls for the mean and second moment of ``x`` (or of ``transform(x)``
        for reference draws, where its expectations are available)."""
        if self.conditional:
            d = x - self.loc
            G = np.stack([d, d**2 - self.sd**2 * self._var_factor()], -1)
            return G, None
        R = self.reference
        fx, fR = (x, R) if transform is None else (transform(x), transform(R))
        gR = np.stack([fR, fR**2], -1)
        m = gR.mean(0)
        G = np.stack([fx, fx**2], -1) - m
        return G, gR - m

    def block(self, cols):
        """The controls of the columns ``cols`` (a slice) only."""
        if self.conditional:
            return CoordinateControls(self.loc[:, cols], self.sd[:, cols], self.df)
        return CoordinateControls(reference=self.reference[:, cols])

    def _transposed(self):
        """Coordinate-major copies ``(locT, sdT, sd32T)`` ``(p, S)`` (the last scaled by ``sqrt(2 pi)``, float32),
        made once: the quantile solver selects coordinates, which are then contiguous rows."""
        if self._T is None:
            sdT = np.ascontiguousarray(self.sd.T)
            self._T = (np.ascontiguousarray(self.loc.T), sdT, (sdT * math.sqrt(2 * math.pi)).astype(np.float32))
        return self._T

    def _conditional_at(self, t, rows=None):
        """``(F, dens)``: the ``(p, S)`` (coordinate-major) conditional CDFs (float64) and densities (float32) at
        ``t (p,)``; with ``rows``, of those coordinates only (``t`` then of their length).

        The standardisation ``(t - loc) / sd`` is formed in float64 (``t`` and ``loc`` may be large and close); the
        normal CDF and density of it are evaluated in float32, about 5 times faster than in float64, with an error
        below 1e-7 in a probability, four orders of magnitude under the Monte Carlo error of the estimates they
        serve. Student-t draws (whose CDF costs about 50 normal ones), where there are any, in float64."""
        locT, sdT, sd32T = self._transposed()
        if rows is not None:
            locT, sdT, sd32T = locT[rows], sdT[rows], sd32T[rows]
        z = np.asarray(t, dtype=np.float64)[:, None] - locT
        z /= sdT
        z32 = torch.from_numpy(z).to(torch.float32)
        F = torch.erfc(z32 * (-1.0 / math.sqrt(2.0))).mul_(0.5).numpy().astype(np.float64)  # ndtr
        z32.square_().mul_(-0.5).exp_()
        dens = z32.numpy()
        draws = self._t_rows()
        if draws.any():
            nu = np.asarray(self.df, dtype=np.float64)[draws][None, :]
            zr = z[:, draws]
            F[:, draws] = special.stdtr(np.broadcast_to(nu, zr.shape), zr)
            dens[:, draws] = np.exp(special.gammaln((nu + 1) / 2) - special.gammaln(nu / 2) + 0.5 * math.log(2.0)
                                    - 0.5 * np.log(nu) - (nu + 1) / 2 * np.log1p(zr**2 / nu))
        dens /= sd32T
        return F, dens

    def cdf(self, t):
        """``(S, p)`` conditional CDFs at ``t (p,)`` (conditional), or ``(p,)`` the reference CDF."""
        if self.conditional:
            return self._conditional_at(t)[0].T
        return (self.reference <= t).mean(0)

    def cdf_terms(self, xT, t, rows=None):
        """What the quantile's Newton step needs at ``t (p,)``, coordinate-major: ``(ind, F, G_ref, dens)``.
        ``ind`` are the ``(p, S)`` indicators ``x <= t`` of the draws ``xT (p, S)``; for conditional controls ``F``
        the ``(p, S)`` conditional CDFs at ``t`` (the control is ``ind - F``; :func:`cdf_estimate`), ``G_ref``
        ``None`` and ``dens`` the ``(p, S)`` conditional densities (float32); for reference draws ``F`` the
        ``(S, p, 1)`` controls centred by the reference (for :func:`regression_estimate`), whose centred
        indicators are ``G_ref``, and ``dens`` ``None``. With ``rows``, of those coordinates only (``t`` then of
        their length)."""
        xs = xT if rows is None else xT[rows]
        ind = (xs <= np.asarray(t, dtype=np.float64)[:, None]).astype(np.float64)
        if not self.conditional:
            R = self.reference if rows is None else self.reference[:, rows]
            indR = (R <= t).astype(np.float64)
            m = indR.mean(0)
            return ind, (ind.T - m)[..., None], (indR - m)[..., None], None
        F, dens = self._conditional_at(t, rows)
        return ind, F, None, dens

    def at(self, x, t, cols=None):
        """:meth:`cdf_terms` of draws ``x (S, p)``, draw-major, with the controls of :func:`regression_estimate`:
        ``(ind (S, p), G (S, p, 1), G_ref, dens (S, p) or None)``, ``G = ind - F`` for conditional controls."""
        ind, F, G_ref, dens = self.cdf_terms(x.T, t, cols)
        if not self.conditional:
            return ind.T, F, G_ref, None
        return ind.T, (ind - F).T[..., None], None, dens.T

    def density(self, x, w, t, dens=None, cols=None):
        """``(p,)`` density at ``t`` of the importance-weighted posterior: the weighted mixture of the conditional
        densities (conditional; ``dens`` the ``(p, S)`` coordinate-major conditional densities at ``t`` from
        :meth:`cdf_terms`, if already computed), or a weighted Gaussian kernel estimate (reference); with ``cols``,
        of those columns of ``x (S, p)``."""
        if dens is None and self.conditional:
            dens = self._conditional_at(t, cols)[1]
        if dens is not None:
            return (dens @ np.asarray(w, dtype=dens.dtype)).astype(np.float64)
        xs = x if cols is None else x[:, cols]
        m = w @ xs
        sd = np.sqrt(np.maximum(w @ (xs - m) ** 2, 1e-300))
        ess = 1.0 / np.sum(w**2)
        bw = 1.06 * sd * ess ** (-0.2)
        z = (t - xs) / bw
        return w @ (np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)) / bw


#: :func:`cv_moments` and :func:`cv_quantiles` work on this many coordinates at a time: their ``(S, block)`` arrays
#: stay in the processor's cache (the quantiles of 6,000 draws of 900 coordinates: 0.8 s instead of 1.1 s at once)
QUANTILE_BLOCK = 32


def cv_moments(x, w, ctl, transform=None, baseline=False, base_rows=None):
    """Control-variate mean and sd of ``x`` (or ``transform(x)``) ``(S, p)`` with their Monte Carlo errors.

    The second moment is taken about the self-normalised mean ``c`` (a constant once the draws are given), and
    the sd's error by the delta method, ``se(M2) / (2 sd)``.

    :param x: ``(S, p)`` unconstrained draws; ``w`` ``(S,)`` normalised weights; ``ctl`` their
        :class:`CoordinateControls` (``None``: the plain self-normalised estimates).
    :param bool baseline: also return the same estimates with flat weights from the same draws and controls (the
        proposal's own answer, :func:`james_stein`'s baseline).
    :param base_rows: ``(S,)`` boolean, the draws the baseline is taken over (``None``: all; e.g. the draws of the
        fitted Gaussians without a defensive component's), flat over them.
    :returns: ``(mean, sd, mean_mcse, sd_mcse)``, each ``(p,)``; with ``baseline``, ``(mean, sd)`` of the flat
        weights appended.

    Example (flat weights: the proposal's mean and sd exactly)::

        >>> rng = np.random.default_rng(0)
        >>> x = 2.0 + 0.5 * rng.normal(size=(200, 1)); w = np.full(200, 1 / 200)
        >>> ctl = CoordinateControls(np.full((200, 1), 2.0), np.full((200, 1), 0.5), np.full(200, np.inf))
        >>> m, s, _, _ = cv_moments(x, w, ctl)
        >>> round(float(m[0]), 6), round(float(s[0]), 6)
        (2.0, 0.5)
    """
    x = np.asarray(x, dtype=np.float64)
    if x.shape[1] > QUANTILE_BLOCK:  # a block of columns at a time (the transform acts elementwise)
        blocks = [slice(b, b + QUANTILE_BLOCK) for b in range(0, x.shape[1], QUANTILE_BLOCK)]
        parts = [cv_moments(x[:, c], w, None if ctl is None else ctl.block(c), transform, baseline, base_rows)
                 for c in blocks]
        return tuple(np.concatenate(r) for r in zip(*parts))
    G, G_ref = (None, None) if ctl is None else ctl.moment_controls(x, transform)
    h = x if transform is None else transform(x)
    c = w @ h
    (mean, mean_se, _), (m2, m2_se, _) = regression_estimates([h, (h - c) ** 2], w, G, G_ref)
    var = np.maximum(m2 - (mean - c) ** 2, 0.0)
    sd = np.sqrt(var)
    out = (mean, sd, mean_se, m2_se / (2 * np.maximum(sd, 1e-300)))
    if not baseline:
        return out
    if base_rows is not None:  # the controls are centred given the draw's component: exact on any such subset
        h, G = h[base_rows], None if G is None else G[base_rows]
    flat = np.full(h.shape[0], 1.0 / h.shape[0])
    (mean_b, _, _), (m2_b, _, _) = regression_estimates([h, (h - c) ** 2], flat, G, G_ref)
    return out + (mean_b, np.sqrt(np.maximum(m2_b - (mean_b - c) ** 2, 0.0)))


#: a column whose Newton iterates bracket a root of ``F_cv(t) = p`` within this many Monte Carlo errors of the quantile
#: stops after its step into the bracket (``F_cv`` is a step function: Newton steps chatter across its jumps)
BRACKET_TOL = 0.5


def cv_quantiles(x, w, ctl, probs, start, iterations=3, baseline=False, tol=0.5, base_rows=None):
    r"""Control-variate quantiles of ``x`` ``(S, p)``: solve ``F_cv(t) = p`` by safeguarded Newton steps from
    ``start``.

    Over 80 lines: most of it is this docstring; the body is under 80.

    ``F_cv(t)`` is the regression estimate of ``P(x <= t)`` with the control ``1[x <= t] - F_q(t)``; the
    density in the Newton step is the weighted mixture of the conditional densities (Rao-Blackwellised) or a
    kernel estimate for reference coordinates. The Monte Carlo error of a quantile is ``se(F_cv) / f(t)``.
    ``F_cv`` jumps at every draw (by ``w_s - beta / S``), so near a root Newton steps can chatter across a jump
    instead of shrinking; each column keeps the last points on either side of the root, steps that would leave
    that bracket become secant steps within it, and a bracket narrower than :data:`BRACKET_TOL` Monte Carlo errors
    ends the column after its step.

    :param start: ``(P, p)`` initial quantiles (the self-normalised ones).
    :param int iterations: evaluations of ``F_cv`` after the first at most; every evaluation is followed by a step,
        the last one without evaluating ``F_cv`` after it.
    :param float tol: a column stops once its step is below ``tol`` times its quantile's Monte Carlo error (the
        step is still taken; what remains is of the order of its square: for a step of half an error ``e`` at the
        5% quantile of a normal of sd ``sigma``, about ``0.2 e^2 / sigma``, under 1% of ``e`` whenever ``e`` is
        below ``sigma / 20``), and later steps evaluate the remaining columns only. With flat weights the error is
        zero and all ``iterations`` steps are taken.
    :param bool baseline: also return the quantiles of the same estimator with flat weights (the proposal's own
        answer), by ``iterations - 1`` steps from the last weighted evaluation, whose controls it reuses;
        ``base_rows`` ``(S,)`` boolean: flat over those draws only (zero weight on the others).
    :returns: ``(quantiles (P, p), mcse (P, p))``; with ``baseline``, the flat-weight quantiles ``(P, p)``
        appended.

    Example (flat weights: the proposal's quantiles)::

        >>> rng = np.random.default_rng(0)
        >>> x = rng.normal(size=(200, 1)); w = np.full(200, 1 / 200)
        >>> ctl = CoordinateControls(np.zeros((200, 1)), np.ones((200, 1)), np.full(200, np.inf))
        >>> from pyro_convexvb.diagnostics.psis import weighted_quantiles
        >>> q, _ = cv_quantiles(x, w, ctl, (0.05, 0.95), weighted_quantiles(x, w, (0.05, 0.95))[0])
        >>> np.round(q[:, 0], 4).tolist()
        [-1.6449, 1.6449]
    """
    x = np.asarray(x, dtype=np.float64)
    start = np.asarray(start, dtype=np.float64)
    out = [np.empty_like(start) for _ in range(3 if baseline else 2)]
    for b in range(0, x.shape[1], QUANTILE_BLOCK):  # every column's Newton steps are its own
        cols = slice(b, b + QUANTILE_BLOCK)
        part = _block_quantiles(x[:, cols], w, ctl.block(cols), probs, start[:, cols], iterations, baseline, tol,
                                base_rows)
        for o, r in zip(out, part):
            o[:, cols] = r
    return tuple(out)


def _block_quantiles(x, w, ctl, probs, start, iterations, baseline, tol, base_rows=None):
    """:func:`cv_quantiles` on the columns of ``x``, all at once.

    Over 80 lines: the evaluation and the safeguarded Newton solver are closures over the block's draws, controls
    and kept evaluations, which the weighted quantiles and their flat-weight baselines share."""
    P = x.shape[1]
    q = np.array(start, dtype=np.float64, copy=True)
    se = np.empty_like(q)
    qb = np.empty_like(q)
    flat = np.full_like(np.asarray(w, dtype=np.float64), 1.0 / x.shape[0])
    if base_rows is not None and ctl.conditional:  # controls centred given the draw's component: exact on a subset
        flat = np.where(base_rows, 1.0 / max(int(np.count_nonzero(base_rows)), 1), 0.0)
    else:  # reference controls are centred over all draws (and the defensive share leaves their coordinates alone)
        base_rows = None
    lo, hi = x.min(0), x.max(0)
    span = 0.5 * (hi - lo)

    xT = np.ascontiguousarray(x.T)  # coordinate-major: the active columns are contiguous rows

    def evaluate(t, act, keep):
        """:meth:`~CoordinateControls.cdf_terms` on the columns ``act`` at ``t[act]``; with ``keep`` (a list), also
        written into it (each column's latest evaluation; the first, on every column, becomes ``keep``)."""
        ev = ctl.cdf_terms(xT, t[act], None if act.size == P else act)
        if keep is None:
            return ev
        if not keep:
            keep.extend(ev)
        else:
            for k, arr in enumerate(ev):
                if arr is None:
                    continue
                if k == 0 or ctl.conditional:  # coordinate-major
                    keep[k][act] = arr
                else:  # the reference controls: draw-major
                    keep[k][:, act] = arr
        return ev

    def solve(t, p, wts, se_out, err, keep=None, t_eval=None, ev=None, iterations=iterations, rows=None):
        """Safeguarded Newton steps on the columns of ``t`` (in place) under weights ``wts``; ``se_out`` receives
        each column's Monte Carlo error (``None``: not kept), ``err`` gives the error scale of the stopping rules
        (``None``: the errors just computed); ``ev`` an evaluation at ``t`` on every column, if already made."""
        act = np.arange(P)
        below = np.full((2, P), np.nan)  # the last point with F_cv < p: (t, F_cv - p)
        above = np.full((2, P), np.nan)  # ... with F_cv >= p
        for it in range(iterations + 1):
            if ev is None:
                ev = evaluate(t, act, keep)
            if t_eval is not None:
                t_eval[act] = t[act]
            ind, G, G_ref, dens = ev
            ev = None
            F, F_se = cdf_estimate(ind, G, wts, rows) if ctl.conditional else \
                regression_estimate(ind.T, wts, G, G_ref)[:2]
            f = np.maximum(ctl.density(x, wts, t[act], dens, None if act.size == P else act), 1e-300)
            r = F - p
            step = np.clip(r / f, -span[act], span[act])
            s = F_se / f
            if se_out is not None:
                se_out[act] = s
            scale = s if err is None else err[act]
            side = np.where(r < 0, 0, 1)
            for k, store in enumerate((below, above)):
                sel = side == k
                store[0, act[sel]], store[1, act[sel]] = t[act[sel]], r[sel]
            a_t, a_r, b_t, b_r = below[0, act], below[1, act], above[0, act], above[1, act]
            bracketed = np.isfinite(a_t) & np.isfinite(b_t)
            with np.errstate(invalid="ignore", divide="ignore"):
                secant = np.where(bracketed, a_t - a_r * (b_t - a_t) / (b_r - a_r), np.nan)
            narrow = bracketed & (np.abs(b_t - a_t) <= BRACKET_TOL * scale)
            new = t[act] - step
            outside = bracketed & ((new - a_t) * (new - b_t) > 0)  # a step leaving the bracket: the secant instead
            new = np.where(outside, secant, new)
            t[act] = np.clip(new, lo[act], hi[act])
            if it == iterations:  # no evaluation left: the last step is taken unchecked
                break
            # Newton's next correction is of order step^2: done; a narrow bracket: done
            act = act[(np.abs(step) > tol * scale) & ~narrow]
            if act.size == 0:
                break

    for i, p in enumerate(probs):
        keep = [] if baseline else None
        t_eval = q[i].copy()
        solve(q[i], p, w, se[i], None, keep, t_eval)
        if baseline:  # Newton steps on the flat-weight CDF from the weighted quantile, each column's last evaluation
            qb[i] = t_eval  # reused first
            solve(qb[i], p, flat, None, se[i], ev=tuple(keep), iterations=iterations - 1, rows=base_rows)
    return (q, se, qb) if baseline else (q, se)


#: sites with fewer coordinates are not shrunk: the common factor's own relative noise is about ``sqrt(2 / k)``
SHRINK_MIN_COORDINATES = 20


def james_stein(estimate, baseline, mcse, min_coordinates=SHRINK_MIN_COORDINATES):
    r"""Shrink the corrections ``estimate - baseline`` of ``k`` exchangeable coordinates toward zero.

    With ``d_i = estimate_i - baseline_i``, each ``N(theta_i, mcse_i^2)``, and ``z_i = d_i / mcse_i``, the
    positive-part James-Stein estimate (James & Stein 1961; Efron & Morris 1975, §2 for the unequal-variance form
    in standardised units) is ``baseline_i + c d_i`` with ``c = (1 - (k - 2) / sum_i z_i^2)_+``: its total squared
    error in units of ``mcse_i^2`` is below the unshrunk estimate's for every ``theta`` when ``k >= 3``. Its risk
    is estimated by Stein's unbiased risk estimate, ``k - (k - 2)^2 / sum z^2`` (``c > 0``) or ``sum z^2 - k``
    (``c = 0``, clipped at 0), plus two of that estimate's standard errors (``sqrt(2 k)`` each); the reported
    error of every coordinate is its ``mcse`` times the square root of that risk per coordinate (at most 1).
    Coordinates with zero ``mcse`` (exact) are kept as they are and not counted.

    :param estimate: ``(...)`` estimates; ``baseline`` the same shape (the proposal's own answer from the same
        draws); ``mcse`` their Monte Carlo errors.
    :param int min_coordinates: below this many counted coordinates nothing is shrunk (factor 1).
    :returns: ``(shrunk (...), mcse (...), c)``.

    Example (pure noise around the baseline is pulled back to it)::

        >>> rng = np.random.default_rng(0)
        >>> est, se, c = james_stein(rng.normal(size=400) * 0.1, np.zeros(400), np.full(400, 0.1))
        >>> c, bool(np.abs(est).max() < 0.05)
        (0.0, True)
    """
    est = np.asarray(estimate, dtype=np.float64)
    base = np.asarray(baseline, dtype=np.float64)
    se = np.asarray(mcse, dtype=np.float64)
    d = est - base
    counted = (se > 0) & np.isfinite(se) & np.isfinite(d)
    k = int(counted.sum())
    if k < max(int(min_coordinates), 3):
        return est, se, 1.0
    z2 = float(((d[counted] / se[counted]) ** 2).sum())
    c = max(0.0, 1.0 - (k - 2) / z2) if z2 > 0 else 0.0
    sure = k - (k - 2) ** 2 / z2 if c > 0 else max(z2 - k, 0.0)
    rho = min(1.0, (sure + 2.0 * math.sqrt(2.0 * k)) / k)
    out = np.where(counted, base + c * d, est)
    return out, np.where(counted, se * math.sqrt(rho), se), c
