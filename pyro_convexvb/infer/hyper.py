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

import numpy as np
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from torch.distributions import biject_to

from ..errors import (ConvergenceError, ConvergenceWarning, NotPositiveDefiniteError, UnsupportedModelError,
                      WarningsOnce, warn)
from ..lgm.extract import _unwrap, full_data_plates, latent_sites
from ..posterior.hyper import (  # noqa: F401 (re-exported)
    GridWarp,
    HyperMixtureGuide,
    HyperPosterior,
    ThetaDensity,
    ThetaSpace,
)
from .rng import forked_rng
from .type2 import _WarmFrom

__all__ = [
    "HYPER_MAX_DIM",
    "find_hyper_sites",
    "ThetaSpace",
    "theta_space",
    "conditioned_model",
    "ConditionedModel",
    "design_points",
    "HyperPosterior",
]

#: Largest total (unconstrained) dimension of the hyper-latents integrated over.
HYPER_MAX_DIM = 10

#: Whether design points reuse the first extraction's affine maps (:class:`HyperObjective`; the result equals a fresh
#: extraction at every point). ``False`` extracts every point afresh, as before: for benchmarks and tests that
#: compare the two.
REUSE_EXTRACTION = True

#: Spacing ratio of consecutive grid rings past ``grid_radius`` (:class:`~pyro_convexvb.posterior.hyper.GridWarp`).
GRID_GROWTH = 1.25

#: Distribution parameters through which a latent site may feed another site's *prior* (or an
#: observation's noise) -- dependence there makes it a hyper-latent.
_PARAMS = ("loc", "scale", "scale_tril", "covariance_matrix", "precision_matrix", "concentration", "rate",
           "df", "precision", "precision_scale", "total_count", "high", "low")
_SCALE_PARAMS = ("scale", "scale_tril", "covariance_matrix", "precision_matrix", "precision_scale")


def _field_prior(fn):
    """Whether a latent site's prior makes it part of the latent Gaussian field."""
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


#: an observation's parameters that are its noise, not its predictor: a Normal's or Student-t's scale, a Student-t's
#: degrees of freedom, a negative binomial's total count, a Gamma's concentration
_NOISE_PARAMS = ("scale", "df", "total_count", "concentration")


def find_hyper_sites(model, args, kwargs):
    """Names of the model's hyper-latent sites, in trace order.

    A latent site is a hyper-latent when its prior is not one of the latent-field priors (``Normal``,
    ``MultivariateNormal``, ``Laplace``, ``SparseGMRF``), when another latent site's prior parameters
    depend on it, or when an observation's parameters other than its predictor (a ``Normal`` or ``StudentT``
    likelihood's scale, a ``StudentT``'s ``df``, a ``NegativeBinomial``'s ``total_count``, a ``Gamma``'s
    ``concentration``) depend on it.

    Gaussian latents that set a hyper-latent's prior are hyper-latents too (e.g. the ``Normal`` mean of a
    ``LogNormal`` scale).
    """
    sites, deps, _ = _dependencies(model, args, kwargs)
    hyper = {n for n, s in sites if not _field_prior(s["fn"])}
    for found in deps.values():  # what sets another site's prior, or an observation's noise, is a hyper-latent
        hyper |= found
    return [n for n, _ in sites if n in hyper]


def field_scale_sites(model, args, kwargs):
    """``{field site: latent sites that set its prior's scale}`` (a centred hierarchy: ``theta ~ Normal(mu, tau)``
    gives ``{"theta": {"tau"}}``), for the field sites that have any; trace order."""
    _, _, scales = _dependencies(model, args, kwargs)
    return {n: found for n, found in scales.items() if found}


def _dependencies(model, args, kwargs):
    """``(latent sites, deps, field scales)``: ``deps[site]`` the latent sites its distribution's parameters read
    (a field site's scale parameters only, an observation's noise parameters only: its predictor is the field's),
    ``field scales[site]`` those of a field site's scale parameters; by autograd through one trace of the model."""
    sites = latent_sites(model, args, kwargs)
    names = [n for n, _ in sites]
    values = {n: s["value"].detach().clone().requires_grad_(s["value"].is_floating_point()) for n, s in sites}
    with full_data_plates():
        tr = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
    free = [n for n in names if values[n].requires_grad]
    deps, scales = {}, {}
    for name, site in tr.nodes.items():
        if site["type"] != "sample" or type(site["fn"]).__name__ == "_Subsample":
            continue
        observed = name not in values
        field = not observed and _field_prior(site["fn"])
        if observed:
            attrs = _NOISE_PARAMS  # an observation's noise; its predictor (loc, logits, rate) is the field's
            if _sv_site(site["fn"]):  # Normal(m, exp(eta / 2)): its scale is the predictor
                attrs = ()
        elif field:
            attrs = _SCALE_PARAMS  # a field site's location may read other latents affinely
        else:
            attrs = _PARAMS
        found = set()
        for t in _tensor_params(site["fn"], attrs):
            if t.requires_grad:
                grads = torch.autograd.grad(t.sum(), [values[n] for n in free], retain_graph=True, allow_unused=True)
                found |= {n for n, g in zip(free, grads) if g is not None and bool((g != 0).any())}
        deps[name] = found - {name}
        if field:
            scales[name] = deps[name]
    return sites, deps, scales


def theta_space(model, args, kwargs, names, dtype=torch.float64):
    """The :class:`~pyro_convexvb.posterior.hyper.ThetaSpace` of the hyper-latents ``names`` of ``model``."""
    sites = dict(latent_sites(model, args, kwargs))
    shapes, ushapes, transforms, dtypes, devices = [], [], [], [], []
    for n in names:
        try:
            t = biject_to(sites[n]["fn"].support)
        except NotImplementedError:
            raise UnsupportedModelError(n, f"its support {sites[n]['fn'].support} has no transform to unconstrained "
                                           "coordinates, so it cannot be integrated over as a hyper-latent") from None
        v = sites[n]["value"]
        shapes.append(tuple(v.shape))
        ushapes.append(tuple(t.inv(v).shape))
        transforms.append(t)
        dtypes.append(v.dtype)
        devices.append(v.device)
    space = ThetaSpace(list(names), shapes, ushapes, transforms, dtype, dtypes, devices)
    if space.dim > HYPER_MAX_DIM:
        raise UnsupportedModelError(names[0], f"{space.dim} hyper-latent dimensions ({', '.join(names)}); "
                                              f"integration over them supports at most {HYPER_MAX_DIM}")
    return space


