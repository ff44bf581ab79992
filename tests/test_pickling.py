"""Pickling: results, posteriors, guides and fitted estimators round-trip, and estimator pickles are O(model).

* ``convex_relaxation`` results, their matrix-free posteriors and guides built from them pickle (the precision
  operator is a picklable callable, not a closure), and give the same numbers after unpickling;
* ``BayesianLogisticRegression`` (every LGM engine) and ``GLM`` pickle to a size that does not grow with the
  number of training rows (the pickle keeps the posterior moments and the engine's covariance factor, not the
  data), with bitwise-identical predictions after unpickling;
* ``GPClassifier(learn_hyperparameters=True)`` pickles (its type-II model is a module-level callable).
"""
import pickle
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.gp import GPClassifier


def _data(N, d=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N, d))
    y = (X[:, 0] - 0.5 * X[:, 1] + rng.normal(size=N) > 0).astype(int)
    return X, y


def logistic_model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)


def _fit_cr(N=200):
    X, y = _data(N)
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y.astype(np.float64))
    return pcv.fit(logistic_model, Xt, y=yt, engine="convex_relaxation"), Xt


def test_convex_relaxation_result_and_posterior_pickle():
    res, X = _fit_cr()
    assert res.posterior.kind == "precision_operator"
    res2 = pickle.loads(pickle.dumps(res))
    q, q2 = res.posterior, res2.posterior
    assert torch.equal(q.loc, q2.loc) and torch.equal(q.variance, q2.variance)
    v = torch.randn(q.n, 3, dtype=torch.float64)
    assert torch.equal(q.precision_operator.mv(v), q2.precision_operator.mv(v))
    m, var = q.marginals(X[:7])
    m2, var2 = q2.marginals(X[:7])
    assert torch.equal(m, m2) and torch.equal(var, var2)
    g = torch.Generator().manual_seed(3)
    s1 = q.sample(4, generator=g)
    g = torch.Generator().manual_seed(3)
    assert torch.allclose(q2.sample(4, generator=g), s1, rtol=0, atol=1e-12)


@pytest.mark.parametrize("trainable", [True, False])
def test_guide_from_convex_relaxation_pickles(trainable):
    res, X = _fit_cr()
    guide = res.posterior.as_guide(trainable=trainable)
    median = guide.median()["w"]
    guide2 = pickle.loads(pickle.dumps(guide))
    assert torch.allclose(guide2.median()["w"], median, rtol=0, atol=0)


def test_compact_posterior_of_matrix_free_kind_is_dense_precision():
    res, X = _fit_cr()
    q = res.posterior
    c = q.compact()
    assert c.kind == "precision" and c.model_args == ((), {})
    A = q.precision_operator.to_dense()
    assert torch.allclose(torch.linalg.inv(c._precision), torch.linalg.inv(A), rtol=1e-10, atol=1e-12)
    m, v = q.marginals(X[:5])
    m2, v2 = c.marginals(X[:5])
    assert torch.allclose(m, m2, rtol=0, atol=1e-14) and torch.allclose(v, v2, rtol=1e-10)
    # above MAX_COMPACT_DENSE the operator is dropped: the moments stay, the rest refuses clearly
    import pyro_convexvb.posterior.gaussian as post

    q = q.with_model(q.model)  # without the engine's factor: log_prob factorises the operator and keeps the factor
    q.precision_cholesky = None
    q.log_prob(q.loc)
    old = post.MAX_COMPACT_DENSE
    post.MAX_COMPACT_DENSE = 2
    try:
        d = q.compact()
    finally:
        post.MAX_COMPACT_DENSE = old
    assert d.kind == "precision_operator" and d.precision_operator is None
    assert torch.equal(d.loc, q.loc) and torch.equal(d.variance, q.variance)
    for call in (lambda: d.sample(2), lambda: d.marginals(X[:2]), lambda: d.covariance(), lambda: d.log_prob(d.loc)):
        with pytest.raises(ValueError, match="without its precision operator"):
            call()


def _pickle_size(est):
    return len(pickle.dumps(est))


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation", "laplace"])
def test_logistic_regression_pickle_roundtrip_and_size_independent_of_N(engine):
    sizes = []
    for N in (500, 4000):
        X, y = _data(N)
        clf = pcv.BayesianLogisticRegression(engine=engine).fit(X, y)
        clf2 = pickle.loads(pickle.dumps(clf))
        np.testing.assert_array_equal(clf2.predict_proba(X[:40]), clf.predict_proba(X[:40]))
        np.testing.assert_array_equal(clf2.coef_, clf.coef_)
        assert clf2.result_.lgm is None and clf2.posterior_ is clf2.result_.posterior
        # pickling leaves the in-memory estimator's full result alone
        assert "dropped" not in clf.result_.info and "dropped" in clf2.result_.info
        sizes.append(_pickle_size(clf))
    # scikit-learn's LogisticRegression pickles to ~1 kB; ours holds a (d+1)^2 factor and the result summary
    assert sizes[1] <= sizes[0] * 1.05 + 200, sizes
    assert sizes[1] < 20_000, sizes


