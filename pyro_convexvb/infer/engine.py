r"""The engine contract: one base class owns the plumbing that every inference engine shares.

In the style of Pyro's autoguides (a base class owns the wiring, each guide overrides a few hooks),
:class:`Engine` owns

* model → latent Gaussian model extraction (:func:`~pyro_convexvb.lgm_from_pyro`) and the
  :meth:`Engine.applies` check, with an :class:`~pyro_convexvb.UnsupportedModelError` that names the
  site;
* option validation: every engine declares one typed options dataclass (a subclass of
  :class:`EngineOptions`); unknown options raise :class:`TypeError`, ill-typed ones
  :class:`TypeError`, out-of-range ones :class:`ValueError`, each naming the option;
* progress bars (:meth:`RunContext.bar`: tqdm when ``progress=True``, nothing otherwise);
* the :class:`~pyro_convexvb.infer.result.History`, ``stop_reason``, ``converged`` (true only when the
  engine's :class:`Optimality` measure is within its tolerance), the single
  :class:`~pyro_convexvb.ConvergenceWarning` of an unconverged fit (or a
  :class:`~pyro_convexvb.ConvergenceError` with ``on_fail="raise"``), result assembly and the wiring
  of the posterior to the model (layout, model, arguments).

An engine overrides only :meth:`Engine.solve`, which receives the latent Gaussian model (or, for
engines that run on the Pyro model itself, a :class:`ModelCall`) and a :class:`RunContext`, and returns
a :class:`Solution`.

Example (a complete engine for linear-Gaussian models)::

    >>> import math, torch
    >>> from dataclasses import dataclass
    >>> import pyro_convexvb as pcv
    >>> @dataclass(frozen=True)
    ... class ExactOptions(pcv.EngineOptions):
    ...     jitter: float = pcv.option(0.0, "added to the precision diagonal", min=0.0)
    >>> class ExactGaussian(pcv.Engine):
    ...     name = "exact_gaussian_doc"
    ...     description = "closed-form posterior of linear-Gaussian models"
    ...     Options = ExactOptions
    ...     optimality_measure = "none needed: closed form"
    ...     def solve(self, lgm, run):
    ...         (g,) = lgm.sites
    ...         A = g.design.to_dense(); s2 = g.family.params["scale"] ** 2
    ...         P = lgm.dense_prior_prec() + A.T @ (A / s2[:, None])
    ...         cov = torch.linalg.inv(P + self.options.jitter * torch.eye(lgm.n, dtype=P.dtype))
    ...         loc = cov @ (A.T @ ((g.family.params["y"] - g.offset) / s2))
    ...         return pcv.Solution(pcv.GaussianPosterior(loc, covariance=cov),
    ...                             float(lgm.evidence_lower_bound(loc, cov)),
    ...                             pcv.Optimality.exact(), "closed form")
    >>> X = torch.randn(20, 2, dtype=torch.float64)
    >>> lgm = pcv.LatentGaussianModel.from_design(X, pcv.lgm.sites.Gaussian(X @ torch.ones(2, dtype=torch.float64),
    ...                                                                      torch.ones(20, dtype=torch.float64)))
    >>> res = ExactGaussian(lgm, progress=False).run()
    >>> res.converged, res.stop_reason
    (True, 'closed form')
"""
import contextlib
import dataclasses
import difflib
import math
import time
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Optional, Tuple

from ..errors import ConvergenceError, UnsupportedModelError, warn
from .result import History, InferenceResult

__all__ = [
    "Engine",
    "EngineOptions",
    "option",
    "Criterion",
    "Optimality",
    "Solution",
    "RunContext",
    "ModelCall",
    "options_table",
    "LGMEngineOptions",
    "forked_rng",
    "draw_seed",
]


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------
def option(default, doc, *, min=None, gt=None, max=None, choices=None):
    """A field of an :class:`EngineOptions` dataclass with its documentation and range.

    :param default: default value (immutable, or ``None``).
    :param str doc: one line for the docs' option table.
    :param min: smallest allowed value (inclusive), for numbers.
    :param gt: exclusive lower bound, for numbers.
    :param max: largest allowed value (inclusive), for numbers.
    :param choices: allowed values (for strings; ``typing.Literal`` annotations give them too).
    """
    return field(default=default, metadata=dict(doc=doc, min=min, gt=gt, max=max, choices=choices))