def conditioned_model(model, values):
    """``model`` with the hyper-latents fixed at ``values`` and hidden from traces (a latent Gaussian model)."""
    return poutine.block(poutine.condition(model, data=values), hide=list(values))


class _ThetaLogProb(poutine.messenger.Messenger):
    """Records ``log p(theta)``, the hyper-latents' own prior log densities at their conditioned values."""

    def __init__(self, names, keep_graph=False):
        super().__init__()
        self.names, self.terms, self.keep_graph = set(names), {}, keep_graph

    def _pyro_post_sample(self, msg):
        if msg["name"] in self.names:
            with torch.set_grad_enabled(self.keep_graph and torch.is_grad_enabled()):
                self.terms[msg["name"]] = msg["fn"].log_prob(msg["value"]).sum()


class ConditionedModel:
    """``model`` with the hyper-latents fixed at ``values`` and hidden from traces (as :func:`conditioned_model`),
    as a design point of :class:`HyperObjective` runs it.

    It carries the integration's shared ``extraction_cache`` (the structure trace and the
    :class:`~pyro_convexvb.lgm.template.ExtractionTemplate` of its affine maps), and every run records
    ``log p(theta)`` in :attr:`log_prior` (a float, the sum of the hyper-latents' prior log densities in trace
    order, as :func:`log_prior` computes it), so that a design point needs no run of its own for it.

    :param model: the Pyro model.
    :param dict values: ``{name: value}`` of the hyper-latents (constrained).
    :param dict extraction_cache: shared by the conditioned models of one integration, or ``None``.
    :param bool keep_graph: record ``log p(theta)`` with the autograd graph of ``values`` as well
        (:attr:`log_prior_tensor`, a 0-d tensor), for envelope gradients.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model():
        ...     s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64)))
        ...     return pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), s).to_event(1))
        >>> m = ConditionedModel(model, {"s": torch.tensor(0.5, dtype=torch.float64)})
        >>> list(pyro.poutine.trace(m).get_trace().nodes)  # s is fixed and hidden
        ['_INPUT', 'w', '_RETURN']
        >>> round(m.log_prior, 6)  # log HalfNormal(0.5 | 1)
        -0.350791
    """

    def __init__(self, model, values, extraction_cache=None, keep_graph=False):
        self.model, self.values, self.extraction_cache = model, values, extraction_cache
        self.keep_graph = keep_graph
        self.log_prior, self.log_prior_tensor = None, None

    def __call__(self, *args, **kwargs):
        rec = _ThetaLogProb(self.values, self.keep_graph)
        with poutine.block(hide=list(self.values)), rec, poutine.condition(data=self.values):
            out = self.model(*args, **kwargs)
        complete = len(rec.terms) == len(self.values)
        self.log_prior_tensor = sum(rec.terms[n] for n in self.values) if complete else None
        self.log_prior = float(self.log_prior_tensor.detach()) if complete else None
        return out


def log_prior(model, args, kwargs, values):
    """``log p(theta)``: the hyper-latents' own prior log densities at ``values`` (constrained)."""
    with torch.no_grad(), full_data_plates():
        tr = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
    return float(sum(tr.nodes[n]["fn"].log_prob(tr.nodes[n]["value"]).sum() for n in values))


# ---------------------------------------------------------------------------------------------
# integration designs
# ---------------------------------------------------------------------------------------------
def _fractional_factorial(d):
    """Corners ``{-1, 1}^d`` of a two-level design: the full factorial for ``d <= 4``, else a half (or smaller)
    fraction built from the full factorial of the first ``d - p`` factors, each added factor the product of four of
    them: resolution V for ``d <= 7``, IV for ``d = 8-10`` (the two generators share three factors). Either way
    no two corners' columns or their squares alias, so the central composite design integrates every polynomial of
    degree two exactly, which is what it is used for."""
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
# the outer loop over theta
# ---------------------------------------------------------------------------------------------
class _FitSummary:
    """What a design-point fit leaves behind once its full result is released: the value, whether it converged, the
    bound and the state a nearby fit is warm-started from (``state.warm_start()``: ``alpha`` for ``dual_vg``, the
    widths for ``convex_relaxation``), never the data-sized backend, model or posterior."""

    def __init__(self, res):
        self.converged = bool(res.converged)
        self.log_evidence_bound = res.log_evidence_bound
        self.state = None if res.state is None else res.state.warm_start()


class _PointResult:
    """A design point's fit as the mixture needs it: the posterior, convergence, bound, optimality and report; the
    data-sized model and state are released (``lgm`` and ``state`` are ``None``)."""

    lgm = None
    state = None

    def __init__(self, res):
        self.posterior, self.converged = res.posterior, res.converged
        self.log_evidence_bound, self.optimality = res.log_evidence_bound, res.optimality
        self.stop_reason, self.info = res.stop_reason, res.info


