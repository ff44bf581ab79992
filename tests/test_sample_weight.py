"""``sample_weight`` in the estimators' ``fit``: weighted likelihood sites (``poutine.scale`` / ``Weighted``).

References (float64): the same fit on the data with row ``i`` repeated ``w_i`` times (integer weights), and on
the data without the zero-weight rows; all-one weights are the unweighted fit. Invalid weights raise errors
that name ``sample_weight``.
"""
import warnings

import numpy as np
import pytest

import pyro_convexvb as pcv


def _data(N=60, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N, d))
    y = (X[:, 0] - 0.5 * X[:, 1] + rng.normal(size=N) > 0).astype(int)
    w = rng.integers(0, 4, N).astype(float)
    w[:2] = [2.0, 3.0]
    return X, y, w


def _repeat(X, y, w):
    k = w.astype(int)
    return np.repeat(X, k, 0), np.repeat(y, k)


# engine -> (options, atol): dual_vg at a duality gap of 1e-12 nats; convex_relaxation's LGM path and laplace's
# Pyro-model path (poutine.scale) agree with duplication to rounding
# (laplace: one explicit seed, so both fits start L-BFGS from the same point)
_ENGINES = {"dual_vg": ({"gap_tol": 1e-12}, 1e-8), "convex_relaxation": (None, 1e-10), "laplace": ({"seed": 0}, 1e-10)}


@pytest.mark.parametrize("engine", sorted(_ENGINES))
def test_logistic_integer_weights_equal_duplicated_rows(engine):
    options, atol = _ENGINES[engine]
    X, y, w = _data()
    a = pcv.BayesianLogisticRegression(engine=engine, options=options).fit(X, y, sample_weight=w)
    b = pcv.BayesianLogisticRegression(engine=engine, options=options).fit(*_repeat(X, y, w))
    np.testing.assert_allclose(a.coef_, b.coef_, rtol=0, atol=atol)
    np.testing.assert_allclose(a.coef_var_, b.coef_var_, rtol=0, atol=atol)
    np.testing.assert_allclose(a.intercept_, b.intercept_, rtol=0, atol=atol)
    np.testing.assert_allclose(a.predict_proba(X), b.predict_proba(X), rtol=0, atol=atol)
    assert abs(a.log_evidence_bound_ - b.log_evidence_bound_) <= 1e-8 * abs(b.log_evidence_bound_)
    # weights change the answer (the test is not vacuous)
    c = pcv.BayesianLogisticRegression(engine=engine, options=options).fit(X, y)
    assert np.abs(c.coef_ - a.coef_).max() > 1e-3


@pytest.mark.parametrize("engine", ["dual_vg", "laplace"])
def test_logistic_zero_weight_drops_the_row_and_ones_are_unweighted(engine):
    X, y, w = _data()
    options = _ENGINES[engine][0]
    w01 = (w > 0).astype(float)
    a = pcv.BayesianLogisticRegression(engine=engine, options=options).fit(X, y, sample_weight=w01)
    b = pcv.BayesianLogisticRegression(engine=engine, options=options).fit(X[w > 0], y[w > 0])
    np.testing.assert_array_equal(a.coef_, b.coef_)
    np.testing.assert_array_equal(a.coef_var_, b.coef_var_)
    ones = pcv.BayesianLogisticRegression(engine=engine, options=options).fit(X, y, sample_weight=np.ones(len(y)))
    ref = pcv.BayesianLogisticRegression(engine=engine, options=options).fit(X, y)
    np.testing.assert_array_equal(ones.coef_, ref.coef_)


def test_logistic_fractional_weights_through_pyro_model_match_lgm_path():
    # laplace sees poutine.scale in the Pyro model; convex_relaxation and dual_vg the Weighted LGM family: the
    # Laplace mode is the MAP of the weighted log joint, which the two LGM engines' means do not share, so compare
    # laplace against an independent MAP by scipy on the weighted log joint
    import scipy.optimize as so

    X, y, w = _data()
    w = w * 0.37 + 0.05
    clf = pcv.BayesianLogisticRegression(engine="laplace").fit(X, y, sample_weight=w)
    D = np.hstack([X, np.ones((len(y), 1))])
    prec = np.r_[np.ones(X.shape[1]), 1 / 100.0]

    def negjoint(u):
        eta = D @ u
        ll = y * eta - np.logaddexp(0, eta)
        g = D.T @ (w * (y - 1 / (1 + np.exp(-eta)))) - prec * u
        return -(w * ll).sum() + 0.5 * (prec * u * u).sum(), -g

    ref = so.minimize(negjoint, np.zeros(D.shape[1]), jac=True, method="L-BFGS-B",
                      options={"gtol": 1e-12, "ftol": 1e-15}).x
    np.testing.assert_allclose(np.r_[clf.coef_[0], clf.intercept_], ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (lambda n: -np.ones(n), "sample_weight: .* negative"),
    (lambda n: np.r_[np.nan, np.ones(n - 1)], "sample_weight: .* NaN"),
    (lambda n: np.ones(n + 1), r"sample_weight: expected shape \(60,\)"),
    (lambda n: np.ones((n, 2)), r"sample_weight: expected shape \(60,\)"),
    (lambda n: np.zeros(n), "sample_weight: every weight is zero"),
    (lambda n: ["a"] * n, "sample_weight: expected numbers"),
])
@pytest.mark.parametrize("make", [lambda: pcv.BayesianLogisticRegression(engine="laplace"),
                                  lambda: pcv.BayesianLinearRegression(),
                                  lambda: pcv.GLM(max_iter=5, min_steps=5)])
