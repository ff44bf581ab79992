"""The shared estimator layer (pyro_convexvb/estimator_base.py): declared parameter constraints, and
``max_iter`` / ``tol`` / ``random_state`` with scikit-learn's meanings on every estimator where they apply --
each either changes the fit or is refused -- with the deprecated old names (``seed``, ``maxiter``, ``max_steps``,
``rtol``) still working behind a ``FutureWarning``."""
import math
import warnings

import numpy as np
import pytest
import torch
from sklearn.utils._param_validation import InvalidParameterError
from sklearn.utils.estimator_checks import check_param_validation

import pyro_convexvb as pcv
from pyro_convexvb.estimator_base import engine_options, renamed, seed_from
from pyro_convexvb.gp import GPClassifier
from pyro_convexvb.infer.registry import get_engine
from pyro_convexvb.online import (OnlineADF, OnlineAdaGradLogistic, OnlineBayesLogistic, OnlineDimGauss,
                                  OnlineMarginalVB)

from _estimators import binary_problem, estimator_factories

FACTORIES = estimator_factories()


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        return fn()


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_parameter_is_declared_and_checked_at_fit(name):
    """scikit-learn's own check: a constraint per parameter, and a bad type or value raises InvalidParameterError
    naming the parameter from fit (and partial_fit)."""
    est = FACTORIES[name]()
    check_param_validation(type(est).__name__, est)


def test_booleans_are_not_counts():
    X, y = binary_problem()
    for est, param in [(pcv.BayesianLogisticRegression(num_points=True), "num_points"),
                       (pcv.BayesianLinearRegression(max_iter=True), "max_iter"),
                       (pcv.GLM(num_components=True), "num_components"),
                       (OnlineBayesLogistic(max_iter=True), "max_iter")]:
        with pytest.raises(InvalidParameterError, match=f"'{param}' parameter of {type(est).__name__}"):
            est.fit(X, y)


def _coef(est):
    return np.asarray(est.coef_).ravel()


# ------------------------------------------------------------------------------ BayesianLogisticRegression
def test_logistic_max_iter_and_tol_reach_the_engine():
    X, y = binary_problem()
    ref = pcv.BayesianLogisticRegression().fit(X, y)
    capped = _quiet(lambda: pcv.BayesianLogisticRegression(max_iter=1).fit(X, y))
    assert capped.n_iter_ < ref.n_iter_ and not capped.converged_
    assert np.abs(_coef(capped) - _coef(ref)).max() > 1e-6
    loose = pcv.BayesianLogisticRegression(tol=1.0).fit(X, y)  # duality gap of 1 nat
    assert loose.n_iter_ < ref.n_iter_ and np.abs(_coef(loose) - _coef(ref)).max() > 1e-8
    # the same fit as the engine's own option names
    same = pcv.BayesianLogisticRegression(options={"gap_tol": 1.0}).fit(X, y)
    np.testing.assert_array_equal(_coef(same), _coef(loose))
    lap = pcv.BayesianLogisticRegression(engine="laplace", max_iter=2).fit
    assert _quiet(lambda: lap(X, y)).n_iter_ <= 3