class HyperObjective:
    """``f(z) = log p(theta(z)) + log|d theta/d z| + B(theta(z))``: the engine fitted on the conditioned model.

    Every evaluation is cached; a fit is warm-started from the state at the nearest ``z`` already evaluated (its
    ``state.warm_start()``, passed by ``Engine.inner_engine``). The points asked for with ``keep=True`` (the mode)
    keep their full result, those asked for with ``keep="posterior"`` (the design points) a :class:`_PointResult`
    (posterior, convergence, report), the latest fit its full result until the next one, and every other point a
    :class:`_FitSummary` (value, convergence, warm-start state), so memory does not grow with the number of
    finite-difference evaluations. A point asked for again with more than it kept is fitted again from its own
    state (a few Newton steps at most); its value stays the first one.

    The conditioned models of all points (:class:`ConditionedModel`) share one ``extraction_cache``: the structure
    trace is taken once, and an :class:`~pyro_convexvb.lgm.template.ExtractionTemplate` keeps the affine maps of
    the sites and chains, so each point runs the model once (that run also gives ``log p(theta)``) and updates the
    values that read ``theta``; a map that changed with ``theta`` is extracted afresh, and what each extraction
    reused is summarised by :meth:`extraction_report`. When the engine's warm-start state can reuse the
    data-sized structure of the latest fit (``state.reusing(full_state)``: ``dual_vg``'s sparse latent form keeps
    the site pairs, the fill-reducing ordering and the symbolic factorisations; only the prior's values change
    with ``theta``), it is passed on.

    :param bool reuse_extraction: keep the extraction template (default); ``False`` extracts every point afresh
        (two runs of the model and the design's probes, and one more run for ``log p(theta)``), the reference the
        template is tested against.
    """

    def __init__(self, engine, space, args, kwargs, history=None, bar=None, reuse_extraction=True):
        from ..lgm.template import ExtractionTemplate

        self.engine, self.space, self.args, self.kwargs = engine, space, args, kwargs
        self.history, self.bar = history, bar
        self.cache = {}  # key -> [value, summary, full result, _PointResult or None]
        self.pinned = {}  # key -> "full" or "posterior"
        self._latest = None  # key of the latest fit (its full result is kept until the next one)
        self.reuse_extraction = bool(reuse_extraction)
        self._extraction_cache = {"template": ExtractionTemplate()} if self.reuse_extraction else {}
        self.records = []  # the ExtractionRecord of every inner fit's extraction
        self.fits = 0  # inner fits run (refits of released points included)
        self._log_prior = None  # log p(theta) recorded by the latest inner fit's run of the model
        #: the inner fits' warnings, each distinct one issued once per integration; convergence warnings are left
        #: out: the outer fit counts the unconverged design points and warns once about them
        self._warnings = WarningsOnce(drop=(ConvergenceWarning,))
        #: whether envelope gradients agreed with central differences of fits (``None``: not yet checked, ``False``:
        #: they did not, or the engine has none, and :meth:`gradient` differences fits) and why not
        self.envelope_ok, self.envelope_note = None, None
        self.gradients = {"envelope": 0, "differences": 0}  # gradients taken each way
        self._grad_cache = {"template": ExtractionTemplate()}  # the graph-keeping extractions' own structure

    def gradient(self, z, fd_step):
        """``df/dz`` ``(d,)`` at ``z``: by the envelope theorem when the engine's bound allows it
        (:meth:`~pyro_convexvb.infer.engine.Engine.envelope_bound`: the bound at the fitted state, differentiated
        through a graph-keeping extraction of the model at ``theta(z)``; one extraction and no fit beyond the one
        at ``z``), else by central differences of fits (step ``fd_step``, ``2 d`` fits).

        The first envelope gradient of an integration is checked against a central difference of fits along a
        random direction; when they disagree (a dependence on ``theta`` the extraction's graph does not carry,
        e.g. a design scaled by a hyper-latent, which extraction detaches) every gradient is differenced.
        """
        z = torch.as_tensor(z, dtype=torch.float64).reshape(-1)
        if self.envelope_ok is not False:
            g = self._envelope_gradient(z)
            if g is not None and self.envelope_ok is None:
                self.envelope_ok = self._check_envelope(z, g, fd_step)
            if g is not None and self.envelope_ok:
                self.gradients["envelope"] += 1
                return g
        self.gradients["differences"] += 1
        return _grad_fd(self, z, fd_step)

    def _envelope_gradient(self, z):
        """The envelope gradient at ``z`` (:meth:`gradient`), or ``None`` (then :attr:`envelope_ok` is ``False``)."""
        from ..lgm.extract import lgm_from_pyro

        value, _ = self.fit(z)
        key = tuple(round(float(v), 12) for v in z)
        full = self.cache[key][2]
        if full is None or isinstance(full, _PointResult):  # released: fitted again from its own state
            full = self._run(z, self.space.unpack(z)[0], self.cache[key][1])
        zl = z.clone().requires_grad_(True)
        values, logjac = self.space.unpack(zl, keep_graph=True)
        model = ConditionedModel(self.engine.model, values, self._grad_cache, keep_graph=True)
        try:
            with self._warnings.collect():
                lgm = lgm_from_pyro(model, *self.args, dtype=torch.float64, keep_graph=True, **self.kwargs)
                bound = self.engine.envelope_bound(full, lgm)
            why = None if bound is not None else f"engine '{self.engine.name}' has no envelope form of its bound here"
        except UnsupportedModelError as e:  # e.g. an intrinsic GMRF, whose graph-keeping extraction is refused
            why = f"the graph-keeping extraction was refused: {e}"
        if why is None and model.log_prior_tensor is None:
            why = "the model's run did not record log p(theta)"
        if why is None:
            total = model.log_prior_tensor + logjac + bound
            if abs(float(total.detach()) - value) > 1e-6 * (1.0 + abs(value)):
                why = (f"the bound at the fitted state, {float(total.detach()):.10g}, is not the fit's value "
                       f"{value:.10g}")
        if why is not None:
            self.envelope_ok, self.envelope_note = False, why
            return None
        (g,) = torch.autograd.grad(total, zl, allow_unused=True) if total.requires_grad else (None,)
        return torch.zeros_like(z) if g is None else g.detach().to(torch.float64)

    def _check_envelope(self, z, g, fd_step):
        """Whether the envelope gradient ``g`` at ``z`` agrees with a central difference of fits along a random unit
        direction (step ``fd_step``; two fits), to ``1e-3 (1 + |difference|)``: above the differences' own error
        (the fits' errors over the step, about 1e-4) and far below a missed dependence."""
        gen = torch.Generator().manual_seed(z.shape[0])
        d = torch.randn(z.shape[0], generator=gen, dtype=torch.float64)
        d = d / d.norm()
        fd = (self(z + fd_step * d) - self(z - fd_step * d)) / (2 * fd_step)
        gd = float(g @ d)
        if abs(fd - gd) <= 1e-3 * (1.0 + abs(fd)):
            return True
        self.envelope_note = (f"the envelope gradient along a random direction, {gd:.6g}, disagreed with central "
                              f"differences of fits, {fd:.6g}")
        return False

    def _nearest(self, z):
        if not self.cache:
            return None
        keys = list(self.cache)  # the first of the nearest, in the order the points were fitted
        zz = np.asarray(z.detach().cpu() if torch.is_tensor(z) else z, dtype=np.float64).reshape(-1)
        d = ((np.asarray(keys, dtype=np.float64).reshape(len(keys), -1) - zz) ** 2).sum(1)
        return self.cache[keys[int(np.argmin(d))]][1]

    def _run(self, z, values, warm):
        eng = self.engine
        init = None if warm is None else warm.state
        latest = None if self._latest is None else self.cache[self._latest][2]
        if init is not None and latest is not None and latest.state is not None and hasattr(init, "reusing"):
            init = init.reusing(latest.state)
        model = ConditionedModel(eng.model, values, self._extraction_cache)
        template = self._extraction_cache.get("template")
        if template is not None:
            template.record = None
        inner = eng.inner_engine(model, None if init is None else _WarmFrom(init), learn_params=False)
        inner.extract_dtype = torch.float64  # bounds accurate enough for finite differences over theta
        with self._warnings.collect():
            res = inner.run(*self.args, **self.kwargs)
        self.fits += 1
        self._log_prior = model.log_prior if self.reuse_extraction else None
        if template is not None and template.record is not None:
            self.records.append(template.record)
        if res.log_evidence_bound is None or not math.isfinite(res.log_evidence_bound):
            raise UnsupportedModelError(self.space.names[0], f"engine '{eng.name}' gave no evidence bound at "
                                                             f"theta = {values}; hyper-latents need one")
        return res

    def _slim(self, key):
        """What the entry ``key`` keeps once it is not the latest fit: by its pin level (see the class docstring)."""
        entry, level = self.cache[key], self.pinned.get(key)
        if level == "posterior" and entry[2] is not None and not isinstance(entry[2], _PointResult):
            entry[2] = _PointResult(entry[2])
        elif level is None:
            entry[2] = None

    def _release_latest(self, key):
        """Slim the previous latest fit (:meth:`_slim`); ``key`` becomes the latest."""
        old = self._latest
        self._latest = key
        if old is not None and old != key:
            self._slim(old)

    def _pin(self, key, keep):
        if keep is True or keep == "full":
            self.pinned[key] = "full"
        elif keep == "posterior" and self.pinned.get(key) != "full":
            self.pinned[key] = "posterior"

    def fit(self, z, keep=False):
        """``(f(z), engine result)``; cached. ``keep=True``: the full result is kept; ``keep="posterior"``: at least
        a :class:`_PointResult`; either is refitted from the point's own state if it had been released. Otherwise
        the result may be a :class:`_FitSummary`."""
        z = torch.as_tensor(z, dtype=torch.float64).reshape(-1)
        key = tuple(round(float(v), 12) for v in z)
        entry = self.cache.get(key)
        if entry is not None:
            if keep:
                self._pin(key, keep)
                kept = entry[2]
                if kept is None or (self.pinned[key] == "full" and isinstance(kept, _PointResult)):
                    values, _ = self.space.unpack(z)
                    entry[2] = self._run(z, values, entry[1])
                    self._release_latest(key)
            return entry[0], entry[2] if entry[2] is not None else entry[1]
        values, logjac = self.space.unpack(z)
        res = self._run(z, values, self._nearest(z))
        lp = self._log_prior  # recorded by the fit's own run of the model
        if lp is None:
            lp = log_prior(self.engine.model, self.args, self.kwargs, values)
        value = lp + logjac + float(res.log_evidence_bound)
        self.cache[key] = [value, _FitSummary(res), res]
        if keep:
            self._pin(key, keep)
        self._release_latest(key)
        if self.history is not None:
            self.history.record(objective=value, converged=float(res.converged))
        if self.bar is not None:
            self.bar.update(1)
        return value, res

    def __call__(self, z):
        return self.fit(z)[0]

    def extraction_report(self):
        """What the design points' extractions took from the template (plain values, kept in ``res.hyper``).

        ``extractions`` (inner fits), ``reused`` (extractions that took every affine map from the template),
        ``re_extracted`` (component -> how many extractions extracted its map afresh although the template had
        one) with the ``reasons``, ``structure_changes`` (extractions whose latent structure differed from the
        template's, which was then dropped) and a one-line ``summary``.
        """
        if not self.reuse_extraction:
            return {"extractions": self.fits, "reused": 0, "re_extracted": {}, "reasons": {}, "structure_changes": 0,
                    "summary": "every design point extracted afresh (reuse_extraction=False)"}
        counts, reasons, structure, first_structure = {}, {}, 0, None
        for rec in self.records:
            for name, why in rec.changed.items():
                counts[name] = counts.get(name, 0) + 1
                reasons.setdefault(name, why)
            if rec.structure is not None:
                structure += 1
                first_structure = first_structure or rec.structure
        reused = sum(rec.complete for rec in self.records)
        parts = [f"{reused} of {len(self.records)} design-point extractions reused every affine map"]
        if counts:
            parts.append("extracted afresh: " + "; ".join(f"{n} at {c} (because {reasons[n]})"
                                                          for n, c in counts.items()))
        if structure:
            parts.append(f"the model's structure changed with the hyper-latents at {structure} point"
                         f"{'s' if structure > 1 else ''} ({first_structure}): extracted afresh there")
        return {"extractions": len(self.records), "reused": reused, "re_extracted": counts, "reasons": reasons,
                "structure_changes": structure, "structure_reason": first_structure, "summary": "; ".join(parts)}

    def release_extraction(self):
        """Drop the shared extraction cache (structure trace and template): the design points' posteriors keep
        their conditioned models, which would otherwise keep it alive."""
        self._extraction_cache.clear()


