"""Weighted (tempered) likelihood sites ``t(eta)^w`` -- ``poutine.scale`` -- in ``dual_vg`` and ``convex_relaxation``.

Float64 checks against independent references: brute-force suprema of the weighted local bound
(its Fenchel conjugate), finite differences, the same model with every row repeated ``w`` times
(integer weights), a direct primal optimisation of the weighted local-bound ELBO by scipy
(fractional weights), brute-force minimisation of ``x / gamma + 2 w g(x)`` (the weighted
super-Gaussian ``h``), and 2-D quadrature of the weighted model's evidence.
"""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import scipy.optimize as so
import torch

import pyro_convexvb as pcv
from pyro_convexvb.infer.convex_relaxation import (
    ConvexVariationalRelaxation,
    GenericPotential,
    LaplacePotential,
    LogisticPotential,
    StudentTPotential,
    gaussian_lower_bound,
    h_implicit,
    h_star,
    h_star_implicit,
)
from pyro_convexvb.infer.convex_relaxation.potentials import WeightedPotential, potential_for
from pyro_convexvb.infer.dual_vg import fit_dual_vg, make_bound
from pyro_convexvb.infer.dual_vg.bounds import WeightedBound
from pyro_convexvb.infer.dual_vg.engine import dual_vg_applies
from pyro_convexvb.lgm.layout import LatentLayout
from pyro_convexvb.lgm.model import LatentGaussianModel, PriorBlock, SiteGroup
from pyro_convexvb.lgm.sites import (
    BernoulliLogit,
    BernoulliProbit,
    Gaussian,
    Laplace,
    Poisson,
    StochasticVolatility,
    StudentT,
    Weighted,
)
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
    y = (torch.rand(N, dtype=D, generator=gen) < 0.5).to(D)
    return BernoulliProbit(y) if kind == "probit" else BernoulliLogit(y)


def _problem(N, L, seed):
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
    prior = PriorBlock("z", mu, cov=DenseOperator(S), prec=DenseOperator(torch.linalg.inv(S)),
                       logdet_cov=float(torch.logdet(S)))
    return LatentGaussianModel(layout, [prior], [SiteGroup("y", family, DenseOperator(W), d, (N,))])


BOUND_CASES = [("poisson", None), ("sv", None), ("gaussian", None), ("probit", None), ("logit", "tight"),
               ("logit", "jensen"), ("logit", "bohning"), ("logit", "jaakkola")]
# each site with weight w, the same sites repeated w times
INT_WEIGHTS = [1, 2, 3, 1, 2, 3, 2]


# ============================================================================ dual_vg: the weighted local bound
@pytest.mark.parametrize("kind,name", BOUND_CASES)
def test_weighted_conjugate_matches_brute_force_supremum(kind, name):
    """``(w f)*(alpha, lambda) = sup_{h, rho >= 0} alpha h + lambda rho / 2 - w f(h, rho)`` by grid + L-BFGS-B."""
    gen = torch.Generator().manual_seed(1)
    N = 4
    fam = _family(kind, N, gen)
    w = _t([0.3, 1.0, 2.5, 4.0])
    xi = 1.3 if name == "jaakkola" else None
    b = make_bound(Weighted(fam, w), name or "tight", xi=xi)
    base = make_bound(fam, name or "tight", xi=xi)
    assert isinstance(b, WeightedBound) and b.name == "weighted_" + base.name
    lo, hi = b.alpha_domain(torch.zeros(N, dtype=D))
    lo0, hi0 = base.alpha_domain(torch.zeros(N, dtype=D))
    torch.testing.assert_close(lo, w * lo0, rtol=0, atol=0)
    torch.testing.assert_close(hi, w * hi0, rtol=0, atol=0)
    lo_f = torch.where(torch.isfinite(lo), lo, -2 * w)
    hi_f = torch.where(torch.isfinite(hi), hi, 2 * w)
    alpha = lo_f + (hi_f - lo_f) * torch.rand(N, dtype=D, generator=gen).clamp(0.2, 0.8)
    ell = b.ell(alpha)[0]
    hg = torch.linspace(-30, 30, 241, dtype=D)
    rg = torch.cat([torch.zeros(1, dtype=D), torch.logspace(-4, 2.5, 27, dtype=D)])
    HH, RR = (a.reshape(-1) for a in torch.meshgrid(hg, rg, indexing="ij"))
    f_grid = {}  # f of site n on the grid (the same for both lambdas)
    for lam in (ell, 0.5 * ell):
        closed = b.conjugate(alpha, lam)
        assert torch.isfinite(closed).all()
        torch.testing.assert_close(closed, b.psi(alpha)[0], rtol=0, atol=0)
        for n in range(N):
            # w f of site n, from the unweighted bound (on the grid, and at one point)
            if n not in f_grid:
                grid_bound = make_bound(fam.subset(torch.full((HH.shape[0],), n)), name or "tight", xi=xi)
                f_grid[n] = grid_bound.f(HH, RR)
            one = make_bound(fam.subset(torch.tensor([n])), name or "tight", xi=xi)
            grid = float(alpha[n]) * HH + 0.5 * float(lam[n]) * RR - float(w[n]) * f_grid[n]
            i = int(torch.argmax(grid))

            def neg(x, n=n, one=one):
                h = torch.tensor([x[0]], dtype=D, requires_grad=True)
                r = torch.tensor([max(x[1], 0.0)], dtype=D, requires_grad=True)
                val = float(w[n]) * one.f(h, r).sum()
                gh, gr = torch.autograd.grad(val, (h, r))
                J = float(alpha[n]) * x[0] + 0.5 * float(lam[n]) * x[1] - float(val.detach())
                return -J, -np.array([float(alpha[n]) - float(gh), 0.5 * float(lam[n]) - float(gr)])

            starts = ([float(HH[i]), float(RR[i])], [0.0, 0.5], [1.0, 2.0])
            best = min((so.minimize(neg, x0, jac=True, method="L-BFGS-B", bounds=[(-40, 40), (0, 400)],
                                    options=dict(ftol=1e-16, gtol=1e-12, maxiter=5000)) for x0 in starts),
                       key=lambda r: r.fun)
            sup = max(-best.fun, float(grid.max()))
            assert sup == pytest.approx(float(closed[n]), abs=1e-8 * (1 + abs(float(closed[n]))))
    # lambda > ell_w: unbounded
    assert torch.isinf(b.conjugate(alpha, ell * 1.5 + 0.1)).all()


