"""Pyro model (+ its arguments) -> :class:`LatentGaussianModel`, with errors that name the site."""
import contextlib
import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.poutine.subsample_messenger import SubsampleMessenger

from ..errors import UnsupportedModelError
from ..linalg.operators import (
    DenseOperator,
    DiagonalOperator,
    EmbedColumnsOperator,
    FunctionOperator,
    IdentityOperator,
    BlockDiagonalOperator,
    SumOperator,
)
from .layout import LatentLayout
from .linear import record_linear
from .model import LatentGaussianModel, PriorBlock, SiteGroup
from .sites import BernoulliLogit, Gaussian, Laplace, Poisson

__all__ = ["lgm_from_pyro", "full_data_plates", "latent_sites", "unconstrained_layout", "DENSE_JACOBIAN_LIMIT"]

#: Largest ``q * n`` for which a predictor that was not built with ``pcv.linear`` is materialised
#: as a dense Jacobian (the model's own design is then dense already); larger ones stay as
#: autograd-probed operators.
DENSE_JACOBIAN_LIMIT = 25_000_000

_AFFINE_RTOL = 1e-7


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
    g = torch.autograd.grad(t.sum(), u, retain_graph=True, allow_unused=True)[0]
    return g is not None and bool((g != 0).any())


@contextlib.contextmanager
def full_data_plates():
    """Context in which every subsampled ``pyro.plate`` runs on its full size (no mini-batch scaling).

    Engines that fit all the data at once (the latent Gaussian model, Laplace, NUTS) run the model
    inside it, so ``pyro.plate(..., subsample_size=M)`` does not make them see random mini-batches.
    """
    original = SubsampleMessenger.__dict__["_subsample"]
    orig_fn = original.__func__

    def full(name, size=None, subsample_size=None, subsample=None, use_cuda=None, device=None):
        if size is not None and subsample is None:
            subsample_size = size
        return orig_fn(name, size, subsample_size, subsample, use_cuda, device)

    SubsampleMessenger._subsample = staticmethod(full)
    try:
        yield
    finally:
        SubsampleMessenger._subsample = original


def latent_sites(model, args, kwargs):
    """``[(name, site)]`` of the model's latent sample sites in trace order (the packing order of Pyro's
    :class:`~pyro.infer.autoguide.AutoContinuous`), traced with every plate at full size."""
    with torch.no_grad(), full_data_plates():
        tr = poutine.trace(model).get_trace(*args, **kwargs)
    return [(n, s) for n, s in tr.nodes.items()
            if s["type"] == "sample" and not s["is_observed"] and not _is_subsample(s)]


def unconstrained_layout(model, args, kwargs):
    """:class:`LatentLayout` of the model's latent sites in unconstrained coordinates (``biject_to`` of each support)."""
    from torch.distributions import biject_to

    named = []
    for name, site in latent_sites(model, args, kwargs):
        named.append((name, tuple(biject_to(site["fn"].support).inv(site["value"]).shape)))
    return LatentLayout.from_shapes(named)


def _trace(model, args, kwargs, values=None):
    m = model
    if values is not None:
        tr = poutine.trace(m).get_trace(*args, **kwargs)
        for name, v in values.items():
            tr.nodes[name]["value"] = v
        m = poutine.replay(m, trace=tr)
    with record_linear() as records:
        tr = poutine.trace(m).get_trace(*args, **kwargs)
    return tr, records


