r"""Outer loop: variance updates ``z <- diag(B A^{-1} B^T)`` and the double loop (Nickisch & Seeger 2009, §2.2-2.3).

``log|A|`` is concave in ``gamma^{-1}``, so ``log|A| <= z^T gamma^{-1} - g^*(z)`` with equality at
``z = diag(B A^{-1} B^T)``; the double loop alternates this tangent (outer) update with the inner
loop minimisation of the upper bound ``phi_z`` (Nickisch & Seeger 2009, §2.2).  With exact ``z`` every outer
iteration decreases ``phi`` (a CCCP/majorisation argument; Nickisch & Seeger 2009 §2.2, Seeger 2010 §4.2).

Variance methods (``variance=``):

* ``"lanczos"`` -- ``k`` (block) Lanczos steps with full reorthogonalisation, with one of two estimators
  (``lanczos_estimator=``, chosen by :func:`choose_lanczos_estimator` unless given):

  * ``"k-lanczos"`` -- Nickisch & Seeger 2009 §2.3 (Seeger 2010 §3), Lanczos on the precision ``A``:
    ``z_k = diag(B Q T^{-1} Q^T B^T)``; every component ``<=`` the exact variance and nondecreasing in
    ``k`` (Seeger 2010 §4.1).  The underestimation strengthens the penalty in ``h^*`` (Seeger 2010
    §4.1: "selective shrinkage is strengthened").
  * ``"whitened"`` -- for a prior given by covariances (e.g. a Gaussian process ``u ~ N(mu, Sigma)``):
    with ``u = mu + L v``, ``Sigma = L L^T``, Lanczos runs on ``A_v = L^T A L = I + L^T M_u L`` and
    ``Var[v] ~ I - Q (I - T^{-1}) Q^T`` (the prior minus the data correction the Krylov space has
    captured), so ``z ~ diag(B Sigma B^T) - diag(B L Q Q^T L^T B^T) + diag(B L Q T^{-1} Q^T L^T B^T)``.
    Exact at ``k = n``; not a bound in either direction.  K-Lanczos on ``A = Sigma^{-1} + ...`` instead
    finds the directions of *smallest* variance first and returns variances near zero.

* ``"pca"`` -- *L-PCA* (Seeger 2010 §3-4): the ``L`` smallest eigenpairs of ``A`` (converged Ritz
  pairs); with it the double loop provably converges, but on a modified criterion (Seeger 2010 Thm 1).
* ``"exact"`` -- dense Cholesky of ``A`` (small ``n``): the reference.
* ``"auto"`` -- ``"exact"`` when the cost model of :func:`variance_costs` predicts it to be cheaper than
  ``"lanczos"`` (and ``n <= exact_max``), else ``"lanczos"`` (:func:`choose_variance_method`).

``log|A|`` for ``phi`` and the bound: exact (Cholesky) when ``n <= dense_logdet_max``; otherwise a
rigorous *upper* bound (so the evidence bound stays a lower bound), the smaller of Hadamard's
``sum_j log A_jj`` and, with the Lanczos basis ``Q`` completed to ``[Q, Q_perp]``, Fischer's
inequality plus AM-GM on the complement: ``log|A| <= log|T_k| + (n-k) log((tr A - tr T_k)/(n-k))``
(for the whitened estimator applied to ``A_v``, with ``log|A| = log|A_v| - log|Sigma|``).
"""
from dataclasses import dataclass, replace
import math
import time
from typing import Any, ClassVar, Optional

import torch

from ...errors import NotPositiveDefiniteError
from ...linalg.cg import cg
from ...linalg.lanczos import block_lanczos, pca_variances
from ...linalg.operators import ComposedOperator, as_operator
from .inner import inner_loop
from .problem import RelaxationProblem

__all__ = ["RelaxationState", "VarianceStep", "WhitenedLanczos", "variance_step", "variance_costs", "choose_variance_method",
           "choose_lanczos_estimator", "logdet_upper_bound", "h_value", "phi_value", "double_loop"]

# ---------------------------------------------------------------------------------------------------
# Cost model of variance="auto".  All constants are calibrated by benchmarks/variance_crossover.py, which
# times one exact and one Lanczos variance step over n, design density and k, fits these constants by
# nonnegative least squares on relative errors and prints them; only their ratios affect the choice.
# The values below are the fit of the full run (n = 100 .. 3200, k = 80 and 750, one quiet 2-core machine,
# one torch thread, run of 2026-11-27) recorded in docs/convex_relaxation.md; the fit put no weight on the
# separate reorthogonalisation term (its cost is absorbed by the per-product and per-step terms).
# ---------------------------------------------------------------------------------------------------
#: Seconds per ``n^3`` of the exact route's dense factorisations: the Cholesky factor of ``A``
#: (``n^3/3`` flops) and its triangular inverse (``n^3`` flops).  Calibrated by benchmarks/variance_crossover.py.
EXACT_CUBIC_SECONDS = 1.08e-10
#: Seconds per flop of the batched products that form ``A`` densely (``n`` identity columns) and
#: ``B L^{-T}``.  Calibrated by benchmarks/variance_crossover.py.
FORM_FLOP_SECONDS = 1.31e-11
#: Seconds per flop of the Lanczos products with ``A`` (or ``A_v``), one block per step.
#: Calibrated by benchmarks/variance_crossover.py.
MVM_FLOP_SECONDS = 8.33e-11
#: Seconds per flop of the Gram-Schmidt reorthogonalisation (``2 n k^2`` flops for ``k`` steps).
#: Calibrated by benchmarks/variance_crossover.py.
ORTH_FLOP_SECONDS = 0.0
#: Fixed seconds per Lanczos block step (Python and small factorisations).
#: Calibrated by benchmarks/variance_crossover.py.
STEP_SECONDS = 5.56e-4
#: Largest per-vector speed-up of block Lanczos (``b`` vectors per product and reorthogonalisation pass)
#: over single vectors, applied as ``min(b, BLOCK_SPEEDUP_MAX)``; 3.6-3.9x was measured on real-sim at
#: ``b = 8, 16`` (docs/convex_relaxation.md).  Calibrated by benchmarks/variance_crossover.py.
BLOCK_SPEEDUP_MAX = 3.0
#: Whitened estimator: smallest fraction of the latent coordinates under dense-covariance prior blocks.
WHITEN_DENSE_FRACTION = 0.5