@pytest.mark.parametrize("kind,name", BOUND_CASES)
def test_weighted_bound_derivatives_and_fenchel_young(kind, name):
    """``psi_w``, ``ell_w`` derivatives against central differences; ``alpha_star = d(w f)/dh``; the
    Fenchel-Young residual vanishes at the marginals that ``alpha`` is optimal for."""
    gen = torch.Generator().manual_seed(3)
    N = 5
    fam = _family(kind, N, gen)
    w = _t([0.25, 0.7, 1.0, 2.0, 5.5])
    b = make_bound(Weighted(fam, w), name or "tight", xi=0.9 if name == "jaakkola" else None)
    h = torch.randn(N, dtype=D, generator=gen)
    rho = 0.2 + torch.rand(N, dtype=D, generator=gen)
    alpha = b.alpha_star(h, rho)
    lo, hi = b.alpha_domain(alpha)
    assert bool(((alpha > lo) & (alpha < hi)).all())
    e = 1e-6 * (1 + alpha.abs())
    p, dp, d2p = b.psi(alpha)
    l, dl, d2l = b.ell(alpha)
    pp, dpp, _ = b.psi(alpha + e)
    pm, dpm, _ = b.psi(alpha - e)
    lp, dlp, _ = b.ell(alpha + e)
    lm, dlm, _ = b.ell(alpha - e)
    for an, fd in ((dp, (pp - pm) / (2 * e)), (d2p, (dpp - dpm) / (2 * e)), (dl, (lp - lm) / (2 * e)),
                   (d2l, (dlp - dlm) / (2 * e))):
        assert float((an - fd).abs().max()) <= 1e-6 * (1 + float(an.abs().max()))
    # alpha_star is d(w f)/dh
    eh = 1e-6
    fd_h = (b.f(h + eh, rho) - b.f(h - eh, rho)) / (2 * eh)
    torch.testing.assert_close(alpha, fd_h, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.f(h, rho), w * make_bound(fam, name or "tight", xi=0.9).f(h, rho))
    # the exact expectation of the weighted site: w E log p by Gauss-Hermite, independently
    from pyro_convexvb.lgm.sites import gaussian_expectation
    ref = w * gaussian_expectation(lambda e_: fam._broadcast_log_prob(e_), h, rho, 80)
    torch.testing.assert_close(b.exact_expected_log_prob(h, rho), ref, rtol=1e-9, atol=1e-9)
    # the exact (Poisson, SV, Gaussian) bounds are exact for the weighted sites too
    if b.exact:
        torch.testing.assert_close(-b.f(h, rho), ref, rtol=1e-9, atol=1e-9)
    # Fenchel-Young: zero where alpha = d(w f)/dh and lambda = ell_w(alpha) = 2 d(w f)/drho (the (h, rho)
    # that alpha is optimal for); positive elsewhere
    er = 1e-6
    fd_r = (b.f(h, rho + er) - b.f(h, rho - er)) / (2 * er)
    torch.testing.assert_close(l, 2 * fd_r, rtol=1e-6, atol=1e-7)
    assert float(b.fenchel_young_residual(alpha, h, rho).abs().max()) < 1e-9
    assert bool((b.fenchel_young_residual(alpha, h + 0.4, rho + 0.5) >= -1e-12).all())


def test_tight_logit_bound_is_its_supremum_at_large_site_variances():
    """The weighted conjugates reach the tight logit bound at ``rho = rho_w / w``-scaled points with large site
    variances; its value there is the supremum over ``kappa`` (brute force on a fine grid), where plain
    Newton in ``logit kappa`` used to cycle between the ends of its bracket."""
    from pyro_convexvb.infer.dual_vg.bounds import _entropy_terms

    h = _t([-12.5, -12.5, 0.0, 5.0, 30.0, -40.0])
    rho = _t([31.6, 316.2, 31.6, 100.0, 1000.0, 3.0])
    f = make_bound(BernoulliLogit(torch.zeros(6, dtype=D))).f(h, rho)
    k = torch.linspace(1e-12, 1 - 1e-12, 400001, dtype=D)[:, None]
    brute = (k * h + 0.5 * k * (1 - k) * rho - _entropy_terms(k)[0]).max(0).values
    assert float((f - brute).abs().max()) < 1e-6  # the grid's resolution; f >= brute always
    assert bool((f >= brute - 1e-12).all())


