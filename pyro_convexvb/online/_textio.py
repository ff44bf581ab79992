"""The reading core of the text streams: byte blocks, compiled field parsing and hashing, a prefetch thread.

One core serves :func:`~pyro_convexvb.online.iter_criteo` / :func:`~pyro_convexvb.online.iter_csv` /
:func:`~pyro_convexvb.online.iter_svmlight` and the whole-file readers of :mod:`pyro_convexvb.datasets`
(``load_svmlight(backend="python")``, its ``shard=`` path, ``load_csv``):

* :func:`iter_blocks` reads a plain or ``.gz`` file in blocks of whole lines (bytes; lines end at ``\\n``,
  a ``\\r`` before it is dropped; no other character ends a line, so a form feed inside a comment does not
  invent a row), with the number of the first line of each block for error messages;
* delimited text (CSV / Criteo): a numba kernel over the raw bytes splits fields, bins integer fields and
  hashes tokens with CRC-32 (bit-identical to ``zlib.crc32`` of the token text, so the columns are those of
  :func:`~pyro_convexvb.online.hash_features` on every platform), one row after the other without a Python
  loop; a row the kernel cannot read exactly (a number that is not a plain integer, e.g. ``1.5``, ``1e3``,
  ``inf``) is handed to the Python reference code for that one row, so the output never differs.
  :func:`iter_delimited` reads by default into one reused buffer (:func:`_iter_delimited_direct`,
  :func:`_line_blocks`: the kernel finds fields and hashes tokens 8 bytes at a time, straight into the chunk's
  arrays); ``direct=False`` keeps the block path (:func:`iter_blocks`, the kernel a byte at a time);
* svmlight (:func:`iter_svmlight_chunks`): without hashing, :func:`_svm_chunk_kernel` parses each block of
  a reused buffer straight into the chunk's arrays (indices shifted, range-checked, int32); a block with a line
  it declines is read again by the block path: :func:`_svm_kernel` up to the first line it declines, then
  scikit-learn's compiled ``load_svmlight_file``, and for a block that rejects (a malformed line, a duplicated
  or negative index) the Python reference parser :func:`parse_svmlight_block`, which accepts unsorted indices
  and raises with the file and line number otherwise;
* :func:`prefetch` runs a chunk iterator in a reader thread (the compiled parsers and the learner's kernels
  release the GIL), so reading overlaps learning.

Chunks hold ``chunk_size`` *rows*: blank and comment lines never give a chunk of 0 rows.
"""
import contextlib
import gzip
import io
import math
import os
import queue
import threading
import zlib

import numpy as np
import scipy.sparse as sp

_BLOCK_BYTES = 1 << 22
_INT_LUT = 1024  # integer fields 0 <= v < _INT_LUT take their hashed column from a table (DelimitedSpec.int_bucket)


# ----------------------------------------------------------------------------- blocks of lines
class _NamedGzipFile(gzip.GzipFile):
    """:class:`gzip.GzipFile` whose read errors name the file: a truncated stream (gzip's bare ``EOFError``, no
    file named) or corrupt compressed data (``zlib.error``) raise ``ValueError``, a bad header or checksum
    :class:`gzip.BadGzipFile` with the file's name in the message."""

    def _named(self, read, *args):
        try:
            return read(*args)
        except EOFError as e:
            raise ValueError(f"{self.name}: the .gz file is truncated or corrupt: {e}") from None
        except zlib.error as e:
            raise ValueError(f"{self.name}: the .gz file is corrupt: {e}") from None
        except gzip.BadGzipFile as e:  # (named once: readinto reads by read)
            if str(e).startswith(f"{self.name}: "):
                raise
            raise gzip.BadGzipFile(f"{self.name}: {e}") from None

    def read(self, size=-1):
        return self._named(super().read, size)

    def read1(self, size=-1):
        return self._named(super().read1, size)

    def readinto(self, b):
        return self._named(super().readinto, b)

    def readline(self, size=-1):
        return self._named(super().readline, size)

    def peek(self, n):
        return self._named(super().peek, n)

    def seek(self, offset, whence=0):
        return self._named(super().seek, offset, whence)


def open_binary(path):
    """Open ``path`` for reading bytes, decompressing a ``.gz`` file: reading a truncated one, or one whose
    compressed data is corrupt, raises ``ValueError`` naming the file; a bad header or checksum raises
    :class:`gzip.BadGzipFile` naming it."""
    path = str(path)
    if path.endswith(".gz"):
        return _NamedGzipFile(path, "rb")
    return open(path, "rb")


def check_shard(shard):
    """``shard`` as ``(rank, world_size)`` integers with ``0 <= rank < world_size``, or ``None``."""
    if shard is None:
        return None
    try:
        r, P = (int(v) for v in shard)
    except (TypeError, ValueError):
        raise ValueError(f"shard: expected (rank, world_size), got {shard!r}") from None
    if P < 1 or not 0 <= r < P or tuple(shard) != (r, P):
        raise ValueError(f"shard: expected integers (rank, world_size) with 0 <= rank < world_size, got {shard!r}")
    return r, P


class _LineRange:
    """The bytes of an open binary file from its position ``start`` to the end of the line holding byte
    ``stop - 1`` (``stop=None``: to the end of the file), read as a file: :meth:`read`, :meth:`readinto`."""

    def __init__(self, fh, start, stop):
        self._fh = fh
        self._left = None if stop is None else max(0, stop - start)
        self._last = 10  # the last byte handed out (a newline: nothing to finish)
        self._tail = None  # the rest of the line across stop, once stop is reached

    def readinto(self, b):
        view = memoryview(b).cast("B")
        if self._left is None:
            return self._fh.readinto(view)
        if self._left > 0:
            got = self._fh.readinto(view[:min(len(view), self._left)])
            if got:
                self._left -= got
                self._last = view[got - 1]
                return got
            self._left = 0  # the file ended before stop
        if self._tail is None:  # finish the line that holds byte stop - 1
            self._tail = memoryview(self._fh.readline() if self._last != 10 else b"")
        got = min(len(view), len(self._tail))
        view[:got] = self._tail[:got]
        self._tail = self._tail[got:]
        return got

    def read(self, size=-1):
        if self._left is None:
            return self._fh.read(size)
        out = b""
        if self._left > 0:
            want = self._left if size < 0 else min(size, self._left)
            out = self._fh.read(want)
            self._left = self._left - len(out) if len(out) == want else 0  # fewer: the file ended before stop
            if out:
                self._last = out[-1]
        if self._left == 0 and (size < 0 or len(out) < size):
            if self._tail is None:  # finish the line that holds byte stop - 1
                self._tail = memoryview(self._fh.readline() if self._last != 10 else b"")
            k = len(self._tail) if size < 0 else min(size - len(out), len(self._tail))
            if k:
                out += self._tail[:k]
                self._tail = self._tail[k:]
        return out

    def close(self):
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_line_range(path, shard):
    """The lines of ``path`` (plain or ``.gz``) that start in byte range ``rank`` of ``world_size`` equal ranges:
    ``(file, start)``, a binary file-like object (``read``, ``readinto``, ``close``) of those lines and the
    offset of the first.

    The file's ``S`` bytes (decompressed: a ``.gz`` file is read once to count them, unless ``world_size`` is 1)
    are cut at ``floor(S r / P)``; a rank owns the lines whose first byte lies in its range, so every line
    belongs to exactly one rank and no rank reads more than its range plus one line (a ``.gz`` file is
    decompressed from its start)."""
    r, P = check_shard(shard)
    fh = open_binary(path)
    try:
        if P == 1:
            return _LineRange(fh, 0, None), 0
        if str(path).endswith(".gz"):
            size = 0
            with open_binary(path) as g:
                while True:
                    n = len(g.read(_BLOCK_BYTES))
                    if not n:
                        break
                    size += n
        else:
            size = os.fstat(fh.fileno()).st_size
        a, b = size * r // P, size * (r + 1) // P
        if a > 0:
            fh.seek(a - 1)
            fh.readline()  # to the first line that starts at or after a
        start = fh.tell()
        return _LineRange(fh, start, b), start
    except BaseException:
        fh.close()
        raise


def lines_before(path, start):
    """Number of lines that end before byte ``start`` of ``path`` (plain or ``.gz``); for error messages."""
    n, left = 0, start
    with open_binary(path) as f:
        while left > 0:
            block = f.read(min(left, _BLOCK_BYTES))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n


def iter_blocks(path, block_bytes=_BLOCK_BYTES, fh=None):
    """Yield ``(block, first_lineno)``: ``bytes`` of whole lines (each ends with ``\\n``), and the line number
    of its first line (1-based).  A last line without ``\\n`` gets one."""
    own = fh is None
    fh = open_binary(path) if own else fh
    try:
        rest = b""
        lineno = 1
        while True:
            new = fh.read(block_bytes)
            if not new:
                if rest:
                    yield rest + b"\n", lineno
                return
            data = rest + new if rest else new
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            block, rest = data[:cut], data[cut:]
            yield block, lineno
            lineno += block.count(b"\n")
    finally:
        if own:
            fh.close()


