"""The direct path of the delimited reader (``iter_delimited(direct=True)``: one reused buffer,
``_delimited_kernel`` in its ``wide`` mode) against the block path (``direct=False``, the kernel a byte at a
time) and the Python reference rules (``use_kernel=False``): the same chunks (values, dtypes, chunk boundaries),
the same errors."""
import gzip
import zlib

import numpy as np
import pytest

from pyro_convexvb.online import _textio
from pyro_convexvb.online.streams import iter_criteo

pytestmark = pytest.mark.skipif(not _textio.have_kernels(), reason="numba is not installed")

from test_online_textio import _random_criteo_lines, ref_iter_csv  # noqa: E402

CRITEO = dict(label_column=0, integer_columns=tuple(range(1, 14)), categorical_columns=tuple(range(14, 40)))


def _spec(num_features=2 ** 12, seed=5, delimiter="\t", add_bias=True, **cols):
    cols = cols or CRITEO
    return _textio.DelimitedSpec(cols["label_column"], cols["integer_columns"], cols["categorical_columns"],
                                 num_features, seed, delimiter, add_bias)


def _chunks(path, spec, chunk_size, **kw):
    return list(_textio.iter_delimited(path, spec, chunk_size, **kw))


def _assert_chunks_identical(a, b):
    assert len(a) == len(b)
    for (Xa, ya), (Xb, yb) in zip(a, b):
        assert Xa.shape == Xb.shape
        for f in ("indptr", "indices", "data"):
            u, v = getattr(Xa, f), getattr(Xb, f)
            assert u.dtype == v.dtype, f
            np.testing.assert_array_equal(u, v)
        assert ya.dtype == yb.dtype == np.float64
        np.testing.assert_array_equal(ya, yb)
        assert Xa.has_canonical_format and Xb.has_canonical_format


def _all_paths(path, spec, chunk_size, header=False, block_bytes=_textio._BLOCK_BYTES):
    """Chunks by the direct path, the block path and the Python reference; asserts all three identical."""
    direct = _chunks(path, spec, chunk_size, header=header, block_bytes=block_bytes)
    blocks = _chunks(path, spec, chunk_size, header=header, block_bytes=block_bytes, direct=False)
    python = _chunks(path, spec, chunk_size, header=header, block_bytes=block_bytes, use_kernel=False)
    _assert_chunks_identical(direct, blocks)
    _assert_chunks_identical(direct, python)
    return direct


def _errors(path, spec, chunk_size=7, **kw):
    """The error message of each path (all three must raise)."""
    msgs = []
    for extra in ({}, {"direct": False}, {"use_kernel": False}):
        with pytest.raises(ValueError) as info:
            _chunks(path, spec, chunk_size, **kw, **extra)
        msgs.append(str(info.value))
    return msgs


# ----------------------------------------------------------------------------- CRC and the field scan
def test_crc_slicing_by_8_equals_zlib():
    rng = np.random.default_rng(0)
    for n in list(range(0, 40)) + [63, 64, 65, 1000]:
        for _ in range(5):
            data = rng.integers(0, 256, size=n, dtype=np.uint8)
            state = int(rng.integers(0, 2 ** 32))
            s = int(rng.integers(0, 9))
            buf = np.zeros(s + n + _textio._DIRECT_PAD, dtype=np.uint8)
            buf[s:s + n] = data
            got = _textio._crc_continue8(state, buf, s, s + n, _textio._CRC_TABLES8)
            assert got == zlib.crc32(data.tobytes(), state)