class FieldRefit:
    """The field fitted afresh at further hyper-latent values once an integration is done (for checks of the mixture
    away from its design points, :mod:`~pyro_convexvb.diagnostics.field_check`): ``refit(z) -> (f(z), posterior,
    converged)``, ``f`` the integration's objective, by a :class:`HyperObjective` of the same engine, kept until
    :meth:`release`. A pickled or copied one has no engine and refuses to refit."""

    def __init__(self, engine, space, args, kwargs):
        self.engine, self.space, self.args, self.kwargs = engine, space, args, kwargs
        self._obj = self._grid = None

    @property
    def available(self):
        return self.engine is not None

    def __call__(self, z):
        if self.engine is None:
            raise RuntimeError("this hyper-latent posterior was pickled or copied without its engine and data: refit "
                               "the model to check its field away from the design points")
        if self._obj is None:
            self._obj = HyperObjective(self.engine, self.space, self.args, self.kwargs)
        value, res = self._obj.fit(torch.as_tensor(z, dtype=torch.float64), keep="posterior")
        return value, res.posterior, bool(res.converged)

    def on_grid(self, progress=False):
        """The whole fit again with the hyper-latents integrated on a grid grown on to the prior's quantiles it
        leaves out (``hyper_strategy="grid"``, ``hyper_probe=True``), every other option as the caller gave it: an
        :class:`~pyro_convexvb.InferenceResult`, fitted once and kept."""
        if self.engine is None:
            raise RuntimeError("this hyper-latent posterior was pickled or copied without its engine and data: fit "
                               "the model with options={'hyper_strategy': 'grid', 'hyper_probe': True}")
        if self._grid is None:
            e = self.engine
            options = {name: getattr(e.options, name) for name in e.given_options}
            options.update(hyper_strategy="grid", hyper_probe=True)
            self._grid = type(e)(e.model, progress=progress, **options).run(*self.args, **self.kwargs)
        return self._grid

    @property
    def probed(self):
        """Whether the fit already grew its grid on to the prior's quantiles (``hyper_probe=True``)."""
        return self.engine is not None and bool(getattr(self.engine.options, "hyper_probe", False))

    def release(self):
        """Drop the refits and their extraction cache."""
        if self._obj is not None:
            self._obj.release_extraction()
        self._obj = None

    def __getstate__(self):
        return {"engine": None, "space": self.space, "args": (), "kwargs": {}, "_obj": None, "_grid": None}

    def __deepcopy__(self, memo):
        new = FieldRefit(None, self.space, (), {})
        memo[id(self)] = new
        return new