def split_lines(block):
    """Lines of a block (``\\n``-terminated bytes), ``\\r\\n`` read as ``\\n``; only ``\\n`` ends a line."""
    lines = block.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]


# ----------------------------------------------------------------------------- CRC-32 and integer bins
def _crc_table():
    t = np.empty(256, dtype=np.uint32)
    for n in range(256):
        c = n
        for _ in range(8):
            c = (0xEDB88320 ^ (c >> 1)) if c & 1 else (c >> 1)
        t[n] = c
    return t


_CRC_TABLE = _crc_table()


def _crc_tables4():
    """Slicing-by-4 tables ``(4, 256)``: ``T_k[n]`` is the CRC of byte ``n`` followed by ``k`` zero bytes."""
    t = np.empty((4, 256), dtype=np.int64)
    t[0] = _CRC_TABLE
    for k in range(1, 4):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t


_CRC_TABLES4 = _crc_tables4()


def _crc_tables8():
    """Slicing-by-8 tables, flattened ``(8 * 256,)``: entry ``256 k + n`` is the CRC of byte ``n`` followed by
    ``k`` zero bytes (the first four rows are :data:`_CRC_TABLES4`)."""
    t = np.empty((8, 256), dtype=np.int64)
    t[0] = _CRC_TABLE
    for k in range(1, 8):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t.ravel().astype(np.uint64)


_CRC_TABLES8 = _crc_tables8()
_DIRECT_PAD = 16  # bytes after a block in the direct path's buffer: its kernel reads 8 bytes at a time
_TEN_POW = np.array([10 ** k for k in range(9)], dtype=np.int64)  # 10^n for the n digits read in one step


def integer_bin(value):
    """Bucket of a count feature: the value itself up to 2, then ``"L" + floor(log(v)^2)``.

    :raises ValueError: ``value`` is NaN or infinite (no bucket).
    """
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{value!r} is not a finite number")
    if v <= 2:
        return str(int(math.floor(v)))
    return "L" + str(int(math.floor(math.log(v) ** 2)))


def _reference_row(line, path, lineno, delimiter, need, label_column, int_cols, cat_cols, add_bias,
                   num_features, seed):
    """Label and hashed columns of one delimited line by the plain Python rules (the reference)."""
    text = line.decode("utf-8", "surrogateescape")  # bytes that are not UTF-8 hash as themselves, as compiled
    f = text.split(delimiter)
    if len(f) < need:
        raise ValueError(f"{path}: line {lineno}: expected at least {need} fields, got {len(f)}")
    try:
        label = float(f[label_column])
    except ValueError as exc:
        raise ValueError(f"{path}: line {lineno}: non-numeric label ({exc})") from None
    toks = ["__bias__"] if add_bias else []
    for j in int_cols:
        if f[j] != "":
            try:
                toks.append(f"{j}#{integer_bin(f[j])}")
            except ValueError as exc:
                raise ValueError(f"{path}: line {lineno}: integer column {j}: {exc}") from None
    toks += [f"{j}={f[j]}" for j in cat_cols if f[j] != ""]
    cols = np.array([zlib.crc32(t.encode("utf-8", "surrogateescape"), seed) % num_features for t in toks],
                    dtype=np.int64)
    return label, cols


# ----------------------------------------------------------------------------- compiled kernels
try:  # pragma: no branch - numba is in the 'fast' extra
    from numba import njit
    from numba.cpython.unsafe.numbers import trailing_zeros
except ImportError:  # pragma: no cover - depends on the environment
    njit = None

