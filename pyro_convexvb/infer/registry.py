"""Engine registry: ``pcv.engines()``, ``pcv.fit(model, *args, engine=NAME, options={...})``.

Every engine is an :class:`~pyro_convexvb.infer.engine.Engine` subclass. The built-in engines are
listed here by import path and imported on first use (so importing the registry imports no engine
module, and no engine module imports the registry). Other packages register theirs with
:func:`register_engine` or through the ``pyro_convexvb.engines`` entry-point group, whose objects
are :class:`~pyro_convexvb.infer.engine.Engine` subclasses.
"""
import importlib

from ..distributed import find_comm
from ..errors import UnsupportedModelError
from ..lgm.extract import check_model_data, lgm_from_pyro
from ..lgm.model import LatentGaussianModel
from .engine import Engine
from .meta import hyper_latents
from .rng import forked_rng
from .type2 import model_params

__all__ = ["register_engine", "engines", "get_engine", "engines_that_fit", "fit"]

#: name -> "module:Class" of the built-in engines (imported lazily).
BUILTIN_ENGINES = {
    "convex_relaxation": "pyro_convexvb.infer.convex_relaxation.engine:ConvexVariationalRelaxation",
    "dual_vg": "pyro_convexvb.infer.dual_vg.engine:DualVGEngine",
    "diag_mixture": "pyro_convexvb.infer.diag_mixture.engine:DiagMixtureEngine",
    "svi_autonormal": "pyro_convexvb.infer.pyro_engines:SVIAutoNormal",
    "svi_automvn": "pyro_convexvb.infer.pyro_engines:SVIAutoMultivariateNormal",
    "svi_lowrank": "pyro_convexvb.infer.pyro_engines:SVILowRank",
    "laplace": "pyro_convexvb.infer.pyro_engines:LaplaceEngine",
    "nuts": "pyro_convexvb.infer.pyro_engines:NUTSEngine",
}

_ENGINES = {}
_ENTRY_POINTS_LOADED = False


def _check_engine_class(cls):
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise TypeError(f"an engine must be a subclass of pyro_convexvb.Engine, got {cls!r}")
    for attr in ("name", "description"):
        if not isinstance(getattr(cls, attr, None), str) or not getattr(cls, attr):
            raise TypeError(f"engine class {cls.__name__} needs a non-empty class attribute '{attr}'")
    if cls.takes not in ("lgm", "model"):
        raise TypeError(f"engine class {cls.__name__}: takes must be 'lgm' or 'model', got {cls.takes!r}")


def register_engine(cls=None, *, overwrite=False):
    """Register an :class:`~pyro_convexvb.infer.engine.Engine` subclass under its ``name``.

    Usable as ``@register_engine`` or ``@register_engine(overwrite=True)``.

    Example::

        >>> import pyro_convexvb as pcv
        >>> @pcv.register_engine(overwrite=True)
        ... class Nothing(pcv.Engine):
        ...     name = "nothing_doc"
        ...     description = "does nothing useful"
        >>> "nothing_doc" in pcv.engines()
        True
    """

    def deco(c):
        _check_engine_class(c)
        _load_builtin()
        if c.name in _ENGINES and _ENGINES[c.name] is not c and not overwrite:
            raise ValueError(f"an engine named '{c.name}' is already registered ({_ENGINES[c.name].__qualname__})")
        _ENGINES[c.name] = c
        return c

    return deco if cls is None else deco(cls)


def _resolve(path):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _load_builtin():
    for name, path in BUILTIN_ENGINES.items():
        if name not in _ENGINES:
            _ENGINES[name] = _resolve(path)


def _load_entry_points():
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    from importlib.metadata import entry_points

    try:
        eps = entry_points(group="pyro_convexvb.engines")
    except TypeError:  # Python < 3.10
        eps = entry_points().get("pyro_convexvb.engines", [])
    for ep in eps:
        obj = ep.load()
        try:
            _check_engine_class(obj)
        except TypeError as e:
            raise TypeError(f"entry point {ep.name!r} of group 'pyro_convexvb.engines': {e}") from None
        _ENGINES.setdefault(obj.name, obj)


def engines():
    """``{name: one-line description}`` of every registered engine.

    Example::

        >>> import pyro_convexvb as pcv
        >>> sorted(pcv.engines())[:3]
        ['convex_relaxation', 'diag_mixture', 'dual_vg']
    """
    _load_builtin()
    _load_entry_points()
    return {k: v.description for k, v in sorted(_ENGINES.items())}


def get_engine(name):
    """The :class:`~pyro_convexvb.infer.engine.Engine` subclass registered as ``name``.

    Example::

        >>> import pyro_convexvb as pcv
        >>> E = pcv.get_engine("laplace")
        >>> E.name, E.Options().on_fail
        ('laplace', 'warn')
    """
    engines()
    try:
        return _ENGINES[name]
    except KeyError:
        raise KeyError(f"unknown engine '{name}'; registered engines: {', '.join(sorted(_ENGINES))}") from None


