"""One Gaussian posterior type for every engine, and the Pyro guides built from it.

:meth:`GaussianPosterior.as_guide` returns a guide whose parameters live in Pyro's param store,
initialised at the posterior, so ``SVI`` can keep training from an engine's answer:

* dense kinds (``covariance``, ``scale_tril``, ``precision``, and ``precision_operator`` for
  ``n <= MAX_TRAINABLE_DENSE``) -> :class:`PosteriorMultivariateNormal`
  (a :class:`~pyro.infer.autoguide.AutoMultivariateNormal`);
* ``diagonal`` -> :class:`PosteriorDiagonalNormal` (a :class:`~pyro.infer.autoguide.AutoDiagonalNormal`);
* ``low_rank_diagonal`` (``C = W W^T + diag(d)``) -> :class:`PosteriorLowRankMultivariateNormal`
  (a :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`).

``as_guide(trainable=False)`` gives the fixed, parameter-free :class:`GaussianPosteriorGuide`.
"""
import inspect
import math

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.infer.autoguide import (AutoContinuous, AutoDiagonalNormal, AutoLowRankMultivariateNormal,
                                  AutoMultivariateNormal)
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.nn import PyroParam
from torch import nn
from torch.distributions import constraints

from ..errors import NotPositiveDefiniteError
from ..linalg.cg import cg
from ..linalg.operators import as_operator
from .base import Posterior

__all__ = [
    "GaussianPosterior",
    "GaussianPosteriorGuide",
    "PosteriorMultivariateNormal",
    "PosteriorDiagonalNormal",
    "PosteriorLowRankMultivariateNormal",
    "MAX_DENSE",
    "MAX_TRAINABLE_DENSE",
    "MAX_COMPACT_DENSE",
]

#: Largest latent dimension for which ``covariance()`` materialises a dense matrix without ``force=True``.
MAX_DENSE = 10_000

#: Largest latent dimension for which :meth:`GaussianPosterior.compact` (pickled estimators, ``pcv.save``) stores a
#: matrix-free (``precision_operator``) posterior as its dense precision (``n^2`` numbers: 8 MB in float64 at
#: ``n = 1000``); above it only the mean and the marginal variances are kept.
MAX_COMPACT_DENSE = 1000

#: Largest latent dimension for which a matrix-free (``precision_operator``) posterior is turned into a
#: trainable dense guide: the precision is densified and factorised (``O(n^3)``), and training keeps about
#: five ``n x n`` arrays (Cholesky factor, its gradient, two Adam moments, the scaled factor), 640 MB in
#: float64 at ``n = 4000``.
MAX_TRAINABLE_DENSE = 4000


#: right-hand sides per batched CG solve of :meth:`GaussianPosterior.marginals` under a matrix-free precision
CG_BLOCK = 256


