r"""Importance-sampling proposals built from a fitted posterior.

Every proposal draws the model's latent sites in unconstrained coordinates and returns the exact log density
``log q`` of each draw, so that ``log p(y, x) - log q(x)`` are importance ratios with all constants.

* ``"fitted"``: the engine's posterior as it is: a :class:`~pyro_convexvb.GaussianPosterior`, a
  :class:`~pyro_convexvb.infer.diag_mixture.DiagMixturePosterior`, or, for hyper-latents integrated
  INLA-style, the :class:`~pyro_convexvb.infer.hyper.HyperPosterior` mixture: ``theta`` from its smooth density
  (the interpolated surface of a grid design, the split normal of a central composite design) and the field
  from the Gaussian of the design point nearest to ``theta`` (the same rule its guide samples by), so
  ``q(z, u) = q(z) q_{k(z)}(u)``.
* ``"interpolated"`` (hyper-latents integrated over; otherwise the same as ``"fitted"``): ``theta`` as fitted, the
  field from the nearest design point's Gaussian moved to the location and log scales interpolated
  piecewise-linearly between design points, ``u = m(theta) + D(theta) (u_k - m_k)``, density
  ``q_k(u_k) / det D`` exactly;
* ``"adapted"`` (:class:`AdaptedProposal`, built by :func:`~pyro_convexvb.diagnostics.correct` from a first round):
  a proposal's draws shifted and scaled per coordinate to the first round's importance-weighted moments;
* ``"widened"``: the defensive mixture ``(q + q_c) / 2`` (Hesterberg 1995), ``q_c`` the same Gaussians with every
  scale multiplied by ``c = 1.5`` (for hyper-latents: ``theta`` from a normal of scale ``c`` in the standardised
  coordinates of the integration design, or the split normal widened by ``c``).
* ``"student_t"``: the defensive mixture ``(q + t_5) / 2`` with ``t_5`` the multivariate Student-t of 5 degrees
  of freedom with the Gaussian's location and scale matrix (hyper-latents as for ``"widened"``).
"""
import math

import numpy as np
import torch

__all__ = ["PROPOSALS", "make_proposal", "AdaptedProposal", "FieldCovariance"]

PROPOSALS = ("fitted", "interpolated", "widened", "student_t")
WIDEN = 1.5

#: the share of the hyper-latents' draws that the correction's ``"interpolated"`` proposal takes from the tempered
#: surface (:meth:`~pyro_convexvb.posterior.hyper.ThetaDensity.defended`): the adaptive rounds move the field's
#: proposal but not the hyper-latents', whose surface is that of the evidence bound; where the bound falls faster than
#: the evidence (a scale's upper tail), the surface's own draws leave that tail to a few large weights
HYPER_DEFENSIVE_WEIGHT = 0.2
#: the tempering exponent of that share: ``surface^beta``, about twice a Gaussian's variance
HYPER_TEMPER = 0.5
T_DF = 5.0


#: largest latent dimension at which a matrix-free precision is densified for its log density
DENSE_MAX = 4000
#: rows per block of the proposals' elementwise passes over ``(S, n)`` draws (their temporaries stay small)
ROW_BLOCK = 256


def field_vector(layout, values):
    """``(S, n)`` the flat field vector of the draws ``values`` (``{site: (S, ...)}``), the layout's blocks in order."""
    return layout.flatten({b.name: values[b.name] for b in layout.blocks})


def with_field(layout, values, u, like):
    """``values`` with the layout's blocks replaced by the flat field draws ``u`` ``(S, n)`` (an array, made a tensor
    of ``like``'s dtype and device); the other sites (hyper-latents) kept."""
    new = layout.unflatten(torch.as_tensor(u, dtype=like.dtype, device=like.device))
    out = dict(values)
    out.update({b.name: new[b.name] for b in layout.blocks})
    return out


def _triangular_inverse(F):
    """``F^{-1}`` of a lower triangular ``F`` ``(n, n)``: LAPACK's ``trtri`` on the CPU (``n^3 / 3`` flops, a third
    of a triangular solve against the identity, which is what it does on other devices)."""
    if F.device.type == "cpu" and F.dtype in (torch.float32, torch.float64):
        from scipy.linalg import lapack

        inv, info = (lapack.dtrtri if F.dtype == torch.float64 else lapack.strtri)(F.detach().numpy(), lower=1)
        if info == 0:
            return torch.from_numpy(np.tril(inv))
    return torch.linalg.solve_triangular(F, torch.eye(F.shape[0], dtype=F.dtype, device=F.device), upper=False)


#: a dense SPD matrix whose nonzeros lie within this fraction of its size of the diagonal is factorised as a band
#: (LAPACK ``pbtrf``, ``n kd^2`` flops instead of ``n^3 / 3``: a lattice GMRF's precision in its natural ordering)
BAND_FRACTION = 0.125


def _banded_cholesky(A):
    """The lower Cholesky factor ``(n, n)`` of the dense SPD ``A`` by LAPACK's banded factorisation when its
    nonzeros lie in a narrow band (:data:`BAND_FRACTION`), else ``None`` (also when the banded factorisation fails:
    the dense one then reports it). The factor of a band matrix has no fill outside the band: the same factor to
    rounding."""
    if A.device.type != "cpu" or A.dtype != torch.float64 or A.dim() != 2:
        return None
    a = A.detach().numpy()
    n = a.shape[0]
    rows, cols = np.nonzero(a)
    kd = int(np.abs(rows - cols).max(initial=0))
    if n < 64 or kd > BAND_FRACTION * n:
        return None
    from scipy.linalg import LinAlgError, cholesky_banded

    ab = np.zeros((kd + 1, n))
    for d in range(kd + 1):
        ab[d, :n - d] = np.diagonal(a, -d)
    try:
        cb = cholesky_banded(ab, lower=True, check_finite=False)
    except LinAlgError:
        return None
    F = np.zeros((n, n))
    idx = np.arange(n)
    for d in range(kd + 1):
        F[idx[d:], idx[:n - d]] = cb[d, :n - d]
    return torch.from_numpy(F)


