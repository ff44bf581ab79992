r"""Public helpers for code built on the convex relaxation (active learning, experimental design).

* :func:`site_designs` -- the stacked design ``B`` (``(q, n)``) and offsets of a model's non-Gaussian
  site groups, in the order of the engine's ``state.gamma`` and ``state.z``, with one slice
  per group (Nickisch & Seeger 2009 §2: ``s = B u``, one super-Gaussian potential per row).
* :func:`laplace_map` -- the MAP estimate of a model whose non-Gaussian sites are Laplace, by the
  engine's Newton/CG inner loop at a decreasing constant ``z`` (Seeger 2010 §2, Eq. (3) and footnote 2).

These wrap the engine's internal problem representation, so callers never depend on it.
"""
import math
from dataclasses import dataclass

import torch

from ...errors import warn
from ...lgm.families import Laplace
from .inner import inner_loop
from .problem import RelaxationProblem

__all__ = ["SiteDesigns", "site_designs", "laplace_map"]


@dataclass(frozen=True)
class SiteDesigns:
    r"""The non-Gaussian sites ``eta = B u + offset`` of a latent Gaussian model, in the engine's order.

    :ivar design: stacked design operator ``B`` of shape ``(q, n)``
        (a :class:`~pyro_convexvb.linalg.LinearOperator`), or ``None`` when ``q = 0``.
    :ivar offset: ``(q,)`` offsets of the linear predictors ``eta = B u + offset``.
    :ivar names: site-group names, in order (the keys of the engine's ``info["gamma"]``).
    :ivar slices: one ``slice`` into ``0..q`` per group, aligned with ``names``; the engine's
        ``state.gamma`` and ``state.z`` are laid out the same way.
    :ivar q: number of sites.
    """

    design: object
    offset: torch.Tensor
    names: tuple
    slices: tuple
    q: int


def _check_lgm(lgm, fn):
    from ...lgm.model import LatentGaussianModel

    if not isinstance(lgm, LatentGaussianModel):
        raise TypeError(f"lgm: {fn} expected a LatentGaussianModel, got {type(lgm).__name__}")


def site_designs(lgm):
    r"""Design and offsets of the non-Gaussian site groups of ``lgm``, stacked in the order the
    :class:`~pyro_convexvb.infer.convex_relaxation.ConvexVariationalRelaxation` engine uses for
    ``state.gamma`` and ``state.z`` (Nickisch & Seeger 2009 §2: ``s = B u``).

    With ``A`` the posterior precision of a fit, ``state.z = diag(B A^{-1} B^T)``, and
    ``state.gamma[slices[j]] = info["gamma"][names[j]]``.

    :param lgm: a :class:`~pyro_convexvb.LatentGaussianModel` (e.g. ``result.lgm`` of a fit).
    :returns: :class:`SiteDesigns` with ``design`` ``(q, n)``, ``offset`` ``(q,)``, ``names``,
        ``slices`` and ``q``.
    :raises TypeError: if ``lgm`` is not a latent Gaussian model.

    Example::

        >>> import torch
        >>> from pyro_convexvb.lgm.model import LatentGaussianModel
        >>> from pyro_convexvb.lgm.sites import BernoulliLogit
        >>> X = torch.randn(5, 2, dtype=torch.float64)
        >>> lgm = LatentGaussianModel.from_design(X, BernoulliLogit(torch.ones(5, dtype=torch.float64)))
        >>> sd = site_designs(lgm)
        >>> sd.names, sd.slices, sd.q
        (('y',), (slice(0, 5, None),), 5)
        >>> torch.allclose(sd.design.mv(torch.eye(2, dtype=torch.float64)), X)
        True
    """
    _check_lgm(lgm, "site_designs")
    groups = list(lgm.nongaussian_groups)
    names, slices, start = [], [], 0
    for g in groups:
        names.append(g.name)
        slices.append(slice(start, start + g.size))
        start += g.size
    if groups:
        design, offset = lgm.design(groups), lgm.offset(groups)
    else:
        design, offset = None, torch.zeros(0, dtype=lgm.dtype, device=lgm.device)
    return SiteDesigns(design, offset, tuple(names), tuple(slices), start)


