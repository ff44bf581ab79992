"""Float64 reference checks of the dual VG method (Khan et al. 2013): conjugates, objective, duality, guide."""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import scipy.optimize as so
import torch

import pyro_convexvb as pcv
from pyro_convexvb.infer.dual_vg import (
    BandedPrecisionBackend,
    DualState,
    DualVG,
    GenericBound,
    LatentSpaceBackend,
    PiecewiseQuadraticBound,
    SiteSpaceBackend,
    StackedBound,
    StochasticVolatility,
    dual_vg_objective,
    exact_elbo,
    fit_dual_vg,
    make_bound,
    minimize_joint,
    numerical_conjugate,
    reduced_objective,
    solve_dual,
)
from pyro_convexvb.infer.dual_vg.reference import cvi_fixed_point, primal_optimum
from pyro_convexvb.lgm.layout import LatentLayout
from pyro_convexvb.lgm.model import LatentGaussianModel, PriorBlock, SiteGroup
from pyro_convexvb.lgm.sites import BernoulliLogit, BernoulliProbit, Gaussian, Poisson
from pyro_convexvb.linalg.operators import DenseOperator, SparseOperator

D = torch.float64


def _t(x):
    return torch.as_tensor(x, dtype=D)


def _family(kind, N, gen):
    if kind == "poisson":
        return Poisson(torch.poisson(torch.full((N,), 2.0, dtype=D), generator=gen))
    if kind == "sv":
        return StochasticVolatility(torch.randn(N, dtype=D, generator=gen))
    if kind == "gaussian":
        return Gaussian(torch.randn(N, dtype=D, generator=gen), torch.full((N,), 0.7, dtype=D))
    return BernoulliLogit((torch.rand(N, dtype=D, generator=gen) < 0.5).to(D))


