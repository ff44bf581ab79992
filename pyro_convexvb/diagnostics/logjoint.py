r"""The model's log joint density, evaluated through the Pyro model as written.

For draws of every latent site in Pyro's unconstrained coordinates (``biject_to`` of each support, as the
posteriors are packed), :class:`ModelLogJoint` returns

.. math:: \log p(y, x) = \log p\big(y, T(x)\big) + \log\left|\det \partial T(x) / \partial x\right|,

with every normalising constant (the model's ``log_prob_sum`` under ``poutine.condition``, every plate at
its full size), and, on request, the pointwise log-likelihood of each observation, its predictive CDF (for
PIT values) and a replicated observation.

**Batching.** The model is traced once per draw, vectorised over draws with ``torch.func.vmap`` (chunks of 64
draws; distribution argument validation is off, as ``vmap`` cannot branch on data, and GPyTorch kernels run in
GPyTorch's ``trace_mode``, without custom autograd functions, with a ``torch.equal`` that compares batched inputs,
:func:`_gpytorch_traceable`): the model runs as
written -- ``X @ w`` sees one ``w`` -- and the cost is that of a few traces. On the first evaluation the vmapped
log joint and pointwise log-likelihoods are checked against plain traces of two draws; a model that ``vmap``
cannot run (data-dependent Python control flow, ``.item()``, samplers without batching rules), or whose
vmapped values disagree, is evaluated by the plain loop, one trace per draw (about 50 times slower: 2 ms per draw
on a small logistic regression, against 0.04 ms vectorised).
"""
import contextlib
import functools
import math
import warnings

import numpy as np
import pyro
import pyro.poutine as poutine
import torch
from torch.distributions import biject_to

from ..lgm.extract import ObsMaskMessenger

__all__ = ["ModelLogJoint", "model_of"]


class _UnmaskImputed(ObsMaskMessenger):
    """The entries of an ``obs_mask`` site's ``<name>_unobserved`` latent that the model masks out (those at observed
    positions) get the site's own conditional density instead of none.

    They have no density in the model, while a proposal (the completed posterior) draws them from exactly that
    conditional given the field: the ratio ``p / q`` then carried ``1 / q`` of every such entry and its weights
    degenerated (k_hat 2.5 on an exact fit). With the density the target is ``p(y, x) prod_i p(z_i | x)`` on the
    extended space, a proper auxiliary factor whose marginal is the model's, so every importance estimate of the
    model's variables is unchanged in expectation and the masked entries cancel for the fitted proposal.
    """

    def _imputed(self, msg):
        msg["mask"] = None


@contextlib.contextmanager
def _gpytorch_traceable():
    """When a model may use GPyTorch (it is imported): GPyTorch's ``settings.trace_mode``, so that its kernels
    compute with plain tensor operations instead of custom autograd functions (``RBFCovariance``), and a
    ``torch.equal`` that compares vmapped tensors (:func:`_batched_equal`), which every kernel calls on its inputs
    (``covar_dist``) and which ``torch.func.vmap`` has no rule for: a kernel of a hyper-latent (``x / ell``) was
    evaluated one trace per draw, 50 times slower. The kernels' values are the same and nothing of them is changed;
    ``torch.equal`` is restored on exit and behaves as before on plain tensors."""
    import sys

    gpytorch = sys.modules.get("gpytorch")
    if gpytorch is None:
        yield
        return
    plain = torch.equal
    torch.equal = functools.partial(_batched_equal, plain)
    try:
        with gpytorch.settings.trace_mode(True):
            yield
    finally:
        torch.equal = plain