def test_logistic_random_state_seeds_a_stochastic_engine_and_dual_vg_draws_nothing():
    X, y = binary_problem(n=40)

    def svi(rs):
        return pcv.BayesianLogisticRegression(engine="svi_autonormal", max_iter=30, random_state=rs,
                                              options={"min_steps": 30, "window": 10})
    a, b, c = (_quiet(lambda rs=rs: svi(rs).fit(X, y)) for rs in (0, 0, 1))
    np.testing.assert_array_equal(_coef(a), _coef(b))
    assert np.abs(_coef(a) - _coef(c)).max() > 1e-6
    d = _quiet(lambda: svi(np.random.RandomState(0)).fit(X, y))  # a RandomState: the seed drawn from it
    e = _quiet(lambda: svi(seed_from(np.random.RandomState(0))).fit(X, y))
    np.testing.assert_array_equal(_coef(d), _coef(e))
    # dual_vg is deterministic: every random_state gives the same fit
    np.testing.assert_array_equal(_coef(pcv.BayesianLogisticRegression(random_state=0).fit(X, y)),
                                  _coef(pcv.BayesianLogisticRegression(random_state=7).fit(X, y)))
    # so is convex_relaxation with exact variances ("auto" on this small dense problem), as documented; with
    # Lanczos variances the seed of the start vectors changes the fit
    for variance, same in (("auto", True), ("exact", True), ("lanczos", False)):
        cr = [_quiet(lambda rs=rs: pcv.BayesianLogisticRegression(
            engine="convex_relaxation", random_state=rs, options={"variance": variance, "lanczos_rank": 2}
            if variance == "lanczos" else {"variance": variance}).fit(X, y)) for rs in (0, 7)]
        assert np.array_equal(_coef(cr[0]), _coef(cr[1])) == same, variance


def test_logistic_knobs_an_engine_lacks_or_set_twice_are_refused():
    X, y = binary_problem(n=20)
    with pytest.raises(ValueError, match="max_iter=5, but engine 'nuts' has no option"):
        pcv.BayesianLogisticRegression(engine="nuts", max_iter=5).fit(X, y)
    with pytest.raises(ValueError, match="tol=0.1, but engine 'nuts'"):
        pcv.BayesianLogisticRegression(engine="nuts", tol=0.1).fit(X, y)
    with pytest.raises(ValueError, match=r"max_iter=5 and options=\{'max_iter': 9\}"):
        pcv.BayesianLogisticRegression(max_iter=5, options={"max_iter": 9}).fit(X, y)
    # out of the engine option's range: named by the estimator's parameter and the option it sets
    with pytest.raises(ValueError, match="max_iter=0 sets option 'max_steps' of engine 'svi_autonormal', which must "
                                         "be >= 1"):
        pcv.BayesianLogisticRegression(engine="svi_autonormal", max_iter=0).fit(X, y)
    with pytest.raises(ValueError, match="max_iter=0 sets option 'max_iter' of engine 'dual_vg', which must be >= 1"):
        pcv.BayesianLogisticRegression(max_iter=0).fit(X, y)


def test_engine_options_maps_onto_each_engines_names():
    est = pcv.BayesianLogisticRegression(max_iter=7, tol=1e-3, random_state=3)
    assert engine_options(est, get_engine("dual_vg"), None) == {"max_iter": 7, "gap_tol": 1e-3}
    assert engine_options(est, get_engine("convex_relaxation"), {"cg_tol": 1e-9}) == {
        "cg_tol": 1e-9, "max_outer": 7, "phi_tol": 1e-3, "seed": 3}
    assert engine_options(est, get_engine("laplace"), None) == {"max_iter": 7, "grad_tol": 1e-3, "seed": 3}
    assert engine_options(est, get_engine("svi_autonormal"), None) == {"max_steps": 7, "rtol": 1e-3, "seed": 3}
    assert engine_options(pcv.BayesianLogisticRegression(), get_engine("dual_vg"), None) == {}


# ------------------------------------------------------------------------------ GLM
def _glm(**kw):
    kw = {"min_steps": 20, "window": 10, "lr": 0.1, "max_iter": 40, **kw}
    return pcv.GLM("bernoulli", **kw)


def test_glm_max_iter_tol_random_state_change_the_fit():
    X, y = binary_problem(n=60)
    ref = _quiet(lambda: _glm().fit(X, y))
    assert ref.n_iter_ == 40
    short = _quiet(lambda: _glm(max_iter=25).fit(X, y))
    assert short.n_iter_ == 25 and not np.allclose(short.posterior_.locs, ref.posterior_.locs)
    # a loose plateau tolerance stops at the first window past min_steps
    assert _quiet(lambda: _glm(max_iter=200, tol=10.0).fit(X, y)).n_iter_ < 200
    np.testing.assert_array_equal(_quiet(lambda: _glm(random_state=0).fit(X, y)).posterior_.locs,
                                  ref.posterior_.locs)
    assert not np.allclose(_quiet(lambda: _glm(random_state=1).fit(X, y)).posterior_.locs, ref.posterior_.locs)