if njit is not None:
    @njit(cache=True, nogil=True)
    def _crc_continue(state, buf, s, e, t4):
        """``zlib.crc32(buf[s:e], state)``, four bytes a step (slicing-by-4)."""
        c = (~state) & 0xFFFFFFFF
        k = s
        while e - k >= 4:
            c ^= np.int64(buf[k]) | (np.int64(buf[k + 1]) << 8) | (np.int64(buf[k + 2]) << 16) \
                | (np.int64(buf[k + 3]) << 24)
            c = t4[3, c & 0xFF] ^ t4[2, (c >> 8) & 0xFF] ^ t4[1, (c >> 16) & 0xFF] ^ t4[0, c >> 24]
            k += 4
        while k < e:
            c = t4[0, (c ^ buf[k]) & 0xFF] ^ (c >> 8)
            k += 1
        return (~c) & 0xFFFFFFFF

    @njit(cache=True, nogil=True)
    def _crc_digits(state, v, table, scratch):
        """CRC continued over the decimal text of the integer ``v`` (with a minus sign when negative)."""
        n = 0
        neg = v < 0
        u = -v if neg else v
        if u == 0:
            scratch[0] = 48
            n = 1
        while u > 0:
            scratch[n] = 48 + u % 10
            u //= 10
            n += 1
        c = (~state) & 0xFFFFFFFF
        if neg:
            c = table[(c ^ 45) & 0xFF] ^ (c >> 8)
        for k in range(n - 1, -1, -1):
            c = table[(c ^ scratch[k]) & 0xFF] ^ (c >> 8)
        return (~c) & 0xFFFFFFFF

    @njit(cache=True, nogil=True)
    def _plain_int(buf, s, e):
        """``(ok, value)``: the field is ``[+-]digits`` with at most 15 digits (exact as a float)."""
        if s >= e:
            return False, 0
        neg = False
        if buf[s] == 45 or buf[s] == 43:
            neg = buf[s] == 45
            s += 1
        if s >= e or e - s > 15:
            return False, 0
        v = 0
        for k in range(s, e):
            b = buf[k]
            if b < 48 or b > 57:
                return False, 0
            v = v * 10 + (b - 48)
        return True, -v if neg else v

    @njit(cache=True, nogil=True, inline="always")
    def _load8(buf, k):
        """The 8 bytes ``buf[k:k + 8]`` as a little-endian ``uint64`` (one unaligned load: the index is unsigned,
        so no negative-index wraparound keeps LLVM from combining the byte loads)."""
        u = np.uint64(k)
        return (np.uint64(buf[u]) | (np.uint64(buf[u + np.uint64(1)]) << np.uint64(8))
                | (np.uint64(buf[u + np.uint64(2)]) << np.uint64(16))
                | (np.uint64(buf[u + np.uint64(3)]) << np.uint64(24))
                | (np.uint64(buf[u + np.uint64(4)]) << np.uint64(32))
                | (np.uint64(buf[u + np.uint64(5)]) << np.uint64(40))
                | (np.uint64(buf[u + np.uint64(6)]) << np.uint64(48))
                | (np.uint64(buf[u + np.uint64(7)]) << np.uint64(56)))

    @njit(cache=True, nogil=True)
    def _crc_continue8(state, buf, s, e, t8):
        """``zlib.crc32(buf[s:e], state)``, eight bytes a step (slicing-by-8 over ``t8``, :data:`_CRC_TABLES8`),
        the rest a byte at a time; ``buf`` must be readable up to ``e + 7``."""
        ff = np.uint64(0xFF)
        c = np.uint64((~state) & 0xFFFFFFFF)
        k = s
        while e - k >= 8:
            w = _load8(buf, k) ^ c
            c = (t8[np.uint64(1792) + (w & ff)] ^ t8[np.uint64(1536) + ((w >> np.uint64(8)) & ff)]
                 ^ t8[np.uint64(1280) + ((w >> np.uint64(16)) & ff)] ^ t8[np.uint64(1024) + ((w >> np.uint64(24)) & ff)]
                 ^ t8[np.uint64(768) + ((w >> np.uint64(32)) & ff)] ^ t8[np.uint64(512) + ((w >> np.uint64(40)) & ff)]
                 ^ t8[np.uint64(256) + ((w >> np.uint64(48)) & ff)] ^ t8[w >> np.uint64(56)])
            k += 8
        while k < e:
            c = t8[(c ^ np.uint64(buf[k])) & ff] ^ (c >> np.uint64(8))
            k += 1
        return np.int64((~c) & np.uint64(0xFFFFFFFF))

    @njit(cache=True, nogil=True, inline="always")
    def _finish_row(buf, need, label_column, kinds, prefix, bin_prefix, add_bias, bias_col, num_features, t4, t8,
                    wide, nnz, indices, data, fstart, fend, scratch, int_bucket, lut, shift, mask, counts, tmp):
        """One row of the delimited kernels from its field bounds ``fstart``/``fend``: the label, then the row's
        hashed columns written from ``indices[nnz]`` on (integer fields binned, tokens hashed -- 8 bytes a step
        by :func:`_crc_continue8` when ``wide``, else 4 by :func:`_crc_continue`), sorted and merged.

        Returns ``(status, label, nnz)``: status 0, or 1 when the line needs the reference reader (``nnz``
        then unchanged)."""
        ok, lab = _plain_int(buf, fstart[label_column], fend[label_column])
        if not ok:
            return 1, 0, nnz
        k0 = nnz
        if add_bias:
            indices[nnz] = bias_col
            nnz += 1
        for j in range(need):
            kind = kinds[j]
            if kind == 0 or fstart[j] == fend[j]:
                continue
            if kind == 1:
                ok, v = _plain_int(buf, fstart[j], fend[j])
                if not ok:
                    return 1, 0, k0
                if 0 <= v < lut:
                    indices[nnz] = int_bucket[j, v]
                    nnz += 1
                    continue
                if v <= 2:
                    h = _crc_digits(prefix[j], v, t4[0], scratch)
                else:
                    lg = math.log(float(v))
                    h = _crc_digits(bin_prefix[j], np.int64(math.floor(lg * lg)), t4[0], scratch)
            else:
                h = _crc_continue8(prefix[j], buf, fstart[j], fend[j], t8) if wide else \
                    _crc_continue(prefix[j], buf, fstart[j], fend[j], t4)
            indices[nnz] = h & mask if mask >= 0 else h % num_features  # CRCs are >= 0: the same bucket
            nnz += 1
        # sort the row's columns: a counting pass over 64 buckets of the (uniform) hashed columns, then an
        # insertion sort of the nearly sorted row (a few dozen entries: about a quarter faster than the
        # insertion sort alone; counting ranks without branches and numba's sort were slower)
        for q in range(65):
            counts[q] = 0
        for q in range(k0, nnz):
            counts[(indices[q] >> shift) + 1] += 1
        for q in range(64):
            counts[q + 1] += counts[q]
        for q in range(k0, nnz):
            bkt = indices[q] >> shift
            tmp[counts[bkt]] = indices[q]
            counts[bkt] += 1
        w = nnz - k0
        for q in range(1, w):
            key = tmp[q]
            b = q - 1
            while b >= 0 and tmp[b] > key:
                tmp[b + 1] = tmp[b]
                b -= 1
            tmp[b + 1] = key
        # merge colliding columns (summed, as hash_features does)
        out = k0
        for a in range(w):
            if a > 0 and tmp[a] == indices[out - 1]:
                data[out - 1] += 1.0
            else:
                indices[out] = tmp[a]
                data[out] = 1.0
                out += 1
        return 0, lab, out

    @njit(cache=True, nogil=True)
    def _delimited_kernel(buf, pos, end, delim, need, label_column, kinds, prefix, bin_prefix, add_bias,
                          bias_col, num_features, t4, t8, wide, max_rows, row0, nnz0, indptr, indices, data, labels,
                          fstart, fend, scratch, int_bucket, shift, mask):
        """Parse whole lines of ``buf[pos:end]`` into rows ``row0, row0 + 1, ...`` (at most ``max_rows``).

        Over 80 lines: a numba parser kernel (a byte-level state machine), compiled as one unit.

        ``int_bucket[j, v]`` is the hashed column of integer column ``j`` holding ``0 <= v < int_bucket.shape[1]``
        (the token ``"j#" + integer_bin(v)``, precomputed by :class:`DelimitedSpec`); other values are binned and
        hashed here.  ``shift``: the row's columns are bucketed by ``column >> shift`` (64 buckets over
        ``[0, num_features)``) before the insertion sort.  ``mask``: ``num_features - 1`` when it is a power of two
        (the bucket of a hash is then ``h & mask``), else -1.

        With ``wide`` (the direct path: ``buf[end - 1]`` is ``\\n`` and ``buf`` is readable up to ``end + 7``,
        :data:`_DIRECT_PAD`) the fields are found 8 bytes at a time (a word with no delimiter and no newline is
        skipped in one step; otherwise the first such byte is the lowest zero byte of ``word ^ broadcast(byte)``,
        found with the borrow trick, which is exact for the lowest one) and categorical tokens hashed 8 bytes a
        step (:func:`_crc_continue8` over ``t8``, :data:`_CRC_TABLES8`); otherwise a byte at a time and by
        :func:`_crc_continue` over ``t4``.  Both give the same rows and values.

        Returns ``(status, pos, row, nnz, lines)``: status 0 (block done or chunk full), 1 (the line at
        ``pos`` needs the reference reader), 2 (the line at ``pos`` has fewer than ``need`` fields);
        ``lines`` counts the lines consumed (blank ones included).
        """
        lut = int_bucket.shape[1]
        counts = np.zeros(65, dtype=np.int64)
        tmp = np.empty(need + 1, dtype=indices.dtype)
        ones = np.uint64(0x0101010101010101)
        highs = np.uint64(0x8080808080808080)
        dmask = np.uint64(delim) * ones
        nmask = np.uint64(10) * ones
        row = row0
        nnz = nnz0
        lines = 0
        while pos < end and row < max_rows:
            # one scan: field bounds up to the newline
            nf = 0
            s = pos
            e = pos
            if wide:
                while True:
                    w = _load8(buf, e)
                    x = w ^ dmask
                    z = w ^ nmask
                    hit = (((x - ones) & ~x) | ((z - ones) & ~z)) & highs
                    if hit == 0:
                        e += 8
                        continue
                    e += np.int64(trailing_zeros(hit)) >> 3
                    if buf[e] == 10:
                        break
                    if nf < need:
                        fstart[nf] = s
                        fend[nf] = e
                    nf += 1
                    e += 1
                    s = e
            else:
                while True:
                    b = buf[e]
                    if b == 10:
                        break
                    if b == delim:
                        if nf < need:
                            fstart[nf] = s
                            fend[nf] = e
                        nf += 1
                        s = e + 1
                    e += 1
            nxt = e + 1
            if e > s and buf[e - 1] == 13:
                e -= 1
            if e == pos:  # blank line
                pos = nxt
                lines += 1
                continue
            if nf < need:
                fstart[nf] = s
                fend[nf] = e
            nf += 1
            if nf < need:
                return 2, pos, row, nnz, lines
            status, lab, nnz = _finish_row(buf, need, label_column, kinds, prefix, bin_prefix, add_bias, bias_col,
                                           num_features, t4, t8, wide, nnz, indices, data, fstart, fend, scratch,
                                           int_bucket, lut, shift, mask, counts, tmp)
            if status:
                return status, pos, row, nnz, lines
            labels[row] = lab
            row += 1
            indptr[row] = nnz
            pos = nxt
            lines += 1
        return 0, pos, row, nnz, lines

    @njit(cache=True, nogil=True, inline="always")
    def _is_space(b):
        """ASCII whitespace as ``str.split`` sees it (one comparison for the printable bytes)."""
        return b <= 32 and (b == 32 or (9 <= b <= 13) or (28 <= b <= 31))

    @njit(cache=True, nogil=True, inline="always")
    def _exact_value(m, ex, neg, pow10):
        """``(ok, ±m 10^ex)`` for an integer ``m < 10^15``: exact when ``|ex| <= 22``, where one correctly rounded
        multiplication or division by an exact power of ten gives Python's ``float`` (Clinger 1990); ``ok`` False
        otherwise."""
        if ex < -22 or ex > 22:
            return False, 0.0
        v = float(m)
        if ex >= 0:
            v = v * pow10[ex]
        else:
            v = v / pow10[-ex]
        return True, -v if neg else v

    @njit(cache=True, nogil=True)
    def _scan_float(buf, s, stop, pow10):
        """``(ok, value, end)``: the number ``[+-]digits[.digits][(e|E)[+-]digits]`` starting at ``s``, whose
        token ends at the first whitespace byte or at ``stop`` (found while reading, not in a pass of its own).

        ``ok`` is True only on the fast path: at most 15 significant digits and a decimal exponent within 22,
        where one correctly rounded operation gives Python's ``float`` (Clinger 1990); anything else (another
        byte in the token, ``inf``, a long mantissa) returns ``ok = False`` for the Python parser to handle."""
        k = s
        neg = False
        if k < stop and (buf[k] == 45 or buf[k] == 43):
            neg = buf[k] == 45
            k += 1
        m0 = k
        m = 0
        nd = 0
        frac = 0
        seen_dot = False
        while k < stop:
            b = buf[k]
            if 48 <= b <= 57:
                if nd > 0 or b != 48:
                    nd += 1
                m = m * 10 + (b - 48)
                if seen_dot:
                    frac += 1
            elif b == 46 and not seen_dot:
                seen_dot = True
            else:
                break
            k += 1
        if nd > 15 or k - m0 - (1 if seen_dot else 0) == 0:
            return False, 0.0, k
        ex = 0
        if k < stop and (buf[k] == 101 or buf[k] == 69):
            k += 1
            eneg = False
            if k < stop and (buf[k] == 45 or buf[k] == 43):
                eneg = buf[k] == 45
                k += 1
            e0 = k
            while k < stop and 48 <= buf[k] <= 57:
                ex = ex * 10 + (buf[k] - 48)
                k += 1
            if k == e0 or k - e0 > 3:
                return False, 0.0, k
            if eneg:
                ex = -ex
        if k < stop and not _is_space(buf[k]):  # another byte in the token
            return False, 0.0, k
        ok, v = _exact_value(m, ex - frac, neg, pow10)
        return ok, v, k

    @njit(cache=True, nogil=True)
    def _svm_kernel(buf, pos, end, max_rows, row0, nnz0, indptr, indices, values, labels, pow10):
        """Parse whole svmlight lines of ``buf[pos:end]`` into rows ``row0, ...`` (at most ``max_rows``).

        Over 80 lines: a numba parser kernel (a byte-level state machine), compiled as one unit.

        Returns ``(status, pos, row, nnz, lines)``: 0 (block done or chunk full), 1 (the line at ``pos`` needs
        the Python parser: a non-ASCII byte, a number off the fast path, a duplicated or negative index, a
        malformed token), 3 (the line at ``pos`` does not fit in ``indices``: grow it).
        """
        row = row0
        nnz = nnz0
        lines = 0
        cap = indices.shape[0]
        while pos < end and row < max_rows:
            e = pos
            while buf[e] != 10:
                if buf[e] >= 128 or buf[e] == 35:  # non-ASCII, or the start of a comment
                    break
                e += 1
            if buf[e] >= 128:
                return 1, pos, row, nnz, lines
            stop = e  # the data part ends at '#' or at the newline
            while buf[e] != 10:
                e += 1
            nxt = e + 1
            k = pos
            while k < stop and _is_space(buf[k]):
                k += 1
            if k == stop:  # blank or comment-only line
                pos = nxt
                lines += 1
                continue
            ok, lab, k = _scan_float(buf, k, stop, pow10)
            if not ok:
                return 1, pos, row, nnz, lines
            k0 = nnz
            while True:
                while k < stop and _is_space(buf[k]):
                    k += 1
                if k >= stop:
                    break
                t0 = k
                idx = 0  # the usual token, 1-15 digits, a colon, a number: read in one pass
                while k < stop and 48 <= buf[k] <= 57:
                    idx = idx * 10 + (buf[k] - 48)
                    k += 1
                if k < stop and buf[k] == 58 and 0 < k - t0 <= 15:
                    ok, v, k = _scan_float(buf, k + 1, stop, pow10)
                    if not ok:
                        nnz = k0
                        return 1, pos, row, nnz, lines
                else:  # anything else: find the token and its first colon
                    k = t0
                    colon = -1
                    while k < stop and not _is_space(buf[k]):
                        if buf[k] == 58 and colon < 0:
                            colon = k
                        k += 1
                    if colon - t0 == 3 and buf[t0] == 113 and buf[t0 + 1] == 105 and buf[t0 + 2] == 100:
                        continue  # qid:...
                    nnz = k0  # no colon, an empty, long or non-digit index: the Python parser says what is wrong
                    return 1, pos, row, nnz, lines
                if nnz >= cap:
                    nnz = k0
                    return 3, pos, row, nnz, lines
                indices[nnz] = idx
                values[nnz] = v
                nnz += 1
            # sort the row by index (insertion sort, values along); a duplicate goes to the Python parser
            for a in range(k0 + 1, nnz):
                key = indices[a]
                val = values[a]
                b = a - 1
                while b >= k0 and indices[b] > key:
                    indices[b + 1] = indices[b]
                    values[b + 1] = values[b]
                    b -= 1
                indices[b + 1] = key
                values[b + 1] = val
            for a in range(k0 + 1, nnz):
                if indices[a] == indices[a - 1]:
                    nnz = k0
                    return 1, pos, row, nnz, lines
            labels[row] = lab
            row += 1
            indptr[row] = nnz
            pos = nxt
            lines += 1
        return 0, pos, row, nnz, lines

    @njit(cache=True, nogil=True, inline="always")
    def _digits(buf, k, m):
        """The decimal digits from ``buf[k]`` on appended to the integer ``m``: ``(m, index after them)``; the
        caller knows a non-digit byte follows (a block ends with ``\\n``) and that ``buf`` is readable 8 bytes past
        it (:data:`_DIRECT_PAD`).

        Eight bytes a step (SWAR): a byte is a digit when its high nibble is 3 both as it is and with 6 added (no
        carry reaches a byte from the digits before it); the leading digits, their ASCII offset removed and moved to
        the top of the word, become one number by three multiply-shift steps (pairs, quads, the eight)."""
        ff = np.uint64(0xF0F0F0F0F0F0F0F0)
        threes = np.uint64(0x3030303030303030)
        low7 = np.uint64(0x7F7F7F7F7F7F7F7F)
        while True:
            w = _load8(buf, k)
            bad = ((w & ff) ^ threes) | (((w + np.uint64(0x0606060606060606)) & ff) ^ threes)
            bad = (((bad & low7) + low7) | bad) & ~low7  # the high bit of every byte that is not a digit
            n = 8 if bad == 0 else np.int64(trailing_zeros(bad)) >> 3
            if n == 0:
                return m, k
            d = (w - threes) << np.uint64(8 * (8 - n))  # the digits at the top, zeros (leading zeros) below
            d = (d * np.uint64(10)) + (d >> np.uint64(8))
            d = (((d & np.uint64(0x000000FF000000FF)) * np.uint64(100 + (1000000 << 32)))
                 + (((d >> np.uint64(16)) & np.uint64(0x000000FF000000FF)) * np.uint64(1 + (10000 << 32))))
            m = m * _TEN_POW[n] + np.int64(d >> np.uint64(32))
            k += n
            if n < 8:
                return m, k

    @njit(cache=True, nogil=True, inline="always")
    def _scan_number(buf, k, pow10):
        """:func:`_scan_float` on a block that ends with ``\\n``, with no bound to check per byte: the number at
        ``k`` ends at a whitespace byte or at ``#`` (the data part of the line ends there).  Returns ``(ok, value,
        end)``; ``ok`` exactly where :func:`_scan_float`'s is, with its value: its "at most 15 significant
        digits" is ``m < 10**15`` for the integer ``m`` of all the digits (leading zeros do not change ``m``),
        counted digit by digit only past 18 digits, where ``m`` could otherwise have overflowed."""
        neg = False
        b = buf[k]
        if b == 45 or b == 43:
            neg = b == 45
            k += 1
        k0 = k
        m, k = _digits(buf, k, 0)
        nd = k - k0
        frac = 0
        if buf[k] == 46:
            f0 = k + 1
            m, k = _digits(buf, f0, m)
            frac = k - f0
            nd += frac
        if nd == 0:
            return False, 0.0, k
        if nd > 18:  # leading zeros leave m exact: count the significant digits (rare)
            z = 0
            q = k0
            while buf[q] == 48 or buf[q] == 46:
                z += buf[q] == 48
                q += 1
            if nd - z > 15:
                return False, 0.0, k
        elif m >= 1000000000000000:  # more than 15 significant digits
            return False, 0.0, k
        ex = 0
        b = buf[k]
        if b == 101 or b == 69:
            k += 1
            eneg = False
            b = buf[k]
            if b == 45 or b == 43:
                eneg = b == 45
                k += 1
            e0 = k
            while 48 <= buf[k] <= 57:
                ex = ex * 10 + (np.int64(buf[k]) - 48)
                k += 1
            if k == e0 or k - e0 > 3:
                return False, 0.0, k
            if eneg:
                ex = -ex
        b = buf[k]
        if b != 35 and not _is_space(b):  # another byte in the token
            return False, 0.0, k
        ok, v = _exact_value(m, ex - frac, neg, pow10)
        return ok, v, k

    @njit(cache=True, nogil=True)
    def _svm_chunk_kernel(buf, pos, end, max_rows, row0, nnz0, indptr, indices, values, labels, pow10, shift,
                          num_features):
        """Parse whole svmlight lines of ``buf[pos:end]`` (``buf[end - 1]`` is ``\\n``) straight into the arrays
        of a chunk, rows ``row0, ...`` (at most ``max_rows``): each row's indices shifted by ``shift``, checked
        to lie in ``[0, num_features)``, sorted, distinct.

        Over 80 lines: a numba parser kernel (a byte-level state machine), compiled as one unit.

        It accepts a subset of what :func:`_svm_kernel` accepts (one pass over each line, no bound checked per
        byte, out-of-range indices declined), with the same values.  Returns ``(status, pos, row, nnz, lines)``:
        0 (``end`` reached or ``max_rows`` rows), 1 (the line at ``pos`` is declined: the caller reads the block
        by the former path, which says what is wrong or reads it), 3 (the line at ``pos`` does not fit in
        ``indices``: grow it).
        """
        row = row0
        nnz = nnz0
        lines = 0
        cap = indices.shape[0]
        while pos < end and row < max_rows:
            k = pos
            b = buf[k]
            while b != 10 and _is_space(b):
                k += 1
                b = buf[k]
            if b == 10 or b == 35:  # blank or comment-only line
                while buf[k] != 10:
                    k += 1
                pos = k + 1
                lines += 1
                continue
            ok, lab, k = _scan_number(buf, k, pow10)
            if not ok:
                return 1, pos, row, nnz, lines
            k0 = nnz
            while True:
                b = buf[k]
                while b != 10 and _is_space(b):
                    k += 1
                    b = buf[k]
                if b == 10 or b == 35:
                    break
                t0 = k
                idx, k = _digits(buf, k, 0)  # the usual token, 1-15 digits, a colon, a number: read in one pass
                if buf[k] == 58 and 0 < k - t0 <= 15:
                    ok, v, k = _scan_number(buf, k + 1, pow10)
                    if not ok:
                        return 1, pos, row, k0, lines
                else:  # anything else: a qid:... token is skipped, the rest declined
                    k = t0
                    colon = -1
                    b = buf[k]
                    while b != 35 and not _is_space(b):
                        if b >= 128:
                            return 1, pos, row, k0, lines
                        if b == 58 and colon < 0:
                            colon = k
                        k += 1
                        b = buf[k]
                    if colon - t0 == 3 and buf[t0] == 113 and buf[t0 + 1] == 105 and buf[t0 + 2] == 100:
                        continue
                    return 1, pos, row, k0, lines
                j = idx - shift
                if j < 0 or j >= num_features:
                    return 1, pos, row, k0, lines
                if nnz >= cap:
                    return 3, pos, row, k0, lines
                # insertion into the sorted row (values along); a duplicate is declined
                a = nnz
                while a > k0 and indices[a - 1] > j:
                    indices[a] = indices[a - 1]
                    values[a] = values[a - 1]
                    a -= 1
                if a > k0 and indices[a - 1] == j:
                    return 1, pos, row, k0, lines
                indices[a] = j
                values[a] = v
                nnz += 1
            while buf[k] != 10:  # to the end of a comment
                k += 1
            labels[row] = lab
            row += 1
            indptr[row] = nnz
            pos = k + 1
            lines += 1
        return 0, pos, row, nnz, lines

    @njit(cache=True, nogil=True)
    def _last_newline(buf, n):
        """Index of the last ``\\n`` in ``buf[:n]``, -1 if none."""
        for k in range(n - 1, -1, -1):
            if buf[k] == 10:
                return k
        return -1

    @njit(cache=True, nogil=True)
    def _next_newline(buf, pos, end):
        """Index of the first ``\\n`` in ``buf[pos:end]`` (the caller knows there is one)."""
        while pos < end and buf[pos] != 10:
            pos += 1
        return pos

    @njit(cache=True, nogil=True)
    def _count_byte(buf, n, byte):
        """How many bytes of ``buf[:n]`` equal ``byte``."""
        c = 0
        for k in range(n):
            c += buf[k] == byte
        return c


