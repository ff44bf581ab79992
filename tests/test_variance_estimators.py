"""Variance estimators of the convex relaxation's outer loop (float64): the whitened (covariance-form)
Lanczos estimator for Gaussian-process priors against dense formulas and exact variances, Nickisch &
Seeger's (2009) K-Lanczos lower bounds on sparse designs, and the cost model of ``variance="auto"``."""
import math

import pytest
import torch

from pyro_convexvb.gp.classifier import gp_classification_lgm
from pyro_convexvb.infer.convex_relaxation import outer
from pyro_convexvb.infer.convex_relaxation.outer import (
    WhitenedLanczos,
    choose_lanczos_estimator,
    choose_variance_method,
    double_loop,
    variance_costs,
    variance_step,
)
from pyro_convexvb.infer.convex_relaxation import ConvexRelaxationOptions as O
from pyro_convexvb.infer.convex_relaxation import ConvexVariationalRelaxation
from pyro_convexvb.infer.convex_relaxation.problem import RelaxationProblem
from pyro_convexvb.lgm.layout import LatentLayout
from pyro_convexvb.lgm.model import LatentGaussianModel, PriorBlock, SiteGroup
from pyro_convexvb.lgm.sites import BernoulliLogit, Gaussian
from pyro_convexvb.linalg import DenseOperator, DiagonalOperator, IdentityOperator

D = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _step(prob, gamma, generator=None, **options):
    """One variance step with the engine's options (``variance`` defaults to ``"lanczos"`` here)."""
    return variance_step(prob, gamma, O(**{"variance": "lanczos", **options}), generator)


def _loop(prob, **options):
    """The double loop with the engine's options; the state's and the report's entries in one dict."""
    st, rep = double_loop(prob, O(**options))
    step = rep["step"]
    return dict(rep, gamma=st.gamma, u=st.u, variance_method=st.variance_method, variance_estimator=step.estimator,
                variances_are_lower_bounds=step.lower_bounds)


def _rbf(X, scale=2.0, ls=0.8, jitter=1e-6):
    return scale * torch.exp(-0.5 * torch.cdist(X, X) ** 2 / ls**2) + jitter * torch.eye(X.shape[0], dtype=D)


def _gp_classification(N=300, seed=0):
    g = _gen(seed)
    X = torch.randn(N, 2, generator=g, dtype=D)
    K = _rbf(X)
    f = torch.linalg.cholesky(K) @ torch.randn(N, generator=g, dtype=D)
    y = (torch.rand(N, generator=g, dtype=D) < torch.sigmoid(f)).to(D)
    return gp_classification_lgm(K, y)


def _gp_mixed(nf=20, seed=1):
    """A dense RBF block f and a diagonal block b (two coefficients); logistic sites on f + b_0 and on
    random rows; a Gaussian observation group with unequal noise scales."""
    g = _gen(seed)
    X = torch.randn(nf, 1, generator=g, dtype=D)
    K = _rbf(X, scale=1.5, ls=0.7, jitter=1e-3)  # well conditioned: the dense references invert Sigma
    sd_b = torch.tensor([1.5, 0.7], dtype=D)
    n = nf + 2
    layout = LatentLayout.from_shapes([("f", (nf,)), ("b", (2,))], [1, 1])
    priors = [PriorBlock("f", 0.1 * torch.ones(nf, dtype=D), cov=DenseOperator(K)),
              PriorBlock("b", torch.zeros(2, dtype=D), cov=DiagonalOperator(sd_b**2), prec=DiagonalOperator(sd_b**-2),
                         logdet_cov=float(2 * torch.log(sd_b).sum()))]
    B1 = torch.zeros(nf, n, dtype=D)
    B1[:, :nf] = torch.eye(nf, dtype=D)
    B1[:, nf] = 1.0
    B2 = torch.randn(10, n, generator=g, dtype=D)
    Bs = torch.cat([B1, B2])
    y = (torch.rand(nf + 10, generator=g, dtype=D) < 0.5).to(D)
    G = torch.randn(8, n, generator=g, dtype=D)
    sd = 0.3 + torch.rand(8, generator=g, dtype=D)
    yg = torch.randn(8, generator=g, dtype=D)
    sites = [SiteGroup("y", BernoulliLogit(y), DenseOperator(Bs), torch.zeros(nf + 10, dtype=D), (nf + 10,)),
             SiteGroup("obs", Gaussian(yg, sd), DenseOperator(G), torch.zeros(8, dtype=D), (8,))]
    lgm = LatentGaussianModel(layout, priors, sites)
    Lf = torch.linalg.cholesky(K)
    L = torch.block_diag(Lf, torch.diag(sd_b))
    return lgm, dict(L=L, B=Bs, G=G, sd=sd, Sigma=L @ L.T)


