r"""Hyper-latents of latent Gaussian models: found, then integrated over (INLA-style) or maximised.

A hierarchical Pyro model often has a few non-Gaussian latent sites ``theta`` (a ``HalfCauchy`` prior
scale, a ``Gamma`` precision, a ``LogNormal`` lengthscale) that feed only the prior or the likelihood
parameters of a large latent Gaussian field ``u``. Given ``theta`` the model is a latent Gaussian
model, which every engine with an evidence bound fits; its bound ``B(theta) <= log p(y | theta)``
makes

.. math:: \log \tilde\pi(\theta \mid y) = \log p(\theta) + B(\theta) \;\le\; \log p(\theta, y),

a lower bound on the unnormalised hyper-posterior, used as INLA uses its Laplace approximation
(Rue, Martino & Chopin 2009, §3): on the unconstrained scale ``z`` of ``theta`` (Pyro's ``biject_to``
of each support, log-Jacobian included) find the mode, the Hessian there by finite differences, and
standardised coordinates ``x = H^{1/2} (z - z*)``; integrate with a grid in ``x`` (dimension <= 2) or a
central composite design (above; Rue et al. 2009, §6.5), each design point ``x_k`` running the
engine on the model conditioned on ``theta_k`` (warm-started from the nearest point already fitted).
The posterior is the mixture ``sum_k w_k q(u | theta_k)`` with

.. math:: w_k \propto a_k\, \tilde\pi(\theta_k \mid y)\, / \,\varphi(x_k),

``a_k`` the design's quadrature weights for a standard normal density ``varphi`` (exact for
polynomials of degree 2: for the central composite design with ``n_s`` points on the sphere of
radius ``f_0 \sqrt{d}``, ``a_0 = 1 - 1/f_0^2`` at the centre and ``1/(n_s f_0^2)`` on the sphere; for the
grid ``a_k \propto \varphi(x_k)``, so ``w_k \propto \tilde\pi(\theta_k \mid y)``). ``hyper="map"`` keeps
only the mode (type-II maximum a posteriori for ``theta``).
"""
import itertools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from torch.distributions import biject_to

from ..errors import ConvergenceWarning, UnsupportedModelError

__all__ = [
    "HYPER_MAX_DIM",
    "find_hyper_sites",
    "ThetaSpace",
    "conditioned_model",
    "design_points",
    "HyperPosterior",
]

#: Largest total (unconstrained) dimension of the hyper-latents integrated over.
HYPER_MAX_DIM = 10

#: Distribution parameters through which a latent site may feed another site's *prior* (or an
#: observation's noise) -- dependence there makes it a hyper-latent.
_PARAMS = ("loc", "scale", "scale_tril", "covariance_matrix", "precision_matrix", "concentration", "rate",
           "df", "precision", "precision_scale", "total_count", "high", "low")
_SCALE_PARAMS = ("scale", "scale_tril", "covariance_matrix", "precision_matrix", "precision_scale")


def _field_prior(fn):
    """Whether a latent site's prior makes it part of the latent Gaussian field."""
    from ..lgm.extract import _unwrap

    base, _ = _unwrap(fn)
    field_types = (dist.Normal, torch.distributions.Normal, dist.MultivariateNormal,
                   torch.distributions.MultivariateNormal, dist.Laplace, torch.distributions.Laplace)
    try:
        from ..distributions import SparseGMRF

        field_types = field_types + (SparseGMRF,)
    except ImportError:  # pragma: no cover - the GMRF distribution is optional here
        pass
    return isinstance(base, field_types)


def _sv_site(fn):
    """An observed ``Normal`` whose scale reads the latents and whose mean does not: a stochastic-volatility site
    (:class:`~pyro_convexvb.lgm.families.StochasticVolatility`), its scale the predictor, not a noise parameter."""
    from ..lgm.families import StochasticVolatility
    from ..lgm.extract import _unwrap

    return StochasticVolatility.predictor(_unwrap(fn)[0]) is not None