def _problem(N=7, L=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(N, L, dtype=D, generator=gen) / math.sqrt(L)
    A = torch.randn(L, L, dtype=D, generator=gen)
    S = A @ A.T / L + 0.5 * torch.eye(L, dtype=D)
    mu = 0.3 * torch.randn(L, dtype=D, generator=gen)
    d = 0.1 * torch.randn(N, dtype=D, generator=gen)
    return W, S, mu, d, gen


def _lgm(W, S, mu, d, family):
    N, L = W.shape
    layout = LatentLayout.from_shapes([("z", (L,))], [1])
    prior = PriorBlock("z", mu, cov=DenseOperator(S), prec=DenseOperator(torch.linalg.inv(S)))
    return LatentGaussianModel(layout, [prior], [SiteGroup("y", family, DenseOperator(W), d, (N,))])


BOUND_CASES = [("poisson", None), ("sv", None), ("gaussian", None), ("logit", "tight"), ("logit", "jensen"),
               ("logit", "bohning"), ("logit", "jaakkola")]


def _bound(kind, name, N, gen):
    fam = _family(kind, N, gen)
    b = make_bound(fam, name or "tight", xi=1.3 if name == "jaakkola" else None)
    return fam, b


# ----------------------------------------------------------------------------- conjugates
@pytest.mark.parametrize("kind,name", BOUND_CASES)
def test_conjugate_matches_numerical_supremum(kind, name):
    gen = torch.Generator().manual_seed(1)
    fam, b = _bound(kind, name, 4, gen)
    lo, hi = b.alpha_domain(torch.zeros(4, dtype=D))
    lo_f = torch.where(torch.isfinite(lo), lo, _t(-2.0))
    hi_f = torch.where(torch.isfinite(hi), hi, _t(2.0))
    alpha = lo_f + (hi_f - lo_f) * torch.rand(4, dtype=D, generator=gen).clamp(0.1, 0.9)
    ell = b.ell(alpha)[0]
    for lam in (ell, 0.5 * ell):
        closed = b.conjugate(alpha, lam)
        for n in range(4):
            def neg(x, n=n, lam=lam):
                h, rho = _t([x[0]]), _t([x[1]])
                full_h = torch.zeros(4, dtype=D); full_h[n] = h[0]
                full_r = torch.ones(4, dtype=D); full_r[n] = rho[0]
                return -float(alpha[n] * h[0] + 0.5 * lam[n] * rho[0] - b.f(full_h, full_r)[n])
            best = min((so.minimize(neg, x0, method="L-BFGS-B", bounds=[(-30, 30), (0, 200)],
                                    options=dict(ftol=1e-15, gtol=1e-12, maxiter=5000))
                        for x0 in ([0.0, 0.5], [1.0, 2.0])), key=lambda r: r.fun)
            assert -best.fun == pytest.approx(float(closed[n]), abs=2e-7, rel=1e-7)
    # outside the domain (lambda > ell) the supremum is unbounded
    assert torch.isinf(b.conjugate(alpha, ell * 1.5 + 0.1)).all()


def test_tight_logit_bound_is_valid_convex_and_tighter():
    h, rho = torch.meshgrid(torch.linspace(-8, 8, 33, dtype=D), torch.logspace(-3, 1.5, 25, dtype=D), indexing="ij")
    h, rho = h.reshape(-1), rho.reshape(-1)
    fam = BernoulliLogit(torch.zeros_like(h))
    exact = -fam.expected_log_prob(h, rho, num_points=200)
    tight = make_bound(fam, "tight").f(h, rho)
    assert (tight - exact).min() > -1e-10  # a valid bound
    for other in ("jensen", "bohning"):
        assert (make_bound(fam, other).f(h, rho) - tight).min() > -1e-12
    # second order in rho: f - exact = O(rho^2)
    small = rho < 2e-3
    assert (tight - exact)[small].max() < 1e-5
    # joint convexity: finite-difference Hessian eigenvalues on the grid
    e = 1e-4
    b = make_bound(fam, "tight")
    f = lambda a, r: b.f(a, r)
    r = rho + 0.01
    fhh = (f(h + e, r) - 2 * f(h, r) + f(h - e, r)) / e**2
    frr = (f(h, r + e) - 2 * f(h, r) + f(h, r - e)) / e**2
    fhr = (f(h + e, r + e) - f(h + e, r - e) - f(h - e, r + e) + f(h - e, r - e)) / (4 * e * e)
    tr, det = fhh + frr, fhh * frr - fhr**2
    lam_min = 0.5 * (tr - torch.sqrt((tr**2 - 4 * det).clamp_min(0)))
    assert lam_min.min() > -1e-5


def test_tight_kappa_solves_its_stationarity_equation_in_at_most_16_newton_steps():
    """``z* = logit(kappa*)`` is the root of ``z + rho sigmoid(z) = h + rho/2``: against SciPy's ``brentq`` on
    moderate inputs, and at rounding level after 16 steps for ``|h|, rho`` over 16 decades (float64) and in
    float32."""
    from pyro_convexvb.lgm.families.logit import _tight_kappa

    g = torch.Generator().manual_seed(0)
    n = 4000
    h = torch.randn(n, generator=g, dtype=D) * 10 ** (16 * torch.rand(n, generator=g, dtype=D) - 4)
    rho = 10 ** (16 * torch.rand(n, generator=g, dtype=D) - 4)
    h = torch.cat([h, torch.tensor([0.0, 0.5, -0.5, 4990.0, 1e-300], dtype=D)])
    rho = torch.cat([rho, torch.tensor([1e4, 0.0, 1e4, 1e4, 1e-12], dtype=D)])

    def G(z, h, rho):
        return z + rho * torch.sigmoid(z) - h - 0.5 * rho

    k, z = _tight_kappa(h, rho, iters=16)
    scale = z.abs() + rho * torch.sigmoid(z) + (h + 0.5 * rho).abs()
    assert float((G(z, h, rho).abs() / scale).max()) < 1e-14
    assert torch.equal(k, torch.sigmoid(z))
    k100, z100 = _tight_kappa(h, rho)
    assert float(((z100 - z).abs() / (1 + z.abs())).max()) < 1e-13
    moderate = ((h.abs() < 1e4) & (rho < 1e4)).nonzero().squeeze(-1)[:300]
    for i in moderate.tolist():
        hi, ri = float(h[i]), float(rho[i])
        ref = so.brentq(lambda t: t + ri / (1 + math.exp(-t)) - hi - 0.5 * ri if t > -700 else t - hi - 0.5 * ri,
                        hi - 0.5 * ri - 1e-9, hi + 0.5 * ri + 1e-9, xtol=1e-300, rtol=8.9e-16, maxiter=500)
        assert abs(float(z[i]) - ref) <= 1e-13 * (1 + abs(ref)), (hi, ri)
    h32, rho32 = (h[:n] / 10 ** 8).float(), (rho[:n] / 10 ** 8).float()  # |h|, rho within 1e-12 .. 1e4
    k32, z32 = _tight_kappa(h32, rho32, iters=16)
    s32 = z32.abs() + rho32 * torch.sigmoid(z32) + (h32 + 0.5 * rho32).abs()
    assert k32.dtype == torch.float32 and float((G(z32, h32, rho32).abs() / s32).max()) < 1e-6


def test_exact_logit_expectation_and_piecewise_bound_are_not_convex():
    fam = BernoulliLogit(torch.zeros(1, dtype=D))
    pw = PiecewiseQuadraticBound(fam)
    x = torch.linspace(-12, 12, 2001, dtype=D)
    assert (pw.q(x) - torch.nn.functional.softplus(x)).min() >= -1e-12  # an upper bound
    # closed-form expectation against quadrature
    h, rho = _t([0.3, -2.0, 4.2]), _t([0.5, 2.0, 0.01])
    gh = torch.stack([(pw.q(hh + rr.sqrt() * torch.linspace(-12, 12, 200001, dtype=D)) *
                       torch.exp(-0.5 * torch.linspace(-12, 12, 200001, dtype=D) ** 2)).sum() * (24 / 200000)
                      / math.sqrt(2 * math.pi) for hh, rr in zip(h, rho)])
    assert torch.allclose(pw.f(h, rho), gh, atol=1e-6)

    def min_eig(fn, h0, r0, e=1e-3):
        H = np.zeros((2, 2))
        for i, j in [(0, 0), (1, 1), (0, 1)]:
            def at(a, b):
                return float(fn(_t([h0 + a]), _t([r0 + b]))[0])
            ei = [e if k == i else 0 for k in (0, 1)]
            ej = [e if k == j else 0 for k in (0, 1)]
            H[i, j] = H[j, i] = (at(ei[0] + ej[0], ei[1] + ej[1]) - at(ei[0] - ej[0], ei[1] - ej[1])
                                 - at(-ei[0] + ej[0], -ei[1] + ej[1]) + at(-ei[0] - ej[0], -ei[1] - ej[1])) / (4 * e * e)
        return np.linalg.eigvalsh(H).min()

    assert min_eig(pw.f, 1.5, 0.02) < -0.05  # at a breakpoint, small variance
    exact = lambda a, r: -fam.expected_log_prob(a, r, num_points=100)
    # about -0.031 (docs/dual_vg.md, § Primal variational-Gaussian problem)
    assert min_eig(exact, 0.0, 0.01) < -0.02


# ----------------------------------------------------------------------------- objective
@pytest.mark.parametrize("kind,name", [("poisson", None), ("sv", None), ("logit", "tight"), ("logit", "jensen")])
def test_reduced_gradient_and_hessian_match_finite_differences(kind, name):
    W, S, mu, d, gen = _problem(N=6, L=6, seed=3)
    fam, b = _bound(kind, name, 6, gen)
    be = SiteSpaceBackend(W @ S @ W.T, W @ mu + d)
    a0 = solve_dual(be, b, gap_tol=1e-9).alpha
    alpha = a0 + 0.02 * torch.randn(6, dtype=D, generator=gen) * (1 if kind != "logit" else 0.5 * torch.minimum(
        a0 + b.y, 1 - b.y - a0))
    val = reduced_objective(be, b, alpha, hessian=True)
    e = 1e-6
    I = torch.eye(6, dtype=D)
    fd_g = torch.stack([(reduced_objective(be, b, alpha + e * I[i]).g - reduced_objective(be, b, alpha - e * I[i]).g)
                        / (2 * e) for i in range(6)])
    fd_H = torch.stack([(reduced_objective(be, b, alpha + e * I[i]).grad - reduced_objective(be, b, alpha - e * I[i]).grad)
                        / (2 * e) for i in range(6)])
    assert torch.allclose(val.grad, fd_g, atol=1e-6, rtol=1e-6)
    assert torch.allclose(val.hessian, fd_H, atol=1e-5, rtol=1e-5)
    assert torch.linalg.eigvalsh(val.hessian).min() > 0


def test_joint_objective_gradient_and_forms_agree():
    W, S, mu, d, gen = _problem(N=8, L=4, seed=5)
    fam, b = _bound("poisson", None, 8, gen)
    alpha = torch.rand(8, dtype=D, generator=gen) + 0.2 - fam.params["y"] * 0.5
    lam = b.ell(alpha)[0] * 0.7
    site = SiteSpaceBackend(W @ S @ W.T, W @ mu + d)
    latent = LatentSpaceBackend(W, mu, d, prior_cov=S)
    v1 = dual_vg_objective(alpha, lam, bound=b, backend=site)
    v2 = dual_vg_objective(alpha, lam, bound=b, backend=latent)
    v3 = dual_vg_objective(alpha, lam, W @ S @ W.T, W @ mu + d, bound=b)
    assert float(v1.g) == pytest.approx(float(v2.g), abs=1e-10) == float(v3.g)
    assert torch.allclose(v1.v_tilde, v2.v_tilde, atol=1e-12) and torch.allclose(v1.m_tilde, v2.m_tilde, atol=1e-12)
    e = 1e-6
    I = torch.eye(8, dtype=D)
    fa = torch.stack([(dual_vg_objective(alpha + e * I[i], lam, bound=b, backend=site).g
                       - dual_vg_objective(alpha - e * I[i], lam, bound=b, backend=site).g) / (2 * e) for i in range(8)])
    fl = torch.stack([(dual_vg_objective(alpha, lam + e * I[i], bound=b, backend=site).g
                       - dual_vg_objective(alpha, lam - e * I[i], bound=b, backend=site).g) / (2 * e) for i in range(8)])
    assert torch.allclose(v1.grad, fa, atol=1e-7) and torch.allclose(v1.grad_lam, fl, atol=1e-7)
    # the dense reference: g = 1/2 a'St a - mu_t'a - 1/2 log|I + L^1/2 St L^1/2| + sum f*
    St = W @ S @ W.T
    s = lam.sqrt()
    ref = 0.5 * alpha @ St @ alpha - (W @ mu + d) @ alpha - 0.5 * torch.logdet(torch.eye(8, dtype=D) + s[:, None] * St * s) \
        + b.conjugate(alpha, lam).sum()
    assert float(v1.g) == pytest.approx(float(ref), abs=1e-12)
    with pytest.raises(ValueError, match="lam"):
        dual_vg_objective(alpha, -lam, St, W @ mu + d)


# ----------------------------------------------------------------------------- strong duality
@pytest.mark.parametrize("kind,name", BOUND_CASES)
def test_strong_duality_against_primal_optimisation(kind, name):
    W, S, mu, d, gen = _problem(N=6, L=4, seed=11)
    fam, b = _bound(kind, name, 6, gen)
    be = SiteSpaceBackend(W @ S @ W.T, W @ mu + d)
    sol = solve_dual(be, b, gap_tol=1e-11)
    assert sol.converged and sol.gap < 1e-10
    pval, m, V = primal_optimum(S, mu, W, d, lambda h, r: -b.f(h, r), tol=1e-13)
    assert sol.g == pytest.approx(pval, abs=1e-7)
    lgm = _lgm(W, S, mu, d, fam)
    res = fit_dual_vg(lgm, progress=False, bound=name or "tight", gap_tol=1e-11,
                      **({"xi": 1.3} if name == "jaakkola" else {}))  # xi belongs to the Jaakkola bound alone
    q = res.posterior
    assert torch.allclose(q.loc, m, atol=2e-5) and torch.allclose(q.covariance(), V, atol=2e-5)
    # reported bound: exact VG bound of q (independent dense evaluation), never -g
    assert res.log_evidence_bound == pytest.approx(float(lgm.evidence_lower_bound(q.loc, q.covariance())), abs=1e-9)
    assert res.log_evidence_bound >= res.info["lvb_elbo"] - 1e-9
    if b.exact:
        assert res.log_evidence_bound == pytest.approx(float(sol.g), rel=0, abs=1e-8)  # strong duality
        assert res.log_evidence_bound == pytest.approx(res.info["lvb_elbo"], abs=1e-8)


def test_logit_bounds_within_documented_gap_of_exact_vg_optimum():
    W, S, mu, d, gen = _problem(N=8, L=3, seed=2)
    fam = _family("logit", 8, gen)
    lgm = _lgm(W, S, mu, d, fam)
    best, _, _ = primal_optimum(S, mu, W, d, fam.expected_log_prob, tol=1e-12)
    gaps = {}
    for name in ("tight", "jensen", "bohning", "jaakkola"):
        res = fit_dual_vg(lgm, progress=False, bound=name, **({"xi": 1.3} if name == "jaakkola" else {}))
        gaps[name] = best - res.log_evidence_bound
        assert gaps[name] >= -1e-7  # the exact VG optimum is the best Gaussian
    assert gaps["tight"] < 0.02 and gaps["tight"] <= min(gaps["jensen"], gaps["bohning"]) + 1e-9


def test_cvi_fixed_point_is_the_exact_vg_optimum():
    gen = torch.Generator().manual_seed(4)
    X = torch.randn(7, 2, dtype=D, generator=gen)
    K = 1.5 * torch.exp(-0.5 * torch.cdist(X, X) ** 2) + 1e-3 * torch.eye(7, dtype=D)
    fam = _family("logit", 7, gen)
    out = cvi_fixed_point(K, torch.zeros(7, dtype=D), fam, tol=1e-14)
    best, m, V = primal_optimum(K, torch.zeros(7, dtype=D), torch.eye(7, dtype=D), torch.zeros(7, dtype=D),
                                fam.expected_log_prob, tol=1e-12)
    assert out["converged"] and out["elbo"] == pytest.approx(best, abs=1e-8)
    assert torch.allclose(out["loc"], m, atol=1e-4)


def test_refine_reaches_the_exact_vg_optimum_in_the_site_and_latent_forms():
    """refine=True from the latent form (its working means) and from the site form (Woodbury) give the exact VG
    optimum found by direct maximisation over the mean and Cholesky factor (not the tight bound's optimum)."""
    W, S, mu, d, gen = _problem(N=30, L=4, seed=11)
    fam = _family("logit", 30, gen)
    lgm = _lgm(W, S, mu, d, fam)
    best, m, V = primal_optimum(S, mu, W, d, fam.expected_log_prob, tol=1e-12)
    plain = fit_dual_vg(lgm, progress=False, form="latent", gap_tol=1e-11)
    assert plain.log_evidence_bound < best - 1e-4  # the bound's own optimum is short of it
    for form in ("latent", "site"):
        res = fit_dual_vg(lgm, progress=False, form=form, gap_tol=1e-11, refine=True)
        assert res.converged and res.info["refine"] and res.info["form"] == form
        assert res.log_evidence_bound == pytest.approx(best, abs=1e-8)
        torch.testing.assert_close(res.posterior.loc, m, rtol=0, atol=1e-6)
        torch.testing.assert_close(res.posterior.covariance(), V, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- optimisers and forms
def test_newton_lbfgs_latent_and_site_forms_agree_and_history_has_gap():
    W, S, mu, d, gen = _problem(N=30, L=4, seed=7)
    fam = _family("logit", 30, gen)
    lgm = _lgm(W, S, mu, d, fam)
    r_site = fit_dual_vg(lgm, progress=False, form="site", gap_tol=1e-11)
    r_lat = fit_dual_vg(lgm, progress=False, form="latent", gap_tol=1e-11)
    r_lbfgs = fit_dual_vg(lgm, progress=False, form="latent", method="lbfgs", gap_tol=1e-11)
    assert r_site.info["form"] == "site" and r_lat.info["form"] == "latent"
    for r in (r_lat, r_lbfgs):
        assert r.converged and r.log_evidence_bound == pytest.approx(r_site.log_evidence_bound, abs=1e-6)
        assert torch.allclose(r.posterior.loc, r_site.posterior.loc, atol=1e-5)
        assert torch.allclose(r.posterior.covariance(), r_site.posterior.covariance(), atol=1e-6)
    gaps = r_site.history["gap"]
    assert gaps[-1] <= 1e-11 and len(gaps) == len(r_site.history["objective"]) and r_site.info["iterations"] < 15


def test_mixed_site_groups_stacked_bound():
    W, S, mu, d, gen = _problem(N=10, L=4, seed=8)
    fam1, fam2 = _family("logit", 6, gen), _family("poisson", 4, gen)
    layout = LatentLayout.from_shapes([("z", (4,))], [1])
    prior = PriorBlock("z", mu, cov=DenseOperator(S), prec=DenseOperator(torch.linalg.inv(S)))
    lgm = LatentGaussianModel(layout, [prior], [SiteGroup("a", fam1, DenseOperator(W[:6]), d[:6], (6,)),
                                                 SiteGroup("b", fam2, DenseOperator(W[6:]), d[6:], (4,))])
    res = fit_dual_vg(lgm, progress=False, form="site", gap_tol=1e-11)
    b = StackedBound([make_bound(fam1), make_bound(fam2)])
    pval, m, V = primal_optimum(S, mu, W, d, lambda h, r: -b.f(h, r), tol=1e-13)
    assert res.info["lvb_elbo"] == pytest.approx(pval, abs=1e-7)
    assert torch.allclose(res.posterior.loc, m, atol=1e-5)


def test_banded_gmrf_matches_dense():
    import scipy.sparse as sp

    n = 40
    main = np.full(n, 2.2); main[[0, -1]] = 1.2
    Q = sp.diags([main, -np.ones(n - 1), -np.ones(n - 1), 0.1 * np.ones(n - 2), 0.1 * np.ones(n - 2)],
                 [0, -1, 1, -2, 2], format="csr")
    Qd = torch.as_tensor(Q.toarray(), dtype=D)
    gen = torch.Generator().manual_seed(0)
    y = torch.poisson(torch.exp(torch.sin(torch.arange(n, dtype=D) / 5)), generator=gen)
    Qt = torch.as_tensor(Q.toarray(), dtype=D).to_sparse_csr()
    layout = LatentLayout.from_shapes([("x", (n,))], [1])
    lgm = LatentGaussianModel(layout, [PriorBlock("x", torch.zeros(n, dtype=D), prec=SparseOperator(Qt))],
                              [SiteGroup("y", Poisson(y), SparseOperator(torch.eye(n, dtype=D).to_sparse_csr()),
                                         torch.zeros(n, dtype=D), (n,))])
    res = fit_dual_vg(lgm, progress=False, gap_tol=1e-10)
    assert res.info["form"] == "banded" and res.converged
    be = SiteSpaceBackend(torch.linalg.inv(Qd), torch.zeros(n, dtype=D))
    sol = solve_dual(be, make_bound(Poisson(y)), gap_tol=1e-10)
    assert torch.allclose(res.posterior.loc, be.mu_t - be.St @ sol.alpha, atol=1e-5)
    Vd = be.site_covariance(sol.lam)
    assert torch.allclose(res.posterior.variance, torch.diagonal(Vd), atol=1e-6)
    assert res.log_evidence_bound == pytest.approx(float(exact_elbo(be, make_bound(Poisson(y)), sol.alpha, sol.lam)),
                                                   abs=1e-5)
    s = res.posterior.sample(2000, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(s.var(0), res.posterior.variance, rtol=0.15)


def test_generic_bound_numerical_conjugate_and_joint_dual():
    gen = torch.Generator().manual_seed(9)
    fam = _family("logit", 5, gen)
    jensen = make_bound(fam, "jensen")
    g = GenericBound(jensen.f, fam)
    alpha = torch.rand(5, dtype=D, generator=gen) * 0.8 + 0.1 - fam.params["y"]
    lam = jensen.ell(alpha)[0] * 0.8
    val, h, rho, ok = numerical_conjugate(g, alpha, lam)
    assert ok.all() and torch.allclose(val, jensen.conjugate(alpha, lam), atol=1e-9)
    # a smooth generic bound with a conjugate finite everywhere: Poisson + rho^2 / 2 (still a valid bound)
    W, S, mu, d, gen = _problem(N=5, L=3, seed=10)
    pf = _family("poisson", 5, gen)
    pb = make_bound(pf)
    smooth = GenericBound(lambda hh, rr: pb.f(hh, rr) + 0.5 * rr**2, pf)
    be = SiteSpaceBackend(W @ S @ W.T, W @ mu + d)
    sol = minimize_joint(be, smooth, torch.zeros(5, dtype=D) + 1.0, torch.full((5,), 0.5, dtype=D), gap_tol=1e-9)
    pval, m, V = primal_optimum(S, mu, W, d, lambda hh, rr: -smooth.f(hh, rr), tol=1e-13)
    assert sol.converged and sol.g == pytest.approx(pval, abs=1e-6)


# ----------------------------------------------------------------------------- guide and engine
def _logreg(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(torch.zeros((), dtype=X.dtype), 2.0))
    with pyro.plate("data", X.shape[0]):
        return pyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def test_guide_is_a_pyro_autoguide():
    pyro.clear_param_store()
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(60, 3, dtype=D, generator=gen)
    y = (torch.rand(60, dtype=D, generator=gen) < torch.sigmoid(X @ _t([1.0, -1.0, 0.5]))).to(D)
    guide = DualVG(_logreg)
    res = guide.fit(X, y=y)
    assert isinstance(guide, pyro.infer.autoguide.AutoContinuous) and res.converged and res.engine == "dual_vg"
    ref = pcv.fit(_logreg, X, y=y, engine="dual_vg", progress=False)
    assert res.log_evidence_bound == pytest.approx(ref.log_evidence_bound, abs=1e-10)
    q = guide.get_posterior()
    assert torch.allclose(q.loc, res.posterior.loc) and torch.allclose(q.covariance_matrix, res.posterior.covariance(), atol=1e-10)
    med = guide.median()
    assert torch.allclose(med["w"], res.posterior.loc[:3]) and med["b"].shape == ()
    qs = guide.quantiles([0.5])
    assert torch.allclose(qs["w"][0], med["w"])
    pred = pyro.infer.Predictive(_logreg, guide=guide, num_samples=7)(X)
    assert pred["y"].shape == (7, 60)
    assert {"DualVG.loc", "DualVG.scale", "DualVG.scale_tril"} <= set(pyro.get_param_store().keys())
    # further SVI training starts from the dual optimum: the exact VG optimum is near, the loss is finite
    svi = pyro.infer.SVI(_logreg, guide, pyro.optim.Adam({"lr": 1e-3}), pyro.infer.Trace_ELBO(num_particles=50))
    loss = svi.step(X, y=y)
    assert math.isfinite(loss) and abs(-loss - res.log_evidence_bound) < 5.0
    # warm start of a second fit
    res2 = guide.fit(X, y=y)
    assert res2.info["iterations"] <= 1


def _logreg_data(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, dtype=D, generator=gen)
    y = (torch.rand(n, dtype=D, generator=gen) < torch.sigmoid(X @ _t([1.0, -1.0, 0.5]))).to(D)
    return X, y


def test_guide_warm_start_on_data_of_another_size_starts_cold():
    """The previous state has 60 dual variables, the new data 45 observations: the guide checks before the run
    and starts cold, giving the answer (and the iterations) of a fresh guide's cold fit on the 45."""
    pyro.clear_param_store()
    X, y = _logreg_data(60)
    guide = DualVG(_logreg)
    first = guide.fit(X, y=y)
    assert first.state.alpha.shape == (60,) and first.state.mismatch(first.lgm) is None
    Xs, ys = X[:45], y[:45]
    reason = first.state.mismatch(pcv.fit(_logreg, Xs, y=ys, engine="dual_vg", progress=False).lgm)
    assert reason == "the state has (60,) dual variables, the model 45 observed site entries"
    warm = guide.fit(Xs, y=ys)
    pyro.clear_param_store()
    cold = DualVG(_logreg).fit(Xs, y=ys)
    assert warm.converged and cold.converged and cold.info["iterations"] >= 2
    assert warm.info["iterations"] == cold.info["iterations"]
    assert torch.allclose(warm.posterior.loc, cold.posterior.loc, rtol=0, atol=1e-12)
    assert torch.allclose(warm.posterior.covariance(), cold.posterior.covariance(), rtol=0, atol=1e-12)
    assert warm.log_evidence_bound == pytest.approx(cold.log_evidence_bound, abs=1e-12)
    # the same data again: the state fits, the warm start is used (the optimum already: no iteration)
    again = guide.fit(Xs, y=ys)
    assert again.info["iterations"] == 0
    assert again.log_evidence_bound == pytest.approx(cold.log_evidence_bound, abs=1e-9)


def test_dual_state_mismatch_names_what_differs():
    X, y = _logreg_data(30)
    res = pcv.fit(_logreg, X, y=y, engine="dual_vg", progress=False)
    st = res.state
    assert st.mismatch(res.lgm) is None
    other = pcv.fit(_logreg, torch.cat([X, X[:, :1]], 1), y=y, engine="dual_vg", progress=False)  # 5 latents
    assert st.mismatch(other.lgm) == "the state's Gaussian is over 4 latent coordinates, the model's over 5"
    assert DualState(st.alpha, form="block").mismatch(res.lgm) == (
        "the state is of the 'block' form, the model has no vector sites")
    assert DualState(st.alpha).mismatch(other.lgm) is None  # a bare warm start (alpha only) needs the size alone


def test_guide_warm_started_fit_propagates_its_errors(monkeypatch):
    """An error raised inside a warm-started fit is not swallowed by a cold restart (it was, for any
    ValueError/RuntimeError)."""
    from pyro_convexvb.infer.dual_vg import engine as dual_engine

    pyro.clear_param_store()
    X, y = _logreg_data(60)
    guide = DualVG(_logreg)
    guide.fit(X, y=y)
    real = dual_engine.solve_dual
    for exc in (RuntimeError, ValueError):
        def failing(backend, lb, alpha0, exc=exc, **kw):
            if alpha0 is not None:
                raise exc("solver failure from the warm start")
            return real(backend, lb, alpha0, **kw)

        monkeypatch.setattr(dual_engine, "solve_dual", failing)
        with pytest.raises(exc, match="solver failure from the warm start"):
            guide.fit(X, y=y)
    cold = guide.fit(X, y=y, warm_start=False)  # the cold path does not reach the failure
    assert cold.converged and cold.info["iterations"] >= 2


def test_engine_registry_and_errors():
    assert "dual_vg" in pcv.engines()
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(10, 2, dtype=D, generator=gen)
    from pyro_convexvb.lgm.families import StudentT

    # no convex local bound (and no exact VG refinement for a likelihood that is not log-concave)
    lgm = LatentGaussianModel.from_design(X, StudentT(torch.ones(10, dtype=D), torch.full((10,), 3.0, dtype=D), 1.0))
    with pytest.raises(ValueError, match="not log-concave"):
        pcv.fit(lgm, engine="dual_vg", progress=False)
    with pytest.raises(ValueError, match="bound"):
        make_bound(BernoulliLogit(torch.zeros(3, dtype=D)), "nope")
    with pytest.raises(ValueError, match="labels"):
        make_bound(BernoulliLogit(_t([0.0, 2.0])))
    with pytest.raises(ValueError, match="bound"):
        DualVG(_logreg, bound="nope")
    with pytest.raises(ValueError, match="Sigma_tilde"):
        SiteSpaceBackend(torch.eye(3, dtype=D), torch.zeros(4, dtype=D))
    with pytest.raises(ValueError, match="NaN"):
        StochasticVolatility(_t([1.0, float("nan")]))
    lgm = LatentGaussianModel.from_design(X, Poisson(torch.ones(10, dtype=D)))
    with pytest.warns(pcv.ConvergenceWarning, match="gap"):
        fit_dual_vg(lgm, progress=False, max_iter=1, gap_tol=1e-30)
    with pytest.raises(pcv.ConvergenceError):
        fit_dual_vg(lgm, progress=False, max_iter=1, gap_tol=1e-30, on_fail="raise")


# ----------------------------------------------------------------------------- L-space matrix-free Newton
@pytest.mark.parametrize("kind,name", [("poisson", None), ("logit", "tight"), ("logit", "jensen")])
def test_latent_hessian_operator_matches_dense_hessian_and_finite_differences(kind, name):
    W, S, mu, d, gen = _problem(N=12, L=4, seed=21)
    fam, b = _bound(kind, name, 12, gen)
    be = LatentSpaceBackend(W, mu, d, prior_cov=S)
    a0 = solve_dual(be, b, gap_tol=1e-9).alpha
    lo, hi = b.alpha_domain(a0)
    width = torch.where(torch.isfinite(hi - lo), torch.minimum(a0 - lo, hi - a0), torch.ones_like(a0))
    alpha = a0 + 0.3 * width * (2 * torch.rand(12, dtype=D, generator=gen) - 1)
    dense = reduced_objective(be, b, alpha, hessian=True).hessian
    op = reduced_objective(be, b, alpha, hessian="operator").hessian
    assert not torch.is_tensor(op) and op.shape == (12, 12)
    e, I = 1e-6, torch.eye(12, dtype=D)
    fd_H = torch.stack([(reduced_objective(be, b, alpha + e * I[i]).grad - reduced_objective(be, b, alpha - e * I[i]).grad)
                        / (2 * e) for i in range(12)])
    H_op = torch.stack([op.mv(I[i]) for i in range(12)], 1)
    assert torch.allclose(H_op, dense, atol=1e-12, rtol=1e-12)
    assert torch.allclose(op.to_dense(), dense, atol=1e-12, rtol=1e-12)
    assert torch.allclose(H_op, fd_H, atol=1e-5, rtol=1e-5)
    # the Woodbury preconditioner is the exact inverse of Sigma_t + diag(psi'' - ell'' v/2 + ell'^2 v^2/2)
    v = (op.G * op.G).sum(0)
    P = W @ S @ W.T + torch.diag(op.diag + 0.5 * (op.dl * v) ** 2)
    r = torch.randn(12, dtype=D, generator=gen)
    assert torch.allclose(op.precondition(r), torch.linalg.solve(P, r), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", ["logit", "poisson"])
def test_latent_form_cg_newton_matches_site_form_optimum(kind):
    W, S, mu, d, gen = _problem(N=60, L=5, seed=22)
    fam = _family(kind, 60, gen)
    lgm = _lgm(W, S, mu, d, fam)
    r_site = fit_dual_vg(lgm, progress=False, form="site", gap_tol=1e-11)
    r_dense = fit_dual_vg(lgm, progress=False, form="latent", newton_solver="dense", gap_tol=1e-11)
    r_cg = fit_dual_vg(lgm, progress=False, form="latent", newton_solver="cg", gap_tol=1e-11)
    assert r_cg.info["cg_iterations"] >= r_cg.info["iterations"] > 0 and r_dense.info["cg_iterations"] == 0
    for r in (r_dense, r_cg):
        assert r.converged and r.info["form"] == "latent" and r.info["gap"] <= 1e-11
        assert r.log_evidence_bound == pytest.approx(r_site.log_evidence_bound, abs=1e-8)
        assert r.info["dual_objective"] == pytest.approx(r_site.info["dual_objective"], abs=1e-8)
        assert torch.allclose(r.state.alpha, r_site.state.alpha, atol=1e-6)
        assert torch.allclose(r.posterior.loc, r_site.posterior.loc, atol=1e-6)
        assert torch.allclose(r.posterior.covariance(), r_site.posterior.covariance(), atol=1e-7)
    # same Newton path as the dense system (inexact solves may add at most a step or two)
    assert r_cg.info["iterations"] <= r_dense.info["iterations"] + 2
    # independent reference: the primal LVB optimum by scipy over (m, chol V) equals min g (strong duality)
    b = make_bound(fam, "tight")
    best, m, V = primal_optimum(S, mu, W, d, lambda h, r: -b.f(h, r), tol=1e-12)
    assert r_cg.info["dual_objective"] == pytest.approx(best, abs=1e-6)
    assert torch.allclose(r_cg.posterior.loc, m, atol=1e-4)


def test_newton_solver_argument_is_checked():
    W, S, mu, d, gen = _problem(N=20, L=3, seed=23)
    lgm = _lgm(W, S, mu, d, _family("logit", 20, gen))
    with pytest.raises(ValueError, match="newton_solver"):
        fit_dual_vg(lgm, progress=False, form="latent", newton_solver="qr")


def test_newton_solver_cg_is_refused_by_the_site_form_which_has_no_matrix_free_hessian():
    """The N x N site form solves Newton steps by Cholesky only; newton_solver='cg' ran that silently."""
    W, S, mu, d, gen = _problem(N=8, L=10, seed=23)
    lgm = _lgm(W, S, mu, d, _family("logit", 8, gen))
    with pytest.raises(ValueError, match=r"newton_solver='cg' needs a matrix-free Hessian, which the site form "
                                         r"does not have.*form='latent'"):
        fit_dual_vg(lgm, progress=False, form="site", newton_solver="cg")
    ref = fit_dual_vg(lgm, progress=False, form="site", gap_tol=1e-11)
    cg = fit_dual_vg(lgm, progress=False, form="latent", newton_solver="cg", gap_tol=1e-11)
    assert cg.info["cg_iterations"] > 0
    assert cg.log_evidence_bound == pytest.approx(ref.log_evidence_bound, abs=1e-8)


def test_auto_form_is_banded_for_a_gmrf_read_through_a_gather():
    """x[idx] of a SparseGMRF is extracted as a dense design with one nonzero per row (below a thousand latents):
    the documented rule picks the banded form for it, as for a sparse design (it picked the site or latent form)."""
    import scipy.sparse as sp
    n = 40
    Q = sp.diags([-np.ones(n - 1), 2.3 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1], format="csr")
    Qt = torch.sparse_csr_tensor(torch.as_tensor(Q.indptr), torch.as_tensor(Q.indices), torch.as_tensor(Q.data),
                                 size=(n, n), dtype=D)
    g = torch.Generator().manual_seed(5)
    idx = torch.cat([torch.randperm(n, generator=g), torch.randint(0, n, (10,), generator=g)])
    y = torch.poisson(torch.full((n + 10,), 2.0, dtype=D), generator=g)

    def model(y=None):
        x = pyro.sample("x", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Qt))
        with pyro.plate("data", n + 10):
            pyro.sample("y", dist.Poisson(torch.exp(x[idx])), obs=y)

    auto = pcv.fit(model, y=y, engine="dual_vg", options={"gap_tol": 1e-10}, progress=False)
    site = pcv.fit(model, y=y, engine="dual_vg", options={"form": "site", "gap_tol": 1e-10}, progress=False)
    assert auto.info["form"] == "banded" and auto.converged
    assert auto.log_evidence_bound == pytest.approx(site.log_evidence_bound, abs=1e-8)


def test_site_backend_covariance_from_the_inverse_of_B_matches_the_direct_inverse():
    """``V_t = (Sigma_t^{-1} + Lam)^{-1}`` from ``cholesky_inverse(B)`` (and, for weak or zero ``lam``, from
    ``V_t``'s columns) against the direct inverse, at strong, weak and zero site precisions."""
    g = torch.Generator().manual_seed(3)
    N = 12
    A = torch.randn(N, N, dtype=D, generator=g)
    S = A @ A.T / N + 0.5 * torch.eye(N, dtype=D)
    lam = torch.rand(N, dtype=D, generator=g) * 0.25
    lam[0], lam[1], lam[2] = 0.0, 1e-9, 3e-5  # zero, and weak sites below SMALL_PRECISION
    be = SiteSpaceBackend(S, torch.zeros(N, dtype=D))
    alpha = torch.randn(N, dtype=D, generator=g) * 0.1
    t = be.evaluate(alpha, lam, hessian=True)
    ref = torch.linalg.inv(torch.linalg.inv(S) + torch.diag(lam))
    assert torch.allclose(t.V_tilde, ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(t.v_tilde, torch.diagonal(ref), rtol=1e-10, atol=1e-12)
    assert torch.allclose(be.evaluate(alpha, lam).v_tilde, torch.diagonal(ref), rtol=1e-10, atol=1e-12)
    B = torch.eye(N, dtype=D) + lam.sqrt()[:, None] * S * lam.sqrt()[None, :]
    assert float(t.logdet_B) == pytest.approx(float(torch.logdet(B)), rel=1e-12)


def test_refine_keeps_going_while_the_exact_bound_rises_on_a_strongly_coupled_gp():
    """GP classification on ionosphere at a learned kernel (outputscale 61): the CVI residual stays put for many
    steps while the exact VG bound still rises; ``refine`` must not stop there (it stopped 4.6e-3 nats short of
    the CVI optimum; now 1.1e-4, reported as not converged by the residual criterion)."""
    X, y, _, _ = pcv.datasets.load_keel("ionosphere", test_size=0.3, seed=0)
    X = X.to(D)
    K = 60.83 * torch.exp(-0.5 * torch.cdist(X, X) ** 2 / 8.3**2) + 1e-6 * torch.eye(X.shape[0], dtype=D)
    from pyro_convexvb.gp.classifier import gp_classification_lgm

    lgm = gp_classification_lgm(K, y.to(D))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        res = pcv.fit(lgm, engine="dual_vg", options=dict(refine=True), progress=False)
    ref = cvi_fixed_point(K, torch.zeros(X.shape[0], dtype=D), BernoulliLogit(y.to(D)), tol=1e-15, max_iter=3000)
    assert res.log_evidence_bound >= ref["elbo"] - 5e-4, (res.log_evidence_bound, ref["elbo"])
    assert res.info["refine_converged"] == (res.info["refine_residual"] <= 1e-8)
    # the reason names the refinement's own outcome, not only the dual solver's gap
    how = "reached" if res.info["refine_converged"] else "stopped short of"
    assert f"refinement: {res.info['refine_iterations']} CVI steps {how} the exact-VG fixed point" in res.stop_reason
    assert res.converged <= res.info["refine_converged"]  # an unconverged refinement is an unconverged fit


def test_refine_stops_on_a_flat_bound_and_runs_on_while_it_rises():
    """``refine_exact`` judged by an unreachable residual: from the dual's (local-bound) optimum, several nats
    below the exact VG optimum, it keeps taking CVI steps while the exact bound rises by more than
    ``REFINE_RISE_RTOL`` (relative); started again at its own end point, where the bound is flat to rounding
    and the residual no longer falls, it stops after the five stalled steps instead of running to ``max_iter``
    (with any rise counting, the polish of banana ran all 100 steps on rounding-level rises)."""
    from pyro_convexvb.gp.classifier import gp_classification_lgm
    from pyro_convexvb.infer.dual_vg.engine import build_dual_problem
    from pyro_convexvb.infer.dual_vg.optim import REFINE_RISE_RTOL, refine_exact

    assert REFINE_RISE_RTOL == 1e-10
    g = torch.Generator().manual_seed(4)
    N = 60
    X = torch.randn(N, 2, generator=g, dtype=D)
    K = 30.0 * torch.exp(-0.5 * torch.cdist(X, X) ** 2 / 1.5**2) + 1e-6 * torch.eye(N, dtype=D)
    y = (torch.rand(N, generator=g, dtype=D) < torch.sigmoid(3 * X[:, 0])).to(D)
    backend, lb, form = build_dual_problem(gp_classification_lgm(K, y), "tight", "site")
    sol = solve_dual(backend, lb, on_fail="ignore")
    a1, l1, e1, it1, conv1, r1 = refine_exact(backend, lb, sol.alpha, sol.lam, tol=1e-15, residual_tol=0.0,
                                              max_iter=400, return_residual=True)
    lvb = float(exact_elbo(backend, lb, sol.alpha, sol.lam, backend.evaluate(sol.alpha, sol.lam)))
    assert e1 - lvb > 0.1 and not conv1
    assert 5 < it1 < 400
    a2, l2, e2, it2, conv2, r2 = refine_exact(backend, lb, a1, l1, tol=1e-15, residual_tol=0.0, max_iter=400,
                                              return_residual=True)
    assert it2 <= 6 and not conv2
    assert abs(e2 - e1) <= 1e-9 * abs(e1)
    ref = cvi_fixed_point(K, torch.zeros(N, dtype=D), BernoulliLogit(y), tol=1e-15, max_iter=3000)
    # at the optimum of its own (64-point) bound; the reference's fixed point is that of a 32-point quadrature
    assert e1 == pytest.approx(ref["elbo"], abs=1e-5)


def test_refine_reaches_the_fixed_point_of_a_weakly_determined_logistic_regression():
    """Sonar (208 rows, 61 weights, nearly separable) under a wide N(0, 1.2^2) prior: the CVI targets were
    quadratures of d log p and d2 log p (32 points) and the bound a 64-point quadrature of log p, which part by
    1e-4 at the wide site variances here, so full CVI steps went downhill on the reported bound and the
    refinement stalled at a residual of 4.5e-4 (converged=False; 3 of the hierarchical benchmark's 10 design points
    did so). With the derivatives of the reported quadrature itself it reaches the fixed point."""
    Xtr, ytr, _, _ = pcv.datasets.load_keel("sonar", seed=0)
    X = torch.cat([Xtr.to(D), torch.ones(Xtr.shape[0], 1, dtype=D)], 1)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.2).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    plain = pcv.fit(model, X, y=ytr.to(D), engine="dual_vg", progress=False)
    res = pcv.fit(model, X, y=ytr.to(D), engine="dual_vg", options={"refine": True}, progress=False)
    assert res.converged and res.info["refine_converged"] and res.info["refine_residual"] <= 1e-8
    assert res.log_evidence_bound > plain.log_evidence_bound + 0.1


def test_poisson_regression_with_wide_covariates_fits_and_a_diverging_start_is_named():
    """Unstandardised covariates (sd 5) under a N(0, 1) prior put the prior-marginal start at rates of exp(100): its
    dual point had no positive definite precision and a raw torch LinAlgError ended the fit; a Gamma regression
    returned posterior means of -2e17. Now the Poisson fit starts from a feasible candidate and agrees with grid
    quadrature; where no start or iteration is feasible the error says why and what to do."""
    from tests._grid_quadrature import grid_posterior_2d

    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 2, generator=g, dtype=D) * 5
    y = torch.poisson(torch.exp(X @ torch.tensor([0.3, -0.2], dtype=D)), generator=g)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("n", X.shape[0]):
            pyro.sample("y", dist.Poisson(torch.exp(X @ w)), obs=y)

    res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
    Xn, yn = X.numpy(), y.numpy()
    m, s, log_z = grid_posterior_2d(lambda W: (yn * (W @ Xn.T) - np.exp(W @ Xn.T)).sum(1)
                                    - float(torch.lgamma(y + 1).sum()), [-1, -1], [1, 1], n=801)
    assert res.converged and res.log_evidence_bound <= log_z + 1e-6
    assert np.abs((res.posterior.loc.numpy() - m) / s).max() < 0.1

    def gamma(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("n", X.shape[0]):
            pyro.sample("y", dist.Gamma(2.0, 2.0 * torch.exp(-(X @ w))), obs=y)

    for seed in range(3):
        gs = torch.Generator().manual_seed(seed)
        Xg = torch.randn(30, 2, generator=gs, dtype=D) * 5
        yg = torch.distributions.Gamma(2.0, 2.0 * torch.exp(-(Xg @ torch.tensor([0.3, -0.2], dtype=D)))).sample()
        try:
            r = pcv.fit(gamma, Xg, y=yg, engine="dual_vg", progress=False)
        except pcv.NotPositiveDefiniteError as e:
            assert "standardise the covariates" in str(e) and "engine='laplace'" in str(e)
        else:
            assert math.isfinite(r.log_evidence_bound) and bool(r.posterior.loc.abs().max() < 10)


def _logit_regression_30():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(30, 2, generator=g, dtype=D)
    y = (torch.rand(30, generator=g, dtype=D) < torch.sigmoid(X @ torch.tensor([1.5, -1.0], dtype=D))).to(D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.5).to_event(1))
        with pyro.plate("n", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
    return model, X, y


def _quadrature_log_evidence(loglik, prior_sd, lim=8.0, n=801):
    """``log p(y)`` of a 2-coefficient model with an ``N(0, prior_sd^2 I)`` prior by a fixed 2-D grid."""
    g = torch.linspace(-lim, lim, n, dtype=D)
    W1, W2 = torch.meshgrid(g, g, indexing="ij")
    W = torch.stack([W1.reshape(-1), W2.reshape(-1)], 1)
    lp = loglik(W) + torch.distributions.Normal(0.0, prior_sd).log_prob(W).sum(1)
    return float(torch.logsumexp(lp, 0) + 2 * math.log(float(g[1] - g[0])))


def test_lbfgs_leaves_the_domain_boundary_jensen_logit():
    # the prior-marginal start of the Jensen bound puts kappa within 8e-8 of 1 at one site, whose own descent heads
    # for the boundary: a step cut to 99.5% of that site's distance for every site moved nothing in 20000 iterations
    # (dual objective +119.77 against -18.4768)
    model, X, y = _logit_regression_30()
    fits = {m: pcv.fit(model, X, y=y, engine="dual_vg", options={"bound": "jensen", "method": m}, progress=False)
            for m in ("newton", "lbfgs")}
    new, lb = fits["newton"], fits["lbfgs"]
    assert new.converged and lb.converged and lb.info["iterations"] < 100
    assert new.info["dual_objective"] == pytest.approx(-18.4767784, abs=1e-6)
    assert lb.info["dual_objective"] == pytest.approx(new.info["dual_objective"], abs=3e-7)
    assert lb.log_evidence_bound == pytest.approx(new.log_evidence_bound, abs=1e-5)
    assert torch.allclose(lb.posterior.loc, new.posterior.loc, atol=1e-4)
    log_p = _quadrature_log_evidence(lambda W: (y * (W @ X.T) - torch.nn.functional.softplus(W @ X.T)).sum(1), 1.5)
    assert log_p == pytest.approx(-17.025, abs=1e-3) and -17.75 < lb.log_evidence_bound < log_p


def _poisson_regression(seed, scale, prior_sd):
    torch.manual_seed(seed)
    N = int(torch.randint(3, 40, ()).item())
    X = torch.randn(N, 2, dtype=D) * scale
    w0 = torch.randn(2, dtype=D) * 2
    torch.rand(N, dtype=D)
    y = torch.poisson(torch.exp((X @ w0).clamp(max=6)))

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), prior_sd).to_event(1))
        with pyro.plate("n", X.shape[0]):
            pyro.sample("y", dist.Poisson(torch.exp(X @ w)), obs=y)
    return model, X, y


