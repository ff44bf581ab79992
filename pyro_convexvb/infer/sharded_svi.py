r"""Data-parallel Pyro SVI on row-sharded data (``torch.distributed``), equal to the one-process fit.

Each rank runs the unchanged Pyro model on its own rows (a design wrapped by
:func:`pyro_convexvb.distributed.row_sharded`, its own labels). The ELBO of all rows is

.. math::

    \mathcal L(\theta) = \sum_r \mathbb E_q[\log p(y_r \mid z)] + \mathbb E_q[\log p(z) - \log q_\theta(z)],

a sum over ranks of each rank's expected log-likelihood plus the prior and entropy terms, which
belong to no rank. The SVI engines here make every rank compute

* the **same draw** ``z ~ q_theta`` (the same seed on every rank, and the guide is replicated), so
  the reparameterised particle is identical everywhere;
* a **local surrogate** ``-(log p(y_r | z) + [r = 0] (log p(z) - log q(z)))``: the observed sites of
  its trace, plus the latent sites and the guide only on rank 0, so that every term of the ELBO is
  counted exactly once;
* its gradients, which are then **all-reduced** (summed) over ranks, as PyTorch's
  ``DistributedDataParallel`` does: the sum of the local gradients is the gradient of the full
  ELBO at the common draw, bit for bit the single-process estimator up to the order of the
  floating-point additions. The loss value is all-reduced the same way, so the plateau rule of the
  engines stops every rank at the same step.

Every observed site (``obs=``, ``pyro.factor``) is taken to hold this rank's rows; a latent
(non-observed) site is replicated. A model that observes replicated data (a prior written as an
observed factor, say) would count it once per rank: write such terms as latent priors.

For functions of the replicated latents evaluated outside SVI (the Monte Carlo decrement of the
engines' optimality check, the sharded Laplace approximation),
:func:`~pyro_convexvb.distributed.enter_local` and :func:`~pyro_convexvb.distributed.sum_over_ranks` are the pair
of autograd-aware collectives (identity forward / all-reduce backward, and all-reduce forward / identity
backward) that give the full gradient with respect to replicated inputs. Every collective is
:mod:`pyro_convexvb.distributed`'s; this module only decides what each rank contributes.
"""
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.util import is_identically_zero, torch_item

from .. import distributed
from ..lgm.extract import obs_mask_base, subsampled_frame

__all__ = ["local_args", "reshard_lgm", "ShardedTraceELBO", "all_reduce_param_grads",
           "local_log_prob"]


