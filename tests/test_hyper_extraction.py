"""Design points of a hyper-latent integration built from one extraction's affine maps (an extraction template):
the latent Gaussian model equals a fresh extraction at every hyper value, structure that reads the hyper-latents is
detected and extracted afresh, and the model runs once per design point."""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.distributions import SparseGMRF, icar_precision
from pyro_convexvb.infer import hyper as hyper_mod
from pyro_convexvb.infer.hyper import ConditionedModel, conditioned_model
from pyro_convexvb.infer.result import _is_plain
from pyro_convexvb.lgm.template import ExtractionTemplate
from tests.references import hyper_models as hm
from tests.zoo.models import lattice_adjacency

from _hierarchies import centred_hyper, noncentred_hyper, random_intercepts

D = torch.float64
TOL = 1e-12


# ----------------------------------------------------------------------------- comparing two extractions
def _close(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    if isinstance(a, (int, float)):
        assert abs(float(a) - float(b)) <= TOL * (1 + abs(float(b))), (what, a, b)
        return
    if torch.is_tensor(a) and a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    if hasattr(a, "to_dense") and not torch.is_tensor(a):
        a, b = a.to_dense(), b.to_dense()
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a, b, rtol=TOL, atol=TOL), (what, float((a - b).abs().max()))


def _same_family(a, b, what):
    assert type(a) is type(b), what
    for k in set(vars(a)) | set(vars(b)):
        va, vb = getattr(a, k, None), getattr(b, k, None)
        if isinstance(va, dict):
            assert set(va) == set(vb), (what, k)
            for kk in va:
                if torch.is_tensor(va[kk]) or isinstance(va[kk], (int, float)):
                    _close(va[kk], vb[kk], f"{what}.{k}[{kk}]")
                else:
                    assert va[kk] == vb[kk], (what, k, kk)
        elif torch.is_tensor(va) or isinstance(va, float):
            _close(va, vb, f"{what}.{k}")
        elif hasattr(va, "params"):  # a wrapped family (tempered sites)
            _same_family(va, vb, f"{what}.{k}")


def assert_same_lgm(a, b):
    """Every field of two latent Gaussian models equal to 1e-12 (operators compared as dense matrices)."""
    assert a.layout.names == b.layout.names and [bl.shape for bl in a.layout.blocks] == [bl.shape for bl in b.layout.blocks]
    assert a.model_layout.names == b.model_layout.names
    assert len(a.priors) == len(b.priors)
    for p, q in zip(a.priors, b.priors):
        assert p.name == q.name and p.flat == q.flat
        _close(p.loc, q.loc, f"prior {p.name} loc")
        _close(p.logdet_cov, q.logdet_cov, f"prior {p.name} logdet")
        _close(p.cov, q.cov, f"prior {p.name} cov")
        _close(p.prec, q.prec, f"prior {p.name} prec")
    assert [g.name for g in a.sites] == [g.name for g in b.sites]
    for g, h in zip(a.sites, b.sites):
        assert g.obs_shape == h.obs_shape and g.from_prior == h.from_prior
        _same_family(g.family, h.family, f"site {g.name} family")
        _close(g.design, h.design, f"site {g.name} design")
        _close(g.offset, h.offset, f"site {g.name} offset")
    _close(a.log_const, b.log_const, "log_const")
    assert [i.name for i in a.imputed] == [i.name for i in b.imputed]
    for i, j in zip(a.imputed, b.imputed):
        _close(i.design, j.design, f"imputed {i.name} design")
        _close(i.offset, j.offset, f"imputed {i.name} offset")
        _close(i.scale, j.scale, f"imputed {i.name} scale")
    assert (a.chain is None) == (b.chain is None)
    if a.chain is not None:
        assert a.chain.children == b.chain.children
        for f in ("A", "M", "T"):
            d = getattr(a.chain, f) - getattr(b.chain, f)
            assert abs(d).max() <= TOL if d.nnz else True, f
        _close(torch.as_tensor(a.chain.c), torch.as_tensor(b.chain.c), "chain c")