@pytest.mark.parametrize("seed,scale,prior_sd,form", [(101, 1.0, 2.0, "latent"), (102, 3.0, 5.0, "latent"),
                                                      (102, 3.0, 5.0, "sparse"), (101, 1.0, 2.0, "site")])
def test_lbfgs_reaches_the_newton_optimum_on_poisson_rates_of_many_scales(seed, scale, prior_sd, form):
    # site rates from 1e-5 to 1e3 make the conjugate curvature 1 / lambda span eight orders of magnitude; with the
    # scalar initial scaling L-BFGS was 4e-5 and 1.5e-4 nats from closing the gap after 2000 iterations
    model, X, y = _poisson_regression(seed, scale, prior_sd)
    assert X.shape[0] == 36 and float(y.max()) > 400 and float(y.min()) == 0
    fits = {m: pcv.fit(model, X, y=y, engine="dual_vg", options={"method": m, "form": form}, progress=False)
            for m in ("newton", "lbfgs")}
    new, lb = fits["newton"], fits["lbfgs"]
    assert new.converged and lb.converged and lb.info["iterations"] < 500
    assert lb.info["dual_objective"] == pytest.approx(new.info["dual_objective"], abs=4e-7)
    assert lb.log_evidence_bound == pytest.approx(new.log_evidence_bound, abs=4e-7)
    sd = new.posterior.variance.sqrt()
    assert torch.allclose(lb.posterior.loc, new.posterior.loc, atol=1e-3 * float(sd.min()))


