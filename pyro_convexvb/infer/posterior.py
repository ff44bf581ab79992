"""One Gaussian posterior type for every engine, and its Pyro guide."""
import math

import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.infer.autoguide import AutoContinuous
from torch.distributions import constraints

from ..linalg.operators import as_operator

__all__ = ["GaussianPosterior", "GaussianPosteriorGuide", "MAX_DENSE"]

#: Largest latent dimension for which ``covariance()`` materialises a dense matrix without ``force=True``.
MAX_DENSE = 10_000


class GaussianPosterior:
    """A Gaussian ``q(u) = N(loc, C)`` over the flat latent vector ``u`` (see :class:`~pyro_convexvb.lgm.LatentLayout`).

    Exactly one covariance representation is given:

    * ``covariance``: dense ``(n, n)``;
    * ``scale_tril``: lower Cholesky factor ``(n, n)`` of ``C``;
    * ``precision``: dense ``(n, n)`` precision ``C^{-1}``;
    * ``precision_operator`` (+ ``precision_factor``): a matrix-free SPD precision ``A = J^T J``
      (scaled by ``precision_scale``, i.e. ``C = precision_scale * A^{-1}``); samples are drawn exactly
      by perturb-and-solve ``A^{-1} J^T eps`` with conjugate gradients, and ``variance`` must be
      provided (engines estimate it, e.g. by Lanczos);
    * ``low_rank``: a pair ``(Q, T)`` with ``C ~= Q T^{-1} Q^T`` (Lanczos), for downstream scores;
    * ``variance`` alone: a diagonal covariance.

    :param torch.Tensor loc: ``(n,)`` posterior mean.
    :param torch.Tensor variance: ``(n,)`` marginal variances (computed from the representation when omitted).
    :param layout: optional :class:`~pyro_convexvb.lgm.LatentLayout` mapping ``u`` to Pyro sites.

    Example::

        >>> import torch
        >>> q = GaussianPosterior(torch.zeros(2, dtype=torch.float64),
        ...                       covariance=torch.tensor([[2., .5], [.5, 1.]], dtype=torch.float64))
        >>> q.variance
        tensor([2., 1.], dtype=torch.float64)
        >>> q.sample(5).shape
        torch.Size([5, 2])
    """

    def __init__(self, loc, variance=None, *, covariance=None, scale_tril=None, precision=None,
                 precision_operator=None, precision_factor=None, precision_scale=1.0, low_rank=None,
                 layout=None, model=None, cg_options=None):
        self.loc = loc
        self.layout = layout
        self.model = model
        self.model_args = ((), {})
        reps = {k: v for k, v in dict(covariance=covariance, scale_tril=scale_tril, precision=precision,
                                      precision_operator=precision_operator, low_rank=low_rank).items()
                if v is not None}
        if len(reps) > 1:
            raise ValueError(f"give one covariance representation, got {sorted(reps)}")
        self.kind = next(iter(reps)) if reps else "diagonal"
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
        if variance is None:
            if self.kind == "diagonal":
                raise ValueError("a GaussianPosterior needs a covariance representation or marginal variances")
            if self.kind == "precision_operator":
                raise ValueError("precision_operator posteriors need their marginal variances (estimate them, e.g. by Lanczos)")
            variance = self._dense_variance()
        self.variance = variance
        if (self.variance < 0).any() or not torch.isfinite(self.variance).all():
            raise ValueError("marginal variances must be finite and nonnegative")

    # ------------------------------------------------------------------ representations
    @property
    def n(self):
        return int(self.loc.shape[-1])

    @property
    def dtype(self):
        return self.loc.dtype

    @property
    def device(self):
        return self.loc.device

    @property
    def scale(self):
        """Marginal standard deviations ``(n,)``."""
        return self.variance.sqrt()

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
        raise ValueError(f"cannot compute variances for kind {self.kind}")

    def covariance(self, force=False):
        """Dense ``(n, n)`` covariance; refuses ``n > MAX_DENSE`` unless ``force=True``."""
        if self.n > MAX_DENSE and not force:
            raise MemoryError(f"covariance(): n = {self.n} > {MAX_DENSE}; pass force=True to materialise it")
        if self.kind == "covariance":
            return self._covariance
        if self.kind == "scale_tril":
            return self._scale_tril @ self._scale_tril.transpose(-1, -2)
        if self.kind == "precision":
            return torch.cholesky_inverse(torch.linalg.cholesky(self._precision))
        if self.kind == "precision_operator":
            A = self.precision_operator.to_dense()
            return self.precision_scale * torch.cholesky_inverse(torch.linalg.cholesky(A))
        if self.kind == "low_rank":
            Q, T = self.low_rank
            return Q @ torch.linalg.solve(T, Q.transpose(0, 1))
        return torch.diag(self.variance)

    def scale_tril(self):
        """Dense lower Cholesky factor of the covariance (small problems)."""
        if self.kind == "scale_tril":
            return self._scale_tril
        if self.kind == "diagonal":
            return torch.diag(self.variance.sqrt())
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
        elif self.kind == "low_rank":
            raise NotImplementedError(
                "a low-rank (Lanczos) covariance is an approximation for scores and variances; "
                "sample from the engine's precision representation instead")
        else:
            x = eps @ self.scale_tril().transpose(-1, -2)
        return (self.loc + x).reshape(shape + (self.n,))

    def _sample_matrix_free(self, m, generator):
        from ..linalg.cg import cg

        if self.precision_factor is None:
            raise NotImplementedError("matrix-free sampling needs precision_factor J with precision = J^T J")
        J = self.precision_factor
        eps = torch.randn((J.shape[0], m), dtype=self.dtype, device=self.device, generator=generator)
        res = cg(self.precision_operator, J.rmv(eps), **self.cg_options)
        return (math.sqrt(self.precision_scale) * res.x).transpose(0, 1)

    def log_prob(self, u):
        """Log density of ``u`` ``(..., n)`` (dense representations only)."""
        if self.kind in ("precision_operator", "low_rank"):
            raise NotImplementedError(f"log_prob is not available for a {self.kind} posterior")
        if self.kind == "diagonal":
            return dist.Normal(self.loc, self.variance.sqrt()).to_event(1).log_prob(u)
        if self.kind == "precision":
            return dist.MultivariateNormal(self.loc, precision_matrix=self._precision).log_prob(u)
        return dist.MultivariateNormal(self.loc, scale_tril=self.scale_tril()).log_prob(u)

    def entropy(self):
        """Differential entropy (dense representations)."""
        if self.kind == "diagonal":
            return 0.5 * self.n * (1 + math.log(2 * math.pi)) + 0.5 * torch.log(self.variance).sum()
        L = self.scale_tril()
        return 0.5 * self.n * (1 + math.log(2 * math.pi)) + torch.log(torch.diagonal(L)).sum()

    def marginals(self, design, offset=None):
        """Means and variances of ``eta = design @ u + offset`` under q.

        Dense representations give exact variances; ``low_rank`` gives the Lanczos estimate
        ``diag(B Q T^{-1} Q^T B^T)``; ``diagonal`` assumes independence.

        :param design: ``(q, n)`` tensor or operator.
        :returns: ``(mean (q,), var (q,))``.
        """
        B = as_operator(design)
        mean = B.mv(self.loc)
        if offset is not None:
            mean = mean + offset
        if self.kind == "diagonal":
            sq = B.squared()
            var = sq.mv(self.variance) if sq is not None else (B.to_dense() ** 2) @ self.variance
        elif self.kind == "low_rank":
            Q, T = self.low_rank
            L = torch.linalg.cholesky(T)
            W = torch.linalg.solve_triangular(L, B.mv(Q).transpose(0, 1), upper=False)
            var = (W**2).sum(0)
        elif self.kind == "precision_operator":
            var = self._precision_operator_quad(B)
        else:
            L = self.scale_tril()
            var = (B.mv(L) ** 2).sum(-1)
        return mean, var

    def _precision_operator_quad(self, B):
        """``precision_scale * diag(B A^{-1} B^T)``: dense Cholesky for ``n <= 4000``, else batched CG."""
        if self.n <= 4000:
            L = torch.linalg.cholesky(self.precision_operator.to_dense())
            W = torch.linalg.solve_triangular(L, B.to_dense().transpose(0, 1), upper=False)
            return self.precision_scale * (W**2).sum(0)
        from ..linalg.cg import cg

        Bt = B.T.mv(torch.eye(B.shape[0], dtype=self.dtype, device=self.device)) if B.shape[0] <= 2048 else None
        if Bt is None:
            raise NotImplementedError(
                "marginals of more than 2048 new rows under a matrix-free precision: use the engine's Lanczos factors")
        res = cg(self.precision_operator, Bt, **self.cg_options)
        return self.precision_scale * (Bt * res.x).sum(0)

    def unflatten(self, u=None):
        """``{site: value}`` for ``u`` (default: the mean), using the layout."""
        if self.layout is None:
            raise ValueError("this posterior has no latent layout (it was not built from a Pyro model)")
        return self.layout.unflatten(self.loc if u is None else u)

    def to_distribution(self):
        """A Pyro distribution with ``event_shape (n,)`` (MultivariateNormal for dense kinds)."""
        if self.kind == "diagonal":
            return dist.Normal(self.loc, self.variance.sqrt()).to_event(1)
        if self.kind in ("covariance", "scale_tril", "precision"):
            return dist.MultivariateNormal(self.loc, scale_tril=self.scale_tril())
        return _PosteriorDistribution(self)

    def as_guide(self, model=None):
        """A Pyro guide (an :class:`~pyro.infer.autoguide.AutoContinuous`) that samples from this posterior.

        Works with :class:`pyro.infer.Predictive`, ``median()`` and ``quantiles()``.

        :param model: the Pyro model (default: the model the posterior was fitted to).
        """
        if model is None:
            model, (args, kwargs) = self.model, self.model_args
        else:
            args, kwargs = (), {}
        if model is None:
            raise ValueError("as_guide() needs the Pyro model (pass model=...)")
        guide = GaussianPosteriorGuide(model, self)
        if args or kwargs:
            # build the prototype with the fitting data, so observed sites stay observed in Predictive
            guide._setup_prototype(*args, **kwargs)
        return guide

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


class GaussianPosteriorGuide(AutoContinuous):
    """Pyro autoguide whose (fixed) joint latent distribution is a :class:`GaussianPosterior`.

    :param callable model: the Pyro model.
    :param GaussianPosterior posterior: the fitted posterior over the flat latent vector, in the model's
        latent-site order (as produced by every engine of this package).
    """

    def __init__(self, model, posterior):
        super().__init__(model)
        self.posterior = posterior

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        if self.latent_dim != self.posterior.n:
            raise ValueError(
                f"the model has {self.latent_dim} latent dimensions but the posterior has {self.posterior.n}")

    def get_posterior(self, *args, **kwargs):
        return self.posterior.to_distribution()

    def _loc_scale(self, *args, **kwargs):
        return self.posterior.loc, self.posterior.scale
