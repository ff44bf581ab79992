"""Sharded readers and generators (one process): the shards, concatenated in rank order, are the whole."""
import numpy as np
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.datasets import load_csv, load_svmlight, make_sparse_classification, read_byte_range, save_svmlight


@pytest.fixture
def svm_file(tmp_path):
    X, y, _ = make_sparse_classification("a9a", scale=0.003, seed=2)
    path = tmp_path / "d.svm"
    save_svmlight(path, X, 2 * y - 1)
    return path, X, y


@pytest.mark.parametrize("P", [1, 2, 3, 7])
def test_byte_ranges_partition_the_lines(svm_file, P):
    path, _, _ = svm_file
    whole = path.read_bytes()
    parts = [read_byte_range(path, (r, P))[0] for r in range(P)]
    assert b"".join(parts) == whole
    assert all(p == b"" or p.endswith(b"\n") for p in parts)


@pytest.mark.parametrize("P", [2, 5])
def test_svmlight_shards_concatenate_to_the_whole(svm_file, P):
    path, X, y = svm_file
    Xw, yw = load_svmlight(path, n_features=X.shape[1])
    parts = [load_svmlight(path, n_features=X.shape[1], zero_based=False, shard=(r, P)) for r in range(P)]
    assert sum(p[0].shape[0] for p in parts) == X.shape[0]
    assert torch.equal(torch.cat([p[0].to_dense() for p in parts]), Xw.to_dense())
    assert torch.equal(torch.cat([p[1] for p in parts]), yw)


def test_svmlight_shard_needs_agreement_without_a_process_group(svm_file):
    path, X, _ = svm_file
    with pytest.raises(ValueError, match="zero_based"):
        load_svmlight(path, n_features=X.shape[1], shard=(0, 2))
    with pytest.raises(ValueError, match="n_features"):
        load_svmlight(path, zero_based=False, shard=(0, 2))
    with pytest.raises(ValueError, match="shard"):
        load_svmlight(path, shard=(2, 2))
    Xs, _ = load_svmlight(path, shard=(0, 1))  # one shard: the whole file, nothing to agree on
    assert Xs.shape[0] == X.shape[0]


@pytest.mark.parametrize("header", [False, True])
def test_csv_shards_concatenate_to_the_whole(tmp_path, header):
    rng = np.random.default_rng(0)
    table = np.column_stack([rng.integers(0, 2, 57), rng.normal(size=(57, 4))])
    path = tmp_path / "d.csv"
    with open(path, "w") as f:
        if header:
            f.write("y,a,b,c,d\n")
        for row in table:
            f.write(",".join(repr(float(v)) for v in row) + "\n")
    X, y = load_csv(path, header=header)
    assert np.array_equal(X.numpy(), table[:, 1:]) and np.array_equal(y.numpy(), table[:, 0])
    parts = [load_csv(path, header=header, shard=(r, 4)) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts if p[0].numel()]), X)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)


@pytest.mark.parametrize("shape", ["a9a", "real-sim"])
def test_generator_shards_are_slices(shape):
    X, y, w, b = make_sparse_classification(shape, scale=0.01, seed=4, return_intercept=True)
    parts = [make_sparse_classification(shape, scale=0.01, seed=4, return_intercept=True, shard=(r, 3))
             for r in range(3)]
    for r, (Xr, yr, wr, br) in enumerate(parts):
        lo, hi = pcv.distributed.shard_range(X.shape[0], r, 3)
        assert torch.equal(Xr.to_dense(), X.to_dense()[lo:hi]) and torch.equal(yr, y[lo:hi])
        assert torch.equal(wr, w) and br == b
