"""Trainable guides from fitted posteriors: the param store holds the posterior, SVI continues from it.

References are independent of the guide code: covariances are rebuilt from the raw param-store entries
with Pyro's parametrisations, and ELBOs are computed by tensor-product Gauss-Hermite quadrature.
"""
import copy
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoMultivariateNormal

import pyro_convexvb as pcv
from pyro_convexvb.posterior import gaussian as posterior_module
from pyro_convexvb.infer.diag_mixture import AutoDiagMixture, DiagMixtureGuide, DiagMixturePosterior
from pyro_convexvb.posterior.gaussian import (GaussianPosteriorGuide, PosteriorDiagonalNormal,
                                           PosteriorLowRankMultivariateNormal, PosteriorMultivariateNormal)
from pyro_convexvb.linalg.operators import DenseOperator

D = torch.float64
TOL = 1e-10


# ------------------------------------------------------------------------------------------ models and data
def logreg(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        return pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def two_site_model(X, y=None):
    """A (2, 2) matrix latent and a positive scalar latent (unconstrained as its log)."""
    W = pyro.sample("W", dist.Normal(torch.zeros(2, 2, dtype=D), 1.0).to_event(2))
    sigma = pyro.sample("sigma", dist.LogNormal(torch.tensor(0.0, dtype=D), 0.5))
    with pyro.plate("data", X.shape[0]):
        return pyro.sample("y", dist.Normal(X @ W.reshape(4), sigma), obs=y)


def _logreg_data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, generator=g, dtype=D)
    y = (torch.rand(n, generator=g, dtype=D) < torch.sigmoid(X @ torch.tensor([1.0, -0.5, 0.3], dtype=D))).to(D)
    return X, y


def _log_joint(u, X, y):
    """``log p(y, w = u)`` of :func:`logreg`, for ``u`` ``(M, 3)``."""
    logits = u @ X.T
    return dist.Normal(0.0, 1.0).log_prob(u).sum(-1) + (y * logits - torch.nn.functional.softplus(logits)).sum(-1)


def _laplace(X, y):
    """Mode and inverse Hessian of the logistic-regression posterior (Newton's method)."""
    m = torch.zeros(3, dtype=D)
    for _ in range(50):
        p = torch.sigmoid(X @ m)
        H = torch.eye(3, dtype=D) + X.T @ (X * (p * (1 - p))[:, None])
        m = m + torch.linalg.solve(H, X.T @ (y - p) - m)
    p = torch.sigmoid(X @ m)
    H = torch.eye(3, dtype=D) + X.T @ (X * (p * (1 - p))[:, None])
    return m, torch.linalg.inv(H)


def _gh_grid(order, dim=3):
    """Nodes ``(order^dim, dim)`` and weights of ``E_{N(0, I)}[f]`` by tensor-product Gauss-Hermite."""
    x, w = np.polynomial.hermite.hermgauss(order)
    x, w = torch.tensor(x, dtype=D), torch.tensor(w, dtype=D)
    grid = torch.stack([g.reshape(-1) for g in torch.meshgrid(*[x] * dim, indexing="ij")], -1) * math.sqrt(2)
    weight = torch.stack([g.reshape(-1) for g in torch.meshgrid(*[w] * dim, indexing="ij")], -1).prod(-1)
    return grid, weight / math.pi ** (dim / 2)


def _gh_elbo(locs, covs, X, y, order=30):
    """ELBO of ``q = (1/K) sum_k N(locs[k], covs[k])`` for :func:`logreg` by Gauss-Hermite quadrature.

    ``sum_k (1/K) E_{q_k}[log p(y, u) - log q(u)]``, each expectation on an ``order^3`` product grid.
    """
    grid, weight = _gh_grid(order)
    comps = [dist.MultivariateNormal(m, covariance_matrix=S) for m, S in zip(locs, covs)]
    K = len(comps)
    total = torch.zeros((), dtype=D)
    for m, S in zip(locs, covs):
        U = m + grid @ torch.linalg.cholesky(S).T
        log_q = torch.logsumexp(torch.stack([c.log_prob(U) for c in comps]), 0) - math.log(K)
        total = total + (weight * (_log_joint(U, X, y) - log_q)).sum() / K
    return float(total)


# ------------------------------------------------------------------------------------------ posteriors
KINDS = ["covariance", "scale_tril", "precision", "diagonal", "low_rank_diagonal", "precision_operator"]
PYRO_BASE = {"covariance": AutoMultivariateNormal, "scale_tril": AutoMultivariateNormal,
             "precision": AutoMultivariateNormal, "precision_operator": AutoMultivariateNormal,
             "diagonal": AutoDiagonalNormal, "low_rank_diagonal": AutoLowRankMultivariateNormal}
OURS = {AutoMultivariateNormal: PosteriorMultivariateNormal, AutoDiagonalNormal: PosteriorDiagonalNormal,
        AutoLowRankMultivariateNormal: PosteriorLowRankMultivariateNormal}


