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


def test_sparse_loads_do_not_leak_torchs_beta_warning():
    """torch's one-time "sparse CSR tensor support is in beta" UserWarning is taken at import, not in a user's call."""
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('error', UserWarning)\n"
            "import pyro_convexvb as pcv\n"
            "X, y, _ = pcv.datasets.make_sparse_classification('a9a', scale=0.01, seed=0)\n"
            "print(X.layout)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sparse_csr" in proc.stdout