def test_glm_min_steps_beyond_max_iter_is_refused_by_the_estimators_names():
    X, y = binary_problem(n=20)
    with pytest.raises(ValueError, match="GLM: min_steps=50 exceeds max_iter=40"):
        _glm(min_steps=50).fit(X, y)


def test_glm_old_names_warn_and_fit_alike():
    X, y = binary_problem(n=60)
    new = _quiet(lambda: _glm(max_iter=30, tol=1e-3, random_state=2).fit(X, y))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        old = _quiet(lambda: pcv.GLM("bernoulli", min_steps=20, window=10, lr=0.1, max_steps=30, rtol=1e-3,
                                     seed=2).fit(X, y))
    future = [w for w in record if w.category is FutureWarning]
    assert {str(w.message).split("'")[1] for w in future} == {"max_steps", "rtol", "seed"}
    assert {w.filename for w in future} == {__file__}  # the caller's line
    np.testing.assert_array_equal(old.posterior_.locs, new.posterior_.locs)
    assert old.n_iter_ == 30
    with pytest.raises(ValueError, match="both seed=2 and random_state=3 given"):
        pcv.GLM(seed=2, random_state=3).fit(X, y)


# ------------------------------------------------------------------------------ BayesianLinearRegression
def test_blr_max_iter_and_tol_change_the_fit_and_it_has_no_random_state():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 3))
    y = X @ [1.0, -2.0, 0.5] + 0.3 * rng.normal(size=50)
    ref = pcv.BayesianLinearRegression().fit(X, y)
    capped = _quiet(lambda: pcv.BayesianLinearRegression(max_iter=1).fit(X, y))
    assert capped.n_iter_ < ref.n_iter_ and abs(capped.noise_var_ - ref.noise_var_) > 1e-6
    loose = pcv.BayesianLinearRegression(tol=1e2).fit(X, y)
    assert loose.n_iter_ < ref.n_iter_
    assert "random_state" not in ref.get_params()  # closed form and L-BFGS: nothing random


# ------------------------------------------------------------------------------ GPClassifier
def test_gp_max_iter_tol_random_state_reach_the_engine():
    X, y = binary_problem(n=30, d=2)
    ref = GPClassifier().fit(X, y)
    capped = _quiet(lambda: GPClassifier(max_iter=1).fit(X, y))
    assert capped.n_iter_ < ref.n_iter_
    assert np.abs(capped.predict_latent(X)[0] - ref.predict_latent(X)[0]).max() > 1e-6
    assert GPClassifier(tol=10.0).fit(X, y).n_iter_ < ref.n_iter_

    def svi(rs):
        return _quiet(lambda: GPClassifier(engine="svi_autonormal", max_iter=20, random_state=rs,
                                           options={"min_steps": 20, "window": 10}).fit(X, y).predict_latent(X)[0])
    np.testing.assert_array_equal(svi(0), svi(0))
    assert np.abs(svi(0) - svi(1)).max() > 1e-6
    # as documented, dual_vg and laplace draw nothing for a GP classifier: every random_state gives the same fit
    for engine in ("dual_vg", "laplace"):
        np.testing.assert_array_equal(GPClassifier(engine=engine, random_state=0).fit(X, y).predict_latent(X)[0],
                                      GPClassifier(engine=engine, random_state=7).fit(X, y).predict_latent(X)[0])


