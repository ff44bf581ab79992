r"""Importance sampling over linearly constrained latent fields, in their free coordinates.

An intrinsic GMRF with linear constraints (``SparseGMRF(..., constraints=C)``: ICAR, RW1 and RW2 fields with a
sum-to-zero or trend constraint) lives on the subspace ``{C (x - loc) = 0}`` of its ``m`` coordinates. A Gaussian
posterior over such a field has a singular covariance and no density on the whole space, so the proposals of
:mod:`~pyro_convexvb.diagnostics.proposals` work in *free coordinates* instead: with ``k`` pivot coordinates ``P``
(``C_P`` invertible; the rest ``R``) and ``N = C^T``, the ``m - k`` coordinates ``w`` of

.. math:: x = loc + \phi(\Pi w), \qquad \phi(z) = z - N (C N)^{-1} C z, \qquad
          w = \big(\psi(x - loc)\big)_R, \quad \psi(r) = r - N N_P^{-1} r_P,

``Pi`` placing ``w`` at the coordinates ``R`` (zero at ``P``). ``phi`` is the orthogonal projection onto the
constraint subspace and maps ``{z_P = 0}`` onto it one to one; ``psi`` is its inverse there (Rue & Held 2005,
§2.3.3 and §3.1). The engines fit the same coordinates. Every other site keeps its own.

The model's density of a constrained field is with respect to the Lebesgue measure of the subspace
(:class:`~pyro_convexvb.distributions.SparseGMRF`, with the generalised determinant). In ``w`` it is that density
times the area factor ``sqrt(det(G^T G))`` of the map, ``G = d x / d w = (I - N (N^T N)^{-1} N^T)_{:, R}``; by
Sylvester's determinant identity ``det(G^T G) = det(N_P)^2 / det(N^T N)``. The log joint the importance ratios use
adds this constant (:func:`log_jacobian`), so they keep every constant and the evidence estimate stays one.
"""
import dataclasses

import numpy as np
import torch

from ..lgm.layout import LatentBlock, LatentLayout

__all__ = ["FreeCoordinates", "proposal_posterior", "log_jacobian"]


class _ConstrainedBlock:
    """The free-coordinate map of one constrained block (``m`` coordinates, ``k`` constraints): the field's own
    ``phi`` and its inverse (:meth:`~pyro_convexvb.distributions._IntrinsicFactor.project`, ``pinned``), on
    ``(..., m)`` tensors of any dtype and device (computed in float64 NumPy, as the field samples)."""

    def __init__(self, fac, loc):
        self.fac, self.m, self.k = fac, fac.n, fac.k
        self.loc = np.broadcast_to(np.asarray(loc, dtype=np.float64), (self.m,)).copy()
        self.log_jacobian = fac.log_area

    def to_field(self, w, shift=True):
        """``(..., m)`` the field ``x = loc + phi(Pi w)`` of free coordinates ``w`` ``(..., m - k)``."""
        flat = w.detach().reshape(-1, self.m - self.k).double().cpu().numpy()
        z = np.zeros((self.m, flat.shape[0]))
        z[self.fac.R] = flat.T
        x = self.fac.project(z).T + (self.loc if shift else 0.0)
        return torch.as_tensor(x, dtype=w.dtype, device=w.device).reshape(w.shape[:-1] + (self.m,))

    def to_free(self, x, shift=True):
        """``(..., m - k)`` the free coordinates ``w = (psi(x - loc))_R`` of a field ``x`` ``(..., m)``."""
        flat = x.detach().reshape(-1, self.m).double().cpu().numpy() - (self.loc if shift else 0.0)
        w = self.fac.pinned(flat.T).T
        return torch.as_tensor(w, dtype=x.dtype, device=x.device).reshape(x.shape[:-1] + (self.m - self.k,))


