"""The guide of a hyper-latent fit (``HyperPosterior.as_guide()``) as a Pyro user uses it: ``Predictive`` (also
``parallel=True``), trace log densities, ``Trace_ELBO`` and importance weights.

The model is linear-Gaussian given the group scale ``s ~ HalfNormal(1)``, so the exact answer is a 1-D quadrature
over ``log s`` of closed forms, computed here independently of the package.
"""
import math
import pickle

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import Predictive, Trace_ELBO
from pyro.poutine.util import site_is_subsample

import pyro_convexvb as pcv

D = torch.float64
J = 4


def _data(rows_per_group):
    g = torch.arange(J * rows_per_group) % J
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(g.shape[0], generator=gen, dtype=D) + torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=D)[g]
    return g, y


def group_model(g, y=None):
    """``s ~ HalfNormal(1)``, ``a_j ~ N(0, s^2)`` in a plate, ``y_i ~ N(a[g_i], 1)``; vectorisable over samples."""
    s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    with pyro.plate("groups", J):
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=D), s))
    with pyro.plate("data", g.shape[0]):
        pyro.sample("y", dist.Normal(a[..., g], 1.0), obs=y)


def _exact(g, y, m=4001):
    """``log p(y)``, the 5/50/95% quantiles of ``s`` and the mean and variance of ``a`` by quadrature on ``log s``."""
    A = torch.nn.functional.one_hot(g, J).to(D)
    N = g.shape[0]
    ls = torch.linspace(-9.0, 3.0, m, dtype=D)
    s = ls.exp()
    C = s[:, None, None] ** 2 * (A @ A.T) + torch.eye(N, dtype=D)
    loglik = dist.MultivariateNormal(torch.zeros(N, dtype=D), covariance_matrix=C).log_prob(y)
    lp = loglik + dist.HalfNormal(torch.tensor(1.0, dtype=D)).log_prob(s) + ls  # density of log s
    h = float(ls[1] - ls[0])
    log_z = float(torch.logsumexp(lp, 0)) + math.log(h)
    w = torch.softmax(lp, 0)
    cdf = w.cumsum(0)
    quantiles = {p: float(s[int((cdf >= p).nonzero()[0])]) for p in (0.05, 0.5, 0.95)}
    P = torch.eye(J, dtype=D) / s[:, None, None] ** 2 + A.T @ A
    Cov = torch.linalg.inv(P)
    means = (Cov @ (A.T @ y)[:, None]).squeeze(-1)
    mean = (w[:, None] * means).sum(0)
    var = (w[:, None] * (torch.diagonal(Cov, dim1=-2, dim2=-1) + means**2)).sum(0) - mean**2
    return log_z, quantiles, mean, var


def _assert_draws_have_quantiles(draws, quantiles):
    """The fraction of ``draws`` below each reported quantile ``{p: q}`` is ``p`` within 4.5 Monte Carlo sds."""
    S = draws.shape[0]
    for p, q in quantiles.items():
        frac = float((draws <= q).double().mean())
        assert abs(frac - p) < 4.5 * math.sqrt(p * (1 - p) / S), (p, frac, float(q))


@pytest.fixture(scope="module")
def grid_fit():
    g, y = _data(6)
    return g, y, pcv.fit(group_model, g, y=y, engine="dual_vg", progress=False)


def test_parallel_predictive_draws_follow_the_hyper_marginals_and_the_field_mixture(grid_fit):
    """``Predictive(parallel=True)`` ran the guide once for all samples: every draw was the same."""
    g, y, res = grid_fit
    post = res.posterior
    assert res.hyper["strategy"] == "grid"
    S = 40000
    pred = Predictive(group_model, guide=post.as_guide(), num_samples=S, parallel=True)(g)
    s, a = pred["s"].reshape(S), pred["a"].reshape(S, J)
    assert s.unique().numel() > S // 2
    _, exact_q, exact_mean, exact_var = _exact(g, y)
    _assert_draws_have_quantiles(s, res.hyper["marginals"]["s"]["quantiles"])
    for p, q in res.hyper["marginals"]["s"]["quantiles"].items():
        assert float(q) == pytest.approx(exact_q[p], rel=0.02), (p, float(q), exact_q[p])
    # the field's draws have the mixture's moments (and the mixture those of the exact posterior)
    se = (post.variance / S).sqrt()
    assert float(((a.mean(0) - post.loc).abs() / se).max()) < 4.5
    torch.testing.assert_close(a.var(0), post.variance, rtol=0.03, atol=0)
    torch.testing.assert_close(post.loc, exact_mean, rtol=0, atol=0.01 * float(exact_var.sqrt().min()))
    torch.testing.assert_close(post.variance, exact_var, rtol=0.01, atol=0)
    # and the sequential path draws the same distribution
    seq = Predictive(group_model, guide=post.as_guide(), num_samples=2000)(g)
    assert seq["s"].unique().numel() == 2000
    assert float(((seq["a"].reshape(2000, J).mean(0) - post.loc).abs() / (post.variance / 2000).sqrt()).max()) < 4.5


