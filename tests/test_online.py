"""Online estimators of Shamir & Szpankowski 2021: fast path vs reference path, progressive validation, state,
mini-batches, input validation, regret determinism."""
import math
import sys

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from pyro_convexvb.errors import ConvergenceWarning
from pyro_convexvb.online import (OnlineADF, OnlineAdaGradLogistic, OnlineBayesLogistic, OnlineDimGauss,
                                  OnlineMarginalVB)
from pyro_convexvb.online import equations as eq
from pyro_convexvb.online.streams import make_online_stream, progressive_regret

numba = pytest.importorskip("numba", reason="the fast path needs numba")

D = 30


def _data(n=300, d=D, binary=True, seed=0, empty_rows=True):
    rng = np.random.default_rng(seed)
    X = sp.random(n, d, density=0.2, format="csr", random_state=seed)
    X.data = np.ones_like(X.data) if binary else rng.uniform(-1, 1, X.nnz)
    if empty_rows:
        X = sp.vstack([X[:5], sp.csr_matrix((2, d)), X[5:]], format="csr")
    theta = rng.normal(size=d)
    y = np.where(rng.random(X.shape[0]) < 1 / (1 + np.exp(-(X @ theta))), 1, -1)
    return X, y


CONFIGS = [
    (OnlineBayesLogistic, dict(mean_update="taylor", variance_update="laplace")),
    (OnlineBayesLogistic, dict(mean_update="taylor", variance_update="value")),
    (OnlineBayesLogistic, dict(mean_update="newton", variance_update="laplace")),
    (OnlineBayesLogistic, dict(mean_update="newton", variance_update="value")),
    (OnlineADF, {}),
    (OnlineDimGauss, dict(mean_update="taylor")),
    (OnlineDimGauss, dict(mean_update="newton")),
    (OnlineMarginalVB, dict(num_samples=16)),
]