@dataclass
class VarianceStep:
    """One outer-loop variance computation at fixed ``gamma``.

    :ivar z: ``(q,)`` estimated ``diag(B A^{-1} B^T)`` (= ``Var_Q[s]`` with ``sigma^2 = 1``).
    :ivar var_u: ``(n,)`` estimated ``diag(A^{-1})`` (= ``Var_Q[u]``).
    :ivar logdet: ``log|A|`` (exact) or a rigorous upper bound.
    :ivar logdet_method: ``"cholesky"``, ``"fischer"`` or ``"hadamard"`` (``"unavailable"`` if neither bound applies).
    :ivar num_mvm: products with ``A`` (Lanczos steps, or ``n`` identity probes for the dense route).
    :ivar lanczos: ``None`` for ``"exact"``; the :class:`~pyro_convexvb.linalg.LanczosResult` on ``A`` for
        K-Lanczos and L-PCA; a :class:`WhitenedLanczos` for the whitened estimator.  Each has
        ``variances(D)`` (``diag(D Cov D^T)`` in its own approximation) and ``covariance_factor()``.
    :ivar chol: dense Cholesky factor of ``A`` (exact route or dense log-det), else ``None``.
    :ivar method: ``"exact"``, ``"lanczos"`` or ``"pca"`` (``"given"`` for a warm start).
    :ivar estimator: ``"cholesky"``, ``"k-lanczos"``, ``"whitened"`` or ``"l-pca"`` (``"given"`` for a warm start).
    :ivar lower_bounds: ``True`` when every variance is a lower bound that may be strictly below the exact
        one (K-Lanczos and L-PCA, Seeger 2010 §4.1); ``False`` for exact variances and the whitened estimator.
    :ivar pca_rank: ``L`` of an L-PCA step, else ``None``.
    """

    z: torch.Tensor
    var_u: torch.Tensor
    logdet: float
    logdet_method: str
    num_mvm: int
    lanczos: object = None
    chol: torch.Tensor = None
    method: str = "exact"
    estimator: str = "cholesky"
    lower_bounds: bool = False
    pca_rank: int = None


class WhitenedLanczos:
    r"""Covariance-form (whitened) Lanczos estimate of ``Cov_Q[u] = A^{-1}`` for a prior ``u ~ N(mu, Sigma)``.

    ``u = mu + L v`` with ``Sigma = L L^T`` turns ``A`` into ``A_v = L^T A L = I + L^T M_u L`` (``M_u`` the
    Gaussian observation rows and the sites).  ``k`` Lanczos steps on ``A_v`` give ``Q``, ``T`` and

    .. math:: \widehat{\mathrm{Cov}}[v] = I - Q (I - T^{-1}) Q^T, \qquad
              \widehat{\mathrm{Cov}}[u] = \Sigma - L Q Q^T L^T + L Q T^{-1} Q^T L^T,

    the prior minus the data correction that the Krylov space has captured.  Lanczos finds the large
    eigenvalues of ``A_v`` (the directions the data constrains most) first, and on the rest ``A_v ~ I``,
    so for priors with a fast-decaying spectrum (Gaussian-process kernels) the estimate is accurate at
    ``k << n``; it is exact at ``k = n``.  It is not a bound in either direction: with
    ``A_v = [[T, C], [C^T, D]]`` in the basis ``[Q, Q_perp]`` it replaces ``(A_v^{-1})`` by
    ``blockdiag(T^{-1}, I)``, which differs from it by an indefinite matrix while ``C != 0``.

    :ivar result: the :class:`~pyro_convexvb.linalg.LanczosResult` of the run on ``A_v``.
    :ivar form: the :class:`~.problem.CovarianceForm` (``L``, ``diag(Sigma)``, ...).
    """

    estimator = "whitened"
    lower_bounds = False

    def __init__(self, result, form):
        self.result, self.form = result, form

    @property
    def k(self):
        """Number of Lanczos vectors."""
        return self.result.k

    @property
    def num_mvm(self):
        """Products with ``A_v``."""
        return self.result.num_mvm

    def variances(self, D=None, chunk=256):
        """``diag(D Cov D^T)`` in this approximation, for ``D`` ``(m, n)`` (``None``: the identity, ``Var[u]``).

        ``= diag(G G^T) - sum_j (G q_j)^2 + diag(G Q T^{-1} Q^T G^T)`` with ``G = D L``; ``diag(G G^T)``
        takes ``n`` products of ``D`` (``chunk`` columns of ``L`` at a time).

        :returns: ``(m,)`` tensor.
        """
        L, res = self.form.factor, self.result
        if D is None:
            prior, G = self.form.prior_var, L
        else:
            Dop = as_operator(D)
            if Dop.shape[1] != L.shape[0]:
                raise ValueError(f"D: expected {L.shape[0]} columns, got shape {tuple(Dop.shape)}")
            G = ComposedOperator(Dop, L)
            n = L.shape[0]
            prior = None
            for start in range(0, n, chunk):
                stop = min(n, start + chunk)
                E = torch.zeros(n, stop - start, dtype=res.Q.dtype, device=res.Q.device)
                E[torch.arange(start, stop), torch.arange(stop - start)] = 1
                W = G.mv(E)
                prior = (W * W).sum(1) if prior is None else prior + (W * W).sum(1)
        GQ = G.mv(res.Q)
        return prior - (GQ * GQ).sum(1) + res.variances(G)

    def covariance_factor(self):
        """``F`` with ``F F^T`` the estimated ``Cov[u]``: ``F = L [I - Q Q^T, Q L_T^{-T}]``, shape ``(n, n + k)``."""
        Q = self.result.Q
        n = Q.shape[0]
        P = torch.eye(n, dtype=Q.dtype, device=Q.device) - Q @ Q.transpose(0, 1)
        return self.form.factor.mv(torch.cat([P, self.result.covariance_factor()], 1))

    def logdet_T(self):
        """``log|T_k|`` of the run on ``A_v`` (``log|A| = log|A_v| - log|Sigma|`` at ``k = n``)."""
        return self.result.logdet_T()


