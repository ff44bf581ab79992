"""prior_var="auto" (Bayesian model averaging over prior variances), transactional partial_fit, plain states."""
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from pyro_convexvb.online import OnlineAdaGradLogistic, OnlineBayesLogistic, OnlineMarginalVB, make_online_stream
from pyro_convexvb.online import equations as eq
from pyro_convexvb.online._base import AUTO_PRIOR_VARS

D = 30


def _data(n=120, seed=0):
    X, y = make_online_stream(d=D, d_t=6, weight_std=0.3, seed=seed).take(n)
    return X, y


def _bma_reference(X, y, chunks, **kw):
    """K independent learners, one per prior variance, mixed row by row by their posterior probabilities."""
    members = [OnlineBayesLogistic(D, prior_var=v, fast=False, **kw) for v in AUTO_PRIOR_VARS]
    p1 = np.empty((len(y), len(members)))
    ll = np.empty((len(y), len(members)))
    for a, b in chunks:
        for k, m in enumerate(members):
            p1[a:b, k], ll[a:b, k] = m.partial_fit(X[a:b], y[a:b], return_predictions=True, return_log_loss=True)
    p_mix, l_mix = np.empty(len(y)), np.empty(len(y))
    cum = np.zeros(len(members))
    for t in range(len(y)):
        w = np.exp(-(cum - cum.min()))
        w /= w.sum()
        p_mix[t] = w @ p1[t]
        l_mix[t] = -np.log(w @ np.exp(-ll[t]))
        cum = cum + ll[t]
    w = np.exp(-(cum - cum.min()))
    return p_mix, l_mix, w / w.sum(), members


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_auto_prior_is_the_bayesian_model_average_of_the_grid(fast, batch_size):
    X, y = _data()
    chunks = [(0, 50), (50, 51), (51, 120)]
    p_ref, l_ref, w_ref, members = _bma_reference(X, y, chunks, batch_size=batch_size)
    m = OnlineBayesLogistic(D, batch_size=batch_size, fast=fast)
    assert m.prior_var == "auto"
    out = [m.partial_fit(X[a:b], y[a:b], return_predictions=True, return_log_loss=True) for a, b in chunks]
    np.testing.assert_allclose(np.concatenate([o[0] for o in out]), p_ref, rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([o[1] for o in out]), l_ref, rtol=1e-12)
    np.testing.assert_allclose(m.prior_var_weights_, w_ref, rtol=1e-10)
    assert m.cumulative_log_loss_ == pytest.approx(l_ref.sum(), rel=1e-12)
    mus = np.stack([mm.coef_ for mm in members], axis=1)
    s2s = np.stack([mm.coef_var_ for mm in members], axis=1)
    np.testing.assert_allclose(m.coef_, mus @ w_ref, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(m.coef_var_, (s2s + mus ** 2) @ w_ref - (mus @ w_ref) ** 2, rtol=1e-9)
    # predictions of the average on new rows
    Xn, _ = _data(n=7, seed=9)
    p_new = np.stack([mm.predict_proba(Xn)[:, 1] for mm in members], axis=1) @ w_ref
    np.testing.assert_allclose(m.predict_proba(Xn)[:, 1], p_new, rtol=1e-10)
    np.testing.assert_allclose(np.exp(m.predict_log_proba(Xn)[:, 1]), p_new, rtol=1e-10)
    # the average is never worse than the best member by more than log K
    assert l_ref.sum() <= min(mm.cumulative_log_loss_ for mm in members) + np.log(len(members)) + 1e-9


def test_auto_prior_chooses_the_small_variance_on_many_weak_features():
    X, y = make_online_stream(d=2000, d_t=40, weight_std=0.08, seed=1).take(4000)
    m = OnlineBayesLogistic(2000).fit(X, y)
    assert np.argmax(m.prior_var_weights_) == 0  # prior_var = 0.01: the weights are N(0, 0.08^2)
    assert OnlineBayesLogistic(2000, prior_var=0.01).fit(X, y).cumulative_log_loss_ < \
        OnlineBayesLogistic(2000, prior_var=1.0).fit(X, y).cumulative_log_loss_
    with pytest.raises(ValueError, match="prior_var: 'auto' is implemented for OnlineBayesLogistic only"):
        OnlineMarginalVB(5, prior_var="auto").partial_fit(np.eye(5)[:2], [0, 1])
    with pytest.raises(ValueError, match="prior_var: expected"):
        OnlineBayesLogistic(5, prior_var="wide").partial_fit(np.eye(5)[:2], [0, 1])


# ----------------------------------------------------------------------------- transactional partial_fit
def _arrays(m):
    return {k: np.array(v, copy=True) for k, v in m._state_arrays().items()}


@pytest.mark.parametrize("prior_var", [1.0, "auto"])
def test_interrupted_reference_chunk_is_rolled_back(monkeypatch, prior_var):
    X, y = _data()
    m = OnlineBayesLogistic(D, prior_var=prior_var, fast=False)
    m.partial_fit(X[:40], y[:40])
    before = _arrays(m), m.n_seen_, m.cumulative_log_loss_, m.state_dict()
    calls = {"n": 0}
    real = eq.taylor_mean

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 17:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(eq, "taylor_mean", flaky)
    with pytest.raises(KeyboardInterrupt):
        m.partial_fit(X[40:], y[40:])
    assert calls["n"] == 17
    for k, v in _arrays(m).items():
        np.testing.assert_array_equal(v, before[0][k])
    assert (m.n_seen_, m.cumulative_log_loss_) == before[1:3]
    if prior_var == "auto":
        assert m.state_dict()["extra"] == before[3]["extra"]
    monkeypatch.setattr(eq, "taylor_mean", real)
    ll = m.partial_fit(X[40:], y[40:], return_log_loss=True)  # as if the interrupted call never happened
    whole = OnlineBayesLogistic(D, prior_var=prior_var, fast=False)
    np.testing.assert_allclose(ll, whole.partial_fit(X, y, return_log_loss=True)[40:], rtol=1e-13)


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("prior_var", [1.0, "auto"])
def test_interrupt_after_the_kernel_is_rolled_back(monkeypatch, prior_var, batch_size):
    X, y = _data()
    m = OnlineBayesLogistic(D, prior_var=prior_var, batch_size=batch_size, fast=True)
    m.partial_fit(X[:40], y[:40])
    before = _arrays(m), m.n_seen_, m.cumulative_log_loss_
    real = type(m)._run_fast

    def interrupted(self, *a):
        real(self, *a)  # the kernel ran over the whole chunk, then the interrupt arrives
        raise KeyboardInterrupt

    monkeypatch.setattr(type(m), "_run_fast", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m.partial_fit(X[40:], y[40:])
    for k, v in _arrays(m).items():
        np.testing.assert_array_equal(v, before[0][k])
    assert (m.n_seen_, m.cumulative_log_loss_) == before[1:3]
    # the first call rolled back leaves an unfitted estimator
    fresh = OnlineBayesLogistic(D, prior_var=prior_var, fast=True)
    with pytest.raises(KeyboardInterrupt):
        fresh.partial_fit(X[:10], y[:10])
    assert not hasattr(fresh, "n_seen_") and not hasattr(fresh, "classes_")


# ----------------------------------------------------------------------------- states
def test_state_dict_is_plain_and_loads_with_torch_weights_only(tmp_path):
    X, y = _data(n=30)
    labels = np.where(y > 0, "spam", "ham")
    ests = [OnlineBayesLogistic(D).partial_fit(X, labels),
            OnlineBayesLogistic(D, prior_var=np.full(D, 0.5), prior_mean=np.float64(0.1)).partial_fit(X, y),
            OnlineMarginalVB(D, prior_var=np.float64(0.3)).partial_fit(X, y),
            OnlineAdaGradLogistic(D).partial_fit(X, y)]
    for m in ests:
        path = tmp_path / f"{type(m).__name__}.pt"
        torch.save(m.state_dict(), path)
        state = torch.load(path)  # weights_only=True: no NumPy objects allowed
        r = type(m).from_state_dict(state)
        Xn, _ = _data(n=5, seed=3)
        np.testing.assert_array_equal(r.predict_proba(Xn), m.predict_proba(Xn))
        np.testing.assert_array_equal(r.classes_, m.classes_)
        yn = m.classes_[(_data(n=5, seed=3)[1] > 0).astype(int)]
        l1 = m.partial_fit(Xn, yn, return_log_loss=True)
        l2 = r.partial_fit(Xn, yn, return_log_loss=True)
        np.testing.assert_array_equal(l1, l2)


@pytest.mark.parametrize("key, value, match", [
    ("s2", lambda s: -s["s2"], r"state\['s2'\]: expected positive values"),
    ("s2", lambda s: s["s2"] * float("nan"), r"state\['s2'\]: holds NaN"),
    ("mu", lambda s: s["mu"][:-1], r"state\['mu'\]: expected shape"),
    ("n_seen", lambda s: -1, r"state\['n_seen'\]: expected a non-negative integer"),
    ("n_seen", lambda s: 2.5, r"state\['n_seen'\]"),
    ("cumulative_log_loss", lambda s: float("nan"), r"state\['cumulative_log_loss'\]"),
    ("classes", lambda s: [1, 1], r"state\['classes'\]"),
])
def test_from_state_dict_validates_and_names_the_key(key, value, match):
    X, y = _data(n=20)
    m = OnlineBayesLogistic(D, prior_var=1.0).partial_fit(X, y)
    state = m.state_dict()
    state[key] = value(state)
    with pytest.raises(ValueError, match=match):
        OnlineBayesLogistic.from_state_dict(state)
    fresh = OnlineBayesLogistic(D, prior_var=1.0)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
    assert not hasattr(fresh, "n_seen_")  # nothing half-loaded
    state = m.state_dict()
    del state["n_skipped"]
    with pytest.raises(ValueError, match=r"state\['n_skipped'\]: missing"):
        OnlineBayesLogistic.from_state_dict(state)
    auto = OnlineBayesLogistic(D).partial_fit(X, y).state_dict()
    auto["extra"]["member_log_loss"] = [1.0, -2.0, 3.0]
    with pytest.raises(ValueError, match=r"member_log_loss"):
        OnlineBayesLogistic.from_state_dict(auto)
    ada = OnlineAdaGradLogistic(D).partial_fit(X, y).state_dict()
    ada["G"] = -ada["G"] - 1
    with pytest.raises(ValueError, match=r"state\['G'\]: expected nonnegative"):
        OnlineAdaGradLogistic.from_state_dict(ada)


def test_sparse_input_stays_sparse_with_auto():
    X, y = _data(n=10)
    m = OnlineBayesLogistic(D).partial_fit(sp.csr_matrix(X), y)
    assert m._mu.shape == (D, len(AUTO_PRIOR_VARS))


@pytest.mark.parametrize("fast", [False, True])
def test_occams_window_drops_members_for_good_and_rolls_back(fast, monkeypatch):
    from pyro_convexvb.online import _base

    X, y = make_online_stream(d=400, d_t=30, weight_std=0.08, seed=2).take(3000)
    monkeypatch.setattr(_base, "AUTO_LOG_WINDOW", 3.0)  # a narrow window, so members leave on a short stream
    m = OnlineBayesLogistic(400, fast=fast)
    ll = np.concatenate([m.partial_fit(X[a:a + 500], y[a:a + 500], return_log_loss=True)
                         for a in range(0, 3000, 500)])
    active = m.state_dict()["extra"]["member_active"]
    assert active == [True, False, False]  # prior_var = 0.01 fits N(0, 0.08^2) weights
    assert m.prior_var_weights_.tolist() == [1.0, 0.0, 0.0]
    # the same rows in one chunk give the same numbers (the window is checked row by row)
    one = OnlineBayesLogistic(400, fast=fast)
    np.testing.assert_allclose(one.partial_fit(X, y, return_log_loss=True), ll, rtol=1e-12)
    # after the others left, the average is the remaining member: it matches a lone learner's updates
    frozen = m._mu[:, 1:].copy()
    Xn, yn = make_online_stream(d=400, d_t=30, weight_std=0.08, seed=3).take(200)
    m.partial_fit(Xn, yn)
    np.testing.assert_array_equal(m._mu[:, 1:], frozen)
    # a rolled-back chunk restores the members outside the window untouched
    before = _arrays(m)
    real = type(m)._run_fast if fast else type(m)._run_reference

    def interrupted(self, *a):
        real(self, *a)
        raise KeyboardInterrupt

    monkeypatch.setattr(type(m), "_run_fast" if fast else "_run_reference", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m.partial_fit(Xn, yn)
    for k, v in _arrays(m).items():
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize("fast", [False, True])
def test_rollback_of_a_chunk_in_which_members_leave_the_window(fast, monkeypatch):
    from pyro_convexvb.online import _base

    X, y = make_online_stream(d=400, d_t=30, weight_std=0.08, seed=2).take(3000)
    monkeypatch.setattr(_base, "AUTO_LOG_WINDOW", 3.0)
    m = OnlineBayesLogistic(400, fast=fast).partial_fit(X[:10], y[:10])
    twin = OnlineBayesLogistic.from_state_dict(m.state_dict(), fast=fast)
    twin.partial_fit(X[10:], y[10:])
    assert twin.state_dict()["extra"]["member_active"] == [True, False, False]  # they leave in this chunk
    before = _arrays(m), m.state_dict()["extra"]
    real = type(m)._run_fast if fast else type(m)._run_reference

    def interrupted(self, *a):
        real(self, *a)
        raise KeyboardInterrupt

    monkeypatch.setattr(type(m), "_run_fast" if fast else "_run_reference", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m.partial_fit(X[10:], y[10:])
    for k, v in _arrays(m).items():
        np.testing.assert_array_equal(v, before[0][k])
    assert m.state_dict()["extra"] == before[1]


@pytest.mark.parametrize("fast", [False, True])
def test_members_leaving_on_a_chunks_last_row_leave_whatever_the_chunking(fast):
    """A member that leaves Occam's window on the last row of a chunk leaves then (it stayed, updated with a weight
    of 1e-13, when every chunk was one row, since 'left on the last row' and 'stayed' were stored alike): row by
    row equals one call, in predictions, active set and weights."""
    X, y = make_online_stream(d=D, d_t=6, weight_std=3.0, seed=2).take(400)
    one = OnlineBayesLogistic(D, fast=fast)
    p_one = one.partial_fit(X, y, return_predictions=True)
    rows = OnlineBayesLogistic(D, fast=fast)
    p_rows = np.concatenate([rows.partial_fit(X[i:i + 1], y[i:i + 1], classes=np.unique(y), return_predictions=True)
                             for i in range(X.shape[0])])
    assert not one._member_active.all()  # members did leave on this stream
    np.testing.assert_array_equal(rows._member_active, one._member_active)
    np.testing.assert_allclose(p_rows, p_one, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(rows.prior_var_weights_ == 0, one.prior_var_weights_ == 0)
