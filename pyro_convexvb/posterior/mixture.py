"""Mixtures of diagonal Gaussians over the flat latent vector: the fitted posterior, its Pyro guides, and the
closed-form entropy lower bounds.

Steinberg et al. 2017 (revrand technical report), §1.3: the posterior over all continuous latent variables
(in unconstrained space, like :class:`~pyro.infer.autoguide.AutoNormal`) is approximated by

    q(u) = (1/K) sum_k N(u | m_k, diag psi_k)                                   (Eq. 21)

whose entropy has the closed-form lower bound of Eq. 24 (:func:`entropy_lower_bound`). The loss that trains
:class:`AutoDiagMixture` and the ``diag_mixture`` engine are in :mod:`pyro_convexvb.infer.diag_mixture`.
"""
import math
import warnings

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.initialization import init_to_median
from pyro.nn import PyroParam
from pyro.nn.module import pyro_method
from torch.distributions import biject_to

from ..errors import ConvergenceWarning, UnsupportedModelError
from ..linalg.operators import as_operator
from ..linalg.scalar import newton_bisect_root
from .base import Posterior
from .gaussian import (GaussianPosterior, _KeepsItsModel, _apply_name_prefix, _check_latent_dim, _guide_model_and_data,
                       _prototype_dtype, _write_guide_params)

__all__ = [
    "entropy_lower_bound",
    "bhattacharyya_entropy_lower_bound",
    "mixture_quantiles",
    "DiagNormalMixture",
    "AutoDiagMixture",
    "DiagMixtureGuide",
    "DiagMixturePosterior",
    "mixture_evidence_bound",
]

_LOG_2PI = math.log(2 * math.pi)


# ---------------------------------------------------------------------------------------------
# entropy bounds
# ---------------------------------------------------------------------------------------------
def entropy_lower_bound(locs, variances):
    """Closed-form lower bound on the entropy of ``q = (1/K) sum_k N(m_k, diag psi_k)``.

    Steinberg et al. 2017, Eq. (24) (Gershman et al. 2012; Nguyen & Bonilla 2014), by Jensen's inequality::

        H[q] >= -(1/K) sum_k log sum_j (1/K) N(m_k | m_j, Psi_k + Psi_j)

    evaluated with a log-sum-exp over the ``K x K`` pairwise terms.  For ``K = 1`` the bound is
    ``H[q] - (D/2)(1 - log 2)``: a constant below the entropy (so it has the same maximiser).

    :param torch.Tensor locs: ``(K, D)`` component means ``m_k``.
    :param torch.Tensor variances: ``(K, D)`` component variances ``psi_k`` (positive).
    :returns: scalar tensor (differentiable).

    Example::

        >>> import torch
        >>> m = torch.zeros(1, 3, dtype=torch.float64); psi = torch.ones(1, 3, dtype=torch.float64)
        >>> float(entropy_lower_bound(m, psi))  # (3/2) log(4 pi)
        3.7965...
    """
    locs, variances = _check_mixture(locs, variances)
    K = locs.shape[0]
    s = variances.unsqueeze(1) + variances.unsqueeze(0)  # (K, K, D): psi_k + psi_j
    d2 = (locs.unsqueeze(1) - locs.unsqueeze(0)) ** 2
    log_n = -0.5 * (torch.log(s) + _LOG_2PI + d2 / s).sum(-1)  # log N(m_k | m_j, psi_k + psi_j)
    return -(torch.logsumexp(log_n, dim=1) - math.log(K)).mean()


