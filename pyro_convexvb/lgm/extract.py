"""Pyro model (+ its arguments) -> :class:`LatentGaussianModel`, with errors that name the site."""
import math
import warnings

import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide.initialization import InitMessenger, init_to_mean
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.subsample_messenger import SubsampleMessenger

from ..errors import UnsupportedModelError
from ..linalg.operators import (
    ComposedOperator,
    DenseOperator,
    DiagonalOperator,
    EmbedColumnsOperator,
    FunctionOperator,
    IdentityOperator,
    BlockDiagonalOperator,
    SparseOperator,
    SumOperator,
)
from ..linalg.scalar import _broadcast_shapes
from .chains import PROBE_BATCH
from .layout import LatentLayout
from .linear import record_linear, record_normal_cdf
from .model import ImputedBlock, LatentGaussianModel, PriorBlock, SiteGroup
from .families import LIKELIHOODS, Gaussian, Laplace, tempered

__all__ = ["lgm_from_pyro", "full_data_plates", "FullDataPlates", "latent_sites", "unconstrained_layout", "DENSE_JACOBIAN_LIMIT"]

#: Largest ``q * n`` for which a predictor that was not built with ``pcv.linear`` is materialised
#: as a dense Jacobian (the model's own design is then dense already); larger ones stay as
#: autograd-probed operators.
DENSE_JACOBIAN_LIMIT = 25_000_000
#: a predictor's Jacobian with more than this many entries (``rows x latents``) that no ``pcv.linear`` record
#: reproduces is first probed for a sparse structure (:func:`~pyro_convexvb.lgm.chains.probe_sparse_jacobian`)
PROBE_MIN_ENTRIES = 1_000_000
#: ... and so is every such predictor of a model with at least this many latents, whatever its number of rows: a
#: hierarchy deeper than its data (2,000 pupil intercepts under schools and regions, a few hundred rows) needs a
#: sparse design for the sparse latent form of ``dual_vg``, where a dense ``q x n`` Jacobian would send it to a
#: dense ``L x L`` (or ``n x n`` prior covariance) form
PROBE_MIN_LATENTS = 1_000
#: largest fraction of nonzeros for which a probed Jacobian is kept sparse
PROBE_MAX_DENSITY = 0.1
#: Jacobian products from this many on are computed in vectorised batches (one backward pass per batch; below it
#: the first such pass's one-off set-up, about half a second, would cost more than it saves)
BATCHED_PRODUCTS_FROM = 200
#: a predictor of a model with at least this many latent blocks (a loop of scalar sites) is first probed by residue
#: classes of its coordinates (:func:`~pyro_convexvb.lgm.chains.probe_by_residues`: a few products through the
#: model's graph instead of one per block, each of which walks the whole graph), for its sparse or its dense design
RESIDUE_PROBE_FROM_BLOCKS = 200
#: an affine Gaussian chain of at least this many children has their mean coefficients probed all at once
#: (:func:`_chain_batch`: at most 60 products, against a few per child one by one)
CHAIN_BATCH_FROM = 20

_AFFINE_RTOL = 1e-7


def _affine_tol(*computed):
    """Relative tolerance of the affinity checks: :data:`_AFFINE_RTOL` when every tensor (or dtype) ``computed`` --
    the extraction's and what the model computed with it -- is float64, else 1e-3 (a float32 model's predictor
    deviates from affine by its rounding, about 1e-6, also when the extraction runs in float64)."""
    dts = [c if isinstance(c, torch.dtype) else c.dtype for c in computed]
    return _AFFINE_RTOL if all(d == torch.float64 for d in dts if d.is_floating_point) else 1e-3


def _d(t, keep_graph):
    """``t.detach()``, unless the extraction keeps the graph to the model's ``pyro.param`` sites (``keep_graph``:
    prior parameters, noise scales, offsets and constants keep their autograd history, for envelope gradients)."""
    return t if keep_graph else t.detach()


def _num(t, keep_graph):
    """A Python float, or (keeping the graph) a 0-d tensor."""
    return t if keep_graph else float(t.detach())

#: Largest latent dimension for which a ``pyro.factor`` that depends on the latents is probed (dense Hessian).
_FACTOR_MAX_LATENTS = 2000


def _unwrap(fn):
    """Strip Independent / Expanded / Masked wrappers; return (base, mask or None)."""
    mask = None
    while True:
        if isinstance(fn, dist.Independent) or isinstance(fn, torch.distributions.Independent):
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            fn = fn.base_dist
        elif isinstance(fn, dist.MaskedDistribution):
            mask = fn._mask if mask is None else mask & fn._mask
            fn = fn.base_dist
        else:
            return fn, mask


def _is_subsample(site):
    return type(site["fn"]).__name__ == "_Subsample"


def _depends_on(t, u):
    if not torch.is_tensor(t) or not t.requires_grad:
        return False
    # unequal weights: a predictor whose entries sum to a constant (centred softmax logits) still depends on u
    # (a weighted sum, not grad_outputs=: torch checks grad_outputs' shapes with its symbolic-shape machinery, whose
    # first import costs ~0.5 s)
    w = torch.linspace(1.0, 2.0, t.numel(), dtype=t.dtype, device=t.device).reshape(t.shape)
    g = torch.autograd.grad((t * w).sum(), u, retain_graph=True, allow_unused=True)[0]
    return g is not None and bool((g != 0).any())


class ObsMaskMessenger(poutine.messenger.Messenger):
    """Base of the handlers of ``obs_mask`` sites: NaN in the unused entries of ``<name>_observed`` is filled
    (:func:`fill_unused_entries`), and :meth:`_imputed` sees every ``<name>_unobserved`` latent with a tensor mask."""

    def __init__(self):
        super().__init__()
        self._observed = set()

    def _process_message(self, msg):
        if msg["type"] != "sample":
            return
        name = msg["name"]
        if msg["is_observed"]:
            if name.endswith("_observed") and torch.is_tensor(msg.get("mask")):
                self._observed.add(name[:-len("_observed")])
                fill_unused_entries(msg)
            return
        if name.endswith("_unobserved") and name[:-len("_unobserved")] in self._observed \
                and torch.is_tensor(msg.get("mask")):
            self._imputed(msg)

    def _imputed(self, msg):
        raise NotImplementedError

    @classmethod
    def wrap(cls, model):
        """``model`` run under a fresh handler of this class at every call (picklable when ``model`` is)."""
        return _UnderHandler(cls, model)


class _UnderHandler:
    """A model run under a fresh handler of class ``handler`` at every call (:meth:`ObsMaskMessenger.wrap`); an
    object rather than a closure, so that a result whose diagnostics hold it pickles."""

    def __init__(self, handler, model):
        self.handler, self.model = handler, model
        self.__name__ = getattr(model, "__name__", type(model).__name__)

    def __call__(self, *args, **kwargs):
        with self.handler():
            return self.model(*args, **kwargs)


class _Filler(dist.TransformedDistribution):
    """``base`` pushed through ``transforms`` onto ``support``, which it reports as its own: the mixture with the
    site's distribution then has that support (not a ``MaskedConstraint``, which Pyro cannot map to unconstrained
    coordinates; ``biject_to(GreaterThanEq(0))`` reports ``GreaterThan(0)``, e.g., for a Gamma site)."""

    def __init__(self, base, transforms, support):
        self._own_support = support
        super().__init__(base, transforms)

    @property
    def support(self):
        return self._own_support

    def expand(self, batch_shape, _instance=None):
        new = super().expand(batch_shape, _instance=_instance)
        new._own_support = self._own_support
        return new


class _ProperMissing(ObsMaskMessenger):
    """Give the masked-out entries of ``obs_mask``'s ``<name>_unobserved`` sites a proper density.

    ``pyro.sample(name, fn, obs=y, obs_mask=m)`` samples ``<name>_unobserved`` with the full batch shape
    under ``poutine.mask(~m)``, so its entries at observed positions have a flat (improper) density.
    They never enter the model (``torch.where`` takes the data there), so an independent standard
    density on them (``Normal(0, 1)`` pushed through ``biject_to(fn.support)``) leaves the joint of every
    other variable unchanged and makes the joint proper, which engines that sample or optimise the
    unconstrained joint (SVI, Laplace, NUTS) need.
    """

    def _imputed(self, msg):
        mask = msg["mask"]
        fn = msg["fn"]
        if fn.support.is_discrete or fn.event_shape != () or fn.support.event_dim != 0:
            return
        from torch.distributions import biject_to

        zero = torch.zeros(fn.batch_shape, dtype=fn.mean.dtype if fn.mean.is_floating_point() else torch.float64,
                           device=mask.device)
        filler = _Filler(dist.Normal(zero, 1.0), [biject_to(fn.support)], fn.support)
        keep = mask.expand(fn.batch_shape) if mask.shape != fn.batch_shape else mask
        msg["fn"] = dist.MaskedMixture(keep, filler, fn)
        msg["mask"] = None


def fill_unused_entries(msg):
    """The unused (masked-out) entries of an ``obs_mask`` site's data may hold NaN: Pyro still evaluates and
    validates their log density (masked afterwards), and a NaN there fails the support check or poisons the
    gradients through the mask. They are set to a value in the support (``biject_to(support)(0)``, or 0 for
    a discrete support), which no other variable reads."""
    value, mask, fn = msg["value"], msg.get("mask"), msg["fn"]
    if not (torch.is_tensor(value) and value.is_floating_point() and torch.is_tensor(mask)):
        return
    unused = ~torch.isfinite(value) & ~mask.bool()
    if not bool(unused.any()):
        return
    from torch.distributions import biject_to

    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    fill = zero if fn.support.is_discrete else biject_to(fn.support)(zero)
    msg["value"] = torch.where(unused, fill, value)
    msg["infer"] = dict(msg.get("infer") or {}, data=value)  # the data as given (check_model_data names it)


def proper_missing(model):
    """``model`` with a proper density on the unused entries of its ``obs_mask`` sites (see :class:`_ProperMissing`)."""
    return _ProperMissing.wrap(model)


class FullDataPlates(poutine.messenger.Messenger):
    """Every ``pyro.plate`` created inside runs on its full size (no mini-batch scaling).

    Engines that fit all the data at once (the latent Gaussian model, Laplace, NUTS) run the model inside it,
    so ``pyro.plate(..., subsample_size=M)`` does not make them see random mini-batches. A plate's size and
    indices are fixed when it is created, by Pyro's ``SubsampleMessenger._subsample``, which takes
    ``subsample_size`` from the plate's arguments; no message can change them. The handler therefore works with
    a hook installed once at import (:func:`_subsample`), which asks for the full size only while a
    :class:`FullDataPlates` is on the effect-handler stack and calls Pyro's own code unchanged otherwise.
    """

    def __init__(self):
        super().__init__()
        #: names of the plates the model asked to subsample (``subsample_size`` below its size), run at full size
        self.mini_batched = set()

    def _pyro_sample(self, msg):
        pass  # a marker on the stack; the plates are sized by the hook


def subsampled_frame(site):
    """The first plate frame of a trace ``site`` that holds fewer rows than its full size (``subsample_size`` in a
    plain trace, or explicit ``subsample=`` indices), else ``None``."""
    return next((f for f in site.get("cond_indep_stack", ())
                 if getattr(f, "full_size", None) is not None and f.size is not None and f.size < f.full_size), None)


def obs_mask_base(name, nodes):
    """The name ``y`` of the ``obs_mask`` site whose missing entries the latent site ``name`` holds
    (``y_unobserved`` beside ``y_observed`` among the trace's ``nodes``), else ``None``."""
    base = name[:-len("_unobserved")] if name.endswith("_unobserved") else None
    return base if base is not None and f"{base}_observed" in nodes else None


def full_data_plates():
    """A :class:`FullDataPlates` handler (use as ``with full_data_plates(): ...``)."""
    return FullDataPlates()


_PYRO_SUBSAMPLE = SubsampleMessenger._subsample


def _subsample(name, size=None, subsample_size=None, subsample=None, use_cuda=None, device=None):
    """Pyro's ``SubsampleMessenger._subsample``, at the full size inside a :class:`FullDataPlates` handler."""
    handler = next((m for m in _PYRO_STACK if isinstance(m, FullDataPlates)), None)
    if size is not None and subsample is None and handler is not None:
        if subsample_size is not None and subsample_size < size:
            handler.mini_batched.add(name)
        subsample_size = size
    return _PYRO_SUBSAMPLE(name, size, subsample_size, subsample, use_cuda, device)


SubsampleMessenger._subsample = staticmethod(_subsample)


