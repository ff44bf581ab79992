"""``pcv.save`` / ``pcv.load``: atomic files of plain states that torch's default ``weights_only=True`` loads.

Round trips (identical predictions) for online learners, inference results, posteriors and fitted
estimators; the payload holds only tensors and plain Python types; unknown classes, class versions and
file versions are refused with a clear error; a failing write leaves the previous file intact. The
kill -9 scenarios are in tests/reliability/.
"""
import os
import warnings

import numpy as np
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.io import atomic_write, to_state
from pyro_convexvb.online import OnlineADF, OnlineBayesLogistic, OnlineMarginalVB


def _data(N, d=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N, d))
    y = (X[:, 0] - 0.5 * X[:, 1] + rng.normal(size=N) > 0).astype(int)
    return X, y


def _assert_plain(x, where="payload"):
    if x is None or isinstance(x, (bool, int, float, str)) or type(x) is torch.Tensor:
        return
    if type(x) in (list, tuple):
        for i, v in enumerate(x):
            _assert_plain(v, f"{where}[{i}]")
        return
    assert type(x) is dict, f"{where}: {type(x)} is not a plain type"
    for k, v in x.items():
        assert isinstance(k, (str, int)), f"{where}: key {k!r}"
        _assert_plain(v, f"{where}[{k!r}]")


