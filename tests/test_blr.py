"""Bayesian linear regression (Steinberg et al. 2017 §1.2) against dense closed forms and scipy type-II ML."""
import math
import warnings

import gpytorch
import numpy as np
import pytest
import scipy.optimize
import torch

from pyro_convexvb.blr import BayesianLinearRegression, blr_log_marginal_likelihood, blr_posterior
from pyro_convexvb.errors import ConvergenceWarning
from pyro_convexvb.gp.random_features import RandomFourierFeatures

# our own defaults must reach their tolerances: an unconverged fit here is a failure, not a warning
pytestmark = pytest.mark.filterwarnings("error::pyro_convexvb.ConvergenceWarning")

DT = torch.float64


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _data(N, D, seed=0, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    Phi = torch.randn(N, D, generator=g, dtype=DT)
    y = Phi @ torch.randn(D, generator=g, dtype=DT) + noise * torch.randn(N, generator=g, dtype=DT)
    return Phi, y


def _dense_lml(Phi, y, s2, lam):
    N = Phi.shape[0]
    K = s2 * torch.eye(N, dtype=DT) + lam * Phi @ Phi.T
    return torch.distributions.MultivariateNormal(torch.zeros(N, dtype=DT), K).log_prob(y)


@pytest.mark.parametrize("N,D", [(40, 5), (5, 40), (12, 12)])
def test_log_marginal_likelihood_and_posterior_closed_form(N, D):
    Phi, y = _data(N, D)
    s2, lam = 0.2, 1.7
    assert torch.allclose(blr_log_marginal_likelihood(Phi, y, s2, lam), _dense_lml(Phi, y, s2, lam), rtol=1e-12)
    m, C = blr_posterior(Phi, y, s2, lam)
    A = Phi.T @ Phi / s2 + torch.eye(D, dtype=DT) / lam
    C_ref = torch.linalg.inv(A)
    assert torch.allclose(C, C_ref, rtol=1e-9, atol=1e-11)
    assert torch.allclose(m, C_ref @ Phi.T @ y / s2, rtol=1e-9, atol=1e-11)


def test_log_marginal_likelihood_gradients_finite_differences():
    Phi, y = _data(30, 4)
    t = torch.tensor([math.log(0.3), math.log(2.0)], dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: blr_log_marginal_likelihood(Phi, y, t[0].exp(), t[1].exp()), (t,))


def _scipy_type2(Phi, y):
    P, Y = Phi.numpy(), y.numpy()
    N = P.shape[0]

    def neg(theta):
        s2, lam = np.exp(theta)
        K = s2 * np.eye(N) + lam * P @ P.T
        sign, logdet = np.linalg.slogdet(K)
        return 0.5 * (logdet + Y @ np.linalg.solve(K, Y) + N * np.log(2 * np.pi))

    res = scipy.optimize.minimize(neg, np.zeros(2), method="Nelder-Mead",
                                  options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 5000})
    return np.exp(res.x), -res.fun


@pytest.mark.parametrize("N,D,seed", [(60, 4, 3), (15, 30, 4)])
def test_type2_ml_matches_scipy(N, D, seed):
    Phi, y = _data(N, D, seed=seed, noise=0.5)
    (s2, lam), best = _scipy_type2(Phi, y)
    blr = BayesianLinearRegression(noise_var=0.7, prior_var=0.5).fit(Phi, y)
    assert blr.converged_
    assert abs(blr.log_marginal_likelihood_ - best) < 1e-7
    np.testing.assert_allclose([blr.noise_var_, blr.prior_var_], [s2, lam], rtol=1e-4)
    m, C = blr_posterior(Phi, y, s2, lam)
    assert isinstance(blr.coef_, np.ndarray) and blr.intercept_ == 0.0
    np.testing.assert_allclose(blr.coef_, m.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(blr.covariance_, C.numpy(), rtol=1e-3, atol=1e-8)


def test_basis_hyperparameters_match_scipy():
    """Learning an RBF lengthscale through random Fourier features vs scipy on the same frequencies."""
    g = torch.Generator().manual_seed(5)
    X = torch.rand(50, 1, generator=g, dtype=DT) * 6 - 3
    y = torch.sin(1.5 * X[:, 0]) + 0.1 * torch.randn(50, generator=g, dtype=DT)
    k = gpytorch.kernels.RBFKernel().double()
    rff = RandomFourierFeatures(k, 20, seed=0)
    rff(X[:1])
    eps = rff.spectral.eps.numpy()[:, 0]  # fixed standard normal draws: s = eps / lengthscale
    Xn, Yn = X.numpy()[:, 0], y.numpy()

    def neg(theta):
        s2, lam, ell = np.exp(theta)
        proj = np.outer(Xn, eps / ell)
        P = np.hstack([np.cos(proj), np.sin(proj)]) / np.sqrt(20)
        K = s2 * np.eye(50) + lam * P @ P.T
        return 0.5 * (np.linalg.slogdet(K)[1] + Yn @ np.linalg.solve(K, Yn) + 50 * np.log(2 * np.pi))

    starts = [np.log([0.1, 1.0, ell]) for ell in (0.5, 1.0, 2.0)]
    res = min((scipy.optimize.minimize(neg, s, method="Nelder-Mead",
                                       options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000}) for s in starts),
              key=lambda r: r.fun)
    k.lengthscale = 1.0
    blr = BayesianLinearRegression(basis=rff, noise_var=0.1).fit(X, y)
    assert abs(blr.log_marginal_likelihood_ + res.fun) < 1e-6
    ell = float(blr.basis_.kernel.lengthscale.detach())
    np.testing.assert_allclose([blr.noise_var_, blr.prior_var_, ell], np.exp(res.x), rtol=1e-3)
    assert float(k.lengthscale.detach()) == 1.0 and blr.basis_ is not rff  # the basis passed in is not trained