def test_on_a_central_composite_design_the_field_draws_follow_the_mixture_weights():
    """Pairing each ``theta`` draw with its nearest design point weighted the field's components by the masses of the
    design points' cells (0.42, 0.24, 0.33 here), not by their weights (0.18, 0.30, 0.53): the draws' mean was 0.06
    sd off ``posterior.loc`` and their variance 4% below ``posterior.variance``."""
    g, y = _data(1)  # one row per group: the field's spread comes mostly from s
    res = pcv.fit(group_model, g, y=y, engine="dual_vg", options={"hyper_strategy": "ccd"}, progress=False)
    post = res.posterior
    assert res.hyper["strategy"] == "ccd" and post.num_points == 3
    S = 200000
    pred = Predictive(group_model, guide=post.as_guide(), num_samples=S, parallel=True)(g)
    s, a = pred["s"].reshape(S), pred["a"].reshape(S, J)
    se = (post.variance / S).sqrt()
    assert float(((a.mean(0) - post.loc).abs() / se).max()) < 4.5
    torch.testing.assert_close(a.var(0), post.variance, rtol=0.012, atol=0)
    _assert_draws_have_quantiles(s, res.hyper["marginals"]["s"]["quantiles"])


def group_and_noise_model(g, y=None):
    """:func:`group_model` with the noise scale ``t ~ HalfNormal(1)`` a second hyper-latent (a 2-D grid)."""
    s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    t = pyro.sample("t", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    with pyro.plate("groups", J):
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=D), s))
    with pyro.plate("data", g.shape[0]):
        pyro.sample("y", dist.Normal(a[..., g], t), obs=y)


def test_two_hyper_latents_draws_follow_their_marginals_and_the_field_mixture():
    g, y = _data(3)
    res = pcv.fit(group_and_noise_model, g, y=y, engine="dual_vg", progress=False)
    post = res.posterior
    assert res.hyper["strategy"] == "grid" and post.x.shape[1] == 2
    S = 100000
    pred = Predictive(group_and_noise_model, guide=post.as_guide(), num_samples=S, parallel=True)(g)
    a = pred["a"].reshape(S, J)
    se = (post.variance / S).sqrt()
    assert float(((a.mean(0) - post.loc).abs() / se).max()) < 4.5
    torch.testing.assert_close(a.var(0), post.variance, rtol=0.02, atol=0)
    for name in ("s", "t"):
        _assert_draws_have_quantiles(pred[name].reshape(S), res.hyper["marginals"][name]["quantiles"])


def test_guide_log_density_is_the_density_of_its_draws(grid_fit):
    """The guide's sites were Deltas of log density 0 (and of the wrong event_dim inside plates, so ``Trace_ELBO``
    raised): importance weights and ELBOs computed from its traces were wrong. Now ``E_q[p(y, s, a) / q]`` is the
    evidence and ``Trace_ELBO`` a bound just below it."""
    g, y, res = grid_fit
    log_z, _, _, _ = _exact(g, y)
    guide = res.posterior.as_guide()
    elbo = -Trace_ELBO(num_particles=20000, vectorize_particles=True, max_plate_nesting=1).loss(
        group_model, guide, g, y=y)
    assert log_z - 0.02 < elbo < log_z + 0.005, (elbo, log_z)
    # importance weights p(y, s, a) / q(s, a) of guide traces replayed through the model, 20000 particles at once
    S = 20000
    with pyro.plate("particles", S, dim=-2):
        guide_tr = poutine.trace(guide).get_trace(g)
        model_tr = poutine.trace(poutine.replay(group_model, trace=guide_tr)).get_trace(g, y=y)
    log_w = 0.0
    for tr, sign in ((model_tr, 1.0), (guide_tr, -1.0)):
        tr.compute_log_prob()
        for site in tr.nodes.values():
            if site["type"] == "sample" and not site_is_subsample(site):
                log_w = log_w + sign * site["log_prob"].reshape(S, -1).sum(1)
    est = float(torch.logsumexp(log_w, 0)) - math.log(S)
    assert est == pytest.approx(log_z, abs=0.005), (est, log_z)
    assert float(log_w.mean()) == pytest.approx(elbo, abs=0.01)
    # the trace's log density is the guide's joint density of (s, a): the Jacobian of s = exp(z) included
    tr = poutine.trace(guide).get_trace(g)
    tr.compute_log_prob()
    aux = [n for n in tr.nodes if n.endswith("_latent")][0]
    s = tr.nodes["s"]["value"]
    assert float(tr.nodes["s"]["log_prob"]) == pytest.approx(-math.log(float(s)), rel=1e-12)
    total = float(tr.log_prob_sum())
    assert total == pytest.approx(float(tr.nodes[aux]["log_prob"]) - math.log(float(s)), rel=1e-12)


