"""Student-t and Laplace likelihoods (robust regression): their densities against torch, expectations against scipy
quadrature, their super-Gaussian potentials at ``s = eta - y`` (every constant included, Gaussian lower bounds below
the site and touching it), ``convex_relaxation`` fits against the exact posterior by 2-D quadrature with a reported
bound below the exact log evidence, and ``dual_vg``'s refusals."""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import integrate, stats

import pyro_convexvb as pcv
from pyro_convexvb.infer.convex_relaxation.potentials import gaussian_lower_bound, h_implicit, potential_for
from pyro_convexvb.lgm.families import Laplace, StudentT
from _grid_quadrature import grid_posterior_2d

D = torch.float64
Y = torch.tensor([0.0, 1.5, -3.0, 7.0, 0.2, -0.4], dtype=D)
NU = torch.tensor([1.0, 4.0, 2.5, 30.0, 3.0, 0.7], dtype=D)
B = torch.tensor([0.5, 1.0, 2.0, 0.3, 1.7, 1.0], dtype=D)


def _quad(fn, m, v):
    sd = math.sqrt(v)
    val, _ = integrate.quad(lambda e: fn(m + sd * e) * math.exp(-0.5 * e * e) / math.sqrt(2 * math.pi),
                            -14, 14, epsabs=1e-13, epsrel=1e-13, limit=400, points=[(0.0 - m) / sd])
    return val


def _families():
    return {"student_t": (StudentT(Y, NU, B), lambda i: (lambda e: stats.t.logpdf(float(Y[i]), float(NU[i]), e,
                                                                                       float(B[i])))),
            "laplace": (Laplace(B, Y), lambda i: (lambda e: stats.laplace.logpdf(float(Y[i]), e, float(B[i]))))}


@pytest.mark.parametrize("name", ["student_t", "laplace"])
def test_log_prob_is_torch_and_expectation_matches_quadrature(name):
    fam, site = _families()[name]
    eta = torch.linspace(-3, 3, 6, dtype=D)
    ref = (torch.distributions.StudentT(NU, eta, B) if name == "student_t" else torch.distributions.Laplace(eta, B))
    torch.testing.assert_close(fam.log_prob(eta), ref.log_prob(Y), rtol=1e-13, atol=1e-13)
    mean = torch.tensor([-2.0, -0.5, 0.0, 6.0, 1.5, 3.0], dtype=D)
    var = torch.tensor([0.01, 0.5, 2.0, 1.0, 0.3, 0.2], dtype=D)
    ref = torch.tensor([_quad(site(i), float(mean[i]), float(var[i])) for i in range(6)], dtype=D)
    got = fam.expected_log_prob(mean, var, num_points=200)
    # Laplace: closed form; Student-t: Gauss-Hermite of a heavy-tailed, kinkless log density
    torch.testing.assert_close(got, ref, rtol=1e-8 if name == "student_t" else 1e-12, atol=1e-9)


def test_student_t_predictive_mean_exists_only_above_one_degree_of_freedom():
    """E[y] = E[eta] for df > 1; a Student-t with df <= 1 has no mean: nan, as torch's StudentT.mean."""
    y, mean, var = torch.zeros(3, dtype=D), torch.tensor([0.5, -1.0, 2.0], dtype=D), torch.ones(3, dtype=D)
    got = StudentT(y, torch.tensor([3.0, 1.0, 0.5], dtype=D), 1.0).predictive_mean(mean, var)
    assert float(got[0]) == 0.5 and torch.isnan(got[1:]).all()
    assert torch.isnan(torch.distributions.StudentT(torch.tensor([1.0, 0.5])).mean).all()


