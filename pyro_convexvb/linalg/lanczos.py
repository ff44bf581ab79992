"""Lanczos tridiagonalisation with full reorthogonalisation, and Gaussian variance estimators.

``k`` Lanczos steps on an SPD operator ``A`` (``n x n``) give an orthonormal ``Q`` (``n x k``)
and a tridiagonal ``T = Q^T A Q`` (diagonal ``alpha``, off-diagonal ``beta``).  The extremal
eigenvalues of ``A`` are approximated by the Ritz values (eigenvalues of ``T``), and
``A^{-1}`` by ``Q T^{-1} Q^T``.

Variance estimators (symbols of Nickisch & Seeger 2009 §2.3 and Seeger 2010 §3):

* :func:`lanczos_variances` -- *K-Lanczos*: ``z_k = diag(B Q T^{-1} Q^T B^T)``, accumulated one
  Lanczos vector at a time through the bidiagonal Cholesky factor of ``T``;
* :func:`pca_variances` -- *L-PCA*: ``diag(B U_L Lambda_L^{-1} U_L^T B^T)`` with the ``L``
  smallest eigenpairs of ``A`` obtained as converged Ritz pairs.

Both are lower bounds on the exact ``diag(B A^{-1} B^T)`` in every component and nondecreasing in
``k`` (resp. ``L``) (Seeger 2010 §4.1): ``Q T^{-1} Q^T`` and ``U Lambda^{-1} U^T`` are
``A^{-1}`` compressed to a subspace, hence ``<= A^{-1}`` in the Loewner order.

Why not :func:`linear_operator.utils.lanczos.lanczos_tridiag`?  It reorthogonalises with
elementwise products over a ``(k, n, 1)`` buffer (10x slower than BLAS matrix-vector products at
``k = 200, n = 20,000``, see ``docs/linalg.md``), declares breakdown when ``beta < 1e-6`` in
absolute terms (it stops after two steps on a matrix scaled by ``1e-8``), and returns neither the
Lanczos coefficients, the number of products nor Ritz residuals.
"""
from dataclasses import dataclass
import math
import warnings

import torch

from ..errors import ConvergenceWarning
from .cg import NotPositiveDefiniteError, _check_finite, _resolve_matmul
from .operators import LinearOperator, as_operator

__all__ = ["LanczosResult", "BlockLanczosResult", "lanczos", "block_lanczos", "banded_lanczos_z", "lanczos_variances",
           "pca_variances", "tridiagonal_cholesky"]


def tridiagonal_cholesky(alpha, beta):
    """Bidiagonal Cholesky factor of the SPD tridiagonal ``T = L L^T``.

    ``L`` is lower bidiagonal with diagonal ``e`` and subdiagonal ``d`` (Nickisch & Seeger 2009 §2.3 writes
    ``e_k`` for the diagonal and ``d_{k-1}`` for the subdiagonal):
    ``e_1 = sqrt(alpha_1)``, ``d_{j-1} = beta_{j-1} / e_{j-1}``, ``e_j = sqrt(alpha_j - d_{j-1}^2)``.
    Computed in float64 on the CPU (``k`` scalar steps).

    :param alpha: diagonal of ``T``, shape ``(k,)``.
    :param beta: off-diagonal of ``T``, shape ``(k-1,)``.
    :returns: ``(e, d)`` as float64 CPU tensors of shapes ``(k,)`` and ``(k-1,)``.
    :raises NotPositiveDefiniteError: if a pivot ``alpha_j - d_{j-1}^2`` is ``<= 0``.

    Example::

        >>> import torch
        >>> e, d = tridiagonal_cholesky(torch.tensor([2.0, 2.0]), torch.tensor([1.0]))
        >>> torch.allclose(e, torch.tensor([2.0 ** 0.5, 1.5 ** 0.5], dtype=torch.float64))
        True
    """
    a = alpha.detach().double().cpu().tolist()
    b = beta.detach().double().cpu().tolist()
    e, d = [], []
    prev = None
    for j, aj in enumerate(a):
        if j == 0:
            piv = aj
        else:
            dj = b[j - 1] / prev
            d.append(dj)
            piv = aj - dj * dj
        if not piv > 0:
            raise NotPositiveDefiniteError(
                f"the Lanczos matrix T is not positive definite (pivot {piv:.3e} at step {j + 1}); "
                "the operator is not SPD or too ill-conditioned for its dtype"
            )
        prev = math.sqrt(piv)
        e.append(prev)
    return torch.tensor(e, dtype=torch.float64), torch.tensor(d, dtype=torch.float64)


