"""Importance diagnostics and corrections of models with linearly constrained fields (intrinsic GMRFs with
sum-to-zero or trend constraints): the proposals work in the fields' free coordinates
(:mod:`pyro_convexvb.diagnostics.constrained`), with the log joint's area factor, so evidence estimates keep
every constant. References: exact Gaussian posteriors and evidences, quadrature over a hyper-latent, and the
model zoo's long NUTS run of a BYM model."""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.diagnostics.constrained import FreeCoordinates, proposal_posterior
from pyro_convexvb.lgm.layout import LatentLayout
from tests.zoo.harness import load_references, run_corrected_cell
from tests.zoo.models import ZOO

D = torch.float64


def _fit(model, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pcv.fit(model, *args, engine="dual_vg", progress=False, **kwargs)


def test_free_coordinates_map_onto_the_constraints_and_back_with_the_area_factor():
    """An RW2 field (constant and linear trend constraints, k = 2) and a plain site: the free vector maps onto the
    constraint subspace one to one, and the log Jacobian is log sqrt(det(G^T G)) of the map's matrix G."""
    m = 7
    t = torch.arange(m, dtype=D)
    C = torch.stack([torch.ones(m, dtype=D), t])
    loc = torch.linspace(-1.0, 2.0, m, dtype=D)
    d = pcv.distributions.SparseGMRF(loc, pcv.distributions.rw_precision(m, order=2), constraints=C)
    layout = LatentLayout.from_shapes([("b", (2,)), ("x", (m,))])
    free = FreeCoordinates(layout, {"x": (d.constraint_factor, d.loc)})
    assert free.size == 2 + m - 2 and free.mapped == {"x"}
    u = torch.randn(5, free.size, dtype=D, generator=torch.Generator().manual_seed(0))
    values = free.unflatten(u)
    assert torch.equal(values["b"], u[:, :2])
    assert float(((values["x"] - loc) @ C.T).abs().max()) < 1e-12
    assert torch.allclose(free.flatten(values), u, atol=1e-12, rtol=0)
    # the area factor: G = d x / d w column by column
    G = torch.stack([free.unflatten(e, shift=False)["x"] for e in torch.eye(free.size, dtype=D)[2:]], 1)
    assert free.log_jacobian == pytest.approx(0.5 * float(torch.logdet(G.T @ G)), abs=1e-12)
    # a constrained draw of the model's own distribution is reproduced from its free coordinates
    x = d.sample((3,))
    assert torch.allclose(free.unflatten(free.flatten({"b": torch.zeros(3, 2, dtype=D), "x": x}))["x"], x, atol=1e-10)


def test_rw1_trend_gives_the_exact_evidence_and_posterior():
    """Gaussian observations of an intercept plus an intrinsic RW1 trend: dual_vg's posterior is exact, so the
    importance weights are flat, the evidence estimate is the exact log p(y) (constants and the area factor
    included), and the corrected moments are the exact ones up to their Monte Carlo errors."""
    model, args, kwargs = ZOO["rw1_intrinsic"].builder()
    res = _fit(model, *args, **kwargs)
    y = kwargs["y"]
    n = y.shape[0]
    Q = pcv.distributions.rw_precision(n)
    c = pcv.distributions.bym2_scaling(Q)
    S = 9.0 * torch.ones(n, n, dtype=D) + torch.linalg.pinv(4.0 * c * Q.to_dense()) + 0.16 * torch.eye(n, dtype=D)
    exact = float(torch.distributions.MultivariateNormal(torch.zeros(n, dtype=D), S).log_prob(y))
    d = res.diagnostics
    assert d.reliable and d.ess == pytest.approx(d.num_draws, rel=1e-9)
    assert d.log_evidence == pytest.approx(exact, abs=1e-8)
    ref = load_references()["rw1_intrinsic"]["sites"]
    corr = res.corrected(2000)
    for name in ("b0", "x"):
        got = corr.sites[name]
        m_ref = torch.as_tensor(ref[name]["mean"], dtype=D).reshape(got["mean"].shape)
        s_ref = torch.as_tensor(ref[name]["sd"], dtype=D).reshape(got["sd"].shape)
        assert bool(((got["mean"] - m_ref).abs() <= 4 * got["mean_mcse"] + 1e-8).all())
        assert bool(((got["sd"] - s_ref).abs() <= 4 * got["sd_mcse"] + 1e-8).all())
    assert float(corr.sites["x"]["mean"].sum().abs()) < 1e-10  # every draw satisfies the constraint
    # flat weights: the field's control variates (its conditional moments through the free-coordinate map) return
    # the proposal's, here the exact posterior's, moments whatever the draws
    got = corr.sites["x"]
    s_ref = torch.as_tensor(ref["x"]["sd"], dtype=D)
    assert float(((got["mean"] - torch.as_tensor(ref["x"]["mean"], dtype=D)).abs() / s_ref).max()) < 1e-6
    assert float(((got["sd"] - s_ref).abs() / s_ref).max()) < 1e-6
    assert float((got["mean_mcse"] / s_ref).max()) < 1e-6


def test_hyper_latent_precision_of_an_rw1_trend_against_quadrature():
    """The RW1 trend's precision scale ``tau ~ Gamma`` integrated over: the evidence estimate and the corrected
    quantiles of ``tau`` against quadrature over ``log tau`` of the exact Gaussian marginal likelihood."""
    n = 12
    g = torch.Generator().manual_seed(143)
    y = 0.5 + torch.sin(torch.arange(n, dtype=D) / 2) + 0.4 * torch.randn(n, generator=g, dtype=D)
    Q = pcv.distributions.rw_precision(n)
    c = pcv.distributions.bym2_scaling(Q)
    prior = dist.Gamma(torch.tensor(2.0, dtype=D), 0.5)

    def model(y=None):
        b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 3.0))
        tau = pyro.sample("tau", prior)
        x = pyro.sample("x", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Q, tau * c,
                                                          constraints="sum_to_zero"))
        pyro.sample("y", dist.Normal(b0 + x, 0.4).to_event(1), obs=y)

    Qp = torch.linalg.pinv(Q.to_dense())
    lt = torch.linspace(-6.0, 8.0, 4001, dtype=D)
    base = 9.0 * torch.ones(n, n, dtype=D) + 0.16 * torch.eye(n, dtype=D)
    S = base + Qp / (c * torch.exp(lt))[:, None, None]
    lp = torch.distributions.MultivariateNormal(torch.zeros(n, dtype=D), S).log_prob(y) + prior.log_prob(lt.exp()) + lt
    h = float(lt[1] - lt[0])
    log_z = float(torch.logsumexp(lp, 0)) + math.log(h)
    cdf = torch.cumsum(torch.exp(lp - log_z) * h, 0)
    res = _fit(model, y=y)
    assert isinstance(proposal_posterior(res).layout, FreeCoordinates)
    corr = res.corrected(2000)
    assert corr.diagnostics.reliable
    assert corr.diagnostics.log_evidence == pytest.approx(log_z, abs=0.01)
    for p, q in corr.hyper["tau"]["quantiles"].items():
        exact = float(torch.exp(lt[torch.searchsorted(cdf, torch.tensor(p, dtype=D))]))
        assert float(q) == pytest.approx(exact, abs=4 * float(corr.hyper["tau"]["quantile_mcse"][p]) + 0.01 * exact)