def _duplicated(W, d, fam, weights):
    idx = torch.repeat_interleave(torch.arange(len(weights)), torch.as_tensor(weights))
    return W[idx], d[idx], fam.subset(idx), idx


@pytest.mark.parametrize("form", ["site", "latent"])
@pytest.mark.parametrize("kind,name", BOUND_CASES)
def test_integer_weights_equal_the_rows_repeated(kind, name, form):
    """Weight ``w`` = the same site repeated ``w`` times: the dual optimum (``alpha``, ``lambda`` summed over
    the copies), the posterior, the local-bound ELBO and the reported bound agree to 1e-8."""
    N, L = len(INT_WEIGHTS), 4 if form == "latent" else 9
    W, S, mu, d, gen = _problem(N, L, seed=5)
    fam = _family(kind, N, gen)
    w = _t(INT_WEIGHTS)
    opts = dict(progress=False, bound=name or "tight", gap_tol=1e-13, form=form, max_iter=200)
    a = fit_dual_vg(_lgm(W, S, mu, d, Weighted(fam, w)), **opts)
    Wd, dd, famd, idx = _duplicated(W, d, fam, INT_WEIGHTS)
    b = fit_dual_vg(_lgm(Wd, S, mu, dd, famd), **opts)
    assert a.converged and b.converged and a.info["form"] == form
    qa, qb = a.posterior, b.posterior
    assert float((qa.loc - qb.loc).abs().max()) < 1e-8
    assert float((qa.covariance() - qb.covariance()).abs().max()) < 1e-8
    summed = torch.zeros(N, dtype=D).index_add_(0, idx, b.state.alpha)
    assert float((a.state.alpha - summed).abs().max()) < 1e-8 * (1 + float(summed.abs().max()))
    summed_lam = torch.zeros(N, dtype=D).index_add_(0, idx, b.state.lam)
    assert float((a.state.lam - summed_lam).abs().max()) < 1e-8 * (1 + float(summed_lam.abs().max()))
    assert a.info["lvb_elbo"] == pytest.approx(b.info["lvb_elbo"], abs=1e-8)
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-8)


@pytest.mark.parametrize("kind", ["poisson", "logit"])
def test_integer_weights_on_a_gmrf_equal_the_rows_repeated(kind):
    """The sparse-precision (GMRF) form with weighted sites, Newton with its matrix-free Hessian."""
    n = 15
    main = torch.full((n,), 2.2, dtype=D)
    Q = torch.diag(main) - torch.diag(torch.ones(n - 1, dtype=D), 1) - torch.diag(torch.ones(n - 1, dtype=D), -1)
    gen = torch.Generator().manual_seed(2)
    fam = _family(kind, n, gen)
    weights = [1 + (i % 3) for i in range(n)]

    def lgm(rows, family):
        P = torch.zeros(len(rows), n, dtype=D)
        P[torch.arange(len(rows)), torch.as_tensor(rows)] = 1.0
        layout = LatentLayout.from_shapes([("x", (n,))], [1])
        return LatentGaussianModel(layout, [PriorBlock("x", torch.zeros(n, dtype=D),
                                                       prec=SparseOperator(Q.to_sparse_csr()))],
                                   [SiteGroup("y", family, SparseOperator(P.to_sparse_csr()),
                                              torch.zeros(len(rows), dtype=D), (len(rows),))])

    opts = dict(progress=False, gap_tol=1e-13, max_iter=200)
    a = fit_dual_vg(lgm(list(range(n)), Weighted(fam, _t(weights))), **opts)
    idx = torch.repeat_interleave(torch.arange(n), torch.as_tensor(weights))
    b = fit_dual_vg(lgm(idx.tolist(), fam.subset(idx)), **opts)
    assert a.info["form"] == "banded" and a.converged and b.converged
    # a duality gap g bounds the KL from the optimum, so each mean is within sqrt(2 g lambda_max(Sigma)) of the
    # optimal one: the two fits (different trajectories) can promise no more than twice that
    tol = 2 * (2 * opts["gap_tol"] * float(a.posterior.variance.max())) ** 0.5
    assert float((a.posterior.loc - b.posterior.loc).abs().max()) < tol
    assert float((a.posterior.variance - b.posterior.variance).abs().max()) < tol
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-8)


