"""svmlight read straight into the chunks (``_textio._svm_chunk_kernel``) against the Python reference parser and
the former block path (each block parsed into arrays of its own, then copied into the chunks): the same chunks,
bit for bit, and the same errors with the same line numbers."""
import gzip

import numpy as np
import pytest
import scipy.sparse as sp

from pyro_convexvb.online import _textio
from pyro_convexvb.online.streams import iter_svmlight

pytestmark = pytest.mark.skipif(not _textio.have_kernels(), reason="the compiled reader needs numba")

EDGE_LINES = [
    b"+1 3:0.5 1:2 # unsorted, with a comment",
    b"",
    b"   ",
    b"# only a comment 5:1",
    b"\t# a tab, then a comment",
    b"-1 2:1 4:0.25\r",  # CRLF
    b"1 qid:3 4:1e-3 2:.5",
    b"0 5:1E+2\t6:-0",
    b"1 1:1 # a form\x0cfeed",
    b"1 2:1 # caf\xc3\xa9",  # UTF-8 in a comment
    b"1 007:1 8:5.",
    b"1.0 3:0.12345678901234567",  # 17 digits: not the compiled fast path
    b"-1 3:1e-30 4:2.5e-23 5:1E22",
    b"1 3:0.0000000000000000001 4:0.000648600607903335",  # 19 digits, 1 and 15 significant
    b"1 9:inf 2:-nan",
    b"-1 1:123456789012345 2:1234567890123456",
    b"1\t\t2:3   7:1\x0b",
    b"1 6:7#comment right after a value",
    b"-1",  # a row with no entries
    b"1 3:-2.5e-3 2:+4",
]


def _block_path_chunks(path, chunk_size, num_features, shift, block_bytes):
    """The former reader: each block by :func:`_textio.read_svmlight_rows` (compiled line parser, then
    scikit-learn's, then the Python one), rows copied into the chunks when a chunk is full."""
    big = max(num_features, chunk_size) > np.iinfo(np.int32).max
    parts, have = [], 0
    for block, lineno in _textio.iter_blocks(path, block_bytes):
        part = _textio.read_svmlight_rows(block, path, lineno, shift, num_features)
        if len(part[3]) == 0:
            continue
        parts.append(list(part))
        have += len(part[3])
        while have >= chunk_size:
            yield _textio._take_rows(parts, chunk_size, num_features, np.int64 if big else np.int32)
            have -= chunk_size
    if have:
        yield _textio._take_rows(parts, have, num_features, np.int64 if big else np.int32)


def _reference(data, num_features, shift):
    """All rows by the Python reference parser, sorted within rows, as CSR."""
    indptr, indices, values, labels = _textio.parse_svmlight_block(_textio.split_lines(data), "ref", 1)
    X = sp.csr_matrix((values, indices - shift, indptr), shape=(len(labels), num_features))
    X.sort_indices()
    return X, labels


def _assert_same_chunks(got, want):
    assert len(got) == len(want)
    for (Xa, ya), (Xb, yb) in zip(got, want):
        assert Xa.shape == Xb.shape
        assert Xa.indices.dtype == Xb.indices.dtype and Xa.indptr.dtype == Xb.indptr.dtype
        np.testing.assert_array_equal(Xa.indptr, Xb.indptr)
        np.testing.assert_array_equal(Xa.indices, Xb.indices)
        np.testing.assert_array_equal(Xa.data.view(np.int64), Xb.data.view(np.int64))  # bit for bit, NaN too
        np.testing.assert_array_equal(ya.view(np.int64), yb.view(np.int64))
        assert Xa.has_canonical_format


