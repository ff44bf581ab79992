"""Pyro's engines and the hyper-latent path behave as Pyro users expect: honest NUTS convergence, option
rules that do not refuse a lone ``max_steps``, a param store and RNG streams left as the user had them,
options that reach the inner fits, and float32 data."""
import math
import random
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import (AutoLaplaceApproximation, AutoLowRankMultivariateNormal, AutoMultivariateNormal,
                                  AutoNormal)

import pyro_convexvb as pcv
from pyro_convexvb.infer.diag_mixture import AutoDiagMixture

D = torch.float64


def _logistic_data(n=30, dtype=D):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, 2, generator=g, dtype=dtype)
    y = (X[:, 0] + 0.5 * torch.randn(n, generator=g, dtype=dtype) > 0).to(dtype)
    return X, y


def logistic_model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("obs", dist.Bernoulli(logits=X @ w), obs=y)


def _quiet_fit(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        return pcv.fit(*args, progress=False, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# nuts
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_samples", [5, 10])
def test_nuts_needs_the_effective_sample_size_to_converge(num_samples):
    """A handful of draws cannot be converged: min_ess is part of the optimality measure."""
    X, y = _logistic_data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = pcv.fit(logistic_model, X, y=y, engine="nuts", options=dict(num_samples=num_samples, warmup_steps=20,
                                                                            seed=0), progress=False)
    assert not res.converged
    names = [c.name for c in res.optimality.criteria]
    assert any("effective sample size" in n for n in names)
    ess = [c for c in res.optimality.criteria if "effective sample size" in c.name][0]
    # reported as a shortfall below the option's minimum (100 draws' worth by default)
    # (a NaN estimate, as from a chain that barely moved, is no evidence either)
    m = res.info["min_ess"]
    assert not m >= 100
    assert ess.tol == 0.0 and ess.value == (pytest.approx(100.0 - m) if math.isfinite(m) else math.inf)
    assert sum(issubclass(w.category, pcv.ConvergenceWarning) for w in caught) == 1


def test_nuts_converges_with_enough_draws_and_reports_both_criteria():
    X, y = _logistic_data()
    res = pcv.fit(logistic_model, X, y=y, engine="nuts", options=dict(num_samples=400, warmup_steps=200, seed=0),
                  progress=False)
    assert res.converged and res.info["min_ess"] >= 100 and res.info["r_hat"] <= 1.01
    assert len(res.optimality.criteria) == 2


@pytest.mark.parametrize("num_samples", [2, 3])
def test_nuts_too_few_samples_is_a_clear_error(num_samples):
    X, y = _logistic_data()
    with pytest.raises(ValueError, match=r"option 'num_samples' must be >= 4, got " + str(num_samples)):
        pcv.fit(logistic_model, X, y=y, engine="nuts", options=dict(num_samples=num_samples), progress=False)


@pytest.mark.parametrize("labels", ["two", "pm1"])
def test_nuts_refuses_bernoulli_labels_outside_0_1_naming_the_site(labels):
    X, y = _logistic_data()
    yy = 2 * y if labels == "two" else 2 * y - 1
    with pytest.raises(ValueError, match=r"site 'obs': observed values outside the support of Bernoulli") as e:
        pcv.fit(logistic_model, X, y=yy, engine="nuts", options=dict(num_samples=10, warmup_steps=5), progress=False)
    # a data error: no engine fits these data, so none is suggested
    assert "engines that fit" not in str(e.value)


# ---------------------------------------------------------------------------------------------------------
# SVI: max_steps alone
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["svi_autonormal", "svi_automvn", "svi_lowrank", "diag_mixture"])
def test_max_steps_alone_budgets_svi(engine):
    X, y = _logistic_data()
    opts = dict(max_steps=3, seed=0)
    if engine == "diag_mixture":
        opts["optimizer"] = "svi"
    res = _quiet_fit(logistic_model, X, y=y, engine=engine, options=opts)
    assert res.info["steps"] == 3 and res.stop_reason == "max_steps" and not res.converged
    # an explicit min_steps above max_steps is still an error naming both
    with pytest.raises(ValueError, match=r"option 'min_steps' \(10\) exceeds 'max_steps' \(3\)"):
        pcv.fit(logistic_model, X, y=y, engine=engine, options=dict(opts, min_steps=10), progress=False)


# ---------------------------------------------------------------------------------------------------------
# the user's param store
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine, options, user_guide", [
    ("svi_automvn", dict(max_steps=20), AutoMultivariateNormal),
    ("svi_autonormal", dict(max_steps=20), AutoNormal),
    ("svi_lowrank", dict(max_steps=20), AutoLowRankMultivariateNormal),
    ("laplace", {}, AutoLaplaceApproximation),
    ("laplace", {}, AutoMultivariateNormal),  # Pyro's laplace_approximation builds one
    ("diag_mixture", dict(max_steps=20, optimizer="svi"), AutoDiagMixture),
])
def test_fits_leave_the_users_guide_params_alone(engine, options, user_guide):
    """The user's own guide of the engine's guide class keeps its trained values (and still trains)."""
    X, y = _logistic_data()
    guide = user_guide(logistic_model)
    svi = SVI(logistic_model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(30):
        svi.step(X, y)
    store = pyro.get_param_store()
    before = {k: store[k].detach().clone() for k in store.keys()}
    assert any(k.startswith(user_guide.__name__ + ".") for k in before)
    res = _quiet_fit(logistic_model, X, y=y, engine=engine, options=options)
    for k, v in before.items():
        assert k in store.keys(), f"{engine} removed the user's param {k}"
        assert torch.equal(store[k].detach(), v), f"{engine} overwrote the user's param {k}"
    svi.step(X, y)  # the user's guide still trains
    # and the engine's own guide (if any) is still usable after the fit
    g = res.info.get("guide")
    if g is not None:
        g(X, y)


# ---------------------------------------------------------------------------------------------------------
# seeding
# ---------------------------------------------------------------------------------------------------------
SEEDED = [("svi_autonormal", dict(max_steps=30)), ("nuts", dict(num_samples=10, warmup_steps=10)),
          ("diag_mixture", dict(max_steps=30, optimizer="svi"))]


def _loc(engine, options, X, y):
    return _quiet_fit(logistic_model, X, y=y, engine=engine, options=options).posterior.loc


@pytest.mark.parametrize("engine, options", SEEDED)
def test_without_a_seed_option_fits_follow_pyros_global_seed(engine, options):
    X, y = _logistic_data()
    pyro.set_rng_seed(1)
    a = _loc(engine, options, X, y)
    a2 = _loc(engine, options, X, y)  # the stream moved on: a second fit differs
    pyro.set_rng_seed(2)
    b = _loc(engine, options, X, y)
    pyro.set_rng_seed(1)
    c = _loc(engine, options, X, y)
    assert not torch.equal(a, b) and not torch.equal(a, a2)
    torch.testing.assert_close(a, c, rtol=0, atol=0)


@pytest.mark.parametrize("engine, options", SEEDED)
def test_an_explicit_seed_is_reproducible_and_leaves_the_global_streams_alone(engine, options):
    X, y = _logistic_data()
    opts = dict(options, seed=3)
    out = []
    for s in (1, 2):
        pyro.set_rng_seed(s)
        loc = _loc(engine, opts, X, y)
        # the caller's torch, numpy and random streams are where they were: the fit neither drew from nor reset them
        after = (torch.rand(3, dtype=D), np.random.rand(3), random.random())
        pyro.set_rng_seed(s)
        expected = (torch.rand(3, dtype=D), np.random.rand(3), random.random())
        torch.testing.assert_close(after[0], expected[0], rtol=0, atol=0)
        np.testing.assert_array_equal(after[1], expected[1])
        assert after[2] == expected[2]
        out.append(loc)
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def test_without_a_seed_the_fit_consumes_the_callers_stream_but_does_not_reset_it():
    """Two sessions seeded differently end in different states after a fit (a reset would make them equal)."""
    X, y = _logistic_data()
    after = []
    for s in (5, 6):
        pyro.set_rng_seed(s)
        _loc("svi_autonormal", dict(max_steps=5), X, y)
        after.append((torch.rand(3, dtype=D), np.random.rand(3)))
    assert not torch.equal(after[0][0], after[1][0])
    assert not np.array_equal(after[0][1], after[1][1])


# ---------------------------------------------------------------------------------------------------------
# hyper-latents: options reach the inner fits, float32 data, the mode reaches its tolerance
# ---------------------------------------------------------------------------------------------------------
def _halfcauchy_model(X, y=None):
    tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(1.0, dtype=X.dtype)))
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), tau).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def test_convex_relaxation_with_a_hyper_latent_honours_max_outer():
    X, y = _logistic_data(40)
    full = pcv.fit(_halfcauchy_model, X, y=y, engine="convex_relaxation", options=dict(hyper="map"), progress=False)
    assert full.converged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capped = pcv.fit(_halfcauchy_model, X, y=y, engine="convex_relaxation",
                         options=dict(hyper="map", max_outer=1), progress=False)
    assert not capped.converged
    assert not capped.info["mode_result"].converged and capped.info["mode_result"].stop_reason == "max_outer"
    crit = {c.name: c for c in capped.optimality.criteria}
    assert crit["design-point fits not converged"].value >= 1
    assert not torch.equal(capped.posterior.loc, full.posterior.loc)
    assert sum(issubclass(w.category, pcv.ConvergenceWarning) for w in caught) == 1


