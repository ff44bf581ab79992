"""Shamir & Szpankowski 2021 equations against independent references: brute-force optimisation, quadrature,
finite differences, dense linear algebra (float64)."""
import math

import numpy as np
import pytest
from scipy import integrate, optimize, special

from pyro_convexvb.online import equations as eq
from pyro_convexvb.online.baselines import adf_update, dimgauss_update, marginal_vb_update

LINKS = ["logit", "probit"]


def _neg_log_post(w, y, x, mu, s2, mu_minus, s2_minus, link):
    """-log of the r.h.s. of Eq. (12) / (26) up to a constant, for one feature."""
    c = float(eq.shrinkage(s2_minus, link))
    return (w - mu) ** 2 / (2 * s2) - float(eq.log_link_cdf(y * (mu_minus + x * w) / c, link))


def _cases(seed=0, n=25):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        out.append(dict(y=float(rng.choice([-1.0, 1.0])), x=float(rng.choice([1.0, rng.uniform(-1, 1)])),
                        mu=rng.normal(0, 1.0), s2=float(rng.uniform(0.05, 3.0)),
                        mu_minus=rng.normal(0, 2.0), s2_minus=float(rng.uniform(0.0, 8.0))))
    return out


@pytest.mark.parametrize("link", LINKS)
def test_link_functions_against_scipy_and_finite_differences(link):
    z = np.linspace(-60, 30, 901) if link == "probit" else np.linspace(-40, 40, 801)
    ref_log = special.log_ndtr(z) if link == "probit" else -np.logaddexp(0, -z)
    np.testing.assert_allclose(eq.log_link_cdf(z, link), ref_log, rtol=1e-12, atol=1e-300)
    h = 1e-5
    zz = z[(z > -30) & (z < 20)]
    d1 = (eq.log_link_cdf(zz + h, link) - eq.log_link_cdf(zz - h, link)) / (2 * h)
    np.testing.assert_allclose(eq.psi1(zz, link), d1, rtol=1e-6, atol=1e-9)
    h = 1e-3
    d2 = (eq.log_link_cdf(zz + h, link) - 2 * eq.log_link_cdf(zz, link) + eq.log_link_cdf(zz - h, link)) / h**2
    np.testing.assert_allclose(eq.psi2(zz, link), -d2, rtol=1e-5, atol=1e-7)
    if link == "probit":  # Mills-ratio branch, both sides of the -35 threshold
        zt = np.linspace(-60, -10, 501)
        r_ref = np.exp(-0.5 * zt**2 - 0.5 * math.log(2 * math.pi) - special.log_ndtr(zt))
        np.testing.assert_allclose(eq.psi1(zt, link), r_ref, rtol=1e-10)


@pytest.mark.parametrize("link", LINKS)
def test_newton_mean_is_the_mode_of_the_marginalised_posterior(link):
    for k in _cases(1):
        args = (k["y"], k["x"], k["mu"], k["s2"], k["mu_minus"], k["s2_minus"], link)
        w, ok = eq.newton_mean(k["y"], np.array([k["x"]]), np.array([k["mu"]]), np.array([k["s2"]]),
                               np.array([k["mu_minus"]]), np.array([k["s2_minus"]]), link)
        assert ok.all()
        ref = optimize.minimize_scalar(_neg_log_post, args=args, bracket=(k["mu"] - 5, k["mu"] + 5),
                                       tol=1e-12).x
        assert abs(w[0] - ref) < 1e-6
        # stationarity by central finite differences of the exact objective
        h = 1e-6
        g = (_neg_log_post(w[0] + h, *args) - _neg_log_post(w[0] - h, *args)) / (2 * h)
        assert abs(g) < 1e-6


