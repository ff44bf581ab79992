"""Distributed cases of what row-sharded fits must refuse, and of models whose sharded fit once went wrong.

Each ``case_*(rank, world_size)`` builds this rank's rows (all rows when ``world_size == 1``) and returns float64
results that must equal the single-process ones (see ``worker.py``). Refusals return ones on every rank when they
raise as they should (on one process there is nothing to refuse, and the reference is those ones).
"""
import pyro
import pyro.distributions as dist
import torch
from torch.distributions import constraints

import pyro_convexvb as pcv
from pyro_convexvb.distributed import row_sharded


def _rows(q, rank, world, first):
    """Uneven shards: rank 0 holds ``first`` of the ``q`` rows, the other ranks split the rest."""
    if world == 1:
        return 0, q
    if rank == 0:
        return 0, first
    per = (q - first) // (world - 1)
    a = first + (rank - 1) * per
    return a, q if rank == world - 1 else a + per


def _problem(rank, world, q=60, n=5, seed=1, first=7):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(q, n, generator=g, dtype=torch.float64)
    w = torch.randn(n, generator=g, dtype=torch.float64)
    y = (torch.rand(q, generator=g, dtype=torch.float64) < torch.sigmoid(X @ w)).to(torch.float64)
    a, b = _rows(q, rank, world, first)
    return X[a:b], y[a:b]


def logistic_model(X, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)


def side_observation_model(X, y, t):
    """``t``: three side observations of ``w[0]``, the same on every rank (not rows of the data)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("side", t.shape[0]):
        pyro.sample("t", dist.Normal(w[0], 0.5), obs=t)
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)


def masked_model(X, y, mask):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(pcv.linear(X, w), 0.5), obs=y, obs_mask=mask)


def _refused(fn, kind, match):
    try:
        fn()
    except kind as e:
        assert match in str(e), str(e)
        return 1.0
    return 0.0


_SVI = {"max_steps": 60, "min_steps": 20, "window": 20, "lr": 0.05}


def case_guard_refusals(rank, world):
    """Replicated side observations (counted once per rank: variances 8-15% off), diagnostics of a sharded fit
    (one shard's likelihood against the all-rows posterior), obs_mask imputation by the SVI engines, and a label
    outside the support on one rank only (the other ranks waited in their next collective) are refused on every
    rank."""
    X, y = _problem(rank, world)
    if world == 1:
        return {"refused": torch.ones(7, dtype=torch.float64)}
    Xs, t = row_sharded(X), torch.tensor([1.2, 0.8, 1.5], dtype=torch.float64)
    out = [_refused(lambda: pcv.fit(side_observation_model, Xs, y, t, engine=e, options=o, progress=False),
                    pcv.UnsupportedModelError, "holds the same rows on every rank")
           for e, o in (("dual_vg", {}), ("laplace", {}), ("svi_autonormal", _SVI))]
    res = pcv.fit(logistic_model, Xs, y, engine="dual_vg", progress=False)
    out.append(_refused(lambda: res.diagnostics, ValueError, "row-sharded data"))
    out.append(_refused(lambda: res.loo(), ValueError, "row-sharded data"))
    mask = torch.ones(X.shape[0], dtype=torch.bool)
    mask[0] = False
    out.append(_refused(lambda: pcv.fit(masked_model, Xs, torch.where(mask, y, 0.0), mask, engine="svi_autonormal",
                                        options=_SVI, progress=False), NotImplementedError, "obs_mask imputation"))
    bad = y.clone()
    if rank == 1:
        bad[-1] = 2.0
    out.append(_refused(lambda: pcv.fit(logistic_model, Xs, bad, engine="dual_vg", progress=False), ValueError,
                        "outside the support" if rank == 1 else "rank(s) [1]"))
    return {"refused": torch.tensor(out, dtype=torch.float64)}


def intercept_model(X, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=torch.float64), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(torch.zeros((), dtype=torch.float64), 2.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w) + b), obs=y)


def case_svi_one_row_rank(rank, world):
    """A rank holding one row of ``pcv.linear(Xs, w) + b``: its probed design has no entrywise square, and the
    optimality measure's variance gradient was this rank's alone (8.17 against 0.416; the other rank then hung)."""
    X, y = _problem(rank, world, first=1)
    pyro.set_rng_seed(0)
    res = pcv.fit(intercept_model, row_sharded(X), y, engine="svi_autonormal", options=_SVI, progress=False)
    return {"bound": torch.tensor(res.log_evidence_bound, dtype=torch.float64),
            "optimality": torch.tensor([c.value for c in res.optimality.criteria], dtype=torch.float64)}


def noise_model(X, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=torch.float64), 1.0).to_event(1))
    s = pyro.param("noise", torch.tensor(1.0, dtype=torch.float64), constraint=constraints.positive)
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(pcv.linear(X, w), s), obs=y)


def case_convex_relaxation_gaussian_sites_only(rank, world):
    """A model with Gaussian likelihood sites only (a TypeError on row-sharded data), its noise learned."""
    X, _ = _problem(0, 1)  # all rows, then this rank's
    y = X @ torch.linspace(-1, 1, X.shape[1], dtype=torch.float64) + 0.3 * torch.cos(torch.arange(X.shape[0]) + 0.0)
    a, b = _rows(X.shape[0], rank, world, 7)
    X, y = X[a:b], y[a:b]
    pyro.clear_param_store()
    res = pcv.fit(noise_model, row_sharded(X), y, engine="convex_relaxation", progress=False)
    return {"mean": res.posterior.loc, "bound": torch.tensor(res.log_evidence_bound, dtype=torch.float64),
            "noise": res.hyperparameters["noise"].reshape(1)}


def hyper_model(X, y):
    s = pyro.sample("s", dist.LogNormal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=torch.float64), s).expand([X.shape[1]]).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)


def case_laplace_latent_read_by_the_prior_only(rank, world):
    """``laplace`` with a prior scale ``s`` read only by the prior (counted on rank 0): the ranks' Hessian rows
    issued different collectives (a gloo abort)."""
    X, y = _problem(rank, world)
    res = pcv.fit(hyper_model, row_sharded(X), y, engine="laplace", progress=False)
    return {"mean": res.posterior.loc, "variance": res.posterior.variance}


case_laplace_latent_read_by_the_prior_only.rtol = 1e-7
