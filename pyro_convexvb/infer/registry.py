"""Engine registry: ``pcv.engines()``, ``pcv.fit(model, *args, engine=NAME, ...)``.

Engines register with :func:`register_engine` (a decorator) or, from other packages, through
the ``pyro_convexvb.engines`` entry-point group whose objects are :class:`EngineSpec` instances
or decorated functions.
"""
import time
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["EngineSpec", "register_engine", "engines", "get_engine", "fit"]


@dataclass
class EngineSpec:
    """An inference engine.

    :param name: registry name.
    :param fn: ``fn(lgm, progress=..., **options)`` if ``takes == "lgm"``, else
        ``fn(model, args, kwargs, progress=..., **options)``; returns an
        :class:`~pyro_convexvb.infer.result.InferenceResult`.
    :param description: one line for :func:`engines`.
    :param takes: ``"lgm"`` (works on the extracted latent Gaussian model) or ``"model"`` (runs on
        the Pyro model itself, like Pyro's own engines).
    :param applies: optional predicate ``applies(lgm) -> (bool, reason)`` telling whether the engine
        handles a given latent Gaussian model (used by the demo and for clear errors).
    """

    name: str
    fn: Callable
    description: str
    takes: str = "lgm"
    applies: Optional[Callable] = None


_ENGINES = {}
_ENTRY_POINTS_LOADED = False


def register_engine(name, description, takes="lgm", applies=None, overwrite=False):
    """Decorator registering an engine function under ``name``.

    Example::

        >>> from pyro_convexvb.infer.registry import register_engine
        >>> @register_engine("my_engine", "does nothing useful", overwrite=True)
        ... def my_engine(lgm, progress=True):
        ...     raise NotImplementedError
    """
    if takes not in ("lgm", "model"):
        raise ValueError("takes must be 'lgm' or 'model'")

    def deco(fn):
        if name in _ENGINES and not overwrite:
            raise ValueError(f"an engine named '{name}' is already registered")
        _ENGINES[name] = EngineSpec(name, fn, description, takes, applies)
        fn.engine_spec = _ENGINES[name]
        return fn

    return deco


def _load_builtin():
    # importing the modules registers their engines
    from . import baselines  # noqa: F401
    import importlib

    for mod in ("pyro_convexvb.infer.convex_relaxation", "pyro_convexvb.infer.dual_vg",
                "pyro_convexvb.infer.diag_mixture"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


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
        if isinstance(obj, EngineSpec):
            _ENGINES.setdefault(obj.name, obj)
        elif not hasattr(obj, "engine_spec"):
            raise TypeError(f"entry point {ep.name!r} must be an EngineSpec or a function decorated by register_engine")


def engines():
    """``{name: one-line description}`` of every registered engine."""
    _load_builtin()
    _load_entry_points()
    return {k: v.description for k, v in sorted(_ENGINES.items())}


def get_engine(name):
    engines()
    try:
        return _ENGINES[name]
    except KeyError:
        raise KeyError(f"unknown engine '{name}'; registered engines: {', '.join(sorted(_ENGINES))}") from None


def fit(model, *args, engine, options=None, progress=True, **kwargs):
    """Run inference engine ``engine`` on a Pyro model (or a :class:`LatentGaussianModel`).

    :param model: a Pyro model callable, or a :class:`~pyro_convexvb.LatentGaussianModel`.
    :param args: the model's positional arguments.
    :param str engine: registry name (see :func:`engines`).
    :param dict options: engine options (keyword arguments of the engine).
    :param bool progress: show a tqdm progress bar on long fits.
    :param kwargs: the model's keyword arguments (e.g. ``y=...``).
    :returns: :class:`~pyro_convexvb.infer.result.InferenceResult`.

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
    from ..lgm.extract import lgm_from_pyro
    from ..lgm.model import LatentGaussianModel

    spec = get_engine(engine)
    options = dict(options or {})
    t0 = time.perf_counter()
    if spec.takes == "lgm":
        lgm = model if isinstance(model, LatentGaussianModel) else lgm_from_pyro(model, *args, **kwargs)
        if spec.applies is not None:
            ok, reason = spec.applies(lgm)
            if not ok:
                raise ValueError(f"engine '{engine}' does not apply to this model: {reason}")
        result = spec.fn(lgm, progress=progress, **options)
        result.lgm = lgm
        if result.posterior is not None and getattr(result.posterior, "layout", None) is None:
            result.posterior.layout = lgm.layout
    else:
        if isinstance(model, LatentGaussianModel):
            raise TypeError(f"engine '{engine}' runs on a Pyro model, not on a LatentGaussianModel")
        result = spec.fn(model, args, kwargs, progress=progress, **options)
    result.engine = engine
    result.seconds = time.perf_counter() - t0
    if callable(model) and not isinstance(model, LatentGaussianModel) and result.posterior is not None:
        result.posterior.model = model
        result.posterior.model_args = (args, kwargs)
    return result