def _tensor_params(fn, names):
    from ..lgm.extract import _unwrap

    base, _ = _unwrap(fn)
    out = []
    for attr in names:
        t = base.__dict__.get(attr) if attr not in ("scale_tril",) else getattr(base, "_unbroadcasted_scale_tril",
                                                                                   None)
        if t is None and attr in ("loc", "scale", "rate", "concentration", "df"):
            t = getattr(base, attr, None)
        if torch.is_tensor(t):
            out.append(t)
    return out


def find_hyper_sites(model, args, kwargs):
    """Names of the model's hyper-latent sites, in trace order.

    A latent site is a hyper-latent when its prior is not one of the latent-field priors (``Normal``,
    ``MultivariateNormal``, ``Laplace``, ``SparseGMRF``), when another latent site's prior parameters
    depend on it, or when an observation's parameters other than its predictor (e.g. a ``Normal``
    likelihood's scale) depend on it.

    Gaussian latents that set a hyper-latent's prior are hyper-latents too (e.g. the ``Normal`` mean of a
    ``LogNormal`` scale).
    """
    from ..lgm.extract import full_data_plates, latent_sites

    sites = latent_sites(model, args, kwargs)
    names = [n for n, _ in sites]
    values = {n: s["value"].detach().clone().requires_grad_(s["value"].is_floating_point()) for n, s in sites}
    with full_data_plates():
        tr = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
    deps = {}
    for name, site in tr.nodes.items():
        if site["type"] != "sample" or type(site["fn"]).__name__ == "_Subsample":
            continue
        observed = name not in values
        if observed:
            attrs = ("scale",)  # an observation's noise; its predictor (loc, logits, rate) is the field's
            if _sv_site(site["fn"]):  # Normal(m, exp(eta / 2)): its scale is the predictor
                attrs = ()
        elif _field_prior(site["fn"]):
            attrs = _SCALE_PARAMS  # a field site's location may read other latents affinely
        else:
            attrs = _PARAMS
        params = _tensor_params(site["fn"], attrs)
        found = set()
        for t in params:
            if t.requires_grad:
                grads = torch.autograd.grad(t.sum(), [values[n] for n in names if values[n].requires_grad],
                                            retain_graph=True, allow_unused=True)
                found |= {n for n, g in zip([n for n in names if values[n].requires_grad], grads)
                          if g is not None and bool((g != 0).any())}
        deps[name] = found - {name}
    hyper = {n for n, s in sites if not _field_prior(s["fn"])}
    for found in deps.values():  # what sets another site's prior, or an observation's noise, is a hyper-latent
        hyper |= found
    return [n for n in names if n in hyper]


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

    @classmethod
    def from_model(cls, model, args, kwargs, names, dtype=torch.float64):
        from ..lgm.extract import latent_sites

        sites = dict(latent_sites(model, args, kwargs))
        shapes, ushapes, transforms, dtypes, devices = [], [], [], [], []
        for n in names:
            t = biject_to(sites[n]["fn"].support)
            v = sites[n]["value"]
            shapes.append(tuple(v.shape))
            ushapes.append(tuple(t.inv(v).shape))
            transforms.append(t)
            dtypes.append(v.dtype)
            devices.append(v.device)
        space = cls(list(names), shapes, ushapes, transforms, dtype, dtypes, devices)
        if space.dim > HYPER_MAX_DIM:
            raise UnsupportedModelError(names[0], f"{space.dim} hyper-latent dimensions ({', '.join(names)}); "
                                                  f"integration over them supports at most {HYPER_MAX_DIM}")
        return space

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


def conditioned_model(model, values):
    """``model`` with the hyper-latents fixed at ``values`` and hidden from traces (a latent Gaussian model)."""
    return poutine.block(poutine.condition(model, data=values), hide=list(values))


def log_prior(model, args, kwargs, values):
    """``log p(theta)``: the hyper-latents' own prior log densities at ``values`` (constrained)."""
    from ..lgm.extract import full_data_plates

    with torch.no_grad(), full_data_plates():
        tr = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
    return float(sum(tr.nodes[n]["fn"].log_prob(tr.nodes[n]["value"]).sum() for n in values))