def test_form_banded_is_refused_without_a_gmrf_read_one_latent_per_site():
    # it failed inside the backend with "Q: expected a sparse matrix ..., got DiagonalOperator"
    model, X, y = _logit_regression_30()
    with pytest.raises(ValueError, match=r"option form='banded' needs a Gaussian Markov random field prior .*"
                                         r"the prior of 'w' has a precision of type DiagonalOperator, not a sparse "
                                         r"matrix\. Use form='auto' .* 'sparse', 'latent', 'site'"):
        pcv.fit(model, X, y=y, engine="dual_vg", options={"form": "banded"}, progress=False)
    ref = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
    for form in ("sparse", "latent", "site"):  # the forms the message offers run the model
        r = pcv.fit(model, X, y=y, engine="dual_vg", options={"form": form}, progress=False)
        # the exact VG bound of q, not the dual's objective: first order in q's distance from the default gap_tol
        assert r.converged and r.log_evidence_bound == pytest.approx(ref.log_evidence_bound, abs=2e-5)

    # a GMRF prior whose sites each read two latents (a chain of 6, sites on neighbouring pairs)
    import scipy.sparse as sp
    Q = sp.diags([-0.4 * np.ones(5), 1.5 * np.ones(6), -0.4 * np.ones(5)], [-1, 0, 1], format="csr")
    Qt = torch.sparse_csr_tensor(torch.as_tensor(Q.indptr), torch.as_tensor(Q.indices), torch.as_tensor(Q.data),
                                 size=(6, 6), dtype=D)
    Xp = torch.zeros(5, 6, dtype=D)
    Xp[torch.arange(5), torch.arange(5)] = 1.0
    Xp[torch.arange(5), torch.arange(1, 6)] = 1.0
    yp = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0], dtype=D)

    def gmrf_model(Xp, y=None):
        x = pyro.sample("x", pcv.distributions.SparseGMRF(torch.zeros(6, dtype=D), Qt))
        with pyro.plate("n", 5):
            pyro.sample("y", dist.Bernoulli(logits=Xp @ x), obs=y)
    with pytest.raises(ValueError, match=r"option form='banded' .* site row 0 reads 2 latents\. Use form='auto'"):
        pcv.fit(gmrf_model, Xp, y=yp, engine="dual_vg", options={"form": "banded"}, progress=False)
    assert pcv.fit(gmrf_model, Xp, y=yp, engine="dual_vg", options={"form": "site"}, progress=False).converged