@pytest.mark.parametrize("name", ["student_t", "laplace"])
def test_potential_is_the_observed_site_at_s_equals_eta_minus_y_and_its_gaussian_bounds_touch_it(name):
    fam, _ = _families()[name]
    pot = potential_for(fam)
    assert pot.log_concave == (name == "laplace")
    torch.testing.assert_close(pot.shift, Y)  # s = eta - y
    eta = torch.tensor([-2.5, -0.3, 0.4, 1.1, 2.0, -1.0], dtype=D)
    s = eta - pot.shift
    torch.testing.assert_close(pot.log_prob(s), fam.log_prob(eta), rtol=1e-13, atol=1e-13)  # kappa: every constant
    for gamma in torch.logspace(-3, 3, 13, dtype=D):  # every width bounds the site from below ...
        assert bool((gaussian_lower_bound(pot, s, gamma.expand(6)) <= fam.log_prob(eta) + 1e-11).all())
    gamma_star = -0.5 / pot.dg(s * s)  # ... and the width of x_*(gamma) = s^2 touches it
    torch.testing.assert_close(gaussian_lower_bound(pot, s, gamma_star), fam.log_prob(eta), rtol=1e-11, atol=1e-11)
    gamma = torch.tensor([0.3, 1.0, 2.0, 5.0, 0.05, 10.0], dtype=D)
    x = torch.cat([torch.zeros(1, dtype=D), torch.logspace(-8, 6, 400001, dtype=D)])[:, None].expand(-1, 6)
    brute = (-(x / gamma + 2 * pot.g(x))).max(0).values
    torch.testing.assert_close(h_implicit(pot, gamma)[0], brute, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pot.h(gamma), h_implicit(pot, gamma)[0], rtol=1e-9, atol=1e-9)


def robust_data(m=20, seed=5):
    g = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.ones(m, 1, dtype=D), torch.randn(m, 1, generator=g, dtype=D)], 1)
    y = X @ torch.tensor([0.5, -1.0], dtype=D) + 0.5 * torch.randn(m, generator=g, dtype=D)
    y[:3] += torch.tensor([5.0, -4.0, 6.0], dtype=D)  # outliers
    return X, y


def robust_model(X, y=None, family="student_t", scale=0.5):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        loc = X @ w
        d = dist.StudentT(3.0, loc, scale) if family == "student_t" else dist.Laplace(loc, scale)
        pyro.sample("y", d, obs=y)


def _log_lik(family, W, X, y):
    eta = W @ X.numpy().T
    if family == "student_t":
        return stats.t.logpdf(y.numpy()[None], 3.0, eta, 0.5).sum(1)
    return stats.laplace.logpdf(y.numpy()[None], eta, 0.5).sum(1)


def _reference(family, X, y, n=401):
    """Posterior mean, sd of ``w`` and ``log p(y)`` by 2-D tensor-grid quadrature (scipy densities)."""
    return grid_posterior_2d(lambda W: _log_lik(family, W, X, y), [-3.0, -4.0], [3.0, 2.0], n)