# ---------------------------------------------------------------------------------------------
# integration designs
# ---------------------------------------------------------------------------------------------
def _fractional_factorial(d):
    """Corners ``{-1, 1}^d`` of a two-level design: the full factorial for ``d <= 4``, else a resolution-V
    half (or smaller) fraction built from the full factorial of the first ``d - p`` factors."""
    if d <= 4:
        return torch.tensor(list(itertools.product((-1.0, 1.0), repeat=d)), dtype=torch.float64)
    p = {5: 1, 6: 1, 7: 1, 8: 2, 9: 2, 10: 3}[d]
    base = torch.tensor(list(itertools.product((-1.0, 1.0), repeat=d - p)), dtype=torch.float64)
    gens = list(itertools.combinations(range(d - p), 4))[:p] if d - p >= 4 else []
    extra = [base[:, list(g)].prod(1, keepdim=True) for g in gens]
    return torch.cat([base] + extra, 1)


def design_points(d, strategy, *, step=0.75, radius=3.5, f0=1.1):
    """Standardised design points ``x`` ``(K, d)`` and quadrature weights ``a`` ``(K,)`` for ``N(0, I)``.

    :param str strategy: ``"grid"`` (a square grid of spacing ``step`` within ``radius``; ``a`` proportional
        to the normal density, so ``w_k`` is proportional to the hyper-posterior) or ``"ccd"`` (centre plus
        ``2 d`` axial points and the corners of a two-level (fractional) factorial, all on the sphere of
        radius ``f0 sqrt(d)``; ``a_0 = 1 - 1/f0^2``, ``a = 1/(n_s f0^2)`` elsewhere: exact for polynomials
        of degree 2 under ``N(0, I)``).
    """
    if strategy == "grid":
        m = int(math.floor(radius / step))
        ticks = torch.arange(-m, m + 1, dtype=torch.float64) * step
        x = torch.cartesian_prod(*([ticks] * d)).reshape(-1, d)
        x = x[(x**2).sum(1) <= radius**2 + 1e-12]
        a = torch.exp(-0.5 * (x**2).sum(1))
        return x, a / a.sum()
    if strategy == "ccd":
        r = f0 * math.sqrt(d)
        axial = torch.cat([torch.eye(d, dtype=torch.float64), -torch.eye(d, dtype=torch.float64)]) * r
        corners = _fractional_factorial(d) * (r / math.sqrt(d)) if d > 1 else torch.zeros(0, 1, dtype=torch.float64)
        sphere = torch.cat([axial, corners])
        x = torch.cat([torch.zeros(1, d, dtype=torch.float64), sphere])
        a = torch.full((x.shape[0],), 1.0 / (sphere.shape[0] * f0**2), dtype=torch.float64)
        a[0] = 1.0 - 1.0 / f0**2
        return x, a
    raise ValueError(f"strategy: expected 'grid' or 'ccd', got {strategy!r}")


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

    @classmethod
    def surface(cls, z_mode, A_inv, x, logf, radius, resolution=None):
        from scipy.interpolate import RBFInterpolator

        d = x.shape[1]
        m = resolution or (801 if d == 1 else 161)
        ticks = torch.linspace(-radius, radius, m, dtype=torch.float64)
        xs = ticks.reshape(-1, 1) if d == 1 else torch.cartesian_prod(ticks, ticks)
        xs = xs[(xs**2).sum(1) <= radius**2]
        f = (logf - logf.max()).numpy()
        interp = RBFInterpolator(x.numpy(), f, kernel="thin_plate_spline", degree=2)
        lp = torch.as_tensor(interp(xs.numpy()), dtype=torch.float64)
        probs = torch.softmax(lp, 0)
        return cls("surface", z_mode, A_inv, xs=xs, probs=probs, cell=float(ticks[1] - ticks[0]))

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

    def to_z(self, x):
        if self.kind == "point":
            return self.z_mode.expand(x.shape[0], -1).clone()
        return self.z_mode + x @ self.A_inv.T


@dataclass
class HyperPosterior:
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

    @property
    def scale(self):
        return self.variance.sqrt()

    def sample_z(self, num_samples, generator=None):
        """Samples of the unconstrained hyper-latents ``(S, d)`` and the nearest design point of each ``(S,)``."""
        xs = self.density.sample_x(num_samples, generator)
        k = torch.cdist(xs, self.x).argmin(1)
        return self.density.to_z(xs), k

    def theta_marginals(self, probs=(0.05, 0.5, 0.95), num_samples=20000, seed=0):
        """``{site: {"mean", "sd", "quantiles"}}`` of the constrained hyper-latents (from :attr:`density`)."""
        gen = torch.Generator().manual_seed(seed)
        z, _ = self.sample_z(num_samples, gen)
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


