"""Design scores vs brute-force dense references (float64)."""
import math

import numpy as np
import pytest
import torch
from scipy import integrate, optimize

from pyro_convexvb.design.scores import (
    classifier_uncertainty,
    design_score,
    information_gain,
    lanczos_covariance_factor,
    minimize_site_phi,
    predictive_probability,
    rank_one_include,
    site_phi,
    tilted_kl,
)
from pyro_convexvb.infer.convex_relaxation import LaplacePotential, LogisticPotential
from pyro_convexvb.linalg.lanczos import lanczos

D = torch.float64


def _problem(n=6, q=15, N=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(q, n, generator=g, dtype=D)
    gamma = torch.rand(q, generator=g, dtype=D) + 0.3
    A = torch.eye(n, dtype=D) + B.T @ (B / gamma[:, None])
    C = torch.randn(N, n, generator=g, dtype=D)
    u = torch.randn(n, generator=g, dtype=D)
    return A, B, gamma, C, u


def _marginals(A, C, u):
    cov = torch.linalg.inv(A)
    return C @ u, torch.einsum("ij,jk,ik->i", C, cov, C)


def test_predictive_probability_and_cu_vs_quad():
    A, B, gamma, C, u = _problem()
    mu, rho = _marginals(A, C, u)
    p = predictive_probability(mu, rho, tau=1.5, num_points=48)
    for i in range(0, 40, 7):
        m, v = float(mu[i]), float(rho[i])
        ref = integrate.quad(lambda s: math.exp(-0.5 * (s - m) ** 2 / v) / math.sqrt(2 * math.pi * v)
                             / (1 + math.exp(-1.5 * s)), m - 40 * math.sqrt(v), m + 40 * math.sqrt(v), epsabs=1e-13)[0]
        assert abs(float(p[i]) - ref) < 1e-9
    cu = classifier_uncertainty(mu, rho, tau=1.5, num_points=48)
    assert torch.allclose(cu, -(p - 0.5).abs())


@pytest.mark.parametrize("c", [1.0, 0.0])
def test_minimize_site_phi_vs_scipy(c):
    g = torch.Generator().manual_seed(1)
    N = 12
    mu = 3 * torch.randn(N, generator=g, dtype=D)
    rho = torch.exp(2 * torch.randn(N, generator=g, dtype=D))
    pot = LogisticPotential(torch.full((N,), c, dtype=D), tau=1.3)
    gam = minimize_site_phi(pot, mu, rho)
    for i in range(N):
        p1 = LogisticPotential(torch.full((1,), c, dtype=D), tau=1.3)
        m, v = mu[i:i + 1], rho[i:i + 1]

        def f(t):
            return float(site_phi(p1, torch.tensor([math.exp(t)], dtype=D), m, v))

        res = optimize.minimize_scalar(f, bounds=(-15, 15), method="bounded", options={"xatol": 1e-10})
        ref = math.exp(res.x)
        assert abs(float(gam[i]) - ref) <= 1e-5 * ref
        assert float(site_phi(p1, gam[i:i + 1], m, v)) <= res.fun + 1e-10


def test_minimize_site_phi_laplace_vs_scipy():
    g = torch.Generator().manual_seed(2)
    N = 8
    mu = torch.randn(N, generator=g, dtype=D)
    rho = torch.rand(N, generator=g, dtype=D) + 0.1
    b = torch.rand(N, generator=g, dtype=D) + 0.5
    gam = minimize_site_phi(LaplacePotential(b), mu, rho)
    for i in range(N):
        p1 = LaplacePotential(b[i:i + 1])
        f = lambda t: float(site_phi(p1, torch.tensor([math.exp(t)], dtype=D), mu[i:i + 1], rho[i:i + 1]))  # noqa: E731
        res = optimize.minimize_scalar(f, bounds=(-20, 10), method="bounded", options={"xatol": 1e-10})
        assert abs(float(gam[i]) - math.exp(res.x)) <= 1e-5 * math.exp(res.x)


def _kl_gauss(m1, v1, m0, v0):
    return 0.5 * (v1 / v0 + (m1 - m0) ** 2 / v0 - 1 + math.log(v0 / v1))


def test_tilted_kl_vs_closed_form_gaussian_kl():
    g = torch.Generator().manual_seed(3)
    mu, rho = torch.randn(20, generator=g, dtype=D), torch.rand(20, generator=g, dtype=D) + 0.2
    beta, gam = torch.randn(20, generator=g, dtype=D), torch.rand(20, generator=g, dtype=D) + 0.1
    kl = tilted_kl(mu, rho, beta, gam)
    for i in range(20):
        # tilted Q' ∝ N(s|mu,rho) exp(beta s - s^2/(2 gamma)): natural parameters add
        prec = 1 / float(rho[i]) + 1 / float(gam[i])
        v1 = 1 / prec
        m1 = v1 * (float(mu[i]) / float(rho[i]) + float(beta[i]))
        assert abs(float(kl[i]) - _kl_gauss(m1, v1, float(mu[i]), float(rho[i]))) < 1e-12


def test_information_gain_brute_force():
    A, B, gamma, C, u = _problem(seed=4)
    mu, rho = _marginals(A, C, u)
    s_ig, parts = information_gain(mu, rho, num_points=48, return_parts=True)
    for i in range(0, 40, 5):
        m, v = float(mu[i]), float(rho[i])
        p = integrate.quad(lambda s: math.exp(-0.5 * (s - m) ** 2 / v) / math.sqrt(2 * math.pi * v)
                           / (1 + math.exp(-s)), m - 40 * math.sqrt(v), m + 40 * math.sqrt(v), epsabs=1e-13)[0]
        total = 0.0
        for c, w in ((1, p), (-1, 1 - p)):
            p1 = LogisticPotential(torch.tensor([(c + 1) / 2], dtype=D))
            f = lambda t: float(site_phi(p1, torch.tensor([math.exp(t)], dtype=D), mu[i:i + 1], rho[i:i + 1]))  # noqa: E731
            gam_ref = math.exp(optimize.minimize_scalar(f, bounds=(-15, 15), method="bounded",
                                                        options={"xatol": 1e-11}).x)
            prec = 1 / v + 1 / gam_ref
            v1 = 1 / prec
            m1 = v1 * (m / v + c / 2)
            total += w * _kl_gauss(m1, v1, m, v)
        assert abs(float(s_ig[i]) - total) < 1e-7 * max(1.0, total)
    assert bool((s_ig > 0).all())


def test_design_score_dense_rows_and_blocks():
    A, B, gamma, C, u = _problem(n=7, seed=5)
    cov = torch.linalg.inv(A)
    F = torch.linalg.cholesky(cov)
    d1 = design_score(C, F, noise_var=0.3)
    ref1 = torch.stack([torch.logdet(torch.eye(1, dtype=D) + C[i:i + 1] @ cov @ C[i:i + 1].T / 0.3) for i in range(40)])
    assert torch.allclose(d1, ref1, atol=1e-12)
    # sparse rows give the same
    assert torch.allclose(design_score(C.to_sparse_csr(), F, noise_var=0.3), ref1, atol=1e-12)
    g = torch.Generator().manual_seed(6)
    Xb = torch.randn(9, 3, 7, generator=g, dtype=D)
    Xc = torch.complex(torch.randn(9, 10, 7, generator=g, dtype=D), torch.randn(9, 10, 7, generator=g, dtype=D))
    db, dc = design_score(Xb, F, chunk_size=4), design_score(Xc, F, noise_var=2.0)
    for i in range(9):
        assert abs(float(db[i]) - float(torch.logdet(torch.eye(3, dtype=D) + Xb[i] @ cov @ Xb[i].T))) < 1e-11
        M = torch.eye(10, dtype=Xc.dtype) + Xc[i] @ cov.to(Xc.dtype) @ Xc[i].conj().T / 2.0
        assert abs(float(dc[i]) - float(torch.linalg.slogdet(M)[1])) < 1e-10


def test_design_score_lanczos_full_rank_equals_exact_and_underestimates():
    A, B, gamma, C, u = _problem(n=8, seed=7)
    cov = torch.linalg.inv(A)
    exact = design_score(C, torch.linalg.cholesky(cov))
    res = lanczos(lambda v: A @ v, 8, 8, dtype=D)
    full = design_score(C, lanczos_covariance_factor(res))
    assert torch.allclose(full, exact, atol=1e-9)
    res4 = lanczos(lambda v: A @ v, 8, 4, dtype=D)
    part = design_score(C, lanczos_covariance_factor(res4))
    assert bool((part <= exact + 1e-12).all())


def test_rank_one_include_equals_dense_refit():
    A, B, gamma, C, u0 = _problem(n=6, q=15, N=40, seed=8)
    g = torch.Generator().manual_seed(9)
    rhs = torch.randn(6, generator=g, dtype=D)
    u = torch.linalg.solve(A, rhs)
    o = torch.randn(40, generator=g, dtype=D)  # candidate offsets
    mu, rho = C @ u + o, torch.einsum("ij,jk,ik->i", C, torch.linalg.inv(A), C)
    i = 11
    b = C[i]
    d = torch.linalg.solve(A, b)
    mean_i, var_i = float(b @ u + o[i]), float(b @ d)
    pot = LogisticPotential(torch.ones(1, dtype=D))
    gam = minimize_site_phi(pot, torch.tensor([mean_i], dtype=D), torch.tensor([var_i], dtype=D))
    beta_i, gamma_i = float(pot.beta[0]), float(gam[0])
    upd = rank_one_include(mu, rho, C @ d, d, u, float(torch.logdet(A)), mean_i=mean_i, var_i=var_i,
                           beta_i=beta_i, gamma_i=gamma_i)
    A2 = A + torch.outer(b, b) / gamma_i
    u2 = torch.linalg.solve(A2, rhs + b * (beta_i - o[i] / gamma_i))
    cov2 = torch.linalg.inv(A2)
    assert torch.allclose(upd.u, u2, atol=1e-11)
    assert torch.allclose(upd.mean, C @ u2 + o, atol=1e-10)
    assert torch.allclose(upd.var, torch.einsum("ij,jk,ik->i", C, cov2, C), atol=1e-11)
    assert abs(upd.log_det - float(torch.logdet(A2))) < 1e-11


def test_bad_input():
    z = torch.zeros(3, dtype=D)
    with pytest.raises(ValueError, match="var"):
        classifier_uncertainty(z, -torch.ones(3, dtype=D))
    with pytest.raises(ValueError, match="mean"):
        information_gain(torch.tensor([float("nan"), 0, 0], dtype=D), torch.ones(3, dtype=D))
    with pytest.raises(ValueError, match="noise_var"):
        design_score(torch.eye(3, dtype=D), torch.eye(3, dtype=D), noise_var=0.0)
    with pytest.raises(ValueError, match="X_star"):
        design_score(torch.eye(4, dtype=D), torch.eye(3, dtype=D))


def test_design_score_checks_its_arguments():
    """NaN in 2-D candidates or in the factor gave NaN scores silently (argmax then picked the NaN row); NumPy and
    0-d torch noise variances were refused, True accepted as 1; a zero chunk size and empty 3-D candidates raised
    raw Python/torch errors; float32 candidates with a float64 factor a dtype error."""
    from pyro_convexvb.design.scores import design_score

    g = torch.Generator().manual_seed(0)
    L = torch.linalg.cholesky(torch.eye(5, dtype=torch.float64) + 0.1)
    X = torch.randn(3, 5, generator=g, dtype=torch.float64)
    ref = design_score(X, L)
    for nv in (np.float32(1.0), np.int64(1), torch.tensor(1.0)):
        assert torch.allclose(design_score(X, L, noise_var=nv), ref)
    for nv in (True, 0.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="noise_var: expected a positive finite number"):
            design_score(X, L, noise_var=nv)
    bad = X.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="X_star: contains NaN/inf"):
        design_score(bad, L)
    with pytest.raises(ValueError, match="X_star: contains NaN/inf"):
        design_score(bad.to_sparse_csr(), L)
    with pytest.raises(ValueError, match="factor: contains NaN/inf"):
        design_score(X, L * float("nan"))
    with pytest.raises(ValueError, match="chunk_size: expected a positive integer"):
        design_score(X[:, None, :], L, chunk_size=0)
    assert design_score(X[:0, None, :], L).shape == (0,)
    assert torch.allclose(design_score(X.float(), L).double(), ref, rtol=1e-5)