def _initial_z(model, args, kwargs, space, num=51, seed=0):
    """The coordinatewise prior median of the hyper-latents, on the unconstrained scale."""
    zs = []
    with torch.no_grad(), full_data_plates(), forked_rng(seed):  # a fixed start, whatever the run's seed
        for _ in range(num):
            tr = poutine.trace(model).get_trace(*args, **kwargs)
            zs.append(space.pack({n: tr.nodes[n]["value"] for n in space.names}))
    return torch.stack(zs).median(0).values


#: the prior's quantiles of each hyper-latent at which the objective is probed beyond a design (:func:`probe_points`)
PROBE_LEVELS = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
#: prior draws per hyper-latent for those quantiles
PROBE_PRIOR_DRAWS = 4000


def prior_draws(model, args, kwargs, space, num=PROBE_PRIOR_DRAWS, seed=0):
    """``(num, d)`` the hyper-latents' unconstrained prior draws (each from its own prior in one trace of the model;
    a prior that reads another hyper-latent takes that trace's value)."""
    with forked_rng(seed), torch.no_grad(), full_data_plates():
        tr = poutine.trace(model).get_trace(*args, **kwargs)
        cols = []
        for name, t, size in zip(space.names, space.transforms, space.sizes):
            v = tr.nodes[name]["fn"].sample((num,))
            cols.append(t.inv(v).reshape(num, size).double().cpu())
    return torch.cat(cols, 1)


def probe_points(model, args, kwargs, space, z_design, centre, seed=0):
    """``(P, d)`` unconstrained points where a design's reach is probed: the prior's :data:`PROBE_LEVELS` quantiles of
    each coordinate that lie outside the range of the design's points ``z_design`` ``(K, d)`` along that axis, the
    other coordinates at ``centre`` ``(d,)``."""
    draws = prior_draws(model, args, kwargs, space, seed=seed)
    levels = torch.tensor(PROBE_LEVELS, dtype=torch.float64)
    z_design, centre = z_design.double().cpu(), centre.double().cpu()
    lo, hi = z_design.min(0).values, z_design.max(0).values
    probes = []
    for j in range(space.dim):
        for q in torch.quantile(draws[:, j], levels).tolist():
            if lo[j] - 1e-9 <= q <= hi[j] + 1e-9:
                continue  # inside the design's range along this axis
            z = centre.clone()
            z[j] = q
            probes.append(z)
    return torch.stack(probes) if probes else torch.zeros(0, space.dim, dtype=torch.float64)


def probe_drops(probes, top, fit):
    """``(P,)`` the objective's drops ``top - f(z)`` (nats) at the probes ``(P, d)``, ``fit(z) -> (f(z), converged)``;
    NaN where the fit did not converge or failed (a fit far out may): that probe is not judged."""
    drops = []
    for z in probes:
        try:
            value, converged = fit(z)
            drops.append(top - float(value) if converged else math.nan)
        except (ConvergenceError, NotPositiveDefiniteError, UnsupportedModelError):
            drops.append(math.nan)
    return torch.tensor(drops, dtype=torch.float64)


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


def find_mode(obj, z0, *, max_iter=100, gtol=1e-4, fd_step=1e-3, bound=12.0, hess_step=2e-2, newton_steps=3,
              grad=None):
    """Maximise ``obj`` (a :class:`HyperObjective`) over ``z`` by L-BFGS-B with the gradients ``grad(z)`` (default:
    central differences of ``obj``, step ``fd_step``; :meth:`HyperObjective.gradient` gives envelope gradients
    where the engine allows), then Newton steps on the central-difference Hessian while ``max |grad| > gtol``.

    The Newton steps are needed because every value of ``obj`` is an inner fit stopped at its own tolerance
    and warm-started from the nearest point fitted before: its error (about 1e-7 to 1e-6 nats) depends on
    that starting point. L-BFGS-B's line search compares values at different points, and near the mode,
    where a step gains only about ``|g|^2 / H``, that error decides it: the search fails ("ABNORMAL") with
    ``|g|`` above ``gtol``. A gradient or Hessian stencil is fitted from its own centre, so its differences
    cancel the error, and an envelope gradient reads no difference of values at all; Newton steps use only
    those and reach ``gtol``.

    :param float hess_step: step of the central-difference Hessian of the Newton steps.
    :param int newton_steps: most Newton steps after L-BFGS-B (each stops early when it does not reduce
        ``max |grad|``).
    :returns: ``(z*, f(z*), scipy result)``; ``z`` stays within ``z0 +- bound``.
    """
    import numpy as np
    import scipy.optimize

    # L-BFGS-B's first step on a boxed problem is the whole gradient (step length one): with |grad| ~ 80 at
    # the prior median of a 3000-group scale it jumped to the box's edge (sigma ~ 1e5), where one inner fit took
    # minutes. The objective is divided by |grad f(z0)|, so the first step has length one in z; the iterates that
    # follow are those of L-BFGS-B on f (its curvature pairs scale with f), and its gradient tolerance is scaled back.
    if grad is None:
        def grad(z):
            return _grad_fd(obj, z, fd_step)
    z0 = z0.to(torch.float64)
    scale = max(1.0, float(grad(z0).norm()))

    def fun(x):
        z = torch.as_tensor(x, dtype=torch.float64)
        v = obj(z)
        g = grad(z)
        return -v / scale, -g.numpy() / scale

    x0 = z0.numpy().astype(np.float64)
    res = scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B",
                                  bounds=[(v - bound, v + bound) for v in x0],
                                  options=dict(maxiter=max_iter, gtol=gtol / scale, ftol=1e-12))
    z = torch.as_tensor(res.x, dtype=torch.float64)
    lo, hi = z0.to(torch.float64) - bound, z0.to(torch.float64) + bound
    g = grad(z)
    for _ in range(newton_steps):
        if float(g.abs().max()) <= gtol:
            break
        H = -_hessian_fd(obj, z, hess_step)
        try:
            L = torch.linalg.cholesky(0.5 * (H + H.T))
        except torch.linalg.LinAlgError:
            break  # not locally concave: no Newton step (the caller reports the gradient)
        z_new = torch.minimum(torch.maximum(z + torch.cholesky_solve(g.reshape(-1, 1), L).reshape(-1), lo), hi)
        g_new = grad(z_new)
        if float(g_new.abs().max()) >= float(g.abs().max()):
            break
        z, g = z_new, g_new
    return z, obj(z), res