def laplace_map(lgm, u0=None, *, z_start=1e-2, z_final=1e-12, z_factor=1e-2, max_newton=50, cg_tol=1e-10,
                newton_tol=1e-14, preconditioner="jacobi"):
    r"""MAP estimate ``argmax_u P(u | y)`` of a latent Gaussian model whose non-Gaussian sites are Laplace
    (e.g. :func:`~pyro_convexvb.design.compressive_sensing_model`): the minimiser of

    .. math:: \Psi_0(u) = \tfrac12 \|\tilde y - X u\|^2 + \sum_j |s_j| / b_j, \qquad s = B u,

    the reconstruction Seeger 2010 §5 reports. Over 80 lines: most of it is this docstring and the argument
    checks; the body is one loop over the ``z`` path. Solved as the limit ``z -> 0`` of the smooth problems
    ``Psi_z(u) = ||y~ - X u||^2/2 + sum_j sqrt(z + s_j^2)/b_j`` — the inner-loop criterion of Seeger 2010 Eq. (3)
    at a constant ``z`` (its footnote 2: ``z = 0`` is MAP estimation) — each minimised by the engine's
    Newton/IRLS inner loop with CG (Nickisch & Seeger 2009 §2.2), warm-started from the previous ``z``
    (``z_start``, ``z_start z_factor``, ... down to ``z_final``). ``0 <= Psi_z - Psi_0 <= sqrt(z) sum_j 1/b_j``.

    :param lgm: :class:`~pyro_convexvb.LatentGaussianModel` with ``n`` latents and Laplace site groups only
        (besides Gaussian ones).
    :param u0: ``(n,)`` start (default ``0``).
    :param float z_start: first smoothing ``z`` (units of ``s^2``); :param float z_final: last one.
    :param float z_factor: ratio of successive ``z``.
    :param int max_newton: Newton steps per ``z``.
    :param float cg_tol: final relative CG residual of the Newton systems.
    :param float newton_tol: Newton decrement test, relative to ``max(1, |Psi_z|)``.
    :param str preconditioner: CG preconditioner of the Newton systems, ``"jacobi"``, ``"fourier"``,
        ``"circulant"``, ``"block2"`` or ``"block4"`` (all but Jacobi for image models whose operators offer the
        structure, e.g.
        :func:`~pyro_convexvb.design.compressive_sensing_model`; see
        :meth:`~pyro_convexvb.infer.convex_relaxation.RelaxationProblem.preconditioner`).
    :returns: ``(u, info)``: ``u`` of shape ``(n,)``; ``info`` has ``objective`` (``Psi_0(u)``),
        ``smoothed_objective``, ``newton_steps`` (per ``z``), ``cg_iterations`` (per ``z``, one count per Newton
        system), ``converged`` and ``z`` (the path).
    :raises TypeError: if ``lgm`` is not a latent Gaussian model.
    :raises ValueError: if a non-Gaussian site group is not Laplace, or for an invalid ``u0`` or ``z`` path.

    A Newton loop that stops without meeting its decrement test issues a
    :class:`~pyro_convexvb.errors.ConvergenceWarning` with the final decrement.

    Example::

        >>> import torch
        >>> from pyro_convexvb.design import compressive_sensing_model, fourier_columns_operator
        >>> u = torch.rand(8, 8, dtype=torch.float64).reshape(-1)
        >>> y = fourier_columns_operator(8, 8, [0, 1, 2, 7]).mv(u)
        >>> lgm = compressive_sensing_model(y, 8, 8, [0, 1, 2, 7], 1e-3, 0.08, 0.16)
        >>> u_map, info = laplace_map(lgm)
        >>> u_map.shape, info["converged"]
        (torch.Size([64]), True)
    """
    _check_lgm(lgm, "laplace_map")
    groups = list(lgm.nongaussian_groups)
    for g in groups:
        if not isinstance(g.family, Laplace):
            raise ValueError(f"lgm: site group '{g.name}' is '{g.family.name}'; laplace_map needs Laplace sites")
    for name, v in (("z_start", z_start), ("z_final", z_final), ("z_factor", z_factor)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}: expected a finite number, got {v!r}")
    if not (0 < z_final <= z_start and 0 < z_factor < 1):
        raise ValueError("z_start, z_final, z_factor: expected 0 < z_final <= z_start and 0 < z_factor < 1")
    if isinstance(max_newton, bool) or not isinstance(max_newton, int) or max_newton < 1:
        raise ValueError(f"max_newton: expected an integer >= 1, got {max_newton!r}")
    prob = RelaxationProblem(lgm)
    if preconditioner != "jacobi":  # fails early, naming the argument, when the model offers no symbol
        prob.preconditioner(torch.ones(prob.q, dtype=lgm.dtype, device=lgm.device), preconditioner)
    u = torch.zeros(lgm.n, dtype=lgm.dtype, device=lgm.device) if u0 is None else u0.to(lgm.dtype).clone()
    if u.shape != (lgm.n,) or not bool(torch.isfinite(u).all()):
        raise ValueError(f"u0: expected a finite ({lgm.n},) tensor")
    zs = []
    z = float(z_start)
    while z > z_final * (1 + 1e-9):
        zs.append(z)
        z *= z_factor
    zs.append(float(z_final))
    q = sum(g.size for g in groups)
    steps, cg_its, inner = [], [], None
    for z in zs:
        zz = torch.full((q,), z, dtype=lgm.dtype, device=lgm.device)
        inner = inner_loop(prob, zz, u, max_newton=max_newton, cg_tol=cg_tol, newton_tol=newton_tol,
                           preconditioner=preconditioner)
        u = inner.u
        steps.append(inner.newton_steps)
        cg_its.append(list(inner.cg_iterations))
    if not inner.converged:
        warn(f"laplace_map: Newton stopped after {inner.newton_steps} steps at z = {zs[-1]:g} without meeting "
             f"its test (Newton decrement {inner.decrement:.3g})")
    psi0 = 0.5 * float(prob.quad(u))
    if groups:
        eta = lgm.design(groups).mv(u) + lgm.offset(groups)  # Laplace sites exp(-|eta_j - y_j| / b_j)
        eta = eta - torch.cat([g.family.params["y"] for g in groups])
        b = torch.cat([g.family.params["scale"] for g in groups])
        psi0 += float((eta.abs() / b).sum())
    return u, {"objective": psi0, "smoothed_objective": inner.objective, "newton_steps": steps, "cg_iterations": cg_its,
               "converged": bool(inner.converged), "z": zs}