# ---------------------------------------------------------------------------------------------
# the outer loop over theta
# ---------------------------------------------------------------------------------------------
class HyperObjective:
    """``f(z) = log p(theta(z)) + log|d theta/d z| + B(theta(z))``: the engine fitted on the conditioned model.

    Every evaluation is cached with the engine's result; a fit is warm-started from the result at the
    nearest ``z`` already evaluated (:meth:`~pyro_convexvb.infer.engine.Engine.warm_start_options`).
    """

    def __init__(self, engine, space, args, kwargs, history=None, bar=None):
        self.engine, self.space, self.args, self.kwargs = engine, space, args, kwargs
        self.history, self.bar = history, bar
        self.cache = {}

    def _nearest(self, z):
        if not self.cache:
            return None
        key = min(self.cache, key=lambda k: float(((torch.tensor(k, dtype=torch.float64) - z) ** 2).sum()))
        return self.cache[key][1]

    def fit(self, z):
        """``(f(z), engine result)``; cached."""
        z = torch.as_tensor(z, dtype=torch.float64).reshape(-1)
        key = tuple(round(float(v), 12) for v in z)
        if key in self.cache:
            return self.cache[key]
        values, logjac = self.space.unpack(z)
        eng = self.engine
        lp = log_prior(eng.model, self.args, self.kwargs, values)
        warm = self._nearest(z)
        inner = eng.inner_engine(conditioned_model(eng.model, values), warm, learn_params=False)
        inner.extract_dtype = torch.float64  # bounds accurate enough for finite differences over theta
        with warnings.catch_warnings():  # the outer fit counts unconverged design points and warns once
            warnings.simplefilter("ignore", ConvergenceWarning)
            res = inner.run(*self.args, **self.kwargs)
        if res.log_evidence_bound is None or not math.isfinite(res.log_evidence_bound):
            raise UnsupportedModelError(self.space.names[0], f"engine '{eng.name}' gave no evidence bound at "
                                                             f"theta = {values}; hyper-latents need one")
        out = (lp + logjac + float(res.log_evidence_bound), res)
        self.cache[key] = out
        if self.history is not None:
            self.history.record(objective=out[0], converged=float(res.converged))
        if self.bar is not None:
            self.bar.update(1)
        return out

    def __call__(self, z):
        return self.fit(z)[0]


def _initial_z(model, args, kwargs, space, num=51, seed=0):
    """The coordinatewise prior median of the hyper-latents, on the unconstrained scale."""
    from ..lgm.extract import full_data_plates

    from .engine import forked_rng

    zs = []
    with torch.no_grad(), full_data_plates(), forked_rng(seed):  # a fixed start, whatever the run's seed
        for _ in range(num):
            tr = poutine.trace(model).get_trace(*args, **kwargs)
            zs.append(space.pack({n: tr.nodes[n]["value"] for n in space.names}))
    return torch.stack(zs).median(0).values


def _grad_fd(f, z, h):
    g = torch.zeros_like(z)
    for i in range(z.shape[0]):
        e = torch.zeros_like(z)
        e[i] = h
        g[i] = (f(z + e) - f(z - e)) / (2 * h)
    return g


def _hessian_fd(f, z, h):
    d = z.shape[0]
    H = torch.zeros(d, d, dtype=torch.float64)
    f0 = f(z)
    for i in range(d):
        ei = torch.zeros(d, dtype=torch.float64)
        ei[i] = h
        H[i, i] = (f(z + ei) - 2 * f0 + f(z - ei)) / h**2
        for j in range(i):
            ej = torch.zeros(d, dtype=torch.float64)
            ej[j] = h
            H[i, j] = H[j, i] = (f(z + ei + ej) - f(z + ei - ej) - f(z - ei + ej) + f(z - ei - ej)) / (4 * h**2)
    return H