def _latent_prior(name, fn, shape, dtype, device):
    """PriorBlock (or 'laplace' marker) for a latent site; raises for anything else."""
    base, mask = _unwrap(fn)
    if mask is not None:
        raise UnsupportedModelError(name, "masked latent sites are not supported")
    size = int(math.prod(shape)) if shape else 1
    if isinstance(base, (dist.Normal, torch.distributions.Normal)):
        loc = base.loc.expand(shape).reshape(size).to(dtype)
        scale = base.scale.expand(shape).reshape(size).to(dtype)
        if (scale <= 0).any() or not torch.isfinite(scale).all():
            raise UnsupportedModelError(name, "prior scale must be positive and finite")
        return PriorBlock(name, loc.detach(), cov=DiagonalOperator(scale.detach() ** 2),
                          prec=DiagonalOperator(scale.detach() ** -2),
                          logdet_cov=float(2 * torch.log(scale.detach()).sum())), None
    if isinstance(base, (dist.MultivariateNormal, torch.distributions.MultivariateNormal)):
        d = base.event_shape[0]
        tril = base.scale_tril.expand(tuple(shape[:-1]) + (d, d)).reshape(-1, d, d).to(dtype).detach()
        loc = base.loc.expand(shape).reshape(size).to(dtype).detach()
        covs, precs, logdet = [], [], 0.0
        for L in tril:
            if not torch.isfinite(L).all() or (torch.diagonal(L) <= 0).any():
                raise UnsupportedModelError(name, "prior covariance is not positive definite")
            cov = L @ L.transpose(-1, -2)
            covs.append(DenseOperator(cov))
            precs.append(DenseOperator(torch.cholesky_inverse(L)))
            logdet += float(2 * torch.log(torch.diagonal(L)).sum())
        cov_op = covs[0] if len(covs) == 1 else BlockDiagonalOperator(covs)
        prec_op = precs[0] if len(precs) == 1 else BlockDiagonalOperator(precs)
        return PriorBlock(name, loc, cov=cov_op, prec=prec_op, logdet_cov=logdet), None
    if isinstance(base, (dist.Laplace, torch.distributions.Laplace)):
        loc = base.loc.expand(shape).reshape(size).to(dtype).detach()
        scale = base.scale.expand(shape).reshape(size).to(dtype).detach()
        if (scale <= 0).any():
            raise UnsupportedModelError(name, "Laplace prior scale must be positive")
        return PriorBlock(name, torch.zeros(size, dtype=dtype, device=device), flat=True), (loc, scale)
    if fn.support.is_discrete if hasattr(fn, "support") else False:
        raise UnsupportedModelError(name, "discrete latent variables are outside the latent Gaussian model class")
    raise UnsupportedModelError(
        name, f"unsupported prior {type(base).__name__}: a latent site needs a Normal, MultivariateNormal or Laplace prior"
    )


def _check_obs(name, family, y):
    if not torch.isfinite(y).all():
        raise UnsupportedModelError(name, "observed data contain NaN or inf")
    if family == "bernoulli" and not ((y == 0) | (y == 1)).all():
        bad = y[(y != 0) & (y != 1)][:3].tolist()
        raise UnsupportedModelError(name, f"Bernoulli labels must be in {{0, 1}}, found {bad}")
    if family == "poisson":
        if (y < 0).any():
            raise UnsupportedModelError(name, "Poisson counts must be nonnegative")
        if (y != torch.round(y)).any():
            raise UnsupportedModelError(name, "Poisson counts must be integers")


def _observed_site(name, site, dtype):
    """(family-name, eta tensor, family constructor kwargs, extra log-const) for an observed site."""
    fn = site["fn"]
    base, mask = _unwrap(fn)
    y = site["value"]
    if not torch.is_tensor(y):
        y = torch.as_tensor(y)
    batch = tuple(fn.batch_shape) + tuple(fn.event_shape)
    if isinstance(base, (dist.Bernoulli, torch.distributions.Bernoulli)):
        eta = base.logits
        kind = "bernoulli"
    elif isinstance(base, (dist.Poisson, torch.distributions.Poisson)):
        eta = torch.log(base.rate)
        kind = "poisson"
    elif isinstance(base, (dist.Normal, torch.distributions.Normal)):
        eta = base.loc
        kind = "gaussian"
    else:
        raise UnsupportedModelError(
            name, f"unsupported likelihood {type(base).__name__}: use Bernoulli(logits=...), Poisson(rate=exp(...)) or Normal"
        )
    eta = eta.expand(batch)
    y = y.expand(batch).to(dtype)
    keep = None
    if mask is not None:
        keep = torch.as_tensor(mask).expand(batch).reshape(-1)
    _check_obs(name, kind, y)
    return kind, base, eta.reshape(-1), y.reshape(-1), batch, keep


class _AutogradJacobian:
    """Jacobian of eta(u) from a retained autograd graph: vjp by backward, jvp by double backward."""

    def __init__(self, eta, u):
        self.eta, self.u = eta, u
        self.w = torch.zeros_like(eta, requires_grad=True)
        g = torch.autograd.grad(eta, u, self.w, create_graph=True, allow_unused=True)[0]
        self.g = torch.zeros_like(u) if g is None else g

    def vjp(self, r):
        out = torch.autograd.grad(self.eta, self.u, r.detach(), retain_graph=True, allow_unused=True)[0]
        return torch.zeros_like(self.u) if out is None else out.detach()

    def jvp(self, v):
        if not self.g.requires_grad:
            return torch.zeros_like(self.eta).detach()
        out = torch.autograd.grad(self.g, self.w, v.detach(), retain_graph=True, allow_unused=True)[0]
        return torch.zeros_like(self.eta).detach() if out is None else out.detach()

    def dense(self):
        q, n = self.eta.shape[0], self.u.shape[0]
        if n <= q:
            cols = [self.jvp(e) for e in torch.eye(n, dtype=self.u.dtype, device=self.u.device)]
            return torch.stack(cols, 1)
        rows = [self.vjp(e) for e in torch.eye(q, dtype=self.u.dtype, device=self.u.device)]
        return torch.stack(rows, 0)

    def operator(self):
        q, n = self.eta.shape[0], self.u.shape[0]
        return FunctionOperator(self.jvp, self.vjp, (q, n), dtype=self.u.dtype, device=self.u.device)


