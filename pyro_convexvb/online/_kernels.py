"""Compiled (numba) stream kernels: the fast path of :mod:`pyro_convexvb.online`.

One kernel, :func:`run_diagonal`, streams CSR rows through every diagonal-Gaussian method
(Algorithm 1, ADF, DimGauss, marginalised VB) with per-row predictions, log-losses and the
optional mini-batch accumulation in natural parameters; :func:`run_adagrad` streams SGD with
AdaGrad.  The arithmetic mirrors :mod:`pyro_convexvb.online.equations` and
:mod:`pyro_convexvb.online.baselines` (the reference path) operation by operation; the tests
hold the two paths to 1e-12.  The diagonal-Gaussian kernels divide as NumPy does (``error_model="numpy"``):
a division by zero gives inf or NaN instead of raising, and ``partial_fit``'s check of the state it wrote
names the row and undoes the chunk, as on the reference path.

Importing this module requires numba (``pip install 'pyro_convexvb[fast]'``).
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

LOGIT = 0
PROBIT = 1
M_ALG1 = 0
M_ADF = 1
M_DIMGAUSS = 2
M_VB = 3

_SQRT2 = math.sqrt(2.0)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TAIL = -35.0
#: the smallest normal float64: a variance below it is refused (``_base._FLOORS["positive"]``)
TINY = float(np.finfo(np.float64).tiny)


@intrinsic
def _prefetch(typingctx, arr, offset):
    """Ask the CPU to load element ``offset`` of the C-contiguous array ``arr``'s data into its caches (LLVM's
    ``llvm.prefetch``: a hint, no value and no fault): the learner's next row is fetched while this one is computed.
    On a 2^22-feature hashed state (64 MiB, beyond the caches) the rows' scattered reads otherwise wait for memory."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32,
                                                                                                      i32]))
        # write access (the row updates what it reads), high locality, data cache
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), i8p), ir.Constant(i32, 1), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, offset), codegen


@njit(cache=True, inline="always")
def _sigmoid(z):
    e = math.exp(-abs(z))
    if z >= 0:
        return 1.0 / (1.0 + e)
    return e / (1.0 + e)


@njit(cache=True)
def _inv_mills(z):
    if z < _TAIL:
        x = -z
        u = 1.0 / (x * x)
        return x / (1.0 - u * (1.0 - u * (3.0 - u * (15.0 - 105.0 * u))))
    return math.exp(-0.5 * z * z) * _INV_SQRT_2PI / (0.5 * math.erfc(-z / _SQRT2))


@njit(cache=True)
def _cdf(z, link):
    if link == LOGIT:
        return _sigmoid(z)
    return 0.5 * math.erfc(-z / _SQRT2)


@njit(cache=True)
def _log_cdf(z, link):
    if link == LOGIT:
        return -(max(-z, 0.0) + math.log1p(math.exp(-abs(z))))
    if z < _TAIL:
        return -0.5 * z * z - _LOG_SQRT_2PI - math.log(_inv_mills(z))
    if z > 0:
        return math.log1p(-0.5 * math.erfc(z / _SQRT2))
    return math.log(0.5 * math.erfc(-z / _SQRT2))


@njit(cache=True)
def _psi(z, link):
    """``(psi1(z), psi2(z))``: minus the first and the second derivative of ``-log F``."""
    if link == LOGIT:
        e = math.exp(-abs(z))
        r = 1.0 / (1.0 + e)
        if z >= 0:
            return e * r, r * (e * r)
        return r, (e * r) * r
    r = _inv_mills(z)
    return r, r * (z + r)


