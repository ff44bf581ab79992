"""Corrected posteriors of the hierarchical models of the test zoo against their stored references (slow).

Each model is fitted by ``dual_vg`` with its hyper-latents integrated over (``convex_relaxation`` where ``dual_vg``
does not apply) and importance-corrected with 4,000 draws; in Pyro's unconstrained coordinates (where the zoo's
references live) every corrected mean is within 0.1 reference sds and every sd within 10% of the reference, and the
uncorrected result's diagnostic (500 draws) is not ``ok`` whenever its sds are more than 20% off. Every correction is
reliable except the GP's with a latent length-scale (``hier_gp_lengthscale``, 25 points): its field's proposal inside
the grid's cells is tens of nats from refits there, which the field check reports (its corrected 5% quantile of
``ell`` came out up to 0.28 sds off over six seeds at ``k_hat`` 0.58-0.71); its means and sds are checked all the
same.
"""
import json
import os
import warnings

import pytest
import torch

import pyro_convexvb as pcv
from tests.zoo.models import ZOO

REFS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo", "references.json")
HIER = [name for name, m in ZOO.items() if m.group == "hierarchical"]


@pytest.mark.slow
@pytest.mark.parametrize("name", HIER)
def test_corrected_hierarchical_zoo_models_match_their_references(name):
    with open(REFS) as f:
        ref = json.load(f)[name]["sites"]
    model, args, kwargs = ZOO[name].builder()
    fits = pcv.engines_that_fit(model, *args, **kwargs)
    engine = next(e for e in ("dual_vg", "convex_relaxation", "laplace") if e in fits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = pcv.fit(model, *args, engine=engine, progress=False, **kwargs)
        c = res.corrected(num_draws=4000)
    if name == "hier_gp_lengthscale":
        fc = c.diagnostics.field_check
        assert not c.diagnostics.reliable and fc.passed is False and "between the design points" in fc.note, fc
    else:
        assert c.diagnostics.reliable, c.diagnostics
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the uncorrected answer's warning is what is checked below
        d = res.diagnostics
    off = 0.0  # the largest relative error of the uncorrected sds (the proposal's own draws)
    for site, r in ref.items():
        s = c.unconstrained[site]
        mean, sd = s["mean"].reshape(-1), s["sd"].reshape(-1)
        rm, rs = torch.tensor(r["mean"], dtype=torch.float64), torch.tensor(r["sd"], dtype=torch.float64)
        assert float(((mean - rm).abs() / rs).max()) < 0.1, (name, site, engine)
        assert float((sd / rs - 1).abs().max()) < 0.1, (name, site, engine)
        q_sd = d.draws[site].reshape(d.num_draws, -1).std(0)
        off = max(off, float((q_sd / rs - 1).abs().max()))
    if off > 0.2:  # the diagnostic flags every uncorrected answer whose sds are more than 20% off
        assert not d.ok, (name, off, d)


def _glm():
    g = torch.Generator().manual_seed(21)
    X = torch.randn(60, 3, generator=g, dtype=torch.float64)
    y = (torch.rand(60, generator=g, dtype=torch.float64) < torch.sigmoid(X @ torch.tensor([1.0, -1.0, 0.5],
                                                                                         dtype=torch.float64))).double()

    def model(X, y=None):
        import pyro
        import pyro.distributions as dist

        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X,), {"y": y}


def _gp_classification():
    g = torch.Generator().manual_seed(22)
    x = torch.sort(torch.rand(30, generator=g, dtype=torch.float64) * 6 - 3).values
    y = (torch.rand(30, generator=g, dtype=torch.float64) < torch.sigmoid(2 * torch.sin(x))).double()
    K = 2.0 * torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2) + 1e-6 * torch.eye(30, dtype=torch.float64)

    def model(x, y=None):
        import pyro
        import pyro.distributions as dist

        f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(30, dtype=torch.float64), covariance_matrix=K))
        with pyro.plate("data", 30):
            pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

    L = torch.linalg.cholesky(K)

    def whitened(x, y=None):  # the same posterior for NUTS: f = L v, v ~ N(0, I)
        import pyro
        import pyro.distributions as dist

        v = pyro.sample("v", dist.Normal(torch.zeros(30, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", 30):
            pyro.sample("y", dist.Bernoulli(logits=L @ v), obs=y)

    model.nuts = (whitened, lambda s: {"f": s["v"] @ L.T})
    return model, (x,), {"y": y}


def _hierarchical():
    from tests.references import hyper_models as hm

    return hm.logistic_halfcauchy()


@pytest.mark.slow
@pytest.mark.parametrize("builder", [_glm, _gp_classification, _hierarchical])
def test_loo_from_the_fit_agrees_with_az_loo_on_nuts_draws(builder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        az = pytest.importorskip("arviz")
    import numpy as np
    import pyro
    from pyro.infer import MCMC, NUTS

    from pyro_convexvb.diagnostics import ModelLogJoint

    model, args, kwargs = builder()
    pyro.set_rng_seed(0)
    nuts_model, to_sites = getattr(model, "nuts", (model, None))
    mcmc = MCMC(NUTS(nuts_model), num_samples=1000, warmup_steps=500, disable_progbar=True)
    mcmc.run(*args, **kwargs)
    s = mcmc.get_samples()
    if to_sites is not None:
        s = to_sites(s)
    lj = ModelLogJoint(model, args, kwargs)
    out = lj.evaluate({n: lj.transforms[n].inv(s[n]) for n in lj.names}, pointwise=True)
    idata = az.from_dict(posterior={n: s[n].numpy()[None] for n in lj.names},
                         log_likelihood={"y": out["log_lik"]["y"][None]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = az.loo(idata)
        res = pcv.fit(model, *args, engine="dual_vg", progress=False, **kwargs)
    ours = res.loo(num_draws=2000)
    assert abs(ours.elpd_loo - ref.elpd_loo) < ref.se, (ours.elpd_loo, ref.elpd_loo, ref.se)
    assert abs(ours.se - ref.se) < 0.2 * ref.se
    assert np.isfinite(ours.pit).all() and ((ours.pit > 0) & (ours.pit < 1)).all()