@pytest.mark.parametrize("delimiter", ["\t", ",", ";", " ", "\x00", "|"])
def test_fields_at_every_offset_of_a_word(tmp_path, delimiter):
    """Fields of every length 0..20 (so every delimiter and newline position in an 8-byte word)."""
    rng = np.random.default_rng(1)
    lines = []
    for _ in range(300):
        toks = ["".join(rng.choice(list("abcdef0123456789"), size=int(rng.integers(0, 21)))) for _ in range(6)]
        lines.append(delimiter.join([str(rng.integers(0, 2)), str(rng.integers(0, 5000))] + toks))
    path = tmp_path / "f.txt"
    path.write_bytes(("\n".join(lines) + "\n").encode())
    spec = _spec(2 ** 16, 3, delimiter, label_column=0, integer_columns=(1,), categorical_columns=range(2, 8))
    for block_bytes in (1, 9, 64, 1000, _textio._BLOCK_BYTES):
        out = _all_paths(path, spec, 17, block_bytes=block_bytes)
    assert sum(X.shape[0] for X, _ in out) == 300


# ----------------------------------------------------------------------------- against the block path and Python
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("chunk_size,block_bytes", [(1, 50), (128, 333), (1000, 7), (50_000, 1 << 22)])
def test_direct_equals_block_path_and_python(tmp_path, newline, chunk_size, block_bytes):
    """Empty fields, odd integers (1.5, 2.0, 1e3, -3, +7, ' 4', 007: the per-row fallback), non-ASCII bytes and
    spaces, blank lines, no newline after the last line; chunks of one row, blocks smaller than a line."""
    rng = np.random.default_rng(2)
    lines = _random_criteo_lines(rng, 600)
    lines[10] = ""
    lines[11] = "\r" if newline == "\n" else ""  # a line of a lone CR is blank too
    path = tmp_path / "c.txt"
    path.write_bytes(newline.join(lines).encode("utf-8"))
    out = _all_paths(path, _spec(), chunk_size, block_bytes=block_bytes)
    rows = [X.shape[0] for X, _ in out]
    assert rows[:-1] == [chunk_size] * (len(rows) - 1) and sum(rows) == 598
    Xr, yr = ref_iter_csv(path, 0, range(1, 14), range(14, 40), 2 ** 12, 5, "\t")
    X = out[0][0] if len(out) == 1 else None
    if X is not None:
        np.testing.assert_array_equal(X.indices, Xr.indices)
        np.testing.assert_array_equal(X.data, Xr.data)
        np.testing.assert_array_equal(out[0][1], yr)


def test_every_row_by_the_fallback_and_float_labels(tmp_path):
    """Labels 1.0 / -1.5 and integers 1e3 / 1.5 on every line: each row goes to the Python rules."""
    rng = np.random.default_rng(3)
    lines = []
    for i in range(400):
        ints = [rng.choice(["1e3", "1.5", "", "12", "-2"]) for _ in range(13)]
        cats = [f"{int(rng.integers(0, 99)):x}" for _ in range(26)]
        lines.append("\t".join([rng.choice(["1.0", "-1.5", "0"])] + ints + cats))
    path = tmp_path / "odd.txt"
    path.write_text("\n".join(lines) + "\n")
    out = _all_paths(path, _spec(), 64, block_bytes=500)
    y = np.concatenate([c[1] for c in out])
    np.testing.assert_array_equal(y, [float(ln.split("\t")[0]) for ln in lines])


def test_very_long_tokens_and_lines_longer_than_a_block(tmp_path):
    rng = np.random.default_rng(4)
    lines = _random_criteo_lines(rng, 50, odd=False)
    for i in (0, 7, 49):
        f = lines[i].split("\t")
        f[20] = "x" * (10_000 + i)  # a token longer than the block
        f[30] = "".join(rng.choice(list("0123456789abcdef"), size=333))
        lines[i] = "\t".join(f)
    path = tmp_path / "long.txt"
    path.write_text("\n".join(lines) + "\n")
    for block_bytes in (64, 4096, 1 << 20):
        _all_paths(path, _spec(2 ** 22, 0), 8, block_bytes=block_bytes)