def find_mode(obj, z0, *, max_iter=100, gtol=1e-4, fd_step=1e-3, bound=12.0, hess_step=2e-2, newton_steps=3):
    """Maximise ``obj`` (a :class:`HyperObjective`) over ``z`` by L-BFGS-B with central-difference gradients,
    then Newton steps on the central-difference Hessian while ``max |grad| > gtol``.

    The Newton steps are needed because every value of ``obj`` is an inner fit stopped at its own tolerance
    and warm-started from the nearest point fitted before: its error (about 1e-7 to 1e-6 nats) depends on
    that starting point. L-BFGS-B's line search compares values at different points, and near the mode,
    where a step gains only about ``|g|^2 / H``, that error decides it: the search fails ("ABNORMAL") with
    ``|g|`` above ``gtol``. A gradient or Hessian stencil is fitted from its own centre, so its differences
    cancel the error; Newton steps use only those and reach ``gtol``.

    :param float hess_step: step of the central-difference Hessian of the Newton steps.
    :param int newton_steps: most Newton steps after L-BFGS-B (each stops early when it does not reduce
        ``max |grad|``).
    :returns: ``(z*, f(z*), scipy result)``; ``z`` stays within ``z0 +- bound``.
    """
    import numpy as np
    import scipy.optimize

    def fun(x):
        z = torch.as_tensor(x, dtype=torch.float64)
        v = obj(z)
        g = _grad_fd(obj, z, fd_step)
        return -v, -g.numpy()

    x0 = z0.numpy().astype(np.float64)
    res = scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B",
                                  bounds=[(v - bound, v + bound) for v in x0],
                                  options=dict(maxiter=max_iter, gtol=gtol, ftol=1e-12))
    z = torch.as_tensor(res.x, dtype=torch.float64)
    lo, hi = z0.to(torch.float64) - bound, z0.to(torch.float64) + bound
    g = _grad_fd(obj, z, fd_step)
    for _ in range(newton_steps):
        if float(g.abs().max()) <= gtol:
            break
        H = -_hessian_fd(obj, z, hess_step)
        try:
            L = torch.linalg.cholesky(0.5 * (H + H.T))
        except torch.linalg.LinAlgError:
            break  # not locally concave: no Newton step (the caller reports the gradient)
        z_new = torch.minimum(torch.maximum(z + torch.cholesky_solve(g.reshape(-1, 1), L).reshape(-1), lo), hi)
        g_new = _grad_fd(obj, z_new, fd_step)
        if float(g_new.abs().max()) >= float(g.abs().max()):
            break
        z, g = z_new, g_new
    return z, obj(z), res


