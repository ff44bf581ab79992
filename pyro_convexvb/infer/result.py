"""What an engine's run produces: its :class:`Solution` (posterior, bound, :class:`Optimality`), the run's
:class:`History` and progress bars (:class:`RunContext`), and the :class:`InferenceResult` handed to the user."""
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

__all__ = ["History", "InferenceResult", "WorkReport", "Criterion", "Optimality", "Solution", "RunContext"]


class History(dict):
    """Per-iteration records: ``history["objective"]``, ``history["seconds"]``, ``history["mvm"]``, ...

    Each key maps to a list; :meth:`record` appends one iteration and the wall seconds since
    the history was created. Keys are also attributes (``history.objective``).

    Example::

        >>> from pyro_convexvb.infer.result import History
        >>> h = History()
        >>> h.record(objective=-3.2, mvm=4); h.record(objective=-3.1, mvm=4)
        >>> h.objective, h["mvm"], len(h.seconds)
        ([-3.2, -3.1], [4.0, 4.0], 2)
    """

    def __init__(self):
        super().__init__()
        self._t0 = time.perf_counter()

    def record(self, **values):
        values.setdefault("seconds", time.perf_counter() - self._t0)
        for k, v in values.items():
            if hasattr(v, "detach"):
                v = v.detach()
            self.setdefault(k, []).append(float(v) if hasattr(v, "__float__") else v)

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e