def test_gzip_header_and_csv(tmp_path):
    rng = np.random.default_rng(5)
    rows = [",".join([str(rng.integers(0, 2)), str(rng.integers(-3, 5000)), "", f"t{rng.integers(0, 9)}",
                      rng.choice(["0", "1.5", "1e3", ""])]) for _ in range(500)]
    text = "y,a,b,c,d\r\n" + "\r\n".join(rows) + "\r\n"
    with gzip.open(tmp_path / "t.csv.gz", "wt", encoding="utf-8", newline="") as fh:
        fh.write(text)
    (tmp_path / "t.csv").write_bytes(text.encode())
    spec = _spec(97, 3, ",", False, label_column=0, integer_columns=(1, 4), categorical_columns=(2, 3))
    plain = _all_paths(tmp_path / "t.csv", spec, 64, header=True, block_bytes=100)
    gz = _all_paths(tmp_path / "t.csv.gz", spec, 64, header=True)
    _assert_chunks_identical(plain, gz)
    Xr, yr = ref_iter_csv(tmp_path / "t.csv", 0, (1, 4), (2, 3), 97, 3, ",", header=True, add_bias=False)
    assert sum(X.shape[0] for X, _ in plain) == 500 == len(yr)


def test_header_only_empty_file_and_no_final_newline(tmp_path):
    spec = _spec(97, 0, ",", True, label_column=0, integer_columns=(1,), categorical_columns=(2,))
    p = tmp_path / "h.csv"
    for text, rows in ((b"", 0), (b"y,a,b", 0), (b"y,a,b\n", 0), (b"y,a,b\n1,2,c", 1), (b"\n\n1,2,c\n\n", 1)):
        p.write_bytes(text)
        out = _all_paths(p, spec, 3, header=text.startswith(b"y"))
        assert sum(X.shape[0] for X, _ in out) == rows


@pytest.mark.parametrize("bad,lineno,msg", [
    ("\t".join(["0", "3"]), 5, "expected at least 40 fields, got 2"),
    ("inf", 5, "integer column 1: 'inf' is not a finite number"),
    ("nan", 5, "integer column 1: 'nan'"),
    ("abc", 5, "integer column 1: could not convert"),
    ("label", 5, "non-numeric label"),
])
@pytest.mark.parametrize("block_bytes", [30, 1 << 22])
def test_errors_name_file_and_line_on_every_path(tmp_path, bad, lineno, msg, block_bytes):
    good = "\t".join(["1"] + ["1"] * 13 + ["a"] * 26)
    if bad == "label":
        line = good.replace("1\t1\t1", "x\t1\t1", 1)
    elif "\t" in bad:
        line = bad
    else:
        line = good.replace("1\t1\t1", f"1\t{bad}\t1", 1)
    p = tmp_path / "bad.tsv"
    p.write_text("\n".join([good, "", good, good, line, good]) + "\n")
    msgs = _errors(p, _spec(), block_bytes=block_bytes)
    assert msgs[0] == msgs[1] == msgs[2]
    assert msgs[0].startswith(f"{p}: line {lineno}: ") and msg in msgs[0]
    # the chunks handed out before the error are the same (chunk_size 1: the three rows before line 5)
    seen = []
    with pytest.raises(ValueError, match=f"line {lineno}"):
        for X, y in _textio.iter_delimited(p, _spec(), 1, block_bytes=block_bytes):
            seen.append(y[0])
    assert seen == [1.0, 1.0, 1.0]


def test_iter_criteo_takes_the_direct_path_and_options_are_checked(tmp_path, monkeypatch):
    p = tmp_path / "c.txt"
    p.write_text("\t".join(["1"] + ["1"] * 13 + ["a"] * 26) + "\n")
    called = []
    real = _textio._iter_delimited_direct
    monkeypatch.setattr(_textio, "_iter_delimited_direct", lambda *a: called.append(a) or real(*a))
    (X, y), = list(iter_criteo(p, prefetch=False))
    assert called and X.shape == (1, 2 ** 22) and X.indices.dtype == np.int32
    with pytest.raises(ValueError, match="direct=True: .* needs use_kernel"):
        list(_textio.iter_delimited(p, _spec(), 1, use_kernel=False, direct=True))