def have_kernels():
    return njit is not None


# ----------------------------------------------------------------------------- delimited text
class DelimitedSpec:
    """What to read from a delimited line (validated column lists, hashing seed, buckets)."""

    def __init__(self, label_column, integer_columns, categorical_columns, num_features, seed, delimiter,
                 add_bias):
        if isinstance(num_features, bool) or int(num_features) != num_features or num_features < 1:
            raise ValueError(f"num_features: expected a positive integer, got {num_features!r}")
        if isinstance(seed, bool) or int(seed) != seed or not 0 <= seed < 2 ** 32:
            raise ValueError(f"seed: expected an integer in [0, 2^32), got {seed!r}")
        if not isinstance(delimiter, str) or len(delimiter.encode("utf-8")) != 1 or delimiter in "\r\n":
            raise ValueError(f"delimiter: expected one ASCII character other than CR/LF, got {delimiter!r}")
        self.label_column = int(label_column)
        self.int_cols = tuple(int(c) for c in integer_columns)
        self.cat_cols = tuple(int(c) for c in categorical_columns)
        cols = (self.label_column,) + self.int_cols + self.cat_cols
        if min(cols) < 0:
            raise ValueError(f"label_column/integer_columns/categorical_columns: negative column {min(cols)}")
        if len(set(cols)) != len(cols):
            raise ValueError("label_column/integer_columns/categorical_columns: a column is named twice")
        self.need = max(cols) + 1
        self.num_features = int(num_features)
        self.seed = int(seed)
        self.delimiter = delimiter
        self.add_bias = bool(add_bias)
        self.width = int(self.add_bias) + len(self.int_cols) + len(self.cat_cols)
        kinds = np.zeros(self.need, dtype=np.int64)
        prefix = np.zeros(self.need, dtype=np.int64)
        bin_prefix = np.zeros(self.need, dtype=np.int64)
        for j in self.int_cols:
            kinds[j] = 1
            prefix[j] = zlib.crc32(f"{j}#".encode(), self.seed)
            bin_prefix[j] = zlib.crc32(f"{j}#L".encode(), self.seed)
        for j in self.cat_cols:
            kinds[j] = 2
            prefix[j] = zlib.crc32(f"{j}=".encode(), self.seed)
        self.kinds, self.prefix, self.bin_prefix = kinds, prefix, bin_prefix
        self.bias_col = zlib.crc32(b"__bias__", self.seed) % self.num_features
        # index arrays of the chunks: int32 when every value fits (halves their memory; scipy keeps them as they are)
        self.index_dtype = np.int32 if self.num_features <= np.iinfo(np.int32).max else np.int64
        self._int_bucket = None

    @property
    def int_bucket(self):
        """``(need, _INT_LUT)`` hashed column of integer column ``j`` holding the value ``v`` (the token
        ``"j#" + integer_bin(v)``, by the same ``zlib.crc32`` as :func:`_reference_row`), built on first use."""
        if self._int_bucket is None:
            table = np.zeros((self.need, _INT_LUT), dtype=self.index_dtype)
            bins = [integer_bin(v) for v in range(_INT_LUT)]
            for j in self.int_cols:
                table[j] = [zlib.crc32(f"{j}#{b}".encode(), self.seed) % self.num_features for b in bins]
            self._int_bucket = table
        return self._int_bucket

    def reference_row(self, line, path, lineno):
        return _reference_row(line, path, lineno, self.delimiter, self.need, self.label_column, self.int_cols,
                              self.cat_cols, self.add_bias, self.num_features, self.seed)