def test_readme_hyper_latent_snippet_runs_on_float32_data():
    """The hyper-latent path computes in float64 internally and hands the model values in its own dtype."""
    X64, y64 = _logistic_data(40)
    X32, y32 = X64.float(), y64.float()
    r32 = pcv.fit(_halfcauchy_model, X32, y=y32, engine="dual_vg", progress=False)
    r64 = pcv.fit(_halfcauchy_model, X64, y=y64, engine="dual_vg", progress=False)
    assert r32.converged and r64.converged
    assert r32.posterior.loc.dtype == torch.float32 and r32.posterior.variance.dtype == torch.float32
    assert r32.hyper["marginals"]["tau"]["mean"].dtype == torch.float32
    # the same answer up to float32 rounding of the data
    torch.testing.assert_close(r32.posterior.loc.double(), r64.posterior.loc, rtol=0, atol=1e-4)
    m32, m64 = r32.hyper["marginals"]["tau"], r64.hyper["marginals"]["tau"]
    assert float(m32["mean"]) == pytest.approx(float(m64["mean"]), rel=1e-3)
    # and the guide samples the model's sites in its dtype
    from pyro.infer import Predictive

    pred = Predictive(_halfcauchy_model, guide=r32.posterior.as_guide(_halfcauchy_model), num_samples=3)(X32)
    assert pred["y"].shape == (3, 40) and pred["tau"].dtype == torch.float32


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_float32_hierarchies_are_not_refused_for_their_rounding(engine):
    """The hyper-latent path extracts in float64, but a float32 model rounds its predictor in float32: on these data
    its deviation from affine (1.4e-6) exceeded float64's affinity tolerance and both engines refused the model,
    each naming the other as one that fits it."""
    g = torch.Generator().manual_seed(0)
    X64 = torch.randn(30, 3, generator=g, dtype=D)
    y64 = torch.bernoulli(torch.sigmoid(X64 @ torch.tensor([1.0, -0.5, 0.25], dtype=D)), generator=g)

    def _halfcauchy_model(X, y=None):
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(1.0, dtype=X.dtype)))
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), tau).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    r32 = pcv.fit(_halfcauchy_model, X64.float(), y=y64.float(), engine=engine, progress=False)
    r64 = pcv.fit(_halfcauchy_model, X64, y=y64, engine=engine, progress=False)
    m32, m64 = r32.hyper["marginals"]["tau"], r64.hyper["marginals"]["tau"]
    assert float(m32["mean"]) == pytest.approx(float(m64["mean"]), rel=1e-3)


