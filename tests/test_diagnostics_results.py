"""Diagnostics of fitted results: PSIS k_hat, corrected marginals, LOO/WAIC/CPO/PIT and the ArviZ round trip,
against closed forms (a conjugate Gaussian model) and the long NUTS reference of a hierarchical logistic model."""
import functools
import importlib.util
import json
import math
import os
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.diagnostics.psis import weighted_quantiles
from pyro_convexvb.diagnostics import ApproximationWarning, correct, diagnose
from tests.references import hyper_models as hm

D = torch.float64
REF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "references", "hyper_nuts.json")


def _arviz():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("arviz")


def _linear(n=15, noise=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, generator=g, dtype=D)
    y = X @ torch.tensor([1.0, -0.5], dtype=D) + noise * torch.randn(n, generator=g, dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, noise), obs=y)

    return model, X, y, noise


def _exact_posterior(X, y, noise):
    A = torch.eye(X.shape[1], dtype=D) + X.T @ X / noise**2
    S = torch.linalg.inv(A)
    return S @ X.T @ y / noise**2, S


@pytest.fixture(scope="module")
def linear_fit():
    model, X, y, noise = _linear()
    res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
    return model, X, y, noise, res


def test_exact_posterior_has_flat_ratios_and_the_exact_evidence(linear_fit):
    model, X, y, noise, res = linear_fit
    d = diagnose(res, num_draws=200)
    n = X.shape[0]
    exact = float(dist.MultivariateNormal(torch.zeros(n, dtype=D), X @ X.T + noise**2 * torch.eye(n, dtype=D)).log_prob(y))
    assert d.log_evidence == pytest.approx(exact, abs=1e-6)
    assert d.k_hat == -math.inf and d.reliable and d.ess == pytest.approx(200, rel=1e-6)


def test_loo_cpo_pit_match_the_closed_form(linear_fit):
    """Leave-one-out predictive of a conjugate model: N(y_i; x_i m_{-i}, noise^2 + x_i S_{-i} x_i)."""
    model, X, y, noise, res = linear_fit
    r = res.loo(num_draws=3000)
    elpd, pit = [], []
    for i in range(X.shape[0]):
        keep = torch.arange(X.shape[0]) != i
        m, S = _exact_posterior(X[keep], y[keep], noise)
        sd = math.sqrt(noise**2 + float(X[i] @ S @ X[i]))
        p = torch.distributions.Normal(float(X[i] @ m), sd)
        elpd.append(float(p.log_prob(y[i])))
        pit.append(float(p.cdf(y[i])))
    # Monte Carlo error of PSIS-LOO with 3000 draws: about 0.01-0.03 nats on the influential observations
    np.testing.assert_allclose(r.elpd_i, elpd, atol=0.05)
    np.testing.assert_allclose(r.cpo, np.exp(elpd), rtol=0.05)
    np.testing.assert_allclose(r.pit, pit, atol=0.02)
    assert r.elpd_loo == pytest.approx(sum(elpd), abs=0.15)
    assert (r.pareto_k < 0.5).all() and r.sites == {"y": slice(0, X.shape[0])}


@pytest.fixture(scope="module")
def logistic_hyper():
    model, args, kwargs = hm.logistic_halfcauchy()
    res = pcv.fit(model, *args, engine="dual_vg", progress=False, **kwargs)
    with open(REF) as f:
        ref = json.load(f)["logistic_halfcauchy"]["sites"]
    return model, args, kwargs, res, ref


def test_corrected_hyper_posterior_matches_long_nuts(logistic_hyper):
    """Integrated hyper-latent (grid mixture proposal): means within 0.1 reference sds, sds within 10%, the
    hyper-latent's quantiles within 5%, each reported with a Monte Carlo error that covers the difference."""
    model, args, kwargs, res, ref = logistic_hyper
    d = res.diagnostics
    assert d.reliable and d.k_hat < 0.7 and d.num_draws == 500 and d.log_evidence is not None
    c = res.corrected(num_draws=2000)
    assert res.correction is c and c.hyper is not None and set(c.hyper) == {"tau"}
    for site in ("tau", "w"):
        s, r = c.sites[site], ref[site]
        sd_ref = torch.tensor(r["sd"], dtype=D).reshape(s["sd"].shape)
        mean_ref = torch.tensor(r["mean"], dtype=D).reshape(s["mean"].shape)
        assert ((s["mean"] - mean_ref).abs() / sd_ref).max() < 0.1
        assert ((s["sd"] / sd_ref) - 1).abs().max() < 0.1
        assert ((s["mean"] - mean_ref).abs() < 4 * s["mean_mcse"] + 0.02 * sd_ref).all()
    for p, key in ((0.05, "q05"), (0.5, "q50"), (0.95, "q95")):
        assert float(c.hyper["tau"]["quantiles"][p]) == pytest.approx(ref["tau"][key][0], rel=0.05)
    assert 0 < float(c.hyper["tau"]["quantile_mcse"][0.95]) < 0.1
    draws = c.resample(100)
    assert draws["tau"].shape == (100,) and bool((draws["tau"] > 0).all()) and draws["w"].shape == (100, 4)


def test_a_too_narrow_posterior_is_flagged_and_corrected_with_a_wider_proposal(linear_fit):
    model, X, y, noise, res = linear_fit
    bad = pcv.GaussianPosterior(res.posterior.loc, covariance=0.5 * res.posterior.covariance())
    bad.layout, bad.model, bad.model_args = res.posterior.layout, model, ((X,), {"y": y})
    res_bad = pcv.InferenceResult(bad, None, engine="test")
    with pytest.warns(ApproximationWarning, match=r"k_hat = .*res.corrected\(\)"):
        d = res_bad.diagnostics
    assert not d.ok and d.sd_ratio[1] > 1.2  # sds 29% too small
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximationWarning)
        c = res_bad.corrected(num_draws=2000)  # an adapted round: the whitened scales widened
        c0 = correct(res_bad, num_draws=2000, adapt=0)  # no adaptation: the defensive mixtures
    assert {"fitted", "affine"} <= set(c.diagnostics.tried) <= {"fitted", "affine", "affine2"}
    assert c.diagnostics.proposal == "affine"
    assert c.k_hat < 0.7 and c.diagnostics.maps[1].s.min() > 1.2  # sds 29% too small: scales about 1.4
    assert set(c0.diagnostics.tried) == {"fitted", "widened", "student_t"}
    assert c0.diagnostics.proposal in ("widened", "student_t") and c0.k_hat < 0.7
    m, S = _exact_posterior(X, y, noise)
    for corrected in (c, c0):
        s = corrected.sites["w"]
        assert ((s["mean"] - m).abs() / S.diagonal().sqrt()).max() < 0.1
        assert ((s["sd"] / S.diagonal().sqrt()) - 1).abs().max() < 0.1
    assert c.ess > c0.ess


