"""Our warnings are scikit-learn's kind and point at the caller's line."""
import warnings

import pyro
import pyro.distributions as dist
import pytest
import sklearn.exceptions
import torch

import pyro_convexvb as pcv

D = torch.float64


def logistic(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 3, generator=g, dtype=D)
    return X, (X[:, 0] > 0).to(D)


def test_convergence_warning_is_scikit_learns():
    assert issubclass(pcv.ConvergenceWarning, sklearn.exceptions.ConvergenceWarning)
    X, y = _data()
    with warnings.catch_warnings():
        warnings.filterwarnings("error")
        warnings.filterwarnings("ignore", category=sklearn.exceptions.ConvergenceWarning)
        pcv.fit(logistic, X, y=y, engine="dual_vg", progress=False, options={"max_iter": 1})


@pytest.mark.parametrize("engine, options", [("dual_vg", {"max_iter": 1}), ("convex_relaxation", {"max_outer": 1}),
                                             ("laplace", {"max_iter": 1})])
def test_an_unconverged_fit_warns_at_the_callers_line(engine, options):
    X, y = _data()
    with pytest.warns(pcv.ConvergenceWarning) as record:
        pcv.fit(logistic, X, y=y, engine=engine, progress=False, options=options)
    assert all(w.filename == __file__ for w in record if issubclass(w.category, pcv.ConvergenceWarning))


def test_an_estimators_warning_points_at_the_callers_line():
    X, y = _data()
    with pytest.warns(pcv.ConvergenceWarning) as record:
        pcv.BayesianLinearRegression(max_iter=1).fit(X.numpy(), y.numpy())
    assert [w.filename for w in record if issubclass(w.category, pcv.ConvergenceWarning)] == [__file__]


# torch's one-time "sparse CSR tensor support is in beta" UserWarning is taken at import, not in a user's call:
# tests/test_datasets.py::test_a_sparse_load_does_not_surface_torch_beta_notices checks a first load_svmlight and
# a first make_sparse_classification in one fresh process (this module's former copy of that check)
