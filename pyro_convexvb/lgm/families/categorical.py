r"""Categorical (multinomial-logit, softmax) sites: ``y_i ~ Categorical(logits=eta_i)``, ``eta_i`` a ``K``-vector.

A *vector site*: each observation ``i`` reads ``K`` rows ``eta_i = W_i u + d_i`` of the design (row ``i K + k``
is class ``k``), and ``log t_i(eta_i) = eta_{i, y_i} - lse(eta_i)``, ``lse(eta) = log sum_k exp(eta_k)``.
Its expectations under a Gaussian need each row's ``K x K`` covariance block ``S_i = W_i V W_i^T``, not only
the marginal variances, so every method here takes ``(h, S)`` with ``h`` ``(n, K)`` and ``S`` ``(n, K, K)``.

Two local bounds ``f(h, S) >= -E_{N(eta | h, S)}[log t(eta)]`` for the dual (Khan et al. 2013, Eq. 10, with the
pairing ``alpha^T h + tr(Lambda S) / 2`` of their Eq. 19 taken blockwise), both with conjugate ``H(kappa) =
sum_k kappa_k log kappa_k`` at ``kappa = alpha + e_y`` in the simplex (``lse^*``):

* :class:`SoftmaxTightBound` (default): ``f = sup_kappa [kappa^T h + tr(C(kappa) S) / 2 - H(kappa)] - h_y`` with
  ``C(kappa) = diag(kappa) - kappa kappa^T``, the softmax curvature at the point of gradient ``kappa``; its
  conjugate is ``H(kappa)`` on ``{Lambda <= C(kappa)}`` (PSD order). The ``K``-class form of the tight
  Bernoulli-logit bound (``K = 2`` gives it back); valid by the argument of ``docs/dual_vg.md`` (§ Categorical
  sites).
* :class:`SoftmaxBohningBound`: ``f = lse(h) + tr(A S) / 2 - h_y`` with Böhning's curvature bound
  ``A = (I - 1 1^T / K) / 2 >= C(kappa)`` (Böhning 1992); conjugate ``H(kappa)`` on ``{Lambda <= A}``.

Exact expectations use a rule in the ``K - 1`` logit differences that is accurate at any covariance: Gauss-Hermite
in narrow directions, composite panels around the kinks of ``lse`` in wide ones (:func:`expected_lse`).
"""
import itertools
import math

import numpy as np
import pyro.distributions as dist
import torch

from ...errors import UnsupportedModelError
from .base import SiteFamily, _check_values, normal_panels

__all__ = ["Categorical", "SoftmaxTightBound", "SoftmaxBohningBound", "SOFTMAX_BOUNDS", "expected_lse",
           "softmax_curvature", "tight_kappa", "MAX_QUADRATURE_CLASSES", "QuadratureBudgetError", "wide_sd"]

SOFTMAX_BOUNDS = ("tight", "bohning")
#: Gauss-Hermite points per narrow dimension of the rule in the ``m = K - 1`` logit differences, by ``m``
_GH_POINTS = {1: 64, 2: 48, 3: 24, 4: 12}
#: the largest ``K`` whose exact expectation is computed (the rule is a product over ``K - 1`` dimensions)
MAX_QUADRATURE_CLASSES = max(_GH_POINTS) + 1
#: the most quadrature nodes one row may need (the panels multiply across wide directions)
NODE_BUDGET = 4_000_000
_RANGE = 9.0  # |z| <= 9 holds all but 2e-19 of a standard normal's mass
_PANEL_NODES = 8
_LEVELS = 2.0 ** np.arange(-2, 8)  # panel ends at z* +- width 2^k around each kink


class QuadratureBudgetError(ValueError):
    """The exact ``K``-class expectation of a row would need more than :data:`NODE_BUDGET` quadrature nodes."""


def wide_sd(points):
    """The widest standard deviation (logit units) of a direction whose kink of ``lse`` a ``points``-point
    Gauss-Hermite rule resolves to about 1e-10 (measured on ``E softplus``: 1e-10 at 1 sd with 24 points, 1.5 with
    48): a kink narrower than ``1 / wide_sd(points)`` standard deviations needs panels."""
    return 0.2 * math.sqrt(points)


