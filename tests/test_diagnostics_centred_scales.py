"""A case the importance correction gets wrong while k_hat is below 0.7: three scales of a centred hierarchy
integrated by a central composite design (``docs/diagnostics.md``). The check of the field's proposal against refits
away from the design points (:mod:`pyro_convexvb.diagnostics.field_check`) reports it unreliable. The reference is
exact: the model is Gaussian given the scales, so their marginal likelihood is a Gaussian density, integrated here
on a grid."""
import functools
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv

D = torch.float64


def _data():
    g = torch.Generator().manual_seed(2)
    sizes = torch.randint(3, 16, (20,), generator=g)
    group = torch.repeat_interleave(torch.arange(20), sizes)
    x = (torch.rand(len(group), generator=g, dtype=D) < 0.4).to(D)
    a = 1.5 + 0.3 * torch.randn(20, generator=g, dtype=D)
    b = -0.7 + 0.2 * torch.randn(20, generator=g, dtype=D)
    return group, x, a[group] + b[group] * x + 0.7 * torch.randn(len(group), generator=g, dtype=D)


def model(group, x, y=None):
    one = torch.tensor(1.0, dtype=D)
    mu_a = pyro.sample("mu_a", dist.Normal(0 * one, 10 * one))
    sigma_a = pyro.sample("sigma_a", dist.HalfNormal(one))
    mu_b = pyro.sample("mu_b", dist.Normal(0 * one, 10 * one))
    sigma_b = pyro.sample("sigma_b", dist.HalfNormal(one))
    with pyro.plate("group", 20):
        a = pyro.sample("a", dist.Normal(mu_a, sigma_a))
        b = pyro.sample("b", dist.Normal(mu_b, sigma_b))
    sigma_y = pyro.sample("sigma_y", dist.HalfNormal(one))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(a[group] + b[group] * x, sigma_y), obs=y)


@functools.lru_cache(maxsize=1)
def _exact_sigma_b_quantiles(qs=(0.05, 0.5, 0.95)):
    """The ``qs`` quantiles of ``sigma_b``'s posterior given :func:`_data`, computed once per session."""
    group, x, y = _data()
    return _exact_sigma_b_quantile(group, x, y, qs)


def _exact_sigma_b_quantile(group, x, y, q):
    """The ``q`` quantile (or quantiles, a tuple ``q``) of ``sigma_b``'s posterior by quadrature of the scales'
    exact marginal likelihood (a Gaussian: the field, means and noise integrated in closed form) on a grid in the logs
    of the three scales."""
    N = len(y)
    Z = torch.zeros(N, 20, dtype=D)
    Z[torch.arange(N), group] = 1.0
    Zx = Z * x[:, None]
    base = 100.0 * (torch.ones(N, N, dtype=D) + torch.outer(x, x))
    A, B, eye = Z @ Z.T, Zx @ Zx.T, torch.eye(N, dtype=D)
    ls = torch.linspace(math.log(0.005), math.log(3.0), 36, dtype=D)
    lsy = torch.linspace(math.log(0.3), math.log(1.5), 24, dtype=D)

    def log_half_normal(log_s):  # in log s, with the Jacobian
        return math.log(2) - 0.5 * math.log(2 * math.pi) - 0.5 * math.exp(2 * log_s) + log_s

    out = torch.empty(36, 36, 24, dtype=D)
    for i, la in enumerate(ls.tolist()):
        for j, lb in enumerate(ls.tolist()):
            C0 = base + math.exp(2 * la) * A + math.exp(2 * lb) * B
            covs = C0 + torch.exp(2 * lsy)[:, None, None] * eye
            lp = torch.distributions.MultivariateNormal(torch.zeros(N, dtype=D), covariance_matrix=covs).log_prob(y)
            out[i, j] = lp + log_half_normal(la) + log_half_normal(lb) + torch.tensor(
                [log_half_normal(v) for v in lsy.tolist()], dtype=D)
    cdf = torch.cumsum(torch.softmax(out.reshape(-1), 0).reshape(out.shape).sum((0, 2)), 0)
    edges = ls + (ls[1] - ls[0]) / 2  # the cumulative mass at each cell's upper edge
    if isinstance(q, tuple):
        return tuple(math.exp(float(v)) for v in np.interp(q, cdf.numpy(), edges.numpy()))
    return math.exp(float(np.interp(q, cdf.numpy(), edges.numpy())))


@pytest.mark.slow
def test_corrected_lower_tail_of_a_centred_scale_against_its_exact_marginal():
    """The central composite design's own correction is right within 5% or reported unreliable, on four seeds (its
    5% quantile is about 0.20); by default an unreliable one is redone on a grid refit (fitted once), which is
    right within 3 of its Monte Carlo errors plus the exact grid's own error (2%)."""
    group, x, y = _data()
    exact = _exact_sigma_b_quantiles()[0]
    assert 0.09 < exact < 0.12  # 0.106 on this grid (0.105 on a finer one)
    res = pcv.fit(model, group, x, y=y, engine="dual_vg", progress=False)
    for seed in range(4):
        c = res.corrected(seed=seed, warn=False, regrid=False)
        got = float(c.sites["sigma_b"]["quantiles"][0.05])
        assert not c.diagnostics.reliable or abs(got - exact) < 0.05 * exact, (seed, got, exact, c.diagnostics)
        c = res.corrected(seed=seed, warn=False)
        got, se = float(c.sites["sigma_b"]["quantiles"][0.05]), float(c.sites["sigma_b"]["quantile_mcse"][0.05])
        assert c.refit is not None and c.refit.hyper["strategy"] == "grid" and c.diagnostics.reliable, seed
        assert abs(got - exact) < 3 * se + 0.02 * exact, (seed, got, se, exact)
    assert res.posterior.refit.on_grid() is c.refit


@pytest.mark.slow
def test_a_three_dimensional_grid_gets_the_scales_marginals_and_a_reliable_correction():
    """The same model integrated on a 3-D grid (``hyper_strategy="grid"``): the design's own marginals of sigma_b
    within 3% of the exact quantiles (0.105 / 0.374 / 0.650), and a correction that is right within 3 of its Monte
    Carlo errors (plus the exact grid's own error, 2%) and passes the field check."""
    group, x, y = _data()
    exact = _exact_sigma_b_quantiles()
    res = pcv.fit(model, group, x, y=y, engine="dual_vg", options={"hyper_strategy": "grid"}, progress=False)
    assert res.hyper["strategy"] == "grid" and res.converged
    q = res.hyper["marginals"]["sigma_b"]["quantiles"]
    for p, e in zip((0.05, 0.5, 0.95), exact):
        assert abs(float(q[p]) - e) < 0.03 * e, (p, float(q[p]), e)
    c = res.corrected(seed=0)
    assert c.diagnostics.reliable and c.diagnostics.field_check.passed
    s = c.sites["sigma_b"]
    for p, e in zip((0.05, 0.5, 0.95), exact):
        assert abs(float(s["quantiles"][p]) - e) < 3 * float(s["quantile_mcse"][p]) + 0.02 * e, (p, s, e)