def choose_lanczos_estimator(prob):
    """``"whitened"`` when the prior is in covariance form with mostly dense blocks, else ``"k-lanczos"``.

    The whitened estimator needs every latent coordinate under a Gaussian prior given by a covariance
    (:meth:`~.problem.RelaxationProblem.covariance_blocks`: no flat block, e.g. a Laplace prior, and no
    precision-only block) and is chosen when at least ``WHITEN_DENSE_FRACTION`` of the coordinates lie in
    dense (non-diagonal) covariance blocks, e.g. a Gaussian-process prior, possibly with a few diagonal
    coefficients beside it.  Diagonal priors under many sites (sparse logistic regression) keep Nickisch &
    Seeger's (2009) K-Lanczos: there the data correction has high rank and ``k << n`` steps cannot capture it.

    :param prob: :class:`~.problem.RelaxationProblem`.
    :returns: ``"whitened"`` or ``"k-lanczos"``.
    """
    blocks = prob.covariance_blocks()
    if blocks is None:
        return "k-lanczos"
    dense = sum(sl.stop - sl.start for sl, _, d in blocks if d)
    return "whitened" if dense >= WHITEN_DENSE_FRACTION * prob.n else "k-lanczos"


def _resolve_estimator(prob, estimator):
    if estimator == "auto":
        return choose_lanczos_estimator(prob)
    if estimator == "whitened":
        why = prob.covariance_obstacle()
        if why is not None:
            raise ValueError(f"lanczos_estimator='whitened' needs every latent coordinate under a Gaussian prior "
                             f"given by a covariance, but {why}; use lanczos_estimator='k-lanczos' (or 'auto')")
    return estimator


def variance_costs(prob, opts):
    r"""Predicted seconds of one exact and one Lanczos variance step (the cost model of ``variance="auto"``).

    With ``f_A`` the flops of one product with ``A`` (:meth:`~.problem.RelaxationProblem.mvm_flops`),
    ``f_B`` those with ``B`` and ``k = min(lanczos_rank, n)``:

    * exact: ``EXACT_CUBIC_SECONDS n^3`` (Cholesky and triangular inverse) ``+ FORM_FLOP_SECONDS n (f_A + f_B)``
      (``A`` formed from ``n`` products, ``z`` from ``B L^{-T}``);
    * Lanczos: ``STEP_SECONDS ceil(k/b) + (MVM_FLOP_SECONDS k f_A' + ORTH_FLOP_SECONDS 2 n k^2) / min(b,
      BLOCK_SPEEDUP_MAX)``, with ``f_A'`` the flops of a product with ``A_v`` for the whitened estimator;
      plus, when ``n <= dense_logdet_max``, the dense ``log|A|`` the Lanczos route then also computes
      (``FORM_FLOP_SECONDS n f_A + EXACT_CUBIC_SECONDS n^3 / 4``, the Cholesky share of the cubic term).

    :param prob: :class:`~.problem.RelaxationProblem`.
    :param opts: :class:`~.engine.ConvexRelaxationOptions` (``lanczos_rank`` ``k``, ``lanczos_block_size`` ``b``,
        ``dense_logdet_max``, ``lanczos_estimator``).
    :returns: ``dict(exact=seconds, lanczos=seconds, estimator=..., k=k)``.
    """
    n, dense_logdet_max = prob.n, opts.dense_logdet_max
    est = _resolve_estimator(prob, opts.lanczos_estimator)
    k = min(opts.lanczos_rank, n)
    b = max(1, min(opts.lanczos_block_size, k)) if k < n else 1
    f_a = prob.mvm_flops()
    f_b = prob.B.flops() if prob.B is not None else 0.0
    exact = EXACT_CUBIC_SECONDS * n**3 + FORM_FLOP_SECONDS * n * (f_a + f_b)
    f_lz = prob.mvm_flops(whitened=True) if est == "whitened" else f_a
    lz = STEP_SECONDS * math.ceil(k / b) + (MVM_FLOP_SECONDS * k * f_lz + ORTH_FLOP_SECONDS * 2.0 * n * k * k) / min(
        b, BLOCK_SPEEDUP_MAX)
    if n <= dense_logdet_max:
        lz += FORM_FLOP_SECONDS * n * f_a + 0.25 * EXACT_CUBIC_SECONDS * n**3
    return dict(exact=exact, lanczos=lz, estimator=est, k=k)