def _posterior(kind, X, y):
    """A deliberately suboptimal posterior (Laplace mean, covariance inflated 2x) and its covariance ``(3, 3)``."""
    m, C = _laplace(X, y)
    C2 = 2 * C
    if kind == "covariance":
        return pcv.GaussianPosterior(m, covariance=C2), C2
    if kind == "scale_tril":
        L = torch.linalg.cholesky(C2) * torch.tensor([1.0, -1.0, 1.0], dtype=D)  # a non-Cholesky factor of C2
        return pcv.GaussianPosterior(m, scale_tril=L), C2
    if kind == "precision":
        return pcv.GaussianPosterior(m, precision=torch.linalg.inv(C2)), C2
    if kind == "diagonal":
        return pcv.GaussianPosterior(m, C2.diagonal().clone()), torch.diag(C2.diagonal())
    if kind == "low_rank_diagonal":
        evals, evecs = torch.linalg.eigh(C2)
        W = evecs[:, -1:] * evals[-1].sqrt()
        d = C2.diagonal() / 2
        return pcv.GaussianPosterior(m, cov_factor=W, cov_diag=d), W @ W.T + torch.diag(d)
    if kind == "precision_operator":
        # C2 = precision_scale * A^{-1} with A = J^T J, precision_scale = 0.5
        A = 0.5 * torch.linalg.inv(C2)
        J = torch.linalg.cholesky(A).T
        q = pcv.GaussianPosterior(m, C2.diagonal().clone(), precision_operator=DenseOperator(A),
                                  precision_factor=DenseOperator(J), precision_scale=0.5)
        return q, C2
    raise AssertionError(kind)


def _attach(q, model, *args, **kwargs):
    q.model, q.model_args = model, (args, kwargs)
    return q


def _store_loc_cov(base, prefix):
    """Mean and covariance rebuilt from the raw param-store entries with Pyro's parametrisation."""
    loc = pyro.param(f"{prefix}.loc").detach().clone()  # a copy: SVI updates the store in place
    scale = pyro.param(f"{prefix}.scale").detach()
    if base is AutoMultivariateNormal:
        L = scale[:, None] * pyro.param(f"{prefix}.scale_tril").detach()
        return loc, L @ L.T
    if base is AutoDiagonalNormal:
        return loc, torch.diag(scale**2)
    F = pyro.param(f"{prefix}.cov_factor").detach() * scale[:, None]
    return loc, F @ F.T + torch.diag(scale**2)


def _stale_entries(base, prefix, n=3):
    names = {"loc": torch.full((n,), 7.0, dtype=D), "scale": torch.full((n,), 3.0, dtype=D)}
    if base is AutoMultivariateNormal:
        names["scale_tril"] = torch.eye(n, dtype=D)
    if base is AutoLowRankMultivariateNormal:
        names["cov_factor"] = torch.ones(n, 1, dtype=D)
    for k, v in names.items():
        pyro.param(f"{prefix}.{k}", v)


# ------------------------------------------------------------------------------------------ the store
@pytest.mark.parametrize("kind", KINDS)
def test_store_holds_posterior_and_stale_entries_do_not_override(kind):
    X, y = _logreg_data()
    q, C = _posterior(kind, X, y)
    _attach(q, logreg, X, y=y)
    base = PYRO_BASE[kind]
    prefix = OURS[base].__name__
    _stale_entries(base, prefix)
    pyro.param("unrelated.param", torch.arange(4.0, dtype=D))
    guide = q.as_guide()
    assert type(guide) is OURS[base] and isinstance(guide, base)
    loc, cov = _store_loc_cov(base, prefix)
    torch.testing.assert_close(loc, q.loc, rtol=0, atol=TOL)
    torch.testing.assert_close(cov, C, rtol=0, atol=TOL)
    assert torch.equal(pyro.param("unrelated.param").detach(), torch.arange(4.0, dtype=D))
    # Pyro's own view of the guide agrees, and calling the guide does not bring stale values back
    qd = guide.get_posterior()
    cov_pyro = qd.covariance_matrix if base is not AutoDiagonalNormal else torch.diag(qd.base_dist.scale**2)
    torch.testing.assert_close(cov_pyro.detach(), C, rtol=0, atol=TOL)
    guide(X, y=y)
    Predictive(logreg, guide=guide, num_samples=5)(X)
    loc2, cov2 = _store_loc_cov(base, prefix)
    torch.testing.assert_close(loc2, q.loc, rtol=0, atol=TOL)
    torch.testing.assert_close(cov2, C, rtol=0, atol=TOL)
    torch.testing.assert_close(guide.to_posterior().covariance(), C, rtol=0, atol=TOL)
    # the guide's parameters are copies: training cannot modify the engine's posterior
    assert guide.loc.data_ptr() != q.loc.data_ptr()


