"""Pyro's own engines, swapped in with one word, recover the exact posterior of a conjugate model."""
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv

D = torch.float64


@pytest.fixture(scope="module")
def conjugate():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 3, generator=g, dtype=D)
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=D) + 0.5 * torch.randn(40, generator=g, dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    P = torch.eye(3, dtype=D) + X.T @ X / 0.25
    C = torch.linalg.inv(P)
    m = C @ X.T @ y / 0.25
    logZ = dist.MultivariateNormal(torch.zeros(40, dtype=D), X @ X.T + 0.25 * torch.eye(40, dtype=D)).log_prob(y)
    return model, X, y, m, C, float(logZ)


def test_engines_listed():
    names = pcv.engines()
    for e in ("svi_autonormal", "svi_automvn", "svi_lowrank", "laplace", "nuts"):
        assert e in names and names[e]


SVI_FAST = dict(lr=0.05, max_steps=2000, min_steps=600, window=200, rtol=1e-4)


@pytest.mark.parametrize(
    "engine, options, tol_mean, tol_var, full_cov",
    [
        ("laplace", {}, 1e-7, 1e-7, True),
        ("svi_automvn", SVI_FAST, 0.5, 0.3, True),
        ("svi_lowrank", dict(SVI_FAST, rank=2), 0.5, 0.3, True),
        ("svi_autonormal", SVI_FAST, 0.5, None, False),
        # slow: NUTS against an exact linear-Gaussian posterior is tests/zoo/test_zoo.py's linear-nuts cell, its
        # converged flag test_pyro_citizenship.py::test_nuts_converges_with_enough_draws_and_reports_both_criteria
        pytest.param("nuts", dict(num_samples=600, warmup_steps=300), 0.3, 0.25, True, marks=pytest.mark.slow),
    ],
)
def test_baseline_recovers_conjugate_posterior(conjugate, engine, options, tol_mean, tol_var, full_cov):
    model, X, y, m, C, logZ = conjugate
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = pcv.fit(model, X, y=y, engine=engine, options=options, progress=False)
    assert res.engine == engine
    # converged is earned by the optimality measure, and an unconverged fit warns once
    assert res.converged == res.optimality.converged
    conv_warnings = [w for w in caught if issubclass(w.category, pcv.ConvergenceWarning)]
    assert len(conv_warnings) == (0 if res.converged else 1)
    if engine in ("laplace", "nuts"):
        assert res.converged
    sd = C.diagonal().sqrt()
    # tol_mean in posterior standard deviations (stochastic engines), absolute for Laplace (exact here)
    assert float(((res.posterior.loc - m) / sd).abs().max()) < (tol_mean if engine != "laplace" else 1e-6)
    if tol_var is not None:
        rel = (res.posterior.variance - C.diagonal()).abs() / C.diagonal()
        assert float(rel.max()) < tol_var
    else:
        # the mean-field optimum has the exact precision diagonal: var_j = 1 / P_jj
        P = torch.linalg.inv(C)
        rel = (res.posterior.variance - 1 / P.diagonal()).abs() * P.diagonal()
        assert float(rel.max()) < 0.3
    if engine == "nuts":
        assert res.log_evidence_bound is None
    else:
        assert res.log_evidence_bound <= logZ + 1e-9
        gap = logZ - res.log_evidence_bound
        assert gap < (1e-9 if engine == "laplace" else 0.5 if full_cov else 2.0)
    if engine == "svi_automvn":
        # the full-rank family contains the exact posterior, so the bound can still rise by logZ - bound:
        # the natural-gradient decrement (exact for quadratic objectives) must estimate that gain
        dec = res.optimality.criteria[0].value
        assert 0.5 * gap <= dec <= 2.0 * gap
    assert res.history["seconds"]


def test_fit_rejects_unknown_engine_and_options(conjugate):
    model, X, y, *_ = conjugate
    with pytest.raises(KeyError, match="unknown engine 'nope'"):
        pcv.fit(model, X, y=y, engine="nope")
    with pytest.raises(TypeError):
        pcv.fit(model, X, y=y, engine="laplace", options={"bogus": 1}, progress=False)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Engines registered by a test leave the registry with it."""
    from pyro_convexvb.infer import registry

    registry.engines()  # the built-in and entry-point engines are loaded first
    monkeypatch.setattr(registry, "_ENGINES", dict(registry._ENGINES))


def test_register_engine_and_swap(conjugate, scratch_registry):
    model, X, y, m, C, _ = conjugate

    @pcv.register_engine(overwrite=True)
    class ExactGaussian(pcv.Engine):
        name = "exact_gaussian_test"
        description = "closed form for linear-Gaussian LGMs (test)"

        def solve(self, lgm, run):
            (g,) = lgm.sites
            A = g.design.to_dense()
            s2 = g.family.params["scale"] ** 2
            P = lgm.dense_prior_prec() + A.T @ (A / s2.unsqueeze(-1))
            cov = torch.linalg.inv(P)
            loc = cov @ (A.T @ ((g.family.params["y"] - g.offset) / s2))
            q = pcv.GaussianPosterior(loc, covariance=cov)
            return pcv.Solution(q, float(lgm.evidence_lower_bound(loc, cov)), pcv.Optimality.exact(), "closed form")

    class Other(pcv.Engine):
        name = "exact_gaussian_test"
        description = "dup"

    with pytest.raises(ValueError, match="already registered"):
        pcv.register_engine(Other)
    with pytest.raises(TypeError, match="subclass of pyro_convexvb.Engine"):
        pcv.register_engine(lambda lgm: None)
    res = pcv.fit(model, X, y=y, engine="exact_gaussian_test")
    torch.testing.assert_close(res.posterior.loc, m)
    assert res.converged and res.stop_reason == "closed form"
    assert res.lgm is not None and res.posterior.layout.names == ["w"]
    pred = pyro.infer.Predictive(model, guide=res.posterior.as_guide(), num_samples=50)(X)
    assert pred["y"].shape == (50, 40)


def test_model_engine_runs_on_the_pyro_model(conjugate, scratch_registry):
    """A ``pcv.ModelEngine`` receives the Pyro model and its data (a ``ModelCall``), refuses a
    LatentGaussianModel, and its posterior is named by the model's unconstrained latent sites; an ``Engine``
    receives the extracted latent Gaussian model."""
    model, X, y, m, C, _ = conjugate
    seen = {}

    @pcv.register_engine(overwrite=True)
    class ExactOnModel(pcv.ModelEngine):
        name = "exact_on_model_test"
        description = "closed form from the extracted model, run on the Pyro model (test)"

        def solve(self, call, run):
            seen["problem"] = call
            lgm = pcv.lgm_from_pyro(call.model, *call.args, **call.kwargs)
            (g,) = lgm.sites
            A = g.design.to_dense()
            P = lgm.dense_prior_prec() + A.T @ (A / (g.family.params["scale"] ** 2)[:, None])
            cov = torch.linalg.inv(P)
            loc = cov @ (A.T @ ((g.family.params["y"] - g.offset) / g.family.params["scale"] ** 2))
            return pcv.Solution(pcv.GaussianPosterior(loc, covariance=cov), None, pcv.Optimality.exact(), "closed form")

    assert ExactOnModel.takes == "model" and pcv.Engine.takes == "lgm"
    res = pcv.fit(model, X, y=y, engine="exact_on_model_test")
    assert isinstance(seen["problem"], pcv.infer.engine.ModelCall) and seen["problem"].args == (X,)
    torch.testing.assert_close(res.posterior.loc, m)
    torch.testing.assert_close(res.posterior.covariance(), C)
    assert res.lgm is None and res.posterior.layout.names == ["w"]
    assert "exact_on_model_test" in pcv.engines_that_fit(model, X, y=y)
    lgm = pcv.lgm_from_pyro(model, X, y=y)
    assert ExactOnModel.fits(lgm).reason == "this engine runs on a Pyro model"
    with pytest.raises(TypeError, match="runs on a Pyro model, not on a LatentGaussianModel"):
        ExactOnModel(lgm, progress=False).run()


def test_takes_follows_the_base_class():
    """``takes`` is read-only: it says which base the engine derives from, and an engine cannot claim the
    other kind (it would get the other kind's hooks); hyper-latent integration needs an engine on the LGM."""
    with pytest.raises(TypeError, match="derive from pyro_convexvb.ModelEngine"):
        class Claims(pcv.Engine):  # noqa: F841
            name = "claims_model_test"
            takes = "model"
    with pytest.raises(TypeError, match="integrates_hyper needs an engine on the latent Gaussian model"):
        class Hyper(pcv.ModelEngine):  # noqa: F841
            name = "hyper_model_test"
            integrates_hyper = True
    for name in pcv.engines():
        cls = pcv.get_engine(name)
        assert cls.takes == ("model" if issubclass(cls, pcv.ModelEngine) else "lgm"), name


def test_entry_point_engines_are_loaded(monkeypatch):
    """Third-party engines declared in the ``pyro_convexvb.engines`` entry-point group appear in pcv.engines()."""
    import importlib.metadata

    from pyro_convexvb.infer import registry

    class ThirdParty(pcv.Engine):
        name = "third_party_test"
        description = "an engine from another package"

    class FakeEntryPoint:
        name = "third_party_test"

        def load(self):
            return ThirdParty

    def fake_entry_points(group=None):
        return [FakeEntryPoint()] if group == "pyro_convexvb.engines" else []

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(registry, "_ENTRY_POINTS_LOADED", False)
    try:
        assert pcv.engines()["third_party_test"] == "an engine from another package"
        assert registry.get_engine("third_party_test") is ThirdParty
    finally:
        registry._ENGINES.pop("third_party_test", None)
