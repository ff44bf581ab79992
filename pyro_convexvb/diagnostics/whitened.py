r"""Adaptive importance sampling by a whole-field affine moment match in whitened coordinates.

A plain proposal built from the fitted posterior (:mod:`~pyro_convexvb.diagnostics.proposals`) draws, given the
draw's component ``k`` (and for hyper-latents the interpolation frame ``a, d`` at its ``theta``), the field as

.. math:: u = a + d \odot L_k \varepsilon, \qquad \varepsilon \sim N(0, I_n),

``L_k`` a square root of the component's covariance (its lower Cholesky factor, or ``F^{-T}`` for ``F`` that of
a precision). The *whitened coordinates* ``eps`` of a draw
are therefore exactly standard normal under the proposal, whatever the component. The adapted proposal replaces
``eps`` by ``e = mu + B eps`` with

.. math:: B = \mathrm{diag}(s) (I + U \mathrm{diag}(g) U^\top), \qquad B B^\top
   = \mathrm{diag}(s) (I + U \mathrm{diag}(\lambda) U^\top) \mathrm{diag}(s), \quad (1 + g)^2 = 1 + \lambda,

``U`` ``(n, r)`` orthonormal: a shift, a scale per whitened coordinate and ``r`` directions of wider or narrower
spread. Given the component the map is affine, so the density stays exact,
``log q'(u) = log q(u_0) - log|det B|`` with ``u_0`` the base draw and ``log|det B| = sum log s + 1/2 sum
log(1 + lambda)``, and the field's conditional moments are known (mean ``a + d L_k mu``, marginal variances
``d^2 diag(L_k B B^T L_k^T)``), as the control variates need.

The map is fitted (:func:`fit_affine_map`) to the importance-weighted draws of the rounds so far, the moments of
``e`` under the target estimated with the proposal's own moments as control variates (exact when the weights are
flat), and every estimated part shrunk by its Monte Carlo noise: the shift and the scales by positive-part
James-Stein factors (toward 0 and toward the pooled scale; James & Stein 1961, Efron & Morris 1975), the
directions found on one half of the draws and kept only when the other half, independent of the choice, confirms
their strength. The draws of all rounds are pooled with the deterministic-mixture weights
``p / ((1/J) sum_j q_j)`` (the balance heuristic, Veach & Guibas 1995; adaptive multiple importance sampling,
Cornuet, Marin, Mira & Robert 2012; Owen 2013, ch. 9, multiple importance sampling), whose mixture density is
exact as all rounds share the base proposal's ``q(theta)`` and frames: ``log q_j(u) = C(u) + l_j(e)`` with
``l_j(e) = log N(B_j^{-1}(e - mu_j)) - log|det B_j|``. Adaptive importance sampling in general: Cappé, Douc,
Guillin, Marin & Robert (2008); Owen (2013, ch. 10).

Every adapted round has a defensive share (Hesterberg 1995): its ``eps`` comes from
``g = (1 - a) N(0, I) + a t_5(0, I)`` (:data:`DEFENSIVE_WEIGHT`, ``a``), so ``l_j`` has ``log g`` in place of
``log N`` and the weights stay bounded in tails heavier than the Gaussian's, which moment-matched rounds alone never
reach; a draw given its Student-t scale factor ``r`` is normal with its scales times ``r`` (the conditional moments
the control variates use).
"""
import math

import numpy as np
import torch

from .proposals import Proposal, field_vector, with_field

__all__ = ["AffineMap", "WhitenedProposal", "PooledProposal", "fit_affine_map", "mixture_log_q", "whiten"]

#: largest field dimension at which the directions of the map are estimated (an ``(n, n)`` moment matrix)
LOW_RANK_MAX_N = 3000
#: at most this many directions
MAX_DIRECTIONS = 10


#: rows per block of :meth:`AffineMap.log_kernel` and of :func:`fit_affine_map`'s passes over the draws
KERNEL_ROWS = 512

#: the defensive share of the adaptive rounds' draws: each round draws ``eps`` from ``(1 - a) N(0, I) + a t_nu(0, I)``
#: instead of ``N(0, I)`` (Hesterberg 1995, defensive importance sampling), so that the importance weights stay
#: bounded (by ``1 / (1 - a)`` times the Gaussian's weights in the bulk, and by the heavy component in tails that are
#: heavier than any Gaussian's), whatever the tails of the target; ``a = 0.2``
DEFENSIVE_WEIGHT = 0.2
#: the degrees of freedom of the defensive component
DEFENSIVE_DF = 5