def _batched_equal(plain, a, b):
    """``torch.equal(a, b)`` where either may be a tensor batched by ``torch.func.vmap``: ``True`` when the two are
    equal for every draw of the batch (a plain tensor is compared with each draw). GPyTorch takes its ``x1 == x2``
    shortcut (a zero diagonal) only then, so a batch of mixed draws takes the general path, right for all."""
    from torch._C import _functorch as ft

    batched = [t for t in (a, b) if ft.is_batchedtensor(t)]
    if not batched:
        return plain(a, b)
    level = ft.maybe_get_level(batched[0])
    size = ft.get_unwrapped(batched[0]).shape[ft.maybe_get_bdim(batched[0])]

    def whole(t):
        if not ft.is_batchedtensor(t):
            return t.unsqueeze(0).expand(size, *t.shape)
        if ft.maybe_get_level(t) != level:
            raise RuntimeError("torch.equal on tensors of two vmap levels")
        return ft.get_unwrapped(t).movedim(ft.maybe_get_bdim(t), 0)

    return plain(whole(a), whole(b))


@contextlib.contextmanager
def _unvalidated():
    """Pyro's and torch's distribution argument checks off (both batched and draw-by-draw evaluation): ``vmap``
    cannot branch on data, and one draw at a time the checks took a third of the time. The fit has already checked
    the model's observations and supports, and the draws are mapped into each support by ``biject_to``."""
    old = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        with pyro.validation_enabled(False), _gpytorch_traceable():
            yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(old)


def _is_deterministic(site):
    """A ``pyro.deterministic`` site (Pyro records it as an observed ``Delta``; ``obs_mask`` ends with one): not an
    observation."""
    return bool((site.get("infer") or {}).get("_deterministic"))


def _base(fn):
    """The distribution under ``Independent``, ``MaskedDistribution`` and ``ExpandedDistribution`` wrappers, which
    leave each element's distribution unchanged.

    Other wrappers with a ``base_dist`` change it (``LogNormal`` and ``HalfNormal`` transform a ``Normal``,
    ``ZeroInflatedPoisson`` mixes a ``Poisson`` with a point mass) and are returned as they are, so that
    :func:`_cdf_parts` gives them their own CDF (or none), never their base's.
    """
    from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution

    while isinstance(fn, (torch.distributions.Independent, MaskedDistribution, ExpandedDistribution)):
        fn = fn.base_dist
    return fn


def _observed_entries(site, shape):
    """``(prod(shape),)`` bool array of the entries of an observed site that the model scores (``None``: all).

    An entry is dropped when ``poutine.mask`` (the site's ``mask``) or the distribution's own ``.mask(m)``
    (``MaskedDistribution``, outside any ``.to_event``) masks it out: its log density is then 0 whatever the draw,
    so it is no observation.
    """
    from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution

    fn = site["fn"]
    keep = torch.ones(shape, dtype=torch.bool)
    masks = [site.get("mask")]
    d = fn
    while isinstance(d, (MaskedDistribution, ExpandedDistribution)):  # masks below .to_event cover parts of events
        if isinstance(d, MaskedDistribution):
            masks.append(d._mask)
        d = d.base_dist
    changed = False
    for m in masks:
        if m is None or m is True:
            continue
        changed = True
        if m is False:
            keep = torch.zeros_like(keep)
        else:
            keep = keep & torch.as_tensor(m, device="cpu").bool().expand(shape)
    return keep.reshape(-1).numpy().copy() if changed else None