def _extract_both(model, args, kwargs, points):
    """The template path (one cache shared by the points, as a hyper fit shares it) and fresh extractions at every
    ``points`` entry (a dict of hyper values); returns their LGMs and the template's records."""
    cache = {"template": ExtractionTemplate()}
    out = []
    for values in points:
        values = {k: torch.as_tensor(v, dtype=D) for k, v in values.items()}
        lgm = pcv.lgm_from_pyro(ConditionedModel(model, values, cache), *args, dtype=D, **kwargs)
        fresh = pcv.lgm_from_pyro(conditioned_model(model, values), *args, dtype=D, **kwargs)
        out.append((lgm, fresh, cache["template"].record))
    return out


# ----------------------------------------------------------------------------- models
def _ri_data(J=12):
    X, grp, y = random_intercepts(J, rows=5 * J, seed=2)
    return (X, grp, J), {"y": y}


def icar_bym(E, y=None):
    """ICAR field (sum to zero) of precision ``tau`` and iid effects of scale ``sigma_v``: two hyper-latents."""
    n = E.shape[0]
    tau = pyro.sample("tau", dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)))
    sigma_v = pyro.sample("sigma_v", dist.HalfNormal(torch.tensor(0.5, dtype=D)))
    b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
    s = pyro.sample("s", SparseGMRF(torch.zeros(n, dtype=D), _ICAR_Q, tau, constraints="sum_to_zero"))
    with pyro.plate("areas", n):
        v = pyro.sample("v", dist.Normal(torch.tensor(0.0, dtype=D), sigma_v))
        pyro.sample("y", dist.Poisson(E * torch.exp(b0 + s + v)), obs=y)


_ICAR_Q = icar_precision(lattice_adjacency(4, 4))


def _icar_data():
    g = torch.Generator().manual_seed(3)
    E = 3.0 + 5.0 * torch.rand(16, generator=g, dtype=D)
    y = torch.poisson(E * torch.exp(0.2 * torch.randn(16, generator=g, dtype=D)), generator=g)
    return (E,), {"y": y}


def negbin(x, y=None):
    """A negative-binomial likelihood whose concentration ``r`` is a hyper-latent (it also enters the offset)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    r = pyro.sample("r", dist.Gamma(torch.tensor(2.0, dtype=D), 0.5))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.NegativeBinomial(r, logits=x @ w - torch.log(r)), obs=y)


def student_t(x, y=None):
    """A Student-t likelihood whose scale ``s`` is a hyper-latent."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.StudentT(4.0, x @ w, s), obs=y)


def _glm_data(counts):
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.ones(30, 1, dtype=D), torch.randn(30, 1, generator=g, dtype=D)], 1)
    if counts:
        y = torch.poisson(torch.exp(0.5 + 0.6 * x[:, 1]), generator=g)
    else:
        y = 0.3 + 0.8 * x[:, 1] + 0.5 * torch.randn(30, generator=g, dtype=D)
    return (x,), {"y": y}


def _split(builder):
    model, args, kwargs = builder()
    return model, (args, kwargs)


_BYM, _GP, _LIN = _split(hm.bym), _split(hm.gp_lengthscale), _split(hm.linear_noise_and_scale)