def _roundtrip(obj, tmp_path):
    path = tmp_path / "obj.pt"
    pcv.save(obj, path)
    payload = torch.load(path)  # torch's default: weights_only=True
    _assert_plain(payload)
    assert payload["format"] == "pyro_convexvb.save"
    return pcv.load(path)


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation", "laplace", "diag_mixture"])
def test_logistic_regression_roundtrip(engine, tmp_path):
    X, y = _data(300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        clf = pcv.BayesianLogisticRegression(engine=engine, options={"max_steps": 300} if engine == "diag_mixture"
                                             else None).fit(X, y)
    clf2 = _roundtrip(clf, tmp_path)
    assert type(clf2) is pcv.BayesianLogisticRegression and clf2.get_params() == clf.get_params()
    for method in ("predict_proba", "decision_function", "predict"):
        np.testing.assert_array_equal(getattr(clf2, method)(X[:50]), getattr(clf, method)(X[:50]))
    for attr in ("coef_", "coef_var_", "intercept_", "classes_"):
        np.testing.assert_array_equal(getattr(clf2, attr), getattr(clf, attr))
    assert clf2.converged_ == clf.converged_ and clf2.log_evidence_bound_ == clf.log_evidence_bound_
    assert clf2.posterior_ is clf2.result_.posterior and clf2.result_.lgm is None


def test_saved_estimator_size_does_not_grow_with_N(tmp_path):
    sizes = []
    for N in (400, 4000):
        X, y = _data(N)
        pcv.save(pcv.BayesianLogisticRegression().fit(X, y), tmp_path / "m.pt")
        sizes.append(os.path.getsize(tmp_path / "m.pt"))
    assert sizes[1] <= sizes[0] * 1.05 + 200, sizes


def test_string_classes_and_feature_names(tmp_path):
    pd = pytest.importorskip("pandas")
    X, y = _data(120)
    Xf = pd.DataFrame(X, columns=["a", "b", "c", "d"])
    clf = pcv.BayesianLogisticRegression(engine="laplace").fit(Xf, np.where(y == 1, "yes", "no"))
    clf2 = _roundtrip(clf, tmp_path)
    assert clf2.classes_.tolist() == ["no", "yes"] and clf2.feature_names_in_.tolist() == ["a", "b", "c", "d"]
    assert clf2.predict(Xf[:5]).tolist() == clf.predict(Xf[:5]).tolist()


def test_glm_and_linear_regression_roundtrip(tmp_path):
    X, y = _data(200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        glm = pcv.GLM(max_iter=60, min_steps=60, window=20, lr=0.1).fit(X, y)
    glm2 = _roundtrip(glm, tmp_path)
    np.testing.assert_array_equal(glm2.predict_proba(X[:20]), glm.predict_proba(X[:20]))
    assert glm2.param_state_["params"].keys() == glm.param_state_["params"].keys()
    reg = pcv.BayesianLinearRegression().fit(X, X @ np.arange(4.0) + np.random.default_rng(1).normal(size=200))
    reg2 = _roundtrip(reg, tmp_path)
    m, s = reg.predict(X[:20], return_std=True)
    m2, s2 = reg2.predict(X[:20], return_std=True)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(s2, s)


@pytest.mark.parametrize("cls", [OnlineBayesLogistic, OnlineADF, OnlineMarginalVB])
def test_online_learner_roundtrip_and_resume(cls, tmp_path):
    X, y = _data(300, d=6)
    a = cls(6).partial_fit(X[:150], y[:150])
    b = _roundtrip(a, tmp_path)
    assert type(b) is cls
    np.testing.assert_array_equal(b.predict_proba(X[150:]), a.predict_proba(X[150:]))
    a.partial_fit(X[150:], y[150:])
    b.partial_fit(X[150:], y[150:])  # resuming from the file continues the same stream
    np.testing.assert_allclose(b.predict_proba(X), a.predict_proba(X), rtol=0, atol=0)
    assert b.n_seen_ == a.n_seen_ == 300


def test_result_and_posterior_roundtrip(tmp_path):
    X, y = _data(150)
    clf = pcv.BayesianLogisticRegression(engine="convex_relaxation").fit(X, y)
    res = clf.result_
    r2 = _roundtrip(res, tmp_path)
    assert r2.engine == res.engine and r2.converged == res.converged and r2.stop_reason == res.stop_reason
    assert r2.log_evidence_bound == res.log_evidence_bound
    assert str(r2.optimality) == str(res.optimality)
    assert r2.history["objective"] == res.history["objective"]
    assert torch.equal(r2.posterior.precision_cholesky, res.posterior.precision_cholesky) and r2.lgm is None
    # the matrix-free precision is stored dense (n <= MAX_COMPACT_DENSE): exact same covariance
    C = torch.linalg.inv(res.posterior.precision_operator.to_dense())
    assert torch.allclose(r2.posterior.covariance(), C, rtol=1e-10, atol=1e-13)
    for q in (pcv.GaussianPosterior(torch.zeros(3, dtype=torch.float64),
                                    cov_factor=torch.ones(3, 1, dtype=torch.float64),
                                    cov_diag=torch.full((3,), .5, dtype=torch.float64)),
              pcv.GaussianPosterior(torch.ones(2, dtype=torch.float64),
                                    scale_tril=torch.tensor([[1., 0.], [.5, 2.]], dtype=torch.float64))):
        q2 = _roundtrip(q, tmp_path)
        assert q2.kind == q.kind and torch.equal(q2.covariance(), q.covariance())


def test_refuses_unknown_class_version_and_format(tmp_path):
    X, y = _data(100)
    clf = pcv.BayesianLogisticRegression(engine="laplace").fit(X, y)
    path = tmp_path / "m.pt"
    pcv.save(clf, path)
    payload = torch.load(path)
    bad = dict(payload, object=dict(payload["object"], version=99))
    torch.save(bad, tmp_path / "v.pt")
    with pytest.raises(ValueError, match="version 99 of 'BayesianLogisticRegression'"):
        pcv.load(tmp_path / "v.pt")
    bad = dict(payload, object=dict(payload["object"], **{"class": "os.system"}))
    torch.save(bad, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="class 'os.system'"):
        pcv.load(tmp_path / "c.pt")
    torch.save(dict(payload, format_version=2), tmp_path / "f.pt")
    with pytest.raises(ValueError, match="file format version 2"):
        pcv.load(tmp_path / "f.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "o.pt")
    with pytest.raises(ValueError, match="not a file written by pyro_convexvb.save"):
        pcv.load(tmp_path / "o.pt")
    # empty, garbage, a flipped byte, a truncated file: a ValueError naming the file (raw KeyError, EOFError,
    # UnicodeDecodeError, RuntimeError before)
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[200] ^= 0xFF
    for name, data in (("empty", b""), ("garbage", b"hello world\n" * 10), ("flipped", bytes(flipped)),
                       ("half", good[:len(good) // 2])):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=rf"{name}: not a readable file written by pyro_convexvb.save"):
            pcv.load(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="no such file"):
        pcv.load(tmp_path / "missing.pt")


def test_refuses_objects_without_plain_state(tmp_path):
    with pytest.raises(TypeError, match=r"obj\['f'\] is a builtins.function"):
        pcv.save({"f": lambda x: x}, tmp_path / "x.pt")
    X, y = _data(50)
    reg = pcv.BayesianLinearRegression(basis=torch.tanh).fit(X, X[:, 0])
    with pytest.raises(TypeError, match="basis="):
        pcv.save(reg, tmp_path / "x.pt")
    assert not os.path.exists(tmp_path / "x.pt")


def test_atomic_write_failure_keeps_previous_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_write(path, lambda f: f.write(b"old"))

    def broken(f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, broken)
    assert path.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # the temporary file was removed
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_write(tmp_path / "nope" / "x.pt", lambda f: None)


def test_plain_state_of_nested_values():
    state = to_state({"a": np.arange(3), "b": (1, "x"), "c": np.array(["u", "v"]), 3: None})
    _assert_plain(state)
    back = pcv.io.from_state(state)
    assert back["b"] == (1, "x") and back[3] is None and back["c"].tolist() == ["u", "v"]
    np.testing.assert_array_equal(back["a"], np.arange(3))


def test_malformed_objects_raise_naming_the_file_and_random_states_round_trip(tmp_path):
    """A valid container whose object was edited (a field missing or of the wrong type, a dtype tag naming a torch
    function, variances of another shape) is a ValueError naming the file (bare KeyError/AttributeError, or a
    silent load, before); an estimator's numpy RandomState saves with its generator state."""
    X, y = _data(100)
    clf = pcv.BayesianLogisticRegression(engine="laplace", random_state=np.random.RandomState(3)).fit(X, y)
    clf2 = _roundtrip(clf, tmp_path)
    assert isinstance(clf2.random_state, np.random.RandomState)
    assert clf2.random_state.randint(1 << 30) == clf.random_state.randint(1 << 30)  # the state as saved
    q = pcv.GaussianPosterior(torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    path = tmp_path / "q.pt"
    pcv.save(q, path)
    payload = torch.load(path)
    fields = payload["object"]["fields"]
    for name, obj in (("nofields", {k: v for k, v in payload["object"].items() if k != "fields"}),
                      ("noloc", dict(payload["object"], fields={k: v for k, v in fields.items() if k != "loc"})),
                      ("strloc", dict(payload["object"], fields=dict(fields, loc="abc"))),
                      ("shape", dict(payload["object"],
                                     fields=dict(fields, variance=torch.ones(5, dtype=torch.float64)))),
                      ("dtype", {"__pcv__": "dtype", "name": "load"})):
        torch.save(dict(payload, object=obj), tmp_path / f"{name}.pt")
        with pytest.raises(ValueError, match=rf"{name}\.pt: "):
            pcv.load(tmp_path / f"{name}.pt")