def _cdf_parts(fn, y):
    """``(kind, tensors)`` for the CDF of an observation family at ``y`` (elementwise), or ``None`` for a family
    without one here. ``kind == "pair"``: the tensors are ``(P(Y < y), P(Y = y))``, computed in torch (inside the
    vectorised model run); otherwise the family's parameters broadcast to ``y``, for :func:`_cdf_from_parts` to
    evaluate with :mod:`scipy.special` after the run (torch has no incomplete beta function): ``"student_t"``
    ``(y, df, loc, scale)``, ``"binomial"`` ``(y, n, p)``, ``"negative_binomial"`` ``(y, r, p)`` (failures ``y``
    before the ``r``-th success of probability ``p``), ``"zi_negative_binomial"`` ``(y, r, p, gate)``."""
    import pyro.distributions as dist

    td = torch.distributions
    b = _base(fn)
    zero = torch.zeros_like(y)
    if isinstance(b, td.Normal):
        return "pair", (b.cdf(y), zero)
    if isinstance(b, td.LogNormal):  # P(Y < y) = Phi((log y - loc) / scale), y > 0
        pos = y > 0
        z = (torch.log(torch.where(pos, y, torch.ones_like(y))) - b.loc) / b.scale
        return "pair", (torch.where(pos, td.Normal(0.0, 1.0).cdf(z), zero), zero)
    if isinstance(b, td.HalfNormal):
        return "pair", (torch.where(y > 0, torch.erf(y.clamp_min(0) / (b.scale * math.sqrt(2.0))), zero), zero)
    if isinstance(b, td.Laplace):
        return "pair", (b.cdf(y), zero)
    if isinstance(b, td.Gamma):  # regularised lower incomplete gamma P(a, rate y)
        return "pair", (torch.special.gammainc(b.concentration, (b.rate * y).clamp_min(0)), zero)
    if isinstance(b, td.Exponential):
        return "pair", (-torch.expm1(-b.rate * y.clamp_min(0)), zero)
    if isinstance(b, td.Bernoulli):
        p1 = b.probs
        return "pair", (torch.where(y > 0.5, 1 - p1, torch.zeros_like(p1)), torch.where(y > 0.5, p1, 1 - p1))
    if isinstance(b, td.Poisson):
        return "pair", _poisson_pair(b.rate, y)
    if isinstance(b, dist.ZeroInflatedNegativeBinomial):  # gate g: a point mass at 0, else negative binomial
        nb = b.base_dist
        return "zi_negative_binomial", torch.broadcast_tensors(y, nb.total_count, 1 - nb.probs, b.gate)
    if isinstance(b, dist.ZeroInflatedPoisson):  # gate g: a point mass at 0, else Poisson
        return "pair", _zero_inflated(b.gate, y, *_poisson_pair(b.base_dist.rate, y))
    if isinstance(b, td.StudentT):
        return "student_t", torch.broadcast_tensors(y, b.df, b.loc, b.scale)
    if isinstance(b, td.Binomial):
        return "binomial", torch.broadcast_tensors(y, b.total_count, b.probs)
    if isinstance(b, td.NegativeBinomial):  # torch counts successes of probability probs before total_count failures
        return "negative_binomial", torch.broadcast_tensors(y, b.total_count, 1 - b.probs)
    if isinstance(b, dist.GammaPoisson):  # Poisson with a Gamma(concentration, rate) mean
        return "negative_binomial", torch.broadcast_tensors(y, b.concentration, b.rate / (1 + b.rate))
    return None


def _poisson_pair(rate, y):
    rate = rate.expand_as(y)
    at = torch.exp(torch.xlogy(y, rate) - rate - torch.lgamma(y + 1))
    # P(Y <= y) = Q(y + 1, rate), the regularised upper incomplete gamma function
    return torch.special.gammaincc(y + 1, rate) - at, at


def _zero_inflated(gate, y, below, at):
    """``(P(Y < y), P(Y = y))`` of a point mass at 0 of probability ``gate`` mixed with a count distribution whose
    pair is ``(below, at)`` (torch tensors or numpy arrays alike)."""
    return (1 - gate) * below + gate * (y > 0), (1 - gate) * at + gate * (y == 0)


def _cdf_from_parts(kind, parts):
    """``(P(Y < y), P(Y = y))`` numpy arrays from :func:`_cdf_parts`' ``kind`` and its tensors as arrays."""
    from scipy import special, stats

    if kind == "pair":
        return parts
    if kind == "student_t":
        y, df, loc, scale = parts
        return special.stdtr(df, (y - loc) / scale), np.zeros_like(y)
    if kind == "zi_negative_binomial":
        y, n, p, g = parts
        return _zero_inflated(g, y, *_cdf_from_parts("negative_binomial", (y, n, p)))
    y, n, p = parts
    if kind == "binomial":
        return stats.binom.cdf(y - 1, n, p), stats.binom.pmf(y, n, p)
    if kind == "negative_binomial":
        return stats.nbinom.cdf(y - 1, n, p), stats.nbinom.pmf(y, n, p)
    raise ValueError(f"unknown CDF kind {kind!r}")


