"""The posterior of a latent Gaussian model with hyper-latents ``theta`` integrated over (INLA-style): a mixture
over design points ``theta_k`` of the engine's posteriors of the latent field (Rue, Martino & Chopin 2009, §3).

The design and the fits are made by :mod:`pyro_convexvb.infer.hyper`; this module holds only what the answer is.
"""
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List

import pyro
import pyro.distributions as dist
import torch

from .base import Posterior
from .empirical import weighted_quantiles

__all__ = ["ThetaSpace", "ThetaDensity", "HyperPosterior", "HyperMixtureGuide"]


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

    def unpack(self, z):
        """``({site: constrained value}, log|d theta / d z|)`` for ``z`` of shape ``(dim,)``; the values in each
        site's own dtype and device, the log-Jacobian computed in :attr:`dtype`."""
        z = torch.as_tensor(z).detach().to(device="cpu", dtype=self.dtype)
        vals, ld, start = {}, 0.0, 0
        for k, (n, us, t, size) in enumerate(zip(self.names, self.ushapes, self.transforms, self.sizes)):
            x = z[start:start + size].reshape(us)
            start += size
            v = t(x)
            ld = ld + float(t.log_abs_det_jacobian(x, v).sum())
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
@dataclass
class ThetaDensity:
    """A smooth approximation of the hyper-posterior in standardised coordinates ``x`` (``z = z* + A^{-1} x``).

    * ``"surface"`` (grid designs): the log density at the design points interpolated by a thin-plate
      spline with a quadratic tail (exact for a Gaussian), evaluated on a fine grid inside the design's
      radius; samples are fine-grid cells drawn by mass, uniform within a cell.
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
    #: the surface's fine grid: ``ticks`` per axis from ``-radius`` (``xs`` keeps those within ``radius``)
    radius: float = 0.0
    ticks: int = 0

    @classmethod
    def surface(cls, z_mode, A_inv, x, logf, radius, resolution=None):
        from scipy.interpolate import RBFInterpolator

        d = x.shape[1]
        # fine-grid cells of at most 0.25 standardised units (the mode's Hessian scale is 1)
        m = resolution or (max(801, int(8 * radius) + 1) if d == 1 else max(161, int(8 * radius) + 1))
        ticks = torch.linspace(-radius, radius, m, dtype=torch.float64)
        xs = ticks.reshape(-1, 1) if d == 1 else torch.cartesian_prod(ticks, ticks)
        xs = xs[(xs**2).sum(1) <= radius**2]
        f = (logf - logf.max()).numpy()
        interp = RBFInterpolator(x.numpy(), f, kernel="thin_plate_spline", degree=2)
        lp = torch.as_tensor(interp(xs.numpy()), dtype=torch.float64)
        probs = torch.softmax(lp, 0)
        return cls("surface", z_mode, A_inv, xs=xs, probs=probs, cell=float(ticks[1] - ticks[0]), radius=radius,
                   ticks=m)

    @classmethod
    def split_normal(cls, z_mode, A_inv, x, logf):
        d = x.shape[1]
        r = float(x[1].norm())
        drop_p = (logf[0] - logf[1:1 + d]).clamp_min(1e-6)
        drop_m = (logf[0] - logf[1 + d:1 + 2 * d]).clamp_min(1e-6)
        return cls("split-normal", z_mode, A_inv, s_plus=r / torch.sqrt(2 * drop_p), s_minus=r / torch.sqrt(2 * drop_m))

    @classmethod
    def point(cls, z_mode):
        return cls("point", z_mode, None)

    def sample_x(self, num_samples, generator=None):
        d = self.z_mode.shape[0]
        if self.kind == "point":
            return torch.zeros(num_samples, d, dtype=torch.float64)
        if self.kind == "surface":
            k = torch.multinomial(self.probs, num_samples, replacement=True, generator=generator)
            jitter = (torch.rand(num_samples, d, dtype=torch.float64, generator=generator) - 0.5) * self.cell
            return self.xs[k] + jitter
        e = torch.randn(num_samples, d, dtype=torch.float64, generator=generator)
        return torch.where(e > 0, e * self.s_plus, e * self.s_minus)

    def log_prob_x(self, x):
        """``(S,)`` log density at ``x (S, d)`` of the draws of :meth:`sample_x` (``-inf`` outside a surface's
        cells): a surface's probability of the fine-grid cell holding ``x`` over the cell's volume, found by rounding
        to the grid (no search over its points), or the split normal's density."""
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
        idx = torch.round((x + self.radius) / self.cell).long()
        ok = ((idx >= 0) & (idx < self.ticks)).all(1)
        idx = idx.clamp(0, self.ticks - 1)
        # the grid point's own square cell (ties at a shared edge go to the rounded point)
        # (the centres in x's dtype: an integer tensor times a Python float is float32, whose centres are off by
        # 1e-7 and put a draw within that of its cell's edge outside every cell)
        ok &= (x - (idx.to(x.dtype) * self.cell - self.radius)).abs().max(1).values <= 0.5 * self.cell + 1e-12
        lq = table[self._flat(idx)]
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