def test_lazy_build_with_explicit_model_overwrites_stale_entries_at_first_call():
    X, y = _logreg_data()
    q, C = _posterior("covariance", X, y)
    _stale_entries(AutoMultivariateNormal, "lazy")
    guide = q.as_guide(logreg, name_prefix="lazy")  # no data known: built at the first call
    assert guide.prototype_trace is None
    assert torch.equal(pyro.param("lazy.loc").detach(), torch.full((3,), 7.0, dtype=D))
    guide(X, y=y)
    loc, cov = _store_loc_cov(AutoMultivariateNormal, "lazy")
    torch.testing.assert_close(loc, q.loc, rtol=0, atol=TOL)
    torch.testing.assert_close(cov, C, rtol=0, atol=TOL)
    # built inside the first SVI step: the optimiser trains the posterior's values, not the stale ones
    _stale_entries(AutoMultivariateNormal, "lazy2")
    guide2 = q.as_guide(logreg, name_prefix="lazy2")
    svi = SVI(logreg, guide2, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    svi.step(X, y=y)
    loc2 = pyro.param("lazy2.loc").detach()
    assert 0 < float((loc2 - q.loc).abs().max()) < 2e-3
    torch.testing.assert_close(guide2.to_posterior().loc, loc2, rtol=0, atol=0)


def test_name_prefix_keeps_two_guides_apart():
    X, y = _logreg_data()
    q1, C1 = _posterior("covariance", X, y)
    q2, C2 = _posterior("diagonal", X, y)
    g1 = q1.as_guide(logreg, name_prefix="first", model_args=(X,), model_kwargs={"y": y})
    g2 = q2.as_guide(logreg, form="full", name_prefix="second", model_args=(X,), model_kwargs={"y": y})
    assert isinstance(g2, PosteriorMultivariateNormal)
    torch.testing.assert_close(_store_loc_cov(AutoMultivariateNormal, "first")[1], C1, rtol=0, atol=TOL)
    torch.testing.assert_close(_store_loc_cov(AutoMultivariateNormal, "second")[1], C2, rtol=0, atol=TOL)
    names = set(pyro.get_param_store().keys())
    assert names == {f"{p}.{k}" for p in ("first", "second") for k in ("loc", "scale", "scale_tril")}
    tr = poutine.trace(g1).get_trace(X, y=y)
    params = {n for n, s in tr.nodes.items() if s["type"] == "param"}
    assert params == {"first.loc", "first.scale", "first.scale_tril"} and "_first_latent" in tr.nodes


# ------------------------------------------------------------------------------------------ SVI continues
def test_gauss_hermite_elbo_is_converged():
    """The quadrature error is far below the tolerance used for 'the ELBO did not decrease'."""
    X, y = _logreg_data()
    m, C = _laplace(X, y)
    e30 = _gh_elbo([m], [2 * C], X, y, order=30)
    e40 = _gh_elbo([m], [2 * C], X, y, order=40)
    assert abs(e30 - e40) < 1e-10
    # for one Gaussian it is E[log p] (quadrature) plus the closed-form entropy
    grid, weight = _gh_grid(40)
    U = m + grid @ torch.linalg.cholesky(2 * C).T
    e_logp = float((weight * _log_joint(U, X, y)).sum())
    entropy = 0.5 * float(torch.logdet(2 * math.pi * math.e * 2 * C))
    assert e_logp + entropy == pytest.approx(e40, abs=1e-10)


def _svi_steps(guide, steps=50, lr=5e-3):
    X, y = _logreg_data()
    svi = SVI(logreg, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO(num_particles=4))
    for _ in range(steps):
        svi.step(X, y=y)


@pytest.mark.parametrize("kind", KINDS)
def test_svi_continues_from_the_posterior_and_does_not_lower_the_elbo(kind):
    X, y = _logreg_data()
    q, C = _posterior(kind, X, y)
    guide = _attach(q, logreg, X, y=y).as_guide()
    base, prefix = PYRO_BASE[kind], type(guide).__name__
    loc0, cov0 = _store_loc_cov(base, prefix)
    before = _gh_elbo([loc0], [cov0], X, y)
    assert before == pytest.approx(_gh_elbo([q.loc], [C], X, y), abs=1e-9)
    _svi_steps(guide)
    loc1, cov1 = _store_loc_cov(base, prefix)
    assert float((loc1 - loc0).abs().max()) > 1e-3 and float((cov1 - cov0).abs().max()) > 1e-3
    after = _gh_elbo([loc1], [cov1], X, y)
    # exact ELBOs (quadrature error < 1e-10, see above): the start is 2x too wide, so SVI must gain
    assert after > before + 1e-3, (before, after)
    # the module reads the trained store values
    torch.testing.assert_close(guide.to_posterior().covariance(), cov1, rtol=0, atol=TOL)


# ------------------------------------------------------------------------------------------ Pyro API
def test_two_sites_of_different_shapes_median_quantiles_predictive_poutine():
    g = torch.Generator().manual_seed(2)
    X = torch.randn(25, 4, generator=g, dtype=D)
    y = X @ torch.tensor([0.5, -1.0, 0.2, 0.8], dtype=D) + 0.3 * torch.randn(25, generator=g, dtype=D)
    A = torch.randn(5, 5, generator=g, dtype=D)
    C = (A @ A.T + 5 * torch.eye(5, dtype=D)) / 50
    loc = torch.tensor([0.5, -1.0, 0.2, 0.8, math.log(0.3)], dtype=D)
    q = _attach(pcv.GaussianPosterior(loc, covariance=C), two_site_model, X, y=y)
    guide = q.as_guide(name_prefix="two")
    torch.testing.assert_close(pyro.param("two.loc").detach(), loc, rtol=0, atol=TOL)
    med = guide.median()
    torch.testing.assert_close(med["W"], loc[:4].reshape(2, 2), rtol=0, atol=TOL)
    assert float(med["sigma"]) == pytest.approx(0.3, abs=1e-12)
    qs = guide.quantiles([0.25, 0.75])
    z = float(dist.Normal(0.0, 1.0).icdf(torch.tensor(0.75)))
    assert float(qs["sigma"][1]) == pytest.approx(math.exp(loc[4] + z * C[4, 4].sqrt()), rel=1e-6)
    torch.testing.assert_close(qs["W"][0], (loc[:4] - z * C.diagonal()[:4].sqrt()).reshape(2, 2), rtol=1e-6, atol=0)
    pred = Predictive(two_site_model, guide=guide, num_samples=400)(X)
    assert pred["W"].shape[-2:] == (2, 2) and pred["W"].numel() == 400 * 4 and pred["y"].shape == (400, 25)
    torch.testing.assert_close(pred["W"].reshape(400, 2, 2).mean(0), loc[:4].reshape(2, 2), atol=0.1, rtol=0)
    assert bool((pred["sigma"] > 0).all())
    tr = poutine.trace(guide).get_trace(X, y=y)
    assert {n for n, s in tr.nodes.items() if s["type"] == "param"} == {"two.loc", "two.scale", "two.scale_tril"}
    assert tr.nodes["W"]["value"].shape == (2, 2) and float(tr.nodes["sigma"]["value"].detach()) > 0
    tr2 = poutine.trace(poutine.block(guide, hide_types=["param"])).get_trace(X, y=y)
    assert not any(s["type"] == "param" for s in tr2.nodes.values()) and "W" in tr2.nodes
    # the model runs under the guide's trace (observed y stays observed)
    mtr = poutine.trace(poutine.replay(two_site_model, trace=tr)).get_trace(X, y=y)
    assert mtr.nodes["y"]["is_observed"]


# ------------------------------------------------------------------------------------------ errors, fixed guide
def test_untrainable_forms_raise_at_construction(monkeypatch):
    X, y = _logreg_data()
    Q, _ = torch.linalg.qr(torch.randn(3, 2, dtype=D))
    lanczos = pcv.GaussianPosterior(torch.zeros(3, dtype=D), low_rank=(Q, torch.eye(2, dtype=D)))
    for kwargs in ({}, {"trainable": False}, {"form": "diagonal"}):
        with pytest.raises(ValueError, match="Lanczos.*not a proper distribution"):
            lanczos.as_guide(logreg, **kwargs)
    # matrix-free precision above the dense limit: names n and the alternatives
    q, C = _posterior("precision_operator", X, y)
    monkeypatch.setattr(posterior_module, "MAX_TRAINABLE_DENSE", 2)
    with pytest.raises(ValueError, match=r"n = 3 > MAX_TRAINABLE_DENSE = 2.*trainable=False.*form='diagonal'"):
        q.as_guide(logreg, model_args=(X,), model_kwargs={"y": y})
    fixed = q.as_guide(logreg, trainable=False, model_args=(X,), model_kwargs={"y": y})
    assert type(fixed) is GaussianPosteriorGuide
    mf = q.as_guide(logreg, form="diagonal", model_args=(X,), model_kwargs={"y": y})
    assert type(mf) is PosteriorDiagonalNormal
    torch.testing.assert_close(_store_loc_cov(AutoDiagonalNormal, "PosteriorDiagonalNormal")[1],
                               torch.diag(C.diagonal()), rtol=0, atol=TOL)
    # other misuse
    dense, _ = _posterior("covariance", X, y)
    with pytest.raises(ValueError, match="form='low_rank' needs a posterior of kind 'low_rank_diagonal'"):
        dense.as_guide(logreg, form="low_rank")
    with pytest.raises(ValueError, match="form: expected one of"):
        dense.as_guide(logreg, form="dense")
    with pytest.raises(ValueError, match="trainable=False gives the fixed"):
        dense.as_guide(logreg, trainable=False, form="full")
    with pytest.raises(ValueError, match="not positive definite"):
        pcv.GaussianPosterior(torch.zeros(2, dtype=D), covariance=torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=D)) \
            .as_guide(logreg)
    with pytest.raises(ValueError, match="positive marginal variances"):
        pcv.GaussianPosterior(torch.zeros(3, dtype=D), torch.tensor([1.0, 0.0, 1.0], dtype=D)).as_guide(logreg)
    with pytest.raises(ValueError, match="latent dimensions"):
        pcv.GaussianPosterior(torch.zeros(4, dtype=D), torch.ones(4, dtype=D)).as_guide(
            logreg, model_args=(X,), model_kwargs={"y": y})
    with pytest.raises(ValueError, match="needs the Pyro model"):
        dense.as_guide()
    with pytest.raises(ValueError, match="name_prefix"):
        dense.as_guide(logreg, name_prefix="")