class _ChunkBuilder:
    """The arrays of the chunk being filled (every chunk gets new ones: a chunk handed out is never overwritten)."""

    def __init__(self, chunk_size, width, index_dtype=np.int64, first=None):
        self.chunk_size = chunk_size
        self.size = chunk_size if first is None else first  # the rows of the chunk being filled
        self.width = width
        big = chunk_size * max(width, 1) > np.iinfo(np.int32).max
        self.index_dtype = np.int64 if big else index_dtype
        self.new()

    def new(self):
        self.indptr = np.zeros(self.size + 1, dtype=self.index_dtype)
        self.indices = np.empty(self.size * self.width, dtype=self.index_dtype)
        self.data = np.empty(self.size * self.width, dtype=np.float64)
        self.labels = np.empty(self.size, dtype=np.float64)
        self.row = 0
        self.nnz = 0

    def add(self, label, cols):
        cols, counts = np.unique(cols, return_counts=True)
        self.indices[self.nnz:self.nnz + len(cols)] = cols
        self.data[self.nnz:self.nnz + len(cols)] = counts
        self.nnz += len(cols)
        self.labels[self.row] = label
        self.row += 1
        self.indptr[self.row] = self.nnz

    def take(self, num_features):
        """The chunk so far as canonical CSR (sorted, duplicate-free rows) and labels; starts a new chunk."""
        m, nnz = self.row, self.nnz
        X = sp.csr_matrix((self.data[:nnz], self.indices[:nnz], self.indptr[:m + 1]), shape=(m, num_features))
        X.has_sorted_indices = True
        X.has_canonical_format = True
        y = self.labels[:m]
        self.size = _next_size(self.size, self.chunk_size)
        self.new()
        return X, y


def _next_size(size, chunk_size):
    """The rows of the chunk after one of ``size`` rows: twice as many, up to ``chunk_size``."""
    return min(chunk_size, 2 * size)


def _first_size(chunk_size, first):
    """The rows of the first chunk: ``first`` (at most ``chunk_size``), or ``chunk_size``.  Each later chunk has
    twice its predecessor's rows, up to ``chunk_size``: a reader thread then hands the learner its first rows
    early, so reading and learning overlap from the start (a file of few chunks is otherwise read half before the
    learner starts)."""
    if first is None:
        return chunk_size
    if isinstance(first, bool) or int(first) != first or first < 1:
        raise ValueError(f"first: expected a positive integer, got {first!r}")
    return min(int(first), chunk_size)