@njit(cache=True)
def _solve_zeta(z0, q, link, tol, maxiter, w0, a):
    """Root of ``zeta = z0 + q psi1(zeta)`` by Newton's method, safeguarded by bisection.

    The score after the update solves this scalar equation in both Newton options:
    Algorithm 1, Eq. (15)/(28) with ``zeta = z_{i,t+}``, ``z0 = z_i``,
    ``q = x^2 sigma^2_i / c^2`` (Newton is affine invariant, so the iterates are those of
    Eqs. (32)-(34) in ``w``), and DimGauss, Eq. (37) along ``v_t`` with ``q = x^T Sigma_t x``.
    The root lies in ``[z0, z0 + q psi1(z0)]``; Newton steps that leave the bracket or are
    more than half the previous step are replaced by bisection (as ``rtsafe``). The iteration stops as the
    reference path's does, on the step in its own variable ``w = w0 + a (zeta - z0)`` (the weight for Algorithm 1,
    ``a = c / (y x)``; the score itself for DimGauss, ``a = 1``): ``|a dx| <= tol (1 + |w|)``.
    """
    p1, _ = _psi(z0, link)
    lo = z0
    hi = z0 + q * p1
    zeta = z0
    dx_old = np.inf
    for _ in range(maxiter):
        q1, q2 = _psi(zeta, link)
        g = zeta - z0 - q * q1
        h = 1.0 + q * q2
        if g > 0:
            hi = zeta
        else:
            lo = zeta
        dx = g / h
        z_new = zeta - dx
        if abs(a * dx) <= tol * (1.0 + abs(w0 + a * (zeta - z0))):
            return z_new, True
        if z_new < lo or z_new > hi or abs(dx) > 0.5 * abs(dx_old):
            z_new = 0.5 * (lo + hi)
            dx_old = zeta - z_new
        else:
            dx_old = dx
        zeta = z_new
    return zeta, False