def choose_variance_method(prob, opts):
    """``"exact"`` if ``n <= opts.exact_max`` and the cost model predicts a dense Cholesky variance step to be
    cheaper than a ``opts.lanczos_rank``-step Lanczos one (:func:`variance_costs`), else ``"lanczos"``.

    :param opts: :class:`~.engine.ConvexRelaxationOptions`.
    :returns: ``"exact"`` or ``"lanczos"``.
    """
    if prob.n > opts.exact_max:
        return "lanczos"
    c = variance_costs(prob, opts)
    return "exact" if c["exact"] <= c["lanczos"] else "lanczos"


def _exact_z(prob, L, chunk=256):
    """``diag(B A^{-1} B^T)`` and ``diag(A^{-1})`` from ``A = L L^T`` (``z_i = ||L^{-1} b_i||^2``)."""
    n = prob.n
    Linv = torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device), upper=False)
    var_u = (Linv * Linv).sum(0)
    z = torch.zeros(prob.q, dtype=L.dtype, device=L.device)
    if prob.q:
        LinvT = Linv.transpose(0, 1)
        for start in range(0, n, chunk):
            W = prob.B.mv(LinvT[:, start:start + chunk].contiguous())
            z += (W * W).sum(1)
    return z, var_u


def logdet_upper_bound(prob, w, lanczos_result=None):
    """Rigorous upper bound on ``log|A|``, ``A = X^T X + B^T diag(w) B`` (module docstring).

    :param lanczos_result: a :class:`~pyro_convexvb.linalg.LanczosResult` on ``A`` or a :class:`WhitenedLanczos`
        (then Fischer's bound is applied to ``A_v`` with ``tr A_v = n + gauss_trace + sum_i w_i (B Sigma B^T)_ii``).
    :returns: ``(value, method)``; ``(inf, "unavailable")`` if neither bound is available.
    """
    n = prob.n
    d = prob.diag_a(w)
    best, method = math.inf, "unavailable"
    if d is not None and bool((d > 0).all()):
        best, method = float(torch.log(d).sum()), "hadamard"
    if lanczos_result is not None:
        if isinstance(lanczos_result, WhitenedLanczos):
            form, res = lanczos_result.form, lanczos_result.result
            trace = n + form.gauss_trace + (prob.site_dot(w, form.site_prior_var) if prob.q else 0.0)
            shift = -form.logdet
        elif d is not None:
            res, trace, shift = lanczos_result, float(d.sum()), 0.0
        else:
            res = None
        if res is not None:
            k = res.k
            logdet_t = float(res.logdet_T())
            rest = trace - float(res.alpha.sum())
            if k >= n:
                val = logdet_t
            elif rest > 0:
                val = logdet_t + (n - k) * math.log(rest / (n - k))
            else:
                val = math.inf
            val += shift
            if val < best:
                best, method = val, "fischer"
    return best, method


def _k_lanczos(prob, w, k, generator, block_size=1):
    """K-Lanczos run on ``A`` with ``z`` and ``diag(A^{-1})`` accumulated block by block (Nickisch & Seeger 2009 §2.3).

    ``A Q_j = X^T X Q_j + B^T (w * (B Q_j))`` computes ``B Q_j`` anyway; the run's ``project`` hook hands
    that product (and ``Q_j`` itself, for ``Var_Q[u]``) to the recursion of
    :func:`~pyro_convexvb.linalg.block_lanczos`, so the variances cost no extra product with ``B`` and no
    ``k x q`` buffer.  ``block_size = 1`` is Nickisch & Seeger's (2009) single-vector Lanczos.

    :returns: ``(result, z, var_u)``.
    """
    B, stash = prob.B, {}
    wcol = w.unsqueeze(-1)

    def matmul(V):  # (n, b_j): keeps B V for the projection of the same block
        if B is None:
            return prob.xtx_mv(V)
        BV = B.mv(V)
        stash["BV"] = BV
        return prob.xtx_mv(V) + B.rmv(BV * wcol)

    def project(V):
        return [V] if B is None else [stash.pop("BV"), V]

    res = block_lanczos(matmul, prob.n, k, block_size, generator=generator, dtype=prob.dtype, device=prob.device,
                        project=project)
    if B is None:
        return res, torch.zeros(0, dtype=prob.dtype, device=prob.device), res.projected_variances[0]
    z, var_u = res.projected_variances
    return res, z, var_u