def test_invalid_weights_name_sample_weight(bad, match, make):
    X, y, _ = _data()
    with pytest.raises(ValueError, match=match):
        make().fit(X, y, sample_weight=bad(len(y)))


def test_linear_regression_weights_equal_duplication_and_dropping():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(50, 4))
    y = X @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.3 * rng.normal(size=50)
    w = rng.integers(0, 4, 50).astype(float)
    w[0] = 2.0
    a = pcv.BayesianLinearRegression().fit(X, y, sample_weight=w)
    b = pcv.BayesianLinearRegression().fit(*_repeat(X, y, w))
    np.testing.assert_allclose(a.coef_, b.coef_, rtol=0, atol=1e-9)
    np.testing.assert_allclose(a.covariance_, b.covariance_, rtol=0, atol=1e-10)
    np.testing.assert_allclose([a.noise_var_, a.prior_var_], [b.noise_var_, b.prior_var_], rtol=1e-8)
    assert abs(a.log_marginal_likelihood_ - b.log_marginal_likelihood_) <= 1e-9 * abs(b.log_marginal_likelihood_)
    # N <= D branch of the evidence (N x N Cholesky) at fixed hyperparameters, with zero weights dropped
    Xs, ys, ws = X[:6], y[:6], np.array([2.0, 0.0, 1.0, 3.0, 1.0, 0.0])
    kw = dict(learn_noise=False, learn_prior_var=False, noise_var=0.5, prior_var=2.0)
    a = pcv.BayesianLinearRegression(**kw).fit(np.tile(Xs, (1, 2)), ys, sample_weight=ws)
    b = pcv.BayesianLinearRegression(**kw).fit(*_repeat(np.tile(Xs, (1, 2)), ys, ws))
    np.testing.assert_allclose(a.coef_, b.coef_, rtol=0, atol=1e-12)
    np.testing.assert_allclose(a.log_marginal_likelihood_, b.log_marginal_likelihood_, rtol=1e-12)