def test_xi_and_alpha0_of_the_wrong_shape_or_type_are_refused_by_name():
    # xi of the wrong shape failed with torch's "The expanded size of the tensor (30) must match ..." and
    # alpha0='abc' with "new(): invalid data type 'str'"
    model, X, y = _logit_regression_30()

    def fit(**options):
        return pcv.fit(model, X, y=y, engine="dual_vg", options=options, progress=False)
    with pytest.raises(ValueError, match=r"option 'xi' must be a finite scalar or a \(30,\) tensor, one Jaakkola "
                                         r"tangent point per observed site entry; got shape \(3,\)$"):
        fit(bound="jaakkola", xi=torch.ones(3, dtype=D))
    with pytest.raises(ValueError, match=r"option 'xi' .* got shape \(30,\) with non-finite entries"):
        fit(bound="jaakkola", xi=torch.full((30,), math.nan, dtype=D))
    with pytest.raises(TypeError, match=r"option 'xi' expects a finite scalar or a \(30,\) tensor.*, got 'abc' "
                                        r"\(str\)"):
        fit(bound="jaakkola", xi="abc")
    with pytest.raises(TypeError, match=r"option 'alpha0' expects a \(30,\) tensor of real numbers, got 'abc' \(str\)"):
        fit(alpha0="abc")
    with pytest.raises(ValueError, match=r"option 'alpha0' must be a finite vector .* shape \(30,\); got shape \(3,\)"):
        fit(alpha0=[0.1, 0.2, 0.3])
    # a scalar xi is every site's: the same fit as the vector; the bound is the closed form's at the optimum
    r_scalar, r_vec = fit(bound="jaakkola", xi=3.0), fit(bound="jaakkola", xi=torch.full((30,), 3.0, dtype=D))
    assert r_scalar.converged and r_scalar.log_evidence_bound == pytest.approx(-17.202657942, abs=1e-8)
    assert r_vec.log_evidence_bound == r_scalar.log_evidence_bound


