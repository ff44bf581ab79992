"""Chunks of the text readers: assembled across blocks with one copy, int32 indices, canonical flags that hold."""
import re

import numpy as np
import scipy.sparse as sp

from pyro_convexvb.online import _textio
from pyro_convexvb.online._validation import splitmix64


def _write(path, rng, n=300):
    lines = []
    for _ in range(n):
        idx = np.sort(rng.choice(np.arange(1, 200), size=rng.integers(0, 12), replace=False))
        lines.append(" ".join([str(rng.choice([-1, 1]))] + [f"{i}:{rng.normal():.6g}" for i in idx]))
        if rng.random() < 0.05:
            lines.append("# a comment line")
    path.write_text("\n".join(lines) + "\n")
    return lines


def _whole(path, num_features, hashing=None):
    from sklearn.datasets import load_svmlight_file

    X, y = load_svmlight_file(str(path), n_features=num_features + 1 if hashing is None else 400, zero_based=True)
    X = sp.csr_matrix(X)
    cols = X.indices - 1
    if hashing is not None:
        cols = (splitmix64(cols, hashing) % np.uint64(num_features)).astype(np.int64)
    X = sp.csr_matrix((X.data, cols, X.indptr), shape=(X.shape[0], num_features))
    X.sum_duplicates()
    return X, y


def test_svmlight_chunks_across_blocks_equal_the_whole_file(tmp_path):
    rng = np.random.default_rng(4)
    p = tmp_path / "a.svm"
    _write(p, rng)
    for hashing, d in ((None, 200), (7, 16)):
        Xr, yr = _whole(p, d, hashing)
        for block, chunk in ((300, 37), (2000, 64), (1 << 22, 1000)):
            chunks = list(_textio.iter_svmlight_chunks(p, chunk, d, 1, hashing=hashing, block_bytes=block))
            assert [c[0].shape[0] for c in chunks[:-1]] == [chunk] * (len(chunks) - 1)
            for X, _ in chunks:
                assert X.indices.dtype == np.int32 and X.indptr.dtype == np.int32
                assert X.has_canonical_format
                Y = sp.csr_matrix((X.data.copy(), X.indices.copy(), X.indptr.copy()), shape=X.shape)
                assert Y.has_canonical_format  # recomputed by scipy from the arrays, not the flag we set
            X = sp.vstack([c[0] for c in chunks], format="csr")
            np.testing.assert_array_equal(X.indptr, Xr.indptr)
            np.testing.assert_array_equal(X.indices, Xr.indices)
            np.testing.assert_array_equal(X.data, Xr.data)
            np.testing.assert_array_equal(np.concatenate([c[1] for c in chunks]), yr)


def test_a_chunk_handed_out_is_never_overwritten(tmp_path):
    rng = np.random.default_rng(5)
    p = tmp_path / "b.svm"
    _write(p, rng, n=200)
    it = _textio.iter_svmlight_chunks(p, 50, 200, 1, block_bytes=400)
    first = next(it)
    copy = (first[0].data.copy(), first[0].indices.copy(), first[1].copy())
    rest = list(it)
    assert len(rest) == 3
    np.testing.assert_array_equal(first[0].data, copy[0])
    np.testing.assert_array_equal(first[0].indices, copy[1])
    np.testing.assert_array_equal(first[1], copy[2])


_FAST_NUMBER = re.compile(r"([+-]?)(?:([0-9]+)(?:\.([0-9]*))?|\.([0-9]+))(?:[eE]([+-]?[0-9]{1,3}))?", re.ASCII)


def _fast_path_float(tok):
    """``(ok, value)`` of the svmlight kernel's number reader, written from its grammar: a decimal number with
    at most 15 significant digits and a decimal exponent (after the fraction digits) within 22."""
    m = _FAST_NUMBER.fullmatch(tok)
    if m is None:
        return False, 0.0
    whole = m.group(2) if m.group(2) is not None else ""
    frac = m.group(3) if m.group(2) is not None else m.group(4)
    frac = frac or ""
    significant = (whole + frac).lstrip("0")
    exponent = int(m.group(5) or 0) - len(frac)
    if len(significant) > 15 or not -22 <= exponent <= 22:
        return False, 0.0
    return True, float(tok)


def test_svmlight_number_scan_reads_exactly_the_fast_path():
    """The one-pass number reader of the svmlight kernel accepts exactly the tokens of its fast path (the
    grammar above, written independently), with Python's value, and stops at the token's end, on well-formed and
    malformed value tokens followed by nothing, a space or another entry."""
    import pytest

    pytest.importorskip("numba")
    toks = ["1", "-0", "+3", ".5", "5.", "00012.50", "1e-5", "1E+22", "2.5e-23", "1e", "1e+", "1e1234", "1.2.3",
            "1:2", "", "-", "+.", ".", "inf", "nan", "1_0", "0.000123456789012345", "123456789012345",
            "1234567890123456", "3.14159", "7e-22", "7e22", "7e23", "1x", "1e5x", "\u0663", "0x10"]
    rng = np.random.default_rng(0)
    toks += [f"{v:.{rng.integers(1, 17)}g}" for v in rng.normal(size=200) * 10.0 ** rng.integers(-8, 8, 200)]
    for tok in toks:
        for tail in ("", " ", "\t5:1"):
            raw = (tok + tail).encode()
            buf = np.frombuffer(raw + b"\n", dtype=np.uint8)
            end = len(tok.encode())
            ok_b, v_b = _fast_path_float(tok)
            ok_s, v_s, k = _textio._scan_float(buf, 0, len(raw), _textio._POW10)
            assert ok_s == ok_b, (tok, tail)
            if ok_b:
                assert k == end and v_s == v_b, (tok, tail)