@dataclass
class LanczosResult:
    """Outcome of :func:`lanczos`.

    :ivar Q: orthonormal Lanczos vectors, shape ``(n, k)`` (a transposed view of a row-major buffer).
    :ivar alpha: diagonal of ``T``, shape ``(k,)``.
    :ivar beta: off-diagonal of ``T``, shape ``(k-1,)``.
    :ivar num_mvm: products with ``A``.
    :ivar breakdown: ``True`` if the run stopped before the requested ``k`` because the Krylov
        space became invariant (``beta_k <= breakdown_tol * ||T||``); the Ritz values are then
        exact eigenvalues of ``A``.
    :ivar ritz_values: eigenvalues of ``T`` in ascending order, shape ``(k,)``.
    :ivar ritz_residuals: ``|beta_k s_{k,i}|`` = ``||A y_i - theta_i y_i||`` for the Ritz pair
        ``(theta_i, y_i = Q s_i)``, shape ``(k,)``; ``|lambda - theta_i| <= ritz_residuals[i]``
        for some eigenvalue ``lambda`` of ``A``.
    :ivar beta_next: ``beta_k``, norm of the residual of the last step (0-d tensor).
    :ivar ritz_vectors_T: eigenvectors ``S`` of ``T`` (columns), shape ``(k, k)``.
    """

    Q: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    num_mvm: int
    breakdown: bool
    ritz_values: torch.Tensor
    ritz_residuals: torch.Tensor
    beta_next: torch.Tensor = None
    ritz_vectors_T: torch.Tensor = None

    @property
    def k(self):
        """Number of Lanczos vectors."""
        return self.alpha.shape[0]

    def T(self):
        """The dense ``(k, k)`` tridiagonal matrix ``T = Q^T A Q``."""
        T = torch.diag(self.alpha)
        if self.k > 1:
            T = T + torch.diag(self.beta, 1) + torch.diag(self.beta, -1)
        return T

    def cholesky_T(self):
        """Bidiagonal Cholesky factor ``(e, d)`` of ``T`` (see :func:`tridiagonal_cholesky`)."""
        if getattr(self, "_chol", None) is None:
            self._chol = tridiagonal_cholesky(self.alpha, self.beta)
        return self._chol

    def logdet_T(self):
        """``log|T| = 2 sum_j log e_j``; at ``k = n`` (no breakdown) it equals ``log|A|``.

        Seeger 2010 §4.2: ``log|T_k|`` replaces ``log|A|`` in the K-Lanczos approximation.
        Returned as a 0-d tensor of the dtype/device of ``alpha``.
        """
        e, _ = self.cholesky_T()
        return (2.0 * torch.log(e).sum()).to(dtype=self.alpha.dtype, device=self.alpha.device)

    def ritz_vectors(self, index=None):
        """Ritz vectors ``Q S[:, index]`` of shape ``(n, len(index))`` (all if ``index`` is None)."""
        S = self.ritz_vectors_T if index is None else self.ritz_vectors_T[:, index]
        return self.Q @ S

    def apply_inverse(self, v):
        """``Q T^{-1} Q^T v`` for ``v`` of shape ``(n,)`` or ``(n, m)`` (the low-rank ``A^{-1}``)."""
        return self.Q @ torch.linalg.solve(self.T(), self.Q.transpose(0, 1) @ v)

    def variances(self, B=None, chunk_size=64):
        """K-Lanczos variances ``diag(B Q T^{-1} Q^T B^T)`` of this run (Nickisch & Seeger 2009 §2.3).

        ``z_j = z_{j-1} + v_j^2`` with ``v_j = (B q_j - d_{j-1} v_{j-1}) / e_j`` where ``(e, d)`` is the
        bidiagonal Cholesky factor of ``T``.  ``B q_j`` is computed ``chunk_size`` columns at a
        time, so the extra memory is ``O(q * chunk_size)``; ``B Q`` is never formed whole.

        :param B: ``(q, n)`` operator or tensor; ``None`` means the identity (variances of ``u``).
        :param chunk_size: Lanczos vectors per product with ``B``.
        :returns: ``z`` of shape ``(q,)``.
        """
        return _lanczos_z(self, B, chunk_size)


def _as_design(B, n, name="B"):
    if B is None:
        return None
    op = as_operator(B)
    if op.shape[1] != n:
        raise ValueError(f"{name}: expected {n} columns (the size of A), got shape {tuple(op.shape)}")
    return op


def _design_rows(Q, B):
    """``(s, t) -> (B Q[:, s:t])^T``, the row blocks :func:`banded_lanczos_z` reads (``B = None``: ``Q^T``)."""
    op = _as_design(B, Q.shape[0])

    def rows(s, t):
        return Q[:, s:t].transpose(0, 1) if op is None else op.mv(Q[:, s:t].contiguous()).transpose(0, 1)

    return rows


def _lanczos_z(res, B, chunk_size):
    e, d = res.cholesky_T()
    L = (torch.diag(e) + torch.diag(d, -1)).to(dtype=res.Q.dtype, device=res.Q.device)
    return banded_lanczos_z(L, 1, _design_rows(res.Q, B), res.k, max(1, int(chunk_size)))