CASES = {
    # name: (model, (args, kwargs), hyper values at the design points, components re-extracted at every later point)
    "centred": (centred_hyper, _ri_data(), [{"sigma": s} for s in (0.8, 0.3, 1.7, 4.0)], set()),
    "noncentred": (noncentred_hyper, _ri_data(), [{"sigma": s} for s in (0.8, 0.3, 1.7, 4.0)], {"y"}),
    "icar_bym": (icar_bym, _icar_data(), [{"tau": t, "sigma_v": s} for t, s in ((1.0, 0.3), (0.2, 0.05), (7.0, 1.2))],
                 set()),
    "car_bym": (_BYM[0], _BYM[1], [{"kappa": k, "sigma_v": s} for k, s in ((2.0, 0.3), (0.5, 0.1), (5.0, 0.9))],
                set()),
    "gp_lengthscale": (_GP[0], _GP[1], [{"ell": e} for e in (1.0, 0.4, 2.5)], set()),
    "gaussian_noise": (_LIN[0], _LIN[1],
                       [{"tau": t, "sigma": s} for t, s in ((1.0, 0.5), (0.3, 2.0), (3.0, 0.1))], set()),
    "negbin_concentration": (negbin, _glm_data(True), [{"r": r} for r in (2.0, 0.5, 9.0)], set()),
    "student_t_scale": (student_t, _glm_data(False), [{"s": s} for s in (0.5, 0.1, 2.0)], set()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_template_extraction_equals_a_fresh_extraction_at_every_hyper_value(case):
    model, (args, kwargs), points, changing = CASES[case]
    out = _extract_both(model, args, kwargs, points)
    for k, (lgm, fresh, rec) in enumerate(out):
        assert_same_lgm(lgm, fresh)
        if k == 0:
            assert rec.built and not rec.reused and rec.structure is None
        else:  # the maps that do not read the hyper-latents are the first extraction's objects
            assert set(rec.changed) == changing, rec
            assert rec.structure is None and not rec.built, rec
            assert set(rec.reused) >= {g.name for g in lgm.sites if not g.from_prior} - changing, rec
            for g, g0 in zip(lgm.sites, out[0][0].sites):
                if g.name not in changing and not g.from_prior:
                    assert g.design is g0.design, g.name
    # the hyper value reaches the numbers: the models at the first two points differ
    a, b = out[0][0], out[1][0]
    differ = any(not torch.equal(p.loc, q.loc) or p.logdet_cov != q.logdet_cov for p, q in zip(a.priors, b.priors))
    differ = differ or any(not torch.equal(g.offset, h.offset) for g, h in zip(a.sites, b.sites))
    differ = differ or any(vars(g.family).get("params") is not None and any(
        torch.is_tensor(v) and not torch.equal(v, h.family.params[k]) for k, v in g.family.params.items())
        for g, h in zip(a.sites, b.sites))
    assert differ


def test_centred_chain_reuses_its_coefficients_and_composed_design():
    (args, kwargs) = _ri_data()
    out = _extract_both(centred_hyper, args, kwargs, [{"sigma": 0.8}, {"sigma": 2.0}])
    (l0, _, r0), (l1, _, r1) = out
    assert "<chain>" in r0.built and "alpha" in r0.built
    assert {"<chain>", "alpha", "y"} <= set(r1.reused) and r1.complete
    assert l1.chain is l0.chain and l1.sites[0].design is l0.sites[0].design
    # the chain child's prior scale is the new sigma's
    alpha = [p for p in l1.priors if p.name == "alpha"][0]
    assert torch.allclose(alpha.cov.diag, torch.full((12,), 4.0, dtype=D))


# ----------------------------------------------------------------------------- structure that reads theta
def branching_sites(x, y=None, y2=None):
    """A second likelihood appears when ``s > 0.6``: the model's sites depend on the hyper-latent."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(x @ w, s), obs=y)
        if s > 0.6:
            pyro.sample("y2", dist.Normal(2.0 * (x @ w), 1.0), obs=y2)


def branching_design(x, y=None):
    """The design doubles when ``s > 0.6`` (a data-dependent branch on the hyper-latent)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    k = 2.0 if s > 0.6 else 1.0
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(k * (x @ w), s), obs=y)


def branching_latents(x, y=None):
    """An extra latent effect when ``s > 0.6``: the latent layout depends on the hyper-latent."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    eta = x @ w
    if s > 0.6:
        eta = eta + pyro.sample("c", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(eta, s), obs=y)


def split_likelihood(x, y=None):
    """The same density either way, written as one likelihood site when ``s > 0.6`` and as two below: the sites
    change with the hyper-latent, the hyper-posterior does not jump."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    eta, N = x @ w, x.shape[0]
    if s > 0.6:
        with pyro.plate("data", N):
            pyro.sample("y", dist.Normal(eta, s), obs=y)
    else:
        with pyro.plate("first", 10):
            pyro.sample("y_a", dist.Normal(eta[:10], s), obs=None if y is None else y[:10])
        with pyro.plate("rest", N - 10):
            pyro.sample("y_b", dist.Normal(eta[10:], s), obs=None if y is None else y[10:])


@pytest.mark.parametrize("model", [branching_sites, branching_design, branching_latents, split_likelihood])
def test_structure_that_reads_the_hyper_latents_is_detected_and_extracted_afresh(model):
    (args, kwargs) = _glm_data(False)
    if model is branching_sites:
        kwargs = dict(kwargs, y2=kwargs["y"].flip(0))
    out = _extract_both(model, args, kwargs, [{"s": s} for s in (0.5, 0.55, 0.9, 1.2, 0.4)])
    for lgm, fresh, _ in out:
        assert_same_lgm(lgm, fresh)
    recs = [r for _, _, r in out]
    assert recs[1].complete and recs[3].complete  # the same branch as the point before
    for k in (2, 4):  # the branch switched
        if model is branching_design:
            assert set(recs[k].changed) == {"y"} and recs[k].structure is None
        else:
            assert recs[k].structure is not None and "changed" in recs[k].structure


def test_a_hyper_fit_reports_a_structure_change_in_its_result():
    """The mode search starts at the prior median (s = 0.67) and finds s near 0.5: it crosses the branch."""
    (args, kwargs) = _glm_data(False)
    res = pcv.fit(split_likelihood, *args, engine="dual_vg", progress=False, **kwargs)
    ext = res.hyper["extraction"]
    assert ext["structure_changes"] >= 1 and "changed" in ext["structure_reason"]
    assert "structure changed" in res.stop_reason and "structure changed" in ext["summary"]
    assert 0.3 < float(res.hyper["marginals"]["s"]["quantiles"][0.5]) < 0.6


# ----------------------------------------------------------------------------- whole fits and model runs
def _counted(model, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return model(*args, **kwargs)

    return counted


def _fit_counting(monkeypatch, model, args, kwargs, reuse):
    """A hyper fit with the template on or off; returns the result and the model runs made inside design-point
    fits (``HyperObjective.fit``: the extractions, and ``log p(theta)`` when it is not recorded)."""
    calls, per_fit = [], []
    fit = hyper_mod.HyperObjective.fit

    def counting_fit(self, z, keep=False):
        before = len(calls)
        out = fit(self, z, keep)
        per_fit.append(len(calls) - before)
        return out

    with monkeypatch.context() as m:
        m.setattr(hyper_mod, "REUSE_EXTRACTION", reuse)
        m.setattr(hyper_mod.HyperObjective, "fit", counting_fit)
        res = pcv.fit(_counted(model, calls), *args, engine="dual_vg", progress=False, **kwargs)
    return res, sum(per_fit)


def test_a_hyper_fit_runs_the_model_once_per_design_point_and_gives_the_same_posterior(monkeypatch):
    (args, kwargs) = _ri_data(J=15)
    new, runs_new = _fit_counting(monkeypatch, centred_hyper, args, kwargs, True)
    old, runs_old = _fit_counting(monkeypatch, centred_hyper, args, kwargs, False)
    E, fits = new.hyper["evaluations"], new.info["hyper_details"]["fits"]
    assert (E, fits) == (old.hyper["evaluations"], old.info["hyper_details"]["fits"]) and fits >= E > 10
    # before: per new point one run for log p(theta), per fit two runs (u0, u1) of the extraction, and the
    # structure trace once; now: one run per fit, plus the structure trace and the second run of the first point
    assert runs_old == E + 2 * fits + 1, (runs_old, E, fits)
    assert runs_new == fits + 2, (runs_new, fits)
    ext = new.hyper["extraction"]
    assert ext["extractions"] == fits and ext["reused"] == fits - 1 and not ext["re_extracted"]
    assert ext["structure_changes"] == 0 and old.hyper["extraction"]["reused"] == 0
    # every inner model equals the fresh one, so the whole fit is the same
    assert new.converged and old.converged
    for p in (0.05, 0.5, 0.95):
        a, b = new.hyper["marginals"]["sigma"]["quantiles"][p], old.hyper["marginals"]["sigma"]["quantiles"][p]
        assert abs(float(a) - float(b)) <= 1e-10 * abs(float(b)), p
    assert torch.allclose(new.posterior.loc, old.posterior.loc, rtol=1e-10, atol=1e-12)
    assert torch.allclose(new.posterior.variance, old.posterior.variance, rtol=1e-10, atol=1e-12)


def test_a_noncentred_hyper_fit_re_extracts_the_design_that_reads_sigma(monkeypatch):
    (args, kwargs) = _ri_data(J=10)
    new, runs_new = _fit_counting(monkeypatch, noncentred_hyper, args, kwargs, True)
    old, runs_old = _fit_counting(monkeypatch, noncentred_hyper, args, kwargs, False)
    fits, E = new.info["hyper_details"]["fits"], new.hyper["evaluations"]
    ext = new.hyper["extraction"]
    assert ext["re_extracted"] == {"y": fits - 1} and "depends on the hyper-latents" in ext["reasons"]["y"]
    assert runs_new == 2 * fits + 1 and runs_old == E + 2 * fits + 1  # the log p(theta) run is saved
    assert torch.allclose(new.posterior.loc, old.posterior.loc, rtol=1e-10, atol=1e-12)


def test_the_template_leaves_nothing_behind_in_the_result():
    (args, kwargs) = _ri_data(J=8)
    res = pcv.fit(centred_hyper, *args, engine="dual_vg", progress=False, **kwargs)
    comps = res.posterior.components
    assert all(isinstance(c.model, ConditionedModel) for c in comps)
    assert all(not c.model.extraction_cache for c in comps)  # released at the end of the integration
    assert _is_plain(res.hyper["extraction"])  # kept by res.compact()
    assert res.hyper["extraction"]["extractions"] == res.info["hyper_details"]["fits"]


def test_conditioned_model_records_the_hyper_latents_log_prior():
    (args, kwargs) = _icar_data()
    values = {"tau": torch.tensor(1.3, dtype=D), "sigma_v": torch.tensor(0.4, dtype=D)}
    m = ConditionedModel(icar_bym, values)
    tr = pyro.poutine.trace(m).get_trace(*args, **kwargs)
    assert "tau" not in tr.nodes and "sigma_v" not in tr.nodes and "s" in tr.nodes
    ref = float(dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)).log_prob(values["tau"])
                + dist.HalfNormal(torch.tensor(0.5, dtype=D)).log_prob(values["sigma_v"]))
    assert m.log_prior == pytest.approx(ref, abs=1e-14)
    assert m.log_prior == hyper_mod.log_prior(icar_bym, args, kwargs, values)


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_a_hyper_latent_whose_support_has_no_transform_is_refused_by_name(engine):
    """A Wishart precision or a mixture prior over a scale: torch has no bijection to unconstrained coordinates, so
    they cannot be integrated over; the refusal names the site (it was torch's bare NotImplementedError)."""
    X = torch.randn(20, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = X @ torch.tensor([1.0, 0.6], dtype=torch.float64)
    mix = dist.MixtureSameFamily(dist.Categorical(torch.tensor([0.5, 0.5], dtype=torch.float64)),
                                 dist.LogNormal(torch.tensor([-1.0, 1.0], dtype=torch.float64), 0.5))

    def wishart(y=None):
        lam = pyro.sample("Lam", dist.Wishart(torch.tensor(4.0, dtype=D), torch.eye(2, dtype=D)))
        w = pyro.sample("w", dist.MultivariateNormal(torch.zeros(2, dtype=torch.float64), precision_matrix=lam))
        with pyro.plate("data", 20):
            pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    def mixture(y=None):
        tau = pyro.sample("tau", mix)
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), tau).to_event(1))
        with pyro.plate("data", 20):
            pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    for model, site in ((wishart, "Lam"), (mixture, "tau")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(pcv.UnsupportedModelError, match=rf"site '{site}': its support .* has no transform to "
                                                                r"unconstrained coordinates"):
                pcv.fit(model, y=y, engine=engine, progress=False)


def test_an_observation_of_a_hyper_latent_alone_raises_no_torch_warning():
    """An observed site that reads only the hyper-latent is a constant of the field's model, whose finiteness check
    converted a graph-keeping tensor to a float: torch's 'requires_grad ... to a scalar' warning reached users."""
    X = torch.randn(20, 2, generator=torch.Generator().manual_seed(34), dtype=D)

    def with_obs(y=None):
        tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        pyro.sample("tau_obs", dist.Normal(tau, 0.2), obs=torch.tensor(0.4, dtype=D))
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), tau).to_event(1))
        with pyro.plate("data", 20):
            pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pcv.fit(with_obs, y=X @ torch.tensor([1.5, -1.2], dtype=D), engine="dual_vg", progress=False)
    assert not [w for w in caught if "requires_grad=True to a scalar" in str(w.message)]


