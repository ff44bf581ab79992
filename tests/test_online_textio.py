"""The reading core of the text streams against the earlier pure-Python readers (copied here as references)."""
import gzip
import itertools
import math
import zlib

import numpy as np
import pytest
import scipy.sparse as sp

from pyro_convexvb.online import _textio
from pyro_convexvb.online.streams import iter_criteo, iter_csv, iter_svmlight


# ----------------------------------------------------------------------------- references (the former readers)
def _ref_bin(value):
    v = float(value)
    if v <= 2:
        return str(int(math.floor(v)))
    return "L" + str(int(math.floor(math.log(v) ** 2)))


def _ref_hash(rows, num_features, seed):
    indptr, cols = [0], []
    for toks in rows:
        cols.extend(zlib.crc32(t.encode("utf-8"), seed) % num_features for t in toks)
        indptr.append(len(cols))
    X = sp.csr_matrix((np.ones(len(cols)), np.asarray(cols, dtype=np.int64), np.asarray(indptr)),
                      shape=(len(indptr) - 1, num_features))
    X.sum_duplicates()
    return X


def ref_iter_csv(path, label_column, int_cols, cat_cols, num_features, seed, delimiter, header=False,
                 add_bias=True):
    """All rows of the former pure-Python ``iter_csv`` as one ``(X, y)`` (blank lines skipped)."""
    need = max((label_column,) + tuple(int_cols) + tuple(cat_cols)) + 1
    opener = gzip.open if str(path).endswith(".gz") else open
    labels, rows = [], []
    with opener(path, "rt", encoding="utf-8") as fh:
        lines = list(fh)
    for lineno, line in enumerate(lines[int(header):], 1 + int(header)):
        line = line.rstrip("\r\n")
        if not line:
            continue
        f = line.split(delimiter)
        assert len(f) >= need, lineno
        labels.append(float(f[label_column]))
        toks = ["__bias__"] if add_bias else []
        toks += [f"{j}#{_ref_bin(f[j])}" for j in int_cols if f[j] != ""]
        toks += [f"{j}={f[j]}" for j in cat_cols if f[j] != ""]
        rows.append(toks)
    return _ref_hash(rows, num_features, seed), np.asarray(labels)


def _random_criteo_lines(rng, n, odd=True):
    lines = []
    for _ in range(n):
        label = str(rng.integers(0, 2))
        ints = []
        for _ in range(13):
            u = rng.random()
            if u < 0.2:
                ints.append("")
            elif odd and u < 0.25:
                ints.append(rng.choice(["1.5", "2.0", "1e3", "-3", "+7", " 4", "0", "-0", "007"]))
            else:
                ints.append(str(int(rng.geometric(0.05)) - 1))
        cats = ["" if rng.random() < 0.15 else f"{int(rng.zipf(1.5)) % 5000:08x}" for _ in range(26)]
        if odd and rng.random() < 0.1:
            cats[3] = "caf\u00e9 x"  # non-ASCII, a space
        lines.append("\t".join([label] + ints + cats))
    return lines


def _stack(chunks):
    chunks = list(chunks)
    return sp.vstack([c[0] for c in chunks], format="csr"), np.concatenate([c[1] for c in chunks]), chunks


def _assert_same(X, y, Xr, yr):
    assert X.shape == Xr.shape
    assert X.has_sorted_indices
    np.testing.assert_array_equal(X.indptr, Xr.indptr)
    np.testing.assert_array_equal(X.indices, Xr.indices)
    np.testing.assert_array_equal(X.data, Xr.data)
    np.testing.assert_array_equal(y, yr)


# ----------------------------------------------------------------------------- delimited text
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_criteo_reader_equals_the_former_python_reader(tmp_path, newline, prefetch):
    rng = np.random.default_rng(0)
    lines = _random_criteo_lines(rng, 700)
    lines[10] = ""  # a blank line
    path = tmp_path / "c.txt"
    path.write_bytes((newline.join(lines)).encode("utf-8"))  # no newline after the last line
    Xr, yr = ref_iter_csv(path, 0, range(1, 14), range(14, 40), 2 ** 12, 5, "\t")
    X, y, chunks = _stack(iter_criteo(path, chunk_size=128, num_features=2 ** 12, seed=5, prefetch=prefetch))
    assert [c[0].shape[0] for c in chunks] == [128] * 5 + [699 - 640]
    _assert_same(X, y, Xr, yr)
    assert X.data.max() >= 2  # collisions in 2^12 buckets are summed
    # small blocks: lines cut across block boundaries, the kernel restarted in the middle of a chunk
    spec = _textio.DelimitedSpec(0, range(1, 14), range(14, 40), 2 ** 12, 5, "\t", True)
    Xb, yb, _ = _stack(_textio.iter_delimited(path, spec, 100, block_bytes=333))
    _assert_same(Xb, yb, Xr, yr)
    Xp, yp, _ = _stack(_textio.iter_delimited(path, spec, 100, use_kernel=False))
    _assert_same(Xp, yp, Xr, yr)