def test_trainable_false_gives_the_fixed_guide():
    X, y = _logreg_data()
    q, C = _posterior("precision_operator", X, y)
    guide = _attach(q, logreg, X, y=y).as_guide(trainable=False)
    assert type(guide) is GaussianPosteriorGuide
    assert list(guide.parameters()) == []
    n = 1000
    pred = Predictive(logreg, guide=guide, num_samples=n)(X)
    assert len(pyro.get_param_store().keys()) == 0
    w = pred["w"].reshape(n, 3)
    torch.testing.assert_close(w.mean(0), q.loc, atol=4 * float(C.diagonal().max().sqrt()) / math.sqrt(n), rtol=0)
    mix = DiagMixturePosterior(torch.stack([q.loc, q.loc + 0.1]), torch.stack([C.diagonal()] * 2))
    fixed_mix = mix.as_guide(logreg, trainable=False, model_args=(X,), model_kwargs={"y": y})
    assert type(fixed_mix) is DiagMixtureGuide and list(fixed_mix.parameters()) == []


def test_fixed_guide_of_a_matrix_free_posterior_has_its_log_density():
    """``log_prob`` raised for a matrix-free posterior, so ``Trace_ELBO``/``poutine.trace(...).log_prob_sum()`` of
    its fixed guide (the documented guide of ``convex_relaxation`` results too large to train) failed."""
    X, y = _logreg_data()
    q, C = _posterior("precision_operator", X, y)
    guide = _attach(q, logreg, X, y=y).as_guide(trainable=False)
    tr = poutine.trace(guide).get_trace(X, y=y)
    w = tr.nodes["w"]["value"]
    exact = dist.MultivariateNormal(q.loc, covariance_matrix=C)
    assert float(tr.log_prob_sum()) == pytest.approx(float(exact.log_prob(w)), abs=1e-10)
    u = exact.sample((5,))
    torch.testing.assert_close(q.log_prob(u), exact.log_prob(u), rtol=0, atol=1e-10)
    # with the engine's own factor of A (C = precision_scale * A^{-1}), as convex_relaxation gives it
    A = q.precision_operator.to_dense()
    q_chol = pcv.GaussianPosterior(q.loc, q.variance, precision_operator=q.precision_operator,
                                   precision_factor=q.precision_factor, precision_scale=q.precision_scale,
                                   precision_cholesky=torch.linalg.cholesky(A))
    torch.testing.assert_close(q_chol.log_prob(u), exact.log_prob(u), rtol=0, atol=1e-10)
    elbo = -Trace_ELBO(num_particles=20000, vectorize_particles=True, max_plate_nesting=1).loss(
        _vectorised_logreg, guide, X, y=y)
    assert elbo == pytest.approx(_gh_elbo([q.loc], [C], X, y), abs=0.01)