@njit(cache=True, error_model="numpy")
def _row_update(method, link, a, mean_newton, var_value, tol, maxiter, y, start, end,
                indices, data, mu, s2, mu_t, s2_t, log_p_t, samples, t, buf_mu, buf_s2):
    """New (mean, variance) of the row's features into ``buf_*``; returns #unconverged solves.

    Over 80 lines: a numba kernel (no Python objects, no closures), compiled as one unit over the row loop of every
    update method.
    """
    unconverged = 0
    if method == M_ADF:
        # Appendix D.2: moment matching of N(mu_t, s2_t) times the normaliser (8)/(24).
        c = math.sqrt(1.0 + a * s2_t)
        p1, p2 = _psi(y * mu_t / c, link)
        for k in range(start, end):
            i = indices[k]
            x = data[k]
            buf_mu[k - start] = mu[i] + s2[i] * x * y * p1 / c
            buf_s2[k - start] = s2[i] - s2[i] * s2[i] * x * x * p2 / (c * c)
        return 0
    if method == M_DIMGAUSS:
        # Appendix D.1, Eqs. (42)-(46) with Sherman-Morrison; x^T Sigma_t x = s2_t.
        z0 = y * mu_t
        q = s2_t
        if mean_newton:
            zeta, ok = _solve_zeta(z0, q, link, tol, maxiter, z0, 1.0)
            if not ok:
                unconverged += 1
            delta, _ = _psi(zeta, link)
        else:
            p1, p2 = _psi(z0, link)
            delta = p1 / (1.0 + q * p2)
        _, b = _psi(z0 + q * delta, link)
        for k in range(start, end):
            i = indices[k]
            x = data[k]
            v = s2[i] * x
            buf_mu[k - start] = mu[i] + y * v * delta
            buf_s2[k - start] = s2[i] - b * v * v / (1.0 + b * q)
        return unconverged
    for k in range(start, end):
        i = indices[k]
        x = data[k]
        m_i = mu[i]
        v_i = s2[i]
        mum = mu_t - x * m_i
        s2m = max(s2_t - x * x * v_i, 0.0)
        c = math.sqrt(1.0 + a * s2m)
        ic = 1.0 / c
        if method == M_VB:
            # Appendix D.3, Eqs. (50)-(54): joint Newton on (mu', sigma') with N samples.
            n_s = samples.shape[1]
            al = y * x / c
            m_new = m_i
            sd = math.sqrt(v_i)
            ok = False
            for _ in range(maxiter):
                s1 = 0.0
                s1s = 0.0
                s2a = 0.0
                s2s = 0.0
                s2ss = 0.0
                for j in range(n_s):
                    sj = samples[t, j]
                    q1, q2 = _psi(y * (mum + x * (m_new + sj * sd)) / c, link)
                    s1 += q1
                    s1s += sj * q1
                    s2a += q2
                    s2s += sj * q2
                    s2ss += sj * sj * q2
                s1 /= n_s
                s1s /= n_s
                s2a /= n_s
                s2s /= n_s
                s2ss /= n_s
                g1 = (m_new - m_i) / v_i - al * s1
                g2 = -1.0 / sd + sd / v_i - al * s1s
                h11 = 1.0 / v_i + al * al * s2a
                h12 = al * al * s2s
                h22 = 1.0 / (sd * sd) + 1.0 / v_i + al * al * s2ss
                det = h11 * h22 - h12 * h12
                d1 = (h22 * g1 - h12 * g2) / det
                d2 = (h11 * g2 - h12 * g1) / det
                lam = 1.0
                while sd - lam * d2 <= 0.0:
                    lam *= 0.5
                m_new -= lam * d1
                sd -= lam * d2
                if abs(lam * d1) <= tol * (1.0 + abs(m_new)) and abs(lam * d2) <= tol * (1.0 + sd):
                    ok = True
                    break
            if not ok:
                unconverged += 1
            buf_mu[k - start] = m_new
            buf_s2[k - start] = sd * sd
            continue
        # Algorithm 1: mean by (17)/(30) or Newton on (15)/(28); variance by (18) or (19)/(31).
        if mean_newton:
            z0 = y * mu_t * ic
            dw = 1.0 / (y * x * ic) if x != 0.0 else 0.0  # w = m_i + dw (zeta - z0)
            zeta, ok = _solve_zeta(z0, x * x * v_i * ic * ic, link, tol, maxiter, m_i, dw)
            if not ok:
                unconverged += 1
            m_new = m_i + dw * (zeta - z0)  # the Newton iterate in w (y x v_i psi1(zeta) / c only at the root)
        else:
            q1, q2 = _psi(y * mu_t * ic, link)
            m_new = m_i + y * x * v_i * q1 * ic / (1.0 + x * x * v_i * q2 * ic * ic)
        z_plus = y * (mum + x * m_new) * ic
        if var_value:
            d = m_new - m_i
            buf_s2[k - start] = v_i * math.exp(2.0 * (log_p_t - _log_cdf(z_plus, link)) + d * d / v_i)
        else:
            _, q2 = _psi(z_plus, link)
            buf_s2[k - start] = v_i / (1.0 + v_i * x * x * ic * ic * q2)
        buf_mu[k - start] = m_new
    return unconverged


@njit(cache=True, inline="always")
def _valid_update(m, v):
    """Whether a row's new mean ``m`` and variance ``v`` of a feature are a finite mean and a finite positive
    variance (a mini-batch sums them in natural parameters, where an infinite variance would look like a zero
    precision)."""
    return math.isfinite(m) and v > 0.0 and v < np.inf


