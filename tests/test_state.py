"""Typed engine states in and out (float64): fits resume from ``result.state`` (``pcv.fit(..., init=)``), the
envelope bound at a state, predictive marginals through the posterior, and errors naming ``init``."""
import warnings

import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.errors import ConvergenceWarning
from pyro_convexvb.infer.convex_relaxation import RelaxationState
from pyro_convexvb.infer.dual_vg import DualState
from pyro_convexvb.lgm.sites import BernoulliLogit, Poisson

D = torch.float64


def _logistic(N=60, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, n, generator=g, dtype=D)
    y = (X @ torch.linspace(1.0, -1.0, n, dtype=D) + 0.5 * torch.randn(N, generator=g, dtype=D) > 0).to(D)
    return pcv.LatentGaussianModel.from_design(X, BernoulliLogit(y), prior_scale=1.0), X


def _fit(lgm, engine, init=None, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # capped fits stop unconverged on purpose
        return pcv.fit(lgm, engine=engine, options=options, init=init, progress=False)


# ------------------------------------------------------------------------------ convex_relaxation
def test_relaxation_resumed_from_a_converged_state_converges_at_once_to_the_same_answer():
    lgm, _ = _logistic()
    res = _fit(lgm, "convex_relaxation", variance="exact", max_outer=50)
    assert res.converged and isinstance(res.state, RelaxationState)
    again = _fit(lgm, "convex_relaxation", init=res.state, variance="exact", max_outer=50)
    assert again.converged and len(again.history["objective"]) == 2  # the given step and one more
    torch.testing.assert_close(again.state.gamma, res.state.gamma, rtol=1e-3, atol=0)
    torch.testing.assert_close(again.posterior.loc, res.posterior.loc, rtol=1e-4, atol=1e-8)
    assert again.log_evidence_bound == pytest.approx(res.log_evidence_bound, abs=1e-6)


def test_relaxation_capped_and_resumed_equals_one_longer_fit():
    lgm, _ = _logistic(seed=1)
    one = _fit(lgm, "convex_relaxation", variance="exact", max_outer=5, gamma_tol=0.0, phi_tol=0.0)
    part = _fit(lgm, "convex_relaxation", variance="exact", max_outer=2, gamma_tol=0.0, phi_tol=0.0)
    rest = _fit(lgm, "convex_relaxation", init=part.state, variance="exact", max_outer=3, gamma_tol=0.0, phi_tol=0.0)
    # equal to the inner loop's tolerance: the single fit solves its Newton systems after an exact variance step
    # with that step's Cholesky factor, the resumed one (whose state may come from another model) by CG
    torch.testing.assert_close(rest.state.gamma, one.state.gamma, rtol=1e-7, atol=0)
    torch.testing.assert_close(rest.state.z, one.state.z, rtol=1e-7, atol=0)
    torch.testing.assert_close(rest.posterior.loc, one.posterior.loc, rtol=1e-7, atol=1e-9)
    assert rest.log_evidence_bound == pytest.approx(one.log_evidence_bound, rel=1e-10)
    A = one.posterior.precision_operator.to_dense()
    assert rest.state.logdet == pytest.approx(float(torch.logdet(A)), rel=1e-8)


def test_relaxation_state_bound_at_is_the_bound_and_marginals_use_the_engine_factor():
    lgm, X = _logistic(seed=2)
    res = _fit(lgm, "convex_relaxation", variance="exact", max_outer=50)
    assert float(res.state.bound_at(lgm)) == pytest.approx(res.log_evidence_bound, abs=1e-8)
    # exact: the Cholesky factor of A; marginals of new rows equal the dense covariance's
    C = torch.linalg.inv(res.posterior.precision_operator.to_dense())
    m, v = res.posterior.marginals(X[:7])
    torch.testing.assert_close(v, torch.diagonal(X[:7] @ C @ X[:7].T), rtol=1e-10, atol=1e-14)
    assert torch.equal(pcv.infer.convex_relaxation.predictive_marginals(res, X[:7])[1], v)
    # Lanczos without a dense factor: the K-Lanczos estimate of the state's run (a lower bound)
    lz = _fit(lgm, "convex_relaxation", variance="lanczos", lanczos_rank=2, dense_logdet_max=0, max_outer=2)
    assert lz.state.cholesky is None and lz.posterior.lanczos is lz.state.lanczos
    _, vl = lz.posterior.marginals(X[:7])
    torch.testing.assert_close(vl, lz.state.lanczos.variances(X[:7]), rtol=0, atol=0)
    C = torch.linalg.inv(lz.posterior.precision_operator.to_dense())
    assert bool((vl <= torch.diagonal(X[:7] @ C @ X[:7].T) * (1 + 1e-10)).all())


def test_relaxation_init_errors_name_init():
    lgm, _ = _logistic()
    small, _ = _logistic(N=30)
    res = _fit(small, "convex_relaxation", variance="exact")
    with pytest.raises(ValueError, match=r"init\.gamma: .*\(60,\); got shape \(30,\)"):
        _fit(lgm, "convex_relaxation", init=res.state)
    dual = _fit(small, "dual_vg")
    with pytest.raises(TypeError, match="init: engine 'convex_relaxation' resumes from a RelaxationState .* "
                                        "DualState of engine 'dual_vg'"):
        _fit(small, "convex_relaxation", init=dual.state)
    with pytest.raises(TypeError, match="init: engine 'laplace' resumes from a LaplaceState .* RelaxationState"):
        _fit(small, "laplace", init=res.state)
    with pytest.raises(TypeError, match="init: engine 'nuts' resumes from no state"):
        _fit(small, "nuts", init=res.state)
    with pytest.raises(ValueError, match="init or option 'gamma_init'"):
        _fit(small, "convex_relaxation", init=res.state, gamma_init=1.0)
    with pytest.raises(ValueError, match="u_init: a mean needs the site variances z_init"):
        _fit(small, "convex_relaxation", gamma_init=1.0, u_init=torch.zeros(4, dtype=D))


# ------------------------------------------------------------------------------ dual_vg
def _poisson(N=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 3, generator=g, dtype=D)
    y = torch.poisson(torch.exp(X @ torch.tensor([.3, -.2, .1], dtype=D)), generator=g)
    return pcv.LatentGaussianModel.from_design(X, Poisson(y))


def test_dual_resumed_from_a_converged_state_and_capped_then_resumed():
    lgm = _poisson()
    res = _fit(lgm, "dual_vg")
    assert res.converged and isinstance(res.state, DualState) and res.state.form == "latent"
    again = _fit(lgm, "dual_vg", init=res.state)
    assert again.converged and again.info["iterations"] == 0
    assert again.log_evidence_bound == pytest.approx(res.log_evidence_bound, abs=1e-10)
    part = _fit(lgm, "dual_vg", max_iter=1)  # the Laplace start of Poisson sites converges in 2 steps
    assert not part.converged
    rest = _fit(lgm, "dual_vg", init=part.state)
    assert rest.converged
    assert rest.log_evidence_bound == pytest.approx(res.log_evidence_bound, abs=1e-7)
    torch.testing.assert_close(rest.posterior.loc, res.posterior.loc, rtol=1e-5, atol=1e-7)


def test_dual_state_bound_at_is_the_local_bound_elbo_and_init_errors():
    lgm = _poisson()
    res = _fit(lgm, "dual_vg", gap_tol=1e-10)
    assert float(res.state.bound_at(lgm)) == pytest.approx(float(res.info["lvb_elbo"]), abs=1e-8)
    with pytest.raises(ValueError, match=r"init\.alpha must be .* shape \(30,\); got shape \(40,\)"):
        _fit(_poisson(N=30), "dual_vg", init=res.state)
    with pytest.raises(ValueError, match="init or option 'alpha0'"):
        _fit(lgm, "dual_vg", init=res.state, alpha0=res.state.alpha)


def test_dual_site_predictive_of_a_gp_equals_the_dense_formula():
    from pyro_convexvb.gp.classifier import gp_classification_lgm

    g = torch.Generator().manual_seed(3)
    Xa = torch.randn(25, 1, generator=g, dtype=D)
    K_all = torch.exp(-0.5 * torch.cdist(Xa, Xa) ** 2) + 1e-6 * torch.eye(25, dtype=D)
    K, Ks, kss = K_all[:20, :20], K_all[20:, :20], torch.diagonal(K_all)[20:]
    y = (Xa[:20, 0] > 0).to(D)
    res = _fit(gp_classification_lgm(K, y, 0.0), "dual_vg", form="site")
    assert res.state.gp_site_form
    m, v = res.state.site_predictive(Ks, kss)
    A = Ks @ torch.linalg.inv(K)
    V = res.posterior.covariance()
    torch.testing.assert_close(m, A @ res.posterior.loc, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(v, kss - (A * Ks).sum(1) + torch.diagonal(A @ V @ A.T), rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------ diag_mixture
def test_mixture_state_carries_the_mixture_and_checks_its_shape():
    import pyro
    import pyro.distributions as dist

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    X = torch.randn(30, 2, dtype=D)
    y = (X[:, 0] > 0).to(D)
    opts = dict(num_components=2, max_steps=40, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = pcv.fit(model, X, y=y, engine="diag_mixture", options=opts, progress=False)
        assert res.state.steps == res.info["steps"] and res.state.locs.shape == (2, 2)
        torch.testing.assert_close(res.state.locs, res.posterior.locs, rtol=0, atol=0)
        with pytest.raises(ValueError, match="init: the state has 2 mixture components, option num_components = 3"):
            pcv.fit(model, X, y=y, engine="diag_mixture", options=dict(opts, num_components=3), init=res.state,
                    progress=False)
