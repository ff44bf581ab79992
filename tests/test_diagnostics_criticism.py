"""Model criticism against independent references: PIT of every supported likelihood family, masked and vector
sites, the ArviZ export."""
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import stats

import pyro_convexvb as pcv
from pyro_convexvb.diagnostics.logjoint import _cdf_pair

F64 = torch.float64


def test_cdf_pair_of_families_that_transform_or_mix_their_base_is_their_own():
    """LogNormal / HalfNormal (transformed Normal) and ZeroInflatedPoisson (a mixture with a Poisson base) once got
    their base's CDF (Normal(0, 1).cdf(1) = 0.84 for a LogNormal whose CDF at 1 is 0.5), then none; now their own
    (scipy's closed forms; the ZIP's against sums of its own pmf)."""
    y = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
    below, at = _cdf_pair(dist.LogNormal(torch.tensor(0.0, dtype=F64), 1.0), y)
    np.testing.assert_allclose(below.numpy(), stats.lognorm(1.0).cdf(y.numpy()), rtol=1e-12)
    assert float(below[1]) == 0.5 and float(at.abs().max()) == 0.0
    below, _ = _cdf_pair(dist.HalfNormal(torch.tensor(1.5, dtype=F64)), y)
    np.testing.assert_allclose(below.numpy(), stats.halfnorm(scale=1.5).cdf(y.numpy()), rtol=1e-12)
    zip_ = dist.ZeroInflatedPoisson(torch.tensor(2.0, dtype=F64), gate=torch.tensor(0.4, dtype=F64))
    k = torch.tensor([0.0, 1.0, 3.0], dtype=F64)
    below, at = _cdf_pair(zip_, k)
    pmf = torch.exp(zip_.log_prob(torch.arange(10, dtype=F64))).numpy()
    np.testing.assert_allclose(below.numpy(), [pmf[:int(v)].sum() for v in k], atol=1e-14)
    np.testing.assert_allclose(at.numpy(), [pmf[int(v)] for v in k], atol=1e-14)
    # wrappers that keep each element's distribution still give it
    d = dist.Normal(torch.tensor(0.3, dtype=F64), 2.0).expand([3]).mask(torch.tensor([True, False, True]))
    below, at = _cdf_pair(d, y)
    np.testing.assert_allclose(below.numpy(), stats.norm(0.3, 2.0).cdf(y.numpy()), rtol=1e-12)
    np.testing.assert_array_equal(at.numpy(), 0.0)
    p = torch.tensor([0.2, 0.7], dtype=F64)
    below, at = _cdf_pair(dist.Bernoulli(probs=p).to_event(1).mask(True), torch.tensor([1.0, 0.0], dtype=F64))
    np.testing.assert_allclose(below.numpy(), [0.8, 0.0])
    np.testing.assert_allclose(at.numpy(), [0.2, 0.3])


def _t(*a):
    return torch.tensor(a, dtype=F64)


@pytest.mark.parametrize("fn", [dist.StudentT(_t(3.0), _t(0.5), _t(2.0)), dist.Laplace(_t(0.3), _t(1.5)),
                                dist.Gamma(_t(2.0), _t(1.3)), dist.Exponential(_t(0.8))],
                         ids=["student_t", "laplace", "gamma", "exponential"])
def test_cdf_pair_of_continuous_families_against_quadrature(fn):
    """P(Y < y) against the integral of the family's own density (trapezoid rule on a fine grid)."""
    y = _t(0.5, 1.0, 2.0, 3.0)
    below, at = _cdf_pair(fn, y)
    lo = 0.0 if isinstance(fn, (dist.Gamma, dist.Exponential)) else -4000.0
    for v, b in zip(y.tolist(), below.tolist()):
        g = torch.cat([torch.linspace(lo, -20.0, 400001, dtype=F64), torch.linspace(-20.0, v, 400001, dtype=F64)]) \
            if lo < -20 else torch.linspace(lo + 1e-12, v, 800001, dtype=F64)
        dens = torch.exp(fn.log_prob(g))
        ref = float(torch.trapezoid(dens, g))
        assert abs(b - ref) < 1e-6, (v, b, ref)
    assert float(at.abs().max()) == 0.0


@pytest.mark.parametrize("fn", [dist.Binomial(_t(10.0), _t(0.3)), dist.NegativeBinomial(_t(4.0), _t(0.6)),
                                dist.GammaPoisson(_t(2.5), _t(0.7)), dist.Poisson(_t(2.2)), dist.Poisson(_t(0.0)),
                                dist.ZeroInflatedNegativeBinomial(_t(3.0), logits=_t(0.4), gate=_t(0.25))],
                         ids=["binomial", "negative_binomial", "gamma_poisson", "poisson", "poisson_zero_rate",
                              "zi_negative_binomial"])