def test_csv_reader_header_gzip_and_other_options(tmp_path):
    rng = np.random.default_rng(1)
    rows = [",".join([str(rng.integers(0, 2) * 2 - 1), str(rng.integers(0, 50)), "", f"t{rng.integers(0, 9)}",
                      str(rng.integers(0, 3))]) for _ in range(300)]
    text = "y,a,b,c,d\n" + "\n".join(rows) + "\n"
    with gzip.open(tmp_path / "t.csv.gz", "wt", encoding="utf-8") as fh:
        fh.write(text)
    (tmp_path / "t.csv").write_text(text)
    for name in ("t.csv", "t.csv.gz"):
        Xr, yr = ref_iter_csv(tmp_path / name, 0, (1, 4), (2, 3), 97, 3, ",", header=True, add_bias=False)
        X, y, _ = _stack(iter_csv(tmp_path / name, chunk_size=64, label_column=0, integer_columns=(1, 4),
                                  categorical_columns=(2, 3), num_features=97, seed=3, header=True,
                                  add_bias=False))
        _assert_same(X, y, Xr, yr)


def test_csv_reader_errors_name_file_and_line(tmp_path):
    p = tmp_path / "bad.tsv"
    good = "\t".join(["1"] + ["1"] * 13 + ["a"] * 26)
    p.write_text(good + "\n\n" + "\t".join(["0", "3"]) + "\n")
    with pytest.raises(ValueError, match=r"bad.tsv: line 3: expected at least 40 fields, got 2"):
        list(iter_criteo(p))
    p.write_text(good + "\n" + good.replace("1\t1\t1", "1\tinf\t1", 1) + "\n")
    with pytest.raises(ValueError, match=r"bad.tsv: line 2: integer column 1: 'inf' is not a finite number"):
        list(iter_criteo(p, prefetch=False))
    p.write_text(good + "\n" + good.replace("1\t1\t1", "1\tnan\t1", 1) + "\n")
    with pytest.raises(ValueError, match=r"line 2: integer column 1: 'nan'"):
        list(iter_criteo(p))
    p.write_text(good + "\n" + good.replace("1\t1\t1", "x\t1\t1", 1) + "\n")
    with pytest.raises(ValueError, match=r"line 2: non-numeric label"):
        list(iter_criteo(p))
    p.write_text(good + "\n" + good.replace("1\t1\t1", "1\tabc\t1", 1) + "\n")
    with pytest.raises(ValueError, match=r"line 2: integer column 1: could not convert"):
        list(iter_criteo(p))
    with pytest.raises(ValueError, match="chunk_size"):
        iter_criteo(p, chunk_size=0)
    with pytest.raises(ValueError, match="delimiter"):
        iter_csv(p, delimiter="ab")
    with pytest.raises(ValueError, match="named twice"):
        iter_csv(p, integer_columns=[1], categorical_columns=[1])


def test_integer_bins_agree_with_python_over_a_wide_range(tmp_path):
    vals = np.unique(np.concatenate([np.arange(-5, 3000), np.geomspace(3, 1e15, 4000).astype(np.int64)]))
    text = "".join(f"1,{v}\n" for v in vals).encode()
    spec = _textio.DelimitedSpec(0, (1,), (), 2 ** 31 - 1, 0, ",", False)
    path = tmp_path / "bins.csv"
    path.write_bytes(text)
    (X, _), = list(_textio.iter_delimited(path, spec, len(vals)))
    expect = [zlib.crc32(f"1#{_ref_bin(str(v))}".encode(), 0) % (2 ** 31 - 1) for v in vals]
    np.testing.assert_array_equal(X.indices, expect)