class _WarmStartedQuadratic:
    """``f(z) = -14 d^2 - 0.3 d^3 - 40`` (``d = z - a``) plus an error of size ``noise`` that each new evaluation
    inherits from the point it is warm-started from (the nearest one evaluated before), as inner fits stopped
    at their tolerance do: values compared across points carry it, a stencil around one centre cancels it."""

    def __init__(self, a, noise):
        self.a, self.noise, self.cache = a, noise, {}

    def __call__(self, z):
        import hashlib

        z = torch.as_tensor(z, dtype=D).reshape(-1)
        key = tuple(round(float(v), 12) for v in z)
        if key not in self.cache:
            u = 0.0
            if self.cache:
                anchor = min(self.cache, key=lambda k: sum((p - q) ** 2 for p, q in zip(k, key)))
                u = int(hashlib.sha256(repr(anchor).encode()).hexdigest()[:8], 16) / 2**32 * 2 - 1
            d = z - self.a
            self.cache[key] = float(-14.0 * (d**2).sum() - 0.3 * (d**3).sum() - 40.0) + self.noise * u
        return self.cache[key]


def test_hyper_mode_search_reaches_its_gradient_tolerance_through_warm_start_noise():
    """L-BFGS-B's line search fails on this objective (as on the gp-lengthscale case of
    benchmarks/hierarchical.py, |g| = 0.00137 > 0.001); Newton steps on the stencils' curvature reach gtol."""
    from pyro_convexvb.infer.hyper import _grad_fd, find_mode

    a = torch.tensor([1.0 + 0.5 * 1.5409961], dtype=D)
    f = _WarmStartedQuadratic(a, 1e-7)
    z, fz, res = find_mode(f, torch.zeros(1, dtype=D), gtol=1e-3)
    assert float(_grad_fd(f, z, 1e-3).abs().max()) <= 1e-3
    assert float((z - a).abs().max()) < 1e-4  # the mode of the smooth part is z = a