class GaussianPosterior(Posterior):
    """A Gaussian ``q(u) = N(loc, C)`` over the flat latent vector ``u`` (see :class:`~pyro_convexvb.lgm.LatentLayout`).

    Exactly one covariance representation is given:

    * ``covariance``: dense ``(n, n)``;
    * ``scale_tril``: lower Cholesky factor ``(n, n)`` of ``C``;
    * ``precision``: dense ``(n, n)`` precision ``C^{-1}``;
    * ``precision_operator`` (+ ``precision_factor``): a matrix-free SPD precision ``A = J^T J``
      (scaled by ``precision_scale``, i.e. ``C = precision_scale * A^{-1}``); samples are drawn exactly
      by perturb-and-solve ``A^{-1} J^T eps`` with conjugate gradients, and ``variance`` must be
      provided (engines estimate it, e.g. by Lanczos);
    * ``low_rank``: a pair ``(Q, T)`` with ``C ~= Q T^{-1} Q^T`` (Lanczos), for downstream scores only
      (rank-deficient: not a distribution over all of ``u``, so it cannot be sampled or turned into a guide);
    * ``cov_factor`` and ``cov_diag`` together (kind ``"low_rank_diagonal"``): ``C = W W^T + diag(d)``
      with ``W`` ``(n, r)`` and ``d`` ``(n,)`` positive, as :class:`~pyro.distributions.LowRankMultivariateNormal`;
    * ``variance`` alone: a diagonal covariance.

    :param torch.Tensor loc: ``(n,)`` posterior mean.
    :param torch.Tensor variance: ``(n,)`` marginal variances (computed from the representation when omitted).
    :param torch.Tensor cov_factor: ``(n, r)`` factor ``W`` of the low-rank part (with ``cov_diag``).
    :param torch.Tensor cov_diag: ``(n,)`` positive diagonal ``d`` (with ``cov_factor``).
    :param layout: optional :class:`~pyro_convexvb.lgm.LatentLayout` mapping ``u`` to Pyro sites.
    :param torch.Tensor precision_cholesky: ``(n, n)`` lower Cholesky factor of ``precision_scale * C^{-1}`` (the
        operator ``A`` of a matrix-free posterior): an engine's own factor, used by :meth:`marginals` and
        :meth:`log_prob`.
    :param lanczos: a Lanczos estimate of ``C`` (with ``variances(D)``): an engine's own factor for :meth:`marginals`.
    :param model: the Pyro model it was fitted to, and ``model_args = (args, kwargs)`` its fitting arguments
        (for :meth:`as_guide`; see :meth:`~pyro_convexvb.posterior.base.Posterior.with_model`).

    Example::

        >>> import torch
        >>> q = GaussianPosterior(torch.zeros(2, dtype=torch.float64),
        ...                       covariance=torch.tensor([[2., .5], [.5, 1.]], dtype=torch.float64))
        >>> q.variance
        tensor([2., 1.], dtype=torch.float64)
        >>> q.sample(5).shape
        torch.Size([5, 2])
        >>> W = torch.tensor([[1.], [2.]], dtype=torch.float64)
        >>> r = GaussianPosterior(torch.zeros(2, dtype=torch.float64), cov_factor=W,
        ...                       cov_diag=torch.tensor([.5, .5], dtype=torch.float64))
        >>> r.kind, r.variance
        ('low_rank_diagonal', tensor([1.5000, 4.5000], dtype=torch.float64))
    """

    def __init__(self, loc, variance=None, *, covariance=None, scale_tril=None, precision=None,
                 precision_operator=None, precision_factor=None, precision_scale=1.0, low_rank=None,
                 cov_factor=None, cov_diag=None, layout=None, model=None, model_args=((), {}), cg_options=None,
                 precision_cholesky=None, lanczos=None):
        self.loc = loc
        self.precision_cholesky, self.lanczos = precision_cholesky, lanczos
        self.layout = layout
        self.model = model
        self.model_args = model_args
        if (cov_factor is None) != (cov_diag is None):
            raise ValueError("a low-rank-plus-diagonal covariance needs both cov_factor= (n, r) and cov_diag= (n,)")
        reps = {k: v for k, v in dict(covariance=covariance, scale_tril=scale_tril, precision=precision,
                                      precision_operator=precision_operator, low_rank=low_rank,
                                      low_rank_diagonal=cov_factor).items()
                if v is not None}
        if len(reps) > 1:
            names = {"low_rank_diagonal": "cov_factor/cov_diag"}
            raise ValueError(f"give one covariance representation, got {sorted(names.get(k, k) for k in reps)}")
        self.kind = next(iter(reps)) if reps else "diagonal"
        self.cov_factor, self.cov_diag = cov_factor, cov_diag
        self._covariance = covariance
        self._scale_tril = scale_tril
        self._precision = precision
        self.precision_operator = None if precision_operator is None else as_operator(precision_operator)
        self.precision_factor = None if precision_factor is None else as_operator(precision_factor)
        self.precision_scale = float(precision_scale)
        self.low_rank = low_rank
        self.cg_options = dict(rtol=1e-8, max_iter=None, on_fail="warn") if cg_options is None else dict(cg_options)
        n = loc.shape[-1]
        for name, m in (("covariance", covariance), ("scale_tril", scale_tril), ("precision", precision)):
            if m is not None and tuple(m.shape) != (n, n):
                raise ValueError(f"{name} must have shape ({n}, {n}), got {tuple(m.shape)}")
        if cov_factor is not None:
            if cov_factor.dim() != 2 or cov_factor.shape[0] != n or tuple(cov_diag.shape) != (n,):
                raise ValueError(f"cov_factor must have shape ({n}, r) and cov_diag ({n},), got "
                                 f"{tuple(cov_factor.shape)} and {tuple(cov_diag.shape)}")
            if not bool((cov_diag > 0).all()) or not bool(torch.isfinite(cov_diag).all()) \
                    or not bool(torch.isfinite(cov_factor).all()):
                raise ValueError("cov_diag must be positive and finite, and cov_factor finite")
        if variance is None:
            if self.kind == "diagonal":
                raise ValueError("a GaussianPosterior needs a covariance representation or marginal variances")
            if self.kind == "precision_operator":
                raise ValueError("precision_operator posteriors need their marginal variances (estimate them, e.g. by Lanczos)")
            variance = self._dense_variance()
        self.variance = variance
        if tuple(variance.shape) != tuple(loc.shape):
            raise ValueError(f"variance must have the shape of loc {tuple(loc.shape)}, got {tuple(variance.shape)}")
        if (self.variance < 0).any() or not torch.isfinite(self.variance).all():
            raise ValueError("marginal variances must be finite and nonnegative")

    # ------------------------------------------------------------------ representations
    @property
    def n(self):
        return int(self.loc.shape[-1])


    def _dense_variance(self):
        if self.kind == "covariance":
            return torch.diagonal(self._covariance).clone()
        if self.kind == "scale_tril":
            return (self._scale_tril**2).sum(-1)
        if self.kind == "precision":
            return torch.diagonal(self.covariance()).clone()
        if self.kind == "low_rank":
            Q, T = self.low_rank
            L = torch.linalg.cholesky(T)
            W = torch.linalg.solve_triangular(L, Q.transpose(0, 1), upper=False)
            return (W**2).sum(0)
        if self.kind == "low_rank_diagonal":
            return (self.cov_factor**2).sum(-1) + self.cov_diag
        raise ValueError(f"cannot compute variances for kind {self.kind}")

    def covariance(self, force=False):
        """Dense ``(n, n)`` covariance; refuses ``n > MAX_DENSE`` unless ``force=True`` or it is stored already
        (kind ``"covariance"``)."""
        if self.kind == "covariance":
            return self._covariance
        if self.n > MAX_DENSE and not force:
            raise MemoryError(f"covariance(): n = {self.n} > {MAX_DENSE}; pass force=True to materialise it")
        if self.kind == "scale_tril":
            return self._scale_tril @ self._scale_tril.transpose(-1, -2)
        if self.kind == "precision":
            return torch.cholesky_inverse(torch.linalg.cholesky(self._precision))
        if self.kind == "precision_operator":
            A = self._require_operator("covariance()").to_dense()
            return self.precision_scale * torch.cholesky_inverse(torch.linalg.cholesky(A))
        if self.kind == "low_rank":
            Q, T = self.low_rank
            return Q @ torch.linalg.solve(T, Q.transpose(0, 1))
        if self.kind == "low_rank_diagonal":
            return self.cov_factor @ self.cov_factor.transpose(0, 1) + torch.diag(self.cov_diag)
        return torch.diag(self.variance)

    def scale_tril(self):
        """Dense lower Cholesky factor of the covariance (small problems)."""
        if self.kind == "scale_tril":
            return self._scale_tril
        if self.kind == "diagonal":
            return torch.diag(self.variance.sqrt())
        if self.kind == "covariance":  # the stored covariance's factor is computed once (:meth:`_root`)
            L, singular = self._root()
            if not singular:
                return L
        return torch.linalg.cholesky(self.covariance())

    # ------------------------------------------------------------------ sampling and densities
    def sample(self, num_samples=(), generator=None):
        """Draw samples of shape ``(*num_samples, n)`` (differentiable w.r.t. ``loc`` when it requires grad)."""
        shape = (num_samples,) if isinstance(num_samples, int) else tuple(num_samples)
        m = int(math.prod(shape)) if shape else 1
        eps = torch.randn((m, self.n), dtype=self.dtype, device=self.device, generator=generator)
        if self.kind == "diagonal":
            x = eps * self.variance.sqrt()
        elif self.kind == "precision":
            L = torch.linalg.cholesky(self._precision)
            x = torch.linalg.solve_triangular(L.transpose(-1, -2), eps.transpose(0, 1), upper=True).transpose(0, 1)
        elif self.kind == "precision_operator":
            x = self._sample_matrix_free(m, generator)
        elif self.kind == "low_rank_diagonal":
            r = self.cov_factor.shape[1]
            e2 = torch.randn((m, r), dtype=self.dtype, device=self.device, generator=generator)
            x = eps * self.cov_diag.sqrt() + e2 @ self.cov_factor.transpose(0, 1)
        elif self.kind == "low_rank":
            raise NotImplementedError(
                "a low-rank (Lanczos) covariance is an approximation for scores and variances; "
                "sample from the engine's precision representation instead")
        else:
            x = eps @ self._sampling_root().transpose(-1, -2)
        return (self.loc + x).reshape(shape + (self.n,))

    def _sampling_root(self):
        """``R`` with ``R R^T = covariance`` (:meth:`_root`)."""
        return self._root()[0]

    def _root(self):
        """``(R, singular)``: the Cholesky factor of the covariance, or, for a covariance singular to rounding (the
        posterior of an intrinsic field on its constraint subspace, rank ``n - k``), its eigen-root, whose draws
        satisfy the constraints to rounding; a covariance with a clearly negative eigenvalue raises.

        Singular means a Cholesky failure or a pivot (a conditional variance) below ``n eps`` of the largest
        variance (numpy's rank tolerance): rounding decides which of the two a singular covariance gives, and a
        Cholesky factor that succeeds there draws ``1e-7``-sized departures from the constraints."""
        if self.kind == "scale_tril":
            return self._scale_tril, False
        C = self.covariance()
        cached = self.__dict__.get("_root_cache")  # a stored covariance is factored once (guides call this per draw)
        if cached is not None and cached[0] is C and cached[1] == C._version:
            return cached[2]
        out = self._factor_root(C)
        if self.kind == "covariance" and not C.requires_grad:
            self.__dict__["_root_cache"] = (C, C._version, out)
        return out

    def _factor_root(self, C):
        L, info = torch.linalg.cholesky_ex(C)
        # numpy's matrix_rank tolerance, relative: singular for sampling (the importance diagnostics refuse a
        # density already below diagnostics.proposals.SINGULAR_PIVOT, 1e-11, where it is rounding noise)
        tol = self.n * torch.finfo(C.dtype).eps
        if int(info) == 0 and bool((torch.diagonal(L) ** 2 > tol * torch.diagonal(C).max()).all()):
            return L, False
        lam, V = torch.linalg.eigh(0.5 * (C + C.transpose(-1, -2)))
        if bool((lam < -1e-9 * lam.abs().max()).any()):
            raise NotPositiveDefiniteError(f"the posterior covariance is not positive definite: it has a negative "
                                           f"eigenvalue ({float(lam.min()):.3g}, largest {float(lam.max()):.3g}), so "
                                           "there is no Gaussian to sample")
        # eigenvalues at rounding level (the rank tolerance of numpy's matrix_rank) are the null directions: zero,
        # not the square root of their rounding error (1e-8 departures from the constraints)
        null = lam <= lam.abs().max() * tol
        return V * torch.where(null, torch.zeros_like(lam), lam).sqrt(), True

    def is_singular(self):
        """Whether the covariance is singular to rounding (dense kinds: an intrinsic field's posterior, rank
        ``n - k`` on its constraint subspace), so that it has draws but no density and no Cholesky factor."""
        return self.kind == "covariance" and self._root()[1]

    def _sample_matrix_free(self, m, generator):
        self._require_operator("sample()")
        if self.precision_factor is None:
            raise NotImplementedError("matrix-free sampling needs precision_factor J with precision = J^T J")
        J = self.precision_factor
        eps = torch.randn((J.shape[0], m), dtype=self.dtype, device=self.device, generator=generator)
        res = cg(self.precision_operator, J.rmv(eps), **self.cg_options)
        return (math.sqrt(self.precision_scale) * res.x).transpose(0, 1)

    def log_prob(self, u):
        """Log density of ``u`` ``(..., n)``; a matrix-free posterior's through the dense Cholesky factor of its
        precision (the engine's ``precision_cholesky``, else factorised at the first call and kept; ``n <= MAX_DENSE``).
        A Lanczos ``low_rank`` covariance is singular and has none."""
        if self.kind == "low_rank":
            raise NotImplementedError("log_prob is not available for a low_rank (Lanczos) posterior: its covariance "
                                      "is singular")
        if self.kind == "precision_operator":
            L = self.precision_cholesky if self.precision_cholesky is not None else self.__dict__.get("_dense_chol")
            if L is None:
                if self.n > MAX_DENSE:
                    raise NotImplementedError(
                        f"log_prob of a matrix-free posterior factorises its dense n x n precision, and n = {self.n} > "
                        f"MAX_DENSE = {MAX_DENSE}: evaluate densities on a smaller model, or sample without them")
                L = self.__dict__["_dense_chol"] = torch.linalg.cholesky(self._require_operator("log_prob").to_dense())
            r = (u - self.loc) @ L  # L^T (u - loc), with C = precision_scale * (L L^T)^{-1}
            s = self.precision_scale
            return -0.5 * (r**2).sum(-1) / s - 0.5 * self.n * math.log(2 * math.pi * s) + torch.log(L.diagonal()).sum()
        if self.kind == "diagonal":
            return dist.Normal(self.loc, self.variance.sqrt()).to_event(1).log_prob(u)
        if self.kind == "precision":
            return dist.MultivariateNormal(self.loc, precision_matrix=self._precision).log_prob(u)
        if self.kind == "low_rank_diagonal":
            return self.to_distribution().log_prob(u)
        if self.is_singular():
            raise ValueError("log_prob: the posterior's covariance is singular to working precision (an intrinsic "
                             "field's posterior lives on its constraint subspace; a laplace fit at a funnel's neck has "
                             "unbounded variances), so it has no density over all n coordinates")
        return dist.MultivariateNormal(self.loc, scale_tril=self.scale_tril()).log_prob(u)

    def entropy(self):
        """Differential entropy (dense representations)."""
        if self.kind == "diagonal":
            return 0.5 * self.n * (1 + math.log(2 * math.pi)) + 0.5 * torch.log(self.variance).sum()
        if self.kind == "low_rank_diagonal":
            return self.to_distribution().entropy()
        L = self.scale_tril()
        return 0.5 * self.n * (1 + math.log(2 * math.pi)) + torch.log(torch.diagonal(L)).sum()

    def marginals(self, design, offset=None):
        """Means and variances of ``eta = design @ u + offset`` under q.

        An engine's own factor comes first (``precision_cholesky``: exact; ``lanczos``: its estimate, a lower bound
        for K-Lanczos, Seeger 2010 §4.1).  Dense representations give exact variances; ``low_rank`` gives the Lanczos
        estimate ``diag(B Q T^{-1} Q^T B^T)``; ``low_rank_diagonal`` gives ``diag(B W W^T B^T) + B^2 d`` exactly;
        ``diagonal`` assumes independence.

        :param design: ``(q, n)`` tensor or operator.
        :returns: ``(mean (q,), var (q,))``.
        """
        B = as_operator(design)
        mean = B.mv(self.loc)
        if offset is not None:
            mean = mean + offset
        if self.precision_cholesky is not None:
            L = self.precision_cholesky
            Linv = torch.linalg.solve_triangular(L, torch.eye(L.shape[0], dtype=L.dtype, device=L.device), upper=False)
            var = self.precision_scale * (B.mv(Linv.transpose(0, 1).contiguous()) ** 2).sum(1)
        elif self.lanczos is not None:
            var = self.precision_scale * self.lanczos.variances(B)
        elif self.kind == "diagonal":
            sq = B.squared()
            var = sq.mv(self.variance) if sq is not None else (B.to_dense() ** 2) @ self.variance
        elif self.kind == "low_rank":
            Q, T = self.low_rank
            L = torch.linalg.cholesky(T)
            W = torch.linalg.solve_triangular(L, B.mv(Q).transpose(0, 1), upper=False)
            var = (W**2).sum(0)
        elif self.kind == "low_rank_diagonal":
            sq = B.squared()
            var = sq.mv(self.cov_diag) if sq is not None else (B.to_dense() ** 2) @ self.cov_diag
            var = var + (B.mv(self.cov_factor) ** 2).sum(-1)
        elif self.kind == "precision_operator":
            var = self._precision_operator_quad(B)
        elif self.kind == "covariance":  # diag(B C B^T) from the stored C: no factorisation
            var = B.diag_congruence(self._covariance)
        else:
            L = self.scale_tril()
            var = (B.mv(L) ** 2).sum(-1)
        return mean, var

    def _precision_operator_quad(self, B):
        """``precision_scale * diag(B A^{-1} B^T)``: dense Cholesky for ``n <= 4000``, else batched CG."""
        GaussianPosterior._require_operator(self, "marginals()")
        if self.n <= 4000:
            L = torch.linalg.cholesky(self.precision_operator.to_dense())
            W = torch.linalg.solve_triangular(L, B.to_dense().transpose(0, 1), upper=False)
            return self.precision_scale * (W**2).sum(0)
        q = B.shape[0]
        if q > 2048:
            raise NotImplementedError(
                "marginals of more than 2048 new rows under a matrix-free precision: use the engine's Lanczos factors")
        out = []
        for start in range(0, q, CG_BLOCK):  # blocks of right-hand sides: memory n x CG_BLOCK, not n x q
            cols = torch.arange(start, min(start + CG_BLOCK, q), device=self.device)
            E = torch.zeros(q, cols.numel(), dtype=self.dtype, device=self.device)
            E[cols, cols - start] = 1.0  # the identity's columns of this block, not the q x q identity each time
            Bt = B.T.mv(E)
            out.append((Bt * cg(self.precision_operator, Bt, **self.cg_options).x).sum(0))
        return self.precision_scale * torch.cat(out)

    def to_distribution(self):
        """A Pyro distribution with ``event_shape (n,)`` (MultivariateNormal for dense kinds)."""
        if self.kind == "diagonal":
            return dist.Normal(self.loc, self.variance.sqrt()).to_event(1)
        if self.kind in ("covariance", "scale_tril", "precision"):
            if self.is_singular():  # an intrinsic field's posterior: draws on its constraint subspace, no density
                return _PosteriorDistribution(self)
            return dist.MultivariateNormal(self.loc, scale_tril=self.scale_tril())
        if self.kind == "low_rank_diagonal":
            return dist.LowRankMultivariateNormal(self.loc, self.cov_factor, self.cov_diag)
        return _PosteriorDistribution(self)

    def as_guide(self, model=None, *, trainable=True, form=None, name_prefix=None, model_args=None,
                 model_kwargs=None):
        """A Pyro guide over the model's latent sites, initialised at this posterior.

        With ``trainable=True`` (default) the guide's parameters are registered in Pyro's param store with
        this posterior's values, so ``SVI(model, guide, optim, Trace_ELBO())`` continues from the engine's
        answer; ``Predictive``, ``median()``, ``quantiles()``, ``get_posterior()`` and ``poutine`` handlers
        work as for Pyro's own autoguides.  The guide class follows ``form``:

        * ``"full"`` -> :class:`PosteriorMultivariateNormal` (``loc``, ``scale``, ``scale_tril``); the default
          for ``covariance``, ``scale_tril``, ``precision`` and, for ``n <= MAX_TRAINABLE_DENSE``, matrix-free
          ``precision_operator`` posteriors (densified and factorised; larger ones raise ``ValueError``);
        * ``"diagonal"`` -> :class:`PosteriorDiagonalNormal` (``loc``, ``scale``); the default for diagonal
          posteriors.  Asked for explicitly on a correlated posterior it is a mean-field guide at the
          posterior's marginal variances: it drops all correlations (for ``precision_operator`` posteriors
          the variances are the engine's estimates, e.g. by Lanczos);
        * ``"low_rank"`` -> :class:`PosteriorLowRankMultivariateNormal` (``loc``, ``scale``, ``cov_factor``); the
          default for ``low_rank_diagonal`` posteriors, and only available for them.

        A Lanczos ``low_rank`` posterior is rank-deficient (not a distribution over all of ``u``) and raises
        ``ValueError`` for every form.

        Param store: the parameters are named ``"<prefix>.loc"`` etc., with ``prefix = name_prefix`` or the
        guide's class name (as Pyro's autoguides).  When the guide is built (here if the model's data are
        known, else at its first call) entries of *those names* already in the store, e.g. from an earlier
        fit, are replaced by this posterior's values (cast to the model's dtype); other entries are left
        alone.  Two live guides with the same names share their parameters, as in Pyro: give them distinct
        ``name_prefix`` values.

        :param model: the Pyro model (default: the model the posterior was fitted to, with its fitting
            arguments, so observed sites stay observed in ``Predictive``).
        :param bool trainable: ``False`` gives the fixed, parameter-free :class:`GaussianPosteriorGuide`
            (samples exactly from this posterior, also matrix-free ones of any size, by perturb-and-solve;
            SVI cannot train it).
        :param str form: ``"full"``, ``"diagonal"`` or ``"low_rank"`` (trainable guides only; default by kind).
        :param str name_prefix: prefix of the parameter names in the param store.
        :param tuple model_args: positional arguments used to build the guide's prototype trace now
            (default: the fitting arguments when ``model`` is ``None`` or the fitted model; else the guide is
            built at its first call).
        :param dict model_kwargs: keyword arguments for the same (default: the fitting keyword arguments when
            ``model`` is ``None`` or the fitted model, also beside a new ``model_args``, so an observed site given
            by name stays observed; positional arguments that clash with them are refused).
        :returns: an :class:`~pyro.infer.autoguide.AutoContinuous` guide over the flat latent vector of
            length ``n`` (the order of Pyro's ``AutoContinuous`` packing of the latent sites, unconstrained).

        Example::

            >>> import pyro, pyro.distributions as dist, torch
            >>> def model():
            ...     pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.).to_event(1))
            >>> q = GaussianPosterior(torch.tensor([1., -1.], dtype=torch.float64),
            ...                       covariance=torch.tensor([[.5, .1], [.1, .3]], dtype=torch.float64))
            >>> guide = q.as_guide(model, model_args=(), name_prefix="q")
            >>> pyro.param("q.loc").tolist()
            [1.0, -1.0]
            >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), pyro.infer.Trace_ELBO())
            >>> _ = svi.step()
            >>> q.as_guide(model, trainable=False).median()["w"]
            tensor([ 1., -1.], dtype=torch.float64)
        """
        model, args, kwargs, eager = _guide_model_and_data(self, model, model_args, model_kwargs)
        if trainable:
            form = _default_guide_form(self) if form is None else form
            if form not in _GUIDE_CLASSES:
                raise ValueError(f"form: expected one of {sorted(_GUIDE_CLASSES)}, got {form!r}")
            guide = _GUIDE_CLASSES[form](model, self, name_prefix=name_prefix)
        else:
            if form is not None:
                raise ValueError("form= chooses the parametrisation of a trainable guide; "
                                 "trainable=False gives the fixed GaussianPosteriorGuide")
            guide = GaussianPosteriorGuide(model, self, name_prefix=name_prefix)
        if eager:
            # build the prototype with the fitting data, so observed sites stay observed in Predictive
            guide._setup_prototype(*args, **kwargs)
        return guide

    def compact(self, keep_model=True):
        """A copy without the fitting data, for pickling and :func:`pyro_convexvb.save` (size ``O(model)``).

        The model's fitting arguments (``model_args``, e.g. the training data) are dropped, so
        :meth:`as_guide` then needs ``model_args=`` to build a guide with observed sites; with
        ``keep_model=False`` the model is dropped too (pass ``model=`` to :meth:`as_guide`).  A matrix-free
        ``precision_operator`` posterior (whose operator holds the data) becomes the equivalent dense
        ``precision`` posterior for ``n <= MAX_COMPACT_DENSE`` (``precision_operator.to_dense() /
        precision_scale``, ``n`` products); above that the operator is dropped: the mean and the
        engine's marginal variances stay, and sampling, ``covariance()``, ``marginals()`` and guides raise
        ``ValueError`` saying so.  An engine's ``precision_cholesky``/``lanczos`` factors are not kept here
        (:func:`pyro_convexvb.save` and the estimators keep them, :func:`pyro_convexvb.logistic.compact_result`, so
        their ``marginals()`` still work).

        :param bool keep_model: keep the Pyro model callable (a module-level function or object).
        :returns: a new :class:`GaussianPosterior`; ``self`` is unchanged.

        Example::

            >>> import torch
            >>> q = GaussianPosterior(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
            >>> q.model_args = ((torch.ones(1000, 2),), {})
            >>> q.compact().model_args
            ((), {})
        """
        if self.kind == "precision_operator" and self.precision_operator is not None and self.n <= MAX_COMPACT_DENSE:
            A = self.precision_operator.to_dense()
            A = 0.5 * (A + A.transpose(0, 1)) / self.precision_scale
            out = GaussianPosterior(self.loc, self.variance, precision=A, layout=self.layout,
                                    model=self.model if keep_model else None, cg_options=self.cg_options)
            return out._without_data()
        out = self.with_model(self.model if keep_model else None)._without_data()
        if self.kind == "precision_operator":
            out.precision_operator = out.precision_factor = out.precision_cholesky = out.lanczos = None
            out.__dict__.pop("_dense_chol", None)  # log_prob's dense factor of the dropped operator (n^2 numbers)
        return out

    def _require_operator(self, what):
        if self.precision_operator is None:
            raise ValueError(
                f"{what}: this matrix-free posterior (n = {self.n}) was saved without its precision operator, which "
                "holds the training data (GaussianPosterior.compact, pickled estimators, pcv.save); its mean `loc` and "
                "marginal variances `variance` are kept. Refit, or use the fitted result before saving")
        return self.precision_operator

    def __repr__(self):
        return f"GaussianPosterior(n={self.n}, kind={self.kind}, dtype={self.dtype})"


