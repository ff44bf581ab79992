"""Vectorised safeguarded Newton/bisection for many independent scalar problems.

The convex relaxation needs, for every site at once, roots of increasing scalar functions and
minimisers of convex scalar functions: ``gamma_* = argmin_gamma k(x, gamma)`` and
``x_*(gamma) = argmin_x l(x, gamma)`` in the appendix of Nickisch & Seeger 2009 ("Implicit computation of
h_i and h_i*", footnote 2: "first constructing a bracket, then using a robust combination of
Newton and bisection steps").  All routines here work elementwise on tensors of any shape; the
user function is evaluated on the whole tensor at every iteration (problems that are done keep
their value), so a problem set of size ``q`` costs ``O(q)`` per iteration.

* :func:`newton_bisect_root` -- root of an increasing ``f`` in a sign-changing bracket;
* :func:`expand_bracket` -- build such brackets from a starting point inside ``(lower, upper)``;
* :func:`minimize_convex_scalar` -- minimiser of convex ``k`` from ``(k', k'')`` on an interval
  (closed or open, finite or infinite), including minimisers on the boundary.
"""
import math

import torch

from ..errors import ConvergenceError

__all__ = ["newton_bisect_root", "expand_bracket", "minimize_convex_scalar"]



def _broadcast_shapes(*shapes):
    """NumPy broadcasting of shapes (``torch.broadcast_shapes`` imports torch's symbolic-shape machinery,
    and with it sympy, on first use: about half a second of the first fit in a process)."""
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for shape in shapes:
        for i, d in enumerate(shape, start=ndim - len(shape)):
            if d != 1:
                if out[i] not in (1, d):
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} are not broadcastable")
                out[i] = d
    return torch.Size(out)

def _as_tensor(x, like=None):
    if isinstance(x, torch.Tensor):
        return x
    if like is not None:
        return torch.as_tensor(x, dtype=like.dtype, device=like.device)
    return torch.as_tensor(x, dtype=torch.get_default_dtype())


def _prepare(*xs):
    """Broadcast numbers/tensors (``None`` passes through) to one floating dtype, device and shape."""
    tensors = [x for x in xs if isinstance(x, torch.Tensor)]
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    dtype = floats[0] if floats else torch.get_default_dtype()
    for d in floats[1:]:
        dtype = torch.promote_types(dtype, d)
    device = tensors[0].device if tensors else None
    out = [None if x is None else torch.as_tensor(x, dtype=dtype, device=device) for x in xs]
    shaped = iter(torch.broadcast_tensors(*[t for t in out if t is not None]))
    return [None if t is None else next(shaped).clone() for t in out]


def _evaluate(fun, x, need_derivative=True):
    out = fun(x)
    if isinstance(out, (tuple, list)):
        f = out[0]
        df = out[1] if len(out) > 1 else None
    else:
        f, df = out, None
    f = _as_tensor(f, x)
    if need_derivative:
        if df is None:
            raise ValueError("fun: must return (f, f') for Newton steps")
        df = _as_tensor(df, x)
        shape = _broadcast_shapes(x.shape, f.shape, df.shape)
        return f.expand(shape), df.expand(shape)
    return f.expand(_broadcast_shapes(x.shape, f.shape)), None


def _grow(f, *ts):
    """Expand state tensors to the problems' shape and dtype, known after evaluating ``f``.

    Problems are defined by the user function (its closure may hold per-problem parameters),
    so ``lo``/``hi`` given as numbers take the shape and precision of its output.
    """
    out = []
    for t in ts:
        if t is not None:
            if t.is_floating_point() and f.is_floating_point():
                t = t.to(torch.promote_types(t.dtype, f.dtype))
            if t.shape != f.shape:
                t = t.expand(_broadcast_shapes(t.shape, f.shape)).clone()
        out.append(t)
    return out


def _midpoint(a, b):
    """Bisection point: geometric mean for wide brackets of one sign, arithmetic mean otherwise."""
    mid = a + 0.5 * (b - a)
    geo_pos = (a > 0) & (b > 4.0 * a)
    geo_neg = (b < 0) & (a < 4.0 * b)
    if bool(geo_pos.any()) or bool(geo_neg.any()):
        g = torch.sqrt(a.abs()) * torch.sqrt(b.abs())
        mid = torch.where(geo_pos, g, torch.where(geo_neg, -g, mid))
    return mid