def test_glm_pickle_size_independent_of_N():
    sizes = []
    for N in (300, 2400):
        X, y = _data(N)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            glm = pcv.GLM(max_iter=60, min_steps=60, window=20, lr=0.1).fit(X, y)
        glm2 = pickle.loads(pickle.dumps(glm))
        np.testing.assert_array_equal(glm2.predict_proba(X[:30]), glm.predict_proba(X[:30]))
        sizes.append(_pickle_size(glm))
    assert sizes[1] <= sizes[0] * 1.05 + 200, sizes


@pytest.mark.filterwarnings("ignore::pyro_convexvb.ConvergenceWarning")  # a 5-step type-II budget
def test_gp_classifier_with_type2_pickles():
    X, y = _data(40, d=2)
    clf = GPClassifier(learn_hyperparameters=True, hyper_options={"max_iter": 5}).fit(X, y)
    clf2 = pickle.loads(pickle.dumps(clf))
    np.testing.assert_array_equal(clf2.predict_proba(X[:10]), clf.predict_proba(X[:10]))


@pytest.mark.filterwarnings("ignore::pyro_convexvb.ConvergenceWarning")  # random labels; pickling is the point
def test_large_sparse_logistic_regression_with_lanczos_variances_pickles_compactly(tmp_path):
    # d = 3000 > MAX_COMPACT_DENSE: the pickle keeps the mean, the marginal variances and the Lanczos factors
    # (n x k) that prediction uses, not the dense precision nor the design
    import scipy.sparse as sp

    sizes = []
    for N in (600, 2400):
        X = sp.random(N, 3000, density=0.003, format="csr", random_state=1)
        y = np.random.default_rng(0).integers(0, 2, N)
        clf = pcv.BayesianLogisticRegression(engine="convex_relaxation", options={"variance": "lanczos"}).fit(X, y)
        assert clf.result_.posterior.lanczos is not None and clf.result_.posterior.precision_cholesky is None
        blob = pickle.dumps(clf)
        clf2 = pickle.loads(blob)
        np.testing.assert_array_equal(clf2.predict_proba(X[:30]), clf.predict_proba(X[:30]))
        assert clf2.posterior_.precision_operator is None
        with pytest.raises(ValueError, match="without its precision operator"):
            clf2.posterior_.sample(1)
        pcv.save(clf, tmp_path / "m.pt")
        clf3 = pcv.load(tmp_path / "m.pt")
        np.testing.assert_array_equal(clf3.predict_proba(X[:30]), clf.predict_proba(X[:30]))
        sizes.append(len(blob))
    assert sizes[1] <= sizes[0] * 1.05 + 200, sizes


def _gmrf_precision(n=9):
    from pyro_convexvb.distributions import rw_precision

    return (rw_precision(n).to_dense() + 0.3 * torch.eye(n, dtype=torch.float64)).to_sparse_csr()


def gmrf_model(y=None):
    from pyro_convexvb.distributions import SparseGMRF

    x = pyro.sample("x", SparseGMRF(torch.zeros(9, dtype=torch.float64), _gmrf_precision()))
    with pyro.plate("obs", 9):
        pyro.sample("y", dist.Normal(x, 0.5), obs=y)


def test_results_and_guides_of_a_sparse_gmrf_model_pickle():
    """The SparseGMRF prior's Cholesky factor held QDLDL's solver (an extension type): pickling the distribution, a
    result whose state reaches it, or a guide whose prototype trace holds it raised TypeError. The factor's arrays
    travel; the solver is remade at the next refactorisation."""
    from pyro_convexvb.distributions import SparseGMRF

    n, Q, model = 9, _gmrf_precision(), gmrf_model
    y = torch.linspace(-1.0, 1.0, n, dtype=torch.float64)
    d = SparseGMRF(torch.zeros(n, dtype=torch.float64), Q, torch.tensor(2.0, dtype=torch.float64))
    d2 = pickle.loads(pickle.dumps(d))
    torch.testing.assert_close(d2.log_prob(y), d.log_prob(y), rtol=1e-14, atol=0.0)
    chol = pickle.loads(pickle.dumps(d._chol))
    logdet = chol.logdet()
    # a refactorisation after unpickling (same pattern: the backend's solver is remade)
    assert chol.update(2.0 * Q.to_dense()).logdet() == pytest.approx(logdet + n * np.log(2.0), rel=1e-12)
    res = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    res2 = pickle.loads(pickle.dumps(res))
    torch.testing.assert_close(res2.posterior.loc, res.posterior.loc, rtol=0, atol=0)
    guide = pickle.loads(pickle.dumps(res.posterior.as_guide(trainable=False)))
    torch.testing.assert_close(guide.median()["x"], res.posterior.loc, rtol=0, atol=1e-12)