def latent_sites(model, args, kwargs):
    """``[(name, site)]`` of the model's latent sample sites in trace order (the packing order of Pyro's
    :class:`~pyro.infer.autoguide.AutoContinuous`), traced with every plate at full size; each site's
    ``"mini_batched_plates"`` lists its plates that the model subsamples (``subsample_size``)."""
    with torch.no_grad(), full_data_plates() as plates:
        tr = poutine.trace(model).get_trace(*args, **kwargs)
    out = [(n, s) for n, s in tr.nodes.items()
           if s["type"] == "sample" and not s["is_observed"] and not _is_subsample(s)]
    for _, s in out:  # the plates of each site that the model mini-batches (run here at full size)
        s["mini_batched_plates"] = [f.name for f in s["cond_indep_stack"] if f.name in plates.mini_batched]
    return out


def _named_arguments(model, args, kwargs):
    """``[(name, value)]`` of the model's arguments, positional ones named by the model's signature."""
    import inspect

    try:
        bound = inspect.signature(model).bind_partial(*args, **kwargs).arguments
        return list(bound.items())
    except (TypeError, ValueError):
        return [(f"#{i}", a) for i, a in enumerate(args)] + list(kwargs.items())


def _nonfinite(value):
    """``(count, first index)`` of the non-finite entries of a floating tensor, array or SciPy sparse matrix."""
    import numpy as np
    import scipy.sparse as sp

    if sp.issparse(value):
        value = value.tocoo()
        bad = ~np.isfinite(value.data)
        if not bad.any():
            return 0, None
        i = int(np.argmax(bad))
        return int(bad.sum()), (int(value.row[i]), int(value.col[i]))
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
        bad = ~np.isfinite(value)
        return (int(bad.sum()), tuple(int(i) for i in np.argwhere(bad)[0])) if bad.any() else (0, None)
    if torch.is_tensor(value) and value.is_floating_point():
        if value.layout != torch.strided:  # COO and CSR alike: the stored entries
            return int((~torch.isfinite(value.values())).sum()), None
        bad = ~torch.isfinite(value)
        return (int(bad.sum()), tuple(int(i) for i in bad.nonzero()[0])) if bool(bad.any()) else (0, None)
    return 0, None


#: what to do about inf/NaN data
_NONFINITE_HINT = "remove or impute those entries (for missing responses use pyro.sample(..., obs_mask=...))"


def _check_support(name, fn, value, mask):
    """Observed values outside the support of their distribution are a data error (e.g. Bernoulli labels 2 or
    -1, negative or fractional counts), whatever the engine: raised here; for inf/NaN values the message is returned
    (the caller names the argument holding them when there is one)."""
    support = getattr(fn, "support", None)
    if support is None or not torch.is_tensor(value):
        return
    try:
        ok = support.check(value)
    except (RuntimeError, NotImplementedError, TypeError):
        return
    ok = torch.as_tensor(ok)
    if torch.is_tensor(mask):
        try:
            ok = ok | ~torch.broadcast_to(mask.bool(), ok.shape)
        except RuntimeError:
            pass
    if not bool(ok.all()):
        bad = value[~ok] if ok.shape == value.shape else value.flatten()
        base, _ = _unwrap(fn)
        if value.is_floating_point() and not bool(torch.isfinite(bad).all()):
            count = int((~torch.isfinite(bad)).sum())
            return (f"site '{name}': {count} observed value{'s are' if count > 1 else ' is'} inf or NaN: no engine "
                    f"fits non-finite data; {_NONFINITE_HINT}")
        raise ValueError(f"site '{name}': observed values outside the support of {type(base).__name__} "
                         f"({support}), e.g. {bad.flatten()[:3].tolist()}; recode the data (Bernoulli labels "
                         "as 0/1, counts as nonnegative integers)")


def element_support(fn):
    """The support of the distribution ``fn`` elementwise (its ``independent`` wrappers looked through)."""
    support = fn.support
    while isinstance(support, torch.distributions.constraints.independent):
        support = support.base_constraint
    return support


def real_support(fn):
    """Whether the distribution ``fn`` lives on all of the reals: its unconstrained coordinates are its values."""
    return element_support(fn) is torch.distributions.constraints.real


def _check_degenerate_rows(name, fn, value, mask, confirmed=False):
    """Rows whose likelihood does not depend on the latents in a way any engine can use are a data error, named
    here: a ``Poisson`` rate of exactly 0 (an exposure of 0: a row with ``y = 0`` scores ``log p = 0`` whatever the
    latents and carries no information, one with ``y > 0`` is impossible; the log link's offset is ``-inf`` and the
    gradient of ``log_prob`` NaN), and a ``Gamma`` response of 0 with a concentration other than 1 (density 0 or
    unbounded there, whatever the rate).  A zero Poisson rate at the caller's trace (prior draws, where ``exp`` of
    a far draw may underflow) is only reported (``True``) until ``confirmed`` (a trace at the priors' means)."""
    base, _ = _unwrap(fn)
    poisson = isinstance(base, dist.Poisson)
    if not torch.is_tensor(value) or not (poisson or isinstance(base, dist.Gamma) and value.is_floating_point()):
        return
    keep = torch.ones_like(value, dtype=torch.bool) if not torch.is_tensor(mask) else torch.broadcast_to(
        mask.bool(), value.shape)
    if poisson:
        zero = (torch.broadcast_to(base.rate.detach(), value.shape) == 0) & keep
        if bool(zero.any()) and not confirmed:
            return True
        if bool(zero.any()):
            rows = torch.nonzero(zero.reshape(-1)).flatten()[:5].tolist()
            impossible = bool((value[zero] > 0).any())
            raise ValueError(f"site '{name}': the Poisson rate is exactly 0 at {int(zero.sum())} observation(s) (flat "
                             f"indices {rows}; e.g. an exposure of 0): "
                             + ("an observed count above 0 there is impossible under the model; check the exposure "
                                "or the counts" if impossible else
                                "with a count of 0 such a row scores log p = 0 whatever the latents and carries no "
                                "information, so leave it out of the data (the posterior is the same)"))
    else:
        conc = torch.broadcast_to(base.concentration.detach(), value.shape)
        zero = (value == 0) & (conc != 1) & keep
        if bool(zero.any()):
            rows = torch.nonzero(zero.reshape(-1)).flatten()[:5].tolist()
            raise ValueError(f"site '{name}': {int(zero.sum())} observed value(s) of 0 (flat indices {rows}) under a "
                             f"Gamma likelihood of concentration other than 1, whose density at 0 is 0 (or unbounded) "
                             "whatever its rate: the data are impossible under the model; recode them (e.g. a "
                             "detection limit) or model the zeros")


def _check_scoreable(name, fn, value):
    """An observed value that the model as written cannot score (a NumPy array, integer labels where the
    likelihood computes in floating point) is a data error whatever the engine: Pyro's own inference, the
    diagnostics and ``Predictive`` all evaluate ``log_prob`` of the model as written. Raised here, naming the site."""
    base = type(_unwrap(fn)[0]).__name__
    if not torch.is_tensor(value):
        raise ValueError(f"site '{name}': the observed value is a {type(value).__module__}.{type(value).__name__}, "
                         f"not a torch tensor, so {base}.log_prob of the model as written cannot score it; pass "
                         "torch.as_tensor(y) (floating point, the dtype of the model's parameters)")
    shape = tuple(fn.batch_shape + fn.event_shape)
    try:
        both = tuple(_broadcast_shapes(value.shape, torch.Size(shape)))
        wider = both != shape
    except RuntimeError:
        wider = False  # shapes that do not broadcast: the distribution's own validation names them
    if wider:
        head = (f"site '{name}': the observed value has shape {tuple(value.shape)}, wider than the distribution's "
                f"shape {shape} (batch {tuple(fn.batch_shape)}, event {tuple(fn.event_shape)})")
        if math.prod(both) > value.numel():  # (N, 1) against (N,): cross terms
            hint = f", e.g. y.squeeze({value.dim() - 1})" if value.shape[-1:] == (1,) else ""
            raise ValueError(f"{head}: log_prob would broadcast every observation against every row, to shape "
                             f"{both}; pass the observations in the distribution's shape{hint}")
        raise ValueError(f"{head}: its extra dimensions are declared by no pyro.plate, which Pyro's own inference "
                         f"refuses too ('invalid log_prob shape'); put the rows in a pyro.plate (with "
                         f"pyro.plate('data', {value.shape[0]}): ...), or give the distribution their shape "
                         "(.expand(y.shape).to_event(y.dim()))")
    try:
        with torch.no_grad():
            fn.log_prob(value)
    except (ValueError, NotImplementedError):  # its own validation (values outside the support): the caller's
        return
    except (RuntimeError, TypeError) as e:
        hint = ("; pass the labels as floating point, e.g. y.double()" if not value.is_floating_point() else "")
        raise ValueError(f"site '{name}': {base}.log_prob of the model as written fails on the observed value "
                         f"({value.dtype}, shape {tuple(value.shape)}): {str(e).splitlines()[0]}{hint}") from None


def check_model_data(model, args, kwargs):
    """Refuse data that no engine can fit, before any engine runs, with an error that names the input.

    * an argument (tensor, NumPy array, SciPy sparse matrix) with ``inf``/``NaN`` entries, except the observed
      values of ``obs_mask`` sites (their masked-out entries are never read);
    * an observed site with no entries (``0`` rows of data);
    * a model with no latent sample site (nothing to infer), or with no observed one (a forgotten ``y=``: the
      posterior would be the prior);
    * observed values outside the support of their distribution (Bernoulli labels 2 or -1, negative counts);
    * observed values that the model as written cannot score (a NumPy array; integer labels where ``log_prob``
      computes in floating point).

    Row-sharded data (:mod:`pyro_convexvb.distributed`) are checked on this rank's arguments only.

    :raises ValueError: naming the argument or the site and what to do.
    """
    from ..distributed import agree_on_errors, find_comm, local_only

    if find_comm(args, kwargs) is not None:  # row-sharded data: this rank's rows, a failure raised on every rank
        def local():
            with local_only():
                return check_model_data(model, args, kwargs)

        return agree_on_errors(local)
    masked, nonfinite = [], None
    if find_comm(args, kwargs) is None:
        try:
            with torch.no_grad(), full_data_plates():
                tr = _first_trace(proper_missing(model), args, kwargs)
        except ValueError:  # e.g. a NaN input makes a distribution's parameter invalid: name the input instead
            _check_finite_arguments(model, args, kwargs, ())
            raise
        except ZeroDivisionError:  # pyro.plate(name, 0)
            empty = [n for n, v in _named_arguments(model, args, kwargs) if 0 in tuple(getattr(v, "shape", ()))]
            which = (f": argument{'s' if len(empty) > 1 else ''} {', '.join(repr(n) for n in empty)} "
                     f"ha{'ve' if len(empty) > 1 else 's'} 0 rows") if empty else ""
            raise ValueError(f"the model fails on empty data (a pyro.plate of size 0){which}; there is nothing to "
                             "fit: pass at least one row") from None
        latent, observed = [], 0
        for name, site in tr.nodes.items():
            if site["type"] != "sample" or _is_subsample(site):
                continue
            if not site["is_observed"]:
                latent.append(name)
                continue
            observed += 1
            if _is_factor(site):  # pyro.factor: an observed Unit site of no data
                continue
            value = site["value"]
            if torch.is_tensor(value) and value.numel() == 0:
                raise ValueError(f"site '{name}': there are no observations (the data have 0 rows), so there is "
                                 "nothing to fit; pass at least one row")
            mask = site.get("mask")
            if name.endswith("_observed") and torch.is_tensor(mask):
                masked.append((site.get("infer") or {}).get("data", value))
            nonfinite = nonfinite or _check_support(name, site["fn"], value, mask)
            _check_scoreable(name, site["fn"], value)
            if _check_degenerate_rows(name, site["fn"], value, mask):  # a zero rate at a prior draw: at the means?
                with torch.no_grad(), full_data_plates(), InitMessenger(init_to_mean):
                    again = poutine.trace(proper_missing(model)).get_trace(*args, **kwargs).nodes[name]
                _check_degenerate_rows(name, again["fn"], value, mask, confirmed=True)
        if not latent:
            raise ValueError("the model has no latent sample site (every pyro.sample is observed), so there is no "
                             "posterior to infer")
        if not observed:
            raise ValueError(f"the model has no observed site (every pyro.sample is latent: "
                             f"{', '.join(repr(n) for n in latent)}; no obs= and no pyro.factor), so its posterior is "
                             "its prior and there is nothing to fit: were the data left out of the call (e.g. y=...)?")
    _check_finite_arguments(model, args, kwargs, masked)
    if nonfinite:  # inf/NaN observations that no argument holds
        raise ValueError(nonfinite)


def _check_finite_arguments(model, args, kwargs, masked):
    """Raise for the first argument with ``inf``/``NaN`` entries, other than the observed values of ``obs_mask``
    sites in ``masked``."""
    for name, value in _named_arguments(model, args, kwargs):
        if any(value is m for m in masked):
            continue
        count, where = _nonfinite(value)
        if count:
            at = f", the first at index {where}" if where is not None else ""
            raise ValueError(f"argument '{name}' has {count} non-finite entr{'y' if count == 1 else 'ies'} (inf or "
                             f"NaN){at}: no engine fits non-finite data; {_NONFINITE_HINT}") from None