class _LanczosProcess:
    """Lanczos iteration that can be extended step by step (row-major buffer of Lanczos vectors)."""

    def __init__(self, apply_a, v0, capacity, reorthogonalize=True, breakdown_tol=None):
        n = v0.shape[0]
        self.apply_a = apply_a
        self.n = n
        self.reorthogonalize = reorthogonalize
        eps = torch.finfo(v0.dtype).eps
        self.breakdown_tol = float(breakdown_tol) if breakdown_tol is not None else eps ** (2.0 / 3.0)
        self.Qr = v0.new_empty((max(1, capacity), n))
        nrm = torch.linalg.vector_norm(v0)
        if not float(nrm) > 0:
            raise ValueError("v0: the starting vector must be nonzero")
        self.q = v0 / nrm
        self.alpha, self.beta = [], []  # beta[j] = norm of the residual after step j
        self.num_mvm = 0
        self.breakdown = False
        self.anorm = 0.0

    @property
    def k(self):
        return len(self.alpha)

    def _grow(self, capacity):
        if capacity > self.Qr.shape[0]:
            new = self.Qr.new_empty((capacity, self.n))
            new[: self.k] = self.Qr[: self.k]
            self.Qr = new

    def run(self, k):
        """Extend to ``k`` steps in total (fewer on breakdown)."""
        k = min(int(k), self.n)
        self._grow(k)
        with torch.no_grad():
            while self.k < k and not self.breakdown:
                j = self.k
                if j > 0:
                    bprev = self.beta[-1]
                    if bprev <= self.breakdown_tol * self.anorm:
                        self.breakdown = True
                        break
                    self.q = self.w / bprev
                q = self.q
                self.Qr[j] = q
                w = self.apply_a(q)
                if not isinstance(w, torch.Tensor) or w.shape != q.shape:
                    got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                    raise ValueError(f"matmul: expected an output of shape {tuple(q.shape)}, got {got}")
                self.num_mvm += 1
                w = w.detach().clone()
                a = float(torch.dot(q, w))
                if not math.isfinite(a):
                    raise ValueError("matmul returned NaN or inf during Lanczos")
                w.add_(q, alpha=-a)
                if j > 0:
                    w.add_(self.Qr[j - 1], alpha=-self.beta[-1])
                if self.reorthogonalize:
                    Qj = self.Qr[: j + 1]
                    # classical Gram-Schmidt, repeated once if the norm dropped a lot (DGKS criterion)
                    for _ in range(2):
                        before = float(torch.linalg.vector_norm(w))
                        c = Qj @ w
                        w.sub_(Qj.transpose(0, 1) @ c)
                        a += float(c[j])
                        after = float(torch.linalg.vector_norm(w))
                        if after > 0.7071 * before:
                            break
                    b = after
                else:
                    b = float(torch.linalg.vector_norm(w))
                self.w = w
                self.alpha.append(a)
                prev_b = self.beta[-1] if self.beta else 0.0
                self.beta.append(b)
                self.anorm = max(self.anorm, abs(a) + b + prev_b)
        return self

    def result(self, ritz=True):
        k = self.k
        dt, dev = self.Qr.dtype, self.Qr.device
        alpha = torch.tensor(self.alpha, dtype=dt, device=dev)
        beta = torch.tensor(self.beta[: k - 1], dtype=dt, device=dev)
        beta_next = torch.tensor(0.0 if self.breakdown else self.beta[k - 1], dtype=dt, device=dev)
        res = LanczosResult(
            Q=self.Qr[:k].transpose(0, 1),
            alpha=alpha,
            beta=beta,
            num_mvm=self.num_mvm,
            breakdown=self.breakdown,
            ritz_values=None,
            ritz_residuals=None,
            beta_next=beta_next,
        )
        if ritz:
            theta, S = torch.linalg.eigh(res.T())
            res.ritz_values = theta
            res.ritz_vectors_T = S
            res.ritz_residuals = (beta_next * S[-1, :]).abs()
        return res


def _start_vector(n_or_v0, apply_n, op_dtype, op_device, dtype, device, generator):
    if isinstance(n_or_v0, torch.Tensor):
        v0 = n_or_v0
        if v0.dim() != 1:
            raise ValueError(f"v0: expected a 1-D starting vector, got shape {tuple(v0.shape)}")
        if apply_n is not None and v0.shape[0] != apply_n:
            raise ValueError(f"v0: operator has size {apply_n} but v0 has shape {tuple(v0.shape)}")
        _check_finite(v0, "v0")
        if dtype is not None or device is not None:
            v0 = v0.to(dtype=dtype or v0.dtype, device=device or v0.device)
        return v0.detach()
    n = int(n_or_v0)
    if apply_n is not None and n != apply_n:
        raise ValueError(f"n_or_v0: operator has size {apply_n}, got n={n}")
    if n < 1:
        raise ValueError(f"n_or_v0: n must be >= 1, got {n}")
    dtype = dtype or op_dtype or torch.get_default_dtype()
    device = device or op_device or (generator.device if generator is not None else None)
    return torch.randn(n, dtype=dtype, device=device, generator=generator)


def lanczos(
    matmul,
    n_or_v0,
    k,
    *,
    reorthogonalize=True,
    breakdown_tol=None,
    generator=None,
    dtype=None,
    device=None,
):
    """``k`` Lanczos steps with full reorthogonalisation on a symmetric operator ``A``.

    Each step costs one product with ``A`` and, with ``reorthogonalize=True``, one or two classical
    Gram-Schmidt passes against all previous vectors (``O(n j)`` BLAS matrix-vector work; the second
    pass is done only if the first one removed more than 30% of the norm).  The run stops early
    (``breakdown=True``) when ``beta_j <= breakdown_tol * ||T||_est``, i.e. when the Krylov space is
    numerically invariant.  Memory: ``Q`` of ``n k`` numbers.

    :param matmul: callable ``v -> A v`` on ``(n,)`` vectors, a LinearOperator or a tensor.
    :param n_or_v0: starting vector ``(n,)``, or ``n`` for a standard normal start drawn with ``generator``.
    :param k: number of steps (at most ``n``).
    :param reorthogonalize: full reorthogonalisation (strongly recommended; without it Ritz values
        repeat and ``Q`` loses orthogonality, Seeger 2010 §3).
    :param breakdown_tol: relative breakdown threshold on ``beta_j / ||T||``; default ``eps**(2/3)``
        (``3.7e-11`` in float64, ``2.4e-5`` in float32).  Rounding leaves ``beta ~ 1e-17..1e-13``
        at a true invariant subspace in float64; continuing past a missed breakdown is harmless
        (the next vector is orthogonalised against ``Q`` and ``T`` stays exact).
    :param generator: :class:`torch.Generator` for the random start.
    :param dtype: dtype of a random start (default: the operator's, else torch's default).
    :param device: device of a random start (default: the operator's).
    :returns: :class:`LanczosResult`.

    Example::

        >>> import torch
        >>> A = torch.diag(torch.arange(1.0, 11.0, dtype=torch.float64))
        >>> res = lanczos(A, 10, 10, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(res.ritz_values, torch.arange(1.0, 11.0, dtype=torch.float64))
        True
    """
    apply_a, n_op, op_dtype, op_device = _resolve_matmul(matmul)
    v0 = _start_vector(n_or_v0, n_op, op_dtype, op_device, dtype, device, generator)
    k = int(k)
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    proc = _LanczosProcess(apply_a, v0, min(k, v0.shape[0]), reorthogonalize, breakdown_tol)
    return proc.run(k).result()


