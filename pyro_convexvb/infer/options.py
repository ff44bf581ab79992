"""Engine options: one frozen dataclass per engine, validated once, documented from its fields.

Every engine declares an :class:`EngineOptions` subclass whose fields are made with :func:`option` (default, one
line of documentation, range). :func:`options_table` renders it for ``docs/engines.md``.
"""
import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["option", "EngineOptions", "Type2Options", "LGMEngineOptions", "options_table", "range_violation"]


def option(default, doc, *, min=None, gt=None, max=None, choices=None):
    """A field of an :class:`EngineOptions` dataclass with its documentation and range.

    :param default: default value (immutable, or ``None``).
    :param str doc: one line for the docs' option table.
    :param min: smallest allowed value (inclusive), for numbers.
    :param gt: exclusive lower bound, for numbers.
    :param max: largest allowed value (inclusive), for numbers.
    :param choices: allowed values (for strings; ``typing.Literal`` annotations give them too).

    Example::

        >>> import dataclasses, pyro_convexvb as pcv
        >>> @dataclasses.dataclass(frozen=True)
        ... class MyOptions(pcv.EngineOptions):
        ...     step: float = pcv.option(0.5, "step size", gt=0.0, max=1.0)
        >>> MyOptions(step=0.0)
        Traceback (most recent call last):
            ...
        ValueError: option 'step' must be > 0.0, got 0.0
    """
    return field(default=default, metadata=dict(doc=doc, min=min, gt=gt, max=max, choices=choices))


def range_violation(value, meta):
    """The range of an option's ``metadata`` (:func:`option`) that the number ``value`` breaks, as text
    (``">= 1"``), or ``None`` when it is within range."""
    if meta.get("min") is not None and value < meta["min"]:
        return f">= {meta['min']}"
    if meta.get("gt") is not None and not value > meta["gt"]:
        return f"> {meta['gt']}"
    if meta.get("max") is not None and value > meta["max"]:
        return f"<= {meta['max']}"
    return None


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

    Example::

        >>> import dataclasses
        >>> from typing import Literal
        >>> import pyro_convexvb as pcv
        >>> @dataclasses.dataclass(frozen=True)
        ... class MyOptions(pcv.EngineOptions):
        ...     max_steps: int = pcv.option(100, "iterations at most", min=1)
        ...     rule: Literal["a", "b"] = pcv.option("a", "which rule")
        >>> MyOptions(max_steps=5).max_steps, MyOptions().rule, MyOptions().on_fail
        (5, 'a', 'warn')
        >>> MyOptions(rule="c")
        Traceback (most recent call last):
            ...
        ValueError: option 'rule' must be one of ['a', 'b'], got 'c'
    """

    on_fail: typing.Literal["warn", "raise"] = option(
        "warn", "unconverged fits warn once (ConvergenceWarning) or raise (ConvergenceError)")

    def is_set(self, name):
        """Whether option ``name`` differs from its default (how an option the caller set is told from one left
        alone; a default passed explicitly is the default)."""
        return getattr(self, name) != type(self).__dataclass_fields__[name].default

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
        hints = _type_hints(type(self))
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
                bound = range_violation(value, meta)
                if bound is not None:
                    raise ValueError(f"option '{f.name}' must be {bound}, got {value!r}")
        self.check()

    def check(self):
        """Checks that involve several options (override; raise ``ValueError`` naming the options)."""

    def replace(self, **changes):
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def as_dict(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@functools.lru_cache(maxsize=None)
def _type_hints(cls):
    """The resolved annotations of an options class, once per class (every engine built validates its options:
    an integrated fit builds one per design point)."""
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class Type2Options(EngineOptions):
    """Options of the engines that learn the model's ``pyro.param`` sites in an outer type-II loop (an engine
    with ``type2 = "outer"``, see :mod:`~pyro_convexvb.infer.meta`)."""

    learn_params: bool = option(True, "type-II maximum likelihood: maximise the bound over the model's pyro.param sites")
    type2_max_iter: int = option(50, "type-II: L-BFGS-B iterations over the params", min=1)
    type2_gtol: float = option(1e-5, "type-II convergence: max |dB/dz| <= type2_gtol (1 + |B|)", gt=0)


@dataclass(frozen=True)
class LGMEngineOptions(Type2Options):
    """Options shared by the engines that fit latent Gaussian models with an evidence bound (type-II learning of
    ``pyro.param`` sites, and hyper-latents: an engine with ``integrates_hyper = True``).

    :ivar hyper: what to do with hyper-latents (non-Gaussian latent sites feeding the Gaussian part, see
        :mod:`~pyro_convexvb.infer.hyper`): integrate over them (INLA-style), or keep only their mode.
    :ivar hyper_strategy: design of the integration: a grid (dimension <= 2), a central composite design,
        or ``"auto"`` (grid for dimension <= 2, as R-INLA does).
    :ivar hyper_probe: grow the grid on to the prior's quantiles it leaves out where they carry mass (a grid up to 3
        dimensions; ``res.corrected()`` refits so when the diagnostic finds such mass).
    """

    hyper: typing.Literal["auto", "integrate", "map"] = option(
        "auto", "hyper-latents: integrate over them (INLA-style design points; 'auto') or keep their mode ('map')")
    hyper_strategy: typing.Literal["auto", "grid", "ccd"] = option(
        "auto", "design of the hyper-latent integration: grid (d <= 2 under 'auto', up to 3 on request), central "
        "composite design")
    hyper_probe: bool = option(
        False, "after growing a grid design, fit the field at the prior's 1-99% quantiles of each hyper-latent "
        "outside it and grow the grid on to those within its pruning threshold (another mode beyond a valley)")


def options_table(engine_cls):
    """Markdown table of an engine's options (name, type, default, meaning) from its dataclass."""
    hints = _type_hints(engine_cls.Options)
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

