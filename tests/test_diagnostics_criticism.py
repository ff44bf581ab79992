"""Model criticism against independent references: PIT of wrapped likelihood families."""
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from scipy import stats

import pyro_convexvb as pcv
from pyro_convexvb.diagnostics.logjoint import _cdf_pair

F64 = torch.float64


def test_cdf_pair_is_refused_for_families_that_transform_or_mix_their_base():
    """LogNormal / HalfNormal (transformed Normal) and ZeroInflatedPoisson (a mixture with a Poisson base) used to get
    their base's CDF: Normal(0, 1).cdf(1) = 0.84 for a LogNormal whose CDF at 1 is 0.5."""
    y = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
    assert _cdf_pair(dist.LogNormal(torch.tensor(0.0, dtype=F64), 1.0), y) is None
    assert _cdf_pair(dist.HalfNormal(torch.tensor(1.0, dtype=F64)), y) is None
    zip_ = dist.ZeroInflatedPoisson(torch.tensor(2.0, dtype=F64), gate=torch.tensor(0.4, dtype=F64))
    assert _cdf_pair(zip_, torch.tensor([0.0, 1.0, 3.0], dtype=F64)) is None
    # wrappers that keep each element's distribution still give it
    d = dist.Normal(torch.tensor(0.3, dtype=F64), 2.0).expand([3]).mask(torch.tensor([True, False, True]))
    below, at = _cdf_pair(d, y)
    np.testing.assert_allclose(below.numpy(), stats.norm(0.3, 2.0).cdf(y.numpy()), rtol=1e-12)
    np.testing.assert_array_equal(at.numpy(), 0.0)
    p = torch.tensor([0.2, 0.7], dtype=F64)
    below, at = _cdf_pair(dist.Bernoulli(probs=p).to_event(1).mask(True), torch.tensor([1.0, 0.0], dtype=F64))
    np.testing.assert_allclose(below.numpy(), [0.8, 0.0])
    np.testing.assert_allclose(at.numpy(), [0.2, 0.3])


def test_loo_pit_of_a_lognormal_likelihood_is_nan_not_the_normal_cdf():
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
    assert np.all(np.isnan(r.pit))
    # the elpd itself is right: conjugate in log y, closed-form leave-one-out predictive of log y, minus log y
    ly = np.log(y.numpy())
    ex = []
    for i in range(30):
        rest = np.delete(ly, i)
        prec = 1.0 + rest.size / 0.25
        mean = rest.sum() / 0.25 / prec
        ex.append(stats.norm.logpdf(ly[i], mean, np.sqrt(0.25 + 1.0 / prec)) - ly[i])
    np.testing.assert_allclose(r.elpd_i, ex, atol=0.02)