def _whitened_lanczos(prob, w, k, generator, block_size=1):
    r"""Whitened Lanczos run on ``A_v = I + L^T M_u L`` with ``z`` and ``Var[u]`` accumulated during the run.

    ``A_v V = V + L^T (obs(L V) + B^T (w * (B L V)))`` computes ``L V`` and ``B L V``; the ``project`` hook
    hands them to :func:`~pyro_convexvb.linalg.block_lanczos`'s recursion for ``diag(P Q T^{-1} Q^T P^T)``
    (``P = B L`` and ``L``) and adds up ``sum_j (P q_j)^2`` alongside, so
    ``z = diag(B Sigma B^T) - sum_j (B L q_j)^2 + diag(B L Q T^{-1} Q^T L^T B^T)`` costs no extra product.

    :returns: ``(WhitenedLanczos, z, var_u)``.
    """
    form = prob.covariance_form()
    L, B, stash = form.factor, prob.B, {}
    wcol = w.unsqueeze(-1)
    sq = {}

    def matmul(V):
        LV = L.mv(V)
        M = prob.obs_mv(LV)
        stash["LV"] = LV
        if B is not None:
            BLV = B.mv(LV)
            stash["BLV"] = BLV
            M = M + B.rmv(BLV * wcol)
        return V + L.rmv(M)

    def project(V):
        P = [stash.pop("LV")] if B is None else [stash.pop("BLV"), stash.pop("LV")]
        for i, Pi in enumerate(P):
            s = (Pi * Pi).sum(1)
            sq[i] = s if i not in sq else sq[i] + s
        return P

    res = block_lanczos(matmul, prob.n, k, block_size, generator=generator, dtype=prob.dtype, device=prob.device,
                        project=project)
    pv = res.projected_variances
    if B is None:
        z = torch.zeros(0, dtype=prob.dtype, device=prob.device)
        var_u = form.prior_var - sq[0] + pv[0]
    else:
        z = form.site_prior_var - sq[0] + pv[0]
        var_u = form.prior_var - sq[1] + pv[1]
    return WhitenedLanczos(res, form), z, var_u


