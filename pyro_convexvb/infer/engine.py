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

An engine overrides only :meth:`Engine.solve`, which receives the latent Gaussian model and a
:class:`RunContext`, and returns a :class:`Solution`. Engines that run on the Pyro model itself (Pyro's
SVI, Laplace and NUTS) derive from :class:`ModelEngine`, whose hooks hand :meth:`~ModelEngine.solve` a
:class:`ModelCall` instead; :class:`Engine` itself never asks which kind it is.

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
import time
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch

from ..distributed import broadcast, comm_of, find_comm
from ..errors import ConvergenceError, UnsupportedModelError, warn
from ..lgm.extract import (_unwrap, check_model_data, latent_sites, lgm_from_pyro, proper_missing, subsampled_frame,
                           unconstrained_layout)
from ..lgm.model import LatentGaussianModel
from ..linalg.scalar import _broadcast_shapes
from . import meta
from .options import EngineOptions, LGMEngineOptions, option, options_table
from .result import Criterion, InferenceResult, Optimality, RunContext, Solution
from .rng import cuda_in_use, draw_seed, forked_rng
from .runtime import pyro_runtime_restored
from .type2 import refit_gradient

__all__ = [
    "Engine",
    "ModelEngine",
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


# ---------------------------------------------------------------------------------------------
# the base class
# ---------------------------------------------------------------------------------------------
class Engine:
    """Base class of every inference engine (see the module docstring).

    :param model: a Pyro model, or a :class:`~pyro_convexvb.LatentGaussianModel` (engines on the latent Gaussian
        model; a :class:`ModelEngine` needs the Pyro model).
    :param bool progress: show tqdm progress bars.
    :param init: a state of this engine (``result.state`` of an earlier fit of a model of the same shape) to
        resume from, or ``None``.
    :param options: the engine's options (fields of its :attr:`Options` dataclass).

    Class attributes a subclass sets: ``name`` (registry name), ``description`` (one line),
    ``Options`` (its :class:`EngineOptions` subclass), ``optimality_measure`` (what ``converged`` means, for the
    docs), ``distributed`` (``True`` when it fits row-sharded data, :mod:`pyro_convexvb.distributed`, reducing
    every sum over sites across ranks; an engine left at ``False`` refuses such data rather than fit this rank's
    rows only), and its capabilities ``type2`` and ``integrates_hyper``.

    The hooks that depend on what the engine runs on (:meth:`fits`, :meth:`problem`, :meth:`completed`) are, here,
    those of an engine on the latent Gaussian model extracted from the Pyro model; :class:`ModelEngine`
    overrides them for engines that run on the Pyro model itself. ``takes`` (``"lgm"`` here, ``"model"`` there)
    says which, for readers such as the estimators; it follows the base class and a subclass cannot change it.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
        >>> X = torch.randn(20, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> Engine = pcv.get_engine("dual_vg")
        >>> res = Engine(model, progress=False, gap_tol=1e-9).run(X, y=X.sum(1))
        >>> issubclass(Engine, pcv.Engine), res.engine, res.converged
        (True, 'dual_vg', True)

    A complete engine written from scratch: :mod:`pyro_convexvb.infer.engine`.
    """

    name: ClassVar[str] = ""
    distributed: ClassVar[bool] = False
    description: ClassVar[str] = ""
    Options: ClassVar[type] = EngineOptions
    #: the engine's immutable state type (``result.state``, ``init=``), or ``None`` when it has none
    State: ClassVar[Optional[type]] = None
    #: what :meth:`solve` receives: ``"lgm"`` (a :class:`~pyro_convexvb.LatentGaussianModel`) or, for a
    #: :class:`ModelEngine`, ``"model"`` (a :class:`ModelCall`); read-only (it follows the base class)
    takes: ClassVar[str] = "lgm"
    optimality_measure: ClassVar[str] = ""
    #: how the engine learns the model's ``pyro.param`` sites: ``"outer"`` (a type-II loop around fits,
    #: :mod:`~pyro_convexvb.infer.meta`; its ``Options`` derive from :class:`~.options.Type2Options`), ``"joint"``
    #: (the engine optimises them itself, e.g. SVI), or ``None`` (it leaves them at their values)
    type2: ClassVar[Optional[str]] = None
    #: whether the engine integrates over hyper-latents (:mod:`~pyro_convexvb.infer.hyper`; its ``Options`` derive
    #: from :class:`~.options.LGMEngineOptions`)
    integrates_hyper: ClassVar[bool] = False

    _run_seed = None
    #: whether :meth:`check_data` may skip the data (an inner fit of a run that checked them)
    data_checked = False
    #: dtype of the extracted latent Gaussian model (``None``: the model's own); the hyper-latent path sets
    #: float64 on its inner fits (:mod:`~pyro_convexvb.infer.hyper`)
    extract_dtype = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = next(b.__dict__["takes"] for b in cls.__mro__ if b.__module__ == __name__ and "takes" in b.__dict__)
        if cls.takes != own:
            raise TypeError(f"engine class {cls.__name__}: takes = {cls.takes!r} is set by the base class ({own!r} "
                            "here): derive from pyro_convexvb.ModelEngine for an engine that runs on the Pyro model "
                            "itself, from pyro_convexvb.Engine for one on the latent Gaussian model")

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
        if find_comm(args, kwargs) is not None or comm_of(self.model) is not None:
            seed = int(broadcast(torch.tensor(seed, dtype=torch.int64)))
        return seed

    def __init__(self, model, *, progress=True, init=None, **options):
        if not isinstance(progress, bool):
            raise TypeError(f"engine '{self.name}': progress expects a bool, got {progress!r}")
        if init is not None and (self.State is None or not isinstance(init, self.State)):
            want = f"a {self.State.__name__} (result.state of a '{self.name}' fit)" if self.State else "no state"
            raise TypeError(f"init: engine '{self.name}' resumes from {want}, got {type(init).__name__}"
                            + (f" of engine '{init.engine}'" if hasattr(init, "engine") else ""))
        self.model = model
        self.init = init
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
        """Fit; ``problem`` is what :meth:`problem` made (a :class:`~pyro_convexvb.LatentGaussianModel`, or for a
        :class:`ModelEngine` a :class:`ModelCall`); ``run`` a :class:`RunContext`. Returns a :class:`Solution`."""
        raise NotImplementedError

    def precise_options(self):
        """Options that make the evidence bound accurate enough for finite differences over hyper-latents."""
        return {}

    def inner_engine(self, model, warm=None, **overrides):
        """An engine of the same class and options for ``model`` (e.g. a conditioned model), warm-started from
        ``warm`` (an earlier result on a nearby model: its ``state.warm_start()``), with precise bounds
        (:meth:`precise_options`, except for options the caller set) and the ``overrides``; its ``seed`` is this
        run's, and it does not check the data again (:meth:`check_data`)."""
        opts = self.options.as_dict()
        opts.update({k: v for k, v in self.precise_options().items() if k not in self.given_options})
        init = warm.state.warm_start() if warm is not None and warm.state is not None else None
        if init is not None:  # the state replaces the options that warm-start by hand
            opts.update({k: None for k in init.options})
        if opts.get("seed", 0) is None:  # every inner fit of a run uses the run's seed (common random numbers)
            opts["seed"] = self.run_seed
        opts.update(overrides)
        inner = type(self)(model, progress=False, init=init, **opts)
        inner.data_checked = True  # the data are this run's, checked once by it
        return inner

    def type2_value(self, result):
        """The type-II objective of a fit: the engine's evidence bound (override)."""
        return result.log_evidence_bound

    def envelope_bound(self, result, lgm):
        """The fit's evidence bound as a function of the model's parameters at its fixed optimal state, for envelope
        gradients over hyper-latents (:meth:`~pyro_convexvb.infer.hyper.HyperObjective.gradient`): a 0-d tensor
        carrying ``lgm``'s autograd graph, ``lgm`` the model re-extracted at the same parameters with their graph,
        whose derivative is that of ``result.log_evidence_bound`` because the state maximises that very bound; or
        ``None`` when the engine has no such form (default), and the caller differentiates refits instead."""
        return None

    def type2_gradient(self, params, x, result, args, kwargs, h):
        """``dB/dz`` over the params' unconstrained values ``x`` (default: central differences of refits)."""
        return refit_gradient(self, params, x, result, args, kwargs, max(h, 1e-4))

    # ------------------------------------------------------------------ hooks of what the engine runs on
    @classmethod
    def fits(cls, model, args=(), kwargs=None, lgm=None):
        """``None`` if this engine fits ``model`` with these arguments, else the
        :class:`~pyro_convexvb.UnsupportedModelError` that says where and why not.

        :param lgm: the model's :class:`~pyro_convexvb.LatentGaussianModel` if already extracted (or the
            :class:`~pyro_convexvb.infer.engine.LatentGaussianModel` itself as ``model``).
        """
        kwargs = kwargs or {}
        if isinstance(model, LatentGaussianModel):
            return cls.applies(model)
        if lgm is None:
            try:
                lgm = lgm_from_pyro(model, *args, **kwargs)
            except UnsupportedModelError as e:
                # outside the class, the model may be a latent Gaussian model given a few hyper-latents
                return None if meta.hyper_latents(cls, model, args, kwargs) else e
        return cls.applies(lgm)

    def problem(self, args, kwargs, lgm=None):
        """``(problem, lgm)``: what :meth:`solve` receives for the data ``(*args, **kwargs)`` and the latent
        Gaussian model the result carries: here both are the extracted model (:meth:`extract`; ``lgm`` if given).

        :raises UnsupportedModelError: naming the site and the reason.
        """
        lgm = lgm if lgm is not None else self.extract(*args, **kwargs)
        return lgm, lgm

    def completed(self, post, lgm, args, kwargs):
        """``(posterior, layout)``: the solution's posterior with the latent sites the latent Gaussian model
        integrated out of ``u`` added (``obs_mask`` entries, an affine chain's ``x``), and the layout that names
        its coordinates (``None``: keep the posterior's own)."""
        if lgm is not None and post.n == lgm.n and (getattr(lgm, "imputed", None) or getattr(lgm, "chain", None)
                                                    is not None):
            post = lgm.complete_posterior(post)
        return post, (lgm.layout if post.layout is None and lgm is not None and lgm.n == post.n else None)

    def refusal(self, err, args, kwargs, lgm=None):
        """The refusal ``err`` (an :class:`~pyro_convexvb.UnsupportedModelError`) again, naming this engine;
        ``pcv.fit`` adds the engines that fit the model (:func:`~pyro_convexvb.infer.registry.fit`), from
        ``refused_by`` and ``lgm``."""
        out = UnsupportedModelError(err.site, f"engine '{self.name}' does not apply: {err.reason}")
        out.refused_by, out.lgm = self.name, lgm
        return out

    def extract(self, *args, **kwargs):
        """The latent Gaussian model this engine fits (checked by :meth:`applies`).

        :raises UnsupportedModelError: naming the site and the reason.
        """
        if isinstance(self.model, LatentGaussianModel):
            if args or kwargs:
                raise TypeError(f"engine '{self.name}': a LatentGaussianModel takes no model arguments")
            lgm = self.model
        else:
            try:
                lgm = lgm_from_pyro(self.model, *args, dtype=self.extract_dtype, **kwargs)
            except UnsupportedModelError as e:
                raise self.refusal(e, args, kwargs) from None
        err = self.applies(lgm)
        if err is not None:
            raise self.refusal(err, args, kwargs, lgm=lgm)
        return lgm

    def run(self, *args, **kwargs):
        """Fit the model to its data ``(*args, **kwargs)``; returns an :class:`~pyro_convexvb.InferenceResult`.

        Type-II learning of ``pyro.param`` sites and hyper-latent integration are composed around single fits
        (:meth:`run_once`) by :func:`pyro_convexvb.infer.meta.run`. The fit runs on a fork of the global random
        number generators (torch, NumPy, ``random``), seeded with the ``seed`` option, or without one with a
        seed drawn from the caller's torch stream (see :func:`forked_rng`): the caller's streams are never reset.
        A fit that raises (a Ctrl-C included) leaves Pyro's handler stack and plate dimensions as they were
        (:func:`~pyro_convexvb.infer.runtime.pyro_runtime_restored`).
        """
        with pyro_runtime_restored(), forked_rng(self._resolve_seed(args, kwargs), cuda=cuda_in_use()) as seed:
            self._run_seed = seed
            return meta.run(self, args, kwargs)

    def check_data(self, args, kwargs):
        """Refuse data no engine fits (:func:`~pyro_convexvb.lgm.extract.check_model_data`) and row-sharded data
        an engine without ``distributed`` would fit on this rank's rows only."""
        if self.data_checked:
            return
        self._check_distributed(args, kwargs)
        if not isinstance(self.model, LatentGaussianModel):
            with forked_rng(0):  # its trace's prior draws leave the run's stream where it was
                check_model_data(self.model, args, kwargs)  # (on row-sharded data: a failure raised on every rank)

    def run_once(self, args, kwargs, t0, lgm=None):
        """One fit: the problem (:meth:`problem`: the latent Gaussian model, unless given as ``lgm``, or the
        Pyro model), solve, assemble (:meth:`assemble`); no type-II or hyper-latent routing (:meth:`run` does
        that)."""
        problem, lgm = self.problem(args, kwargs, lgm)
        run = RunContext(self.name, self.progress)
        try:
            sol = self.solve(problem, run)
        finally:
            run.close()
        return self.assemble(sol, run, lgm if lgm is not None else sol.lgm, args, kwargs, t0)

    def _check_distributed(self, args, kwargs):
        """Refuse row-sharded data (``pcv.distributed.row_sharded``) unless the engine reduces its site sums."""
        if type(self).distributed or (find_comm(args, kwargs) is None and comm_of(self.model) is None):
            return
        able = sorted({c.name for c in _subclasses(Engine) if c.distributed and c.name})
        raise NotImplementedError(
            f"engine '{self.name}' cannot fit row-sharded data (pcv.distributed.row_sharded): it would fit this "
            f"rank's rows only. Engines that fit row-sharded data: {', '.join(able) or 'none'}")

    def assemble(self, sol, run, lgm, args, kwargs, t0):
        """The :class:`~pyro_convexvb.InferenceResult` of a :class:`Solution`: the posterior completed (latents
        integrated out of ``u``) and bound to the model and its data, the convergence warning or error."""
        post = sol.posterior
        if post is not None:
            post, layout = self.completed(post, lgm, args, kwargs)
            if callable(self.model) and not isinstance(self.model, LatentGaussianModel):
                post = post.with_model(self.model, (args, kwargs), layout)
            elif layout is not None:
                post = post.with_model(post.model, post.model_args, layout)
        res = InferenceResult(post, sol.log_evidence_bound, run.history, sol.optimality.converged, self.name,
                              sol.info, lgm, seconds=time.perf_counter() - t0, stop_reason=sol.stop_reason,
                              optimality=sol.optimality, hyperparameters=sol.info.get("hyperparameters"),
                              state=sol.state)
        if not res.converged:
            msg = (f"engine '{self.name}' did not converge (stopped by: {sol.stop_reason}): {sol.optimality}"
                   + sol.advice)
            if self.options.on_fail == "raise":
                worst = max((c for c in sol.optimality.criteria if not c.met), key=lambda c: c.value, default=None)
                raise ConvergenceError(msg, residual=None if worst is None else worst.value)
            warn(msg)
        return res

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r}, options={self.options})"