def _tie_rows(m, size, dtype, device):
    """``(subsets, size - 1, m)``: for every set of ``size`` classes (class 0 the reference, ``d_0 = 0``), the
    differences ``d_{t_i} - d_{t_0}`` whose zeros are the points where the set ties."""
    eye = torch.cat([torch.zeros(1, m, dtype=dtype, device=device), torch.eye(m, dtype=dtype, device=device)])
    sets = list(itertools.combinations(range(m + 1), size))
    return torch.stack([torch.stack([eye[t] - eye[T[0]] for t in T[1:]]) for T in sets])


def _kink_cuts(mu, F, Z, l, points):
    """Sorted panel ends in ``z_l`` ``(n, B, C)`` given the outer coordinates ``Z`` ``(n, B, l)``, or ``None`` where
    Gauss-Hermite suffices. Where ``lse(0, d)`` turns, at the scale ``w`` of its sharpest pair in ``z_l``: at each
    pair's kink ``d_j = d_k`` that is sharp in ``z_l`` (width ``sqrt(1 + s^2) / |a|`` below ``1 / wide_sd(points)``,
    ``a`` its coefficient on ``z_l``, ``s`` the spread the inner directions add), and, outside the innermost
    direction, at every point where ``m - l + 1`` classes tie in the slice (the inner directions smooth the faces
    of lower dimension, not these: the second derivative of the inner integral jumps there). Around each, graded
    panels of widths ``w 2^k``, plus the unit grid; columns of ends clamped at both edges are trimmed."""
    n, B = Z.shape[:2]
    m = mu.shape[-1]
    pairs = _tie_rows(m, 2, mu.dtype, mu.device)[:, 0]
    Nz = torch.einsum("pm,nmk->npk", pairs, F)
    a = Nz[:, :, l]
    width = torch.sqrt(1 + (Nz[:, :, l + 1:] ** 2).sum(-1)) / a.abs().clamp_min(1e-300)
    sharp = width * wide_sd(points) < 1.0  # (n, pairs)
    finest = 1.0 / a.abs().amax(-1).clamp_min(1e-300)  # (n,)
    ties = finest * wide_sd(points) < 1.0 if l < m - 1 else torch.zeros_like(finest, dtype=torch.bool)
    if not bool(sharp.any() or ties.any()):
        return None
    o = (mu @ pairs.T)[:, None, :] + torch.einsum("nbl,npl->nbp", Z, Nz[:, :, :l])
    kinks = [torch.where(sharp[:, None, :], -o / torch.where(a.abs() > 0, a, torch.ones_like(a))[:, None, :], _RANGE)]
    widths = [width[:, None, :].expand(n, B, -1)]
    if bool(ties.any()):
        G = torch.einsum("sim,nmk->nsik", _tie_rows(m, m - l + 1, mu.dtype, mu.device), F)  # (n, sets, m - l, m)
        rhs = torch.einsum("sim,nm->nsi", _tie_rows(m, m - l + 1, mu.dtype, mu.device), mu)[:, None] + \
            torch.einsum("nsik,nbk->nbsi", G[..., :l], Z)
        square = G[..., l:]
        ok = (torch.linalg.matrix_rank(square) == m - l) & ties[:, None]  # (n, sets); degenerate ties: none
        eye = torch.eye(m - l, dtype=mu.dtype, device=mu.device)
        first = torch.linalg.solve(torch.where(ok[..., None, None], square, eye).transpose(-1, -2), eye[0].expand(
            *square.shape[:2], -1))  # (n, sets, m - l): the first row of square^{-1}
        tie = -(first[:, None] * rhs).sum(-1)
        kinks.append(torch.where(ok[:, None, :], tie, _RANGE))
        widths.append(finest[:, None, None].expand(n, B, tie.shape[-1]))
    kink, wd = torch.cat(kinks, -1), torch.cat(widths, -1)
    off = (wd[..., None] * torch.as_tensor(_LEVELS, dtype=mu.dtype, device=mu.device)).flatten(-2)
    kk = kink.repeat_interleave(len(_LEVELS), -1)
    grid = torch.arange(-int(_RANGE), int(_RANGE) + 1, dtype=mu.dtype, device=mu.device).expand(n, B, -1)
    cuts, _ = torch.sort(torch.cat([grid, kink, kk - off, kk + off], -1).clamp(-_RANGE, _RANGE), -1)
    first_col = int((cuts > -_RANGE).int().argmax(-1).min()) - 1
    last_col = int((cuts < _RANGE).sum(-1).max()) + 1
    return cuts[..., max(first_col, 0):last_col]