def _scipy_primal(S, mu, W, d, site_term):
    """``max -KL(N(m, V) || N(mu, S)) + sum site_term(h, rho)`` over ``(m, Cholesky of V)`` by scipy L-BFGS-B."""
    L = mu.shape[0]
    idx = torch.tril_indices(L, L)
    LS = torch.linalg.cholesky(S)
    logdet_S = 2 * torch.log(torch.diagonal(LS)).sum()

    def unpack(x):
        x = torch.as_tensor(x, dtype=D)
        m = x[:L]
        M = torch.zeros(L, L, dtype=D).index_put((idx[0], idx[1]), x[L:])
        return m, M.tril(-1) + torch.diag(torch.exp(torch.diagonal(M)))

    def value(x):
        m, Lv = unpack(x)
        V = Lv @ Lv.T
        r = torch.cholesky_solve((m - mu)[:, None], LS)[:, 0]
        neg_kl = 0.5 * (2 * torch.log(torch.diagonal(Lv)).sum() - logdet_S
                        - torch.trace(torch.cholesky_solve(V, LS)) - (m - mu) @ r + L)
        return neg_kl + site_term(W @ m + d, ((W @ Lv) ** 2).sum(-1)).sum()

    def neg(x):
        xt = torch.tensor(x, dtype=D, requires_grad=True)
        v = value(xt)
        (g,) = torch.autograd.grad(v, xt)
        return -float(v.detach()), -g.numpy()

    diag = (idx[0] == idx[1]).numpy()
    raw = np.zeros(len(diag))
    raw[diag] = np.log(0.5 * np.diag(LS.numpy()))
    x0 = np.concatenate([mu.numpy(), raw])
    res = so.minimize(neg, x0, jac=True, method="L-BFGS-B",
                      options=dict(ftol=1e-16, gtol=1e-11, maxiter=20000, maxcor=50))
    m, Lv = unpack(res.x)
    return -res.fun, m, Lv @ Lv.T


@pytest.mark.parametrize("kind,name", BOUND_CASES)
def test_fractional_weights_against_a_direct_primal_optimisation(kind, name):
    """Fractional weights: the dual optimum equals the scipy maximiser of ``-KL - sum_n w_n f_n`` (``f_n`` the
    unweighted bound); the reported bound is the exact VG bound of ``q`` for the weighted sites."""
    N, L = 6, 3
    W, S, mu, d, gen = _problem(N, L, seed=7)
    fam = _family(kind, N, gen)
    w = _t([0.35, 1.6, 0.8, 2.7, 0.5, 1.25])
    lgm = _lgm(W, S, mu, d, Weighted(fam, w))
    res = fit_dual_vg(lgm, progress=False, bound=name or "tight", gap_tol=1e-12, form="site",
                      **({"xi": 1.3} if name == "jaakkola" else {}))
    assert res.converged
    base = make_bound(fam, name or "tight", xi=1.3)
    pval, m, V = _scipy_primal(S, mu, W, d, lambda h, r: -w * base.f(h, r))
    assert res.info["lvb_elbo"] == pytest.approx(pval, abs=1e-8)
    q = res.posterior
    assert float((q.loc - m).abs().max()) < 1e-5 and float((q.covariance() - V).abs().max()) < 1e-5
    # reported bound = -KL(q || p) + sum_n w_n E_q log p(y_n | eta_n), evaluated densely here
    Vq, mq = q.covariance(), q.loc
    h, rho = W @ mq + d, torch.einsum("nl,lk,nk->n", W, Vq, W)
    Si = torch.linalg.inv(S)
    neg_kl = 0.5 * (torch.logdet(Vq) - torch.logdet(S) - torch.trace(Si @ Vq) - (mq - mu) @ Si @ (mq - mu) + L)
    from pyro_convexvb.lgm.sites import gaussian_expectation
    ell = (w * gaussian_expectation(lambda e: fam._broadcast_log_prob(e), h, rho, 96)).sum()
    assert res.log_evidence_bound == pytest.approx(float(neg_kl + ell), abs=1e-9)
    assert res.log_evidence_bound >= res.info["lvb_elbo"] - 1e-9


# ============================================================================ convex_relaxation: the weighted potential
def _potentials():
    y = _t([1, 0, 1])
    return {
        "logistic": LogisticPotential(y, tau=1.3),
        "laplace": LaplacePotential(_t([0.5, 1.0, 2.0])),
        "student_t": StudentTPotential(_t([0.3, -1.0, 2.0]), 4.0, _t([0.7, 1.0, 1.5])),
        "generic": GenericPotential(lambda x: -(1 + x).sqrt(), lambda x: -0.5 / (1 + x).sqrt(),
                                    lambda x: 0.25 * (1 + x) ** -1.5, beta=_t([0.2, -0.1, 0.0]), kappa=-0.3),
    }