def _wider_mask_or_scale(name, site):
    """The refusal of a latent site whose ``poutine.mask``/``poutine.scale`` (e.g. a row mask around the whole model)
    is wider than its batch shape: its log density would be counted once per entry, which Pyro's own inference
    refuses ('invalid log_prob shape') and its NUTS does silently."""
    batch = tuple(site["fn"].batch_shape)
    for what in ("mask", "scale"):
        t = site.get(what)
        if not torch.is_tensor(t) or t.dim() == 0:
            continue
        try:
            wider = tuple(_broadcast_shapes(t.shape, torch.Size(batch))) != batch
        except RuntimeError:
            wider = True
        if wider:
            return UnsupportedModelError(
                name, f"a poutine.{what} of shape {tuple(t.shape)} reaches this latent site of batch shape {batch}: "
                      f"its log density would count once per {what} entry (Pyro's own inference refuses this: 'invalid "
                      f"log_prob shape'); apply the {what} to the observed sites only (inside their pyro.plate)")
    return None


def _subsampled_local(name, site):
    """The refusal of a latent site inside a plate subsampled by explicit indices, else ``None`` (the model is traced
    with every other plate at full size, so only explicit ``subsample=`` indices leave a plate smaller)."""
    frame = subsampled_frame(site)
    if frame is not None:
        return UnsupportedModelError(name, f"a local latent site inside plate '{frame.name}' subsampled by explicit "
                                           f"indices ({frame.size} of {frame.full_size}; Pyro scales its prior by "
                                           "their ratio), which this engine's guide does not follow")
    return None