def _with_density(post):
    """``post``, or for a matrix-free precision ``A`` (covariance ``precision_scale * A^{-1}``) up to
    :data:`DENSE_MAX` latents the same Gaussian with its dense precision (exact samples and log density)."""
    from ..infer.posterior import GaussianPosterior

    if getattr(post, "kind", None) == "precision_operator" and post.n <= DENSE_MAX:
        cached = post.__dict__.get("_dense_with_factor")
        if cached is not None:
            return cached
        A = post.precision_operator.to_dense()
        A = 0.5 * (A + A.transpose(0, 1)) / post.precision_scale
        # the exact marginal variances from the factor (diag A^{-1} = column norms of F^{-1}), which the proposal
        # uses again (one Cholesky factorisation, no dense inverse)
        F = _banded_cholesky(A)
        if F is None:
            F = torch.linalg.cholesky(A)
        F_inv = _triangular_inverse(F)
        dense = GaussianPosterior(post.loc, (F_inv**2).sum(0), precision=A, layout=post.layout)
        dense.__dict__["_precision_factor"] = (F, F_inv)
        post.__dict__["_dense_with_factor"] = dense
        return dense
    return post


#: pivots of the covariance's Cholesky factor below this fraction of its largest variance mark it singular
SINGULAR_PIVOT = 1e-11


def _singular_message(post):
    """Why a posterior with a singular covariance has no importance diagnostics, naming the sites its null space
    lives on (a field with linear constraints, e.g. an intrinsic GMRF with a sum-to-zero constraint)."""
    cov = post.covariance().detach().double()
    cov = 0.5 * (cov + cov.transpose(0, 1))
    lam, vec = torch.linalg.eigh(cov)
    null = vec[:, lam <= 10 * SINGULAR_PIVOT * lam.abs().max().clamp_min(1e-300)]
    sites = []
    layout = getattr(post, "layout", None)
    if layout is not None and null.shape[1]:
        for b in layout.blocks:
            if float(null[b.slice].abs().max()) > 1e-6:
                sites.append(b.name)
    where = f" (sites {', '.join(repr(n) for n in sites)})" if sites else ""
    return (f"importance diagnostics and correct='psis' need a non-singular posterior covariance; this one is "
            f"singular in {null.shape[1]} direction(s){where}. A latent field with linear constraints (e.g. an "
            "intrinsic GMRF with a sum-to-zero constraint) lives on a subspace, where the proposals work in its free "
            "coordinates; this singularity is not one of a constrained SparseGMRF site of the model (the only kind "
            "the proposals reparametrise). A posterior whose variance is unbounded in these directions (a laplace "
            "fit at the neck of a centred hierarchy's funnel, where the log joint is flat in the log scale) is no "
            "usable approximation: refit with engine='dual_vg' or 'nuts'")


