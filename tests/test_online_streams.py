"""Streams: synthetic generator settings, chunked svmlight/CSV/Criteo readers, feature hashing."""
import ast
import gzip
import math
import subprocess
import sys
import zlib

import numpy as np
import pytest
import scipy.sparse as sp

from pyro_convexvb.online.streams import (hash_features, iter_criteo, iter_csv, iter_svmlight,
                                          make_online_stream)


def test_random_stream_matches_its_specification():
    s = make_online_stream(d=200, d_t=20, weight_std=1.0, seed=0)
    X, y = s.take(20000)
    assert X.shape == (20000, 200)
    nnz = np.diff(X.indptr)
    assert nnz.mean() == pytest.approx(20, abs=0.15)
    assert nnz.var() == pytest.approx(200 * 0.1 * 0.9, rel=0.05)  # Binomial(d, d_t / d)
    assert np.all(X.data == 1.0)
    assert s.theta.std() == pytest.approx(1.0, abs=0.12)
    p = 1 / (1 + np.exp(-(X @ s.theta)))
    assert (y > 0).mean() == pytest.approx(p.mean(), abs=0.01)
    Xu, _ = make_online_stream(d=50, d_t=10, weight_std=2.0, binary=False, seed=1).take(3000)
    assert 0 <= Xu.data.min() and Xu.data.max() <= 1 and Xu.data.mean() == pytest.approx(0.5, abs=0.02)


def test_stream_rows_do_not_depend_on_chunking():
    s = make_online_stream(d=40, d_t=4, weight_std=1.0, seed=2)
    X1, y1 = s.take(40000)
    parts = list(s.chunks(40000, chunk_size=6999))
    assert [p[0].shape[0] for p in parts[:-1]] == [6999] * (len(parts) - 1)
    X2 = sp.vstack([p[0] for p in parts], format="csr")
    assert (X1 != X2).nnz == 0
    np.testing.assert_array_equal(y1, np.concatenate([p[1] for p in parts]))