def _two_mode_scale():
    """A scale with a two-component prior whose posterior keeps 12% of its mass in the far component, beyond a
    valley 5 nats deep; its exact 5/50/95% quantiles by quadrature over ``log tau`` (20,001 points)."""
    from pyro.distributions.transforms import ExpTransform

    g = torch.Generator().manual_seed(18)
    X = torch.randn(6, 2, generator=g, dtype=D)
    y = X @ torch.tensor([0.5, -0.5], dtype=D) + torch.randn(6, generator=g, dtype=D)
    two = dist.TransformedDistribution(dist.MixtureSameFamily(
        dist.Categorical(torch.tensor([0.5, 0.5], dtype=D)),
        dist.Normal(torch.tensor([math.log(0.05), math.log(3.0)], dtype=D), 0.25)), [ExpTransform()])

    def model(prior, y=None):
        tau = pyro.sample("tau", prior)
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), tau).to_event(1))
        with pyro.plate("data", 6):
            pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    lt = torch.linspace(-8.0, 4.0, 20001, dtype=D)
    cov = lt.exp()[:, None, None] ** 2 * (X @ X.T) + torch.eye(6, dtype=D)
    lp = dist.MultivariateNormal(torch.zeros(6, dtype=D), cov).log_prob(y) + two.log_prob(lt.exp()) + lt
    cdf = torch.softmax(lp, 0).cumsum(0)
    exact = {p: float(lt.exp()[int(torch.searchsorted(cdf, torch.tensor(p, dtype=D)))]) for p in (0.05, 0.5, 0.95)}
    return model, two, y, exact