def test_affine_rounds_stop_when_a_round_adds_draws_but_not_efficiency(linear_fit, monkeypatch):
    """A pooled round that raises the importance ESS but not the ESS per draw is kept and ends the rounds: its map
    was no better than the last one's, so a further round would only add draws."""
    from pyro_convexvb.diagnostics import importance as imp

    model, X, y, noise, res = linear_fit
    bad = pcv.GaussianPosterior(res.posterior.loc, covariance=0.5 * res.posterior.covariance())
    bad.layout, bad.model, bad.model_args = res.posterior.layout, model, ((X,), {"y": y})
    res_bad = pcv.InferenceResult(bad, None, engine="test")
    weigh, pool, pooled = imp._weigh, imp._pool, []

    def first_round(*a, **k):  # the plain round: ESS 100 of 2,000 draws (5% a draw)
        d = weigh(*a, **k)
        if d.proposal == "fitted":
            d.ess = 100.0
        return d

    def pooled_round(*a, **k):  # each pooled round: one more effective draw, 4,000 or more draws (under 5%)
        d = pool(*a, **k)
        d.ess = 101.0 + len(pooled)
        pooled.append(d.num_draws)
        return d

    monkeypatch.setattr(imp, "_weigh", first_round)
    monkeypatch.setattr(imp, "_pool", pooled_round)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximationWarning)
        c = correct(res_bad, num_draws=2000, adapt=2)
    assert pooled == [4000]  # no third round
    assert c.diagnostics.proposal == "affine" and c.diagnostics.num_draws == 4000 and c.ess == 101.0
    assert set(c.diagnostics.tried) == {"fitted", "affine"}


def test_fit_correct_option(linear_fit):
    model, X, y, noise, _ = linear_fit
    with pytest.raises(ValueError, match="correct: expected None or 'psis'"):
        pcv.fit(model, X, y=y, engine="dual_vg", progress=False, correct="yes")
    res = pcv.fit(model, X, y=y, engine="laplace", progress=False, correct="psis")
    assert res.correction is not None and res.correction.k_hat < 0.7
    m, S = _exact_posterior(X, y, noise)
    assert ((res.correction.sites["w"]["mean"] - m).abs() / S.diagonal().sqrt()).max() < 0.1


def test_lgm_results_have_no_model_to_evaluate(linear_fit):
    model, X, y, noise, _ = linear_fit
    lgm = pcv.lgm_from_pyro(model, X, y=y)
    res = pcv.fit(lgm, engine="dual_vg", progress=False)
    with pytest.raises(ValueError, match="not fitted on a Pyro model"):
        res.diagnostics


def test_to_arviz_round_trip(logistic_hyper):
    az = _arviz()
    model, args, kwargs, res, ref = logistic_hyper
    idata = res.to_arviz(num_draws=400)
    assert idata.posterior["tau"].shape == (4, 100) and idata.posterior["w"].shape == (4, 100, 4)
    assert idata.log_likelihood["y"].shape == (4, 100, 80)
    assert idata.posterior_predictive["y"].shape == (4, 100, 80)
    np.testing.assert_array_equal(idata.observed_data["y"].values, kwargs["y"].numpy())
    assert idata.attrs["engine"] == "dual_vg" and "lp" in idata.sample_stats
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summ = az.summary(idata)
        l_az = az.loo(idata)
    assert summ.loc["tau", "mean"] == pytest.approx(ref["tau"]["mean"][0], abs=4 * summ.loc["tau", "mcse_mean"] + 0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximationWarning)  # 2 of 80 observations' k_hat above it at 400 draws
        ours = res.loo(num_draws=400)
    assert abs(ours.elpd_loo - l_az.elpd_loo) < 0.5 * l_az.se
    # a corrected result exports draws resampled by the importance weights
    res.corrected(num_draws=400)
    idata_c = res.to_arviz(num_draws=400)
    assert "resampled" in idata_c.attrs["draws"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cmp = az.compare({"fitted": idata, "corrected": idata_c})
    assert set(cmp.index) == {"fitted", "corrected"}
    assert abs(cmp["elpd_loo"].iloc[0] - cmp["elpd_loo"].iloc[1]) < cmp["se"].iloc[0]


def test_vectorised_and_looped_log_joint_agree_and_unvectorisable_models_fall_back():
    from pyro_convexvb.diagnostics import ModelLogJoint

    model, args, kwargs = hm.logistic_halfcauchy()
    g = torch.Generator().manual_seed(0)
    vals = {"tau": torch.randn(70, generator=g, dtype=D), "w": torch.randn(70, 4, generator=g, dtype=D)}
    fast = ModelLogJoint(model, args, kwargs)
    slow = ModelLogJoint(model, args, kwargs, vectorise=False)
    a = fast.evaluate(vals, pointwise=True, pit=True)
    b = slow.evaluate(vals, pointwise=True, pit=True)
    assert fast.vectorised is True and slow.vectorised is False
    np.testing.assert_allclose(a["log_joint"], b["log_joint"], rtol=1e-10)
    np.testing.assert_allclose(a["log_lik"]["y"], b["log_lik"]["y"], rtol=1e-10)
    np.testing.assert_allclose(a["cdf"]["y"][0], b["cdf"]["y"][0], atol=1e-12)
    # the log joint by hand: HalfCauchy prior at exp(z), its log-Jacobian z, the Gaussian prior and the likelihood
    X, y = args[0], kwargs["y"]
    tau, w = vals["tau"][0].exp(), vals["w"][0]
    hand = (dist.HalfCauchy(torch.tensor(1.0, dtype=D)).log_prob(tau) + vals["tau"][0]
            + dist.Normal(0.0, tau).log_prob(w).sum() + dist.Bernoulli(logits=X @ w).log_prob(y).sum())
    assert a["log_joint"][0] == pytest.approx(float(hand), rel=1e-12)

    def branchy(y=None):  # Python control flow on a latent value: vmap cannot run it
        s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        loc = torch.tensor(1.0, dtype=D) if float(s) > 1 else torch.tensor(0.0, dtype=D)
        pyro.sample("y", dist.Normal(loc, s), obs=y)

    lj = ModelLogJoint(branchy, (), {"y": torch.tensor(0.3, dtype=D)})
    with pytest.warns(RuntimeWarning, match=r"model 'branchy'.*one trace per draw.*vmap cannot run it"):
        out = lj.evaluate({"s": torch.tensor([-1.0, 1.0], dtype=D)})
    assert lj.vectorised is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not at every evaluation
        lj.evaluate({"s": torch.tensor([0.5], dtype=D)})
    exact = [float(dist.HalfNormal(torch.tensor(1.0, dtype=D)).log_prob(torch.tensor(math.exp(z), dtype=D)) + z
                   + dist.Normal(torch.tensor(loc, dtype=D), torch.tensor(math.exp(z), dtype=D)).log_prob(
                       torch.tensor(0.3, dtype=D)))
             for z, loc in ((-1.0, 0.0), (1.0, 1.0))]
    np.testing.assert_allclose(out["log_joint"], exact, rtol=1e-12)


def test_a_gpytorch_kernel_of_a_latent_lengthscale_is_vectorised():
    """A kernel evaluated at ``x / ell`` with ``ell`` latent, train and cross: every GPyTorch kernel calls
    ``torch.equal`` on its inputs, which vmap has no rule for, so such models were evaluated one trace per draw
    (the zoo's GP: 8.8 s for a correction, 0.4 s vectorised). The vectorised values are the loop's, and
    ``torch.equal`` is restored afterwards."""
    gpytorch = pytest.importorskip("gpytorch")
    from pyro_convexvb.diagnostics import ModelLogJoint

    plain_equal = torch.equal
    x = torch.linspace(-1.0, 1.0, 6, dtype=D).unsqueeze(-1)
    z = torch.tensor([[0.2], [0.9]], dtype=D)
    unit = gpytorch.kernels.RBFKernel().double()
    unit.lengthscale = 1.0

    def model(x, y=None):
        ell = pyro.sample("ell", dist.LogNormal(torch.tensor(0.0, dtype=D), torch.tensor(0.5, dtype=D)))
        K = unit(x / ell).to_dense() + 1e-2 * torch.eye(6, dtype=D)
        f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(6, dtype=D), covariance_matrix=K))
        cross = unit(z / ell, x / ell).to_dense()  # (2, 6): not square, no zero diagonal
        pyro.sample("g", dist.Normal(cross @ f, 0.5).to_event(1), obs=torch.tensor([0.3, -0.2], dtype=D))
        with pyro.plate("data", 6):
            pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

    y = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0], dtype=D)
    g = torch.Generator().manual_seed(3)
    vals = {"ell": 0.5 * torch.randn(70, generator=g, dtype=D), "f": torch.randn(70, 6, generator=g, dtype=D)}
    fast = ModelLogJoint(model, (x,), {"y": y})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the loop
        a = fast.evaluate(vals, pointwise=True)
    b = ModelLogJoint(model, (x,), {"y": y}, vectorise=False).evaluate(vals, pointwise=True)
    assert fast.vectorised is True and torch.equal is plain_equal
    np.testing.assert_allclose(a["log_joint"], b["log_joint"], rtol=1e-12)
    np.testing.assert_allclose(a["log_lik"]["g"], b["log_lik"]["g"], rtol=1e-12)