class FreeCoordinates(LatentLayout):
    """The layout of the proposals' field vector when some sites are constrained fields: the vector holds each
    constrained site's free coordinates (``m - k`` entries) and every other site's own; :meth:`unflatten` returns
    the model's site values (constrained fields on their subspace), :meth:`flatten` the free vector of them.

    :param layout: the model's :class:`~pyro_convexvb.lgm.layout.LatentLayout` (the posterior's).
    :param constrained: ``{site: (factor, loc)}`` of the constrained sites: the field's
        :attr:`~pyro_convexvb.distributions.SparseGMRF.constraint_factor` and its location ``(m,)``.

    :ivar mapped: the names of the sites whose free coordinates are not their own (their per-coordinate summaries
        cannot use the proposals' conditional moments).
    :ivar log_jacobian: ``sum log sqrt(det(G^T G))`` over the constrained sites (the module's docstring).

    Example (an RW1 field of 5 coordinates with a sum-to-zero constraint)::

        >>> import torch
        >>> import pyro_convexvb as pcv
        >>> from pyro_convexvb.lgm.layout import LatentLayout
        >>> d = pcv.distributions.SparseGMRF(torch.zeros(5, dtype=torch.float64), pcv.distributions.rw_precision(5),
        ...                                  constraints="sum_to_zero")
        >>> layout = LatentLayout.from_shapes([("b", ()), ("x", (5,))])
        >>> free = FreeCoordinates(layout, {"x": (d.constraint_factor, d.loc)})
        >>> free.size, free["x"].size
        (5, 4)
        >>> values = free.unflatten(torch.randn(3, 5, dtype=torch.float64))
        >>> values["x"].shape, bool(values["x"].sum(-1).abs().max() < 1e-12)
        (torch.Size([3, 5]), True)
        >>> round(free.log_jacobian, 6) == round(-0.5 * float(np.log(5)), 6)  # sum-to-zero: det(G^T G) = 1 / m
        True
    """

    def __init__(self, layout, constrained):
        self.model_layout = layout
        self.constrained = {name: _ConstrainedBlock(fac, loc) for name, (fac, loc) in constrained.items()}
        blocks, start = [], 0
        for b in layout.blocks:
            c = self.constrained.get(b.name)
            shape = b.shape if c is None else (c.m - c.k,)
            nb = LatentBlock(b.name, tuple(shape), start, b.event_dim)
            blocks.append(nb)
            start += nb.size
        super().__init__(blocks)
        self.mapped = frozenset(self.constrained)
        self.log_jacobian = float(sum(c.log_jacobian for c in self.constrained.values()))

    def unflatten(self, u, shift=True):
        """``{site: (..., *site_shape)}`` the model's values of the free vector ``u`` ``(..., n_free)``."""
        batch = u.shape[:-1]
        out = {}
        for b, mb in zip(self.blocks, self.model_layout.blocks):
            v = u[..., b.slice]
            c = self.constrained.get(b.name)
            if c is not None:
                v = c.to_field(v, shift)
            out[b.name] = v.reshape(batch + mb.shape)
        return out

    def flatten(self, values, shift=True):
        """``(..., n_free)`` the free vector of the model's values ``{site: (..., *site_shape)}``."""
        parts = []
        for mb in self.model_layout.blocks:
            v = values[mb.name]
            batch = v.shape[: v.dim() - len(mb.shape)]
            v = v.reshape(batch + (mb.size,))
            c = self.constrained.get(mb.name)
            parts.append(v if c is None else c.to_free(v, shift))
        return torch.cat(parts, -1)

    def free_gaussian(self, post):
        """The Gaussian ``post`` over the model's coordinates (its covariance singular along the constraints) as a
        :class:`~pyro_convexvb.GaussianPosterior` over the free vector, with this layout (dense covariance)."""
        from ..posterior.gaussian import GaussianPosterior

        S = post.covariance(force=True)
        lin = lambda a: self.flatten(self.model_layout.unflatten(a), shift=False)  # noqa: E731
        C = lin(lin(S).transpose(0, 1))  # K S K^T, K the linear part of the map to free coordinates
        loc = self.flatten(self.model_layout.unflatten(post.loc))
        out = GaussianPosterior(loc, covariance=0.5 * (C + C.transpose(0, 1)), layout=self,
                                model=getattr(post, "model", None), model_args=getattr(post, "model_args", ((), {})))
        return out


def _constrained_sites(result):
    """``{site: (factor, loc)}`` of the model's constrained fields (intrinsic ``SparseGMRF`` sites with
    constraints, unbatched), from one trace of the Pyro model the result was fitted on; empty without a model."""
    from pyro import poutine

    from ..distributions import SparseGMRF
    from ..lgm.extract import full_data_plates

    post = result.posterior
    model = getattr(post, "model", None)
    if model is None or not callable(model):
        return {}
    args, kwargs = getattr(post, "model_args", ((), {}))
    with torch.no_grad(), full_data_plates():
        tr = poutine.trace(model).get_trace(*args, **kwargs)
    out = {}
    for name, site in tr.nodes.items():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        fn = site["fn"]
        while hasattr(fn, "base_dist"):
            fn = fn.base_dist
        if isinstance(fn, SparseGMRF) and fn.is_intrinsic and tuple(site["value"].shape) == (fn.n,):
            out[name] = (fn.constraint_factor, fn.loc.detach())
    return out


def proposal_posterior(result):
    """The posterior the importance proposals are built from: ``result.posterior``, or, when the model has
    constrained fields, the same posterior over the free coordinates (:class:`FreeCoordinates`; a hyper-latent
    mixture with each design point's Gaussian moved there). Computed once per result."""
    cached = result.__dict__.get("_proposal_posterior")
    if cached is not None:
        return cached
    post = result.posterior
    layout = getattr(post, "layout", None)
    sites = _constrained_sites(result) if layout is not None else {}
    if sites and all(n in layout.names for n in sites):
        free = FreeCoordinates(layout, sites)
        components = getattr(post, "components", None)
        if components is not None and all(hasattr(c, "covariance") for c in components):
            post = dataclasses.replace(post, components=[free.free_gaussian(c) for c in components], layout=free)
        elif components is None and hasattr(post, "covariance") and hasattr(post, "kind"):
            post = free.free_gaussian(post)
    result.__dict__["_proposal_posterior"] = post
    return post


def log_jacobian(result):
    """The constant ``log sqrt(det(G^T G))`` that turns the model's log joint into the density of the proposals'
    coordinates (0 without constrained fields)."""
    layout = getattr(proposal_posterior(result), "layout", None)
    return float(getattr(layout, "log_jacobian", 0.0))

