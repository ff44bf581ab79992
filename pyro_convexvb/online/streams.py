"""Example streams for online learning: synthetic generators, file readers, feature hashing.

* :func:`make_online_stream` -- the synthetic settings of Shamir & Szpankowski 2021 (§4, Figures 1-2,
  Appendix E): random sparse binary or ``[0, 1]`` features, or one feature per category with
  uniform or Zipf long-tail draws; true weights ``N(0, weight_std^2)``;
* :func:`iter_svmlight` / :func:`iter_csv` / :func:`iter_criteo` -- chunked readers whose
  memory does not grow with the file;
* :func:`hash_features` -- feature hashing of categorical tokens into a fixed number of columns;
* :func:`progressive_regret` -- progressive-validation loss and regret ``R_t`` of Eq. (4).
"""
import math
import time
import zlib

import numpy as np
import scipy.sparse as sp

from ..io import open_text as _open_text, parse_svmlight_lines  # noqa: F401  (re-exports)
from . import _textio, equations as eq

__all__ = [
    "OnlineStream",
    "make_online_stream",
    "hash_features",
    "iter_svmlight",
    "iter_csv",
    "iter_criteo",
    "CRITEO_INTEGER_COLUMNS",
    "CRITEO_CATEGORICAL_COLUMNS",
    "DEFAULT_CHUNK_ROWS",
    "FIRST_CHUNK_ROWS",
    "progressive_regret",
]

_BLOCK = 1 << 14  # rows per internal generation block: the stream does not depend on chunk sizes


class OnlineStream:
    """A reproducible synthetic stream with known true weights ``theta`` (the comparator ``w*``).

    Built by :func:`make_online_stream`.  ``chunks(T, chunk_size)`` yields ``(X, y)`` pairs
    (CSR ``(m, d)`` and ``(m,)`` labels in ``{-1, +1}``); the rows do not depend on
    ``chunk_size``: row ``t`` is the same however the stream is cut.

    With ``shard=(rank, world_size)`` the stream is one rank's share of the global stream: its
    generation blocks of ``2^14`` rows are the global blocks ``rank, rank + world_size, ...``
    (block-cyclic), generated directly (no rank draws another's rows). The shards of all ranks
    together are the global stream's rows; :meth:`global_block` gives a block of the global order.

    :ivar theta: ``(d,)`` true weights (the same on every shard).
    :ivar int num_features: ``d``.
    :ivar shard: ``None`` or ``(rank, world_size)``.

    Example::

        >>> from pyro_convexvb.online import make_online_stream
        >>> stream = make_online_stream(d=50, d_t=5, seed=0)
        >>> [X.shape for X, y in stream.chunks(2500, chunk_size=1000)]
        [(1000, 50), (1000, 50), (500, 50)]
    """

    def __init__(self, theta, sampler, link, seed, shard=None):
        self.theta = theta
        self.num_features = theta.shape[0]
        self.link = link
        self._sampler = sampler
        self._seed = seed
        self.shard = shard

    def _block(self, b):
        if self.shard is not None:
            b = b * self.shard[1] + self.shard[0]
        return self.global_block(b)

    def global_block(self, b):
        """Rows ``b 2^14 ... (b + 1) 2^14 - 1`` of the global (unsharded) stream, as ``(X, y)``."""
        rng = np.random.default_rng([self._seed, 1, b])
        X = self._sampler(rng, _BLOCK)
        p = eq.link_cdf(X @ self.theta, self.link)
        y = np.where(rng.random(_BLOCK) < p, 1.0, -1.0)
        return X, y

    def chunks(self, T, chunk_size=100_000):
        """Yield the first ``T`` rows as ``(X, y)`` chunks of ``chunk_size`` rows (the last may be shorter)."""
        if T < 0 or chunk_size < 1:
            raise ValueError(f"T >= 0 and chunk_size >= 1 required, got T={T}, chunk_size={chunk_size}")
        buf_X, buf_y, have, b, done = [], [], 0, 0, 0
        while done < T:
            while have < min(chunk_size, T - done):
                X, y = self._block(b)
                b += 1
                buf_X.append(X)
                buf_y.append(y)
                have += X.shape[0]
            m = min(chunk_size, T - done)
            X = sp.vstack(buf_X, format="csr") if len(buf_X) > 1 else buf_X[0]
            y = np.concatenate(buf_y) if len(buf_y) > 1 else buf_y[0]
            yield X[:m], y[:m]
            buf_X, buf_y, have = ([X[m:]], [y[m:]], X.shape[0] - m) if X.shape[0] > m else ([], [], 0)
            done += m

    def take(self, T):
        """The first ``T`` rows as one ``(X, y)`` pair."""
        X, y = next(self.chunks(T, chunk_size=max(T, 1))) if T else (sp.csr_matrix((0, self.num_features)), np.empty(0))
        return X, y

    def comparator_log_loss(self, X):
        """Per-row log-loss ``-log F(y x^T theta)`` of the true weights, as a function of ``y``.

        :returns: ``(loss_if_pos, loss_if_neg)``, each ``(m,)``.
        """
        s = np.asarray(X @ self.theta)
        return -eq.log_link_cdf(s, self.link), -eq.log_link_cdf(-s, self.link)