# ------------------------------------------------------------------------------ online learners
def test_online_max_iter_and_tol_change_the_newton_updates():
    X, y = binary_problem(n=200, d=4)
    for cls, kw in [(OnlineBayesLogistic, dict(prior_var=4.0, mean_update="newton")),
                    (OnlineDimGauss, dict(prior_var=4.0))]:
        ref = cls(fast=False, **kw).fit(X, y)
        with pytest.warns(pcv.ConvergenceWarning, match="max_iter=1"):
            capped = cls(fast=False, max_iter=1, **kw).fit(X, y)
        assert np.abs(capped.coef_ - ref.coef_).max() > 1e-8
        loose = cls(fast=False, tol=0.5, **kw).fit(X, y)
        assert np.abs(loose.coef_ - ref.coef_).max() > 1e-10
        with pytest.warns(FutureWarning, match="'maxiter' is deprecated"):
            old = _quiet(lambda: cls(fast=False, maxiter=1, **kw).fit(X, y))
        np.testing.assert_array_equal(old.coef_, capped.coef_)
        assert old.state_dict()["config"]["max_iter"] == 1


def test_online_state_saved_under_the_old_name_loads():
    X, y = binary_problem(n=50, d=4)
    m = OnlineBayesLogistic(prior_var=1.0, mean_update="newton", max_iter=7).fit(X, y)
    state = m.state_dict()
    state["config"] = {("maxiter" if k == "max_iter" else k): v for k, v in state["config"].items()}
    again = OnlineBayesLogistic.from_state_dict(state)
    assert again.max_iter == 7 and again.maxiter == "deprecated"
    np.testing.assert_array_equal(again.coef_, m.coef_)
    OnlineBayesLogistic(prior_var=1.0, mean_update="newton", max_iter=7).load_state_dict(state)


def test_online_marginal_vb_random_state():
    X, y = binary_problem(n=60, d=3)

    def fit(**kw):
        return OnlineMarginalVB(num_samples=8, fast=False, **kw).fit(X, y).coef_
    np.testing.assert_array_equal(fit(random_state=3), fit(random_state=3))
    assert np.abs(fit(random_state=3) - fit(random_state=4)).max() > 1e-8
    with pytest.warns(FutureWarning, match="'seed' is deprecated"):
        np.testing.assert_array_equal(fit(seed=3), fit(random_state=3))


def test_online_learners_without_iterations_take_no_knobs():
    for cls in (OnlineADF, OnlineAdaGradLogistic):
        params = cls().get_params()
        assert not {"max_iter", "tol", "random_state"} & set(params)


def test_renamed_refuses_both_names():
    est = OnlineMarginalVB(seed=1, random_state=2)
    with pytest.raises(ValueError, match="both seed=1 and random_state=2"):
        renamed(est, "seed", "random_state")
    with pytest.warns(FutureWarning):
        assert renamed(OnlineMarginalVB(seed=1, random_state=1), "seed", "random_state") == 1


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation", "laplace", "svi_autonormal"])
def test_n_iter_counts_the_engines_iterations_within_max_iter(engine):
    """``n_iter_`` is the engine's own count: it was the history's rows (one above max_iter where the history holds
    the start) or, for the SVI engines, windows of 250 steps (0 after 50 steps)."""
    X, y = binary_problem(n=60, d=3)
    for cap in (1, 3, 50):
        m = _quiet(lambda: pcv.BayesianLogisticRegression(engine=engine, max_iter=cap).fit(X, y))
        assert 1 <= m.n_iter_ <= cap
    if engine == "svi_autonormal":
        assert m.n_iter_ == 50  # stopped by the cap: every step counts
    rng = np.random.default_rng(0)
    Xr = rng.normal(size=(40, 3))
    yr = Xr @ [1.0, -2.0, 0.5] + rng.normal(size=40)
    assert _quiet(lambda: pcv.BayesianLinearRegression(max_iter=1).fit(Xr, yr)).n_iter_ == 1