def unconstrained_layout(model, args, kwargs):
    """:class:`LatentLayout` of the model's latent sites in unconstrained coordinates (``biject_to`` of each support)."""
    from torch.distributions import biject_to

    named = []
    for name, site in latent_sites(model, args, kwargs):
        named.append((name, tuple(biject_to(site["fn"].support).inv(site["value"]).shape)))
    return LatentLayout.from_shapes(named)


class _AtValues(poutine.messenger.Messenger):
    """The latent sites named in ``values`` take those values, in one run of the model.

    Each such site still takes its prior draw and drops it, so the global random stream moves as it would
    under a trace of the model replayed at ``values`` (what happens after an extraction is unchanged).
    """

    def __init__(self, values):
        super().__init__()
        self.values = values

    def _pyro_sample(self, msg):
        if msg["name"] in self.values and not msg["is_observed"] and not msg["done"]:
            msg["fn"](*msg["args"], **msg["kwargs"])
            msg["value"] = self.values[msg["name"]]
            msg["done"] = True


def _trace(model, args, kwargs, values):
    """The model's trace with its latent sites at ``values``, and the ``pcv.linear`` calls it made."""
    with record_linear() as records, _AtValues(values):
        tr = poutine.trace(model).get_trace(*args, **kwargs)
    return tr, records


def _latent_prior(name, fn, shape, dtype, device, keep_graph=False, loc=None):
    """PriorBlock (or 'laplace' marker) for a latent site; raises for anything else.

    ``loc`` (flattened, ``(size,)``) replaces the distribution's mean: the constant part ``b`` of the mean of an
    affine Gaussian chain's child (:mod:`pyro_convexvb.lgm.chains`)."""
    base, mask = _unwrap(fn)
    override = loc
    if mask is not None:
        raise UnsupportedModelError(name, "masked latent sites are not supported")
    size = int(math.prod(shape)) if shape else 1
    from ..distributions import SparseGMRF

    if isinstance(base, SparseGMRF):  # sparse precision kept sparse; log|Q| from its sparse Cholesky factor
        _check_gmrf_shape(name, base, shape)
        prec = base.scaled_precision(keep_graph=keep_graph)
        if prec.dtype != dtype or prec.device != device:
            A = prec.matrix
            prec = SparseOperator(torch.sparse_csr_tensor(A.crow_indices(), A.col_indices(), A.values().to(dtype),
                                                          size=A.shape, check_invariants=False).to(device))
        mean = _d(base.loc, keep_graph).reshape(size) if override is None else _d(override, keep_graph)
        return PriorBlock(name, mean.to(dtype=dtype, device=device), prec=prec,
                          logdet_cov=-_num(base.log_det_precision(), keep_graph)), None
    if isinstance(base, (dist.Normal, torch.distributions.Normal)):
        loc = (base.loc.expand(shape).reshape(size) if override is None else override).to(dtype)
        scale = base.scale.expand(shape).reshape(size).to(dtype)
        if (scale <= 0).any() or not torch.isfinite(scale).all():
            raise UnsupportedModelError(name, "prior scale must be positive and finite")
        return PriorBlock(name, _d(loc, keep_graph), cov=DiagonalOperator(_d(scale, keep_graph) ** 2),
                          prec=DiagonalOperator(_d(scale, keep_graph) ** -2),
                          logdet_cov=_num(2 * torch.log(scale).sum(), keep_graph)), None
    if isinstance(base, (dist.MultivariateNormal, torch.distributions.MultivariateNormal)):
        d = base.event_shape[0]
        tril = _d(base.scale_tril.expand(tuple(shape[:-1]) + (d, d)).reshape(-1, d, d).to(dtype), keep_graph)
        loc = _d((base.loc.expand(shape).reshape(size) if override is None else override).to(dtype), keep_graph)
        covs, precs, logdet = [], [], 0.0
        for L in tril:
            if not torch.isfinite(L).all() or (torch.diagonal(L) <= 0).any():
                raise UnsupportedModelError(name, "prior covariance is not positive definite")
            cov = L @ L.transpose(-1, -2)
            covs.append(DenseOperator(cov))
            precs.append(DenseOperator(torch.cholesky_inverse(L)))
            logdet = logdet + _num(2 * torch.log(torch.diagonal(L)).sum(), keep_graph)
        cov_op = covs[0] if len(covs) == 1 else BlockDiagonalOperator(covs)
        prec_op = precs[0] if len(precs) == 1 else BlockDiagonalOperator(precs)
        return PriorBlock(name, loc, cov=cov_op, prec=prec_op, logdet_cov=logdet), None
    if isinstance(base, (dist.Laplace, torch.distributions.Laplace)):
        loc = _d(base.loc.expand(shape).reshape(size).to(dtype), keep_graph)
        scale = _d(base.scale.expand(shape).reshape(size).to(dtype), keep_graph)
        if (scale <= 0).any():
            raise UnsupportedModelError(name, "Laplace prior scale must be positive")
        return PriorBlock(name, torch.zeros(size, dtype=dtype, device=device), flat=True), (loc, scale)
    if fn.support.is_discrete if hasattr(fn, "support") else False:
        raise UnsupportedModelError(name, "discrete latent variables are outside the latent Gaussian model class")
    raise UnsupportedModelError(
        name, f"unsupported prior {type(base).__name__}: a latent site needs a Normal, MultivariateNormal or Laplace prior"
    )


def _check_gmrf_shape(name, base, shape):
    """A ``SparseGMRF`` latent site is one field: shape ``(n,)``, not a batch of fields (a plate, ``expand``)."""
    if tuple(shape) != (base.n,):
        raise UnsupportedModelError(name, f"a SparseGMRF latent site must have shape ({base.n},) (batch shape ()), "
                                          f"got {tuple(shape)}: a plate or expand() over the field makes a batch of "
                                          "independent fields, which the extraction does not stack")


def _rows(t, full_shape, event_dim, name, what):
    """A mask or scale that broadcasts over a site's batch shape, spread over its rows (batch + event, flattened)."""
    t = torch.as_tensor(t)
    if t.dim() > len(full_shape) - event_dim:
        raise UnsupportedModelError(name, f"{what} of shape {tuple(t.shape)} does not broadcast to the site's batch "
                                          f"shape {tuple(full_shape[:len(full_shape) - event_dim])}")
    try:
        return t.reshape(tuple(t.shape) + (1,) * event_dim).expand(full_shape).reshape(-1)
    except RuntimeError:
        raise UnsupportedModelError(name, f"{what} of shape {tuple(t.shape)} does not broadcast to the site's batch "
                                          f"shape {tuple(full_shape[:len(full_shape) - event_dim])}") from None


def _absmax(t):
    return float(t.abs().max()) if t.numel() else 0.0


def _is_one(scale):
    if torch.is_tensor(scale):
        return bool((scale == 1).all())
    return scale == 1


def _keep_rows(name, site):
    """Boolean ``(q,)`` rows that count in the log density: Pyro's ``poutine.mask`` (``site["mask"]``)
    and every ``MaskedDistribution`` wrapper of the site's distribution; ``None`` when all rows count."""
    fn = site["fn"]
    full = tuple(fn.batch_shape) + tuple(fn.event_shape)
    keep = None
    if site.get("mask") is not None and site["mask"] is not True:
        keep = _rows(site["mask"], full, fn.event_dim, name, "mask").to(torch.bool)
    while True:
        if isinstance(fn, (dist.Independent, torch.distributions.Independent, dist.ExpandedDistribution)):
            fn = fn.base_dist
        elif isinstance(fn, dist.MaskedDistribution):
            m = _rows(fn._mask, full, fn.event_dim, name, "mask").to(torch.bool)
            keep = m if keep is None else keep & m
            fn = fn.base_dist
        else:
            return keep


def _site_weight(name, site):
    """``(q,)`` per-row weights from ``poutine.scale`` (``site["scale"]``), or ``None`` for weight one."""
    scale = site.get("scale", 1.0)
    if _is_one(scale):
        return None
    fn = site["fn"]
    full = tuple(fn.batch_shape) + tuple(fn.event_shape)
    scale = scale.detach() if torch.is_tensor(scale) else torch.tensor(float(scale), dtype=torch.float64)  # not float32
    w = _rows(scale, full, fn.event_dim, name, "poutine.scale factor")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise UnsupportedModelError(name, "poutine.scale factors of a likelihood site must be nonnegative and finite "
                                          "(a negative weight is not a likelihood)")
    return w


def _site_log_prob(site):
    """The site's log density as Pyro's trace counts it (``poutine.scale`` and masks applied), summed."""
    lp = site["fn"].log_prob(site["value"])
    return scale_and_mask(lp, site.get("scale", 1.0), site.get("mask")).sum()


def likelihood_family(fn):
    """The site family (of :data:`~pyro_convexvb.lgm.families.LIKELIHOODS`, the first that gives a predictor) that
    reads an observed site of distribution ``fn`` (its ``Independent``/``Expanded``/``Masked`` wrappers looked
    through), or ``None`` when none does."""
    base, _ = _unwrap(fn)
    return next((f for f in LIKELIHOODS if f.predictor(base) is not None), None)


def _observed_site(name, site, dtype):
    """``(family class, base, eta, y, obs_shape)`` of an observed site (the first of
    :data:`~pyro_convexvb.lgm.families.LIKELIHOODS` that reads it); ``eta`` and ``y`` flattened over its rows."""
    fn = site["fn"]
    base, _ = _unwrap(fn)
    y = site["value"]
    if not torch.is_tensor(y):
        y = torch.as_tensor(y)
    batch = tuple(fn.batch_shape) + tuple(fn.event_shape)
    try:  # data of another shape than the site's (10 labels in a plate of 12) failed as a bare torch size error
        fits = tuple(_broadcast_shapes(tuple(y.shape), batch)) == batch
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"site '{name}': its observed value has shape {tuple(y.shape)}, which does not broadcast to "
                         f"the shape {batch} of its distribution (its plates and batch); pass one value per row")
    family = likelihood_family(base)
    if family is None:
        forms = [f.pyro_form for f in LIKELIHOODS if f.pyro_form]
        raise UnsupportedModelError(name, f"unsupported likelihood {type(base).__name__}: use {', '.join(forms[:-1])} "
                                          f"or {forms[-1]}")
    reason = family.refusal(base)
    if reason is not None:
        raise UnsupportedModelError(name, reason)
    eta = family.predictor(base)
    if family.vector_site:  # K predictor rows per observation (Categorical): eta (n K,), y (n,)
        eta, y, batch, _ = family.vector_rows(name, base, eta, y, dtype, batch)
        return family, base, eta, y, batch
    eta = eta.expand(batch).reshape(-1).to(dtype)
    y = y.expand(batch).reshape(-1).to(dtype)
    return family, base, eta, y, batch


class _AutogradJacobian:
    """Jacobian of eta(u) from a retained autograd graph: vjp by backward, jvp by double backward.

    Products are differentiated as scalars ``(eta * r).sum()``: ``torch.autograd.grad`` with explicit
    ``grad_outputs`` imports torch's symbolic-shape machinery (and sympy) on first use, about half a
    second of the first fit in a process.

    ``parts`` (optional): the tensors the model read as its latent sites, views of ``u`` whose flattened
    concatenation is ``u`` (:meth:`_Extraction.parts`). The forward products then differentiate ``eta`` with respect
    to them instead of ``u``: the same values (the views only place entries), without the graph's every read of a
    site writing a ``u``-sized gradient into each product (for a loop of ``T`` scalar sites, ``O(T)`` work per
    site)."""

    def __init__(self, eta, u, parts=None):
        self.eta, self.u = eta, u
        self.w = torch.zeros_like(eta, requires_grad=True)
        if parts is None:
            g = torch.autograd.grad((eta * self.w).sum(), u, create_graph=True, allow_unused=True)[0]
        else:
            gs = torch.autograd.grad((eta * self.w).sum(), parts, create_graph=True, allow_unused=True)
            g = None if all(gi is None for gi in gs) else torch.cat(
                [torch.zeros(p.numel(), dtype=u.dtype, device=u.device) if gi is None else gi.reshape(-1)
                 for p, gi in zip(parts, gs)])
        self.g = torch.zeros_like(u) if g is None else g

    def vjp(self, r):
        out = torch.autograd.grad((self.eta * r.detach()).sum(), self.u, retain_graph=True, allow_unused=True)[0]
        return torch.zeros_like(self.u) if out is None else out.detach()

    def jvp(self, v):
        if not self.g.requires_grad:
            return torch.zeros_like(self.eta).detach()
        out = torch.autograd.grad((self.g * v.detach()).sum(), self.w, retain_graph=True, allow_unused=True)[0]
        return torch.zeros_like(self.eta).detach() if out is None else out.detach()

    def jvp_many(self, V):
        """``(B, q)`` products ``J v`` of the rows of ``V`` ``(B, n)``: one backward pass vectorised over the batch
        (``is_grads_batched``) instead of ``B`` passes through the graph, a loop of :meth:`jvp` where the graph's
        operations have no batching rule."""
        out = None
        if self.g.requires_grad:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # torch's own slow fallback for an op without a batching rule
                    out = torch.autograd.grad(self.g, self.w, grad_outputs=V.detach(), retain_graph=True,
                                              allow_unused=True, is_grads_batched=True)[0]
            except (RuntimeError, UserWarning):
                return torch.stack([self.jvp(v) for v in V])
        if out is None:  # eta does not read u
            return torch.zeros(V.shape[0], self.eta.shape[0], dtype=self.eta.dtype, device=self.eta.device)
        return out.detach()

    def dense(self):
        q, n = self.eta.shape[0], self.u.shape[0]
        eye = torch.eye(min(n, q), dtype=self.u.dtype, device=self.u.device)
        if n <= q:
            if n < BATCHED_PRODUCTS_FROM:
                return torch.stack([self.jvp(e) for e in eye], 1)
            return torch.cat([self.jvp_many(eye[a:a + PROBE_BATCH]) for a in range(0, n, PROBE_BATCH)]).T
        return torch.stack([self.vjp(e) for e in eye], 0)

    def operator(self):
        q, n = self.eta.shape[0], self.u.shape[0]
        return FunctionOperator(self.jvp, self.vjp, (q, n), dtype=self.u.dtype, device=self.u.device)