def test_batched_equal_compares_every_draw():
    """:func:`_batched_equal`: ``True`` only when the two inputs agree for every draw of a vmapped batch (a plain
    tensor against each draw); plain tensors as ``torch.equal``."""
    from pyro_convexvb.diagnostics.logjoint import _batched_equal

    eq = functools.partial(_batched_equal, torch.equal)
    a = torch.arange(6, dtype=D).reshape(3, 2)
    assert eq(a, a.clone()) and not eq(a, a + 1)
    assert torch.func.vmap(lambda r: torch.tensor(eq(r, r * 1.0)))(a).all()
    assert not torch.func.vmap(lambda r: torch.tensor(eq(r, a[0])))(a).any()  # draw 0 equal, the others not
    assert torch.func.vmap(lambda r: torch.tensor(eq(r, a[0])))(a[:1].expand(3, 2)).all()
    assert torch.func.vmap(lambda r, q: torch.tensor(eq(r, q)), in_dims=(0, 1))(a, a.T.contiguous()).all()


def test_gpytorch_kernels_of_data_inputs_are_vectorised_and_agree_with_the_loop():
    """GPyTorch's RBF kernel runs a custom autograd function that vmap cannot run; in GPyTorch's trace_mode it is
    plain tensor operations, so a model with a latent outputscale is vectorised, with the loop's values, and the
    kernel's own settings are untouched."""
    gpytorch = pytest.importorskip("gpytorch")
    from pyro_convexvb.diagnostics import ModelLogJoint

    x = torch.linspace(-1.0, 1.0, 6, dtype=D).unsqueeze(-1)
    kernel = gpytorch.kernels.RBFKernel().double()
    kernel.lengthscale = 0.7

    def model(x, y=None):
        s = pyro.sample("s", dist.LogNormal(torch.tensor(0.0, dtype=D), torch.tensor(0.5, dtype=D)))
        K = s * kernel(x).to_dense() + 1e-2 * torch.eye(6, dtype=D)
        f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(6, dtype=D), covariance_matrix=K))
        with pyro.plate("data", 6):
            pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

    y = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0], dtype=D)
    g = torch.Generator().manual_seed(2)
    vals = {"s": torch.randn(5, generator=g, dtype=D), "f": torch.randn(5, 6, generator=g, dtype=D)}
    fast = ModelLogJoint(model, (x,), {"y": y})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the loop
        a = fast.evaluate(vals, pointwise=True)
    b = ModelLogJoint(model, (x,), {"y": y}, vectorise=False).evaluate(vals, pointwise=True)
    assert fast.vectorised is True and not gpytorch.settings.trace_mode.on()
    np.testing.assert_allclose(a["log_joint"], b["log_joint"], rtol=1e-12)
    np.testing.assert_allclose(a["log_lik"]["y"], b["log_lik"]["y"], rtol=1e-12)
    s0 = vals["s"][0].exp()  # by hand: the kernel written out, LogNormal prior at exp(z) with its Jacobian z
    ell = kernel.lengthscale.detach().reshape(())
    K = s0 * torch.exp(-0.5 * (x - x.T) ** 2 / ell**2) + 1e-2 * torch.eye(6, dtype=D)
    hand = (dist.LogNormal(torch.tensor(0.0, dtype=D), torch.tensor(0.5, dtype=D)).log_prob(s0) + vals["s"][0]
            + dist.MultivariateNormal(torch.zeros(6, dtype=D), covariance_matrix=K).log_prob(vals["f"][0])
            + dist.Bernoulli(logits=vals["f"][0]).log_prob(y).sum())
    assert a["log_joint"][0] == pytest.approx(float(hand), rel=1e-10)


def test_a_hyper_latent_fixed_at_its_mode_is_not_a_moment_disagreement():
    """hyper='map' on a Gaussian model: the field's Gaussian at the mode is exact (equal weights), but the fixed
    hyper-latent's constant column has a rounding-noise sd, whose ratios gave a mean shift of 0.86 sds and a
    warning to correct an exact answer."""
    _, X, y, _ = _linear(n=20)

    def model(X, y=None):
        tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), tau).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False, options={"hyper": "map"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApproximationWarning)
        d = res.diagnostics
    assert d.ok and d.moments_agree and d.mean_shift == 0.0 and d.sd_ratio == (1.0, 1.0)
    assert d.ess == pytest.approx(d.num_draws, rel=1e-9)


