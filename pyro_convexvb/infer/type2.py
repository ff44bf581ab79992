r"""Type-II maximum likelihood for ``pyro.param`` sites: maximise an engine's own evidence bound.

A Pyro model's ``pyro.param`` sites (a prior scale, a noise scale, a GPyTorch kernel registered with
``pyro.module``) are hyperparameters ``theta`` of its latent Gaussian model. An engine with an
evidence bound ``B(theta) = max_s F(s; theta)`` (``s`` its variational state: the dual variables of
``dual_vg``, ``(gamma, u)`` of ``convex_relaxation``) gives the type-II objective, maximised over the
params' unconstrained values (Pyro's ``biject_to`` of each param's constraint) by L-BFGS-B.

Gradients by the envelope theorem: at the engine's optimum ``s*``,
``dB/dtheta = dF(s*; theta)/dtheta`` with ``s*`` held fixed (Khan et al. 2013, §5, for the dual; the same
argument for the relaxation's ``phi``, whose ``gamma*`` and ``u*`` minimise it). The partial derivative is
evaluated by central differences of ``F(s*; theta)``: re-extracting the model at ``theta +- h e_j`` and
evaluating ``F`` at the fixed ``s*`` -- no engine fit per coordinate. Engines whose answer is not an
optimum of their bound (``laplace``: its bound is the variational-Gaussian bound of a Gaussian found
otherwise) use central differences of the refitted bound instead. Every fit is warm-started from the
previous one.
"""
import warnings

import numpy as np
import pyro
import pyro.poutine as poutine
import scipy.optimize
import torch
from torch.distributions import transform_to

from ..errors import ConvergenceWarning, UnsupportedModelError, WarningsOnce
from ..lgm.extract import full_data_plates, lgm_from_pyro

__all__ = ["model_params", "maximize_bound", "central_differences", "envelope_gradient", "refit_gradient"]


def model_params(model, args, kwargs):
    """Names of the ``pyro.param`` sites the model reads (``pyro.module`` parameters included), in trace order."""
    with torch.no_grad(), full_data_plates():
        tr = poutine.trace(model, param_only=True).get_trace(*args, **kwargs)
    return [n for n, s in tr.nodes.items() if s["type"] == "param"]


class _Params:
    """The params ``theta`` as one flat vector ``x`` of their unconstrained values (as Pyro's param store keeps
    them: ``transform_to`` of each param's constraint), handed to the model explicitly.

    :meth:`bind` gives the model at ``x``: ``poutine.substitute`` with the constrained values, so a fit at another
    ``theta`` reads nothing from the global param store (and, with ``requires_grad``, the values carry the graph
    to a leaf ``x`` for envelope gradients). ``pyro.module`` parameters (names with ``$$$``) are read by the
    module from its own tensors, which are the store's: when the model has one, :meth:`bind` writes ``x`` into
    the store instead. :meth:`set` writes ``x`` into the store (the learned values at the end of a fit).
    """

    def __init__(self, names):
        state = pyro.get_param_store().get_state()
        unconstrained = dict(pyro.get_param_store().named_parameters())
        self.names = list(names)
        self.leaves = [unconstrained[n] for n in self.names]
        self.sizes = [p.numel() for p in self.leaves]
        self.transforms = [transform_to(state["constraints"][n]) for n in self.names]
        #: whether the params reach the model through the store (``pyro.module`` parameters) rather than substitute
        self.in_store = any("$$$" in n for n in self.names)
        #: whether autograd through a graph-keeping extraction agreed with finite differences (None: unchecked)
        self.autograd_ok = None
        #: the model's structure trace, shared by the extractions at every ``theta`` (:func:`~.lgm_from_pyro`)
        self.extraction_cache = {}

    def get(self):
        return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in self.leaves])

    def _split(self, x):
        start = 0
        for p, k in zip(self.leaves, self.sizes):
            yield p, x[start:start + k].reshape(p.shape).to(p.dtype)
            start += k

    def set(self, x):
        """Write ``x`` into Pyro's param store."""
        with torch.no_grad():
            for p, v in self._split(torch.as_tensor(x, dtype=torch.float64)):
                p.copy_(v)

    def bind(self, model, x, requires_grad=False):
        """``model`` with the params at ``x``; ``(model, leaf)`` with ``requires_grad`` (``leaf`` the tensor ``x``
        to differentiate by: a fresh one, or with ``pyro.module`` parameters the store's leaves)."""
        if self.in_store:
            self.set(x)
            return (model, self.leaves) if requires_grad else model
        leaf = torch.as_tensor(x, dtype=torch.float64).clone().requires_grad_(requires_grad)
        values = {n: t(v) for n, t, (_, v) in zip(self.names, self.transforms, self._split(leaf))}
        bound = _ModelAt(model, values, self.extraction_cache)
        return (bound, [leaf]) if requires_grad else bound

    def constrained(self):
        return {n: pyro.param(n).detach().clone() for n in self.names}