def _dense_a(ref, gamma):
    Sinv = torch.linalg.inv(ref["Sigma"])
    return Sinv + ref["G"].T @ (ref["G"] / ref["sd"][:, None] ** 2) + ref["B"].T @ (ref["B"] / gamma[:, None])


# ------------------------------------------------------------------------------ whitened estimator: formulas
@pytest.mark.parametrize("b", [1, 3])
def test_whitened_estimate_equals_dense_formula_and_is_exact_at_k_n(b):
    """z and Var[u] accumulated in the run equal diag(P (I - Q Q^T + Q T^-1 Q^T) P^T) with P = B L (resp. L), the run
    is Lanczos on A_v = L^T A L, and at k = n the estimate is the exact diag(B A^-1 B^T)."""
    lgm, ref = _gp_mixed()
    prob = RelaxationProblem(lgm)
    assert choose_lanczos_estimator(prob) == "whitened"
    n = prob.n
    gam = torch.linspace(0.3, 5.0, prob.q, dtype=D)
    A = _dense_a(ref, gam)
    torch.testing.assert_close(A, prob.dense_a(1 / gam), rtol=1e-9, atol=1e-9 * float(A.abs().max()))
    L, Bd = ref["L"], ref["B"]
    Av = L.T @ A @ L
    C_exact = torch.linalg.inv(A)
    for k in (k for k in (1, 5, 11, n) if k >= b):  # the options refuse a block larger than the run
        step = _step(prob, gam, lanczos_rank=k, lanczos_block_size=b, generator=_gen(3), dense_logdet_max=0)
        assert step.estimator == "whitened" and step.lower_bounds is False and step.method == "lanczos"
        assert isinstance(step.lanczos, WhitenedLanczos)
        res = step.lanczos.result
        Q, T = res.Q, res.T()
        torch.testing.assert_close(Q.T @ Q, torch.eye(Q.shape[1], dtype=D), rtol=0, atol=1e-12)
        torch.testing.assert_close(Q.T @ Av @ Q, T, rtol=0, atol=1e-9 * float(torch.linalg.matrix_norm(Av, 2)))
        Cv = torch.eye(n, dtype=D) - Q @ Q.T + Q @ torch.linalg.solve(T, Q.T)
        C = L @ Cv @ L.T
        torch.testing.assert_close(step.z, torch.diagonal(Bd @ C @ Bd.T), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(step.var_u, torch.diagonal(C), rtol=1e-9, atol=1e-12)
        # the u-space view: predictive variances for new rows and the covariance factor
        Dm = torch.randn(6, n, generator=_gen(k), dtype=D)
        torch.testing.assert_close(step.lanczos.variances(Dm), torch.diagonal(Dm @ C @ Dm.T), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(step.lanczos.variances(), torch.diagonal(C), rtol=1e-9, atol=1e-12)
        F = step.lanczos.covariance_factor()
        assert F.shape == (n, n + Q.shape[1])
        torch.testing.assert_close(F @ F.T, C, rtol=1e-9, atol=1e-11)
        # Fischer's bound on log|A| through A_v (log|A| = log|A_v| - log|Sigma|) stays an upper bound
        exact_logdet = float(torch.logdet(A))
        assert step.logdet >= exact_logdet - 1e-8
        if step.logdet_method == "fischer":
            tr_av = float(torch.trace(Av))
            kk = Q.shape[1]
            expected = float(torch.logdet(T)) - float(torch.logdet(ref["Sigma"]))
            if kk < n:
                expected += (n - kk) * math.log((tr_av - float(torch.trace(T))) / (n - kk))
            assert step.logdet == pytest.approx(expected, rel=1e-9, abs=1e-8)
    torch.testing.assert_close(step.z, torch.diagonal(Bd @ C_exact @ Bd.T), rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(step.var_u, torch.diagonal(C_exact), rtol=1e-8, atol=1e-12)
    assert step.logdet_method == "fischer" and step.logdet == pytest.approx(float(torch.logdet(A)), abs=1e-7)


def test_covariance_form_of_the_problem():
    lgm, ref = _gp_mixed()
    prob = RelaxationProblem(lgm)
    form = prob.covariance_form()
    n = prob.n
    torch.testing.assert_close(form.factor.to_dense(), ref["L"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(form.prior_var, torch.diagonal(ref["Sigma"]), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(form.site_prior_var, torch.diagonal(ref["B"] @ ref["Sigma"] @ ref["B"].T), rtol=1e-11,
                               atol=1e-13)
    G, sd = ref["G"], ref["sd"]
    assert form.gauss_trace == pytest.approx(float((torch.diagonal(G @ ref["Sigma"] @ G.T) / sd**2).sum()), rel=1e-11)
    assert form.logdet == pytest.approx(float(torch.logdet(ref["Sigma"])), rel=1e-11)
    assert form.dense_fraction == pytest.approx(20 / 22)
    # the product with A_v = L^T A L costs two products with the dense factor besides the sites' and the rows'
    f = prob.mvm_flops(whitened=True)
    assert f == 2 * (2 * 20**2 + 2) + (2 * 2 * 30 * n + 30) + (2 * 2 * 8 * n + 8) + n
    assert prob.mvm_flops() == (2 * 20**2 + 2) + (2 * 2 * 30 * n + 30) + (2 * 2 * 8 * n + 8)


# ------------------------------------------------------------------------------ GP classification, 300 points
@pytest.fixture(scope="module")
def gp300():
    lgm = _gp_classification()
    ex = _loop(RelaxationProblem(lgm), variance="exact")
    return lgm, ex


def test_gp_classification_lanczos_variances_match_exact_fit(gp300):
    """300-point GP classification (RBF kernel): the whitened Lanczos fit reproduces the exact-variance fit;
    K-Lanczos on the precision K^-1 + W (the former estimator) returns variances near zero."""
    lgm, ex = gp300
    assert ex["variance_method"] == "exact" and ex["variance_estimator"] == "cholesky"
    prob = RelaxationProblem(lgm)
    la = _loop(prob, variance="lanczos", lanczos_rank=80)
    assert la["variance_method"] == "lanczos" and la["variance_estimator"] == "whitened"
    assert la["variances_are_lower_bounds"] is False
    ze, zl = ex["step"].z, la["step"].z
    assert float(ze.median()) > 0.1  # the exact posterior variances are far from 0
    rel = (zl - ze).abs() / ze
    assert float(rel.median()) < 1e-5 and float(rel.max()) < 1e-4  # measured 1.1e-8 and 9.3e-8
    rel_u = (la["step"].var_u - ex["step"].var_u).abs() / ex["step"].var_u
    assert float(rel_u.median()) < 1e-5
    torch.testing.assert_close(la["u"], ex["u"], rtol=1e-5, atol=1e-6)
    assert la["best_phi"] == pytest.approx(ex["best_phi"], abs=1e-4)
    # at the exact fit's gamma: accuracy against k, and exactness at k = n
    gam = ex["gamma"]
    z40 = _step(prob, gam, lanczos_rank=40, generator=_gen(0)).z
    assert float(((z40 - ze).abs() / ze).median()) < 2e-2  # measured 3.4e-3
    zn = _step(prob, gam, lanczos_rank=prob.n, generator=_gen(0)).z
    torch.testing.assert_close(zn, ze, rtol=1e-7, atol=1e-12)
    # the K-Lanczos lower bound on this model: below the exact values and almost all of them near 0
    kl = _step(prob, gam, lanczos_rank=80, generator=_gen(0), lanczos_estimator="k-lanczos")
    assert kl.estimator == "k-lanczos" and kl.lower_bounds
    assert bool((kl.z <= ze * (1 + 1e-8) + 1e-12).all())
    assert float((kl.z / ze).median()) < 0.05


# ------------------------------------------------------------------------------ sparse designs keep K-Lanczos
def _sparse_logistic(q=400, n=60, seed=4):
    g = _gen(seed)
    X = torch.randn(q, n, generator=g, dtype=D) * (torch.rand(q, n, generator=g, dtype=D) < 0.05)
    w = torch.randn(n, generator=g, dtype=D)
    y = (torch.rand(q, generator=g, dtype=D) < torch.sigmoid(X @ w)).to(D)
    return LatentGaussianModel.from_design(X.to_sparse_csr(), BernoulliLogit(y), prior_scale=1.0)


def test_sparse_logistic_keeps_k_lanczos_lower_bounds():
    lgm = _sparse_logistic()
    prob = RelaxationProblem(lgm)
    assert choose_lanczos_estimator(prob) == "k-lanczos"
    out = _loop(prob, variance="lanczos", lanczos_rank=20, max_outer=3)
    assert out["variance_method"] == "lanczos" and out["variance_estimator"] == "k-lanczos"
    assert out["variances_are_lower_bounds"] is True
    gam = out["gamma"]
    exact = _step(prob, gam, variance="exact")
    step = out["step"]
    assert bool((step.z <= exact.z * (1 + 1e-10) + 1e-14).all())
    assert bool((step.var_u <= exact.var_u * (1 + 1e-10) + 1e-14).all())
    assert float(step.z.sum() / exact.z.sum()) < 0.99  # a strict underestimate at k = 20 < n = 60
    again = _step(prob, gam, lanczos_rank=20, generator=_gen(5))
    assert again.lower_bounds and again.estimator == "k-lanczos"
    assert bool((again.z <= exact.z * (1 + 1e-10) + 1e-14).all())


def test_estimator_choice_rules_and_errors():
    # flat block (Laplace prior turned into sites): K-Lanczos; forcing the whitened form is an error
    X = torch.randn(12, 3, generator=_gen(6), dtype=D)
    y = torch.randn(12, generator=_gen(7), dtype=D)
    layout = LatentLayout.from_shapes([("u", (3,))], [1])
    from pyro_convexvb.lgm.sites import Laplace

    lap = LatentGaussianModel(layout, [PriorBlock("u", torch.zeros(3, dtype=D), flat=True)],
                              [SiteGroup("lap", Laplace(torch.ones(3, dtype=D)),
                                         IdentityOperator(3, dtype=D), torch.zeros(3, dtype=D), (3,), True),
                               SiteGroup("y", Gaussian(y, 0.5 * torch.ones(12, dtype=D)), DenseOperator(X),
                                         torch.zeros(12, dtype=D), (12,))])
    prob = RelaxationProblem(lap)
    assert prob.covariance_blocks() is None and prob.covariance_form() is None
    assert choose_lanczos_estimator(prob) == "k-lanczos"
    # the refusal names the site and the reason, with the limit's value rather than an internal name
    assert "site 'u'" in prob.covariance_obstacle() and "flat" in prob.covariance_obstacle()
    with pytest.raises(ValueError, match="whitened.*site 'u' has no Gaussian prior.*lanczos_estimator='k-lanczos'"):
        _step(prob, torch.ones(3, dtype=D), lanczos_rank=2, lanczos_estimator="whitened")
    with pytest.raises(ValueError, match="whitened.*site 'u'") as err:
        ConvexVariationalRelaxation(lap, variance="lanczos", lanczos_rank=2, lanczos_estimator="whitened",
                                    progress=False).run()
    assert "DENSE_BLOCK_LIMIT" not in str(err.value)
    with pytest.raises(ValueError, match="lanczos_estimator"):
        _loop(prob, variance="lanczos", lanczos_rank=2, lanczos_estimator="precision")
    with pytest.raises(ValueError, match="variance"):
        _loop(prob, variance="fast")
    # a diagonal Gaussian prior is in covariance form, but K-Lanczos is kept (no dense block)
    sp = RelaxationProblem(_sparse_logistic(q=50, n=8))
    assert sp.covariance_blocks() is not None and choose_lanczos_estimator(sp) == "k-lanczos"
    # forcing the whitened estimator there still gives the right answer at k = n
    gam = torch.linspace(0.5, 3.0, sp.q, dtype=D)
    w_full = _step(sp, gam, lanczos_rank=8, lanczos_estimator="whitened", generator=_gen(8))
    torch.testing.assert_close(w_full.z, _step(sp, gam, variance="exact").z, rtol=1e-8, atol=1e-12)


def test_whitened_refusal_names_a_dense_block_too_large_by_its_size(monkeypatch):
    """A dense prior covariance above the limit is named with its size and the limit's value."""
    from pyro_convexvb.infer.convex_relaxation import problem

    monkeypatch.setattr(problem, "DENSE_BLOCK_LIMIT", 2)
    X = torch.randn(6, 3, generator=_gen(1), dtype=D)
    lgm = LatentGaussianModel(LatentLayout.from_shapes([("f", (3,))]),
                              [PriorBlock("f", torch.zeros(3, dtype=D), cov=DenseOperator(torch.eye(3, dtype=D) + 0.5),
                                          prec=DenseOperator(torch.linalg.inv(torch.eye(3, dtype=D) + 0.5)))],
                              [SiteGroup("y", BernoulliLogit(torch.ones(6, dtype=D)), DenseOperator(X),
                                         torch.zeros(6, dtype=D), (6,))])
    prob = RelaxationProblem(lgm)
    assert prob.covariance_obstacle() == ("the dense prior covariance of site 'f' has 3 coordinates, more than the 2 "
                                          "factorised densely")
    with pytest.raises(ValueError, match="site 'f' has 3 coordinates, more than the 2 factorised densely"):
        _step(prob, torch.ones(6, dtype=D), lanczos_rank=2, lanczos_estimator="whitened")


# ------------------------------------------------------------------------------ variance="auto"
def test_variance_costs_follow_the_cost_model():
    lgm = _sparse_logistic(q=300, n=50)
    prob = RelaxationProblem(lgm)
    nnz = lgm.sites[0].design.nnz
    n, q = 50, 300
    f_a = n + 2 * 2 * nnz + q  # diagonal prior, B^T W B
    assert prob.mvm_flops() == f_a and prob.B.flops() == 2 * nnz
    k, b = 20, 4
    c = variance_costs(prob, O(lanczos_rank=k, lanczos_block_size=b, dense_logdet_max=0))
    exact = outer.EXACT_CUBIC_SECONDS * n**3 + outer.FORM_FLOP_SECONDS * n * (f_a + 2 * nnz)
    lz = outer.STEP_SECONDS * 5 + (outer.MVM_FLOP_SECONDS * k * f_a + outer.ORTH_FLOP_SECONDS * 2 * n * k * k) / min(
        b, outer.BLOCK_SPEEDUP_MAX)
    assert c["exact"] == pytest.approx(exact, rel=1e-12) and c["lanczos"] == pytest.approx(lz, rel=1e-12)
    assert c["estimator"] == "k-lanczos" and c["k"] == k
    # with a dense log|A| the Lanczos route also pays for forming and factorising A
    c2 = variance_costs(prob, O(lanczos_rank=k, lanczos_block_size=b, dense_logdet_max=1000))
    extra = outer.FORM_FLOP_SECONDS * n * f_a + 0.25 * outer.EXACT_CUBIC_SECONDS * n**3
    assert c2["lanczos"] == pytest.approx(lz + extra, rel=1e-12)
    # the GP model prices products with A_v = L^T A L
    gp = RelaxationProblem(_gp_mixed()[0])
    cg_ = variance_costs(gp, O(lanczos_rank=10, dense_logdet_max=0))
    assert cg_["estimator"] == "whitened"
    nn = gp.n
    lz_gp = outer.STEP_SECONDS * 10 + outer.MVM_FLOP_SECONDS * 10 * gp.mvm_flops(True) + \
        outer.ORTH_FLOP_SECONDS * 2 * nn * 100
    assert cg_["lanczos"] == pytest.approx(lz_gp, rel=1e-12)


def test_auto_picks_by_cost_and_reports_the_method(monkeypatch):
    lgm = _sparse_logistic(q=200, n=30)
    prob = RelaxationProblem(lgm)
    ref_exact = _loop(RelaxationProblem(lgm), variance="exact", max_outer=2)
    ref_lz = _loop(RelaxationProblem(lgm), variance="lanczos", lanczos_rank=10, max_outer=2)
    # make the dense route expensive: auto runs Lanczos, with the same numbers as the explicit choice
    monkeypatch.setattr(outer, "EXACT_CUBIC_SECONDS", 1.0)
    assert choose_variance_method(prob, O(lanczos_rank=10)) == "lanczos"
    out = _loop(prob, variance="auto", lanczos_rank=10, max_outer=2)
    assert out["variance_method"] == "lanczos" and out["variance_estimator"] == "k-lanczos"
    assert out["variances_are_lower_bounds"] is True
    torch.testing.assert_close(out["step"].z, ref_lz["step"].z, rtol=0, atol=0)
    # make Lanczos expensive: auto runs the exact route
    monkeypatch.setattr(outer, "EXACT_CUBIC_SECONDS", 0.0)
    monkeypatch.setattr(outer, "FORM_FLOP_SECONDS", 0.0)
    assert choose_variance_method(prob, O(lanczos_rank=10)) == "exact"
    out = _loop(RelaxationProblem(lgm), variance="auto", lanczos_rank=10, max_outer=2)
    assert out["variance_method"] == "exact" and out["variance_estimator"] == "cholesky"
    assert out["variances_are_lower_bounds"] is False
    torch.testing.assert_close(out["step"].z, ref_exact["step"].z, rtol=0, atol=0)
    step = _step(prob, ref_exact["gamma"], variance="auto", lanczos_rank=10)
    assert step.method == "exact"
    # n above exact_max never goes to the dense route
    assert choose_variance_method(prob, O(lanczos_rank=10, exact_max=29)) == "lanczos"
    out = _loop(RelaxationProblem(lgm), variance="auto", lanczos_rank=10, max_outer=1, exact_max=29)
    assert out["variance_method"] == "lanczos"