@pytest.mark.parametrize("link", LINKS)
def test_laplace_variance_is_the_inverse_curvature_at_the_mode(link):
    for k in _cases(2):
        x, mu, s2 = np.array([k["x"]]), np.array([k["mu"]]), np.array([k["s2"]])
        mm, sm = np.array([k["mu_minus"]]), np.array([k["s2_minus"]])
        w, _ = eq.newton_mean(k["y"], x, mu, s2, mm, sm, link)
        s2_new = eq.laplace_variance(k["y"], x, s2, w, mm, sm, link)[0]
        args = (k["y"], k["x"], k["mu"], k["s2"], k["mu_minus"], k["s2_minus"], link)
        h = 1e-4
        curv = (_neg_log_post(w[0] + h, *args) - 2 * _neg_log_post(w[0], *args) + _neg_log_post(w[0] - h, *args)) / h**2
        assert s2_new == pytest.approx(1.0 / curv, rel=1e-5)


@pytest.mark.parametrize("link", LINKS)
def test_value_variance_matches_the_peak_height(link):
    """Eq. (18): N(mu', s2') at its peak has the height of the normalised posterior (12) at its mode."""
    for k in _cases(3):
        x, mu, s2 = np.array([k["x"]]), np.array([k["mu"]]), np.array([k["s2"]])
        mm, sm = np.array([k["mu_minus"]]), np.array([k["s2_minus"]])
        mu_t = k["mu_minus"] + k["x"] * k["mu"]
        s2_t = k["s2_minus"] + k["x"] ** 2 * k["s2"]
        log_p_t = float(eq.log_link_cdf(k["y"] * mu_t / eq.shrinkage(s2_t, link), link))
        w, _ = eq.newton_mean(k["y"], x, mu, s2, mm, sm, link)
        s2_new = eq.value_variance(log_p_t, k["y"], x, mu, s2, w, mm, sm, link)[0]
        args = (k["y"], k["x"], k["mu"], k["s2"], k["mu_minus"], k["s2_minus"], link)
        log_post_peak = -_neg_log_post(w[0], *args) - 0.5 * math.log(2 * math.pi * k["s2"]) - log_p_t
        assert -0.5 * math.log(2 * math.pi * s2_new) == pytest.approx(log_post_peak, abs=1e-10)


@pytest.mark.parametrize("link", LINKS)
def test_taylor_is_the_first_newton_step_and_close_to_newton_on_typical_rows(link):
    rng = np.random.default_rng(4)
    d_t = 20
    for _ in range(20):
        y = float(rng.choice([-1.0, 1.0]))
        x = np.ones(d_t)
        mu_i = rng.normal(0, 0.5, d_t)
        s2_i = rng.uniform(0.05, 1.0, d_t)
        mu_t, s2_t = eq.score_moments(x, mu_i, s2_i)
        mm, sm = eq.self_excluding_moments(x, mu_i, s2_i, mu_t, s2_t)
        taylor = eq.taylor_mean(y, x, mu_i, s2_i, mu_t, sm, link)
        one_step, _ = eq.newton_mean(y, x, mu_i, s2_i, mm, sm, link, maxiter=1)
        np.testing.assert_allclose(taylor, one_step, rtol=1e-14, atol=1e-15)
        newton, ok = eq.newton_mean(y, x, mu_i, s2_i, mm, sm, link)
        assert ok.all()
        step = np.abs(newton - mu_i)
        assert np.all(np.abs(taylor - newton) <= 0.02 * step + 1e-12)


def test_logit_prediction_eq8_against_quadrature():
    """Eq. (8) approximates int N(s; mu_t, s2_t) Sigma(s) ds within the 0.02 bound of Appendix A."""
    for mu_t, s2_t in [(0.0, 1.0), (1.5, 0.3), (-2.0, 4.0), (3.0, 10.0), (0.7, 0.0)]:
        if s2_t == 0:
            ref = 1 / (1 + math.exp(-mu_t))
        else:
            sd = math.sqrt(s2_t)
            ref = integrate.quad(lambda s: math.exp(-0.5 * ((s - mu_t) / sd) ** 2) / (sd * math.sqrt(2 * math.pi))
                                 / (1 + math.exp(-s)), mu_t - 12 * sd, mu_t + 12 * sd, epsabs=1e-13)[0]
        assert abs(eq.predict_proba(mu_t, s2_t, "logit") - ref) < 0.02