@pytest.mark.parametrize("tau", [1.0, 2.5])
def test_predictive_probability_is_accurate_for_any_variance(tau):
    """32 Gauss-Hermite nodes straddled the sigmoid's step on a wide Gaussian: 7e-3 off at variance 100, and 0.5 for
    0.5004 at variance 1e4 (a classifier-uncertainty score 1000 times too small). Against adaptive quadrature."""
    from scipy import special

    from pyro_convexvb.design.scores import predictive_probability

    means = [0.0, 0.5, 3.0, -7.0, 30.0]
    sds = [0.3, 0.99, 1.01, 2.0, 10.0, 100.0, 1000.0]
    m = torch.tensor([a for a in means for _ in sds], dtype=torch.float64)
    sd = torch.tensor([b for _ in means for b in sds], dtype=torch.float64)
    p = predictive_probability(m, sd**2, tau=tau)
    for k in range(len(m)):
        mk, sk = float(m[k]), float(sd[k])

        def f(s):
            return special.expit(tau * s) * np.exp(-0.5 * ((s - mk) / sk) ** 2) / (sk * math.sqrt(2 * math.pi))

        ref = integrate.quad(f, mk - 12 * sk, mk + 12 * sk, points=[0.0] if abs(mk) < 12 * sk else None, limit=500,
                             epsabs=1e-14)[0]
        assert abs(float(p[k]) - ref) < 1e-8, (mk, sk)  # the reference itself is good to about 1e-9 at sd 1000


