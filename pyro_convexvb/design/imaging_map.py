r"""Exact MAP reconstruction of the compressive-sensing image model by ADMM with Fourier-diagonal updates.

:func:`imaging_map` minimises the negative log posterior of :func:`~.imaging.compressive_sensing_model`
(Seeger 2010 §5, Eq. (1)),

.. math:: \Psi_0(u) = \frac{1}{2\sigma^2}\|y - X u\|^2 + \sum_i \frac{|(B_a u)_i|}{b_a}
          + \sum_j \frac{|(B_r u)_j|}{b_r},

``X`` the measured k-space columns (``X^T X`` diagonal in the 2-D Fourier basis), ``B_a`` an orthonormal
Haar transform (``B_a^T B_a = I``), ``B_r`` the non-periodic horizontal/vertical differences, by the
alternating direction method of multipliers (Boyd et al. 2011, §3.1, scaled form) on the split
``s = B~ u`` with

.. math:: \tilde B = \begin{bmatrix} B_a \\ B_r \\ E \end{bmatrix},

``E`` the ``H + W`` *wrap-around* differences (``u[i, 0] - u[i, W-1]`` and ``u[0, j] - u[H-1, j]``) with zero
weight in the objective: they change neither the problem nor its minimiser, but complete ``B_r`` to the
periodic differences, so ``B~^T B~ = I + L_per`` with ``L_per`` the periodic 5-point Laplacian, and the
``u``-update

.. math:: (X^T X / \sigma^2 + \rho (I + L_{per}))\, u = X^T y / \sigma^2 + \rho \tilde B^T (s - \lambda)

is diagonal in the 2-D Fourier basis: one real FFT pair, exactly, no inner CG. The ``s``-update is soft
thresholding at ``w_i / rho`` (identity on the wrap rows), the dual update ``lambda += B~ u - s``. The fixed-point
map of ``z = s + lambda`` is Anderson-accelerated (Walker & Ni 2011, safeguarded); ``rho`` is fixed by default
(residual balancing, Boyd et al. 2011, §3.4.1, on request: it measured slower here) and the run stops on the
primal and stationarity residuals (§3.3.1). The derivation is in ``docs/design.md`` ("Fast exact MAP
reconstructions").
"""
import math

import torch

from ..errors import warn

__all__ = ["imaging_map"]


def _probe(n, dtype, device, seed=12345):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def _rel(a, b):
    return float(torch.linalg.vector_norm(a - b)) / max(float(torch.linalg.vector_norm(b)), 1e-300)


_ROUNDING = 4  # multiple of the dtype's eps below which the stopping test treats a residual as rounding


def _probe_tol(dtype):
    """Relative tolerance of the probe checks in :func:`_model_parts`: ``1024 eps`` of ``dtype`` (``2.3e-13`` in
    float64, ``1.2e-4`` in float32). An FFT or Haar product is exact to a few ``eps`` (measured below ``2 eps`` up
    to 512x512), a model of another form misses by order one."""
    return 1024 * torch.finfo(dtype).eps