@pytest.mark.parametrize("engine", ["laplace", "dual_vg"])
def test_n_iter_of_a_type2_fit_counts_the_outer_loop(engine):
    """With type-II learning (``prior_scale="auto"``, ``learn_hyperparameters=True``) ``n_iter_`` is the outer
    L-BFGS-B loop's iterations, as BayesianLinearRegression's evidence maximisation and scikit-learn's
    BayesianRidge; it was the last refit's own count. A loop capped at k iterations reports k."""
    X, y = binary_problem(n=80, d=3)
    full = _quiet(lambda: pcv.BayesianLogisticRegression(engine=engine, prior_scale="auto").fit(X, y))
    outer = full.result_.info["type2"]["iterations"]
    assert full.n_iter_ == outer == full.result_.type2_iterations and outer >= 3
    assert full.result_.iterations != outer  # the last fit's own count, not the loop's
    for k in (1, 2):
        capped = _quiet(lambda: pcv.BayesianLogisticRegression(engine=engine, prior_scale="auto",
                                                               options={"type2_max_iter": k}).fit(X, y))
        assert capped.n_iter_ == k and capped.result_.type2_iterations == k
        assert abs(capped.prior_scale_ - full.prior_scale_) > 1e-6  # the cap stopped the loop short
    fixed = pcv.BayesianLogisticRegression(engine=engine).fit(X, y)  # no type-II: the engine's own count
    assert fixed.result_.type2_iterations is None and fixed.n_iter_ == fixed.result_.iterations >= 1
    gpc = _quiet(lambda: GPClassifier(engine=engine, learn_hyperparameters=True, hyper_options={"max_iter": 3})
                 .fit(X, y))
    assert gpc.n_iter_ == 3 == gpc.hyper_result_.info["type2"]["iterations"]
    assert gpc.result_.iterations <= 1  # the fit at the learned values starts from the loop's last state
    plain = GPClassifier(engine=engine).fit(X, y)
    assert plain.n_iter_ == plain.result_.iterations >= 1


def test_n_iter_of_nuts_is_its_steps_with_warm_up():
    """NUTS has no max_iter; its n_iter_ was 1 (the history's single row), now the chain's steps."""
    X, y = binary_problem(n=30, d=2)
    m = _quiet(lambda: pcv.BayesianLogisticRegression(engine="nuts", options={"num_samples": 20, "warmup_steps": 10},
                                                      random_state=0).fit(X, y))
    assert m.n_iter_ == 30


@pytest.mark.parametrize("cls", [pcv.BayesianLinearRegression, pcv.GLM, pcv.BayesianLogisticRegression, GPClassifier])
def test_every_parameter_is_documented(cls):
    """Every constructor parameter has a ``:param ...:`` entry in the class docstring (GLM's ``learn_prior_var``,
    ``learn_noise``, ``learn_basis`` and GPClassifier's ``learn_mean`` had none)."""
    import re

    documented = set(re.findall(r":param (?:[\w\[\], .]+ )?(\w+):", cls.__doc__))
    assert sorted(set(cls().get_params()) - documented) == []


def test_logistic_intercept_scale_without_an_intercept_is_warned_of():
    """An ``intercept_scale`` that ``fit_intercept=False`` leaves unused is named in a UserWarning (it was ignored
    silently); the default, or an intercept, warns of nothing; the fit is the one without it."""
    X, y = binary_problem()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = pcv.BayesianLogisticRegression(fit_intercept=False, intercept_scale=0.5).fit(X, y)
        pcv.BayesianLogisticRegression(fit_intercept=False).fit(X, y)
        pcv.BayesianLogisticRegression(intercept_scale=0.5).fit(X, y)
    assert [str(m.message) for m in w if m.category is UserWarning] == [
        "BayesianLogisticRegression: intercept_scale=0.5 is not used (fit_intercept=False fits no intercept); leave "
        "it at its default"]
    b = pcv.BayesianLogisticRegression(fit_intercept=False).fit(X, y)
    np.testing.assert_array_equal(a.coef_, b.coef_)
    assert a.intercept_.tolist() == [0.0]


