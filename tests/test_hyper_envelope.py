"""Envelope gradients of the hyper-latents' objective (``HyperObjective.gradient``): the bound at the fitted dual state
differentiated through a graph-keeping extraction, against central differences of refitted bounds (float64); the
graph-keeping extraction of a scaled ``SparseGMRF`` prior; the fallback to differences where the envelope does not
apply."""
import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.infer import hyper as hyper_mod
from pyro_convexvb.lgm.extract import lgm_from_pyro

D = torch.float64


def _lattice(m):
    n = m * m
    idx = torch.arange(n).reshape(m, m)
    W = torch.zeros(n, n, dtype=D)
    for a, b in ((idx[:, :-1], idx[:, 1:]), (idx[:-1, :], idx[1:, :])):
        W[a.reshape(-1), b.reshape(-1)] = 1.0
        W[b.reshape(-1), a.reshape(-1)] = 1.0
    return (torch.diag(W.sum(1)) - 0.9 * W).to_sparse_csr()


def _bym(m=4, seed=0):
    """A small BYM model: proper CAR field of precision ``kappa Q0`` plus iid effects of scale ``sigma``, Poisson
    counts (every local bound exact, so the dual's state maximises the reported bound)."""
    Q0 = _lattice(m)
    g = torch.Generator().manual_seed(seed)
    n = m * m
    E = 3.0 + 5.0 * torch.rand(n, generator=g, dtype=D)
    y = torch.poisson(E * torch.exp(0.4 * torch.randn(n, generator=g, dtype=D)), generator=g)

    def model(E, y=None):
        kappa = pyro.sample("kappa", dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)))
        sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(0.5, dtype=D)))
        phi = pyro.sample("phi", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Q0, precision_scale=kappa))
        v = pyro.sample("v", dist.Normal(torch.zeros(n, dtype=D), sigma).to_event(1))
        with pyro.plate("areas", n):
            pyro.sample("y", dist.Poisson(E * torch.exp(phi + v)), obs=y)

    return model, (E,), {"y": y}


def _hyper_objective(model, args, kwargs):
    from pyro_convexvb.infer.registry import get_engine

    names = hyper_mod.find_hyper_sites(model, args, kwargs)
    space = hyper_mod.theta_space(model, args, kwargs, names)
    engine = get_engine("dual_vg")(model, progress=False)
    return hyper_mod.HyperObjective(engine, space, args, kwargs)


def test_scaled_gmrf_prior_keeps_its_graph():
    """``E_q log p(phi | kappa)`` of a graph-keeping extraction differentiates in ``kappa`` as its central difference
    (the scaled precision's values carried no graph: only ``log|kappa Q0|`` did, so the derivative was ``n / 2``)."""
    Q0 = _lattice(3)
    n = 9
    loc = torch.linspace(-0.5, 0.5, n, dtype=D)
    V = 0.1 * torch.eye(n, dtype=D) + 0.02

    def elp(kappa, keep_graph):
        def model():
            pyro.sample("phi", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Q0, precision_scale=kappa))
        return lgm_from_pyro(model, keep_graph=keep_graph).expected_log_prior(loc, V)

    k = torch.tensor(1.7, dtype=D, requires_grad=True)
    (g,) = torch.autograd.grad(elp(k, True), k)
    h = 1e-5
    with torch.no_grad():
        fd = (float(elp(torch.tensor(1.7 + h, dtype=D), False)) - float(elp(torch.tensor(1.7 - h, dtype=D), False))) \
            / (2 * h)
    assert abs(float(g) - fd) < 1e-7 * (1 + abs(fd)), (float(g), fd, n / 2 / 1.7)
    assert abs(fd - n / 2 / 1.7) > 0.1  # the old answer is far off