class _PosteriorDistribution(TorchDistribution):
    """Wraps a matrix-free :class:`GaussianPosterior` as a distribution (sampling only)."""

    arg_constraints = {}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, posterior):
        self.posterior = posterior
        super().__init__(batch_shape=torch.Size(), event_shape=torch.Size([posterior.n]), validate_args=False)

    def rsample(self, sample_shape=torch.Size()):
        return self.posterior.sample(tuple(sample_shape))

    def log_prob(self, value):
        return self.posterior.log_prob(value)

    @property
    def mean(self):
        return self.posterior.loc

    @property
    def variance(self):
        return self.posterior.variance


class _KeepsItsModel:
    """Pickling a guide (or ``copy.deepcopy``) leaves the guide itself whole.  Pyro's ``AutoGuide.__getstate__``
    drops the model (it may not pickle) by setting it to ``None`` on the guide being pickled, so the original lost
    its model too and its next build or ``fit`` failed with a bare ``TypeError``.  The copy has no model, as
    Pyro's own guides; using one where a model is needed says so."""

    def __getstate__(self):
        model, master = self._model, self.master
        try:
            return super().__getstate__()
        finally:
            self._model, self.master = model, master

    @property
    def model(self):
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}: this guide was pickled or deep-copied, and Pyro's guides do "
                               "not carry their model through a pickle: once built it still samples (Predictive) and "
                               "gives median()/quantiles(), but building or fitting needs the model; make the guide "
                               "again from the model (e.g. res.posterior.as_guide(model))")
        return self._model[0]


