"""ActiveLearner: within-block rank-one state vs a dense recomputation, score choice, history, validation."""
import dataclasses
import warnings
import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.design.active import ActiveLearner, _take_rows
from pyro_convexvb.design.scores import classifier_uncertainty

D = torch.float64


def _model(X, y):
    u = pyro.sample("u", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, u)), obs=y)


def _laplace_model(X, y):
    u = pyro.sample("u", dist.Laplace(torch.zeros(X.shape[1], dtype=X.dtype), 0.7).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, u)), obs=y)


def _dense_sites(model, X):
    """Dense model-site design ``B`` in the engine's group order and the Gaussian prior precision ``P``:
    ``_model`` has one site group (the cases, ``B = X``) and prior ``N(0, I)``; ``_laplace_model`` has the
    Laplace prior sites first, then the cases (``B = [I; X]``), and no Gaussian prior."""
    n = X.shape[1]
    if model is _model:
        return X, torch.eye(n, dtype=D)
    return torch.cat([torch.eye(n, dtype=D), X]), torch.zeros(n, n, dtype=D)


def _data(N=160, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, n, generator=g, dtype=D)
    w = 2 * torch.randn(n, generator=g, dtype=D)
    y = (torch.rand(N, generator=g, dtype=D) < torch.sigmoid(X @ w)).to(D)
    return X, y


def test_block_state_equals_dense_refit_of_marginals():
    X, y = _data()
    calls = []

    def oracle(i):
        calls.append(len(i))
        return y[i]

    L = ActiveLearner(_model, X, oracle, score="cu", refit_every=4, variance="exact", progress=False)
    h = L.run(4, init=torch.arange(12))
    st = L.last_block
    res = st["result"]
    A0 = res.posterior.precision_operator.to_dense()
    u0 = res.posterior.loc
    rows = torch.stack(st["rows"])
    gam = st["gamma"]
    beta = 0.5 * (2 * st["labels"] - 1)
    A1 = A0 + rows.T @ (rows / gam[:, None])
    u_ref = torch.linalg.solve(A1, A0 @ u0 + rows.T @ beta)  # offsets are zero in this model
    assert torch.allclose(st["u"], u_ref, atol=1e-8)
    assert torch.allclose(st["mean"], X @ u_ref, atol=1e-8)
    var_ref = torch.einsum("ij,jk,ik->i", X, torch.linalg.inv(A1), X)
    assert torch.allclose(st["var"], var_ref, atol=1e-8)
    assert abs(st["log_det"] - float(torch.logdet(A1))) < 1e-8
    # rows are the chosen pool rows; labels asked once per case
    assert torch.allclose(rows, X[h.chosen], atol=1e-14)
    assert sum(calls) == 12 + 4
    # the new gamma_i minimise phi_i at the exact marginals before each inclusion: gamma > gamma_0 = 4
    assert bool((gam > 4).all())


def test_first_choice_is_argmax_of_cu_from_dense_marginals():
    X, y = _data(seed=1)
    L = ActiveLearner(_model, X, lambda i: y[i], score="cu", refit_every=1, variance="exact", progress=False)
    h = L.run(1, init=torch.arange(15))
    res = L.last_block["result"]
    cov = torch.linalg.inv(res.posterior.precision_operator.to_dense())
    s = classifier_uncertainty(X @ res.posterior.loc, torch.einsum("ij,jk,ik->i", X, cov, X))
    s[:15] = -math.inf
    assert h.chosen[0] == int(torch.argmax(s))
    assert abs(h.scores[0] - float(s.max())) < 1e-10


@pytest.mark.parametrize("score", ["cu", "ig", "random"])
def test_history_and_test_error(score):
    X, y = _data(N=200, seed=2)
    L = ActiveLearner(_model, X[:150], lambda i: y[:150][i], score=score, refit_every=3, variance="exact",
                      progress=False)
    h = L.run(7, init=torch.arange(10), X_test=X[150:], y_test=y[150:])
    assert len(h.chosen) == 7 and len(set(h.chosen)) == 7 and not set(h.chosen) & set(range(10))
    assert h.num_included == [10, 13, 16, 17]
    assert len(h.test_error) == 4 and len(h.seconds) == 4
    w = h.result.posterior.loc
    assert abs(h.test_error[-1] - float((((X[150:] @ w) > 0).to(D) != y[150:]).double().mean())) < 1e-12
    assert all(b >= a for a, b in zip(h.seconds, h.seconds[1:]))