def iter_delimited(path, spec, chunk_size, header=False, block_bytes=_BLOCK_BYTES, use_kernel=None, direct=None,
                   first=None):
    """Chunks ``(X, y)`` of ``chunk_size`` rows of a delimited file (see :class:`DelimitedSpec`): canonical CSR
    ``(m, spec.num_features)`` (``spec.index_dtype`` indices, float64 counts) and float64 labels ``(m,)``; with
    ``first``, the first chunk has ``first`` rows and each later one twice its predecessor's, up to ``chunk_size``.

    ``use_kernel`` (default: when numba is installed) parses by the compiled kernels, ``False`` by the Python
    reference rules line by line.  With the kernels, ``direct`` (default True) takes the direct path
    (:func:`_iter_delimited_direct`: one reused buffer, :func:`_delimited_kernel` 8 bytes at a time);
    ``direct=False`` the block path (:func:`iter_blocks`, the kernel a byte at a time).  Both give the same chunks,
    values and errors; a line the kernel declines is read by :meth:`DelimitedSpec.reference_row` (which raises,
    with the file and line number, on a short line or a field that is not a number)."""
    if isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    chunk_size = int(chunk_size)
    first = _first_size(chunk_size, first)
    use_kernel = have_kernels() if use_kernel is None else bool(use_kernel)
    if use_kernel and not have_kernels():
        raise ValueError("use_kernel=True: numba is not installed (pip install numba), so there is no compiled kernel")
    if direct is None:
        direct = use_kernel
    elif direct and not use_kernel:
        raise ValueError("direct=True: the direct path is a compiled kernel; it needs use_kernel (and numba)")
    if direct:
        yield from _iter_delimited_direct(path, spec, chunk_size, header, block_bytes, first)
        return
    yield from _iter_delimited_blocks(path, spec, chunk_size, header, block_bytes, use_kernel, first)


def _kernel_args(spec):
    """The per-file arguments of the delimited kernels: ``(int_bucket, shift, mask, delim, fstart, fend,
    scratch)``."""
    shift = max(0, int(spec.num_features - 1).bit_length() - 6)  # 64 buckets of the row's columns for the sort
    mask = spec.num_features - 1 if spec.num_features & (spec.num_features - 1) == 0 else -1
    return (spec.int_bucket, shift, mask, spec.delimiter.encode()[0], np.empty(spec.need, dtype=np.int64),
            np.empty(spec.need, dtype=np.int64), np.empty(24, dtype=np.int64))


def _delimited_block(out, spec, kargs, buf, pos, end, wide, lineno, path):
    """The whole lines ``buf[pos:end]`` (line ``lineno`` first) into ``out`` by :func:`_delimited_kernel`
    (``wide``: the direct path's buffer), a line it declines by :meth:`DelimitedSpec.reference_row` (which raises
    on a short line); yields each chunk as it fills and returns the number of the line after the block."""
    int_bucket, shift, mask, delim, fstart, fend, scratch = kargs
    while pos < end:
        status, pos, row, nnz, lines = _delimited_kernel(
            buf, pos, end, delim, spec.need, spec.label_column, spec.kinds, spec.prefix, spec.bin_prefix,
            spec.add_bias, spec.bias_col, spec.num_features, _CRC_TABLES4, _CRC_TABLES8, wide, out.size, out.row,
            out.nnz, out.indptr, out.indices, out.data, out.labels, fstart, fend, scratch, int_bucket, shift, mask)
        out.row, out.nnz = row, nnz
        lineno += lines
        if status != 0:  # this one line by the reference rules (status 2, a short line, raises there)
            e = _next_newline(buf, pos, end)
            line = buf[pos:e].tobytes()
            if line.endswith(b"\r"):
                line = line[:-1]
            out.add(*spec.reference_row(line, path, lineno))
            pos = e + 1
            lineno += 1
        if out.row == out.size:
            yield out.take(spec.num_features)
    return lineno


def _iter_delimited_blocks(path, spec, chunk_size, header, block_bytes, use_kernel, first):
    """The block path of :func:`iter_delimited`: blocks of :func:`iter_blocks` (bytes), each parsed by
    :func:`_delimited_kernel` (or, without ``use_kernel``, the Python reference) into the chunk's arrays."""
    out = _ChunkBuilder(chunk_size, spec.width, spec.index_dtype, first)
    kargs = _kernel_args(spec) if use_kernel else None
    skip_header = bool(header)
    for block, lineno in iter_blocks(path, block_bytes):
        pos = 0
        if skip_header:
            pos = block.index(b"\n") + 1
            lineno += 1
            skip_header = False
        if not use_kernel:
            for line in split_lines(block[pos:]):
                if line:
                    out.add(*spec.reference_row(line, path, lineno))
                    if out.row == out.size:
                        yield out.take(spec.num_features)
                lineno += 1
            continue
        yield from _delimited_block(out, spec, kargs, np.frombuffer(block, dtype=np.uint8), pos, len(block), False,
                                    lineno, path)
    if out.row:
        yield out.take(spec.num_features)


def _iter_delimited_direct(path, spec, chunk_size, header, block_bytes, first):
    """The direct path of :func:`iter_delimited`: the blocks of :func:`_line_blocks` (one reused buffer, no copy
    of a block, no pass to count its lines: the kernel counts them), each parsed by :func:`_delimited_kernel`
    (``wide``) straight into the chunk's arrays; a line it declines is read by
    :meth:`DelimitedSpec.reference_row`, as on the block path, so rows, values, errors and line numbers are the
    same.  A chunk is handed out as soon as it is full (the buffer is not written while the generator waits)."""
    out = _ChunkBuilder(chunk_size, spec.width, spec.index_dtype, first)
    kargs = _kernel_args(spec)
    skip_header = bool(header)
    lineno = 1
    with contextlib.closing(_line_blocks(path, block_bytes, _DIRECT_PAD)) as blocks:
        for buf, end in blocks:
            pos = 0
            if skip_header:
                pos = _next_newline(buf, 0, end) + 1
                lineno += 1
                skip_header = False
            lineno = yield from _delimited_block(out, spec, kargs, buf, pos, end, True, lineno, path)
    if out.row:
        yield out.take(spec.num_features)


# ----------------------------------------------------------------------------- svmlight
def parse_svmlight_block(lines, path, first_lineno):
    """Reference parser of svmlight lines (bytes): ``(indptr, indices, values, labels)``, indices as written.

    Lines are ``label idx:value ...`` with an optional ``# comment`` and ``qid:`` (ignored); blank and
    comment lines give no row.  Indices may be unsorted; a duplicated index raises (as scikit-learn's
    ``load_svmlight_file``), so does a negative one.

    :raises ValueError: naming the file and line.
    """
    labels, indptr, indices, values = [], [0], [], []
    for lineno, raw in enumerate(lines, first_lineno):
        try:
            line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}, line {lineno}: not UTF-8 text ({err})") from None
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        tokens = line.split()
        row = []
        try:
            labels.append(float(tokens[0]))
            for tok in tokens[1:]:
                i, v = tok.split(":", 1)
                if i == "qid":
                    continue
                row.append((int(i), float(v)))
        except ValueError as err:
            raise ValueError(f"{path}, line {lineno}: cannot parse {line[:60]!r} as LIBSVM ({err})") from None
        idx = [i for i, _ in row]
        if idx and min(idx) < 0:
            raise ValueError(f"{path}, line {lineno}: negative feature index {min(idx)}")
        if idx and max(idx) >= 2**62:
            raise ValueError(f"{path}, line {lineno}: feature index {max(idx)} is too large")
        if len(set(idx)) != len(idx):
            dup = sorted(i for i in set(idx) if idx.count(i) > 1)[0]
            raise ValueError(f"{path}, line {lineno}: feature index {dup} appears twice in a row "
                             "(scikit-learn's load_svmlight_file rejects this too)")
        indices.extend(idx)
        values.extend(v for _, v in row)
        indptr.append(len(indices))
    return (np.array(indptr, dtype=np.int64), np.array(indices, dtype=np.int64),
            np.array(values, dtype=np.float64), np.array(labels, dtype=np.float64))


def parse_svmlight_bytes(block, path, first_lineno, use_sklearn=True, use_kernel=None):
    """``(indptr, indices, values, labels)`` of a block of whole svmlight lines, indices as written, each
    row's indices sorted: the compiled line parser (``use_kernel``, default: with ``use_sklearn`` when numba is
    installed) up to the first line it declines, then scikit-learn's compiled parser when it accepts the rest,
    else the reference parser."""
    if use_kernel is None:
        use_kernel = use_sklearn and have_kernels()
    if use_kernel and block:
        return _parse_block_kernel(block, path, first_lineno, use_sklearn)
    if use_sklearn and b"\f" not in block and b"\r" not in block:
        try:
            from sklearn.datasets import load_svmlight_file

            X, y = load_svmlight_file(io.BytesIO(block), zero_based=True, dtype=np.float64)
            X = sp.csr_matrix(X)
            return (X.indptr.astype(np.int64), X.indices.astype(np.int64), X.data, np.asarray(y, np.float64))
        except ImportError:  # pragma: no cover - depends on the environment
            pass
        except (ValueError, OverflowError):
            pass  # the reference parser says why, with the line (or accepts unsorted indices)
    indptr, indices, values, labels = parse_svmlight_block(split_lines(block), path, first_lineno)
    if indices.size:  # sort within rows
        rows = np.repeat(np.arange(len(labels)), np.diff(indptr))
        order = np.lexsort((indices, rows))
        indices, values = indices[order], values[order]
    return indptr, indices, values, labels


