"""The latent Gaussian model every engine works on.

    u ~ N(mu, Sigma)  (given by a covariance or a precision operator; a zero precision block is flat)
    eta_g = B_g u + offset_g           for each site group g (B_g: any linear operator)
    p(D | u) = prod_g prod_i t_gi(eta_gi)

A group of sites under ``poutine.scale(scale=w)`` holds tempered sites ``t_i(eta_i)^{w_i}``
(a :class:`~pyro_convexvb.lgm.sites.Weighted` family; :attr:`SiteGroup.weight`). Latent sites of the
Pyro model that no site reads (the missing entries of ``obs_mask``) are :class:`ImputedBlock` s,
integrated out of ``u`` and restored by :meth:`LatentGaussianModel.complete_posterior`.

Gaussian observation groups N(y | X u + offset, s^2) are site groups of family
:class:`~pyro_convexvb.lgm.sites.Gaussian`; engines that want Nickisch & Seeger's (2009) form
``N(y | X u, sigma^2 I) prod_i t_i(s_i)`` read them through :meth:`LatentGaussianModel.gaussian_groups`.
"""
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..errors import NotPositiveDefiniteError, UnsupportedModelError
from ..linalg.operators import (
    DENSE_LIMIT,
    BlockDiagonalOperator,
    DiagonalOperator,
    LinearOperator,
    StackedOperator,
    as_operator,
)
from ..posterior.base import Posterior
from ..posterior.gaussian import GaussianPosterior
from .layout import LatentLayout
from .sites import Gaussian, SiteFamily, Weighted

__all__ = ["PriorBlock", "SiteGroup", "ImputedBlock", "LatentGaussianModel"]


@dataclass
class PriorBlock:
    """Gaussian prior of one latent block (or a flat block, whose coordinates carry sites instead).

    :param name: latent site name.
    :param loc: ``(size,)`` prior mean.
    :param cov: covariance operator ``(size, size)`` or ``None``.
    :param prec: precision operator ``(size, size)`` or ``None`` (at least one of the two unless ``flat``).
    :param flat: ``True`` for a block without a Gaussian prior (e.g. a Laplace prior turned into sites).

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
        >>> X = torch.randn(20, 2, dtype=torch.float64)
        >>> b, = pcv.lgm_from_pyro(model, X, y=X.sum(1)).priors
        >>> b.name, b.loc.shape, b.cov.shape
        ('w', torch.Size([2]), (2, 2))
    """

    name: str
    loc: torch.Tensor
    cov: Optional[LinearOperator] = None
    prec: Optional[LinearOperator] = None
    flat: bool = False
    logdet_cov: Optional[float] = None

    @property
    def size(self):
        return int(self.loc.shape[0])


def _check_posterior(posterior):
    """Refuse what is not a posterior (it was returned unchanged when the model has no imputed blocks)."""
    if not isinstance(posterior, Posterior):
        raise TypeError(f"posterior: expected a pyro_convexvb posterior (e.g. GaussianPosterior), got "
                        f"{type(posterior).__name__}")