def test_lanczos_sparse_pool_and_laplace_prior():
    X, y = _data(N=120, n=6, seed=3)
    Xs = X.to_sparse_csr()
    assert torch.allclose(_take_rows(Xs, [3, 1]).to_dense(), X[[3, 1]])
    L = ActiveLearner(_laplace_model, Xs, lambda i: y[i], score="ig", refit_every=2, lanczos_rank=6, progress=False)
    h = L.run(4, init=torch.arange(20))
    assert len(h.chosen) == 4
    assert torch.isfinite(h.result.posterior.loc).all()


def test_validation():
    X, y = _data(N=30)
    with pytest.raises(ValueError, match="score"):
        ActiveLearner(_model, X, lambda i: y[i], score="bald")
    with pytest.raises(ValueError, match="refit_every"):
        ActiveLearner(_model, X, lambda i: y[i], refit_every=0)
    with pytest.raises(ValueError, match="lanczos_rank"):
        ActiveLearner(_model, X, lambda i: y[i], lanczos_rank=0)
    with pytest.raises(TypeError, match="block_size"):  # the old name is gone, not silently ignored
        ActiveLearner(_model, X, lambda i: y[i], block_size=2)
    L = ActiveLearner(_model, X, lambda i: 2 * y[i], variance="exact", progress=False)
    with pytest.raises(ValueError, match="oracle"):
        L.run(1, init=torch.arange(5))
    L = ActiveLearner(_model, X, lambda i: y[i], variance="exact", progress=False)
    with pytest.raises(ValueError, match="init"):
        L.run(1, init=[1, 1])
    with pytest.raises(ValueError, match="num_inclusions"):
        L.run(40, init=torch.arange(5))