def test_bym_corrected_marginals_meet_the_targets_against_nuts():
    """The zoo's BYM model (intrinsic CAR field with sum-to-zero, iid effects, Poisson counts): corrected
    marginals within 0.1 reference sds in mean and 10% in sd of the long NUTS reference, k_hat reliable."""
    cell = run_corrected_cell("bym_icar", "dual_vg")
    assert cell.status == "fit", cell.error
    assert cell.details["k_hat"] < 0.7
    assert cell.mean_err < 0.1 and cell.sd_err < 0.1


def test_loo_of_an_rw1_trend_is_the_exact_leave_one_out_density():
    """PSIS-LOO from the constrained field's draws against the exact leave-one-out predictive densities of a
    Gaussian model (y ~ N(0, S): y_i | y_-i is normal with variance 1 / (S^-1)_ii)."""
    _, _, kwargs = ZOO["rw1_intrinsic"].builder()
    y = kwargs["y"]
    TAU = 40.0  # a smooth trend: every observation's leave-one-out k_hat below 0.7
    n = y.shape[0]
    Q = pcv.distributions.rw_precision(n)
    c = pcv.distributions.bym2_scaling(Q)

    def model(y=None):  # the zoo model with one observation per time point
        b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 3.0))
        x = pyro.sample("x", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Q, torch.tensor(TAU * c, dtype=D),
                                                          constraints="sum_to_zero"))
        with pyro.plate("time", n):
            pyro.sample("y", dist.Normal(b0 + x, 0.4), obs=y)

    res = _fit(model, y=y)
    S = 9.0 * torch.ones(n, n, dtype=D) + torch.linalg.pinv(TAU * c * Q.to_dense()) + 0.16 * torch.eye(n, dtype=D)
    P = torch.linalg.inv(S)
    var = 1.0 / P.diagonal()
    mu = y - (P @ y) * var
    exact = dist.Normal(mu, var.sqrt()).log_prob(y)
    r = res.loo(num_draws=4000)
    assert r.pareto_k.shape == (n,) and float(r.pareto_k.max()) < 0.7
    # PSIS-LOO's own error at k_hat ~ 0.5 (4000 draws): 0.054 at most per observation, 0.062 in the sum
    assert np.allclose(r.elpd_i, exact.numpy(), atol=0.1)
    assert r.elpd_loo == pytest.approx(float(exact.sum()), abs=0.15)