@dataclass
class InferenceResult:
    """What ``pcv.fit`` (and every engine) returns.

    :ivar posterior: the approximate posterior (a :class:`~pyro_convexvb.GaussianPosterior`, or a
        mixture posterior for mixture guides) over the flat latent vector.
    :ivar log_evidence_bound: a lower bound on ``log p(y)`` of the model as written (every
        normalising constant included), or ``None`` for engines without one (e.g. NUTS).
    :ivar history: per-iteration objective, wall seconds and MVM counts (:class:`History`).
    :ivar converged: whether the engine's optimality measure (``optimality``) is within its tolerance.
    :ivar engine: registry name of the engine.
    :ivar info: engine-specific extras (site marginals, variational parameters, samples, ...).
    :ivar lgm: the :class:`~pyro_convexvb.LatentGaussianModel` the engine worked on, if any.
    :ivar seconds: wall time of the fit.
    :ivar stop_reason: which rule stopped the engine (e.g. ``"duality gap"``, ``"max_steps"``, ``"plateau"``).
    :ivar optimality: the engine's :class:`~pyro_convexvb.infer.engine.Optimality` measure at the answer.
    :ivar hyper: for models with hyper-latents, their names, mode and marginals (``None`` otherwise).
    :ivar hyperparameters: the learned ``pyro.param`` values (type-II maximum likelihood), ``None`` otherwise.
    :ivar state: the engine's immutable state at the answer (e.g. ``RelaxationState``, ``DualState``), from which
        ``pcv.fit(..., init=result.state)`` resumes; ``None`` for engines without one.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(40, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> y = (X[:, 0] > 0).double()
        >>> res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
        >>> res.converged, res.engine, res.posterior.loc.shape
        (True, 'dual_vg', torch.Size([2]))
        >>> [str(c.name) for c in res.optimality.criteria], res.log_evidence_bound < 0
        (['duality gap (nats)'], True)
        >>> len(res.history.objective) > 0, res.state is not None
        (True, True)
    """

    posterior: Any
    log_evidence_bound: Optional[float]
    history: History = field(default_factory=History)
    converged: bool = True
    engine: str = ""
    info: Dict[str, Any] = field(default_factory=dict)
    lgm: Any = None
    seconds: float = 0.0
    stop_reason: str = ""
    optimality: Any = None
    hyper: Any = None
    hyperparameters: Any = None
    state: Any = None

    def compact(self, keep_model=True):
        """A copy without the training data, whose size does not grow with the number of data rows.

        Drops ``lgm``, ``state`` (of data size), the posterior's fitting data (:meth:`GaussianPosterior.compact`, or
        the same for mixture posteriors), and every ``info`` entry that is not plain (``None``, ``bool``, ``int``,
        ``float``, ``str``, or lists/tuples/dicts of them), listed in ``info["dropped"]``.  Pickled estimators keep
        this form of their ``result_``.

        :param bool keep_model: keep the posterior's Pyro model callable.
        :returns: a new :class:`InferenceResult` (``self`` is unchanged).

        Example::

            >>> import torch, pyro_convexvb as pcv
            >>> q = pcv.GaussianPosterior(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
            >>> r = InferenceResult(q, -1.0, info={"site_var": torch.ones(10**5), "iterations": 7})
            >>> c = r.compact()
            >>> sorted(c.info), c.info["dropped"]
            (['dropped', 'iterations'], ['site_var'])
        """
        import dataclasses

        info = self.info_to_store()
        post = self.posterior
        if post is not None:
            post = post.compact(keep_model=keep_model)
        return dataclasses.replace(self, posterior=post, info=info, lgm=None, state=None)

    def info_to_store(self, convert=None, dropped=()):
        """The ``info`` of a stored copy (:meth:`compact`, ``pcv.save``): each entry as ``convert(key, value)``
        returns it, the entries it refuses with :class:`TypeError` left out, and ``info["dropped"]`` listing them
        with ``dropped`` (other parts the caller left out) and whatever an earlier copy had left out.

        :param convert: ``convert(key, value) -> stored value``; default: the value itself when it is plain
            (``None``, ``bool``, ``int``, ``float``, ``str``, or lists/tuples/dicts of them), else ``TypeError``.
        :param dropped: names of other parts left out (e.g. ``"hyper"``).
        :returns: a new ``dict`` (``self.info`` is unchanged).

        Example::

            >>> r = InferenceResult(None, None, info={"site_var": object(), "iterations": 7})
            >>> r.info_to_store(dropped=["hyper"])
            {'iterations': 7, 'dropped': ['hyper', 'site_var']}
        """
        convert = _plain if convert is None else convert
        kept, out = {}, list(dropped) + list(self.info.get("dropped", []))
        for k, v in self.info.items():
            if k == "dropped":
                continue
            try:
                kept[k] = convert(k, v)
            except TypeError:
                out.append(k)
        kept["dropped"] = sorted(set(out))
        return kept

    # ------------------------------------------------------------ diagnostics (pyro_convexvb.diagnostics)
    @property
    def from_draws(self):
        """Whether the posterior is a Gaussian summary of a sampler's draws (kept in ``info["samples"]``)."""
        return "samples" in (self.info or {})

    @property
    def diagnostics(self):
        """PSIS diagnostic of the posterior (:class:`~pyro_convexvb.diagnostics.ImportanceDiagnostics`: ``k_hat``,
        importance ESS, an importance estimate of ``log p(y)``), computed on first access from 500 draws (one model
        evaluation each) and cached; warns (:class:`~pyro_convexvb.diagnostics.ApproximationWarning`) when ``k_hat``
        says the approximation is unreliable. See ``docs/diagnostics.md``."""
        d = self.__dict__.get("_diagnostics")
        if d is None:
            from ..diagnostics import diagnose

            d = diagnose(self)
            self.__dict__["_diagnostics"] = d
        return d

    @property
    def correction(self):
        """The :class:`~pyro_convexvb.diagnostics.CorrectedPosterior` of ``pcv.fit(..., correct="psis")`` or of the
        last :meth:`corrected` call, else ``None``."""
        return self.__dict__.get("_correction")

    def corrected(self, num_draws=None, seed=0, *, proposal="auto", probs=(0.05, 0.5, 0.95), progress=False,
                  estimator="cv", adapt="auto", adaptation="affine", shrink=None, warn=True, regrid=True):
        """Importance-corrected means, sds and quantiles with Monte Carlo errors
        (:func:`pyro_convexvb.diagnostics.correct`, which documents every option; default 2000 draws a round). Also
        stored as :attr:`correction`."""
        from ..diagnostics import correct
        from ..diagnostics.importance import CORRECTION_DRAWS

        c = correct(self, CORRECTION_DRAWS if num_draws is None else num_draws, seed, proposal=proposal,
                    probs=probs, progress=progress, estimator=estimator, adapt=adapt, adaptation=adaptation,
                    shrink=shrink, warn=warn, regrid=regrid)
        self.__dict__["_correction"] = c
        return c

    def loo(self, num_draws=None, seed=0, **kwargs):
        """PSIS-LOO, WAIC, CPO and PIT of the fit (:func:`pyro_convexvb.diagnostics.loo`)."""
        from ..diagnostics import loo

        return loo(self, num_draws=num_draws, seed=seed, **kwargs)

    def to_arviz(self, num_draws=None, seed=0, **kwargs):
        """An ``arviz.InferenceData`` of the fit (:func:`pyro_convexvb.diagnostics.to_arviz`; needs ``arviz``)."""
        from ..diagnostics import to_arviz

        return to_arviz(self, num_draws=num_draws, seed=seed, **kwargs)

    @property
    def iterations(self):
        """The engine's own iteration count: ``info["iterations"]`` (``dual_vg``'s steps, ``convex_relaxation``'s outer
        updates, ``laplace``'s Newton steps (L-BFGS iterations with ``method="lbfgs"``), ``nuts``'s steps with warm-up)
        or ``info["steps"]`` (the SVI steps, whose history has a row per window of steps only), else the rows of
        :attr:`history`. For a type-II result (``learn_params``) that is the count of the last fit, at the learned
        values; the type-II loop's own is :attr:`type2_iterations`."""
        for key in ("iterations", "steps"):
            if self.info.get(key) is not None:
                return int(self.info[key])
        return len(self.history.get("seconds", ())) if self.history is not None else 0

    @property
    def work(self):
        """The fit's :class:`WorkReport` (Newton steps, CG iterations, seconds by loop) for the engines that count
        their work so (``convex_relaxation``), else ``None``."""
        return self.info.get("work")

    @property
    def type2_objective(self):
        """The objective a type-II fit maximised over the learned ``pyro.param`` values (the engine's own:
        :meth:`~pyro_convexvb.infer.engine.Engine.type2_value`), at those values; ``None`` without type-II."""
        report = self.info.get("type2")
        return None if report is None else float(report["value"])

    @property
    def type2_iterations(self):
        """The iterations of a type-II fit's outer optimiser (L-BFGS-B over the learned ``pyro.param`` values,
        :func:`~pyro_convexvb.infer.type2.maximize_bound`; each iteration refits the model one or more times);
        ``None`` without type-II."""
        report = self.info.get("type2")
        return None if report is None else int(report["iterations"])

    def __repr__(self):
        b = "None" if self.log_evidence_bound is None else f"{self.log_evidence_bound:.6g}"
        return (f"InferenceResult(engine={self.engine!r}, log_evidence_bound={b}, converged={self.converged}, "
                f"stop_reason={self.stop_reason!r}, seconds={self.seconds:.3g}, posterior={self.posterior!r})")


