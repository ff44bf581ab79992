r"""Pyro distributions for latent Gaussian models with sparse structure.

:class:`SparseGMRF` is a Gaussian Markov random field (Rue & Held 2005, §2.1) given by a sparse
precision matrix: a Pyro distribution that the engines of this package read without densifying
(:func:`pyro_convexvb.lgm_from_pyro` turns it into a prior block with a sparse precision operator)
and that Pyro's own inference (NUTS, SVI) runs with as any other distribution.
"""
import math
import weakref

import torch
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import constraints

from .linalg.operators import SparseOperator, to_csr
from .linalg.sparse_cholesky import SparseCholesky

__all__ = ["SparseGMRF"]

# factorisations of precision objects shared by distribution instances built from the same object
# (a Pyro model builds a new instance at every execution): id -> (weakref, version, dtype, operator, factor)
_FACTORS = {}


def _forget(key):
    def callback(_):
        _FACTORS.pop(key, None)

    return callback


def _version(obj):
    try:
        return obj._version if torch.is_tensor(obj) else obj.matrix._version
    except (AttributeError, RuntimeError):
        return None


def _precision_and_factor(precision, dtype, device):
    """``(SparseOperator, SparseCholesky)`` of ``precision`` in ``dtype``, cached per precision object."""
    key = id(precision)
    hit = _FACTORS.get(key)
    if hit is not None:
        ref, version, dt, dev, op, chol = hit
        if ref() is precision and version == _version(precision) and dt == dtype and dev == device:
            return op, chol
    if isinstance(precision, SparseOperator):
        matrix = precision.matrix
    elif torch.is_tensor(precision):
        if precision.layout not in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc):
            raise TypeError("precision: expected a torch sparse tensor (COO/CSR/CSC) or a SparseOperator, got a dense "
                            "tensor; for a dense precision use pyro.distributions.MultivariateNormal(precision_matrix=...)")
        matrix = precision
    else:
        raise TypeError(f"precision: expected a torch sparse tensor (COO/CSR/CSC) or a SparseOperator, "
                        f"got {type(precision).__name__}")
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"precision: must be a square matrix, got shape {tuple(matrix.shape)}")
    if matrix.requires_grad:
        raise ValueError("precision: the sparse precision is a fixed matrix (no gradient flows into its values); "
                         "give a learnable overall scale as precision_scale")
    chol = SparseCholesky(matrix, name="precision")  # checks symmetry and positive definiteness
    csr = to_csr(matrix.detach())
    csr = torch.sparse_csr_tensor(csr.crow_indices(), csr.col_indices(), csr.values().to(dtype), size=csr.shape,
                                  check_invariants=False).to(device)
    op = SparseOperator(csr)
    try:
        ref = weakref.ref(precision, _forget(key))
    except TypeError:  # pragma: no cover - objects without weak references are not cached
        return op, chol
    _FACTORS[key] = (ref, _version(precision), dtype, device, op, chol)
    return op, chol