def test_quadrature_and_update_arguments_are_checked():
    from pyro_convexvb.design.scores import rank_one_include

    m, v = torch.zeros(2, dtype=D), torch.ones(2, dtype=D)
    for kwargs, name in ((dict(num_points=0), "num_points"), (dict(num_points=2.5), "num_points"),
                         (dict(tau=float("nan")), "tau"), (dict(tau=-1.0), "tau")):
        with pytest.raises(ValueError, match=name):
            predictive_probability(m, v, **kwargs)
    with pytest.raises(ValueError, match="pot, mean"):
        minimize_site_phi(LogisticPotential(torch.ones(3, dtype=D)), m, v)
    with pytest.raises(ValueError, match="mean_J, var_J, w"):  # a (1,) w was broadcast into wrong variances
        rank_one_include(m, v, torch.ones(1, dtype=D), torch.ones(3, dtype=D), torch.zeros(3, dtype=D), 0.0,
                         mean_i=0.0, var_i=1.0, beta_i=0.5, gamma_i=1.0)


def test_design_score_rows_in_column_chunks():
    """``chunk_size`` bounds the memory of ``(N, n)`` rows too (columns of the factor per batch): same scores."""
    g = torch.Generator().manual_seed(3)
    X, F = torch.randn(7, 5, generator=g, dtype=D), torch.randn(5, 4, generator=g, dtype=D)
    ref = torch.log1p(((X @ F) ** 2).sum(1) / 0.5)
    for chunk in (1, 3, 4, 100):
        assert torch.allclose(design_score(X, F, 0.5, chunk_size=chunk), ref, rtol=1e-13)
        assert torch.allclose(design_score(X.to_sparse_csr(), F, 0.5, chunk_size=chunk), ref, rtol=1e-13)