def _first_bad_line(block, first_lineno, bad_row):
    """Line number of row ``bad_row`` (0-based) of a block (rows skip blank and comment lines)."""
    r = -1
    for k, line in enumerate(split_lines(block)):
        if line.split(b"#", 1)[0].strip():
            r += 1
            if r == bad_row:
                return first_lineno + k
    return first_lineno


def read_svmlight_rows(block, path, first_lineno, shift, num_features=None, hashing=None, use_sklearn=True,
                       use_kernel=None):
    """Rows of a block as zero-based CSR arrays, checked (or hashed); errors name the line."""
    indptr, indices, values, labels = parse_svmlight_bytes(block, path, first_lineno, use_sklearn, use_kernel)
    if shift:
        indices = indices - shift
    if indices.size and indices.min() < 0:
        k = int(np.argmax(indices < 0))
        row = int(np.searchsorted(indptr, k, side="right") - 1)
        line = _first_bad_line(block, first_lineno, row)
        raise ValueError(f"{path}, line {line}: feature index {int(indices[k]) + shift} is 0 in a file read as "
                         "one-based; use zero_based=True")
    if hashing is not None:
        from ._validation import splitmix64

        indices = (splitmix64(indices, int(hashing)) % np.uint64(num_features)).astype(np.int64)
    elif num_features is not None and indices.size and indices.max() >= num_features:
        k = int(np.argmax(indices >= num_features))
        row = int(np.searchsorted(indptr, k, side="right") - 1)
        line = _first_bad_line(block, first_lineno, row)
        raise ValueError(f"{path}, line {line}: feature index {int(indices[k]) + shift} out of range "
                         f"[{shift}, {num_features + shift}) (num_features={num_features}, "
                         f"zero_based={shift == 0})")
    return indptr, indices, values, labels


_POW10 = np.array([10.0 ** k for k in range(23)])


def _parse_block_kernel(block, path, first_lineno, use_sklearn):
    """Rows of a block by the compiled line parser; from the first line it declines (a number off its exact
    fast path, a duplicated or negative index, a malformed token, non-ASCII text) the rest of the block goes to
    scikit-learn's parser (or the Python one), so the result is theirs."""
    buf = np.frombuffer(block, dtype=np.uint8)
    n_lines = block.count(b"\n")
    indptr = np.zeros(n_lines + 1, dtype=np.int64)
    labels = np.empty(n_lines, dtype=np.float64)
    cap = max(1024, block.count(b":") + 1)  # every entry has a colon: no regrowth on ordinary blocks
    indices = np.empty(cap, dtype=np.int64)
    values = np.empty(cap, dtype=np.float64)
    pos = rows = nnz = lines = 0
    while True:
        status, pos, rows, nnz, done = _svm_kernel(buf, pos, len(block), n_lines, rows, nnz, indptr, indices,
                                                   values, labels, _POW10)
        lines += done
        if status != 3:
            break
        indices = np.concatenate([indices, np.empty(len(indices), dtype=np.int64)])
        values = np.concatenate([values, np.empty(len(values), dtype=np.float64)])
    parts = (indptr[:rows + 1], indices[:nnz], values[:nnz], labels[:rows])
    if status == 0:
        return parts
    rest = parse_svmlight_bytes(block[pos:], path, first_lineno + lines, use_sklearn, use_kernel=False)
    return (np.concatenate([parts[0], rest[0][1:] + nnz]), np.concatenate([parts[1], rest[1]]),
            np.concatenate([parts[2], rest[2]]), np.concatenate([parts[3], rest[3]]))


def _take_rows(parts, m, num_features, index_dtype):
    """The first ``m`` rows of the pending blocks ``parts`` (lists ``[indptr, indices, values, labels]``, consumed
    in place) as one CSR chunk: the rows are copied once, into the chunk's own arrays."""
    ptrs, idx, vals, labs = [], [], [], []
    base = 0
    need = m
    while need:
        indptr, indices, values, labels = parts[0]
        r = min(need, len(labels))
        ptrs.append(indptr[1:r + 1] - indptr[0] + base)
        idx.append(indices[:indptr[r] - indptr[0]])
        vals.append(values[:indptr[r] - indptr[0]])
        labs.append(labels[:r])
        base += int(indptr[r] - indptr[0])
        if r == len(labels):
            parts.pop(0)
        else:  # the rest of the block stays pending (views, no copy)
            cut = indptr[r] - indptr[0]
            parts[0] = [indptr[r:], indices[cut:], values[cut:], labels[r:]]
        need -= r
    indptr = np.zeros(m + 1, dtype=index_dtype)
    np.concatenate(ptrs, out=indptr[1:], casting="unsafe")
    indices = np.concatenate(idx).astype(index_dtype, copy=False)
    X = sp.csr_matrix((np.concatenate(vals), indices, indptr), shape=(m, num_features))
    return X, np.concatenate(labs)


def iter_svmlight_chunks(path, chunk_size, num_features, shift, hashing=None, block_bytes=_BLOCK_BYTES,
                         use_kernel=None, first=None, shard=None):
    """Chunks ``(X, y)`` of ``chunk_size`` rows of an svmlight file (plain or ``.gz``), every row's indices
    sorted and distinct (duplicated indices raise; after ``hashing`` colliding entries are summed); with ``first``,
    the first chunk has ``first`` rows and each later one twice its predecessor's, up to ``chunk_size``.

    Without ``hashing``, when numba is installed (``use_kernel`` None or True): :func:`_svm_chunk_kernel` parses
    each block of lines straight into the chunk's arrays (int32 indices when ``num_features`` fits), shifting
    and checking the indices on the way; a block with a line it declines is read again, whole, by the block
    path below, so values, errors and their line numbers are that path's.  Otherwise (``hashing``, no numba,
    ``use_kernel=False``) each block is parsed into arrays of its own (:func:`read_svmlight_rows`: the compiled
    line parser when ``use_kernel`` allows, scikit-learn's parser from the first line it declines), which wait
    until a chunk is full and are then copied once into the chunk.

    With ``shard=(rank, world_size)`` only the lines of :func:`open_line_range` are read (the byte range of
    ``load_svmlight(shard=...)``). Its errors are first raised with the lines numbered from the range's start;
    the range is then read again, numbered from the file's line (counted once, on this error path only), to
    raise the same error naming the file's line."""
    if isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    args = (path, int(chunk_size), num_features, shift, hashing, block_bytes,
            have_kernels() if use_kernel is None else use_kernel, _first_size(int(chunk_size), first))
    shard = check_shard(shard)
    if shard is None:
        yield from _svmlight_chunks(*args)
        return
    fh, start = open_line_range(path, shard)
    with fh:
        try:
            yield from _svmlight_chunks(*args, fh=fh)
            return
        except ValueError:
            if start == 0:
                raise
    lineno = lines_before(path, start) + 1
    with open_line_range(path, shard)[0] as fh:
        for _ in _svmlight_chunks(*args, fh=fh, lineno=lineno):
            pass
    raise AssertionError("unreachable: the shard's error did not recur")  # pragma: no cover


def _svmlight_chunks(path, chunk_size, num_features, shift, hashing, block_bytes, use_kernel, size, fh=None,
                     lineno=1):
    """The chunks of :func:`iter_svmlight_chunks` (``size``: the first chunk's rows), read from ``fh`` when given
    (its first line numbered ``lineno``), else from ``path``."""
    if use_kernel and hashing is None:
        yield from _iter_svmlight_direct(path, chunk_size, num_features, shift, block_bytes, size, fh, lineno)
        return
    big = max(num_features, chunk_size) > np.iinfo(np.int32).max
    parts = []
    have = 0
    for block, first_line in iter_blocks(path, block_bytes, fh):
        indptr, indices, values, labels = read_svmlight_rows(block, path, first_line + lineno - 1, shift,
                                                             num_features, hashing, use_kernel=use_kernel)
        del block
        if len(labels) == 0:
            continue
        parts.append([indptr, indices, values, labels])
        have += len(labels)
        while have >= size:
            X, y = _take_rows(parts, size, num_features, np.int64 if big or X_big(parts) else np.int32)
            have -= size
            size = _next_size(size, chunk_size)
            yield _canonical(X, hashing), y
    if have:
        X, y = _take_rows(parts, have, num_features, np.int64 if big or X_big(parts) else np.int32)
        yield _canonical(X, hashing), y