def _cdf_pair(fn, y):
    """``(P(Y < y), P(Y = y))`` (float64 tensors) elementwise for the supported observation families, else
    ``None`` (:func:`_cdf_parts`)."""
    out = _cdf_parts(fn, y)
    if out is None:
        return None
    kind, parts = out
    pair = _cdf_from_parts(kind, tuple(np.asarray(t.detach().double().cpu()) for t in parts))
    return tuple(torch.as_tensor(a, dtype=torch.float64) for a in pair)


def model_of(result):
    """``(model, args, kwargs)`` of a result fitted on a Pyro model, whose log joint the diagnostics evaluate."""
    post = result.posterior
    if getattr(post, "data_dropped", False):
        raise ValueError("importance diagnostics (diagnostics, corrected(), loo(), to_arviz()) evaluate the model's "
                         "log joint on its data, which this result left out (InferenceResult.compact(), a pickled "
                         "estimator's result_, a result read back by pcv.load): run them on the fitted result "
                         "before compacting or saving it")
    model = getattr(post, "model", None)
    if model is None or not callable(model):
        raise ValueError("importance diagnostics evaluate the Pyro model's log joint: this result was not fitted on "
                         "a Pyro model (a LatentGaussianModel has no model to evaluate); fit the Pyro model instead")
    args, kwargs = getattr(post, "model_args", ((), {}))
    from ..distributed import find_comm

    if find_comm(args, kwargs) is not None:
        raise ValueError("importance diagnostics (diagnostics, corrected(), loo(), to_arviz()) evaluate the model's "
                         "log joint on this process's rows only: on a fit to row-sharded data they would weigh the "
                         "posterior of all rows against one shard's likelihood (and differ between ranks); run them "
                         "in one process on all rows")
    return model, args, kwargs