def engines_that_fit(model, *args, lgm=None, **kwargs):
    """Names of the registered engines that fit ``model`` with these arguments (each engine's own check).

    :param model: a Pyro model or a :class:`~pyro_convexvb.LatentGaussianModel`.
    :param lgm: the model's latent Gaussian model if already extracted (saves a trace).
    :raises ValueError: for data that no engine fits (non-finite inputs, no rows, observed values outside their
        distribution's support; :func:`~pyro_convexvb.lgm.extract.check_model_data`).

    On row-sharded data (:func:`pyro_convexvb.distributed.row_sharded`) only engines that fit such data are
    considered.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(y=None):
        ...     s = pyro.sample("s", dist.HalfCauchy(torch.tensor(1.0, dtype=torch.float64)))
        ...     pyro.sample("y", dist.Normal(torch.tensor(0.0, dtype=torch.float64), s), obs=y)
        >>> pcv.engines_that_fit(model, y=torch.tensor(0.3, dtype=torch.float64))
        ['diag_mixture', 'laplace', 'nuts', 'svi_automvn', 'svi_autonormal', 'svi_lowrank']
    """
    names = list(engines())
    if find_comm(args, kwargs) is not None:  # row-sharded data: only the engines that reduce over ranks
        names = [n for n in names if _ENGINES[n].distributed]
    if lgm is None and not isinstance(model, LatentGaussianModel):
        with forked_rng(0):  # its trace's prior draws leave the caller's stream where it was
            check_model_data(model, args, kwargs)
    if lgm is None and not isinstance(model, LatentGaussianModel) and any(_ENGINES[n].takes == "lgm" for n in names):
        try:
            lgm = lgm_from_pyro(model, *args, **kwargs)
        except UnsupportedModelError:
            lgm = False
    out, params = [], None
    for name in names:
        cls = _ENGINES[name]
        if cls.takes == "lgm" and lgm is False:
            # outside the class: the engine may integrate over the model's hyper-latents, unless it would also
            # learn pyro.param sites (by default), which it refuses beside hyper-latents (run_type2)
            if hyper_latents(cls, model, args, kwargs):
                if cls.type2 == "outer":
                    params = model_params(model, args, kwargs) if params is None else params
                    if params:
                        continue
                out.append(name)
            continue
        if cls.fits(model, args, kwargs, lgm=lgm or None) is None:
            out.append(name)
    return out


def fit(model, *args, engine, options=None, progress=True, correct=None, init=None, **kwargs):
    """Run inference engine ``engine`` on a Pyro model (or a :class:`LatentGaussianModel`).

    ``pcv.fit(model, *args, engine=name, options=opts, **kwargs)`` is
    ``pcv.get_engine(name)(model, progress=progress, **opts).run(*args, **kwargs)``.

    :param model: a Pyro model callable, or a :class:`~pyro_convexvb.LatentGaussianModel`.
    :param args: the model's positional arguments.
    :param str engine: registry name (see :func:`engines`).
    :param dict options: the engine's options (fields of its options dataclass; unknown or ill-typed
        options raise :class:`TypeError`, out-of-range ones :class:`ValueError`).
    :param bool progress: show tqdm progress bars on long fits.
    :param str correct: ``"psis"`` to also importance-correct the posterior summaries
        (:meth:`~pyro_convexvb.InferenceResult.corrected`, stored as ``res.correction``); ``None`` (default) not to.
    :param init: ``result.state`` of an earlier fit of this engine on a model of the same shape: the fit resumes
        from it (e.g. with more iterations, or after the data changed a little); with ``pyro.param`` sites learned
        (type-II), the first of its fits does. Refused for a model with hyper-latents (each design point starts
        from the nearest one fitted).
    :param kwargs: the model's keyword arguments (e.g. ``y=...``).
    :returns: :class:`~pyro_convexvb.infer.result.InferenceResult`.
    :raises UnsupportedModelError: when the engine does not apply, naming the site, the reason and the registered
        engines that fit the model.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
        >>> X = torch.randn(20, 2, dtype=torch.float64); y = X @ torch.tensor([1., -1.], dtype=torch.float64)
        >>> res = pcv.fit(model, X, y=y, engine="laplace", progress=False)
        >>> res.posterior.loc.shape
        torch.Size([2])
    """
    cls = get_engine(engine)
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise TypeError(f"options: expected a dict of engine '{engine}' options, got {type(options).__name__}")
    if correct not in (None, "psis"):
        raise ValueError(f"correct: expected None or 'psis', got {correct!r}")
    for key in ("progress", "init"):
        if key in options:  # arguments of fit itself: as an option it would collide with (or silently beat) them
            raise TypeError(f"options: {key!r} is an argument of pcv.fit, not an engine option: pass "
                            f"pcv.fit(..., {key}={options[key]!r})")
    try:
        res = cls(model, progress=progress, init=init, **options).run(*args, **kwargs)
    except UnsupportedModelError as e:
        if getattr(e, "refused_by", None) != cls.name:
            raise
        others = [n for n in engines_that_fit(model, *args, lgm=e.lgm, **kwargs) if n != cls.name]
        alt = (f"; engines that fit this model: {', '.join(others)}" if others
               else "; no registered engine fits this model")
        raise UnsupportedModelError(e.site, e.reason + alt) from None
    if correct == "psis":
        res.corrected(progress=progress)
    return res