def _check_prior_diagonal(p):
    """Refuse a prior whose variances underflow or overflow (a scale of 1e-160 squares to a subnormal, whose inverse
    is inf): the engines divided by it and returned a NaN posterior. Only diagonals an operator knows from its
    structure are read (nothing is densified)."""
    for what, op in (("variance", p.cov), ("precision", p.prec)):
        diag = None if op is None else op.diagonal(dense_limit=0)
        if diag is None:
            continue
        bad = ~torch.isfinite(diag) | (diag < torch.finfo(diag.dtype).tiny) if what == "variance" else \
            ~torch.isfinite(diag) | (diag < 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise NotPositiveDefiniteError(
                f"prior of '{p.name}': {what} {float(diag[i]):.3g} at coordinate {i} is not a positive normal "
                f"{diag.dtype} number (a prior scale whose square underflows or overflows); rescale the latent "
                "or fix it with pyro.condition")


@dataclass
class SiteGroup:
    """A group of per-row sites ``t_i(eta_i)``, ``eta = design @ u + offset``.

    :param name: the Pyro site name (or a descriptive name for explicit models).
    :param family: a :class:`~pyro_convexvb.lgm.sites.SiteFamily` holding the data.
    :param design: linear operator ``(q, n)``.
    :param offset: ``(q,)``.
    :param obs_shape: shape of the observation in the Pyro model (for reshaping).

    A weighted group (a Pyro site under ``poutine.scale``) holds a
    :class:`~pyro_convexvb.lgm.sites.Weighted` family: :attr:`weight` gives its per-row weights
    ``w_i`` and :attr:`base_family` the unweighted family, and the group's sites are ``t_i(eta_i)^{w_i}``.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(20, 2, dtype=torch.float64)
        >>> g, = pcv.lgm_from_pyro(model, X, y=(X[:, 0] > 0).double()).sites
        >>> g.name, g.design.shape, g.offset.shape, type(g.family).__name__
        ('y', (20, 2), torch.Size([20]), 'BernoulliLogit')
    """

    name: str
    family: SiteFamily
    design: LinearOperator
    offset: torch.Tensor
    obs_shape: tuple = ()
    from_prior: bool = False

    @property
    def size(self):
        return int(self.design.shape[0])

    @property
    def weight(self):
        """``(q,)`` per-row weights of a tempered group, or ``None`` (all weights one)."""
        return self.family.weight if isinstance(self.family, Weighted) else None

    @property
    def base_family(self):
        """The unweighted site family (the family itself unless the group is weighted)."""
        return self.family.base if isinstance(self.family, Weighted) else self.family

    def eta(self, u):
        """Predictor ``B u + offset`` for ``u`` of shape ``(n,)`` or ``(n, k)``."""
        out = self.design.mv(u)
        return out + (self.offset if u.dim() == 1 else self.offset.unsqueeze(-1))


@dataclass
class ImputedBlock:
    r"""A latent site of the Pyro model that no likelihood, prior or factor reads: ``x = B u + offset + scale * eps``.

    The missing entries of a partially observed Gaussian site (``pyro.sample(name, dist.Normal(eta, s),
    obs=y, obs_mask=m)`` makes the latent site ``name + "_unobserved"``), or any latent
    ``Normal(eta, s)`` with an affine ``eta`` whose value the model does not use. Integrating it out
    leaves ``p(y | u)`` unchanged, so it is not part of ``u``; its posterior is the predictive
    ``q(x) = int N(x | B u + offset, diag(scale^2)) q(u) du``, which
    :meth:`LatentGaussianModel.complete_posterior` joins to a posterior over ``u``.

    Entries that the Pyro model masks out (the observed entries of an ``_unobserved`` site) have no
    density in the model; the completed posterior gives them the same conditional, so a guide
    samples them from a proper distribution (the model never reads them).

    :param name: the Pyro site name.
    :param shape: the site's value shape.
    :param design: linear operator ``(q, n)``, ``q = prod(shape)``.
    :param offset: ``(q,)``.
    :param scale: ``(q,)`` positive standard deviations.
    :param filler: ``(q,)`` boolean, the entries an ``obs_mask`` site masks out (observed positions), which the
        engines on the Pyro model give an independent ``N(0, 1)`` density (``None``: none).
    """

    name: str
    shape: tuple
    design: LinearOperator
    offset: torch.Tensor
    scale: torch.Tensor
    filler: Optional[torch.Tensor] = None

    @property
    def size(self):
        return int(self.design.shape[0])


@dataclass
class LatentGaussianModel:
    """A latent Gaussian model: Gaussian prior blocks over ``u`` and groups of sites on ``B u``.

    Build it from a Pyro model with :func:`pyro_convexvb.lgm_from_pyro`, or explicitly for problems
    too large to trace (e.g. a sparse design with millions of rows).

    :param layout: how ``u`` splits into the model's latent sites.
    :param priors: :class:`PriorBlock` s covering ``u`` in order: one per layout block, or one for a run of whole
        blocks (an AR loop written as a loop of scalar sites, whose joint prior is one sparse precision:
        :mod:`pyro_convexvb.lgm.chains`); :attr:`prior_slices` gives their coordinates.
    :param sites: the site groups.
    :param log_const: constant added to the log joint (factors of the Pyro model that do not
        depend on ``u``), so that bounds refer to ``log p(y)`` of the model as written.
    :param imputed: :class:`ImputedBlock` latent sites of the Pyro model that are integrated out
        (not part of ``u``; see :meth:`complete_posterior`).
    :param model_layout: the layout of all the Pyro model's latent sites in trace order, imputed
        ones included (default: ``layout``).

    Example (Bayesian logistic regression with a sparse design)::

        >>> import torch
        >>> from pyro_convexvb.lgm.sites import BernoulliLogit
        >>> X = torch.randn(20, 3, dtype=torch.float64).to_sparse_csr()
        >>> y = (torch.rand(20, dtype=torch.float64) < 0.5).double()
        >>> lgm = LatentGaussianModel.from_design(X, BernoulliLogit(y), prior_scale=1.0)
        >>> lgm.n, lgm.num_sites
        (3, 20)
    """

    layout: LatentLayout
    priors: List[PriorBlock]
    sites: List[SiteGroup] = field(default_factory=list)
    log_const: float = 0.0
    imputed: List[ImputedBlock] = field(default_factory=list)
    model_layout: Optional[LatentLayout] = None
    #: an :class:`~pyro_convexvb.lgm.chains.AffineChain` when ``u = (I - A) x`` holds the innovations of affine
    #: Gaussian chains (centred hierarchies) rather than the model's sites ``x`` (then the imputed blocks' designs
    #: act on ``x``); :meth:`complete_posterior` maps a posterior back. Chains that would fill in (AR loops) are
    #: over ``x`` as one prior block of sparse precision, outside ``chain`` (:mod:`pyro_convexvb.lgm.chains`)
    chain: Optional[object] = None

    def __post_init__(self):
        if self.model_layout is None:
            self.model_layout = self.layout
        names = set(self.layout.names) | {b.name for b in self.imputed}
        if self.imputed and (set(self.model_layout.names) != names
                             or len(self.model_layout.blocks) != len(self.layout.blocks) + len(self.imputed)):
            raise ValueError("model_layout must hold the latent blocks and the imputed blocks, each once")
        for b in self.imputed:
            if b.design.shape[1] != self.n:
                raise ValueError(f"imputed block '{b.name}': design has {b.design.shape[1]} columns, latent has {self.n}")
            if b.offset.shape != (b.size,) or b.scale.shape != (b.size,) or self.model_layout[b.name].size != b.size:
                raise ValueError(f"imputed block '{b.name}': design, offset, scale and layout sizes differ")
        bounds = {b.start for b in self.layout.blocks} | {self.n}
        pos = 0
        for p in self.priors:
            if pos + p.size not in bounds:
                raise ValueError(f"prior of '{p.name}' has size {p.size}: it ends at coordinate {pos + p.size}, "
                                 "inside a latent block (a PriorBlock covers one latent block, or a run of whole "
                                 "blocks)")
            if not p.flat and p.cov is None and p.prec is None:
                raise ValueError(f"prior of '{p.name}' needs a covariance or a precision")
            _check_prior_diagonal(p)
            pos += p.size
        if pos != self.n:
            raise ValueError(f"the prior blocks cover {pos} coordinates, the latent blocks {self.n}")
        for g in self.sites:
            if g.design.shape[1] != self.n:
                raise ValueError(f"site group '{g.name}': design has {g.design.shape[1]} columns, latent has {self.n}")
            if g.offset.shape != (g.design.shape[0],):
                raise ValueError(f"site group '{g.name}': offset shape {tuple(g.offset.shape)} != ({g.design.shape[0]},)")
            if len(g.family) != g.design.shape[0]:
                raise ValueError(f"site group '{g.name}': {len(g.family)} data rows for {g.design.shape[0]} design rows")
            for key, value in g.family.params.items():
                if torch.is_tensor(value) and value.is_floating_point() and value.dtype != g.design.dtype:
                    raise TypeError(f"family: its {key!r} is {value.dtype} and the design {g.design.dtype} (site "
                                    f"group '{g.name}'); give both one dtype")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_design(cls, design, family, prior_scale=1.0, prior_loc=0.0, offset=None, name="y", latent_name="u"):
        """Single latent vector with prior ``N(prior_loc, prior_scale^2 I)`` and one site group ``eta = design @ u + offset``.

        :param design: dense/sparse ``(q, n)`` tensor or operator.
        :param family: site family with ``q`` rows.
        """
        B = as_operator(design)
        q, n = B.shape
        dt, dev = B.dtype, B.device
        scale = torch.as_tensor(prior_scale, dtype=dt, device=dev).expand(n).clone()
        if not bool((torch.isfinite(scale) & (scale > 0)).all()):
            raise ValueError(f"prior_scale: expected positive finite scales, got {prior_scale!r}")
        loc = torch.as_tensor(prior_loc, dtype=dt, device=dev).expand(n).clone()
        prior = PriorBlock(latent_name, loc, cov=DiagonalOperator(scale**2), prec=DiagonalOperator(scale**-2),
                           logdet_cov=float(2 * torch.log(scale).sum()))
        off = torch.zeros(q, dtype=dt, device=dev) if offset is None else torch.as_tensor(offset, dtype=dt, device=dev)
        layout = LatentLayout.from_shapes([(latent_name, (n,))], [1])
        return cls(layout, [prior], [SiteGroup(name, family, B, off, (q,))])

    # ------------------------------------------------------------------ basic facts
    @property
    def n(self):
        return self.layout.size

    @property
    def num_sites(self):
        return sum(g.size for g in self.sites)

    @property
    def dtype(self):
        return self.priors[0].loc.dtype

    @property
    def device(self):
        return self.priors[0].loc.device

    @property
    def prior_slices(self):
        """The slice of ``u`` of each prior block (one per entry of :attr:`priors`, in order)."""
        out, pos = [], 0
        for p in self.priors:
            out.append(slice(pos, pos + p.size))
            pos += p.size
        return out

    @property
    def prior_loc(self):
        return torch.cat([p.loc for p in self.priors])

    @property
    def prior_cov(self):
        """Block-diagonal prior covariance operator, or ``None`` if a block has none (flat or precision-only)."""
        if any(p.flat or p.cov is None for p in self.priors):
            return None
        ops = [p.cov for p in self.priors]
        return ops[0] if len(ops) == 1 else BlockDiagonalOperator(ops)

    @property
    def prior_prec(self):
        """Block-diagonal prior precision operator (zero on flat blocks), or ``None`` if a block has only a covariance."""
        ops = []
        for p in self.priors:
            if p.flat:
                ops.append(DiagonalOperator(torch.zeros_like(p.loc)))
            elif p.prec is not None:
                ops.append(p.prec)
            else:
                return None
        return ops[0] if len(ops) == 1 else BlockDiagonalOperator(ops)

    def dense_prior_cov(self):
        """Dense prior covariance (small problems; inverts a precision block by Cholesky if needed)."""
        blocks = []
        for p in self.priors:
            if p.flat:
                raise UnsupportedModelError(p.name, "block has no Gaussian prior (flat); a covariance does not exist")
            if p.cov is not None:
                blocks.append(p.cov.to_dense())
            else:
                blocks.append(torch.cholesky_inverse(torch.linalg.cholesky(p.prec.to_dense())))
        return torch.block_diag(*blocks)

    def dense_prior_prec(self):
        blocks = []
        for p in self.priors:
            if p.flat:
                blocks.append(torch.zeros(p.size, p.size, dtype=self.dtype, device=self.device))
            elif p.prec is not None:
                blocks.append(p.prec.to_dense())
            else:
                blocks.append(torch.cholesky_inverse(torch.linalg.cholesky(p.cov.to_dense())))
        return torch.block_diag(*blocks)

    def prior_logdet_cov(self):
        """``log |Sigma|`` over the non-flat blocks (dense Cholesky for dense blocks)."""
        total = 0.0
        for p in self.priors:
            if p.flat:
                continue
            if p.logdet_cov is not None:
                total += p.logdet_cov
            elif p.cov is not None:
                total += float(2 * torch.log(torch.diagonal(torch.linalg.cholesky(p.cov.to_dense()))).sum())
            else:
                total -= float(2 * torch.log(torch.diagonal(torch.linalg.cholesky(p.prec.to_dense()))).sum())
        return total

    @property
    def gaussian_groups(self):
        return [g for g in self.sites if isinstance(g.family, Gaussian)]

    @property
    def nongaussian_groups(self):
        return [g for g in self.sites if not isinstance(g.family, Gaussian)]

    def design(self, groups=None):
        """Stacked design operator of ``groups`` (default: all site groups)."""
        groups = self.sites if groups is None else groups
        return groups[0].design if len(groups) == 1 else StackedOperator([g.design for g in groups])

    def offset(self, groups=None):
        groups = self.sites if groups is None else groups
        return torch.cat([g.offset for g in groups])

    # ------------------------------------------------------------------ imputed sites
    def complete_posterior(self, posterior):
        r"""The posterior over all the Pyro model's latent sites (:attr:`model_layout`) from one over ``u``.

        With ``q(u) = N(m, V)`` and the imputed blocks ``x_k = B_k u + o_k + s_k eps_k``, the joint
        Gaussian has means ``B_k m + o_k``, covariances ``B_k V B_l^T + [k = l] diag(s_k^2)`` and
        cross-covariances ``B_k V``, packed in trace order. The evidence bound of ``q(u)`` is also the
        bound of this joint (the conditional of ``x`` given ``u`` is the model's own and integrates
        to one). Without imputed blocks ``posterior`` is returned as it is.

        :param posterior: a :class:`~pyro_convexvb.GaussianPosterior` over ``u`` (``n`` coordinates).
        :returns: a :class:`~pyro_convexvb.GaussianPosterior` with a dense covariance and ``layout = model_layout``.
        """
        _check_posterior(posterior)
        components = getattr(posterior, "components", None)  # a mixture over hyper-latents: completed per point
        if self.chain is not None and components is not None:
            if not all(getattr(c, "coordinates", None) == "model" for c in components):
                raise ValueError("a mixture posterior of an affine Gaussian chain needs components over the model's "
                                 "sites (complete each component)")
        elif self.chain is not None and getattr(posterior, "coordinates", None) != "model":
            if posterior.n != self.n:
                raise ValueError(f"the posterior has {posterior.n} coordinates, the latent vector u has {self.n}")
            posterior = self.chain.to_model(posterior, layout=self.layout)
        if not self.imputed:
            return posterior
        if posterior.n != self.n:
            raise ValueError(f"the posterior has {posterior.n} coordinates, the latent vector u has {self.n}")
        m = posterior.loc.to(self.dtype)
        V = posterior.covariance().to(self.dtype)
        Bs = [b.design.to_dense().to(self.dtype) for b in self.imputed]
        G = torch.cat(Bs, 0)  # (Q, n)
        GV = G @ V
        mean = torch.cat([m, G @ m + torch.cat([b.offset for b in self.imputed])])
        noise = torch.cat([b.scale for b in self.imputed]) ** 2
        low = GV @ G.transpose(0, 1)
        low.diagonal().add_(noise)
        C = torch.cat([torch.cat([V, GV.transpose(0, 1)], 1), torch.cat([GV, low], 1)], 0)
        # permutation from (u, imputed) order to the model's trace order
        pos = {}
        for b in self.layout.blocks:
            pos[b.name] = torch.arange(b.start, b.start + b.size)
        start = self.n
        for b in self.imputed:
            pos[b.name] = torch.arange(start, start + b.size)
            start += b.size
        perm = torch.cat([pos[b.name] for b in self.model_layout.blocks]).to(m.device)
        C = C[perm][:, perm]
        return GaussianPosterior(mean[perm], covariance=0.5 * (C + C.transpose(0, 1)), layout=self.model_layout)

    def latent_marginal(self, posterior):
        """The marginal over ``u`` of a Gaussian posterior over all the Pyro model's latent sites (:attr:`model_layout`).

        The inverse of :meth:`complete_posterior` for engines that fit the Pyro model itself (their
        Gaussian covers the imputed sites too): its evidence bound on this model is that of the marginal.
        Without imputed blocks ``posterior`` is returned as it is.

        :returns: a :class:`~pyro_convexvb.GaussianPosterior` over ``u`` with a dense covariance and ``layout = layout``.
        """
        _check_posterior(posterior)
        if not self.imputed:
            return posterior if self.chain is None else self.chain.to_latent(posterior, layout=self.layout)
        if posterior.n != self.model_layout.size:
            raise ValueError(f"the posterior has {posterior.n} coordinates, the model's latent sites {self.model_layout.size}")
        idx = torch.cat([torch.arange(self.model_layout[b.name].start, self.model_layout[b.name].start + b.size)
                         for b in self.layout.blocks]).to(posterior.loc.device)
        C = posterior.covariance()[idx][:, idx]
        q = GaussianPosterior(posterior.loc[idx], covariance=C, layout=self.layout)
        return q if self.chain is None else self.chain.to_latent(q, layout=self.layout)

    # ------------------------------------------------------------------ densities
    def log_prior(self, u):
        """``log N(u | mu, Sigma)`` over non-flat blocks, for ``u`` of shape ``(n,)``."""
        total = u.new_zeros(())
        for p, sl in zip(self.priors, self.prior_slices):
            if p.flat:
                continue
            r = u[sl] - p.loc
            if p.prec is not None:
                quad = r @ p.prec.mv(r)
            else:
                L = torch.linalg.cholesky(p.cov.to_dense())
                quad = (torch.linalg.solve_triangular(L, r.unsqueeze(-1), upper=False) ** 2).sum()
            total = total - 0.5 * quad
        return total - 0.5 * self.prior_logdet_cov() - 0.5 * sum(p.size for p in self.priors if not p.flat) * math.log(2 * math.pi)

    def site_sum(self, t):
        """Sum over the sites of all ranks of a local site sum ``t`` when the designs are row-sharded
        (:mod:`pyro_convexvb.distributed`; differentiable), else ``t``."""
        from ..distributed import comm_of, reduce_sites

        return reduce_sites(comm_of(self), t)

    def log_likelihood(self, u):
        """``sum_i log t_i(eta_i)`` for ``u`` of shape ``(n,)`` (over all ranks' rows when row-sharded)."""
        return self.site_sum(sum(g.family.log_prob(g.eta(u)).sum() for g in self.sites))

    def log_joint(self, u):
        """``log p(y, u)`` of the model as written (all constants included; ``log_const`` belongs to the sites:
        with row-sharded data it is this rank's share and is summed over ranks)."""
        from ..distributed import comm_of

        self._check_moments(u, None, None, loc_name="u")  # (n,): a column (n, 1) broadcast to (n, n) silently
        if comm_of(self) is None:
            return self.log_prior(u) + self.log_likelihood(u) + self.log_const
        return self.log_prior(u) + self.site_sum(sum(g.family.log_prob(g.eta(u)).sum() for g in self.sites)
                                                 + self.log_const)

    def evidence_lower_bound(self, loc, cov=None, num_points=64, *, variance=None):
        """Exact variational-Gaussian ELBO ``E_q[log p(y, u)] + H[q]`` for ``q = N(loc, cov)`` or ``N(loc, diag(variance))``.

        Site expectations use closed forms or Gauss-Hermite quadrature on the site marginals, so the
        result is a lower bound on ``log p(y)`` up to quadrature error (~1e-12 for smooth sites).
        Differentiable in ``loc`` and ``cov``/``variance``.

        :param torch.Tensor loc: ``(n,)``.
        :param torch.Tensor cov: ``(n, n)`` symmetric positive definite (dense ``q``).
        :param torch.Tensor variance: ``(n,)`` positive variances (mean-field ``q``), instead of ``cov``.
        """
        if (cov is None) == (variance is None):
            raise ValueError("evidence_lower_bound: give exactly one of cov and variance")
        return self.expected_log_joint(loc, cov, num_points, variance=variance) + _gaussian_entropy(cov, variance)

    def model_evidence_lower_bound(self, loc, cov=None, *, variance=None):
        """:meth:`evidence_lower_bound` of a Gaussian over the Pyro model's latent sites ``x``
        (:meth:`model_expected_log_joint` plus the entropy of ``q`` over ``x``); differentiable."""
        if (cov is None) == (variance is None):
            raise ValueError("model_evidence_lower_bound: give exactly one of cov and variance")
        return self.model_expected_log_joint(loc, cov, variance=variance) + _gaussian_entropy(cov, variance)

    def expected_log_prior(self, loc, cov=None, *, variance=None):
        """``E_q[log N(u | mu, Sigma)]`` over the non-flat prior blocks (normalising constants included)."""
        e_prior = loc.new_zeros(())
        for p, sl in zip(self.priors, self.prior_slices):
            if p.flat:
                continue
            r = loc[sl] - p.loc
            if variance is not None:
                quad = r @ (p.prec.mv(r) if p.prec is not None else self._block_precision(p) @ r)
                tr = (self._block_precision_diagonal(p) * variance[sl]).sum()
            else:
                P = self._block_precision(p)
                quad, tr = r @ P @ r, (P * cov[sl, sl]).sum()
            e_prior = e_prior - 0.5 * (quad + tr + p.size * math.log(2 * math.pi))
        return e_prior - 0.5 * self.prior_logdet_cov()

    @property
    def model_bijective(self):
        """Whether the Pyro model's latent sites ``x`` map one to one onto ``u`` (no imputed sites, no intrinsic
        chain block), so that :meth:`model_expected_log_joint` applies."""
        return not self.imputed and (self.chain is None or not self.chain.has_intrinsic)

    def model_expected_log_joint(self, loc, cov=None, *, variance=None):
        """``E_q[log p(y, x)]`` for a Gaussian ``q`` over the Pyro model's latent sites ``x`` (:attr:`model_layout`),
        given by ``loc`` ``(n,)`` and ``cov`` ``(n, n)`` or ``variance`` ``(n,)``; differentiable.

        Without an affine chain ``x`` is ``u`` (:meth:`expected_log_joint`). A chain's ``u = (I - A) x - c`` has
        Jacobian one, so ``log p(y, x) = log p(y, u)`` and ``q`` is mapped to ``u`` exactly
        (:meth:`~pyro_convexvb.lgm.chains.AffineChain.latent_moments`).

        With imputed blocks ``x_k = B_k u + o_k + s_k eps_k`` (and no chain), ``log p(y, u, x) = log p(y, u) +
        sum_k log N(x_k | B_k u + o_k, diag(s_k^2))``, closed-form in the joint moments; the masked-out entries of an
        ``obs_mask`` site (``filler``) have the ``N(0, 1)`` density the engines on the Pyro model give them.

        :raises ValueError: for a chain with intrinsic blocks, or a chain beside imputed sites.
        """
        if self.imputed and self.chain is None:
            return self._expected_log_joint_with_imputed(loc, cov, variance)
        if not self.model_bijective:
            raise ValueError("model_expected_log_joint: the model's latent sites map to u through imputed sites or "
                             "an intrinsic GMRF's constraint, not a bijection")
        if self.chain is None:
            return self.expected_log_joint(loc, cov, variance=variance)
        return self.expected_log_joint(*self.chain.latent_moments(loc, cov, variance=variance))

    @property
    def model_exact(self):
        """Whether :meth:`model_expected_log_joint` evaluates a Gaussian over the Pyro model's latent sites (a
        bijection to ``u``, or imputed blocks beside ``u`` without a chain)."""
        return self.model_bijective or (bool(self.imputed) and self.chain is None)

    def _expected_log_joint_with_imputed(self, loc, cov=None, variance=None):
        """``E_q[log p(y, u) + sum_k log p(x_k | u)]`` for ``q`` over the model's sites in :attr:`model_layout` order
        (``u``'s blocks and the imputed blocks ``x_k``; see :meth:`model_expected_log_joint`)."""
        def pos(name, size):
            return torch.arange(self.model_layout[name].start, self.model_layout[name].start + size,
                                device=loc.device)

        iu = torch.cat([pos(b.name, b.size) for b in self.layout.blocks])
        m_u = loc[iu]
        S_uu = None if cov is None else cov[iu][:, iu]
        e = self.expected_log_joint(m_u, S_uu, variance=None if variance is None else variance[iu])
        for b in self.imputed:
            ik = pos(b.name, b.size)
            B = b.design.to_dense().to(loc.dtype)
            mean, s2 = B @ m_u + b.offset.to(loc.dtype), b.scale.to(loc.dtype) ** 2
            if variance is not None:  # x_k - B_k u under a diagonal q: var(x_k) + B_k^2 var(u)
                v_cond, v_own = variance[ik] + (B * B) @ variance[iu], variance[ik]
            else:
                v_own = torch.diagonal(cov[ik][:, ik])
                v_cond = v_own + b.design.diag_congruence(S_uu) - 2 * (B * cov[ik][:, iu]).sum(1)
            r = loc[ik] - mean
            terms = -0.5 * (torch.log(2 * math.pi * s2) + (r * r + v_cond) / s2)
            if b.filler is not None:  # obs_mask's unused entries: N(0, 1), independent of u
                filler = b.filler.to(loc.device)
                terms = torch.where(filler, -0.5 * (math.log(2 * math.pi) + loc[ik] ** 2 + v_own), terms)
            e = e + terms.sum()
        return e

    def expected_log_joint(self, loc, cov=None, num_points=64, *, variance=None):
        """``E_q[log p(y, u)]`` (every constant included) for ``q = N(loc, cov)`` or ``N(loc, diag(variance))``.

        Closed-form prior term; closed-form or Gauss-Hermite site expectations on the site marginals.
        """
        if (cov is None) == (variance is None):
            raise ValueError("expected_log_joint: give exactly one of cov and variance")
        self._check_moments(loc, cov, variance)
        e_prior = self.expected_log_prior(loc, cov, variance=variance)
        e_lik = loc.new_zeros(())
        for g in self.sites:
            if g.family.vector_site:  # K x K covariance blocks of each observation's predictor rows
                h, S = self.site_block_marginals(g, loc, cov, variance=variance)
                e_lik = e_lik + g.family.expected_log_prob(h, S).sum()
                continue
            m = g.eta(loc)
            v = self._marginal_var(g, cov) if variance is None else self.diag_marginal_var(g, variance)
            e_lik = e_lik + g.family.expected_log_prob(m, v, num_points).sum()
        from ..distributed import comm_of

        if comm_of(self) is None:
            return e_prior + e_lik + self.log_const
        return e_prior + self.site_sum(e_lik + self.log_const)

    def _check_moments(self, loc, cov, variance, loc_name="loc"):
        """Refuse moments of the wrong kind, shape or dtype (a column ``loc`` or a non-symmetric ``cov`` gave a
        number that is no expectation); they are not checked for positive definiteness (the entropy is)."""
        n = self.n
        for name, value, shape in ((loc_name, loc, (n,)), ("cov", cov, (n, n)), ("variance", variance, (n,))):
            if value is None:
                continue
            if not torch.is_tensor(value):
                raise TypeError(f"{name}: expected a torch tensor, got {type(value).__name__}")
            if tuple(value.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(value.shape)}")
            if value.dtype != self.dtype:
                raise TypeError(f"{name}: dtype {value.dtype} differs from the model's {self.dtype}")
        if cov is not None and not bool(torch.allclose(cov, cov.transpose(0, 1), rtol=1e-8, atol=1e-12)):
            raise ValueError("cov: must be symmetric (max |cov - cov^T| = "
                             f"{float((cov - cov.transpose(0, 1)).abs().max()):.3g})")
        if variance is not None and not bool((variance.detach() >= 0).all()):
            raise ValueError(f"variance: must be non-negative, got a minimum of {float(variance.detach().min()):.3g}")

    @staticmethod
    def _block_precision(p):
        return p.prec.to_dense() if p.prec is not None else torch.cholesky_inverse(torch.linalg.cholesky(p.cov.to_dense()))

    @staticmethod
    def _block_precision_diagonal(p):
        if p.prec is not None:  # from the operator's structure (O(nnz) for a sparse one), without a dense copy
            d = p.prec.diagonal(dense_limit=0)
            if d is not None:
                return d
        if p.size > DENSE_LIMIT:
            raise MemoryError(f"prior block '{p.name}': the diagonal of a {p.size} x {p.size} precision that is not "
                              "diagonal would need a dense matrix")
        return torch.diagonal(LatentGaussianModel._block_precision(p))

    def site_marginals(self, loc, cov):
        """Means and variances of every group's predictor under ``q = N(loc, cov)`` (dense ``cov``); for a vector
        site (``family.vector_site``) the block means ``(n, K)`` and covariance blocks ``(n, K, K)``
        (:meth:`site_block_marginals`)."""
        return {g.name: (self.site_block_marginals(g, loc, cov) if g.family.vector_site else
                         (g.eta(loc), self._marginal_var(g, cov))) for g in self.sites}

    @staticmethod
    def site_block_marginals(group, loc, cov=None, *, variance=None):
        """``(h (n, K), S (n, K, K))``: the mean and covariance of each observation's ``K`` predictor rows of a vector
        site group under ``q = N(loc, cov)`` or ``N(loc, diag(variance))`` (dense design rows; small ``K``).

        :raises ValueError: if neither or both of ``cov`` and ``variance`` are given.
        """
        if (cov is None) == (variance is None):
            raise ValueError("site_block_marginals: give exactly one of cov and variance")
        K = group.family.block_size
        h = group.eta(loc).reshape(-1, K)
        B = group.design.to_dense().to(loc).reshape(h.shape[0], K, -1)
        if cov is not None:
            S = torch.einsum("nkl,lm,njm->nkj", B, cov, B)
        else:
            S = torch.einsum("nkl,l,njl->nkj", B, variance, B)
        return h, 0.5 * (S + S.transpose(-1, -2))

    @staticmethod
    def diag_marginal_var(group, variance):
        """Site variances ``diag(B diag(variance) B^T)`` of ``group`` (``(q,)``), from the design's squared
        entries (densified only when the design has no ``squared()``)."""
        v = group.design.row_sq_norms(variance)
        if v is None:
            return (group.design.to_dense() ** 2) @ variance
        # an identity design returns ``variance`` itself: the site variances must be their own autograd node (as
        # the gradient target ``dE/drho`` of the sites, the same tensor would collect the prior's and entropy's
        # terms too: diag_mixture's natural-gradient steps then stalled 13-27 nats short, converged=True)
        return v.clone() if v is variance else v

    @staticmethod
    def _marginal_var(group, cov):
        return group.design.diag_congruence(cov)  # (q, n) dense like cov itself: small problems only


def _gaussian_entropy(cov=None, variance=None):
    """Entropy of ``N(m, cov)`` (``cov`` ``(n, n)``) or ``N(m, diag(variance))`` (``variance`` ``(n,)``)."""
    if variance is not None:
        return 0.5 * variance.shape[0] * (1 + math.log(2 * math.pi)) + 0.5 * torch.log(variance).sum()
    L, info = torch.linalg.cholesky_ex(cov)
    if int(info) == 0:
        half_logdet = torch.log(torch.diagonal(L)).sum()
    else:  # singular to rounding (a guide's scale_tril early in its fit): the eigenvalues, -inf for a zero one
        half_logdet = 0.5 * torch.log(torch.linalg.eigvalsh(0.5 * (cov + cov.transpose(-1, -2))).clamp_min(0.0)).sum()
    return 0.5 * cov.shape[0] * (1 + math.log(2 * math.pi)) + half_logdet