def _segment_distance(points, targets):
    """``(P, T)`` Euclidean distance of each point ``(P, d)`` to each segment from the origin to a target ``(T, d)``."""
    t2 = (targets**2).sum(1).clamp_min(1e-300)
    s = ((points @ targets.T) / t2).clamp(0.0, 1.0)  # (P, T): each point's projection on each segment
    return (points[:, None, :] - s[..., None] * targets[None]).norm(dim=-1)


def _widen_grid(x, logf, evaluate, d, step, radius, max_radius, prune, warp, targets=None):
    """Widen the grid ring by ring while its rim still carries mass (log density within ``prune`` of the top),
    adding points only next to rim points that still do; ``evaluate(points)`` appends their values to ``logf``.
    The design ``x``, ``step`` and ``radius`` are in the lattice coordinates of ``warp`` (:class:`GridWarp`);
    ``max_radius`` in standardised units. With ``targets`` ``(T, d)`` (lattice coordinates), each ring also takes
    the points next to the segment from the origin to a target it has not passed: a corridor through a valley to
    another mode, around which the rim rule then grows the grid.

    :returns: ``(x, radius, truncated, unreached)``: the grown design, its radius, whether ``max_radius`` stopped it
        while its rim still carried mass, and how many targets lie beyond it.
    """
    targets = torch.zeros(0, d, dtype=torch.float64) if targets is None else targets
    far = targets.norm(dim=1) if targets.shape[0] else torch.zeros(0, dtype=torch.float64)
    while float(warp.to_x(torch.tensor(radius, dtype=torch.float64))) < max_radius:
        lf = torch.tensor(logf, dtype=torch.float64)
        rim = (x**2).sum(1).sqrt() > radius - step
        pending = targets[far > radius - step]
        if not bool((lf[rim] >= lf.max() - prune).any()) and not pending.shape[0]:
            break
        wider, _ = design_points(d, "grid", step=step, radius=radius + step)
        ring = wider[(wider**2).sum(1).sqrt() > radius + 1e-9]
        alive = x[rim & (lf >= lf.max() - prune)]
        near = torch.zeros(ring.shape[0], dtype=torch.bool)
        if alive.shape[0]:
            near |= torch.cdist(ring, alive).min(1).values <= 1.5 * step + 1e-9
        if pending.shape[0]:
            near |= _segment_distance(ring, pending).min(1).values <= 1.5 * step + 1e-9
        ring = ring[near]
        evaluate(ring)
        x = torch.cat([x, ring])
        radius += step
    else:
        lf = torch.tensor(logf, dtype=torch.float64)
        return (x, radius, bool((lf[(x**2).sum(1).sqrt() > radius - step] >= lf.max() - prune).any()),
                int((far > radius - step).sum()))
    return x, radius, False, 0


def _reach_probes(obj, z_mode, A_inv, zs, logf, prune, seed=0):
    """Probe the objective at the prior's quantiles outside the grid (:func:`probe_points`, the others at the mode):
    ``(targets, report)``, the standardised coordinates ``(T, d)`` of the probes within ``prune`` of the grid's top
    (mass the grid leaves out: beyond a rim that fell by ``prune``, another mode) and a plain report (``probes``,
    ``drops`` in nats below the top, NaN where a fit failed, ``targets``)."""
    e = obj.engine
    probes = probe_points(e.model, obj.args, obj.kwargs, obj.space, torch.stack(zs), z_mode, seed=seed)

    def fit(z):
        value, res = obj.fit(z)
        return value, res.converged

    drops = probe_drops(probes, max(logf), fit)
    flagged = drops < prune  # NaN compares False: a failed probe is not a target
    A = torch.linalg.inv(A_inv)
    targets = (probes[flagged] - z_mode) @ A.T if bool(flagged.any()) else torch.zeros(0, z_mode.shape[0])
    report = {"probes": probes.tolist(), "drops": drops.tolist(), "targets": int(flagged.sum())}
    return targets.to(torch.float64), report


def _design_weights(strategy, x, a, logf, prune, log_volume=None):
    """Normalised weights of the design points: the density values times the cells' volumes ``exp(log_volume)`` on
    a grid (pruned ``prune`` below the top), the CCD weights ``a`` times the density over the standard normal
    elsewhere.

    :returns: ``(keep, w, idx)``: the kept points, the weights of the points with positive weight, their indices.
    """
    if strategy == "grid":
        logw = logf if log_volume is None else logf + log_volume
    else:
        logw = torch.log(a) + logf + 0.5 * (x**2).sum(1)
    keep = logf >= logf.max() - prune if strategy == "grid" else torch.ones_like(logf, dtype=torch.bool)
    logw = torch.where(keep, logw, torch.full_like(logw, -math.inf))
    w = torch.softmax(logw, 0)
    idx = [k for k in range(len(logf)) if float(w[k]) > 0]
    return keep, w[idx] / w[idx].sum(), idx