def test_sparse_gmrf_models_are_vectorised_and_agree_with_the_loop():
    """A SparseGMRF latent with a hyper-latent precision scale runs under vmap (a Python branch on the scale made
    every GMRF model fall back to the draw-by-draw loop, about 50 times slower), with the loop's values."""
    from pyro_convexvb.diagnostics import ModelLogJoint
    from pyro_convexvb.distributions import SparseGMRF

    n = 5
    Q = (2.2 * torch.eye(n, dtype=D) - torch.diag(torch.ones(n - 1, dtype=D), 1)
         - torch.diag(torch.ones(n - 1, dtype=D), -1)).to_sparse_csr()

    def model(y=None):
        kappa = pyro.sample("kappa", dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)))
        f = pyro.sample("f", SparseGMRF(torch.zeros(n, dtype=D), Q, precision_scale=kappa))
        with pyro.plate("data", n):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    y = torch.tensor([0.0, 1.0, 3.0, 2.0, 1.0], dtype=D)
    g = torch.Generator().manual_seed(1)
    vals = {"kappa": torch.randn(9, generator=g, dtype=D), "f": 0.5 * torch.randn(9, n, generator=g, dtype=D)}
    fast = ModelLogJoint(model, (), {"y": y})
    a = fast.evaluate(vals, pointwise=True)
    b = ModelLogJoint(model, (), {"y": y}, vectorise=False).evaluate(vals, pointwise=True)
    assert fast.vectorised is True
    np.testing.assert_allclose(a["log_joint"], b["log_joint"], rtol=1e-12)
    np.testing.assert_allclose(a["log_lik"]["y"], b["log_lik"]["y"], rtol=1e-12)
    k, f = vals["kappa"][0].exp(), vals["f"][0]  # by hand: Gamma prior at exp(z) with its Jacobian z, the GMRF, y
    Qd = k * Q.to_dense()
    hand = (dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)).log_prob(k) + vals["kappa"][0]
            + dist.MultivariateNormal(torch.zeros(n, dtype=D), precision_matrix=Qd).log_prob(f)
            + dist.Poisson(f.exp()).log_prob(y).sum())
    assert a["log_joint"][0] == pytest.approx(float(hand), rel=1e-12)


def test_bym_two_hyper_latents_corrected_against_long_nuts():
    """BYM (proper CAR + iid effects; kappa and sigma_v integrated over on a 2-D grid): the corrected hyper-latent
    quantiles within 5%, field means within 0.1 reference sds and sds within 10% of the long NUTS reference
    (non-centred coordinates)."""
    with open(REF) as f:
        refs = json.load(f)
    if "bym" not in refs:
        pytest.skip("no BYM reference in tests/references/hyper_nuts.json (python tests/references/generate.py bym)")
    ref = refs["bym"]["sites"]
    model, args, kwargs = hm.bym()
    res = pcv.fit(model, *args, engine="dual_vg", progress=False, **kwargs)
    assert res.hyper["strategy"] == "grid" and res.posterior.space.names == ["kappa", "sigma_v"]
    d = res.diagnostics
    c = res.corrected(num_draws=4000)
    assert c.diagnostics.reliable, c.diagnostics
    w = c.weights
    for site in ("kappa", "sigma_v"):
        v = c._lj.constrain(site, c.diagnostics.draws[site]).numpy()
        for p, key in ((0.05, "q05"), (0.5, "q50"), (0.95, "q95")):
            # the reference's own Monte Carlo error, sqrt(p (1 - p) / ESS) / f, matters for sigma_v's 5% quantile
            # near 0 (about 6% of it at ESS 5,500); f from the corrected draws
            (lo, hi), _ = weighted_quantiles(v, w, (p - 0.01, p + 0.01))
            ref_se = math.sqrt(p * (1 - p) / refs["bym"]["min_ess"]) * float(hi - lo) / 0.02
            est, se = float(c.hyper[site]["quantiles"][p]), float(c.hyper[site]["quantile_mcse"][p])
            tol = max(0.05 * ref[site][key][0], 3 * math.hypot(se, ref_se))
            assert abs(est - ref[site][key][0]) < tol, (site, p, est, ref[site][key][0], se, ref_se)
    off = 0.0
    for site in ("phi", "v"):
        s, r = c.sites[site], ref[site]
        rm, rs = torch.tensor(r["mean"], dtype=D), torch.tensor(r["sd"], dtype=D)
        assert float(((s["mean"] - rm).abs() / rs).max()) < 0.1, site
        assert float((s["sd"] / rs - 1).abs().max()) < 0.1, site
        off = max(off, float((d.draws[site].std(0) / rs - 1).abs().max()))
    if off > 0.2:
        assert not d.ok, (off, d)


def test_a_model_density_that_is_nan_at_some_draws_is_named_not_smoothed(linear_fit):
    """A log joint that is NaN or +inf at a draw (a model whose densities break down at extreme values) stops the
    weighting with an error that says so, instead of PSIS's generic complaint about its input; a proposal whose own
    density is not finite at its draws is reported as a defect."""
    from pyro_convexvb.diagnostics import importance
    from pyro_convexvb.diagnostics.proposals import make_proposal

    res = linear_fit[4]
    q = make_proposal(res.posterior, "fitted")
    values, log_q = q.sample(50, torch.Generator().manual_seed(0))
    log_q = log_q.numpy()
    lj = np.zeros(50)
    for bad in (np.nan, np.inf):
        lj[7] = bad
        with pytest.raises(ValueError, match="log joint density is NaN or \\+inf at 1 of 50 draws"):
            importance._weigh(res, q, values, log_q, lj, q.conditional())
    lj[7] = -np.inf  # probability zero under the model: a zero weight
    assert importance._weigh(res, q, values, log_q, lj, q.conditional()).num_draws == 50
    log_q[3] = -np.inf
    with pytest.raises(RuntimeError, match="proposal's log density is not finite"):
        importance._weigh(res, q, values, log_q, np.zeros(50), q.conditional())


@pytest.mark.parametrize("K", [1, 2])
def test_a_mixture_posterior_is_corrected_with_its_own_density(K):
    """A ``diag_mixture`` posterior has no Gaussian to widen: the correction keeps the mixture as its proposal (it
    crashed looking for a Gaussian's factor) and, on a 2-D logistic regression, agrees with grid quadrature."""
    from tests._grid_quadrature import grid_posterior_2d

    g = torch.Generator().manual_seed(1)
    X = torch.cat([torch.ones(25, 1, dtype=D), torch.randn(25, 1, generator=g, dtype=D)], 1)
    y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([0.5, 1.5], dtype=D)), generator=g)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    Xn, yn = X.numpy(), y.numpy()
    m, s, _ = grid_posterior_2d(lambda W: (yn * (W @ Xn.T) - np.logaddexp(0, W @ Xn.T)).sum(1), [-5, -5], [5, 5])
    res = pcv.fit(model, X, y=y, engine="diag_mixture", options={"seed": 0, "num_components": K}, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximationWarning)  # the diagonal components miss the correlation
        c = res.corrected(num_draws=2000)
    assert set(c.diagnostics.tried) == {"fitted"}
    assert np.abs((c.sites["w"]["mean"].numpy() - m) / s).max() < 0.1
    assert np.abs(c.sites["w"]["sd"].numpy() / s - 1).max() < 0.1