def test_design_score_complex_factor_vs_numpy():
    """A complex factor (Cov = F F^H) with real rows, sparse rows, real and complex (N, r, n) blocks: against dense
    log|I + X F F^H X^H / noise_var| in NumPy. Real rows raised a torch dtype error; real blocks dropped Im F."""
    rng = np.random.default_rng(4)
    n, k, N, r, nv = 6, 4, 5, 3, 0.7
    F = rng.standard_normal((n, k)) + 1j * rng.standard_normal((n, k))
    rows = rng.standard_normal((N, n))
    blocks = rng.standard_normal((N, r, n))
    cblocks = blocks + 1j * rng.standard_normal((N, r, n))
    cov = F @ F.conj().T

    def ref(X):
        return np.array([np.linalg.slogdet(np.eye(len(x)) + x @ cov @ x.conj().T / nv)[1] for x in X])

    Ft = torch.from_numpy(F)
    expected = ref(rows[:, None, :])
    for X in (torch.from_numpy(rows), torch.from_numpy(rows).to_sparse_csr()):
        for chunk in (1, 3, 1024):
            got = design_score(X, Ft, nv, chunk_size=chunk)
            assert got.dtype == D and np.allclose(got.numpy(), expected, rtol=1e-12, atol=0)
    for X in (blocks, cblocks):
        got = design_score(torch.from_numpy(X), Ft, nv, chunk_size=2)
        assert got.dtype == D and np.allclose(got.numpy(), ref(X), rtol=1e-12, atol=0)
    # the imaginary part matters: the real part of F alone gives other scores
    assert not np.allclose(design_score(torch.from_numpy(blocks), Ft.real.contiguous(), nv).numpy(), ref(blocks))