def test_glm_integer_weights_equal_duplicated_rows():
    X, y, w = _data()
    kw = dict(max_iter=80, min_steps=80, window=20, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)  # a fixed, short SVI budget
        a = pcv.GLM(**kw).fit(X, y, sample_weight=w)
        b = pcv.GLM(**kw).fit(*_repeat(X, y, w))
    # the same objective and the same particles: the SVI paths agree to rounding
    np.testing.assert_allclose(a.posterior_.loc.numpy(), b.posterior_.loc.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(a.predict_proba(X), b.predict_proba(X), rtol=0, atol=1e-10)


def test_gp_classifier_integer_weights_equal_duplicated_rows_up_to_the_jitter():
    """A repeated input is a second latent value correlated ``1 - O(jitter / k)`` with the first: as the jitter
    goes to zero the repeated rows and the weighted row give the same predictions (and the weights do change the
    answer)."""
    from pyro_convexvb.gp import GPClassifier

    X, y, w = _data(N=30)
    engine, options, jitter, atol = "dual_vg", {"gap_tol": 1e-12}, 1e-8, 1e-6
    a = GPClassifier(engine=engine, jitter=jitter, options=options).fit(X, y, sample_weight=w)
    b = GPClassifier(engine=engine, jitter=jitter, options=options).fit(*_repeat(X, y, w))
    np.testing.assert_allclose(a.predict_proba(X), b.predict_proba(X), rtol=0, atol=atol)
    ma, va = a.predict_latent(X)
    mb, vb = b.predict_latent(X)
    np.testing.assert_allclose(ma, mb, rtol=0, atol=10 * atol)
    np.testing.assert_allclose(va, vb, rtol=0, atol=10 * atol)
    c = GPClassifier(engine=engine, jitter=jitter, options=options).fit(X, y)
    assert np.abs(c.predict_proba(X) - a.predict_proba(X)).max() > 1e-3


def test_gp_classifier_zero_weight_drops_the_row_and_invalid_weights_are_named():
    from pyro_convexvb.gp import GPClassifier

    X, y, w = _data(N=30)
    w01 = (w > 0).astype(float)
    a = GPClassifier().fit(X, y, sample_weight=w01)
    b = GPClassifier().fit(X[w > 0], y[w > 0])
    np.testing.assert_array_equal(a.predict_proba(X), b.predict_proba(X))
    ones = GPClassifier().fit(X, y, sample_weight=np.ones(len(y)))
    np.testing.assert_array_equal(ones.predict_proba(X), GPClassifier().fit(X, y).predict_proba(X))
    with pytest.raises(ValueError, match="sample_weight: .* negative"):
        GPClassifier().fit(X, y, sample_weight=-np.ones(len(y)))


def test_gp_classifier_weights_reach_pyro_model_engines_through_poutine_scale():
    """``laplace`` fits the Pyro model with ``poutine.scale``: its mode is the MAP of the weighted log joint,
    ``sum_i w_i log p(y_i | f_i) + log N(f | m, K)``, found independently by scipy on the same ``K``."""
    import scipy.optimize as so
    from pyro_convexvb.gp import GPClassifier

    X, y, w = _data(N=30)
    w = w * 0.37 + 0.05
    clf = GPClassifier(engine="laplace", options={"seed": 0}).fit(X, y, sample_weight=w)
    K = clf.K_train_
    Kinv = np.linalg.inv(K)

    def negjoint(f):
        p = 1 / (1 + np.exp(-f))
        return -(w * (y * f - np.logaddexp(0, f))).sum() + 0.5 * f @ Kinv @ f, -(w * (y - p)) + Kinv @ f

    ref = so.minimize(negjoint, np.zeros(len(y)), jac=True, method="L-BFGS-B",
                      options={"gtol": 1e-10, "ftol": 1e-15, "maxiter": 10000}).x
    np.testing.assert_allclose(clf.posterior_.loc.numpy(), ref, rtol=0, atol=1e-4)


def test_glm_binomial_per_row_trials_follow_their_rows_under_weights():
    """Per-row binomial trials, given to ``fit`` or to the constructor, stay with their rows when zero weights drop
    rows: the weighted fit is the fit on the repeated rows with the trials repeated alike (the constructor's
    per-row ``n_trials`` with zero weights used to raise torch's RuntimeError from a shape mismatch)."""
    X, _, w = _data()
    rng = np.random.default_rng(5)
    trials = rng.integers(1, 6, X.shape[0])
    y = rng.binomial(trials, 1 / (1 + np.exp(-(X[:, 0] - 0.5 * X[:, 1]))))
    kw = dict(max_iter=80, min_steps=80, window=20, lr=0.1)
    k = w.astype(int)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)  # a fixed, short SVI budget
        ref = pcv.GLM("binomial", **kw).fit(np.repeat(X, k, 0), np.repeat(y, k), n_trials=np.repeat(trials, k))
        a = pcv.GLM("binomial", **kw).fit(X, y, n_trials=trials, sample_weight=w)
        b = pcv.GLM("binomial", n_trials=trials, **kw).fit(X, y, sample_weight=w)
    for est in (a, b):
        np.testing.assert_allclose(est.posterior_.loc.numpy(), ref.posterior_.loc.numpy(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(est.predict(X, n_trials=trials), ref.predict(X, n_trials=trials), rtol=1e-10)


def test_linear_regression_weights_equal_repeated_rows_at_the_noise_floor():
    """More features than rows: the learned noise stops at its floor, 1e-10 of the targets' variance, which was that
    of the unweighted rows (a floor of 1.7e-9 against the repeated rows' 9.4e-10, the evidence 1.8 nats apart)."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(7, 10))
    y = X @ rng.normal(size=10) + 0.5 * rng.normal(size=7) + 0.3
    w = rng.integers(0, 4, size=7).astype(float)
    w[0], w[1] = 0, 3
    rep = np.repeat(np.arange(7), w.astype(int))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the floor's own warning
        a = pcv.BayesianLinearRegression().fit(X, y, sample_weight=w)
        b = pcv.BayesianLinearRegression().fit(X[rep], y[rep])
    assert a.noise_var_ == pytest.approx(b.noise_var_, rel=1e-6)
    assert a.log_marginal_likelihood_ == pytest.approx(b.log_marginal_likelihood_, abs=1e-4)
