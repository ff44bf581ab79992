"""The posterior of a latent Gaussian model with hyper-latents ``theta`` integrated over (INLA-style): a mixture
over design points ``theta_k`` of the engine's posteriors of the latent field (Rue, Martino & Chopin 2009, §3).

The design and the fits are made by :mod:`pyro_convexvb.infer.hyper`; this module holds only what the answer is.
"""
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.initialization import init_to_feasible
from torch.distributions import constraints

from .base import Posterior
from .empirical import weighted_quantiles
from .gaussian import _KeepsItsModel, _apply_name_prefix, _guide_model_and_data, _prototype_dtype

__all__ = ["ThetaSpace", "GridWarp", "ThetaDensity", "HyperPosterior", "HyperMixtureGuide"]


@dataclass
class ThetaSpace:
    """The hyper-latents' unconstrained coordinates ``z`` (Pyro's ``biject_to`` of each support).

    :ivar names: hyper-latent site names.
    :ivar shapes: their constrained shapes; ``ushapes`` the unconstrained ones.
    :ivar transforms: ``biject_to(support)`` per site.
    :ivar dtype: dtype of ``z`` (float64, on the CPU: the hyper-latents' few dimensions are computed there);
        ``site_dtypes`` and ``site_devices`` those of the model's own values, which :meth:`unpack` returns
        (float32 data get float32 hyper-latents).
    """

    names: List[str]
    shapes: List[tuple]
    ushapes: List[tuple]
    transforms: List[Any]
    dtype: Any = torch.float64
    site_dtypes: Any = None
    site_devices: Any = None

    @property
    def sizes(self):
        return [int(math.prod(s)) for s in self.ushapes]

    @property
    def dim(self):
        return sum(self.sizes)

    def unpack(self, z, keep_graph=False):
        """``({site: constrained value}, log|d theta / d z|)`` for ``z`` of shape ``(dim,)``; the values in each
        site's own dtype and device, the log-Jacobian computed in :attr:`dtype` (a float; with ``keep_graph`` a 0-d
        tensor, and values and log-Jacobian carry ``z``'s autograd graph)."""
        z = torch.as_tensor(z)
        z = (z if keep_graph else z.detach()).to(device="cpu", dtype=self.dtype)
        vals, ld, start = {}, 0.0, 0
        for k, (n, us, t, size) in enumerate(zip(self.names, self.ushapes, self.transforms, self.sizes)):
            x = z[start:start + size].reshape(us)
            start += size
            v = t(x)
            jac = t.log_abs_det_jacobian(x, v).sum()
            ld = ld + (jac if keep_graph else float(jac))
            if self.site_dtypes is not None:
                v = v.to(device=self.site_devices[k], dtype=self.site_dtypes[k])
            vals[n] = v
        return vals, ld

    def pack(self, values):
        """Flat unconstrained ``z`` ``(dim,)`` (:attr:`dtype`, CPU) of ``{site: constrained value}``."""
        return torch.cat([t.inv(torch.as_tensor(values[n]).detach().to(device="cpu", dtype=self.dtype)).reshape(-1)
                          for n, t in zip(self.names, self.transforms)])



# ---------------------------------------------------------------------------------------------
# the integrated posterior
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GridWarp:
    r"""The per-axis map ``x = g(xi)`` from a grid design's lattice coordinates ``xi`` to standardised ``x``.

    The identity on ``|xi| <= core``; beyond, the spacing grows geometrically: a lattice of spacing ``step`` in
    ``xi`` has spacing ``step (growth - 1) / log(growth) growth^j`` in ``x`` at the ``j``-th step past the core,

    .. math:: g(\xi) = \operatorname{sign}(\xi)\,\Big(c + s\,\frac{\gamma^{(|\xi| - c)/s} - 1}{\log\gamma}
              \Big) \quad (|\xi| > c),

    continuously differentiable at ``|xi| = c``. A hyper-posterior close to Gaussian lies inside the core (the
    design of a Gaussian stops near 3.75 standardised units), where nothing changes; a scale that no data bound
    from below has a log density about linear in ``log sigma`` far from the mode (about 25 Hessian units in a
    BYM model), smooth enough for cells growing with the distance, which a uniform grid tiles with hundreds of fits.
    ``growth = 1`` is the identity everywhere.

    :param float core: radius (standardised units) of the uniform core.
    :param float step: the lattice spacing in ``xi``.
    :param float growth: spacing ratio of consecutive steps past the core (``>= 1``).

    Example (a lattice of spacing 0.75: the identity up to 3, then gaps growing by 1.25)::

        >>> w = GridWarp(core=3.0, step=0.75, growth=1.25)
        >>> x = w.to_x(torch.tensor([2.25, 3.0, 3.75, 4.5, 5.25], dtype=torch.float64))
        >>> [round(v, 3) for v in x.tolist()], [round(v, 3) for v in x.diff().tolist()]
        ([2.25, 3.0, 3.84, 4.891, 6.204], [0.75, 0.84, 1.05, 1.313])
        >>> bool(torch.allclose(w.to_xi(x), torch.tensor([2.25, 3.0, 3.75, 4.5, 5.25], dtype=torch.float64)))
        True
    """

    core: float = math.inf
    step: float = 1.0
    growth: float = 1.0

    @property
    def identity(self):
        return self.growth == 1.0 or math.isinf(self.core)

    def _rate(self):
        return math.log(self.growth) / self.step

    def _past_core(self, v, f):
        """``v`` inside the core; beyond it ``sign(v) (core + f((|v| - core) rate) / rate)``, elementwise."""
        if self.identity:
            return v
        a = v.abs()
        out = self.core + f((a - self.core).clamp_min(0) * self._rate()) / self._rate()
        return torch.where(a <= self.core, v, torch.sign(v) * out)

    def to_x(self, xi):
        """``x`` of lattice coordinates ``xi`` (any shape, elementwise)."""
        return self._past_core(xi, torch.expm1)

    def to_xi(self, x):
        """The inverse of :meth:`to_x`."""
        return self._past_core(x, torch.log1p)

    def log_jacobian(self, xi):
        """``(S,)`` ``log |det dx / dxi|`` at ``xi (S, d)``: the sum over axes of ``log g'``."""
        if self.identity:
            return torch.zeros(xi.shape[0], dtype=xi.dtype)
        return ((xi.abs() - self.core).clamp_min(0) * self._rate()).sum(1)