class GaussianPosteriorGuide(_KeepsItsModel, AutoContinuous):
    """Pyro autoguide whose *fixed* joint latent distribution is a :class:`GaussianPosterior` (no parameters).

    For posteriors too large to train (e.g. matrix-free ones, sampled exactly by perturb-and-solve); SVI
    cannot move it.  :meth:`GaussianPosterior.as_guide` gives the trainable guides.

    :param callable model: the Pyro model.
    :param GaussianPosterior posterior: the fitted posterior over the flat latent vector ``(n,)``, in the
        model's latent-site order (as produced by every engine of this package).
    :param str name_prefix: name of the guide's auxiliary latent site ``"_<name_prefix>_latent"``
        (default: the class name).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model():
        ...     pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.).to_event(1))
        >>> q = GaussianPosterior(torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
        >>> guide = GaussianPosteriorGuide(model, q)
        >>> guide()["w"].shape, len(list(guide.parameters()))
        (torch.Size([2]), 0)
    """

    def __init__(self, model, posterior, *, name_prefix=None):
        if posterior.kind == "low_rank":
            raise ValueError(_lanczos_message(posterior))
        super().__init__(model)
        self.posterior = posterior
        _apply_name_prefix(self, name_prefix)

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        _check_latent_dim(self, self.posterior)

    def get_posterior(self, *args, **kwargs):
        return self.posterior.to_distribution()

    def _unpack_latent(self, latent):
        _check_unpacked(self, latent)
        dtype, device = _prototype_dtype(self, latent)  # draws follow the model's dtype, as the trainable guides do
        return super()._unpack_latent(latent.to(dtype=dtype, device=device))

    def _loc_scale(self, *args, **kwargs):
        if self.prototype_trace is None:  # median()/quantiles() before the first call
            self._setup_prototype(*args, **kwargs)
        return self.posterior.loc, self.posterior.scale


