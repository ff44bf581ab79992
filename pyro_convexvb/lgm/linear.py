"""``pcv.linear``: a matmul that tells the LGM extractor which operator it applied; and the record of
``Normal(loc, scale).cdf(eta)`` calls by which the extractor recognises probit likelihoods."""
import contextlib

import torch

from ..linalg.operators import LinearOperator, SparseOperator, as_operator

_RECORDERS = []
_OPERATOR_CACHE = {}
_CDF_RECORDERS = []
_CDF_ORIGINAL = []


@contextlib.contextmanager
def record_linear():
    """Collect every ``pcv.linear`` call made inside the block (used by :func:`lgm_from_pyro`)."""
    records = []
    _RECORDERS.append(records)
    try:
        yield records
    finally:
        _RECORDERS.pop()


def _operator_for(design):
    if isinstance(design, LinearOperator):
        return design
    if isinstance(design, torch.Tensor) and design.layout != torch.strided:
        key = id(design)
        hit = _OPERATOR_CACHE.get(key)
        if hit is not None and hit[0] is design:
            return hit[1]
        op = SparseOperator(design)
        if len(_OPERATOR_CACHE) > 32:
            _OPERATOR_CACHE.clear()
        _OPERATOR_CACHE[key] = (design, op)
        return op
    return as_operator(design)


def _as_dtype_of(design, u):
    """``design`` in ``u``'s floating dtype when it holds integers, booleans or floats of lower precision (a count
    matrix of scikit-learn's ``CountVectorizer``, a float32 SciPy matrix): exact conversions. Others as they are."""
    import numpy as np
    import scipy.sparse as sp

    target = u.dtype
    if sp.issparse(design) or isinstance(design, np.ndarray):
        kind = np.dtype(design.dtype)
        wide = torch.finfo(target).bits
        if kind.kind in "iub" or (kind.kind == "f" and kind.itemsize * 8 < wide):
            return design.astype(torch.empty((), dtype=target).numpy().dtype)
        return design
    if isinstance(design, torch.Tensor) and design.dtype != target and not design.is_complex():
        if not design.is_floating_point() or torch.finfo(design.dtype).bits < torch.finfo(target).bits:
            return design.to(target)
    return design


def linear(design, u):
    """Compute ``design @ u`` and record ``design`` as the linear operator of the predictor.

    Under any Pyro engine this is just a matrix-vector product (with a fast backward for
    sparse designs: the CSR transpose is built once per design tensor and reused).  Under
    :func:`pyro_convexvb.lgm_from_pyro` the operator is recorded so the extracted latent
    Gaussian model uses it directly (sparse stays sparse).

    :param design: dense tensor ``(q, n)``, torch sparse COO/CSR tensor ``(q, n)``, scipy sparse
        matrix, or a :class:`~pyro_convexvb.linalg.LinearOperator`.
    :param torch.Tensor u: ``(n,)`` or ``(..., n)`` (leading batch dimensions, e.g. from
        vectorised particles, are supported).
    :returns: ``(q,)`` or ``(..., q)``.

    Example::

        >>> X = torch.randn(5, 3, dtype=torch.float64)
        >>> w = torch.ones(3, dtype=torch.float64)
        >>> torch.allclose(linear(X, w), X @ w)
        True
    """
    if not torch.is_tensor(u) or not u.is_floating_point():
        raise TypeError(f"pcv.linear: u: expected a floating-point torch tensor (the latent), got "
                        f"{getattr(u, 'dtype', type(u).__name__)}")
    op = _operator_for(_as_dtype_of(design, u))
    if op.dtype != u.dtype:
        raise TypeError(f"pcv.linear: the design is {op.dtype} and the latent {u.dtype}; give the design in the "
                        "latent's dtype (a design of integers or of a lower precision is converted, not one of a "
                        "higher precision)")
    if u.shape[-1] != op.shape[1]:
        raise ValueError(
            f"pcv.linear: design has {op.shape[1]} columns but the latent has trailing size {u.shape[-1]}"
        )
    if u.dim() == 1:
        out = op.mv(u)
    else:
        # Leading dimensions are batch dimensions of the latent (vectorised particles, plates to the
        # left of the data plate).  A singleton just left of the latent's last axis is the slot of
        # the data plate (Pyro gives a global latent shape (P, 1, n)): drop it so the output
        # (P, q) lines up with the plate instead of broadcasting to (P, P, q).
        if u.dim() >= 3 and u.shape[-2] == 1:
            u = u.squeeze(-2)
        batch = u.shape[:-1]
        flat = u.reshape(-1, u.shape[-1]).transpose(0, 1)
        out = op.mv(flat).transpose(0, 1).reshape(batch + (op.shape[0],))
    for records in _RECORDERS:
        records.append((op, u, out))
    return out


def _recording_cdf(self, value):
    out = _CDF_ORIGINAL[0](self, value)
    if torch.is_tensor(out):
        for records in _CDF_RECORDERS:
            records.append((self.loc, self.scale, value, out, out._version))
    return out


@contextlib.contextmanager
def record_normal_cdf():
    """Collect every ``Normal(loc, scale).cdf(value)`` call made inside the block (``torch.distributions.Normal``
    and Pyro's ``dist.Normal``), as ``(loc, scale, value, output, output version)``.

    Used by :func:`pyro_convexvb.lgm_from_pyro` to recognise ``Bernoulli(probs=Normal(...).cdf(eta))``
    as a probit likelihood of the predictor ``(eta - loc) / scale`` without inverting the CDF
    (``Phi^{-1}(Phi(eta))`` loses all precision for ``|eta| > 8``). ``Normal.cdf`` is wrapped only
    while a block is open; the wrapper returns the original method's result unchanged.
    """
    records = []
    if not _CDF_RECORDERS:
        _CDF_ORIGINAL[:] = [torch.distributions.Normal.cdf]
        torch.distributions.Normal.cdf = _recording_cdf
    _CDF_RECORDERS.append(records)
    try:
        yield records
    finally:
        del _CDF_RECORDERS[next(i for i, r in enumerate(_CDF_RECORDERS) if r is records)]
        if not _CDF_RECORDERS:
            torch.distributions.Normal.cdf = _CDF_ORIGINAL[0]
            _CDF_ORIGINAL[:] = []


def normal_cdf_argument(probs):
    """The standardised argument ``(value - loc) / scale`` of the recorded ``Normal(loc, scale).cdf(value)``
    call whose output ``probs`` is, or ``None``.

    ``probs`` matches a record when it is that output itself or a broadcast view of it (as Pyro's
    ``Bernoulli.expand`` makes) that starts at the same memory, has the same values, and the output
    was not modified in place since the call. Anything computed from the output (a clamp, an
    arithmetic expression) is a different tensor and does not match. The argument is returned with
    ``probs``'s shape.
    """
    if not torch.is_tensor(probs):
        return None
    for records in reversed(_CDF_RECORDERS):
        for loc, scale, value, out, version in reversed(records):
            if out._version != version or out.device != probs.device or out.data_ptr() != probs.data_ptr():
                continue
            if out is not probs:
                try:
                    same = torch.equal(out.expand(probs.shape), probs)
                except RuntimeError:
                    same = False
                if not same:
                    continue
            value = torch.as_tensor(value, dtype=out.dtype, device=out.device)
            return ((value - loc) / scale).expand(out.shape).expand(probs.shape)
    return None