#: most latent coordinates outside the ``pcv.linear`` records' blocks whose Jacobian columns are taken one by one
#: beside the recorded operators (an intercept, a few group effects: ``pcv.linear(X, w) + b``)
RECORD_REMAINDER_MAX = 64


def _recorded_operator(name, records, eta, u, layout, block_values, probe, rows=None, jac=None):
    """Operator from ``pcv.linear`` records that reproduces the Jacobian of eta (on ``rows``), or None; with ``jac``
    (:class:`_AutogradJacobian` of ``eta``) the records plus the dense columns of the few other latent coordinates
    the predictor reads (at most :data:`RECORD_REMAINDER_MAX`), so that a sparse design stays sparse beside an
    intercept."""
    q = eta.shape[0]
    candidates, covered = [], set()
    for op, rec_u, out in records:
        if out.dim() != 1 or out.shape[0] != q:
            continue
        for b in layout.blocks:
            if rec_u is block_values[b.name] and op.shape[1] == b.size:
                covered.add(b.name)
                candidates.append(op if (b.start == 0 and b.size == layout.size) else EmbedColumnsOperator(op, b.start, layout.size))
    recorded = list(candidates)
    for b in layout.blocks:  # eta is (an affine shift of) a latent block itself, e.g. a GP's f
        if b.size == q:
            sel = IdentityOperator(q, dtype=u.dtype, device=u.device)
            candidates.append(sel if b.size == layout.size else EmbedColumnsOperator(sel, b.start, layout.size))
    options = [[c] for c in candidates]
    if 1 < len(candidates) <= 4:
        options.append(candidates)
    others = [b for b in layout.blocks if b.name not in covered]
    if jac is not None and recorded and 0 < sum(b.size for b in others) <= RECORD_REMAINDER_MAX:
        options.append(recorded + _remainder_columns(jac, others, layout.size, u))
    for opts in options:
        op = opts[0] if len(opts) == 1 else SumOperator(opts)
        ok = True
        for v, jv in probe:
            try:
                ref = op.mv(v.to(op.dtype)).to(jv.dtype)
            except RuntimeError:  # e.g. a float32 recorded design in a float64 model
                ok = False
                break
            if rows is not None:
                ref, jv = ref[rows], jv[rows]
            if not torch.allclose(ref, jv, rtol=1e-9, atol=1e-9 * (1 + _absmax(jv))):
                ok = False
                break
        if ok:
            return op
    return None


def _remainder_columns(jac, blocks, n, u):
    """The Jacobian columns of ``blocks`` (few coordinates), each block's as a dense operator embedded in ``n``."""
    idx = torch.cat([torch.arange(b.start, b.start + b.size, device=u.device) for b in blocks])
    E = torch.zeros(idx.shape[0], n, dtype=u.dtype, device=u.device)
    E[torch.arange(idx.shape[0], device=u.device), idx] = 1.0
    # one product each (jvp_many's batched gradient imports torch's symbolic shapes, half a second, on first use)
    cols = torch.stack([jac.jvp(e) for e in E])  # (k, q)
    out, pos = [], 0
    for b in blocks:
        out.append(EmbedColumnsOperator(DenseOperator(cols[pos:pos + b.size].transpose(0, 1).contiguous()),
                                        b.start, n))
        pos += b.size
    return out


def _selection(idx, q, values=None, dtype=torch.float64, device=None):
    """Sparse ``(len(idx), q)`` matrix with ``values`` (default ones) at ``(k, idx[k])``."""
    k = int(idx.shape[0])
    vals = torch.ones(k, dtype=dtype, device=device) if values is None else values
    crow = torch.arange(k + 1, dtype=torch.int64, device=device)
    return SparseOperator(torch.sparse_csr_tensor(crow, idx.to(torch.int64), vals, size=(k, q), check_invariants=True))


def _select_rows(op, idx):
    """The operator of the rows ``idx`` of ``op`` (sparse stays sparse; an identity becomes a one-per-row selection)."""
    q = op.shape[0]
    if isinstance(op, DenseOperator):
        return DenseOperator(op.matrix[idx])
    if isinstance(op, SparseOperator):
        return op.rows(idx)
    if isinstance(op, DiagonalOperator):
        vals = None if isinstance(op, IdentityOperator) else op.diag[idx]
        return _selection(idx, q, vals, dtype=op.dtype, device=op.device)
    if isinstance(op, EmbedColumnsOperator):
        return EmbedColumnsOperator(_select_rows(op.base, idx), op.start, op.total)
    if isinstance(op, SumOperator):
        return SumOperator([_select_rows(o, idx) for o in op.operators], op.coefficients)
    return ComposedOperator(_selection(idx, q, dtype=op.dtype, device=op.device), op)


def _probed_operator(jac, layout, q, n, dtype, device):
    """A sparse design from :func:`~pyro_convexvb.lgm.chains.probe_sparse_jacobian` (a few products per latent
    block: ``pcv.linear``-free predictors such as ``alpha[g] + X @ b``), or ``None`` when the probing does not
    recover it or the result is not sparse (more than :data:`PROBE_MAX_DENSITY` nonzeros)."""
    import numpy as np
    import scipy.sparse as sp

    from .chains import _torch_csr, probe_sparse_jacobian

    got = _residue_probe(jac, layout, q, n, dtype, device)
    if got is None:
        many = jac.jvp_many if len(layout.blocks) >= BATCHED_PRODUCTS_FROM else None
        got = probe_sparse_jacobian(jac.jvp, [b.slice for b in layout.blocks], q, n, dtype, device, jvp_many=many)
    if got is None or len(got[0]) > PROBE_MAX_DENSITY * q * n:
        return None
    r, c, v = got
    if not np.isfinite(v).all():
        return None
    M = sp.csr_matrix((v, (r, c)), shape=(q, n))
    return SparseOperator(_torch_csr(M, dtype, device))


def _residue_probe(jac, layout, q, n, dtype, device):
    """``(rows, cols, vals)`` of the predictor's Jacobian by :func:`~pyro_convexvb.lgm.chains.probe_by_residues` when
    the layout has at least :data:`RESIDUE_PROBE_FROM_BLOCKS` blocks (else, or when its structure is not banded,
    ``None``)."""
    import numpy as np

    from .chains import probe_by_residues

    if len(layout.blocks) < RESIDUE_PROBE_FROM_BLOCKS:
        return None
    got = probe_by_residues(jac.jvp, q, n, dtype, device)
    if got is None or not np.isfinite(got[2]).all():
        return None
    return got


def _affine_operator(name, eta, eta1, u0, u1, gen, records, layout, vals, dtype, rows=None, keep_graph=False,
                     parts=None, computed=()):
    """``(operator, offset, B u0)`` with ``eta(u) = operator @ u + offset`` on ``rows`` (all rows by default) and
    ``B u0`` the product of the map on all rows at ``u0`` (an extraction template's offsets follow from it).
    ``computed``: the dtypes the model computed the predictor in (its latents'), whose rounding the affinity test
    allows when lower than ``dtype``.

    ``eta`` is the predictor at ``u0`` (with its autograd graph), ``eta1`` at ``u1``; raises if the
    two points do not lie on one affine map. ``parts``: the site values as views of ``u0``
    (:class:`_AutogradJacobian`).
    """
    n = u0.shape[0]
    jac = _AutogradJacobian(eta, u0, parts)
    du = (u1 - u0).detach()
    jdu = jac.jvp(du)
    e0, e1, jd = eta.detach(), eta1, jdu
    if rows is not None:
        e0, e1, jd = e0[rows], e1[rows], jd[rows]
    if not bool(torch.isfinite(e0).all()):
        raise UnsupportedModelError(name, "the predictor is not finite (e.g. log of a zero Poisson rate or exposure)")
    lin_err = _absmax((e1 - e0 - jd))
    scale_ref = 1.0 + _absmax(e1) + _absmax(e0)
    tol = _affine_tol(dtype, e0, e1, *computed)
    if not math.isfinite(lin_err) or lin_err > tol * scale_ref:
        raise UnsupportedModelError(
            name, f"the predictor is not an affine function of the latent variables (deviation {lin_err:.3g})")
    v2 = torch.randn(n, generator=gen, dtype=dtype).to(u0.device)
    probe = [(du, jdu), (v2, jac.jvp(v2))]
    op = _recorded_operator(name, records, eta, u0, layout, vals, probe, rows=rows, jac=jac)
    if op is None:
        q = eta.shape[0]
        sparse_worth = q * n > PROBE_MIN_ENTRIES or n >= PROBE_MIN_LATENTS
        op = _probed_operator(jac, layout, q, n, dtype, u0.device) if sparse_worth else None
    if op is None and q * n <= DENSE_JACOBIAN_LIMIT:
        # the entries jac.dense() takes by one forward product per column (n <= q), from a few such products
        got = _residue_probe(jac, layout, q, n, dtype, u0.device) if n <= q else None
        if got is not None:
            dense = torch.zeros(q, n, dtype=dtype, device=u0.device)
            r, c, v = (torch.as_tensor(a).to(u0.device) for a in got)
            dense[r, c] = v.to(dtype)
            op = DenseOperator(dense)
        else:
            op = DenseOperator(jac.dense())
    if op is None:
        op = jac.operator()
    Bu0 = op.mv(u0.detach()).to(eta.dtype)
    offset = _d(eta - Bu0, keep_graph)
    if rows is not None:
        op, offset = _select_rows(op, rows), offset[rows]
    return op, offset, Bu0