def test_predict_closed_form_and_sklearn_contract():
    Phi, y = _data(50, 3)
    blr = BayesianLinearRegression(fit_intercept=True, learn_noise=False, learn_prior_var=False,
                                   noise_var=0.09, prior_var=2.0)
    assert blr.fit(Phi, y) is blr
    Xs = torch.randn(6, 3, dtype=DT)
    P1 = torch.cat([Phi, torch.ones(50, 1, dtype=DT)], 1)
    Ps = torch.cat([Xs, torch.ones(6, 1, dtype=DT)], 1)
    m, C = blr_posterior(P1, y, 0.09, 2.0)
    mean, std = blr.predict(Xs, return_std=True)
    assert isinstance(mean, np.ndarray) and isinstance(std, np.ndarray)
    np.testing.assert_allclose(mean, (Ps @ m).numpy(), rtol=1e-12)
    np.testing.assert_allclose(std ** 2, (0.09 + ((Ps @ C) * Ps).sum(-1)).numpy(), rtol=1e-12)
    _, std_f = blr.predict(Xs, return_std=True, include_noise=False)
    np.testing.assert_allclose(std_f ** 2, ((Ps @ C) * Ps).sum(-1).numpy(), rtol=1e-12)
    assert abs(blr.noise_var_ - 0.09) < 1e-14 and abs(blr.prior_var_ - 2.0) < 1e-13
    assert torch.allclose(blr.posterior_.loc, m)
    np.testing.assert_allclose(blr.coef_, m[:3].numpy(), rtol=1e-12)
    assert blr.intercept_ == pytest.approx(float(m[3]), rel=1e-12)
    # NumPy, float32 and SciPy sparse inputs give the same float64 answer
    np.testing.assert_allclose(blr.predict(Xs.numpy()), mean, rtol=1e-12)
    import scipy.sparse as sp

    sparse = BayesianLinearRegression(fit_intercept=True, learn_noise=False, learn_prior_var=False,
                                      noise_var=0.09, prior_var=2.0).fit(sp.csr_matrix(Phi.numpy()), y.numpy())
    np.testing.assert_allclose(sparse.coef_, blr.coef_, rtol=1e-12)
    resid = y.numpy() - blr.predict(Phi)
    r2 = 1 - resid @ resid / ((y.numpy() - y.numpy().mean()) ** 2).sum()
    assert blr.score(Phi, y) == pytest.approx(r2, rel=1e-12) and r2 > 0.8


def test_errors():
    Phi, y = _data(10, 2)
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        BayesianLinearRegression().predict(Phi)
    with pytest.raises(ValueError, match="X contains NaN"):
        BayesianLinearRegression().fit(Phi * float("nan"), y)
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        BayesianLinearRegression().fit(Phi, y[:5])
    with pytest.raises(ValueError, match="noise_var"):
        BayesianLinearRegression(noise_var=-1.0).fit(Phi, y)
    blr = BayesianLinearRegression().fit(Phi, y)
    with pytest.raises(ValueError, match="features"):
        blr.predict(torch.randn(3, 5, dtype=DT))
    with pytest.raises(ValueError, match="max_iter"):
        BayesianLinearRegression(max_iter=0).fit(Phi, y)
    with pytest.warns(ConvergenceWarning):
        BayesianLinearRegression(max_iter=1, noise_var=10.0, prior_var=0.01).fit(Phi, y)