def newton_bisect_root(
    fun,
    lo,
    hi,
    *,
    x0=None,
    xtol=1e-12,
    xatol=0.0,
    ftol=0.0,
    max_iter=100,
    check_bracket=True,
):
    """Roots of many increasing scalar functions by safeguarded Newton/bisection.

    Over 80 lines: most of it is this docstring (a safeguarded solver's contract); the body is under 80.

    For every problem, ``f`` must be increasing on ``[lo, hi]`` with ``f(lo) <= 0 <= f(hi)``.
    The bracket ``[a, b]`` is updated from the sign of ``f`` at every iterate, so it shrinks at
    every step.  A Newton step ``x - f/f'`` is taken if it stays strictly inside the bracket, ``f'
    > 0`` and it is at most half the step before last (Numerical Recipes' ``rtsafe`` rule);
    otherwise the bracket is bisected (geometrically when ``0 < a`` and ``b > 4a``, or mirrored
    for negative brackets, so brackets spanning many orders of magnitude shrink quickly).

    A problem has converged when ``f(x) == 0`` (or ``|f| <= ftol``), when the last step or the
    bracket width is ``<= xtol * |x| + xatol``, or when the bracket has shrunk to a few ulps.

    :param fun: ``x -> (f(x), f'(x))``, elementwise on tensors of the problems' shape.
    :param lo: lower ends (tensor or number, broadcastable), finite.
    :param hi: upper ends, finite, ``hi >= lo``.
    :param x0: starting points (clipped into the bracket); default the bracket midpoints.
    :param xtol: relative tolerance on ``x``.
    :param xatol: absolute tolerance on ``x`` (needed for roots at exactly ``0``).
    :param ftol: tolerance on ``|f|``.
    :param max_iter: iterations (one evaluation of ``fun`` each).
    :param check_bracket: evaluate ``f(lo)`` and ``f(hi)`` first and raise if a bracket has no
        sign change (costs two evaluations).
    :returns: ``(x, converged)``: roots and a boolean mask of the same shape.  Problems where
        ``f`` returned NaN are reported as not converged.
    :raises ValueError: non-finite or reversed brackets, or (with ``check_bracket``) ``f(lo) > 0``
        or ``f(hi) < 0``.

    Example::

        >>> import torch
        >>> c = torch.tensor([2.0, 3.0, 10.0], dtype=torch.float64)
        >>> x, ok = newton_bisect_root(lambda x: (x * x - c, 2 * x), 0.0, 10.0)
        >>> bool(ok.all()), torch.allclose(x, c.sqrt())
        (True, True)
    """
    a, b, x = _prepare(lo, hi, x0)
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
        raise ValueError("lo/hi: brackets must be finite (use expand_bracket or minimize_convex_scalar for infinite ones)")
    if bool((a > b).any()):
        raise ValueError(f"lo/hi: lo > hi for {int((a > b).sum())} problem(s)")
    done = torch.zeros_like(a, dtype=torch.bool)
    converged = torch.zeros_like(done)
    if check_bracket:
        fa, _ = _evaluate(fun, a, False)
        fb, _ = _evaluate(fun, b, False)
        a, b, x, fb, done = _grow(fa, a, b, x, fb, done)
        a, b, x, fa, done = _grow(fb, a, b, x, fa, done)
        bad = ~((fa <= 0) & (fb >= 0))
        if bool(bad.any()):
            raise ValueError(
                f"lo/hi: f(lo) <= 0 <= f(hi) is violated (or f is NaN) for {int(bad.sum())} problem(s); "
                "the bracket does not contain a root of the increasing function"
            )
        x_init = _midpoint(a, b) if x is None else x
        hit_a, hit_b = fa.abs() <= ftol, fb.abs() <= ftol
        x = torch.where(hit_a, a, torch.where(hit_b, b, x_init))
        done = hit_a | hit_b
        converged = done.clone()
    elif x is None:
        x = _midpoint(a, b)
    x = torch.minimum(torch.maximum(x, a), b)
    tiny = torch.finfo(a.dtype).eps
    dx_old = b - a
    dx = dx_old.clone()
    for _ in range(int(max_iter)):
        if bool(done.all()):
            break
        f, df = _evaluate(fun, x)
        if f.shape != x.shape or f.dtype != x.dtype:
            x, a, b, dx, dx_old, done, converged = _grow(f, x, a, b, dx, dx_old, done, converged)
        act = ~done
        failed = act & torch.isnan(f)
        hit = act & ~failed & (f.abs() <= ftol)
        a = torch.where(act & (f < 0), x, a)
        b = torch.where(act & (f > 0), x, b)
        step = f / df
        newton = x - step
        valid = torch.isfinite(newton) & (df > 0)
        # a Newton step below the tolerance ends the search (it may round onto a bracket end)
        tiny_step = valid & (step.abs() <= xtol * x.abs() + xatol) & (newton >= a) & (newton <= b)
        use_newton = valid & (newton > a) & (newton < b) & (2.0 * step.abs() <= dx_old.abs())
        x_new = torch.where(use_newton | tiny_step, newton, _midpoint(a, b))
        dx_old = torch.where(act, dx, dx_old)
        dx = torch.where(act, (x_new - x).abs(), dx)
        tolx = xtol * x_new.abs() + xatol
        width = b - a
        ulps = width <= 4.0 * tiny * torch.maximum(a.abs(), b.abs())
        conv = act & ~hit & ~failed & (tiny_step | (dx <= tolx) | (width <= tolx) | ulps)
        x = torch.where(act & ~hit & ~failed, x_new, x)
        converged = converged | hit | conv
        done = done | hit | conv | failed
    return x, converged