def _check_axial_drops(space, z_mode, A_inv, x, logf):
    """Refuse a central composite design whose axial point ``k`` (``x[k]``, ``k = 1 .. 2d``) has a log density
    ``logf[k]`` not below the mode's ``logf[0]``: the split normal's scale there, ``r / sqrt(2 drop)``, would be
    infinite or imaginary (a second mode along that direction, or a density too flat for the design)."""
    d = x.shape[1]
    drops = logf[0] - logf[1:1 + 2 * d]
    k = int(torch.argmin(drops))
    if float(drops[k]) > 0:
        return
    theta = space.unpack(z_mode + A_inv @ x[1 + k])[0]
    vals = {n: [float(f"{float(a):.4g}") for a in torch.as_tensor(v).reshape(-1)] for n, v in theta.items()}
    at = ", ".join(f"{n}={v[0] if len(v) == 1 else v}" for n, v in vals.items())
    raise UnsupportedModelError(
        ", ".join(space.names),
        f"the log hyper-posterior at the central composite design's axial point {at} is {-float(drops[k]):.3g} nats "
        "above its value at the mode, so the mode found is not its maximum along that direction (a second mode, or "
        "a surface too flat for the design) and the asymmetric Gaussian through the axial points does not exist; "
        "integrate fewer hyper-latents (hyper_strategy='grid' handles up to 3), fix the others, or sample with "
        "engine='nuts'")


#: the most hyper-latent dimensions ``hyper_strategy="grid"`` integrates over (``"auto"`` takes a grid up to 2)
GRID_MAX_DIM = 3


def _warn_split_normal(space):
    """Say that the hyper-latents' marginals of a central composite design are the asymmetric Gaussian's."""
    warn(f"hyper-latents {', '.join(repr(n) for n in space.names)} ({space.dim} unconstrained dimensions) were "
         "integrated with a central composite design: their marginals (res.hyper['marginals'] and the guide's draws "
         "of them) are an asymmetric Gaussian through the design's axial points (Rue, Martino & Chopin 2009, "
         "section 6.5), coarse for a skewed hyper-posterior (a scale's quantiles 12-19% off exact quadrature on a "
         "3-scale Gaussian model, a 5% quantile of a scale reaching toward zero up to five times too high). "
         + ("For accurate hyper-latent marginals integrate on a grid, options={'hyper_strategy': 'grid'} (1,000-2,200 "
            "fits, 5-20 s on 3-scale models with up to 200 rows; within 3% of exact quadrature on such models), or use "
            "res.corrected(), which refits on that grid when the design's own correction is unreliable"
            if space.dim <= GRID_MAX_DIM else
            "For accurate hyper-latent marginals use res.corrected() (importance sampling through the model) and "
            "check its diagnostics"), UserWarning)