@pytest.mark.parametrize("cls", [OnlineBayesLogistic, OnlineDimGauss])
def test_online_newton_options_with_the_taylor_update_are_warned_of(cls):
    """``tol`` and ``max_iter`` bound the Newton iteration of ``mean_update="newton"``; the one-step ``"taylor"``
    update has none, so they were accepted and ignored silently: now named in a UserWarning. The fit is the one
    with the defaults (bit for bit); with ``"newton"`` they warn of nothing and change the fit."""
    X, y = binary_problem()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = cls(mean_update="taylor", tol=0.1, max_iter=1).fit(X, y)
        cls(mean_update="taylor").fit(X, y)
        c = cls(mean_update="newton", tol=0.1, max_iter=1).fit(X, y)
    assert [str(m.message) for m in w if m.category is UserWarning] == [
        f"{cls.__name__}: tol=0.1, max_iter=1 are not used (mean_update='taylor' is one closed-form step; tol and "
        "max_iter bound mean_update='newton'); leave them at their defaults"]
    b = cls(mean_update="taylor").fit(X, y)
    np.testing.assert_array_equal(a.coef_, b.coef_)
    d = cls(mean_update="newton").fit(X, y)
    assert np.abs(c.coef_ - d.coef_).max() > 1e-6


@pytest.mark.parametrize("make", [lambda: pcv.BayesianLogisticRegression(engine="nope"),
                                  lambda: GPClassifier(engine="nope")])
def test_an_unregistered_engine_name_is_a_value_error_naming_engine(make):
    """A bad ``engine`` value raises a ``ValueError`` (what scikit-learn's callers catch for a bad parameter value)
    naming the parameter and the registered engines, not the registry's ``KeyError``."""
    X, y = binary_problem()
    with pytest.raises(ValueError, match=r"engine='nope' is not a registered engine; use one of \[.*'dual_vg'"):
        make().fit(X, y)


@pytest.mark.parametrize("var", [0.5, 20.0, 90.0, 400.0, 2500.0])
@pytest.mark.parametrize("mean", [0.5, 5.0, 30.0, 100.0])
def test_predictive_log_probs_against_adaptive_quadrature(mean, var):
    """log E[sigmoid(-eta)] under N(mean, var) against scipy's adaptive quadrature of the shifted integrand: plain
    Gauss-Hermite was off by up to 0.1 in log p at a variance of 400 (its nodes miss the sigmoid's step and the
    small probability's mass far from the mean), nodes centred at the integrand's mode by 2e-3 (and gave
    p = 0.50000 for 0.50399 at a variance of 2500, a wrong class); both probabilities sum to one."""
    from scipy.integrate import quad
    from scipy.special import log_expit

    from pyro_convexvb.estimator_base import predictive_log_probs

    sd = math.sqrt(var)
    log_f = lambda z: log_expit(-(mean + sd * z)) - 0.5 * z * z  # noqa: E731
    c = max(log_f(z) for z in np.linspace(-60, 60, 24001))
    val = quad(lambda z: math.exp(log_f(z) - c), -60, 60, points=[-mean / sd], limit=500, epsabs=0, epsrel=1e-13)[0]
    ref = math.log(val) + c - 0.5 * math.log(2 * math.pi)
    lp0, lp1 = predictive_log_probs(torch.tensor([mean], dtype=torch.float64), torch.tensor([var], dtype=torch.float64))
    assert float(lp0) == pytest.approx(ref, abs=1e-9, rel=1e-10)
    assert float(lp0.exp() + lp1.exp()) == pytest.approx(1.0, abs=1e-14)