def _model_parts(lgm):
    """``(X, y, sigma2, Ba, wa, Br, wr, grid, sx)`` of a compressive-sensing model, each checked."""
    from ..lgm.families.gaussian import Gaussian
    from ..lgm.families.laplace import Laplace
    from ..lgm.model import LatentGaussianModel

    if not isinstance(lgm, LatentGaussianModel):
        raise TypeError(f"lgm: imaging_map expected a LatentGaussianModel (compressive_sensing_model), got "
                        f"{type(lgm).__name__}")
    if len(lgm.priors) != 1 or not lgm.priors[0].flat:
        raise ValueError("lgm: imaging_map needs a flat prior on u (compressive_sensing_model); with a Gaussian prior "
                         "use pyro_convexvb.infer.convex_relaxation.laplace_map")
    gauss, lap = list(lgm.gaussian_groups), list(lgm.nongaussian_groups)
    if len(gauss) != 1 or not isinstance(gauss[0].family, Gaussian) or gauss[0].weight is not None:
        raise ValueError("lgm: imaging_map needs exactly one unweighted Gaussian measurement group (the Fourier "
                         "columns of compressive_sensing_model)")
    if len(lap) != 2 or not all(isinstance(g.family, Laplace) and g.weight is None for g in lap):
        raise ValueError("lgm: imaging_map needs exactly two unweighted Laplace site groups (the wavelet "
                         "coefficients and the differences of compressive_sensing_model)")
    obs = gauss[0]
    X, sd = obs.design, obs.family.params["scale"]
    if not bool((sd == sd[0]).all()):
        raise ValueError(f"lgm: group '{obs.name}' has unequal noise scales; imaging_map needs one noise level "
                         "(its X^T X / sigma^2 must be diagonal in the Fourier basis)")
    sigma2 = float(sd[0]) ** 2
    y = obs.family.params["y"] - obs.offset
    n, dt, dev = lgm.n, lgm.dtype, lgm.device
    sym = X.gram_symbol(torch.full((X.shape[0],), 1.0 / sigma2, dtype=dt, device=dev))
    if sym is None:
        raise ValueError(f"lgm: the design of group '{obs.name}' has no Fourier symbol; imaging_map needs the "
                         "k-space column operator of compressive_sensing_model (fourier_columns_operator)")
    grid = sym.grid
    v, tol = _probe(n, dt, dev), _probe_tol(dt)
    if _rel(sym.mv(v), X.rmv(X.mv(v)) / sigma2) > tol:
        raise ValueError(f"lgm: X^T X of group '{obs.name}' is not diagonal in the 2-D Fourier basis (its symbol "
                         "does not reproduce it); imaging_map needs measured k-space columns")
    H, W = grid
    wrap = _Wrap(H, W)
    lper = wrap.laplacian_symbol(dt, dev)
    parts, order = {}, []
    for g in lap:
        if bool((g.family.params["y"] != 0).any()) or bool((g.offset != 0).any()):
            raise ValueError(f"lgm: Laplace group '{g.name}' has a nonzero location or offset; imaging_map needs "
                             "sparsity sites on B u (compressive_sensing_model)")
        B = g.design
        BtBv = B.rmv(B.mv(v))
        if _rel(BtBv, v) < tol:
            kind = "orthonormal"
        elif _rel(BtBv + wrap.rmv(wrap.mv(v)), _apply_symbol(lper, v, grid)) < tol:
            kind = "differences"
        else:
            raise ValueError(f"lgm: the design of Laplace group '{g.name}' is neither orthonormal (B^T B = I) nor "
                             f"the non-periodic horizontal/vertical differences of a {H}x{W} image")
        if kind in parts:
            raise ValueError(f"lgm: two Laplace groups are {kind}; imaging_map needs one orthonormal wavelet group "
                             "and one difference group")
        parts[kind] = (B, 1.0 / g.family.params["scale"])
        order.append(kind)
    return X, y, sigma2, parts["orthonormal"], parts["differences"], grid, sym.values, lper, wrap, order


def _apply_symbol(values, r, grid, inverse=False):
    H, W = grid
    K = torch.fft.rfft2(r.reshape(H, W), norm="ortho")
    K = K / values if inverse else K * values
    return torch.fft.irfft2(K, s=(H, W), norm="ortho").reshape(-1)