def _stack(chunks, num_features):
    if not chunks:
        return sp.csr_matrix((0, num_features)), np.zeros(0)
    return sp.vstack([X for X, _ in chunks], format="csr"), np.concatenate([y for _, y in chunks])


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("block_bytes", [1 << 22, 64, 7])
@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_edge_lines_equal_reference_and_block_path(tmp_path, gz, block_bytes, chunk_size):
    rng = np.random.default_rng(block_bytes + chunk_size)
    lines = [EDGE_LINES[i] for i in rng.permutation(np.repeat(np.arange(len(EDGE_LINES)), 3))]
    data = b"\n".join(lines)  # the last line has no newline
    p = tmp_path / ("e.svm.gz" if gz else "e.svm")
    if gz:
        with gzip.open(p, "wb") as fh:
            fh.write(data)
    else:
        p.write_bytes(data)
    got = list(_textio.iter_svmlight_chunks(p, chunk_size, 10, 1, block_bytes=block_bytes))
    want = list(_block_path_chunks(p, chunk_size, 10, 1, block_bytes))
    _assert_same_chunks(got, want)
    assert [X.shape[0] for X, _ in got[:-1]] == [chunk_size] * (len(got) - 1)
    X, y = _stack(got, 10)
    Xr, yr = _reference(data + b"\n", 10, 1)
    np.testing.assert_array_equal(X.indptr, Xr.indptr)
    np.testing.assert_array_equal(X.indices, Xr.indices)
    np.testing.assert_array_equal(X.data.view(np.int64), Xr.data.view(np.int64))
    np.testing.assert_array_equal(y, yr)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_files_equal_reference_zero_and_one_based(tmp_path, seed, monkeypatch):
    """Random rows (unsorted indices, 1-17 significant digits, exponents, tabs, CRLF, comments): fast path
    accepted for most lines, declined blocks read by the block path; both bases."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(3000):
        k = int(rng.integers(0, 12))
        idx = rng.choice(np.arange(1, 200), size=k, replace=False)
        digits = [17 if rng.random() < 0.0005 else int(rng.integers(1, 16)) for _ in idx]  # 17: declined
        vals = [f"{rng.normal() * 10.0 ** rng.integers(-5, 5):.{n}g}" for n in digits]
        lab = rng.choice(["1", "-1", "+1", "0", "2.5"])
        sep = " " if rng.random() < 0.8 else "\t"
        tail = rng.choice(["", "", " # c", "\r", " qid:1"])
        out.append((sep.join([lab] + [f"{i}:{v}" for i, v in zip(idx, vals)]) + tail).encode())
    data = b"\n".join(out) + b"\n"
    p = tmp_path / "r.svm"
    p.write_bytes(data)
    calls = []
    real = _textio.read_svmlight_rows
    monkeypatch.setattr(_textio, "read_svmlight_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    for shift, d in ((1, 199), (0, 200)):
        for block_bytes in (1 << 22, 1000):
            del calls[:]
            got = list(_textio.iter_svmlight_chunks(p, 700, d, shift, block_bytes=block_bytes))
            if block_bytes == 1000:  # most blocks by the direct kernel, a few declined ones by the block path
                assert 0 < len(calls) < len(data) // 1000 // 4
            _assert_same_chunks(got, list(_block_path_chunks(p, 700, d, shift, block_bytes)))
            X, y = _stack(got, d)
            Xr, yr = _reference(data, d, shift)
            np.testing.assert_array_equal(X.indptr, Xr.indptr)
            np.testing.assert_array_equal(X.indices, Xr.indices)
            np.testing.assert_array_equal(X.data.view(np.int64), Xr.data.view(np.int64))
            np.testing.assert_array_equal(y, yr)


BAD = [
    (b"1 3:1 3:2", r"line 4: feature index 3 appears twice"),
    (b"1 -3:1", r"line 4: negative feature index -3"),
    (b"1 0:1", r"line 4: feature index 0 is 0 in a file read as one-based"),
    (b"1 11:1", r"line 4: feature index 11 out of range \[1, 11\)"),
    (b"1 3:abc", r"line 4: cannot parse"),
    (b"1 3", r"line 4: cannot parse"),
    (b"x 3:1", r"line 4: cannot parse"),
    (b"1 3:1 \xff", r"line 4: not UTF-8 text"),
]


@pytest.mark.parametrize("bad,match", BAD)
@pytest.mark.parametrize("block_bytes", [1 << 22, 16])
def test_errors_name_the_same_line_as_the_block_path(tmp_path, bad, match, block_bytes):
    """The error, its line, and the chunks handed out before it are the block path's (a chunk with rows of a
    block that has an error is not handed out)."""
    p = tmp_path / "bad.svm"
    p.write_bytes(b"1 1:1\n# c\n-1 2:0.5\r\n" + bad + b"\n1 4:1\n")

    def run(it):
        chunks = []
        with pytest.raises(ValueError, match=match) as err:
            for c in it:
                chunks.append(c)
        return chunks, str(err.value)

    got, msg = run(_textio.iter_svmlight_chunks(p, 1, 10, 1, block_bytes=block_bytes))
    want, want_msg = run(_block_path_chunks(p, 1, 10, 1, block_bytes))
    assert msg == want_msg
    assert str(p) in msg
    _assert_same_chunks(got, want)
    # one block: no chunk; 16-byte blocks: row 1 only (row 3 shares the bad line's block)
    assert len(got) == (0 if block_bytes > 100 else 1)


def test_non_ascii_in_comment_read_as_by_the_block_path(tmp_path):
    """A byte that is not UTF-8 after ``#`` is accepted by the compiled parsers (the comment is never decoded);
    the direct path keeps that."""
    p = tmp_path / "c.svm"
    p.write_bytes(b"1 2:1 # \xff\xfe\n-1 1:3\n")
    got = list(_textio.iter_svmlight_chunks(p, 10, 4, 1))
    _assert_same_chunks(got, list(_block_path_chunks(p, 10, 4, 1, 1 << 22)))
    np.testing.assert_array_equal(got[0][0].toarray(), [[0, 1, 0, 0], [3, 0, 0, 0]])


def test_fast_path_does_not_use_the_block_parser(tmp_path, monkeypatch):
    """An ordinary file is read by the direct kernel alone (no per-block arrays); a block with a declined line is
    read again, whole, by the block path, and only that block."""
    calls = []
    real = _textio.read_svmlight_rows

    def spy(block, *args, **kwargs):
        calls.append(block)
        return real(block, *args, **kwargs)

    monkeypatch.setattr(_textio, "read_svmlight_rows", spy)
    lines = [f"{1 if i % 2 else -1} {i % 7 + 1}:{i / 8} {i % 7 + 9}:1.5".encode() for i in range(400)]
    p = tmp_path / "f.svm"
    p.write_bytes(b"\n".join(lines) + b"\n")
    chunks = list(_textio.iter_svmlight_chunks(p, 128, 16, 1, block_bytes=2048))
    assert calls == []
    assert [X.shape[0] for X, _ in chunks] == [128, 128, 128, 16]
    lines[250] = b"1 3:0.12345678901234567"  # off the fast path
    p.write_bytes(b"\n".join(lines) + b"\n")
    chunks2 = list(_textio.iter_svmlight_chunks(p, 128, 16, 1, block_bytes=2048))
    assert len(calls) == 1 and b"0.12345678901234567" in calls[0]
    X2 = sp.vstack([X for X, _ in chunks2])
    assert X2[250, 2] == 0.12345678901234567
    _assert_same_chunks(chunks2, list(_block_path_chunks(p, 128, 16, 1, 2048)))


def test_entry_capacity_grows_for_long_rows(tmp_path):
    """Rows far longer than the first block's average grow the chunk's arrays without changing them."""
    short = [b"1 1:1"] * 200
    long_rows = [(b"-1 " + b" ".join(f"{j}:{j / 4}".encode() for j in range(1, 3001))) for _ in range(5)]
    p = tmp_path / "g.svm"
    p.write_bytes(b"\n".join(short + long_rows + short) + b"\n")
    got = list(_textio.iter_svmlight_chunks(p, 300, 3000, 1, block_bytes=4096))
    _assert_same_chunks(got, list(_block_path_chunks(p, 300, 3000, 1, 4096)))
    assert got[0][0].nnz == 200 + 5 * 3000 + 95


def test_iter_svmlight_prefetch_equals_direct_chunks(tmp_path):
    """The public reader (reader thread) hands out the direct path's chunks."""
    p = tmp_path / "p.svm"
    p.write_bytes(b"".join(f"{(-1) ** i} {i % 9 + 1}:{i}.25 12:1\n".encode() for i in range(1000)))
    a = list(iter_svmlight(p, chunk_size=300, num_features=12))
    b = list(_block_path_chunks(p, 300, 12, 1, 1 << 22))
    _assert_same_chunks(a, b)


