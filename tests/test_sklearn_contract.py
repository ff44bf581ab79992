"""The scikit-learn estimator contract of every estimator, and BayesianLogisticRegression against independent references.

* ``parametrize_with_checks``: scikit-learn's own estimator checks, for every estimator (GLM with a
  small SVI budget so that the ~40 fits of the checks stay fast; no expected failures);
* ``clone``, ``Pipeline`` under ``cross_val_score`` (against a hand-written cross-validation loop),
  ``GridSearchCV`` over an engine name and a hyperparameter, ``CalibratedClassifierCV``;
* ``BayesianLogisticRegression``: the engine's answer against an independent maximisation of the
  variational-Gaussian bound and 2-D quadrature of the exact posterior, sparse against dense, the
  type-II prior scale against a golden-section search over refits, the Laplace path against
  scikit-learn's ``LogisticRegression`` (the same MAP).
"""
import math
import warnings

import numpy as np
import pyro
import pytest
import scipy.optimize
import scipy.sparse as sp
import torch
from sklearn.base import clone, is_classifier, is_regressor
from sklearn.calibration import CalibratedClassifierCV
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, StratifiedKFold, KFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

import pyro_convexvb as pcv
from pyro_convexvb.gp import GPClassifier
from pyro_convexvb.online import OnlineBayesLogistic

from conftest import estimator_factories

# our own defaults must reach their tolerances: an unconverged fit here is a failure, not a warning
pytestmark = pytest.mark.filterwarnings("error::pyro_convexvb.ConvergenceWarning")

ESTIMATORS = [make() for make in estimator_factories().values()]


def _expected_failed_checks(estimator):
    if isinstance(estimator, GPClassifier):
        # a repeated input is a second latent value correlated 1 - O(jitter) with the first, so weights equal
        # repeated rows only up to the jitter (~1e-7 relative at the default 1e-6; the check asks 1e-7):
        # tests/test_sample_weight.py checks 1e-6 at jitter 1e-8
        reason = "weights equal repeated inputs only up to O(jitter) in a GP"
        return {"check_sample_weight_equivalence_on_dense_data": reason,
                "check_sample_weight_equivalence_on_sparse_data": reason}
    return {}


@parametrize_with_checks(ESTIMATORS, expected_failed_checks=_expected_failed_checks)
def test_scikit_learn_estimator_checks(estimator, check):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        check(estimator)


# ------------------------------------------------------------------------------------------ data
def _cancer(n=150, d=6, seed=0):
    X, y = load_breast_cancer(return_X_y=True)
    idx = np.random.default_rng(seed).permutation(X.shape[0])[:n]
    return X[idx, :d], y[idx]


def _diabetes(n=150):
    X, y = load_diabetes(return_X_y=True)
    return X[:n], (y[:n] - y.mean()) / y.std()


CLASSIFIERS = {
    "logistic": lambda: pcv.BayesianLogisticRegression(),
    "glm": lambda: pcv.GLM("bernoulli", max_iter=300, min_steps=150, window=50, lr=0.05),
    "gp": lambda: GPClassifier(),
    "online": lambda: OnlineBayesLogistic(),
}
REGRESSORS = {
    "blr": lambda: pcv.BayesianLinearRegression(fit_intercept=True),
    "glm": lambda: pcv.GLM("gaussian", max_iter=300, min_steps=150, window=50, lr=0.05),
}