def variance_step(prob, gamma, opts, generator=None, *, method=None):
    """Estimate ``z = diag(B A^{-1} B^T)``, ``diag(A^{-1})`` and ``log|A|`` at ``gamma`` (Nickisch & Seeger 2009, §2.3).

    :param prob: :class:`~.problem.RelaxationProblem`.
    :param gamma: ``(q,)`` site widths.
    :param opts: :class:`~.engine.ConvexRelaxationOptions` (``variance``, ``lanczos_rank`` ``k``, ``pca_rank``,
        ``dense_logdet_max``, ``lanczos_block_size`` ``b``, used only while ``k < n``, ``lanczos_estimator``).
    :param generator: torch generator for the Lanczos start vector.
    :param method: the variance method to run (``"exact"``, ``"lanczos"`` or ``"pca"``), e.g. what ``"auto"``
        resolved to; default ``opts.variance``.
    :returns: :class:`VarianceStep` (``method``, ``estimator`` and ``lower_bounds`` say what was used).
    """
    method = opts.variance if method is None else method
    if method == "auto":
        method = choose_variance_method(prob, opts)
    w = 1.0 / gamma if prob.q else torch.zeros(0, dtype=prob.dtype, device=prob.device)
    n = prob.n
    if method == "exact":
        A = prob.dense_a(w)
        L, info = torch.linalg.cholesky_ex(A)
        if int(info) != 0:  # positive definite in exact arithmetic: the prior's precision is numerically singular
            raise NotPositiveDefiniteError(
                f"convex_relaxation: the posterior precision A = prior precision + B^T Gamma^-1 B is not numerically "
                f"positive definite (Cholesky failed at column {int(info)}): the model's prior covariance is "
                "numerically singular (e.g. a MultivariateNormal scale_tril with a diagonal entry near 0); give a "
                "positive definite prior")
        z, var_u = _exact_z(prob, L)
        logdet = float(2 * torch.log(torch.diagonal(L)).sum())
        return VarianceStep(z, var_u, logdet, "cholesky", n, None, L, "exact", "cholesky", False)
    A_op = prob.precision_operator(w)
    B = prob.B
    k = min(opts.lanczos_rank, n)
    b = opts.lanczos_block_size if k < n else 1
    L_rank = None
    if method == "lanczos":
        est = _resolve_estimator(prob, opts.lanczos_estimator)
        if est == "whitened":
            res, z, var_u = _whitened_lanczos(prob, w, k, generator, b)
        else:
            res, z, var_u = _k_lanczos(prob, w, k, generator, b)
        lower = est == "k-lanczos"
    else:
        L_rank = max(1, min(n, opts.pca_rank if opts.pca_rank is not None else max(1, k // 6)))
        zq, res = pca_variances(A_op, B, L_rank, num_steps=max(k, L_rank), max_steps=max(k, L_rank),
                                return_result=True, generator=generator, on_fail="ignore")
        U = res.ritz_vectors(torch.arange(L_rank))
        theta = res.ritz_values[:L_rank]
        var_u = (U * U) @ (1.0 / theta)
        z = zq if B is not None else torch.zeros(0, dtype=prob.dtype, device=prob.device)
        est, lower = "l-pca", True
    num = res.num_mvm
    chol = None
    if n <= opts.dense_logdet_max:
        chol = torch.linalg.cholesky(prob.dense_a(w))
        logdet, how = float(2 * torch.log(torch.diagonal(chol)).sum()), "cholesky"
        num += n
    else:
        logdet, how = logdet_upper_bound(prob, w, res)
    return VarianceStep(z, var_u, logdet, how, num, res, chol, method, est, lower, L_rank)


def h_value(prob, gamma, x_star=None):
    """``h(gamma) = sum_i h_i(gamma_i)``; closed form ``-(x_*/gamma + 2 g(x_*))`` when ``x_*(gamma)`` is known."""
    if not prob.q:
        return 0.0
    if x_star is None:
        return float(prob.site_sum(prob.pot.h(gamma).sum()))
    return float(prob.site_sum((-(x_star / gamma + 2 * prob.pot.g(x_star))).sum()))


def phi_value(prob, gamma, u, logdet, x_star=None):
    """``phi(gamma) = log|A| + h(gamma) + R(u, gamma)`` (Nickisch & Seeger 2009, §2.1), ``u`` a (near-)minimiser of ``R``."""
    return float(logdet) + h_value(prob, gamma, x_star) + float(prob.R(u, gamma))


@dataclass(frozen=True)
class RelaxationState:
    r"""One outer iteration of the double loop: ``pcv.fit(..., init=state)`` resumes from it.

    :ivar gamma: ``(q,)`` site widths (sites ordered as :func:`~.api.site_designs`); :ivar u: ``(n,)`` mean
        ``argmin_u R(u, gamma)`` or ``None``; :ivar z: ``(q,)`` ``diag(B A^{-1} B^T)`` at ``gamma`` or ``None``
        (given, a fit skips its first variance step: Nickisch & Seeger 2009, §3); :ivar logdet: ``log|A|`` (or
        a rigorous upper bound) or ``None``.
    :ivar cholesky: ``(n, n)`` Cholesky factor of ``A``, else ``None``; :ivar lanczos: else the variance step's
        Lanczos result (``LanczosResult`` or :class:`~.outer.WhitenedLanczos`).
    :ivar variance_method: ``"exact"``, ``"lanczos"``, ``"pca"`` (``pca_rank`` ``L``) or ``"given"`` (by hand).

    Example::

        >>> import torch, pyro_convexvb as pcv
        >>> from pyro_convexvb.lgm.sites import BernoulliLogit
        >>> X = torch.randn(40, 3, dtype=torch.float64); y = (X[:, 0] > 0).double()
        >>> lgm = pcv.LatentGaussianModel.from_design(X, BernoulliLogit(y), prior_scale=1.0)
        >>> res = pcv.fit(lgm, engine="convex_relaxation", options={"variance": "exact", "max_outer": 30},
        ...               progress=False)
        >>> abs(float(res.state.bound_at(lgm)) - res.log_evidence_bound) < 1e-8
        True
        >>> again = pcv.fit(lgm, engine="convex_relaxation", options={"variance": "exact"}, init=res.state,
        ...                 progress=False)
        >>> again.converged, len(again.history["objective"])
        (True, 2)
    """

    engine: ClassVar[str] = "convex_relaxation"
    #: the options a state replaces (an inner fit warm-started from a state resets them)
    options: ClassVar[tuple] = ("gamma_init", "z_init", "u_init", "logdet_init")

    gamma: torch.Tensor
    u: Optional[torch.Tensor] = None
    z: Optional[torch.Tensor] = None
    logdet: Optional[float] = None
    cholesky: Optional[torch.Tensor] = None
    lanczos: Any = None
    variance_method: str = "given"
    pca_rank: Optional[int] = None

    def warm_start(self):
        """The widths only (``z``, ``u``, ``log|A|`` belong to this model), for a fit of a nearby model."""
        g = self.gamma
        return RelaxationState(g) if g.numel() and bool((g > 0).all()) else None

    def checked(self, prob, names=None):
        """This state in ``prob``'s dtype and device; :raises ValueError: naming the field (``names``, default
        ``init.gamma``, ...) for a wrong shape or non-finite (or nonpositive ``gamma``) entries."""
        names = names or {f: f"init.{f}" for f in ("gamma", "z", "u")}
        dt, dev, q, n = prob.dtype, prob.device, prob.q, prob.n
        gamma = torch.as_tensor(self.gamma, dtype=dt, device=dev)
        if gamma.numel() == 1:  # one width for every site
            gamma = gamma.reshape(()).expand(q)
        if gamma.shape != (q,):
            raise ValueError(f"{names['gamma']}: expected a single number or one width per site, shape ({q},); got "
                             f"shape {tuple(gamma.shape)}")
        bad = ~(torch.isfinite(gamma) & (gamma > 0))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"{names['gamma']}: the site widths must be positive and finite; {int(bad.sum())} of "
                             f"{q} are not (entry {i} is {float(gamma[i])!r})")
        out = {"gamma": gamma.clone()}
        for f, size, what in (("z", q, "site variances"), ("u", n, "mean")):
            v = getattr(self, f)
            if v is not None:
                v = torch.as_tensor(v, dtype=dt, device=dev)
                if v.shape != (size,):
                    raise ValueError(f"{names[f]}: expected a finite ({size},) {what}, got shape {tuple(v.shape)}")
                if not bool(torch.isfinite(v).all()):
                    raise ValueError(f"{names[f]}: the {what} must be finite; {int((~torch.isfinite(v)).sum())} of "
                                     f"{size} entries are not")
                out[f] = v
        if self.u is not None and self.z is None:
            raise ValueError(f"{names['u']}: a mean needs the site variances {names['z']} valid at {names['gamma']}")
        return replace(self, **out)

    def bound_at(self, lgm):
        r"""``C(theta) - phi(gamma, u; theta)/2`` at this ``(gamma, u)`` on ``lgm`` (the model at other
        hyperparameters ``theta``; Nickisch & Seeger 2009, §2.1) with the exact ``log|A|``: the type-II envelope."""
        prob = RelaxationProblem(lgm)
        st = self.checked(prob)
        A = prob.dense_a(1.0 / st.gamma if prob.q else None)
        logdet = 2 * torch.log(torch.diagonal(torch.linalg.cholesky(A))).sum()
        return prob.log_const() - 0.5 * phi_value(prob, st.gamma, st.u, logdet)


def solve_mean(prob, gamma, u0=None, cg_tol=1e-10, cg_max_iter=None, chol=None, preconditioner="jacobi"):
    """``argmin_u R(u, gamma)``: ``A u = X^T y~ + B^T (beta - o/gamma)`` by preconditioned CG
    (:meth:`~.problem.RelaxationProblem.preconditioner` of kind ``preconditioner``), or directly from a dense
    Cholesky factor ``chol`` of ``A``."""
    w = 1.0 / gamma if prob.q else None
    rhs = prob.mean_rhs(gamma) if prob.q else prob.xty().clone()
    if chol is not None:
        return torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1), 0
    d = prob.preconditioner(w, preconditioner)
    res = cg((lambda v: prob.a_mv(v, w)) if prob.q else prob.xtx_mv, rhs, precond=d, x0=u0, rtol=cg_tol,
             max_iter=cg_max_iter, on_fail="warn")
    return res.x, res.num_mvm


#: how a state built from the warm-start options names its fields in errors
_OPTION_NAMES = {"gamma": "gamma_init", "z": "z_init", "u": "u_init"}


def double_loop(prob, opts, state=None, run=None, *, state_names=None):
    r"""The double-loop algorithm of Nickisch & Seeger 2009, §2.2, from ``state`` to a new state.

    ``t = 0, 1, ...``: variance step at ``gamma_t`` (gives ``z_t`` and completes ``phi(gamma_t)``);
    stop if ``t = max_outer`` or (``t > 0``) ``||gamma_t - gamma_{t-1}|| <= gamma_tol ||gamma_{t-1}||`` and
    ``|phi_t - phi_{t-1}| <= phi_tol max(1, |phi_t|)``; otherwise an inner loop with
    ``z = max(z_t, z_min)`` gives ``(u_{t+1}, gamma_{t+1})``.  The last variance step is at the returned
    ``gamma``, so the posterior variances and the bound refer to the returned ``Q``.  With approximate
    variances ``phi`` may rise between updates (Seeger 2010 §4.2 proves descent only for exact variances and
    L-PCA); the iterate with the smallest ``phi`` (largest bound) is returned, ``best_index`` says which.

    A ``state`` with site variances ``z`` valid at its ``gamma`` replaces the first variance step (Nickisch &
    Seeger 2009, §3; with ``max_outer = 0`` only its ``gamma`` is used).  ``variance="auto"`` and
    ``lanczos_estimator="auto"`` are resolved once, before the first step.  Over 80 lines: the per-iteration
    statistics it reports are updated at every phase of the loop.

    :param prob: :class:`~.problem.RelaxationProblem`.
    :param opts: :class:`~.engine.ConvexRelaxationOptions`; ``seed`` seeds the Lanczos start vectors.
    :param state: :class:`~.state.RelaxationState` to start from, or ``None`` (Gaussians touching each site).
    :param run: a :class:`~pyro_convexvb.infer.engine.RunContext` (history and progress bar), or ``None``.
    :param dict state_names: how to name the state's fields in errors (default ``init.gamma``, ...).
    :returns: ``(state, report)``: the new :class:`~.state.RelaxationState` and a dict: ``phi`` (list),
        ``best_phi``, ``best_index``, ``converged``, ``step`` (the returned iterate's :class:`VarianceStep`),
        ``mvm`` (per phase) and per-iteration lists (``newton_steps``, ``cg_iterations``, ``rel_gamma``, ...).
    """
    o, n, q = opts, prob.n, prob.q
    variance = choose_variance_method(prob, o) if o.variance == "auto" else o.variance
    if variance == "lanczos":
        o = o.replace(lanczos_estimator=_resolve_estimator(prob, o.lanczos_estimator))
    generator = torch.Generator(device=prob.device).manual_seed(int(o.seed))
    history = None if run is None else run.history
    progress = None if run is None else run.bar(total=o.max_outer + 1, unit="outer")
    dt, dev = prob.dtype, prob.device
    counts0 = dict(prob.counts)
    st = None if state is None else state.checked(prob, state_names)
    if st is not None and o.max_outer < 1:
        st = RelaxationState(st.gamma)  # no inner loop follows: the variance step at gamma is the answer
    if not q:
        gamma = torch.zeros(0, dtype=dt, device=dev)
    else:
        gamma = st.gamma if st is not None else prob.pot.gamma_init(prob.s(torch.zeros(n, dtype=dt, device=dev)))
    x_star, u, mvm_init = None, None, 0
    stats = dict(phi=[], logdet=[], logdet_method=[], newton_steps=[], cg_iterations=[], inner_converged=[],
                 rel_gamma=[], lanczos_steps=[], inner_mvm=[], outer_mvm=[])
    mvm = {"init": mvm_init, "inner": 0, "outer": 0}
    seconds = {"inner": 0.0, "outer": 0.0}
    b_counts = {"inner": 0, "outer": 0}
    converged = False
    rel_gamma = math.inf
    step = None
    best = None
    for t in range(o.max_outer + 1):
        c_before = prob.counts.get("B", 0)
        t_start = time.perf_counter()
        warm = t == 0 and st is not None and st.z is not None
        if warm:
            ld = float(st.logdet) if st.logdet is not None else math.nan
            step = VarianceStep(st.z, None, ld, "given", 0, method="given", estimator="given")
            u = st.u
        else:
            step = variance_step(prob, gamma, o, generator, method=variance)
        b_counts["outer"] += prob.counts.get("B", 0) - c_before
        seconds["outer"] += time.perf_counter() - t_start
        mvm["outer"] += step.num_mvm
        if u is None:  # u_0 = argmin_u R(u, gamma_0): Cholesky if the step has one, else PCG
            u, mvm["init"] = solve_mean(prob, gamma, cg_tol=min(o.cg_tol, 1e-8), cg_max_iter=o.cg_max_iter,
                                        chol=step.chol, preconditioner=o.preconditioner)
        stats["outer_mvm"].append(step.num_mvm)
        stats["lanczos_steps"].append(step.lanczos.k if step.lanczos is not None else 0)
        phi = phi_value(prob, gamma, u, step.logdet, x_star)
        stats["phi"].append(phi)
        stats["logdet"].append(step.logdet)
        stats["logdet_method"].append(step.logdet_method)
        if not warm and (best is None or phi < best["phi"] or not math.isfinite(best["phi"])):
            best = dict(u=u, gamma=gamma, x_star=x_star, step=step, phi=phi, index=t)
        if history is not None:
            history.record(objective=phi, mvm=mvm["init"] + mvm["inner"] + mvm["outer"],
                           gap=rel_gamma if math.isfinite(rel_gamma) else float("nan"))
        if progress is not None:
            progress.update(1)
            progress.set_postfix(phi=f"{phi:.6g}", dgamma=f"{rel_gamma:.2e}")
        if t > 0 and rel_gamma <= o.gamma_tol and \
                abs(stats["phi"][-1] - stats["phi"][-2]) <= o.phi_tol * max(1.0, abs(phi)):
            converged = True
            break
        if (t == o.max_outer and not warm) or not q:
            converged = converged or not q
            break
        z = step.z.clamp_min(o.z_min)
        c_before = prob.counts.get("B", 0)
        t_start = time.perf_counter()
        inner = inner_loop(prob, z, u, max_newton=o.max_newton, cg_tol=o.cg_tol, newton_tol=o.newton_tol,
                           cg_max_iter=o.cg_max_iter, chol=step.chol, preconditioner=o.preconditioner)
        seconds["inner"] += time.perf_counter() - t_start
        b_counts["inner"] += prob.counts.get("B", 0) - c_before
        mvm["inner"] += inner.num_mvm
        stats["inner_mvm"].append(inner.num_mvm)
        stats["newton_steps"].append(inner.newton_steps)
        stats["cg_iterations"].append(list(inner.cg_iterations))
        stats["inner_converged"].append(inner.converged)
        if prob.comm is None:
            rel_gamma = float(torch.linalg.vector_norm(inner.gamma - gamma) / torch.linalg.vector_norm(gamma))
        else:
            dg = inner.gamma - gamma
            rel_gamma = math.sqrt(prob.site_dot(dg, dg) / prob.site_dot(gamma, gamma))
        stats["rel_gamma"].append(rel_gamma)
        u, gamma = inner.u, inner.gamma
        x_star = z + inner.s * inner.s
    mvm["B_products"] = b_counts
    mvm["seconds"] = seconds
    mvm["total_B_products"] = prob.counts.get("B", 0) - counts0.get("B", 0)
    # with approximate variances phi need not decrease (Seeger 2010 §4.2): return the best iterate seen
    bstep = best["step"]
    out = RelaxationState(best["gamma"], best["u"], bstep.z, bstep.logdet, bstep.chol, bstep.lanczos, bstep.method,
                          bstep.pca_rank)
    return out, dict(step=bstep, best_phi=best["phi"], best_index=best["index"], converged=converged, mvm=mvm, **stats)