# ---------------------------------------------------------------------------------------------
# trainable guides initialised at a posterior
# ---------------------------------------------------------------------------------------------
def _lanczos_message(q):
    r = q.low_rank[0].shape[-1]
    return (f"this posterior's covariance is a rank-{r} Lanczos approximation Q T^-1 Q^T (kind 'low_rank') of an "
            f"n = {q.n} dimensional latent vector: it is singular, not a proper distribution over all latent "
            "dimensions, so it cannot define or initialise a guide (it serves downstream scores and variances); "
            "use the engine's sampling representation (e.g. its precision operator or a dense covariance) instead")


def _apply_name_prefix(guide, name_prefix):
    if name_prefix is None:
        return
    if not isinstance(name_prefix, str) or not name_prefix:
        raise ValueError(f"name_prefix must be a non-empty string, got {name_prefix!r}")
    guide._pyro_name = name_prefix


def _check_latent_dim(guide, posterior):
    """Refuse a model whose packed latent vector is not the posterior's: another length or, when the posterior knows
    its :attr:`~pyro_convexvb.posterior.base.Posterior.layout`, other sites or another order (which would hand one
    site's values to another)."""
    model_sites = [(name, math.prod(shape)) for name, shape in guide._unconstrained_shapes.items()]
    fitted = [] if posterior.layout is None else [(b.name, b.size) for b in posterior.layout.blocks]
    known = {n for n, _ in fitted}  # once: a set per site made this O(sites^2) (31 s for a 20,000-step AR(1) loop)
    extra = [name for name, _ in model_sites if fitted and name not in known]
    if extra:
        raise ValueError(
            f"latent site(s) {extra} of the model are not in the posterior (its sites: {[n for n, _ in fitted]}): an "
            "observed site called without its data is latent; build the guide with the fitting data "
            "(as_guide(model_args=..., model_kwargs=...)), or pass the model it was fitted to")
    for k, (ours, theirs) in enumerate(zip(model_sites, fitted)):
        if ours != theirs:
            raise ValueError(
                f"latent site {k} of the model is {ours[0]!r} ({ours[1]} unconstrained coordinates) but the posterior's "
                f"is {theirs[0]!r} ({theirs[1]}): the posterior's latent vector follows the sites of the model it was "
                f"fitted to, in trace order ({[n for n, _ in fitted]}); pass that model")
    if guide.latent_dim != posterior.n:
        raise ValueError(f"the model has {guide.latent_dim} latent dimensions but the posterior has {posterior.n}")