def test_cdf_pair_of_count_families_against_their_own_pmf(fn):
    k = _t(0, 1, 3, 7)
    below, at = _cdf_pair(fn, k)
    pmf = torch.exp(fn.log_prob(torch.arange(11 if isinstance(fn, dist.Binomial) else 300, dtype=F64))).reshape(-1)
    np.testing.assert_allclose(below.numpy(), [float(pmf[:int(v)].sum()) for v in k], atol=1e-13)
    np.testing.assert_allclose(at.numpy(), [float(pmf[int(v)]) for v in k], atol=1e-13)


def _quadrature_loo_pit(log_prior, log_lik, pair, grid):
    """Leave-one-out PIT of a one-parameter model on a grid: ``log_lik (G, N)``, ``pair`` the ``(G, N)`` arrays of
    ``P(Y < y_i | theta)``, ``P(Y = y_i | theta)``."""
    total = log_prior[:, None] + log_lik.sum(1, keepdims=True) - log_lik  # (G, N): every observation but i
    w = np.exp(total - total.max(0))
    w /= w.sum(0)
    return (w * (pair[0] + 0.5 * pair[1])).sum(0)


@pytest.mark.parametrize("family", ["binomial", "student_t"])
def test_loo_pit_of_binomial_and_student_t_sites_against_quadrature(family):
    """These sites had no PIT (NaN); now their LOO-PIT from a Laplace fit (importance-corrected toward the exact
    posterior) against the leave-one-out predictive computed by quadrature over the one latent."""
    torch.manual_seed(3)
    N = 25
    if family == "binomial":
        n = torch.full((N,), 12.0, dtype=F64)
        y = torch.distributions.Binomial(n, torch.full((N,), 0.35, dtype=F64)).sample()

        def lik(a):
            return dist.Binomial(n, logits=a)
    else:
        y = 1.0 + 0.8 * torch.distributions.StudentT(torch.tensor(4.0, dtype=F64)).sample((N,))

        def lik(a):
            return dist.StudentT(torch.tensor(4.0, dtype=F64), a, 0.8)

    def model(y=None):
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=F64), 2.0))
        with pyro.plate("data", N):
            pyro.sample("y", lik(a), obs=y)

    res = pcv.fit(model, y=y, engine="laplace", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = res.loo(num_draws=4000)
    grid = torch.linspace(-6.0, 6.0, 6001, dtype=F64)
    fn = lik(grid[:, None].expand(-1, N))
    ll = fn.log_prob(y.expand(grid.shape[0], N)).numpy()
    below, at = _cdf_pair(fn, y.expand(grid.shape[0], N))
    ref = _quadrature_loo_pit(stats.norm(0, 2).logpdf(grid.numpy()), ll, (below.numpy(), at.numpy()), grid)
    assert np.all(np.isfinite(r.pit))
    np.testing.assert_allclose(r.pit, ref, atol=0.01)


def test_loo_pit_of_a_lognormal_likelihood_against_the_closed_form():
    """PIT of a LogNormal site: P(log Y < log y_i | y_-i) of the conjugate model in log y (it was the Normal CDF of
    y itself, then NaN)."""
    torch.manual_seed(0)
    y = torch.exp(0.4 + 0.5 * torch.randn(30, dtype=F64))

    def model(y=None):
        m = pyro.sample("m", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        with pyro.plate("data", 30):
            pyro.sample("y", dist.LogNormal(m, 0.5), obs=y)

    res = pcv.fit(model, y=y, engine="laplace", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = res.loo(num_draws=500)
    # the elpd and PIT: conjugate in log y, closed-form leave-one-out predictive of log y (minus log y for elpd)
    ly = np.log(y.numpy())
    ex, pit = [], []
    for i in range(30):
        rest = np.delete(ly, i)
        prec = 1.0 + rest.size / 0.25
        mean = rest.sum() / 0.25 / prec
        pred = stats.norm(mean, np.sqrt(0.25 + 1.0 / prec))
        ex.append(pred.logpdf(ly[i]) - ly[i])
        pit.append(pred.cdf(ly[i]))
    np.testing.assert_allclose(r.elpd_i, ex, atol=0.02)
    np.testing.assert_allclose(r.pit, pit, atol=0.01)  # the leave-one-out reweighting of 500 draws


def _masked_data():
    torch.manual_seed(0)
    X = torch.randn(12, 2, dtype=F64)
    y = X @ torch.tensor([1.0, -1.0], dtype=F64) + torch.randn(12, dtype=F64)
    m = torch.ones(12, dtype=torch.bool)
    m[[2, 5]] = False
    return X, y, m


def _exact_loo(X, y):
    """Closed-form leave-one-out log predictive densities of y ~ N(X w, 1), w ~ N(0, I)."""
    X, y = X.numpy(), y.numpy()
    out = []
    for i in range(len(y)):
        k = np.arange(len(y)) != i
        C = np.linalg.inv(np.eye(X.shape[1]) + X[k].T @ X[k])
        out.append(stats.norm.logpdf(y[i], X[i] @ C @ X[k].T @ y[k], np.sqrt(1 + X[i] @ C @ X[i])))
    return np.array(out)


def test_entries_masked_by_the_distribution_are_no_observations():
    """``dist.Normal(...).mask(m)`` used to leave its masked entries in LOO as observations of log density 0 (12
    elpd_i, two of them 0, a PIT for each unobserved value) and in to_arviz; now as poutine.mask: dropped."""
    X, y, m = _masked_data()

    def model_dist(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=F64), 1.0).to_event(1))
        with pyro.plate("data", 12):
            pyro.sample("y", dist.Normal(X @ w, 1.0).mask(m), obs=y)

    res = pcv.fit(model_dist, X, y=y, engine="laplace", progress=False)
    r = res.loo(num_draws=2000)
    assert r.sites == {"y": slice(0, 10)}
    np.testing.assert_allclose(r.elpd_i, _exact_loo(X[m], y[m]), atol=0.06)  # PSIS error, 2,000 draws
    assert np.all(np.isfinite(r.pit))
    idata = res.to_arviz(num_draws=200)
    np.testing.assert_array_equal(idata.observed_data["y"].values, y[m].numpy())
    np.testing.assert_array_equal(idata.log_likelihood["y_obs"].values, np.flatnonzero(m.numpy()))


def test_to_arviz_aligns_replicates_with_observations_of_masked_and_vector_sites():
    """posterior_predictive kept every entry of a masked site (12 against 10 in log_likelihood and observed_data,
    under the same dimension, so the replicate at position 2 was set against observation 3), and a vector site's
    observed_data was flattened (36 values on a 12-long dimension whose replicates were 12 x 3)."""
    X, y, m = _masked_data()
    yv = torch.randn(12, 3, dtype=F64)

    def model(X, y=None, yv=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=F64), 1.0).to_event(1))
        with pyro.plate("data", 12):
            with pyro.poutine.mask(mask=m):
                pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
            pyro.sample("yv", dist.Normal((X @ w)[:, None].expand(12, 3), 1.0).to_event(1), obs=yv)

    res = pcv.fit(model, X, y=y, yv=yv, engine="laplace", progress=False)
    idata = res.to_arviz(num_draws=400)
    keep = np.flatnonzero(m.numpy())
    assert idata.posterior_predictive["y"].shape == (4, 100, 10)
    np.testing.assert_array_equal(idata.posterior_predictive["y_obs"].values, keep)
    np.testing.assert_array_equal(idata.observed_data["y"].values, y[m].numpy())
    # replicates follow the fitted mean at the observation's own row: check the alignment by regression on X w
    w = idata.posterior["w"].values.reshape(-1, 2)
    rep = idata.posterior_predictive["y"].values.reshape(-1, 10)
    resid = rep - w @ X[m].numpy().T
    assert abs(resid.mean()) < 0.05 and abs(resid.std() - 1.0) < 0.05
    assert idata.observed_data["yv"].shape == (12, 3)
    np.testing.assert_array_equal(idata.observed_data["yv"].values, yv.numpy())
    assert idata.posterior_predictive["yv"].dims == ("chain", "draw", "yv_obs", "yv_dim_1")
    assert idata.observed_data["yv"].dims == ("yv_obs", "yv_dim_1")


