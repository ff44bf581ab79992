r"""The :class:`DualVG` Pyro autoguide (Khan et al. 2013), fitted by the ``dual_vg`` engine (:mod:`.engine`).

The engine's names (``DualVGEngine``, ``DualVGOptions``, ``fit_dual_vg``, ...) live in :mod:`.engine` and are
importable from here as before.
"""
import torch
from torch import nn
from pyro.infer.autoguide import AutoMultivariateNormal
from pyro.nn.module import PyroParam
from torch.distributions import constraints

from ...errors import UnsupportedModelError
from ...posterior.gaussian import GaussianPosterior, _KeepsItsModel
from ..rng import forked_rng
from ..runtime import pyro_runtime_restored
from . import engine
from .bounds import LOGIT_BOUNDS
from .engine import *  # noqa: F401,F403  (the engine's names, importable from here as before)
from .engine import DualState, DualVGEngine, DualVGOptions

__all__ = ["DualVG"] + engine.__all__


class DualVG(_KeepsItsModel, AutoMultivariateNormal):
    r"""A Pyro autoguide fitted through the convex Fenchel dual of the variational-Gaussian bound.

    A full-rank Gaussian guide over the model's latent vector (an :class:`~pyro.infer.autoguide.AutoContinuous`,
    with the parameters of :class:`~pyro.infer.autoguide.AutoMultivariateNormal`: ``loc``, ``scale``,
    ``scale_tril``). :meth:`fit` extracts the latent Gaussian model, minimises the dual objective of
    Khan et al. 2013 (Eq. 20) by Newton's method until the duality gap is below tolerance, and writes the
    optimal ``q`` into the parameters; afterwards the guide samples, gives ``median()``,
    ``quantiles()``, ``get_posterior()``, works with ``Predictive``, and can be trained further with
    ``SVI`` (its parameters live in the Pyro param store).

    :param callable model: a Pyro model that is a latent Gaussian model (Gaussian priors; Bernoulli-logit,
        Bernoulli-probit (``probs=Normal.cdf(...)``), Poisson or Normal likelihoods with affine predictors,
        each also weighted by ``poutine.scale``).
    :param str bound: Bernoulli-logit local bound (``"tight"``, ``"jensen"``, ``"bohning"``, ``"jaakkola"``);
        the other families use their own bounds.
    :param str method: ``"newton"`` or ``"lbfgs"``.
    :param options: further options of the ``dual_vg`` engine (fields of :class:`DualVGOptions`: ``form``,
        ``gap_tol``, ``max_iter``, ``xi``, ...), validated here.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(50, 2, dtype=torch.float64); y = (X[:, 0] > 0).double()
        >>> guide = DualVG(model)
        >>> res = guide.fit(X, y=y)
        >>> guide.median()["w"].shape
        torch.Size([2])
    """

    def __init__(self, model, bound="tight", method="newton", init_scale=0.1, **options):
        if bound not in LOGIT_BOUNDS:
            raise ValueError(f"bound: expected one of {LOGIT_BOUNDS}, got {bound!r}")
        super().__init__(model, init_scale=init_scale)
        self.bound = bound
        self.method = method
        # validated once, here: unknown or ill-typed options fail at construction, naming the option
        self.engine_options = DualVGOptions.create(DualVGEngine.name, dict(options, bound=bound, method=method))
        self.result = None

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        # Pyro's loc is a plain nn.Parameter, read from the module while its recorded param site holds the param
        # store's entry (they part after get_param_store().set_state()); a PyroParam is read through the store
        # (pyro_convexvb.posterior.gaussian._store_backed)
        self.loc = PyroParam(self._parameters["loc"].detach(), constraints.real)

    def _loc_scale(self, *args, **kwargs):
        with self._pyro_context:  # median()/quantiles() read through the param store, as a guide call does
            return super()._loc_scale(*args, **kwargs)

    def fit(self, *args, progress=False, warm_start=True, **kwargs):
        """Minimise the dual for the model's data ``(*args, **kwargs)``; returns the :class:`InferenceResult`.

        :param bool warm_start: start from the dual variables of the previous :meth:`fit` when they fit the new
            data, that is when :meth:`DualState.mismatch` finds none: one dual variable per observed site entry
            (shape ``(N,)``), a Gaussian over the same number of latent coordinates, the same (block or scalar)
            form. Otherwise, and when the model has no plain latent Gaussian form (hyper-latents) or option
            ``alpha0`` is set, the fit starts cold, as with ``warm_start=False``: the optimum is the same, only
            the number of iterations differs. Whatever the fit raises, warm or cold, propagates.
        :raises ValueError: data that give the model another number of latent coordinates than the guide's first
            call (a Pyro autoguide keeps that shape; the guide and its ``result`` are left as they were).
        """
        opts = self.engine_options.as_dict()
        engine = DualVGEngine(self.model, progress=progress, **opts)
        if warm_start and self.result is not None and opts["alpha0"] is None and self._warm_start_fits(
                engine, args, kwargs):
            engine = DualVGEngine(self.model, progress=progress, init=self.result.state, **opts)
        res = engine.run(*args, **kwargs)
        q = res.posterior
        if not isinstance(q, GaussianPosterior):  # a HyperPosterior: the model has hyper-latents
            names = getattr(getattr(q, "space", None), "names", None)
            raise ValueError(f"DualVG: the model has hyper-latents {names}, whose posterior is not a Gaussian over all "
                             "latent sites (a mixture over their design points, or a point mass with hyper='map'), so "
                             "this AutoMultivariateNormal cannot hold it; use pcv.fit(model, ..., engine='dual_vg') "
                             "and res.posterior.as_guide()")
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        if self.latent_dim != q.n:
            raise ValueError(f"DualVG: the guide was built for {self.latent_dim} latent dimensions (by its first call "
                             f"or fit) and these data give the model {q.n}; like every Pyro autoguide it keeps the "
                             "latent shape of its first call: make a new DualVG(model) for these data")
        self._set_from_posterior(q)
        res.info["guide"] = self
        self.result = res
        return res

    def _warm_start_fits(self, engine, args, kwargs):
        """Whether the previous fit's state can warm-start ``engine``'s fit of the data ``(*args, **kwargs)``
        (:meth:`DualState.mismatch` on the model extracted for them; the extraction draws on a forked random
        stream, so the caller's is left as it was). A model outside the latent Gaussian class (one with
        hyper-latents) has no state of this kind to resume: ``False``; the run then fits or refuses it."""
        state = self.result.state
        if not isinstance(state, DualState):
            return False
        try:
            with pyro_runtime_restored(), forked_rng(0):
                lgm = engine.extract(*args, **kwargs)
        except UnsupportedModelError:
            return False
        return state.mismatch(lgm) is None

    def _set_from_posterior(self, q):
        """Write ``q`` into ``loc``, ``scale``, ``scale_tril`` and make the param store hold these values.

        Store entries of the guide's parameter names (e.g. from SVI steps or an earlier fit) are replaced,
        since a :class:`~pyro.nn.PyroModule` would otherwise take the stale store values at its next call.
        """
        from ..posterior import _write_guide_params

        dtype = self.loc.dtype
        L = q.scale_tril().detach().to(dtype)
        diag = torch.diagonal(L).clone()
        _write_guide_params(self, {
            "loc": nn.Parameter(q.loc.detach().clone().to(dtype)),
            "scale": PyroParam(diag, self.scale_constraint),
            "scale_tril": PyroParam(L / diag[:, None], self.scale_tril_constraint),
        })

    @property
    def posterior(self):
        """The fitted :class:`~pyro_convexvb.GaussianPosterior` (after :meth:`fit`)."""
        if self.result is None:
            raise RuntimeError("call fit(...) first")
        return self.result.posterior