def _expand(fun, x0, lower, upper, factor, max_iter, lo_known=None, hi_known=None):
    """Bracket search; returns ``(lo, hi, found)`` with ``f(lo) <= 0 <= f(hi)`` where ``found``.

    ``lo_known``/``hi_known`` mark problems where ``f(lower) <= 0`` / ``f(upper) >= 0`` is already
    known, so that the bound itself closes the bracket.
    """
    f0, _ = _evaluate(fun, x0, False)
    x0, lower, upper = _grow(f0, x0, lower, upper)
    if lo_known is not None:
        lo_known, hi_known = _grow(f0, lo_known, hi_known)
    if bool(torch.isnan(f0).any()):
        raise ValueError(f"fun returned NaN at the starting point for {int(torch.isnan(f0).sum())} problem(s)")
    lo = torch.where(f0 <= 0, x0, lower)
    hi = torch.where(f0 >= 0, x0, upper)
    need_hi = f0 < 0
    need_lo = f0 > 0
    if hi_known is not None:
        need_hi = need_hi & ~hi_known
    if lo_known is not None:
        need_lo = need_lo & ~lo_known
    failed = torch.zeros_like(need_hi)
    lower_fin, upper_fin = torch.isfinite(lower), torch.isfinite(upper)
    scale = torch.clamp(x0.abs(), min=1.0)
    xu, xd = x0.clone(), x0.clone()
    for j in range(int(max_iter)):
        if not bool((need_hi | need_lo).any()):
            break
        g = factor ** min(j + 1, 60)
        step = scale * (factor - 1.0) * g
        # upward: towards a finite upper bound geometrically, else away from a finite lower bound
        # geometrically, else additively with growing steps
        up = torch.where(
            upper_fin,
            upper - (upper - xu) / g,
            torch.where(lower_fin, lower + (xu - lower) * g, xu + step),
        )
        down = torch.where(
            lower_fin,
            lower + (xd - lower) / g,
            torch.where(upper_fin, upper - (upper - xd) * g, xd - step),
        )
        cand = torch.where(need_hi, up, torch.where(need_lo, down, x0))
        bad = (need_hi | need_lo) & (~torch.isfinite(cand) | (cand <= lower) | (cand >= upper))
        failed = failed | bad
        need_hi, need_lo = need_hi & ~bad, need_lo & ~bad
        cand = torch.where(bad, x0, cand)
        f, _ = _evaluate(fun, cand, False)
        nanf = (need_hi | need_lo) & torch.isnan(f)
        failed = failed | nanf
        need_hi, need_lo = need_hi & ~nanf, need_lo & ~nanf
        # upward search
        lo = torch.where(need_hi & (f <= 0), cand, lo)
        hi = torch.where(need_hi & (f >= 0), cand, hi)
        xu = torch.where(need_hi, cand, xu)
        # downward search
        hi = torch.where(need_lo & (f >= 0), cand, hi)
        lo = torch.where(need_lo & (f <= 0), cand, lo)
        xd = torch.where(need_lo, cand, xd)
        need_hi = need_hi & (f < 0)
        need_lo = need_lo & (f > 0)
    failed = failed | need_hi | need_lo
    return lo, hi, ~failed