def test_a_site_without_a_cdf_does_not_blank_the_pit_of_the_others():
    """PIT was all-NaN as soon as one observed site had no CDF here (a .to_event site), Poisson sites included."""
    torch.manual_seed(1)
    X = torch.randn(15, 2, dtype=F64)
    yv = torch.randn(15, 2, dtype=F64)
    yc = torch.poisson(torch.full((15,), 2.0, dtype=F64))

    def model(event):
        def m(X, yv=None, yc=None):
            w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=F64), 1.0).to_event(1))
            with pyro.plate("data", 15):
                loc = (X @ w)[:, None].expand(15, 2)
                if event:
                    pyro.sample("yv", dist.Normal(loc, 1.0).to_event(1), obs=yv)
                else:
                    with pyro.plate("cols", 2, dim=-2):
                        pyro.sample("yv", dist.Normal(loc.T, 1.0), obs=yv.T)
                pyro.sample("yc", dist.Poisson(torch.exp(0.3 * X @ w)), obs=yc)
        return m

    r = {}
    for event in (True, False):
        res = pcv.fit(model(event), X, yv=yv, yc=yc, engine="laplace", progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r[event] = res.loo(num_draws=1000)
    assert np.all(np.isnan(r[True].pit[r[True].sites["yv"]]))
    pit_c = r[True].pit[r[True].sites["yc"]]
    # the same posterior written with the vector site elementwise (which has a CDF): the same Poisson PIT
    np.testing.assert_allclose(pit_c, r[False].pit[r[False].sites["yc"]], atol=1e-6)
    assert np.all((pit_c > 0) & (pit_c < 1))


def test_to_arviz_and_loo_refuse_draw_counts_and_seeds_they_would_truncate():
    """to_arviz(num_draws=10.7) exported 10 draws, num_draws=True one, and seed=1.5 in loo / to_arviz was seed 1."""
    import pytest

    y = torch.randn(10, dtype=F64)

    def model(y=None):
        m = pyro.sample("m", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        with pyro.plate("d", 10):
            pyro.sample("y", dist.Normal(m, 1.0), obs=y)

    res = pcv.fit(model, y=y, engine="laplace", progress=False)
    for bad in (10.7, True, "100", 3):
        with pytest.raises(ValueError, match="num_draws: expected an integer of at least chains=4"):
            res.to_arviz(num_draws=bad)
    with pytest.raises(ValueError, match="seed: expected an integer"):
        res.to_arviz(num_draws=8, seed=1.5)
    with pytest.raises(ValueError, match="seed: expected an integer"):
        res.loo(num_draws=50, seed=1.5)
    with pytest.raises(ValueError, match="corrected: expected None"):
        res.to_arviz(num_draws=8, corrected="yes")  # a truthy string used to compute and export a correction
    assert res.to_arviz(num_draws=10, seed=np.int64(3)).posterior["m"].shape == (4, 2)  # rounded down to chains


def test_a_zero_likelihood_at_some_draws_is_named_not_a_bare_nan_error():
    """An observation with p(y_i | x_s) = 0 at a draw made the leave-one-out ratio -inf - (-inf) = NaN, and the Pareto
    fit refused 'log_ratios' without saying which observation or why."""
    import pytest

    from pyro_convexvb.diagnostics import loo_from_log_lik

    rng = np.random.default_rng(0)
    ll = rng.normal(size=(200, 5)) - 1
    lr = 0.1 * ll.sum(1)
    ll[7, 2], lr[7] = -np.inf, -np.inf
    with pytest.raises(ValueError, match=r"observation 2 has log-likelihood -inf at draw 7 \(1 of 200 draws"):
        loo_from_log_lik(lr, ll)
    ll[7, 2], lr[7] = np.nan, np.nan
    with pytest.raises(ValueError, match=r"observation 2 has log-likelihood nan"):
        loo_from_log_lik(lr, ll)

    from pyro_convexvb.diagnostics.loo import _check_log_lik

    ll = np.zeros((4, 3))
    ll[[1, 3], 2] = -np.inf
    with pytest.raises(ValueError, match=r"site 'y', observation 2 .* at draw 1 \(2 of 4 draws; 1 observations"):
        _check_log_lik(ll, lambda j: f"site 'y', observation {j}")


def test_loo_over_one_observation_says_so_and_has_no_standard_error():
    """Rows written as one event (``.to_event(1)``) are one observation for LOO: it warns, naming the site and the
    plate that would leave rows out one at a time, and the standard errors are NaN (0 would claim an exact sum)."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 2, generator=g, dtype=torch.float64)
    y = (X[:, 0] + 0.3 * torch.randn(30, generator=g, dtype=torch.float64) > 0).double()

    def event(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        pyro.sample("y", dist.Bernoulli(logits=X @ w).to_event(1), obs=y)

    def plate(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    with pytest.warns(UserWarning, match=r"one observation \(site 'y'\).*pyro.plate"):
        one = pcv.fit(event, X, y=y, engine="dual_vg", progress=False).loo(num_draws=300)
    assert one.pareto_k.shape == (1,) and np.isnan(one.se) and np.isnan(one.se_waic) and np.isfinite(one.elpd_loo)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="PSIS-LOO over one observation")
        rows = pcv.fit(plate, X, y=y, engine="dual_vg", progress=False).loo(num_draws=300)
    assert rows.pareto_k.shape == (30,) and rows.se > 0