class AffineMap:
    r"""``e = mu + diag(s) (I + U diag(g) U^T) eps`` on whitened coordinates (see the module docstring).

    :param mu: ``(n,)`` shift; ``s`` ``(n,)`` positive scales.
    :param U: ``(n, r)`` orthonormal directions (``None``: none); ``lam`` ``(r,)`` their variance changes
        (``> -1``): the scale matrix of ``e`` is ``diag(s) (I + U diag(lam) U^T) diag(s)`` (its covariance when
        ``defensive`` is 0).
    :param float defensive: the share ``a`` in ``[0, 1)`` of draws whose ``eps`` is multivariate Student-t with
        :data:`DEFENSIVE_DF` degrees of freedom (the others standard normal): ``eps`` has the density
        ``g = (1 - a) N(0, I) + a t_nu(0, I)`` and the covariance ``(1 - a + a nu / (nu - 2)) I``.

    Example::

        >>> m = AffineMap(np.array([0.5, 0.0]), np.array([1.0, 2.0]))
        >>> e = m.forward(np.array([[1.0, 1.0]]))
        >>> e.tolist(), np.allclose(m.inverse(e), [[1.0, 1.0]]), round(m.log_det, 6)
        ([[1.5, 2.0]], True, 0.693147)
    """

    def __init__(self, mu, s, U=None, lam=None, defensive=0.0):
        if not 0.0 <= float(defensive) < 1.0:
            raise ValueError(f"AffineMap: expected a defensive share in [0, 1), got {defensive!r}")
        self.defensive, self.df = float(defensive), DEFENSIVE_DF
        #: the variance of each coordinate of ``eps`` under ``g``
        self.spread = 1.0 - self.defensive + self.defensive * self.df / (self.df - 2.0)
        self.mu = np.asarray(mu, dtype=np.float64)
        self.s = np.asarray(s, dtype=np.float64)
        n = self.mu.shape[0]
        self.U = np.zeros((n, 0)) if U is None else np.asarray(U, dtype=np.float64).reshape(n, -1)
        self.lam = np.zeros(0) if lam is None else np.asarray(lam, dtype=np.float64).reshape(-1)
        if self.s.shape != (n,) or not np.all(self.s > 0) or self.lam.shape[0] != self.U.shape[1] \
                or not np.all(self.lam > -1):
            raise ValueError("AffineMap: expected mu (n,), s (n,) > 0, U (n, r) and lam (r,) > -1")
        self.g = np.sqrt(1.0 + self.lam) - 1.0
        self.log_det = float(np.log(self.s).sum() + 0.5 * np.log1p(self.lam).sum())
        #: no shift, unit scales, no directions: ``(e - mu) / s = e`` exactly (the kernel skips two passes)
        self._unmoved = bool(not self.mu.any() and np.all(self.s == 1.0) and self.U.shape[1] == 0)

    @classmethod
    def identity(cls, n, defensive=0.0):
        return cls(np.zeros(n), np.ones(n), defensive=defensive)

    def defended(self, share=DEFENSIVE_WEIGHT):
        """The same map with the defensive share ``share``."""
        return AffineMap(self.mu, self.s, self.U, self.lam, defensive=share)

    @property
    def is_identity(self):
        """The map moves nothing (to ``1e-12``; whatever its defensive share)."""
        return bool(np.abs(self.mu).max(initial=0) <= 1e-12 and np.abs(self.s - 1).max(initial=0) <= 1e-12
                    and np.abs(self.lam).max(initial=0) <= 1e-12)

    @property
    def is_plain(self):
        """The identity without a defensive share: the base proposal itself."""
        return self.is_identity and self.defensive == 0.0

    def defend(self, eps, generator):
        """``(x (S, n), r (S,))``: the standard normal ``eps`` ``(S, n)`` with a share :attr:`defensive` of its rows
        (each independently) turned multivariate Student-t, ``x = r eps`` with ``r = sqrt(nu / chi2_nu)`` (the
        others unchanged, ``r = 1``), drawn with the torch ``generator``; ``x`` has the density ``g``. Given ``r``
        a draw is normal with its scales times ``r``: the conditional moments the control variates use."""
        S = eps.shape[0]
        r = np.ones(S)
        if self.defensive == 0.0:
            return eps, r
        heavy = (torch.rand(S, dtype=torch.float64, generator=generator) < self.defensive).numpy()
        chi2 = (torch.randn((int(heavy.sum()), self.df), dtype=torch.float64, generator=generator) ** 2).sum(1)
        r[heavy] = np.sqrt(self.df / chi2.numpy())
        return eps * r[:, None], r

    def log_base(self, x):
        """``(S,)`` ``log g(x) + n/2 log 2 pi`` at ``x`` ``(S, n)`` (``-|x|^2 / 2`` without a defensive share)."""
        sq = np.einsum("ij,ij->i", x, x)
        return self._log_base_sq(sq, x.shape[1])

    def _log_base_sq(self, sq, n):
        if self.defensive == 0.0:
            return -0.5 * sq
        nu = float(self.df)
        log_t = (math.lgamma(0.5 * (nu + n)) - math.lgamma(0.5 * nu) - 0.5 * n * math.log(0.5 * nu)
                 - 0.5 * (nu + n) * np.log1p(sq / nu))
        return np.logaddexp(math.log1p(-self.defensive) - 0.5 * sq, math.log(self.defensive) + log_t)

    def forward(self, eps):
        """``(S, n)`` whitened draws ``eps`` to ``e``."""
        if self.U.shape[1] == 0:  # no directions: the same numbers without the (S, n) product of zeros
            e = eps * self.s
            e += self.mu
            return e
        return self.mu + self.s * (eps + ((eps @ self.U) * self.g) @ self.U.T)

    def inverse(self, e):
        x = (e - self.mu) / self.s
        return x - ((x @ self.U) * (self.g / (1.0 + self.g))) @ self.U.T

    def log_kernel(self, e):
        """``(S,)`` ``log g(B^{-1}(e - mu)) - log|det B|`` without the ``-n/2 log 2 pi`` (``g`` standard normal
        without a defensive share).

        With ``x = (e - mu) / s`` and ``U`` orthonormal, ``|B^{-1}(e - mu)|^2 = |x|^2 - sum_j (1 - 1/(1 + lam_j))
        (x^T u_j)^2``: the inverse is never formed. Row blocks of :data:`KERNEL_ROWS` keep the temporaries in
        cache (no fresh ``(S, n)`` array per call)."""
        S = e.shape[0]
        sq = np.empty(S)
        if self._unmoved:
            sq[:] = np.einsum("ij,ij->i", e, e)
        else:
            buf = np.empty((min(S, KERNEL_ROWS), e.shape[1]))
            for a in range(0, S, KERNEL_ROWS):
                x = buf[:min(KERNEL_ROWS, S - a)]
                np.subtract(e[a:a + KERNEL_ROWS], self.mu, out=x)
                x /= self.s
                sq[a:a + x.shape[0]] = np.einsum("ij,ij->i", x, x)
                if self.U.shape[1]:
                    sq[a:a + x.shape[0]] -= ((x @ self.U) ** 2) @ (1.0 - 1.0 / (1.0 + self.lam))
        return self._log_base_sq(sq, e.shape[1]) - self.log_det

    def covariance(self):
        """``(n, n)`` scale matrix ``B B^T`` of ``e`` (its covariance without a defensive share)."""
        return (np.diag(np.ones_like(self.s)) + (self.U * self.lam) @ self.U.T) * np.outer(self.s, self.s)

    def second_moment(self):
        """``(n, n)`` ``E[e e^T]`` under the map (the defensive share's heavier spread included)."""
        return self.spread * self.covariance() + np.outer(self.mu, self.mu)

    def field_moments(self, L):
        """``(L mu, diag(L Cov L^T))`` for a square root ``L`` ``(n, n)`` of a component's covariance."""
        Ls = L * self.s[None, :]
        extra = ((Ls @ self.U) ** 2 * self.lam).sum(1) if self.U.shape[1] else None
        Ls *= Ls
        var = Ls.sum(1)
        if extra is not None:
            var = var + extra
        return L @ self.mu, var