@dataclass(frozen=True)
class WorkReport:
    """The work of one double-loop fit (Nickisch & Seeger 2009, §2.2): inner loops (Newton with CG) and variance
    (outer) steps.

    :ivar newton_steps: Newton steps over all inner loops.
    :ivar cg_iterations: CG iterations over all of their Newton systems.
    :ivar inner_seconds: wall seconds in the inner loops; :ivar outer_seconds: in the variance steps.
    """

    newton_steps: int
    cg_iterations: int
    inner_seconds: float
    outer_seconds: float


def _plain(key, v):
    """``v`` if it is plain (:func:`_is_plain`), else :class:`TypeError` naming ``key``."""
    if not _is_plain(v):
        raise TypeError(f"info[{key!r}] is not plain data")
    return v


def _is_plain(v, depth=0):
    """Whether ``v`` is a plain value (``None``, bool, int, float, str, or lists/tuples/dicts of them)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if depth > 4:
        return False
    if isinstance(v, (list, tuple)):
        return all(_is_plain(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_plain(x, depth + 1) for k, x in v.items())
    return False


@dataclass(frozen=True)
class Criterion:
    """One optimality criterion: ``value <= tol`` (a NaN or infinite value never passes).

    Example::

        >>> import pyro_convexvb as pcv
        >>> pcv.Criterion("duality gap (nats)", 3e-9, 1e-8).met, pcv.Criterion("gap", float("nan"), 1e-8).met
        (True, False)
    """

    name: str
    value: float
    tol: float

    @property
    def met(self):
        return math.isfinite(self.value) and self.value <= self.tol

    def __str__(self):
        # three significant digits, more where those would print a value that misses its tolerance as equal to it
        # (an R-hat of 1.0104 against 1.01)
        for digits in range(3, 11):
            v, t = f"{self.value:.{digits}g}", f"{self.tol:.{digits}g}"
            if v != t or self.value == self.tol:
                break
        return f"{self.name} = {v} (tol {t})"


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
    :ivar state: the engine's immutable state at the answer (its :attr:`Engine.State`), from which a fit resumes.
    :ivar advice: when the engine did not converge, what to do (``"; ..."``, appended to the warning or error;
        ``""``: nothing beyond the optimality measure).

    Example::

        >>> import torch, pyro_convexvb as pcv
        >>> q = pcv.GaussianPosterior(torch.zeros(2), torch.ones(2))
        >>> sol = pcv.Solution(q, None, pcv.Optimality.exact(), "closed form")
        >>> sol.stop_reason, sol.optimality.converged
        ('closed form', True)

    A complete engine that returns one: :mod:`pyro_convexvb.infer.engine`.
    """

    posterior: Any
    log_evidence_bound: Optional[float]
    optimality: Optimality
    stop_reason: str
    info: Dict[str, Any] = field(default_factory=dict)
    lgm: Any = None
    state: Any = None
    advice: str = ""


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