def test_probit_prediction_eq24_and_marginalisation_eq25_against_quadrature():
    def gauss(w, m, v):
        return math.exp(-0.5 * (w - m) ** 2 / v) / math.sqrt(2 * math.pi * v)

    for y, mu_t, s2_t in [(1, 0.3, 0.5), (-1, 1.2, 2.0), (1, -2.5, 0.1), (-1, -0.4, 6.0)]:
        ref = integrate.quad(lambda s: gauss(s, mu_t, s2_t) * special.ndtr(y * s), -40, 40, epsabs=1e-14)[0]
        assert float(eq.predict_proba(mu_t, s2_t, "probit")) == pytest.approx(ref if y == 1 else 1 - ref, abs=1e-11)
    # Eq. (25): integrating w_{-i} out of Phi(y (x w_i + w_{-i})) is exact for probit
    for y, x, w_i, mu_m, s2_m in [(1, 1.0, 0.4, -0.3, 1.5), (-1, 0.6, -1.0, 0.8, 0.2), (1, -0.9, 2.0, -2.0, 4.0)]:
        ref = integrate.quad(lambda u: gauss(u, mu_m, s2_m) * special.ndtr(y * (x * w_i + u)), -40, 40,
                             epsabs=1e-14)[0]
        val = float(eq.p_plus(y, x, w_i, mu_m, s2_m, "probit"))
        assert val == pytest.approx(ref, abs=1e-11)