def bhattacharyya_entropy_lower_bound(locs, variances):
    """Pairwise-distance lower bound on the mixture entropy that is exact for ``K = 1``.

    Kolchinsky & Tracey (2017, "Estimating mixture entropy with pairwise distances", Eq. 10 with
    the Bhattacharyya distance ``D_B``)::

        H[q] >= (1/K) sum_k H[q_k] - (1/K) sum_k log sum_j (1/K) exp(-D_B(q_k, q_j)),

    with ``D_B = (1/8) d^T S^{-1} d + (1/2) log(|S| / sqrt(|Psi_k| |Psi_j|))``, ``S = (Psi_k + Psi_j)/2``.
    It equals ``H[q]`` for a single component and is usually, but not always, above
    :func:`entropy_lower_bound` (neither bound dominates the other).

    :param torch.Tensor locs: ``(K, D)``.
    :param torch.Tensor variances: ``(K, D)``.
    :returns: scalar tensor.
    """
    locs, variances = _check_mixture(locs, variances)
    K, D = locs.shape
    logv = torch.log(variances)
    h = 0.5 * D * (1 + _LOG_2PI) + 0.5 * logv.sum(-1)  # H[q_k]
    S = 0.5 * (variances.unsqueeze(1) + variances.unsqueeze(0))
    d2 = (locs.unsqueeze(1) - locs.unsqueeze(0)) ** 2
    db = (d2 / S).sum(-1) / 8 + 0.5 * (torch.log(S).sum(-1) - 0.5 * (logv.sum(-1).unsqueeze(1) + logv.sum(-1).unsqueeze(0)))
    return h.mean() - (torch.logsumexp(-db, dim=1) - math.log(K)).mean()


_ENTROPY_BOUNDS = {"eq24": entropy_lower_bound, "bhattacharyya": bhattacharyya_entropy_lower_bound}


def _entropy_fn(kind):
    try:
        return _ENTROPY_BOUNDS[kind]
    except KeyError:
        raise ValueError(f"entropy must be one of {sorted(_ENTROPY_BOUNDS)}, got {kind!r}") from None


def _check_mixture(locs, variances):
    if locs.dim() != 2 or variances.shape != locs.shape:
        raise ValueError(f"locs and variances must both have shape (K, D); got {tuple(locs.shape)} and "
                         f"{tuple(variances.shape)}")
    return locs, variances


# ---------------------------------------------------------------------------------------------
# the mixture distribution over the flat latent vector, and its marginal quantiles
# ---------------------------------------------------------------------------------------------
def mixture_quantiles(locs, scales, probs, xtol=1e-10):
    """Quantiles of every coordinate's marginal ``(1/K) sum_k N(m_kd, s_kd^2)``, by root finding.

    Solves ``F_d(x) - p = 0`` with the safeguarded Newton/bisection of
    :func:`pyro_convexvb.linalg.scalar.newton_bisect_root` (the marginal density is ``F'``).

    :param torch.Tensor locs: ``(K, D)``.
    :param torch.Tensor scales: ``(K, D)`` standard deviations.
    :param probs: ``(P,)`` levels in ``(0, 1)`` (list or tensor).
    :returns: ``(P, D)`` quantiles.
    """
    p = torch.as_tensor(probs, dtype=locs.dtype, device=locs.device).reshape(-1, 1)
    if ((p <= 0) | (p >= 1)).any():
        raise ValueError(f"quantile levels must lie in (0, 1), got {p.reshape(-1).tolist()}")
    K = locs.shape[0]
    if K == 1:
        return dist.Normal(locs[0], scales[0]).icdf(p)
    # bracket: every component's quantile lies inside [min_k q_k(p), max_k q_k(p)]
    comp_q = dist.Normal(locs.unsqueeze(0), scales.unsqueeze(0)).icdf(p.unsqueeze(-1))  # (P, K, D)
    lo, hi = comp_q.min(1).values, comp_q.max(1).values
    lo, hi = lo - 1e-12 * (1 + lo.abs()), hi + 1e-12 * (1 + hi.abs())
    normal = dist.Normal(locs, scales)

    def fun(x):
        z = x.unsqueeze(-2)  # (P, 1, D)
        F = torch.special.ndtr((z - locs) / scales).mean(-2) - p
        f = torch.exp(normal.log_prob(z)).mean(-2)
        return F, f

    x, ok = newton_bisect_root(fun, lo, hi, xtol=xtol, xatol=xtol, max_iter=200, check_bracket=False)
    if not bool(ok.all()):
        warnings.warn(f"mixture_quantiles: {int((~ok).sum())} quantiles did not converge", ConvergenceWarning)
    return x


