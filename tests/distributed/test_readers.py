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


def _gz(path):
    import gzip

    out = path.with_name(path.name + ".gz")
    out.write_bytes(gzip.compress(path.read_bytes()))
    return out


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("hashing", [None, 5])
@pytest.mark.parametrize("P", [1, 2, 3, 7])
def test_iter_svmlight_shards_concatenate_to_the_whole(svm_file, P, hashing, gz):
    """iter_svmlight(shard=(r, P)) streams the byte range of load_svmlight(shard=...): the shards' chunks in rank
    order are the whole file's rows, every chunk but a shard's last holds chunk_size rows, every chunk is
    canonical CSR (the direct kernel without hashing, the block path with it). The documentation said so; the
    argument did not exist."""
    import scipy.sparse as sp

    from pyro_convexvb.online import iter_svmlight

    path, X, _ = svm_file
    path = _gz(path) if gz else path
    d = X.shape[1]
    whole = list(iter_svmlight(path, num_features=d, hashing=hashing, chunk_size=10 ** 6))
    Xw, yw = whole[0]
    parts = [list(iter_svmlight(path, num_features=d, hashing=hashing, chunk_size=37, shard=(r, P), prefetch=r % 2))
             for r in range(P)]
    chunks = [c for part in parts for c in part]
    Xs = sp.vstack([c[0] for c in chunks], format="csr")
    assert Xs.shape == Xw.shape and (Xs != Xw).nnz == 0
    assert np.array_equal(np.concatenate([c[1] for c in chunks]), yw)
    for r, part in enumerate(parts):
        assert [c[0].shape[0] for c in part[:-1]] == [37] * (len(part) - 1)
        assert all(c[0].has_canonical_format and c[0].shape[1] == d for c in part)
        if hashing is None:  # the rows of load_svmlight's shard
            Xr, yr = load_svmlight(path, n_features=d, zero_based=False, shard=(r, P))
            assert torch.equal(torch.from_numpy(sp.vstack([c[0] for c in part]).toarray()), Xr.to_dense())
            assert torch.equal(torch.from_numpy(np.concatenate([c[1] for c in part])), yr)


@pytest.mark.parametrize("name", ["t.svm", "t.svm.gz"])
def test_iter_svmlight_shard_errors_name_the_files_line(tmp_path, name):
    """A malformed line in a later shard is named by its line of the file (not of the shard); bad shards raise."""
    import gzip

    from pyro_convexvb.online import iter_svmlight

    lines = [f"1 {i % 5 + 1}:1" for i in range(300)]
    lines[250] = "1 3:x"
    data = ("\n".join(lines) + "\n").encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    for hashing in (None, 1):
        assert sum(X.shape[0] for X, _ in iter_svmlight(path, num_features=8, hashing=hashing, shard=(1, 3))) == 100
        with pytest.raises(ValueError, match=rf"{name}, line 251: cannot parse '1 3:x'"):
            list(iter_svmlight(path, num_features=8, hashing=hashing, chunk_size=20, shard=(2, 3)))
    for bad in ((3, 3), (0, 0), (1,), "ab"):
        with pytest.raises(ValueError, match="shard"):
            iter_svmlight(path, num_features=8, shard=bad)


@pytest.mark.parametrize("gz", [False, True])
def test_a_line_range_read_in_pieces_is_the_byte_range(tmp_path, gz):
    """open_line_range (the core of read_byte_range and iter_svmlight(shard=)) gives the range's lines whether
    read whole, by read(k) or by readinto, for any piece size (the range's last line finished past its end)."""
    import gzip

    from pyro_convexvb.online._textio import open_line_range

    rng = np.random.default_rng(1)
    for trial in range(12):
        text = b"".join(b"x" * int(rng.integers(0, 30)) + b"\n" for _ in range(int(rng.integers(0, 40))))
        text = text[:-1] if trial % 2 and text else text  # a last line without a newline
        path = tmp_path / (f"t{trial}.txt" + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(text) if gz else text)
        for P in (1, 2, 5):
            ranges = [read_byte_range(path, (r, P)) for r in range(P)]
            assert b"".join(data for data, _ in ranges) == text
            for r, (whole, start) in enumerate(ranges):
                for piece in (1, 7, 1000):
                    fh, s = open_line_range(path, (r, P))
                    with fh:
                        got = b"".join(iter(lambda: fh.read(piece), b""))
                    fh, _ = open_line_range(path, (r, P))
                    buf, into = bytearray(piece), b""
                    with fh:
                        while k := fh.readinto(buf):
                            into += buf[:k]
                    assert s == start and got == into == whole