# ----------------------------------------------------------------------------- svmlight
def test_svmlight_comment_and_blank_lines_give_no_empty_chunks(tmp_path):
    p = tmp_path / "c.svm"
    p.write_text("# header comment\n\n# another\n1 1:1\n\n# x\n-1 2:1\n# tail\n")
    chunks = list(iter_svmlight(p, chunk_size=1, num_features=3))
    assert [c[0].shape[0] for c in chunks] == [1, 1]
    chunks = list(iter_svmlight(p, chunk_size=2, num_features=3, prefetch=False))
    assert [c[0].shape[0] for c in chunks] == [2]
    (tmp_path / "empty.svm").write_text("# nothing\n\n")
    assert list(iter_svmlight(tmp_path / "empty.svm", num_features=3)) == []


def test_svmlight_form_feed_in_comment_is_not_a_row(tmp_path):
    p = tmp_path / "ff.svm"
    p.write_bytes(b"1 1:0.5 # a form\x0cfeed 2:9\n-1 2:1\r\n")
    (X, y), = list(iter_svmlight(p, num_features=3))
    assert y.tolist() == [1.0, -1.0]
    np.testing.assert_array_equal(X.toarray(), [[0.5, 0, 0], [0, 1, 0]])


def test_svmlight_duplicate_negative_and_unsorted_indices(tmp_path):
    p = tmp_path / "d.svm"
    p.write_text("1 1:1\n1 3:1 3:2\n")
    with pytest.raises(ValueError, match=r"d.svm, line 2: feature index 3 appears twice"):
        list(iter_svmlight(p, num_features=5))
    p.write_text("1 1:1\n\n1 -3:0.5\n")
    with pytest.raises(ValueError, match=r"line 3: negative feature index -3"):
        list(iter_svmlight(p, num_features=5))
    p.write_text("1 1:1\n1 0:0.5\n")
    with pytest.raises(ValueError, match=r"line 2: feature index 0 is 0 in a file read as one-based"):
        list(iter_svmlight(p, num_features=5))
    p.write_text("1 4:1 2:3 qid:7\n")
    (X, _), = list(iter_svmlight(p, num_features=5))
    np.testing.assert_array_equal(X.indices, [1, 3])
    np.testing.assert_array_equal(X.data, [3, 1])
    p.write_text("1 1:1\n# c\n1 2:1 7:1\n")
    with pytest.raises(ValueError, match=r"line 3: feature index 7 out of range"):
        list(iter_svmlight(p, num_features=5))


def test_svmlight_blocks_equal_the_former_parser(tmp_path):
    from pyro_convexvb.io import parse_svmlight_lines

    rng = np.random.default_rng(3)
    lines = []
    for t in range(500):
        k = rng.integers(0, 8)
        idx = np.sort(rng.choice(np.arange(1, 60), size=k, replace=False))
        vals = rng.normal(size=k)
        lines.append(" ".join([str(rng.choice([-1, 1]))] + [f"{i}:{v:.17g}" for i, v in zip(idx, vals)]))
        if t % 37 == 0:
            lines.append("# comment")
    text = "\n".join(lines) + "\n"
    p = tmp_path / "r.svm"
    p.write_text(text)
    indptr, indices, values, labels = parse_svmlight_lines(text.splitlines(), "r")
    Xr = sp.csr_matrix((values, indices - 1, indptr), shape=(len(labels), 59))
    for block in (1 << 22, 97):
        chunks = list(_textio.iter_svmlight_chunks(p, 64, 59, 1, block_bytes=block))
        assert [c[0].shape[0] for c in chunks[:-1]] == [64] * (len(chunks) - 1)
        X, y, _ = _stack(chunks)
        _assert_same(X, y, Xr, labels)
    with gzip.open(tmp_path / "r.svm.gz", "wt") as fh:
        fh.write(text)
    Xg, yg, _ = _stack(iter_svmlight(tmp_path / "r.svm.gz", 100, num_features=59))
    _assert_same(Xg, yg, Xr, labels)


def test_prefetch_reraises_and_stops():
    def gen():
        yield 1
        raise KeyError("boom")

    it = _textio.prefetch(gen())
    assert next(it) == 1
    with pytest.raises(KeyError, match="boom"):
        next(it)
    it = _textio.prefetch(itertools.count())
    assert next(it) == 0
    it.close()
    assert not it._thread.is_alive()