@njit(cache=True, nogil=True, error_model="numpy")
def run_diagonal(method, link, mean_newton, var_value, tol, maxiter, batch_size, indptr, indices,
                 data, y, mu, s2, samples, p1_out, ll_out, acc_h, acc_eta, buf_mu, buf_s2, undo_mu, undo_s2):
    """Stream rows ``0..n-1`` of a CSR chunk, updating ``mu``/``s2`` in place.

    Before entry ``k`` of the chunk is written, its old values go to ``undo_mu[k]``, ``undo_s2[k]``
    (``(nnz,)``; every entry is recorded once), so :func:`undo` can restore the state before the chunk.

    Returns ``(unconverged, skipped)``: inner solves that hit ``maxiter`` and mini-batch
    feature updates dropped because the summed precision was finite but not positive.  A row's update that is not
    a finite mean and a positive finite variance, or a summed precision that is not finite (float64 overflow),
    sets the feature's variance to NaN instead: ``partial_fit``'s check of the state then refuses the chunk.
    """
    n = indptr.shape[0] - 1
    a = math.pi / 8.0 if link == LOGIT else 1.0
    unconverged = 0
    skipped = 0
    b0 = 0
    while b0 < n:
        b1 = min(n, b0 + batch_size)
        for t in range(b0, b1):
            start = indptr[t]
            end = indptr[t + 1]
            mu_t = 0.0
            s2_t = 0.0
            for k in range(start, end):
                i = indices[k]
                x = data[k]
                mu_t += x * mu[i]
                s2_t += x * x * s2[i]
            ct = math.sqrt(1.0 + a * s2_t)
            yt = y[t]
            p1_out[t] = _cdf(mu_t / ct, link)
            log_p_t = _log_cdf(yt * mu_t / ct, link)
            ll_out[t] = -log_p_t + 0.0 * (mu_t + s2_t)  # NaN when the score moments (6) overflowed
            unconverged += _row_update(method, link, a, mean_newton, var_value, tol, maxiter, yt,
                                       start, end, indices, data, mu, s2, mu_t, s2_t, log_p_t,
                                       samples, t, buf_mu, buf_s2)
            if batch_size == 1:
                for k in range(start, end):
                    i = indices[k]
                    undo_mu[k] = mu[i]
                    undo_s2[k] = s2[i]
                    mu[i] = buf_mu[k - start]
                    s2[i] = buf_s2[k - start]
            else:
                for k in range(start, end):
                    i = indices[k]
                    acc_h[i] += 1.0 / buf_s2[k - start] - 1.0 / s2[i]
                    acc_eta[i] += buf_mu[k - start] / buf_s2[k - start] - mu[i] / s2[i]
                    if not _valid_update(buf_mu[k - start], buf_s2[k - start]):
                        acc_h[i] = math.nan  # the row's update overflowed: the sum is marked (see below)
        if batch_size > 1:
            for k in range(indptr[b0], indptr[b1]):
                i = indices[k]
                undo_mu[k] = mu[i]
                undo_s2[k] = s2[i]
                if acc_h[i] != 0.0 or acc_eta[i] != 0.0:
                    h = 1.0 / s2[i] + acc_h[i]
                    if h > 0.0 and math.isfinite(h):
                        eta = mu[i] / s2[i] + acc_eta[i]
                        s2[i] = 1.0 / h
                        mu[i] = eta / h
                    elif math.isfinite(h):
                        skipped += 1
                    else:  # overflow: marked for partial_fit's check of the state
                        s2[i] = math.nan
                    acc_h[i] = 0.0
                    acc_eta[i] = 0.0
        b0 = b1
    return unconverged, skipped


@njit(cache=True, nogil=True)
def run_adagrad(link, eta, delta, indptr, indices, data, y, w, G, p1_out, ll_out):
    """SGD with AdaGrad step sizes (Duchi et al., 2011) on the log-loss of ``F(x^T w)``."""
    n = indptr.shape[0] - 1
    for t in range(n):
        start = indptr[t]
        end = indptr[t + 1]
        m = 0.0
        for k in range(start, end):
            m += data[k] * w[indices[k]]
        yt = y[t]
        if not math.isfinite(m):  # the score overflowed: partial_fit names the row and undoes the chunk
            p1_out[t] = 0.5
            ll_out[t] = math.nan
            return 0
        p1_out[t] = _cdf(m, link)
        ll_out[t] = -_log_cdf(yt * m, link)
        q1, _ = _psi(yt * m, link)
        for k in range(start, end):
            i = indices[k]
            g = -yt * q1 * data[k]
            G[i] += g * g
            w[i] -= eta * g / math.sqrt(G[i] + delta)
    return 0