class SparseGMRF(TorchDistribution):
    r"""Gaussian Markov random field ``x ~ N(loc, Q^{-1})`` with a sparse precision ``Q = s Q_0``.

    The density (Rue & Held 2005, Eq. 2.5) is

    .. math:: \log p(x) = -\tfrac n2 \log 2\pi + \tfrac12 (n \log s + \log|Q_0|)
              - \tfrac s2 (x - \mu)^T Q_0 (x - \mu).

    ``Q_0`` is factored once (sparse Cholesky with a fill-reducing ordering,
    :class:`~pyro_convexvb.linalg.SparseCholesky`; the factorisation is shared by every instance built
    from the same precision object, so a model that builds the distribution at each execution
    factors once). ``log|Q_0|`` comes from the factor, the quadratic form from sparse products that
    autograd differentiates, samples from ``x = loc + s^{-1/2} P^T L^{-T} D^{-1/2} eps``
    (Rue & Held 2005, Algorithm 2.4) and :attr:`variance` from selected inversion of the factor
    (Takahashi et al. 1973). Nothing of size ``n x n`` is formed.

    ``log_prob`` is differentiable in the value, ``loc`` and ``precision_scale``; ``rsample`` is
    reparameterised in ``loc`` and ``precision_scale``. The values of ``Q_0`` are fixed (put a prior
    on the overall scale through ``precision_scale``, e.g. a Gamma).

    Shapes: ``event_shape = (n,)`` and ``batch_shape = ()``. Parameters with batch dimensions are
    not supported and raise; ``expand(batch_shape)`` (and Pyro plates) give independent copies
    through Pyro's :class:`~pyro.distributions.ExpandedDistribution`.

    :param torch.Tensor loc: ``(n,)`` mean (or a scalar, broadcast to ``(n,)``).
    :param precision: ``(n, n)`` symmetric positive definite ``Q_0``: a torch sparse tensor (COO, CSR or
        CSC) or a :class:`~pyro_convexvb.linalg.SparseOperator`. Converted to the dtype of ``loc``.
    :param torch.Tensor precision_scale: optional positive scalar ``s`` (``Q = s Q_0``); default 1.
    :raises TypeError: ``precision`` is dense or of an unknown type.
    :raises ValueError: shapes that do not match, a non-symmetric ``precision``, batch dimensions,
        a non-positive ``precision_scale``.
    :raises pyro_convexvb.NotPositiveDefiniteError: ``precision`` is not positive definite.

    Example (a first-order random walk with a small ridge, sampled and scored)::

        >>> import torch, pyro
        >>> import pyro_convexvb as pcv
        >>> n = 6
        >>> i = torch.arange(n)
        >>> rows = torch.cat([i, i[:-1], i[1:]]); cols = torch.cat([i, i[1:], i[:-1]])
        >>> deg = torch.full((n,), 2.0, dtype=torch.float64); deg[[0, -1]] = 1.0
        >>> vals = torch.cat([deg + 0.1, -torch.ones(2 * (n - 1), dtype=torch.float64)])
        >>> Q = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (n, n))
        >>> d = pcv.distributions.SparseGMRF(torch.zeros(n, dtype=torch.float64), Q, torch.tensor(2.0, dtype=torch.float64))
        >>> x = d.rsample((3,))
        >>> x.shape, d.log_prob(x).shape, d.variance.shape
        (torch.Size([3, 6]), torch.Size([3]), torch.Size([6]))
        >>> ref = pyro.distributions.MultivariateNormal(torch.zeros(n, dtype=torch.float64),
        ...                                             precision_matrix=2.0 * Q.to_dense())
        >>> bool(torch.allclose(d.log_prob(x), ref.log_prob(x)))
        True
    """

    arg_constraints = {"loc": constraints.real_vector, "precision_scale": constraints.positive}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc, precision, precision_scale=None, validate_args=None):
        if not torch.is_tensor(loc):
            loc = torch.as_tensor(loc, dtype=torch.get_default_dtype())
        if not loc.is_floating_point():
            raise ValueError(f"loc: expected a floating-point tensor, got dtype {loc.dtype}")
        shape = precision.shape if isinstance(precision, SparseOperator) else getattr(precision, "shape", None)
        if shape is None or len(shape) != 2:
            raise TypeError(f"precision: expected a torch sparse tensor (COO/CSR/CSC) or a SparseOperator, "
                            f"got {type(precision).__name__}")
        n = int(shape[0])
        if loc.dim() == 0:
            loc = loc.expand(n)
        if loc.dim() != 1 or loc.shape[0] != n:
            raise ValueError(f"loc: expected shape ({n},) to match precision {tuple(shape)}, got {tuple(loc.shape)} "
                             "(SparseGMRF has batch_shape (); batched parameters are not supported)")
        if precision_scale is None:
            precision_scale = torch.ones((), dtype=loc.dtype, device=loc.device)
        else:
            precision_scale = torch.as_tensor(precision_scale, dtype=loc.dtype, device=loc.device)
            if precision_scale.numel() != 1 or precision_scale.dim() > 1:
                raise ValueError(f"precision_scale: expected a scalar, got shape {tuple(precision_scale.shape)} "
                                 "(SparseGMRF has batch_shape (); batched parameters are not supported)")
            precision_scale = precision_scale.reshape(())
            validate = self._validate_args if validate_args is None else validate_args
            # a scale that underflowed to 0 (an MCMC proposal exp(z), z < -745) gives log_prob = -inf, as a
            # vanishing scale does in torch's distributions; negative or NaN scales are errors
            if validate and not torch._C._get_tracing_state() and not bool(precision_scale.detach() >= 0):
                raise ValueError(f"precision_scale: must be positive, got {float(precision_scale.detach()):.6g}")
        self.loc = loc
        self.precision_scale = precision_scale
        self._precision_obj = precision
        self.precision, self._chol = _precision_and_factor(precision, loc.dtype, loc.device)
        self._logdet0 = self._chol.logdet()
        super().__init__(torch.Size(), torch.Size([n]), validate_args=validate_args)

    # ------------------------------------------------------------------ torch.distributions API
    @property
    def n(self):
        return self.event_shape[0]

    @property
    def mean(self):
        return self.loc

    @property
    def mode(self):
        return self.loc

    @property
    def variance(self):
        """``diag(Q^{-1}) = diag(Q_0^{-1}) / s`` by selected inversion (``(n,)``; differentiable in ``s``)."""
        z = torch.as_tensor(self._chol.diag_inverse(), dtype=self.loc.dtype, device=self.loc.device)
        return z / self.precision_scale

    def log_det_precision(self):
        """``log|Q| = n log s + log|Q_0|`` as a tensor (differentiable in ``s``)."""
        return self.n * torch.log(self.precision_scale) + self._logdet0

    def scaled_precision(self):
        """``Q = s Q_0`` as a :class:`~pyro_convexvb.linalg.SparseOperator` (detached values)."""
        s = float(self.precision_scale.detach())
        if s == 1.0:
            return self.precision
        A = self.precision.matrix
        csr = torch.sparse_csr_tensor(A.crow_indices(), A.col_indices(), A.values() * s, size=A.shape,
                                      check_invariants=False)
        return SparseOperator(csr)

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        n = self.n
        r = value - self.loc
        batch = r.shape[:-1]
        flat = r.reshape(-1, n).transpose(0, 1)  # (n, B)
        quad = (flat * self.precision.mv(flat.contiguous())).sum(0).reshape(batch)
        return (-0.5 * n * math.log(2 * math.pi) + 0.5 * self.log_det_precision()
                - 0.5 * self.precision_scale * quad)

    def rsample(self, sample_shape=torch.Size()):
        shape = self._extended_shape(sample_shape)
        n = self.n
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        z = self._chol.solve_Lt(eps.reshape(-1, n).transpose(0, 1).detach())  # (n, B): z ~ N(0, Q_0^{-1})
        z = z.transpose(0, 1).reshape(shape)
        return self.loc + z * torch.rsqrt(self.precision_scale)

    def entropy(self):
        return 0.5 * self.n * (1.0 + math.log(2 * math.pi)) - 0.5 * self.log_det_precision()

    def __repr__(self):
        return f"SparseGMRF(n={self.n}, nnz(Q)={self.precision.nnz}, dtype={self.loc.dtype})"