@pytest.mark.filterwarnings("ignore::pyro_convexvb.ConvergenceWarning")  # iterations capped on purpose
@pytest.mark.parametrize("model", [_model, _laplace_model])
def test_block_end_refit_reuses_kept_marginals_single_lanczos(model):
    """Nickisch & Seeger 2009 §3: the refit's first outer update comes from the rank-one-updated marginals.

    With exact variances, the kept-valid ``z`` of all model sites equals the dense
    ``diag(B A'^{-1} B^T)`` of the enlarged model at ``gamma_init``, so the warm refit equals a cold
    one-outer-iteration refit from the same ``gamma``; with Lanczos, a block costs one Lanczos run.
    """
    X, y = _data(N=120, n=4, seed=3)
    L = ActiveLearner(model, X, lambda i: y[i], score="cu", refit_every=3, variance="exact", progress=False)
    h = L.run(3, init=torch.arange(10))
    st = L.last_block
    idx = list(range(10)) + h.chosen
    Bd, P = _dense_sites(model, X[idx])
    A = P + Bd.T @ (Bd / st["gamma_init"][:, None])
    z_ref = torch.diagonal(Bd @ torch.linalg.solve(A, Bd.T))
    torch.testing.assert_close(st["z_init"], z_ref, rtol=1e-7, atol=1e-10)
    cold = pcv.ConvexVariationalRelaxation(model, variance="exact", max_outer=1, gamma_init=st["gamma_init"],
                                           progress=False).run(X[idx], y[idx])
    warm = h.result
    # equal up to the inner loop's Newton/CG tolerances (the two start from different u)
    torch.testing.assert_close(warm.state.gamma, cold.state.gamma, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(warm.posterior.loc, cold.posterior.loc, rtol=1e-4, atol=1e-8)
    # Lanczos: one variance step (one Lanczos run) in the block-end refit
    Ll = ActiveLearner(model, X, lambda i: y[i], score="cu", refit_every=3, lanczos_rank=3, progress=False)
    hl = Ll.run(3, init=torch.arange(10))
    assert hl.result.info["mvm"]["lanczos_steps"] == [0, 3]
    assert bool((Ll.last_block["z_init"] > 0).all())


def test_nonpositive_model_variances_are_recomputed_by_cg():
    """Model-site variances that turn nonpositive within a block are recomputed by CG (Nickisch & Seeger 2009 §3)."""
    import numpy as np

    import pyro_convexvb.design.active as active

    X, y = _data(N=80, n=4, seed=5)
    L = ActiveLearner(_model, X, lambda i: y[i], score="cu", refit_every=2, variance="exact", progress=False)
    L.run(2, init=torch.arange(8))
    # corrupt the state the way Lanczos underestimation would and rerun the block end by hand
    st = L.last_block
    assert st["recomputed"] == 0
    res0 = st["result"]
    res0.state = dataclasses.replace(res0.state, z=res0.state.z - 10.0)  # every kept model variance would be negative
    idx = list(range(8))
    L2 = ActiveLearner(_model, X, lambda i: y[i], score="cu", refit_every=2, variance="exact", progress=False)
    alive = torch.ones(80, dtype=torch.bool)
    alive[:8] = False
    hist = active.ActiveHistory()
    L2._block(res0, idx, y[:8], 2, alive, np.random.default_rng(0), hist, None)
    st2 = L2.last_block
    assert st2["recomputed"] == 8
    Bd, P = _dense_sites(_model, X[idx])
    A = P + Bd.T @ (Bd / st2["gamma_init"][:, None])
    z_ref = torch.diagonal(Bd @ torch.linalg.solve(A, Bd.T))
    torch.testing.assert_close(st2["z_init"], z_ref, rtol=1e-7, atol=1e-10)


def test_block_whose_candidates_are_all_dropped_ends_early(monkeypatch):
    """Every candidate's variance turning nonpositive within a block (an underestimated Lanczos variance, here
    forced) ends the block and refits: no case is chosen twice (argmax over all -inf was index 0, a training
    case)."""
    import pyro_convexvb.design.active as active

    X, y = _data(N=20, n=3)
    original = active.rank_one_include
    monkeypatch.setattr(active, "rank_one_include", lambda *a, **k: original(*a, **k)._replace(
        var=original(*a, **k).var - 1e6))
    h = ActiveLearner(_model, X, lambda i: y[i], refit_every=3, variance="exact", progress=False).run(
        3, init=torch.arange(5))
    assert len(h.chosen) == 3 and len(set(h.chosen)) == 3 and not set(h.chosen) & set(range(5))
    assert h.num_included == [5, 6, 7, 8] and all(math.isfinite(s) for s in h.scores)


def test_inputs_are_checked_by_name():
    X, y = _data(N=30)
    oracle = lambda i: y[i]  # noqa: E731
    for kwargs, name in ((dict(seed=-1), "seed"), (dict(cg_tol=-1.0), "cg_tol"),
                         (dict(engine_options={"max_outer": 3}), "engine_options"),
                         (dict(lanczos_rank=5, engine_options={"lanczos_rank": 3}), "engine_options")):
        with pytest.raises(ValueError, match=name):
            ActiveLearner(_model, X, oracle, **kwargs)
    with pytest.raises(ValueError, match="X_pool: has no rows"):
        ActiveLearner(_model, X[:0], oracle)
    Xs = X.clone()
    Xs[3, 1] = float("nan")
    with pytest.raises(ValueError, match="X_pool: contains NaN"):
        ActiveLearner(_model, Xs.to_sparse_csr(), oracle)
    L = ActiveLearner(_model, X, oracle, variance="exact", progress=False)
    with pytest.raises(ValueError, match="init: expected integer"):
        L.run(1, init=[0.5, 1.7, 3.2])
    with pytest.raises(ValueError, match="X_test: expected 5 columns"):
        L.run(1, init=torch.arange(5), X_test=X[:4, :4], y_test=y[:4])
    with pytest.raises(ValueError, match="y_test: labels must be coded"):  # {-1, 1} gave a test error of 0.5
        L.run(1, init=torch.arange(5), X_test=X[:10], y_test=2 * y[:10] - 1)


def test_default_cg_tol_follows_the_pool_dtype():
    """The default cg_tol was 1e-8 in every dtype: a float32 pool warned 'cg did not converge' on inclusions whose
    choices equal the float64 run's. Now max(1e-8, 1000 eps) of the pool's dtype; a given cg_tol stays."""
    X, y = _data(N=80, n=4, seed=3)
    assert ActiveLearner(_model, X, lambda i: y[i], progress=False).cg_tol == 1e-8
    assert ActiveLearner(_model, X.float(), lambda i: y[i], progress=False).cg_tol == pytest.approx(1.1920929e-4)
    assert ActiveLearner(_model, X.float(), lambda i: y[i], cg_tol=1e-6, progress=False).cg_tol == 1e-6
    chosen = {}
    for dt in (torch.float64, torch.float32):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="engine 'convex_relaxation' did not converge")
            warnings.filterwarnings("error", message="cg did not converge")
            h = ActiveLearner(_model, X.to(dt), lambda i: y[i].to(dt), variance="exact", progress=False)
            chosen[dt] = h.run(4, init=torch.arange(10)).chosen
    assert chosen[torch.float32] == chosen[torch.float64]