NUMBERS = ["0", "-0", "+3", "5.", ".5", ".", "-", "1e5", "1E+22", "1e23", "2.5e-23", "1e-22", "1e", "1e+", "1e1234",
           "123456789012345", "1234567890123456", "0.000648600607903335", "0.0000000000000000001",
           "00000000000000000000001.5", "000000000000000001234567890123456", "0.1234567890123456789",
           "12345678901234567890123", "1.2.3", "1_0", "inf", "nan", "0x10", "3.14159", "-7.5868972028252e-06",
           "100000000000000000000000000", "1.000000000000000000", "9999999999999999999999e-10"]


@pytest.mark.parametrize("tail", [b" ", b"\n", b"#", b"x"])
def test_number_reader_accepts_what_the_bounded_one_does(tail):
    """``_scan_number`` (no bound per byte) against ``_scan_float`` (the former reader): the same acceptance and
    bit-identical values, the number ending at a space, a newline, a comment or another byte."""
    for text in NUMBERS:
        raw = text.encode() + tail + b"\n"
        buf = np.frombuffer(raw + bytes(_textio._DIRECT_PAD), dtype=np.uint8)  # read 8 bytes at a time
        stop = len(text) + (1 if tail in (b" ", b"x") else 0)  # the former reader's data part ends at '#' / '\n'
        ok_a, v_a, _ = _textio._scan_number(buf, 0, _textio._POW10)
        ok_b, v_b, _ = _textio._scan_float(buf, 0, stop, _textio._POW10)
        assert ok_a == ok_b, text
        if ok_a:
            assert np.float64(v_a).view(np.int64) == np.float64(v_b).view(np.int64), text
            assert v_a == float(text), text


def test_digits_eight_at_a_time_equal_the_digit_loop():
    """``_digits`` reads eight bytes a step: on random runs of 0-20 digits after a prefix, followed by bytes next to
    the digits' range ('/', ':'), non-ASCII ones (0x80, 0xFA, 0xFF: 6 added to them carries into the next byte) and
    NUL, it stops where the digits end and returns the number a digit-by-digit loop gives."""
    import random

    rng = random.Random(0)
    stops = [b" ", b"\n", b":", b"/", b".", b"e", b"#", bytes([0xFA]), bytes([0xFF]), bytes([0x00]), bytes([0x80])]
    for _ in range(3000):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 20)))
        pre, m0 = rng.randint(0, 5), rng.randint(0, 1000)
        tail = b"".join(rng.choice(stops) for _ in range(rng.randint(1, 10)))
        buf = np.frombuffer(b"x" * pre + digits.encode() + tail + bytes(_textio._DIRECT_PAD), dtype=np.uint8)
        m, k = _textio._digits(buf, pre, m0)
        assert k == pre + len(digits)
        if len(digits) <= 15:
            assert m == m0 * 10 ** len(digits) + (int(digits) if digits else 0)