def whiten(base, u, frame):
    """``(S, n)`` whitened coordinates of flat field draws ``u`` ``(S, n)`` whose ``frame`` (``(k, a, d)``) is
    that of ``base``'s sample they came from: ``eps = W_k^{-1} ((u - a) / d)``, ``W_k W_k^T`` the covariance of
    component ``k`` (``W_k`` its lower Cholesky factor, or ``F^{-T}`` for ``F`` that of its precision)."""
    k, a, d = frame
    x = u - a if d is None else (u - a) / d
    eps = np.empty_like(x)
    for j in np.unique(k):
        idx = np.nonzero(k == j)[0]
        eps[idx] = base.frame_parts[int(j)].whiten(x[idx])
    return eps


def _color(base, e, frame):
    k, a, d = frame
    x = np.empty_like(e)
    for j in np.unique(k):
        idx = np.nonzero(k == j)[0]
        x[idx] = base.frame_parts[int(j)].color(e[idx])
    if d is not None:
        x *= d
    x += a
    return x


class WhitenedProposal(Proposal):
    """The base proposal's draws moved by an :class:`AffineMap` of their whitened field coordinates.

    :param base: a plain proposal (``"fitted"`` or ``"interpolated"``) whose draws carry frames
        (:attr:`~pyro_convexvb.diagnostics.proposals.Proposal.frame_posteriors`).
    :param layout: the latent layout of the flat field vector ``(n,)``.
    :param amap: the :class:`AffineMap` (the identity: the base proposal itself).

    After :meth:`sample`, ``last_eps`` ``(S, n)`` holds the draws' coordinates ``e`` in the base frame.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> from pyro_convexvb.diagnostics.proposals import make_proposal
        >>> def model(y=None):
        ...     m = pyro.sample("m", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
        ...     with pyro.plate("data", 3):
        ...         pyro.sample("y", dist.Normal(m.sum(), 1.0), obs=y)
        >>> res = pcv.fit(model, y=torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64), engine="laplace",
        ...               progress=False)
        >>> base = make_proposal(res.posterior, "fitted")
        >>> q = WhitenedProposal(base, res.posterior.layout, AffineMap(np.array([0.2, 0.0]), np.array([1.1, 0.9])))
        >>> values, log_q = q.sample(4, torch.Generator().manual_seed(0))
        >>> values["m"].shape, log_q.shape
        (torch.Size([4, 2]), torch.Size([4]))
    """

    def __init__(self, base, layout, amap):
        if base.frame_posteriors is None:
            raise ValueError(f"the {base.name!r} proposal has no whitening frames (a defensive mixture or a mixture "
                             "posterior): adapt a plain 'fitted' or 'interpolated' proposal")
        self.base, self.layout, self.amap = base, layout, amap
        self.name = base.name if amap.is_identity else "affine"  # a defensive share keeps the name
        self.covers_hyper, self.fixed = base.covers_hyper, base.fixed
        self.hp = getattr(base, "hp", None)
        self._eps = self._pending = None

    @property
    def last_eps(self):
        """``(S, n)`` the last draws' coordinates ``e`` in the base frame (whitened on first access)."""
        if self._eps is None and self._pending is not None:
            self._eps = whiten(self.base, *self._pending)
        return self._eps

    def hyper_reference(self, M, generator=None):
        return self.base.hyper_reference(M, generator)

    def sample(self, S, generator=None):
        plain = self.amap.is_plain
        # a moved draw is coloured here, in its frame: the base draws only its whitened coordinates and frame
        self.base.white_only = not plain
        try:
            values, lq = self.base.sample(S, generator)
        finally:
            self.base.white_only = False
        frame = self.base.frame
        # the base draws' whitened coordinates: the standard normal draws they were made from, else whitened
        known = getattr(self.base, "frame_eps", None)
        if known is not None:
            self._eps, self._pending = known, None
        else:
            self._eps, self._pending = None, (field_vector(self.layout, values).double().cpu().numpy(), frame)
        self.defensive_draws = None
        if plain:  # the base draws; whitened only if asked (last_eps)
            self.cond_loc, self.cond_sd = self.base.cond_loc, self.base.cond_sd
            self.cond_cov = self.base.cond_cov
        else:
            eps = self.last_eps
            x, r = self.amap.defend(eps, generator)
            self.defensive_draws = r != 1.0
            e = self.amap.forward(x)
            like = values[self.layout.blocks[0].name]
            values = with_field(self.layout, values, _color(self.base, e, frame), like)
            lq = lq + torch.as_tensor(_moved_density(self.amap, eps, x), dtype=lq.dtype, device=lq.device)
            self.cond_loc, self.cond_sd = self.field_moments(frame, r=r)
            self.cond_cov = self.field_covariance(frame, [self.amap], np.zeros(S, dtype=np.int64), r)
            self._eps, self._pending = e, None
        self.cond_df = np.full(S, np.inf)  # given its component (and defensive scale factor) a draw is normal
        self.frame = frame
        return values, lq

    def field_covariance(self, frame, maps, own, r=None):
        """:class:`~pyro_convexvb.diagnostics.proposals.FieldCovariance` of draws in ``frame`` moved by
        ``maps[own_s]``: ``Cov(u_s) = r_s^2 D_s W_k B B^T W_k^T D_s``, ``B B^T`` the map's scale matrix of ``e``
        and ``r`` ``(S,)`` the draws' defensive scale factors (:meth:`AffineMap.defend`; ``None``: 1)."""
        from .proposals import FieldCovariance, _CovOf

        k, a, d = frame
        if r is not None and np.any(r != 1.0):
            d = np.broadcast_to(r[:, None], a.shape) if d is None else r[:, None] * d
        J = len(maps)
        parts = self.base.frame_parts  # not self: the covariance, which this proposal keeps, would close a cycle
        return FieldCovariance(np.asarray(k, dtype=np.int64) * J + np.asarray(own, dtype=np.int64), d,
                               [_CovOf(parts[j // J], maps[j % J]) for j in range(len(parts) * J)])

    def field_moments(self, frame, amap=None, r=None):
        """``(S, n)`` conditional means and sds of the field given each draw's component and frame (under
        ``amap``, default this proposal's map), and its defensive scale factor ``r`` ``(S,)`` (``None``: 1)."""
        amap = self.amap if amap is None else amap
        k, a, d = frame
        loc = np.empty_like(a, dtype=np.float64)
        sd = np.empty_like(loc)
        for j in np.unique(k):
            idx = np.nonzero(k == j)[0]
            m, v = amap.field_moments(self.base.frame_parts[int(j)].sqrt())
            loc[idx], sd[idx] = m, np.sqrt(v)
        if d is not None:
            loc *= d
            sd *= d
        loc += a
        if r is not None:
            sd *= r[:, None]
        return loc, sd


class PooledProposal(WhitenedProposal):
    """The equal-weight mixture of the adaptive rounds' proposals (each draw's map chosen uniformly among ``maps``):
    the distribution the pooled rounds were drawn from, as one proposal with the exact mixture density
    (:func:`mixture_log_q`) and each draw's conditional moments under its own map.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> from pyro_convexvb.diagnostics.proposals import make_proposal
        >>> def model(y=None):
        ...     m = pyro.sample("m", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
        ...     pyro.sample("y", dist.Normal(m.sum(), 1.0), obs=y)
        >>> res = pcv.fit(model, y=torch.tensor(0.5, dtype=torch.float64), engine="laplace", progress=False)
        >>> q = PooledProposal(make_proposal(res.posterior, "fitted"), res.posterior.layout,
        ...                    [AffineMap.identity(2), AffineMap(np.array([0.2, 0.0]), np.array([1.1, 0.9]))])
        >>> values, log_q = q.sample(6, torch.Generator().manual_seed(0))
        >>> values["m"].shape, log_q.shape
        (torch.Size([6, 2]), torch.Size([6]))
    """

    def __init__(self, base, layout, maps):
        super().__init__(base, layout, maps[-1])
        self.maps, self.name = list(maps), "affine"

    def sample(self, S, generator=None):
        values, lq = self.base.sample(S, generator)
        own = torch.randint(len(self.maps), (S,), generator=generator).numpy()
        u0 = field_vector(self.layout, values)
        k, a, d = frame = self.base.frame
        eps = whiten(self.base, u0.double().cpu().numpy(), frame)
        e, moved, r = np.empty_like(eps), np.empty(S), np.empty(S)
        loc, sd = np.empty_like(eps), np.empty_like(eps)
        for j, m in enumerate(self.maps):
            idx = np.nonzero(own == j)[0]
            x, r[idx] = m.defend(eps[idx], generator)
            e[idx], moved[idx] = m.forward(x), _moved_density(m, eps[idx], x)
            loc[idx], sd[idx] = self.field_moments((k[idx], a[idx], None if d is None else d[idx]), m, r[idx])
        values = with_field(self.layout, values, _color(self.base, e, frame), u0)
        lq_mix = mixture_log_q(lq.double().cpu().numpy() + moved, e, own, self.maps)
        self.cond_loc, self.cond_sd, self.cond_df = loc, sd, np.full(S, np.inf)
        self.cond_cov = self.field_covariance(frame, self.maps, own, r)
        self.defensive_draws = r != 1.0
        self._eps, self._pending, self.frame = e, None, frame
        return values, torch.as_tensor(lq_mix, dtype=torch.float64)


def _moved_density(amap, eps, x):
    """``(S,)`` what moving base draws of whitened coordinates ``eps`` ``(S, n)`` (standard normal) to
    ``e = amap.forward(x)``, ``x`` the draws :meth:`AffineMap.defend` made of them, adds to their log density:
    ``log g(x) - log N(eps) - log|det B|``."""
    return amap.log_base(x) + 0.5 * np.einsum("ij,ij->i", eps, eps) - amap.log_det


def mixture_log_q(log_q_own, eps, own, maps):
    """``(N,)`` log density of pooled draws under the equal-weight mixture of the rounds' proposals.

    :param log_q_own: ``(N,)`` each draw's log density under the proposal it came from; ``eps`` ``(N, n)`` its
        coordinates in the base frame; ``own`` ``(N,)`` the index of that proposal's map in ``maps``.
    """
    return _mixture_from_kernels(log_q_own, np.stack([m.log_kernel(eps) for m in maps], 1), own)


def _mixture_from_kernels(log_q_own, ker, own):
    """``log q_own - ker_own + log mean_j exp(ker_j)``: the mixture's log density from each draw's log kernels
    ``ker`` ``(N, J)`` under the maps and ``own`` (``(N,)`` or one index for all) the column of its own."""
    own_ker = ker[np.arange(ker.shape[0]), own]
    return log_q_own - own_ker + np.logaddexp.reduce(ker, 1) - math.log(ker.shape[1])


def mixture_log_q_rounds(log_q_own, eps, maps, cache):
    """:func:`mixture_log_q` of pooled rounds given round by round: ``log_q_own`` and ``eps`` lists (round ``j``
    drawn with ``maps[j]``); ``cache`` a dict ``{(j, i): kernel of round j's draws under maps[i]}`` kept between
    calls (a round's draws and the maps so far do not change when a round is added). The same numbers as
    :func:`mixture_log_q` on the concatenated draws."""
    out = []
    J = len(maps)
    for j, (lq, e) in enumerate(zip(log_q_own, eps)):
        for i in range(J):
            if (j, i) not in cache:
                cache[(j, i)] = maps[i].log_kernel(e)
        out.append(_mixture_from_kernels(lq, np.stack([cache[(j, i)] for i in range(J)], 1), j))
    return np.concatenate(out)


def _js(excess_sq, noise):
    """Positive-part James-Stein factor ``max(0, 1 - (p - 2)/p sum noise / sum excess^2)`` of ``p`` estimates
    (no shrinkage for ``p <= 2``)."""
    p = excess_sq.shape[0]
    tot = float(excess_sq.sum())
    if p <= 2:
        return 1.0
    return 0.0 if tot <= 0 else max(0.0, 1.0 - (p - 2) / p * float(noise.sum()) / tot)


def fit_affine_map(eps, w, own, maps, seed=0, max_directions=MAX_DIRECTIONS):
    r"""The :class:`AffineMap` moment-matched to importance-weighted draws in whitened coordinates.

    :param eps: ``(N, n)`` coordinates of the pooled draws in the base frame; ``w`` ``(N,)`` their normalised
        (Pareto-smoothed) importance weights; ``own`` ``(N,)`` the index in ``maps`` of the map each was drawn
        with (the rounds' :class:`AffineMap`, equal numbers of draws each).
    :returns: the fitted :class:`AffineMap`.

    The target's mean and second moment of ``e`` are control-variate estimates (the controls ``e - mu_own`` and
    ``e e^T - E_own[e e^T]``, exact under the round's proposal), ``m = sum_s w_s e_s - mean_s(e_s - mu_own)`` and
    ``M = sum_s (w_s - 1/N) e_s e_s^T + mean_s E_own[e e^T]``; each part is shrunk by its Monte Carlo noise (module
    docstring).
    """
    eps = np.asarray(eps, dtype=np.float64)
    N, n = eps.shape
    c = np.asarray(w, dtype=np.float64) - 1.0 / N
    own = np.asarray(own)
    frac = np.bincount(own, minlength=len(maps)) / N
    # mean_s(e_s - mu_own) = mean_s e_s - sum_j frac_j mu_j (no (N, n) array of each draw's map's shift)
    mean = w @ eps - (eps.mean(0) - frac @ np.stack([m.mu for m in maps]))
    # diagonal of the covariance: sum_s c_s e_s^2 + mean_s E_own[e^2] - mean^2
    map_var = np.stack([m.spread * m.s**2 * (1 + (m.U**2 * m.lam).sum(1)) for m in maps])  # (J, n) each map's
    known_diag = frac @ (map_var + np.stack([m.mu**2 for m in maps]))
    c2 = c**2
    # one pass in row blocks: sum_s c_s e_s^2 and sum_s c_s^2 (e - m)^2
    ce2, dev2 = np.zeros(n), np.zeros(n)
    buf = np.empty((min(N, KERNEL_ROWS), n))
    for a in range(0, N, KERNEL_ROWS):
        b = min(N, a + KERNEL_ROWS)
        x = buf[:b - a]
        np.multiply(eps[a:b], eps[a:b], out=x)
        ce2 += c[a:b] @ x
        np.subtract(eps[a:b], mean, out=x)
        x *= x
        dev2 += c2[a:b] @ x
    var = np.maximum(ce2 + known_diag - mean**2, 1e-6)
    # shift: James-Stein toward 0 (noise variance of each coordinate's estimate: sum_s c_s^2 (e - m)^2)
    mu = np.clip(mean * _js(mean**2, dev2), -1.0, 1.0)
    # scales: the pooled scale, and each coordinate's departure from it shrunk toward it
    rho2 = float(var.mean())
    dev4 = np.zeros(n)  # sum_s c_s^2 ((e - m)^2 - var)^2, in row blocks
    for a in range(0, N, KERNEL_ROWS):
        b = min(N, a + KERNEL_ROWS)
        x = buf[:b - a]
        np.subtract(eps[a:b], mean, out=x)
        x *= x
        x -= var
        x *= x
        dev4 += c2[a:b] @ x
    v = rho2 + _js((var - rho2) ** 2, dev4) * (var - rho2)
    # each round may halve or double a coordinate's scale relative to the rounds' proposals so far (a posterior
    # several times wider than the Gaussian is reached in a few rounds, while one noisy round cannot run away)
    s = np.sqrt(np.clip(v, 0.25 * map_var.min(0), 4.0 * map_var.max(0)))
    U = lam = None
    if 0 < max_directions and 2 < n <= LOW_RANK_MAX_N:
        U, lam = _directions(eps, c, own, maps, frac, mean, s, seed, max_directions)
        if U is not None:  # keep the marginal variances the scales matched
            s = s / np.sqrt(1.0 + (U**2 * lam).sum(1))
    return AffineMap(mu, s, U, lam)


#: fields of at least this many coordinates get their leading eigenpairs by Lanczos iterations (ARPACK), not a
#: full eigendecomposition (2.7x faster at 900 coordinates, the same pairs to rounding)
LANCZOS_MIN_N = 400


def _leading_eigenpairs(A, k, seed):
    """``(lam (m,), V (n, m))``: eigenpairs of the symmetric ``A`` including the ``k`` of largest magnitude (all of
    them for a small ``A``)."""
    n = A.shape[0]
    if n < LANCZOS_MIN_N or k >= n // 4:
        return np.linalg.eigh(A)
    from scipy.sparse.linalg import eigsh

    return eigsh(A, k=k, which="LM", v0=np.random.default_rng(seed).standard_normal(n))


def _weighted_gram(X, c, rows=None):
    """``X^T diag(c) X`` ``(n, n)`` for ``X`` ``(m, n)`` and weights ``c`` ``(m,)`` of either sign: two symmetric
    rank-k updates (BLAS ``syrk``, half the flops of a general product), on the rows of positive and of negative
    weight; ``rows`` ``(m,)`` boolean: over those rows only."""
    from scipy.linalg import blas

    def scaled(sel, sign):
        Y = X[sel]  # a copy: scaled in place
        Y *= np.sqrt(sign * c[sel])[:, None]
        return Y

    pos = c > 0 if rows is None else rows & (c > 0)
    # no rows of one sign (degenerate weights: one draw carries them all): LAPACK refuses an empty product
    # (xerbla prints "DSYRK parameter number 7 had an illegal value"); its sum is zero
    M = blas.dsyrk(1.0, scaled(pos, 1.0), trans=1, lower=0) if pos.any() else np.zeros((X.shape[1],) * 2)
    neg = c < 0 if rows is None else rows & (c < 0)
    if neg.any():
        M = blas.dsyrk(-1.0, scaled(neg, -1.0), trans=1, beta=1.0, c=M, lower=0, overwrite_c=1)
    upper = np.triu(M, 1)
    return np.triu(M) + upper.T


def _directions(eps, c, own, maps, frac, mean, s, seed, r_max):
    """Directions where the target's spread of ``z = (e - m) / s`` differs from 1 (``(n, r)`` orthonormal and
    ``(r,)`` variance changes), or ``(None, None)``, by cross-fitting on two halves of the draws: the candidates
    are the leading eigenvectors of the correlation departure estimated from one half, each kept when the other
    half, independent of the choice, estimates its variance change beyond 2 of its Monte Carlo errors and with the
    same sign; the two halves' confirmed low-rank departures are averaged and re-diagonalised."""
    N, n = eps.shape
    K = sum(f * m.second_moment() for f, m in zip(frac, maps))
    half = np.random.default_rng(seed).permutation(N) < N // 2
    R, cs = [], []
    for part in (half, ~half):
        cs.append(np.where(part, c, 0.0) * N / part.sum())
        M = _weighted_gram(eps, cs[-1], part) + K  # the other half's weights are zero
        Ri = (M - np.outer(mean, mean)) / np.outer(s, s)
        np.fill_diagonal(Ri, 1.0)  # the scales s carry the diagonal
        R.append(Ri)
    kept_vectors = []  # (u, a): the confirmed low-rank departure is sum a u u^T
    for a, b in ((0, 1), (1, 0)):
        lam_a, V = _leading_eigenpairs(R[a] - np.eye(n), 2 * r_max, seed)
        kept = 0
        cand = np.argsort(-np.abs(lam_a))[: 2 * r_max]
        Vs = V[:, cand] / s[:, None]
        Z = eps @ Vs - mean @ Vs  # (N, candidates): z @ u with z = (e - m) / s, without z
        for col, j in enumerate(cand):
            u = V[:, j]
            est = float(u @ R[b] @ u) - 1.0
            se = math.sqrt(float((cs[b] ** 2 * (Z[:, col] ** 2 - 1.0 - est) ** 2).sum()))
            if est * lam_a[j] > 0 and abs(est) > 2 * se + 1e-8:
                kept_vectors.append((u, 0.5 * est))
                kept += 1
            if kept == r_max:
                break
    if not kept_vectors:
        return None, None
    # low = B diag(a) B^T has rank <= 2 r_max: its eigenpairs from those of R diag(a) R^T, B = Q R (QR)
    B = np.stack([u for u, _ in kept_vectors], 1)
    Q, Rb = np.linalg.qr(B)
    small = (Rb * np.array([a for _, a in kept_vectors])) @ Rb.T
    lam, W = np.linalg.eigh(0.5 * (small + small.T))
    V = Q @ W
    top = np.argsort(-np.abs(lam))[:r_max]
    top = top[np.abs(lam[top]) > 1e-8]
    if top.size == 0:
        return None, None
    return V[:, top], np.clip(lam[top], -0.6, 3.0)