def test_score_helpers_name_bad_arguments():
    """site_phi / tilted_kl gave bare torch broadcast errors for mismatched shapes and a number for gamma < 0;
    rank_one_include passed a NaN mean_i through."""
    one2, one3 = torch.ones(2, dtype=D), torch.ones(3, dtype=D)
    pot2 = LogisticPotential(one2)
    cases = [
        (lambda: site_phi(LogisticPotential(one3), one2, 0 * one2, one2),
         r"pot, mean: the potential has \(3,\) sites, the marginals \(2,\)"),
        (lambda: site_phi(pot2, one3, 0 * one2, one2), r"gamma: expected shape \(2,\) \(that of mean\), got \(3,\)"),
        (lambda: site_phi(pot2, -one2, 0 * one2, one2), r"gamma: site widths must be > 0, got -1.0"),
        (lambda: site_phi(pot2, one2, torch.tensor([0.0, float("nan")], dtype=D), one2), "mean: contains NaN/inf"),
        (lambda: site_phi(pot2, one2, 0 * one2, 0 * one2), "var: site_phi needs strictly positive variances"),
        (lambda: tilted_kl(0 * one2, one2, one2, -2 * one2), r"gamma: site widths must be > 0, got -2.0"),
        (lambda: tilted_kl(0 * one2, one2, one2, 0 * one2), r"gamma: site widths must be > 0, got 0.0"),
        (lambda: tilted_kl(0 * one2, one2, one2, one2 * float("nan")), "gamma: contains NaN"),
        (lambda: tilted_kl(0 * one3, one2, 0 * one3, one3), r"mean, var: expected equal shapes \(N,\), got \(3,\)"),
        (lambda: tilted_kl(0 * one3, one3, one2, one3), r"beta: expected shape \(3,\) \(that of mean\), got \(2,\)"),
        (lambda: tilted_kl(one2 * float("nan"), one2, one2, one2), "mean: contains NaN/inf"),
        (lambda: tilted_kl(0 * one2, -one2, one2, one2), "var: must be finite and nonnegative"),
    ]
    kw = dict(mean_i=0.0, var_i=1.0, beta_i=0.5, gamma_i=1.0)
    args = (0 * one3, one3, one3, one2, 0 * one2, 0.0)
    for bad, msg in ((dict(mean_i=float("nan")), "mean_i: expected a finite number, got nan"),
                     (dict(beta_i=float("inf")), "beta_i: expected a finite number, got inf"),
                     (dict(var_i=torch.ones(2, dtype=D)), r"var_i: expected a real scalar, got .* shape \(2,\)"),
                     (dict(gamma_i="1"), "gamma_i: expected a real scalar, got '1'"),
                     (dict(gamma_i=0.0), "gamma_i, var_i: expected gamma_i > 0")):
        cases.append((lambda bad=bad: rank_one_include(*args, **{**kw, **bad}), msg))
    nan_mean = torch.tensor([0.0, float("nan"), 0.0], dtype=D)
    cases.append((lambda: rank_one_include(nan_mean, *args[1:], **kw), "mean_J: contains NaN/inf"))
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
    # valid edge values give the closed forms: gamma = inf is the linear tilt, D = rho beta^2 / 2
    kl = tilted_kl(torch.tensor([0.3], dtype=D), torch.tensor([2.0], dtype=D), torch.tensor([1.5], dtype=D),
                   torch.tensor([float("inf")], dtype=D))
    assert float(kl) == pytest.approx(2.0 * 1.5 ** 2 / 2, rel=1e-15)
    upd = rank_one_include(*args, **{**kw, "mean_i": torch.tensor(0.4, dtype=D)})
    assert upd.kappa == 2.0 and torch.allclose(upd.u, (0.5 - 0.4) / 2.0 * one2)