class _Wrap:
    """The ``H + W`` wrap-around differences ``u[i, 0] - u[i, W-1]`` (``H`` rows) and ``u[0, j] - u[H-1, j]``."""

    def __init__(self, H, W):
        self.H, self.W = H, W

    def mv(self, u):
        U = u.reshape(self.H, self.W, -1)
        out = torch.cat([U[:, 0] - U[:, -1], U[0, :] - U[-1, :]])
        return out.reshape(-1) if u.dim() == 1 else out

    def rmv(self, r):
        H, W = self.H, self.W
        R = r.reshape(H + W, -1)
        U = r.new_zeros(H, W, R.shape[1])
        U[:, 0] += R[:H]
        U[:, -1] -= R[:H]
        U[0, :] += R[H:]
        U[-1, :] -= R[H:]
        return U.reshape(-1) if r.dim() == 1 else U.reshape(H * W, -1)

    def laplacian_symbol(self, dtype, device):
        """Half spectrum of the periodic 5-point Laplacian ``L_per`` (``(H, W // 2 + 1)``)."""
        H, W = self.H, self.W
        k = torch.arange(H, dtype=dtype, device=device)
        c = torch.arange(W // 2 + 1, dtype=dtype, device=device)
        return ((2 - 2 * torch.cos(2 * math.pi * k / H)).view(-1, 1)
                + (2 - 2 * torch.cos(2 * math.pi * c / W)).view(1, -1))


def _check_options(tol, atol, max_iter, rho, mu, rho_factor, adapt_iters, memory):
    """Validate :func:`imaging_map`'s numeric options, naming the first bad one."""
    for name, v in (("tol", tol), ("mu", mu), ("rho_factor", rho_factor)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name}: expected a positive finite number, got {v!r}")
    if not tol < 1:
        raise ValueError(f"tol: expected a relative tolerance below 1, got {tol!r}")
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not math.isfinite(atol) or atol < 0:
        raise ValueError(f"atol: expected a finite number >= 0, got {atol!r}")
    if not (mu > 1 and rho_factor > 1):
        raise ValueError(f"mu, rho_factor: expected both > 1, got {mu!r}, {rho_factor!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter: expected an integer >= 1, got {max_iter!r}")
    if rho is not None and (isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho)
                            or rho <= 0):
        raise ValueError(f"rho: expected None or a positive finite number, got {rho!r}")
    for name, v in (("memory", memory), ("adapt_iters", adapt_iters)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected an integer >= 0, got {v!r}")


def _start_state(init, u, rho, sx, fwd, prox, p):
    """``(z, rho)``: the ADMM state ``z = s + lambda`` and penalty :func:`imaging_map` starts from: ``init``'s
    (its multipliers ``v = rho lambda`` kept when ``rho`` is given anew), else that of a step that returned ``u``."""
    if init is not None:
        if not isinstance(init, dict) or not {"z", "rho"} <= set(init):
            raise ValueError("init: expected the 'state' dict of an earlier imaging_map report (z, rho)")
        if init["z"].shape != (p,):
            raise ValueError(f"init: its state is for another problem size (expected ({p},), got "
                             f"{tuple(init['z'].shape)})")
        z = init["z"].to(dtype=u.dtype, device=u.device).clone()
        r_old = float(init["rho"])
        if rho is not None:  # keep s and the unscaled multipliers v = rho lambda
            s = prox(z, r_old)
            z = s + (z - s) * (r_old / float(rho))
        return z, (r_old if rho is None else float(rho))
    rho = float(sx.max()) / 10.0 if rho is None else float(rho)
    if not rho > 0:
        raise ValueError("lgm: no k-space column is measured (X^T X = 0); pass rho explicitly")
    return fwd(u), rho  # s = prox(B~ u0), lambda = B~ u0 - s: the state of an ADMM step that returned u0


class _Anderson:
    """Type-II Anderson acceleration of a fixed-point map (Walker & Ni 2011) with ``memory`` past steps: a ring of
    iterate differences (rows of ``dZ``) and residual differences (rows of ``dG``) with the Gram matrix of ``dG``
    kept up to date."""

    def __init__(self, memory, p, dtype, device):
        mem = max(memory, 1)
        self.memory = memory
        self.dZ = torch.zeros(mem, p, dtype=dtype, device=device)
        self.dG = torch.zeros(mem, p, dtype=dtype, device=device)
        self.gram = torch.zeros(mem, mem, dtype=dtype, device=device)
        self.filled = self.slot = 0

    def reset(self):
        """Forget the memory (the map changed, or an accelerated point was rejected)."""
        self.filled = self.slot = 0

    def push(self, dz, dg):
        """Remember one step: ``dz`` the change of the iterate, ``dg`` that of its fixed-point residual."""
        if self.memory == 0:
            return
        k = self.slot
        self.dZ[k], self.dG[k] = dz, dg
        self.filled = min(self.filled + 1, self.memory)
        col = self.dG[:self.filled] @ self.dG[k]
        self.gram[k, :self.filled], self.gram[:self.filled, k] = col, col
        self.slot = (k + 1) % self.memory

    def step(self, z, g):
        """The accelerated point ``z + g - (dZ + dG)^T gamma``, ``gamma = argmin ||g - dG^T gamma||``, from the
        iterate ``z`` and its residual ``g = T(z) - z``; ``None`` while the memory is empty."""
        f = self.filled
        if not f:
            return None
        M = self.gram[:f, :f]
        shift = 1e-12 * float(M.diagonal().max()) + torch.finfo(M.dtype).tiny
        M = M + shift * torch.eye(f, dtype=M.dtype, device=M.device)
        gamma = torch.linalg.solve(M, self.dG[:f] @ g)
        return z + g - gamma @ self.dZ[:f] - gamma @ self.dG[:f]


def imaging_map(lgm, u0=None, *, init=None, tol=1e-6, atol=0.0, max_iter=5000, rho=None, adaptive=False, mu=10.0,
                rho_factor=2.0, adapt_iters=100, memory=10, progress=True):
    r"""Exact MAP reconstruction ``argmin_u Psi_0(u)`` of :func:`~.imaging.compressive_sensing_model` by ADMM
    whose linear step is one FFT solve (Boyd et al. 2011, §3; derivation in ``docs/design.md``):

    .. math:: \Psi_0(u) = \tfrac{1}{2\sigma^2}\|y - X u\|^2 + \sum_j |s_j| / b_j, \qquad s = B u,

    the same objective as :func:`~pyro_convexvb.infer.convex_relaxation.laplace_map` reports (``Psi_0``), solved
    without smoothing. Split ``s = [B_a; B_r; E] u`` (``E``: the wrap-around differences, weight 0, so the
    ``u``-system ``X^T X / sigma^2 + rho (I + L_per)`` is diagonal in the 2-D Fourier basis); scaled duals
    ``lambda``; the state ``z = s + lambda`` iterated by the ADMM fixed-point map with type-II Anderson acceleration
    of ``memory`` past steps (an accelerated point that does not reduce the fixed-point residual is replaced by
    the plain step). Penalty ``rho`` fixed unless ``adaptive`` (residual balancing, §3.4.1: ``rho *= rho_factor``
    when the primal residual exceeds ``mu`` times the dual one, ``/=`` in the opposite case, during the first
    ``adapt_iters`` iterations only). Stop when ``||B~ u - s|| <= sqrt(p) atol + (tol + 4 eps) max(||B~ u||, ||s||)``
    and ``||X^T (X u - y) / sigma^2 + B~^T v|| <= sqrt(n) atol + tol ||B~^T v|| + 4 eps ||X^T y|| / sigma^2``
    (§3.3.1), ``v = rho lambda``, ``eps`` that of the model's dtype: the ``eps`` terms are the rounding level at
    which the residuals are computed (negligible in float64; in float32 the stationarity residual stalls near
    ``eps ||X^T y|| / sigma^2``, above ``tol ||B~^T v||`` at the default ``tol``). Each
    iteration is one product with ``B~`` and one with ``B~^T`` (Haar transforms, the differences and their
    adjoints) and one real FFT solve, plus one more ``B~^T`` for the stationarity test once the primal test
    passes; ``X`` is used only for ``X^T y`` and the objective.

    Over 80 lines: the iteration (ADMM step, residual tests, the Anderson safeguard, penalty adaptation) is one
    loop over shared state; the checks, the start and the acceleration are helpers.

    At the returned point the multipliers satisfy ``v in w * d|s|`` exactly (``|v_j| <= 1/b_j``,
    ``v_j = sign(s_j)/b_j`` where ``s_j != 0``), and the dual residual is the stationarity violation
    ``||X^T (X u - y) / sigma^2 + B~^T v||``: the two residuals are the optimality conditions of the MAP.

    :param lgm: the :class:`~pyro_convexvb.LatentGaussianModel` of :func:`~.imaging.compressive_sensing_model`
        (flat prior; one Gaussian group of k-space columns with one noise level; one Laplace group with an
        orthonormal design and one with the non-periodic differences; each checked by a probe product, to a relative
        ``1024 eps`` of the model's dtype). float64 or float32.
    :param u0: ``(n,)`` start (default ``0``): ``z = B~ u0``; not together with ``init``.
    :param dict init: ``report["state"]`` (``z``, ``rho``) of an earlier run on the same image size (e.g. the
        previous design of a sequence): its ``s`` and multipliers start this run (warm start, in place of ``u0``).
    :param float tol: relative residual tolerance (``1e-6``: reconstruction errors within ``1e-7`` relative of a
        ``1e-9`` run at 64x64; ``1e-12`` for objectives to ``1e-10``).
    :param float atol: absolute residual tolerance per entry (default 0).
    :param int max_iter: iteration cap; a run that reaches it issues a
        :class:`~pyro_convexvb.errors.ConvergenceWarning` and reports ``converged=False``.
    :param rho: penalty (default: ``max`` of the ``X^T X / sigma^2`` symbol over 10, i.e. ``1/(10 sigma^2)``, or
        the warm start's).
    :param bool adaptive: residual balancing of ``rho``; :param float mu: its ratio;
        :param float rho_factor: its step; :param int adapt_iters: iterations during which it may change ``rho``.
    :param int memory: Anderson memory (``0``: plain ADMM).
    :param bool progress: tqdm bar over the iterations.
    :returns: ``(u, report)``: ``u`` ``(n,)`` (dtype and device of the model); ``report`` has ``objective``
        (``Psi_0(u)``, the model's operators), ``iterations``, ``primal_residual``, ``dual_residual`` and their
        tolerances, ``converged``, ``rho`` (final), ``rho_changes``, ``anderson_steps``, ``anderson_rejected``,
        ``products`` (products with ``B~`` or ``B~^T``; FFT solves counted apart in ``fft_solves``),
        ``multipliers`` (``v``, ``(q,)`` in the order of the model's Laplace groups) and ``state`` (for ``init``).
    :raises TypeError: if ``lgm`` is not a latent Gaussian model.
    :raises ValueError: if the model is not of the form above (naming the group and why), or for an invalid argument.

    Example::

        >>> import torch
        >>> from pyro_convexvb.design import compressive_sensing_model, fourier_columns_operator
        >>> u = torch.rand(8, 8, dtype=torch.float64).reshape(-1)
        >>> y = fourier_columns_operator(8, 8, [0, 1, 2]).mv(u)
        >>> lgm = compressive_sensing_model(y, 8, 8, [0, 1, 2], 1e-3, 0.08, 0.16)
        >>> u_map, rep = imaging_map(lgm, tol=1e-9, progress=False)
        >>> u_map.shape, rep["converged"]
        (torch.Size([64]), True)
    """
    _check_options(tol, atol, max_iter, rho, mu, rho_factor, adapt_iters, memory)
    if init is not None and u0 is not None:
        raise ValueError("u0, init: give one start (init, the state of an earlier run, determines u, s and the "
                         "multipliers)")
    X, y, sigma2, (Ba, wa), (Br, wr), grid, sx, lper, wrap, order = _model_parts(lgm)
    n, dt, dev = lgm.n, lgm.dtype, lgm.device
    H, W = grid
    qa, qr, qe = Ba.shape[0], Br.shape[0], H + W
    p = qa + qr + qe
    # rows 0..qa: the wavelet coefficients (B_a^T B_a = I); then the differences and the wrap rows (weight 0):
    # B~^T B~ = I + L_per
    wgt = torch.cat([wa.to(dt), wr.to(dt), torch.zeros(qe, dtype=dt, device=dev)])

    def fwd(v):
        return torch.cat([Ba.mv(v), Br.mv(v), wrap.mv(v)])

    def adj(r):
        return Ba.rmv(r[:qa]) + Br.rmv(r[qa:qa + qr]) + wrap.rmv(r[qa + qr:])

    def prox(z, rho):  # soft thresholding at w / rho (identity on the wrap rows)
        return torch.sign(z) * torch.clamp(z.abs() - wgt / rho, min=0.0)

    u = torch.zeros(n, dtype=dt, device=dev) if u0 is None else torch.as_tensor(u0).to(dtype=dt, device=dev).clone()
    if u.shape != (n,) or not bool(torch.isfinite(u).all()):
        raise ValueError(f"u0: expected a finite ({n},) tensor")
    z, rho = _start_state(init, u, rho, sx, fwd, prox, p)
    xty = X.rmv(y) / sigma2
    xty_hat = torch.fft.rfft2(xty.reshape(H, W), norm="ortho")
    one = 1.0 + lper
    adapt_until = min(adapt_iters, max_iter)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_iter, desc="imaging_map", unit="it", leave=False)
    converged, it, changes, accepted, rejected = False, 0, 0, 0, 0
    nprod = 0 if init is not None else 1  # products with B~ or B~^T
    r_norm = d_norm = eps_pri = eps_dual = float("nan")
    sqrt_p, sqrt_n = math.sqrt(p), math.sqrt(n)
    # the rounding level of the residuals: ||B~ u - s|| is computed to about eps max(||B~ u||, ||s||), the gradient
    # X^T (X u - y) / sigma^2 to about eps ||X^T y|| / sigma^2 (a difference of two such terms)
    ulp = _ROUNDING * torch.finfo(dt).eps
    grad_floor = ulp * float(torch.linalg.vector_norm(xty))
    anderson = _Anderson(memory, p, dt, dev)
    prev = None  # (z, g, plain successor T(z), ||g||) of the last iterate
    for it in range(1, max_iter + 1):
        # one ADMM step from the state z = s + lambda: s = prox(z), lambda = z - s
        s = prox(z, rho)
        rhs = xty + rho * adj(2 * s - z)  # X^T y / sigma^2 + rho B~^T (s - lambda)
        u_hat = torch.fft.rfft2(rhs.reshape(H, W), norm="ortho") / (sx + rho * one)
        uv = torch.fft.irfft2(torch.stack([u_hat, sx * u_hat - xty_hat]), s=(H, W), norm="ortho").reshape(2, -1)
        u, grad = uv[0], uv[1]  # grad = X^T (X u - y) / sigma^2
        Bu = fwd(u)
        z_new = Bu + (z - s)  # T(z) = B~ u + lambda
        s_new = prox(z_new, rho)
        lam_new = z_new - s_new
        nprod += 2
        # optimality of (u, s_new, v = rho lambda_new): primal ||B~ u - s_new||, and the stationarity
        # ||X^T (X u - y) / sigma^2 + B~^T v|| (one more product with B~^T: only when the primal test passes, rho
        # adapts, or at the last iteration)
        r_norm = float(torch.linalg.vector_norm(Bu - s_new))
        eps_pri = sqrt_p * atol + (tol + ulp) * max(float(torch.linalg.vector_norm(Bu)),
                                                     float(torch.linalg.vector_norm(s_new)))
        d_norm = eps_dual = float("nan")
        if r_norm <= eps_pri or (adaptive and it <= adapt_until) or it == max_iter:
            Bt_v = rho * adj(lam_new)  # B~^T v, v in w * d|s_new|
            nprod += 1
            d_norm = float(torch.linalg.vector_norm(grad + Bt_v))
            eps_dual = sqrt_n * atol + tol * float(torch.linalg.vector_norm(Bt_v)) + grad_floor
        if bar is not None:
            bar.update(1)
        if r_norm <= eps_pri and d_norm <= eps_dual:
            converged = True
            break
        g = z_new - z
        g_norm = float(torch.linalg.vector_norm(g))
        if prev is not None and prev[4] and g_norm > prev[3]:
            # safeguard: the Anderson point did not reduce the fixed-point residual; take the plain step instead
            rejected += 1
            anderson.reset()
            z, prev = prev[2], None
            continue
        if adaptive and it <= adapt_until:
            f = rho_factor if r_norm > mu * d_norm else (1.0 / rho_factor if d_norm > mu * r_norm else 1.0)
            if f != 1.0:  # the scaled dual lambda = v / rho keeps v; the fixed-point map changes: reset the memory
                rho *= f
                z_new = s_new + lam_new / f
                changes += 1
                anderson.reset()
                z, prev = z_new, None
                continue
        if prev is not None:
            anderson.push(z - prev[0], g - prev[1])
        z_next = anderson.step(z, g)
        accepted += z_next is not None
        prev = (z, g, z_new, g_norm, z_next is not None)
        z = z_new if z_next is None else z_next
    if bar is not None:
        bar.close()
    if not converged:
        warn(f"imaging_map: ADMM stopped after {it} iterations without meeting its residual test (primal "
             f"{r_norm:.3g} vs {eps_pri:.3g}, dual {d_norm:.3g} vs {eps_dual:.3g}); raise max_iter or tol")
    resid = y - X.mv(u)
    sa, sr = Ba.mv(u), Br.mv(u)
    objective = 0.5 * float(resid @ resid) / sigma2 + float((wa * sa.abs()).sum()) + float((wr * sr.abs()).sum())
    v = {"orthonormal": rho * lam_new[:qa], "differences": rho * lam_new[qa:qa + qr]}
    return u, dict(objective=objective, iterations=it, primal_residual=r_norm, dual_residual=d_norm,
                   primal_tolerance=eps_pri, dual_tolerance=eps_dual, converged=converged, rho=rho,
                   rho_changes=changes, anderson_steps=accepted, anderson_rejected=rejected, products=nprod + 1,
                   fft_solves=it, multipliers=torch.cat([v[k] for k in order]), state=dict(z=z_new, rho=rho))
