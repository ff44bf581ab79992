"""The fused Algorithm 1 kernel of prior_var="auto" (K members in one pass) and Occam's window, float64."""
import numpy as np
import pytest
import scipy.sparse as sp

pytest.importorskip("numba")

from pyro_convexvb.online import OnlineBayesLogistic, make_online_stream  # noqa: E402
from pyro_convexvb.online import _base, _kernels  # noqa: E402
from pyro_convexvb.online._base import AUTO_PRIOR_VARS  # noqa: E402

D = 60


def _stream(n, seed=0, binary=False, weight_std=0.5):
    X, y = make_online_stream(d=D, d_t=8, weight_std=weight_std, binary=binary, seed=seed).take(n)
    return X, y


def _separate(X, y, link, chunks, d=D):
    """K independent learners (NumPy reference path), one per prior variance: ``(n, K)`` predictions, losses."""
    members = [OnlineBayesLogistic(d, prior_var=v, link=link, fast=False) for v in AUTO_PRIOR_VARS]
    p1 = np.empty((len(y), len(members)))
    ll = np.empty((len(y), len(members)))
    for a, b in chunks:
        for k, m in enumerate(members):
            p1[a:b, k], ll[a:b, k] = m.partial_fit(X[a:b], y[a:b], return_predictions=True, return_log_loss=True)
    return p1, ll, members


def _mix(p1, ll, active_rows):
    """Model average by hand: weights ``exp(-cumulative loss)`` over the members marked in ``active_rows``."""
    cum = np.zeros(p1.shape[1])
    p, loss = np.empty(len(p1)), np.empty(len(p1))
    for t in range(len(p1)):
        a = active_rows[t]
        w = np.where(a, np.exp(-(cum - cum[a].min())), 0.0)
        w /= w.sum()
        p[t] = w @ p1[t]
        loss[t] = -np.log(w @ np.exp(-ll[t]))
        cum = cum + ll[t]
    return p, loss