def test_as_guide_with_the_fitted_model_predicts_on_new_inputs(grid_fit):
    g, y, res = grid_fit
    g_new = torch.tensor([0, 3, 3])
    pred = Predictive(group_model, guide=res.posterior.as_guide(group_model), num_samples=50, parallel=True)(g_new)
    assert pred["y"].shape == (50, 3) and pred["s"].reshape(-1).unique().numel() == 50
    with pytest.raises(ValueError, match="trainable"):
        res.posterior.as_guide(trainable=True)


def test_compact_drops_the_design_points_data():
    """``HyperPosterior.compact()`` kept every design point's posterior as it was: their fitting data and, for
    ``convex_relaxation``, their matrix-free precisions (which hold the data), so a compacted result grew with the
    number of rows (282 kB against 28 kB at 800 rows)."""
    sizes = []
    for rows in (6, 60):
        g, y = _data(rows)
        res = pcv.fit(group_model, g, y=y, engine="convex_relaxation", progress=False)
        post, small = res.posterior, res.posterior.compact()
        sizes.append(len(pickle.dumps(small)))
        for c, d in zip(post.components, small.components):
            assert d.model_args == ((), {}) and d.kind == "precision"
            torch.testing.assert_close(d.covariance(), c.covariance(), rtol=1e-10, atol=0)
        torch.testing.assert_close(small.loc, post.loc, rtol=0, atol=0)
        torch.testing.assert_close(small.variance, post.variance, rtol=0, atol=0)
    assert sizes[1] < 1.2 * sizes[0], sizes
    S = 20000
    pred = Predictive(group_model, guide=small.as_guide(group_model, model_args=(g,), model_kwargs={"y": y}),
                      num_samples=S, parallel=True)(g)
    a = pred["a"].reshape(S, J)
    assert float(((a.mean(0) - post.loc).abs() / (post.variance / S).sqrt()).max()) < 4.5


@pytest.mark.parametrize("hyper", ["map", "integrate"])
def test_trainable_is_refused_naming_the_hyper_latents_and_the_guides_that_train(hyper):
    """``as_guide(trainable=True)`` said "fit with hyper='map' for a Gaussian posterior whose guide trains", but a
    ``hyper='map'`` fit refuses the same way. The guide it points to, ``components[k].as_guide()``, is checked against
    the closed-form posterior of the field given ``s`` at design point ``k``; ``DualVG`` on this model now names
    ``s`` (it reported 5 latent dimensions against the posterior's 4)."""
    g, y = _data(6)
    res = pcv.fit(group_model, g, y=y, engine="dual_vg", options=dict(hyper=hyper), progress=False)
    q = res.posterior
    with pytest.raises(ValueError, match=r"trainable=True.*\['s'\].*components\[k\]\.as_guide\(\).*\['a'\].*'laplace'"):
        q.as_guide(trainable=True)
    k = int(q.weights.argmax())
    s = float(q.space.unpack(q.z[k])[0]["s"])
    A = torch.nn.functional.one_hot(g, J).to(D)
    cov = torch.linalg.inv(torch.eye(J, dtype=D) / s**2 + A.T @ A)  # y | a ~ N(A a, I), a ~ N(0, s^2 I)
    mean = cov @ (A.T @ y)
    guide = q.components[k].as_guide()
    torch.testing.assert_close(guide.median()["a"], mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(guide.to_posterior().covariance(), cov, rtol=0, atol=1e-6)
    svi = pyro.infer.SVI(q.components[k].model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    svi.step(*q.components[k].model_args[0], **q.components[k].model_args[1])
    if hyper == "map":
        with pytest.raises(ValueError, match=r"DualVG: the model has hyper-latents \['s'\].*engine='dual_vg'"):
            pcv.DualVG(group_model, hyper="map").fit(g, y=y)