def _factor_group(name, F0, u0, F1, u1, dtype):
    r"""Site group and constant of a ``pyro.factor`` that is a concave quadratic in ``u``.

    ``F(u) = -u^T P u / 2 + b^T u + c`` with ``P = A^T A`` (``A`` of rank ``r``, from the eigenvectors of
    ``P`` with positive eigenvalues) is ``log N(z | A u, I_r)`` plus a constant, ``z = A^{+T} b``:
    a Gaussian site group. The quadratic form is checked at a second point (value and gradient).
    """
    n = u0.shape[0]
    if n > _FACTOR_MAX_LATENTS:
        raise UnsupportedModelError(name, f"a pyro.factor that depends on the latent variables is recognised for up to "
                                          f"{_FACTOR_MAX_LATENTS} latent coordinates (the model has {n})")
    try:
        g0 = torch.autograd.grad(F0, u0, create_graph=True)[0]
        rows = []
        for i in range(n):
            r = torch.autograd.grad(g0[i], u0, retain_graph=True, allow_unused=True)[0] if g0.requires_grad else None
            rows.append(torch.zeros_like(u0) if r is None else r)
        H = torch.stack(rows)
        g1 = torch.autograd.grad(F1, u1)[0]
    except RuntimeError as e:
        raise UnsupportedModelError(name, f"the pyro.factor could not be differentiated twice ({e})") from None
    H = torch.nan_to_num(H.detach(), nan=math.inf)
    g0, F0v, F1v, g1 = g0.detach(), float(F0.detach()), float(F1.detach()), g1.detach()
    ref = 1.0 + abs(F0v) + abs(F1v)
    du = (u1 - u0).detach()
    tol = _affine_tol(dtype, F0, F1)
    ok = bool(torch.isfinite(H).all()) and math.isfinite(F0v) and math.isfinite(F1v)
    if ok:
        pred_F = F0v + float(g0 @ du) + 0.5 * float(du @ H @ du)
        pred_g = g0 + H @ du
        ok = abs(pred_F - F1v) <= tol * ref and float((pred_g - g1).abs().max()) <= tol * (1 + float(g1.abs().max()))
    not_gaussian = ("the pyro.factor depends on the latent variables but is not a Gaussian log density of an affine "
                    "predictor; write the likelihood as pyro.sample(..., obs=...) with a supported distribution")
    if not ok:
        raise UnsupportedModelError(name, not_gaussian + " (it is not quadratic in the latents)")
    P = -0.5 * (H + H.transpose(0, 1))
    lam, Vec = torch.linalg.eigh(P)
    top = float(lam.abs().max())
    if float(lam.min()) < -1e-9 * max(top, 1.0):
        raise UnsupportedModelError(name, not_gaussian + " (it is a convex, not a concave, quadratic)")
    keep = lam > 1e-10 * max(top, 1.0)
    lam_r, V_r = lam[keep], Vec[:, keep]
    b = g0 + P @ u0.detach()
    b_perp = b - V_r @ (V_r.transpose(0, 1) @ b)
    if _absmax(b_perp) > 1e-8 * (1 + _absmax(b)):
        raise UnsupportedModelError(name, not_gaussian + " (it grows linearly along a direction of the latents)")
    A = lam_r.sqrt()[:, None] * V_r.transpose(0, 1)  # (r, n), A^T A = P
    z = (V_r.transpose(0, 1) @ b) / lam_r.sqrt()
    r = int(lam_r.shape[0])
    u0d = u0.detach()
    c = F0v - float(b @ u0d) + 0.5 * float(u0d @ P @ u0d)
    const = c + 0.5 * float(z @ z) + 0.5 * r * math.log(2 * math.pi)
    group = SiteGroup(name, Gaussian(z, torch.ones(r, dtype=dtype, device=u0.device)), DenseOperator(A),
                      torch.zeros(r, dtype=dtype, device=u0.device), (r,))
    return group, const


def lgm_from_pyro(model, *args, dtype=None, keep_graph=False, **kwargs):
    """Trace a Pyro model and return its :class:`LatentGaussianModel`.

    Over 80 lines: most of it is this docstring; the body is under 80.

    Recognised: latent sites (any shape, flattened and concatenated in model order) with Normal,
    MultivariateNormal, SparseGMRF (intrinsic ones with ``constraints`` included) or Laplace priors (a Laplace
    prior becomes Laplace sites on the block, Nickisch & Seeger 2009 §2); the mean of a Normal,
    MultivariateNormal or SparseGMRF may be affine in other latent Gaussian sites (an affine Gaussian chain:
    centred hierarchies, AR loops; :mod:`pyro_convexvb.lgm.chains`: hierarchies in the innovation form, where
    ``LatentGaussianModel.chain`` maps ``u`` to the model's sites, chains that would fill in (an AR loop) as one
    prior block of sparse precision over the sites themselves); observed sites Bernoulli(logits=... or
    probs=...; ``probs=Normal(loc, scale).cdf(eta)`` with fixed ``loc``, ``scale`` is a probit site of
    the predictor ``(eta - loc) / scale``), Poisson(rate=exp(...)) and Normal(loc=..., scale fixed) whose
    predictor is an affine function of the latents; plates, including subsampled ones (traced on the full data, so no
    mini-batch scaling applies).

    Pyro's handlers and idioms:

    * masks (``poutine.mask``, ``dist.mask(...)``, the observed part of ``obs_mask``): masked rows
      are absent from the likelihood;
    * ``poutine.scale(scale=w)`` on a likelihood site: tempered sites ``t(eta)^w``, Gaussian ones as
      Gaussians of variance ``s^2 / w`` (exact), the others in a
      :class:`~pyro_convexvb.lgm.sites.Weighted` family; rows of weight zero are dropped;
    * ``pyro.deterministic``: a record, not part of the density;
    * ``pyro.factor``: a factor that does not depend on the latents joins ``log_const``; one that is
      a concave quadratic in them (a Gaussian log density of an affine predictor, e.g.
      ``dist.Normal(X @ w, s).log_prob(y)``) becomes a Gaussian site group; anything else is refused;
    * ``obs_mask`` on a Normal likelihood (and any latent ``Normal(eta, s)``, ``eta`` affine, that no
      other site reads): an :class:`~pyro_convexvb.lgm.model.ImputedBlock`, integrated out of ``u``;
      :meth:`~pyro_convexvb.LatentGaussianModel.complete_posterior` gives its posterior (the
      predictive) jointly with ``u``. Its entries that the model masks out have no density in the
      model and are given the same conditional; the bound is the bound on the evidence of the
      observed data.

    The affine map is taken from :func:`pyro_convexvb.linear` calls when the model uses them
    (sparse designs stay sparse), otherwise probed with autograd: for a sparse structure first when ``q * n >
    PROBE_MIN_ENTRIES`` or ``n >= PROBE_MIN_LATENTS``, else as a dense Jacobian when ``q * n <=
    DENSE_JACOBIAN_LIMIT``, else kept as a vjp/jvp operator. Affinity is checked at two random points, the second
    in the orthant opposite to the first; what the derivatives at the first say is constant is compared at the
    second.

    :param model: a Pyro model callable.
    :param args: positional arguments of the model (data).
    :param bool keep_graph: keep the autograd history from the model's ``pyro.param`` sites into the prior
        parameters, noise scales, offsets and constants of the LGM (for envelope gradients of type-II
        maximum likelihood); designs are always detached.
    :param dtype: floating dtype of the LGM (default: the widest floating dtype of the observed data
        and the latent sites, e.g. float64 when the data are float32 and the parameters float64).
        The model itself always runs in its own dtypes.
    :param kwargs: keyword arguments of the model (e.g. ``y=...`` observations).

    A model with an ``extraction_cache`` dict attribute (type-II learning's model at other params,
    :mod:`pyro_convexvb.infer.type2`; the conditioned models of hyper-latent integration) keeps its structure trace
    there, and later extractions at other params skip it while the model's sample sites and their shapes stay the
    same. With an :class:`~pyro_convexvb.lgm.template.ExtractionTemplate` under ``"template"`` it also keeps the
    affine maps of the sites and chains, which later extractions take where they recognise them (one run of the
    model instead of two, no probing; the result is that of a fresh extraction).

    :raises UnsupportedModelError: naming the site and the reason, for models outside the class, and
        (site ``'<model>'``) for a model that fails on mixed float32/float64 tensors.

    With row-sharded data (an argument made by :func:`pyro_convexvb.distributed.row_sharded`, an active process
    group) every observed site holds this rank's rows: the model is extracted on them with no communication and
    each site group's design becomes a row-sharded operator (:func:`pyro_convexvb.distributed.shard_sites`).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(10, 2, dtype=torch.float64); y = torch.ones(10, dtype=torch.float64)
        >>> lgm = lgm_from_pyro(model, X, y=y)
        >>> torch.allclose(lgm.sites[0].design.to_dense(), X)
        True
    """
    from ..distributed import agree_on_errors, find_comm, local_only, shard_sites

    if find_comm(args, kwargs) is not None:
        # row-sharded data (pcv.distributed): extract on this rank's rows with no communication (probes are
        # local), then mark every site group as this rank's rows of the global design; a rank's refusal is raised
        # on every rank (the others would wait in shard_sites' collective)
        def local():
            with local_only():
                return lgm_from_pyro(model, *args, dtype=dtype, keep_graph=keep_graph, **kwargs)

        return shard_sites(agree_on_errors(local))
    with full_data_plates(), record_normal_cdf(), torch.enable_grad():  # affinity is probed with autograd
        return _extract(model, args, kwargs, dtype, bool(keep_graph))


_DTYPE_WORDS = ("dtype", "scalar type", "Double", "Float", "Half")


class _CurrentSite(poutine.messenger.Messenger):
    """Records the name of the sample site being processed (the one whose sampling fails, when one does)."""

    name = None

    def _pyro_sample(self, msg):
        self.name = msg["name"]


def _first_trace(model, args, kwargs):
    handler = poutine.trace(model)
    current = _CurrentSite()
    try:
        with torch.no_grad(), current:
            return handler.get_trace(*args, **kwargs)
    except NotImplementedError as e:  # e.g. ImproperUniform: Pyro cannot draw the latent site's prior value
        if current.name is None:
            raise
        raise UnsupportedModelError(
            current.name, f"its distribution cannot be sampled ({str(e).splitlines()[0]}), and every engine starts "
                          "from a draw of each latent site's prior: give it a proper prior") from None
    except RuntimeError as e:
        msg = str(e).split("\n")[0]
        if not any(w in msg for w in _DTYPE_WORDS):
            raise
        seen = [n for n, s in handler.msngr.trace.nodes.items() if s["type"] == "sample" and not _is_subsample(s)]
        where = f" after site '{seen[-1]}'" if seen else ""
        given = sorted({str(t.dtype).replace("torch.", "") for t in list(args) + list(kwargs.values())
                        if torch.is_tensor(t) and t.is_floating_point()})
        raise UnsupportedModelError(
            "<model>", f"the model fails{where} on tensors of different floating dtypes ({msg}); the data are "
                       f"{', '.join(given) or 'not tensors'}: give the data and the model's parameters one dtype, "
                       "e.g. torch.as_tensor(X, dtype=torch.float64)") from None


def _site_tensors(site):
    """The tensors a site's density reads: every tensor attribute of its distribution and of its wrappers,
    and its observed value."""
    out = [site["value"]] if site["is_observed"] and torch.is_tensor(site["value"]) else []
    fn = site["fn"]
    while fn is not None:
        out.extend(v for v in vars(fn).values() if torch.is_tensor(v))
        fn = getattr(fn, "base_dist", None)
    return out


def _read_mask(t, u):
    """The coordinates of ``u`` that tensor ``t`` depends on, ``(u.numel(),)`` bool, or ``None`` for none (a random
    projection of its Jacobian; NaN counts as dependence)."""
    if not torch.is_tensor(t) or not t.requires_grad:
        return None
    gen = torch.Generator().manual_seed(1)
    w = (torch.rand(t.shape, generator=gen, dtype=t.dtype) + 0.5).to(t.device)
    g = torch.autograd.grad((t * w).sum(), u, retain_graph=True, allow_unused=True)[0]
    return None if g is None else ((g != 0) | torch.isnan(g)).reshape(-1)


class _Readers:
    """For each coordinate of ``u``, how many sample sites read it (their distributions' tensors and observed
    values), each site's own mask kept to leave it out: one gradient per tensor, not one per (site, block) pair,
    so a chain of ``T`` sites costs ``O(T)`` gradients instead of ``O(T^2)``."""

    def __init__(self, tr, u):
        self.count = torch.zeros(u.numel(), dtype=torch.int64, device=u.device)
        self.own = {}
        for name, s in tr.nodes.items():
            if s["type"] != "sample" or _is_subsample(s) or _is_deterministic(s):
                continue
            mask = None
            for t in _site_tensors(s):
                m = _read_mask(t, u)
                if m is not None:
                    mask = m if mask is None else mask | m
            if mask is not None:
                self.own[name] = torch.nonzero(mask).reshape(-1)  # the coordinates it reads (not an n-mask per site)
                self.count += mask.long()

    def read_by_others(self, name, sl):
        """Whether a sample site other than ``name`` reads ``u[sl]``."""
        c = self.count[sl].clone()
        own = self.own.get(name)
        if own is not None:
            mine = own[(own >= sl.start) & (own < sl.stop)]
            c[mine - sl.start] -= 1
        return bool((c > 0).any())


def _is_deterministic(site):
    return bool((site.get("infer") or {}).get("_deterministic"))


def _is_factor(site):
    return isinstance(_unwrap(site["fn"])[0], dist.Unit)


_SCALE_ATTRS = ("scale", "scale_tril", "_unbroadcasted_scale_tril", "precision_scale")


def _is_gaussian_chain_prior(base):
    from ..distributions import SparseGMRF

    return isinstance(base, (dist.Normal, torch.distributions.Normal, dist.MultivariateNormal,
                             torch.distributions.MultivariateNormal, SparseGMRF))