class ModelLogJoint:
    """Evaluate ``log p(y, x)`` of a Pyro model at draws ``x`` of its latent sites (unconstrained coordinates).

    A model that ``torch.func.vmap`` cannot run is evaluated draw by draw, with a ``RuntimeWarning`` naming why.

    :param model: the Pyro model.
    :param tuple args: its positional arguments; ``kwargs`` its keyword arguments (the data).
    :param bool vectorise: try ``torch.func.vmap`` over draws (checked against plain traces on first use).
    :param str masked: the density of the unused (masked-out) entries of ``obs_mask`` sites' ``<name>_unobserved``
        latents, which the model leaves without one: ``"conditional"``, the site's own (:class:`_UnmaskImputed`, as
        a completed latent-Gaussian posterior draws them), or ``"standard"``, ``Normal(0, 1)`` in unconstrained
        coordinates (the proper joint the Pyro-model engines fit, whose posteriors draw them so). Either is a proper
        auxiliary factor with the model's marginal; the one the proposal used cancels in the ratios.

    :ivar float offset: a constant added to every ``log_joint`` (0 by default): the log Jacobian of the coordinates
        the draws' densities refer to, when they are not the model's own (constrained fields in free coordinates,
        :mod:`~pyro_convexvb.diagnostics.constrained`).

    Example::

        >>> import pyro, pyro.distributions as dist
        >>> def model(y=None):
        ...     s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64)))
        ...     pyro.sample("y", dist.Normal(torch.tensor(0.0, dtype=torch.float64), s), obs=y)
        >>> lj = ModelLogJoint(model, (), {"y": torch.tensor(0.5, dtype=torch.float64)})
        >>> out = lj.evaluate({"s": torch.zeros(3, dtype=torch.float64)})   # s = exp(0) = 1
        >>> exact = dist.HalfNormal(1.).log_prob(torch.tensor(1.)) + dist.Normal(0., 1.).log_prob(torch.tensor(0.5))
        >>> abs(float(out["log_joint"][0]) - float(exact)) < 1e-6     # log|d s / d log s| = log 1 = 0
        True
    """

    def __init__(self, model, args=(), kwargs=None, *, vectorise=True, masked="conditional"):
        from ..lgm.extract import latent_sites, proper_missing

        if masked not in ("conditional", "standard"):
            raise ValueError(f"masked: expected 'conditional' or 'standard', got {masked!r}")
        wrap = _UnmaskImputed.wrap if masked == "conditional" else proper_missing
        self.model, self.args, self.kwargs = wrap(model), tuple(args), dict(kwargs or {})
        self._model_name = getattr(model, "__name__", type(model).__name__)
        sites = latent_sites(model, self.args, self.kwargs)
        self.names = [n for n, _ in sites]
        self.transforms = {n: biject_to(s["fn"].support) for n, s in sites}
        self.shapes = {n: tuple(s["value"].shape) for n, s in sites}
        #: ``None`` until the first evaluation decides, then whether ``torch.func.vmap`` runs the model
        self.vectorised = None if vectorise else False
        self.chunk_size = 64
        self.offset = 0.0
        self._masks = {}
        self._cdf_kinds = {}  # observed site -> the kind of its CDF parts (_cdf_parts)
        from ..lgm.extract import full_data_plates

        with torch.no_grad(), full_data_plates():
            tr = poutine.trace(model).get_trace(*self.args, **self.kwargs)
        #: ``{observed site: (batch shape, event shape)}`` of its distribution
        self.obs_shapes = {}
        for name, site in self._observed_sites(tr):
            event = tuple(site["fn"].event_shape)
            v = site["value"]
            # the shape of log_prob(value): a value may broadcast the distribution (an observed vector, no plate)
            shape = tuple(torch.broadcast_shapes(site["fn"].batch_shape, v.shape[:v.dim() - len(event)]))
            self.obs_shapes[name] = (shape, event)
            keep = _observed_entries(site, shape)
            if keep is not None:
                self._masks[name] = keep

    def constrain(self, name, x):
        """Constrained values of site ``name`` from unconstrained draws ``x`` ``(S, *ushape)``."""
        return self.transforms[name](x)

    def _check(self, values):
        missing = [n for n in self.names if n not in values]
        extra = [n for n in values if n not in self.transforms]
        if missing or extra:
            raise ValueError(f"draws must cover exactly the model's latent sites {self.names}; "
                             f"missing {missing}, unknown {extra}")
        sizes = {int(v.shape[0]) for v in values.values()}
        if len(sizes) != 1:
            raise ValueError(f"draws of every site need the same leading number of draws, got {sorted(sizes)}")
        return sizes.pop()

    def evaluate(self, values, *, pointwise=False, pit=False, predictive=False, progress=False):
        """Evaluate the model at ``S`` draws.

        :param dict values: ``{site: (S, *unconstrained shape) tensor}`` for every latent site.
        :param bool pointwise: also return ``log_lik``: ``{observed site: (S, N_site) array}`` of the
            observations' own log densities (unscaled; masked entries dropped).
        :param bool pit: also return ``cdf``: ``{site: ((S, N_site), (S, N_site))}`` of ``P(Y < y)`` and
            ``P(Y = y)`` (Normal, LogNormal, HalfNormal, Laplace, StudentT, Gamma, Exponential, Bernoulli, Binomial,
            Poisson, ZeroInflatedPoisson, NegativeBinomial, ZeroInflatedNegativeBinomial and GammaPoisson sites,
            elementwise; others are left out).
        :param bool predictive: also return ``y_rep``: ``{site: (S, *shape)}`` replicated observations.
        :returns: dict with ``log_joint`` ``(S,)`` numpy array (unconstrained density, all constants) and
            the requested extras.
        """
        S = self._check(values)
        data, ldj = {}, torch.zeros(S, dtype=torch.float64)
        with torch.no_grad():
            for n in self.names:
                x = values[n]
                t = self.transforms[n]
                v = t(x)
                data[n] = v
                ldj = ldj + t.log_abs_det_jacobian(x, v).reshape(S, -1).sum(1).double().cpu()
        flags = (pointwise or pit, pit, predictive)
        out = None
        if self.vectorised is not False:
            try:
                out = self._run_vmap(data, S, flags)
                if self.vectorised is None:  # first use: check against plain traces of two draws
                    m = min(S, 2)
                    ref = self._run_loop({n: v[:m] for n, v in data.items()}, m, (True, False, False), False)
                    got_ll = out[1]
                    same = np.allclose(out[0][:m], ref[0], rtol=1e-9, atol=1e-9) and \
                        (not flags[0] or (set(got_ll) == set(ref[1]) and all(
                            np.allclose(got_ll[k][:m], ref[1][k], rtol=1e-9, atol=1e-9) for k in ref[1])))
                    self.vectorised = bool(same)
                    if not same:
                        out = None
                        self._warn_loop("its vectorised values disagree with plain traces of the model")
            except Exception as e:  # noqa: BLE001 - anything vmap cannot run is evaluated by the loop
                self.vectorised = False
                out = None
                self._warn_loop(f"torch.func.vmap cannot run it ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        if out is None:
            out = self._run_loop(data, S, flags, progress)
        lp, ll, cdf, rep = out
        res = {"log_joint": lp + ldj.numpy() + self.offset}
        if flags[0]:
            res["log_lik"] = ll
        if pit:
            res["cdf"] = cdf
        if predictive:
            res["y_rep"] = rep
        return res

    def _warn_loop(self, why):
        """Say once that the model is evaluated draw by draw, and why (the answer is the same, only slower)."""
        warnings.warn(f"log joint of model '{self._model_name}': evaluated one trace per "
                      f"draw, about 50 times slower than vectorised, because {why}; Python control flow on latent "
                      "values (if, float(), .item()) is the usual cause", RuntimeWarning, stacklevel=3)

    def _observed_sites(self, tr):
        for name, site in tr.nodes.items():
            if site["type"] != "sample" or not site["is_observed"] or name in self.transforms \
                    or _is_deterministic(site):
                continue  # latent sites are observed here only because they are conditioned on
            yield name, site

    def _one(self, data, flags):
        """``(log joint, {site: flat log lik}, {site: (below, at)}, {site: y_rep})`` of one draw (tensors)."""
        want_ll, want_cdf, want_rep = flags
        tr = poutine.trace(poutine.condition(self.model, data=data)).get_trace(*self.args, **self.kwargs)
        lp = tr.log_prob_sum()
        ll, cdf, rep = {}, {}, {}
        for name, site in self._observed_sites(tr):
            fn, y = site["fn"], site["value"]
            if want_ll:
                lpy = fn.log_prob(y)
                ll[name] = lpy.reshape(-1)
                if want_cdf:
                    out = _cdf_parts(fn, y)
                    if out is not None and out[1][0].shape == lpy.shape:
                        self._cdf_kinds[name] = out[0]  # a Python constant of the site (also under vmap)
                        cdf[name] = tuple(t.reshape(-1) for t in out[1])
            if want_rep:
                rep[name] = fn.sample()
        return lp, ll, cdf, rep

    def _keep(self, name, n):
        keep = self._masks.get(name)
        return None if keep is None or keep.shape[0] != n else keep

    def _collect(self, lps, lls, cdfs, reps):
        lp = np.concatenate([np.atleast_1d(np.asarray(a, dtype=np.float64)) for a in lps])
        ll = {}
        for k in (lls[0] if lls else {}):
            a = np.concatenate([np.asarray(c[k], dtype=np.float64) for c in lls])
            keep = self._keep(k, a.shape[1])
            ll[k] = a if keep is None else a[:, keep]
        cdf = {}
        for k in (cdfs[0] if cdfs else {}):
            if not all(k in c for c in cdfs):
                continue
            parts = []
            for j in range(len(cdfs[0][k])):
                a = np.concatenate([np.asarray(c[k][j], dtype=np.float64) for c in cdfs])
                keep = self._keep(k, a.shape[1])
                parts.append(a if keep is None else a[:, keep])
            cdf[k] = _cdf_from_parts(self._cdf_kinds[k], tuple(parts))
        rep = {k: np.concatenate([np.asarray(c[k], dtype=np.float64) for c in reps]) for k in (reps[0] if reps else {})}
        return lp, ll, cdf, rep

    def _run_vmap(self, data, S, flags):
        from ..lgm.extract import full_data_plates

        def f(d):
            lp, ll, cdf, rep = self._one(d, flags)
            return lp, ll, cdf, rep

        vf = torch.func.vmap(f, randomness="different")
        chunks = ([], [], [], [])
        with torch.no_grad(), full_data_plates(), _unvalidated():
            for start in range(0, S, self.chunk_size):
                d = {n: v[start:start + self.chunk_size] for n, v in data.items()}
                lp, ll, cdf, rep = vf(d)
                chunks[0].append(lp.double().cpu().numpy())
                chunks[1].append({k: v.double().cpu().numpy() for k, v in ll.items()})
                chunks[2].append({k: tuple(a.double().cpu().numpy() for a in v) for k, v in cdf.items()})
                chunks[3].append({k: v.double().cpu().numpy() for k, v in rep.items()})
        return self._collect(*chunks)

    def _run_loop(self, data, S, flags, progress):
        from tqdm.auto import tqdm

        from ..lgm.extract import full_data_plates

        chunks = ([], [], [], [])
        it = range(S)
        if progress:
            it = tqdm(it, desc="log joint", unit="draw", leave=False)
        with torch.no_grad(), full_data_plates(), _unvalidated():
            for s in it:
                lp, ll, cdf, rep = self._one({n: v[s] for n, v in data.items()}, flags)
                chunks[0].append(float(lp))
                chunks[1].append({k: v.double().cpu().numpy()[None] for k, v in ll.items()})
                chunks[2].append({k: tuple(a.double().cpu().numpy()[None] for a in v) for k, v in cdf.items()})
                chunks[3].append({k: v.double().cpu().numpy()[None] for k, v in rep.items()})
        return self._collect(*chunks)

    def observation_index(self, name):
        """``(N_site,)`` flat indices, into the site's batch shape, of the observations of site ``name`` that
        :meth:`evaluate` returns (masked entries dropped)."""
        n = int(np.prod(self.obs_shapes[name][0]))
        keep = self._keep(name, n)
        return np.arange(n) if keep is None else np.flatnonzero(keep)

    def by_observation(self, name, a):
        """Values ``a`` ``(..., *batch, *event)`` of site ``name`` (observations or replicates) as
        ``(..., N_site, *event)``: the batch flattened and masked entries dropped, aligned with :meth:`evaluate`'s
        ``log_lik``. ``None`` when ``a``'s trailing shape is not the site's ``batch + event`` shape (``batch`` the
        shape of the site's ``log_prob``)."""
        batch, event = self.obs_shapes[name]
        a = np.asarray(a)
        k = len(batch) + len(event)
        if a.ndim < k or tuple(a.shape[a.ndim - k:]) != batch + event:
            return None
        a = a.reshape(a.shape[:a.ndim - k] + (int(np.prod(batch)),) + event)
        return np.take(a, self.observation_index(name), axis=a.ndim - 1 - len(event))

    def observed(self):
        """``{observed site: numpy array (N_site, *event_shape)}`` of the observations (the batch flattened, masked
        entries dropped, as :meth:`evaluate`'s ``log_lik``; flat when the site's value does not have the site's
        ``batch + event`` shape)."""
        from ..lgm.extract import full_data_plates

        with torch.no_grad(), full_data_plates():
            tr = poutine.trace(self.model).get_trace(*self.args, **self.kwargs)
        out = {}
        for name, site in self._observed_sites(tr):
            y = site["value"].double().cpu().numpy()
            v = self.by_observation(name, y) if name in self.obs_shapes else None
            out[name] = y.reshape(-1) if v is None else v
        return out