def test_resampled_draws_of_a_corrected_constrained_field_satisfy_the_constraint():
    model, args, kwargs = ZOO["bym_icar"].builder()
    res = _fit(model, *args, **kwargs)
    draws = res.corrected(400).resample(300, seed=1)
    assert draws["s"].shape == (300, 16) and float(draws["s"].sum(-1).abs().max()) < 1e-10


def test_a_singular_posterior_that_is_not_a_constrained_site_is_refused():
    """A Gaussian posterior whose covariance is singular for another reason has no density to weigh by: the
    diagnostics say so (no factorisation error)."""
    def model(y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(w.sum(), 1.0), obs=y)

    res = _fit(model, y=torch.tensor(0.3, dtype=D))
    post = res.posterior
    v = torch.ones(3, dtype=D) / math.sqrt(3.0)
    P = torch.eye(3, dtype=D) - torch.outer(v, v)
    singular = pcv.GaussianPosterior(post.loc, covariance=P @ post.covariance() @ P, layout=post.layout,
                                     model=post.model, model_args=post.model_args)
    res.posterior = singular
    with pytest.raises(NotImplementedError, match=r"singular in 1 direction\(s\) \(sites 'w'\)"):
        res.diagnostics


def test_constrained_field_controls_against_dense_conditional_moments():
    """The controls of a constrained field: its conditional mean and variances given a draw's class and scales,
    ``loc + G E[w]`` and ``diag(G diag(s) C diag(s) G^T)``, against dense products with the map's matrix G."""
    from pyro_convexvb.diagnostics.proposals import FieldCovariance, _mapped_controls

    m = 6
    d = pcv.distributions.SparseGMRF(torch.linspace(0.0, 1.0, m, dtype=D), pcv.distributions.rw_precision(m),
                                     constraints="sum_to_zero")
    layout = LatentLayout.from_shapes([("b", (2,)), ("x", (m,))])
    free = FreeCoordinates(layout, {"x": (d.constraint_factor, d.loc)})
    rng = np.random.default_rng(3)
    S, n = 7, free.size
    covs = []
    for _ in range(2):
        A = rng.normal(size=(n, n))
        covs.append(A @ A.T + 0.1 * np.eye(n))
    cls = rng.integers(0, 2, size=S)
    scale = np.exp(0.3 * rng.normal(size=(S, n)))
    loc = rng.normal(size=(S, n))
    fc = FieldCovariance(cls, scale, [lambda sl, C=C: C[sl, sl] for C in covs])
    sl = free["x"].slice
    ctl = _mapped_controls(free.constrained["x"], loc, np.full(S, np.inf), fc, sl)
    G = torch.stack([free.unflatten(e, shift=False)["x"] for e in torch.eye(n, dtype=D)[sl]], 1).numpy()
    for s in range(S):
        Cs = (np.diag(scale[s]) @ covs[cls[s]] @ np.diag(scale[s]))[sl, sl]
        np.testing.assert_allclose(ctl.loc[s], d.loc.numpy() + G @ loc[s, sl], atol=1e-12)
        np.testing.assert_allclose(ctl.sd[s] ** 2, np.diag(G @ Cs @ G.T), rtol=1e-10)
    # one class, no scales: the same variances for every draw; unknown covariances: no controls
    one = _mapped_controls(free.constrained["x"], loc, np.full(S, np.inf),
                           FieldCovariance(np.zeros(S, dtype=np.int64), None, [lambda sl: covs[0][sl, sl]]), sl)
    np.testing.assert_allclose(one.sd ** 2, np.broadcast_to(np.diag(G @ covs[0][sl, sl] @ G.T), (S, m)), rtol=1e-10)
    assert _mapped_controls(free.constrained["x"], loc, np.full(S, np.inf), None, sl) is None
    # pooled rounds (one without scales): the classes renumbered, the scales read per row without copies
    rounds = [FieldCovariance(np.array([0, 0, 0]), None, [lambda sl: covs[1][sl, sl]]), fc]
    pooled = FieldCovariance.pool(rounds, [3, S], n)
    assert pooled.cls.tolist() == [0, 0, 0] + (cls + 1).tolist()
    np.testing.assert_array_equal(pooled.scale[np.arange(3 + S)], np.concatenate([np.ones((3, n)), scale]))
    np.testing.assert_array_equal(pooled.scale[4], scale[1])
    np.testing.assert_array_equal(pooled.matrix(0), covs[1])
    np.testing.assert_array_equal(pooled.matrix(int(pooled.cls[5])), covs[cls[2]])
    np.testing.assert_array_equal(pooled.matrix(int(pooled.cls[5]), sl), covs[cls[2]][sl, sl])
    assert FieldCovariance.pool([rounds[0], None], [3, S], n) is None
    assert FieldCovariance.pool([rounds[0], rounds[0]], [3, 3], n).scale is None