def _difference_rule(mu, F, wide, points):
    """Nodes ``d`` ``(n, P, m)`` and weights ``(n, P)`` of ``E_{N(d | mu, F F^T)}``: ``d = mu + F z``, the first
    ``m - wide`` coordinates of ``z`` by Gauss-Hermite (``points`` each), the last ``wide`` ones (the widest) one
    after another by :func:`_kink_cuts` panels, innermost last."""
    n, m = mu.shape
    gx, gw = np.polynomial.hermite_e.hermegauss(points)
    gx = torch.as_tensor(gx, dtype=mu.dtype, device=mu.device)
    gw = torch.as_tensor(gw / math.sqrt(2 * math.pi), dtype=mu.dtype, device=mu.device)
    Z, W = mu.new_zeros(n, 1, 0), mu.new_ones(n, 1)
    for l in range(m):
        B = Z.shape[1]
        # the unit grid alone has 2 R panels: refuse before building what would not fit
        too_big = l >= m - wide and B * 2 * _RANGE * _PANEL_NODES > NODE_BUDGET
        cuts = _kink_cuts(mu, F, Z, l, points) if l >= m - wide and not too_big else None
        P = NODE_BUDGET + 1 if too_big else points if cuts is None else (cuts.shape[-1] - 1) * _PANEL_NODES
        if B * P > NODE_BUDGET:
            raise QuadratureBudgetError(
                f"expected_lse: a row's {m + 1}-class expectation with {wide} wide directions (logit-difference sds "
                f"above {wide_sd(points):.3g}) needs more than {NODE_BUDGET:,} quadrature nodes")
        t, wt = (gx.expand(n, B, -1), gw.expand(n, B, -1)) if cuts is None else normal_panels(cuts, _PANEL_NODES)
        Z = torch.cat([Z[:, :, None, :].expand(n, B, P, l), t[..., None]], -1).reshape(n, B * P, l + 1)
        W = (W[:, :, None] * wt).reshape(n, B * P)
    return mu[:, None, :] + torch.einsum("nbk,nmk->nbm", Z, F), W