def lanczos_variances(
    matmul,
    B,
    k,
    *,
    v0=None,
    return_result=False,
    reorthogonalize=True,
    breakdown_tol=None,
    generator=None,
    chunk_size=64,
):
    """K-Lanczos variance estimate ``z_k = diag(B Q T^{-1} Q^T B^T) ~ diag(B A^{-1} B^T)``.

    Nickisch & Seeger 2009 §2.3 (Nickisch & Seeger 2009): with ``T = L L^T``, ``L`` bidiagonal (diagonal ``e``,
    subdiagonal ``d``), ``z_k = z_{k-1} + v_k^2``, ``v_k = (B q_k - d_{k-1} v_{k-1}) / e_k``.  Each
    component of ``z_k`` is nondecreasing in ``k`` and ``<=`` the exact variance (Seeger 2010 §4.1),
    with equality at ``k = n``, and whenever the rows of ``B`` lie in the Krylov space (e.g. at
    breakdown).  Cost: ``k`` products with ``A``, ``k`` columns of products with ``B`` (taken
    ``chunk_size`` at a time), ``O(n k^2)`` reorthogonalisation; memory ``Q`` (``n k``) plus
    ``O(q * chunk_size)``.  ``B Q`` is never formed whole.

    :param matmul: the SPD precision ``A`` (``n x n``): callable, LinearOperator or tensor.
    :param B: ``(q, n)`` LinearOperator or tensor (dense or sparse); ``None`` for the identity.
    :param k: number of Lanczos steps.
    :param v0: starting vector ``(n,)``; default standard normal from ``generator``.
    :param return_result: also return the :class:`LanczosResult` (``Q``, ``T``, ``log|T|``, ...).
    :param reorthogonalize: see :func:`lanczos`.
    :param breakdown_tol: see :func:`lanczos`.
    :param generator: :class:`torch.Generator` for the random start.
    :param chunk_size: Lanczos vectors per product with ``B``.
    :returns: ``z`` of shape ``(q,)``, or ``(z, result)``.
    :raises NotPositiveDefiniteError: if ``T`` is not positive definite (``A`` not SPD).

    Example::

        >>> import torch
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> z = lanczos_variances(A, torch.eye(2, dtype=torch.float64), 2, v0=torch.tensor([1.0, 0.0], dtype=torch.float64))
        >>> torch.allclose(z, torch.linalg.inv(A).diagonal())
        True
    """
    apply_a, n_op, op_dtype, op_device = _resolve_matmul(matmul)
    if v0 is None:
        n = n_op if n_op is not None else as_operator(B).shape[1] if B is not None else None
        if n is None:
            raise ValueError("lanczos_variances: pass v0 (or an operator with a known size) to fix n")
        start = n
        dt = op_dtype or (as_operator(B).dtype if B is not None else None)
        dev = op_device or (as_operator(B).device if B is not None else None)
    else:
        start, dt, dev = v0, None, None
    res = lanczos(
        matmul,
        start,
        k,
        reorthogonalize=reorthogonalize,
        breakdown_tol=breakdown_tol,
        generator=generator,
        dtype=dt,
        device=dev,
    )
    z = res.variances(B, chunk_size=chunk_size)
    return (z, res) if return_result else z