@pytest.mark.parametrize("family, tol", [
    ("student_t", 0.2),
    # measured 0.33 sd at w[1]: the relaxation's Gaussian of the kinked Laplace sites (20 rows, 3 outliers) is
    # a looser fit than Student-t's; the zoo's convex_relaxation tolerance (0.4) applies
    ("laplace", 0.4),
])
def test_convex_relaxation_fits_the_exact_posterior_and_its_bound_is_below_the_evidence(family, tol):
    X, y = robust_data()
    mean, sd, log_ev = _reference(family, X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Student-t relaxation is not convex: NonConvexWarning
        res = pcv.fit(robust_model, X, y=y, family=family, engine="convex_relaxation",
                      options=dict(max_outer=200), progress=False)
    assert res.converged
    err = np.abs(res.posterior.loc.numpy() - mean) / sd
    print(family, err, res.log_evidence_bound, log_ev)
    assert err.max() < tol
    assert res.log_evidence_bound <= log_ev
    assert res.log_evidence_bound > log_ev - 5.0


@pytest.mark.parametrize("family", ["student_t", "laplace"])
def test_both_families_are_extracted_and_dual_vg_refuses_only_student_t_with_the_reason(family):
    X, y = robust_data()
    lgm = pcv.lgm_from_pyro(robust_model, X, y=y, family=family)
    (g,) = lgm.sites
    assert isinstance(g.family, StudentT if family == "student_t" else Laplace)
    torch.testing.assert_close(g.family.params["y"], y)
    torch.testing.assert_close(g.design.to_dense(), X, rtol=1e-10, atol=1e-10)
    fitting = pcv.engines_that_fit(robust_model, X, y=y, family=family)
    assert "convex_relaxation" in fitting
    if family == "laplace":  # log-concave: dual_vg refines to the exact VG optimum
        assert "dual_vg" in fitting
        return
    assert "dual_vg" not in fitting
    with pytest.raises(pcv.UnsupportedModelError, match="not log-concave") as err:
        pcv.fit(robust_model, X, y=y, family=family, engine="dual_vg", progress=False)
    assert err.value.site == "y"


def test_laplace_expectation_terms_are_the_derivatives_of_the_closed_form():
    """dE/dmean and dE/dvar of Laplace.expected_log_prob_terms against central differences of the closed-form E
    (itself checked against quadrature above); quadrature of the second derivative would give dE/dvar = 0."""
    fam, _ = _families()["laplace"]
    mean = torch.tensor([-2.0, -0.5, 0.0, 6.0, 1.5, 3.0], dtype=D)
    var = torch.tensor([0.01, 0.5, 2.0, 1.0, 0.3, 0.2], dtype=D)
    E, dm, dv = fam.expected_log_prob_terms(mean, var)
    torch.testing.assert_close(E, fam.expected_log_prob(mean, var), rtol=1e-14, atol=1e-14)
    h = 1e-6
    fd_m = (fam.expected_log_prob(mean + h, var) - fam.expected_log_prob(mean - h, var)) / (2 * h)
    fd_v = (fam.expected_log_prob(mean, var + h * var) - fam.expected_log_prob(mean, var - h * var)) / (2 * h * var)
    torch.testing.assert_close(dm, fd_m, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(dv, fd_v, rtol=1e-6, atol=1e-8)
    assert bool((dv < 0).all())  # log-concave: the curvature term is strictly negative


@pytest.mark.parametrize("form", ["latent", "site"])
def test_dual_vg_fits_laplace_likelihoods_at_the_exact_vg_optimum(form):
    """The surrogate bound's dual optimum, refined: the exact VG optimum (found independently by maximising the exact
    bound over the mean and Cholesky factor), within 0.05 sds in mean and 10% in sd of the quadrature posterior here
    (20 rows, 3 outliers; measured 0.02 sds and 7%: the relaxation's Gaussian is 0.33 sds off), and its bound below
    the evidence."""
    from pyro_convexvb.infer.dual_vg.reference import primal_optimum

    X, y = robust_data()
    mean, sd, log_ev = _reference("laplace", X, y)
    res = pcv.fit(robust_model, X, y=y, family="laplace", engine="dual_vg", options=dict(form=form), progress=False)
    assert res.converged and res.info["refine"] and res.info["form"] == form
    assert "refinement" in res.stop_reason and res.info["refine_residual"] <= 1e-8
    lgm = pcv.lgm_from_pyro(robust_model, X, y=y, family="laplace")
    fam = lgm.sites[0].family
    value, m, V = primal_optimum(torch.eye(2, dtype=D), torch.zeros(2, dtype=D), X, torch.zeros(20, dtype=D),
                                 fam.expected_log_prob)
    assert abs(res.log_evidence_bound - value) < 1e-8
    torch.testing.assert_close(res.posterior.loc, m, rtol=0, atol=1e-6)
    torch.testing.assert_close(res.posterior.covariance(), V, rtol=0, atol=1e-6)
    assert res.log_evidence_bound <= log_ev
    q_sd = res.posterior.scale.numpy()
    assert (np.abs(res.posterior.loc.numpy() - mean) / sd).max() < 0.05
    assert np.abs(q_sd / sd - 1).max() < 0.10


def test_dual_vg_refuses_refine_false_on_laplace_sites():
    X, y = robust_data()
    with pytest.raises(ValueError, match="refine=False: site 'y' \\(laplace\\) has no exact local bound"):
        pcv.fit(robust_model, X, y=y, family="laplace", engine="dual_vg", options=dict(refine=False), progress=False)


def test_invalid_scales_are_refused_naming_the_site():
    X, y = robust_data()
    bad = torch.where(y > 0, 0.5, 0.0).to(D)
    for family in ("student_t", "laplace"):
        with pyro.validation_enabled(False), pytest.raises(pcv.UnsupportedModelError, match="scale must be positive") \
                as err:
            pcv.lgm_from_pyro(robust_model, X, y=y, family=family, scale=bad)
        assert err.value.site == "y"


def test_diabetes_example_runs_and_the_student_t_fit_resists_the_outliers():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "robust_diabetes.py"
    spec = importlib.util.spec_from_file_location("robust_diabetes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--samples", "0"])
    X, y, Xt, yt = mod.data(0.1)
    rmse = {name.split(",")[0]: float(((Xt @ mean - yt) ** 2).mean().sqrt()) for name, mean, *_ in rows}
    assert all(r[4] for r in rows)  # converged
    assert rmse["Student-t"] < rmse["Gaussian"] - 0.02
    assert rmse["Laplace"] < rmse["Gaussian"] - 0.02  # measured 0.671 against 0.717


def test_laplace_surrogate_bound_is_a_valid_convex_upper_bound_on_the_expected_loss():
    """The dual's starting bound f(h, rho) >= -E log p at every (h, rho): the unrefined dual answer is a lower
    bound on log p(y) too."""
    fam, _ = _families()["laplace"]
    bound = fam.local_bound()
    assert bound.surrogate and not bound.exact
    for h in torch.linspace(-8, 8, 33, dtype=D):
        for rho in torch.logspace(-6, 3, 19, dtype=D):
            hh, rr = h.expand(6), rho.expand(6)
            assert bool((bound.f(hh, rr) >= -fam.expected_log_prob(hh, rr) - 1e-12).all())


def test_weighted_laplace_sites_equal_repeated_rows():
    """poutine.scale(scale=2) on every Laplace row is the data twice (the weighted terms of the refinement)."""
    X, y = robust_data()

    def scaled(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]), pyro.poutine.scale(scale=2.0):
            pyro.sample("y", dist.Laplace(X @ w, 0.5), obs=y)

    a = pcv.fit(scaled, X, y=y, engine="dual_vg", progress=False)
    b = pcv.fit(robust_model, torch.cat([X, X]), y=torch.cat([y, y]), family="laplace", engine="dual_vg",
                progress=False)
    assert a.converged and b.converged
    torch.testing.assert_close(a.posterior.loc, b.posterior.loc, rtol=0, atol=1e-7)
    torch.testing.assert_close(a.posterior.covariance(), b.posterior.covariance(), rtol=0, atol=1e-7)
    assert abs(a.log_evidence_bound - b.log_evidence_bound) < 1e-6