def _type_name(hint):
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if hint is Any:
        return "any value"
    return getattr(hint, "__name__", str(hint))


def _literal_values(hint):
    """The allowed values of a ``Literal`` (or ``Optional[Literal]``) annotation, else ``[]``."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return list(typing.get_args(hint))
    if origin is typing.Union:
        return [v for a in typing.get_args(hint) for v in _literal_values(a)]
    return []


def _matches(value, hint):
    """Whether ``value`` has the annotated type (bool is not an int/float; int is a float)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(hint))
    if origin is typing.Union:
        return any(_matches(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    if hint is Callable or origin is Callable:
        return callable(value)
    return isinstance(value, hint)


@dataclass(frozen=True)
class EngineOptions:
    """Base class of every engine's options: a frozen dataclass validated once, at construction.

    Subclasses declare their fields with :func:`option` and type annotations (``int``, ``float``,
    ``bool``, ``str``, ``typing.Literal[...]``, ``Optional[...]``, ``Any``). :meth:`create` rejects
    unknown names; ``__post_init__`` checks types and ranges. Override :meth:`check` for checks that
    involve several options.

    :ivar on_fail: what an unconverged fit does: ``"warn"`` (one
        :class:`~pyro_convexvb.ConvergenceWarning` with the optimality measure) or ``"raise"``
        (:class:`~pyro_convexvb.ConvergenceError`).
    """

    on_fail: typing.Literal["warn", "raise"] = option(
        "warn", "unconverged fits warn once (ConvergenceWarning) or raise (ConvergenceError)")

    @classmethod
    def create(cls, engine, options):
        """Validated options of engine ``engine`` from a dict; unknown names raise :class:`TypeError`."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise TypeError(f"engine '{engine}': unknown option '{key}'{hint}; its options are: "
                                f"{', '.join(sorted(names))}")
        try:
            return cls(**options)
        except (TypeError, ValueError) as e:
            raise type(e)(f"engine '{engine}': {e}") from None

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            hint = hints.get(f.name, Any)
            if not _matches(value, hint):
                allowed = _literal_values(hint)
                if allowed and isinstance(value, str):
                    raise ValueError(f"option '{f.name}' must be one of {allowed}, got {value!r}")
                raise TypeError(f"option '{f.name}' expects {_type_name(hint)}, got {value!r} "
                                f"({type(value).__name__})")
            meta = f.metadata
            if meta.get("choices") is not None and value not in meta["choices"]:
                raise ValueError(f"option '{f.name}' must be one of {list(meta['choices'])}, got {value!r}")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"option '{f.name}' must be a finite number, got {value!r}")
                if meta.get("min") is not None and value < meta["min"]:
                    raise ValueError(f"option '{f.name}' must be >= {meta['min']}, got {value!r}")
                if meta.get("gt") is not None and not value > meta["gt"]:
                    raise ValueError(f"option '{f.name}' must be > {meta['gt']}, got {value!r}")
                if meta.get("max") is not None and value > meta["max"]:
                    raise ValueError(f"option '{f.name}' must be <= {meta['max']}, got {value!r}")
        self.check()

    def check(self):
        """Checks that involve several options (override; raise ``ValueError`` naming the options)."""

    def replace(self, **changes):
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def as_dict(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class LGMEngineOptions(EngineOptions):
    """Options shared by the engines that fit latent Gaussian models with an evidence bound.

    :ivar hyper: what to do with hyper-latents (non-Gaussian latent sites feeding the Gaussian part, see
        :mod:`~pyro_convexvb.infer.hyper`): integrate over them (INLA-style), or keep only their mode.
    :ivar hyper_strategy: design of the integration: a grid (dimension <= 2), a central composite design,
        or ``"auto"`` (grid for dimension <= 2, as R-INLA does).
    """

    learn_params: bool = option(True, "type-II maximum likelihood: maximise the bound over the model's pyro.param sites")
    type2_max_iter: int = option(50, "type-II: L-BFGS-B iterations over the params", min=1)
    type2_gtol: float = option(1e-5, "type-II convergence: max |dB/dz| <= type2_gtol (1 + |B|)", gt=0)
    hyper: typing.Literal["auto", "integrate", "map"] = option(
        "auto", "hyper-latents: integrate over them (INLA-style design points; 'auto') or keep their mode ('map')")
    hyper_strategy: typing.Literal["auto", "grid", "ccd"] = option(
        "auto", "design of the hyper-latent integration: grid (d <= 2 under 'auto'), central composite design")


def options_table(engine_cls):
    """Markdown table of an engine's options (name, type, default, meaning) from its dataclass."""
    hints = typing.get_type_hints(engine_cls.Options)
    lines = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(engine_cls.Options):
        doc = f.metadata.get("doc", "")
        rng = []
        for key, sym in (("min", ">="), ("gt", ">"), ("max", "<=")):
            if f.metadata.get(key) is not None:
                rng.append(f"{sym} {f.metadata[key]}")
        if rng:
            doc = f"{doc} ({', '.join(rng)})"
        typ = _type_name(hints.get(f.name, Any))
        cells = [f"`{f.name}`", typ, f"`{f.default!r}`", doc]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# optimality and solutions
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Criterion:
    """One optimality criterion: ``value <= tol`` (a NaN or infinite value never passes)."""

    name: str
    value: float
    tol: float

    @property
    def met(self):
        return math.isfinite(self.value) and self.value <= self.tol

    def __str__(self):
        return f"{self.name} = {self.value:.3g} (tol {self.tol:.3g})"


@dataclass(frozen=True)
class Optimality:
    """An engine's optimality measure at its answer: one or more :class:`Criterion`, all must be met.

    Example::

        >>> Optimality.single("duality gap (nats)", 3e-9, 1e-8).converged
        True
    """

    criteria: Tuple[Criterion, ...]

    @classmethod
    def single(cls, name, value, tol):
        return cls((Criterion(name, float(value), float(tol)),))

    @classmethod
    def exact(cls, name="closed-form solution"):
        """For answers that are exact by construction (measure 0 with tolerance 0)."""
        return cls.single(name, 0.0, 0.0)

    @property
    def converged(self):
        return bool(self.criteria) and all(c.met for c in self.criteria)

    def __str__(self):
        return "; ".join(str(c) for c in self.criteria)


@dataclass
class Solution:
    """What :meth:`Engine.solve` returns.

    :ivar posterior: the approximate posterior over the flat latent vector.
    :ivar log_evidence_bound: a lower bound on ``log p(y)`` of the model as written, or ``None``.
    :ivar optimality: the engine's :class:`Optimality` at the answer.
    :ivar stop_reason: which rule stopped the engine (e.g. ``"duality gap"``, ``"max_steps"``).
    :ivar info: engine-specific extras.
    :ivar lgm: the latent Gaussian model, for engines that run on the Pyro model but extracted one.
    """

    posterior: Any
    log_evidence_bound: Optional[float]
    optimality: Optimality
    stop_reason: str
    info: Dict[str, Any] = field(default_factory=dict)
    lgm: Any = None


@dataclass
class ModelCall:
    """A Pyro model with its arguments, as handed to engines that run on the model itself."""

    model: Callable
    args: tuple
    kwargs: dict
    #: the model as the user wrote it (``model`` may wrap it, e.g. to make ``obs_mask`` sites proper)
    as_written: Optional[Callable] = None

    @property
    def source(self):
        """The model as written (what the latent Gaussian extraction reads)."""
        return self.as_written if self.as_written is not None else self.model


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix(self, **kwargs):
        pass

    def close(self):
        pass


class RunContext:
    """Per-run services of :class:`Engine`: the history and progress bars.

    :ivar history: the run's :class:`~pyro_convexvb.infer.result.History`.
    :ivar progress: whether progress bars are shown.
    """

    def __init__(self, engine_name, progress):
        self.engine_name = engine_name
        self.progress = bool(progress)
        self.history = History()
        self._bars = []

    def bar(self, total=None, unit="it", desc=None):
        """A tqdm progress bar (closed by the engine when the run ends), or a no-op bar when disabled."""
        if not self.progress:
            return _NoBar()
        from tqdm.auto import tqdm

        b = tqdm(total=total, unit=unit, desc=desc or self.engine_name, leave=False)
        self._bars.append(b)
        return b

    def close(self):
        for b in self._bars:
            b.close()
        self._bars = []


# ---------------------------------------------------------------------------------------------
# random numbers
# ---------------------------------------------------------------------------------------------
def draw_seed():
    """A seed drawn from the caller's global torch stream (advancing it by one draw, as a Pyro fit would)."""
    import torch

    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def _cuda_in_use():
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextlib.contextmanager
def forked_rng(seed=None, cuda=False):
    """Run a block on a fork of the global random number generators, seeded; the caller's streams are restored.

    ``seed=None`` draws the seed from the caller's torch stream first (:func:`draw_seed`): results then follow
    ``pyro.set_rng_seed``, two consecutive blocks differ, and a re-seeded session reproduces them, as with
    Pyro's own inference, while the caller's stream only moves on by that one draw. Forked: torch's CPU
    generator (and the CUDA generators when ``cuda``), NumPy's global ``RandomState`` and Python's ``random``,
    all seeded as :func:`pyro.set_rng_seed` does.

    :param seed: an integer, or ``None``.
    :yields: the seed used.

    Example::

        >>> import torch
        >>> _ = torch.manual_seed(1); a = torch.rand(1)
        >>> _ = torch.manual_seed(1)
        >>> with forked_rng(5):
        ...     _ = torch.rand(100)
        >>> bool(torch.rand(1) == a)
        True
    """
    import random

    import numpy as np
    import torch

    if seed is None:
        seed = draw_seed()
    seed = int(seed)
    np_state, py_state = np.random.get_state(), random.getstate()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with torch.random.fork_rng(devices=devices):
        try:
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed_all(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)
            yield seed
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)


# ---------------------------------------------------------------------------------------------
# the base class
# ---------------------------------------------------------------------------------------------
class Engine:
    """Base class of every inference engine (see the module docstring).

    :param model: a Pyro model, or a :class:`~pyro_convexvb.LatentGaussianModel` for engines that
        work on one (``takes = "lgm"``).
    :param bool progress: show tqdm progress bars.
    :param options: the engine's options (fields of its :attr:`Options` dataclass).

    Class attributes a subclass sets: ``name`` (registry name), ``description`` (one line),
    ``Options`` (its :class:`EngineOptions` subclass), ``takes`` (``"lgm"`` or ``"model"``) and
    ``optimality_measure`` (what ``converged`` means, for the docs), and ``distributed`` (``True`` when it fits
    row-sharded data, :mod:`pyro_convexvb.distributed`, reducing every sum over sites across ranks; an engine
    left at ``False`` refuses such data rather than fit this rank's rows only).
    """

    name: ClassVar[str] = ""
    distributed: ClassVar[bool] = False
    description: ClassVar[str] = ""
    Options: ClassVar[type] = EngineOptions
    takes: ClassVar[str] = "lgm"
    optimality_measure: ClassVar[str] = ""

    _run_seed = None
    #: dtype of the extracted latent Gaussian model (``None``: the model's own); the hyper-latent path sets
    #: float64 on its inner fits (:mod:`~pyro_convexvb.infer.hyper`)
    extract_dtype = None

    @property
    def run_seed(self):
        """The seed of the current (or last) :meth:`run`: the ``seed`` option, or the seed drawn from the caller's
        torch stream when it is ``None`` (seeds, e.g., the engine's private generators)."""
        if self._run_seed is None:
            raise RuntimeError(f"engine '{self.name}': run_seed is set by run()")
        return self._run_seed

    def _resolve_seed(self, args, kwargs):
        """The ``seed`` option, else a seed drawn from the caller's torch stream; on row-sharded data (which every
        rank fits with the same random draws) rank 0's draw, broadcast."""
        seed = getattr(self.options, "seed", None)
        if seed is not None:
            return seed
        seed = draw_seed()
        from ..distributed import broadcast, comm_of, find_comm

        if find_comm(args, kwargs) is not None or comm_of(self.model) is not None:
            import torch

            seed = int(broadcast(torch.tensor(seed, dtype=torch.int64)))
        return seed

    def __init__(self, model, *, progress=True, **options):
        if not isinstance(progress, bool):
            raise TypeError(f"engine '{self.name}': progress expects a bool, got {progress!r}")
        self.model = model
        self.progress = progress
        self.options = self.Options.create(self.name, options)
        #: the options the caller set (they win over :meth:`precise_options` in inner fits)
        self.given_options = frozenset(options)

    # ------------------------------------------------------------------ hooks
    @classmethod
    def applies(cls, lgm):
        """``None`` if the engine handles ``lgm``, else the :class:`~pyro_convexvb.UnsupportedModelError` naming
        the site and the reason (returned, not raised)."""
        return None

    def solve(self, problem, run):
        """Fit; ``problem`` is a :class:`~pyro_convexvb.LatentGaussianModel` (``takes = "lgm"``) or a
        :class:`ModelCall`; ``run`` a :class:`RunContext`. Returns a :class:`Solution`."""
        raise NotImplementedError

    def warm_start_options(self, result):
        """Options that warm-start this engine from an earlier ``result`` on a nearby model (override)."""
        return {}

    def precise_options(self):
        """Options that make the evidence bound accurate enough for finite differences over hyper-latents."""
        return {}

    def inner_engine(self, model, warm=None, **overrides):
        """An engine of the same class and options for ``model`` (e.g. a conditioned model), warm-started from
        ``warm``, with precise bounds (:meth:`precise_options`, except for options the caller set) and the
        ``overrides``; its ``seed`` is this run's."""
        opts = self.options.as_dict()
        opts.update({k: v for k, v in self.precise_options().items() if k not in self.given_options})
        if warm is not None:
            opts.update(self.warm_start_options(warm))
        if opts.get("seed", 0) is None:  # every inner fit of a run uses the run's seed (common random numbers)
            opts["seed"] = self.run_seed
        opts.update(overrides)
        return type(self)(model, progress=False, **opts)

    #: how this engine learns ``pyro.param`` sites: ``"outer"`` (type-II loop around fits) or ``"joint"``
    #: (the engine optimises them itself, e.g. SVI).
    type2 = "outer"

    def type2_value(self, result):
        """The type-II objective of a fit: the engine's evidence bound (override)."""
        return result.log_evidence_bound

    def type2_gradient(self, params, x, result, args, kwargs, h):
        """``dB/dz`` over the params' unconstrained values ``x`` (default: central differences of refits)."""
        from .type2 import refit_gradient

        return refit_gradient(self, params, x, result, args, kwargs, max(h, 1e-4))

    # ------------------------------------------------------------------ the run
    @classmethod
    def model_applies(cls, model, args, kwargs):
        """``None`` if an engine that runs on the Pyro model itself (``takes = "model"``) fits it, else the
        :class:`~pyro_convexvb.UnsupportedModelError` naming the site.

        The default accepts every model whose latent sites are continuous (the engines of this kind
        work in Pyro's unconstrained coordinates).
        """
        from ..lgm.extract import _unwrap, latent_sites

        for name, site in latent_sites(model, args, kwargs):
            if getattr(site["fn"].support, "is_discrete", False):
                return UnsupportedModelError(name, "a discrete latent site (this engine needs continuous latents)")
            if getattr(_unwrap(site["fn"])[0], "is_intrinsic", False):
                return UnsupportedModelError(name, "an intrinsic SparseGMRF: its Pyro density is flat along the null "
                                                   "space of its precision, so an engine that runs the Pyro model does "
                                                   "not enforce its constraints (dual_vg and convex_relaxation do)")
        return None

    @classmethod
    def fits(cls, model, args=(), kwargs=None, lgm=None):
        """``None`` if this engine fits ``model`` with these arguments, else the
        :class:`~pyro_convexvb.UnsupportedModelError` that says where and why not.

        :param lgm: the model's :class:`~pyro_convexvb.LatentGaussianModel` if already extracted (or the
            :class:`~pyro_convexvb.infer.engine.LatentGaussianModel` itself as ``model``).
        """
        from ..lgm.extract import lgm_from_pyro
        from ..lgm.model import LatentGaussianModel

        kwargs = kwargs or {}
        if isinstance(model, LatentGaussianModel):
            return cls.applies(model) if cls.takes == "lgm" else UnsupportedModelError("<model>", "this engine runs on "
                                                                                               "a Pyro model")
        if cls.takes == "model":
            return cls.model_applies(model, args, kwargs)
        if lgm is None:
            try:
                lgm = lgm_from_pyro(model, *args, **kwargs)
            except UnsupportedModelError as e:
                # outside the class, the model may be a latent Gaussian model given a few hyper-latents
                return None if cls.hyper_latents(model, args, kwargs) else e
        return cls.applies(lgm)

    @classmethod
    def hyper_latents(cls, model, args, kwargs):
        """The hyper-latent sites this engine integrates over for ``model`` (see
        :mod:`~pyro_convexvb.infer.hyper`), or ``[]`` when it does not handle the model that way.

        Non-empty only for latent-Gaussian engines (``Options`` derived from :class:`LGMEngineOptions`) when
        every hyper-latent is continuous, a latent Gaussian field is left, and the model conditioned on the
        hyper-latents' current values is one this engine applies to.
        """
        return cls._hyper_check(model, args, kwargs)[0]

    @classmethod
    def _hyper_check(cls, model, args, kwargs):
        """``(hyper, refusal)``: the hyper-latents this engine integrates over (else ``[]``), and the
        :class:`~pyro_convexvb.UnsupportedModelError` when the model given its hyper-latents is outside the
        engine's class (else ``None``)."""
        from ..lgm.extract import latent_sites, lgm_from_pyro
        from ..lgm.model import LatentGaussianModel
        from .hyper import conditioned_model, find_hyper_sites

        if isinstance(model, LatentGaussianModel) or cls.takes != "lgm" or \
                not issubclass(cls.Options, LGMEngineOptions):
            return [], None
        try:
            sites = dict(latent_sites(model, args, kwargs))
            hyper = find_hyper_sites(model, args, kwargs)
        except UnsupportedModelError:
            return [], None
        if not hyper or len(hyper) == len(sites):
            return [], None  # nothing to integrate over, or no latent Gaussian field would be left
        if any(getattr(sites[n]["fn"].support, "is_discrete", False) for n in hyper):
            return [], None  # a discrete latent: the extraction's refusal names it
        values = {n: sites[n]["value"].detach() for n in hyper}
        try:
            lgm = lgm_from_pyro(conditioned_model(model, values), *args, **kwargs)
        except UnsupportedModelError as e:
            return [], e
        err = cls.applies(lgm)
        return (hyper, None) if err is None else ([], err)

    def _refuse(self, err, args, kwargs, lgm=None):
        """The refusal ``err`` (an :class:`~pyro_convexvb.UnsupportedModelError`) again, naming this engine and the
        engines that fit."""
        from .registry import engines_that_fit

        others = [n for n in engines_that_fit(self.model, *args, lgm=lgm, **kwargs) if n != self.name]
        alt = (f"; engines that fit this model: {', '.join(others)}" if others
               else "; no registered engine fits this model")
        return UnsupportedModelError(err.site, f"engine '{self.name}' does not apply: {err.reason}{alt}")

    def extract(self, *args, **kwargs):
        """The latent Gaussian model this engine fits (checked by :meth:`applies`).

        :raises UnsupportedModelError: naming the site and the reason, and listing the registered engines
            that do fit the model.
        """
        from ..lgm.extract import lgm_from_pyro
        from ..lgm.model import LatentGaussianModel

        if isinstance(self.model, LatentGaussianModel):
            if args or kwargs:
                raise TypeError(f"engine '{self.name}': a LatentGaussianModel takes no model arguments")
            lgm = self.model
        else:
            try:
                lgm = lgm_from_pyro(self.model, *args, dtype=self.extract_dtype, **kwargs)
            except UnsupportedModelError as e:
                raise self._refuse(e, args, kwargs) from None
        err = self.applies(lgm)
        if err is not None:
            raise self._refuse(err, args, kwargs, lgm=lgm)
        return lgm

    def run(self, *args, **kwargs):
        """Fit the model to its data ``(*args, **kwargs)``; returns an :class:`~pyro_convexvb.InferenceResult`.

        The fit runs on a fork of the global random number generators (torch, NumPy, ``random``), seeded with
        the ``seed`` option, or without one with a seed drawn from the caller's torch stream (see
        :func:`forked_rng`): the caller's streams are never reset.
        """
        with forked_rng(self._resolve_seed(args, kwargs), cuda=_cuda_in_use()) as seed:
            self._run_seed = seed
            from ..lgm.model import LatentGaussianModel

            t0 = time.perf_counter()
            self._check_distributed(args, kwargs)
            if not isinstance(self.model, LatentGaussianModel):
                from ..lgm.extract import check_model_data

                with forked_rng(0):  # its trace's prior draws leave the run's stream where it was
                    check_model_data(self.model, args, kwargs)
            params = self._type2_params(args, kwargs)
            if params:
                return self._run_type2(params, args, kwargs, t0)
            if self.takes == "lgm":
                try:
                    lgm = self.extract(*args, **kwargs)
                except UnsupportedModelError:
                    # a model outside the class may be a latent Gaussian model given a few hyper-latents
                    hyper, reason = type(self)._hyper_check(self.model, args, kwargs)
                    if reason is not None:  # it is, but not one this engine fits: say why
                        raise self._refuse(reason, args, kwargs) from None
                    if not hyper:
                        raise
                    return self._run_hyper(hyper, args, kwargs, t0)
                problem = lgm
            else:
                if isinstance(self.model, LatentGaussianModel):
                    raise TypeError(f"engine '{self.name}' runs on a Pyro model, not on a LatentGaussianModel")
                err = self.model_applies(self.model, args, kwargs)
                if err is not None:
                    raise self._refuse(err, args, kwargs)
                from ..lgm.extract import proper_missing

                # the unused entries of obs_mask sites get a proper density (an improper flat one otherwise)
                lgm, problem = None, ModelCall(proper_missing(self.model), args, kwargs, self.model)
            run = RunContext(self.name, self.progress)
            try:
                sol = self.solve(problem, run)
            finally:
                run.close()
            return self._result(sol, run, lgm if lgm is not None else sol.lgm, args, kwargs, t0)

    def _check_distributed(self, args, kwargs):
        """Refuse row-sharded data (``pcv.distributed.row_sharded``) unless the engine reduces its site sums."""
        if type(self).distributed:
            return
        from ..distributed import comm_of, find_comm

        if find_comm(args, kwargs) is None and comm_of(self.model) is None:
            return
        from .registry import get_engine, engines

        able = sorted(name for name in engines() if getattr(get_engine(name), "distributed", False))
        raise NotImplementedError(
            f"engine '{self.name}' cannot fit row-sharded data (pcv.distributed.row_sharded): it would fit this "
            f"rank's rows only. Engines that fit row-sharded data: {', '.join(able) or 'none'}")

    def _type2_params(self, args, kwargs):
        """The model's ``pyro.param`` sites when this engine learns them in an outer type-II loop, else ``[]``."""
        from ..lgm.model import LatentGaussianModel

        if not getattr(self.options, "learn_params", False) or self.type2 != "outer" or \
                isinstance(self.model, LatentGaussianModel):
            return []
        from .type2 import model_params

        return model_params(self.model, args, kwargs)

    def _run_type2(self, names, args, kwargs, t0):
        """Type-II maximum likelihood over the ``pyro.param`` sites ``names`` (:mod:`~pyro_convexvb.infer.type2`)."""
        from .type2 import learn_params

        if self._hyper_sites_safe(args, kwargs):
            raise UnsupportedModelError(names[0], f"engine '{self.name}': the model has pyro.param hyperparameters "
                                                  "and hyper-latents; give the params priors (hyper-latents) or pass "
                                                  "learn_params=False to keep them fixed")
        run = RunContext(self.name, self.progress)
        try:
            o = self.options
            res, info = learn_params(self, names, args, kwargs, run=run,
                                     max_iter=getattr(o, "type2_max_iter", 50), gtol=getattr(o, "type2_gtol", 1e-5))
        finally:
            run.close()
        crit = Criterion("type-II gradient max |dB/dz| over the params", info["grad_norm"], info["gtol"])
        sol = Solution(res.posterior, res.log_evidence_bound, Optimality(res.optimality.criteria + (crit,)),
                       f"type-II over {', '.join(names)}; {res.stop_reason}", dict(res.info, type2=info))
        out = self._result(sol, run, res.lgm, args, kwargs, t0)
        out.hyperparameters = info["learned"]
        return out

    def _hyper_sites_safe(self, args, kwargs):
        try:
            return self._hyper_sites(args, kwargs)
        except UnsupportedModelError:
            return []

    def _hyper_sites(self, args, kwargs):
        """The model's hyper-latents if this engine integrates over them, else ``[]``."""
        return type(self).hyper_latents(self.model, args, kwargs)

    def _run_hyper(self, hyper, args, kwargs, t0):
        """Integrate over (or maximise) the hyper-latents ``hyper``; each design point is one fit of this engine."""
        from .hyper import integrate_hyper

        o = self.options
        strategy = "map" if o.hyper == "map" else o.hyper_strategy
        run = RunContext(self.name, self.progress)
        try:
            post, mode_res, info = integrate_hyper(self, hyper, args, kwargs, strategy=strategy, run=run)
        finally:
            run.close()
        inner = [mode_res] + list(info.get("results", []))
        unconverged = sum(not r.converged for r in inner)
        grad = info["mode_grad_norm"]
        crit = (Criterion("hyper-mode gradient max |d log p(theta, y)/dz|", grad, info["mode_gtol"]),
                Criterion("design-point fits not converged", float(unconverged), 0.0))
        space = info["space"]
        if o.hyper == "map":  # the field's posterior at the mode, theta fixed there
            marg = None
            reason = "hyper-latent mode"
        else:
            marg = post.theta_marginals()
            reason = f"hyper-latents integrated ({info['strategy']}, {post.num_points} points)"
        hyper_info = {"names": space.names, "mode": info["mode_theta"], "marginals": marg,
                      "log_post_mode": info["log_post_mode"], "evaluations": info["evaluations"],
                      "strategy": "map" if o.hyper == "map" else info["strategy"]}
        posterior = post
        sol = Solution(posterior, None, Optimality(crit), reason,
                       {"hyper": hyper_info, "mode_result": mode_res, "hyper_details": info})
        res = self._result(sol, run, mode_res.lgm, args, kwargs, t0)
        res.hyper = hyper_info
        return res

    def _result(self, sol, run, lgm, args, kwargs, t0):
        from ..lgm.model import LatentGaussianModel

        post = sol.posterior
        if post is not None and lgm is not None and post.n == lgm.n and (
                getattr(lgm, "imputed", None) or (getattr(lgm, "chain", None) is not None and self.takes == "lgm")):
            post = lgm.complete_posterior(post)  # add the latent sites integrated out of u (e.g. obs_mask)
        if post is not None:
            if getattr(post, "layout", None) is None and lgm is not None and lgm.n == post.n:
                post.layout = lgm.layout
            if getattr(post, "layout", None) is None and self.takes == "model":
                from ..lgm.extract import unconstrained_layout

                post.layout = unconstrained_layout(self.model, args, kwargs)
            if callable(self.model) and not isinstance(self.model, LatentGaussianModel):
                post.model = self.model
                post.model_args = (args, kwargs)
        res = InferenceResult(post, sol.log_evidence_bound, run.history, sol.optimality.converged, self.name,
                              sol.info, lgm, seconds=time.perf_counter() - t0, stop_reason=sol.stop_reason,
                              optimality=sol.optimality, hyperparameters=sol.info.get("hyperparameters"))
        if not res.converged:
            msg = (f"engine '{self.name}' did not converge (stopped by: {sol.stop_reason}): {sol.optimality}")
            if self.options.on_fail == "raise":
                worst = max((c for c in sol.optimality.criteria if not c.met), key=lambda c: c.value, default=None)
                raise ConvergenceError(msg, residual=None if worst is None else worst.value)
            warn(msg)
        return res

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r}, options={self.options})"