#: points per fine-grid cell in :func:`surface_marginals` (a Fibonacci number: the 2-D lattice's size)
SUBCELLS = 21


def surface_marginals(space, density, probs=(0.05, 0.5, 0.95)):
    """``{site: {"mean", "sd", "quantiles"}}`` of the constrained hyper-latents under a surface
    :class:`ThetaDensity`, by quadrature over its fine grid (each cell's mass spread evenly over
    :data:`SUBCELLS` points in it, as its draws are uniform in it)."""
    # each cell's mass spread over SUBCELLS points inside it with distinct coordinates on every axis (its centre
    # alone, or a sub-grid, would put many cells' masses on one value of a coordinate when the cells line up with
    # it): evenly spaced in 1-D, a Fibonacci lattice (21 points, generator 13) in 2-D
    d = density.xs.shape[1]
    i = torch.arange(SUBCELLS, dtype=torch.float64)
    cols = [(i + 0.5) / SUBCELLS] + ([torch.remainder((i * 13 + 0.5) / SUBCELLS, 1.0)] if d == 2 else [])
    offsets = (torch.stack(cols, 1) - 0.5) * density.cell
    z = density.to_z((density.xs[:, None, :] + offsets[None]).reshape(-1, d))
    w = (density.probs.double()[:, None] / offsets.shape[0]).expand(-1, offsets.shape[0]).reshape(-1)
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
        out[n] = {"mean": mean, "sd": sd, "quantiles": dict(zip(probs, q))}
    return out


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
        k = torch.cdist(xs, self.x).argmin(1)
        return self.density.to_z(xs), k

    def theta_marginals(self, probs=(0.05, 0.5, 0.95), num_samples=200_000, seed=0):
        """``{site: {"mean", "sd", "quantiles"}}`` of the constrained hyper-latents (from :attr:`density`): a
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
            out[n] = {"mean": v.mean(0), "sd": v.std(0), "quantiles": dict(zip(probs, q))}
        return out

    def sample(self, num_samples=(), generator=None):
        """Samples of the latent field ``(*num_samples, n)`` from the mixture."""
        shape = (num_samples,) if isinstance(num_samples, int) else tuple(num_samples)
        m = int(math.prod(shape)) if shape else 1
        k = torch.multinomial(self.weights, m, replacement=True, generator=generator)
        out = torch.empty(m, self.n, dtype=self.components[0].dtype, device=self.device)
        for j in k.unique().tolist():
            idx = (k == j).nonzero().reshape(-1)
            out[idx] = self.components[j].sample(len(idx), generator=generator).reshape(len(idx), self.n)
        return self._out(out.reshape(shape + (self.n,)))

    def as_guide(self, model=None, *, trainable=False):
        """A Pyro guide sampling the hyper-latents and the latent field jointly (for ``Predictive``).

        A design point ``k`` is drawn with probability ``w_k``; the hyper-latents from the kernel around
        ``z_k`` (constrained by ``biject_to``) and the field from ``q(u | theta_k)``. The mixture over design
        points is not a trainable family: ``trainable=True`` raises.
        """
        if trainable:
            raise ValueError("a mixture over hyper-latent design points is not a trainable guide; use "
                             "as_guide(trainable=False), or fit with hyper='map' for a Gaussian posterior whose "
                             "guide trains")
        if model is None:
            model = self.model
        if model is None:
            raise ValueError("as_guide() needs the Pyro model (pass model=...)")
        return HyperMixtureGuide(model, self)

    def __repr__(self):
        return (f"HyperPosterior(hyper={self.space.names}, points={self.num_points}, n={self.n}, "
                f"components={type(self.components[0]).__name__})")


class HyperMixtureGuide:
    """Fixed guide of a :class:`HyperPosterior`: samples ``theta`` and the field ``u`` jointly.

    Works with :class:`pyro.infer.Predictive` and ``poutine.trace``; every latent site of the model is
    sampled as a ``Delta`` at the drawn value.
    """

    def __init__(self, model, posterior):
        self.model = model
        self.posterior = posterior

    def __call__(self, *args, **kwargs):
        post = self.posterior
        z, k = post.sample_z(1)
        theta, _ = post.space.unpack(z[0])
        u = post._out(post.components[int(k[0])].sample(1).reshape(-1))
        values = {}
        for n in post.space.names:
            values[n] = pyro.sample(n, dist.Delta(theta[n], event_dim=theta[n].dim()))
        field_vals = post.layout.unflatten(u) if post.layout is not None else {}
        for n, v in field_vals.items():
            values[n] = pyro.sample(n, dist.Delta(v, event_dim=v.dim()))
        return values