def _prototype_dtype(guide, default):
    """``(dtype, device)`` of the model's latent values (the guide's parameters follow the model)."""
    for _, site in guide.prototype_trace.iter_stochastic_nodes():
        v = site["value"]
        if torch.is_tensor(v) and v.is_floating_point():
            return v.dtype, v.device
    return default.dtype, default.device


def _is_fitted_model(model, fitted):
    """Whether ``model`` is the ``fitted`` model: the same object, or the same method of the same object (each
    attribute access ``obj.model`` makes a new bound-method object, so identity alone missed it)."""
    if model is fitted:
        return True
    return inspect.ismethod(model) and inspect.ismethod(fitted) and model.__self__ is fitted.__self__ \
        and model.__func__ is fitted.__func__


def _guide_model_and_data(posterior, model, model_args, model_kwargs):
    """``(model, args, kwargs, build_now)`` for ``as_guide``: the fitting model and data by default, and the fitting
    data when ``model`` is the fitted model itself (so that ``Predictive`` on new inputs keeps the observed sites
    observed instead of building the guide from a call without them)."""
    if model is None or _is_fitted_model(model, posterior.model):
        model, (args, kwargs) = posterior.model, posterior.model_args
        if model is None:
            raise ValueError("as_guide() needs the Pyro model (pass model=...)")
    else:
        args, kwargs = (), {}
    build_now = bool(args or kwargs) or model_args is not None or model_kwargs is not None
    if model_args is not None:
        args = tuple(model_args)
        if model_kwargs is None and kwargs:  # the fitting keyword arguments stay: they must not clash
            try:
                inspect.signature(model).bind(*args, **kwargs)
            except (TypeError, ValueError) as err:
                raise ValueError(f"model_args: the model cannot take them with the fitting keyword arguments "
                                 f"{sorted(kwargs)}, which as_guide keeps unless model_kwargs is given ({err}); "
                                 "pass model_kwargs too (e.g. model_kwargs={}, or the new data by name)") from None
    if model_kwargs is not None:
        kwargs = dict(model_kwargs)
    return model, args, kwargs, build_now


def _full_param_name(module, name):
    prefix = module._pyro_name
    return f"{prefix}.{name}" if prefix else name


def _store_backed(value):
    """``value`` as a :class:`~pyro.nn.PyroParam`: a plain :class:`torch.nn.Parameter` becomes one with constraint
    ``real`` (the same tensor, the same param-store name), a PyroParam is returned as it is.

    A :class:`~pyro.nn.PyroModule` reads a PyroParam attribute from the param store, but a plain ``nn.Parameter``
    attribute from the module itself, while the ``pyro.param`` site it records (the tensor SVI's optimiser collects)
    holds the store's entry. Once the two differ (``get_param_store().set_state()``/``load()`` of a saved store, or a
    second guide writing entries of the same names) the guide drew from its own ``loc`` with the store's ``scale``
    and ``scale_tril``, and SVI left ``loc`` where it was (its recorded param gets no gradient): Pyro's
    ``AutoMultivariateNormal`` and ``AutoDiagonalNormal`` do so with their ``loc`` (Pyro 1.9).
    """
    if isinstance(value, PyroParam):
        return value
    if isinstance(value, nn.Parameter):
        return PyroParam(value.detach(), constraints.real)
    raise TypeError(f"expected a torch.nn.Parameter or a pyro.nn.PyroParam, got {type(value).__name__}")