@pytest.mark.parametrize("seed", [0, 1])
def test_svmlight_kernel_equals_the_python_parser_on_odd_numbers(tmp_path, seed):
    from pyro_convexvb.io import parse_svmlight_lines

    rng = np.random.default_rng(seed)
    odd = ["1e-5", ".5", "5.", "-0", "+3", "0.000123456789012345", "123456789012345678", "1E+22", "2.5e-23",
           "inf", "-nan", "1_0", "00012.50", "7e300", "0", "3.14159"]
    lines = []
    for t in range(400):
        k = rng.integers(0, 6)
        idx = rng.choice(np.arange(1, 40), size=k, replace=False)  # unsorted
        vals = [rng.choice(odd) if rng.random() < 0.3 else f"{rng.normal():.{rng.integers(1, 17)}g}" for _ in idx]
        lab = rng.choice(["1", "-1", "+1", "0", "1.0"])
        sep = rng.choice([" ", "\t", "  "])
        tail = rng.choice(["", " # c", "\t#x:1", " qid:3"])
        lines.append(sep.join([lab] + [f"{i}:{v}" for i, v in zip(idx, vals)]) + tail)
        if t % 50 == 7:
            lines.append("   ")
    text = "\n".join(lines) + "\n"
    p = tmp_path / "odd.svm"
    p.write_text(text)
    indptr, indices, values, labels = parse_svmlight_lines(text.splitlines(), "odd")
    Xr = sp.csr_matrix((values, indices - 1, indptr), shape=(len(labels), 40))
    Xr.sort_indices()
    for use_kernel in (True, False):
        X, y, _ = _stack(_textio.iter_svmlight_chunks(p, 37, 40, 1, block_bytes=500, use_kernel=use_kernel))
        assert X.shape == Xr.shape
        np.testing.assert_array_equal(X.indptr, Xr.indptr)
        np.testing.assert_array_equal(X.indices, Xr.indices)
        np.testing.assert_array_equal(X.data.view(np.int64), Xr.data.view(np.int64))  # bit for bit, NaN too
        np.testing.assert_array_equal(y, labels)


def test_default_chunks_double_from_4096_to_fifty_thousand_rows(tmp_path):
    """``chunk_size=None`` (the default) cuts FIRST_CHUNK_ROWS rows, then twice the previous chunk's up to
    DEFAULT_CHUNK_ROWS, on every reading path (the svmlight direct kernel, its block path with hashing, the
    delimited direct and block paths); the rows are those of fixed chunks; a bad value names the argument."""
    from pyro_convexvb.online import DEFAULT_CHUNK_ROWS, FIRST_CHUNK_ROWS

    assert (FIRST_CHUNK_ROWS, DEFAULT_CHUNK_ROWS) == (4096, 50_000)
    expected = [4096, 8192, 16384, 32768, 50_000, 50_000, 7]
    n = sum(expected)
    p = tmp_path / "d.svm"
    p.write_text("".join(f"{1 if i % 2 else -1} {i % 5 + 1}:{i % 7 + 1}\n" for i in range(n)))
    fixed = [X for X, _ in iter_svmlight(p, chunk_size=n, num_features=8, prefetch=False)][0]
    for hashing in (None, 3):
        chunks = [X for X, _ in iter_svmlight(p, num_features=8, hashing=hashing)]
        assert [X.shape[0] for X in chunks] == expected
        if hashing is None:
            assert (sp.vstack(chunks) != fixed).nnz == 0
    c = tmp_path / "d.csv"
    c.write_text("".join(f"{i % 2},{i % 3},a{i % 4}\n" for i in range(n)))
    sizes = [X.shape[0] for X, _ in iter_csv(c, integer_columns=[1], categorical_columns=[2], num_features=64)]
    assert sizes == expected
    spec = _textio.DelimitedSpec(0, (1,), (2,), 64, 0, ",", True)
    sizes = [X.shape[0] for X, _ in _textio.iter_delimited(c, spec, 50_000, direct=False, first=4096)]
    assert sizes == expected
    assert [X.shape[0] for X, _ in iter_svmlight(p, chunk_size=30_000, num_features=8)] == [30_000] * 5 + [
        n - 150_000]
    with pytest.raises(ValueError, match=r"chunk_size: expected a positive integer \(or None for 4,096 rows doubling "
                                         r"to 50,000\)"):
        iter_svmlight(p, chunk_size=2.5, num_features=8)