def _recorded_operator(name, records, eta, u, layout, block_values, probe):
    """Operator from ``pcv.linear`` records that reproduces the Jacobian of eta, or None."""
    q = eta.shape[0]
    candidates = []
    for op, rec_u, out in records:
        if out.dim() != 1 or out.shape[0] != q:
            continue
        for b in layout.blocks:
            if rec_u is block_values[b.name] and op.shape[1] == b.size:
                candidates.append(op if (b.start == 0 and b.size == layout.size) else EmbedColumnsOperator(op, b.start, layout.size))
    for b in layout.blocks:  # eta is (an affine shift of) a latent block itself, e.g. a GP's f
        if b.size == q:
            sel = IdentityOperator(q, dtype=u.dtype, device=u.device)
            candidates.append(sel if b.size == layout.size else EmbedColumnsOperator(sel, b.start, layout.size))
    options = [[c] for c in candidates]
    if 1 < len(candidates) <= 4:
        options.append(candidates)
    for opts in options:
        op = opts[0] if len(opts) == 1 else SumOperator(opts)
        ok = True
        for v, jv in probe:
            ref = op.mv(v)
            if not torch.allclose(ref, jv, rtol=1e-9, atol=1e-9 * (1 + float(jv.abs().max()))):
                ok = False
                break
        if ok:
            return op
    return None


def lgm_from_pyro(model, *args, dtype=None, **kwargs):
    """Trace a Pyro model and return its :class:`LatentGaussianModel`.

    Recognised: latent sites (any shape, flattened and concatenated in model order) with Normal,
    MultivariateNormal or Laplace priors whose parameters do not depend on other latents (a Laplace
    prior becomes Laplace sites on the block, Nickisch & Seeger 2009 §2); observed sites Bernoulli(logits=... or
    probs=...), Poisson(rate=exp(...)) and Normal(loc=..., scale fixed) whose predictor is an affine
    function of the latents; plates, including subsampled ones (traced on the full data); masks.

    The affine map is taken from :func:`pyro_convexvb.linear` calls when the model uses them
    (sparse designs stay sparse), otherwise probed with autograd: materialised as a dense Jacobian
    when ``q * n <= DENSE_JACOBIAN_LIMIT`` (the model's own design is dense then), else kept as a
    vjp/jvp operator. Affinity is checked at two random points.

    :param model: a Pyro model callable.
    :param args: positional arguments of the model (data).
    :param dtype: floating dtype of the LGM (default: that of the observed data, else float64).
    :param kwargs: keyword arguments of the model (e.g. ``y=...`` observations).
    :raises UnsupportedModelError: naming the site and the reason, for models outside the class.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(0., 1.).expand([X.shape[1]]).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(10, 2, dtype=torch.float64); y = torch.ones(10, dtype=torch.float64)
        >>> lgm = lgm_from_pyro(model, X, y=y)
        >>> torch.allclose(lgm.sites[0].design.to_dense(), X)
        True
    """
    with full_data_plates():
        return _extract(model, args, kwargs, dtype)