def _write_guide_params(guide, params):
    """Set a Pyro module's parameters and make the param store hold exactly these values.

    :class:`~pyro.nn.PyroModule` takes the param store's value whenever an entry of the parameter's full
    name exists there, so a stale entry (an earlier fit, a loaded store) would silently replace a value
    written to the module.  This removes the store entries of these names, sets the attributes, and
    registers the module's own tensors under those names; other store entries are untouched.  Every
    parameter is set as a :class:`~pyro.nn.PyroParam` (a plain ``nn.Parameter`` with constraint ``real``,
    :func:`_store_backed`), so the guide reads all of them through the store, as its recorded ``pyro.param``
    sites (and SVI's optimiser) see them.

    :param guide: a :class:`~pyro.nn.PyroModule` (e.g. an autoguide).
    :param dict params: ``{attribute name: torch.nn.Parameter or pyro.nn.PyroParam}``.
    """
    params = {name: _store_backed(value) for name, value in params.items()}
    use_store = not pyro.settings.get("module_local_params")
    if use_store:
        store = pyro.get_param_store()
        for name in params:
            full = _full_param_name(guide, name)
            if full in store:
                del store[full]
    for name, value in params.items():
        setattr(guide, name, value)
    if use_store:
        with guide._pyro_context:
            for name in params:
                getattr(guide, name)  # registers the module's tensor under its full name


class _InitialisedAtPosterior:
    """Mixin for autoguides whose parameters start at a fitted :class:`GaussianPosterior`.

    Subclasses define ``_form``, ``_values_from(q)`` (constrained initial values in the posterior's dtype,
    computed at construction so that an unusable posterior fails there) and ``_make_params(values)``.
    """

    _form = None

    def __init__(self, model, posterior, *, name_prefix=None):
        if not isinstance(posterior, GaussianPosterior):
            raise TypeError(f"expected a GaussianPosterior, got {type(posterior).__name__}")
        super().__init__(model, init_loc_fn=init_to_feasible, **self._autoguide_options(posterior))
        _check_trainable(posterior, self._form)
        self.init_posterior = posterior
        self._init_values = self._values_from(posterior)
        _apply_name_prefix(self, name_prefix)

    @staticmethod
    def _autoguide_options(posterior):
        """Keyword arguments of the Pyro autoguide's constructor (e.g. the rank) that follow the posterior."""
        return {}

    def _setup_prototype(self, *args, **kwargs):
        AutoContinuous._setup_prototype(self, *args, **kwargs)  # the parameters come from the posterior
        q = self.init_posterior
        _check_latent_dim(self, q)
        values = self._init_values if self._init_values is not None else self._values_from(q)
        self._init_values = None
        dtype, device = _prototype_dtype(self, q.loc)
        values = {k: v.detach().to(dtype=dtype, device=device).clone() for k, v in values.items()}
        _write_guide_params(self, self._make_params(values))

    def _unpack_latent(self, latent):
        _check_unpacked(self, latent)
        return super()._unpack_latent(latent)

    def _loc_scale(self, *args, **kwargs):
        if self.prototype_trace is None:  # median()/quantiles() before the first call
            self._setup_prototype(*args, **kwargs)
        with self._pyro_context:  # read through the param store, as a guide call does (e.g. after set_state())
            return super()._loc_scale(*args, **kwargs)

    def _current(self, *names):
        if self.prototype_trace is None:
            raise RuntimeError("the guide has no parameters yet: call it once, or build it with the model's data "
                               "(as_guide(model_args=...))")
        with torch.no_grad(), self._pyro_context:  # read through the param store, as a guide call does
            return [getattr(self, n).detach().clone() for n in names]

    def _posterior_like(self, loc, **rep):
        q = self.init_posterior
        return GaussianPosterior(loc, layout=q.layout, model=q.model, model_args=q.model_args, **rep)


def _check_unpacked(guide, latent):
    """Refuse a latent vector of another size than the guide's model (Pyro's own check is a bare assert): the
    guide's default-named param-store entries were written by another model's guide."""
    if latent.shape[-1] != guide.latent_dim:
        raise ValueError(f"guide '{guide._pyro_name}': its parameters in Pyro's param store hold {latent.shape[-1]} "
                         f"latent coordinates, the model has {guide.latent_dim}: another guide of the same name "
                         "(another model's) wrote them; give each guide a name of its own (as_guide(name_prefix=...))")


def _default_guide_form(q):
    return {"diagonal": "diagonal", "low_rank_diagonal": "low_rank"}.get(q.kind, "full")


def _check_trainable(q, form):
    if q.kind == "low_rank":
        raise ValueError(_lanczos_message(q))
    if form == "full" and q.kind == "precision_operator" and q.n > MAX_TRAINABLE_DENSE:
        raise ValueError(
            f"a trainable full-covariance guide needs the dense n x n Cholesky factor of this matrix-free posterior, "
            f"but n = {q.n} > MAX_TRAINABLE_DENSE = {MAX_TRAINABLE_DENSE}; use as_guide(trainable=False) for the "
            "fixed guide that samples this posterior exactly by perturb-and-solve (not trainable), or "
            "as_guide(form='diagonal') for a trainable mean-field guide at its marginal variances (drops all "
            "correlations)")
    if form == "low_rank" and q.kind != "low_rank_diagonal":
        raise ValueError(f"form='low_rank' needs a posterior of kind 'low_rank_diagonal' (cov_factor=, cov_diag=), "
                         f"this one is of kind '{q.kind}'; use form='full' or form='diagonal'")
    if form == "diagonal":
        bad = (q.variance <= 0).nonzero().reshape(-1)
        if bad.numel():
            raise ValueError(f"a diagonal guide needs positive marginal variances; {bad.numel()} are zero "
                             f"(first at index {int(bad[0])})")