def test_float32_model_with_hyper_latents_is_diagnosed_corrected_and_exported():
    """The design points' fits run in float64 whatever the model's dtype: the proposal's draws were put into a
    float32 buffer (an index_put dtype error ended diagnostics, corrected() and to_arviz() of float32 models with
    hyper-latents). The float32 answers agree with the float64 ones from the same seed well inside their Monte Carlo
    error (about 0.03 sd at 1,000 draws): the float32 mode differs by ~1e-4, which can move a draw of the hyper-latent
    into the neighbouring cell of the surface and pair it with another design point."""
    def centred(sigma, y=None):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=sigma.dtype), 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(5.0, dtype=sigma.dtype)))
        with pyro.plate("J", 8):
            theta = pyro.sample("theta", dist.Normal(mu, tau))
            pyro.sample("obs", dist.Normal(theta, sigma), obs=y)

    y = torch.tensor([28.0, 8, -3, 7, -1, 1, 18, 12], dtype=D)
    sigma = torch.tensor([15.0, 10, 16, 11, 9, 11, 10, 18], dtype=D)
    out = {}
    for dt in (torch.float64, torch.float32):
        res = pcv.fit(centred, sigma.to(dt), y=y.to(dt), engine="dual_vg", progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ApproximationWarning)
            out[dt] = (res.diagnostics, res.corrected(num_draws=1000))
    (d64, c64), (d32, c32) = out[torch.float64], out[torch.float32]
    assert d32.k_hat == pytest.approx(d64.k_hat, abs=0.02)
    for site in ("mu", "theta"):
        sd = c64.sites[site]["sd"].double()
        assert float(((c32.sites[site]["mean"].double() - c64.sites[site]["mean"].double()) / sd).abs().max()) < 0.02
    assert c32.hyper["tau"]["quantiles"][0.5] == pytest.approx(float(c64.hyper["tau"]["quantiles"][0.5]), rel=0.02)
    if importlib.util.find_spec("arviz") is not None:  # the optional extra
        assert "posterior" in res.to_arviz().groups()


def _masked_linear(n=60, seed=1):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, generator=g, dtype=D)
    y = X @ torch.tensor([1.3, -0.3, 0.2], dtype=D) + torch.randn(n, generator=g, dtype=D)
    mask = torch.ones(n, dtype=torch.bool)
    mask[::4] = False
    y[~mask] = float("nan")

    def model(X, y=None, mask=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        f = pyro.deterministic("f", X @ w)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(f, 1.0), obs=y, obs_mask=mask)

    return model, X, y, mask


def test_obs_mask_fits_of_the_pyro_model_engines_are_diagnosed_against_their_own_filler():
    """laplace fits the proper joint with N(0, 1) on obs_mask's unused entries; scored with the site's conditional
    instead, its exact fit of this conjugate model had k_hat 8.6, ESS 1 and an importance log evidence 72 nats off."""
    model, X, y, mask = _masked_linear()
    res = pcv.fit(model, X, y=y, mask=mask, engine="laplace", progress=False)
    d = res.diagnostics
    assert d.k_hat < 0.5 and d.ess > 0.99 * d.num_draws
    assert d.log_evidence == pytest.approx(res.log_evidence_bound, abs=1e-6)


def test_obs_mask_and_deterministic_sites_are_diagnosed_as_the_model_reads_them():
    """obs_mask's masked-out latent entries have no density in the model while the proposal draws them: the ratios
    carried 1/q of each (k_hat 2.5 on an exact fit, a 'corrected' mean 1.9 sds off). pyro.deterministic sites (obs_mask
    ends with one) were counted as observations in LOO and exported as log-likelihoods (az.loo refused the export).
    The exact fit of this conjugate model is now recognised as exact and LOO equals the closed form."""
    model, X, y, mask = _masked_linear()
    res = pcv.fit(model, X, y=y, mask=mask, engine="dual_vg", progress=False)
    m, S = _exact_posterior(X[mask], y[mask], 1.0)
    d = res.diagnostics
    assert d.k_hat < 0.5 and d.ess > 0.99 * d.num_draws
    c = res.corrected(num_draws=1000)
    sd = S.diagonal().sqrt()
    assert float(((c.sites["w"]["mean"] - m) / sd).abs().max()) < 1e-6
    r = res.loo(num_draws=2000)
    assert r.sites == {"y_observed": slice(0, int(mask.sum()))}
    Xo, yo = X[mask], y[mask]
    exact = []
    for i in range(Xo.shape[0]):
        keep = torch.arange(Xo.shape[0]) != i
        mi, Si = _exact_posterior(Xo[keep], yo[keep], 1.0)
        exact.append(float(torch.distributions.Normal(float(Xo[i] @ mi), math.sqrt(1 + float(Xo[i] @ Si @ Xo[i])))
                           .log_prob(yo[i])))
    np.testing.assert_allclose(r.elpd_i, exact, atol=0.05)
    if importlib.util.find_spec("arviz") is not None:
        idata = res.to_arviz(num_draws=200)
        assert list(idata.log_likelihood.data_vars) == ["y_observed"]
        assert list(idata.observed_data.data_vars) == ["y_observed"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import arviz as az

            assert az.loo(idata).elpd_loo == pytest.approx(sum(exact), abs=0.5)


def test_correct_and_diagnose_refuse_draw_counts_and_seeds_they_would_truncate(linear_fit):
    """correct() and diagnose() truncated a float seed or draw count silently (seed=1.5 ran seed 1)."""
    from pyro_convexvb.diagnostics.importance import correct, diagnose

    res = linear_fit[-1]
    for fn in (correct, diagnose):
        for bad in (0, 5, 300.5, True):
            with pytest.raises(ValueError, match="num_draws: expected an integer >= 10"):
                fn(res, bad)
        with pytest.raises(ValueError, match="seed: expected an integer"):
            fn(res, 200, seed=1.5)
    with pytest.raises(ValueError, match="seed: expected an integer"):
        res.corrected(num_draws=200, seed=True)


def test_loo_validates_its_draws_and_warns_when_its_weights_are_unreliable(linear_fit):
    model, X, y, noise, res = linear_fit
    for bad in (0, 1, 2.5, True):
        with pytest.raises(ValueError, match="num_draws: expected an integer >= 10"):
            res.loo(num_draws=bad)
    bad_q = pcv.GaussianPosterior(res.posterior.loc, covariance=0.2 * res.posterior.covariance())
    bad_q.layout, bad_q.model, bad_q.model_args = res.posterior.layout, model, ((X,), {"y": y})
    wording = r"PSIS-LOO may be unreliable: .* have their own k_hat above the threshold \(the k_hat threshold at "
    with pytest.warns(ApproximationWarning, match=wording + r"500 draws is 0\.\d\d\)"):
        pcv.InferenceResult(bad_q, None, engine="test").loo(num_draws=500)


def test_a_posterior_five_times_wider_than_the_gaussian_is_reached_or_warned_about():
    """Sparse logistic regression on spambase (Laplace prior, ``convex_relaxation``): the Gaussian's sd of the
    coefficient of ``x3`` is 0.12 where the long NUTS reference's is 0.64. With the adapted scales clipped to
    [0.5, 2] of the Gaussian's and two rounds, the corrected sd was 0.36-0.40 and the mean 0.35 reference sds low,
    with k_hat 0.39-0.59 and no warning. The default rounds now reach it (means within 0.1 reference sds, sds within
    10%); a correction stopped early while its proposal is still too narrow warns."""
    with open(REF) as f:
        refs = json.load(f)
    ref = refs["lasso_spambase"]["sites"]["w"]
    model, args, kwargs = hm.lasso_spambase()
    res = pcv.fit(model, *args, engine="convex_relaxation", options=dict(variance="exact", max_outer=50),
                  progress=False, **kwargs)
    rm, rs = torch.tensor(ref["mean"], dtype=D), torch.tensor(ref["sd"], dtype=D)
    assert float(res.posterior.scale[3] / rs[3]) < 0.25  # the Gaussian is far too narrow there
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApproximationWarning)
        c = res.corrected()
    s = c.sites["w"]
    assert float(((s["mean"] - rm).abs() / rs).max()) < 0.1, ((s["mean"] - rm) / rs)
    assert float((s["sd"] / rs - 1).abs().max()) < 0.1, s["sd"] / rs
    assert c.diagnostics.sd_ratio[1] <= 1.2
    with pytest.warns(ApproximationWarning, match="too narrow there.*adapt=8"):
        early = res.corrected(adapt=2)
    assert float(early.sites["w"]["sd"][3] / rs[3]) < 0.8  # what the warning is about