def _vectorised_logreg(X, y=None):
    """:func:`logreg`, written to broadcast over a leading sample dimension of ``w``."""
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        return pyro.sample("y", dist.Bernoulli(logits=(X * w).sum(-1)), obs=y)


def test_as_guide_with_the_fitted_model_keeps_the_fitting_data_for_new_inputs():
    """``as_guide(model)`` with the fitted model itself was built at its first call: ``Predictive`` on new inputs
    (no ``y``) then built it with ``y`` latent, and refused ("cannot handle discrete sample site 'y'")."""
    X, y = _logreg_data()
    res = pcv.fit(logreg, X, y=y, engine="laplace", progress=False)
    X_new = X[:7] + 0.5
    pred = Predictive(logreg, guide=res.posterior.as_guide(logreg), num_samples=1000)(X_new)
    assert pred["y"].shape == (1000, 7)
    w = pred["w"].reshape(1000, 3)
    se = res.posterior.scale / math.sqrt(1000)
    assert float(((w.mean(0) - res.posterior.loc).abs() / se).max()) < 4.5


def _two_scalars(y=None):
    a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=D), 10.0))
    b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 0.01))
    with pyro.plate("data", 20):
        pyro.sample("y", dist.Normal(a + b, 1.0), obs=y)


def _two_scalars_reordered(y=None):
    """:func:`_two_scalars` with its sites sampled in the other order."""
    b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 0.01))
    a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=D), 10.0))
    with pyro.plate("data", 20):
        pyro.sample("y", dist.Normal(a + b, 1.0), obs=y)


@pytest.mark.parametrize("how", ["full", "diagonal", "fixed", "mixture", "fixed mixture"])
def test_a_model_with_other_sites_in_the_same_dimensions_is_refused(how):
    """Guides checked the model's latent dimension only: the same model with its two scalar sites in the other order
    got each other's posteriors (median of b 4.91, of a 5e-6)."""
    y = torch.randn(20, generator=torch.Generator().manual_seed(0), dtype=D) + 5.0
    q = pcv.fit(_two_scalars, y=y, engine="laplace", progress=False).posterior
    if "mixture" in how:
        q = DiagMixturePosterior(torch.stack([q.loc, q.loc]), torch.stack([q.variance, q.variance]), layout=q.layout)
    kw = {"trainable": False} if "fixed" in how else ({} if how == "mixture" else {"form": how})
    with pytest.raises(ValueError, match="latent site 0 of the model is 'b'.*posterior's is 'a'"):
        q.as_guide(_two_scalars_reordered, model_kwargs={"y": y}, **kw)
    guide = q.as_guide(_two_scalars, model_kwargs={"y": y}, **kw)
    assert float(guide.median()["a"]) == pytest.approx(float(q.loc[0]), abs=1e-9)


def _groups(grp, y=None):
    """Random intercepts whose number of groups is read from the data."""
    a = pyro.sample("a", dist.Normal(torch.zeros(int(grp.max()) + 1, dtype=D), 1.0).to_event(1))
    with pyro.plate("data", grp.shape[0]):
        pyro.sample("y", dist.Normal(a[grp], 0.5), obs=y)


def test_guides_name_the_site_whose_size_differs_and_keep_fitting_keywords_apart():
    """A model with another number of groups was refused without a site ('6 latent dimensions but ... 5'); new
    positional data clashing with the fitting keyword data failed inside the model's call; DualVG refitted on data
    of another latent size ran the whole fit, then misstated the sizes."""
    grp3 = torch.arange(12) % 3
    y = torch.randn(12, generator=torch.Generator().manual_seed(1), dtype=D)
    res = pcv.fit(_groups, grp3, y=y, engine="dual_vg", progress=False)
    with pytest.raises(ValueError, match=r"latent site 0 of the model is 'a' \(4 unconstrained coordinates\) but the "
                                         r"posterior's is 'a' \(3\)"):
        res.posterior.as_guide(model_args=(torch.arange(12) % 4,), model_kwargs={"y": y})
    with pytest.raises(ValueError, match=r"model_args: .* fitting keyword arguments \['y'\].*pass model_kwargs"):
        res.posterior.as_guide(model_args=(grp3, y))
    guide = res.posterior.as_guide(model_args=(grp3, y), model_kwargs={})
    torch.testing.assert_close(guide.median()["a"], res.posterior.loc, rtol=0, atol=TOL)
    dvg = pcv.DualVG(_groups)
    dvg.fit(grp3, y=y)
    first = dvg.result
    with pytest.raises(ValueError, match=r"built for 3 latent dimensions .* give the model 4.*new DualVG"):
        dvg.fit(torch.arange(12) % 4, y=y)
    assert dvg.result is first