@njit(cache=True, nogil=True, error_model="numpy")
def run_diagonal_multi(method, link, mean_newton, var_value, tol, maxiter, batch_size, indptr, indices,
                       data, y, mu, s2, samples, p1_out, ll_out, acc_h, acc_eta, buf_mu, buf_s2, undo_mu, undo_s2,
                       slot, cum, active, until, log_window):
    """:func:`run_diagonal` for ``K`` learners side by side on the same rows (``mu``, ``s2``: ``(K, d)``).

    Over 80 lines: a numba kernel (no Python objects, no closures), compiled as one unit over the stream.

    Member ``m`` sees exactly the arithmetic of :func:`run_diagonal` on ``mu[m]``, ``s2[m]``; rows are
    interleaved (all members on row ``t``, then row ``t + 1``).  ``p1_out``, ``ll_out``: ``(n, K)``; ``acc_h``,
    ``acc_eta``: ``(K, d)`` when ``batch_size > 1``; ``undo_mu``, ``undo_s2``: ``(S, nnz)``, the old values of
    member ``m`` in row ``slot[m]`` (``S`` members active at the start; see :func:`undo_multi`).

    Occam's window: ``cum`` (``(K,)``, in/out) are the members' cumulative log losses and ``active`` (``(K,)``
    uint8, in/out) the members still in the average; at the end of every batch a member whose loss exceeds the
    best active one's by more than ``log_window`` leaves for good (``until[m]`` = the first row without it).
    An inactive member is neither predicted nor updated (``p1_out`` 0.5, ``ll_out`` 0 there).
    Returns ``(unconverged, skipped)`` summed over members.
    """
    n = indptr.shape[0] - 1
    K = mu.shape[0]
    a = math.pi / 8.0 if link == LOGIT else 1.0
    unconverged = 0
    skipped = 0
    b0 = 0
    while b0 < n:
        b1 = min(n, b0 + batch_size)
        for t in range(b0, b1):
            start = indptr[t]
            end = indptr[t + 1]
            yt = y[t]
            for m in range(K):
                if not active[m]:
                    p1_out[t, m] = 0.5
                    ll_out[t, m] = 0.0
                    continue
                mu_m = mu[m]
                s2_m = s2[m]
                u = slot[m]
                mu_t = 0.0
                s2_t = 0.0
                for k in range(start, end):
                    i = indices[k]
                    x = data[k]
                    mu_t += x * mu_m[i]
                    s2_t += x * x * s2_m[i]
                ct = math.sqrt(1.0 + a * s2_t)
                p1_out[t, m] = _cdf(mu_t / ct, link)
                log_p_t = _log_cdf(yt * mu_t / ct, link)
                bad = 0.0 * (mu_t + s2_t)  # NaN when the score moments (6) overflowed
                ll_out[t, m] = -log_p_t + bad
                cum[m] += -log_p_t + bad
                unconverged += _row_update(method, link, a, mean_newton, var_value, tol, maxiter, yt,
                                           start, end, indices, data, mu_m, s2_m, mu_t, s2_t, log_p_t,
                                           samples, t, buf_mu, buf_s2)
                if batch_size == 1:
                    for k in range(start, end):
                        i = indices[k]
                        undo_mu[u, k] = mu_m[i]
                        undo_s2[u, k] = s2_m[i]
                        mu_m[i] = buf_mu[k - start]
                        s2_m[i] = buf_s2[k - start]
                else:
                    for k in range(start, end):
                        i = indices[k]
                        acc_h[m, i] += 1.0 / buf_s2[k - start] - 1.0 / s2_m[i]
                        acc_eta[m, i] += buf_mu[k - start] / buf_s2[k - start] - mu_m[i] / s2_m[i]
                        if not _valid_update(buf_mu[k - start], buf_s2[k - start]):
                            acc_h[m, i] = math.nan  # the row's update overflowed: the sum is marked (see below)
        if batch_size > 1:
            for m in range(K):
                if not active[m]:
                    continue
                u = slot[m]
                for k in range(indptr[b0], indptr[b1]):
                    i = indices[k]
                    undo_mu[u, k] = mu[m, i]
                    undo_s2[u, k] = s2[m, i]
                    if acc_h[m, i] != 0.0 or acc_eta[m, i] != 0.0:
                        h = 1.0 / s2[m, i] + acc_h[m, i]
                        if h > 0.0 and math.isfinite(h):
                            eta = mu[m, i] / s2[m, i] + acc_eta[m, i]
                            s2[m, i] = 1.0 / h
                            mu[m, i] = eta / h
                        elif math.isfinite(h):
                            skipped += 1
                        else:  # overflow: marked for partial_fit's check of the state
                            s2[m, i] = math.nan
                        acc_h[m, i] = 0.0
                        acc_eta[m, i] = 0.0
        best = np.inf
        for m in range(K):
            if active[m] and cum[m] < best:
                best = cum[m]
        for m in range(K):
            if active[m] and cum[m] - best > log_window:
                active[m] = 0
                until[m] = b1
        b0 = b1
    return unconverged, skipped