class _GaussianParts:
    """Log densities of the fitted Gaussian ``q``, its widened version and the matching Student-t, at draws."""

    def __init__(self, post):
        if getattr(post, "kind", None) in ("precision_operator", "low_rank"):
            raise NotImplementedError(
                f"importance diagnostics need the posterior's log density, which a {post.kind} posterior of "
                f"{post.n} latents does not give (a matrix-free precision is densified up to {DENSE_MAX} latents; a "
                "Lanczos factor is not a distribution); refit with a dense or Cholesky representation")
        self.post = post
        self.n = post.n
        self._fac = self._np = self._sqrt = None
        self.lp_loc = float(self.log_prob(post.loc))  # = -n/2 log 2 pi - 1/2 log det Sigma

    def factor(self):
        """``(kind, F)``, computed once: ``"precision"`` with ``F`` the lower Cholesky factor of the precision
        (``Sigma = F^{-T} F^{-1}``), or ``"scale"`` with ``F`` that of the covariance (``Sigma = F F^T``)."""
        if self._fac is None:
            p = self.post
            if p.kind == "precision":
                known = p.__dict__.get("_precision_factor")
                self._fac = ("precision", known[0] if known is not None else torch.linalg.cholesky(p._precision))
            else:
                try:
                    L = p.scale_tril()
                except torch.linalg.LinAlgError:
                    raise NotImplementedError(_singular_message(p)) from None
                # a pivot L_ii^2 bounds the smallest eigenvalue from above: a pivot at rounding level means a
                # singular covariance that the factorisation got through by rounding (its density is then noise)
                if float(torch.diagonal(L).min() ** 2) <= SINGULAR_PIVOT * float((L * L).sum(1).max()):  # max variance
                    raise NotImplementedError(_singular_message(p))
                self._fac = ("scale", L)
        return self._fac

    def log_prob(self, u):
        kind, F = self.factor()
        x = (u - self.post.loc).reshape(-1, self.n).to(F.dtype)
        if kind == "precision":
            z = x @ F
        else:
            z = torch.linalg.solve_triangular(F, x.transpose(0, 1), upper=False).transpose(0, 1)
        return self.log_prob_white(z).reshape(u.shape[:-1])

    def log_prob_white(self, eps):
        """``(m,)`` log density at the draws whose whitened coordinates (``u - loc = W eps``) are ``eps (m, n)``."""
        kind, F = self.factor()
        half_logdet = torch.log(torch.diagonal(F)).sum() * (-1.0 if kind == "precision" else 1.0)
        return -0.5 * (eps**2).sum(-1) - half_logdet - 0.5 * self.n * math.log(2 * math.pi)

    def draw(self, m, generator, white=False, color=True):
        """``(m, n)`` draws of the Gaussian ``N(loc, Sigma)`` by its factor; with ``white``, also their whitened
        coordinates ``eps`` (``u - loc = W eps``, :meth:`whiten`), the standard normal draws they were made from.
        Without ``color`` (with ``white``) the draws are not formed: ``(None, eps)``, the same random stream."""
        kind, F = self.factor()
        eps = torch.randn((m, self.n), dtype=F.dtype, device=F.device, generator=generator)
        if white and not color:
            return None, eps
        if kind == "precision":
            x = torch.linalg.solve_triangular(F.transpose(0, 1), eps.transpose(0, 1), upper=True).transpose(0, 1)
        else:
            x = eps @ F.transpose(0, 1)
        u = self.post.loc + x.to(self.post.loc.dtype)
        return (u, eps) if white else u

    # whitened coordinates eps of u - loc = W eps, W W^T = Sigma (numpy, float64)
    def _factor_np(self):
        if self._np is None:
            kind, F = self.factor()
            self._np = (kind, F.detach().double().cpu().numpy())
        return self._np

    def whiten(self, x):
        """``(S, n)`` whitened coordinates of ``x = u - loc`` ``(S, n)``."""
        from scipy.linalg import solve_triangular

        kind, F = self._factor_np()
        return x @ F if kind == "precision" else solve_triangular(F, x.T, lower=True).T

    def color(self, e):
        """``(S, n)`` ``W e`` (the inverse of :meth:`whiten`)."""
        from scipy.linalg import solve_triangular

        kind, F = self._factor_np()
        return solve_triangular(F.T, e.T, lower=False).T if kind == "precision" else e @ F.T

    def sqrt(self):
        """``(n, n)`` the dense square root ``W`` of the covariance the whitened coordinates refer to."""
        if self._sqrt is None:
            from scipy.linalg import solve_triangular

            kind, F = self._factor_np()
            known = self.post.__dict__.get("_precision_factor")
            if kind == "precision" and known is not None:  # F^{-T}
                self._sqrt = known[1].transpose(0, 1).detach().double().cpu().numpy()
            else:
                self._sqrt = solve_triangular(F.T, np.eye(self.n), lower=False) if kind == "precision" else F
        return self._sqrt

    def sample(self, m, generator, kind):
        """``m`` draws of the kind's *second* component (``"widened"``: scale c; ``"student_t"``: t_5)."""
        g = self.draw(m, generator).reshape(m, self.n) - self.post.loc
        if kind == "widened":
            return self.post.loc + WIDEN * g
        # chi^2 with T_DF (an integer) degrees of freedom from the seeded generator
        chi2 = (torch.randn((m, int(T_DF)), dtype=torch.float64, generator=generator) ** 2).sum(1)
        return self.post.loc + g * torch.sqrt(T_DF / chi2).to(g.dtype).reshape(m, 1)

    def log_prob_second(self, u, kind, lp=None):
        if lp is None:
            lp = self.log_prob(u)
        maha = (-2.0 * (lp - self.lp_loc)).clamp_min(0)  # (u - m)^T Sigma^{-1} (u - m)
        if kind == "widened":
            return self.lp_loc - self.n * math.log(WIDEN) - 0.5 * maha / WIDEN**2
        n, nu = self.n, T_DF
        return (self.lp_loc + 0.5 * n * math.log(2 * math.pi) + math.lgamma(0.5 * (nu + n)) - math.lgamma(0.5 * nu)
                - 0.5 * n * math.log(nu * math.pi) - 0.5 * (nu + n) * torch.log1p(maha / nu))


class FieldCovariance:
    """The conditional covariances of the flat field draws given their components:
    ``Cov(u_s | s) = diag(scale_s) C_{cls_s} diag(scale_s)`` (for a Student-t draw, its scale matrix).

    :param cls: ``(S,)`` each draw's class (a component, or a component and an adaptive round's map).
    :param scale: ``(S, n)`` per-draw scales (an interpolation frame, a widened component, an adaptation), or
        ``None`` (all 1).
    :param covs: one callable per class, ``cov(sl)`` returning the block ``C[sl, sl]`` of its ``(n, n)`` matrix on
        the coordinates of the slice ``sl`` (evaluated on first use and kept: only a constrained field's controls
        need them, and only the field's block).
    """

    def __init__(self, cls, scale, covs):
        self.cls = np.asarray(cls, dtype=np.int64)
        self.scale = None if scale is None else np.asarray(scale, dtype=np.float64)
        self._covs, self._done = list(covs), {}

    def matrix(self, j, sl=slice(None)):
        """The class ``j``'s matrix ``C`` on the coordinates ``sl`` (default all): ``C[sl, sl]``."""
        key = (j, sl.start, sl.stop, sl.step)
        if key not in self._done:
            C = np.asarray(self._covs[j](sl), dtype=np.float64)
            self._done[key] = 0.5 * (C + C.T)
        return self._done[key]

    def scaled(self, factor):
        """The covariances of the draws multiplied by ``diag(factor)`` on both sides (``factor`` ``(n,)`` or
        ``(S, n)``; not for pooled rounds)."""
        f = np.asarray(factor, dtype=np.float64)
        scale = np.broadcast_to(f, (self.cls.shape[0], f.shape[-1])) if self.scale is None else self.scale * f
        out = FieldCovariance(self.cls, scale, self._covs)
        out._done = self._done
        return out

    @staticmethod
    def pool(parts, sizes, n):
        """The draws of several rounds (``parts``, each of ``sizes[i]`` draws, or ``None``) in one, their classes
        renumbered (the rounds' scales are kept, not copied); ``None`` if any round has none."""
        if any(p is None for p in parts):
            return None
        cls, covs, offset = [], [], 0
        for p in parts:
            cls.append(p.cls + offset)
            covs.extend(_RoundMatrix(p, j) for j in range(len(p._covs)))
            offset += len(p._covs)
        scaled = any(p.scale is not None for p in parts)
        out = FieldCovariance(np.concatenate(cls), None, covs)
        out.scale = _PooledRows([p.scale for p in parts], sizes, n) if scaled else None
        return out