class _ModelAt:
    """A Pyro model with its params at ``values`` (``poutine.substitute``), carrying the ``extraction_cache`` of a
    type-II run (:func:`~pyro_convexvb.lgm_from_pyro` traces the model's structure once per run)."""

    def __init__(self, model, values, extraction_cache):
        self.model, self.values, self.extraction_cache = model, values, extraction_cache

    def __call__(self, *args, **kwargs):
        with poutine.substitute(data=self.values):
            return self.model(*args, **kwargs)


def _refit(engine, params, x, warm, args, kwargs):
    """One fit of ``engine``'s class at the params ``x``, warm-started from ``warm``; its convergence is reported
    once, by the outer loop."""
    inner = engine.inner_engine(params.bind(engine.model, x), warm, learn_params=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        try:
            return inner.run(*args, **kwargs)
        except ValueError as err:
            if not str(err).startswith("Expected parameter"):  # torch's argument validation, at the params' values
                raise
            raise ValueError(f"type-II learning of {', '.join(repr(n) for n in params.names)}: at a point of the "
                             f"search the model's distribution refuses its arguments ({str(err).splitlines()[0]}); "
                             "the evidence's maximiser likely lies on the boundary of the params' support (a "
                             "singular covariance, a zero scale): give the param a floor, or fix it "
                             "(learn_params=False)") from None


def maximize_bound(engine, names, args, kwargs, *, max_iter=50, gtol=1e-5, fd_step=1e-5, run=None):
    """Maximise ``engine``'s type-II objective over the ``pyro.param`` sites ``names``; the learned values are
    written into Pyro's param store at the end.

    :param engine: an :class:`~pyro_convexvb.infer.engine.Engine` with ``type2_value`` and ``type2_gradient``.
    :param float gtol: convergence: ``max |dB/dz| <= gtol (1 + |B|)`` on the unconstrained scale ``z``.
    :returns: ``(final result, info)`` with the objective history, the gradient norm and the learned values.
    """
    with WarningsOnce().collect():  # every refit would repeat the engine's warnings: each passed on once
        return _maximize_bound(engine, names, args, kwargs, max_iter, gtol, fd_step, run)


class _WarmFrom:
    """A result-like object whose ``state.warm_start()`` is ``init`` (what
    :meth:`~pyro_convexvb.infer.engine.Engine.inner_engine` reads): an inner fit resumes from that state."""

    def __init__(self, init):
        self.state = self
        self._init = init

    def warm_start(self):
        return self._init


def _maximize_bound(engine, names, args, kwargs, max_iter, gtol, fd_step, run):
    params = _Params(names)
    # the first fit resumes from the caller's init (pcv.fit(..., init=res.state)), the later ones from the previous
    state = {"res": None if engine.init is None else _WarmFrom(engine.init), "x": None, "evals": 0}
    bar = run.bar(unit="fit", desc=f"{engine.name} (type-II)") if run is not None else None

    def fit_at(x):
        res = _refit(engine, params, x, state["res"], args, kwargs)
        state["res"], state["x"] = res, x.copy()
        state["evals"] += 1
        if bar is not None:
            bar.update(1)
        return res

    def fun(x):
        res = fit_at(x)
        value = engine.type2_value(res)
        if value is None:
            raise UnsupportedModelError(names[0], f"engine '{engine.name}' gives no evidence bound for this model "
                                                  f"({_no_bound_reason(engine, res)}), and type-II learning maximises "
                                                  "that bound over the pyro.param sites "
                                                  f"{', '.join(repr(n) for n in names)}; pass learn_params=False to "
                                                  "keep them at their values, or learn them with an svi_* engine "
                                                  "(Pyro's SVI, jointly with its guide)")
        grad = engine.type2_gradient(params, x, res, args, kwargs, fd_step)
        if run is not None:
            run.history.record(objective=value, grad_norm=float(np.abs(grad).max()))
        return -value, -grad

    x = params.get().numpy()
    f0, _ = fun(x)  # the gradient test is relative to the bound's size at the start of each run
    nit, left = 0, max_iter
    for _ in range(3):  # a run whose test was scaled by a far larger start (e.g. a prior's density far from its mode)
        opt = scipy.optimize.minimize(fun, x, jac=True, method="L-BFGS-B",
                                      options=dict(maxiter=left, gtol=0.5 * gtol * (1.0 + abs(f0)), ftol=1e-14))
        x, nit, left = opt.x, nit + int(opt.nit), left - int(opt.nit)
        res = fit_at(x) if state["x"] is None or not np.array_equal(state["x"], x) else state["res"]
        value = engine.type2_value(res)
        grad = engine.type2_gradient(params, x, res, args, kwargs, fd_step)
        if float(np.abs(grad).max()) <= gtol * (1.0 + abs(value)) or left <= 0 or abs(value) >= 0.5 * abs(f0):
            break
        f0 = value  # again from here, the test scaled by the bound where it now is
    params.set(x)
    gnorm = float(np.abs(grad).max())
    info = {"learned": params.constrained(), "value": value, "grad_norm": gnorm,
            "gtol": gtol * (1.0 + abs(value)), "iterations": nit, "fits": state["evals"],
            "message": str(opt.message)}
    return res, info


def _no_bound_reason(engine, res):
    """Why a fit reports no evidence bound (the engine's own note where it gives one)."""
    note = (getattr(res, "info", None) or {}).get("bound_note")
    return note or f"{engine.name} reports one only for a latent Gaussian model of moderate size"


def central_differences(f, x, h):
    """Central differences of the scalar function ``f`` of a NumPy vector at ``x`` (step ``h (1 + |x_j|)``)."""
    g = np.zeros_like(x)
    for j in range(x.shape[0]):
        step = h * (1.0 + abs(x[j]))
        e = np.zeros_like(x)
        e[j] = step
        g[j] = (f(x + e) - f(x - e)) / (2 * step)
    return g


def envelope_gradient(params, x, model, args, kwargs, value_at_fixed_state, h, autograd=False):
    """``dF(s*; theta)/dz`` at the fixed state ``s*``: autograd or central differences over the params.

    :param value_at_fixed_state: ``lgm -> F(s*; theta)`` for the model extracted at other params (a 0-d
        tensor carrying the graph when ``autograd``).
    :param bool autograd: differentiate a graph-keeping extraction (:func:`~pyro_convexvb.lgm_from_pyro`
        with ``keep_graph=True``); the first such gradient of a type-II run is checked against a central
        difference along a random direction, and central differences over every param are used from
        then on when they disagree (a dependence on the params that the graph does not carry, e.g. a
        design built from a param) or when the extraction cannot keep the graph (a param in the mean of an
        affine Gaussian chain's child).
    """
    def f(xx):
        with torch.no_grad():
            return float(value_at_fixed_state(lgm_from_pyro(params.bind(model, xx), *args, **kwargs)))

    try:
        if autograd and params.autograd_ok is not False:
            bound, leaves = params.bind(model, x, requires_grad=True)
            try:
                lgm = lgm_from_pyro(bound, *args, keep_graph=True, **kwargs)
            except UnsupportedModelError:  # a graph the extraction cannot keep (a param in a chain's mean)
                params.autograd_ok = False
                return central_differences(f, x, h)
            val = value_at_fixed_state(lgm)
            grads = torch.autograd.grad(val, leaves, allow_unused=True) if val.requires_grad else [None] * len(leaves)
            g = np.concatenate([np.zeros(p.numel()) if gr is None else gr.detach().reshape(-1).double().numpy()
                                for p, gr in zip(leaves, grads)])
            if params.autograd_ok:
                return g
            # the first time: check the graph against a central difference along a random direction
            d = np.random.default_rng(len(x)).standard_normal(x.shape[0])
            d /= np.linalg.norm(d)
            step = 1e-4
            fd = (f(x + step * d) - f(x - step * d)) / (2 * step)
            gd = float(g @ d)
            params.autograd_ok = abs(fd - gd) <= 1e-4 * (abs(fd) + abs(gd)) + 1e-7 * (1.0 + abs(float(val.detach())))
            if params.autograd_ok:
                return g
        return central_differences(f, x, h)
    finally:
        if params.in_store:
            params.set(x)


def refit_gradient(engine, params, x, res, args, kwargs, h):
    """``dB/dz`` by central differences of the bound refitted at ``theta +- h e_j`` (warm-started from ``res``)."""
    try:
        return central_differences(lambda xx: engine.type2_value(_refit(engine, params, xx, res, args, kwargs)), x, h)
    finally:
        if params.in_store:
            params.set(x)