@dataclass
class ThetaDensity:
    """A smooth approximation of the hyper-posterior in standardised coordinates ``x`` (``z = z* + A^{-1} x``).

    * ``"surface"`` (grid designs): the log density at the design points interpolated by a thin-plate
      spline with a quadratic tail (exact for a Gaussian), evaluated on a fine grid inside the design's
      radius; samples are fine-grid cells drawn by mass, uniform within a cell. Grid, cells and radius are in the
      design's lattice coordinates ``xi`` (:class:`GridWarp` ``warp``, ``x = g(xi)``; the identity unless the
      design's spacing grows past its core), and the density in ``x`` carries the warp's Jacobian.
    * ``"split-normal"`` (central composite designs): along each standardised axis a Gaussian with its
      own scale on each side, ``s_+- = r / sqrt(2 (f(0) - f(+-r e_i)))`` from the axial points (the
      asymmetric Gaussian of Rue, Martino & Chopin 2009, §6.5).
    * ``"point"`` (``hyper="map"``): the mode.
    """

    kind: str
    z_mode: torch.Tensor
    A_inv: torch.Tensor
    xs: Any = None
    probs: Any = None
    cell: float = 0.0
    s_plus: Any = None
    s_minus: Any = None
    #: the surface's fine grid: ``ticks`` per axis from ``-radius`` (``xs`` keeps those within ``radius``); all in
    #: the lattice coordinates ``xi`` of ``warp``
    radius: float = 0.0
    ticks: int = 0
    warp: GridWarp = field(default_factory=GridWarp)

    @classmethod
    def surface(cls, z_mode, A_inv, x, logf, radius, step, resolution=None, warp=None):
        """The surface through ``logf (K,)`` at the design points ``x (K, d)`` (those kept by the pruning).

        The fine grid covers only the design's cells (points within ``step / 2`` of a design point on every axis):
        the grid grows only next to rim points that still carry mass, so most of the disc of ``radius`` can lie
        beyond the last points kept, where the spline's quadratic tail is an extrapolation (on a 1-D Gaussian model
        with a ``Gamma`` prior scale it put the log density 1.4 nats too high one step past the design and 26 too
        high at the radius, and the scale's sd 2% high against quadrature of the exact hyper-posterior).

        :param float step: the design's grid spacing (in the lattice coordinates).
        :param float radius: the design's radius (in the lattice coordinates).
        :param GridWarp warp: the design's map from lattice coordinates to ``x`` (default: the identity).
        """
        from scipy.interpolate import RBFInterpolator

        warp = warp or GridWarp()
        d = x.shape[1]
        # fine-grid cells of at most 0.25 lattice units, 0.5 in 3-D (the mode's Hessian scale is 1 in the core)
        m = resolution or _fine_ticks(d, radius)
        ticks = torch.linspace(-radius, radius, m, dtype=torch.float64)
        xs = ticks.reshape(-1, 1) if d == 1 else torch.cartesian_prod(*([ticks] * d))
        xs = xs[(xs**2).sum(1) <= radius**2]
        # squared distance to the nearest design point, per axis
        near2 = _neighbours(xs, warp.to_xi(x), 1, p=math.inf)[1][:, 0]
        xs = xs[near2 <= (0.5 * step + 1e-9) ** 2]  # the design's cells only
        f = (logf - logf.max()).numpy()
        interp = RBFInterpolator(x.numpy(), f, kernel="thin_plate_spline", degree=2)
        lp = torch.as_tensor(interp(warp.to_x(xs).numpy()), dtype=torch.float64) + warp.log_jacobian(xs)
        probs = torch.softmax(lp, 0)
        return cls("surface", z_mode, A_inv, xs=xs, probs=probs, cell=float(ticks[1] - ticks[0]), radius=radius,
                   ticks=m, warp=warp)

    @classmethod
    def split_normal(cls, z_mode, A_inv, x, logf):
        d = x.shape[1]
        r = float(x[1].norm())
        drop_p = logf[0] - logf[1:1 + d]
        drop_m = logf[0] - logf[1 + d:1 + 2 * d]
        if not bool((drop_p > 0).all() and (drop_m > 0).all()):
            raise ValueError("split_normal: every axial point's log density must lie below the mode's (drops "
                             f"{drop_p.tolist()} and {drop_m.tolist()})")
        return cls("split-normal", z_mode, A_inv, s_plus=r / torch.sqrt(2 * drop_p), s_minus=r / torch.sqrt(2 * drop_m))

    @classmethod
    def point(cls, z_mode):
        return cls("point", z_mode, None)

    def defended(self, weight, beta):
        """A surface mixed with its own tempered version: the fine-grid cells' masses
        ``(1 - weight) p + weight p^beta / sum p^beta`` (the same cells, so :meth:`sample_x` and :meth:`log_prob_x`
        stay exact for the mixture). A defensive share (Hesterberg 1995) for importance sampling of the hyper-latents:
        the tempered surface (``beta < 1``: wider, about ``1 / sqrt(beta)`` times a Gaussian's sd) puts more draws
        where the surface of an evidence bound falls too fast. Other kinds are returned unchanged."""
        import dataclasses

        if self.kind != "surface" or weight == 0.0:
            return self
        tempered = torch.softmax(beta * torch.log(self.probs), 0)
        return dataclasses.replace(self, probs=(1.0 - weight) * self.probs + weight * tempered)

    def sample_x(self, num_samples, generator=None):
        d = self.z_mode.shape[0]
        if self.kind == "point":
            return torch.zeros(num_samples, d, dtype=torch.float64)
        if self.kind == "surface":
            k = torch.multinomial(self.probs, num_samples, replacement=True, generator=generator)
            jitter = (torch.rand(num_samples, d, dtype=torch.float64, generator=generator) - 0.5) * self.cell
            return self.warp.to_x(self.xs[k] + jitter)
        e = torch.randn(num_samples, d, dtype=torch.float64, generator=generator)
        return torch.where(e > 0, e * self.s_plus, e * self.s_minus)

    def log_prob_x(self, x):
        """``(S,)`` log density at ``x (S, d)`` of the draws of :meth:`sample_x` (``-inf`` outside a surface's
        cells): a surface's probability of the fine-grid cell holding ``x`` over the cell's volume (in the lattice
        coordinates, with the warp's Jacobian at ``x``), found by rounding to the grid (no search over its points), or
        the split normal's density."""
        if self.kind == "split-normal":
            s = torch.where(x > 0, self.s_plus, self.s_minus)
            return (-0.5 * (x / s) ** 2 - torch.log(s) - 0.5 * math.log(2 * math.pi)).sum(1)
        if self.kind != "surface":
            raise ValueError(f"a {self.kind!r} hyper-latent density has no density in x")
        d = x.shape[1]
        table = self.__dict__.get("_log_table")
        if table is None:  # log cell probability on the full (ticks,)*d grid, -inf at the points outside radius
            idx = torch.round((self.xs + self.radius) / self.cell).long()
            table = torch.full((self.ticks ** d,), -math.inf, dtype=torch.float64)
            table[self._flat(idx)] = torch.log(self.probs) - d * math.log(self.cell)
            self.__dict__["_log_table"] = table
        xi = self.warp.to_xi(x)  # the fine grid's (lattice) coordinates
        idx = torch.round((xi + self.radius) / self.cell).long()
        ok = ((idx >= 0) & (idx < self.ticks)).all(1)
        idx = idx.clamp(0, self.ticks - 1)
        # the grid point's own square cell (ties at a shared edge go to the rounded point)
        # (the centres in xi's dtype: an integer tensor times a Python float is float32, whose centres are off by
        # 1e-7 and put a draw within that of its cell's edge outside every cell)
        ok &= (xi - (idx.to(xi.dtype) * self.cell - self.radius)).abs().max(1).values <= 0.5 * self.cell + 1e-12
        lq = table[self._flat(idx)] - self.warp.log_jacobian(xi)
        return torch.where(ok, lq, torch.full_like(lq, -math.inf))

    def _flat(self, idx):
        out = idx[:, 0].clone()
        for j in range(1, idx.shape[1]):
            out = out * self.ticks + idx[:, j]
        return out

    def to_z(self, x):
        if self.kind == "point":
            return self.z_mode.expand(x.shape[0], -1).clone()
        return self.z_mode + x @ self.A_inv.T

    def to_x(self, z):
        """The standardised coordinates ``(S, d)`` of ``z (S, d)``, the inverse of :meth:`to_z`."""
        if self.kind == "point":
            raise ValueError("a 'point' hyper-latent density has no standardised coordinates")
        return torch.linalg.solve(self.A_inv, (z - self.z_mode).T).T

    def quadrature(self, subcells=True):
        """Points ``x (M, d)`` and weights ``(M,)`` (summing to one) for expectations under this density.

        A surface's: each fine-grid cell's mass spread over :data:`SUBCELLS` points inside it whose coordinates differ
        on every axis (its centre alone, or a sub-grid, would put many cells' masses on one value of a coordinate when
        the cells line up with it): evenly spaced in 1-D, a Fibonacci lattice (21 points, generator 13) in 2-D, the
        rank-1 lattice of generator (1, 13, 8) in 3-D; with
        ``subcells=False`` the cells' centres (for functions smooth on the scale of a cell).
        A split normal's: :data:`SOBOL_POINTS` scrambled Sobol points (seed 0) through its quantile function, axis by
        axis. A point's: the mode.
        """
        d = self.z_mode.shape[0]
        if self.kind == "point":
            return torch.zeros(1, d, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
        if self.kind == "split-normal":
            u = torch.quasirandom.SobolEngine(d, scramble=True, seed=0).draw(SOBOL_POINTS, dtype=torch.float64)
            e = torch.special.ndtri(u.clamp(1e-12, 1 - 1e-12))
            return torch.where(e > 0, e * self.s_plus, e * self.s_minus), \
                torch.full((SOBOL_POINTS,), 1.0 / SOBOL_POINTS, dtype=torch.float64)
        if not subcells:
            return self.warp.to_x(self.xs), self.probs.double()
        i = torch.arange(SUBCELLS, dtype=torch.float64)
        cols = [(i + 0.5) / SUBCELLS] + [torch.remainder((i * g + 0.5) / SUBCELLS, 1.0) for g in (13, 8)[:d - 1]]
        offsets = (torch.stack(cols, 1) - 0.5) * self.cell
        x = self.warp.to_x((self.xs[:, None, :] + offsets[None]).reshape(-1, d))
        w = (self.probs.double()[:, None] / offsets.shape[0]).expand(-1, offsets.shape[0]).reshape(-1)
        return x, w


#: points per fine-grid cell in :meth:`ThetaDensity.quadrature` (a Fibonacci number: the 2-D lattice's size)
SUBCELLS = 21


def _fine_ticks(d, radius):
    """Ticks per axis of a surface's fine grid over ``[-radius, radius]``: cells of at most 0.25 lattice units in 1-D
    and 2-D (801 and 161 ticks at least), 0.5 in 3-D (the spline is smooth on the design's spacing, 0.75, and the
    cells are ``ticks^3``: about 70,000 within a radius of 10)."""
    if d == 1:
        return max(801, int(8 * radius) + 1)
    if d == 2:
        return max(161, int(8 * radius) + 1)
    return max(25, int(4 * radius) + 1)


#: quasi-random points of a split normal's :meth:`ThetaDensity.quadrature`
SOBOL_POINTS = 2**16


def surface_marginals(space, density, probs=(0.05, 0.5, 0.95)):
    """``{site: {"mean", "sd", "quantiles": {p: ...}}}`` (each of the site's shape) of the constrained hyper-latents
    under a surface
    :class:`ThetaDensity`, by quadrature over its fine grid (:meth:`ThetaDensity.quadrature`: each cell's mass
    spread evenly over :data:`SUBCELLS` points in it, as its draws are uniform in it)."""
    x, w = density.quadrature()
    z = density.to_z(x)
    out, start = {}, 0
    for k, (n, us, t, size) in enumerate(zip(space.names, space.ushapes, space.transforms, space.sizes)):
        u = z[:, start:start + size]
        start += size
        v = t(u.reshape((u.shape[0],) + tuple(us))).reshape(u.shape[0], -1).double()
        mean = w @ v
        sd = (w @ (v - mean) ** 2).sqrt()
        q = torch.as_tensor(weighted_quantiles(v.numpy(), w.numpy(), probs), dtype=torch.float64)
        if space.site_dtypes is not None:  # computed in float64, reported in the site's dtype
            mean, sd, q = (a.to(device=space.site_devices[k], dtype=space.site_dtypes[k]) for a in (mean, sd, q))
        out[n] = _site_summary(mean, sd, q, probs, space.shapes[k])
    return out


def _site_summary(mean, sd, q, probs, shape):
    """``{"mean", "sd", "quantiles": {p: ...}}`` of one hyper-latent from its flattened summaries (``mean``, ``sd``
    ``(size,)``, ``q`` ``(len(probs), size)``), each in the site's constrained ``shape`` (``()`` for a scalar
    site, as Pyro's sample site and its autoguides' ``median()``/``quantiles()`` have it)."""
    shape = tuple(shape)
    return {"mean": mean.reshape(shape), "sd": sd.reshape(shape),
            "quantiles": {p: q[i].reshape(shape) for i, p in enumerate(probs)}}


def _neighbours(x, centres, L, chunk=8192, p=2.0):
    """``(idx (S, L), squared distances (S, L))`` of the ``L`` points of ``centres (K, d)`` nearest to each row of
    ``x (S, d)`` in the ``p``-norm (Euclidean by default), nearest first; ``chunk`` rows at a time."""
    idx, d2 = [], []
    for i in range(0, x.shape[0], chunk):
        dist2 = torch.cdist(x[i:i + chunk], centres, p=p) ** 2
        v, j = torch.topk(dist2, L, dim=1, largest=False)
        idx.append(j)
        d2.append(v)
    if not idx:
        return torch.zeros(0, L, dtype=torch.long), torch.zeros(0, L, dtype=x.dtype)
    return torch.cat(idx), torch.cat(d2)


def _semi_discrete_potentials(x, p, centres, w, h, L, tol=1e-12, max_iter=100):
    """``beta (K,)`` with ``sum_i p_i P(k | x_i) = w_k`` for ``P(k | x) = softmax_k(beta_k - |x - c_k|^2 / (2 h^2))``
    over the ``L`` centres nearest to ``x``: the dual potentials of the entropic semi-discrete optimal transport of
    ``sum_i p_i delta(x_i)`` onto ``sum_k w_k delta(c_k)`` (Peyré & Cuturi 2019, §5.3).

    Newton's method on the concave dual ``G(beta) = w^T beta - sum_i p_i log sum_k exp(beta_k - D_ik)``, whose
    gradient is ``w - E[P(k | x)]`` and whose Hessian ``-sum_i p_i (diag P_i - P_i P_i^T)`` is singular only along
    the constant vector (an added ``1 1^T / K`` makes the step unique), with a backtracking line search.

    :param x: ``(M, d)`` quadrature points; ``p`` ``(M,)`` their weights (summing to one).
    :param centres: ``(K, d)``; ``w`` ``(K,)`` positive weights summing to one.
    :raises RuntimeError: when the mass error is still above ``tol`` after ``max_iter`` steps.
    """
    K = centres.shape[0]
    idx, d2 = _neighbours(x, centres, L)
    D = d2 / (2 * h * h)
    beta = torch.log(w).clone()

    def dual(b):
        return float(w @ b - p @ torch.logsumexp(b[idx] - D, 1))

    g_val = dual(beta)
    for _ in range(max_iter):
        P = torch.softmax(beta[idx] - D, 1)
        pP = p[:, None] * P
        grad = w - torch.zeros(K, dtype=torch.float64).index_add_(0, idx.reshape(-1), pP.reshape(-1))
        if float(grad.abs().max()) <= tol:
            return beta
        H = torch.zeros(K * K, dtype=torch.float64)
        for i in range(0, idx.shape[0], 8192):  # sum_i p_i P_i P_i^T, in chunks of M x L x L
            j = idx[i:i + 8192]
            H.index_add_(0, (j[:, :, None] * K + j[:, None, :]).reshape(-1),
                         (pP[i:i + 8192, :, None] * P[i:i + 8192, None, :]).reshape(-1))
        H = torch.diag(w - grad) - H.reshape(K, K)  # -Hessian, positive semi-definite (w - grad = E[P(k | x)])
        step = torch.linalg.solve(H + 1.0 / K, grad)
        dec, t = float(grad @ step), 1.0  # the predicted increase; below 1e-12 the dual's rounding hides it
        while True:
            new = beta + t * step
            g_new = dual(new)
            if g_new >= g_val + 0.25 * t * dec or dec < 1e-12 or t < 1e-10:
                break
            t *= 0.5
        beta, g_val = new, g_new
    raise RuntimeError(f"the pairing of hyper-latent draws with design points did not converge in {max_iter} Newton "
                       f"steps (largest mass error {float(grad.abs().max()):.3g})")


@dataclass
class HyperPosterior(Posterior):
    """Mixture over hyper-latent design points of the engine's posteriors of the latent field.

    :ivar space: the :class:`ThetaSpace`.
    :ivar z: ``(K, d)`` unconstrained design points; ``theta`` the constrained values per point.
    :ivar weights: ``(K,)`` mixture weights (sum to one).
    :ivar components: the engine's posterior over the field ``u`` at each point.
    :ivar log_post: ``(K,)`` ``log p(theta_k) + B(theta_k) + log|J|`` (unconstrained density, up to a constant).
    :ivar density: the :class:`ThetaDensity` giving smooth ``theta`` marginals and samples.
    :ivar x: ``(K, d)`` the design points in standardised coordinates (pairs a ``theta`` sample with the
        nearest design point's field posterior).
    """

    space: ThetaSpace
    z: torch.Tensor
    weights: torch.Tensor
    components: list
    log_post: torch.Tensor
    density: ThetaDensity
    x: torch.Tensor
    mode: torch.Tensor
    hessian: Any
    layout: Any = None
    model: Any = None
    model_args: Any = ((), {})
    info: Dict[str, Any] = field(default_factory=dict)
    #: dtype of the field's summaries and samples (the model's own; the design-point fits run in float64)
    out_dtype: Any = None
    #: ``refit(z) -> (f(z), posterior, converged)``: the field fitted afresh at an unconstrained ``z`` (``f`` as
    #: :attr:`log_post`), for checks of the mixture away from its design points; set by the integration. A pickled or
    #: copied posterior keeps one that cannot refit (``refit.available`` is ``False``: the engine and the data are not
    #: kept)
    refit: Any = field(default=None, repr=False, compare=False)

    def _out(self, t):
        return t if self.out_dtype is None else t.to(self.out_dtype)

    @property
    def num_points(self):
        return int(self.weights.shape[0])

    @property
    def n(self):
        return self.components[0].n

    @property
    def dtype(self):
        return self.out_dtype or self.components[0].dtype

    @property
    def device(self):
        return self.components[0].device

    @property
    def loc(self):
        """Mixture mean of the latent field ``(n,)``."""
        return self._out(self._loc())

    def _loc(self):
        return sum(w * c.loc for w, c in zip(self.weights, self.components))

    @property
    def variance(self):
        """Mixture marginal variances of the latent field ``(n,)``."""
        m = self._loc()
        second = sum(w * (c.variance + c.loc**2) for w, c in zip(self.weights, self.components))
        return self._out((second - m**2).clamp_min(0))

    def sample_z(self, num_samples, generator=None):
        """Samples of the unconstrained hyper-latents ``(S, d)`` and the nearest design point of each ``(S,)``."""
        xs = self.density.sample_x(num_samples, generator)
        return self.density.to_z(xs), self._nearest(xs)

    def _nearest(self, x):
        """``(S,)`` index of the design point nearest to each of ``x (S, d)`` (standardised coordinates)."""
        return _neighbours(x, self.x, 1)[0][:, 0]

    def _pairing(self):
        """``(beta (K,), h, L)`` of the pairing of :meth:`sample_joint` (computed once, kept on the posterior).

        A ``theta`` draw at ``x`` takes design point ``k`` among its ``L = min(K, 2 d + 2)`` nearest with probability
        ``P(k | x) = softmax_k(beta_k - |x - x_k|^2 / (2 h^2))``, ``h`` half the median distance from a design point
        to its nearest neighbour. ``beta`` solves ``E[P(k | x)] = w_k`` under :attr:`density` (by its
        :meth:`~ThetaDensity.quadrature`), so that the design points are drawn with their weights while ``theta``
        keeps its density: the entropic semi-discrete optimal transport of the density onto the weighted design
        points (Peyré & Cuturi 2019, "Computational Optimal Transport", §5.3), whose pairings are local.
        Pairing every draw with its nearest design point instead weights the field's components by the masses of
        their cells, not by their weights. (On the 24-row model of ``tests/test_hyper_guide.py`` the guide's ELBO is
        then about 0.008 below ``log p(y)``; 0.018 with the nearest design point, 0.055 with ``h`` twice as wide.)
        """
        out = self.__dict__.get("_pairing_cache")
        if out is None:
            K, d = self.x.shape
            w = self.weights.detach().double().cpu()
            if K == 1:
                out = (torch.zeros(1, dtype=torch.float64), 1.0, 1)
            else:
                h = 0.5 * float(_neighbours(self.x, self.x, 2)[1][:, 1].sqrt().median())
                L = min(K, 2 * d + 2)
                x, p = self.density.quadrature(subcells=False)  # P(k | x) is smooth on the scale h > a cell
                out = (_semi_discrete_potentials(x, p, self.x, w, h, L), h, L)
            self.__dict__["_pairing_cache"] = out
        return out

    def _pair_logits(self, x):
        """``(idx (S, L), log P (S, L))``: the candidate design points of draws at ``x (S, d)`` and their log
        probabilities (:meth:`_pairing`)."""
        beta, h, L = self._pairing()
        idx, d2 = _neighbours(x, self.x, L)
        return idx, torch.log_softmax(beta[idx] - d2 / (2 * h * h), 1)

    def _field_draws(self, k, generator=None):
        """``(S, n)`` draws of the field, row ``i`` from the posterior of design point ``k[i]`` (the fits' dtype)."""
        out = torch.empty(k.shape[0], self.n, dtype=self.components[0].dtype, device=self.device)
        for j in k.unique().tolist():
            idx = (k == j).nonzero().reshape(-1)
            out[idx] = self.components[j].sample(len(idx), generator=generator).reshape(len(idx), self.n)
        return out

    def sample_joint(self, num_samples, generator=None):
        """Joint draws of the hyper-latents and the field, the draws of :meth:`as_guide`.

        ``theta`` follows :attr:`density` (the reported hyper-latent marginals) and is paired with a nearby design
        point ``k`` (:meth:`_pairing`), design point ``k`` being drawn with probability its weight ``w_k``; the field
        is drawn from ``q(u | theta_k)``, so it follows the mixture (:attr:`loc`, :attr:`variance`).

        :returns: ``(z (S, d), u (S, n))``: unconstrained hyper-latents (float64) and the field (the fits' dtype).
        """
        x = self.density.sample_x(num_samples, generator)
        idx, logp = self._pair_logits(x)
        pick = torch.multinomial(logp.exp(), 1, generator=generator).reshape(-1)
        k = idx[torch.arange(num_samples), pick]
        return self.density.to_z(x), self._field_draws(k, generator)

    def log_prob_joint(self, z, u):
        """``(S,)`` log density of :meth:`sample_joint`'s draws at ``z (S, d)``, ``u (S, n)``:
        ``log q(z) + log sum_k P(k | z) q(u | theta_k)``, ``q(z)`` the density of :attr:`density` in ``z``.

        With ``hyper="map"`` (a ``"point"`` density) ``theta`` is fixed at the mode, a point mass of log density 0
        (as Pyro's ``Delta``), and this is the field's log density alone.
        """
        z = z.detach().to(device="cpu", dtype=torch.float64)
        S = z.shape[0]
        if self.density.kind == "point":
            lz, idx, logp = torch.zeros(S, dtype=torch.float64), torch.zeros(S, 1, dtype=torch.long), \
                torch.zeros(S, 1, dtype=torch.float64)
        else:
            x = self.density.to_x(z)
            lz = self.density.log_prob_x(x) - float(torch.linalg.slogdet(self.density.A_inv)[1])
            idx, logp = self._pair_logits(x)
        u = u.to(dtype=self.components[0].dtype, device=self.device)
        lu = torch.full(idx.shape, -math.inf, dtype=torch.float64)
        for k in idx.unique().tolist():
            rows, cols = (idx == k).nonzero(as_tuple=True)
            lu[rows, cols] = self.components[k].log_prob(u[rows.to(self.device)]).detach().double().cpu()
        return lz + torch.logsumexp(logp + lu, 1)

    def theta_marginals(self, probs=(0.05, 0.5, 0.95), num_samples=200_000, seed=0):
        """``{site: {"mean", "sd", "quantiles": {p: ...}}}`` of the constrained hyper-latents, each of the site's
        shape (``()`` for a scalar site; ``space.shapes``), from :attr:`density`: a
        surface's by quadrature over its fine grid (:func:`surface_marginals`; no sampling noise), a split
        normal's from ``num_samples`` draws (for a normal marginal a 5% quantile's sampling error is about 0.005
        of its sd at 200,000 draws, 0.015 at 20,000)."""
        return surface_marginals(self.space, self.density, probs) if self.density.kind == "surface" else \
            self._sampled_marginals(probs, num_samples, seed)

    def _sampled_marginals(self, probs, num_samples, seed):
        gen = torch.Generator().manual_seed(seed)
        z = self.density.to_z(self.density.sample_x(num_samples, gen))  # the draws of sample_z, no nearest point
        out, start = {}, 0
        for k, (n, us, t, size) in enumerate(zip(self.space.names, self.space.ushapes, self.space.transforms,
                                                 self.space.sizes)):
            v = t(z[:, start:start + size].reshape((num_samples,) + us)).reshape(num_samples, -1)
            start += size
            if self.space.site_dtypes is not None:  # computed in float64, reported in the site's dtype
                v = v.to(device=self.space.site_devices[k], dtype=self.space.site_dtypes[k])
            q = torch.quantile(v, torch.tensor(probs, dtype=v.dtype), dim=0)
            out[n] = _site_summary(v.mean(0), v.std(0), q, probs, self.space.shapes[k])
        return out

    def sample(self, num_samples=(), generator=None):
        """Samples of the latent field ``(*num_samples, n)`` from the mixture."""
        shape = (num_samples,) if isinstance(num_samples, int) else tuple(num_samples)
        m = int(math.prod(shape)) if shape else 1
        k = torch.multinomial(self.weights, m, replacement=True, generator=generator)
        return self._out(self._field_draws(k, generator).reshape(shape + (self.n,)))

    def as_guide(self, model=None, *, trainable=False, name_prefix=None, model_args=None, model_kwargs=None):
        """A fixed Pyro guide over the hyper-latents and the latent field jointly: :class:`HyperMixtureGuide`.

        Its draws are :meth:`sample_joint`'s: ``theta`` from :attr:`density` (the reported marginals,
        ``res.hyper["marginals"]``), the field from a design point's posterior, the design points drawn with their
        weights (the field's draws have the moments :attr:`loc`, :attr:`variance`). Its log density is
        :meth:`log_prob_joint`, so ``Predictive`` (also ``parallel=True``), ``poutine.trace``, ``Trace_ELBO`` and
        importance sampling see the distribution it samples. The mixture over design points is not a trainable
        family: ``trainable=True`` raises.

        :param model: the Pyro model (default: the model the posterior was fitted to, with its fitting arguments,
            so observed sites stay observed in ``Predictive`` on new inputs).
        :param str name_prefix: name of the guide's auxiliary latent site ``"_<name_prefix>_latent"``.
        :param tuple model_args: positional arguments used to build the guide now (default: the fitting arguments
            when ``model`` is the fitted model; else the guide is built at its first call).
        :param dict model_kwargs: keyword arguments for the same.
        """
        if trainable:
            names = self.space.names
            field = self.layout.names if self.layout is not None else []
            alternatives = (f"res.posterior.components[k].as_guide() is the trainable Gaussian guide of the field "
                            f"{field} for the model conditioned at design point k (its .model), or fit with an engine "
                            f"that treats {names} as ordinary latent sites (e.g. 'laplace', 'svi_automvn'), whose "
                            "Gaussian guide over all latent sites trains")
            if self.density.kind == "point":
                raise ValueError(f"trainable=True: with hyper='map' the hyper-latents {names} are fixed at their mode, "
                                 "a point mass, which is not a trainable family; as_guide(trainable=False) samples it; "
                                 + alternatives.replace("design point k", "the mode (k = 0)"))
            raise ValueError(f"trainable=True: a mixture over the design points of the hyper-latents {names} is not a "
                             "trainable family; as_guide(trainable=False) samples it; " + alternatives)
        model, args, kwargs, build_now = _guide_model_and_data(self, model, model_args, model_kwargs)
        guide = HyperMixtureGuide(model, self, name_prefix=name_prefix)
        if build_now:
            guide._setup_prototype(*args, **kwargs)
        return guide

    def compact(self, keep_model=True):
        """A copy without the fitting data: the model's arguments and those of every design point's posterior,
        each compacted as :meth:`GaussianPosterior.compact <pyro_convexvb.posterior.gaussian.GaussianPosterior.compact>`
        does (a matrix-free precision becomes its dense precision up to ``MAX_COMPACT_DENSE`` coordinates, else is
        dropped), so that its size does not grow with the number of data rows. ``self`` is unchanged."""
        out = super().compact(keep_model)
        out.components = [c.compact(keep_model=False) for c in self.components]
        return out

    def __repr__(self):
        return (f"HyperPosterior(hyper={self.space.names}, points={self.num_points}, n={self.n}, "
                f"components={type(self.components[0]).__name__})")


class _JointDraws(TorchDistribution):
    """The joint of :meth:`HyperPosterior.sample_joint` over an autoguide's packed latent vector ``(D,)``.

    ``order`` ``(D,)`` puts the concatenation ``(z, u)`` in the autoguide's packing order. Not reparameterised (a
    design point is a discrete draw); it has no parameters to train.
    """

    arg_constraints = {}
    support = constraints.real_vector
    has_rsample = False

    def __init__(self, posterior, order, dtype, device):
        self.posterior, self.order = posterior, order
        self.inverse = torch.argsort(order)
        self.out_dtype, self.out_device = dtype, device
        super().__init__(batch_shape=torch.Size(), event_shape=torch.Size([order.shape[0]]), validate_args=False)

    def sample(self, sample_shape=torch.Size()):
        shape = torch.Size(sample_shape)
        z, u = self.posterior.sample_joint(int(math.prod(shape)))
        v = torch.cat([z.to(self.out_dtype), u.detach().to(device="cpu", dtype=self.out_dtype)], 1)[:, self.order]
        return v.to(self.out_device).reshape(shape + self.event_shape)

    def log_prob(self, value):
        flat = value.detach().reshape(-1, self.event_shape[0])[:, self.inverse.to(value.device)]
        d = self.posterior.space.dim
        lp = self.posterior.log_prob_joint(flat[:, :d], flat[:, d:])
        return lp.to(device=value.device, dtype=value.dtype).reshape(value.shape[:-1])


class HyperMixtureGuide(_KeepsItsModel, AutoContinuous):
    """Fixed autoguide of a :class:`HyperPosterior`: samples ``theta`` and the field ``u`` jointly
    (:meth:`HyperPosterior.sample_joint`), with the log density of those draws (:meth:`HyperPosterior.log_prob_joint`).

    Like Pyro's :class:`~pyro.infer.autoguide.AutoContinuous` guides it draws one packed vector of the model's
    latent sites in unconstrained coordinates (auxiliary site ``"_<name_prefix>_latent"``) and returns the sites
    constrained (``biject_to`` of each support, with its log-Jacobian), in plates, batched under
    ``Predictive(parallel=True)`` and vectorised ELBO particles, in the model's dtype. It has no parameters.

    :param callable model: the Pyro model.
    :param HyperPosterior posterior: the integrated posterior; its hyper-latents and field sites must be the model's
        latent sites.
    :param str name_prefix: name of the auxiliary site (default: the class name).
    """

    def __init__(self, model, posterior, *, name_prefix=None):
        super().__init__(model, init_loc_fn=init_to_feasible)
        self.posterior = posterior
        _apply_name_prefix(self, name_prefix)

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        post = self.posterior
        where, start = {}, 0
        for name, size in zip(post.space.names, post.space.sizes):
            where[name], start = (start, size), start + size
        for b in (post.layout.blocks if post.layout is not None else []):
            where[b.name] = (post.space.dim + b.start, b.size)
        sites = list(self._unconstrained_shapes)
        unknown = [n for n in sites if n not in where]
        if unknown:
            field_names = post.layout.names if post.layout is not None else []
            raise ValueError(f"latent site {unknown[0]!r} of the model is not described by this posterior (hyper-"
                             f"latents {post.space.names}, field {field_names}): pass the model it was fitted to, with "
                             "its fitting data (as_guide(model_args=...)) so that observed sites stay observed")
        missing = [n for n in where if n not in self._unconstrained_shapes]
        if missing:
            raise ValueError(f"the posterior's site {missing[0]!r} is not a latent site of the model")
        order = []
        for n in sites:
            begin, size = where[n]
            if size != math.prod(self._unconstrained_shapes[n]):
                raise ValueError(f"site {n!r}: the model's has {math.prod(self._unconstrained_shapes[n])} "
                                 f"unconstrained coordinates, the posterior's {size}")
            order.append(torch.arange(begin, begin + size))
        self._order = torch.cat(order)
        self._dtype, self._device = _prototype_dtype(self, post.components[0].loc)

    def get_posterior(self, *args, **kwargs):
        """The joint of the packed latent vector (a distribution with ``event_shape (D,)``, not reparameterised)."""
        return _JointDraws(self.posterior, self._order, self._dtype, self._device)

    def _loc_scale(self, *args, **kwargs):
        raise NotImplementedError(
            "HyperMixtureGuide has no median or quantiles of its own (its marginals are not Gaussian): read the "
            "hyper-latents' from res.hyper['marginals'] (or posterior.theta_marginals(probs)) and the field's from "
            "posterior.loc / posterior.variance or from posterior.sample(...)")

    def median(self, *args, **kwargs):
        return self._loc_scale()

    def quantiles(self, quantiles, *args, **kwargs):
        return self._loc_scale()