class _RoundMatrix:
    """Class ``j``'s matrix of one pooled round, ``cov(sl)`` (a callable that pickles, unlike a closure)."""

    def __init__(self, part, j):
        self.part, self.j = part, j

    def __call__(self, sl):
        return self.part.matrix(self.j, sl)


class _PooledRows:
    """Row access ``[rows]`` to the per-draw scales of pooled rounds (``None``: all 1) without concatenating them."""

    def __init__(self, arrays, sizes, n):
        self.arrays, self.n = arrays, n
        self.starts = np.concatenate([[0], np.cumsum(sizes)])

    def __getitem__(self, rows):
        scalar = np.ndim(rows) == 0
        rows = np.atleast_1d(np.asarray(rows))
        out = np.ones((rows.size, self.n))
        part = np.searchsorted(self.starts, rows, side="right") - 1
        for j in np.unique(part):
            a = self.arrays[int(j)]
            if a is not None:
                sel = part == j
                out[sel] = a[rows[sel] - self.starts[j]]
        return out[0] if scalar else out


class _CovOf:
    """The block ``(W W^T)[sl, sl]`` of the covariance of a :class:`_GaussianParts` (or, with ``amap``, of
    ``W B B^T W^T``, ``B B^T`` an adaptive map's scale matrix), as a callable of ``sl``: an object rather than a
    closure, so that corrections pickle."""

    def __init__(self, parts, amap=None):
        self.parts, self.amap = parts, amap

    def __call__(self, sl):
        W = self.parts.sqrt()[sl]
        return W @ W.T if self.amap is None else W @ self.amap.covariance() @ W.T


def _cov_of(parts):
    """The callable giving the block ``(W W^T)[sl, sl]`` of a :class:`_GaussianParts`' covariance."""
    return _CovOf(parts)


#: largest ``S m (m - k)^2`` (draws, field size, free coordinates) for which a constrained field's conditional
#: variances are computed for its control variates; beyond it the field's summaries are plain self-normalised ones
MAPPED_CONTROLS_MAX_FLOPS = 4e9


def _mapped_controls(block, loc, df, cov, sl):
    """:class:`~.control_variates.CoordinateControls` of a constrained field ``block`` (a
    :class:`~.constrained._ConstrainedBlock`) from the draws' conditional means ``loc`` ``(S, n)`` of the free
    vector and its covariances ``cov`` (:class:`FieldCovariance`), ``sl`` the field's free coordinates: the field
    ``x = loc_x + G w`` is affine in them, so given a draw's component it has mean ``loc_x + G E[w]`` and variances
    ``diag(G Cov(w) G^T)``; ``None`` when they are unknown or too costly (:data:`MAPPED_CONTROLS_MAX_FLOPS`)."""
    from .control_variates import CoordinateControls

    if loc is None or cov is None:
        return None
    S, f = loc.shape[0], sl.stop - sl.start
    m = block.m
    if S * m * f * f > MAPPED_CONTROLS_MAX_FLOPS:
        return None
    t = torch.as_tensor
    mean = block.to_field(t(np.ascontiguousarray(loc[:, sl]))).numpy()
    G = block.to_field(t(np.eye(f)), shift=False).numpy().T  # (m, f): d x / d w
    var = np.empty((S, m))
    for j in np.unique(cov.cls):
        idx = np.nonzero(cov.cls == j)[0]
        C = cov.matrix(int(j), sl)
        lam, V = np.linalg.eigh(C)
        R = V * np.sqrt(np.clip(lam, 0.0, None))  # C = R R^T
        if cov.scale is None:
            var[idx] = ((G @ R) ** 2).sum(1)
            continue
        for c in range(0, idx.size, 256):
            rows = idx[c:c + 256]
            M = G[None, :, :] * cov.scale[rows][:, None, sl]  # (s, m, f): G diag(scale_s)
            var[rows] = ((M @ R) ** 2).sum(2)
    return CoordinateControls(mean, np.sqrt(np.maximum(var, 1e-300)), df)