def _local(x):
    if isinstance(x, distributed.RowShardedOperator):
        return x.local
    if isinstance(x, list):
        return [_local(v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_local(v) for v in x)
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    return x


def local_args(args, kwargs):
    """``(args, kwargs)`` with every row-sharded design replaced by its local rows: the model then runs on
    this rank's rows with no communication inside (no all-reduce in the backward of its products), and
    the reductions are done once, on the ELBO's terms and gradients."""
    return tuple(_local(a) for a in args), {k: _local(v) for k, v in kwargs.items()}


def reshard_lgm(lgm, args, kwargs):
    """Mark the extracted model of row-sharded data as row-sharded when extraction lost the marker.

    A predictor that is not written ``pcv.linear(Xs, w)`` alone (``pcv.linear(Xs, w) + b``, say) has its
    Jacobian probed on this rank's rows into a plain local operator, so the latent Gaussian model would
    look like a single-process one and its site sums would cover this rank's rows only. Every observed
    site of a rank's model run holds that rank's rows (the rule of this module), so each site group's
    design is wrapped as a :class:`~pyro_convexvb.distributed.RowShardedOperator` of its local rows:
    site sums are then reduced over ranks and ``B^T u`` all-reduced. Collective (every rank calls it).

    :returns: ``lgm`` (modified in place when needed; unchanged without row-sharded arguments).
    """
    if lgm is None or distributed.find_comm(args, kwargs) is None or distributed.comm_of(lgm) is not None and all(
            distributed.comm_of(g.design) is not None for g in lgm.sites):
        return lgm
    if getattr(lgm, "imputed", None):
        raise NotImplementedError("row-sharded data with imputed (obs_mask) blocks whose predictor is not written "
                                  "pcv.linear(Xs, w) are not supported")
    for g in lgm.sites:
        if distributed.comm_of(g.design) is None:
            g.design = distributed.RowShardedOperator(g.design)
    return lgm


def check_sharded_rows(trace, latent=()):
    """Refuse an observed site whose rows (its values and its distribution's mean at the replicated draw) are the
    same on every rank: each rank's ELBO would count them, once per rank. ``latent``: names of latent sites the
    trace conditions on (observed in it, replicated by design). Collective (one all-reduce)."""
    from ..errors import UnsupportedModelError

    prints = []
    for name, site in trace.nodes.items():
        if site["type"] == "sample" and site["is_observed"] and name not in latent and torch.is_tensor(site["value"]):
            value = site["value"].reshape(1) if site["value"].dim() == 0 else site["value"]
            try:
                mean = site["fn"].mean.expand(site["value"].shape).reshape(value.shape)
            except (NotImplementedError, RuntimeError, AttributeError):
                mean = torch.zeros_like(value)
            prints.append((name, [value, mean]))
    same = distributed.replicated_names(prints)
    if same:
        raise UnsupportedModelError(same[0], "this observed site holds the same rows on every rank, so the ELBO "
                                             "would count them once per rank: with row-sharded data every observed "
                                             "site must hold this rank's share of its rows (give rank 0 the side "
                                             "observations and the other ranks none, or fit on one process)")


def check_full_plates(trace):
    """Refuse subsampled plates on row-sharded data: each rank would draw its mini-batch indices from its own
    number of rows, the random streams of the ranks would drift apart and the replicated draws with them. Refuse
    ``obs_mask`` imputation too: its ``<name>_unobserved`` latents are this rank's rows, not replicated latents."""
    for name, site in trace.nodes.items():
        if site["type"] != "sample":
            continue
        base = obs_mask_base(name, trace.nodes)
        if base is not None:
            raise NotImplementedError(
                f"site '{base}': obs_mask imputation is not supported on row-sharded data "
                "(pcv.distributed.row_sharded): the imputed entries are latents of this rank's rows, not replicated "
                "ones; drop the unobserved rows from the shards, or fit on one process")
        f = subsampled_frame(site)
        if f is not None:
            raise NotImplementedError(
                f"plate '{f.name}' subsamples {f.size} of {f.full_size} rows: mini-batches are not supported on "
                "row-sharded data (pcv.distributed.row_sharded); use the full plate (each rank's rows are its batch)")


def local_log_prob(trace, first_rank, latent_names=()):
    """``sum`` of the observed sites' log densities, plus the latent sites' only when ``first_rank``
    (each term of the joint density counted once over ranks). ``trace`` has computed log probabilities;
    ``latent_names``: latent sites conditioned to values (``poutine.condition`` marks them observed)."""
    total = 0.0
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or type(site["fn"]).__name__ == "_Subsample":
            continue
        if (site["is_observed"] and name not in latent_names) or first_rank:
            total = total + site["log_prob_sum"]
    return total


def all_reduce_param_grads():
    """Sum the gradients of the Pyro param store's parameters over ranks, in name order
    (:func:`pyro_convexvb.distributed.all_reduce_grads`: one all-reduce, as DDP)."""
    import pyro

    distributed.all_reduce_grads(p for _, p in sorted(pyro.get_param_store().named_parameters(), key=lambda kv: kv[0]))


class ShardedTraceELBO(Trace_ELBO):
    """Pyro's ``Trace_ELBO`` on row-sharded data: local surrogate, gradients and loss all-reduced.

    See the module docstring. Reparameterised guides only (every autoguide is): a score-function
    term would need the other ranks' log-likelihoods per particle.

    :param reduction: the data's :class:`~pyro_convexvb.distributed.Communicator`
        (:func:`~pyro_convexvb.distributed.find_comm` of the model's arguments), or ``None`` (one process).
    :param kwargs: Pyro's ``Trace_ELBO`` options (``num_particles``, ``vectorize_particles``).

    Example (runs under ``torchrun``; one process shown, where it is ``Trace_ELBO``)::

        >>> loss = ShardedTraceELBO(None)
        >>> loss.num_particles
        1
    """

    def __init__(self, reduction, **kwargs):
        super().__init__(**kwargs)
        self.reduction = reduction

    def _local_particle(self, model_trace, guide_trace, first):
        elbo, surrogate = 0.0, 0.0
        for name, site in model_trace.nodes.items():
            if site["type"] == "sample" and (site["is_observed"] or first):
                elbo = elbo + torch_item(site["log_prob_sum"])
                surrogate = surrogate + site["log_prob_sum"]
        for name, site in guide_trace.nodes.items():
            if site["type"] == "sample":
                log_prob, score_function_term, entropy_term = site["score_parts"]
                if not is_identically_zero(score_function_term):
                    raise ValueError(f"sharded SVI: guide site '{name}' is not reparameterised (a score-function "
                                     "gradient needs every rank's log-likelihood of each particle); use an autoguide")
                if first:
                    elbo = elbo - torch_item(site["log_prob_sum"])
                    if not is_identically_zero(entropy_term):
                        surrogate = surrogate - entropy_term.sum()
        return -elbo, -surrogate

    def loss_and_grads(self, model, guide, *args, **kwargs):
        if self.reduction is None:
            return super().loss_and_grads(model, guide, *args, **kwargs)
        first = distributed.rank() == 0
        args, kwargs = local_args(args, kwargs)
        loss = 0.0
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            check_full_plates(model_trace)
            check_full_plates(guide_trace)
            if not self.__dict__.get("_rows_checked"):
                check_sharded_rows(model_trace)
                self._rows_checked = True
            loss_particle, surrogate = self._local_particle(model_trace, guide_trace, first)
            loss += loss_particle / self.num_particles
            if getattr(surrogate, "requires_grad", False):
                (surrogate / self.num_particles).backward(retain_graph=self.retain_graph)
        all_reduce_param_grads()
        return float(self.reduction.sum(torch.tensor(loss, dtype=torch.float64)))

    def loss(self, model, guide, *args, **kwargs):
        if self.reduction is None:
            return super().loss(model, guide, *args, **kwargs)
        first = distributed.rank() == 0
        args, kwargs = local_args(args, kwargs)
        with torch.no_grad():
            loss = 0.0
            for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
                loss += float(self._local_particle(model_trace, guide_trace, first)[0]) / self.num_particles
        return float(self.reduction.sum(torch.tensor(loss, dtype=torch.float64)))