# ------------------------------------------------------------------------------------------ mixtures
def test_diag_mixture_as_guide_store_stale_svi_and_predictive():
    X, y = _logreg_data()
    m, C = _laplace(X, y)
    locs = torch.stack([m - 0.3, m + 0.3])
    variances = torch.stack([2 * C.diagonal(), 1.5 * C.diagonal()])
    q = _attach(DiagMixturePosterior(locs, variances), logreg, X, y=y)
    pyro.param("AutoDiagMixture.locs", torch.zeros(2, 3, dtype=D))
    pyro.param("AutoDiagMixture.scales", torch.ones(2, 3, dtype=D), constraint=dist.constraints.positive)
    pyro.param("unrelated", torch.ones(2, dtype=D))
    guide = q.as_guide()
    assert type(guide) is AutoDiagMixture and guide.num_components == 2
    torch.testing.assert_close(pyro.param("AutoDiagMixture.locs").detach(), locs, rtol=0, atol=TOL)
    torch.testing.assert_close(pyro.param("AutoDiagMixture.scales").detach() ** 2, variances, rtol=0, atol=TOL)
    assert torch.equal(pyro.param("unrelated").detach(), torch.ones(2, dtype=D))
    pred = Predictive(logreg, guide=guide, num_samples=20)(X)
    assert pred["y"].shape == (20, 40)

    def current():
        L = pyro.param("AutoDiagMixture.locs").detach().clone()  # a copy: SVI updates the store in place
        S = pyro.param("AutoDiagMixture.scales").detach() ** 2
        return L, S

    L0, S0 = current()
    torch.testing.assert_close(L0, locs, rtol=0, atol=TOL)  # the guide call did not bring stale values back
    before = _gh_elbo(list(L0), [torch.diag(s) for s in S0], X, y)
    _svi_steps(guide)
    L1, S1 = current()
    assert float((L1 - L0).abs().max()) > 1e-3
    after = _gh_elbo(list(L1), [torch.diag(s) for s in S1], X, y)
    assert after > before + 1e-3, (before, after)
    back = guide.to_posterior()
    torch.testing.assert_close(back.locs, L1, rtol=0, atol=TOL)
    torch.testing.assert_close(back.variances, S1, rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="num_components"):
        AutoDiagMixture(logreg, num_components=3, posterior=q)