class Proposal:
    """Base class: ``sample(S, generator) -> ({site: (S, *ushape)}, log_q (S,))``."""

    name = "fitted"
    #: whether the draws cover the hyper-latents (``False`` for a ``hyper="map"`` result: theta is fixed)
    covers_hyper = True
    fixed = None
    #: after :meth:`sample`: ``(S, n)`` location and scale of each flat latent coordinate given the draw's
    #: component, and ``(S,)`` degrees of freedom (``inf``: normal); ``None`` when the proposal is not a
    #: Gaussian (mixture) whose components are known
    cond_loc = cond_sd = cond_df = None
    #: after :meth:`sample`: the draws' conditional covariances (:class:`FieldCovariance`), or ``None``
    cond_cov = None
    #: the field's Gaussians ``q_k`` (``None`` when the proposal is not a plain one of them: a defensive mixture,
    #: a mixture posterior) and, after :meth:`sample`, ``frame = (k (S,), a (S, n), d (S, n) or None)``: the draw's
    #: component and the affine frame ``u = a + d * (u_k - m_k)`` it was moved by (``d = None``: unmoved); with
    #: ``u_k - m_k = W_k eps``, ``W_k`` the square root of ``q_k``'s covariance its factor gives
    #: (``frame_parts[k].sqrt()``), ``eps`` are the draw's whitened coordinates
    #: (:mod:`~pyro_convexvb.diagnostics.whitened`)
    frame_posteriors = None
    frame_parts = None
    frame = None
    #: after :meth:`sample` of a plain proposal: ``(S, n)`` the draws' whitened coordinates ``eps`` in their frame
    #: (the standard normal draws they were made from), or ``None``
    frame_eps = None
    #: after :meth:`sample`: ``(S,)`` boolean, the draws made by a defensive component of an adapted proposal
    #: (:mod:`~pyro_convexvb.diagnostics.whitened`), or ``None``
    defensive_draws = None
    #: set by a :class:`~pyro_convexvb.diagnostics.whitened.WhitenedProposal` that moves the draws: a plain
    #: proposal's :meth:`sample` then draws ``frame_eps``, ``frame``, ``log_q`` and its conditional moments (the
    #: same random stream and numbers) but leaves the field of its values unformed (zeros): the adapted proposal
    #: colours its own coordinates in the frame
    white_only = False

    def hyper_reference(self, M, generator=None):
        """``(M, d)`` draws of the unconstrained hyper-latents from the proposal (no field); ``None`` if it has
        none."""
        return None

    def conditional(self):
        """``(cond_loc, cond_sd, cond_df, cond_cov)`` of the last :meth:`sample` (a snapshot: a later sample
        replaces them)."""
        return self.cond_loc, self.cond_sd, self.cond_df, self.cond_cov

    def controls(self, name, layout, M=200_000, seed=0, conditional=None):
        """:class:`~pyro_convexvb.diagnostics.control_variates.CoordinateControls` of site ``name`` (its flat
        unconstrained coordinates) for the draws whose :meth:`conditional` snapshot is ``conditional`` (default:
        the last :meth:`sample`), or ``None`` when nothing is known about it."""
        from .control_variates import CoordinateControls

        loc, sd, df, cov = self.conditional() if conditional is None else conditional
        if layout is not None and name in [b.name for b in layout.blocks]:
            if name in getattr(layout, "mapped", ()):  # a constrained field: affine in its free coordinates
                return _mapped_controls(layout.constrained[name], loc, df, cov, layout[name].slice)
            if loc is None:
                return None
            sl = layout[name].slice
            return CoordinateControls(loc[:, sl], sd[:, sl], df)
        ref = self._hyper_ref(M, seed)
        if ref is None:
            return None
        start = 0
        for n, size in zip(self.hp.space.names, self.hp.space.sizes):
            if n == name:
                return CoordinateControls(reference=ref[:, start:start + size])
            start += size
        return None

    def _hyper_ref(self, M, seed):
        cache = self.__dict__.setdefault("_ref_cache", {})
        if (M, seed) not in cache:
            gen = __import__("torch").Generator().manual_seed(int(seed) + 7919)
            z = self.hyper_reference(M, gen)
            cache[(M, seed)] = None if z is None else z.double().cpu().numpy()
        return cache[(M, seed)]


class GaussianProposal(Proposal):
    def __init__(self, post, kind):
        self.layout = post.layout
        post = _with_density(post)
        self.post, self.name = post, kind
        if self.layout is None:
            raise ValueError("the posterior has no latent layout (it was not fitted on a Pyro model)")
        plain = kind in ("fitted", "interpolated")
        if not plain and not hasattr(post, "kind"):
            raise NotImplementedError(f"the {kind!r} proposal is built from a Gaussian posterior, not from a "
                                      f"{type(post).__name__}")
        self.parts = None if plain and not hasattr(post, "kind") else _GaussianParts(post)
        self.frame_posteriors = [post] if plain and hasattr(post, "kind") else None
        self.frame_parts = None if self.frame_posteriors is None else [self.parts]

    def _record(self, S, second):
        if not hasattr(self.post, "kind"):  # a mixture posterior: no conditional Gaussian known per draw
            self.cond_loc = self.cond_sd = self.cond_df = self.cond_cov = None
            return
        loc = self.post.loc.detach().double().cpu().numpy()
        sd = self.post.scale.detach().double().cpu().numpy()
        sec = np.zeros(S, dtype=bool) if second is None else second.cpu().numpy()
        self.cond_loc = np.broadcast_to(loc, (S, loc.shape[0]))
        fac = np.where(sec & (self.name == "widened"), WIDEN, 1.0)
        self.cond_sd = sd[None, :] * fac[:, None]
        self.cond_df = np.where(sec & (self.name == "student_t"), T_DF, np.inf)
        scale = None if second is None else np.broadcast_to(fac[:, None], (S, loc.shape[0]))
        self.cond_cov = FieldCovariance(np.zeros(S, dtype=np.int64), scale, [_cov_of(self.parts)])

    def sample_flat(self, S, generator):
        if self.name in ("fitted", "interpolated"):
            self._record(S, None)
            if self.parts is None:  # a mixture posterior
                u = self.post.sample(S, generator=generator).reshape(S, -1)
                return u, self.post.log_prob(u)
            u, eps = self.parts.draw(S, generator, white=True, color=not self.white_only)
            if u is None:
                u = torch.zeros((S, self.parts.n), dtype=self.post.loc.dtype, device=self.post.loc.device)
            loc = self.post.loc.detach().double().cpu().numpy()
            self.frame = (np.zeros(S, dtype=np.int64), np.broadcast_to(loc, (S, loc.shape[0])), None)
            self.frame_eps = eps.detach().double().cpu().numpy()
            return u, self.parts.log_prob_white(eps)
        second = torch.rand(S, generator=generator) < 0.5
        u = self.parts.draw(S, generator)
        m = int(second.sum())
        if m:
            u[second] = self.parts.sample(m, generator, self.name)
        lp = self.parts.log_prob(u)
        lq = torch.logaddexp(lp, self.parts.log_prob_second(u, self.name, lp)) - math.log(2.0)
        self._record(S, second)
        return u, lq

    def sample(self, S, generator=None):
        u, lq = self.sample_flat(S, generator)
        return self.layout.unflatten(u), lq.double()