def pca_variances(
    matmul,
    B,
    L,
    *,
    num_steps=None,
    max_steps=None,
    tol=1e-6,
    v0=None,
    generator=None,
    return_result=False,
    on_fail="warn",
    chunk_size=64,
):
    """L-PCA variance estimate ``diag(B U_L Lambda_L^{-1} U_L^T B^T)`` (Seeger 2010 §3, ``rho^(L)``).

    ``(Lambda_L, U_L)`` are the ``L`` smallest eigenpairs of ``A``, computed as Ritz pairs of a
    Lanczos run with full reorthogonalisation that starts with ``num_steps`` steps and is extended
    (by ``max(L, K/2)`` steps at a time) until the ``L`` smallest Ritz values satisfy
    ``ritz_residual <= tol * theta`` or ``max_steps`` is reached (then a ConvergenceWarning).
    Because ``U^T A U = Lambda`` holds for Ritz pairs, the estimate is ``<=`` the exact variances
    in every component even before convergence, nondecreasing in ``L``, and exact at ``L = n``.

    Cost: ``K`` products with ``A`` (``K`` the final number of steps), ``O(n K^2)``
    reorthogonalisation, one ``K x K`` eigendecomposition per convergence check, ``O(n K L)`` to
    form ``U_L`` and ``L`` columns of products with ``B`` (``chunk_size`` at a time).  Memory
    ``n K`` for ``Q``.  Lanczos finds the smallest eigenvalues only as fast as the spectrum allows
    (gaps at the low end); ``K`` several times ``L`` is typical.

    :param matmul: the SPD precision ``A``.
    :param B: ``(q, n)`` operator or tensor, ``None`` for the identity.
    :param L: number of eigenpairs (``1 <= L <= n``).
    :param num_steps: initial number of Lanczos steps; default ``min(n, max(2 L, L + 20))``.
    :param max_steps: cap on Lanczos steps; default ``min(n, max(4 L, L + 100))``.
    :param tol: relative Ritz residual tolerance of the ``L`` smallest pairs.
    :param v0: starting vector; default standard normal from ``generator``.
    :param return_result: also return the :class:`LanczosResult`.
    :param on_fail: ``"warn"`` or ``"ignore"`` if the ``L`` pairs did not converge.
    :param chunk_size: eigenvectors per product with ``B``.
    :returns: ``z`` of shape ``(q,)``, or ``(z, result)``.
    """
    apply_a, n_op, op_dtype, op_device = _resolve_matmul(matmul)
    if v0 is None:
        n = n_op if n_op is not None else (as_operator(B).shape[1] if B is not None else None)
        if n is None:
            raise ValueError("pca_variances: pass v0 (or an operator with a known size) to fix n")
        dt = op_dtype or (as_operator(B).dtype if B is not None else None)
        dev = op_device or (as_operator(B).device if B is not None else None)
        v0 = _start_vector(n, n_op, dt, dev, None, None, generator)
    else:
        v0 = _start_vector(v0, n_op, None, None, None, None, None)
    n = v0.shape[0]
    op = _as_design(B, n)
    L = int(L)
    if not 1 <= L <= n:
        raise ValueError(f"L: must be in [1, {n}], got {L}")
    if on_fail not in ("warn", "ignore"):
        raise ValueError(f"on_fail: expected 'warn' or 'ignore', got {on_fail!r}")
    K = min(n, max(2 * L, L + 20)) if num_steps is None else min(n, int(num_steps))
    max_steps = min(n, max(4 * L, L + 100)) if max_steps is None else min(n, int(max_steps))
    K = max(L, min(K, max_steps))
    proc = _LanczosProcess(apply_a, v0, K, True, None)
    while True:
        proc.run(K)
        res = proc.result()
        if res.k < L:
            raise ValueError(
                f"pca_variances: Lanczos broke down after {res.k} < L={L} steps (the Krylov space of v0 is "
                "invariant); use another v0 or a smaller L"
            )
        theta, rr = res.ritz_values[:L], res.ritz_residuals[:L]
        if not bool((theta > 0).all()):
            raise NotPositiveDefiniteError("pca_variances: A has a nonpositive Ritz value; A is not SPD")
        ok = bool((rr <= tol * theta).all())
        if ok or res.breakdown or K >= max_steps:
            break
        K = min(max_steps, K + max(L, K // 2))
    if not ok and on_fail == "warn":
        worst = float((rr / theta).max())
        warnings.warn(
            f"pca_variances: the {L} smallest Ritz pairs did not converge in {res.k} Lanczos steps "
            f"(largest relative Ritz residual {worst:.2e} > tol={tol:g}); the estimate is still a lower bound",
            ConvergenceWarning,
            stacklevel=2,
        )
    Q = res.Q
    q_rows = n if op is None else op.shape[0]
    z = torch.zeros(q_rows, dtype=Q.dtype, device=Q.device)
    inv_theta = 1.0 / theta
    with torch.no_grad():
        for start in range(0, L, max(1, int(chunk_size))):
            stop = min(L, start + max(1, int(chunk_size)))
            U = Q @ res.ritz_vectors_T[:, start:stop]
            W = U if op is None else op.mv(U)
            z.add_((W * W) @ inv_theta[start:stop])
    return (z, res) if return_result else z


# ---------------------------------------------------------------------------------------------------
# Block Lanczos
# ---------------------------------------------------------------------------------------------------
def banded_lanczos_z(L, band, rows, k, chunk_size=None):
    r"""``z = diag(R^T T^{-1} R)`` for ``T = L L^T`` banded and ``R = (B Q)^T`` given by row blocks.

    With ``V = L^{-1} R`` (``k x q``), ``z = sum_j V_j^2``.  ``L`` (Cholesky of a (block) tridiagonal
    ``T``) has lower bandwidth ``band``, so row block ``[s, e)`` of ``V`` is
    ``L_{ss}^{-1} (R_{[s,e)} - L_{[s,e), [s-band, s)} V_{[s-band, s)})``: forward substitution in
    chunks, ``O(k band q)`` work and ``O(chunk q)`` memory.  For ``band = 1`` this is Nickisch & Seeger 2009 §2.3's
    recursion ``v_k = (B q_k - d_{k-1} v_{k-1}) / e_k``.

    :param L: ``(k, k)`` lower-triangular Cholesky factor of ``T``.
    :param int band: lower bandwidth of ``L`` (the block size of the Lanczos run).
    :param rows: callable ``(s, e) -> (e - s, q)`` tensor, the rows ``s..e-1`` of ``(B Q)^T``.
    :param int k: number of rows of ``R`` (Lanczos vectors).
    :param int chunk_size: rows per substitution block (raised to ``band`` if smaller); default
        ``4 * band``, which balances the ``chunk^2 q`` triangular solves against the per-chunk overhead.
    :returns: ``z`` of shape ``(q,)``.
    """
    chunk = max(int(chunk_size) if chunk_size is not None else 4 * int(band), int(band), 1)
    z, tail, tail_start = None, None, 0
    if band == 1:  # bidiagonal L: the scalar recursion, no triangular solves
        e_diag, d_sub = torch.diagonal(L).tolist(), torch.diagonal(L, -1).tolist()
    with torch.no_grad():
        for s in range(0, k, chunk):
            e = min(k, s + chunk)
            R = rows(s, e)
            if band == 1:
                for j in range(s, e):
                    tail = R[j - s] / e_diag[j] if j == 0 else (R[j - s] - d_sub[j - 1] * tail) / e_diag[j]
                    z = tail * tail if z is None else z.add_(tail * tail)
                continue
            if tail is not None:
                lo = max(0, s - band)
                R = R - L[s:e, lo:s] @ tail[lo - tail_start:]
            V = torch.linalg.solve_triangular(L[s:e, s:e], R, upper=False)
            z = (V * V).sum(0) if z is None else z.add_((V * V).sum(0))
            tail, tail_start = V, s
    return z


@dataclass
class BlockLanczosResult:
    """Outcome of :func:`block_lanczos`; the interface of :class:`LanczosResult` where it applies.

    :ivar Q: orthonormal Lanczos vectors, shape ``(n, k)``.
    :ivar T_matrix: the block-tridiagonal ``T = Q^T A Q``, shape ``(k, k)``.
    :ivar block_size: lower bandwidth of ``T`` (the block size ``b``; larger after a deflated block).
    :ivar num_mvm: columns multiplied by ``A``.
    :ivar breakdown: ``True`` if a new block was (numerically) linearly dependent on the previous
        ones: the run either stopped early (the Krylov space is invariant) or went on with the
        independent directions only (a deflated block).
    :ivar ritz_values: eigenvalues of ``T`` in ascending order, shape ``(k,)`` (computed on first use).
    :ivar ritz_vectors_T: eigenvectors of ``T`` (columns), shape ``(k, k)`` (computed on first use).
    :ivar projected_variances: with :func:`block_lanczos`'s ``project``: the list of
        ``diag(P_i Q T^{-1} Q^T P_i^T)``, one ``(m_i,)`` tensor per projection; else ``None``.
    """

    Q: torch.Tensor
    T_matrix: torch.Tensor
    block_size: int
    num_mvm: int
    breakdown: bool
    projected_variances: list = None
    _eigh: tuple = None
    _L: torch.Tensor = None

    def _ritz(self):
        if self._eigh is None:
            self._eigh = torch.linalg.eigh(self.T_matrix)
        return self._eigh

    @property
    def ritz_values(self):
        """Eigenvalues of ``T`` in ascending order, shape ``(k,)``."""
        return self._ritz()[0]

    @property
    def ritz_vectors_T(self):
        """Eigenvectors of ``T`` (columns), shape ``(k, k)``."""
        return self._ritz()[1]

    @property
    def k(self):
        """Number of Lanczos vectors."""
        return self.T_matrix.shape[0]

    @property
    def alpha(self):
        """Diagonal of ``T`` (so ``alpha.sum() = tr T``)."""
        return torch.diagonal(self.T_matrix)

    def T(self):
        """The dense ``(k, k)`` matrix ``T = Q^T A Q``."""
        return self.T_matrix

    def cholesky_L(self):
        """Lower Cholesky factor of ``T`` (lower bandwidth ``block_size``)."""
        if self._L is None:
            L, info = torch.linalg.cholesky_ex(self.T_matrix)
            if int(info) != 0:
                raise NotPositiveDefiniteError(
                    f"the block Lanczos matrix T is not positive definite (pivot {int(info)}); "
                    "the operator is not SPD or too ill-conditioned for its dtype")
            self._L = L
        return self._L

    def logdet_T(self):
        """``log|T|`` as a 0-d tensor."""
        return 2.0 * torch.log(torch.diagonal(self.cholesky_L())).sum()

    def ritz_vectors(self, index=None):
        """Ritz vectors ``Q S[:, index]``, shape ``(n, len(index))``."""
        S = self.ritz_vectors_T if index is None else self.ritz_vectors_T[:, index]
        return self.Q @ S

    def apply_inverse(self, v):
        """``Q T^{-1} Q^T v`` for ``v`` of shape ``(n,)`` or ``(n, m)``."""
        return self.Q @ torch.cholesky_solve(
            (self.Q.transpose(0, 1) @ v).reshape(self.k, -1), self.cholesky_L()).reshape((self.k,) + v.shape[1:])

    def variances(self, B=None, chunk_size=None):
        """``diag(B Q T^{-1} Q^T B^T)`` (``B = None``: the identity), see :func:`banded_lanczos_z`."""
        return banded_lanczos_z(self.cholesky_L(), self.block_size, _design_rows(self.Q, B), self.k, chunk_size)


class _BlockVarianceAccumulator:
    r"""``z = diag(P Q T^{-1} Q^T P^T)`` accumulated one Lanczos block at a time (Nickisch & Seeger 2009 §2.3, blocked).

    ``T = Q^T A Q`` is block tridiagonal, so its Cholesky factor ``L`` is block bidiagonal and can be
    extended as the blocks arrive: ``L_{j,j-1} = T_{j,j-1} L_{j-1,j-1}^{-T}`` and
    ``L_{jj} L_{jj}^T = T_{jj} - L_{j,j-1} L_{j,j-1}^T``.  With ``V = L^{-1} (P Q)^T`` and ``z = sum_j V_j^2``,
    block row ``j`` of ``V`` is ``L_{jj}^{-1} ((P Q_j)^T - L_{j,j-1} V_{j-1})``: only the previous block of
    ``V`` is kept, so the memory is ``O(b m)`` per projection instead of the ``O(k m)`` of ``B Q``.  For
    ``b = 1`` this is Nickisch & Seeger 2009 §2.3's recursion ``v_k = (B q_k - d_{k-1} v_{k-1}) / e_k``.
    """

    def __init__(self, k, dtype, device):
        self.L = torch.zeros(k, k, dtype=dtype, device=device)
        self.z, self.prev, self.Ldiag = None, None, None

    def add(self, s, Tjj, Tsub, projections):
        """Block ``[s, s + b_j)``: ``Tjj = T_{jj}``, ``Tsub = T_{j,j-1}`` (``None`` for the first block) and
        the products ``P_i Q_j`` (shape ``(m_i, b_j)``); raises if ``T`` is not positive definite."""
        bj = Tjj.shape[0]
        if Tsub is not None:
            Lsub = torch.linalg.solve_triangular(self.Ldiag.transpose(0, 1), Tsub, upper=True, left=False)
            S = Tjj - Lsub @ Lsub.transpose(0, 1)
            self.L[s:s + bj, s - Tsub.shape[1]:s] = Lsub
        else:
            Lsub, S = None, Tjj
        Ljj, info = torch.linalg.cholesky_ex(S)
        if int(info) != 0:
            raise NotPositiveDefiniteError(
                f"the block Lanczos matrix T is not positive definite (pivot {s + int(info)}); "
                "the operator is not SPD or too ill-conditioned for its dtype")
        self.L[s:s + bj, s:s + bj] = Ljj
        LjjT = Ljj.transpose(0, 1)
        V = []
        for i, P in enumerate(projections):
            if Lsub is not None:
                P = P - self.prev[i] @ Lsub.transpose(0, 1)
            Vi = torch.linalg.solve_triangular(LjjT, P, upper=True, left=False)  # (m_i, b_j): rows of V^T
            V.append(Vi)
        sq = [torch.square(Vi).sum(1) for Vi in V]
        self.z = sq if self.z is None else [zi.add_(si) for zi, si in zip(self.z, sq)]
        self.prev, self.Ldiag = V, Ljj


def block_lanczos(matmul, n_or_V0, k, block_size, *, breakdown_tol=None, generator=None, dtype=None, device=None,
                  project=None):
    r"""Block Lanczos with full reorthogonalisation: ``k`` orthonormal vectors in blocks of ``b``.

    Each block step multiplies ``A`` with ``b`` vectors at once (one sparse-times-dense product
    instead of ``b`` sparse matrix-vector products) and reorthogonalises the new block against all
    previous vectors by classical Gram-Schmidt as matrix-matrix products (a second pass when the
    DGKS criterion asks for it), so ``Q`` is read ``b`` times less often than by :func:`lanczos`.  ``T = Q^T A Q`` is block tridiagonal with
    bandwidth ``b``; the K-Lanczos variance estimate ``diag(B Q T^{-1} Q^T B^T)`` keeps the
    properties of Seeger 2010 §4.1 (a lower bound on the exact variances, nondecreasing in ``k``:
    ``Q T^{-1} Q^T`` is ``A^{-1}`` compressed to ``span Q``).  For the same ``k`` the block Krylov
    space has lower polynomial degree, so the estimate is somewhat less accurate than that of
    :func:`lanczos` (``docs/convex_relaxation.md`` measures it); ``b = 1`` is plain Lanczos.

    The working block is kept as ``b`` contiguous rows of length ``n`` (the layout of the stored ``Q^T``),
    so both Gram-Schmidt products stream ``Q`` in its memory order.

    With ``project``, K-Lanczos variances are accumulated while the run goes (Nickisch & Seeger 2009 §2.3): after the
    product with block ``Q_j``, ``project(Q_j)`` returns products ``P_i Q_j`` (shapes ``(m_i, b_j)``) and
    ``diag(P_i Q T^{-1} Q^T P_i^T)`` is updated through the block-bidiagonal Cholesky factor of ``T``, which
    is extended block by block (:class:`_BlockVarianceAccumulator`).  ``P_i Q`` is never stored
    (``O(b m_i)`` memory); ``project`` may return a product its ``matmul`` already computed (e.g.
    ``B Q_j`` inside ``A Q_j = X^T X Q_j + B^T W B Q_j``), so the variances cost no extra product.

    :param matmul: SPD operator; a callable must accept ``(n, b)`` inputs.
    :param n_or_V0: starting block ``(n, b)``, or ``n`` for a Gaussian random start.
    :param int k: number of Lanczos vectors (at most ``n``); the last block is truncated to reach ``k``.
    :param int block_size: ``b >= 1``.
    :param breakdown_tol: relative threshold on the diagonal of the block QR factor, default ``eps**(2/3)``.
    :param project: optional callable ``(n, b_j) block -> sequence of (m_i, b_j) tensors``; its variances
        are returned in ``projected_variances`` (then ``T`` must be positive definite:
        :class:`~pyro_convexvb.errors.NotPositiveDefiniteError` otherwise).
    :returns: :class:`BlockLanczosResult`.

    Example::

        >>> import torch
        >>> A = torch.diag(torch.arange(1.0, 13.0, dtype=torch.float64))
        >>> res = block_lanczos(A, 12, 12, 3, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(res.ritz_values, torch.arange(1.0, 13.0, dtype=torch.float64))
        True
        >>> B = torch.ones(1, 12, dtype=torch.float64)
        >>> res = block_lanczos(A, 12, 12, 3, generator=torch.Generator().manual_seed(0), project=lambda V: [B @ V])
        >>> z = res.projected_variances[0]  # 1^T A^{-1} 1, exact at k = n
        >>> abs(float(z) - float((1.0 / torch.arange(1.0, 13.0, dtype=torch.float64)).sum())) < 1e-12
        True
    """
    apply_a, n_op, op_dtype, op_device = _resolve_matmul(matmul)
    b = int(block_size)
    if b < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    if isinstance(n_or_V0, torch.Tensor):
        V0 = n_or_V0.detach()
        if V0.dim() != 2 or V0.shape[1] != b:
            raise ValueError(f"n_or_V0: expected a starting block of shape (n, {b}), got {tuple(V0.shape)}")
        if n_op is not None and V0.shape[0] != n_op:
            raise ValueError(f"n_or_V0: operator has size {n_op} but the block has {V0.shape[0]} rows")
        _check_finite(V0, "n_or_V0")
    else:
        n = int(n_or_V0)
        if n_op is not None and n != n_op:
            raise ValueError(f"n_or_V0: operator has size {n_op}, got n={n}")
        dt = dtype or op_dtype or torch.get_default_dtype()
        dev = device or op_device or (generator.device if generator is not None else None)
        V0 = torch.randn(n, b, dtype=dt, device=dev, generator=generator)
    n = V0.shape[0]
    k = min(int(k), n)
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    b = min(b, k)
    V0 = V0[:, :b]
    tol = float(breakdown_tol) if breakdown_tol is not None else torch.finfo(V0.dtype).eps ** (2.0 / 3.0)
    Qr = V0.new_empty((k, n))
    T = V0.new_zeros((k + b, k + b))
    Qj, R0 = torch.linalg.qr(V0)
    if not bool((torch.diagonal(R0).abs() > 0).all()):
        raise ValueError("n_or_V0: the starting block must have full column rank")
    Qt = Qj.transpose(0, 1).contiguous()  # the current block as rows, (b_j, n)
    acc = _BlockVarianceAccumulator(k, V0.dtype, V0.device) if project is not None else None
    num_mvm, breakdown, anorm, filled, band = 0, False, 0.0, 0, 1
    s, prev = 0, None  # start of the current block, (start, size) of the previous one
    with torch.no_grad():
        while True:
            if s + Qt.shape[0] > k:  # truncate the last block to reach exactly k vectors
                Qt = Qt[:k - s]
            bj = Qt.shape[0]
            Qr[s:s + bj] = Qt
            filled = s + bj
            V = Qt.transpose(0, 1).contiguous()
            W = apply_a(V)
            if not isinstance(W, torch.Tensor) or W.shape != V.shape:
                got = tuple(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
                raise ValueError(f"matmul: expected an output of shape {tuple(V.shape)}, got {got}")
            num_mvm += bj
            Wt = W.detach().transpose(0, 1).contiguous()  # (b_j, n)
            Aj = Wt @ V
            if not bool(torch.isfinite(Aj).all()):
                raise ValueError("matmul returned NaN or inf during block Lanczos")
            Aj = 0.5 * (Aj + Aj.transpose(0, 1))
            T[s:filled, s:filled] = Aj
            anorm = max(anorm, float(torch.linalg.matrix_norm(T[s:filled, :filled], 1)))
            band = max(band, bj - 1)
            if acc is not None:
                acc.add(s, Aj, T[s:filled, prev[0]:s] if prev is not None else None, _projections(project, V, acc))
            if filled >= k:
                break
            Wt.sub_(Aj @ Qt)
            if prev is not None:
                ps, pb = prev
                Wt.sub_(T[s:filled, ps:ps + pb] @ Qr[ps:ps + pb])
            Qall = Qr[:filled]
            # classical Gram-Schmidt as matrix products; a second pass only if a vector lost more than
            # 30% of its norm (DGKS criterion, as in :func:`lanczos`)
            before = torch.linalg.vector_norm(Wt, dim=1)
            for _ in range(2):
                Wt.sub_((Wt @ Qall.transpose(0, 1)) @ Qall)
                after = torch.linalg.vector_norm(Wt, dim=1)
                if bool((after > 0.7071 * before).all()):
                    break
                before = after
            thresh = tol * max(anorm, 1e-300)
            Qn, Rj = torch.linalg.qr(Wt.transpose(0, 1))
            if float(torch.diagonal(Rj).abs().min()) <= thresh:
                # (numerically) rank-deficient block: deflate to the directions that are really new
                U, S, Vh = torch.linalg.svd(Wt.transpose(0, 1), full_matrices=False)
                r = int((S > thresh).sum())
                if r == 0:
                    breakdown = True
                    break
                Qn, Rj = U[:, :r], S[:r, None] * Vh[:r]
                if r < bj:
                    breakdown = True  # the Krylov space lost dimensions: report it
                band = max(band, bj + r - 1)
            else:
                band = max(band, bj)
            r = Qn.shape[1]
            T[filled:filled + r, s:filled] = Rj
            T[s:filled, filled:filled + r] = Rj.transpose(0, 1)
            prev, s, Qt = (s, bj), filled, Qn.transpose(0, 1).contiguous()
    Tk = T[:filled, :filled].clone()
    res = BlockLanczosResult(Q=Qr[:filled].transpose(0, 1), T_matrix=Tk, block_size=band, num_mvm=num_mvm,
                             breakdown=breakdown)
    if acc is not None:
        for i, zi in enumerate(acc.z):
            if not bool(torch.isfinite(zi).all()):
                raise ValueError(f"project: output {i} contains NaN or inf")
        res._L = acc.L[:filled, :filled]
        res.projected_variances = acc.z
    return res


def _projections(project, V, acc):
    """``project(V)`` checked: a non-empty sequence of ``(m_i, b_j)`` tensors, as many as for earlier blocks."""
    P = project(V)
    if isinstance(P, torch.Tensor) or not isinstance(P, (list, tuple)) or not P:
        raise ValueError(f"project: expected a non-empty list of tensors, got {type(P).__name__}")
    for i, Pi in enumerate(P):
        if not isinstance(Pi, torch.Tensor) or Pi.dim() != 2 or Pi.shape[1] != V.shape[1]:
            got = tuple(Pi.shape) if isinstance(Pi, torch.Tensor) else type(Pi).__name__
            raise ValueError(f"project: output {i} must have shape (m, {V.shape[1]}) for a block of "
                             f"{V.shape[1]} vectors, got {got}")
    if acc.z is not None and [len(z) for z in acc.z] != [Pi.shape[0] for Pi in P]:
        raise ValueError(f"project: output sizes changed between blocks: {[len(z) for z in acc.z]} -> "
                         f"{[Pi.shape[0] for Pi in P]}")
    return P
