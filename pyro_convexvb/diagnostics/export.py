"""ArviZ export of a fitted result: ``res.to_arviz()`` -> ``arviz.InferenceData``.

ArviZ is an optional dependency (``pip install pyro_convexvb[arviz]``).
"""
import numpy as np
import torch

from .importance import _log_joint, check_seed, whole_number_at_least
from .constrained import proposal_posterior
from .proposals import DENSE_MAX, make_proposal

__all__ = ["to_arviz"]

#: default draws of :func:`to_arviz`
ARVIZ_DRAWS = 1000


def _import_arviz():
    try:
        import arviz
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("to_arviz needs ArviZ: pip install 'pyro_convexvb[arviz]' (arviz>=0.17,<1)") from e
    return arviz


def to_arviz(result, num_draws=None, seed=0, *, chains=4, corrected=None, progress=False):
    """An ``arviz.InferenceData`` of the fit, for ``az.summary``, ``az.loo``, ``az.compare`` and ``az.plot_*``.

    Over 80 lines: most of it is this docstring; the body is under 80.

    Groups: ``posterior`` (every latent site in the model's constrained coordinates), ``posterior_predictive``
    (one replicated data set per draw), ``log_likelihood`` (pointwise, per observed site, masked entries
    dropped; dimension ``<site>_obs``), ``observed_data``, ``sample_stats`` (``lp``: the log joint of each draw
    in unconstrained coordinates) and attributes with the engine's report (engine, converged, stop reason,
    seconds, evidence bound, PSIS ``k_hat`` when computed).

    The draws are independent draws from the fitted posterior, split into ``chains`` pseudo-chains (so R-hat is a
    check of nothing but Monte Carlo noise), or, for a corrected result, draws resampled by the importance
    weights (multinomially, with replacement; repeated draws lower ArviZ's ESS accordingly). ArviZ's ``az.loo``
    on the former is LOO of the approximate posterior; on the latter, of the corrected one.

    :param result: an :class:`~pyro_convexvb.InferenceResult` fitted on a Pyro model.
    :param int num_draws: total draws (default 1000; rounded down to a multiple of ``chains``).
    :param int chains: pseudo-chains.
    :param bool corrected: resample by the importance weights of ``result.correction`` (default: when the
        result has a correction); ``True`` without one computes it (``result.corrected()``).
    :returns: ``arviz.InferenceData``.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = torch.randn(40, 2, dtype=torch.float64); y = (X[:, 0] > 0).double()
        >>> idata = pcv.fit(model, X, y=y, engine="dual_vg", progress=False).to_arviz(num_draws=200)
        >>> idata.posterior["w"].shape, idata.log_likelihood["y"].shape
        ((4, 50, 2), (4, 50, 40))
    """
    az = _import_arviz()
    if isinstance(chains, bool) or not isinstance(chains, (int, np.integer)) or chains < 1:
        raise ValueError(f"chains: expected a positive int, got {chains!r}")
    chains = int(chains)
    n = ARVIZ_DRAWS if num_draws is None else num_draws
    if not whole_number_at_least(n, chains):
        raise ValueError(f"num_draws: expected an integer of at least chains={chains} (one draw per chain; default "
                         f"{ARVIZ_DRAWS}), got {num_draws!r}")
    check_seed(seed)
    S = int(n) // chains * chains
    lj = _log_joint(result)
    corr = result.__dict__.get("_correction")
    if corrected not in (None, True, False):
        raise ValueError(f"corrected: expected None (resample when the result has a correction), True or False, got "
                         f"{corrected!r}")
    if corrected is None:
        corrected = corr is not None
    if corrected:
        if corr is None:
            corr = result.corrected()
        values = corr.resample(S, seed=seed, constrained=False)
        source = f"resampled by PSIS weights (proposal {corr.diagnostics.proposal!r}, k_hat {corr.k_hat:.3f})"
    else:
        post = proposal_posterior(result)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            if getattr(post, "kind", None) == "precision_operator" and post.n > DENSE_MAX:
                # draws need no density: the matrix-free posterior's own sampler (one CG solve a draw), where the
                # proposal would factorise its dense precision and refuses above DENSE_MAX
                values = post.layout.unflatten(post.sample(S, generator=gen).reshape(S, -1))
            else:
                values, _ = make_proposal(post, "fitted").sample(S, gen)
        source = "independent draws from the fitted posterior"
    out = lj.evaluate(values, pointwise=True, predictive=True, progress=progress)

    def shaped(a):
        a = np.asarray(a)
        return a.reshape((chains, S // chains) + a.shape[1:])

    posterior = {n: shaped(lj.constrain(n, values[n]).double().cpu().numpy()) for n in lj.names}
    log_lik = {n: shaped(v) for n, v in out["log_lik"].items()}
    obs = lj.observed()
    y_rep, dims, coords = {}, {}, {}
    for n, v in out["y_rep"].items():
        # replicates per observation, masked entries dropped, so that they line up with log_likelihood and
        # observed_data along <site>_obs (whose coordinate is the flat index into the site's batch shape)
        r = lj.by_observation(n, v) if n in lj.obs_shapes else None
        y_rep[n] = shaped(v if r is None else r)
    for n in log_lik:
        dims[n] = [f"{n}_obs"]
        if n in lj.obs_shapes:
            coords[f"{n}_obs"] = lj.observation_index(n)
    attrs = {"inference_library": "pyro_convexvb", "engine": result.engine, "converged": int(bool(result.converged)),
             "stop_reason": str(result.stop_reason), "seconds": float(result.seconds), "draws": source}
    if result.log_evidence_bound is not None:
        attrs["log_evidence_bound"] = float(result.log_evidence_bound)
    d = result.__dict__.get("_diagnostics")
    if d is not None:
        attrs["psis_k_hat"] = float(d.k_hat)
    if corr is not None:
        attrs["corrected_k_hat"] = float(corr.k_hat)
    observed = {n: v for n, v in obs.items() if n in log_lik}
    for n, idx in list(coords.items()):
        site = n[:-len("_obs")]
        if log_lik[site].shape[-1] != idx.shape[0] or (site in observed and observed[site].shape[0] != idx.shape[0]) \
                or (site in y_rep and y_rep[site].shape[2] != idx.shape[0]):
            del coords[n]  # a site whose value does not have its distribution's shape: plain positions
    for group, vals in (("observed_data", observed), ("posterior_predictive", y_rep)):
        for n, v in vals.items():
            if n in dims and v.shape[2 if group == "posterior_predictive" else 0] != log_lik[n].shape[-1]:
                raise RuntimeError(f"to_arviz: site '{n}': {group} has {v.shape} against {log_lik[n].shape[-1]} "
                                   "observations in log_likelihood; please report the model")
    return az.from_dict(posterior=posterior, posterior_predictive=y_rep, log_likelihood=log_lik,
                        observed_data=observed, sample_stats={"lp": shaped(out["log_joint"])},
                        dims=dims, coords=coords, attrs=attrs)