@pytest.mark.parametrize("name", sorted(CLASSIFIERS))
def test_classifier_in_a_pipeline_under_cross_val_score(name):
    """Scores equal a hand-written cross-validation loop (no silent NaN scores), outputs are NumPy."""
    X, y = _cancer()
    est = make_pipeline(StandardScaler(), CLASSIFIERS[name]())
    assert is_classifier(est)
    cv = StratifiedKFold(3, shuffle=True, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        scores = cross_val_score(est, X, y, cv=cv, error_score="raise")
        manual = []
        for tr, te in cv.split(X, y):
            fitted = clone(est).fit(X[tr], y[tr])
            pred, proba = fitted.predict(X[te]), fitted.predict_proba(X[te])
            assert isinstance(pred, np.ndarray) and isinstance(proba, np.ndarray) and proba.shape == (len(te), 2)
            np.testing.assert_array_equal(pred, fitted.classes_[proba.argmax(1)])
            manual.append(np.mean(pred == y[te]))
    np.testing.assert_allclose(scores, manual, rtol=0, atol=0)
    assert np.all(scores > 0.85)


@pytest.mark.parametrize("name", sorted(REGRESSORS))
def test_regressor_in_a_pipeline_under_cross_val_score(name):
    X, y = _diabetes()
    est = make_pipeline(StandardScaler(), REGRESSORS[name]())
    assert is_regressor(est)
    cv = KFold(3, shuffle=True, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        scores = cross_val_score(est, X, y, cv=cv, error_score="raise")
        manual = []
        for tr, te in cv.split(X):
            pred = clone(est).fit(X[tr], y[tr]).predict(X[te])
            assert isinstance(pred, np.ndarray)
            manual.append(1 - np.sum((y[te] - pred) ** 2) / np.sum((y[te] - y[te].mean()) ** 2))
    np.testing.assert_allclose(scores, manual, rtol=1e-12)
    assert np.all(np.isfinite(scores)) and np.mean(scores) > 0.3


def test_glm_type_follows_the_likelihood():
    assert is_classifier(pcv.GLM("bernoulli")) and not is_regressor(pcv.GLM("bernoulli"))
    for lik in ("gaussian", "poisson", "binomial"):
        assert is_regressor(pcv.GLM(lik)) and not hasattr(pcv.GLM(lik), "predict_proba")


def test_clone_and_params_leave_the_arguments_alone():
    import gpytorch

    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    clf = GPClassifier(kernel, engine="convex_relaxation", options={"max_outer": 10})
    twin = clone(clf)
    assert twin.get_params()["engine"] == "convex_relaxation" and twin.options == {"max_outer": 10}
    assert twin.kernel is not kernel and twin.options is not clf.options  # deep copies
    X, y = _cancer(60, 3)
    Xs = StandardScaler().fit_transform(X)
    before = {k: v.clone() for k, v in kernel.state_dict().items()}
    clf.fit(Xs, y)
    assert clf.get_params()["kernel"] is kernel and all(torch.equal(v, before[k]) for k, v in kernel.state_dict().items())
    online = OnlineBayesLogistic(prior_var=np.ones(3)).fit(Xs, y)
    assert online.get_params()["num_features"] is None and online.n_features_in_ == 3
    assert OnlineBayesLogistic().set_params(prior_var=2.0).prior_var == 2.0


def test_grid_search_over_an_engine_and_a_hyperparameter():
    X, y = _cancer(120, 5)
    pipe = make_pipeline(StandardScaler(), pcv.BayesianLogisticRegression())
    grid = {"bayesianlogisticregression__engine": ["dual_vg", "laplace"],
            "bayesianlogisticregression__prior_scale": [0.05, 1.0]}
    cv = StratifiedKFold(3, shuffle=True, random_state=1)
    search = GridSearchCV(pipe, grid, cv=cv, error_score="raise", scoring="neg_log_loss").fit(X, y)
    assert np.all(np.isfinite(search.cv_results_["mean_test_score"]))
    best = search.best_params_
    assert best["bayesianlogisticregression__prior_scale"] == 1.0  # a scale of 0.05 underfits
    ref = cross_val_score(clone(pipe).set_params(**best), X, y, cv=cv, scoring="neg_log_loss")
    assert search.best_score_ == pytest.approx(ref.mean(), rel=1e-12)
    assert search.best_estimator_[-1].engine == best["bayesianlogisticregression__engine"]


def test_grid_search_over_gp_engines_and_kernels():
    import gpytorch

    def rbf(ls):
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        k.base_kernel.lengthscale = ls
        return k

    X, y = _cancer(90, 3)
    pipe = make_pipeline(StandardScaler(), GPClassifier())
    search = GridSearchCV(pipe, {"gpclassifier__engine": ["dual_vg", "convex_relaxation"],
                                 "gpclassifier__kernel": [rbf(0.05), rbf(2.0)]},
                          cv=3, error_score="raise").fit(X, y)
    assert search.best_params_["gpclassifier__kernel"].base_kernel.lengthscale.item() == 2.0
    assert search.best_score_ > 0.85


@pytest.mark.parametrize("name", ["logistic", "gp", "online"])
def test_calibrated_classifier_cv(name):
    X, y = _cancer(150, 5)
    Xs = StandardScaler().fit_transform(X)
    cal = CalibratedClassifierCV(CLASSIFIERS[name](), cv=3, method="sigmoid").fit(Xs, y)
    p = cal.predict_proba(Xs)
    assert p.shape == (150, 2) and np.allclose(p.sum(1), 1.0)
    assert np.mean(cal.predict(Xs) == y) > 0.85


def test_pandas_and_torch_inputs():
    pd = pytest.importorskip("pandas")
    X, y = _cancer(80, 4)
    names = [f"f{i}" for i in range(4)]
    df = pd.DataFrame(StandardScaler().fit_transform(X), columns=names)
    for est in (pcv.BayesianLogisticRegression(), GPClassifier(), OnlineBayesLogistic()):
        est.fit(df, pd.Series(np.where(y == 1, "benign", "malignant")))
        assert est.feature_names_in_.tolist() == names and est.classes_.tolist() == ["benign", "malignant"]
        p_df = est.predict_proba(df)
        with pytest.warns(UserWarning, match="does not have valid feature names"):
            p_t = est.predict_proba(torch.tensor(df.to_numpy()))
        assert isinstance(p_t, np.ndarray)
        np.testing.assert_allclose(p_t, p_df, rtol=1e-12)
        with pytest.raises(ValueError, match="feature names"):
            est.predict_proba(df.rename(columns={"f0": "other"}))


# ------------------------------------------------------------------------------------------ online API
def test_online_partial_fit_with_classes_like_sgd_classifier():
    X, y = _cancer(120, 4)
    Xs = StandardScaler().fit_transform(X)
    labels = np.where(y == 1, "yes", "no")
    first = labels[:10] == labels[0]
    m = OnlineBayesLogistic()
    with pytest.raises(ValueError, match="classes="):
        m.partial_fit(Xs[:10][first], labels[:10][first])  # one string label: the other class is unknown
    m.partial_fit(Xs[:10][first], labels[:10][first], classes=["no", "yes"])
    m.partial_fit(Xs[10:], labels[10:])
    assert m.classes_.tolist() == ["no", "yes"] and m.n_features_in_ == 4 and m.n_seen_ == first.sum() + 110
    with pytest.raises(ValueError, match="differs"):
        m.partial_fit(Xs[:2], labels[:2], classes=["a", "b"])
    with pytest.raises(ValueError, match="has 3 features"):
        m.partial_fit(Xs[:2, :3], labels[:2])
    # partial_fit over chunks continues the stream; fit restarts from the prior
    whole = OnlineBayesLogistic().fit(Xs, labels)
    chunks = OnlineBayesLogistic()
    for a in range(0, 120, 40):
        chunks.partial_fit(Xs[a:a + 40], labels[a:a + 40])
    np.testing.assert_allclose(chunks.coef_, whole.coef_, rtol=1e-13)
    again = whole.fit(Xs, labels)
    np.testing.assert_allclose(again.coef_, chunks.coef_, rtol=1e-13)
    assert again.n_seen_ == 120


def test_online_hashing_needs_num_features_and_keeps_any_width():
    cols = np.random.default_rng(0).integers(0, 10**9, size=90)
    X = sp.csr_matrix((np.ones(90), cols, np.arange(0, 91, 3)), shape=(30, 10**9))
    y = np.arange(30) % 2
    with pytest.raises(ValueError, match="num_features"):
        OnlineBayesLogistic(hashing=3).fit(X, y)
    m = OnlineBayesLogistic(num_features=64, hashing=3).fit(X, y)
    assert m.coef_.shape == (64,) and not hasattr(m, "n_features_in_")
    assert m.predict_proba(sp.random(2, 5, density=0.5, format="csr", random_state=1)).shape == (2, 2)


# ------------------------------------------------------------------------------------------ BayesianLogisticRegression
def _one_feature(N=40, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=N)
    y = (rng.random(N) < 1 / (1 + np.exp(-(1.5 * x - 0.5)))).astype(int)
    return x[:, None], y


def _independent_vg_optimum(X, y, prior_var):
    """Maximise the exact variational-Gaussian bound over (mean, Cholesky factor) by L-BFGS (100-node quadrature)."""
    D = torch.tensor(np.hstack([X, np.ones((X.shape[0], 1))]))
    yt = torch.tensor(y, dtype=torch.float64)
    xg, wg = np.polynomial.hermite_e.hermegauss(100)
    xg, wg = torch.tensor(xg), torch.tensor(wg / math.sqrt(2 * math.pi))
    pv = torch.tensor(prior_var, dtype=torch.float64)

    def unpack(z):
        L = torch.zeros(2, 2, dtype=torch.float64)
        L = L + torch.diag(torch.exp(z[2:4])) + torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=torch.float64) * z[4]
        return z[:2], L @ L.T

    def neg_elbo(z):
        z = torch.tensor(z, requires_grad=True)
        m, S = unpack(z)
        mu, v = D @ m, ((D @ S) * D).sum(1)
        eta = mu[:, None] + v.sqrt()[:, None] * xg
        ell = (torch.nn.functional.logsigmoid((2 * yt - 1)[:, None] * eta) * wg).sum()
        kl = 0.5 * ((torch.diagonal(S) / pv).sum() + (m**2 / pv).sum() - 2 + pv.log().sum() - torch.logdet(S))
        f = kl - ell
        (g,) = torch.autograd.grad(f, z)
        return f.item(), g.numpy()

    r = scipy.optimize.minimize(neg_elbo, np.zeros(5), jac=True, method="L-BFGS-B",
                                options=dict(maxiter=5000, ftol=1e-15, gtol=1e-11))
    m, S = unpack(torch.tensor(r.x))
    return -r.fun, m.numpy(), S.numpy()


def test_dual_vg_reaches_the_variational_gaussian_optimum():
    """Against an independent maximisation of the exact VG bound; the default (local-bound) answer is just below it."""
    X, y = _one_feature()
    best, m_ref, S_ref = _independent_vg_optimum(X, y, [1.5**2, 2.0**2])
    exact = pcv.BayesianLogisticRegression(prior_scale=1.5, intercept_scale=2.0,
                                           options=dict(form="site", refine=True, gap_tol=1e-12)).fit(X, y)
    assert exact.log_evidence_bound_ == pytest.approx(best, abs=1e-8)
    np.testing.assert_allclose([exact.coef_[0, 0], exact.intercept_[0]], m_ref, atol=1e-5)
    np.testing.assert_allclose([exact.coef_var_[0, 0], exact.intercept_var_[0]], np.diag(S_ref), rtol=1e-4)
    default = pcv.BayesianLogisticRegression(prior_scale=1.5, intercept_scale=2.0).fit(X, y)
    assert best - 0.01 < default.log_evidence_bound_ <= best + 1e-9
    assert default.converged_ and default.coef_.shape == (1, 1) and default.intercept_.shape == (1,)


def test_predictions_integrate_over_the_posterior():
    """predict_proba is E[sigmoid(eta)] under the Gaussian marginal of eta (brute-force 2-D grid), and close
    to the exact posterior predictive (2-D quadrature of the true posterior)."""
    X, y = _one_feature()
    clf = pcv.BayesianLogisticRegression(prior_scale=1.5, intercept_scale=2.0,
                                         options=dict(form="site", refine=True, gap_tol=1e-12)).fit(X, y)
    m = np.array([clf.coef_[0, 0], clf.intercept_[0]])
    S = clf.posterior_.covariance().numpy()
    Xt = np.array([[-2.0], [0.0], [0.7], [3.0]])
    # the Gaussian posterior's predictive on a 2-D grid in whitened coordinates
    g = np.linspace(-9, 9, 601)
    Z1, Z2 = np.meshgrid(g, g, indexing="ij")
    wz = np.exp(-0.5 * (Z1**2 + Z2**2)) / (2 * np.pi) * (g[1] - g[0]) ** 2
    L = np.linalg.cholesky(S)
    W = m[:, None, None] + np.einsum("ij,jab->iab", L, np.stack([Z1, Z2]))
    p_grid = [np.sum(wz / (1 + np.exp(-(x * W[0] + W[1])))) for x in Xt[:, 0]]
    np.testing.assert_allclose(clf.predict_proba(Xt)[:, 1], p_grid, atol=1e-9)
    mean, var = clf.predictive_moments(Xt)
    np.testing.assert_allclose(mean, Xt[:, 0] * m[0] + m[1], rtol=1e-12)
    np.testing.assert_allclose(var, Xt[:, 0] ** 2 * S[0, 0] + 2 * Xt[:, 0] * S[0, 1] + S[1, 1], rtol=1e-10)
    # the exact posterior by quadrature on a grid around the mode
    a = np.linspace(m[0] - 8 * math.sqrt(S[0, 0]), m[0] + 8 * math.sqrt(S[0, 0]), 401)
    b = np.linspace(m[1] - 8 * math.sqrt(S[1, 1]), m[1] + 8 * math.sqrt(S[1, 1]), 401)
    A, B = np.meshgrid(a, b, indexing="ij")
    eta = X[:, 0, None, None] * A + B
    logp = (np.where(y[:, None, None] == 1, -np.logaddexp(0, -eta), -np.logaddexp(0, eta)).sum(0)
            - 0.5 * A**2 / 1.5**2 - 0.5 * B**2 / 2.0**2)
    post = np.exp(logp - logp.max())
    post /= post.sum()
    mean_exact = [np.sum(post * A), np.sum(post * B)]
    sd_exact = [math.sqrt(np.sum(post * (A - mean_exact[0]) ** 2)), math.sqrt(np.sum(post * (B - mean_exact[1]) ** 2))]
    assert np.all(np.abs(m - mean_exact) < 0.1 * np.array(sd_exact))
    np.testing.assert_allclose(np.sqrt(np.diag(S)), sd_exact, rtol=0.1)
    p_exact = [np.sum(post / (1 + np.exp(-(x * A + B)))) for x in Xt[:, 0]]
    np.testing.assert_allclose(clf.predict_proba(Xt)[:, 1], p_exact, atol=0.01)
    np.testing.assert_allclose(np.exp(clf.predict_log_proba(Xt)), clf.predict_proba(Xt), rtol=1e-13)
    d = clf.decision_function(Xt)
    np.testing.assert_allclose(d, np.log(np.array(p_grid) / (1 - np.array(p_grid))), rtol=1e-7)


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation", "laplace"])
def test_sparse_input_gives_the_dense_answer(engine):
    X, y = _cancer(150, 8)
    Xs = StandardScaler().fit_transform(X)
    Xs[np.abs(Xs) < 0.5] = 0.0  # a genuinely sparse design
    dense = pcv.BayesianLogisticRegression(engine=engine).fit(Xs, y)
    sparse = pcv.BayesianLogisticRegression(engine=engine).fit(sp.csr_matrix(Xs), y)
    # Laplace's L-BFGS stops at a relative gradient of ~1e-8, where rounding differences of the sparse and
    # dense products show; the two convex engines solve to their (much tighter) optimality measures
    rtol = 1e-6 if engine == "laplace" else 1e-8
    for attr in ("coef_", "coef_var_", "intercept_", "intercept_var_"):
        np.testing.assert_allclose(getattr(sparse, attr), getattr(dense, attr), rtol=rtol, atol=1e-10)
    assert sparse.log_evidence_bound_ == pytest.approx(dense.log_evidence_bound_, rel=rtol * 1e-2)
    np.testing.assert_allclose(sparse.predict_proba(sp.csc_matrix(Xs)), dense.predict_proba(Xs), rtol=rtol, atol=1e-12)


def test_sparse_design_is_never_densified(monkeypatch):
    """A 2000 x 6000 sparse problem through the convex relaxation with every densification guarded."""
    rng = np.random.default_rng(0)
    X = sp.random(2000, 6000, density=0.003, format="csr", random_state=0, data_rvs=lambda k: np.ones(k))
    y = (rng.random(2000) < 1 / (1 + np.exp(-(X @ rng.normal(size=6000))))).astype(int)

    def refuse(*args, **kwargs):
        raise AssertionError("the sparse design was densified")

    to_dense = torch.Tensor.to_dense

    def guarded(self, *args, **kwargs):
        if self.layout != torch.strided and self.shape.numel() > 10**6:
            refuse()
        return to_dense(self, *args, **kwargs)

    for cls in (sp.csr_matrix, sp.csc_matrix, sp.coo_matrix):
        monkeypatch.setattr(cls, "toarray", refuse)
        monkeypatch.setattr(cls, "todense", refuse)
    monkeypatch.setattr(torch.Tensor, "to_dense", guarded)
    with warnings.catch_warnings():  # the Lanczos variance estimates keep gamma moving by ~0.3% per outer step
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        clf = pcv.BayesianLogisticRegression(engine="convex_relaxation").fit(X, y)
    p = clf.predict_proba(X)
    assert p.shape == (2000, 2) and clf.coef_.shape == (1, 6000) and np.all(clf.coef_var_ > 0)
    assert np.mean(clf.predict(X) == y) > 0.7


def test_auto_prior_scale_is_the_maximiser_of_the_engine_bound():
    """Type-II on dual_vg's bound (Pyro model, pyro.param) against golden section over refits of the explicit model."""
    X, y = _cancer(150, 5, seed=2)
    Xs = StandardScaler().fit_transform(X)
    pyro.param("prior_scale", torch.tensor(7.0))  # a user's param of the same name is left alone
    auto = pcv.BayesianLogisticRegression(prior_scale="auto", options={"gap_tol": 1e-12}).fit(Xs, y)
    assert float(pyro.param("prior_scale")) == 7.0 and list(pyro.get_param_store().keys()) == ["prior_scale"]
    assert auto.converged_ and auto.result_.info["type2"]["grad_norm"] <= auto.result_.info["type2"]["gtol"]

    def lvb(log_s):  # dual_vg's type-II objective: the local-bound ELBO at the dual optimum
        fit = pcv.BayesianLogisticRegression(prior_scale=math.exp(log_s), options={"gap_tol": 1e-12}).fit(Xs, y)
        return fit.result_.info["lvb_elbo"]

    ref = scipy.optimize.minimize_scalar(lambda t: -lvb(t), bracket=(math.log(0.3), math.log(3.0), math.log(30.0)),
                                         method="golden", tol=1e-7)
    assert auto.prior_scale_ == pytest.approx(math.exp(ref.x), rel=2e-3)  # a flat maximum: see the values
    assert auto.result_.info["type2"]["value"] == pytest.approx(-ref.fun, abs=1e-6)
    fixed = pcv.BayesianLogisticRegression(prior_scale=auto.prior_scale_, options={"gap_tol": 1e-12}).fit(Xs, y)
    assert auto.log_evidence_bound_ == pytest.approx(fixed.log_evidence_bound_, abs=1e-6)
    np.testing.assert_allclose(auto.coef_, fixed.coef_, rtol=1e-5, atol=1e-7)


def test_laplace_mean_is_the_map_of_scikit_learn_logistic_regression():
    """With a negligible intercept prior the Laplace posterior mean is LogisticRegression's MAP with C = prior_scale^2."""
    X, y = _cancer(200, 6, seed=4)
    Xs = StandardScaler().fit_transform(X)
    # grad_tol 1e-8: L-BFGS stops where the loss (|log joint| ~ 60) stops changing in float64, measured at a relative
    # gradient of 1e-9 to 2e-9 depending on its start; 1e-8 keeps the mode within ~1e-6 of scikit-learn's
    ours = pcv.BayesianLogisticRegression(engine="laplace", prior_scale=0.7, intercept_scale=1e4,
                                          options={"grad_tol": 1e-8, "max_iter": 2000}).fit(Xs, y)
    ref = LogisticRegression(C=0.7**2, tol=1e-12, max_iter=10000).fit(Xs, y)
    np.testing.assert_allclose(ours.coef_, ref.coef_, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.intercept_, ref.intercept_, rtol=1e-5, atol=1e-6)
    assert np.all(ours.coef_std_ > 0)


def test_logistic_regression_errors_name_the_argument():
    X, y = _cancer(40, 3)
    with pytest.raises(ValueError, match="Only binary classification is supported"):
        pcv.BayesianLogisticRegression().fit(X, np.arange(40) % 3)
    with pytest.raises(ValueError, match="prior_scale"):
        pcv.BayesianLogisticRegression(prior_scale=-1.0).fit(X, y)
    with pytest.raises(ValueError, match="prior_scale='auto'.*nuts"):
        pcv.BayesianLogisticRegression(engine="nuts", prior_scale="auto").fit(X, y)
    with pytest.raises(ValueError, match="learn_params=False"):
        pcv.BayesianLogisticRegression(prior_scale="auto", options={"learn_params": False}).fit(X, y)
    with pytest.raises(ValueError, match="intercept_scale"):
        pcv.BayesianLogisticRegression(intercept_scale=0).fit(X, y)
    with pytest.raises(TypeError, match="gap_tolerance"):
        pcv.BayesianLogisticRegression(options={"gap_tolerance": 1.0}).fit(X, y)


def test_calibration_example_runs(tmp_path, capsys):
    """``examples/sklearn_calibration.py`` end to end on one small split (keel spambase, offline)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "sklearn_calibration.py"
    spec = importlib.util.spec_from_file_location("sklearn_calibration", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fig = tmp_path / "calibration.png"
    mod.main(["--splits", "1", "--train", "120", "--figure", str(fig)])
    out = capsys.readouterr().out
    assert fig.stat().st_size > 10_000 and "| BayesianLogisticRegression (prior_scale='auto') |" in out