def test_dual_vg_refinement_converges_on_ten_thousand_laplace_rows():
    """The refinement carries the natural parameters and the site means of q(nu, lam) (working means): recomputing
    the means from alpha, m_t = mu_t - Sigma_t alpha, loses digits to Sigma_t's norm (about N), and the Laplace
    kink turned that into a residual floor of 2e-7 at 10^4 rows (reported unconverged although the answer was
    right). The answer is the exact VG optimum of a direct maximisation (started from it)."""
    from pyro_convexvb.infer.dual_vg.reference import primal_optimum

    g = torch.Generator().manual_seed(0)
    N, L = 10000, 20
    X = torch.randn(N, L, generator=g, dtype=D)
    y = X @ torch.randn(L, generator=g, dtype=D) + 0.5 * torch.distributions.Laplace(
        torch.tensor(0.0, dtype=D), torch.tensor(1.0, dtype=D)).sample((N,))

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(L, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Laplace(X @ w, 0.5), obs=y)

    res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
    assert res.converged and res.info["form"] == "latent" and res.info["refine_residual"] <= 1e-8
    fam = pcv.lgm_from_pyro(model, X, y=y).sites[0].family
    value, m, V = primal_optimum(torch.eye(L, dtype=D), torch.zeros(L, dtype=D), X, torch.zeros(N, dtype=D),
                                 fam.expected_log_prob, m0=res.posterior.loc,
                                 L0=torch.linalg.cholesky(res.posterior.covariance()))
    assert res.log_evidence_bound >= value - 1e-6
    sd = V.diagonal().sqrt()
    assert float(((res.posterior.loc - m).abs() / sd).max()) < 1e-6
    assert float((res.posterior.scale / sd - 1).abs().max()) < 1e-6