def test_xi_vector_is_split_over_several_site_groups():
    # two Bernoulli-logit groups: one xi per observed entry, in site order (it failed in torch's expand before)
    model, X, y = _logit_regression_30()

    def two_groups(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.5).to_event(1))
        with pyro.plate("a", 12):
            pyro.sample("ya", dist.Bernoulli(logits=X[:12] @ w), obs=None if y is None else y[:12])
        with pyro.plate("b", 18):
            pyro.sample("yb", dist.Bernoulli(logits=X[12:] @ w), obs=None if y is None else y[12:])
    xi = torch.linspace(0.5, 4.0, 30, dtype=D)
    one = pcv.fit(model, X, y=y, engine="dual_vg", options={"bound": "jaakkola", "xi": xi}, progress=False)
    two = pcv.fit(two_groups, X, y=y, engine="dual_vg", options={"bound": "jaakkola", "xi": xi}, progress=False)
    assert one.converged and two.converged
    assert two.log_evidence_bound == pytest.approx(one.log_evidence_bound, abs=1e-9)
    assert torch.allclose(two.posterior.loc, one.posterior.loc, atol=1e-8)


def test_a_logit_bound_option_on_a_model_without_logit_sites_warns():
    """``bound='jaakkola'`` on a Poisson model changed nothing, silently (``hyper='map'`` on a model without
    hyper-latents already warned); it now warns that it has no effect. On a logistic model it does not."""
    D = torch.float64
    X = torch.randn(20, 2, dtype=D, generator=torch.Generator().manual_seed(0))

    def model(X, y=None, logit=False):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("d", 20):
            pyro.sample("y", dist.Bernoulli(logits=X @ w) if logit else dist.Poisson(torch.exp(X @ w)), obs=y)

    with pytest.warns(UserWarning, match=r"option bound='jaakkola' has no effect: the model has no logit-family"):
        pcv.fit(model, X, y=torch.ones(20, dtype=D), engine="dual_vg", options=dict(bound="jaakkola"),
                progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pcv.fit(model, X, y=(X[:, 0] > 0).double(), logit=True, engine="dual_vg", options=dict(bound="jaakkola"),
                progress=False)


def test_a_logit_bound_option_on_weighted_logit_sites_does_not_warn():
    """Weighted (``poutine.scale``) logit sites wrap their bound: the option takes effect, no warning."""
    D = torch.float64
    X = torch.randn(20, 2, dtype=D, generator=torch.Generator().manual_seed(0))

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("d", 20), pyro.poutine.scale(scale=torch.full((20,), 2.0, dtype=D)):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pcv.fit(model, X, y=(X[:, 0] > 0).double(), engine="dual_vg", options=dict(bound="jensen"), progress=False)