class DiagNormalMixture(TorchDistribution):
    """``(1/K) sum_k N(m_k, diag s_k^2)`` over vectors of length ``D`` (event shape ``(D,)``).

    ``rsample`` is pathwise: a component index is drawn uniformly (the weights are fixed), then
    ``m_k + s_k * eps`` -- an unbiased reparameterisation for the means and scales.

    :param torch.Tensor locs: ``(K, D)``.
    :param torch.Tensor scales: ``(K, D)``.
    """

    arg_constraints = {"locs": constraints.real, "scales": constraints.positive}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, locs, scales, validate_args=None):
        _check_mixture(locs, scales)
        self.locs, self.scales = locs, scales
        super().__init__(batch_shape=torch.Size(), event_shape=torch.Size([locs.shape[-1]]),
                         validate_args=validate_args)

    @property
    def num_components(self):
        return self.locs.shape[0]

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        return _ExpandedMixture(self, batch_shape)

    def rsample(self, sample_shape=torch.Size()):
        shape = torch.Size(sample_shape)
        K, D = self.locs.shape
        k = torch.randint(K, shape, device=self.locs.device)
        eps = torch.randn(shape + (D,), dtype=self.locs.dtype, device=self.locs.device)
        return self.locs[k] + self.scales[k] * eps

    def log_prob(self, value):
        lp = dist.Normal(self.locs, self.scales).log_prob(value.unsqueeze(-2)).sum(-1)  # (..., K)
        return torch.logsumexp(lp, -1) - math.log(self.num_components)

    @property
    def mean(self):
        return self.locs.mean(0)

    @property
    def variance(self):
        m = self.mean
        return (self.scales**2 + self.locs**2).mean(0) - m**2

    def entropy_lower_bound(self, kind="eq24"):
        return _entropy_fn(kind)(self.locs, self.scales**2)


class _ExpandedMixture(TorchDistribution):
    """A :class:`DiagNormalMixture` broadcast over batch dimensions (independent draws per batch element)."""

    arg_constraints = {}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, base, batch_shape):
        self.base = base
        super().__init__(batch_shape=batch_shape, event_shape=base.event_shape, validate_args=False)

    def rsample(self, sample_shape=torch.Size()):
        return self.base.rsample(torch.Size(sample_shape) + self.batch_shape)

    def log_prob(self, value):
        return self.base.log_prob(value)

    @property
    def mean(self):
        return self.base.mean.expand(self.batch_shape + self.event_shape)

    @property
    def variance(self):
        return self.base.variance.expand(self.batch_shape + self.event_shape)