def test_dual_vg_learns_a_laplace_scale_param_at_the_maximum_of_the_exact_vg_bound():
    """Type-II on a refined fit maximises the reported exact VG bound (refit gradients; the envelope of the
    surrogate's bound would be another function): against a scalar maximisation of the directly maximised bound."""
    import scipy.optimize

    from pyro_convexvb.infer.dual_vg.reference import primal_optimum

    X, y = robust_data()

    def model(X, y=None):
        b = pyro.param("b", torch.tensor(1.0, dtype=D), constraint=dist.constraints.positive)
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Laplace(X @ w, b), obs=y)

    pyro.clear_param_store()
    res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
    assert res.converged and "type-II over b" in res.stop_reason

    def neg_bound(log_b):
        fam = Laplace(torch.full((20,), math.exp(log_b), dtype=D), y)
        return -primal_optimum(torch.eye(2, dtype=D), torch.zeros(2, dtype=D), X, torch.zeros(20, dtype=D),
                               fam.expected_log_prob)[0]

    ref = scipy.optimize.minimize_scalar(neg_bound, bounds=(-3, 2), method="bounded", options=dict(xatol=1e-7))
    assert float(pyro.param("b")) == pytest.approx(math.exp(ref.x), rel=1e-4)
    assert res.log_evidence_bound == pytest.approx(-ref.fun, abs=1e-8)



def test_student_t_expectation_at_wide_site_variances_against_adaptive_quadrature():
    """64 Gauss-Hermite nodes step over the Student-t's core when the site sd is many scales wide: 1e-2 off at 50
    squared scales and 0.2 at 1,000, either sign (a reported 'lower bound' could exceed the truth). Panels around
    the core now: within 1e-12 of adaptive quadrature at every width, with the terms equal to the value's
    derivatives."""
    from pyro_convexvb.lgm.families import StudentT

    y = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64)
    nu = torch.tensor([3.0, 1.0, 10.0, 4.0], dtype=torch.float64)
    b = torch.tensor([1.0, 0.5, 2.0, 0.1], dtype=torch.float64)
    fam = StudentT(y, nu, b)
    m = torch.tensor([0.0, 3.0, -2.0, 40.0], dtype=torch.float64)
    for v0 in (0.01, 5.0, 200.0, 1e4):
        v = torch.full((4,), v0, dtype=torch.float64)
        got = fam.expected_log_prob(m, v)
        s = v0 ** 0.5
        for i in range(4):
            def f(z, i=i):
                return stats.t.logpdf(z, nu[i].item(), y[i].item(), b[i].item()) * stats.norm.pdf(z, m[i].item(), s)
            ref = integrate.quad(f, m[i].item() - 40 * s, m[i].item() + 40 * s,
                                 points=sorted({y[i].item(), m[i].item()}), limit=1000, epsabs=1e-14, epsrel=1e-13)[0]
            assert float(got[i]) == pytest.approx(ref, rel=1e-12, abs=1e-12), (v0, i)
        mm, vv = m.clone().requires_grad_(True), v.clone().requires_grad_(True)
        gm, gv = torch.autograd.grad(fam.expected_log_prob(mm, vv).sum(), [mm, vv])
        _, d_m, d_v = fam.expected_log_prob_terms(m, v)
        torch.testing.assert_close(d_m, gm, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(d_v, gv, rtol=1e-8, atol=1e-10)