@njit(cache=True, nogil=True, error_model="numpy")
def run_alg1_fused(link, indptr, indices, data, y, st, p1_out, ll_out, undo_mu, undo_s2, slot, cum, active,
                   until, log_window, bad):
    """Algorithm 1 with the default options (Taylor mean (17)/(30), Laplace variance (19)/(31), one row at a
    time) for ``K`` learners at once, and their Bayesian model average.

    Over 80 lines: a numba kernel (no Python objects, no closures), compiled as one unit over the stream.

    ``st``: ``(K, d, 2)``, C order: member ``m``'s mean and variance of feature ``i`` in ``st[m, i, 0]`` and
    ``st[m, i, 1]`` (``K = 1``: one learner; the two in one cache line).  Each row's indices and
    values are read once for all active members (the score moments (6) of every member in one pass over the
    row, then every member's update of a feature in one pass), and each member's arithmetic is operation for
    operation that of :func:`run_diagonal`, so the result equals ``K`` separate learners.  Rows must hold
    distinct indices (canonical CSR): a feature's new values are written as soon as they are computed.

    ``p1_out``, ``ll_out`` (``(n,)``) receive the model average's predictive probability of ``y = 1`` and its log
    loss, with the weights ``w_m ∝ exp(-cum[m])`` of the members active before the row (Hoeting et al. 1999,
    Eq. (1)); with one active member they are that member's own.  ``cum`` (in/out): the members' cumulative
    log losses; ``active`` (uint8, in/out); after every row a member whose loss exceeds the best active
    one's by more than ``log_window`` leaves for good and ``until[m]`` is set to the next row (Occam's
    window, Madigan & Raftery 1994).  ``undo_mu``, ``undo_s2``: ``(S, nnz)``: entry ``k``'s old values of member
    ``m`` go to row ``slot[m]`` before they are overwritten (see :func:`undo_multi`).  ``bad`` (``(1,)`` uint8,
    out) is set to 1 when a write leaves a mean that is not finite or a variance that is not a finite normal float64
    (below ``tiny``): the caller's state check, done here at no extra pass over the state.
    """
    n = indptr.shape[0] - 1
    K = st.shape[0]
    d = st.shape[1]
    a = math.pi / 8.0 if link == LOGIT else 1.0
    act = np.empty(K, dtype=np.int64)
    na = 0
    for m in range(K):
        if active[m]:
            act[na] = m
            na += 1
    mt = np.zeros(K)
    vt = np.zeros(K)
    lp = np.zeros(K)
    pk = np.zeros(K)
    # one member left (the usual case once Occam's window has closed): its rows of the arrays, no member loop
    st1, um1, us1 = st[act[0]], undo_mu[slot[act[0]]], undo_s2[slot[act[0]]]
    for t in range(n):
        start = indptr[t]
        end = indptr[t + 1]
        yt = y[t]
        if t + 1 < n:  # the next row's state, fetched while this row is computed
            for k in range(end, indptr[t + 2]):
                for j in range(na):
                    _prefetch(st, (act[j] * d + indices[k]) * 2)
        if na == 1:
            p1_out[t], lp1 = _alg1_row(link, a, start, end, yt, indices, data, st1, um1, us1, bad)
            ll_out[t] = -lp1
            cum[act[0]] += -lp1
            continue
        for j in range(na):
            mt[j] = 0.0
            vt[j] = 0.0
        for k in range(start, end):  # Eq. (6) for every member
            i = indices[k]
            x = data[k]
            for j in range(na):
                m = act[j]
                mt[j] += x * st[m, i, 0]
                vt[j] += x * x * st[m, i, 1]
        for j in range(na):  # Eq. (8) / (24)
            ct = math.sqrt(1.0 + a * vt[j])
            pk[j] = _cdf(mt[j] / ct, link)
            lp[j] = _log_cdf(yt * mt[j] / ct, link) + 0.0 * (mt[j] + vt[j])  # NaN when (6) overflowed
        # the model average (two or more members), as _mix: log-weights within the window, then log-sum-exp
        mx = -np.inf
        for j in range(na):
            mx = max(mx, -cum[act[j]])
        tot = 0.0
        for j in range(na):
            tot += math.exp(-cum[act[j]] - mx)
        lse = mx + math.log(tot)
        p = 0.0
        mx2 = -np.inf
        for j in range(na):
            lw = -cum[act[j]] - lse
            p += math.exp(lw) * pk[j]
            mx2 = max(mx2, lw - (-lp[j]))
        if not math.isfinite(mx2):
            mx2 = 0.0
        tot = 0.0
        for j in range(na):
            tot += math.exp((-cum[act[j]] - lse) - (-lp[j]) - mx2)
        p1_out[t] = p
        ll_out[t] = -(mx2 + math.log(tot))
        for k in range(start, end):  # Eqs. (7), (17)/(30), (19)/(31) for every member
            i = indices[k]
            x = data[k]
            for j in range(na):
                m = act[j]
                m_i = st[m, i, 0]
                v_i = st[m, i, 1]
                m_new, v_new = _alg1_feature(link, a, yt, x, m_i, v_i, mt[j], vt[j])
                u = slot[m]
                undo_mu[u, k] = m_i
                undo_s2[u, k] = v_i
                st[m, i, 0] = m_new
                st[m, i, 1] = v_new
                if not (abs(m_new) < np.inf and TINY <= v_new < np.inf):  # NaN fails both
                    bad[0] = 1
        for j in range(na):
            cum[act[j]] += -lp[j]
        if na > 1:  # Occam's window
            best = np.inf
            for j in range(na):
                best = min(best, cum[act[j]])
            keep = 0
            for j in range(na):
                m = act[j]
                if cum[m] - best > log_window:
                    active[m] = 0
                    until[m] = t + 1
                else:
                    act[keep] = m
                    keep += 1
            na = keep
            st1, um1, us1 = st[act[0]], undo_mu[slot[act[0]]], undo_s2[slot[act[0]]]
    return 0, 0