def test_bytes_that_are_not_utf8_hash_alike_on_both_paths(tmp_path):
    """A categorical field of bytes that are not UTF-8 hashes as those bytes on the compiled path; a row sent to the
    Python path (its label '0.0' is not a plain integer) raised a bare UnicodeDecodeError. Both give one hash."""
    fast, slow = tmp_path / "a.csv", tmp_path / "b.csv"
    fast.write_bytes(b"1,abc\n0,\xff\xfe\n")
    slow.write_bytes(b"1,abc\n0.0,\xff\xfe\n")
    (Xa, ya), = list(iter_csv(fast, categorical_columns=[1], num_features=2 ** 20))
    (Xb, yb), = list(iter_csv(slow, categorical_columns=[1], num_features=2 ** 20))
    assert (Xa != Xb).nnz == 0 and np.array_equal(ya, yb)
    col = (zlib.crc32(b"1=\xff\xfe", 0) % 2 ** 20)
    assert col in Xb[1].indices


def test_svmlight_index_beyond_int64_names_file_and_line(tmp_path):
    from pyro_convexvb.datasets import load_svmlight

    p = tmp_path / "o.svm"
    p.write_text("1 1:1\n-1 2:1\n1 99999999999999999999:1\n")
    with pytest.raises(ValueError, match=r"o.svm, line 3: feature index 99999999999999999999 is too large"):
        list(iter_svmlight(p, num_features=10))
    with pytest.raises(ValueError, match=r"line 3: feature index 99999999999999999999 is too large"):
        load_svmlight(p)


def test_public_line_parser_refuses_duplicated_and_negative_indices():
    from pyro_convexvb.io import parse_svmlight_lines

    with pytest.raises(ValueError, match="line 1: feature index 3 appears twice"):
        parse_svmlight_lines(["1 3:1 3:2"])
    with pytest.raises(ValueError, match="line 2: negative feature index -2"):
        parse_svmlight_lines(["1 1:1", "-1 -2:1"])


def test_a_truncated_gz_file_raises_a_value_error_naming_it(tmp_path):
    """A .gz file cut short raised gzip's bare EOFError ("Compressed file ended before the end-of-stream marker was
    reached"), naming no file, from every reader; now ValueError with the file, from the streams, the whole-file
    readers (both svmlight backends, and their shards); a checksum error names the file too."""
    from pyro_convexvb.datasets import load_csv, load_svmlight

    def cut(name, text):
        blob = gzip.compress(text)
        path = tmp_path / name
        path.write_bytes(blob[: len(blob) // 2])
        return path

    svm = cut("t.svm.gz", b"1 1:1 2:0.5\n" * 5000)
    crit = cut("c.txt.gz", ("1" + "\t1" * 39 + "\n").encode() * 5000)
    csv = cut("t.csv.gz", b"1,0.5,2\n" * 5000)
    readers = {
        "iter_svmlight": lambda: list(iter_svmlight(svm, num_features=3)),
        "iter_svmlight block path": lambda: list(iter_svmlight(svm, num_features=3, hashing=0)),
        "iter_svmlight shard": lambda: list(iter_svmlight(svm, num_features=3, shard=(1, 2))),
        "load_svmlight sklearn": lambda: load_svmlight(svm, backend="sklearn"),
        "load_svmlight python": lambda: load_svmlight(svm, backend="python"),
        "load_svmlight shard": lambda: load_svmlight(svm, n_features=3, zero_based=False, shard=(0, 2)),
        "iter_criteo": lambda: list(iter_criteo(crit)),
        "iter_csv": lambda: list(iter_csv(csv, integer_columns=[1, 2])),
        "iter_csv block path": lambda: list(_textio.iter_delimited(
            csv, _textio.DelimitedSpec(0, (1, 2), (), 64, 0, ",", True), 100, direct=False, use_kernel=False)),
        "load_csv": lambda: load_csv(csv),
        "load_csv shard": lambda: load_csv(csv, shard=(1, 2)),
    }
    for name, read in readers.items():
        path = {"iter_criteo": crit}.get(name, csv if "csv" in name else svm)
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value).startswith(f"{path}: the .gz file is truncated or corrupt: Compressed file ended"), name
    blob = gzip.compress(b"1 1:1\n" * 100)
    bad = tmp_path / "crc.svm.gz"
    bad.write_bytes(blob[:-8] + bytes(8))
    with pytest.raises(gzip.BadGzipFile, match=rf"^{bad}: CRC check failed"):
        list(iter_svmlight(bad, num_features=3))