@pytest.mark.parametrize("which", ["logistic", "laplace", "student_t", "generic"])
def test_weighted_potential_is_the_tempered_site(which):
    """``t(s)^w``: ``log t_w = w log t``; ``h_w`` equals ``-min_x (x / gamma + 2 w g(x))`` by brute force and
    the appendix's implicit route; ``h*`` equals its nested implicit route; the Gaussian lower bounds
    stay below ``w log t`` and touch it at ``x_*``; ``gamma_init`` touches where the base one does."""
    base = _potentials()[which]
    w = _t([0.4, 1.0, 2.5])
    pot = WeightedPotential(base, w)
    assert pot.name == "weighted_" + base.name and pot.log_concave == base.log_concave
    s = _t([-1.3, 0.2, 2.4])
    torch.testing.assert_close(pot.log_prob(s), w * base.log_prob(s), rtol=1e-14, atol=1e-14)
    # g, g', g'' of the weighted site by finite differences of w g (from the base g)
    x = _t([0.05, 0.7, 3.0])
    e = 1e-5 * x
    torch.testing.assert_close(pot.dg(x), w * (base.g(x + e) - base.g(x - e)) / (2 * e), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(pot.d2g(x), w * (base.dg(x + e) - base.dg(x - e)) / (2 * e), rtol=1e-6, atol=1e-10)
    torch.testing.assert_close(pot.curv(x), -(2 * pot.dg(x) + 4 * x * pot.d2g(x)), rtol=1e-10, atol=1e-12)
    # h_w(gamma) = -min_x (x / gamma + 2 w g(x)), brute force by scipy on log x (and x = 0)
    for gamma in (_t([0.3, 0.9, 1.7]), _t([4.0, 9.0, 30.0])):
        hw = pot.h(gamma)
        for i in range(3):
            def obj(lx, i=i):
                xx = _t([math.exp(lx)] * 3)
                return float(xx[i] / gamma[i] + 2 * w[i] * base.g(xx)[i])

            r = so.minimize_scalar(obj, bounds=(-30, 12), method="bounded", options=dict(xatol=1e-12))
            at0 = float(2 * w[i] * base.g(torch.zeros(3, dtype=D))[i])
            assert float(hw[i]) == pytest.approx(-min(r.fun, at0), abs=1e-8 * (1 + abs(float(hw[i]))))
        torch.testing.assert_close(hw, h_implicit(pot, gamma)[0], rtol=1e-9, atol=1e-9)
        # x_*: the touching point of the width-gamma Gaussian lower bound
        xs = pot.x_star(gamma)
        torch.testing.assert_close(xs, h_implicit(pot, gamma)[3], rtol=1e-7, atol=1e-9)
        sg = torch.linspace(-6, 6, 241, dtype=D)
        for i in range(3):
            base_i, pot_i = _slice(pot, i, sg.shape[0])
            lb = gaussian_lower_bound(pot_i, sg, gamma[i].expand_as(sg))
            assert bool((lb <= w[i] * base_i.log_prob(sg) + 1e-12).all())
            base_1, pot_1 = _slice(pot, i, 1)
            st = xs[i].sqrt().expand(1)
            lb_t = gaussian_lower_bound(pot_1, st, gamma[i].expand(1))
            assert float(lb_t) == pytest.approx(float(w[i] * base_1.log_prob(st)), abs=1e-9)
    # h*: closed form equals the appendix's nested implicit route
    z = _t([0.3, 1.1, 0.05])
    for a, b_ in zip(h_star(pot, s, z), h_star_implicit(pot, s, z)):
        torch.testing.assert_close(a, b_, rtol=1e-7, atol=1e-9)
    # gamma_init touches the weighted site where the base gamma_init touches the base site
    torch.testing.assert_close(pot.x_star(pot.gamma_init(s)), base.x_star(base.gamma_init(s)), rtol=1e-9, atol=1e-9)


def _slice(pot, i, size):
    """``(base, weighted)`` potentials of site ``i`` of a weighted potential, repeated ``size`` times."""
    idx = torch.full((size,), i, dtype=torch.long)
    base = pot.base
    if isinstance(base, LogisticPotential):
        b = LogisticPotential((base.beta[idx] > 0).to(D), tau=base.tau)
    elif isinstance(base, LaplacePotential):
        b = LaplacePotential(base.scale[idx])
    elif isinstance(base, StudentTPotential):
        b = StudentTPotential(base.shift[idx], base.df[idx], base.scale[idx])
    else:
        b = GenericPotential(base._g, base._dg, base._d2g, beta=base.beta[idx], kappa=base.kappa[idx],
                             log_concave=base.log_concave)
    return b, WeightedPotential(b, pot.weight[idx])


def _explicit_lgm(X, family, prior_scale=1.5):
    return LatentGaussianModel.from_design(X, family, prior_scale=prior_scale)


# a fixed number of outer steps, few enough that phi still falls by far more than rounding at the last one (the
# engine returns the iterate of smallest phi: at a converged fixed point that choice would be decided by rounding)
CR_OPTS = dict(variance="exact", max_outer=4, gamma_tol=0.0, phi_tol=0.0, newton_tol=1e-13, cg_tol=1e-12,
               progress=False)


@pytest.mark.parametrize("kind", ["logit", "laplace"])
def test_convex_relaxation_integer_weights_equal_the_rows_repeated(kind):
    """Every double-loop iterate of the weighted model is that of the repeated rows (``gamma_w = gamma / w``):
    posterior mean, variances, relaxation bound and ``phi`` agree to 1e-8."""
    gen = torch.Generator().manual_seed(4)
    N, n = len(INT_WEIGHTS), 3
    X = torch.randn(N, n, dtype=D, generator=gen)
    if kind == "logit":
        fam = BernoulliLogit((torch.rand(N, dtype=D, generator=gen) < 0.5).to(D))
    else:
        fam = Laplace(0.5 + torch.rand(N, dtype=D, generator=gen))
    w = _t(INT_WEIGHTS)
    idx = torch.repeat_interleave(torch.arange(N), torch.as_tensor(INT_WEIGHTS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        a = ConvexVariationalRelaxation(_explicit_lgm(X, Weighted(fam, w)), **CR_OPTS).run()
        b = ConvexVariationalRelaxation(_explicit_lgm(X[idx], fam.subset(idx)), **CR_OPTS).run()
    assert a.info["best_outer_index"] == b.info["best_outer_index"] == CR_OPTS["max_outer"]
    assert float((a.posterior.loc - b.posterior.loc).abs().max()) < 1e-8
    assert float((a.posterior.variance - b.posterior.variance).abs().max()) < 1e-8
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-8)
    assert np.allclose(a.info["phi_history"], b.info["phi_history"], rtol=0, atol=1e-8)
    ga, gb = a.state.gamma, b.state.gamma
    first = torch.cumsum(torch.as_tensor(INT_WEIGHTS), 0) - torch.as_tensor(INT_WEIGHTS)
    torch.testing.assert_close(ga * w, gb[first], rtol=1e-8, atol=1e-10)


def test_convex_relaxation_refuses_a_weighted_gaussian_family_and_non_super_gaussian_sites():
    X = torch.randn(5, 2, dtype=D, generator=torch.Generator().manual_seed(0))
    wg = Weighted(Gaussian(torch.zeros(5, dtype=D), torch.ones(5, dtype=D)), torch.full((5,), 2.0, dtype=D))
    with pytest.raises(pcv.UnsupportedModelError, match="weighted by poutine.scale"):
        potential_for(wg)
    for fam in (Poisson(torch.ones(5, dtype=D)), BernoulliProbit(torch.ones(5, dtype=D))):
        err = ConvexVariationalRelaxation.applies(_explicit_lgm(X, Weighted(fam, torch.full((5,), 0.5, dtype=D))))
        reason = str(err)
        assert err.site == "y" and reason.startswith("site 'y': ") and "weighted by poutine.scale" in reason
        assert "not super-Gaussian" in reason
        assert not any(e in reason for e in pcv.engines())  # refusals never name engines


def test_dual_vg_refuses_a_weighted_site_without_a_local_bound_naming_it():
    X = torch.randn(5, 2, dtype=D, generator=torch.Generator().manual_seed(0))
    fam = Weighted(StudentT(torch.zeros(5, dtype=D), 3.0, 1.0), torch.full((5,), 0.5, dtype=D))
    err = dual_vg_applies(_explicit_lgm(X, fam))
    reason = str(err)
    assert err.site == "y" and reason.startswith("site 'y': ") and "weighted by poutine.scale" in reason
    assert "student_t" in reason and not any(e in reason for e in pcv.engines())
    with pytest.raises(ValueError, match="weighted by poutine.scale"):
        make_bound(fam)


# ============================================================================ Pyro models with poutine.scale
def _data(N=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.linspace(-2, 2, N, dtype=D)
    X = torch.stack([torch.ones(N, dtype=D), x], 1)
    y = (torch.rand(N, dtype=D, generator=gen) < torch.sigmoid(0.4 + 1.2 * x)).to(D)
    counts = torch.poisson(torch.exp(0.2 + 0.5 * x), generator=gen)
    return X, y, counts


def _model(kind, weights):
    def model(X, y=None):
        b = pyro.sample("b", dist.Normal(torch.zeros(2, dtype=D), 1.5).to_event(1))
        eta = X @ b
        with pyro.plate("data", X.shape[0]), poutine.scale(scale=weights):
            if kind == "logit":
                pyro.sample("y", dist.Bernoulli(logits=eta), obs=y)
            elif kind == "probit":
                pyro.sample("y", dist.Bernoulli(probs=dist.Normal(0.0, 1.0).cdf(eta)), obs=y)
            else:
                pyro.sample("y", dist.Poisson(torch.exp(eta)), obs=y)
    return model


def _fit(model, *args, engine, **kwargs):
    opts = {"dual_vg": dict(gap_tol=1e-13, max_iter=200), "convex_relaxation": CR_OPTS_FIT}[engine]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        return pcv.fit(model, *args, engine=engine, options=opts, progress=False, **kwargs)


CR_OPTS_FIT = {k: v for k, v in CR_OPTS.items() if k != "progress"}


@pytest.mark.parametrize("engine,kind", [("dual_vg", "logit"), ("dual_vg", "probit"), ("dual_vg", "poisson"),
                                         ("convex_relaxation", "logit")])
def test_poutine_scale_with_integer_weights_is_the_data_repeated(engine, kind):
    X, y, counts = _data()
    obs = counts if kind == "poisson" else y
    weights = _t([1 + (i % 3) for i in range(X.shape[0])])
    a = _fit(_model(kind, weights), X, y=obs, engine=engine)
    idx = torch.repeat_interleave(torch.arange(X.shape[0]), weights.long())
    b = _fit(_model(kind, torch.ones(len(idx), dtype=D)), X[idx], y=obs[idx], engine=engine)
    assert pcv.lgm_from_pyro(_model(kind, weights), X, y=obs).sites[0].family.name.startswith("weighted_")
    tol = 1e-8
    if engine == "dual_vg":  # a gap g bounds the KL from the optimum: means within sqrt(2 g lambda_max(Sigma)) each
        gap = max(r.optimality.criteria[0].tol for r in (a, b))
        tol = max(tol, 2 * (2 * gap * float(torch.linalg.eigvalsh(a.posterior.covariance()).max())) ** 0.5)
    assert float((a.posterior.loc - b.posterior.loc).abs().max()) < tol
    assert float((a.posterior.covariance() - b.posterior.covariance()).abs().max()) < tol
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-8)


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_plate_with_explicit_subsample_indices_is_a_weighted_likelihood(engine):
    """``pyro.plate(size=N, subsample=idx)`` scales the ``M`` rows by ``N / M``: here 3, so it is the
    subsample repeated three times."""
    X, y, _ = _data(N=12)
    sub = torch.tensor([0, 3, 5, 8])

    def model(X, y=None, subsample=None):
        b = pyro.sample("b", dist.Normal(torch.zeros(2, dtype=D), 1.5).to_event(1))
        with pyro.plate("data", X.shape[0], subsample=subsample) as i:
            pyro.sample("y", dist.Bernoulli(logits=X[i] @ b), obs=y[i])

    lgm = pcv.lgm_from_pyro(model, X, y=y, subsample=sub)
    torch.testing.assert_close(lgm.sites[0].weight, torch.full((4,), 3.0, dtype=D))
    a = _fit(model, X, y=y, subsample=sub, engine=engine)
    idx = sub.repeat_interleave(3)
    b = _fit(_model("logit", torch.ones(len(idx), dtype=D)), X[idx], y=y[idx], engine=engine)
    assert float((a.posterior.loc - b.posterior.loc).abs().max()) < 1e-8
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-8)


def _log_integral_2d(logf, mode, sd, half_width=9.0, num=481):
    """``log int exp(logf(b)) db`` over ``b in R^2`` by a trapezoid rule on ``mode +- half_width sd``."""
    g0 = mode[0] + sd[0] * torch.linspace(-half_width, half_width, num, dtype=D)
    g1 = mode[1] + sd[1] * torch.linspace(-half_width, half_width, num, dtype=D)
    G = torch.stack(torch.meshgrid(g0, g1, indexing="ij"), -1).reshape(-1, 2)
    lj = logf(G).reshape(num, num)
    mx = lj.max()
    return float(mx + torch.log(torch.trapezoid(torch.trapezoid(torch.exp(lj - mx), g1, dim=1), g0)))


def _log_evidence_2d(model, kind, X, obs, weights):
    """``log int p(b) prod_n p(y_n | x_n b)^{w_n} db`` by a 2-D trapezoid rule around the mode; the weighted log
    likelihood is written out with torch distributions, and checked against Pyro's trace of the model.
    Returns ``(log Z, mode, sd)``."""
    def loglik(B):
        eta = B @ X.T
        if kind == "logit":
            lp = torch.distributions.Bernoulli(logits=eta).log_prob(obs)
        elif kind == "probit":
            lp = torch.special.log_ndtr((2 * obs - 1) * eta)
        else:
            lp = torch.distributions.Poisson(torch.exp(eta)).log_prob(obs)
        return (weights * lp).sum(-1) + torch.distributions.Normal(_t(0.0), _t(1.5)).log_prob(B).sum(-1)

    b0 = torch.zeros(2, dtype=D, requires_grad=True)
    opt = torch.optim.LBFGS([b0], max_iter=200, tolerance_grad=1e-12, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        v = -loglik(b0[None])[0]
        v.backward()
        return v
    opt.step(closure)
    mode = b0.detach()
    Hm = torch.autograd.functional.hessian(lambda b: -loglik(b[None])[0], mode)
    sd = torch.sqrt(torch.diagonal(torch.linalg.inv(Hm)))
    for pt in (mode, mode + 0.3 * sd):  # the integrand is the model's own (scaled) log joint
        tr = poutine.trace(poutine.condition(model, data={"b": pt})).get_trace(X, y=obs)
        assert float(tr.log_prob_sum()) == pytest.approx(float(loglik(pt[None])[0]), abs=1e-10)
    return _log_integral_2d(loglik, mode, sd), mode, sd


@pytest.mark.parametrize("engine,kind", [("dual_vg", "logit"), ("dual_vg", "probit"), ("dual_vg", "poisson"),
                                         ("convex_relaxation", "logit")])
def test_fractional_weights_bound_below_the_log_evidence_by_quadrature(engine, kind):
    X, y, counts = _data(N=10, seed=3)
    obs = counts if kind == "poisson" else y
    weights = torch.linspace(0.3, 2.6, X.shape[0], dtype=D)
    model = _model(kind, weights)
    log_z, mode, sd = _log_evidence_2d(model, kind, X, obs, weights)
    res = _fit(model, X, y=obs, engine=engine)
    assert res.log_evidence_bound <= log_z + 1e-9
    # and not a vacuous one (measured: 0.05 nats below for dual_vg, 0.54 for the relaxation)
    assert res.log_evidence_bound >= log_z - (0.1 if engine == "dual_vg" else 1.0)
    if engine == "convex_relaxation":
        # the relaxation's bound is log int of its Gaussian minorant: prior times, per site, w times the
        # logistic's Gaussian lower bound of width w gamma (Nickisch & Seeger 2009, §2), by quadrature
        gamma = res.state.gamma
        base = LogisticPotential(obs)

        def log_minorant(B):
            s_ = B @ X.T
            lb = base.kappa + base.beta * s_ - s_ * s_ / (2 * weights * gamma) - 0.5 * base.h(weights * gamma)
            return (weights * lb).sum(-1) + torch.distributions.Normal(_t(0.0), _t(1.5)).log_prob(B).sum(-1)

        assert res.log_evidence_bound == pytest.approx(_log_integral_2d(log_minorant, mode, sd), abs=1e-8)
        # and it lies below the exact VG bound of its own Q
        lgm = pcv.lgm_from_pyro(model, X, y=obs)
        q = res.posterior
        assert res.log_evidence_bound <= float(lgm.evidence_lower_bound(q.loc, q.covariance())) + 1e-9


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_a_weighted_group_beside_unweighted_groups(engine):
    """One weighted Bernoulli group next to an unweighted Poisson (``dual_vg``) or Normal (both) group: the
    same as the Bernoulli rows repeated, the other groups unchanged."""
    X, y, counts = _data(N=9, seed=5)
    weights = _t([1 + (i % 3) for i in range(X.shape[0])])
    r = X @ _t([0.3, -0.8]) + 0.4 * torch.randn(X.shape[0], dtype=D, generator=torch.Generator().manual_seed(1))
    with_poisson = engine == "dual_vg"

    def model(X, Xb, y, r, counts, wts):
        b = pyro.sample("b", dist.Normal(torch.zeros(2, dtype=D), 1.5).to_event(1))
        with pyro.plate("bern", Xb.shape[0]), poutine.scale(scale=wts):
            pyro.sample("y", dist.Bernoulli(logits=Xb @ b), obs=y)
        with pyro.plate("gauss", X.shape[0]):
            pyro.sample("r", dist.Normal(X @ b, 0.6), obs=r)
        if with_poisson:
            with pyro.plate("counts", X.shape[0]):
                pyro.sample("c", dist.Poisson(torch.exp(X @ b)), obs=counts)

    a = _fit(model, X, X, y, r, counts, weights, engine=engine)
    idx = torch.repeat_interleave(torch.arange(X.shape[0]), weights.long())
    b = _fit(model, X, X[idx], y[idx], r, counts, torch.ones(len(idx), dtype=D), engine=engine)
    assert float((a.posterior.loc - b.posterior.loc).abs().max()) < 1e-8
    assert float((a.posterior.covariance() - b.posterior.covariance()).abs().max()) < 1e-8
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-8)


def test_refine_to_the_exact_vg_optimum_with_weights():
    """``refine=True`` (natural-gradient steps with exact expectations) on weighted logit sites: the exact VG
    optimum of the weighted model is that of the repeated rows."""
    N, L = len(INT_WEIGHTS), 9
    W, S, mu, d, gen = _problem(N, L, seed=8)
    fam = _family("logit", N, gen)
    opts = dict(progress=False, gap_tol=1e-12, form="site", refine=True)
    a = fit_dual_vg(_lgm(W, S, mu, d, Weighted(fam, _t(INT_WEIGHTS))), **opts)
    Wd, dd, famd, _ = _duplicated(W, d, fam, INT_WEIGHTS)
    b = fit_dual_vg(_lgm(Wd, S, mu, dd, famd), **opts)
    assert a.info["refine_converged"] and b.info["refine_converged"]
    assert a.log_evidence_bound == pytest.approx(b.log_evidence_bound, abs=1e-8)
    assert a.log_evidence_bound > a.info["lvb_elbo"]  # the exact optimum lies above the tight-bound optimum
    assert float((a.posterior.loc - b.posterior.loc).abs().max()) < 1e-8


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation", "laplace"])
def test_scale_factor_is_kept_in_double_precision(engine):
    """``poutine.scale(0.3)`` on a Gaussian site is a Gaussian of precision 0.3 / sigma^2: the bound is the closed-form
    evidence to 1e-12 (the weight was rounded to float32, 0.30000001192, and every engine's bound was 8.6e-8 off)."""
    D = torch.float64
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 2, generator=g, dtype=D)
    y = torch.randn(2, generator=g, dtype=D)
    s = 0.5

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", 2), poutine.scale(scale=0.3):
            pyro.sample("y", dist.Normal(X @ w, s), obs=y)

    # the tempered site N(y; eta, s)^0.3 = N(y; eta, s^2 / 0.3) * c, c = (2 pi s^2)^(-0.15) (2 pi s^2 / 0.3)^(1/2)
    var = s * s / 0.3
    log_c = -0.3 * 0.5 * math.log(2 * math.pi * s * s) + 0.5 * math.log(2 * math.pi * var)
    exact = torch.distributions.MultivariateNormal(torch.zeros(2, dtype=D), X @ X.T + var * torch.eye(2, dtype=D))
    ref = float(exact.log_prob(y)) + 2 * log_c
    res = pcv.fit(model, X, y=y, engine=engine, progress=False)
    assert res.log_evidence_bound == pytest.approx(ref, abs=1e-10)


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_numerically_singular_prior_is_named(engine):
    """A MultivariateNormal prior whose scale_tril has a diagonal entry of 9e-15 (a value a type-II search over it
    reaches): an error that says the prior covariance is numerically singular (a bare LinAlgError from
    convex_relaxation, a hint about Poisson rates from dual_vg before)."""
    D = torch.float64
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(30, 2, generator=g, dtype=D), torch.randn(30, generator=g, dtype=D)
    L = torch.tensor([[0.9656, 0.0], [1.1866, 9e-15]], dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.MultivariateNormal(torch.zeros(2, dtype=D), scale_tril=L))
        with pyro.plate("d", 30):
            pyro.sample("y", dist.Normal(X @ w, 0.4), obs=y)

    with pytest.raises(pcv.NotPositiveDefiniteError, match="prior covariance is numerically singular"):
        pcv.fit(model, X, y=y, engine=engine, progress=False)
