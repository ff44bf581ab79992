"""Vectorised Newton/bisection against scipy.optimize.brentq on thousands of problems (float64)."""
import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq

from pyro_convexvb.errors import ConvergenceError
from pyro_convexvb.linalg import expand_bracket, minimize_convex_scalar, newton_bisect_root

DT = torch.float64
N = 1500


def _u(lo, hi, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return lo + (hi - lo) * torch.rand(n, generator=g, dtype=DT)


def _brentq_all(f_scalar, lo, hi, params):
    """brentq per problem; f_scalar(x, *p) on Python floats."""
    out = np.empty(len(params[0]))
    cols = [np.asarray(p.tolist() if isinstance(p, torch.Tensor) else p) for p in params]
    lo = np.broadcast_to(np.asarray(lo), out.shape)
    hi = np.broadcast_to(np.asarray(hi), out.shape)
    for i in range(out.shape[0]):
        p = [c[i] for c in cols]
        out[i] = brentq(lambda x: f_scalar(x, *p), lo[i], hi[i], xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500)
    return torch.from_numpy(out)


def _assert_close_rel(x, ref, rtol, atol=0.0):
    err = (x - ref).abs()
    bound = rtol * ref.abs() + atol
    bad = err > bound
    assert not bool(bad.any()), f"{int(bad.sum())} problems off; worst err {float(err.max()):.3e}"


def test_log_scale_roots_over_forty_decades():
    c = torch.exp(_u(-46.0, 46.0, seed=1))  # 1e-20 .. 1e20
    x, ok = newton_bisect_root(lambda x: (torch.log(x) - torch.log(c), 1.0 / x), 1e-30, 1e30)
    assert bool(ok.all())
    ref = _brentq_all(lambda x, ci: math.log(x) - math.log(ci), 1e-30, 1e30, [c])
    _assert_close_rel(x, ref, 1e-12)
    _assert_close_rel(x, c, 1e-12)


def test_exponential_steep_and_huge_values():
    s, r = torch.exp(_u(math.log(0.1), math.log(40.0), seed=2)), _u(-5, 5, seed=3)
    x, ok = newton_bisect_root(lambda x: (torch.expm1(s * (x - r)), s * torch.exp(s * (x - r))), -10.0, 10.0)
    assert bool(ok.all())
    ref = _brentq_all(lambda x, si, ri: math.expm1(si * (x - ri)), -10.0, 10.0, [s, r])
    _assert_close_rel(x, ref, 1e-12, 1e-13)


@pytest.mark.parametrize("delta", [0.0, 1e-12, 1e-3])
def test_flat_derivative_at_the_root(delta):
    r = _u(-3, 3, seed=4)
    x, ok = newton_bisect_root(lambda x: ((x - r) ** 3 + delta * (x - r), 3 * (x - r) ** 2 + delta), -10.0, 10.0)
    assert bool(ok.all())
    ref = _brentq_all(lambda x, ri: (x - ri) ** 3 + delta * (x - ri), -10.0, 10.0, [r])
    _assert_close_rel(x, ref, 1e-10, 1e-10)


def test_kinked_piecewise_linear():
    r, a1, a2 = _u(-1, 1, seed=5), torch.exp(_u(-7, 0, seed=6)), torch.exp(_u(0, 7, seed=7))

    def f(x):
        left = x < r
        return torch.where(left, a1 * (x - r), a2 * (x - r)), torch.where(left, a1, a2)

    x, ok = newton_bisect_root(f, -3.0, 3.0)
    assert bool(ok.all())
    _assert_close_rel(x, r, 1e-12, 1e-14)


def test_extremely_steep_tanh_needs_bisection():
    r, s = _u(-2, 2, seed=8), torch.exp(_u(0, math.log(1e8), seed=9))

    def f(x):
        t = torch.tanh(s * (x - r))
        return t, s * (1 - t * t)

    x, ok = newton_bisect_root(f, -5.0, 5.0, max_iter=200)
    assert bool(ok.all())
    ref = _brentq_all(lambda x, ri, si: math.tanh(si * (x - ri)), -5.0, 5.0, [r, s])
    _assert_close_rel(x, ref, 1e-10, 1e-12)


@pytest.mark.parametrize("bad", ["zero", "negative", "nan"])
def test_useless_derivative_falls_back_to_bisection(bad):
    r = _u(-2, 2, seed=10)

    def f(x):
        val = torch.atan(x - r)
        d = {"zero": torch.zeros_like(x), "negative": -torch.ones_like(x), "nan": torch.full_like(x, float("nan"))}[bad]
        return val, d

    x, ok = newton_bisect_root(f, -4.0, 4.0, max_iter=200)
    assert bool(ok.all())
    _assert_close_rel(x, r, 1e-11, 1e-12)


def test_roots_on_the_bracket_ends_and_exact_zeros():
    lo = _u(-2, 0, seed=11)
    hi = lo + 1.0
    # root exactly at lo for half the problems, exactly at hi for the other half
    at_lo = torch.arange(N) % 2 == 0
    root = torch.where(at_lo, lo, hi)
    x, ok = newton_bisect_root(lambda x: (x - root, torch.ones_like(x)), lo, hi)
    assert bool(ok.all())
    assert torch.equal(x, root)


def test_newton_is_quadratic_on_smooth_problems():
    c = _u(0.5, 100.0, seed=12)
    calls = []

    def f(x):
        calls.append(1)
        return x * x - c, 2 * x

    x, ok = newton_bisect_root(f, 0.0, 101.0, x0=c.sqrt() * 1.5)
    assert bool(ok.all())
    _assert_close_rel(x, c.sqrt(), 1e-14)
    assert len(calls) <= 2 + 10  # two bracket checks + a handful of Newton steps


def test_shapes_dtype_and_partial_failures():
    c = _u(1, 4, n=12, seed=13).reshape(3, 4)
    # scalar brackets: the problems' shape comes from fun
    x, ok = newton_bisect_root(lambda x: (x * x - c, 2 * x), 0.0, 5.0)
    assert x.shape == (3, 4) and x.dtype == DT and bool(ok.all())
    _assert_close_rel(x, c.sqrt(), 1e-13)
    # float32
    c32 = c.float()
    x32, ok32 = newton_bisect_root(lambda x: (x * x - c32, 2 * x), torch.zeros(3, 4), torch.full((3, 4), 5.0), xtol=1e-6)
    assert x32.dtype == torch.float32 and bool(ok32.all())
    # NaN for some problems: they are reported, the others converge
    bad = torch.zeros(3, 4, dtype=torch.bool)
    bad[1, 2] = True

    def f(x):
        val = x * x - c
        return torch.where(bad & (x > 0.5), torch.full_like(x, float("nan")), val), 2 * x

    x, ok = newton_bisect_root(f, 0.0, 5.0, check_bracket=False)
    assert not bool(ok[1, 2]) and bool(ok[~bad].all())


def test_invalid_brackets_are_reported():
    with pytest.raises(ValueError, match="does not contain a root"):
        newton_bisect_root(lambda x: (x - 3.0, torch.ones_like(x)), torch.zeros(5, dtype=DT), torch.ones(5, dtype=DT))
    with pytest.raises(ValueError, match="expand_bracket"):
        newton_bisect_root(lambda x: (x, torch.ones_like(x)), -math.inf, 1.0)
    with pytest.raises(ValueError, match="lo > hi"):
        newton_bisect_root(lambda x: (x, torch.ones_like(x)), 1.0, -1.0)
    with pytest.raises(ValueError, match=r"\(f, f'\)"):
        newton_bisect_root(lambda x: x, -1.0, 1.0)


def test_expand_bracket_on_log_scale_and_additively():
    c = torch.exp(_u(-230.0, 230.0, seed=14))  # 1e-100 .. 1e100
    lo, hi = expand_bracket(lambda g: torch.log(g) - torch.log(c), torch.ones(N, dtype=DT), lower=0.0)
    assert bool(((lo <= c) & (c <= hi)).all()) and bool((lo > 0).all())
    assert float((torch.log(hi) - torch.log(lo)).max()) < 60 * math.log(2.0)
    r = _u(-1e6, 1e6, seed=15)
    lo, hi = expand_bracket(lambda x: x - r, torch.zeros(N, dtype=DT))
    assert bool(((lo <= r) & (r <= hi)).all())
    # towards a finite upper bound geometrically
    r = 1.0 - torch.exp(_u(-30, -1, seed=16))
    lo, hi = expand_bracket(lambda x: x - r, torch.zeros(N, dtype=DT), upper=1.0)
    assert bool(((lo <= r) & (r <= hi) & (hi < 1.0)).all())
    # the brackets feed newton_bisect_root directly
    x, ok = newton_bisect_root(lambda x: (x - r, torch.ones_like(x)), lo, hi)
    assert bool(ok.all())
    _assert_close_rel(x, r, 1e-14)


def test_expand_bracket_failures():
    with pytest.raises(ConvergenceError, match="no sign change"):
        expand_bracket(lambda x: -torch.ones_like(x), torch.ones(3, dtype=DT), lower=0.0)
    lo, hi = expand_bracket(lambda x: -torch.ones_like(x), torch.ones(3, dtype=DT), lower=0.0, on_fail="ignore")
    assert bool(torch.isinf(hi).all())
    with pytest.raises(ValueError, match="inside"):
        expand_bracket(lambda x: x, torch.zeros(3, dtype=DT), lower=0.0)
    with pytest.raises(ValueError, match="factor"):
        expand_bracket(lambda x: x, torch.ones(3, dtype=DT), factor=1.0)


def test_minimize_on_open_half_line():
    """k(gamma) = z / gamma + gamma over gamma > 0 (the shape of Nickisch & Seeger's (2009) k(x, gamma) with h linear)."""
    z = torch.exp(_u(-46.0, 46.0, seed=17))
    g, ok = minimize_convex_scalar(lambda g: (1 - z / g**2, 2 * z / g**3), 0.0, math.inf, closed=False)
    assert bool(ok.all())
    _assert_close_rel(g, z.sqrt(), 1e-12)
    # Laplace sites: k(gamma) = (z + x)/gamma + tau^2 gamma  ->  gamma* = sqrt(z + x) / tau
    x, tau = _u(0, 10, seed=18), torch.exp(_u(-3, 3, seed=19))
    g, ok = minimize_convex_scalar(
        lambda g: (-(z + x) / g**2 + tau**2, 2 * (z + x) / g**3), 0.0, math.inf, x0=torch.ones(N, dtype=DT), closed=False
    )
    assert bool(ok.all())
    _assert_close_rel(g, (z + x).sqrt() / tau, 1e-12)


def _logistic_gprime(x, C):
    """g'(x) = -C tanh(v)/v and g''(x) for g(x) = -log cosh(v) - log 2, v = sqrt(2C x) (Nickisch & Seeger 2009 appendix)."""
    v = torch.sqrt(2 * C * x)
    small = v < 1e-3
    vs = torch.where(small, torch.ones_like(v), v)
    t = torch.tanh(vs)
    tanh_over_v = torch.where(small, 1 - v**2 / 3 + 2 * v**4 / 15, t / vs)
    # g'' = C^2 / v^3 (tanh v - v + v tanh^2 v), series 2C^2/3 - 8C^2 v^2/15 near 0
    g2 = torch.where(small, C**2 * (2.0 / 3 - 8.0 * v**2 / 15), C**2 / vs**3 * (t - vs + vs * t * t))
    return -C * tanh_over_v, g2


def test_minimize_closed_boundary_logistic_xstar():
    """x_*(gamma) = argmin_{x >= 0} x/gamma + 2 g(x): x_* = 0 iff gamma <= gamma_0 = 1/(2C) (Nickisch & Seeger 2009 appendix)."""
    C = torch.exp(_u(math.log(0.05), math.log(5.0), seed=20))
    gamma0 = 1 / (2 * C)
    gamma = gamma0 * torch.exp(_u(-3, 3, seed=21))

    def dl(x):
        g1, g2 = _logistic_gprime(x, C)
        return 1 / gamma + 2 * g1, 2 * g2

    x, ok = minimize_convex_scalar(dl, 0.0, math.inf)
    assert bool(ok.all())
    at_zero = gamma <= gamma0
    assert torch.equal(x[at_zero], torch.zeros(int(at_zero.sum()), dtype=DT))
    assert bool((x[~at_zero] > 0).all())

    def dl_scalar(xx, Ci, gi):
        v = math.sqrt(2 * Ci * xx)
        tv = 1.0 if v < 1e-8 else math.tanh(v) / v
        return 1 / gi - 2 * Ci * tv

    idx = (~at_zero).nonzero().squeeze(-1)
    hi = [1.0] * len(idx)
    for j, i in enumerate(idx.tolist()):  # bracket for brentq: l_x(hi) > 0
        while dl_scalar(hi[j], float(C[i]), float(gamma[i])) <= 0:
            hi[j] *= 2
    ref = _brentq_all(dl_scalar, 0.0, np.array(hi), [C[idx], gamma[idx]])
    _assert_close_rel(x[idx], ref, 1e-9, 1e-14)
    # just above gamma_0 the paper's approximation x_* ~ xi_0 log(gamma/gamma_0), xi_0 = 3/(2C)
    eps = 1e-6
    gamma = gamma0 * (1 + eps)
    x, ok = minimize_convex_scalar(dl, 0.0, math.inf)
    assert bool(ok.all())
    _assert_close_rel(x, 3 / (2 * C) * math.log1p(eps), 1e-5)


def test_minimize_box_and_unbounded_cases():
    m = _u(-2, 3, seed=22)
    x, ok = minimize_convex_scalar(lambda x: (x - m, torch.ones_like(x)), 0.0, 1.0)
    assert bool(ok.all()) and torch.equal(x, m.clamp(0, 1))
    x, ok = minimize_convex_scalar(lambda x: (x - m, torch.ones_like(x)), -math.inf, math.inf)
    assert bool(ok.all())
    _assert_close_rel(x, m, 1e-14, 1e-15)
    x, ok = minimize_convex_scalar(lambda x: (x - m, torch.ones_like(x)), -math.inf, 0.5)
    assert bool(ok.all()) and torch.equal(x, m.clamp(max=0.5))
    # -log(1 + x) on [0, inf): no minimiser, reported as not converged
    x, ok = minimize_convex_scalar(lambda x: (-1 / (1 + x), 1 / (1 + x) ** 2), 0.0, math.inf, max_expand=20)
    assert not bool(ok.any()) and bool((x > 1e30).all())
    # lo == hi
    x, ok = minimize_convex_scalar(lambda x: (x - m, torch.ones_like(x)), 0.25, 0.25)
    assert bool(ok.all()) and bool((x == 0.25).all())


def test_minimize_random_convex_against_brentq():
    """k(x) = a x^2 + b x + c exp(d x) on [-5, 5]: k' = 2 a x + b + c d exp(d x)."""
    a, b = torch.exp(_u(-6, 2, seed=23)), _u(-20, 20, seed=24)
    c, d = torch.exp(_u(-6, 1, seed=25)), _u(-3, 3, seed=26)

    def dk(x):
        e = torch.exp(d * x)
        return 2 * a * x + b + c * d * e, 2 * a + c * d * d * e

    x, ok = minimize_convex_scalar(dk, -5.0, 5.0)
    assert bool(ok.all())

    def dk_s(x, ai, bi, ci, di):
        return 2 * ai * x + bi + ci * di * math.exp(di * x)

    kl = dk(torch.full((N,), -5.0, dtype=DT))[0]
    kh = dk(torch.full((N,), 5.0, dtype=DT))[0]
    inside = (kl < 0) & (kh > 0)
    idx = inside.nonzero().squeeze(-1)
    ref = _brentq_all(dk_s, -5.0, 5.0, [a[idx], b[idx], c[idx], d[idx]])
    _assert_close_rel(x[idx], ref, 1e-11, 1e-12)
    assert torch.equal(x[kl >= 0], torch.full((int((kl >= 0).sum()),), -5.0, dtype=DT))
    assert torch.equal(x[kh <= 0], torch.full((int((kh <= 0).sum()),), 5.0, dtype=DT))
    assert int(inside.sum()) > N // 2


def test_minimize_errors():
    with pytest.raises(ValueError, match="closed=False"):
        minimize_convex_scalar(lambda g: (1 - 1 / g**2 + 0 * torch.log(g - g), 2 / g**3), 0.0, math.inf)
    with pytest.raises(ValueError, match="lo > hi"):
        minimize_convex_scalar(lambda x: (x, torch.ones_like(x)), 1.0, 0.0)