def _zipf_cdf(size, exponent):
    n = np.arange(size, dtype=np.float64)
    return np.cumsum((n + 1.0) ** (-exponent))


def make_online_stream(d=200, d_t=20, weight_std=1.0, binary=True, categorical=None, zipf=None, seed=0,
                       link="logit", shard=None):
    """Synthetic sparse logistic (or probit) stream of Shamir & Szpankowski 2021, §4 and Appendix E.

    Over 80 lines: most of it is this docstring (a generator with many knobs); the body is under 80.

    * Random features (``categorical=None``): each of the ``d`` features is present with
      probability ``d_t / d`` (so ``E[d_t]`` features per row); values are 1 (``binary=True``)
      or uniform on ``[0, 1]``.  Figure 1 / Table 1: ``d=200, d_t in {20, 40}, weight_std=1``.
    * Categorical features: ``categorical`` is a list of category sizes (or an integer
      number of equal categories splitting ``d``); every row has exactly one feature from each
      category, drawn uniformly or, with ``zipf=s``, with probability ``c / (n + 1)^s`` for the
      ``n``-th feature of its category.  Figure 2 (left): sizes ``2^j, j = 1..22``,
      ``zipf=1.75``, ``weight_std=2``.

    Labels are drawn with ``P(y_t = 1) = F(x_t^T theta)``, ``theta_i ~ N(0, weight_std^2)``.

    :param int d: number of features (``None`` with a list of category sizes).
    :param float d_t: expected number of active features per row (random mode).
    :param float weight_std: standard deviation of the true log-odds weights.
    :param bool binary: binary features, else uniform values in ``[0, 1]`` (random mode).
    :param categorical: ``None``, an integer, or a sequence of category sizes.
    :param zipf: ``None`` (uniform within a category) or the Zipf exponent ``s > 0``.
    :param int seed: the stream is a function of ``seed`` only.
    :param str link: ``"logit"`` or ``"probit"`` label model.
    :param shard: ``None`` or ``(rank, world_size)``: this rank's share of the stream, generated
        directly (block-cyclic blocks of ``2^14`` rows; see :class:`OnlineStream`), for
        :class:`~pyro_convexvb.online.ShardedOnline`.
    :returns: :class:`OnlineStream`.

    Example::

        >>> stream = make_online_stream(d=200, d_t=20, weight_std=1.0, seed=0)
        >>> X, y = stream.take(1000)
        >>> X.shape, round(X.getnnz() / 1000)
        ((1000, 200), 20)
    """
    if link not in eq.LINKS:
        raise ValueError(f"link: expected one of {eq.LINKS}, got {link!r}")
    if shard is not None:
        try:
            r, P = (int(v) for v in shard)
        except (TypeError, ValueError):
            raise ValueError(f"shard: expected (rank, world_size), got {shard!r}") from None
        if P < 1 or not 0 <= r < P:
            raise ValueError(f"shard: expected integers (rank, world_size) with 0 <= rank < world_size, got {shard!r}")
        shard = None if P == 1 else (r, P)
    if not (weight_std >= 0 and math.isfinite(weight_std)):
        raise ValueError(f"weight_std: expected a finite number >= 0, got {weight_std!r}")
    if zipf is not None and not zipf > 0:
        raise ValueError(f"zipf: expected None or a positive exponent, got {zipf!r}")
    if categorical is None:
        if zipf is not None:
            raise ValueError("zipf: only used with categorical features (set categorical=...)")
        if d is None or int(d) != d or d < 1:
            raise ValueError(f"d: expected a positive integer, got {d!r}")
        d = int(d)
        if not (0 < d_t <= d):
            raise ValueError(f"d_t: expected 0 < d_t <= d = {d}, got {d_t!r}")
        alpha = d_t / d

        def sampler(rng, m):
            if d <= 4096:
                rows, cols = np.nonzero(rng.random((m, d)) < alpha)
            else:  # Binomial counts, then distinct random columns per row
                counts = rng.binomial(d, alpha, size=m)
                rows = np.repeat(np.arange(m), counts)
                cols = rng.integers(0, d, size=rows.shape[0])
                key = np.unique(rows.astype(np.int64) * d + cols)
                rows, cols = key // d, key % d
            vals = np.ones(rows.shape[0]) if binary else rng.random(rows.shape[0])
            return sp.csr_matrix((vals, (rows, cols)), shape=(m, d))
    else:
        if isinstance(categorical, (int, np.integer)):
            if d is None or categorical < 1 or d % categorical:
                raise ValueError(f"categorical: an integer must divide d={d}, got {categorical!r}")
            sizes = [d // int(categorical)] * int(categorical)
        else:
            sizes = [int(s) for s in categorical]
            if not sizes or min(sizes) < 1:
                raise ValueError(f"categorical: expected positive category sizes, got {categorical!r}")
        if d is not None and d != sum(sizes):
            raise ValueError(f"d: the category sizes sum to {sum(sizes)}, got d={d}")
        d = sum(sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        cdfs = [_zipf_cdf(s, zipf) if zipf is not None else None for s in sizes]
        n_cat = len(sizes)

        def sampler(rng, m):
            cols = np.empty((m, n_cat), dtype=np.int64)
            for j, (size, cdf) in enumerate(zip(sizes, cdfs)):
                if cdf is None:
                    cols[:, j] = rng.integers(0, size, size=m)
                else:
                    cols[:, j] = np.minimum(np.searchsorted(cdf, rng.random(m) * cdf[-1], side="right"), size - 1)
                cols[:, j] += offsets[j]
            indptr = np.arange(0, m * n_cat + 1, n_cat)
            return sp.csr_matrix((np.ones(m * n_cat), cols.ravel(), indptr), shape=(m, d))
    theta = np.random.default_rng([seed, 0]).normal(0.0, weight_std, size=d)
    return OnlineStream(theta, sampler, link, seed, shard)


# ----------------------------------------------------------------------------- hashing
def _hash_token(token, num_features, seed):
    return zlib.crc32(token.encode("utf-8"), seed) % num_features


def hash_features(rows, num_features, seed=0):
    """Feature hashing: each row is a list of string tokens (e.g. ``"C3=68fd1e64"``).

    Token ``s`` goes to column ``crc32(s, seed) % num_features`` with value 1; tokens of a row
    that collide are summed.

    :param rows: iterable of iterables of ``str``.
    :param int num_features: number of hash buckets.
    :returns: CSR ``(n_rows, num_features)``.

    Example::

        >>> hash_features([["a=1", "b=x"], []], 16).toarray().sum(1)
        array([2., 0.])
    """
    if int(num_features) != num_features or num_features < 1:
        raise ValueError(f"num_features: expected a positive integer, got {num_features!r}")
    indptr = [0]
    cols = []
    for toks in rows:
        cols.extend(_hash_token(t, num_features, seed) for t in toks)
        indptr.append(len(cols))
    X = sp.csr_matrix((np.ones(len(cols)), np.asarray(cols, dtype=np.int64), np.asarray(indptr)),
                      shape=(len(indptr) - 1, int(num_features)))
    X.sum_duplicates()
    return X


# ----------------------------------------------------------------------------- svmlight
#: rows per chunk of the text readers when ``chunk_size`` is not given. Measured end to end (reader thread and
#: learner, benchmarks/online_text.py --chunk-sizes): 50,000 rows beat 20,000 (more per-chunk overhead) and
#: 100,000 (a file of fewer rows is one chunk, so reading and learning do not overlap) on Criteo-, real-sim- and
#: regret-shaped files (docs/online.md).
DEFAULT_CHUNK_ROWS = 50_000
#: rows of the first chunk when ``chunk_size`` is not given; each later chunk has twice its predecessor's rows, up
#: to :data:`DEFAULT_CHUNK_ROWS` (4,096, 8,192, 16,384, 32,768, then 50,000), so the learner starts after a few
#: milliseconds of reading instead of a whole first chunk's (on a 72,000-row file, 70% of it)
FIRST_CHUNK_ROWS = 4096


def _chunk_rows(chunk_size):
    """``(rows per chunk, rows of the first chunk)``."""
    if chunk_size is None:
        return DEFAULT_CHUNK_ROWS, FIRST_CHUNK_ROWS
    if isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer (or None for {FIRST_CHUNK_ROWS:,} rows doubling "
                         f"to {DEFAULT_CHUNK_ROWS:,}), got {chunk_size!r}")
    return int(chunk_size), int(chunk_size)


def _reader(chunks, prefetch):
    if prefetch is True or (isinstance(prefetch, int) and not isinstance(prefetch, bool) and prefetch > 0):
        return _textio.prefetch(chunks, depth=1 if prefetch is True else int(prefetch))
    if prefetch is False or prefetch == 0:
        return chunks
    raise ValueError(f"prefetch: expected True, False or a positive number of chunks, got {prefetch!r}")


def iter_svmlight(path, chunk_size=None, num_features=None, zero_based=False, hashing=None, prefetch=True,
                  shard=None):
    """Read an svmlight / LIBSVM file (optionally ``.gz``) in chunks of ``chunk_size`` rows (by default
    :data:`FIRST_CHUNK_ROWS`, 4,096, doubling chunk by chunk up to :data:`DEFAULT_CHUNK_ROWS`, 50,000, so a
    learner fed by the reader thread starts early).

    Lines are ``label idx:value ...`` with an optional ``# comment`` and ``qid:`` (ignored); blank and
    comment lines give no row, so every chunk but the last holds exactly ``chunk_size`` rows (or its size in the
    default's doubling).  Blocks of
    lines are parsed by a compiled line parser (numba) straight into the chunk's arrays; a block with a line it
    declines (a number it cannot read exactly, a malformed token, a bad index) is read again, whole, by the
    former compiled parser and scikit-learn's ``load_svmlight_file`` from the first line that one declines, and
    a block both reject by a Python parser that names the line (duplicated or negative indices raise, unsorted
    ones are sorted).
    Memory is bounded by one chunk plus one 4 MB block (with ``prefetch``, three chunks: the one being
    learned, one waiting, the one being read).

    :param int num_features: number of columns (indices must be smaller after the 1-based
        shift); with ``hashing`` the number of buckets.
    :param bool zero_based: indices start at 0 (``False``: the LIBSVM convention, 1-based).
    :param hashing: ``None`` or an integer seed to hash indices into ``num_features`` buckets.
    :param prefetch: ``True`` (default) reads in a background thread one chunk ahead, so parsing overlaps
        learning; ``False`` reads in the caller's thread; an integer sets how many chunks ahead.
    :param shard: ``None`` (the whole file) or ``(rank, world_size)``: only the lines that start in byte range
        ``rank`` of ``world_size`` equal ranges, the rows of ``pcv.datasets.load_svmlight(shard=...)`` (a plain
        file is read from the range's start, no rank reads more than its range plus one line; a ``.gz`` file is
        decompressed once to measure it, then up to the range's end). Concatenating the shards' chunks in rank
        order gives the whole file's rows; each shard's chunks hold ``chunk_size`` rows (or the doubling), as a
        whole file's do. An error names the file's line (its line number is counted only then).
    :returns: iterator of ``(X, y)``: CSR ``(m, num_features)`` and float labels as written.
    :raises ValueError: malformed lines (with the line number), out-of-range indices, or a truncated or corrupt
        ``.gz`` file (named).

    Example::

        >>> for X, y in iter_svmlight("data.svm", num_features=2**20):   # doctest: +SKIP
        ...     model.partial_fit(X, y)
        >>> rank, P = pcv.distributed.init()                               # doctest: +SKIP
        >>> for X, y in iter_svmlight("data.svm", num_features=2**20, shard=(rank, P)):   # doctest: +SKIP
        ...     learner.partial_fit(X, y)
    """
    if num_features is None or isinstance(num_features, bool) or int(num_features) != num_features \
            or num_features < 1:
        raise ValueError(f"num_features: a positive integer is needed to stream with constant memory, "
                         f"got {num_features!r}")
    if zero_based not in (True, False):
        raise ValueError(f"zero_based: expected True or False, got {zero_based!r}")
    if hashing is not None and (isinstance(hashing, bool) or int(hashing) != hashing or hashing < 0):
        raise ValueError(f"hashing: expected None or a non-negative integer seed, got {hashing!r}")
    rows, first = _chunk_rows(chunk_size)
    chunks = _textio.iter_svmlight_chunks(path, rows, int(num_features), 0 if zero_based else 1, hashing, first=first,
                                          shard=_textio.check_shard(shard))
    return _reader(chunks, prefetch)


# ----------------------------------------------------------------------------- CSV / Criteo
CRITEO_INTEGER_COLUMNS = tuple(range(1, 14))
CRITEO_CATEGORICAL_COLUMNS = tuple(range(14, 40))


def iter_csv(path, chunk_size=None, label_column=0, integer_columns=(), categorical_columns=(),
             num_features=2 ** 20, seed=0, delimiter=",", header=False, add_bias=True, prefetch=True):
    """Read a delimited text file (optionally ``.gz``) in chunks of ``chunk_size`` rows (by default
    :data:`FIRST_CHUNK_ROWS`, 4,096, doubling chunk by chunk up to :data:`DEFAULT_CHUNK_ROWS`, 50,000) and hash
    its columns.

    Every categorical column ``j`` with value ``v`` becomes the token ``"j=v"``; an integer
    column becomes ``"j#b"`` with ``b`` its logarithmic bucket (the value up to 2, then
    ``"L" + floor(log(v)^2)``); empty fields are skipped.  Tokens are hashed as by
    :func:`hash_features` (``crc32(token, seed) % num_features``, colliding tokens summed).  With ``add_bias``
    every row also gets a constant feature.  Lines end at ``\\n`` (``\\r\\n`` too); blank lines are skipped.
    Fields are split at every ``delimiter``: CSV quoting is not interpreted (``"a,b"`` is two fields, quotes
    included), as in Criteo's tab-separated logs; quoted fields need another reader (``csv``, pandas).

    The file is read into one reused buffer and its fields split, binned and hashed by a compiled kernel over
    the raw bytes (numba), straight into the chunk's arrays; a row whose label or integer field is not a plain
    integer (``1.5``, ``1e3``, ``inf``) is read by the Python rules, so the result is the same either way.

    :param int label_column: column of the label (``0``/``1`` or ``-1``/``+1``).
    :param prefetch: ``True`` (default) reads in a background thread one chunk ahead; ``False`` in the
        caller's thread; an integer sets how many chunks ahead.
    :returns: iterator of ``(X, y)``: CSR ``(m, num_features)`` and float labels.
    :raises ValueError: a short line, a non-numeric label, or a non-numeric or non-finite integer field (with
        the file and line number); a truncated or corrupt ``.gz`` file (named).

    Example::

        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "t.csv")
        >>> _ = open(p, "w").write("1,3,a\\n0,,b\\n")
        >>> (X, y), = iter_csv(p, integer_columns=[1], categorical_columns=[2], num_features=64)
        >>> X.getnnz(axis=1).tolist(), y.tolist()
        ([3, 2], [1.0, 0.0])
    """
    spec = _textio.DelimitedSpec(label_column, integer_columns, categorical_columns, num_features, seed,
                                 delimiter, add_bias)
    rows, first = _chunk_rows(chunk_size)
    return _reader(_textio.iter_delimited(path, spec, rows, header=header, first=first), prefetch)


def iter_criteo(path, chunk_size=None, num_features=2 ** 22, seed=0, add_bias=True, prefetch=True):
    """Chunks of the Criteo display-advertising layout: tab-separated label, 13 integer and 26
    categorical columns (Shamir & Szpankowski 2021, §4); see :func:`iter_csv`.

    Example::

        >>> for X, y in iter_criteo("day_0.txt.gz"):   # doctest: +SKIP
        ...     model.partial_fit(X, y)
    """
    return iter_csv(path, chunk_size=chunk_size, label_column=0, integer_columns=CRITEO_INTEGER_COLUMNS,
                    categorical_columns=CRITEO_CATEGORICAL_COLUMNS, num_features=num_features, seed=seed,
                    delimiter="\t", add_bias=add_bias, prefetch=prefetch)


# ----------------------------------------------------------------------------- regret
def progressive_regret(model, stream, T, chunk_size=100_000, num_points=200):
    """Progressive-validation loss and regret on ``stream`` (Shamir & Szpankowski 2021, Eq. (4) and §4).

    ``R_t = sum_{tau <= t} [-log p_tau + log(1 + exp(-y_tau x_tau^T w*))]`` with the true
    weights ``w* = stream.theta`` as comparator.  Several models can share one pass over the
    stream (each chunk is generated once and fed to all of them), so memory stays constant
    even for ``T = 10^7``.

    :param model: an estimator of this package, or a dict ``name -> estimator``.
    :param OnlineStream stream: the data and the comparator.
    :param int T: number of rows.
    :param int num_points: size of the log-spaced grid on which ``R_t`` is recorded.
    :returns: dict with ``t`` (grid), ``regret`` (``R_t`` on the grid), ``R_T``,
        ``r_T = R_T / log T``, ``loss`` and ``comparator_loss`` (totals) and ``seconds`` (time
        spent in ``partial_fit``); a dict of those per name when ``model`` is a dict.

    Example::

        >>> from pyro_convexvb.online import OnlineBayesLogistic
        >>> stream = make_online_stream(d=50, d_t=5, seed=0)
        >>> res = progressive_regret(OnlineBayesLogistic(50), stream, T=2000)
        >>> res["regret"].shape == res["t"].shape
        True
    """
    models = model if isinstance(model, dict) else {None: model}
    grid = np.unique(np.geomspace(1, T, num_points).astype(np.int64)) if T else np.empty(0, np.int64)
    res = {k: {"t": grid, "regret": np.empty(grid.shape[0]), "R_T": 0.0, "loss": 0.0,
               "comparator_loss": 0.0, "seconds": 0.0} for k in models}
    start = 0
    for X, y in stream.chunks(T, chunk_size):
        lp, ln = stream.comparator_log_loss(X)
        cl = np.where(y > 0, lp, ln)
        m = X.shape[0]
        sel = (grid > start) & (grid <= start + m)
        for name, est in models.items():
            r = res[name]
            t0 = time.perf_counter()
            ll = est.partial_fit(X, y, return_log_loss=True)
            r["seconds"] += time.perf_counter() - t0
            cum = r["R_T"] + np.cumsum(ll - cl)
            r["regret"][sel] = cum[grid[sel] - start - 1]
            r["R_T"] = float(cum[-1]) if m else r["R_T"]
            r["loss"] += float(ll.sum())
            r["comparator_loss"] += float(cl.sum())
        start += m
    for r in res.values():
        r["r_T"] = r["R_T"] / math.log(T) if T > 1 else float("nan")
    return res if isinstance(model, dict) else res[None]
