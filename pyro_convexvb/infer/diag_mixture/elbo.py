"""The loss of :class:`~pyro_convexvb.posterior.mixture.AutoDiagMixture`: the ELBO of Steinberg et al. 2017, Eq. (27),
with the closed-form entropy lower bound (Eq. 24) instead of a sampled ``log q``.

Under ``pyro.plate(..., subsample_size=M)`` Pyro scales the likelihood by ``N / M`` (Eq. 6), so the mini-batch
objective is unbiased for the full-batch one.
"""
import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import ELBO
from torch.distributions import biject_to

from ...distributed import rank
from ...errors import UnsupportedModelError
from ...posterior.mixture import AutoDiagMixture, _entropy_fn

__all__ = ["DiagMixtureELBO"]


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
    :param reduction: ``None``, or for row-sharded data the data's communicator
        (:func:`~pyro_convexvb.distributed.find_comm`): every rank draws the same stratified particles (same
        seed), evaluates the model on its own rows, and counts its observed sites plus -- on rank 0 only -- the latent
        sites, log-Jacobians and the entropy bound; gradients and the loss are then summed over ranks
        (as in ``DistributedDataParallel``), which is the single-process objective and gradient up
        to the order of floating-point additions (:mod:`~pyro_convexvb.infer.sharded_svi`).

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(y):
        ...     z = pyro.sample("z", dist.Normal(torch.zeros(3), 1.).to_event(1))
        ...     pyro.sample("y", dist.Normal(z, 0.5).to_event(1), obs=y)
        >>> pyro.set_rng_seed(0); pyro.clear_param_store()
        >>> guide = pcv.AutoDiagMixture(model, num_components=2)
        >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), loss=pcv.DiagMixtureELBO(num_particles=4))
        >>> losses = [svi.step(torch.tensor([0.5, -1.0, 2.0])) for _ in range(300)]
        >>> losses[-1] < losses[0]
        True
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
        from ..sharded_svi import check_full_plates, local_log_prob

        check_full_plates(tr)
        first = rank() == 0
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
        try:
            with pyro.plate("_diag_mixture_particles", P, dim=-(mpn + 1)):
                tr = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
        except (RuntimeError, ValueError, IndexError) as e:
            self._blame_vectorisation(model, guide, z[0], args, kwargs, e)
            raise
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

    def _blame_vectorisation(self, model, guide, z0, args, kwargs, error):
        """The model failed inside the particle plate: when it runs at one particle ``z0`` without the plate, the
        failure is the vectorisation's, and a ``ValueError`` says so (the model's own error is chained); otherwise
        the caller re-raises the model's error."""
        try:
            with torch.no_grad(), poutine.block():
                values, _ = self._constrain(guide, z0.detach())
                poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the model fails without the plate too: its own error stands
            return
        raise ValueError(
            "DiagMixtureELBO(vectorize_particles=True): the model runs at one particle but fails inside the "
            f"particle plate ({type(error).__name__}: {str(error).splitlines()[0][:200]}), so it does not broadcast "
            "over a leading particle dimension (e.g. a global vector latent of shape (P, 1, D) in 'X @ w'); use "
            "vectorize_particles=False, or write the model to broadcast (see the diag_mixture docs)") from error

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
            from ..sharded_svi import local_args

            args, kwargs = local_args(args, kwargs)
        self._check_guide(guide, args, kwargs)
        z, locs, variances = guide._stratified_latent(self.num_particles)
        if self.vectorize_particles:
            e_log_joint = self._log_joint_vectorized(model, guide, z, args, kwargs)
        else:
            e_log_joint = self._log_joint_sequential(model, guide, z, args, kwargs)
        if self.reduction is not None and rank() != 0:  # the entropy bound is counted once, on rank 0
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
        from ..sharded_svi import all_reduce_param_grads

        all_reduce_param_grads()
        return float(self.reduction.sum(loss.detach()))