def _exposure_model(X, E, y=None, sd=1.0):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), sd).to_event(1))
    with pyro.plate("d", X.shape[0]):
        pyro.sample("y", dist.Poisson(torch.exp(X @ w) * E), obs=y)


def _gamma_model(X, y=None, concentration=2.0):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("d", X.shape[0]):
        pyro.sample("y", dist.Gamma(concentration, concentration / torch.exp(X @ w)), obs=y)


@pytest.mark.parametrize("engine", ["dual_vg", "laplace", "diag_mixture", "nuts", "svi_autonormal"])
def test_rows_no_engine_can_score_are_named_before_any_engine_runs(engine):
    """A Poisson row of exposure 0 (rate exactly 0) and a Gamma response of 0 at concentration 2: the LGM engines
    refused them pointing to Pyro-model engines, which then failed with NaN parameters or 'lower the learning rate'.
    Every engine now names the site, the rows and what to do; a wide prior whose draws underflow exp() to 0 is not
    mistaken for a zero exposure, and a Gamma of concentration 1 (the exponential, density finite at 0) passes."""
    X = torch.stack([torch.ones(8, dtype=D), torch.linspace(-1, 1, 8, dtype=D)], 1)
    E = torch.ones(8, dtype=D)
    E[0] = 0.0
    y = torch.tensor([0.0, 1, 2, 0, 1, 3, 2, 4], dtype=D)
    with pytest.raises(ValueError, match=r"site 'y': the Poisson rate is exactly 0 at 1 observation\(s\) \(flat "
                                         r"indices \[0\].* leave it out of the data"):
        pcv.fit(_exposure_model, X, E, y=y, engine=engine, progress=False)
    y1 = y.clone()
    y1[0] = 1.0
    with pytest.raises(ValueError, match="an observed count above 0 there is impossible under the model"):
        pcv.fit(_exposure_model, X, E, y=y1, engine=engine, progress=False)
    g = torch.ones(8, dtype=D)
    g[0] = 0.0
    with pytest.raises(ValueError, match=r"site 'y': 1 observed value\(s\) of 0 .* Gamma likelihood of "
                                         "concentration other than 1"):
        pcv.fit(_gamma_model, X, y=g, engine=engine, progress=False)


def test_a_wide_prior_is_not_taken_for_a_zero_exposure():
    from pyro_convexvb.lgm.extract import check_model_data

    X = torch.stack([torch.ones(8, dtype=D), torch.linspace(-1, 0, 8, dtype=D)], 1)
    y = torch.tensor([0.0, 1, 2, 0, 1, 3, 2, 4], dtype=D)
    underflow = 0
    for seed in range(20):  # prior draws of sd 400 underflow exp() to 0 at some rows (and never overflow: x <= 0)
        pyro.set_rng_seed(seed)
        w = dist.Normal(torch.zeros(2, dtype=D), 400.0).sample()
        underflow += bool((torch.exp(X @ w) == 0).any())
        pyro.set_rng_seed(seed)
        check_model_data(_exposure_model, (X, torch.ones(8, dtype=D)), {"y": y, "sd": 400.0})
    assert underflow > 0
    check_model_data(_gamma_model, (X,), {"y": torch.zeros(8, dtype=D), "concentration": 1.0})


def test_nuts_samples_a_float32_model_under_a_float64_default():
    """Pyro's NUTS builds its step size and mass matrix in torch's default dtype: a float32 model under the float64
    default these docs advise failed with a bare 'addmv ... same dtype' error. The default is set to the model's
    dtype for the run and restored."""
    g = torch.Generator().manual_seed(14)
    X = torch.randn(40, 2, generator=g, dtype=torch.float32)
    y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([1.0, -0.5])), generator=g)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        res = pcv.fit(model, X, y=y, engine="nuts", progress=False,
                      options={"num_samples": 50, "warmup_steps": 50, "seed": 0})
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(before)
    assert res.posterior.loc.dtype == torch.float32 and bool(torch.isfinite(res.posterior.loc).all())
