"""GPClassifier (GPyTorch kernels, dual VG and other engines): predictions vs dense references, envelope gradients."""
import math

import gpytorch
import pytest
import torch

from pyro_convexvb.gp.classifier import GPClassifier, gp_classification_lgm
from pyro_convexvb.gp.hyper import envelope_objective
from pyro_convexvb.infer.dual_vg import SiteSpaceBackend, make_bound, solve_dual
from pyro_convexvb.infer.dual_vg.reference import cvi_fixed_point
from pyro_convexvb.lgm.sites import BernoulliLogit

D = torch.float64


def _data(n=60, seed=0, noise=0.3):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, dtype=D, generator=gen)
    f = torch.sin(2 * X[:, 0]) + X[:, 1]
    y = (f + noise * torch.randn(n, dtype=D, generator=gen) > 0).long()
    return X, y


def _kernel(ls=0.8, os=2.0):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.base_kernel.lengthscale = ls
    k.outputscale = os
    return k


def test_predictions_match_dense_reference():
    X, y = _data()
    Xt, yt = _data(40, seed=1)
    clf = GPClassifier(_kernel(), options={"gap_tol": 1e-11}).fit(X, y)
    K = clf.K_train_
    Kx = clf.kernel(Xt, X).to_dense().detach()
    kd = clf.kernel(Xt, diag=True).detach()
    q = clf.posterior_
    # dense reference with explicit K^{-1}: mean Kx K^-1 m, var kd - diag(Kx K^-1 Kx^T) + diag(Kx K^-1 V K^-1 Kx^T)
    A = Kx @ torch.linalg.inv(K)
    m_ref = A @ q.loc
    v_ref = kd - (A * Kx).sum(-1) + ((A @ q.covariance()) * A).sum(-1)
    m, v = clf.predict_latent(Xt)
    assert torch.allclose(m, m_ref, atol=1e-7) and torch.allclose(v, v_ref, atol=1e-7)
    # probabilities: brute-force quadrature of sigmoid under N(m, v)
    z = torch.linspace(-10, 10, 20001, dtype=D)
    w = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi) * (20 / 20000)
    p_ref = (torch.sigmoid(m[:, None] + v.sqrt()[:, None] * z) * w).sum(-1)
    P = clf.predict_proba(Xt)
    assert torch.allclose(P[:, 1], p_ref, atol=1e-8) and torch.allclose(P.sum(-1), torch.ones(40, dtype=D))
    assert torch.equal(clf.predict(Xt), (P[:, 1] > 0.5).long())
    assert clf.score(Xt, yt) > 0.8 and clf.nlpd(Xt, yt) < 0.45
    assert torch.allclose(clf.decision_function(Xt), m)


def test_bound_is_exact_vg_bound_and_close_to_exact_optimum():
    X, y = _data()
    clf = GPClassifier(_kernel()).fit(X, y)
    lgm = gp_classification_lgm(clf.K_train_, clf.y_train_)
    q = clf.posterior_
    assert clf.log_evidence_bound_ == pytest.approx(float(lgm.evidence_lower_bound(q.loc, q.covariance())), abs=1e-8)
    best = cvi_fixed_point(clf.K_train_, torch.zeros(60, dtype=D), BernoulliLogit(clf.y_train_), tol=1e-13)
    assert best["converged"]
    gap = best["elbo"] - clf.log_evidence_bound_
    assert 0 <= gap < 0.05
    refined = GPClassifier(_kernel(), options={"refine": True}).fit(X, y)
    assert refined.log_evidence_bound_ == pytest.approx(best["elbo"], abs=1e-7)
    assert torch.allclose(refined.posterior_.loc, best["loc"], atol=1e-4)
    # a Pyro engine through the same classifier: its exact VG bound cannot beat the exact optimum
    Xs, ys = X[:25], y[:25]
    dual = GPClassifier(_kernel()).fit(Xs, ys)
    best_s = cvi_fixed_point(dual.K_train_, torch.zeros(25, dtype=D), BernoulliLogit(dual.y_train_), tol=1e-13)
    lap = GPClassifier(_kernel(), engine="laplace", options={"max_iter": 200}).fit(Xs, ys)
    assert lap.log_evidence_bound_ <= best_s["elbo"] + 1e-8
    assert lap.score(Xs, ys) > 0.8