@pytest.mark.parametrize("link", ["logit", "probit"])
def test_fused_kernel_equals_K_separate_learners(link):
    X, y = _stream(400, binary=False)  # values in [0, 1], so x^2 != x
    y = np.where(y > 0, 1.0, -1.0)
    K = len(AUTO_PRIOR_VARS)
    st = np.zeros((K, D, 2))
    mu, s2 = st[..., 0], st[..., 1]
    s2[:] = np.asarray(AUTO_PRIOR_VARS)[:, None]
    n, nnz = X.shape[0], X.nnz
    p_mix, ll_mix = np.empty(n), np.empty(n)
    cum, active, until = np.zeros(K), np.ones(K, np.uint8), np.full(K, n, dtype=np.int64)
    bad = np.zeros(1, dtype=np.uint8)
    _kernels.run_alg1_fused(_kernels.LOGIT if link == "logit" else _kernels.PROBIT, X.indptr.astype(np.int64),
                            X.indices.astype(np.int64), X.data, y, st, p_mix, ll_mix, np.empty((K, nnz)),
                            np.empty((K, nnz)), np.arange(K), cum, active, until, np.inf, bad)
    assert bad[0] == 0  # every value written is a finite mean and a normal variance
    p1, ll, members = _separate(X, y, link, [(0, n)])
    for k, m in enumerate(members):  # every member's posterior is its separate learner's
        np.testing.assert_allclose(mu[k], m.coef_, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(s2[k], m.coef_var_, rtol=1e-12)
    np.testing.assert_allclose(cum, ll.sum(axis=0), rtol=1e-12)
    p_ref, l_ref = _mix(p1, ll, np.ones((n, K), dtype=bool))
    np.testing.assert_allclose(p_mix, p_ref, rtol=1e-12)
    np.testing.assert_allclose(ll_mix, l_ref, rtol=1e-12)
    assert active.all() and (until == n).all()


@pytest.mark.parametrize("link", ["logit", "probit"])
def test_one_learner_runs_the_fused_kernel_and_equals_the_reference(link):
    X, y = _stream(300, seed=3, binary=False)
    fast = OnlineBayesLogistic(D, prior_var=0.3, link=link, fast=True)
    ref = OnlineBayesLogistic(D, prior_var=0.3, link=link, fast=False)
    assert fast._fused() is True
    out_f = [fast.partial_fit(X[a:b], y[a:b], return_predictions=True, return_log_loss=True)
             for a, b in [(0, 120), (120, 300)]]
    out_r = [ref.partial_fit(X[a:b], y[a:b], return_predictions=True, return_log_loss=True)
             for a, b in [(0, 120), (120, 300)]]
    for f, r in zip(out_f, out_r):
        np.testing.assert_allclose(f[0], r[0], rtol=1e-12)
        np.testing.assert_allclose(f[1], r[1], rtol=1e-12)
    np.testing.assert_allclose(fast.coef_, ref.coef_, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(fast.coef_var_, ref.coef_var_, rtol=1e-12)


def test_reader_chunks_are_learned_without_a_copy_and_as_int64_copies(tmp_path):
    from pyro_convexvb.online import iter_csv

    rng = np.random.default_rng(0)
    path = tmp_path / "t.csv"
    path.write_text("".join(f"{rng.integers(0, 2)},{rng.integers(0, 40)},c{rng.integers(0, 30)}\n"
                            for _ in range(500)))
    (X, y), = list(iter_csv(path, chunk_size=1000, integer_columns=(1,), categorical_columns=(2,),
                            num_features=64, prefetch=False))
    assert X.indices.dtype == np.int32 and X.has_canonical_format
    before = (X.indices.copy(), X.data.copy(), X.indptr.copy())
    a = OnlineBayesLogistic(64).partial_fit(X, y, return_log_loss=True)
    X64 = sp.csr_matrix((X.data.copy(), X.indices.astype(np.int64), X.indptr.astype(np.int64)), shape=X.shape)
    b = OnlineBayesLogistic(64).partial_fit(X64, y, return_log_loss=True)
    np.testing.assert_array_equal(a, b)
    for old, new in zip(before, (X.indices, X.data, X.indptr)):
        np.testing.assert_array_equal(old, new)  # the caller's chunk is untouched
    # a matrix with stored zeros or duplicates is copied before it is cleaned: the caller's matrix stays as given
    Xd = sp.csr_matrix((np.array([1.0, 0.0, 2.0]), np.array([3, 5, 3]), np.array([0, 3])), shape=(1, 64))
    OnlineBayesLogistic(64).partial_fit(Xd, [1])
    assert Xd.nnz == 3 and Xd.data.tolist() == [1.0, 0.0, 2.0]


@pytest.mark.parametrize("fast", [False, True])
def test_dropping_members_moves_predictions_by_at_most_their_weight(fast, monkeypatch):
    """Occam's window: the windowed average differs from the full average by at most the full average's
    weight on the members the window has dropped (``|p_window - p_full| <= W_out(t)``), and a member leaves when
    that weight is below ``exp(-AUTO_LOG_WINDOW)``."""
    window = 3.0  # narrow, so that members leave on a short stream
    X, y = make_online_stream(d=400, d_t=30, weight_std=0.08, seed=2).take(1200)
    chunks = [(0, 500), (500, 501), (501, 1200)]
    monkeypatch.setattr(_base, "AUTO_LOG_WINDOW", window)
    m = OnlineBayesLogistic(400, fast=fast)
    outs = [m.partial_fit(X[a:b], y[a:b], return_predictions=True, return_log_loss=True) for a, b in chunks]
    p_win = np.concatenate([o[0] for o in outs])
    monkeypatch.setattr(_base, "AUTO_LOG_WINDOW", np.inf)
    full = OnlineBayesLogistic(400, fast=fast)
    p_full = np.concatenate([full.partial_fit(X[a:b], y[a:b], return_predictions=True) for a, b in chunks])
    # the separate learners give the members' losses; replay the window's rule on them
    members = [OnlineBayesLogistic(400, prior_var=v, fast=False) for v in AUTO_PRIOR_VARS]
    ll = np.stack([mm.partial_fit(X, y, return_log_loss=True) for mm in members], axis=1)
    n, K = ll.shape
    cum = np.zeros(K)
    active = np.ones(K, dtype=bool)
    w_out = np.empty(n)
    for t in range(n):
        w = np.exp(-(cum - cum.min()))
        w /= w.sum()
        w_out[t] = w[~active].sum()
        cum = cum + ll[t]
        drop = active & (cum - cum[active].min() > window)
        if drop.any():
            w_next = np.exp(-(cum - cum.min()))
            assert (w_next[drop] / w_next[active].max() < np.exp(-window)).all()
        active &= ~drop
    assert m.state_dict()["extra"]["member_active"] == active.tolist()
    assert not active.all()  # members did leave on this stream
    np.testing.assert_allclose(p_full, _mix(*_separate(X, y, "logit", [(0, n)], d=400)[:2], np.ones((n, K), bool))[0],
                               rtol=1e-12)
    assert np.all(np.abs(p_win - p_full) <= w_out + 1e-12)
    assert np.abs(p_win - p_full).max() > 0  # the bound is not vacuous here: the window changed something


def test_fused_kernel_flags_a_variance_below_the_smallest_normal_float64():
    """The fused kernel checks the values it writes (the chunk's state check is skipped on that path): a variance
    of 3e-308 shrunk by a row with x = 1e154 (x^2 v = 3, finite score moments) falls below 2.2e-308 and sets
    ``bad``; a variance of 1e-300 stays normal and does not."""
    indptr, indices, data = np.array([0, 1], dtype=np.int64), np.array([0], dtype=np.int64), np.array([1e154])
    for v0, expected in ((3e-308, 1), (1e-300, 0)):
        st = np.array([[[0.0, v0]]])
        bad = np.zeros(1, dtype=np.uint8)
        _kernels.run_alg1_fused(_kernels.LOGIT, indptr, indices, data, np.array([1.0]), st, np.empty(1),
                                np.empty(1), np.empty((1, 1)), np.empty((1, 1)), np.zeros(1, dtype=np.int64),
                                np.zeros(1), np.ones(1, np.uint8), np.full(1, 1, dtype=np.int64), np.inf, bad)
        assert int(bad[0]) == expected, (v0, st)


def test_fused_path_refuses_a_chunk_whose_update_leaves_a_subnormal_variance():
    """End to end on the default (fused) path: the kernel's flag makes partial_fit refuse the chunk and undo it."""
    import scipy.sparse as sp
    import torch

    from pyro_convexvb.online import OnlineBayesLogistic

    est = OnlineBayesLogistic(num_features=4, prior_var=1.0)
    est.partial_fit(sp.csr_matrix(np.array([[1.0, 0, 0, 0]])), np.array([1]), classes=[0, 1])
    st = est.state_dict()
    st["s2"] = torch.tensor([3e-308, 1.0, 1.0, 1.0], dtype=torch.float64)  # a normal float64, just above tiny
    st["mu"] = torch.zeros(4, dtype=torch.float64)  # a zero score: the update's curvature term is 1/4
    est.load_state_dict(st)
    before = {k: v.clone() if hasattr(v, "clone") else v for k, v in est.state_dict().items()}
    with pytest.raises(FloatingPointError, match="row 0 of this batch, column 0"):
        est.partial_fit(sp.csr_matrix(np.array([[1e154, 0, 0, 0]])), np.array([1]))
    after = est.state_dict()
    for k, v in before.items():
        assert (bool((after[k] == v).all()) if hasattr(v, "clone") else after[k] == v), k


@pytest.mark.parametrize("prior_var", [0.3, "auto"])
def test_pickled_learner_keeps_the_interleaved_state_and_continues_identically(prior_var):
    """A pickle stores the fused kernel's (K, d, 2) state once; the loaded learner's ``_mu``/``_s2`` are views of
    it again, so its next chunk gives the same numbers as the original's."""
    import pickle

    X, y = _stream(300, seed=5, binary=False)
    a = OnlineBayesLogistic(D, prior_var=prior_var, fast=True)
    a.partial_fit(X[:150], y[:150], classes=[-1, 1])
    b = pickle.loads(pickle.dumps(a))
    assert b._pair is not None and np.shares_memory(b._mu, b._pair) and np.shares_memory(b._s2, b._pair)
    assert "_mu" not in a.__getstate__() and "_s2" not in a.__getstate__()
    pa = a.partial_fit(X[150:], y[150:], return_predictions=True)
    pb = b.partial_fit(X[150:], y[150:], return_predictions=True)
    np.testing.assert_array_equal(pa, pb)
    np.testing.assert_array_equal(a.coef_, b.coef_)
    np.testing.assert_array_equal(a.coef_var_, b.coef_var_)


def test_fit_on_labels_of_one_class_raises_as_scikit_learn():
    """fit restarts from the prior, so one numeric class (1.0) cannot tell the other (0 or -1): it raised nothing
    and invented classes_ [0, 1]; scikit-learn's SGDClassifier raises.  partial_fit with classes= still takes a
    stream whose first rows hold one class."""
    import scipy.sparse as sp

    X = sp.random(20, 5, density=0.5, format="csr", random_state=0)
    for y in (np.ones(20), np.full(20, "spam")):
        with pytest.raises(ValueError, match="number of classes has to be greater than one; got 1 class"):
            OnlineBayesLogistic(5).fit(X, y)
    est = OnlineBayesLogistic(5).partial_fit(X, np.ones(20), classes=[0, 1])
    assert est.classes_.tolist() == [0, 1] and est.n_seen_ == 20