def expand_bracket(fun, x0, *, lower=-math.inf, upper=math.inf, factor=2.0, max_iter=60, on_fail="raise"):
    """Brackets ``[lo, hi]`` with ``f(lo) <= 0 <= f(hi)`` for many increasing scalar functions.

    Starting at ``x0`` (strictly inside ``(lower, upper)``) the search moves towards the side
    where the sign changes, with distances that grow like ``factor**(j(j+1)/2)``: geometrically away
    from a finite ``lower`` (so ``gamma in (0, inf)`` is searched on a log scale), geometrically
    towards a finite bound it approaches, and additively otherwise.  The bounds themselves are
    never evaluated (open domain).  The returned brackets are the tightest ones seen.

    :param fun: ``x -> f(x)`` or ``x -> (f(x), f'(x))``, elementwise.
    :param x0: starting points (tensor or number).
    :param lower: open lower limit of the domain (number or tensor), default ``-inf``.
    :param upper: open upper limit, default ``+inf``.
    :param factor: growth factor ``> 1``.
    :param max_iter: search steps (one evaluation each).
    :param on_fail: ``"raise"`` (:class:`~pyro_convexvb.errors.ConvergenceError`) if some problem
        has no sign change within ``max_iter`` steps, or ``"ignore"``: such problems keep the
        domain limit (``lower`` or ``upper``) as their open end.
    :returns: ``(lo, hi)``.

    Example::

        >>> import torch
        >>> lo, hi = expand_bracket(lambda g: torch.log(g) - 20.0, torch.tensor([1.0]), lower=0.0)
        >>> bool(lo <= torch.exp(torch.tensor(20.0)) <= hi)
        True
    """
    if not factor > 1:
        raise ValueError(f"factor: must be > 1, got {factor}")
    if on_fail not in ("raise", "ignore"):
        raise ValueError(f"on_fail: expected 'raise' or 'ignore', got {on_fail!r}")
    x0, lower, upper = _prepare(x0, lower, upper)
    if not bool(torch.isfinite(x0).all()):
        raise ValueError("x0: starting points must be finite")
    if bool(((x0 <= lower) | (x0 >= upper)).any()):
        raise ValueError("x0: starting points must lie strictly inside (lower, upper)")
    lo, hi, found = _expand(fun, x0, lower, upper, float(factor), max_iter)
    if on_fail == "raise" and not bool(found.all()):
        raise ConvergenceError(
            f"expand_bracket: no sign change found for {int((~found).sum())} problem(s) within {max_iter} steps",
            residual=None,
            iterations=max_iter,
        )
    return lo, hi