def integrate_hyper(engine, hyper_names, args, kwargs, *, strategy="auto", fd_step=1e-3, hess_step=2e-2,
                    grid_step=0.75, grid_radius=3.0, max_radius=6.0, prune=7.0, f0=1.1, run=None):
    """INLA-style integration (or maximisation) over the hyper-latents ``hyper_names`` (see the module docstring).

    :param engine: the outer :class:`~pyro_convexvb.infer.engine.Engine` (its class fits each conditioned model).
    :param str strategy: ``"grid"``, ``"ccd"``, ``"auto"`` (grid for ``d <= 2``) or ``"map"`` (the mode only).
    :returns: ``(posterior, mode result, info)``: a :class:`HyperPosterior` (``None`` for ``"map"``), the
        engine's result at the mode, and a dict with the mode, Hessian, points, weights and evaluations.
    """
    model = engine.model
    space = ThetaSpace.from_model(model, args, kwargs, hyper_names)
    from ..lgm.extract import latent_sites

    field_dtypes = [s["value"].dtype for n, s in latent_sites(model, args, kwargs)
                    if n not in hyper_names and s["value"].is_floating_point()]
    out_dtype = field_dtypes[0] if field_dtypes else None  # the model's own dtype, reported back
    bar = run.bar(unit="fit", desc=f"{engine.name} (hyper)") if run is not None else None
    obj = HyperObjective(engine, space, args, kwargs, history=None if run is None else run.history, bar=bar)
    z0 = _initial_z(model, args, kwargs, space)
    gtol = 1e-3
    z_mode, f_mode, opt = find_mode(obj, z0, fd_step=fd_step, gtol=gtol, hess_step=hess_step)
    mode_res = obj.fit(z_mode)[1]
    gnorm = float(_grad_fd(obj, z_mode, fd_step).abs().max())
    info = {"mode_z": z_mode, "mode_theta": space.unpack(z_mode)[0], "log_post_mode": f_mode,
            "mode_grad_norm": gnorm, "mode_gtol": gtol, "mode_message": str(opt.message), "space": space}
    if strategy == "map":
        info["evaluations"] = len(obj.cache)
        post = HyperPosterior(space, z_mode.reshape(1, -1), torch.ones(1, dtype=torch.float64),
                              [mode_res.posterior], torch.tensor([f_mode], dtype=torch.float64),
                              ThetaDensity.point(z_mode), torch.zeros(1, space.dim, dtype=torch.float64), z_mode,
                              None, layout=mode_res.posterior.layout, out_dtype=out_dtype)
        return post, mode_res, info
    H = -_hessian_fd(obj, z_mode, hess_step)
    H = 0.5 * (H + H.T)
    evals, evecs = torch.linalg.eigh(H)
    if not bool((evals > 0).all()):
        raise UnsupportedModelError(space.names[0], "the hyper-posterior bound is not locally concave at its mode "
                                                    f"(Hessian eigenvalues {evals.tolist()}); integration needs a mode")
    A_inv = evecs @ torch.diag(evals.rsqrt())  # z = z* + A_inv x
    d = space.dim
    if strategy == "auto":
        strategy = "grid" if d <= 2 else "ccd"
    x, a = design_points(d, strategy, step=grid_step, radius=grid_radius, f0=f0)
    zs, logf, results = [], [], []

    def evaluate(points):
        for k in range(points.shape[0]):
            z = z_mode + A_inv @ points[k]
            val, res = obj.fit(z)
            zs.append(z)
            logf.append(val)
            results.append(res)

    evaluate(x)
    radius = grid_radius
    if strategy == "grid":
        # widen the grid ring by ring while its rim still carries mass (log density within `prune` of the top)
        while radius < max_radius:
            lf = torch.tensor(logf, dtype=torch.float64)
            rim = (x**2).sum(1).sqrt() > radius - grid_step
            if not bool((lf[rim] >= lf.max() - prune).any()):
                break
            wider, _ = design_points(d, "grid", step=grid_step, radius=radius + grid_step)
            ring = wider[(wider**2).sum(1).sqrt() > radius + 1e-9]
            alive = x[rim & (lf >= lf.max() - prune)]  # only next to rim points that still carry mass
            ring = ring[torch.cdist(ring, alive).min(1).values <= 1.5 * grid_step + 1e-9]
            evaluate(ring)
            x = torch.cat([x, ring])
            radius += grid_step
        a = torch.exp(-0.5 * (x**2).sum(1))
    logf = torch.tensor(logf, dtype=torch.float64)
    if strategy == "grid":
        logw = logf
    else:
        logw = torch.log(a) + logf + 0.5 * (x**2).sum(1)
    keep = logf >= logf.max() - prune if strategy == "grid" else torch.ones_like(logf, dtype=torch.bool)
    logw = torch.where(keep, logw, torch.full_like(logw, -math.inf))
    w = torch.softmax(logw, 0)
    idx = [k for k in range(len(results)) if float(w[k]) > 0]
    w = w[idx] / w[idx].sum()
    if strategy == "grid":
        density = ThetaDensity.surface(z_mode, A_inv, x[keep], logf[keep], radius)
    else:
        density = ThetaDensity.split_normal(z_mode, A_inv, x, logf)
    post = HyperPosterior(space, torch.stack([zs[k] for k in idx]), w, [results[k].posterior for k in idx],
                          logf[idx], density, x[idx], z_mode, H, layout=mode_res.posterior.layout,
                          out_dtype=out_dtype)
    info.update(strategy=strategy, radius=radius, evaluations=len(obj.cache), hessian=H, design_x=x[idx],
                design_a=a[idx],
                results=[results[k] for k in idx])
    return post, mode_res, info