class HyperProposal(Proposal):
    """Draws of the hyper-latents ``z`` and the field ``u`` from a :class:`~pyro_convexvb.infer.hyper.HyperPosterior`."""

    def __init__(self, hp, kind):
        self.hp, self.name = hp, kind
        # the correction's proposal: the fitted surface with a defensive tempered share (the diagnostic's "fitted"
        # proposal is the posterior itself)
        self.density = hp.density.defended(HYPER_DEFENSIVE_WEIGHT, HYPER_TEMPER) if kind == "interpolated" \
            else hp.density
        self.covers_hyper = hp.density.kind != "point"
        # the densified components and their factors, shared by every proposal built from hp
        shared = hp.__dict__.get("_proposal_parts")
        if shared is None:
            comps = [_with_density(c) for c in hp.components]
            shared = hp.__dict__["_proposal_parts"] = (comps, [_GaussianParts(c) for c in comps])
        self.components, self.parts = shared
        if hp.layout is None:
            raise ValueError("the hyper-latent posterior has no field layout")
        if not self.covers_hyper:
            theta, _ = hp.space.unpack(hp.z[0])
            self.fixed = theta
        else:
            self.log_det_A_inv = float(torch.linalg.slogdet(hp.density.A_inv)[1])
        self.mixture = kind in ("widened", "student_t")
        self.frame_posteriors = None if self.mixture else self.components
        self.frame_parts = None if self.mixture else self.parts
        if kind == "interpolated":
            self._locs = torch.stack([c.loc.detach() for c in self.components]).double().cpu().numpy()
            self._logsd = np.log(torch.stack([c.scale.detach() for c in self.components]).double().cpu().numpy())

    def _interpolate(self, x):
        """``(S, n)`` field locations and log scales at ``x (S, d)``: piecewise-linear interpolation of the design
        points' (linear between neighbours in 1-D, on the Delaunay triangulation beyond), the nearest design
        point's outside their hull."""
        from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator

        X = self.hp.x.double().cpu().numpy()
        vals = np.concatenate([self._locs, self._logsd], 1)
        xs = x.double().cpu().numpy()
        n = self._locs.shape[1]
        if len(X) < X.shape[1] + 2:
            out = NearestNDInterpolator(X, vals)(xs)
        elif X.shape[1] == 1:
            order = np.argsort(X[:, 0])
            Xo, Vo = X[order, 0], vals[order]
            j = np.clip(np.searchsorted(Xo, xs[:, 0]) - 1, 0, len(Xo) - 2)
            lam = np.clip((xs[:, 0] - Xo[j]) / (Xo[j + 1] - Xo[j]), 0.0, 1.0)[:, None]
            dV = np.diff(Vo, axis=0)
            # V_j + lam (V_{j+1} - V_j), in row blocks (no (S, 2n) temporaries), locations and log scales apart
            loc, logsd = np.empty((len(xs), n)), np.empty((len(xs), n))
            for a in range(0, len(xs), ROW_BLOCK):
                jb, lb = j[a:a + ROW_BLOCK], lam[a:a + ROW_BLOCK]
                for out, cols in ((loc, slice(0, n)), (logsd, slice(n, 2 * n))):
                    o = out[a:a + ROW_BLOCK]
                    np.take(dV[:, cols], jb, axis=0, out=o)
                    o *= lb
                    o += Vo[jb, cols]
            return loc, logsd
        else:
            if not hasattr(self, "_lin"):
                self._lin = LinearNDInterpolator(X, vals)
                self._near = NearestNDInterpolator(X, vals)
            out = self._lin(xs)
            bad = ~np.isfinite(out).all(1)
            if bad.any():
                out[bad] = self._near(xs[bad])
        return out[:, :n], out[:, n:]

    def field_conditional(self, x, m, generator=None):
        """``m`` draws of the field from this proposal given the hyper-latents at one point ``x (d,)`` (standardised
        coordinates), and their log densities: ``((m, n) float64, (m,))``. For the plain proposals only (``"fitted"``,
        ``"interpolated"``): the defensive mixtures draw the field from either of two Gaussians."""
        if self.mixture:
            raise ValueError(f"field_conditional: the {self.name!r} proposal is a mixture; ask its plain proposal")
        x = torch.as_tensor(x, dtype=torch.float64).reshape(1, -1)
        k = int(torch.cdist(x, self.hp.x).argmin())
        draw, e = self.parts[k].draw(m, generator, white=True)
        u = draw.reshape(m, self.hp.n).double()
        lq = self.parts[k].log_prob_white(e).double()
        if self.name == "interpolated":
            un, _, _, log_det, _ = self._move(x, np.array([k]), u.cpu().numpy(), sd=False)
            u = torch.as_tensor(un, dtype=torch.float64)
            lq = lq - float(log_det.sum())
        return u, lq

    def _move(self, x, kk, uk, sd=True):
        """The ``"interpolated"`` proposal's field at ``x (S, d)`` (or one row, for draws all at one point): the draws
        ``uk (S, n)`` of the design points ``kk (S,)`` moved to the location and log scales interpolated there,
        ``u = loc(x) + D (u_k - loc_k)`` with ``D = sd(x) / sd_k``. Returns ``(u, loc(x), sd(x), sum log D (S,), D)``
        (numpy; ``u`` is ``None`` for ``uk=None``, ``sd(x)`` without ``sd``); ``log q(u | x) = log q_k(u_k) -
        sum log D``. In row blocks and in place: no ``(S, n)`` temporaries beside the results."""
        loc_x, logsd_x = self._interpolate(x)
        kk = np.broadcast_to(kk, (logsd_x.shape[0],))
        D = np.empty_like(logsd_x)
        for a in range(0, D.shape[0], ROW_BLOCK):
            np.subtract(logsd_x[a:a + ROW_BLOCK], self._logsd[kk[a:a + ROW_BLOCK]], out=D[a:a + ROW_BLOCK])
        log_det = D.sum(1)
        np.exp(D, out=D)
        sd_x = np.exp(logsd_x, out=logsd_x) if sd else None
        if uk is None:
            return None, loc_x, sd_x, log_det, D
        u = np.array(uk, dtype=np.float64, copy=True)
        one = D.shape[0] == 1  # draws all at one point: its frame for every row
        for a in range(0, u.shape[0], ROW_BLOCK):
            ub = u[a:a + ROW_BLOCK]
            fr = slice(0, 1) if one else slice(a, a + ROW_BLOCK)
            ub -= self._locs[kk[fr]]
            ub *= D[fr]
            ub += loc_x[fr]
        return u, loc_x, sd_x, log_det, D

    # ---- theta part, in the standardised coordinates x of the design
    def _log_qx(self, x):
        return self.density.log_prob_x(x)

    def _wide_x(self, m, generator):
        d = self.density
        e = torch.randn(m, self.hp.space.dim, dtype=torch.float64, generator=generator)
        if d.kind == "split-normal":
            return torch.where(e > 0, e * d.s_plus, e * d.s_minus) * WIDEN
        return e * WIDEN

    def _log_q_wide_x(self, x):
        d = self.density
        if d.kind == "split-normal":
            s = torch.where(x > 0, d.s_plus, d.s_minus) * WIDEN
            return (-0.5 * (x / s) ** 2 - torch.log(s) - 0.5 * math.log(2 * math.pi)).sum(1)
        return (-0.5 * (x / WIDEN) ** 2 - math.log(WIDEN) - 0.5 * math.log(2 * math.pi)).sum(1)

    def hyper_reference(self, M, generator=None):
        if not self.covers_hyper:
            return None
        x = self.density.sample_x(M, generator)
        if self.mixture:
            second = torch.rand(M, generator=generator) < 0.5
            m = int(second.sum())
            if m:
                x[second] = self._wide_x(m, generator)
        return self.density.to_z(x)

    def sample(self, S, generator=None):
        hp = self.hp
        second = (torch.rand(S, generator=generator) < 0.5) if self.mixture else torch.zeros(S, dtype=torch.bool)
        if self.covers_hyper:
            x = self.density.sample_x(S, generator)
            m = int(second.sum())
            if m:
                x[second] = self._wide_x(m, generator)
            k = torch.cdist(x, hp.x).argmin(1)
            z = self.density.to_z(x)
        else:
            x = torch.zeros(S, 0, dtype=torch.float64)
            k = torch.zeros(S, dtype=torch.long)
            z = hp.z[0].reshape(1, -1).expand(S, -1)  # theta fixed at its mode; q covers the field only
        fdt = hp.components[0].dtype  # the design points' fits run in float64, whatever the model's dtype
        white_only = self.white_only and not self.mixture
        u = (torch.zeros if white_only else torch.empty)(S, hp.n, dtype=fdt, device=hp.device)
        lu1 = torch.empty(S, dtype=torch.float64)
        lu2 = torch.empty(S, dtype=torch.float64)
        eps = None if self.mixture else np.empty((S, hp.n))  # the plain draws' whitened coordinates
        for j in k.unique().tolist():
            idx = (k == j).nonzero().reshape(-1)
            parts = self.parts[j]
            draw, e = parts.draw(len(idx), generator, white=True, color=not white_only)
            if not white_only:
                draw = draw.reshape(len(idx), hp.n)
            sec = second[idx]
            if self.mixture and bool(sec.any()):
                draw[sec] = parts.sample(int(sec.sum()), generator, self.name)
            if not white_only:
                u[idx] = draw
            if self.mixture:
                lp = parts.log_prob(draw).double()
            else:
                lp = parts.log_prob_white(e).double()
                eps[idx.cpu().numpy()] = e.detach().double().cpu().numpy()
            lu1[idx] = lp
            if self.mixture:
                lu2[idx] = parts.log_prob_second(draw, self.name, lp).double()
        kk = k.cpu().numpy()
        if self.name == "interpolated" and self.covers_hyper:
            un, loc_x, sd_x, log_det, D = self._move(x, kk, None if white_only else u.double().cpu().numpy())
            if un is not None:
                u = torch.as_tensor(un, dtype=fdt, device=hp.device)
            lu1 = lu1 - torch.as_tensor(log_det, dtype=torch.float64)
        if self.covers_hyper:
            lq1 = self._log_qx(x) + lu1
            if not self.mixture:
                lq = lq1
            else:
                lq = torch.logaddexp(lq1, self._log_q_wide_x(x) + lu2) - math.log(2.0)
            lq = lq - self.log_det_A_inv
        else:
            lq = lu1 if not self.mixture else torch.logaddexp(lu1, lu2) - math.log(2.0)
        sec = second.cpu().numpy()
        covs = [_cov_of(p) for p in self.parts]
        if self.name == "interpolated" and self.covers_hyper:
            self.cond_loc, self.cond_sd = loc_x, sd_x
            self.frame = (kk, loc_x, D)
            self.cond_cov = FieldCovariance(kk, self.frame[2], covs)
        else:
            locs = torch.stack([c.loc.detach() for c in self.components]).double().cpu().numpy()
            sds = torch.stack([c.scale.detach() for c in self.components]).double().cpu().numpy()
            self.cond_loc = locs[kk]
            wide = sec & (self.name == "widened")
            fac = np.where(wide, WIDEN, 1.0)[:, None]
            self.cond_sd = sds[kk] * fac
            self.frame = None if self.mixture else (kk, self.cond_loc, None)
            self.cond_cov = FieldCovariance(kk, np.broadcast_to(fac, (S, hp.n)) if wide.any() else None, covs)
        self.frame_eps = eps
        self.cond_df = np.where(sec & (self.name == "student_t"), T_DF, np.inf)
        values = dict(hp.layout.unflatten(u))
        start = 0
        for n, us, size in zip(hp.space.names, hp.space.ushapes, hp.space.sizes):
            values[n] = z[:, start:start + size].reshape((S,) + tuple(us))
            start += size
        return values, lq