def test_categorical_zipf_stream_has_one_feature_per_category_and_the_long_tail():
    sizes = [2**j for j in range(1, 9)]
    s = make_online_stream(d=None, d_t=None, weight_std=2.0, categorical=sizes, zipf=1.75, seed=0)
    X, _ = s.take(30000)
    assert X.shape[1] == sum(sizes)
    np.testing.assert_array_equal(np.diff(X.indptr), len(sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    last = X[:, offsets[-1]:].toarray().sum(0)  # the category with 256 features
    n = np.arange(sizes[-1])
    prob = (n + 1.0) ** -1.75 / np.sum((n + 1.0) ** -1.75)
    np.testing.assert_allclose(last[:3] / 30000, prob[:3], rtol=0.05)
    uniform, _ = make_online_stream(d=60, d_t=None, weight_std=1.0, categorical=3, seed=0).take(9000)
    counts = uniform.toarray().sum(0)
    assert counts.min() > 0.7 * 9000 / 20
    with pytest.raises(ValueError, match="d: the category sizes"):
        make_online_stream(d=10, categorical=[4, 4])
    with pytest.raises(ValueError, match="zipf"):
        make_online_stream(d=10, d_t=2, zipf=1.5)
    with pytest.raises(ValueError, match="d_t"):
        make_online_stream(d=10, d_t=20)


def test_svmlight_reader_roundtrip_in_chunks(tmp_path):
    pytest.importorskip("sklearn")
    from sklearn.datasets import dump_svmlight_file

    rng = np.random.default_rng(0)
    X = sp.random(257, 40, density=0.1, format="csr", random_state=0)
    X.data = np.round(rng.normal(size=X.nnz), 6)
    y = rng.choice([-1, 1], 257)
    path = tmp_path / "d.svm"
    dump_svmlight_file(X, y, str(path), zero_based=False)
    chunks = list(iter_svmlight(path, chunk_size=100, num_features=40))
    assert [c[0].shape[0] for c in chunks] == [100, 100, 57]
    Xr = sp.vstack([c[0] for c in chunks], format="csr")
    np.testing.assert_allclose(Xr.toarray(), X.toarray(), rtol=1e-12)
    np.testing.assert_array_equal(np.concatenate([c[1] for c in chunks]), y)
    with gzip.open(tmp_path / "d.svm.gz", "wt") as fh:
        fh.write(path.read_text())
    Xg = sp.vstack([c[0] for c in iter_svmlight(tmp_path / "d.svm.gz", 1000, num_features=40)])
    assert (Xg != Xr).nnz == 0


def test_svmlight_reader_reports_bad_lines(tmp_path):
    p = tmp_path / "bad.svm"
    p.write_text("1 1:0.5 3:1\n-1 2:x\n")
    with pytest.raises(ValueError, match="line 2"):
        list(iter_svmlight(p, num_features=5))
    p.write_text("1 1:0.5 9:1 # comment\n")
    with pytest.raises(ValueError, match="out of range"):
        list(iter_svmlight(p, num_features=5))
    X, _ = next(iter_svmlight(p, num_features=4, hashing=0))
    assert X.shape == (1, 4) and X.sum() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="num_features"):
        list(iter_svmlight(p))


def test_streams_read_svmlight_through_io_not_datasets():
    import pyro_convexvb.io as pio
    import pyro_convexvb.online.streams as streams

    assert streams.parse_svmlight_lines is pio.parse_svmlight_lines
    tree = ast.parse(open(streams.__file__, encoding="utf-8").read())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    # datasets imports streams (its make_online_stream re-export), so streams must not import datasets
    assert not [m for m in imported if m.split(".")[-1] == "datasets"], imported


def test_datasets_and_streams_import_in_either_order():
    """Each order in a fresh package: one interpreter, which forgets every ``pyro_convexvb`` module between the
    orders (its dependencies stay loaded)."""
    orders = [("pyro_convexvb.online.streams", "pyro_convexvb.datasets"),
              ("pyro_convexvb.datasets", "pyro_convexvb.online.streams")]
    code = ("import importlib, sys\n"
            "for order in sys.argv[1:]:\n"
            "    for name in [m for m in sys.modules if m == 'pyro_convexvb' or m.startswith('pyro_convexvb.')]:\n"
            "        del sys.modules[name]\n"
            "    for m in order.split(','):\n"
            "        importlib.import_module(m)\n"
            "    import pyro_convexvb.datasets as D\n"
            "    print(D.parse_svmlight_lines.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code, *(",".join(o) for o in orders)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pyro_convexvb.io"] * len(orders), out.stdout


def test_open_text_reads_plain_and_gzip(tmp_path):
    from pyro_convexvb.io import open_text

    (tmp_path / "a.txt").write_text("1 1:2\n")
    with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as fh:
        fh.write("1 1:2\n")
    for name in ("a.txt", "a.txt.gz"):
        with open_text(tmp_path / name) as fh:
            assert fh.read() == "1 1:2\n"


def _criteo_line(label, ints, cats):
    return "\t".join([str(label)] + [("" if v is None else str(v)) for v in ints] + cats)


def test_criteo_reader_hashes_13_integer_and_26_categorical_columns(tmp_path):
    ints1 = [1, 0, 5, None, 100, 2, 3, 0, 7, 1, None, 2, 1000]
    cats1 = [f"{k:08x}" for k in range(26)]
    cats2 = [""] * 26
    cats2[3] = "deadbeef"
    lines = [_criteo_line(1, ints1, cats1), _criteo_line(0, [None] * 13, cats2)]
    path = tmp_path / "criteo.txt"
    path.write_text("\n".join(lines) + "\n")
    (X, y), = list(iter_criteo(path, num_features=2**24))
    np.testing.assert_array_equal(y, [1, 0])
    # 1 bias + 11 non-empty integer fields + 26 categorical fields; 1 bias + 1 categorical
    assert X[0].sum() == 1 + 11 + 26 and X[1].sum() == 2
    col = zlib.crc32("17=deadbeef".encode(), 0) % 2**24
    assert X[1, col] == 1.0
    col_int = zlib.crc32("5#L21".encode(), 0) % 2**24  # floor(log(100)^2) = 21
    assert X[0, col_int] == 1.0
    with pytest.raises(ValueError, match="line 1"):
        list(iter_csv(path, integer_columns=[1], categorical_columns=[45], delimiter="\t"))


def test_hash_features_is_deterministic_and_sums_collisions():
    X = hash_features([["a", "b", "a"], [], ["z"]], 1000, seed=3)
    assert X.shape == (3, 1000)
    assert X[0].sum() == 3 and X[0].max() == 2 and X[1].nnz == 0
    assert hash_features([["a"]], 1000, seed=3).indices[0] == X[0].indices[X[0].data == 2][0]
    assert X[2].indices[0] == zlib.crc32(b"z", 3) % 1000
    assert math.isclose(hash_features([["q"]], 7).sum(), 1.0)