# ------------------------------------------------------------------------------------------ DualVG
def test_dual_vg_fit_writes_its_optimum_into_the_param_store():
    X, y = _logreg_data()
    guide = pcv.DualVG(logreg)
    _stale_entries(AutoMultivariateNormal, "DualVG")
    pyro.param("unrelated", torch.ones(2, dtype=D))
    res = guide.fit(X, y=y)
    loc, cov = _store_loc_cov(AutoMultivariateNormal, "DualVG")
    torch.testing.assert_close(loc, res.posterior.loc, rtol=0, atol=TOL)
    torch.testing.assert_close(cov, res.posterior.covariance(), rtol=0, atol=TOL)
    guide(X, y=y)  # a call reads the fitted values, not the stale ones
    torch.testing.assert_close(guide.median()["w"], res.posterior.loc, rtol=0, atol=TOL)
    torch.testing.assert_close(_store_loc_cov(AutoMultivariateNormal, "DualVG")[0], res.posterior.loc, rtol=0, atol=TOL)
    assert torch.equal(pyro.param("unrelated").detach(), torch.ones(2, dtype=D))
    # SVI moves the store; a refit on new data writes the new optimum over it
    svi = SVI(logreg, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(5):
        svi.step(X, y=y)
    assert float((pyro.param("DualVG.loc").detach() - res.posterior.loc).abs().max()) > 1e-3
    res2 = guide.fit(X[:30], y=y[:30])
    loc2, cov2 = _store_loc_cov(AutoMultivariateNormal, "DualVG")
    torch.testing.assert_close(loc2, res2.posterior.loc, rtol=0, atol=TOL)
    torch.testing.assert_close(cov2, res2.posterior.covariance(), rtol=0, atol=TOL)
    guide(X[:30], y=y[:30])
    torch.testing.assert_close(pyro.param("DualVG.loc").detach(), res2.posterior.loc, rtol=0, atol=TOL)


# ------------------------------------------------------------------------------------------ a restored param store
def _shifted_state(shift):
    """The param store's state with every ``*.loc``/``*.locs`` entry moved by ``shift`` (a saved, trained store)."""
    state = copy.deepcopy(pyro.get_param_store().get_state())
    for k in state["params"]:
        if k.endswith(".loc") or k.endswith(".locs"):
            state["params"][k] = state["params"][k].detach() + shift
    return state


@pytest.mark.parametrize("kind", KINDS + ["mixture", "dual_vg"])
def test_a_restored_param_store_is_what_the_guide_samples_and_trains(kind):
    """``loc`` (``locs``, ``cov_factor``) was a plain ``nn.Parameter``, which a PyroModule reads from itself while the
    ``pyro.param`` site it records holds the store's entry: after ``get_param_store().set_state()`` of a saved store
    the guide drew from its old ``loc`` with the restored ``scale``/``scale_tril`` (``Predictive`` means 65 to 94
    standard errors from the restored ``loc``, trace log densities up to 1.9 nats off), ``median()`` gave the old
    ``loc`` and SVI never moved ``loc`` (by 0.0: its recorded param got no gradient)."""
    X, y = _logreg_data()
    if kind == "mixture":
        m, C = _laplace(X, y)
        q = _attach(DiagMixturePosterior(torch.stack([m - 0.3, m + 0.3]), torch.stack([C.diagonal()] * 2)),
                    logreg, X, y=y)
        guide, prefix = q.as_guide(), "AutoDiagMixture"
    elif kind == "dual_vg":
        guide, prefix = pcv.DualVG(logreg), "DualVG"
        guide.fit(X, y=y)
    else:
        q, _ = _posterior(kind, X, y)
        guide = _attach(q, logreg, X, y=y).as_guide()
        prefix = type(guide).__name__
    shift = torch.tensor([0.5, -0.25, 0.125], dtype=D)
    pyro.get_param_store().set_state(_shifted_state(shift))
    # the independent reference: the restored store's raw entries with Pyro's parametrisation
    if kind == "mixture":
        locs = pyro.param("AutoDiagMixture.locs").detach().clone()
        scales = pyro.param("AutoDiagMixture.scales").detach()
        reference = dist.MixtureSameFamily(dist.Categorical(logits=torch.zeros(2, dtype=D)),
                                           dist.Normal(locs, scales).to_event(1))
        loc = reference.mean
        torch.testing.assert_close(guide.median()["w"], guide.quantiles([0.5])["w"][0], rtol=0, atol=0)
        med = guide.median()["w"]
        torch.testing.assert_close(dist.Normal(locs, scales).cdf(med).mean(0), torch.full((3,), 0.5, dtype=D),
                                   rtol=0, atol=1e-9)  # the marginal medians of the restored mixture
    else:
        base = AutoMultivariateNormal if kind == "dual_vg" else PYRO_BASE[kind]
        loc, cov = _store_loc_cov(base, prefix)
        reference = dist.MultivariateNormal(loc, covariance_matrix=cov)
        torch.testing.assert_close(guide.median()["w"], loc, rtol=0, atol=TOL)
        torch.testing.assert_close(guide.quantiles([0.9])["w"][0],
                                   loc + 1.2815515655446004 * cov.diagonal().sqrt(), rtol=0, atol=1e-9)
    tr = poutine.trace(guide).get_trace(X, y=y)
    tr.compute_log_prob()
    latent = tr.nodes[f"_{prefix}_latent"]
    assert float(latent["log_prob_sum"].detach()) == pytest.approx(float(reference.log_prob(latent["value"].detach())),
                                                          abs=1e-10)
    n = 4000
    w = Predictive(logreg, guide=guide, num_samples=n)(X)["w"].reshape(n, 3)
    se = reference.variance.sqrt() / math.sqrt(n)
    assert float(((w.mean(0) - loc).abs() / se).max()) < 4.5
    # SVI trains the restored values, and the guide reports what it trained
    before = pyro.param(f"{prefix}.{'locs' if kind == 'mixture' else 'loc'}").detach().clone()
    _svi_steps(guide, steps=10, lr=0.02)
    after = pyro.param(f"{prefix}.{'locs' if kind == 'mixture' else 'loc'}").detach()
    assert float((after - before).abs().max()) > 0.05
    if kind == "mixture":
        torch.testing.assert_close(guide.to_posterior().locs, after, rtol=0, atol=0)
    elif kind == "dual_vg":
        torch.testing.assert_close(guide.median()["w"], after, rtol=0, atol=0)
    else:
        torch.testing.assert_close(guide.to_posterior().loc, after, rtol=0, atol=0)


class _LinearRegression:
    """A model written as a method: ``w ~ N(0, I)``, ``y ~ N(X w, 0.5^2)`` (vectorisable over draws of ``w``)."""

    noise = 0.5

    def model(self, X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            return pyro.sample("y", dist.Normal((X * w.unsqueeze(-2)).sum(-1), self.noise), obs=y)


@pytest.mark.parametrize("trainable", [True, False])
def test_a_method_model_is_recognised_as_the_fitted_model(trainable):
    """``as_guide(obj.model)`` compared the model by identity, and every ``obj.model`` is a new bound-method object:
    the guide was built at its first call, and ``Predictive`` on new inputs (no ``y``) refused with "the model has 12
    latent dimensions but the posterior has 3". The draws must follow the exact conjugate posterior."""
    X, _ = _logreg_data()
    y = X @ torch.tensor([1.0, -1.0, 0.5], dtype=D) + 0.5 * torch.randn(40, generator=torch.Generator().manual_seed(3),
                                                                       dtype=D)
    obj = _LinearRegression()
    res = pcv.fit(obj.model, X, y=y, engine="laplace", progress=False)
    precision = torch.eye(3, dtype=D) + X.T @ X / obj.noise**2  # the closed-form posterior
    cov = torch.linalg.inv(precision)
    mean = cov @ (X.T @ y) / obj.noise**2
    guide = res.posterior.as_guide(obj.model, trainable=trainable)
    assert guide.prototype_trace is not None  # built now, with the fitting data
    n = 4000
    pred = Predictive(obj.model, guide=guide, num_samples=n, parallel=True)(X[:9] + 0.5)
    assert pred["y"].shape == (n, 9)
    w = pred["w"].reshape(n, 3)
    assert float(((w.mean(0) - mean).abs() / (cov.diagonal().sqrt() / math.sqrt(n))).max()) < 4.5
    torch.testing.assert_close(torch.cov(w.T), cov, rtol=0, atol=6 * float(cov.diagonal().max()) / math.sqrt(n))
    # without the fitting data, the observed site that became latent is named
    pyro.clear_param_store()
    with pytest.raises(ValueError, match=r"latent site\(s\) \['y'\] of the model are not in the posterior.*model_args"):
        Predictive(obj.model, guide=res.compact().posterior.as_guide(trainable=trainable), num_samples=5)(X[:9])


def test_a_guide_whose_shared_names_another_model_took_says_so():
    """Two guides of the default name share their param-store entries (as Pyro's autoguides do): after a guide of
    another size wrote them, the first one raised a bare, empty AssertionError from inside Pyro."""
    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            return pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    pyro.clear_param_store()
    X, y = _logreg_data()
    g1 = pcv.fit(model, X, y=y, engine="dual_vg", progress=False).posterior.as_guide()
    Predictive(model, guide=g1, num_samples=5)(X)
    X4 = torch.cat([X, X[:, :1] ** 2], 1)
    pcv.fit(model, X4, y=y, engine="dual_vg", progress=False).posterior.as_guide()(X4)
    with pytest.raises(ValueError, match=r"guide 'PosteriorMultivariateNormal': its parameters .* hold 4 latent "
                                         r"coordinates, the model has 3.*name_prefix"):
        Predictive(model, guide=g1, num_samples=5)(X)
    pyro.clear_param_store()


@pytest.mark.parametrize("posterior", ["gaussian", "mixture"])
def test_fixed_guides_draw_in_the_models_dtype(posterior):
    """A fixed guide (trainable=False) of a float64 posterior, used with float32 data, draws float32 values, as the
    trainable guides do (it handed the model float64 values and the model failed inside torch), with the same
    median."""
    D = torch.float64
    X = torch.randn(30, 3, generator=torch.Generator().manual_seed(0), dtype=D)
    y = X @ torch.tensor([1.0, -0.5, 0.3], dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            return pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    q = pcv.fit(model, X, y=y, engine="dual_vg", progress=False).posterior
    if posterior == "mixture":
        q = DiagMixturePosterior(torch.stack([q.loc, q.loc + 0.1]), torch.stack([q.variance, q.variance]),
                                 layout=q.layout, model=q.model, model_args=q.model_args)
    pyro.clear_param_store()
    g = q.as_guide(model, trainable=False, model_args=(X.float(),), model_kwargs={"y": y.float()})
    assert isinstance(g, (GaussianPosteriorGuide, DiagMixtureGuide))
    out = Predictive(model, guide=g, num_samples=5)(X.float())
    assert out["w"].dtype == torch.float32 and out["y"].dtype == torch.float32
    torch.testing.assert_close(g.median()["w"], q.as_guide(model, trainable=False).median()["w"].float(), rtol=1e-6,
                               atol=1e-6)


def _pickled_model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        return pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def _pickled_model_wrapper(X, y=None):
    return _pickled_model(X, y)


@pytest.mark.parametrize("make", ["dual_vg", "as_guide"])
def test_pickling_a_guide_keeps_the_originals_model_and_the_copy_says_what_it_lacks(make):
    """Pyro's AutoGuide.__getstate__ set the guide's own model to None, so after pickle.dumps (or pickling the
    result of DualVG.fit, which holds the guide) the original's next fit failed with a bare TypeError.  The
    original keeps its model; the unpickled copy samples, and building or fitting it names what is missing."""
    import pickle

    from pyro_convexvb.infer.dual_vg import DualVG

    X = torch.randn(20, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model = _pickled_model
    pyro.clear_param_store()
    if make == "dual_vg":
        guide = DualVG(model)
        res = guide.fit(X, y=X.sum(1))
        pickle.dumps(res)  # the result holds the guide
        copy_ = pickle.loads(pickle.dumps(guide))
        assert guide.fit(X, y=X.sum(1)).converged
        with pytest.raises(RuntimeError, match="pickled or deep-copied.*needs the model"):
            copy_.fit(X, y=X.sum(1))
    else:
        q = pcv.fit(model, X, y=X.sum(1), engine="dual_vg", progress=False).posterior

        guide = q.as_guide(_pickled_model_wrapper)  # another model object: built lazily, at its first call
        copy_ = pickle.loads(pickle.dumps(guide))
        assert guide(X, y=X.sum(1))["w"].shape == (2,)
        with pytest.raises(RuntimeError, match="pickled or deep-copied.*needs the model"):
            copy_(X, y=X.sum(1))
    built = pickle.loads(pickle.dumps(guide))  # built before pickling: the copy samples
    assert Predictive(model, guide=built, num_samples=3)(X)["w"].shape == (3, 1, 2)  # as AutoMultivariateNormal
