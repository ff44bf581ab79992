"""Mixtures of diagonal Gaussians as Pyro guides, with the closed-form entropy lower bound.

Steinberg et al. 2017 (revrand technical report), §1.3: the posterior over all continuous latent variables
(in unconstrained space, like :class:`~pyro.infer.autoguide.AutoNormal`) is approximated by

    q(u) = (1/K) sum_k N(u | m_k, diag psi_k)                                   (Eq. 21)

and the evidence lower bound (Eq. 23) is estimated with the reparameterisation trick for the
expected log joint (Eqs. 25-26, ``L`` samples per component) and the *closed-form* lower bound on
the entropy of the mixture (Eq. 24), never with a sampled ``log q``.  Under
``pyro.plate(..., subsample_size=M)`` Pyro scales the likelihood by ``N / M`` (Eq. 6), so the
mini-batch objective is unbiased for the full-batch one.

Public API:

* :class:`AutoDiagMixture` -- the autoguide (sampling, ``median``, ``quantiles``, ``get_posterior``,
  :class:`~pyro.infer.Predictive`);
* :class:`DiagMixtureELBO` -- the loss, usable as ``SVI(model, guide, optim, loss=DiagMixtureELBO())``;
* :class:`DiagMixturePosterior` -- the fitted mixture over the flat latent vector;
* :func:`entropy_lower_bound` (Eq. 24) and :func:`bhattacharyya_entropy_lower_bound`;
* the registry engine ``diag_mixture``.
"""
import math
import typing
import warnings
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import pyro.optim
import pyro.poutine as poutine
import torch
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.infer import ELBO
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.initialization import init_to_median
from pyro.nn import PyroParam
from pyro.nn.module import pyro_method
from pyro.distributions import constraints
from torch.distributions import biject_to

from ..errors import ConvergenceWarning, UnsupportedModelError
from .baselines import (
    SVIEngine,
    SVIOptions,
    flat_log_joint,
    model_param_values,
    svi_until_plateau,
    try_lgm,
)
from .engine import Optimality, Solution, option
from .optimality import mixture_decrement, monte_carlo_objective
from .posterior import GaussianPosterior
from .sharded_svi import data_reduction, sharded_lgm_or_none