def test_a_hyper_posterior_mode_the_design_never_reaches_is_flagged():
    """A scale with a two-component prior (12% of the posterior in the far component): the design grows from the
    first mode and stops at the valley, so the far mode was lost with k_hat 0.45 and nothing said. The prior's
    quantiles outside the design are probed; a plain HalfCauchy scale passes."""
    model, two, y, _ = _two_mode_scale()
    res = pcv.fit(model, two, y=y, engine="dual_vg", progress=False)
    from pyro_convexvb.diagnostics import ApproximationWarning

    with pytest.warns(ApproximationWarning, match=r"objective at tau=\d.* outside the integration design, is only"):
        d = res.diagnostics
    assert not d.reach.passed and not d.reliable and np.nanmin(d.reach.drop) < 3
    res = pcv.fit(model, dist.HalfCauchy(torch.tensor(1.0, dtype=D)), y=y, engine="dual_vg", progress=False)
    assert res.diagnostics.reach.passed and res.diagnostics.reliable


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_a_grid_grown_on_to_the_probed_quantiles_finds_the_second_mode(engine):
    """``hyper_probe=True`` fits the field at the prior's quantiles outside the grown grid; those within the pruning
    threshold of its top lie beyond a valley, and the grid is laid again, uniform out past them, through the valley
    and around the far mode. The scale's quantiles then match quadrature (the 95% one was 0.076 against 2.81), the
    diagnostic's reach check passes, and ``res.corrected()`` on a fit without the option refits so by itself."""
    model, two, y, exact = _two_mode_scale()
    res = pcv.fit(model, two, y=y, engine=engine, progress=False, options={"hyper_probe": True})
    assert res.converged and res.hyper["reach"]["targets"] >= 1 and res.hyper["reach"]["unreached"] == 0
    q = res.hyper["marginals"]["tau"]["quantiles"]
    for p in (0.05, 0.5, 0.95):
        assert float(q[p]) == pytest.approx(exact[p], rel=0.03)  # measured within 1.2%
    assert res.diagnostics.reach.passed and res.diagnostics.reliable
    plain = pcv.fit(model, two, y=y, engine=engine, progress=False)
    from pyro_convexvb.diagnostics import ApproximationWarning

    with pytest.warns(ApproximationWarning, match=r"reach check found mass it leaves out .*\(hyper_probe=True"):
        c = plain.corrected(seed=0)
    assert c.refit is not None and c.refit.hyper["reach"]["targets"] >= 1 and c.diagnostics.reliable
    for p in (0.05, 0.5, 0.95):
        assert float(c.sites["tau"]["quantiles"][p]) == pytest.approx(exact[p], rel=0.03)  # measured within 1.1%