@njit(cache=True, inline="always", error_model="numpy")
def _alg1_feature(link, a, yt, x, m_i, v_i, mt, vt):
    """Algorithm 1's update of one feature (value ``x``, mean ``m_i``, variance ``v_i``) by a row with score moments
    ``mt``, ``vt`` (Eq. (6)): Eq. (7), the Taylor mean (17)/(30) and the Laplace variance (19)/(31).

    For the logit link ``psi1 = e / (1 + e)`` (or ``1 / (1 + e)`` below zero) and ``psi2 = e / (1 + e)^2`` with
    ``e = exp(-|z|)``, so each update is one fraction: ``psi1 / (1 + g psi2) = n (1 + e) / ((1 + e)^2 + g e)``
    (``n`` = the numerator of ``psi1``), the same values as :func:`_psi` to rounding."""
    mum = mt - x * m_i
    s2m = max(vt - x * x * v_i, 0.0)
    ic = 1.0 / math.sqrt(1.0 + a * s2m)
    g = v_i * x * x * ic * ic
    z = yt * mt * ic
    if link == LOGIT:
        e = math.exp(-abs(z))
        o = 1.0 + e
        m_new = m_i + yt * x * v_i * ic * ((e if z >= 0 else 1.0) * o) / (o * o + g * e)
        z_plus = yt * (mum + x * m_new) * ic
        e = math.exp(-abs(z_plus))
        o = (1.0 + e) * (1.0 + e)
        return m_new, v_i * o / (o + g * e)
    q1, q2 = _psi(z, link)
    m_new = m_i + yt * x * v_i * q1 * ic / (1.0 + g * q2)
    _, q2 = _psi(yt * (mum + x * m_new) * ic, link)
    return m_new, v_i / (1.0 + g * q2)