@pytest.mark.parametrize("var", [0.5, 20.0, 90.0])
def test_logit_and_binomial_predictive_means_against_adaptive_quadrature(var):
    """``BernoulliLogit.predictive_mean`` (and a logit Binomial's, ``n`` times it) is ``E[sigmoid(eta)]`` by the
    same mode-centred quadrature as the classifiers' probabilities: plain 64-node Gauss-Hermite was 2e-3 off (0.4%) at a
    variance of 90 and a mean of 5."""
    from scipy.integrate import quad
    from scipy.special import expit

    from pyro_convexvb.lgm.families import Binomial, BernoulliLogit

    means = [-5.0, 0.5, 5.0]
    sd = math.sqrt(var)
    ref = [quad(lambda z: expit(m + sd * z) * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi), -60, 60,
                points=[-m / sd], limit=500, epsabs=1e-15, epsrel=1e-12)[0] for m in means]
    mean = torch.tensor(means, dtype=torch.float64)
    v = torch.full((3,), var, dtype=torch.float64)
    y = torch.ones(3, dtype=torch.float64)
    got = BernoulliLogit(y).predictive_mean(mean, v)
    np.testing.assert_allclose(got.numpy(), ref, rtol=3e-5, atol=1e-7)
    n = torch.tensor([3.0, 7.0, 10.0], dtype=torch.float64)
    got = Binomial(y, n).predictive_mean(mean, v)
    np.testing.assert_allclose(got.numpy(), n.numpy() * np.array(ref), rtol=3e-5, atol=1e-6)


@pytest.mark.parametrize("var", [3.0, 25.0, 100.0, 1000.0, 1e4])
@pytest.mark.parametrize("mean", [0.0, 0.5, -7.0, 60.0])
def test_logit_expected_log_prob_at_wide_site_variances(mean, var):
    """``E softplus(eta)`` of a Bernoulli-logit site (the evidence bound's site term) against scipy's adaptive
    quadrature, and its derivatives those of the value (finite differences): 64-node Gauss-Hermite was 2e-3 off at a
    site variance of 100 and 7e-2 at 1000, either sign, so a reported bound could exceed the true bound's maximum."""
    from scipy.integrate import quad

    from pyro_convexvb.lgm.families.logit import BernoulliLogit

    sd = math.sqrt(var)
    ref = quad(lambda z: np.logaddexp(0.0, mean + sd * z) * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi),
               -40, 40, points=[-mean / sd], limit=1000, epsabs=1e-15, epsrel=1e-14)[0]
    fam = BernoulliLogit(torch.ones(1, dtype=torch.float64))
    m, v = torch.tensor([mean], dtype=torch.float64), torch.tensor([var], dtype=torch.float64)
    value, d_mean, d_var = fam.expected_log_prob_terms(m, v)
    assert float(mean - fam.expected_log_prob(m, v)) == pytest.approx(ref, abs=1e-11)
    assert float(mean - value) == pytest.approx(ref, abs=1e-11 if var > 4 else 1e-8)  # 32 Gauss-Hermite nodes below
    h, hv = 1e-5, 1e-6 * var
    fd_m = float(fam.expected_log_prob_terms(m + h, v)[0] - fam.expected_log_prob_terms(m - h, v)[0]) / (2 * h)
    fd_v = float(fam.expected_log_prob_terms(m, v + hv)[0] - fam.expected_log_prob_terms(m, v - hv)[0]) / (2 * hv)
    assert float(d_mean) == pytest.approx(fd_m, abs=1e-8)
    assert float(d_var) == pytest.approx(fd_v, abs=1e-8, rel=1e-6)


@pytest.mark.parametrize("out", ["numpy", "float32"])
def test_a_basis_returning_another_type_is_named(out):
    """A user basis returning NumPy or float32 features: an error naming ``basis`` (a bare AttributeError or torch's
    addmv dtype error before)."""
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(30, 2)), rng.normal(size=30)
    basis = (lambda Z: Z.numpy()) if out == "numpy" else (lambda Z: Z.float())
    for est in (pcv.BayesianLinearRegression(basis=basis), pcv.GLM("gaussian", basis=basis)):
        with pytest.raises(ValueError, match="basis must return"):
            est.fit(X, y)
