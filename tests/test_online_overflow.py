"""float64 overflow in the online learners: a batch whose arithmetic leaves float64 (huge features, a variance
update that overflows, underflows or cancels) is refused with a FloatingPointError naming the row and column that
broke the state, and undone; predictions whose scores overflow are refused.  Each test is one failure that the
learners used to let through silently (or reported at the wrong row, or as a ZeroDivisionError)."""
import copy
import math
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from pyro_convexvb.errors import ConvergenceWarning
from pyro_convexvb.online import (OnlineADF, OnlineAdaGradLogistic, OnlineBayesLogistic, OnlineDimGauss,
                                  OnlineMarginalVB)
from pyro_convexvb.online._validation import splitmix64

pytest.importorskip("numba", reason="the fast path needs numba")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference path's NumPy meets inf and NaN

# learned first: columns 0-2 move away from the prior, column 3 keeps it
X0 = np.array([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [1.0, 1.0, 0, 0]])
Y0 = [1, 0, 1, 0]


def _state(m):
    """A copy of everything :meth:`state_dict` saves: the state arrays, counters, classes and extra state."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in m.state_dict().items()}


def _assert_state(m, before):
    after = m.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(after[k], v), k  # bit for bit
        else:
            assert after[k] == v, k


def _refused(m, X, y, match, sparse=True):
    """``m.partial_fit(X, y)`` raises ``FloatingPointError`` matching ``match``; the state, counters and
    predictions after it are those before it."""
    before, p_before, s_before = _state(m), m.predict_proba(X0), m.decision_function(X0)
    X = np.asarray(X, dtype=float)
    with pytest.raises(FloatingPointError, match=match) as err:
        m.partial_fit(sp.csr_matrix(X) if sparse else X, y)
    assert "rescale the features" in str(err.value)
    assert "The batch was not applied: the learner's state is as before this call" in str(err.value)
    _assert_state(m, before)
    np.testing.assert_array_equal(m.predict_proba(X0), p_before)
    np.testing.assert_array_equal(m.decision_function(X0), s_before)
    return str(err.value)


# (learner, options, batch, labels, message); the broken row touches column 3, still at its prior
UPDATE_CASES = {
    # Appendix D.2: sigma^2 - sigma^4 x^2 psi2 / c^2, and sigma^4 x^2 = 9e308 overflows although sigma^2 x^2 = 9e307
    "adf-variance-overflows": (OnlineADF, dict(prior_var=10.0), [[0, 1.0, 0, 0], [0, 1.0, 0, 3e153]], [0, 1],
                               r"row 1 of this batch, column 3 = 3e\+153: the moment-matching update of this feature "
                               r"\(Shamir & Szpankowski 2021, Appendix D.2\) gave mu_i = 2\.523, sigma_i\^2 = -inf"),
    # Eq. (46): sigma^2 - b v^2 / (1 + b q) cancels to 0 once b q exceeds 1/eps (x = 1e10 at sigma^2 = 1)
    "dimgauss-variance-cancels-to-zero": (
        OnlineDimGauss, dict(), [[0, 1.0, 0, 0], [0, 0, 0, 1e10]], [0, 1],
        r"row 1 of this batch, column 3 = 1e\+10: the Sherman-Morrison update of this feature .*"
        r"gave mu_i = 0\., sigma_i\^2 = 0\., not a finite mean and a finite variance of at least 2\.2e-308"),
    "dimgauss-taylor-variance-cancels-below-zero": (
        OnlineDimGauss, dict(mean_update="taylor"), [[0, 1.0, 0, 0], [0, 0, 0, 1e10]], [0, 1],
        r"row 1 of this batch, column 3 = 1e\+10: the Sherman-Morrison update .* sigma_i\^2 = -2\.22e-16"),
    # Eq. (31): the second row of 1e154 takes the variance below the smallest normal float64 (its precision
    # 1/sigma^2 would overflow in a mini-batch or a sharded merge)
    "probit-variance-underflows": (
        OnlineBayesLogistic, dict(link="probit", prior_var=1.0), [[0, 1.0, 0, 0], [0, 1.0, 0, 1e154],
                                                                  [0, 1.0, 0, 1e154]], [0, 1, 0],
        r"row 2 of this batch, column 3 = 1e\+154: the update of this feature \(Shamir & Szpankowski 2021, "
        r"Algorithm 1.* sigma_i\^2 = 1\.252e-308"),
    # Appendix D.3: the Newton iteration does not converge on the row of 1e153 (a ConvergenceWarning on its own);
    # the next row of column 0 takes the mean and the variance to inf (the reference path saved them; the kernel
    # raised ZeroDivisionError)
    "marginal-vb-update-overflows": (
        OnlineMarginalVB, dict(num_samples=10), [[0, 0, 1.0, 0], [1e153, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0]],
        [1, 0, 1, 0],
        r"row 2 of this batch, column 0 = 1: the variational update of this feature .* mu_i = inf, sigma_i\^2 = inf"),
    # Shamir & Szpankowski 2021, §4: a wrong prediction on x = 1e160 gives g^2 = inf; w never moves again
    "adagrad-sum-of-squares-overflows": (
        OnlineAdaGradLogistic, dict(), [[0, 1.0, 0, 0], [0, 0, 0, 1e160]], [0, 0],
        r"row 1 of this batch, column 3 = 1e\+160: the AdaGrad step of this feature \(Shamir & Szpankowski 2021, "
        r"§4\) gave w_i = 0\., G_i \(its sum of squared gradients\) = inf, not finite values"),
}


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("case", list(UPDATE_CASES))
def test_an_update_that_leaves_float64_is_refused_and_undone(case, fast, sparse):
    cls, kw, X, y, match = UPDATE_CASES[case]
    m = cls(4, fast=fast, **kw).partial_fit(X0, Y0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # marginal-vb: the Newton iteration on 1e153
        _refused(m, X, y, match, sparse)
    type(m).from_state_dict(m.state_dict(), fast=fast)  # still a valid state
    m.partial_fit(np.asarray(X, dtype=float)[:1], y[:1])  # and the stream goes on from it


def _sparse_rows(n, d, scale, seed):
    r = np.random.default_rng(seed)
    X = sp.random(n, d, density=0.3, format="csr", random_state=seed)
    X.data = r.normal(size=X.nnz) * scale
    return X, r.integers(0, 2, n)


@pytest.mark.parametrize("fast", [True, False])
def test_the_row_whose_update_broke_the_state_is_named_not_a_later_one(fast):
    # Eq. (18) (variance_update="value") multiplies sigma^2 by exp(2 (log p_t - log p_{i,t+}) + d^2 / sigma^2): on
    # features of scale 30 one row takes it to inf.  The next row of that feature then overflowed the score moments
    # (6) and was named instead ("column 2 = -17"), and row by row the broken state was even saved.
    X, y = _sparse_rows(40, 8, 30.0, seed=3)
    m = OnlineBayesLogistic(8, prior_var=0.5, variance_update="value", fast=fast).partial_fit(np.eye(8), [1, 0] * 4)
    single = copy.deepcopy(m)
    msg = _refused_on(m, X, y)
    culprit = None  # independently: one row per call, the first call refused
    for t in range(X.shape[0]):
        try:
            single.partial_fit(X[t], y[t:t + 1])
        except FloatingPointError:
            culprit = t
            break
    assert culprit == 1
    assert msg.startswith(f"X: row {culprit} of this batch, column 3 = -76.7: the update of this feature")
    assert "sigma_i^2 = inf" in msg
    assert "or use variance_update='laplace' (Eq. (19)), under which a variance can only shrink" in msg


def _refused_on(m, X, y):
    before, p_before = _state(m), m.predict_proba(np.eye(8))
    with pytest.raises(FloatingPointError) as err:
        m.partial_fit(X, y)
    _assert_state(m, before)
    np.testing.assert_array_equal(m.predict_proba(np.eye(8)), p_before)
    return str(err.value)


@pytest.mark.parametrize("fast", [True, False])
def test_a_minibatch_update_that_overflows_is_refused_not_dropped(fast):
    # batch_size > 1 sums the rows' updates in natural parameters: ADF's variance -inf (see above) became the
    # precision 1/-inf = -0, the summed precision 0, and the update was dropped with a ConvergenceWarning that
    # blamed the batch size ("use a smaller batch_size"), where batch_size=1 refuses the row
    m = OnlineADF(4, prior_var=10.0, batch_size=2, fast=fast).partial_fit(X0, Y0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        msg = _refused(m, [[0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 1.0, 0, 3e153]], [0, 1, 1],
                       r"row 2 of this batch, column 3 = 3e\+153: the moment-matching update of this feature .*, "
                       r"summed over the mini-batch of row 2 in natural parameters \(Appendix D\.1\)")
    assert m.n_skipped_ == 0
    assert "sigma_i^2 = nan" in msg  # the mark of an overflowed sum


@pytest.mark.parametrize("fast", [True, False])
def test_a_division_by_zero_in_the_kernel_is_refused_and_the_state_restored(fast):
    # DimGauss's row variance cancels to 0 (x = 1.3e152); the mini-batch sum divides by it.  The kernel raised
    # ZeroDivisionError part-way, before it had recorded the old values of the batch's entries, and the undo then
    # wrote uninitialised memory into mu and sigma^2 (column 3 became 2e-320 and 2e-314); the reference path
    # dropped the update as not positive.
    m = OnlineDimGauss(4, batch_size=2, fast=fast).partial_fit(X0, Y0)
    _refused(m, [[0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.3e152], [0, 0, 1.0, 0]], [0, 1, 1, 0],
             r"row 2 of this batch, column 3 = 1\.3e\+152: the Sherman-Morrison update of this feature .*, summed "
             r"over the mini-batch of rows 2 to 3 in natural parameters")


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("label", [1, 0])
def test_an_adagrad_score_that_overflows_is_refused(fast, label):
    # x^T w = 3e308 * 10 is inf: with label 1 the prediction was P = 1 and nothing else happened (a silent inf score);
    # with label 0 the loss was inf and the error spoke of the score moments and variances AdaGrad does not have
    m = OnlineAdaGradLogistic(2, learning_rate=10.0, fast=fast).partial_fit(np.eye(2), [1, 1])
    before, p_before = _state(m), m.predict_proba(np.eye(2))
    with pytest.raises(FloatingPointError) as err:
        m.partial_fit(np.array([[1.0, 0.0], [1.5e308, 1.5e308]]), [1, label])
    msg = str(err.value)
    assert msg.startswith("X: row 1 of this batch, column 0 = 1.5e+308: the score x_t^T w = sum_i x_i w_i overflows "
                          "float64, or the log loss of the row's prediction does; rescale the features")
    assert "sigma" not in msg
    _assert_state(m, before)
    np.testing.assert_array_equal(m.predict_proba(np.eye(2)), p_before)


@pytest.mark.parametrize("cls", [OnlineBayesLogistic, OnlineAdaGradLogistic])
@pytest.mark.parametrize("hashing", [False, True])
def test_entries_that_sum_past_float64_are_refused(cls, hashing):
    # two finite entries of one row that share a column (duplicates, or columns hashed to one bucket) were summed to
    # inf after the check for finite input: AdaGrad saved NaN weights, the Gaussian learners named "column 0 = inf"
    if hashing:
        buckets = splitmix64(np.arange(64), 0) % np.uint64(4)
        a, b = np.flatnonzero(buckets == buckets[0])[:2]
        X = np.zeros((2, 64))
        X[0, 5] = 1.0
        X[1, [a, b]] = 1e308
        m = cls(4, hashing=True).partial_fit(np.eye(64)[:4], [1, 0, 1, 0])
        where = rf"row 1, hash bucket {int(buckets[0])}: the sum of the columns hashed to it"
    else:  # a CSR matrix with a duplicate entry (not canonical)
        X = sp.csr_matrix((np.array([1.0, 1e308, 1e308]), np.array([1, 0, 0]), np.array([0, 1, 3])), shape=(2, 4))
        m = cls(4).partial_fit(X0, Y0)
        where = r"row 1, column 0: the sum of its duplicate entries"
    before = _state(m)
    with pytest.raises(FloatingPointError, match=rf"^X: {where} overflows float64 \(inf\); rescale the features"):
        m.partial_fit(X, [0, 1])
    _assert_state(m, before)


def _logistic(z):
    return 1.0 / (1.0 + math.exp(-z))


def _normal_cdf(z):
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


@pytest.mark.parametrize("cls, kw, a, cdf", [
    (OnlineBayesLogistic, dict(prior_var=1.0), math.pi / 8.0, _logistic),  # Eqs. (6), (8)
    (OnlineADF, dict(link="probit"), 1.0, _normal_cdf),  # Eq. (24)
    (OnlineAdaGradLogistic, dict(learning_rate=10.0), None, _logistic),  # F(x^T w)
    (OnlineBayesLogistic, {}, None, None),  # prior_var="auto": the model average, see test_online_bma.py
], ids=["logit", "probit", "adagrad", "auto"])
def test_predictions_whose_scores_overflow_are_refused(cls, kw, a, cdf):
    # x = 1e160: sigma^2 x^2 = inf shrank any score to 0, so P = 0.5 whatever the mean said; AdaGrad's score
    # 1.5e308 (w_0 + w_1) was inf or NaN
    m = cls(2, **kw).partial_fit(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), [1, 0, 1])
    huge = 1.5e308 if cls is OnlineAdaGradLogistic else 1e160
    X = np.array([[0.5, -2.0], [huge, huge]])
    methods = ["predict_proba", "decision_function", "predict"] + (["score_moments"] if hasattr(m, "coef_var_")
                                                                     else [])
    for method in methods:
        with pytest.raises(FloatingPointError, match=r"^X: row 1, column 0 = " + f"{huge:.3g}".replace("+", r"\+")
                           + r": the score .* overflows? float64.*: the prediction would be meaningless; rescale "
                             r"the features \(e\.g\. standardise them\)\.$"):
            getattr(m, method)(X)
    if cdf is None:
        return
    x = X[0]  # a finite row: its prediction from the posterior (or the weights), in float64
    z = float(x @ m.coef_)
    if a is not None:
        z /= math.sqrt(1.0 + a * float(x ** 2 @ m.coef_var_))
    np.testing.assert_allclose(m.predict_proba(X[:1])[0, 1], cdf(z), rtol=1e-13)


def test_a_saved_variance_below_the_smallest_normal_float64_is_refused():
    # what partial_fit now refuses to write, load_state_dict refuses to read (the variance 1.252e-308 of
    # "probit-variance-underflows" was saved before)
    state = OnlineBayesLogistic(4, prior_var=1.0).partial_fit(X0, Y0).state_dict()
    state["s2"][3] = 1.252e-308
    with pytest.raises(ValueError, match=r"state\['s2'\]: expected positive values \(variances, at least the "
                                         r"smallest normal float64 2\.23e-308"):
        OnlineBayesLogistic.from_state_dict(state)
    state["s2"][3] = 2.3e-308
    OnlineBayesLogistic.from_state_dict(state)