# ---------------------------------------------------------------------------------------------
# guides
# ---------------------------------------------------------------------------------------------
class _MixtureGuideMixin:
    """``median``/``quantiles`` of the mixture marginals and latent-to-site helpers shared by both guides."""

    def _mixture_params(self):  # -> (locs (K, D), scales (K, D))
        raise NotImplementedError

    def get_posterior(self, *args, **kwargs):
        """The mixture over the flat unconstrained latent vector (:class:`DiagNormalMixture`)."""
        locs, scales = self._mixture_params()
        return DiagNormalMixture(locs, scales)

    def _loc_scale(self, *args, **kwargs):
        q = self.get_posterior()
        return q.mean, q.variance.sqrt()

    def _to_sites(self, latent):
        return {site["name"]: biject_to(site["fn"].support)(v) for site, v in self._unpack_latent(latent)}

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs):
        """Marginal quantiles of every latent site under the mixture (root finding on the mixture CDF).

        :param quantiles: list or tensor of levels in (0, 1).
        :returns: ``{site: tensor (len(quantiles), *site_shape)}`` in constrained space.
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        locs, scales = self._mixture_params()
        qs = mixture_quantiles(locs.detach(), scales.detach(), quantiles)
        result = {}
        for latent in qs:
            for name, value in self._to_sites(latent).items():
                result.setdefault(name, []).append(value)
        return {k: torch.stack(v) for k, v in result.items()}

    @torch.no_grad()
    def median(self, *args, **kwargs):
        """Marginal medians of the mixture, per latent site (constrained space)."""
        return {k: v[0] for k, v in self.quantiles([0.5], *args, **kwargs).items()}


class AutoDiagMixture(_KeepsItsModel, _MixtureGuideMixin, AutoContinuous):
    """Autoguide ``q(u) = (1/K) sum_k N(u | m_k, diag psi_k)`` over all continuous latent sites.

    Steinberg et al. 2017, Eq. (21).  Like :class:`~pyro.infer.autoguide.AutoNormal` it works in unconstrained
    space (constrained sites get the usual bijections and log-Jacobians).  Train it with
    :class:`~pyro_convexvb.infer.diag_mixture.DiagMixtureELBO` (closed-form entropy bound, stratified over components) or with Pyro's
    ``Trace_ELBO`` (then ``log q`` is the exact mixture density at the sample).

    Parameters (Pyro params): ``locs`` ``(K, D)`` and ``scales`` ``(K, D)`` (softplus-positive);
    ``psi_k = scales_k ** 2``.

    With ``posterior=`` (a fitted :class:`DiagMixturePosterior`, as from ``DiagMixturePosterior.as_guide()``)
    the parameters start at its component means and variances: when the guide is built, entries of the
    guide's parameter names already in Pyro's param store are replaced by the posterior's values (cast to
    the model's dtype), so a stale entry of an earlier fit cannot override them; other entries are left alone.

    :param callable model: a Pyro model.
    :param int num_components: ``K`` (default 1, or the posterior's ``K``).
    :param float init_scale: initial ``sqrt(psi)`` (ignored with ``posterior``).
    :param float init_spread: standard deviation of the random offsets of components ``k >= 1``
        from the initial location (breaks the symmetry between components; component 0 starts
        at the initial location; ignored with ``posterior``).
    :param callable init_loc_fn: per-site initialisation (Pyro's ``init_to_median`` by default).
    :param DiagMixturePosterior posterior: initial mixture over the model's flat latent vector ``(D,)``.
    :param str name_prefix: parameter names ``"<name_prefix>.locs"``, ``"<name_prefix>.scales"``
        (default: the class name, as Pyro's autoguides).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> from pyro.infer import SVI
        >>> from pyro_convexvb.infer.diag_mixture import DiagMixtureELBO
        >>> def model():
        ...     pyro.sample("x", dist.Normal(torch.zeros(2), 1.).to_event(1))
        >>> guide = AutoDiagMixture(model, num_components=3)
        >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), loss=DiagMixtureELBO())
        >>> _ = svi.step()
        >>> guide.get_posterior().locs.shape
        torch.Size([3, 2])
    """

    scale_constraint = constraints.softplus_positive

    def __init__(self, model, num_components=None, init_scale=0.1, init_spread=None, init_loc_fn=init_to_median, *,
                 posterior=None, name_prefix=None):
        if posterior is not None:
            if not isinstance(posterior, DiagMixturePosterior):
                raise TypeError(f"posterior: expected a DiagMixturePosterior, got {type(posterior).__name__}")
            if num_components is not None and num_components != posterior.num_components:
                raise ValueError(f"num_components = {num_components!r} but the posterior has "
                                 f"{posterior.num_components} components")
            num_components = posterior.num_components
        num_components = 1 if num_components is None else num_components
        if not isinstance(num_components, int) or num_components < 1:
            raise ValueError(f"num_components must be a positive integer, got {num_components!r}")
        if not (isinstance(init_scale, (int, float)) and init_scale > 0):
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        self.num_components = num_components
        self._init_scale = float(init_scale)
        self._init_spread = float(init_scale if init_spread is None else init_spread)
        super().__init__(model, init_loc_fn=init_loc_fn)
        self.init_posterior = posterior
        if name_prefix is not None:
            _apply_name_prefix(self, name_prefix)

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            for frame in site["cond_indep_stack"]:
                if getattr(frame, "full_size", None) not in (None, frame.size):
                    raise UnsupportedModelError(
                        name, "local latent variables inside a subsampled plate are not supported by AutoDiagMixture")
        q = self.init_posterior
        if q is not None:
            _check_latent_dim(self, q)
            dtype, device = _prototype_dtype(self, q.locs)
            locs = q.locs.detach().to(dtype=dtype, device=device).clone()
            scales = q.variances.detach().to(dtype=dtype, device=device).sqrt()
            _write_guide_params(self, {"locs": torch.nn.Parameter(locs),
                                       "scales": PyroParam(scales, self.scale_constraint)})
            return
        loc0 = self._init_loc()
        K = self.num_components
        offsets = self._init_spread * torch.randn((K, loc0.shape[0]), dtype=loc0.dtype, device=loc0.device)
        offsets[0] = 0
        # a PyroParam (read through the param store, as the recorded param site) rather than a plain nn.Parameter
        # (read from the module): see pyro_convexvb.posterior.gaussian._store_backed
        self.locs = PyroParam(loc0.unsqueeze(0) + offsets, constraints.real)
        self.scales = PyroParam(torch.full_like(self.locs, self._init_scale), self.scale_constraint)

    def _mixture_params(self):
        with self._pyro_context:  # read through the param store, as a guide call does (e.g. after set_state())
            return self.locs, self.scales

    def to_posterior(self):
        """The guide's current mixture as a :class:`DiagMixturePosterior` (``locs``, ``variances`` ``(K, D)``)."""
        if self.prototype_trace is None:
            raise RuntimeError("the guide has no parameters yet: call it once, or build it with the model's data")
        with torch.no_grad(), self._pyro_context:  # read through the param store, as a guide call does
            locs, scales = self.locs.detach().clone(), self.scales.detach().clone()
        q = self.init_posterior
        if q is None:
            return DiagMixturePosterior(locs, scales**2)
        return DiagMixturePosterior(locs, scales**2, layout=q.layout, model=q.model, model_args=q.model_args)

    @pyro_method
    def _stratified_latent(self, num_particles):
        """``K * L`` reparameterised draws, ``L`` per component (Steinberg et al. 2017, Eq. 26), and the parameters.

        Runs inside the module's Pyro context so SVI registers the parameters.

        :returns: ``(z (K*L, D), locs (K, D), variances (K, D))``; rows ``k*L .. k*L+L-1`` come from component ``k``.
        """
        locs, scales = self.locs, self.scales
        K, D = locs.shape
        eps = torch.randn((K, num_particles, D), dtype=locs.dtype, device=locs.device)
        z = locs.unsqueeze(1) + scales.unsqueeze(1) * eps
        return z.reshape(K * num_particles, D), locs, scales**2


class DiagMixtureGuide(_KeepsItsModel, _MixtureGuideMixin, AutoContinuous):
    """A fixed Pyro guide sampling from a fitted :class:`DiagMixturePosterior` (``Predictive``, ``median``, ``quantiles``).

    It has no parameters, so SVI cannot train it; :meth:`DiagMixturePosterior.as_guide` gives the trainable
    :class:`AutoDiagMixture` by default.

    :param callable model: the Pyro model.
    :param DiagMixturePosterior posterior: the mixture over the model's flat latent vector ``(D,)``.
    :param str name_prefix: name of the auxiliary latent site ``"_<name_prefix>_latent"`` (default: the class name).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> def model():
        ...     pyro.sample("x", dist.Normal(torch.zeros(1), 1.).to_event(1))
        >>> guide = DiagMixtureGuide(model, DiagMixturePosterior(torch.tensor([[-1.], [1.]]), torch.ones(2, 1)))
        >>> guide()["x"].shape, len(list(guide.parameters()))
        (torch.Size([1]), 0)
    """

    def __init__(self, model, posterior, *, name_prefix=None):
        super().__init__(model)
        self.posterior = posterior
        if name_prefix is not None:
            _apply_name_prefix(self, name_prefix)

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        _check_latent_dim(self, self.posterior)

    def _mixture_params(self):
        locs, scales = self.posterior.locs, self.posterior.variances.sqrt()
        if self.prototype_trace is None:
            return locs, scales
        dtype, device = _prototype_dtype(self, locs)  # draws follow the model's dtype, as the trainable guides do
        return locs.to(dtype=dtype, device=device), scales.to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# the fitted posterior
# ---------------------------------------------------------------------------------------------
class DiagMixturePosterior(Posterior):
    """A fitted mixture ``(1/K) sum_k N(m_k, diag psi_k)`` over the flat latent vector ``u``.

    :param torch.Tensor locs: ``(K, n)`` component means.
    :param torch.Tensor variances: ``(K, n)`` component variances.
    :param layout: optional :class:`~pyro_convexvb.lgm.LatentLayout`.
    :param model: the Pyro model it was fitted to, and ``model_args = (args, kwargs)`` its fitting arguments
        (for :meth:`as_guide`).

    Example::

        >>> import torch
        >>> q = DiagMixturePosterior(torch.tensor([[-1.], [1.]]), torch.ones(2, 1))
        >>> q.loc, q.variance
        (tensor([0.]), tensor([2.]))
        >>> q.sample(4).shape
        torch.Size([4, 1])
    """

    def __init__(self, locs, variances, *, layout=None, model=None, model_args=((), {})):
        _check_mixture(locs, variances)
        if (variances <= 0).any() or not torch.isfinite(variances).all() or not torch.isfinite(locs).all():
            raise ValueError("component variances must be positive and finite, and means finite")
        self.locs, self.variances = locs, variances
        self.layout, self.model, self.model_args = layout, model, model_args

    @property
    def n(self):
        return int(self.locs.shape[1])

    @property
    def num_components(self):
        return int(self.locs.shape[0])

    @property
    def loc(self):
        """Mixture mean ``(n,)``."""
        return self.locs.mean(0)

    @property
    def variance(self):
        """Mixture marginal variances ``(n,)``: ``mean_k(psi_k + m_k^2) - mean^2``."""
        m = self.loc
        return ((self.variances + self.locs**2).mean(0) - m**2).clamp_min(0)

    @property
    def components(self):
        """The components as diagonal :class:`~pyro_convexvb.GaussianPosterior` objects."""
        return [GaussianPosterior(m, v, layout=self.layout) for m, v in zip(self.locs, self.variances)]

    def to_distribution(self):
        return DiagNormalMixture(self.locs, self.variances.sqrt())

    def sample(self, num_samples=(), generator=None):
        """Samples ``(*num_samples, n)``: uniform component, then ``m_k + sqrt(psi_k) * eps``."""
        shape = (num_samples,) if isinstance(num_samples, int) else tuple(num_samples)
        m = int(math.prod(shape)) if shape else 1
        k = torch.randint(self.num_components, (m,), generator=generator, device=self.device)
        eps = torch.randn((m, self.n), dtype=self.dtype, device=self.device, generator=generator)
        x = self.locs[k] + self.variances[k].sqrt() * eps
        return x.reshape(shape + (self.n,))

    def log_prob(self, u):
        """Exact mixture log density of ``u`` ``(..., n)``."""
        return self.to_distribution().log_prob(u)

    def entropy_lower_bound(self, kind="eq24"):
        """Closed-form entropy lower bound (``"eq24"``: Steinberg et al. 2017 Eq. 24; or ``"bhattacharyya"``)."""
        return _entropy_fn(kind)(self.locs, self.variances)

    def quantiles(self, probs):
        """Marginal quantiles ``(len(probs), n)`` of the mixture, by root finding."""
        return mixture_quantiles(self.locs, self.variances.sqrt(), probs)

    def component_marginals(self, design, offset=None):
        """Means and variances ``(K, q)`` of ``eta = design @ u + offset`` under every component."""
        B = as_operator(design)
        mean = B.mv(self.locs.transpose(0, 1)).transpose(0, 1)
        sq = B.squared()
        if sq is not None:
            var = sq.mv(self.variances.transpose(0, 1)).transpose(0, 1)
        else:
            var = ((B.to_dense() ** 2) @ self.variances.transpose(0, 1)).transpose(0, 1)
        if offset is not None:
            mean = mean + offset
        return mean, var

    def marginals(self, design, offset=None):
        """Mixture mean and variance ``(q,)`` of ``eta = design @ u + offset``."""
        m, v = self.component_marginals(design, offset)
        mean = m.mean(0)
        return mean, ((v + m**2).mean(0) - mean**2).clamp_min(0)

    def as_guide(self, model=None, *, trainable=True, name_prefix=None, model_args=None, model_kwargs=None):
        """A Pyro guide over the model's latent sites, initialised at this mixture.

        With ``trainable=True`` (default) an :class:`AutoDiagMixture` whose ``locs`` ``(K, n)`` and
        ``scales = sqrt(variances)`` ``(K, n)`` are registered in Pyro's param store with this mixture's
        values, so SVI (with :class:`~pyro_convexvb.infer.diag_mixture.DiagMixtureELBO` or Pyro's ``Trace_ELBO``) continues from it.  When the
        guide is built (here if the model's data are known, else at its first call), store entries of the
        guide's parameter names (``"<prefix>.locs"``, ``"<prefix>.scales"``, prefix ``name_prefix`` or
        ``"AutoDiagMixture"``) are replaced by these values; other entries are left alone.

        :param model: the Pyro model (default: the model the posterior was fitted to, with its fitting
            arguments, so observed sites stay observed in ``Predictive``).
        :param bool trainable: ``False`` gives the fixed, parameter-free :class:`DiagMixtureGuide`.
        :param str name_prefix: prefix of the parameter names in the param store.
        :param tuple model_args: positional arguments used to build the guide now (default: the fitting
            arguments when ``model`` is ``None`` or the fitted model; else the guide is built at its first call).
        :param dict model_kwargs: keyword arguments for the same.

        Example::

            >>> import pyro, pyro.distributions as dist, torch
            >>> def model():
            ...     pyro.sample("x", dist.Normal(torch.zeros(1, dtype=torch.float64), 1.).to_event(1))
            >>> q = DiagMixturePosterior(torch.tensor([[-1.], [1.]], dtype=torch.float64),
            ...                          torch.ones(2, 1, dtype=torch.float64))
            >>> guide = q.as_guide(model, model_args=())
            >>> pyro.param("AutoDiagMixture.locs").tolist()
            [[-1.0], [1.0]]
        """
        model, args, kwargs, build_now = _guide_model_and_data(self, model, model_args, model_kwargs)
        if trainable:
            guide = AutoDiagMixture(model, posterior=self, name_prefix=name_prefix)
        else:
            guide = DiagMixtureGuide(model, self, name_prefix=name_prefix)
        if build_now:
            guide._setup_prototype(*args, **kwargs)
        return guide

    def __repr__(self):
        return f"DiagMixturePosterior(K={self.num_components}, n={self.n}, dtype={self.dtype})"


# ---------------------------------------------------------------------------------------------
# exact bound for latent Gaussian models
# ---------------------------------------------------------------------------------------------
def _mixture_entropy_bound(locs, variances, entropy):
    """The entropy lower bound of kind ``entropy`` (``"eq24"``, ``"bhattacharyya"`` or ``"best"``)."""
    if entropy != "best":
        return _entropy_fn(entropy)(locs, variances)
    return torch.stack([_entropy_fn(k)(locs, variances) for k in sorted(_ENTROPY_BOUNDS)]).max()


def mixture_evidence_bound(lgm, posterior, entropy="eq24"):
    """Deterministic lower bound on ``log p(y)`` for a mixture posterior on a latent Gaussian model.

    ``(1/K) sum_k E_{q_k}[log p(y, x)] + Hbound(q)`` over the Pyro model's latent sites ``x``, with exact
    (quadrature) expectations (:meth:`~pyro_convexvb.LatentGaussianModel.model_expected_log_joint`): the quantity
    :class:`~pyro_convexvb.infer.diag_mixture.DiagMixtureELBO` estimates stochastically. ``entropy`` is ``"eq24"``, ``"bhattacharyya"``
    or ``"best"`` (the larger of the two entropy bounds, still a lower bound).
    """
    locs, variances = posterior.locs.to(lgm.dtype), posterior.variances.to(lgm.dtype)
    e = torch.stack([lgm.model_expected_log_joint(m, variance=v) for m, v in zip(locs, variances)]).mean()
    return float((e + _mixture_entropy_bound(locs, variances, entropy)).detach())  # the model may hold trained modules