__all__ = [
    "entropy_lower_bound",
    "bhattacharyya_entropy_lower_bound",
    "mixture_quantiles",
    "DiagNormalMixture",
    "AutoDiagMixture",
    "DiagMixtureGuide",
    "DiagMixtureELBO",
    "DiagMixturePosterior",
    "DiagMixtureOptions",
    "DiagMixtureEngine",
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
    from ..linalg.scalar import newton_bisect_root

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


class AutoDiagMixture(_MixtureGuideMixin, AutoContinuous):
    """Autoguide ``q(u) = (1/K) sum_k N(u | m_k, diag psi_k)`` over all continuous latent sites.

    Steinberg et al. 2017, Eq. (21).  Like :class:`~pyro.infer.autoguide.AutoNormal` it works in unconstrained
    space (constrained sites get the usual bijections and log-Jacobians).  Train it with
    :class:`DiagMixtureELBO` (closed-form entropy bound, stratified over components) or with Pyro's
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
            from .posterior import _apply_name_prefix

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
            from .posterior import _check_latent_dim, _prototype_dtype, _write_guide_params

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
        self.locs = torch.nn.Parameter(loc0.unsqueeze(0) + offsets)
        self.scales = PyroParam(torch.full_like(self.locs, self._init_scale), self.scale_constraint)

    def _mixture_params(self):
        return self.locs, self.scales

    def to_posterior(self):
        """The guide's current mixture as a :class:`DiagMixturePosterior` (``locs``, ``variances`` ``(K, D)``)."""
        if self.prototype_trace is None:
            raise RuntimeError("the guide has no parameters yet: call it once, or build it with the model's data")
        with torch.no_grad(), self._pyro_context:  # read through the param store, as a guide call does
            locs, scales = self.locs.detach().clone(), self.scales.detach().clone()
        q = self.init_posterior
        out = DiagMixturePosterior(locs, scales**2, layout=None if q is None else q.layout,
                                   model=None if q is None else q.model)
        if q is not None:
            out.model_args = q.model_args
        return out

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


class DiagMixtureGuide(_MixtureGuideMixin, AutoContinuous):
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
            from .posterior import _apply_name_prefix

            _apply_name_prefix(self, name_prefix)

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        if self.latent_dim != self.posterior.n:
            raise ValueError(
                f"the model has {self.latent_dim} latent dimensions but the posterior has {self.posterior.n}")

    def _mixture_params(self):
        return self.posterior.locs, self.posterior.variances.sqrt()


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
class DiagMixtureELBO(ELBO):
    """ELBO of Steinberg et al. 2017, Eq. (27), for :class:`AutoDiagMixture`, usable as ``SVI(..., loss=DiagMixtureELBO())``.

    ``L = (1/K) sum_k (1/L) sum_l [log p(y, T(z_kl)) + log|T'(z_kl)|] + Hbound(q)`` with
    ``z_kl = m_k + sqrt(psi_k) * eps_kl`` (Eqs. 25-26, stratified over the components) and ``Hbound``
    the closed-form entropy lower bound (Eq. 24; ``entropy="bhattacharyya"`` for the tighter pairwise
    bound that is exact at ``K = 1``).  Subsampled plates are scaled by ``N/M`` by Pyro (Eq. 6), so
    the mini-batch objective is unbiased for the full-data objective.  The expected log prior is
    sampled like the likelihood (Eq. 27 keeps it inside the sample average, too).

    :param int num_particles: ``L``, samples per component.
    :param str entropy: ``"eq24"`` (Steinberg et al. 2017, Eq. 24) or ``"bhattacharyya"``.
    :param bool vectorize_particles: evaluate the ``K * L`` particles in one vectorised model run
        inside an outermost plate (the model must broadcast over a leading batch dimension, e.g.
        use ``pcv.linear(X, w)`` instead of ``X @ w``); otherwise one model run per particle.
    :param max_plate_nesting: as in Pyro's ELBOs (guessed when needed).
    :param reduction: ``None``, or for row-sharded data (:func:`~.sharded_svi.data_reduction`) the
        reduction over ranks: every rank draws the same stratified particles (same seed), evaluates the
        model on its own rows, and counts its observed sites plus -- on rank 0 only -- the latent
        sites, log-Jacobians and the entropy bound; gradients and the loss are then summed over ranks
        (as in ``DistributedDataParallel``), which is the single-process objective and gradient up
        to the order of floating-point additions (:mod:`~pyro_convexvb.infer.sharded_svi`).
    """

    def __init__(self, num_particles=1, entropy="eq24", vectorize_particles=False, max_plate_nesting=float("inf"),
                 reduction=None):
        _entropy_fn(entropy)
        if not isinstance(num_particles, int) or num_particles < 1:
            raise ValueError(f"num_particles must be a positive integer, got {num_particles!r}")
        super().__init__(num_particles=num_particles, max_plate_nesting=max_plate_nesting,
                         vectorize_particles=vectorize_particles)
        self.entropy = entropy
        self.reduction = reduction

    def _joint_terms(self, tr, log_det):
        """``log p(y, z) + log|T'|`` of a model trace; on row-sharded data this rank's share (see ``reduction``)."""
        if self.reduction is None:
            return tr.log_prob_sum() + log_det
        from .sharded_svi import _rank, check_full_plates, local_log_prob

        check_full_plates(tr)
        first = _rank() == 0
        tr.compute_log_prob()
        return local_log_prob(tr, first, set(self._latent_names)) + (log_det if first else 0.0)

    def _get_trace(self, model, guide, args, kwargs):
        # Pyro's ELBO interface; this loss never needs guide traces with sampled log q
        raise NotImplementedError("DiagMixtureELBO evaluates the model at stratified particles directly")

    # -- pieces -------------------------------------------------------------------------------
    def _check_guide(self, guide, args, kwargs):
        if not isinstance(guide, AutoDiagMixture):
            raise TypeError(f"DiagMixtureELBO needs an AutoDiagMixture guide, got {type(guide).__name__}")
        if guide.prototype_trace is None:
            guide._setup_prototype(*args, **kwargs)

    def _log_joint_vectorized(self, model, guide, z, args, kwargs):
        P = z.shape[0]
        if self.max_plate_nesting == float("inf"):
            with poutine.block():
                g_tr = poutine.trace(guide).get_trace(*args, **kwargs)
                m_tr = poutine.trace(poutine.replay(model, trace=g_tr)).get_trace(*args, **kwargs)
            dims = [f.dim for site in m_tr.nodes.values() if site["type"] == "sample"
                    for f in site["cond_indep_stack"] if f.vectorized]
            self.max_plate_nesting = -min(dims) if dims else 0
        mpn = int(self.max_plate_nesting)
        values, log_det = self._constrain(guide, z.reshape((P,) + (1,) * mpn + z.shape[-1:]))
        self._latent_names = tuple(values)
        with pyro.plate("_diag_mixture_particles", P, dim=-(mpn + 1)):
            tr = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
        self._check_model_trace(tr, guide)
        for name, site in tr.nodes.items():
            if site["type"] == "sample" and type(site["fn"]).__name__ != "_Subsample" and \
                    len(site["fn"].batch_shape) > mpn + 1:
                raise ValueError(
                    f"DiagMixtureELBO(vectorize_particles=True): site '{name}' has batch shape "
                    f"{tuple(site['fn'].batch_shape)}, more than max_plate_nesting + 1 = {mpn + 1} dims, so the model "
                    "does not broadcast over the particle plate (e.g. a global vector latent of shape (P, 1, D) "
                    "multiplied into (P, 1, N)); use vectorize_particles=False")
        return self._joint_terms(tr, log_det) / P

    def _log_joint_sequential(self, model, guide, z, args, kwargs):
        total = 0.0
        for zp in z:
            values, log_det = self._constrain(guide, zp)
            self._latent_names = tuple(values)
            tr = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
            self._check_model_trace(tr, guide)
            total = total + self._joint_terms(tr, log_det)
        return total / z.shape[0]

    @staticmethod
    def _constrain(guide, latent):
        """Site values ``T(u)`` and the summed ``log|T'(u)|`` for a packed unconstrained latent."""
        values, log_det = {}, 0.0
        for site, uv in guide._unpack_latent(latent):
            t = biject_to(site["fn"].support)
            v = t(uv)
            ld = t.log_abs_det_jacobian(uv, v)
            log_det = log_det + ld.sum() if torch.is_tensor(ld) else log_det
            values[site["name"]] = v
        return values, log_det

    @staticmethod
    def _check_model_trace(tr, guide):
        names = set(guide._unconstrained_shapes)
        for name, site in tr.nodes.items():
            if site["type"] == "sample" and not site["is_observed"] and type(site["fn"]).__name__ != "_Subsample":
                if name not in names:
                    raise UnsupportedModelError(name, "latent site is not covered by the AutoDiagMixture guide")

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """``-ELBO`` as a differentiable scalar (one stratified draw of ``K * L`` particles)."""
        if self.reduction is not None:
            from .sharded_svi import _rank, local_args

            args, kwargs = local_args(args, kwargs)
        self._check_guide(guide, args, kwargs)
        z, locs, variances = guide._stratified_latent(self.num_particles)
        if self.vectorize_particles:
            e_log_joint = self._log_joint_vectorized(model, guide, z, args, kwargs)
        else:
            e_log_joint = self._log_joint_sequential(model, guide, z, args, kwargs)
        if self.reduction is not None and _rank() != 0:  # the entropy bound is counted once, on rank 0
            return -e_log_joint
        return -(e_log_joint + _entropy_fn(self.entropy)(locs, variances))

    def loss(self, model, guide, *args, **kwargs):
        with torch.no_grad():
            loss = self.differentiable_loss(model, guide, *args, **kwargs)
            return float(loss if self.reduction is None else self.reduction.sum(loss.detach()))

    def loss_and_grads(self, model, guide, *args, **kwargs):
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward()
        if self.reduction is None:
            return float(loss.detach())
        from .sharded_svi import all_reduce_param_grads

        all_reduce_param_grads(self.reduction)
        return float(self.reduction.sum(loss.detach()))


# ---------------------------------------------------------------------------------------------
# the fitted posterior
# ---------------------------------------------------------------------------------------------
class DiagMixturePosterior:
    """A fitted mixture ``(1/K) sum_k N(m_k, diag psi_k)`` over the flat latent vector ``u``.

    :param torch.Tensor locs: ``(K, n)`` component means.
    :param torch.Tensor variances: ``(K, n)`` component variances.
    :param layout: optional :class:`~pyro_convexvb.lgm.LatentLayout`.
    :param model: the Pyro model it was fitted to (for :meth:`as_guide`).

    Example::

        >>> import torch
        >>> q = DiagMixturePosterior(torch.tensor([[-1.], [1.]]), torch.ones(2, 1))
        >>> q.loc, q.variance
        (tensor([0.]), tensor([2.]))
        >>> q.sample(4).shape
        torch.Size([4, 1])
    """

    def __init__(self, locs, variances, *, layout=None, model=None):
        _check_mixture(locs, variances)
        if (variances <= 0).any() or not torch.isfinite(variances).all() or not torch.isfinite(locs).all():
            raise ValueError("component variances must be positive and finite, and means finite")
        self.locs, self.variances = locs, variances
        self.layout, self.model = layout, model
        self.model_args = ((), {})

    @property
    def n(self):
        return int(self.locs.shape[1])

    @property
    def num_components(self):
        return int(self.locs.shape[0])

    @property
    def dtype(self):
        return self.locs.dtype

    @property
    def device(self):
        return self.locs.device

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
    def scale(self):
        return self.variance.sqrt()

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
        from ..linalg.operators import as_operator

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

    def unflatten(self, u=None):
        if self.layout is None:
            raise ValueError("this posterior has no latent layout (it was not built from a Pyro model)")
        return self.layout.unflatten(self.loc if u is None else u)

    def as_guide(self, model=None, *, trainable=True, name_prefix=None, model_args=None, model_kwargs=None):
        """A Pyro guide over the model's latent sites, initialised at this mixture.

        With ``trainable=True`` (default) an :class:`AutoDiagMixture` whose ``locs`` ``(K, n)`` and
        ``scales = sqrt(variances)`` ``(K, n)`` are registered in Pyro's param store with this mixture's
        values, so SVI (with :class:`DiagMixtureELBO` or Pyro's ``Trace_ELBO``) continues from it.  When the
        guide is built (here if the model's data are known, else at its first call), store entries of the
        guide's parameter names (``"<prefix>.locs"``, ``"<prefix>.scales"``, prefix ``name_prefix`` or
        ``"AutoDiagMixture"``) are replaced by these values; other entries are left alone.

        :param model: the Pyro model (default: the model the posterior was fitted to, with its fitting
            arguments, so observed sites stay observed in ``Predictive``).
        :param bool trainable: ``False`` gives the fixed, parameter-free :class:`DiagMixtureGuide`.
        :param str name_prefix: prefix of the parameter names in the param store.
        :param tuple model_args: positional arguments used to build the guide now (default: the fitting
            arguments when ``model`` is ``None``; else the guide is built at its first call).
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
        from .posterior import _guide_model_and_data

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
# exact bound for latent Gaussian models, and the engine
# ---------------------------------------------------------------------------------------------
def _mixture_entropy_bound(locs, variances, entropy):
    """The entropy lower bound of kind ``entropy`` (``"eq24"``, ``"bhattacharyya"`` or ``"best"``)."""
    if entropy != "best":
        return _entropy_fn(entropy)(locs, variances)
    return torch.stack([_entropy_fn(k)(locs, variances) for k in sorted(_ENTROPY_BOUNDS)]).max()


def mixture_evidence_bound(lgm, posterior, entropy="eq24"):
    """Deterministic lower bound on ``log p(y)`` for a mixture posterior on a latent Gaussian model.

    ``(1/K) sum_k E_{q_k}[log p(y, u)] + Hbound(q)`` with exact (quadrature) expectations
    (:meth:`~pyro_convexvb.LatentGaussianModel.expected_log_joint`): the quantity
    :class:`DiagMixtureELBO` estimates stochastically. ``entropy`` is ``"eq24"``, ``"bhattacharyya"``
    or ``"best"`` (the larger of the two entropy bounds, still a lower bound).
    """
    locs, variances = posterior.locs.to(lgm.dtype), posterior.variances.to(lgm.dtype)
    e = torch.stack([lgm.expected_log_joint(m, variance=v) for m, v in zip(locs, variances)]).mean()
    return float(e + _mixture_entropy_bound(locs, variances, entropy))


@dataclass(frozen=True)
class DiagMixtureOptions(SVIOptions):
    num_components: int = option(1, "K, the number of diagonal Gaussian components", min=1)
    entropy: typing.Literal["eq24", "bhattacharyya"] = option(
        "eq24", "entropy lower bound in the training objective (Steinberg et al. 2017, Eq. 24, or Bhattacharyya)")
    init_spread: typing.Optional[float] = option(None, "spread of the initial component means", gt=0)
    callback: typing.Optional[typing.Callable] = option(None, "called as callback(step, loss, guide) after each step")
    optimizer: typing.Literal["auto", "svi", "natural_gradient"] = option(
        "auto", "'natural_gradient': natural-gradient (CVI) steps on the exact mixture bound (latent Gaussian "
                "models, full data); 'svi': stochastic ELBO with clipped Adam; 'auto': natural_gradient when it "
                "applies and no SVI-only option is set")

    def check(self):
        # min_steps is an SVI option (SVIOptions.check: an unset one is capped at max_steps)
        if self.optimizer != "natural_gradient":
            super().check()


#: options that only the stochastic optimiser uses ('auto' picks SVI when one differs from its default)
SVI_ONLY_OPTIONS = ("lr", "min_steps", "window", "rtol", "lr_decay", "num_particles", "vectorize_particles",
                    "clip_norm", "callback", "check_particles")


def _natural_gradient_refusal(call, lgm, n_guide, learn_params):
    """Why natural gradients on the exact bound do not apply to this model (``None`` when they do)."""
    if lgm is None:
        return "the model is not a latent Gaussian model that pyro_convexvb can extract"
    if lgm.n != n_guide or getattr(lgm, "chain", None) is not None:
        return "the guide's latent vector is not the latent Gaussian model's (constrained or extra latents, or a " \
               "reparametrised affine Gaussian chain or intrinsic GMRF)"
    if learn_params and model_param_values(call):
        return "the model has pyro.param sites to learn jointly (learn_params=True), which only SVI does"
    return None


class DiagMixtureEngine(SVIEngine):
    """SVI with :class:`AutoDiagMixture` and :class:`DiagMixtureELBO` (Steinberg et al. 2017, §1.3).

    Stopping rule of the SVI engines (windowed plateau or ``max_steps``); convergence is judged by the
    natural-gradient decrement of the mixture's evidence bound (exact site expectations for latent
    Gaussian models, the larger of the Eq. 24 and Bhattacharyya entropy bounds) in the block-diagonal
    Fisher metric of the components (:func:`~pyro_convexvb.infer.optimality.mixture_decrement`).

    On row-sharded data the ELBO's gradients and loss are all-reduced over ranks (see
    :class:`DiagMixtureELBO`'s ``reduction``), which gives the single-process fit.

    ``log_evidence_bound`` is :func:`mixture_evidence_bound` with ``entropy="best"`` for latent
    Gaussian models (``info["bound_eq24"]`` with Eq. 24 alone: it sits ``(D/2)(1 - log 2)`` below the
    entropy at ``K = 1``), else ``None``; ``info["elbo_estimate"]`` is the last window's stochastic
    ELBO (the training objective).
    """

    name = "diag_mixture"
    description = "SVI with AutoDiagMixture (mixture of K diagonal Gaussians, closed-form entropy bound, revrand)"
    Options = DiagMixtureOptions
    optimality_measure = ("natural-gradient decrement of the mixture's evidence bound (block-diagonal Fisher) <= "
                          "decrement_tol; stops at an ELBO plateau or max_steps")

    def _use_natural_gradient(self, call, lgm, guide, reduction=None):
        """Whether this run optimises the exact bound by natural gradients (``optimizer`` option); raises when
        asked for ``'natural_gradient'`` on a model it does not apply to."""
        o = self.options
        if o.optimizer == "svi":
            return False
        n_guide = guide.locs.shape[-1]
        why = _natural_gradient_refusal(call, lgm, n_guide, o.learn_params)
        if why is None and reduction is not None:
            why = "the data are row-sharded over processes, which only the SVI optimiser reduces"
        set_svi = [k for k in SVI_ONLY_OPTIONS if getattr(o, k) != type(o).__dataclass_fields__[k].default]
        if o.optimizer == "natural_gradient":
            if why is not None:
                raise UnsupportedModelError("optimizer", f"engine 'diag_mixture' with optimizer='natural_gradient': "
                                                         f"{why}; use optimizer='svi'")
            if set_svi:
                raise ValueError(f"engine 'diag_mixture': option(s) {', '.join(set_svi)} only apply to "
                                 "optimizer='svi'; with optimizer='natural_gradient' leave them at their defaults")
            return True
        return why is None and not set_svi

    def _fit_natural_gradient(self, guide, lgm, run):
        """Second-order ascent on the deterministic mixture bound (latent Gaussian models, full data).

        The objective is ``F = (1/K) sum_k E_{q_k} log p(y, u) + Hbound(q)`` with closed-form prior terms,
        Gauss-Hermite site expectations and the training entropy bound (option ``entropy``). Each step
        updates every component ``k``:

        * variances by the natural-gradient (conjugate-computation, Khan & Lin 2017) step in the metric
          of :func:`~pyro_convexvb.infer.optimality.mixture_decrement`:
          ``1/v_k <- 1/v_k - 2 K b dF/dv_k`` (``b = 1``: the stationarity condition of ``v_k``);
        * means by a Newton step with the expected curvature of the component's log joint,
          ``m_k <- m_k + K b A_k^{-1} dF/dm_k``, ``A_k = P + sum_i b_i b_i^T (-2 dE_i/drho_i)`` (prior
          precision ``P``, site rows ``b_i``, site variance ``rho_i``; by Price's theorem
          ``E[d^2 log t_i] = 2 dE_i/drho_i``), so correlated latents do not slow it down as a diagonal
          metric would.

        Steps that lower ``F`` (or leave a precision nonpositive) are halved. The run stops when the
        decrement is below ``decrement_tol`` and the last step changed ``F`` by less than it.

        :returns: ``(F, iterations, stop reason)``; the optimum is written into the guide's parameters.
        """
        o = self.options
        entropy_fn = _entropy_fn(o.entropy)
        with torch.no_grad():
            locs0, scales0 = guide._mixture_params()
        M = locs0.detach().to(lgm.dtype).clone()
        V = scales0.detach().to(lgm.dtype).clone() ** 2
        K, n = M.shape
        P = lgm.dense_prior_prec()
        groups = list(lgm.sites)

        def evaluate(M, V):
            """``F``, ``dF/dM``, ``dF/dV`` and, per component and site group, ``dE/drho`` of the sites."""
            Mg, Vg = M.clone().requires_grad_(True), V.clone().requires_grad_(True)
            with torch.enable_grad():
                total, rhos = 0.0, []
                for m, v in zip(Mg, Vg):
                    e = lgm.expected_log_prior(m, variance=v) + lgm.log_const
                    for g in groups:
                        rho = lgm.diag_marginal_var(g, v)
                        rhos.append(rho)
                        e = e + g.family.expected_log_prob(g.eta(m), rho).sum()
                    total = total + e
                val = total / K + entropy_fn(Mg, Vg)
                grads = torch.autograd.grad(val, [Mg, Vg] + rhos)
            # dE_k/drho = K dF/drho (F weighs component k by 1/K)
            d = [K * t for t in grads[2:]]
            return float(val.detach()), grads[0], grads[1], d

        def newton_directions(g, d):
            out = torch.empty_like(g)
            for k in range(K):
                A = P.clone()
                for j, grp in enumerate(groups):
                    A = A + grp.design.weighted_gram((-2 * d[k * len(groups) + j]).clamp_min(0))
                A.diagonal().add_(1e-12 * float(A.diagonal().abs().max()) + 1e-300)
                out[k] = K * torch.cholesky_solve(g[k].unsqueeze(-1), torch.linalg.cholesky(A)).squeeze(-1)
            return out

        val, g, gv, d = evaluate(M, V)
        b, reason, it, last_change = 1.0, "max_steps", 0, math.inf
        bar = run.bar(total=o.max_steps, unit="iter")
        for it in range(1, o.max_steps + 1):
            dec = K * float((0.5 * g * g * V).sum() + ((gv * V) ** 2).sum())
            run.history.record(objective=val, decrement=dec)
            bar.update(1)
            if not math.isfinite(dec):
                raise FloatingPointError(f"diag_mixture: the natural-gradient decrement became {dec}")
            if dec <= o.decrement_tol and last_change <= o.decrement_tol:
                reason = "decrement"
                break
            step_m = newton_directions(g, d)
            for _ in range(60):
                prec = 1.0 / V - 2 * K * b * gv
                if bool((prec > 0).all()):
                    V_new = 1.0 / prec
                    M_new = M + b * step_m
                    new = evaluate(M_new, V_new)
                    if new[0] >= val - 1e-12 * (1 + abs(val)):
                        break
                b *= 0.5
            else:
                reason = "no ascent step"
                break
            last_change = new[0] - val
            M, V = M_new, V_new
            val, g, gv, d = new
            b = min(1.0, 2 * b)
        from .posterior import _write_guide_params

        _write_guide_params(guide, {"locs": torch.nn.Parameter(M.to(locs0.dtype).clone()),
                                    "scales": PyroParam(V.sqrt().to(scales0.dtype).clone(), guide.scale_constraint)})
        return val, it, reason

    def solve(self, call, run):
        o = self.options
        model = call.model if o.learn_params else poutine.block(call.model, hide_types=["param"])
        guide = AutoDiagMixture(model, num_components=o.num_components, init_scale=o.init_scale,
                                init_spread=o.init_spread)
        self.own_guide(guide)
        red = data_reduction(call.args, call.kwargs)
        lgm = None if o.optimizer == "svi" else try_lgm(call.source, call.args, call.kwargs)
        with poutine.block(), torch.no_grad():
            guide(*call.args, **call.kwargs)  # builds the prototype and the initial parameters
        if self._use_natural_gradient(call, lgm, guide, red):
            value, steps, reason = self._fit_natural_gradient(guide, lgm, run)
            info_opt = {"optimizer": "natural_gradient", "elbo_estimate": value, "steps": steps}
        else:
            loss = DiagMixtureELBO(num_particles=o.num_particles, entropy=o.entropy,
                                   vectorize_particles=o.vectorize_particles, reduction=red)
            optim = pyro.optim.ClippedAdam({"lr": o.lr, "betas": (0.9, 0.999), "clip_norm": o.clip_norm})
            svi = pyro.infer.SVI(model, guide, optim, loss)
            cb = None if o.callback is None else (lambda step, value: o.callback(step, value, guide))
            losses, reason = svi_until_plateau(
                svi, optim, call.args, call.kwargs, max_steps=o.max_steps, min_steps=o.plateau_min_steps,
                window=o.window, rtol=o.rtol, lr_decay=o.lr_decay, bar=run.bar(total=o.max_steps, unit="step"),
                history=run.history, callback=cb, name=f"AutoDiagMixture(K={o.num_components})")
            info_opt = {"optimizer": "svi", "elbo_estimate": -sum(losses[-o.window:]) / min(o.window, len(losses)),
                        "steps": len(losses)}
        with torch.no_grad(), guide._pyro_context:
            locs, scales = guide._mixture_params()
            posterior = DiagMixturePosterior(locs.detach().clone(), scales.detach().clone() ** 2)
        if lgm is None:
            lgm = try_lgm(call.source, call.args, call.kwargs)
        lgm = sharded_lgm_or_none(lgm, red, call.args, call.kwargs)
        exact = lgm is not None and lgm.n == posterior.n
        info = dict(info_opt, guide=guide, entropy=o.entropy, hyperparameters=model_param_values(call))
        best = "best"
        with torch.no_grad():
            H = {k: float(_entropy_fn(k)(posterior.locs, posterior.variances)) for k in sorted(_ENTROPY_BOUNDS)}
            best = max(H, key=H.get)
        # the deterministic optimiser is judged on the objective it maximises (entropy bound ``entropy``); the
        # reported bound is still the larger of the two entropy bounds (both are lower bounds)
        measured = o.entropy if info["optimizer"] == "natural_gradient" else best
        if exact:
            posterior.layout = lgm.layout

            def objective(M, V):
                e = torch.stack([lgm.expected_log_joint(m, variance=v) for m, v in zip(M, V)]).mean()
                return e + _entropy_fn(measured)(M, V)

            name = "natural-gradient decrement of the exact mixture evidence bound (nats)"
            if measured != best:
                name = f"natural-gradient decrement of the exact mixture evidence bound, {measured} entropy (nats)"
        else:
            log_joint, n = flat_log_joint(call.model, call.args, call.kwargs, red)
            mc = [monte_carlo_objective(log_joint, n, o.check_particles, locs.dtype, locs.device, self.run_seed + k)
                  for k in range(o.num_components)]
            const = 0.5 * n * (1 + math.log(2 * math.pi))

            def objective(M, V):
                e = torch.stack([f(m, v) - 0.5 * torch.log(v).sum() - const for f, m, v in zip(mc, M, V)]).mean()
                return e + _entropy_fn(best)(M, V)

            name = f"natural-gradient decrement of a {o.check_particles}-draw Monte Carlo mixture ELBO (nats)"
        with torch.enable_grad():
            dec, value = mixture_decrement(objective, posterior.locs.to(lgm.dtype if exact else locs.dtype),
                                           posterior.variances.to(lgm.dtype if exact else locs.dtype))
        bound = None
        if exact:
            bound = value if measured == best else mixture_evidence_bound(lgm, posterior, best)
            info["bound_eq24"] = mixture_evidence_bound(lgm, posterior, "eq24")
        return Solution(posterior, bound, Optimality.single(name, dec, o.decrement_tol), reason, info,
                        lgm=lgm if exact else None)