def _classify_dependent_latents(tr, layout, u):
    """``(imputed names, chain names)`` of the latent sites whose distribution reads other latent sites.

    A ``Normal(eta, s)`` that no other site reads is integrated out (an :class:`ImputedBlock`); a ``Normal``,
    ``MultivariateNormal`` or ``SparseGMRF`` whose ``loc`` (only) reads other latents is a child of an affine
    Gaussian chain (:mod:`pyro_convexvb.lgm.chains`); anything else is refused, naming the site and the reason.
    """
    imputed, chain, readers = set(), [], None
    for b in layout.blocks:
        site = tr.nodes[b.name]
        base, _ = _unwrap(site["fn"])
        loc_dep = _depends_on(getattr(base, "loc", None), u)
        scale_dep = any(_depends_on(getattr(base, a, None), u) for a in _SCALE_ATTRS)
        if not (loc_dep or scale_dep):
            continue
        if scale_dep:
            raise UnsupportedModelError(
                b.name, "the scale (or precision) of the latent site depends on another latent site whose prior is "
                        "Gaussian: only its mean may be affine in other latent Gaussian sites; a positive hyper-latent "
                        "on the scale (e.g. HalfCauchy, LogNormal) is integrated by the engines' hyper option")
        if not _is_gaussian_chain_prior(base):
            raise UnsupportedModelError(
                b.name, f"the parameters of its {type(base).__name__} prior depend on another latent site; only a "
                        "Normal, MultivariateNormal or SparseGMRF mean may be affine in other latent Gaussian sites "
                        "(an affine Gaussian chain)")
        readers = readers or _Readers(tr, u)
        read = readers.read_by_others(b.name, b.slice)
        if not read and isinstance(base, (dist.Normal, torch.distributions.Normal)):
            imputed.add(b.name)
        else:
            chain.append(b.name)
    return imputed, chain


def _intrinsic_prior(b, base, dtype, device, keep_graph=False):
    """``(prior block, (slice, factor, loc, name))`` of an intrinsic ``SparseGMRF`` block: the prior of its
    ``u``-part ``w`` (``N(0, (s Q_RR)^{-1})`` on the non-pivot coordinates ``R``, ``N(0, 1)`` on the ``k`` pivot
    coordinates, which the model does not read), with ``x = loc + phi(Pi w)`` (:mod:`pyro_convexvb.lgm.chains`)."""
    import numpy as np
    import scipy.sparse as sp

    if keep_graph:
        raise UnsupportedModelError(b.name, "gradients of the evidence with respect to the parameters of an intrinsic "
                                            "SparseGMRF (keep_graph, learn_params) are not available")
    _check_gmrf_shape(b.name, base, b.shape)
    fac = base._intrinsic
    s = float(base.precision_scale.detach())
    A = base.precision.matrix
    Q = sp.csr_matrix((A.values().detach().cpu().numpy(), A.col_indices().cpu().numpy(), A.crow_indices().cpu().numpy()),
                      shape=A.shape).tocoo()
    pivot = np.zeros(fac.n, dtype=bool)
    pivot[fac.P] = True
    keep = ~(pivot[Q.row] | pivot[Q.col])
    rows = np.concatenate([Q.row[keep], fac.P])
    cols = np.concatenate([Q.col[keep], fac.P])
    vals = np.concatenate([s * Q.data[keep], np.ones(fac.k)])
    P = sp.csr_matrix((vals, (rows, cols)), shape=Q.shape)
    P.sort_indices()
    prec = SparseOperator(torch.sparse_csr_tensor(torch.as_tensor(P.indptr, dtype=torch.int64),
                                                  torch.as_tensor(P.indices, dtype=torch.int64),
                                                  torch.as_tensor(P.data, dtype=dtype), size=P.shape).to(device))
    logdet_cov = -((fac.n - fac.k) * math.log(s) + float(fac.chol.logdet()))
    prior = PriorBlock(b.name, torch.zeros(fac.n, dtype=dtype, device=device), prec=prec, logdet_cov=logdet_cov)
    loc = base.loc.detach().expand(fac.n).reshape(-1).to(torch.float64).cpu().numpy()
    return prior, (b.slice, fac, loc, b.name)


def _reads_leaves_other_than(t, u):
    """Whether the autograd graph of ``t`` reaches a leaf tensor other than ``u`` (e.g. a ``pyro.param`` value)."""
    if not torch.is_tensor(t) or t.grad_fn is None:
        return torch.is_tensor(t) and t.requires_grad and t is not u
    seen, stack = set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
        if var is not None and var is not u:
            return True
        stack.extend(f for f, _ in fn.next_functions)
    return False


def _chain_batch(x, chain_names):
    """``{child: (rows, cols, vals, J u0)}``: the mean coefficients of every child of the affine Gaussian chain at
    once, or ``None`` (the children are then extracted one by one, by :func:`_chain_prior`, which names the site of
    any refusal).

    The children's means, stacked, are one linear map of ``u`` probed by
    :func:`~pyro_convexvb.lgm.chains.probe_by_residues`: a few products through the model's graph, where one
    gradient per child would cost ``O(T)`` products for a loop of ``T`` sites, each also ``O(T)``. The entries are
    those of the per-child probing (each nonzero one product term); a mean that reads a site sampled after it, is not
    finite or not affine (tested at the second point as per child), or a structure the residue classes do not
    recover gives ``None``; so does a chain of fewer than :data:`CHAIN_BATCH_FROM` children."""
    import numpy as np

    from .chains import probe_by_residues

    if len(chain_names) < max(CHAIN_BATCH_FROM, 2):
        return None
    dtype, u0, layout = x.dtype, x.u0, x.layout
    by_name = {b.name: b for b in layout.blocks}
    u1, tr1, _, _ = x.second_trace()
    locs, locs1 = [], []
    for name in chain_names:
        fn = x.tr.nodes[name]["fn"]
        full = tuple(fn.batch_shape) + tuple(fn.event_shape)
        locs.append(_unwrap(fn)[0].loc.expand(full).reshape(-1).to(dtype))
        locs1.append(_unwrap(tr1.nodes[name]["fn"])[0].loc.expand(full).reshape(-1).detach().to(dtype))
    sizes = np.array([t.shape[0] for t in locs])
    if np.any(sizes != np.array([by_name[nm].size for nm in chain_names])) or not sizes.all():
        return None
    L, m = torch.cat(locs), int(sizes.sum())
    got = probe_by_residues(_AutogradJacobian(L, u0, x.parts()).jvp, m, u0.shape[0], dtype, u0.device)
    if got is None or not np.isfinite(got[2]).all():
        return None
    first = np.concatenate([[0], np.cumsum(sizes)])  # the children's first rows in L
    child = np.repeat(np.arange(len(chain_names)), sizes)
    starts = np.array([by_name[nm].start for nm in chain_names])
    r, c, v = got
    if (c >= starts[child[r]]).any():  # a mean reads a site sampled after it
        return None
    J = torch.sparse_coo_tensor(torch.stack([torch.as_tensor(r), torch.as_tensor(c)]), torch.as_tensor(v, dtype=dtype),
                                (m, u0.shape[0])).coalesce().to(u0.device)
    r, c = (a.cpu().numpy() for a in J.indices())
    v = J.values().cpu().to(torch.float64).numpy()
    e0, e1 = L.detach(), torch.cat(locs1)
    pred = e0 + torch.sparse.mm(J, (u1 - u0).detach().unsqueeze(-1)).squeeze(-1)
    tol = _affine_tol(dtype, e0, e1)
    err, ref1, ref0 = (np.maximum.reduceat(t.abs().cpu().numpy(), first[:-1])  # per child: the max over its rows
                       for t in (pred - e1, e1, e0))
    if not (np.isfinite(err).all() and (err <= tol * (1.0 + ref1 + ref0)).all()):
        return None
    Ju0 = torch.sparse.mm(J, u0.detach().unsqueeze(-1)).squeeze(-1)
    lo = np.searchsorted(r, first)  # r is sorted (coalesced): each child's entries are one run
    return {nm: (r[lo[k]:lo[k + 1]] - first[k], c[lo[k]:lo[k + 1]], v[lo[k]:lo[k + 1]], Ju0[first[k]:first[k + 1]])
            for k, nm in enumerate(chain_names)}


def _chain_prior(x, b, site, batch=None):
    """``(prior block, (rows, cols, vals))`` of a chain child ``b``: its prior ``N(b, S)`` on ``u_b = x_b - A_b x``
    and the coordinates of ``A_b`` (rows within the block, columns of ``u``); refuses a mean that is not affine.
    With an extraction template (:mod:`~pyro_convexvb.lgm.template`) whose coefficients the mean matches, they are
    the template's; else those of ``batch`` (a callable giving :func:`_chain_batch`'s dict or ``None``) when it has
    them."""
    from .chains import chain_jacobian

    dtype, device, keep_graph, u0, layout = x.dtype, x.device, x.keep_graph, x.u0, x.layout
    fn = site["fn"]
    base, _ = _unwrap(fn)
    full = tuple(fn.batch_shape) + tuple(fn.event_shape)
    loc = base.loc.expand(full).reshape(-1).to(dtype)
    if keep_graph and _reads_leaves_other_than(loc, u0):
        raise UnsupportedModelError(
            b.name, "the mean of this child of an affine Gaussian chain depends on a pyro.param value: its coefficients "
                    "and constant are extracted as constants, so gradients of the evidence with respect to those "
                    "params (keep_graph, learn_params) are not available; make the param a latent site, or fix it")
    hit = None if x.template is None else x.template.lookup("chain", b.name, loc, u0)
    pre = None if hit is not None or batch is None else (batch() or {}).get(b.name)
    if hit is not None:
        (rows, cols, vals), Ju0 = hit.value, hit.Bu0
    elif pre is not None:
        rows, cols, vals, Ju0 = pre
        if x.template is not None:
            x.template.store("chain", b.name, loc, u0, None, (rows, cols, vals), Ju0)
    else:
        u1, tr1, _, _ = x.second_trace()
        loc1 = _unwrap(tr1.nodes[b.name]["fn"])[0].loc.expand(full).reshape(-1).detach().to(dtype)
        gen = torch.Generator().manual_seed(2)
        w = (torch.rand(loc.shape, generator=gen, dtype=loc.dtype) + 0.5).to(loc.device)
        g = torch.autograd.grad((loc * w).sum(), u0, retain_graph=True, allow_unused=True)[0]
        parents = [] if g is None else layout.blocks_at((g != 0) | torch.isnan(g))
        for p in parents:
            if p.start >= b.start:
                raise UnsupportedModelError(b.name, f"its mean reads the latent site '{p.name}', sampled after it")
        rows, cols, vals = chain_jacobian(b.name, loc, u0, [p.slice for p in parents], dtype)
        J = torch.sparse_coo_tensor(torch.stack([torch.as_tensor(rows), torch.as_tensor(cols)]),
                                    torch.as_tensor(vals, dtype=dtype), (loc.shape[0], u0.shape[0])).to(device)
        du = (u1 - u0).detach()
        e0 = loc.detach()
        pred = e0 + torch.sparse.mm(J, du.unsqueeze(-1)).squeeze(-1)
        err = _absmax(pred - loc1)
        tol = _affine_tol(dtype, e0, loc1)
        if not math.isfinite(err) or err > tol * (1.0 + _absmax(loc1) + _absmax(e0)):
            raise UnsupportedModelError(
                b.name, f"the mean of the latent site is not an affine function of the latent sites it reads "
                        f"({', '.join(p.name for p in parents)}; deviation {err:.3g}); an affine Gaussian chain needs "
                        "loc = A x + b")
        Ju0 = torch.sparse.mm(J, u0.detach().unsqueeze(-1)).squeeze(-1)
        if x.template is not None:
            x.template.store("chain", b.name, loc, u0, None, (rows, cols, vals), Ju0)
    offset = loc.detach() - Ju0
    prior, lap = _latent_prior(b.name, fn, b.shape, dtype, device, keep_graph, loc=offset)
    return prior, (rows, cols, vals)


def _same_sites(tr, other):
    """Refuse a model whose sample sites (names, kinds, shapes) differ between two runs at different latent values,
    naming the first site that differs: a model that branches on a latent."""
    from itertools import zip_longest

    for s, t in zip_longest(_sites(tr), _sites(other)):
        if s != t:
            raise UnsupportedModelError((s or t)[0], "the site is sampled, or has a shape, at some values of the "
                                                     "latent sites and not at others (the model branches on a "
                                                     "latent): outside the latent Gaussian model class")


def _sites(tr):
    """The sample sites of a trace with their kind and shapes: what an extraction's structure depends on."""
    return [(n, s["is_observed"], tuple(s["fn"].batch_shape), tuple(s["fn"].event_shape)) for n, s in tr.nodes.items()
            if s["type"] == "sample" and not _is_subsample(s)]


