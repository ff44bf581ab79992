"""Distributed cases of dual_vg (L-space form), diag_mixture, the SVI baselines and the online learner.

Each ``case_*(rank, world_size)`` builds this rank's rows (all rows when ``world_size == 1``) and returns
float64 results that must equal the single-process ones (see ``worker.py``).
"""
import torch

import pyro_convexvb as pcv
from pyro_convexvb.distributed import row_sharded, shard_range


def _problem(rank, world, q=80, n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(q, n, generator=g, dtype=torch.float64)
    w = torch.randn(n, generator=g, dtype=torch.float64)
    y = (torch.rand(q, generator=g, dtype=torch.float64) < torch.sigmoid(X @ w)).to(torch.float64)
    a, b = shard_range(q, rank, world)
    return X[a:b], y[a:b]


def logistic_model(X, y):
    import pyro
    import pyro.distributions as dist

    n = X.shape[1]
    w = pyro.sample("w", dist.Normal(torch.zeros(n, dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)


def intercept_model(X, y):
    """A predictor with an intercept added outside the design: its gradient does not pass through X."""
    import pyro
    import pyro.distributions as dist

    n = X.shape[1]
    w = pyro.sample("w", dist.Normal(torch.zeros(n, dtype=torch.float64), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(torch.zeros((), dtype=torch.float64), 2.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w) + b), obs=y)


def _summary(res):
    out = {"mean": res.posterior.loc, "variance": res.posterior.variance,
           "bound": res.log_evidence_bound if res.log_evidence_bound is not None else float("nan")}
    out["history_objective"] = torch.as_tensor(list(res.history["objective"]), dtype=torch.float64)
    out["optimality"] = torch.tensor([c.value for c in res.optimality.criteria], dtype=torch.float64)
    return out


def case_dual_vg_latent(rank, world):
    X, y = _problem(rank, world, q=120, n=8)
    res = pcv.fit(logistic_model, row_sharded(X.to_sparse_csr()), y, engine="dual_vg")
    out = _summary(res)
    out["converged"] = float(res.converged)
    del out["optimality"]  # the final duality gap (~1e-10 nats) is a residual at rounding level
    out["lvb_elbo"] = res.info["lvb_elbo"]
    out["history_gap"] = torch.as_tensor(list(res.history["gap"]), dtype=torch.float64)
    out["cg_iterations"] = res.info["cg_iterations"]
    out["covariance"] = res.posterior.covariance()
    if world > 1:  # the N x N form couples every rank's sites: refused, naming the L x L form
        try:
            pcv.fit(logistic_model, row_sharded(X), y, engine="dual_vg", options={"form": "site"})
        except ValueError as e:
            assert "form='latent'" in str(e), str(e)
        else:
            raise AssertionError("dual_vg form='site' fitted row-sharded data")
        # Laplace sites need the exact-VG refinement, which does not run on row-sharded sites: refused by name
        try:
            pcv.fit(laplace_model, row_sharded(X), 2 * y - 1, engine="dual_vg")
        except pcv.UnsupportedModelError as e:
            assert e.site == "y" and "row-sharded data" in str(e), str(e)
        else:
            raise AssertionError("dual_vg fitted Laplace sites on row-sharded data")
    return out


def laplace_model(X, y):
    import pyro
    import pyro.distributions as dist

    n = X.shape[1]
    w = pyro.sample("w", dist.Normal(torch.zeros(n, dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Laplace(pcv.linear(X, w), 0.5), obs=y)


def poisson_model(X, y):
    import pyro
    import pyro.distributions as dist

    n = X.shape[1]
    w = pyro.sample("w", dist.Normal(torch.zeros(n, dtype=torch.float64), 0.5).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Poisson(torch.exp(pcv.linear(X, w))), obs=y)


def case_dual_vg_lbfgs_poisson(rank, world):
    g = torch.Generator().manual_seed(7)
    q, n = 70, 5
    X = 0.5 * torch.randn(q, n, generator=g, dtype=torch.float64)
    y = torch.poisson(torch.exp(X @ torch.randn(n, generator=g, dtype=torch.float64) * 0.5), generator=g)
    a, b = shard_range(q, rank, world)
    res = pcv.fit(poisson_model, row_sharded(X[a:b]), y[a:b], engine="dual_vg",
                  options={"method": "lbfgs", "gap_tol": 1e-9})
    out = _summary(res)
    del out["optimality"]
    out["converged"] = float(res.converged)
    out["iterations"] = res.info["iterations"]
    return out


def case_dual_vg_intercept(rank, world):
    """A predictor written pcv.linear(Xs, w) + b: extraction probes its Jacobian on the local rows."""
    X, y = _problem(rank, world, q=60, n=4, seed=3)
    res = pcv.fit(intercept_model, row_sharded(X), y, engine="dual_vg")
    out = _summary(res)
    del out["optimality"]
    out["covariance"] = res.posterior.covariance()
    return out


_SVI = {"max_steps": 60, "min_steps": 20, "window": 20, "lr": 0.05, "check_particles": 8}


def case_svi_autonormal(rank, world):
    X, y = _problem(rank, world)
    res = pcv.fit(intercept_model, row_sharded(X), y, engine="svi_autonormal", options=_SVI)
    out = _summary(res)
    return out


def noise_model(X, y):
    """Gaussian regression whose noise scale is a pyro.param: its gradient does not pass through X."""
    import pyro
    import pyro.distributions as dist
    from torch.distributions import constraints

    n = X.shape[1]
    w = pyro.sample("w", dist.Normal(torch.zeros(n, dtype=torch.float64), 1.0).to_event(1))
    s = pyro.param("noise", torch.tensor(1.0, dtype=torch.float64), constraint=constraints.positive)
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(pcv.linear(X, w), s), obs=y)


def case_svi_learned_noise(rank, world):
    X, y = _problem(rank, world)
    y = X @ torch.linspace(-1, 1, X.shape[1], dtype=torch.float64) + 0.3 * torch.sin(torch.arange(
        X.shape[0], dtype=torch.float64) + 10 * rank)
    if world == 1:  # the same targets as the sharded run
        X2, _ = _problem(0, 2)
        y = torch.cat([X2 @ torch.linspace(-1, 1, X.shape[1], dtype=torch.float64)
                       + 0.3 * torch.sin(torch.arange(X2.shape[0], dtype=torch.float64)),
                       X[X2.shape[0]:] @ torch.linspace(-1, 1, X.shape[1], dtype=torch.float64)
                       + 0.3 * torch.sin(torch.arange(X.shape[0] - X2.shape[0], dtype=torch.float64) + 10)])
    res = pcv.fit(noise_model, row_sharded(X), y, engine="svi_autonormal", options=_SVI)
    out = _summary(res)
    out["noise"] = res.info["hyperparameters"]["noise"]
    return out


def case_svi_automvn(rank, world):
    X, y = _problem(rank, world)
    res = pcv.fit(logistic_model, row_sharded(X), y, engine="svi_automvn", options=_SVI)
    out = _summary(res)
    out["covariance"] = res.posterior.covariance()
    return out


def case_svi_lowrank(rank, world):
    X, y = _problem(rank, world)
    res = pcv.fit(logistic_model, row_sharded(X), y, engine="svi_lowrank", options=dict(_SVI, rank=2))
    return _summary(res)


def case_diag_mixture(rank, world):
    X, y = _problem(rank, world)
    res = pcv.fit(logistic_model, row_sharded(X), y, engine="diag_mixture",
                  options=dict(_SVI, num_components=2))
    return {"locs": res.posterior.locs, "variances": res.posterior.variances,
            "bound": res.log_evidence_bound if res.log_evidence_bound is not None else float("nan"),
            "history_objective": torch.as_tensor(list(res.history["objective"]), dtype=torch.float64),
            "optimality": torch.tensor([c.value for c in res.optimality.criteria], dtype=torch.float64)}


def case_online_sharded(rank, world):
    """ShardedOnline over the process group equals its one-process simulation (simulate_sharded) with 2 ranks.

    The reference (``world == 1``) simulates both ranks; the sharded run learns this rank's block-cyclic share
    of the stream and merges by all-reduce. (Both approximate the sequential algorithm alike; its regret cost
    is measured in tests/test_online_distributed.py.)"""
    import numpy as np

    from pyro_convexvb.online import OnlineBayesLogistic, ShardedOnline, make_online_stream, simulate_sharded

    P, d, m, rows = 2, 40, 50, 600
    out = {}
    for merge in ("natural", "average"):
        if world == 1:
            shards = [make_online_stream(d=d, d_t=6, seed=5, shard=(r, P)).take(rows) for r in range(P)]
            ests = [OnlineBayesLogistic(d, prior_var=1.0) for _ in range(P)]
            losses = simulate_sharded(ests, shards, m, merge)
            est, total = ests[0], sum(float(ll.sum()) for ll in losses)
        else:
            X, y = make_online_stream(d=d, d_t=6, seed=5, shard=(rank, world)).take(rows)
            sh = ShardedOnline(OnlineBayesLogistic(d, prior_var=1.0), merge_every=m, merge=merge)
            ll = sh.partial_fit(X, y)
            est, total = sh.estimator, float(pcv.distributed.all_reduce_sum(float(np.sum(ll))))
        out[f"{merge}_mean"] = torch.from_numpy(est.coef_)
        out[f"{merge}_var"] = torch.from_numpy(est.coef_var_)
        out[f"{merge}_log_loss"] = total
    return out


def case_online_sharded_rounds_span_calls(rank, world):
    """ShardedOnline's rounds of ``merge_every`` local rows span its partial_fit calls (every call ended with a
    merge of its last, short round, so the posterior depended on the call sizes).

    Equal calls on both ranks (130 + 70 rows, and 37 + 0 + 113 + 50; merge every 50) give the one-call result,
    and the state after the first call of 130 rows is that of 130 rows with the open round combined. Unequal
    calls (rank 0: 130 + 70 rows, rank 1: 70 + 130) close a round when the rank with the most rows of its open
    round reaches 50, the other's short: rounds rank 0 / rank 1 [0, 50) / [0, 50), [50, 100) / [50, 70),
    [100, 150) / [70, 120), [150, 200) / [120, 170), and the open [] / [170, 200) combined at the end. The
    reference learns each of those rounds by one ``simulate_sharded`` call."""
    import copy

    import numpy as np

    from pyro_convexvb.online import OnlineBayesLogistic, ShardedOnline, make_online_stream, simulate_sharded

    P, d, m, rows = 2, 30, 50, 200
    splits = {"equal": [[130, 70]] * P, "equal4": [[37, 0, 113, 50]] * P, "unequal": [[130, 70], [70, 130]]}
    rounds = {"unequal": [((0, 50), (0, 50)), ((50, 100), (50, 70)), ((100, 150), (70, 120)),
                          ((150, 200), (120, 170)), ((200, 200), (170, 200))]}
    first = {"equal": ((0, 130), (0, 130)), "equal4": ((0, 37), (0, 37)), "unequal": ((0, 130), (0, 70))}
    out = {}
    for name, calls in splits.items():
        if world == 1:
            shards = [make_online_stream(d=d, d_t=5, seed=3, shard=(r, P)).take(rows) for r in range(P)]
            parts = rounds.get(name, [((k, k + m),) * P for k in range(0, rows, m)])
            ests = [OnlineBayesLogistic(d, prior_var=0.5) for _ in range(P)]
            after_first, total = None, 0.0
            for k, part in enumerate(parts):
                if after_first is None and all(b >= f[1] for (_, b), f in zip(part, first[name])):
                    early = copy.deepcopy(ests)  # the state after the first call: its rows of this round, combined
                    simulate_sharded(early, [(X[a:f[1]], y[a:f[1]]) for (X, y), (a, _), f
                                             in zip(shards, part, first[name])], rows)
                    after_first = early[0].coef_
                ll = simulate_sharded(ests, [(X[a:b], y[a:b]) for (X, y), (a, b) in zip(shards, part)], rows)
                total += sum(float(v.sum()) for v in ll)
            est, merges = ests[0], 4
        else:
            X, y = make_online_stream(d=d, d_t=5, seed=3, shard=(rank, world)).take(rows)
            sh = ShardedOnline(OnlineBayesLogistic(d, prior_var=0.5), merge_every=m)
            a, lls = 0, []
            for k, c in enumerate(calls[rank]):
                lls.append(sh.partial_fit(X[a:a + c], y[a:a + c]))
                a += c
                if k == 0:
                    after_first = sh.estimator.coef_.copy()
            est, merges = sh.estimator, sh.n_merges_
            total = float(pcv.distributed.all_reduce_sum(float(np.concatenate(lls).sum())))
        out[f"{name}_first_mean"] = torch.from_numpy(after_first)
        out[f"{name}_mean"] = torch.from_numpy(est.coef_)
        out[f"{name}_var"] = torch.from_numpy(est.coef_var_)
        out[f"{name}_log_loss"] = total
        out[f"{name}_merges"] = merges
    return out


def slowcase_dual_vg_sparse(rank, world):
    """dual_vg (L-space, Newton-CG) on a sparse logistic problem of 6000 rows and 300 features."""
    g = torch.Generator().manual_seed(11)
    q, n = 6000, 300
    X = torch.randn(q, n, generator=g, dtype=torch.float64) * (torch.rand(q, n, generator=g, dtype=torch.float64) < 0.03)
    w = torch.randn(n, generator=g, dtype=torch.float64)
    y = (torch.rand(q, generator=g, dtype=torch.float64) < torch.sigmoid(X @ w)).to(torch.float64)
    a, b = shard_range(q, rank, world)
    res = pcv.fit(logistic_model, row_sharded(X[a:b].to_sparse_csr()), y[a:b], engine="dual_vg",
                  options={"newton_solver": "cg"})
    out = _summary(res)
    del out["optimality"]
    out["converged"] = float(res.converged)
    return out


def slowcase_diag_mixture_long(rank, world):
    """diag_mixture, K = 3, SVI run to its plateau rule (``optimizer="svi"``: on one process ``"auto"`` takes the
    natural-gradient ascent, which row-sharded data do not support, so the two would run different optimisers)."""
    X, y = _problem(rank, world, q=400, n=10, seed=12)
    res = pcv.fit(logistic_model, row_sharded(X), y, engine="diag_mixture",
                  options={"num_components": 3, "max_steps": 3000, "lr": 0.02, "optimizer": "svi"})
    return {"locs": res.posterior.locs, "variances": res.posterior.variances,
            "bound": res.log_evidence_bound if res.log_evidence_bound is not None else float("nan"),
            "steps": res.info["steps"]}