def _plate_refusal(name, site, cls):
    """The refusal of a latent site in a sequential ``pyro.plate`` (a Python loop; Pyro's autoguides refuse it) or
    a local latent of a mini-batched plate (``subsample_size``: full-rank guides cannot follow it), for an engine
    class that does not fit it, else ``None``."""
    if not cls.sequential_plates:
        loop = next((f.name for f in site["cond_indep_stack"] if not f.vectorized), None)
        if loop is not None:
            return UnsupportedModelError(name, f"a latent site inside the sequential pyro.plate '{loop}' (a Python "
                                               "loop over the plate), which this engine's Pyro autoguide does not "
                                               "support; write the plate as a vectorised `with pyro.plate(...)`")
    if not cls.mini_batched_locals and site.get("mini_batched_plates"):
        return UnsupportedModelError(name, f"a local latent site inside plate '{site['mini_batched_plates'][0]}', "
                                           "which the model subsamples (subsample_size): this engine's guide "
                                           "couples every latent and cannot follow a mini-batch of them")
    return None


def _untransformable(name, site):
    """The refusal of a latent site whose support Pyro cannot map to unconstrained coordinates (where the engines on
    the Pyro model work), else ``None``."""
    from torch.distributions import biject_to

    support = site["fn"].support
    try:
        biject_to(support)
    except NotImplementedError:
        return UnsupportedModelError(name, f"its support {support} has no transform to unconstrained coordinates "
                                           "(these engines work in Pyro's unconstrained coordinates)")
    return None