def _off_or_warned(res, seed, exact, site, coords=None):
    """``(z, warned)``: the largest ``|corrected - exact| / reported error`` of the site's means and sds, and
    whether the correction warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = res.corrected(seed=seed)
    s = c.sites[site]
    z = max(float(((s[k] - torch.as_tensor(exact[k], dtype=D)).abs() / s[k + "_mcse"]).max()) for k in ("mean", "sd"))
    return z, any(issubclass(w.category, ApproximationWarning) for w in caught)


def test_a_corrected_answer_far_from_its_proposal_warns():
    """A non-centred normal hierarchy fitted by ``laplace`` (a Gaussian over ``log tau`` and the standardised group
    effects: a funnel): its corrected ``tau`` was 5-10 reported errors off the exact answer (1-D quadrature over
    ``tau``) with ``k_hat`` 0.41-0.66 and no warning, while the weighted means sat 0.9-1.1 sds from the proposal's.
    Now such a correction warns."""
    from scipy.stats import multivariate_normal

    J, per = 6, 3
    g = torch.Generator().manual_seed(21)
    grp = torch.arange(J).repeat_interleave(per)
    y = (0.5 + 0.6 * torch.randn(J, generator=g, dtype=D))[grp] + torch.randn(J * per, generator=g, dtype=D)

    def model(grp, y=None):
        tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        with pyro.plate("groups", J):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("data", grp.shape[0]):
            pyro.sample("y", dist.Normal(mu + tau * z[grp], 1.0), obs=y)

    # p(tau | y) by quadrature over log tau: y ~ N(0, I + tau^2 Z Z^T + 4 1 1^T), tau ~ HalfNormal(1)
    Z = np.eye(J)[grp.numpy()]
    u = np.linspace(-9, 3, 2000)
    t = np.exp(u)
    lw = np.array([multivariate_normal(np.zeros(J * per), np.eye(J * per) + ti**2 * Z @ Z.T + 4.0).logpdf(y.numpy())
                   for ti in t]) - 0.5 * t**2 + u
    w = np.exp(lw - lw.max())
    w /= w.sum()
    mean = float((w * t).sum())
    exact = {"mean": mean, "sd": math.sqrt(float((w * t**2).sum()) - mean**2)}
    res = pcv.fit(model, grp, y=y, engine="laplace", progress=False)
    for seed in (0, 2):
        z, warned = _off_or_warned(res, seed, exact, "tau")
        assert z < 3 or warned, (seed, z)


def test_among_reliable_proposals_one_that_settled_beats_a_larger_ess():
    """A 2-weight logistic regression fitted by ``convex_relaxation`` (its sds 0.66 of the exact ones): on seeds 5
    and 11 the adapted round was rejected and, of the reliable proposals, the plain Gaussian (still 1.3 times too
    narrow) beat the Student-t one by its (upward biased) importance ESS: means 4.7 and sds 7.7 reported errors off
    the 2-D quadrature. Now the Student-t proposal is chosen and the answer agrees."""
    g = torch.Generator().manual_seed(11)
    X = torch.randn(20, 2, generator=g, dtype=D)
    y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([2.0, -1.5], dtype=D)), generator=g)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 2.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    a = np.linspace(-3.0, 12.0, 701)
    b = np.linspace(-10.0, 4.0, 701)
    A, B = np.meshgrid(a, b, indexing="ij")
    eta = np.stack([A.ravel(), B.ravel()], 1) @ X.numpy().T
    lp = (y.numpy() * eta - np.logaddexp(0, eta)).sum(1) - (A.ravel() ** 2 + B.ravel() ** 2) / 8.0
    p = np.exp(lp - lp.max()).reshape(A.shape)
    p /= p.sum()
    exact = {"mean": [], "sd": []}
    for grid, marg in ((a, p.sum(1)), (b, p.sum(0))):
        m = float((marg * grid).sum())
        exact["mean"].append(m)
        exact["sd"].append(math.sqrt(float((marg * (grid - m) ** 2).sum())))
    res = pcv.fit(model, X, y=y, engine="convex_relaxation", progress=False)
    for seed in (5, 11):
        z, warned = _off_or_warned(res, seed, exact, "w")
        assert z < 3.5 and not warned, (seed, z, warned)


def test_correction_and_export_arguments_are_checked_not_ignored():
    """Options the proposal would ignore are refused (``adapt``/``adaptation`` with a fixed proposal,
    ``"interpolated"`` without integrated hyper-latents), ``probs=0.5`` and infinite draws are ``ValueError``s naming
    the argument, ``to_arviz`` takes NumPy and integral float counts as ``correct`` and ``loo`` do, and
    ``res.corrected(warn=False)`` passes through."""
    model, X, y, _ = _linear()
    res = pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
    with pytest.raises(ValueError, match="adapt and adaptation apply to proposal='auto' only"):
        res.corrected(num_draws=50, proposal="fitted", adapt=3)
    with pytest.raises(ValueError, match="adapt and adaptation apply to proposal='auto' only"):
        correct(res, num_draws=50, proposal="widened", adaptation="diagonal")
    with pytest.raises(ValueError, match="proposal='interpolated' moves"):
        res.corrected(num_draws=50, proposal="interpolated")
    with pytest.raises(ValueError, match="proposal='interpolated' moves"):
        diagnose(res, num_draws=50, proposal="interpolated")
    with pytest.raises(ValueError, match="probs: expected a sequence"):
        res.corrected(num_draws=50, probs=0.5)
    for bad in (float("inf"), float("nan"), 100.5):
        with pytest.raises(ValueError, match="num_draws: expected an integer"):
            res.corrected(num_draws=bad)
    assert res.corrected(num_draws=60.0, proposal="fitted", warn=False).diagnostics.num_draws == 60
    _arviz()
    idata = res.to_arviz(num_draws=100.0, chains=np.int64(2))
    assert idata.posterior["w"].shape[:2] == (2, 50)
    with pytest.raises(ValueError, match="num_draws: expected an integer of at least chains"):
        res.to_arviz(num_draws=float("inf"))


def _inverse_gamma_variance_fit(concentration):
    """Three groups of five observations, their variance ``v ~ InverseGamma(concentration, 0.5)`` integrated over;
    the exact sd of ``v`` by quadrature of its marginal likelihood (the group means ``~ N(0, v + 1/5)``)."""
    import scipy.stats as st

    g = torch.Generator().manual_seed(0)
    group = torch.arange(3).repeat_interleave(5)
    y = 0.7 * torch.randn(3, generator=g, dtype=D)[group] + torch.randn(15, generator=g, dtype=D)

    def model(group, y=None):
        v = pyro.sample("v", dist.InverseGamma(torch.tensor(concentration, dtype=D), torch.tensor(0.5, dtype=D)))
        with pyro.plate("g", 3):
            a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=D), v.sqrt()))
        with pyro.plate("d", 15):
            pyro.sample("y", dist.Normal(a[group], 1.0), obs=y)

    ybar = np.array([float(y[group == j].mean()) for j in range(3)])
    lv = np.linspace(np.log(1e-5), np.log(1e8), 800_001)
    v = np.exp(lv)
    logp = st.invgamma.logpdf(v, concentration, scale=0.5) + lv + sum(st.norm.logpdf(b, 0, np.sqrt(v + 0.2))
                                                                       for b in ybar)
    p = np.exp(logp - logp.max())
    p /= p.sum()
    m = float((p * v).sum())
    return pcv.fit(model, group, y=y, engine="dual_vg", progress=False), math.sqrt(float((p * (v - m) ** 2).sum()))


def test_the_sd_of_a_hyper_latent_with_an_infinite_fourth_moment_has_an_unbounded_error():
    """An InverseGamma(1, 0.5) variance of three groups: its posterior falls off like ``v^-3.5``, so ``(v - m)^2``
    has tail shape 0.8 and no finite variance. Corrected sds came out 10-16% low (1.68-1.79 against the exact 2.00
    on four seeds) with errors of 0.01; now ``sd_mcse`` is inf with a warning naming the site. With a lighter tail
    (InverseGamma(3, 0.5): ``(v - m)^2`` shape 0.44 in theory) the sd and its error stand and agree with the exact
    sd."""
    from pyro_convexvb.diagnostics import ApproximationWarning

    res, exact = _inverse_gamma_variance_fit(1.0)
    assert 1.95 < exact < 2.05
    with pytest.warns(ApproximationWarning, match="sd of 'v' cannot be estimated from draws.*Pareto shape of 0.[6-9]"):
        c = res.corrected(seed=0)
    assert float(c.sd_tail_k["v"]) > 0.6 and math.isinf(float(c.sites["v"]["sd_mcse"]))
    assert c.hyper["v"]["sd_mcse"] is c.sites["v"]["sd_mcse"] and math.isfinite(float(c.sites["v"]["sd"]))
    res, exact = _inverse_gamma_variance_fit(3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApproximationWarning)
        c = res.corrected(seed=0)
    s = c.sites["v"]
    assert float(c.sd_tail_k["v"]) < 0.5 and abs(float(s["sd"]) - exact) < 4 * float(s["sd_mcse"])


def test_a_lognormal_scale_whose_moments_are_finite_keeps_its_sd_error():
    """A ``LogNormal(0, 1)`` scale of three weakly informed groups: the proposal's tail shape of ``(s - m)^2`` came
    out 0.556 (the posterior's, from exact draws, 0.446), above the first cut of 0.5, which set ``sd_mcse`` to inf
    and claimed an infinite fourth moment for a scale whose moments are all finite; the corrected sd agrees with the
    exact one (0.886) within 4% and its reported error stands."""
    import scipy.stats as st

    from pyro_convexvb.diagnostics.importance import SD_TAIL_K

    rng = np.random.default_rng(5)
    y = rng.normal(0.5, 0.2, 3) + rng.normal(0.0, 2.0, 3)

    def model(y=None):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 5.0))
        s = pyro.sample("s", dist.LogNormal(torch.tensor(0.0, dtype=D), torch.tensor(1.0, dtype=D)))
        with pyro.plate("g", 3):
            a = pyro.sample("a", dist.Normal(mu, s))
            pyro.sample("y", dist.Normal(a, 2.0), obs=y)

    ls = np.linspace(-12.0, 8.0, 8001)
    sc = np.exp(ls)
    lp = st.lognorm.logpdf(sc, 1.0) + ls + np.array([st.multivariate_normal.logpdf(y, np.zeros(3), np.diag(
        np.full(3, v**2 + 4.0)) + 25.0) for v in sc])
    p = np.exp(lp - lp.max())
    p /= p.sum()
    m = float((p * sc).sum())
    exact = math.sqrt(float((p * (sc - m) ** 2).sum()))
    res = pcv.fit(model, y=torch.tensor(y), engine="dual_vg", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApproximationWarning)
        c = res.corrected(seed=0)
    k, s = float(c.sd_tail_k["s"]), c.sites["s"]
    assert 0.5 < k < SD_TAIL_K and math.isfinite(float(s["sd_mcse"]))
    assert abs(float(s["sd"]) - exact) < 0.04 * exact


def _picklable_model(y=None):
    s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), s).to_event(1))
    pyro.sample("y", dist.Normal(w, 0.5).to_event(1), obs=y)


@pytest.mark.parametrize("strategy", ["grid", "ccd"])
def test_a_result_and_its_correction_pickle_after_diagnostics(strategy):
    """``res.diagnostics`` and ``res.corrected()`` cache a log-joint evaluator (the model under a handler, a closure)
    and proposals whose covariances were closures: ``pickle.dumps(res)`` raised a bare ``AttributeError`` ("Can't
    pickle local object") after either, and a correction did not pickle at all. Both now round-trip, with the same
    summaries, and the unpickled correction still resamples."""
    import pickle

    y = torch.tensor([0.4, -0.9, 1.3], dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(_picklable_model, y=y, engine="dual_vg", options={"hyper_strategy": strategy}, progress=False)
        k_hat = res.diagnostics.k_hat
        c = res.corrected(seed=0)
    back = pickle.loads(pickle.dumps(res))
    assert back.diagnostics.k_hat == k_hat
    assert torch.equal(back.correction.sites["s"]["sd"], c.sites["s"]["sd"])
    c2 = pickle.loads(pickle.dumps(c))
    for key in ("mean", "sd", "sd_mcse"):
        assert torch.equal(c2.sites["w"][key], c.sites["w"][key])
    assert torch.equal(c2.resample(50, seed=1)["s"], c.resample(50, seed=1)["s"])


def _centred_binomial(n, y=None, centred=True):
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 2.0))
    tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=torch.float64)))
    with pyro.plate("g", n.shape[0]):
        if centred:
            th = pyro.sample("theta", dist.Normal(mu, tau))
        else:
            th = mu + tau * pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        pyro.sample("y", dist.Binomial(total_count=n, logits=th), obs=y)


def test_a_correction_from_a_joint_gaussian_over_a_centred_hierarchy_warns():
    """A centred binomial hierarchy (six groups) fitted by svi_automvn: the joint Gaussian over (mu, tau, theta)
    misses the funnel's neck, and the correction came out with tau's 5% quantile at 0.30-0.32 +- 0.03 against an
    exact 0.054 (k_hat 0.63, no warning).  The correction now says what k_hat cannot see; the non-centred model,
    whose field scales read no latent, gets no such warning."""
    from pyro_convexvb.diagnostics import ApproximationWarning
    from pyro_convexvb.infer.hyper import field_scale_sites

    n = torch.tensor([8, 12, 5, 20, 9, 15.0], dtype=torch.float64)
    y = torch.tensor([2, 7, 1, 12, 3, 10.0], dtype=torch.float64)
    assert field_scale_sites(_centred_binomial, (n,), {"y": y}) == {"theta": {"tau"}}
    assert field_scale_sites(_centred_binomial, (n,), {"y": y, "centred": False}) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(_centred_binomial, n, y=y, engine="svi_automvn", options=dict(seed=0, max_steps=1500),
                      progress=False)
    with pytest.warns(ApproximationWarning, match=r"scale\(s\) \['tau'\] of its prior .* centred hierarchy's "
                                                  r"funnel.* write the hierarchy non-centred"):
        res.corrected(num_draws=500, seed=0)


def _student_t_scaled(X, y=None):  # module level: a pickled result keeps its model
    s = pyro.sample("s", dist.LogNormal(torch.tensor(0.0, dtype=torch.float64), 0.3))
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 2.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.StudentT(0.5, X @ w, s), obs=y)


def test_a_corrected_fit_with_integrated_hyper_latents_pickles():
    """The correction's pooled rounds held their covariance blocks in closures, so pickling a result after
    ``corrected()`` of integrated hyper-latents raised; the unpickled result keeps the corrected answer."""
    import pickle

    x = torch.linspace(-1, 1, 10, dtype=torch.float64)
    X = torch.stack([torch.ones(10, dtype=torch.float64), x], 1)
    y = 0.5 + x + torch.tensor([0.3, -5.2, 0.1, -3.2, 0.2, 0.5, -1.0, -0.1, 0.4, 1.5], dtype=torch.float64)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(_student_t_scaled, X, y=y, engine="convex_relaxation", progress=False)
        c = res.corrected(num_draws=500, seed=0)
    back = pickle.loads(pickle.dumps(res))
    assert torch.equal(back.correction.loc, c.loc) and back.correction.diagnostics.proposal == c.diagnostics.proposal


def test_diagnostics_of_a_compacted_result_say_its_data_are_gone():
    """``compact(keep_model=True)`` keeps the model but not its data: the diagnostics called the model without its
    arguments (a bare TypeError); they now say why they cannot run."""
    X = torch.randn(30, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    res = pcv.fit(_student_t_scaled, X, y=X[:, 0], engine="laplace", progress=False)
    for keep in (True, False):
        with pytest.raises(ValueError, match=r"left out \(InferenceResult.compact\(\)"):
            res.compact(keep_model=keep).diagnostics


def test_diagnostics_of_a_loaded_or_copied_compact_result_say_its_data_are_gone(tmp_path):
    """The mark that the data are gone lives on the posterior: a copy of a compacted result (``dataclasses.replace``)
    keeps it, and a result read back by ``pcv.load`` (which never stores the model or its data) carries it too,
    where the diagnostics said the result was "not fitted on a Pyro model"; a posterior bound to its model and
    data again (``with_model``) is evaluated as before."""
    import dataclasses

    X = torch.randn(30, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    res = pcv.fit(_student_t_scaled, X, y=X[:, 0], engine="laplace", progress=False)
    path = str(tmp_path / "fit.pt")
    pcv.save(res, path)
    copied = dataclasses.replace(res.compact(), seconds=0.0)
    for r in (copied, pcv.load(path)):
        assert r.posterior.data_dropped
        with pytest.raises(ValueError, match=r"left out \(InferenceResult.compact\(\).*pcv.load"):
            r.diagnostics
    rebound = dataclasses.replace(res, posterior=copied.posterior.with_model(_student_t_scaled, ((X,), {"y": X[:, 0]})))
    assert not rebound.posterior.data_dropped and not res.posterior.data_dropped
    assert rebound.diagnostics.k_hat == pytest.approx(res.diagnostics.k_hat)


def test_the_advice_to_a_nuts_result_is_not_nuts():
    """A flagged NUTS result (its Gaussian summary of the draws) was told to 'use engine=nuts'; it is told to run
    longer and use the draws, while other engines' results keep the advice."""
    X = torch.randn(30, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    res = pcv.fit(_student_t_scaled, X, y=X[:, 0], engine="nuts", progress=False,
                  options={"num_samples": 40, "warmup_steps": 40, "seed": 0})
    d = res.diagnostics
    assert d.of_draws and d.fallback.startswith("run NUTS longer") and "engine='nuts'" not in d.fallback
    assert pcv.fit(_student_t_scaled, X, y=X[:, 0], engine="laplace", progress=False).diagnostics.fallback == \
        "use engine='nuts'"


def test_to_arviz_of_a_matrix_free_posterior_beyond_the_dense_limit_only_samples():
    """The uncorrected export made its draws through the fitted proposal, which factorises a matrix-free precision
    densely (and refuses above DENSE_MAX latents) for a density it never used; it now draws with the posterior's
    own sampler there: a 4,225-node Poisson field exports, its draws centred on the fitted means."""
    from tests._fields import poisson_lattice

    az = _arviz()
    m = 65
    model, y = poisson_lattice(m, 0.5)

    res = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    assert res.posterior.kind == "precision_operator" and res.posterior.n > 4000
    idata = res.to_arviz(num_draws=200)
    assert isinstance(idata, az.InferenceData) and idata.posterior["f"].shape == (4, 50, m * m)
    draws = idata.posterior["f"].values.reshape(200, -1)
    err = (draws.mean(0) - res.posterior.loc.numpy()) / res.posterior.scale.numpy()
    assert np.abs(err).mean() < 0.15  # the mean of 200 draws: about 0.056 sds on average