class AdaptedProposal(Proposal):
    """A proposal moved toward the importance-weighted posterior of a first round of draws (moment matching in the
    spirit of Paananen, Piironen, Buerkner & Vehtari 2021, §3, restricted to a shift and a scale per coordinate).

    Each latent coordinate of a base draw, standardised by its conditional location ``m_s`` and scale ``s_s``
    (known per draw), ``e = (u - m_s) / s_s``, is mapped to ``mu + rho e`` with ``mu`` and ``rho^2`` the
    importance-weighted mean and variance of ``e`` in the first round (``rho`` clipped to [0.5, 2], ``mu`` to
    [-1, 1]). Given the base draw's component the map is affine and diagonal, so ``log q' = log q - sum log rho``
    exactly, and the conditional moments move with it (the control variates stay exact).

    :param base: the proposal adapted (its draws carry conditional moments: a Gaussian or hyper-latent proposal).
    :param layout: the latent layout of the flat field vector ``(n,)``.
    :param mu: ``(n,)`` shifts and ``rho`` ``(n,)`` scales of the standardised coordinates.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(y=None):
        ...     m = pyro.sample("m", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        ...     with pyro.plate("data", 3):
        ...         pyro.sample("y", dist.Normal(m, 1.0), obs=y)
        >>> res = pcv.fit(model, y=torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64), engine="laplace",
        ...               progress=False)
        >>> base = make_proposal(res.posterior, "fitted")
        >>> q = AdaptedProposal(base, res.posterior.layout, [0.5], [1.2])
        >>> values, log_q = q.sample(4, torch.Generator().manual_seed(0))
        >>> values["m"].shape, log_q.shape
        (torch.Size([4]), torch.Size([4]))
    """

    def __init__(self, base, layout, mu, rho):
        self.base, self.layout = base, layout
        self.mu = np.clip(np.asarray(mu, dtype=np.float64), -1.0, 1.0)
        self.rho = np.clip(np.asarray(rho, dtype=np.float64), 0.5, 2.0)
        self.name = "adapted"
        self.covers_hyper, self.fixed = base.covers_hyper, base.fixed
        self.hp = getattr(base, "hp", None)

    @classmethod
    def from_draws(cls, base, layout, values, log_weights, conditional):
        """Adapt ``base`` to its weighted draws ``values`` (whose conditional moments are ``conditional``, the
        snapshot of :meth:`Proposal.conditional`); ``None`` if they are unknown."""
        loc, sd = conditional[0], conditional[1]
        if loc is None:
            return None
        u = field_vector(layout, values).double().cpu().numpy()
        e = (u - loc) / sd
        w = np.exp(np.asarray(log_weights, dtype=np.float64))
        mu = w @ e
        rho = np.sqrt(np.maximum(w @ (e - mu) ** 2, 1e-12))
        return cls(base, layout, mu, rho)

    def hyper_reference(self, M, generator=None):
        return self.base.hyper_reference(M, generator)

    def sample(self, S, generator=None):
        values, lq = self.base.sample(S, generator)
        u0 = field_vector(self.layout, values)
        u = u0.double().cpu().numpy()
        loc, sd = self.base.cond_loc, self.base.cond_sd
        un = loc + sd * (self.mu + self.rho * (u - loc) / sd)
        self.cond_loc = loc + sd * self.mu
        self.cond_sd = sd * self.rho
        self.cond_df = self.base.cond_df
        cov = self.base.cond_cov
        self.cond_cov = None if cov is None else cov.scaled(self.rho)
        return with_field(self.layout, values, un, u0), lq - float(np.log(self.rho).sum())


def make_proposal(posterior, kind="fitted"):
    """The proposal ``kind`` (one of :data:`PROPOSALS`) built from a fitted posterior."""
    from ..infer.hyper import HyperPosterior

    if kind not in PROPOSALS:
        raise ValueError(f"proposal: expected one of {PROPOSALS}, got {kind!r}")
    if isinstance(posterior, HyperPosterior):
        return HyperProposal(posterior, kind)
    if not (hasattr(posterior, "sample") and hasattr(posterior, "log_prob")):
        raise NotImplementedError(f"importance diagnostics need a posterior with sample() and log_prob(), got "
                                  f"{type(posterior).__name__}")
    return GaussianProposal(posterior, kind)