class PosteriorMultivariateNormal(_KeepsItsModel, _InitialisedAtPosterior, AutoMultivariateNormal):
    """A trainable :class:`~pyro.infer.autoguide.AutoMultivariateNormal` initialised at a :class:`GaussianPosterior`.

    Pyro's parametrisation: ``loc`` ``(n,)``, ``scale`` ``(n,)`` (softplus-positive) and ``scale_tril``
    ``(n, n)`` (unit lower triangular), with covariance ``L L^T``, ``L = scale[:, None] * scale_tril``.
    The initial ``L`` is the lower Cholesky factor of the posterior's covariance (for ``precision_operator``
    posteriors, of the densified operator; ``n <= MAX_TRAINABLE_DENSE``), so ``scale = diag(L)`` and
    ``scale_tril = L / diag(L)[:, None]``.

    :param callable model: the Pyro model.
    :param GaussianPosterior posterior: the posterior over the model's flat latent vector ``(n,)``.
    :param str name_prefix: parameter names ``"<name_prefix>.loc"`` etc. (default: the class name).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model():
        ...     pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.).to_event(1))
        >>> C = torch.tensor([[.5, .1], [.1, .3]], dtype=torch.float64)
        >>> guide = PosteriorMultivariateNormal(model, GaussianPosterior(torch.zeros(2, dtype=torch.float64),
        ...                                                                covariance=C))
        >>> guide._setup_prototype()
        >>> torch.allclose(guide.to_posterior().covariance(), C)
        True
    """

    _form = "full"

    @staticmethod
    def _values_from(q):
        if q.kind == "diagonal":
            L = torch.diag(q.variance.sqrt())
        elif q.kind == "scale_tril":
            L = q._scale_tril
        else:
            if q.is_singular():
                raise ValueError("the posterior's covariance is singular to working precision (an intrinsic field's "
                                 "posterior lives on its constraint subspace; a laplace fit at a funnel's neck has "
                                 "unbounded variances), so a trainable guide, which holds a Cholesky factor, cannot "
                                 "represent it; use as_guide(trainable=False), which draws on that subspace")
            if q.kind == "covariance":  # factored by is_singular() (its root, kept): not again
                L = q._root()[0]
            else:
                try:
                    L = torch.linalg.cholesky(q.covariance(force=True))
                except torch.linalg.LinAlgError as e:
                    raise ValueError(f"the posterior's covariance is not positive definite ({e})") from None
        d = torch.diagonal(L)
        if not bool((d != 0).all()) or not bool(torch.isfinite(L).all()):
            raise ValueError("the posterior's scale_tril is singular or not finite")
        L = L * torch.sign(d)  # flip columns to a positive diagonal: same L L^T
        d = d.abs()
        return {"loc": q.loc, "scale": d, "scale_tril": L / d[:, None]}

    def _make_params(self, v):
        return {"loc": nn.Parameter(v["loc"]), "scale": PyroParam(v["scale"], self.scale_constraint),
                "scale_tril": PyroParam(v["scale_tril"], self.scale_tril_constraint)}

    def to_posterior(self):
        """The guide's current ``q`` as a :class:`GaussianPosterior` of kind ``scale_tril``."""
        loc, scale, unit = self._current("loc", "scale", "scale_tril")
        return self._posterior_like(loc, scale_tril=scale[:, None] * unit)


class PosteriorDiagonalNormal(_KeepsItsModel, _InitialisedAtPosterior, AutoDiagonalNormal):
    """A trainable :class:`~pyro.infer.autoguide.AutoDiagonalNormal` initialised at a :class:`GaussianPosterior`.

    Parameters ``loc`` ``(n,)`` and ``scale`` ``(n,)`` (softplus-positive), initialised at the posterior's
    mean and marginal standard deviations.  For a correlated posterior this is a mean-field guide: the
    correlations are dropped.

    :param callable model: the Pyro model.
    :param GaussianPosterior posterior: the posterior over the model's flat latent vector ``(n,)``.
    :param str name_prefix: parameter names ``"<name_prefix>.loc"`` etc. (default: the class name).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model():
        ...     pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.).to_event(1))
        >>> q = GaussianPosterior(torch.zeros(2, dtype=torch.float64), torch.tensor([.5, .3], dtype=torch.float64))
        >>> guide = PosteriorDiagonalNormal(model, q)
        >>> guide.median()["w"].tolist()
        [0.0, 0.0]
    """

    _form = "diagonal"

    @staticmethod
    def _values_from(q):
        return {"loc": q.loc, "scale": q.variance.sqrt()}

    def _make_params(self, v):
        return {"loc": nn.Parameter(v["loc"]), "scale": PyroParam(v["scale"], self.scale_constraint)}

    def to_posterior(self):
        """The guide's current ``q`` as a diagonal :class:`GaussianPosterior`."""
        loc, scale = self._current("loc", "scale")
        return self._posterior_like(loc, variance=scale**2)


class PosteriorLowRankMultivariateNormal(_KeepsItsModel, _InitialisedAtPosterior,
                                         AutoLowRankMultivariateNormal):
    """A trainable :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal` at a ``low_rank_diagonal`` posterior.

    Pyro's parametrisation: ``loc`` ``(n,)``, ``scale`` ``(n,)`` (softplus-positive) and ``cov_factor``
    ``(n, r)``, with covariance ``diag(s) (F F^T + I) diag(s)``, ``s = scale``, ``F = cov_factor``.  A posterior
    ``W W^T + diag(d)`` is written as ``scale = sqrt(d)``, ``cov_factor = W / sqrt(d)[:, None]``.

    :param callable model: the Pyro model.
    :param GaussianPosterior posterior: a posterior of kind ``low_rank_diagonal`` over the model's flat
        latent vector ``(n,)``.
    :param str name_prefix: parameter names ``"<name_prefix>.loc"`` etc. (default: the class name).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model():
        ...     pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.).to_event(1))
        >>> q = GaussianPosterior(torch.zeros(3, dtype=torch.float64), cov_factor=torch.ones(3, 1, dtype=torch.float64),
        ...                       cov_diag=torch.full((3,), .5, dtype=torch.float64))
        >>> guide = PosteriorLowRankMultivariateNormal(model, q)
        >>> guide()["w"].shape, guide.rank
        (torch.Size([3]), 1)
    """

    _form = "low_rank"

    @staticmethod
    def _autoguide_options(posterior):
        return {"rank": posterior.cov_factor.shape[1] if getattr(posterior, "cov_factor", None) is not None else None}

    @staticmethod
    def _values_from(q):
        s = q.cov_diag.sqrt()
        return {"loc": q.loc, "scale": s, "cov_factor": q.cov_factor / s[:, None]}

    def _make_params(self, v):
        return {"loc": nn.Parameter(v["loc"]), "scale": PyroParam(v["scale"], self.scale_constraint),
                "cov_factor": nn.Parameter(v["cov_factor"])}

    def to_posterior(self):
        """The guide's current ``q`` as a :class:`GaussianPosterior` of kind ``low_rank_diagonal``."""
        loc, scale, F = self._current("loc", "scale", "cov_factor")
        return self._posterior_like(loc, cov_factor=F * scale[:, None], cov_diag=scale**2)


_GUIDE_CLASSES = {"full": PosteriorMultivariateNormal, "diagonal": PosteriorDiagonalNormal,
                  "low_rank": PosteriorLowRankMultivariateNormal}