def _classify_sites(tr0):
    """Latent, observed and factor site names of the structure trace; refuses discrete latents and latent sites of
    a constrained support (before any run at random points)."""
    latent, observed, factors = [], [], []
    for name, site in tr0.nodes.items():
        if site["type"] != "sample" or _is_subsample(site) or _is_deterministic(site):
            continue
        if _is_factor(site):
            factors.append(name)
        elif site["is_observed"]:
            observed.append(name)
        else:
            if site["fn"].support.is_discrete if hasattr(site["fn"], "support") else False:
                base = obs_mask_base(name, tr0.nodes)
                if base is not None:
                    raise UnsupportedModelError(
                        name, f"the missing entries of the partially observed discrete site '{base}' (obs_mask) are "
                              "discrete latent variables, outside the latent Gaussian model class; leave them out of "
                              "the likelihood with poutine.mask or dist.mask(...) instead (with any valid value, e.g. "
                              "0, in their place: Pyro validates masked data too)")
                raise UnsupportedModelError(name, "discrete latent variables are outside the latent Gaussian model class")
            latent.append(name)
    if not latent:
        raise UnsupportedModelError("<model>", "the model has no latent sample site")
    for name in latent:  # constrained priors cannot be field priors: refuse before running at random points
        support = element_support(tr0.nodes[name]["fn"])
        if support is not torch.distributions.constraints.real:
            base, _ = _unwrap(tr0.nodes[name]["fn"])
            raise UnsupportedModelError(
                name, f"unsupported prior {type(base).__name__} (support {support}): a latent site needs a Normal, "
                      "MultivariateNormal, Laplace or SparseGMRF prior")
    return latent, observed, factors


def _extraction_dtype(tr0, latent, observed, dtype):
    """The dtype of the model (``dtype``, else the observed data's promoted with the latents'), and each latent's."""
    site_dtype = {n: tr0.nodes[n]["value"].dtype for n in latent}
    if dtype is None:
        floats = [site_dtype[n] for n in latent if site_dtype[n].is_floating_point]
        obs_floats = [tr0.nodes[n]["value"].dtype for n in observed
                      if torch.is_tensor(tr0.nodes[n]["value"]) and tr0.nodes[n]["value"].is_floating_point()]
        dtype = obs_floats[0] if obs_floats else torch.float64
        for d in floats:
            dtype = torch.promote_types(dtype, d)
    return dtype, site_dtype


class _Extraction:
    """One extraction's context: the model run at random latent points ``u0`` (and, on demand, ``u1``) of the
    layout, from which each phase (:func:`_prior_blocks`, :func:`_imputed_blocks`, :func:`_observed_groups`,
    :func:`_factor_groups`) reads its sites."""

    def __init__(self, model, args, kwargs, dtype, keep_graph, site_dtype, device):
        self.model, self.args, self.kwargs = model, args, kwargs
        self.dtype, self.keep_graph, self.site_dtype, self.device = dtype, keep_graph, site_dtype, device
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self.fixed, self._second = None, None
        #: an :class:`~pyro_convexvb.lgm.template.ExtractionTemplate` whose affine maps this extraction reuses
        #: where they match (``None``: every map is extracted)
        self.template = None

    def draw(self, n):
        return torch.randn(n, generator=self.gen, dtype=self.dtype).to(self.device).requires_grad_(True)

    def run_at(self, u, layout):
        vals = {b.name: u[b.slice].reshape(b.shape).to(self.site_dtype[b.name]) for b in layout.blocks}
        all_vals = dict(vals)
        if self.fixed:
            all_vals.update(self.fixed)
        tr, recs = _trace(self.model, self.args, self.kwargs, values=all_vals)
        return tr, recs, vals

    def at(self, u0, layout):
        """Run the model at ``u0``: the trace every phase reads."""
        self.u0, self.layout, self.n = u0, layout, layout.size
        self.tr, self.records, self.vals = self.run_at(u0, layout)

    def parts(self):
        """The values the model read as its latent sites at ``u0``, in layout order (views of ``u0`` whose flattened
        concatenation is ``u0``), or ``None`` when a site runs in another dtype than the extraction (its value is
        then a converted copy, and products are taken with respect to ``u0``)."""
        vals = [self.vals[b.name] for b in self.layout.blocks]
        if any(v.dtype != self.dtype or not v.requires_grad for v in vals):
            return None
        return vals

    def second_trace(self):
        """``(u1, trace, records, values)`` at a second random point (drawn once, on first use), every coordinate of
        the sign opposite to ``u0``'s: a map with a kink at zero (``abs``, ``relu``, a clamp at 0) is affine on
        each orthant, so two points of one orthant (probability ``2^-d`` for ``d`` coordinates read) would pass the
        affinity tests with the map of that orthant."""
        if self._second is None:
            u1 = (-torch.sign(self.u0.detach()) * self.draw(self.n).detach().abs()).requires_grad_(True)
            self._second = (u1,) + self.run_at(u1, self.layout)
            _same_sites(self.tr, self._second[1])
        return self._second

    def affine(self, name, eta, eta1, rows=None):
        """``(operator, offset)`` of the predictor ``eta`` (at ``u0``, with its graph) on ``rows``: the template's
        operator when it recognises the map, else extracted with ``eta1`` (the predictor at ``u1``, or a callable
        that reads it from the second trace, called only then)."""
        tpl = self.template
        hit = None if tpl is None else tpl.lookup("site", name, eta, self.u0, rows)
        if hit is not None:
            offset = _d(eta - hit.Bu0, self.keep_graph)
            return hit.value, (offset if rows is None else offset[rows])
        eta1 = eta1() if callable(eta1) else eta1
        u1 = self.second_trace()[0]
        op, offset, Bu0 = _affine_operator(name, eta, eta1, self.u0, u1, self.gen, self.records, self.layout,
                                           self.vals, self.dtype, rows=rows, keep_graph=self.keep_graph,
                                           parts=self.parts(), computed=tuple(self.site_dtype.values()))
        if tpl is not None:
            tpl.store("site", name, eta, self.u0, rows, op, Bu0)
        return op, offset


#: why a latent site with a scale factor is refused
_SCALED_LATENT = ("latent site is scaled (by poutine.scale, or by a pyro.plate with explicit subsample= indices, which "
                  "scales its prior by size / len(subsample)); scaled priors are not supported: sample the latent "
                  "over its full plate (subsample_size= is fine: it is traced at full size)")


def _prior_blocks(x, chain_names):
    """The priors of the layout's blocks, Laplace prior sites as site groups, the affine chains' Jacobian entries
    and the intrinsic GMRFs."""
    dtype, device, keep_graph, n = x.dtype, x.device, x.keep_graph, x.n
    priors, laplace_groups, chain_coo, intrinsic = [], [], [], []
    batched, children = [], set(chain_names)

    def batch():  # every child's coefficients at once, computed when the first child needs them
        if not batched:
            batched.append(_chain_batch(x, chain_names))
        return batched[0]

    for b in x.layout.blocks:
        site = x.tr.nodes[b.name]
        fn = site["fn"]
        if not _is_one(site.get("scale", 1.0)):
            raise UnsupportedModelError(b.name, _SCALED_LATENT)
        keep = _keep_rows(b.name, site)
        if keep is not None and not bool(keep.all()):
            raise UnsupportedModelError(b.name, "latent site is masked (poutine.mask or dist.mask): its masked entries "
                                                "have no prior, an improper density outside the LGM class")
        base_b = _unwrap(fn)[0]
        if getattr(base_b, "is_intrinsic", False):  # intrinsic GMRF: x = loc + phi(Pi w) (pyro_convexvb.lgm.chains)
            if b.name in children:
                raise UnsupportedModelError(b.name, "an intrinsic SparseGMRF (constraints=...) whose mean reads other "
                                                    "latent sites is not supported; give it a constant mean")
            prior, entry = _intrinsic_prior(b, base_b, dtype, device, keep_graph)
            intrinsic.append(entry)
            lap = None
        elif b.name in children:
            prior, (r, c, v) = _chain_prior(x, b, site, batch)
            chain_coo.append((r + b.start, c, v))
            lap = None
        else:
            prior, lap = _latent_prior(b.name, fn, b.shape, dtype, device, keep_graph)
        priors.append(prior)
        if lap is not None:
            loc, scale = lap
            sel = IdentityOperator(b.size, dtype=dtype, device=device)
            design = sel if (b.start == 0 and b.size == n) else EmbedColumnsOperator(sel, b.start, n)
            laplace_groups.append(SiteGroup(b.name, Laplace(scale), design, -loc, b.shape, from_prior=True))
    return priors, laplace_groups, chain_coo, intrinsic


def _imputed_blocks(x, full_layout, imputed_names):
    """The latents integrated out (the missing entries of obs_mask sites and other unread Gaussian leaves)."""
    imputed = []
    for b in full_layout.blocks:
        if b.name not in imputed_names:
            continue
        site = x.tr.nodes[b.name]
        is_unobserved = obs_mask_base(b.name, x.tr.nodes) is not None
        keep = _keep_rows(b.name, site)
        if keep is not None and not bool(keep.all()) and not is_unobserved:
            raise UnsupportedModelError(b.name, "latent site is masked (poutine.mask or dist.mask): its masked entries "
                                                "have no prior, an improper density outside the LGM class")
        if not _is_one(site.get("scale", 1.0)):
            raise UnsupportedModelError(b.name, _SCALED_LATENT)
        base, _ = _unwrap(site["fn"])
        full = tuple(site["fn"].batch_shape) + tuple(site["fn"].event_shape)
        if _depends_on(base.scale, x.u0):
            raise UnsupportedModelError(b.name, "the scale of a latent Normal depends on a latent site (not an LGM)")
        scale = _d(base.scale.expand(full).reshape(-1).to(x.dtype), x.keep_graph)
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise UnsupportedModelError(b.name, "prior scale must be positive and finite")
        eta = base.loc.expand(full).reshape(-1).to(x.dtype)

        def eta1(name=b.name):
            tr1 = x.second_trace()[1]
            return _unwrap(tr1.nodes[name]["fn"])[0].loc.expand(full).reshape(-1).detach().to(x.dtype)

        op, offset = x.affine(b.name, eta, eta1)
        filler = None if keep is None or not is_unobserved else ~keep  # obs_mask's unused entries
        imputed.append(ImputedBlock(b.name, b.shape, op, offset, scale, filler))
    return imputed


def _observed_groups(x, observed):
    """Site groups of the observed sites that read the latents, and the log density of those that do not."""
    dtype, keep_graph = x.dtype, x.keep_graph
    groups, log_const = [], 0.0
    for name in observed:
        site = x.tr.nodes[name]
        try:
            family_cls, base, eta, y, batch = _observed_site(name, site, dtype)
        except UnsupportedModelError:
            # a site of any family that reads no latent is a constant: a hyper-latent fixed by pyro.condition
            lp = _site_log_prob(site)
            if _depends_on(lp, x.u0):
                raise
            log_const += _constant_log_prob(name, lp, keep_graph)
            continue
        keep = _keep_rows(name, site)
        weight = _site_weight(name, site)
        if weight is not None:
            keep = (weight != 0) if keep is None else keep & (weight != 0)
        idx = None if keep is None or bool(keep.all()) else torch.nonzero(keep).reshape(-1)
        rows = idx
        if family_cls.vector_site and idx is not None:  # the kept observations' K design rows each
            K = eta.shape[0] // y.shape[0]
            rows = (idx.unsqueeze(-1) * K + torch.arange(K, device=idx.device)).reshape(-1)
        eta_k = eta if rows is None else eta[rows]
        site_params = family_cls.fixed_params(base)
        for value, what in site_params.values():
            if _depends_on(value, x.u0):
                raise UnsupportedModelError(name, f"the {what} depends on a latent site (not an LGM)")
        if not _depends_on(eta_k, x.u0):
            log_const += _constant_log_prob(name, _site_log_prob(site), keep_graph)
            continue
        if idx is not None and idx.numel() == 0:
            continue
        y_k = y if idx is None else y[idx]
        if not torch.isfinite(y_k).all():
            raise UnsupportedModelError(name, "observed data contain NaN or inf")
        params = {k: _d(v.expand(batch).reshape(-1).to(dtype), keep_graph) for k, (v, _) in site_params.items()}
        if family_cls.vector_site:
            params["num_classes"] = eta.shape[0] // y.shape[0]
        family = family_cls.from_site(name, y_k, **{k: v if idx is None or not torch.is_tensor(v) else v[idx]
                                                    for k, v in params.items()})
        def eta1(name=name):
            return _observed_site(name, x.second_trace()[1].nodes[name], dtype)[2].detach()

        try:
            op, offset = x.affine(name, eta, eta1, rows=rows)
        except UnsupportedModelError as err:
            raise _probs_hint(err, base) from None
        if weight is not None:
            family, const = tempered(family, (weight if idx is None else weight[idx]).to(dtype))
            log_const += const
        groups.append(SiteGroup(name, family, op, offset, batch))
    return groups, log_const