class ModelEngine(Engine):
    """Base class of engines that run on the Pyro model itself (Pyro's SVI, Laplace and NUTS, ``diag_mixture``):
    :meth:`solve` receives a :class:`ModelCall`, and the model's latent sites must be continuous
    (:meth:`model_applies`). It overrides the hooks of :class:`Engine` that depend on what the engine runs on
    (:meth:`fits`, :meth:`problem`, :meth:`completed`); an engine of this kind does not integrate over
    hyper-latents (that works on a latent Gaussian model).

    Example::

        >>> import pyro_convexvb as pcv
        >>> [issubclass(pcv.get_engine(name), pcv.ModelEngine) for name in ("laplace", "dual_vg")]
        [True, False]
    """

    takes: ClassVar[str] = "model"
    #: whether the engine fits local latent sites of plates subsampled by explicit indices (``subsample=idx``,
    #: whose prior Pyro scales by ``size / len(idx)``): NUTS samples that log joint as written; the guides of
    #: Laplace and SVI do not follow it (Laplace stopped away from its mode)
    subsampled_locals: ClassVar[bool] = False
    #: whether the engine fits latent sites of sequential plates (``for i in pyro.plate(...)``; Pyro's autoguides
    #: refuse them) and local latent sites of plates the model mini-batches (``subsample_size``)
    sequential_plates: ClassVar[bool] = False
    mini_batched_locals: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.integrates_hyper:
            raise TypeError(f"engine class {cls.__name__}: integrates_hyper needs an engine on the latent Gaussian "
                            "model (pyro_convexvb.Engine), not one that runs on the Pyro model (ModelEngine)")

    @classmethod
    def model_applies(cls, model, args, kwargs):
        """``None`` if the engine fits the Pyro model ``model``, else the
        :class:`~pyro_convexvb.UnsupportedModelError` naming the site.

        The default accepts every model whose latent sites are continuous (the engines of this kind
        work in Pyro's unconstrained coordinates).
        """
        for name, site in latent_sites(model, args, kwargs):
            if getattr(site["fn"].support, "is_discrete", False):
                return UnsupportedModelError(name, "a discrete latent site (this engine needs continuous latents)")
            err = _wider_mask_or_scale(name, site) or _untransformable(name, site) \
                or (None if cls.subsampled_locals else _subsampled_local(name, site)) or _plate_refusal(name, site, cls)
            if err is not None:
                return err
            if getattr(_unwrap(site["fn"])[0], "is_intrinsic", False):
                return UnsupportedModelError(name, "an intrinsic SparseGMRF: its Pyro density is flat along the null "
                                                   "space of its precision, so an engine that runs the Pyro model does "
                                                   "not enforce its constraints (the engines on its latent Gaussian "
                                                   "model do, those that fit its likelihood)")
        return None

    @classmethod
    def fits(cls, model, args=(), kwargs=None, lgm=None):
        """``None`` if this engine fits the Pyro model ``model`` with these arguments (:meth:`model_applies`),
        else the :class:`~pyro_convexvb.UnsupportedModelError` that says where and why not (also for a
        :class:`~pyro_convexvb.LatentGaussianModel`, which is not a Pyro model). ``lgm`` is not needed."""
        if isinstance(model, LatentGaussianModel):
            return UnsupportedModelError("<model>", "this engine runs on a Pyro model")
        return cls.model_applies(model, args, kwargs or {})

    def problem(self, args, kwargs, lgm=None):
        """``(ModelCall, lgm)``: the Pyro model with its data, the unused entries of its ``obs_mask`` sites given a
        proper density (an improper flat one otherwise); ``lgm`` is passed through (the engine's
        :class:`Solution` may carry one it extracted).

        :raises TypeError: for a :class:`~pyro_convexvb.LatentGaussianModel` as the model.
        :raises UnsupportedModelError: when :meth:`model_applies` refuses the model.
        """
        if isinstance(self.model, LatentGaussianModel):
            raise TypeError(f"engine '{self.name}' runs on a Pyro model, not on a LatentGaussianModel")
        err = self.model_applies(self.model, args, kwargs)
        if err is not None:
            raise self.refusal(err, args, kwargs)
        return ModelCall(proper_missing(self.model), args, kwargs, self.model), lgm

    def completed(self, post, lgm, args, kwargs):
        """``(posterior, layout)``: the posterior with the ``obs_mask`` entries the latent Gaussian model integrated
        out added (when the engine found one), named by that model's layout, else by the Pyro model's
        unconstrained latent sites."""
        if lgm is not None and post.n == lgm.n and getattr(lgm, "imputed", None):
            post = lgm.complete_posterior(post)
        elif lgm is None or post.n != lgm.n:  # fitted on problem()'s model: N(0, 1) on the unused obs_mask entries
            post.masked_entries = "standard"
        if post.layout is not None:
            return post, None
        if lgm is not None and lgm.n == post.n:
            return post, lgm.layout
        return post, unconstrained_layout(self.model, args, kwargs)


def _subclasses(cls):
    """Every subclass of ``cls``, recursively."""
    for c in cls.__subclasses__():
        yield c
        yield from _subclasses(c)
