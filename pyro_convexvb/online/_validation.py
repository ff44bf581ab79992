"""Input checks and conversions shared by the online estimators."""
import numpy as np
import scipy.sparse as sp

from ..estimator_base import sklearn_input as from_torch  # noqa: F401  (torch tensors as NumPy / SciPy CSR)

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)

def splitmix64(v, seed=0):
    """A fixed 64-bit integer mix (SplitMix64 finaliser) of ``v + seed``; vectorised, wraps mod 2^64."""
    with np.errstate(over="ignore"):
        z = np.asarray(v).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15) * np.uint64(seed + 1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def to_csr(X, num_features, hashing=None, name="X"):
    """Any 2-D input as a canonical float64 CSR matrix with ``num_features`` columns.

    Accepts scipy sparse matrices/arrays, NumPy arrays and torch tensors (dense, sparse COO, CSR or CSC).  With ``hashing`` (an integer seed) column ``j`` moves to bucket
    ``splitmix64(j, seed) % num_features`` and colliding entries of a row are summed, so ``X``
    may have any number of columns.  Duplicate entries are summed and explicit zeros dropped.

    :raises ValueError: wrong dimension, wrong number of columns, NaN or inf entries.
    :raises FloatingPointError: finite entries of a row that share a column (duplicates, or columns hashed to one
        bucket) sum to more than float64 holds.
    """
    X = from_torch(X)
    clean = False
    if sp.issparse(X):
        if X.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {X.shape}")
        # a canonical float64 CSR matrix without stored zeros (what the text readers yield) is used as it is:
        # nothing below would change it, so it is not copied
        clean = (X.format == "csr" and X.dtype == np.float64 and hashing is None and X.has_canonical_format
                 and not np.any(X.data == 0))
        X = sp.csr_matrix(X, dtype=np.float64, copy=not clean)
    else:
        X = np.asarray(X)
        if X.ndim == 1:
            raise ValueError(f"{name}: expected a 2-D matrix (rows are examples), got a 1-D array of "
                             f"shape {X.shape}; use X.reshape(1, -1) for a single example")
        if X.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {X.shape}")
        if not np.issubdtype(X.dtype, np.number) and X.dtype != bool:
            raise ValueError(f"{name}: expected numeric values, got dtype {X.dtype}")
        X = sp.csr_matrix(X.astype(np.float64))
    if not np.all(np.isfinite(X.data)):
        raise ValueError(f"{name}: contains NaN or inf values")
    if hashing is None:
        if X.shape[1] != num_features:
            raise ValueError(f"{name}: expected {num_features} columns (num_features), got {X.shape[1]}")
    else:
        cols = (splitmix64(X.indices, hashing) % np.uint64(num_features)).astype(np.int64)
        X = sp.csr_matrix((X.data, cols, X.indptr), shape=(X.shape[0], num_features))
    if not clean:  # (a clean matrix is canonical and holds no zeros already)
        summed = not X.has_canonical_format
        X.sum_duplicates()
        if summed and not np.all(np.isfinite(X.data)):
            k = int(np.flatnonzero(~np.isfinite(X.data))[0])
            t = int(np.searchsorted(X.indptr, k, side="right")) - 1
            col = f"hash bucket {int(X.indices[k])}" if hashing is not None else f"column {int(X.indices[k])}"
            shared = "the columns hashed to it" if hashing is not None else "its duplicate entries"
            raise FloatingPointError(f"{name}: row {t}, {col}: the sum of {shared} overflows float64 "
                                     f"({X.data[k]}); rescale the features (e.g. standardise them)")
        X.eliminate_zeros()
    return X


def per_feature(value, num_features, name, positive=False):
    """A scalar or ``(num_features,)`` array as a float64 array of length ``num_features``."""
    value = from_torch(value)
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(num_features, float(arr))
    elif arr.shape != (num_features,):
        raise ValueError(f"{name}: expected a scalar or shape ({num_features},), got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: contains NaN or inf")
    if positive and np.any(arr <= 0):
        raise ValueError(f"{name}: must be positive")
    return arr.copy()