@pytest.mark.parametrize("z", [(0.3, -1.2), (1.0, -0.4)])
def test_envelope_gradient_matches_central_differences_of_refitted_bounds(z):
    """``df/dz`` of ``log p(theta) + log|J| + B(theta)`` by the envelope theorem equals central differences of fits
    (each refitted to a duality gap of 1e-9) to 1e-5; no fit beyond the one at ``z``."""
    model, args, kwargs = _bym()
    obj = _hyper_objective(model, args, kwargs)
    z = torch.tensor(z, dtype=D)
    g = obj._envelope_gradient(z)
    assert g is not None and obj.fits == 1
    fd = hyper_mod._grad_fd(obj, z, 1e-4)
    assert torch.allclose(g, fd, rtol=0, atol=1e-5 * (1 + float(fd.abs().max()))), (g, fd)
    assert float(g.abs().min()) > 1e-2  # a real check: the gradient is not near zero


def test_integration_uses_envelope_gradients_and_matches_differenced_mode():
    """The integration's mode search takes envelope gradients (checked once against a difference) and finds the mode
    that central differences find, within the gradient tolerance's step; fewer fits."""
    model, args, kwargs = _bym()
    res = pcv.fit(model, *args, engine="dual_vg", options={"hyper": "map"}, progress=False, **kwargs)
    grads = res.info["hyper_details"]["gradients"]
    assert grads["envelope_ok"] is True and grads["envelope"] > 0 and grads["differences"] == 0
    obj = _hyper_objective(model, args, kwargs)
    z0 = hyper_mod._initial_z(model, args, kwargs, obj.space)
    z_fd, _, _ = hyper_mod.find_mode(obj, z0, gtol=1e-3)  # central differences (the former search)
    z_env = res.info["hyper_details"]["mode_z"]
    H = -hyper_mod._hessian_fd(obj, z_fd, 2e-2)
    # both stop at max |grad| <= 1e-3: their modes differ by at most about H^-1 times that
    assert float((z_env - z_fd).abs().max()) < 4e-3 * float(torch.linalg.inv(H).abs().max()) + 1e-6
    assert res.info["hyper_details"]["mode_grad_norm"] <= 1e-3


def test_a_design_scaled_by_a_hyper_latent_falls_back_to_differences():
    """A hyper-latent that scales the design (``X @ w * s``: extraction detaches designs, so the graph misses it) makes
    the first envelope gradient disagree with its check; every gradient is then differenced, and the mode is right."""
    g = torch.Generator().manual_seed(1)
    X = torch.randn(30, 2, dtype=D, generator=g)
    y = torch.poisson(torch.exp(X @ torch.tensor([0.5, -0.3], dtype=D)), generator=g)

    def model(X, y=None):
        s = pyro.sample("s", dist.LogNormal(torch.tensor(0.0, dtype=D), torch.tensor(0.5, dtype=D)))
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", 30):
            pyro.sample("y", dist.Poisson(torch.exp((X @ w) * s)), obs=y)

    obj = _hyper_objective(model, (X,), {"y": y})
    assert obj.space.names == ["s"]
    z = torch.tensor([0.2], dtype=D)
    g_env = obj._envelope_gradient(z)
    fd = hyper_mod._grad_fd(obj, z, 1e-4)
    # the premise: the graph misses the design's scale (should extraction ever carry it, this test needs a new case)
    assert g_env is not None and abs(float(g_env[0] - fd[0])) > 1e-3
    obj2 = _hyper_objective(model, (X,), {"y": y})
    g = obj2.gradient(z, 1e-3)
    assert obj2.envelope_ok is False and obj2.gradients["differences"] == 1, obj2.envelope_note
    assert abs(float(g[0] - fd[0])) < 1e-3 * (1 + abs(float(fd[0])))


def test_bernoulli_sites_have_no_envelope_and_are_differenced():
    """Bernoulli's local bound is below the reported exact bound: the dual state does not maximise the latter, so no
    envelope is taken (the gradient is differenced)."""
    g = torch.Generator().manual_seed(2)
    X = torch.randn(40, 3, dtype=D, generator=g)
    y = (torch.rand(40, generator=g, dtype=D) < torch.sigmoid(X @ torch.tensor([1.0, -1.0, 0.5], dtype=D))).to(D)

    def model(X, y=None):
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(1.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), tau).to_event(1))
        with pyro.plate("data", 40):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    obj = _hyper_objective(model, (X,), {"y": y})
    z = torch.tensor([0.1], dtype=D)
    g = obj.gradient(z, 1e-3)
    assert obj.envelope_ok is False and "no envelope" in obj.envelope_note
    fd = hyper_mod._grad_fd(obj, z, 1e-3)
    assert torch.allclose(g, fd, atol=1e-12)
    assert not math.isnan(float(g[0]))


