"""Input checks and conversions shared by the online estimators."""
import numpy as np
import scipy.sparse as sp

try:  # torch is a core dependency, but the online module itself only needs NumPy.
    import torch
except ImportError:  # pragma: no cover
    torch = None

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def is_torch(obj):
    return torch is not None and isinstance(obj, torch.Tensor)


def splitmix64(v, seed=0):
    """A fixed 64-bit integer mix (SplitMix64 finaliser) of ``v + seed``; vectorised, wraps mod 2^64."""
    with np.errstate(over="ignore"):
        z = np.asarray(v).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15) * np.uint64(seed + 1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def to_csr(X, num_features, hashing=None, name="X"):
    """Any 2-D input as a canonical float64 CSR matrix with ``num_features`` columns.

    Accepts scipy sparse matrices/arrays, NumPy arrays and torch tensors (dense, sparse COO or
    CSR).  With ``hashing`` (an integer seed) column ``j`` moves to bucket
    ``splitmix64(j, seed) % num_features`` and colliding entries of a row are summed, so ``X``
    may have any number of columns.  Duplicate entries are summed and explicit zeros dropped.

    :raises ValueError: wrong dimension, wrong number of columns, NaN or inf entries.
    """
    if is_torch(X):
        X = X.detach()
        if X.layout == torch.sparse_csr:
            X = sp.csr_matrix((X.values().cpu().numpy(), X.col_indices().cpu().numpy(),
                               X.crow_indices().cpu().numpy()), shape=tuple(X.shape))
        elif X.layout == torch.sparse_coo:
            X = X.coalesce()
            idx = X.indices().cpu().numpy()
            X = sp.csr_matrix((X.values().cpu().numpy(), (idx[0], idx[1])), shape=tuple(X.shape))
        else:
            X = X.cpu().numpy()
    if sp.issparse(X):
        if X.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {X.shape}")
        X = sp.csr_matrix(X, dtype=np.float64, copy=True)
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
    X.sum_duplicates()
    X.eliminate_zeros()
    return X


def from_torch(obj):
    """A torch tensor as NumPy (dense) or SciPy CSR (sparse COO/CSR); anything else unchanged."""
    if not is_torch(obj):
        return obj
    obj = obj.detach()
    if obj.layout == torch.sparse_csr:
        return sp.csr_matrix((obj.values().cpu().numpy(), obj.col_indices().cpu().numpy(),
                              obj.crow_indices().cpu().numpy()), shape=tuple(obj.shape))
    if obj.layout == torch.sparse_coo:
        obj = obj.coalesce()
        idx = obj.indices().cpu().numpy()
        return sp.csr_matrix((obj.values().cpu().numpy(), (idx[0], idx[1])), shape=tuple(obj.shape))
    return obj.cpu().numpy()


def check_positive_float(value, name):
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    if not np.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return v


def check_choice(value, choices, name):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")
    return value


def per_feature(value, num_features, name, positive=False):
    """A scalar or ``(num_features,)`` array as a float64 array of length ``num_features``."""
    if is_torch(value):
        value = value.detach().cpu().numpy()
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