def integrate_hyper(engine, hyper_names, args, kwargs, *, strategy="auto", fd_step=1e-3, hess_step=2e-2,
                    grid_step=0.75, grid_radius=3.0, grid_growth=None, max_radius=40.0, prune=7.0, f0=1.1,
                    run=None, reuse_extraction=None, probe=False):
    """INLA-style integration (or maximisation) over the hyper-latents ``hyper_names`` (see the module docstring).

    Over 80 lines: most of it is this docstring; the body is under 80.

    The grid grows ring by ring, next to rim points whose log density is within ``prune`` of the top, up to
    ``max_radius`` standardised units. The cap is far: a scale whose posterior reaches toward zero (a half-normal
    or half-Cauchy prior on a weakly identified scale) has a log density linear in ``log sigma`` there, so it drops
    by ``prune`` only some ``prune / slope`` Hessian units from the mode (about 25 in a BYM model). Past
    ``grid_radius`` the spacing grows by ``grid_growth`` per ring (:class:`GridWarp`; the cells' volumes weight the
    design points), so such a tail takes a dozen rings, not thirty. A grid stopped by the cap while its rim still
    carries mass is reported (``info["truncated"]``), and the fit is then not converged.

    :param engine: the outer :class:`~pyro_convexvb.infer.engine.Engine` (its class fits each conditioned model).
    :param str strategy: ``"grid"``, ``"ccd"``, ``"auto"`` (grid for ``d <= 2``) or ``"map"`` (the mode only).
    :param reuse_extraction: build each design point's latent Gaussian model from the first extraction's affine
        maps (:class:`HyperObjective`); ``None`` takes :data:`REUSE_EXTRACTION`.
    :param bool probe: (grid only) once grown, fit the field at the prior's quantiles of each hyper-latent outside
        the grid (:func:`probe_points`, the others at the mode); where one is within ``prune`` of its top (beyond a
        rim that fell by ``prune``: another mode), grow the grid again, its spacing uniform out to the farthest such
        probe plus ``grid_radius``, through the valley to them (``_widen_grid``'s targets) and on by the rim rule;
        ``info["reach"]`` says what was found.
    :returns: ``(posterior, mode result, info)``: a :class:`HyperPosterior` (``None`` for ``"map"``), the
        engine's result at the mode, and a dict with the mode, Hessian, points, weights, evaluations and the
        extraction report (:meth:`HyperObjective.extraction_report`).
    """
    if reuse_extraction is None:
        reuse_extraction = REUSE_EXTRACTION
    model = engine.model
    space = theta_space(model, args, kwargs, hyper_names)
    if probe and strategy not in ("grid", "auto"):
        raise ValueError(f"hyper_probe=True grows a grid design on to the prior's quantiles it leaves out, and "
                         f"hyper_strategy={strategy!r} has no grid; use hyper_strategy='grid' (up to {GRID_MAX_DIM} "
                         "hyper-latent dimensions) or drop hyper_probe")
    if strategy == "grid" and space.dim > GRID_MAX_DIM:
        raise ValueError(f"hyper_strategy='grid': a grid integrates over at most {GRID_MAX_DIM} hyper-latent "
                         f"dimensions (about 1,000-2,200 fits in 3), and {', '.join(repr(n) for n in space.names)} "
                         f"have {space.dim}; use 'ccd' (or 'auto', which chooses it above 2) or hyper='map'")
    field_dtypes = [s["value"].dtype for n, s in latent_sites(model, args, kwargs)
                    if n not in hyper_names and s["value"].is_floating_point()]
    out_dtype = field_dtypes[0] if field_dtypes else None  # the model's own dtype, reported back
    bar = run.bar(unit="fit", desc=f"{engine.name} (hyper)") if run is not None else None
    obj = HyperObjective(engine, space, args, kwargs, history=None if run is None else run.history, bar=bar,
                         reuse_extraction=reuse_extraction)
    z0 = _initial_z(model, args, kwargs, space)
    gtol = 1e-3
    z_mode, f_mode, opt = find_mode(obj, z0, fd_step=fd_step, gtol=gtol, hess_step=hess_step,
                                    grad=lambda z: obj.gradient(z, fd_step))
    mode_res = obj.fit(z_mode, keep=True)[1]
    # the reported optimality measure by differences of fits, independent of the envelope gradients that drove the
    # search (a dependence on theta that a graph-keeping extraction missed would otherwise certify its own mode)
    g_mode = _grad_fd(obj, z_mode, fd_step)
    gnorm = float(g_mode.abs().max())
    info = {"mode_z": z_mode, "mode_theta": space.unpack(z_mode)[0], "log_post_mode": f_mode,
            "mode_grad_norm": gnorm, "mode_gtol": gtol, "mode_message": str(opt.message), "space": space,
            "gradients": dict(obj.gradients, envelope_ok=obj.envelope_ok, envelope_note=obj.envelope_note)}
    if strategy == "map":
        info.update(evaluations=len(obj.cache), fits=obj.fits, extraction=obj.extraction_report())
        obj.release_extraction()
        post = HyperPosterior(space, z_mode.reshape(1, -1), torch.ones(1, dtype=torch.float64),
                              [mode_res.posterior], torch.tensor([f_mode], dtype=torch.float64),
                              ThetaDensity.point(z_mode), torch.zeros(1, space.dim, dtype=torch.float64), z_mode,
                              None, layout=mode_res.posterior.layout, out_dtype=out_dtype)
        return post, mode_res, info
    H = -_hessian_fd(obj, z_mode, hess_step)
    H = 0.5 * (H + H.T)
    evals, evecs = torch.linalg.eigh(H)
    if not bool((evals > 0).all()):
        if not mode_res.converged:
            raise ConvergenceError(f"hyper-latent integration: the fit of the latent field at the mode of "
                                   f"{space.names} did not converge ({mode_res.optimality}), so the curvature of the "
                                   f"hyper-posterior bound there means nothing (Hessian eigenvalues "
                                   f"{evals.tolist()}); tighten the priors or standardise the covariates, or use "
                                   "engine='laplace' or 'nuts'")
        raise UnsupportedModelError(space.names[0], "the hyper-posterior bound is not locally concave at its mode "
                                                    f"(Hessian eigenvalues {evals.tolist()}); integration needs a mode")
    A_inv = evecs @ torch.diag(evals.rsqrt())  # z = z* + A_inv x
    # the gradient in the standardised coordinates: the Newton step to the mode in posterior sds (a data set that
    # pins the hyper-latents down makes |df/dz| large for a tiny distance, and its differences noisy)
    info["mode_step_sd"] = float((A_inv.T @ g_mode).abs().max())
    d = space.dim
    if strategy == "auto":
        strategy = "grid" if d <= 2 or (probe and d <= GRID_MAX_DIM) else "ccd"
    if probe and strategy != "grid":
        raise ValueError(f"hyper_probe=True grows a grid design, which integrates over at most {GRID_MAX_DIM} "
                         f"hyper-latent dimensions, and {', '.join(repr(n) for n in space.names)} have {d}; drop "
                         "hyper_probe (res.diagnostics and res.corrected() weigh the central composite design's draws)")
    x, a = design_points(d, strategy, step=grid_step, radius=grid_radius, f0=f0)
    zs, logf, results = [], [], []

    growth = GRID_GROWTH if grid_growth is None else grid_growth
    warp = GridWarp(core=grid_radius, step=grid_step, growth=growth) if strategy == "grid" else GridWarp()

    def evaluate(points):  # lattice coordinates of the warp
        for k in range(points.shape[0]):
            z = z_mode + A_inv @ warp.to_x(points[k])
            val, res = obj.fit(z, keep="posterior")
            zs.append(z)
            logf.append(val)
            results.append(res if res is mode_res or isinstance(res, _PointResult) else _PointResult(res))

    evaluate(x)
    radius = grid_radius
    truncated = False
    log_volume = None
    if strategy == "grid":
        xi, radius, truncated, _ = _widen_grid(x, logf, evaluate, d, grid_step, radius, max_radius, prune, warp)
        if probe:
            targets, info["reach"] = _reach_probes(obj, z_mode, A_inv, zs, logf, prune)
            if targets.shape[0]:  # the grid again, uniform out to past the targets (refits only where it is new)
                core = grid_step * math.ceil((float(targets.abs().max()) + grid_radius) / grid_step)
                warp = GridWarp(core=core, step=grid_step, growth=growth)
                del zs[:], logf[:], results[:]
                evaluate(x)
                xi, radius, truncated, info["reach"]["unreached"] = _widen_grid(
                    x, logf, evaluate, d, grid_step, grid_radius, max_radius, prune, warp, warp.to_xi(targets))
        x, log_volume = warp.to_x(xi), warp.log_jacobian(xi)
        a = torch.exp(-0.5 * (x**2).sum(1))
    logf = torch.tensor(logf, dtype=torch.float64)
    keep, w, idx = _design_weights(strategy, x, a, logf, prune, log_volume)
    if strategy == "grid":
        density = ThetaDensity.surface(z_mode, A_inv, x, logf, radius, grid_step, warp=warp)
        radius = float(warp.to_x(torch.tensor(radius, dtype=torch.float64)))
    else:
        _check_axial_drops(space, z_mode, A_inv, x, logf)
        density = ThetaDensity.split_normal(z_mode, A_inv, x, logf)
        _warn_split_normal(space)
    post = HyperPosterior(space, torch.stack([zs[k] for k in idx]), w, [results[k].posterior for k in idx],
                          logf[idx], density, x[idx], z_mode, H, layout=mode_res.posterior.layout,
                          out_dtype=out_dtype, refit=FieldRefit(engine, space, args, kwargs))
    info.update(strategy=strategy, radius=radius, truncated=truncated, evaluations=len(obj.cache), fits=obj.fits,
                extraction=obj.extraction_report(),
                hessian=H,
                design_x=x[idx],
                design_a=a[idx],
                results=[results[k] for k in idx])
    obj.release_extraction()
    return post, mode_res, info