def test_num_points_applies_to_narrow_marginals_only():
    """As the docstrings say: for tau sd <= 1 the value is a num_points-node Gauss-Hermite sum; for tau sd > 1 it is
    predictive_log_probs' (64 nodes in log space, the step split off above tau^2 var = 4) whatever num_points, and
    accurate against adaptive quadrature. information_gain / classifier_uncertainty inherit both."""
    from scipy import special

    from pyro_convexvb.lgm.families.logit import predictive_log_probs
    from pyro_convexvb.lgm.sites import gaussian_expectation

    tau = 1.5
    mean = torch.tensor([0.7, 0.7, -0.4, 2.0], dtype=D)
    var = torch.tensor([0.2, 0.4, 1.0, 30.0], dtype=D)  # tau sd = 0.67, 0.95 | 1.5, 8.2
    narrow = tau * var.sqrt() <= 1
    assert narrow.tolist() == [True, True, False, False]
    p = {k: predictive_probability(mean, var, tau, num_points=k) for k in (1, 3, 64)}
    for k, pk in p.items():  # narrow: the k-node rule itself; wide: predictive_log_probs, the same for every k
        ref = gaussian_expectation(lambda s: torch.sigmoid(tau * s), mean[narrow], var[narrow], k)
        assert torch.equal(pk[narrow], ref)
        assert torch.equal(pk[~narrow], predictive_log_probs(tau * mean[~narrow], tau ** 2 * var[~narrow])[1].exp())
    assert float((p[1][narrow] - p[64][narrow]).abs().min()) > 1e-3  # one node: the sigmoid at the mean
    for i in range(4):
        m, sd = float(mean[i]), float(var[i]) ** 0.5
        quad = integrate.quad(lambda s: special.expit(tau * s) * math.exp(-0.5 * ((s - m) / sd) ** 2)
                              / (sd * math.sqrt(2 * math.pi)), m - 12 * sd, m + 12 * sd, points=[0.0], epsabs=1e-14)[0]
        assert abs(float(p[64][i]) - quad) < 1e-10
    for k in (1, 3):
        assert torch.equal(classifier_uncertainty(mean, var, tau, k)[~narrow],
                           classifier_uncertainty(mean, var, tau, 64)[~narrow])
        assert torch.equal(information_gain(mean, var, tau, k)[~narrow], information_gain(mean, var, tau, 64)[~narrow])