def _extract(model, args, kwargs, dtype):
    with torch.no_grad():
        tr0 = poutine.trace(model).get_trace(*args, **kwargs)

    latent, observed = [], []
    for name, site in tr0.nodes.items():
        if site["type"] != "sample" or _is_subsample(site):
            continue
        if site["is_observed"]:
            observed.append(name)
        else:
            if site["fn"].support.is_discrete if hasattr(site["fn"], "support") else False:
                raise UnsupportedModelError(name, "discrete latent variables are outside the latent Gaussian model class")
            latent.append(name)
    if not latent:
        raise UnsupportedModelError("<model>", "the model has no latent sample site")
    if dtype is None:
        dtype = torch.float64
        for name in observed:
            v = tr0.nodes[name]["value"]
            if torch.is_tensor(v) and v.is_floating_point():
                dtype = v.dtype
                break
    device = tr0.nodes[latent[0]]["value"].device

    shapes = [tuple(tr0.nodes[n]["value"].shape) for n in latent]
    layout = LatentLayout.from_shapes(list(zip(latent, shapes)),
                                      [tr0.nodes[n]["fn"].event_dim for n in latent])
    n = layout.size

    def run_at(u):
        vals = {b.name: u[b.slice].reshape(b.shape) for b in layout.blocks}
        tr, recs = _trace(model, args, kwargs, values=vals)
        return tr, recs, vals

    gen = torch.Generator(device="cpu").manual_seed(0)
    u0 = torch.randn(n, generator=gen, dtype=dtype).to(device).requires_grad_(True)
    tr, records, vals = run_at(u0)

    # priors
    priors, laplace_groups = [], []
    for b in layout.blocks:
        site = tr.nodes[b.name]
        fn = site["fn"]
        base, _ = _unwrap(fn)
        for attr in ("loc", "scale", "scale_tril"):
            t = getattr(base, attr, None)
            if t is not None and _depends_on(t, u0):
                raise UnsupportedModelError(
                    b.name, "prior parameters depend on another latent site (hierarchical models are outside the LGM class)")
        if site.get("scale", 1.0) != 1.0:
            raise UnsupportedModelError(b.name, "latent site is scaled by poutine.scale; scaled priors are not supported")
        prior, lap = _latent_prior(b.name, fn, b.shape, dtype, device)
        priors.append(prior)
        if lap is not None:
            loc, scale = lap
            sel = IdentityOperator(b.size, dtype=dtype, device=device)
            design = sel if (b.start == 0 and b.size == n) else EmbedColumnsOperator(sel, b.start, n)
            laplace_groups.append(SiteGroup(b.name, Laplace(scale), design, -loc, b.shape, from_prior=True))

    # observed sites
    groups, log_const = [], 0.0
    second = None
    for name in observed:
        site = tr.nodes[name]
        if site.get("scale", 1.0) != 1.0:
            raise UnsupportedModelError(name, "observed site is scaled by poutine.scale; weighted likelihoods are not supported")
        kind, base, eta, y, batch, keep = _observed_site(name, site, dtype)
        if not _depends_on(eta, u0):
            if kind == "gaussian" and _depends_on(base.scale, u0):
                raise UnsupportedModelError(name, "the noise scale depends on a latent site (not an LGM)")
            log_const += float(site["fn"].log_prob(site["value"]).sum().detach())
            continue
        if kind == "gaussian":
            scale = base.scale
            if _depends_on(scale, u0):
                raise UnsupportedModelError(name, "the noise scale depends on a latent site (not an LGM)")
            scale = scale.expand(batch).reshape(-1).detach().to(dtype)
        if second is None:
            u1 = torch.randn(n, generator=gen, dtype=dtype).to(device).requires_grad_(True)
            second = run_at(u1)
        eta1 = _observed_site(name, second[0].nodes[name], dtype)[2].detach()
        jac = _AutogradJacobian(eta, u0)
        du = (u1 - u0).detach()
        jdu = jac.jvp(du)
        lin_err = float((eta1 - eta.detach() - jdu).abs().max())
        scale_ref = 1.0 + float(eta1.abs().max()) + float(eta.detach().abs().max())
        tol = _AFFINE_RTOL if dtype == torch.float64 else 1e-3
        if not math.isfinite(lin_err) or lin_err > tol * scale_ref:
            raise UnsupportedModelError(
                name, f"the predictor is not an affine function of the latent variables (deviation {lin_err:.3g})")
        v2 = torch.randn(n, generator=gen, dtype=dtype).to(device)
        probe = [(du, jdu), (v2, jac.jvp(v2))]
        op = _recorded_operator(name, records, eta, u0, layout, vals, probe)
        if op is None:
            q = eta.shape[0]
            op = DenseOperator(jac.dense()) if q * n <= DENSE_JACOBIAN_LIMIT else jac.operator()
        offset = (eta.detach() - op.mv(u0.detach())).detach()
        if keep is not None:
            idx = torch.nonzero(keep).reshape(-1)
            if hasattr(op, "rows"):
                op = op.rows(idx)
            elif isinstance(op, DenseOperator):
                op = DenseOperator(op.matrix[idx])
            else:
                raise UnsupportedModelError(name, "masks on predictors given as autograd operators are not supported")
            y, offset = y[idx], offset[idx]
            if kind == "gaussian":
                scale = scale[idx]
        if kind == "bernoulli":
            family = BernoulliLogit(y)
        elif kind == "poisson":
            family = Poisson(y)
        else:
            family = Gaussian(y, scale)
        groups.append(SiteGroup(name, family, op, offset, batch))

    for name, site in tr.nodes.items():
        if site["type"] == "sample" and not site["is_observed"] and not _is_subsample(site) and name not in layout.names:
            raise UnsupportedModelError(name, "latent site appeared only in some executions of the model")
    return LatentGaussianModel(layout, priors, laplace_groups + groups, log_const=log_const)