def test_an_intrinsic_gmrf_whose_graph_keeping_extraction_is_refused_is_differenced():
    """An RW1 trend's precision scale as a hyper-latent: a graph-keeping extraction of an intrinsic ``SparseGMRF`` is
    refused (``UnsupportedModelError``), so the envelope is not taken, the reason is reported and the gradients are
    differenced (the fit used to fail with that error)."""
    n = 10
    g = torch.Generator().manual_seed(5)
    counts = torch.poisson(3.0 * torch.exp(torch.sin(torch.arange(n, dtype=D) / 2)), generator=g)
    Q = pcv.distributions.rw_precision(n)

    def model(y=None):
        tau = pyro.sample("tau", dist.Gamma(torch.tensor(2.0, dtype=D), 0.5))
        x = pyro.sample("x", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Q, tau,
                                                          constraints="sum_to_zero"))
        with pyro.plate("data", n):
            pyro.sample("y", dist.Poisson(3.0 * torch.exp(x)), obs=y)

    obj = _hyper_objective(model, (), {"y": counts})
    z = torch.tensor([0.3], dtype=D)
    grad = obj.gradient(z, 1e-3)
    assert obj.envelope_ok is False and "refused" in obj.envelope_note and "intrinsic" in obj.envelope_note
    assert obj.gradients == {"envelope": 0, "differences": 1}
    assert torch.allclose(grad, hyper_mod._grad_fd(obj, z, 1e-3), atol=1e-12)
    res = pcv.fit(model, engine="dual_vg", progress=False, y=counts)
    assert res.info["hyper_details"]["gradients"]["envelope_ok"] is False


def test_posteriors_above_the_envelope_size_are_differenced(monkeypatch):
    """Above ``ENVELOPE_MAX_N`` coordinates the envelope (which forms the posterior's dense covariance) is not taken:
    the same small BYM model with the limit below its 32 coordinates differences every gradient."""
    from pyro_convexvb.infer.dual_vg import engine as dual_engine

    monkeypatch.setattr(dual_engine, "ENVELOPE_MAX_N", 31)
    model, args, kwargs = _bym()
    res = pcv.fit(model, *args, engine="dual_vg", options={"hyper": "map"}, progress=False, **kwargs)
    grads = res.info["hyper_details"]["gradients"]
    assert grads["envelope_ok"] is False and grads["envelope"] == 0 and grads["differences"] > 0
    assert "no envelope form" in grads["envelope_note"]


def test_the_mode_criterion_is_differenced_not_the_envelope_that_drove_the_search(monkeypatch):
    """The reported optimality measure at the mode comes from differences of fits: an envelope gradient that missed a
    dependence on ``theta`` (here: shifted by 0.05 after its check) leads the search to a wrong mode, and the fit says
    it is not converged instead of certifying that mode with the same wrong gradient."""
    model, args, kwargs = _bym()
    good = pcv.fit(model, *args, engine="dual_vg", options={"hyper": "map"}, progress=False, **kwargs)
    assert good.converged and good.info["hyper_details"]["mode_grad_norm"] <= 1e-3
    envelope = hyper_mod.HyperObjective._envelope_gradient
    monkeypatch.setattr(hyper_mod.HyperObjective, "_check_envelope", lambda self, z, g, fd_step: True)
    monkeypatch.setattr(hyper_mod.HyperObjective, "_envelope_gradient",
                        lambda self, z: None if (g := envelope(self, z)) is None else g + 0.05)
    with pytest.warns(UserWarning):
        bad = pcv.fit(model, *args, engine="dual_vg", options={"hyper": "map"}, progress=False, **kwargs)
    assert bad.info["hyper_details"]["gradients"]["envelope"] > 0
    assert bad.info["hyper_details"]["mode_grad_norm"] > 0.04 and not bad.converged