def _lse_moments(h, S, points):
    """``E[lse(eta)]``, ``E[softmax(eta)]`` and ``E[C(softmax(eta))]`` per row for ``eta ~ N(h, S)``, accurate at any
    width (see :func:`expected_lse`)."""
    n, K = h.shape
    m = K - 1
    Dm = torch.cat([-torch.ones(m, 1, dtype=h.dtype, device=h.device), torch.eye(m, dtype=h.dtype, device=h.device)], 1)
    C = Dm @ S @ Dm.T
    evals, U = torch.linalg.eigh(0.5 * (C + C.transpose(-1, -2)))
    sd = evals.clamp_min(0).sqrt()  # ascending: the widest directions last
    F, mu = U * sd.unsqueeze(-2), h[:, 1:] - h[:, :1]
    wide = (sd > wide_sd(points)).sum(-1)
    value, p1, p2 = h.new_empty(n), h.new_empty(n, K), h.new_empty(n, K, K)
    panel_nodes = (2 * int(_RANGE) + 1 + m * (m + 1) // 2 * (1 + 2 * len(_LEVELS))) * _PANEL_NODES
    for q in wide.unique().tolist():
        rows = (wide == q).nonzero().squeeze(-1)
        chunk = max(1, 4_000_000 // (points ** (m - q) * panel_nodes ** q * K))  # at most ~4e6 node values at once
        for i in range(0, rows.numel(), chunk):
            r = rows[i:i + chunk]
            d, w = _difference_rule(mu[r], F[r], q, points)
            eta = torch.cat([torch.zeros_like(d[..., :1]), d], -1)  # lse(eta) = eta_0 + lse(0, d)
            p = torch.softmax(eta, -1)
            value[r] = h[r, 0] + (torch.logsumexp(eta, -1) * w).sum(-1)
            p1[r] = torch.einsum("npk,np->nk", p, w)
            p2[r] = torch.einsum("npk,npj,np->nkj", p, p, w)
    return value, p1, torch.diag_embed(p1) - p2


class _ExpectedLse(torch.autograd.Function):
    """``E_{N(eta | h, S)}[lse(eta)]`` per row, with the Stein/Price derivatives ``d/dh = E[softmax(eta)]`` and
    ``d/dS = E[C(softmax(eta))] / 2`` from the same nodes (no derivative through the factorisation of ``S``, which
    may be singular). Differentiable once."""

    @staticmethod
    def forward(ctx, h, S, points):
        value, d_h, curv = _lse_moments(h.detach(), S.detach(), points)
        ctx.save_for_backward(d_h, 0.5 * curv)
        return value

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        d_h, d_S = ctx.saved_tensors
        return grad[:, None] * d_h, grad[:, None, None] * d_S, None


def softmax_curvature(kappa):
    """``C(kappa) = diag(kappa) - kappa kappa^T``, ``(n, K, K)`` for ``kappa`` ``(n, K)``."""
    return torch.diag_embed(kappa) - kappa.unsqueeze(-1) * kappa.unsqueeze(-2)


def expected_lse(h, S, points=None):
    r"""``E_{N(eta | h_i, S_i)}[log sum_k exp(eta_k)]`` per row, accurate at any covariance.

    ``lse(eta) = eta_0 + lse(0, d)`` with the ``m = K - 1`` differences ``d = eta_{1:} - eta_0 ~ N(mu, C)``; in the
    eigenbasis ``d = mu + F z`` of ``C``, narrow directions (sd at most :func:`wide_sd`) take a Gauss-Hermite rule and
    wide ones composite Gauss-Legendre panels whose ends follow the kinks ``eta_j = eta_k`` of ``lse`` (an iterated
    rule: the kinks of an outer direction are those the inner directions do not smooth). The tensor Gauss-Hermite
    rule in ``eta`` alone was 5e-4 off at logit variances of 10 and 8e-2 at 100; this rule is within 1e-12 of
    dense grids up to variances of 1,000.

    :param torch.Tensor h: ``(n, K)`` means.
    :param torch.Tensor S: ``(n, K, K)`` symmetric PSD covariances (singular allowed, e.g. a class fixed at 0).
    :param int points: Gauss-Hermite points per narrow direction (default 64, 48, 24, 12 for ``K = 2..5``).
    :returns: ``(n,)``; differentiable once in ``h`` and ``S``.
    :raises ValueError: for ``K > 5`` without ``points``; :class:`QuadratureBudgetError` (a ``ValueError``) for a
        row with so many wide directions that the rule needs more than :data:`NODE_BUDGET` nodes.

    Example::

        >>> import math, torch
        >>> h = torch.zeros(1, 2, dtype=torch.float64)
        >>> abs(float(expected_lse(h, torch.zeros(1, 2, 2, dtype=torch.float64))) - math.log(2)) < 1e-14
        True
    """
    if h.shape[-1] == 1:
        return h[:, 0]
    return _ExpectedLse.apply(h, S, _points(h.shape[-1], points))


def _points(K, points):
    """The Gauss-Hermite points per narrow direction: ``points``, else the default for ``K`` classes."""
    if points is None and K - 1 not in _GH_POINTS:
        raise ValueError(f"expected_lse: the {K}-class expectation needs a {K - 1}-dimensional quadrature rule; it is "
                         f"computed up to K = {MAX_QUADRATURE_CLASSES} classes (pass points=P for P^{K - 1} nodes)")
    return points or _GH_POINTS[K - 1]


def _simplex_newton(h, S, c, iters=100):
    """Newton's method on the simplex for :func:`tight_kappa`'s ``phi`` (the KKT system with the constraint ``1^T
    kappa = 1``), a fraction-to-the-boundary step and backtracking on ``phi``, from ``softmax(h)``: ``(n, K)``, every
    share at least 1e-300."""
    n, K = h.shape

    def phi(k):
        return (k * c).sum(-1) - 0.5 * (k * (S @ k.unsqueeze(-1)).squeeze(-1)).sum(-1) - \
            torch.special.xlogy(k, k).sum(-1)

    kappa = torch.softmax(h, -1).clamp_min(1e-300)
    kappa = kappa / kappa.sum(-1, keepdim=True)
    ones = torch.ones(n, K, 1, dtype=h.dtype, device=h.device)
    zero = torch.zeros(n, 1, 1, dtype=h.dtype, device=h.device)
    for _ in range(iters):
        grad = c - (S @ kappa.unsqueeze(-1)).squeeze(-1) - torch.log(kappa) - 1
        H = -S - torch.diag_embed(1.0 / kappa)
        KKT = torch.cat([torch.cat([H, ones], -1), torch.cat([ones.transpose(-1, -2), zero], -1)], -2)
        rhs = torch.cat([-grad, torch.zeros(n, 1, dtype=h.dtype, device=h.device)], -1)
        step = torch.linalg.solve(KKT, rhs)[:, :K]
        dec = -(step * (H @ step.unsqueeze(-1)).squeeze(-1)).sum(-1)  # Newton decrement^2 (>= 0)
        if float(dec.max()) < 1e-24:
            break
        if float(dec.max()) < 1e-8:  # inside the quadratic region: full steps
            kappa = (kappa + step).clamp_min(1e-300)
            kappa = kappa / kappa.sum(-1, keepdim=True)
            continue
        neg = step < 0
        tmax = torch.where(neg, -kappa / torch.where(neg, step, -torch.ones_like(step)), torch.full_like(step, math.inf))
        t = torch.clamp(0.99 * tmax.min(-1).values, max=1.0)
        f0 = phi(kappa)
        for _ in range(60):
            new = kappa + t.unsqueeze(-1) * step
            ok = ((new > 0).all(-1) & (phi(new) >= f0 + 1e-4 * t * dec)) | (t < 1e-12)
            if bool(ok.all()):
                break
            t = torch.where(ok, t, 0.5 * t)
        if bool((t < 1e-12).all()):
            break
        kappa = (kappa + t.unsqueeze(-1) * step).clamp_min(1e-300)
        kappa = kappa / kappa.sum(-1, keepdim=True)
    return kappa


def tight_kappa(h, S, iters=100):
    r"""``kappa* = argmax_{kappa in simplex} phi(kappa)``, ``phi(kappa) = kappa^T h + tr(C(kappa) S) / 2 - H(kappa)``,
    ``(n, K)``, certified to rounding.

    ``phi(kappa) = kappa^T c - kappa^T S kappa / 2 - H(kappa)`` (``c = h + diag(S) / 2``) is strictly concave; its
    maximiser solves ``log kappa = c - S kappa + const``, so with ``kappa = softmax(z)`` it is the root of ``r(z) = z -
    c + S softmax(z)`` (up to a multiple of ``1``). Two phases: Newton's method on the simplex
    (:func:`_simplex_newton`, globally convergent on ``phi``, but a share that vanishes at the maximiser only shrinks
    100-fold a step there: at logit variances of 1e4 it stopped hundreds of nats short), then Newton's method on ``r``
    in the logits ``z = log kappa``, where such a share moves like the others: the step ``d = -(I + S C)^{-1} r`` (``C
    = C(kappa)``) descends ``|r|^2`` and ascends ``phi`` (slope ``r^T (C^{-1} + S)^{-1} r >= 0``), and a backtracking
    line search accepts a step that does either. (From ``z = h`` alone it cycles where ``softmax(h)`` is nearly one-hot
    and ``C`` nearly 0.)

    The certificate: writing ``-kappa^T S kappa / 2 = min_w [w^T S w / 2 - w^T S kappa]`` and exchanging max and min,
    ``max phi = min_w lse(c - S w) + w^T S w / 2``, so ``g(kappa) - phi(kappa) >= phi* - phi(kappa) >= 0`` with ``g``
    that dual at ``w = kappa``; the iterations stop once it is below ``1e-11 (1 + |phi|)``.

    :raises RuntimeError: naming the rows not certified after ``iters`` steps.
    """
    h, S = h.detach(), 0.5 * (S.detach() + S.detach().transpose(-1, -2))
    c = h + 0.5 * torch.diagonal(S, dim1=-2, dim2=-1)
    n, K = h.shape
    eye = torch.eye(K, dtype=h.dtype, device=h.device)

    def at(z):
        """``(kappa, phi, r, dual - primal gap, its tolerance)`` at the logits ``z``."""
        k = torch.softmax(z, -1)
        Sk = (S @ k.unsqueeze(-1)).squeeze(-1)
        f = (k * c).sum(-1) - 0.5 * (k * Sk).sum(-1) - (k * torch.log_softmax(z, -1)).sum(-1)
        r = z - c + Sk
        g = torch.logsumexp(c - Sk, -1) + 0.5 * (k * Sk).sum(-1) - f  # the dual at w = kappa, minus phi
        return k, f, r - r.mean(-1, keepdim=True), g, 1e-11 * (1 + f.abs())

    z = torch.log(_simplex_newton(h, S, c, iters))
    for _ in range(iters):
        k, f0, r, g, tol = at(z)
        done = g <= tol
        if bool(done.all()):
            return k
        Ck = softmax_curvature(k)
        d = -torch.linalg.solve(eye + S @ Ck, r.unsqueeze(-1)).squeeze(-1)
        slope = -(r * (Ck @ d.unsqueeze(-1)).squeeze(-1)).sum(-1)  # of phi along d (>= 0)
        r2, t = (r * r).sum(-1), torch.ones(n, dtype=h.dtype, device=h.device)
        for _ in range(60):  # Armijo on |r|^2 (slope -2 |r|^2) or on phi
            _, ft, rt, _, _ = at(z + t.unsqueeze(-1) * d)
            ok = ((rt * rt).sum(-1) <= (1 - 1e-4 * t) * r2) | (ft >= f0 + 1e-4 * t * slope) | done | (t < 1e-12)
            if bool(ok.all()):
                break
            t = torch.where(ok, t, 0.5 * t)
        z = torch.where(done.unsqueeze(-1), z, z + t.unsqueeze(-1) * d)
    k, _, _, g, tol = at(z)
    bad = (g > tol).nonzero().reshape(-1)
    if bad.numel():
        raise RuntimeError(f"tight_kappa: the maximum of the tight softmax bound was not certified in {iters} Newton "
                           f"steps at rows {bad[:5].tolist()} (duality gap {float(g.max()):.3g}; logit variances up to "
                           f"{float(torch.diagonal(S, dim1=-2, dim2=-1).max()):.3g}): fit with bound='bohning', whose "
                           "curvature is fixed, or give the weights a tighter prior")
    return k


def _onehot(y, K, like):
    return torch.nn.functional.one_hot(y.long(), K).to(like)


def _entropy(kappa):
    """``H(kappa) = sum_k kappa_k log kappa_k`` (``0 log 0 = 0``), ``(n,)``."""
    return torch.special.xlogy(kappa, kappa).sum(-1)


class _SoftmaxBound:
    """Block local bound of ``n`` Categorical sites: ``f(h, S)``, the conjugate ``H(kappa)`` on
    ``{Lambda <= ell(kappa)}`` with ``kappa = alpha + e_y`` in the simplex."""

    block = True

    def __init__(self, family):
        self.family = family
        self.K = family.num_classes

    def __len__(self):
        return len(self.family)

    @property
    def num_obs(self):
        return self.family.num_obs

    def onehot(self, like):
        return _onehot(self.family.params["y"], self.K, like)

    def psi(self, kappa):
        """The conjugate's value ``H(kappa)`` ``(n,)`` (``alpha = kappa - e_y``)."""
        return _entropy(kappa)

    def kappa_star(self, h, S):
        """``kappa`` of the dual optimum for block marginals ``(h, S)``: ``df/dh + e_y``."""
        raise NotImplementedError

    def fenchel_young_residual(self, kappa, h, S):
        """``f(h, S) + f*(alpha, ell) - alpha^T h - tr(ell S) / 2 >= 0`` per row, ``alpha = kappa - e_y``."""
        alpha = kappa - self.onehot(kappa)
        lam = self.ell(kappa)
        return self.f(h, S) + self.psi(kappa) - (alpha * h).sum(-1) - 0.5 * (lam * S).sum((-1, -2))

    def exact_expected_log_prob(self, h, S):
        return self.family.expected_log_prob(h, S)


class SoftmaxTightBound(_SoftmaxBound):
    r"""``f(h, S) = sup_{kappa in simplex} [kappa^T h + tr(C(kappa) S) / 2 - H(kappa)] - h_y``; site precision block
    ``ell(kappa) = C(kappa) = diag(kappa) - kappa kappa^T`` (``docs/dual_vg.md``, § Categorical sites)."""

    name = "tight"

    def f(self, h, S):
        # kappa* detached: by the envelope theorem the first derivatives of f stay exact under autograd
        k = tight_kappa(h, S)
        return (k * h).sum(-1) + 0.5 * (softmax_curvature(k) * S).sum((-1, -2)) - _entropy(k) - \
            (self.onehot(h) * h).sum(-1)

    def ell(self, kappa):
        return softmax_curvature(kappa)

    def kappa_star(self, h, S):
        return tight_kappa(h, S)


class SoftmaxBohningBound(_SoftmaxBound):
    r"""Böhning's bound ``f(h, S) = lse(h) + tr(A S) / 2 - h_y``, ``A = (I - 1 1^T / K) / 2`` (Böhning 1992): the
    site precision block is pinned at ``A``."""

    name = "bohning"

    def A(self, like):
        K = self.K
        return 0.5 * (torch.eye(K, dtype=like.dtype, device=like.device) - 1.0 / K)

    def f(self, h, S):
        return torch.logsumexp(h, -1) + 0.5 * (self.A(h) * S).sum((-1, -2)) - (self.onehot(h) * h).sum(-1)

    def ell(self, kappa):
        return self.A(kappa).expand(kappa.shape[0], self.K, self.K)

    def kappa_star(self, h, S):
        return torch.softmax(h, -1)


class Categorical(SiteFamily):
    r"""``t_i(eta_i) = softmax(eta_i)_{y_i}``: ``n`` observations of ``K`` classes, a vector site of ``K`` design
    rows each (row ``i K + k`` is ``eta_{i k}``; ``len()`` is ``n K``, the number of design rows).

    :param torch.Tensor y: ``(n,)`` labels in ``{0, ..., K - 1}`` (any real dtype holding integers).
    :param int num_classes: ``K >= 2``.

    Example::

        >>> import torch
        >>> fam = Categorical(torch.tensor([2., 0.], dtype=torch.float64), num_classes=3)
        >>> eta = torch.tensor([0., 0., 1., 2., 0., 0.], dtype=torch.float64)
        >>> torch.allclose(fam.log_prob(eta), torch.distributions.Categorical(logits=eta.reshape(2, 3)).log_prob(
        ...     torch.tensor([2, 0])).double())
        True
    """

    name = "categorical_logit"
    distributions = (dist.Categorical, torch.distributions.Categorical)
    pyro_form = "Categorical(logits=...)"
    no_potential = (
        "Categorical (softmax) sites are not super-Gaussian potentials: each row's likelihood is a function of a "
        "K-vector of logits, log-concave but not a product of scalar super-Gaussian factors t(s) = exp(beta s - "
        "rho(s)) (Nickisch & Seeger 2009, §2), so the relaxation has no width per site for them")
    #: extraction reads ``K`` predictor rows per observation (:meth:`vector_rows`)
    vector_site = True

    def __init__(self, y, num_classes):
        num_classes = int(num_classes)
        if num_classes < 2:
            raise ValueError(f"num_classes: a Categorical site needs K >= 2 classes, got {num_classes}")
        _check_values("y", y, lambda v: (v >= 0) & (v < num_classes) & (v == torch.round(v)),
                      f"class labels in 0 .. {num_classes - 1}")
        super().__init__(y=y)
        self.num_classes = num_classes

    @property
    def block_size(self):
        return self.num_classes

    @property
    def num_obs(self):
        return int(self.params["y"].shape[0])

    def __len__(self):
        return self.num_obs * self.num_classes

    def blocks(self, eta):
        """``(n, K)`` view of a ``(n K,)`` predictor vector."""
        return eta.reshape(self.num_obs, self.num_classes)

    def log_prob(self, eta):
        """``log softmax(eta_i)_{y_i}``, ``(n,)``, for ``eta`` ``(n K,)``."""
        e = self.blocks(eta)
        return torch.log_softmax(e, -1).gather(-1, self.params["y"].long().unsqueeze(-1)).squeeze(-1)

    def expected_log_prob(self, mean, cov, num_points=None):
        r"""``E_{N(eta_i | h_i, S_i)}[log softmax(eta_i)_{y_i}] = h_{i y_i} - E[lse(eta_i)]``, ``(n,)``.

        :param mean: ``(n K,)`` or ``(n, K)`` block means ``h``.
        :param cov: ``(n, K, K)`` covariance blocks ``S_i`` of each row's logits (marginal variances alone do not
            determine the expectation: a ``(n K,)`` vector is refused).
        :param num_points: Gauss-Hermite points per narrow direction of the logit differences (default by ``K``,
            :func:`expected_lse`; at most 10^6 nodes in all, else ValueError).
        """
        h, points = self._moments(mean, cov, num_points)
        hy = h.gather(-1, self.params["y"].long().unsqueeze(-1)).squeeze(-1)
        return hy - expected_lse(h, cov, points=points)

    def predictive_mean(self, mean, cov, num_points=None):
        """``E[softmax(eta_i)]``, ``(n, K)``: the derivative of :func:`expected_lse` in ``h``, from its nodes (the
        arguments as :meth:`expected_log_prob`'s)."""
        h, points = self._moments(mean, cov, num_points)
        return _lse_moments(h.detach(), cov.detach(), _points(self.num_classes, points))[1]

    def _moments(self, mean, cov, num_points):
        """``(h (n, K), points or None)``: the block means, after refusing covariance blocks of the wrong shape and a
        quadrature order that cannot be honoured."""
        K = self.num_classes
        if cov.dim() != 3 or tuple(cov.shape) != (self.num_obs, K, K):
            raise ValueError(f"cov: a Categorical site's expectation needs each row's {K} x {K} covariance block, shape "
                             f"({self.num_obs}, {K}, {K}); got {tuple(cov.shape)} (marginal variances alone do not "
                             "determine it)")
        if num_points is not None and (int(num_points) < 1 or int(num_points) ** (K - 1) > 10 ** 6):
            raise ValueError(f"num_points: Gauss-Hermite points per narrow direction of the {K - 1} logit "
                             f"differences, at least 1 and at most 10^6 nodes in all; got {num_points}")
        return mean.reshape(self.num_obs, K), None if num_points is None else int(num_points)

    def super_gaussian(self):
        raise UnsupportedModelError(self.name, self.no_potential)

    def local_bound(self, kind="tight", xi=None):
        """:class:`SoftmaxTightBound` (``kind="tight"``) or :class:`SoftmaxBohningBound` (``"bohning"``).

        :raises ValueError: for another ``kind`` or a ``xi`` (the Jaakkola tangent points have no softmax form here).
        """
        if xi is not None:
            raise ValueError("xi: the Jaakkola tangent points apply to Bernoulli-logit sites; a Categorical site takes "
                             "bound='tight' or 'bohning' without xi")
        if kind == "tight":
            return SoftmaxTightBound(self)
        if kind == "bohning":
            return SoftmaxBohningBound(self)
        raise ValueError(f"bound: Categorical (softmax) sites take the bound 'tight' or 'bohning', got {kind!r}")

    def subset(self, index):
        raise NotImplementedError("Categorical sites are vector sites: select observations, not design rows")

    def to(self, dtype=None, device=None):
        return Categorical(self.params["y"].to(dtype=dtype, device=device), self.num_classes)

    def tempered(self, weight):
        raise UnsupportedModelError(self.name, "a Categorical site under poutine.scale (weighted rows) is not "
                                               "supported by the latent-Gaussian engines; fit it unweighted or with "
                                               "an SVI engine")

    @classmethod
    def predictor(cls, d):
        """The centred logits ``eta - mean_k(eta)`` of ``Categorical(logits=eta)``: torch stores the normalised
        ``eta - lse(eta)``, which is not affine in ``eta``, but the likelihood depends on ``eta`` only up to a
        shift per row, and centring the stored logits removes the ``lse`` exactly."""
        if not isinstance(d, cls.distributions):
            return None
        return d.logits - d.logits.mean(-1, keepdim=True)

    @classmethod
    def refusal(cls, d):
        if isinstance(d, dist.OrderedLogistic):
            return ("OrderedLogistic (ordinal) sites are not read: their class probabilities are differences of "
                    "sigmoids at the cutpoints, not a softmax of logits affine in the latents")
        if getattr(d, "_param", None) is not None and d._param is d.__dict__.get("probs"):
            return ("Categorical(probs=...) is not read as a linear predictor; write Categorical(logits=eta) with eta "
                    "affine in the latents (e.g. X @ W)")
        return None

    @classmethod
    def vector_rows(cls, name, d, eta, y, dtype, batch):
        """``(eta (n K,), y (n,), obs_shape, K)`` of an observed Categorical site of (plate-expanded) batch shape
        ``batch``: the logits flattened row-major over the batch and the class axis, the labels over the batch.

        :raises UnsupportedModelError: naming ``name`` for labels that are not integers in ``[0, K)``.
        """
        K = int(d.logits.shape[-1])
        eta = eta.expand(batch + (K,)).reshape(-1).to(dtype)
        y = torch.as_tensor(y).expand(batch).reshape(-1)
        yf = y.to(dtype)
        if not bool(((yf >= 0) & (yf < K) & (yf == torch.round(yf))).all()):
            raise UnsupportedModelError(name, f"Categorical labels must be integers in [0, {K}), found "
                                              f"{y[(yf < 0) | (yf >= K) | (yf != torch.round(yf))][:3].tolist()}")
        return eta, yf, batch, K

    @classmethod
    def from_site(cls, site, y, num_classes):
        return cls(y, num_classes)

    def __repr__(self):
        return f"Categorical(rows={self.num_obs}, classes={self.num_classes})"