import pyro_convexvb as pcv  # noqa: E402


def test_exactly_fitted_targets_keep_noise_above_floor():
    # targets the features fit exactly (duplicated rows, scikit-learn's sample-weight checks): the evidence grows
    # without bound as sigma^2 -> 0; the learned sigma^2 stops at 1e-10 var(y) instead of breaking the Cholesky
    import warnings

    import numpy as np

    X = np.repeat(np.array([[1, 3], [2, 1], [3, 3], [4, 1]], dtype=float), 4, 0)
    y = np.repeat(np.array([1, 2, 1, 2], dtype=float), 4)  # y = 2.5 - 0.5 x_2 exactly
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)  # the optimum is on the floor
        reg = pcv.BayesianLinearRegression(fit_intercept=True).fit(X, y)
    assert reg.noise_var_ >= 1e-10 * y.var() * (1 - 1e-12)
    assert reg.noise_var_ < 1e-6
    np.testing.assert_allclose(reg.predict(X), y, rtol=0, atol=1e-4)


@pytest.mark.parametrize("rows", [100, 442])
def test_uncentred_targets_reach_the_evidence_maximum_of_bayesian_ridge(rows):
    """The diabetes targets as shipped (mean 152) without an intercept: from the default start (sigma^2 = lambda = 1)
    the evidence is nearly flat over decades of lambda, where L-BFGS alone stopped at lambda = 0.92 with
    converged_=True (all 100 rows' coefficients about 0), or failed with an infinite loss on all 442 rows. The fixed
    point reaches scikit-learn's BayesianRidge (flat hyperpriors, the same evidence), as do repeated rows."""
    from sklearn.datasets import load_diabetes
    from sklearn.linear_model import BayesianRidge

    X, y = load_diabetes(return_X_y=True)
    X, y = X[:rows], y[:rows]
    ref = BayesianRidge(fit_intercept=False, alpha_1=0, alpha_2=0, lambda_1=0, lambda_2=0, tol=1e-12,
                        max_iter=100_000).fit(X, y)
    m = BayesianLinearRegression().fit(X, y)
    assert m.converged_
    assert m.noise_var_ == pytest.approx(1 / ref.alpha_, rel=1e-6)
    assert m.prior_var_ == pytest.approx(1 / ref.lambda_, rel=1e-6)
    np.testing.assert_allclose(m.coef_, ref.coef_, rtol=1e-6, atol=1e-6 * np.abs(ref.coef_).max())
    lml = float(blr_log_marginal_likelihood(torch.tensor(X), torch.tensor(y), 1 / ref.alpha_, 1 / ref.lambda_))
    assert m.log_marginal_likelihood_ == pytest.approx(lml, abs=1e-6)
    twice = BayesianLinearRegression().fit(X, y, sample_weight=np.full(rows, 2.0))
    both = BayesianLinearRegression().fit(np.vstack([X, X]), np.concatenate([y, y]))
    assert twice.converged_ and twice.prior_var_ == pytest.approx(both.prior_var_, rel=1e-8)
    assert twice.noise_var_ == pytest.approx(both.noise_var_, rel=1e-8)
    assert m.n_iter_ <= m.max_iter