@pytest.mark.parametrize("link", ["logit", "probit"])
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("cls,kw", CONFIGS)
def test_fast_path_equals_reference_path(cls, kw, batch_size, link):
    X, y = _data(binary=(batch_size == 1))
    n = 120 if cls is OnlineMarginalVB else X.shape[0]
    fast = cls(D, link=link, batch_size=batch_size, prior_var=1.5, fast=True, **kw)
    ref = cls(D, link=link, batch_size=batch_size, prior_var=1.5, fast=False, **kw)
    pf, lf = fast.partial_fit(X[:n], y[:n], return_predictions=True, return_log_loss=True)
    pr, lr = ref.partial_fit(X[:n], y[:n], return_predictions=True, return_log_loss=True)
    np.testing.assert_allclose(pf, pr, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lf, lr, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(fast.coef_, ref.coef_, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(fast.coef_var_, ref.coef_var_, rtol=1e-12, atol=1e-13)
    assert fast.n_unconverged_ == ref.n_unconverged_ == 0


@pytest.mark.parametrize("cls", [OnlineBayesLogistic])
@pytest.mark.parametrize("tol,max_iter", [(1e-9, 1), (1e-9, 2), (1e-2, 50), (1e-4, 50)])
def test_newton_paths_agree_where_the_iteration_stops_early(cls, tol, max_iter):
    """Loose ``tol`` or a small ``max_iter``: Algorithm 1's fast kernel (Newton in the score) stopped on its own
    scale and read the mean off psi1 of the last score, 1e-3 (max_iter=1) away from the reference path's iterate
    in ``w``, with different ``n_unconverged_``. Now the same iterates and stopping rule. (DimGauss's kernel still
    reads psi1 of the last score: the two paths agree where its Newton iteration converges.)"""
    X, y = _data()
    kw = dict(prior_var=1.5, mean_update="newton", tol=tol, max_iter=max_iter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = cls(D, fast=True, **kw).fit(X, y)
        ref = cls(D, fast=False, **kw).fit(X, y)
    np.testing.assert_allclose(fast.coef_, ref.coef_, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(fast.coef_var_, ref.coef_var_, rtol=1e-12, atol=1e-13)
    assert fast.n_unconverged_ == ref.n_unconverged_


@pytest.mark.parametrize("link", ["logit", "probit"])
def test_adagrad_fast_equals_reference(link):
    X, y = _data(binary=False)
    a = OnlineAdaGradLogistic(D, learning_rate=0.3, link=link, fast=True)
    b = OnlineAdaGradLogistic(D, learning_rate=0.3, link=link, fast=False)
    np.testing.assert_allclose(a.partial_fit(X, y, return_predictions=True),
                               b.partial_fit(X, y, return_predictions=True), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(a.coef_, b.coef_, rtol=1e-12, atol=1e-13)


def test_one_row_of_algorithm1_by_hand():
    """The estimator's first update is Eqs. (6)-(8), (17), (19) applied to the prior."""
    x = np.array([1.0, 0.5, -0.7])
    X = sp.csr_matrix((x, [0, 3, 7], [0, 3]), shape=(1, 10))
    m = OnlineBayesLogistic(10, prior_mean=0.1, prior_var=0.8, fast=False)
    p = m.partial_fit(X, [0], return_predictions=True)[0]
    mu_i, s2_i = np.full(3, 0.1), np.full(3, 0.8)
    mu_t, s2_t = float(x @ mu_i), float(x**2 @ s2_i)
    assert p == pytest.approx(1 / (1 + math.exp(-mu_t / math.sqrt(1 + math.pi * s2_t / 8))), rel=1e-14)
    y = -1.0
    s2m = s2_t - x**2 * s2_i
    c = np.sqrt(1 + math.pi / 8 * s2m)
    p_i = 1 / (1 + np.exp(-y * mu_t / c))  # Eq. (16)
    mu_new = mu_i + y * x * s2_i * (1 - p_i) / (c * (1 + x**2 * s2_i * (1 - p_i) * p_i / c**2))  # Eq. (17)
    pp = 1 / (1 + np.exp(-y * (mu_t - x * mu_i + x * mu_new) / c))  # Eq. (14)
    s2_new = 1 / (1 / s2_i + x**2 / c**2 * pp * (1 - pp))  # Eq. (19)
    np.testing.assert_allclose(m.coef_[[0, 3, 7]], mu_new, rtol=1e-14)
    np.testing.assert_allclose(m.coef_var_[[0, 3, 7]], s2_new, rtol=1e-14)
    untouched = np.setdiff1d(np.arange(10), [0, 3, 7])
    assert np.all(m.coef_[untouched] == 0.1) and np.all(m.coef_var_[untouched] == 0.8)


@pytest.mark.parametrize("fast", [True, False])
def test_progressive_predictions_are_made_before_each_update(fast):
    X, y = _data(n=40)
    whole = OnlineBayesLogistic(D, mean_update="newton", fast=fast)
    p_all = whole.partial_fit(X, y, return_predictions=True)
    step = OnlineBayesLogistic(D, mean_update="newton", fast=fast)
    assert p_all[0] == 0.5  # the prior's prediction (mean 0)
    for t in range(X.shape[0]):
        if t:  # predicting before any fit is refused (NotFittedError), as in scikit-learn
            assert step.predict_proba(X[t])[0, 1] == pytest.approx(p_all[t], rel=1e-13)
        step.partial_fit(X[t], y[t:t + 1])
    np.testing.assert_allclose(step.coef_, whole.coef_, rtol=1e-13)
    assert step.cumulative_log_loss_ == pytest.approx(whole.cumulative_log_loss_, rel=1e-12)


def test_empty_rows_predict_the_prior_and_change_nothing():
    m = OnlineBayesLogistic(5, prior_mean=0.0, fast=False)
    p = m.partial_fit(sp.csr_matrix((3, 5)), [1, 0, 1], return_predictions=True)
    np.testing.assert_array_equal(p, 0.5)
    np.testing.assert_array_equal(m.coef_, 0.0)
    assert m.n_seen_ == 3 and m.cumulative_log_loss_ == pytest.approx(3 * math.log(2))


def test_label_codings_agree_and_bad_labels_are_rejected():
    X, y = _data(n=50, empty_rows=False)
    a = OnlineBayesLogistic(D).partial_fit(X, y)
    b = OnlineBayesLogistic(D).partial_fit(X, (y + 1) // 2)
    np.testing.assert_array_equal(a.coef_, b.coef_)
    assert set(np.unique(b.predict(X))) <= {0, 1}
    assert set(np.unique(a.predict(X))) <= {-1, 1}
    with pytest.raises(ValueError, match="Only binary classification is supported"):
        OnlineBayesLogistic(D).partial_fit(X, np.where(y > 0, 2, 0) + (np.arange(50) % 7 == 0))
    with pytest.raises(ValueError, match="y: mixes"):
        OnlineBayesLogistic(D).partial_fit(X[:3], [0, -1, 1])
    with pytest.raises(ValueError, match="y: expected 50 labels"):
        OnlineBayesLogistic(D).partial_fit(X, y[:-1])
    with pytest.raises(ValueError, match="earlier batches"):
        OnlineBayesLogistic(D).partial_fit(X[:2], [0, 1]).partial_fit(X[:2], [-1, 1])


def test_bad_inputs_name_the_argument():
    """Inputs are checked by scikit-learn's validators; options when the state is created (fit/partial_fit)."""
    with pytest.raises(ValueError, match="Input X contains NaN"):
        OnlineBayesLogistic(3).partial_fit(np.array([[1.0, np.nan, 0.0]]), [1])
    with pytest.raises(ValueError, match="X: expected 3 columns"):
        OnlineBayesLogistic(3).partial_fit(np.ones((2, 4)), [1, 0])
    with pytest.raises(ValueError, match="Expected 2D array"):
        OnlineBayesLogistic(3).partial_fit(np.ones(3), [1])
    with pytest.raises(ValueError, match="has 4 features"):
        OnlineBayesLogistic().partial_fit(np.ones((2, 3)), [1, 0]).partial_fit(np.ones((2, 4)), [1, 0])
    X1, y1 = np.eye(3), [1, 0, 1]
    for kwargs, name in [(dict(prior_var=0.0), "prior_var"), (dict(prior_mean=np.ones(2)), "prior_mean"),
                         (dict(link="cauchit"), "link"), (dict(mean_update="exact"), "mean_update"),
                         (dict(variance_update="ep"), "variance_update"), (dict(num_features=0), "num_features"),
                         (dict(batch_size=0), "batch_size"), (dict(tol=-1.0), "tol"), (dict(max_iter=0), "max_iter"),
                         (dict(hashing=-2, num_features=3), "hashing"), (dict(hashing=True), "num_features")]:
        est = OnlineBayesLogistic(**kwargs)  # construction stores the arguments unchanged
        assert est.get_params()[next(iter(kwargs))] is kwargs[next(iter(kwargs))]
        with pytest.raises(ValueError, match=name):
            est.partial_fit(X1, y1)
    with pytest.raises(ValueError, match="batch_size"):
        OnlineADF(3, batch_size=0).fit(X1, y1)
    with pytest.raises(ValueError, match="learning_rate"):
        OnlineAdaGradLogistic(learning_rate=0).fit(X1, y1)
    with pytest.raises(ValueError, match="num_samples"):
        OnlineMarginalVB(num_samples=1.5).fit(X1, y1)
    m = OnlineBayesLogistic().fit(X1, y1)
    m.set_params(prior_var=2.0)
    with pytest.raises(ValueError, match="prior_var: changed after the stream started"):
        m.partial_fit(X1, y1)
    m.fit(X1, y1)  # fit restarts from the new prior
    np.testing.assert_array_equal(m.coef_var_ <= 2.0, True)


def test_fast_true_without_numba_raises_a_clear_error(monkeypatch):
    import pyro_convexvb.online as online

    monkeypatch.setitem(sys.modules, "pyro_convexvb.online._kernels", None)
    monkeypatch.delattr(online, "_kernels", raising=False)
    with pytest.raises(ImportError, match=r"pyro_convexvb\[fast\]"):
        OnlineBayesLogistic(3, fast=True).partial_fit(np.eye(3), [1, 0, 1])
    assert OnlineBayesLogistic(3, fast=None).partial_fit(np.eye(3), [1, 0, 1]).fast_ is False  # reference path


def test_torch_inputs_give_numpy_outputs():
    X, y = _data(n=30)
    Xt = torch.tensor(X.toarray(), dtype=torch.float32)
    m = OnlineBayesLogistic(D)
    p = m.partial_fit(Xt, torch.tensor(y), return_predictions=True)
    assert isinstance(p, np.ndarray) and p.dtype == np.float64
    ref = OnlineBayesLogistic(D).partial_fit(X, y, return_predictions=True)
    np.testing.assert_allclose(p, ref, rtol=1e-6)
    mt, vt = m.score_moments(Xt.to_sparse_csr())
    mn, vn = m.score_moments(X)
    assert isinstance(mt, np.ndarray) and isinstance(m.predict_proba(Xt), np.ndarray)
    np.testing.assert_allclose(mt, mn, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(vt, vn, rtol=1e-6)
    np.testing.assert_array_equal(m.predict(Xt), m.predict(X))


@pytest.mark.parametrize("cls,kw", [(OnlineBayesLogistic, dict(mean_update="newton")), (OnlineMarginalVB, dict(num_samples=8)),
                                    (OnlineAdaGradLogistic, {}), (OnlineDimGauss, dict(batch_size=3))])
def test_state_dict_resumes_a_stream_exactly(cls, kw):
    X, y = _data(n=90)
    whole = cls(D, **kw)
    l_all = whole.partial_fit(X, y, return_log_loss=True)
    first = cls(D, **kw)
    l1 = first.partial_fit(X[:45], y[:45], return_log_loss=True)
    state = first.state_dict()
    resumed = cls.from_state_dict(state)
    l2 = resumed.partial_fit(X[45:], y[45:], return_log_loss=True)
    np.testing.assert_allclose(np.concatenate([l1, l2]), l_all, rtol=1e-13)
    np.testing.assert_allclose(resumed.coef_, whole.coef_, rtol=1e-13)
    assert resumed.n_seen_ == whole.n_seen_
    with pytest.raises(ValueError, match="configuration"):
        OnlineBayesLogistic(D + 1).load_state_dict(OnlineBayesLogistic(D).state_dict())
    with pytest.raises(ValueError, match="cannot load"):
        OnlineADF(D).load_state_dict(OnlineBayesLogistic(D).state_dict())


def test_minibatch_sums_updates_in_natural_parameters():
    X, y = _data(n=60, empty_rows=False)
    # rows with disjoint features: a mini-batch equals the sequential algorithm
    Xd = sp.csr_matrix(np.kron(np.eye(3), np.ones((1, 4))))
    yd = [1, -1, 1]
    seq = OnlineBayesLogistic(12, fast=False).partial_fit(Xd, yd)
    bat = OnlineBayesLogistic(12, batch_size=3, fast=False).partial_fit(Xd, yd)
    np.testing.assert_allclose(bat.coef_, seq.coef_, rtol=1e-13)
    np.testing.assert_allclose(bat.coef_var_, seq.coef_var_, rtol=1e-13)
    # overlapping rows: precision and precision-mean increments from the batch-start state add up
    b = 6
    m = OnlineBayesLogistic(D, prior_var=1.0, batch_size=b, fast=False)
    m.partial_fit(X[:b], y[:b])
    h0, eta0 = np.ones(D), np.zeros(D)
    h, eta = h0.copy(), eta0.copy()
    for t in range(b):
        single = OnlineBayesLogistic(D, prior_var=1.0, fast=False).partial_fit(X[t], y[t:t + 1])
        h += 1 / single.coef_var_ - h0
        eta += single.coef_ / single.coef_var_ - eta0
    np.testing.assert_allclose(m.coef_var_, 1 / h, rtol=1e-12)
    np.testing.assert_allclose(m.coef_, eta / h, rtol=1e-12, atol=1e-15)


def test_newton_iteration_cap_is_reported():
    X, y = _data(n=20)
    with pytest.warns(ConvergenceWarning, match="max_iter=1"):
        m = OnlineBayesLogistic(D, mean_update="newton", max_iter=1).partial_fit(X, y)
    assert m.n_unconverged_ > 0


def test_hashing_maps_any_column_space_into_the_buckets():
    from pyro_convexvb.online._validation import splitmix64

    cols = np.array([5, 10**9, 123456789012])
    X = sp.csr_matrix((np.ones(3), cols, [0, 2, 3]), shape=(2, 2 * 10**11))
    m = OnlineBayesLogistic(64, hashing=7, fast=False).partial_fit(X, [1, 0])
    buckets = (splitmix64(cols, 7) % np.uint64(64)).astype(int)
    Xh = sp.csr_matrix((np.ones(3), buckets, [0, 2, 3]), shape=(2, 64))
    ref = OnlineBayesLogistic(64, fast=False).partial_fit(Xh, [1, 0])
    np.testing.assert_array_equal(m.coef_, ref.coef_)


def test_probit_link_runs_end_to_end_and_predicts_with_eq24():
    X, y = _data(n=80, empty_rows=False)
    m = OnlineBayesLogistic(D, link="probit", prior_var=1.0).partial_fit(X, y)
    mu_t, s2_t = m.score_moments(X)
    np.testing.assert_allclose(m.predict_proba(X)[:, 1], eq.link_cdf(mu_t / np.sqrt(1 + s2_t), "probit"), rtol=1e-14)


def test_short_stream_regret_is_deterministic_given_the_seed():
    stream = make_online_stream(d=50, d_t=5, weight_std=1.0, seed=3)
    r1 = progressive_regret(OnlineBayesLogistic(50), stream, T=3000, chunk_size=1000)
    again = progressive_regret(OnlineBayesLogistic(50), make_online_stream(d=50, d_t=5, weight_std=1.0, seed=3),
                               T=3000, chunk_size=1000)
    assert again["R_T"] == r1["R_T"]
    np.testing.assert_array_equal(again["regret"], r1["regret"])
    # the stream does not depend on how it is cut (only the summation order of R_t does)
    r2 = progressive_regret(OnlineBayesLogistic(50), stream, T=3000, chunk_size=700)
    np.testing.assert_allclose(r2["regret"], r1["regret"], rtol=1e-12)
    r3 = progressive_regret(OnlineBayesLogistic(50), make_online_stream(d=50, d_t=5, weight_std=1.0, seed=4), T=3000)
    assert r3["R_T"] != r1["R_T"]
    # R_T by hand
    X, yy = stream.take(3000)
    ll = OnlineBayesLogistic(50).partial_fit(X, yy, return_log_loss=True)
    comp = np.logaddexp(0, -yy * (X @ stream.theta))
    assert r1["R_T"] == pytest.approx(float(np.sum(ll - comp)), rel=1e-12)
    assert r1["r_T"] == pytest.approx(r1["R_T"] / math.log(3000))
    assert r1["regret"][-1] == pytest.approx(r1["R_T"])


def test_algorithm1_learns_and_beats_untuned_sgd_on_the_paper_setting():
    """A short Figure-1 stream: the regret coefficient is positive, finite and well below SGD's."""
    stream = make_online_stream(d=200, d_t=20, weight_std=1.0, seed=0)
    alg = progressive_regret(OnlineBayesLogistic(200), stream, T=20000)
    sgd = progressive_regret(OnlineAdaGradLogistic(200, learning_rate=0.1), stream, T=20000)
    assert 0 < alg["r_T"] < sgd["r_T"]
    m = OnlineBayesLogistic(200)
    X, y = stream.take(20000)
    m.partial_fit(X, y)
    assert np.corrcoef(m.coef_, stream.theta)[0, 1] > 0.95
    assert np.all(m.coef_var_ < 1.0)


@pytest.mark.parametrize("cls", [OnlineBayesLogistic, OnlineDimGauss])
def test_newton_paths_agree_and_converge_with_a_wide_prior(cls):
    X, y = _data(n=300, empty_rows=False)
    fast = cls(D, prior_var=50.0, mean_update="newton", fast=True)
    ref = cls(D, prior_var=50.0, mean_update="newton", fast=False)
    np.testing.assert_allclose(fast.partial_fit(X, y, return_log_loss=True),
                               ref.partial_fit(X, y, return_log_loss=True), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(fast.coef_, ref.coef_, rtol=1e-11, atol=1e-12)
    assert fast.n_unconverged_ == ref.n_unconverged_ == 0


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("kw", [dict(prior_var=1.0), dict(), dict(prior_var=1.0, mean_update="newton"),
                                dict(prior_var=1.0, batch_size=4)])
def test_overflowing_score_moments_raise_and_leave_the_state_unchanged(kw, fast):
    # x = 1e160: x^2 sigma^2 overflows float64 in Eq. (6); the batch is refused, naming row and column
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(10, 3)), rng.integers(0, 2, 10)
    m = OnlineBayesLogistic(3, fast=fast, **kw).partial_fit(X, y)
    coef, var, loss = m.coef_.copy(), m.coef_var_.copy(), m.cumulative_log_loss_
    Xb = X.copy()
    Xb[6, 1] = 1e160
    with pytest.raises(FloatingPointError, match=r"row 6 of this batch, column 1 = 1e\+160.*overflow"):
        m.partial_fit(Xb, y)
    assert np.array_equal(m.coef_, coef) and np.array_equal(m.coef_var_, var)
    assert m.cumulative_log_loss_ == loss and m.n_seen_ == 10
    OnlineBayesLogistic.from_state_dict(m.state_dict())  # still a valid state
    Xb[6, 1] = 1e100  # x^2 sigma^2 = 1e200: finite, accepted
    assert np.isfinite(m.partial_fit(Xb, y, return_log_loss=True)).all()


def test_set_params_fast_after_the_stream_started_switches_paths():
    """``set_params(fast=False)`` mid-stream was silently ignored (``fast_`` stayed True); it now switches paths,
    whose updates agree, so the stream continues as one run on either path would."""
    X, y = _data()
    m = OnlineBayesLogistic(D, prior_var=1.5, fast=True).partial_fit(X[:40], y[:40])
    m.set_params(fast=False)
    m.partial_fit(X[40:], y[40:])
    assert m.fast_ is False
    ref = OnlineBayesLogistic(D, prior_var=1.5, fast=True).fit(X, y)
    np.testing.assert_allclose(m.coef_, ref.coef_, rtol=1e-12, atol=1e-13)