def test_adf_probit_equals_exact_moments_by_quadrature():
    """Appendix D.2 with the probit link: mean and marginal variances of the exact tilted posterior."""
    rng = np.random.default_rng(5)
    for _ in range(5):
        d_t = 4
        x = rng.uniform(-1, 1, d_t)
        mu_i = rng.normal(0, 1, d_t)
        s2_i = rng.uniform(0.2, 2.0, d_t)
        y = float(rng.choice([-1.0, 1.0]))
        m, v = eq.score_moments(x, mu_i, s2_i)
        sd = math.sqrt(v)

        def moment(k):
            return integrate.quad(lambda s: s**k * math.exp(-0.5 * ((s - m) / sd) ** 2) * special.ndtr(y * s),
                                  m - 14 * sd, m + 14 * sd, epsabs=1e-14, limit=200)[0]

        Z = moment(0)
        Es = moment(1) / Z
        Vs = moment(2) / Z - Es**2
        gain = s2_i * x / v  # linear-Gaussian conditioning of w on the score s
        mu_ref = mu_i + gain * (Es - m)
        s2_ref = s2_i - gain * s2_i * x + gain**2 * Vs
        mu_new, s2_new = adf_update(y, x, mu_i, s2_i, m, v, "probit")
        np.testing.assert_allclose(mu_new, mu_ref, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(s2_new, s2_ref, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("link", LINKS)
def test_dimgauss_newton_equals_dense_laplace(link):
    """Appendix D.1: the Sherman-Morrison Newton update equals a dense d_t-dimensional Laplace fit."""
    rng = np.random.default_rng(6)
    for _ in range(5):
        d_t = 6
        x = np.where(rng.random(d_t) < 0.5, 1.0, rng.uniform(-1, 1, d_t))
        mu_i = rng.normal(0, 1, d_t)
        s2_i = rng.uniform(0.2, 2.0, d_t)
        y = float(rng.choice([-1.0, 1.0]))

        def f(u):
            return 0.5 * np.sum((u - mu_i) ** 2 / s2_i) - float(eq.log_link_cdf(y * x @ u, link))

        def g(u):
            return (u - mu_i) / s2_i - y * x * float(eq.psi1(y * x @ u, link))

        u_ref = optimize.minimize(f, mu_i, jac=g, method="BFGS", options={"gtol": 1e-12}).x
        H = np.diag(1 / s2_i) + float(eq.psi2(y * x @ u_ref, link)) * np.outer(x, x)
        cov = np.linalg.inv(H)
        u, s2_new, ok = dimgauss_update(y, x, mu_i, s2_i, link, "newton")
        assert ok
        np.testing.assert_allclose(u, u_ref, atol=1e-7)
        np.testing.assert_allclose(s2_new, np.diag(cov), rtol=1e-7)
        # the Taylor form is Eqs. (42)-(46): Sherman-Morrison of Sigma^-1 + a x x^T at the prior mean
        u_t, s2_t, _ = dimgauss_update(y, x, mu_i, s2_i, link, "taylor")
        a = float(eq.psi2(y * x @ mu_i, link))
        sig_tilde = np.linalg.inv(np.diag(1 / s2_i) + a * np.outer(x, x))
        np.testing.assert_allclose(u_t, mu_i + y * float(eq.psi1(y * x @ mu_i, link)) * sig_tilde @ x, atol=1e-13)


def test_marginal_vb_is_the_minimiser_of_the_sampled_kl():
    """Appendix D.3: the Newton iterate minimises the sampled objective (49) over (mu', sigma')."""
    rng = np.random.default_rng(7)
    d_t, N = 3, 64
    x = np.array([1.0, 0.5, -0.8])
    mu_i = rng.normal(0, 1, d_t)
    s2_i = rng.uniform(0.3, 1.5, d_t)
    y = 1.0
    samples = rng.standard_normal(N)
    mu_t, s2_t = eq.score_moments(x, mu_i, s2_i)
    mm, sm = eq.self_excluding_moments(x, mu_i, s2_i, mu_t, s2_t)
    for link in LINKS:
        m_new, s2_new, nu = marginal_vb_update(y, x, mu_i, s2_i, mu_t, s2_t, samples, link)
        assert nu == 0
        for i in range(d_t):
            c = float(eq.shrinkage(sm[i], link))

            def kl(p):
                m, s = p
                if s <= 0:
                    return np.inf
                ll = -eq.log_link_cdf(y * (mm[i] + x[i] * (m + samples * s)) / c, link).mean()
                return -math.log(s) + (s * s + (m - mu_i[i]) ** 2) / (2 * s2_i[i]) + ll

            ref = optimize.minimize(kl, [mu_i[i], math.sqrt(s2_i[i])], method="Nelder-Mead",
                                    options={"xatol": 1e-11, "fatol": 1e-14, "maxiter": 4000}).x
            assert m_new[i] == pytest.approx(ref[0], abs=1e-6)
            assert math.sqrt(s2_new[i]) == pytest.approx(ref[1], abs=1e-6)


@pytest.mark.parametrize("link", LINKS)
def test_newton_solves_converge_on_hard_rows(link):
    """Large prior variances and confidently wrong rows: the safeguarded Newton iterations still
    converge (no maxiter hits) to the root found by bracketing (brentq)."""
    for q, z0 in [(12.13106104672423, -3.5530368799616605), (640.0, -8.0), (2000.0, 3.0), (0.01, -30.0)]:
        d_t = 20
        x = np.ones(d_t)
        s2_i = np.full(d_t, q / d_t)
        mu_i = np.full(d_t, z0 / d_t)
        u, _, ok = dimgauss_update(1.0, x, mu_i, s2_i, link, "newton", maxiter=50)
        assert ok
        root = optimize.brentq(lambda z: z - z0 - q * float(eq.psi1(z, link)), z0, z0 + q * float(eq.psi1(z0, link)) + 1,
                               xtol=1e-14)
        assert float(x @ u) == pytest.approx(root, rel=1e-9, abs=1e-9)
        # Algorithm 1 with a huge prior variance for the feature and a wrong-signed self-excluding mean
        s2 = np.array([q])
        w, ok1 = eq.newton_mean(1.0, np.ones(1), np.zeros(1), s2, np.array([z0]), np.array([1.0]), link)
        assert ok1.all()
        c = float(eq.shrinkage(1.0, link))
        ref = optimize.brentq(lambda v: v / q - float(eq.psi1((z0 + v) / c, link)) / c, 0.0, q / c + 1, xtol=1e-13)
        assert w[0] == pytest.approx(ref, rel=1e-9, abs=1e-10)