def _read_into(fh, buf, offset, n):
    """Read up to ``n`` bytes of ``fh`` into ``buf[offset:]``; fewer only at the end of the file (as
    ``fh.read(n)``, so the blocks are those of :func:`iter_blocks`)."""
    view = memoryview(buf)[offset:offset + n]
    got = 0
    while got < n:
        r = fh.readinto(view[got:])
        if not r:
            break
        got += r
    return got


def _line_blocks(path, block_bytes, pad=0, fh=None):
    """The blocks of :func:`iter_blocks` read (``readinto``) into one reused buffer: yields ``(buf, end)``,
    ``buf[:end]`` a block's whole lines (each ends with ``\\n``; a last line without one gets one) and ``buf``
    readable up to ``end + pad``.  The buffer is rewritten when the next block is asked for (the part line after
    ``end`` moved to its start), so nothing may keep a view of it.  With ``fh`` (an open binary file, e.g. of
    :func:`open_line_range`) its bytes are read, and it is left open."""
    own = fh is None
    fh = open_binary(path) if own else fh
    try:
        buf = np.zeros(2 * block_bytes + 1 + pad, dtype=np.uint8)
        have = 0  # bytes of a partial line carried over at the start of buf
        while True:
            if len(buf) < have + block_bytes + 1 + pad:  # a line longer than a block
                bigger = np.zeros(2 * (have + block_bytes) + 1 + pad, dtype=np.uint8)
                bigger[:have] = buf[:have]
                buf = bigger
            n = _read_into(fh, buf, have, block_bytes)
            total = have + n
            if n == 0:
                if have:
                    buf[have] = 10  # a last line without a newline gets one
                    yield buf, total + 1
                return
            end = _last_newline(buf, total) + 1
            if end == 0:
                have = total
                continue
            yield buf, end
            rest = total - end
            buf[:rest] = buf[end:total]
            have = rest
    finally:
        if own:
            fh.close()


class _SvmChunkBuilder:
    """The arrays of the svmlight chunk being filled: ``chunk_size`` rows, an entry capacity from the entries
    per row seen so far (more than needed is address space, not memory: pages never written are not resident);
    every chunk gets new arrays, so a chunk handed out is never overwritten."""

    _INT32_MAX = np.iinfo(np.int32).max

    def __init__(self, chunk_size, num_features, per_row, first=None):
        self.chunk_size = chunk_size
        self.size = chunk_size if first is None else first  # the rows of the chunk being filled
        self.num_features = num_features
        self.index_dtype = np.int64 if max(num_features, chunk_size) > self._INT32_MAX else np.int32
        self.per_row = per_row
        self.rows_done = self.nnz_done = 0
        self.new()

    def new(self):
        cap = int(self.size * self.per_row * 1.2) + 1024
        dt = np.int64 if cap > self._INT32_MAX else self.index_dtype
        self.indptr = np.zeros(self.size + 1, dtype=dt)
        self.indices = np.empty(cap, dtype=dt)
        self.values = np.empty(cap, dtype=np.float64)
        self.labels = np.empty(self.size, dtype=np.float64)
        self.row = self.nnz = 0

    def state(self):
        return self.indptr, self.indices, self.values, self.labels, self.row, self.nnz

    def restore(self, state):
        self.indptr, self.indices, self.values, self.labels, self.row, self.nnz = state

    def grow(self, need):
        """Room for at least ``need`` entries (the entries so far kept)."""
        cap = max(2 * len(self.indices), need)
        if cap > self._INT32_MAX and self.indices.dtype != np.int64:
            self.indptr = self.indptr.astype(np.int64)
        dt = np.int64 if cap > self._INT32_MAX else self.indices.dtype
        indices = np.empty(cap, dtype=dt)
        values = np.empty(cap, dtype=np.float64)
        indices[:self.nnz] = self.indices[:self.nnz]
        values[:self.nnz] = self.values[:self.nnz]
        self.indices, self.values = indices, values

    def take(self):
        """The chunk so far as canonical CSR and its labels; starts a new chunk."""
        m, nnz = self.row, self.nnz
        X = sp.csr_matrix((self.values[:nnz], self.indices[:nnz], self.indptr[:m + 1]),
                          shape=(m, self.num_features))
        X.has_sorted_indices = True
        X.has_canonical_format = True
        y = self.labels[:m]
        self.rows_done += m
        self.nnz_done += nnz
        self.per_row = self.nnz_done / max(self.rows_done, 1)
        self.size = _next_size(self.size, self.chunk_size)
        self.new()
        return X, y

    def append(self, indptr, indices, values, labels, ready):
        """Copy rows read by the block path into the chunk(s); full chunks go to ``ready``."""
        r, n = 0, len(labels)
        while r < n:
            t = min(self.size - self.row, n - r)
            a, b = int(indptr[r]), int(indptr[r + t])
            if self.nnz + b - a > len(self.indices):
                self.grow(self.nnz + b - a)
            self.indices[self.nnz:self.nnz + b - a] = indices[a:b]
            self.values[self.nnz:self.nnz + b - a] = values[a:b]
            self.indptr[self.row + 1:self.row + t + 1] = indptr[r + 1:r + t + 1] - a + self.nnz
            self.labels[self.row:self.row + t] = labels[r:r + t]
            self.row += t
            self.nnz += b - a
            r += t
            if self.row == self.size:
                ready.append(self.take())


def _iter_svmlight_direct(path, chunk_size, num_features, shift, block_bytes, first, fh=None, lineno=1):
    """:func:`iter_svmlight_chunks` by :func:`_svm_chunk_kernel`: the blocks of :func:`_line_blocks` (one reused
    buffer, no copy of a block, no pass to count its lines: the kernel counts them), each parsed into the chunk's
    arrays.  The chunks a block completes are handed out once the whole block is read, so a block with an error
    gives no chunk of its rows (as the block path).  ``fh``: read from that open file; ``lineno``: the number of
    its first line."""
    out = None
    with contextlib.closing(_line_blocks(path, block_bytes, _DIRECT_PAD, fh)) as blocks:
        for buf, end in blocks:
            if out is None:  # entries per row of the first block: the first chunk's capacity
                out = _SvmChunkBuilder(chunk_size, num_features,
                                       _count_byte(buf, end, 58) / max(1, _count_byte(buf, end, 10)), first)
            start = out.state()
            ready = []
            pos = lines = 0
            declined = False
            while pos < end:
                status, pos, out.row, out.nnz, done = _svm_chunk_kernel(
                    buf, pos, end, out.size, out.row, out.nnz, out.indptr, out.indices, out.values, out.labels,
                    _POW10, shift, num_features)
                lines += done
                if status == 0:
                    if out.row == out.size:
                        ready.append(out.take())
                elif status == 3:
                    out.grow(len(out.indices) + 1)
                else:
                    declined = True
                    break
            if declined:  # the whole block by the block path: its rows, or its error with the line
                out.restore(start)
                ready = []
                block = buf[:end].tobytes()
                out.append(*read_svmlight_rows(block, path, lineno, shift, num_features), ready)
                lines = block.count(b"\n")
                del block
            lineno += lines
            yield from ready
            del ready
    if out is not None and out.row:
        yield out.take()


def X_big(parts):
    """Whether the pending rows hold more entries than int32 indptr can count."""
    return sum(len(p[1]) for p in parts) > np.iinfo(np.int32).max


def _canonical(X, hashing):
    """Sum the entries that hashing made collide (and sort); rows read without hashing are canonical already."""
    if hashing is not None:
        X.sum_duplicates()
    else:
        X.has_sorted_indices = True
        X.has_canonical_format = True
    return X


# ----------------------------------------------------------------------------- prefetch thread
class prefetch:
    """Iterate ``iterable`` in a reader thread, ``depth`` items ahead (exceptions re-raised in the consumer).

    The compiled parsers release the GIL, as do the learner's kernels, so parsing the next chunk overlaps
    learning from this one.  Closing the iterator (or leaving a ``for`` loop early) stops the thread.

    Example::

        >>> list(prefetch(iter(range(3))))
        [0, 1, 2]
    """

    _END = object()

    def __init__(self, iterable, depth=2):
        self._q = queue.Queue(maxsize=max(1, int(depth)))
        self._stop = threading.Event()
        self._it = iterable
        self._thread = threading.Thread(target=self._run, name="pcv-reader", daemon=True)
        self._thread.start()

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        try:
            for item in self._it:
                if not self._put((True, item)):
                    return
            self._put((True, self._END))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put((False, exc))
        finally:
            close = getattr(self._it, "close", None)
            if close is not None and self._stop.is_set():
                try:
                    close()
                except Exception:  # noqa: BLE001
                    pass

    def __iter__(self):
        return self

    def __next__(self):
        if self._stop.is_set():
            raise StopIteration
        ok, item = self._q.get()
        if not ok:
            self.close()
            raise item
        if item is self._END:
            self.close()
            raise StopIteration
        return item

    def close(self):
        self._stop.set()
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __del__(self):
        self._stop.set()