def _probs_hint(err, base):
    """``err``, with a hint when the site was given ``probs``: torch clamps probabilities away from 0 and 1, so the
    logits it recovers from ``probs = sigmoid(eta)`` saturate at about +-36 and look nonlinear at the extraction's
    random latent values (covariates of scale 5 reach that)."""
    if "probs" in vars(base) and "not an affine function" in str(err):
        return UnsupportedModelError(err.site, f"{err.reason}; the site is given probs=, whose logits torch recovers "
                                               "only within about +-36 (probabilities clamped away from 0 and 1): "
                                               "write logits=... instead of probs=sigmoid(...)")
    return err


def _constant_log_prob(name, lp, keep_graph):
    """The log density ``lp`` of an observed site that reads no latent: a constant of the evidence."""
    lp = _num(lp, keep_graph)
    if not math.isfinite(float(lp.detach() if torch.is_tensor(lp) else lp)):
        raise UnsupportedModelError(name, f"observed site that does not depend on the latents has log density {lp} "
                                          "at its data")
    return lp


def _factor_groups(x, factors, log_const):
    """Site groups of the ``pyro.factor`` terms that read the latents; ``log_const`` plus the terms that do not."""
    groups = []
    for name in factors:
        site = x.tr.nodes[name]
        F0 = _site_log_prob(site)
        if not _depends_on(F0, x.u0):
            val = _num(F0, x.keep_graph)  # with keep_graph, its dependence on the params (a prior on them) is kept
            plain = float(F0.detach())
            if not math.isfinite(plain):
                raise UnsupportedModelError(name, f"pyro.factor has the value {plain}")
            log_const += val
            continue
        u1, tr1, _, _ = x.second_trace()
        group, const = _factor_group(name, F0.to(x.dtype), x.u0, _site_log_prob(tr1.nodes[name]).to(x.dtype), u1,
                                     x.dtype)
        groups.append(group)
        log_const += const
    return groups, log_const


def _parameters(fn):
    """``{(depth, attribute): tensor}`` of the dense floating tensors of a distribution and of its wrappers."""
    out, depth = {}, 0
    while fn is not None:
        out.update({(depth, k): v for k, v in vars(fn).items()
                    if torch.is_tensor(v) and v.layout == torch.strided and v.is_floating_point()})
        fn, depth = getattr(fn, "base_dist", None), depth + 1
    return out


def _changed(a, b):
    """Whether two values of a quantity that should not depend on the latents differ (the affinity test's
    tolerance; a shape change or NaN counts)."""
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    if a.shape != b.shape:
        return True
    if a.numel() == 0:
        return False
    tol = _affine_tol(a, b)
    return not bool(((a - b).abs() <= tol * (1.0 + a.abs() + b.abs())).all())


def _check_at_second_point(x, chain_names, imputed_names, read):
    """Compare at the second point ``u1`` what the extraction found not to depend on the latents from derivatives at
    ``u0`` alone: the parameters of latent priors (but the mean of chain children and integrated leaves, checked
    affine by their own test), the fixed parameters of likelihood sites that read the latents, and the log density of
    the observed sites and factors in ``read`` that do not (taken as constants). A flat region at ``u0``
    (``relu(-mu)`` with ``mu > 0``, a clamp, a step) has zero derivative there; ``u1`` lies in the opposite orthant.

    :raises UnsupportedModelError: naming the first site that changes."""
    tr1 = x.second_trace()[1]
    chain_names = set(chain_names)
    flat = ("it has zero derivative in the latents at one point but another value at a second point (a flat piece of "
            "relu, clamp, abs or a step): not an affine function of the latent sites")
    for name, site in x.tr.nodes.items():
        if site["type"] != "sample" or _is_subsample(site) or _is_deterministic(site):
            continue
        site1 = tr1.nodes[name]  # the same sites (second_trace)
        if not site["is_observed"]:
            skip = "loc" if name in chain_names or name in imputed_names else None
            p0, p1 = _parameters(site["fn"]), _parameters(site1["fn"])
            for key in p0.keys() & p1.keys():
                value = torch.as_tensor(p0[key]).detach()
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise ValueError(f"site '{name}': the parameter '{key[1]}' of its prior is not finite "
                                     f"({value.flatten()[~torch.isfinite(value.flatten())][:3].tolist()})")
                if key[1] != skip and _changed(p0[key], p1[key]):
                    raise UnsupportedModelError(name, f"the parameter '{key[1]}' of its prior depends on the latent "
                                                      f"sites: {flat}")
        elif name in read and not _is_factor(site):
            family_cls, base = _observed_site(name, site, x.dtype)[:2]
            p1 = family_cls.fixed_params(_observed_site(name, site1, x.dtype)[1])
            for key, (value, what) in family_cls.fixed_params(base).items():
                if key in p1 and _changed(value, p1[key][0]):
                    raise UnsupportedModelError(name, f"the {what} depends on a latent site: {flat}")
        elif name not in read and _changed(_site_log_prob(site), _site_log_prob(site1)):
            raise UnsupportedModelError(name, f"the site's log density depends on the latent sites: {flat}")


#: the largest intrinsic GMRF the extraction takes: its constraint map x = phi(Pi w) is built as a dense n x n matrix
#: (the chain's design then fills in), about 40 n^2 x 8 bytes of peak memory (n = 2,025: 1.2 GB, 13 s)
INTRINSIC_MAX_N = 5000


def _chain_of(x, priors, chain_coo, intrinsic, chain_names, template=None):
    """``(chain, priors)``: the :class:`~pyro_convexvb.lgm.chains.AffineChain` ``x = M u + c`` of the affine Gaussian
    chains and intrinsic GMRFs in the innovation form (or ``None``), and the prior blocks, where the runs of blocks
    whose chain would fill in (:func:`~pyro_convexvb.lgm.chains.model_coordinate_spans`: an AR loop) are one prior
    block over the model's coordinates (:func:`~pyro_convexvb.lgm.chains.joint_prior`) and leave the chain; an
    extraction template's chain when its coefficients and intrinsic blocks are the same."""
    if not (chain_coo or intrinsic):
        return None, priors
    import numpy as np
    import scipy.sparse as sp

    from .chains import AffineChain, joins_a_joint_prior, joint_prior, model_coordinate_spans

    n, dtype, device, blocks = x.n, x.dtype, x.device, x.layout.blocks
    coo = chain_coo or [(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))]
    rows, cols = np.concatenate([r for r, _, _ in coo]), np.concatenate([c for _, c, _ in coo])
    vals = np.concatenate([v for _, _, v in coo])
    spans = []
    if len(rows) and not x.keep_graph:  # (keep_graph: the prior blocks carry the graph of the params; see chains)
        starts = np.array([b.start for b in blocks] + [n])
        intrinsic_at = {e[0].start for e in intrinsic}
        excluded = np.array([not joins_a_joint_prior(p) or b.start in intrinsic_at for p, b in zip(priors, blocks)])
        spans = model_coordinate_spans(sp.coo_matrix((vals, (rows, cols)), shape=(n, n)), starts, excluded)
    if spans:
        A = sp.csr_matrix((vals, (rows, cols)), shape=(n, n))
        merged, moved, pos = [], np.zeros(n, dtype=bool), 0
        for a, b in spans:
            merged += priors[pos:a]
            name = blocks[a].name if b == a + 1 else f"{blocks[a].name}..{blocks[b - 1].name}"
            merged.append(joint_prior(A, priors[a:b], blocks[a].start, name, dtype, device))
            moved[blocks[a].start:blocks[b - 1].start + blocks[b - 1].size] = True
            pos = b
        priors = merged + priors[pos:]
        keep = ~moved[rows]
        rows, cols, vals = rows[keep], cols[keep], vals[keep]
        inside = {bl.name for a, b in spans for bl in blocks[a:b]}
        chain_names = [c for c in chain_names if c not in inside]
        if not (len(rows) or intrinsic):
            return None, priors
    children = chain_names or [e[3] for e in intrinsic]
    for _, factor, _, site in intrinsic:
        if factor.n > INTRINSIC_MAX_N:
            raise UnsupportedModelError(site, f"an intrinsic SparseGMRF of {factor.n} nodes: its constraint "
                                              f"correction is applied as a dense n x n map (about 40 n^2 x 8 bytes, "
                                              f"{40 * 8 * factor.n ** 2 / 2 ** 30:.0f} GiB here), which this version "
                                              f"limits to n <= {INTRINSIC_MAX_N}; a proper precision (e.g. a CAR "
                                              "D - rho W with rho < 1) stays sparse at any size")

    def build():
        A = sp.coo_matrix((vals, (rows, cols)), shape=(n, n))
        return AffineChain(A, children, dtype=dtype, device=device, intrinsic=[e[:3] for e in intrinsic])

    if template is None:
        return build(), priors
    signature = (n, tuple(children), str(dtype), str(device), rows, cols, vals,
                 tuple((e[0].start, e[0].stop, e[1], np.asarray(e[2])) for e in intrinsic))
    return template.chain_for(signature, build), priors


def _extract(model, args, kwargs, dtype, keep_graph):
    """The phases of an extraction: classify the sites of the structure trace, pick the dtype, run the model at a
    random point of the latent layout (integrating unread Gaussian leaves out), then priors, imputed blocks,
    observed sites and factors (:class:`_Extraction`), and the affine chain."""
    cache = getattr(model, "extraction_cache", None)
    tr0 = None if cache is None else cache.get("structure")
    cached = tr0 is not None
    if not cached:
        tr0 = _first_trace(model, args, kwargs)
    latent, observed, factors = _classify_sites(tr0)
    dtype, site_dtype = _extraction_dtype(tr0, latent, observed, dtype)
    device = tr0.nodes[latent[0]]["value"].device
    shapes = [tuple(tr0.nodes[n]["value"].shape) for n in latent]
    full_layout = LatentLayout.from_shapes(list(zip(latent, shapes)),
                                           [tr0.nodes[n]["fn"].event_dim for n in latent])
    x = _Extraction(model, args, kwargs, dtype, keep_graph, site_dtype, device)

    # latents whose distribution reads other latents: Gaussian leaves that nothing else reads are integrated out
    # (ImputedBlock); Gaussian sites whose loc (only) is affine in other latents are affine Gaussian chains
    uf = x.draw(full_layout.size)
    x.at(uf, full_layout)
    template = None if cache is None else cache.get("template")
    if cached and _sites(x.tr) != _sites(tr0):  # the sites changed with the params: trace the structure again
        del cache["structure"]
        if template is not None:
            template.note_structure_change("the model's sample sites or their shapes changed")
        return _extract(model, args, kwargs, dtype, keep_graph)
    if not cached:
        _same_sites(tr0, x.tr)  # the structure trace ran at a prior draw, x.tr at uf
    if cache is not None:
        cache["structure"] = tr0
    imputed_names, chain_names = _classify_dependent_latents(x.tr, full_layout, uf)
    if template is not None:  # maps kept by an extraction of the same latent structure (lgm.template)
        template.begin((tuple((b.name, tuple(b.shape)) for b in full_layout.blocks), tuple(sorted(imputed_names)),
                        tuple(chain_names), str(dtype), str(device), bool(keep_graph)))
        x.template = template
    if imputed_names:
        layout = LatentLayout.from_shapes([(b.name, b.shape) for b in full_layout.blocks if b.name not in imputed_names],
                                          [b.event_dim for b in full_layout.blocks if b.name not in imputed_names])
        x.fixed = {b.name: uf[b.slice].detach().reshape(b.shape).to(site_dtype[b.name])
                   for b in full_layout.blocks if b.name in imputed_names}
        if layout.size == 0:
            raise UnsupportedModelError("<model>", "the model has no latent sample site that the likelihood reads")
        x.at(x.draw(layout.size), layout)
        _same_sites(tr0, x.tr)
    priors, laplace_groups, chain_coo, intrinsic = _prior_blocks(x, chain_names)
    imputed = _imputed_blocks(x, full_layout, imputed_names)
    groups, log_const = _observed_groups(x, observed)
    factor_groups, log_const = _factor_groups(x, factors, log_const)
    groups = groups + factor_groups
    if x.template is None or x._second is not None:  # (a template's maps were checked by its first extraction)
        _check_at_second_point(x, chain_names, imputed_names, {g.name for g in groups})
    latent_names = set(full_layout.names)  # (a set: a list looked up per site is quadratic in a loop's length)
    for name, site in x.tr.nodes.items():
        if site["type"] == "sample" and not site["is_observed"] and not _is_subsample(site) \
                and name not in latent_names:
            raise UnsupportedModelError(name, "latent site appeared only in some executions of the model")
    chain, priors = _chain_of(x, priors, chain_coo, intrinsic, chain_names, template)
    if chain is not None:
        for g in laplace_groups + groups:
            g.offset = chain.offset(g.design, g.offset)
            g.design = chain.design(g.design) if template is None else template.compose(chain, g.name, g.design)
    return LatentGaussianModel(x.layout, priors, laplace_groups + groups, log_const=log_const, imputed=imputed,
                               model_layout=full_layout, chain=chain)