def test_envelope_gradient_matches_finite_differences_of_the_optimum():
    X, y = _data(40, seed=3)
    y01 = y.to(D)
    bound = make_bound(BernoulliLogit(y01))
    raw_ls = torch.tensor(-0.3, dtype=D, requires_grad=True)
    mean = torch.tensor(0.2, dtype=D, requires_grad=True)

    def K_of(r):
        ls = torch.nn.functional.softplus(r)
        return 1.5 * torch.exp(-0.5 * torch.cdist(X, X) ** 2 / ls**2) + 1e-6 * torch.eye(40, dtype=D)

    def opt_value(r, mval):
        be = SiteSpaceBackend(K_of(r).detach(), mval.detach().expand(40))
        return solve_dual(be, bound, gap_tol=1e-12)

    sol = opt_value(raw_ls, mean)
    g = envelope_objective(K_of(raw_ls), mean.expand(40), bound, sol.alpha, sol.lam)
    assert float(g) == pytest.approx(sol.g, abs=1e-9)
    g.backward()
    e = 1e-5
    fd_ls = (opt_value(raw_ls.detach() + e, mean).g - opt_value(raw_ls.detach() - e, mean).g) / (2 * e)
    fd_mu = (opt_value(raw_ls, mean.detach() + e).g - opt_value(raw_ls, mean.detach() - e).g) / (2 * e)
    assert float(raw_ls.grad) == pytest.approx(fd_ls, rel=1e-5, abs=1e-6)
    assert float(mean.grad) == pytest.approx(fd_mu, rel=1e-5, abs=1e-6)


def test_hyperparameter_learning_improves_the_bound():
    X, y = _data(80, seed=5, noise=0.6)
    fixed = GPClassifier(_kernel(ls=3.0, os=0.5)).fit(X, y)
    learned = GPClassifier(_kernel(ls=3.0, os=0.5), learn_hyperparameters=True, options={"gap_tol": 1e-11},
                           hyper_options={"max_iter": 100}).fit(X, y)
    assert learned.hyper_converged_
    assert learned.log_evidence_bound_ > fixed.log_evidence_bound_ + 1.0
    h = learned.hyper_history_["objective"]
    assert max(h) == pytest.approx(h[-1], abs=1e-6) and all(gp < 1e-5 for gp in learned.hyper_history_["gap"][-3:])
    # the learned q is the dual optimum at the learned hyperparameters (warm start and refit agree)
    again = GPClassifier(learned.kernel_, mean=float(learned.mean_.detach()), options={"gap_tol": 1e-11}).fit(X, y)
    assert again.log_evidence_bound_ == pytest.approx(learned.log_evidence_bound_, abs=1e-6)


def test_the_passed_kernel_is_never_modified():
    """Two classifiers sharing one kernel object stay independent; hyperparameter learning trains a copy."""
    X, y = _data(60, seed=3, noise=0.5)
    kernel = _kernel(ls=2.0, os=1.0)
    before = {k: v.detach().clone() for k, v in kernel.state_dict().items()}
    first = GPClassifier(kernel).fit(X, y)
    p_first = first.predict_proba(X).clone()
    GPClassifier(kernel, learn_hyperparameters=True, hyper_options={"max_iter": 30}).fit(X[:10], y[:10])
    GPClassifier(kernel, dtype=torch.float32).fit(X, y)
    for k, v in kernel.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    torch.testing.assert_close(first.predict_proba(X), p_first, rtol=0, atol=0)
    assert first.kernel_ is not kernel


def test_input_validation():
    X, y = _data(20)
    clf = GPClassifier(_kernel())
    with pytest.raises(RuntimeError, match="fit"):
        clf.predict(X)
    with pytest.raises(ValueError, match="two classes"):
        clf.fit(X, torch.arange(20) % 3)
    with pytest.raises(ValueError, match="X"):
        clf.fit(X[:, 0], y)
    Xn = X.clone(); Xn[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        clf.fit(Xn, y)
    with pytest.raises(ValueError, match="labels"):
        clf.fit(X, y[:10])
    clf.fit(X, 2 * y - 1)  # {-1, +1} labels are kept in their coding
    assert set(clf.predict(X).tolist()) <= {-1, 1}
    with pytest.raises(ValueError, match="features"):
        clf.predict(torch.zeros(3, 5, dtype=D))
    with pytest.raises(ValueError, match="dual_vg"):
        GPClassifier(_kernel(), engine="laplace", learn_hyperparameters=True).fit(X, y)