@njit(cache=True, nogil=True, error_model="numpy")
def _alg1_row(link, a, start, end, yt, indices, data, st, undo_mu, undo_s2, bad):
    """One row of :func:`run_alg1_fused` for one member (``(d, 2)`` state): ``(P(y = 1), log p(y_t))``; ``bad`` as
    there."""
    mt = 0.0
    vt = 0.0
    for k in range(start, end):
        i = indices[k]
        x = data[k]
        mt += x * st[i, 0]
        vt += x * x * st[i, 1]
    ct = math.sqrt(1.0 + a * vt)
    p1 = _cdf(mt / ct, link)
    lp = _log_cdf(yt * mt / ct, link) + 0.0 * (mt + vt)  # NaN when the score moments (6) overflowed
    for k in range(start, end):
        i = indices[k]
        m_i = st[i, 0]
        v_i = st[i, 1]
        m_new, v_new = _alg1_feature(link, a, yt, data[k], m_i, v_i, mt, vt)
        undo_mu[k] = m_i
        undo_s2[k] = v_i
        st[i, 0] = m_new
        st[i, 1] = v_new
        if not (abs(m_new) < np.inf and TINY <= v_new < np.inf):  # NaN fails both
            bad[0] = 1
    return p1, lp


@njit(cache=True, nogil=True)
def undo(indices, mu, s2, undo_mu, undo_s2):
    """Restore ``mu``/``s2`` (``(d,)``) from the old values recorded by :func:`run_diagonal`, newest first, so
    each entry ends at its value before the chunk."""
    for k in range(indices.shape[0] - 1, -1, -1):
        mu[indices[k]] = undo_mu[k]
        s2[indices[k]] = undo_s2[k]


@njit(cache=True, nogil=True)
def undo_multi(indptr, indices, mu, s2, undo_mu, undo_s2, slot, until):
    """:func:`undo` for ``(K, d)`` states (:func:`run_diagonal_multi`, :func:`run_alg1_fused`): member ``m`` with
    ``slot[m] >= 0`` (active at the start of the chunk) wrote the entries of rows ``< until[m]``; they are
    restored newest first."""
    for m in range(mu.shape[0]):
        u = slot[m]
        if u < 0:
            continue
        for k in range(indptr[until[m]] - 1, -1, -1):
            i = indices[k]
            mu[m, i] = undo_mu[u, k]
            s2[m, i] = undo_s2[u, k]
