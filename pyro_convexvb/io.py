"""Reading the LIBSVM / svmlight text format, shared by :mod:`pyro_convexvb.datasets` (whole files)
and :mod:`pyro_convexvb.online.streams` (chunked streams).

A line is ``label idx:value idx:value ...`` with an optional ``# comment``; ``qid:...`` tokens
are ignored.  Only NumPy is needed here, so both users import this module without importing
each other.
"""
import gzip

import numpy as np

__all__ = ["parse_svmlight_lines", "read_svmlight", "open_text"]


def open_text(path):
    """Open a UTF-8 text file for reading, transparently decompressing a ``.gz`` file."""
    path = str(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def parse_svmlight_lines(lines, path="<lines>", first_lineno=1):
    """Parse LIBSVM/svmlight lines (``label idx:value ...``; ``#`` comments, ``qid:`` ignored).

    Shared by :func:`pyro_convexvb.datasets.load_svmlight` (whole files, via :func:`read_svmlight`)
    and :func:`pyro_convexvb.online.iter_svmlight` (chunks of a stream).

    :param lines: iterable of text lines.
    :param path: name used in error messages.
    :param int first_lineno: line number of the first line (for error messages).
    :returns: ``(indptr, indices, values, labels)`` numpy arrays of shapes ``(N + 1,)``,
        ``(nnz,)``, ``(nnz,)``, ``(N,)`` (CSR layout); ``indices`` as written in the file.
    :raises ValueError: a malformed line, naming the file and line number.

    Example::

        >>> indptr, indices, values, labels = parse_svmlight_lines(["1 3:0.5 7:2", "-1 qid:4 1:1 # c"])
        >>> indptr.tolist(), indices.tolist(), values.tolist(), labels.tolist()
        ([0, 2, 3], [3, 7, 1], [0.5, 2.0, 1.0], [1.0, -1.0])
    """
    labels, indptr, indices, values = [], [0], [], []
    for lineno, line in enumerate(lines, first_lineno):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        tokens = line.split()
        try:
            labels.append(float(tokens[0]))
            for tok in tokens[1:]:
                i, v = tok.split(":", 1)
                if i == "qid":
                    continue
                indices.append(int(i))
                values.append(float(v))
        except ValueError as err:
            raise ValueError(f"{path}, line {lineno}: cannot parse {line[:60]!r} as LIBSVM ({err})") from None
        indptr.append(len(indices))
    return (np.array(indptr, dtype=np.int64), np.array(indices, dtype=np.int64), np.array(values, dtype=np.float64),
            np.array(labels, dtype=np.float64))


def read_svmlight(path, zero_based="auto"):
    """Read a whole LIBSVM/svmlight file with :func:`parse_svmlight_lines`.

    :param path: file path (plain text).
    :param zero_based: ``True``, ``False`` or ``"auto"`` (one-based unless an index 0 occurs, as
        in scikit-learn).
    :returns: ``(indptr, indices, values, labels)`` numpy arrays as in :func:`parse_svmlight_lines`,
        with ``indices`` zero-based.
    :raises ValueError: a malformed line, or an index 0 in a file read as one-based.
    """
    with open(path) as f:
        indptr, indices, values, labels = parse_svmlight_lines(f, path)
    if zero_based is False or (zero_based == "auto" and (indices.size == 0 or indices.min() > 0)):
        indices -= 1
    if indices.size and indices.min() < 0:
        raise ValueError(f"{path}: feature index 0 in a file read as one-based (use zero_based=True)")
    return indptr, indices, values, labels