def test_options_that_a_closed_form_fit_does_not_use_are_warned_of():
    """``learn_basis=False`` without a :class:`torch.nn.Module` basis, and ``max_iter`` / ``tol`` when nothing is
    learned (``learn_noise=False``, ``learn_prior_var=False``, no learned basis), were accepted and ignored silently:
    now named in a UserWarning, and the fit is the default one (bit for bit, the closed-form posterior at the given
    variances).  Where they apply they warn of nothing and change the fit."""
    import warnings

    Phi, y = _data(30, 3)
    X, yv = Phi.numpy(), y.numpy()
    fixed = dict(noise_var=0.2, prior_var=3.0, learn_noise=False, learn_prior_var=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = BayesianLinearRegression(learn_basis=False).fit(X, yv)
        b = BayesianLinearRegression(max_iter=1, tol=0.1, **fixed).fit(X, yv)
        BayesianLinearRegression(**fixed).fit(X, yv)
        BayesianLinearRegression(basis=RandomFourierFeatures(gpytorch.kernels.RBFKernel().double(), 8, seed=0),
                                 learn_basis=False, **fixed).fit(X, yv)  # a module, kept fixed: nothing unused
        warnings.simplefilter("ignore", ConvergenceWarning)
        BayesianLinearRegression(max_iter=1, tol=0.1).fit(X, yv)  # the variances are learned: both used
    assert [str(m.message) for m in w if m.category is UserWarning] == [
        "BayesianLinearRegression: learn_basis=False is not used (the basis is not a torch.nn.Module: it has no "
        "parameters to learn); leave it at its default",
        "BayesianLinearRegression: max_iter=1, tol=0.1 are not used (learn_noise=False and learn_prior_var=False with "
        "no learned basis parameters: the fit is closed-form, nothing is optimised); leave them at their defaults"]
    np.testing.assert_array_equal(a.coef_, BayesianLinearRegression().fit(X, yv).coef_)
    ref = BayesianLinearRegression(**fixed).fit(X, yv)
    np.testing.assert_array_equal(b.coef_, ref.coef_)
    m, C = blr_posterior(Phi, y, 0.2, 3.0)  # the closed form at the given variances
    np.testing.assert_allclose(b.coef_, m.numpy(), rtol=1e-12)
    assert b.n_iter_ == 0
    with pytest.warns(ConvergenceWarning):  # where it applies, max_iter caps the fit
        assert BayesianLinearRegression(max_iter=1).fit(X, yv).n_iter_ == 1


def test_include_noise_without_return_std_is_refused():
    """``include_noise`` chooses the variance behind the std: with ``return_std=False`` it was ignored silently (the
    mean came back); now a ValueError naming both. With ``return_std=True`` the two stds differ by the noise."""
    Phi, y = _data(30, 3)
    X, yv = Phi.numpy(), y.numpy()
    blr = BayesianLinearRegression().fit(X, yv)
    with pytest.raises(ValueError, match="include_noise=False: .* pass return_std=True"):
        blr.predict(X, include_noise=False)
    np.testing.assert_array_equal(blr.predict(X, include_noise=True), blr.predict(X))
    _, s_y = blr.predict(X, return_std=True)
    _, s_f = blr.predict(X, return_std=True, include_noise=False)
    np.testing.assert_allclose(s_y ** 2, s_f ** 2 + blr.noise_var_, rtol=1e-12)


def test_tight_tol_converges_at_rounding_and_an_exhausted_fixed_point_says_so():
    """``tol=1e-10`` asked the evidence fixed point for a relative change of 1e-16, below float64's rounding, so it
    used all of ``max_iter`` and warned of an L-BFGS that stopped "after 0 iterations" with a gradient of 1e-17;
    the fixed point now stops at 1e-14 and converges, at the answer of the default ``tol``."""
    import warnings

    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    X, y = 10 * X[:200], y[:200] - y[:200].mean()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tight = pcv.BayesianLinearRegression(tol=1e-10, max_iter=2000).fit(X, y)
    ref = pcv.BayesianLinearRegression().fit(X, y)
    assert tight.converged_ and tight.n_iter_ < 100
    np.testing.assert_allclose([tight.noise_var_, tight.prior_var_], [ref.noise_var_, ref.prior_var_], rtol=1e-5)
    with pytest.warns(ConvergenceWarning, match="fixed point for sigma.2 and lambda did not converge in max_iter=2 "):
        short = pcv.BayesianLinearRegression(max_iter=2).fit(X, y)
    assert not short.converged_


def test_a_noise_variance_stopped_at_its_floor_is_said():
    """Targets of noise sd 1e-6 on a scale of 3.5: the learned noise variance stops at its floor (1e-10 var(y)), its
    predictive sds 40 times BayesianRidge's; the fit says so instead of passing silently."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3))
    y = X @ [1.0, 2.0, 3.0] + 1e-6 * rng.normal(size=60)
    with pytest.warns(UserWarning, match="noise variance stopped at its floor"):
        m = BayesianLinearRegression().fit(X, y)
    assert m.noise_var_ == pytest.approx(1e-10 * y.var(), rel=0.05)
    y = X @ [1.0, 2.0, 3.0] + 1e-3 * rng.normal(size=60)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*noise variance stopped at its floor")
        BayesianLinearRegression().fit(X, y)