def test_probes_that_find_no_mass_leave_the_grid_as_it_was():
    """A HalfCauchy scale: every probe outside the grid is more than the pruning threshold down, so the design and
    the marginals are those of the fit without probes, with the probes' fits on top."""
    model, _, y, _ = _two_mode_scale()
    prior = dist.HalfCauchy(torch.tensor(1.0, dtype=D))
    a = pcv.fit(model, prior, y=y, engine="dual_vg", progress=False)
    b = pcv.fit(model, prior, y=y, engine="dual_vg", progress=False, options={"hyper_probe": True})
    assert b.hyper["reach"]["targets"] == 0 and "unreached" not in b.hyper["reach"]
    assert b.hyper["evaluations"] == a.hyper["evaluations"] + len(b.hyper["reach"]["probes"])
    assert min(b.hyper["reach"]["drops"]) > 7.0
    for p, v in a.hyper["marginals"]["tau"]["quantiles"].items():
        assert float(b.hyper["marginals"]["tau"]["quantiles"][p]) == float(v)


def test_hyper_probe_is_refused_where_it_would_be_ignored():
    """No grid to grow (hyper='map', a central composite design) or no hyper-latents: said, not ignored."""
    model, _, y, _ = _two_mode_scale()
    prior = dist.HalfCauchy(torch.tensor(1.0, dtype=D))
    with pytest.raises(ValueError, match="hyper='map' keeps only the hyper-latents' mode, so hyper_probe=True"):
        pcv.fit(model, prior, y=y, engine="dual_vg", progress=False, options={"hyper": "map", "hyper_probe": True})
    with pytest.raises(ValueError, match="hyper_strategy='ccd' has no grid"):
        pcv.fit(model, prior, y=y, engine="dual_vg", progress=False,
                options={"hyper_strategy": "ccd", "hyper_probe": True})

    def fixed(y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", 6):
            pyro.sample("y", dist.Normal(w.sum() * torch.ones(6, dtype=D), 1.0), obs=y)

    with pytest.warns(UserWarning, match="option hyper_probe=True has no effect"):
        pcv.fit(fixed, y=y, engine="dual_vg", progress=False, options={"hyper_probe": True})