def minimize_convex_scalar(
    dfun,
    lo,
    hi,
    *,
    x0=None,
    closed=True,
    xtol=1e-12,
    xatol=0.0,
    max_iter=100,
    factor=2.0,
    max_expand=60,
):
    """Minimisers of many convex scalar functions ``k`` on ``[lo, hi]`` from ``(k', k'')``.

    Over 80 lines: most of it is this docstring (a safeguarded solver's contract); the body is under 80.

    The minimiser is the root of the nondecreasing ``k'``.  With ``closed=True`` finite bounds
    belong to the domain: ``k'`` is evaluated there, and a problem with ``k'(lo) >= 0`` (resp.
    ``k'(hi) <= 0``) returns the bound itself (e.g. ``x_* = 0`` for ``gamma <= gamma_0`` in seed
    000's appendix).  With ``closed=False`` (e.g. ``gamma in (0, inf)``) bounds are never
    evaluated.  Infinite or open ends are bracketed by :func:`expand_bracket`'s search from ``x0``,
    then :func:`newton_bisect_root` finds the root.

    :param dfun: ``x -> (k'(x), k''(x))`` elementwise.
    :param lo: lower bounds (``-inf`` allowed).
    :param hi: upper bounds (``+inf`` allowed).
    :param x0: starting points inside the domain; default: midpoint of finite bounds, ``lo + max(1, |lo|)``
        if only ``lo`` is finite, ``hi - max(1, |hi|)`` if only ``hi`` is, else 0.
    :param closed: whether finite bounds are feasible points (see above).
    :param xtol: relative tolerance on the minimiser.
    :param xatol: absolute tolerance on the minimiser.
    :param max_iter: Newton/bisection iterations.
    :param factor: bracket growth factor.
    :param max_expand: bracket search steps.
    :returns: ``(x, converged)``.  A problem whose minimiser lies at an open or infinite end (``k'``
        keeps its sign) is returned at the last point searched with ``converged = False``.

    Example::

        >>> import torch
        >>> # minimise k(g) = z / g + g over g > 0: g* = sqrt(z)
        >>> z = torch.tensor([1e-6, 1.0, 1e6], dtype=torch.float64)
        >>> g, ok = minimize_convex_scalar(lambda g: (1 - z / g**2, 2 * z / g**3), 0.0, float("inf"), closed=False)
        >>> bool(ok.all()), torch.allclose(g, z.sqrt())
        (True, True)
    """
    lo, hi, x0 = _prepare(lo, hi, x0)
    if bool((lo > hi).any()):
        raise ValueError(f"lo/hi: lo > hi for {int((lo > hi).sum())} problem(s)")
    lo_fin, hi_fin = torch.isfinite(lo), torch.isfinite(hi)
    if x0 is None:
        x0 = torch.where(
            lo_fin & hi_fin,
            lo + 0.5 * (hi - lo),
            torch.where(lo_fin, lo + torch.clamp(lo.abs(), min=1.0), torch.where(hi_fin, hi - torch.clamp(hi.abs(), min=1.0), torch.zeros_like(lo))),
        )
    probe, _ = _evaluate(dfun, x0, False)  # fixes the problems' shape
    lo, hi, x0, lo_fin, hi_fin = _grow(probe, lo, hi, x0, lo_fin, hi_fin)
    x = torch.where(lo == hi, lo, x0)
    done = lo == hi
    converged = done.clone()
    lo_known = torch.zeros_like(done)
    hi_known = torch.zeros_like(done)
    if closed:
        if bool(lo_fin.any()):
            f_lo, _ = _evaluate(dfun, torch.where(lo_fin, lo, x0), False)
            if bool((lo_fin & torch.isnan(f_lo)).any()):
                raise ValueError("dfun returned NaN at lo; pass closed=False for an open domain")
            at_lo = lo_fin & ~done & (f_lo >= 0)
            x = torch.where(at_lo, lo, x)
            done, converged = done | at_lo, converged | at_lo
            lo_known = lo_fin
        if bool(hi_fin.any()):
            f_hi, _ = _evaluate(dfun, torch.where(hi_fin, hi, x0), False)
            if bool((hi_fin & torch.isnan(f_hi)).any()):
                raise ValueError("dfun returned NaN at hi; pass closed=False for an open domain")
            at_hi = hi_fin & ~done & (f_hi <= 0)
            x = torch.where(at_hi, hi, x)
            done, converged = done | at_hi, converged | at_hi
            hi_known = hi_fin
    if bool(done.all()):
        return x, converged
    # bracket the remaining problems; for closed finite bounds the bound closes the bracket
    both_known = lo_known & hi_known
    start = torch.where(done, x, x0)
    if bool(((~done) & ((start < lo) | (start > hi) | (~both_known & ((start <= lo) | (start >= hi))))).any()):
        raise ValueError("x0: starting points must lie inside the domain (strictly inside at open or infinite ends)")
    need = ~done & ~both_known
    a = torch.where(both_known, lo, start)
    b = torch.where(both_known, hi, start)
    found = ~need
    if bool(need.any()):
        # evaluate from a safe interior start for the problems already done
        start_safe = torch.where(need, start, torch.where(both_known, lo + 0.5 * (hi - lo), start))
        ea, eb, efound = _expand(
            lambda t: _mask_fun(dfun, t, need), start_safe, lo, hi, float(factor), max_expand, lo_known, hi_known
        )
        a = torch.where(need, ea, a)
        b = torch.where(need, eb, b)
        found = found | (need & efound)
        x = torch.where(need & ~efound, torch.where(torch.isfinite(eb), eb, ea), x)
    solve = ~done & found
    if bool(solve.any()):
        a_s = torch.where(solve, a, torch.zeros_like(a))
        b_s = torch.where(solve, b, torch.zeros_like(b))
        xs, ok = newton_bisect_root(
            lambda t: _mask_fun(dfun, t, solve, derivative=True),
            a_s,
            b_s,
            x0=torch.where(solve, start, a_s),
            xtol=xtol,
            xatol=xatol,
            max_iter=max_iter,
            check_bracket=False,
        )
        x = torch.where(solve, xs, x)
        converged = converged | (solve & ok)
    return x, converged


def _mask_fun(fun, t, mask, derivative=False):
    """Evaluate ``fun`` and neutralise the problems outside ``mask`` (f = 0, f' = 1)."""
    f, df = _evaluate(fun, t, derivative)
    f = torch.where(mask, f, torch.zeros_like(f))
    if derivative:
        return f, torch.where(mask, df, torch.ones_like(df))
    return f
