"""AR loops written as Pyro loops of scalar sites: extracted in the model's coordinates with the joint sparse precision
(the representation of one ``SparseGMRF`` site), against the innovation form, the same prior as one ``SparseGMRF``
site and the exact conjugate answer; nothing quadratic in the length is stored."""
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import scipy.sparse as sp
import torch

import pyro_convexvb as pcv
import pyro_convexvb.lgm.chains as chains
from pyro_convexvb.linalg.operators import DenseOperator, DiagonalOperator, SparseOperator

D = torch.float64
PHI, S, C0, C, NOISE = 0.8, 0.5, 0.2, 0.1, 0.3


def ar_loop(T, y=None, lik="bernoulli"):
    """``h_0 ~ N(C0, S^2 / (1 - PHI^2))``, ``h_t ~ N(PHI h_{t-1} + C, S^2)`` as ``T`` scalar sites."""
    h = pyro.sample("h_0", dist.Normal(torch.tensor(C0, dtype=D), S / math.sqrt(1 - PHI**2)))
    hs = [h]
    for t in pyro.markov(range(1, T)):
        h = pyro.sample(f"h_{t}", dist.Normal(PHI * h + C, S))
        hs.append(h)
    _likelihood(torch.stack(hs), y, lik)


def _likelihood(h, y, lik):
    if lik == "bernoulli":
        pyro.sample("y", dist.Bernoulli(logits=h).to_event(1), obs=y)
    else:
        pyro.sample("y", dist.Normal(h, NOISE).to_event(1), obs=y)


def ar_prior(T):
    """``(mean (T,), Q (T, T) SciPy CSR, L = I - A, S (T,))`` of the AR(1) prior above, in NumPy."""
    L = (sp.identity(T) - sp.diags([PHI * np.ones(T - 1)], [-1])).tocsr()
    Sd = np.full(T, S**2)
    Sd[0] = S**2 / (1 - PHI**2)
    b = np.full(T, C)
    b[0] = C0
    Q = (L.T @ sp.diags(1 / Sd) @ L).tocsr()
    return np.linalg.solve(L.toarray(), b), Q, L, Sd


def ar_gmrf(T, y=None, lik="bernoulli"):
    """The same prior as one ``SparseGMRF`` site of tridiagonal precision."""
    mean, Q, _, _ = ar_prior(T)
    Qt = torch.sparse_csr_tensor(torch.as_tensor(Q.indptr), torch.as_tensor(Q.indices), torch.as_tensor(Q.data),
                                 size=Q.shape)
    h = pyro.sample("h", pcv.distributions.SparseGMRF(torch.as_tensor(mean), Qt))
    _likelihood(h, y, lik)


def _data(T, lik, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean, Q, L, Sd = ar_prior(T)
    e = np.sqrt(Sd) * np.random.default_rng(seed).standard_normal(T)
    h = torch.as_tensor(np.linalg.solve(L.toarray(), e) + mean)
    if lik == "bernoulli":
        return torch.bernoulli(torch.sigmoid(h), generator=g)
    return h + NOISE * torch.randn(T, generator=g, dtype=D)


def _fit(model, T, y, lik, engine, innovation=False, monkeypatch=None, form=None):
    if innovation:
        monkeypatch.setattr(chains, "FILL_FACTOR", math.inf)
    opts = {"dual_vg": {"gap_tol": 1e-13}, "laplace": {"grad_tol": 1e-13}}.get(engine, {})
    if form is not None:
        opts["form"] = form
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)
        res = pcv.fit(model, T, y=y, lik=lik, engine=engine, progress=False, options=opts)
    if innovation:
        monkeypatch.undo()
    return res


def _covariance(q):
    return q.covariance(force=True) if q.kind == "precision_operator" else q.covariance()


def test_an_ar_loop_is_one_prior_block_of_the_tridiagonal_precision():
    """The extracted LGM of a loop of 50 sites: no chain, one prior block holding ``Q = (I - A)^T S^{-1} (I - A)``
    (its 3 T - 2 nonzeros), mean ``(I - A)^{-1} b`` and ``log |S|``; the design stays the identity's 50 entries;
    the layout still names every site. The innovation form (FILL_FACTOR = inf) has a chain and a design of
    T (T + 1) / 2 entries."""
    T = 50
    y = _data(T, "bernoulli")
    lgm = pcv.lgm_from_pyro(ar_loop, T, y=y)
    mean, Q, _, Sd = ar_prior(T)
    assert lgm.chain is None and len(lgm.priors) == 1 and lgm.layout.names == [f"h_{t}" for t in range(T)]
    p = lgm.priors[0]
    assert p.name == "h_0..h_49" and isinstance(p.prec, SparseOperator) and p.prec.nnz == 3 * T - 2
    np.testing.assert_allclose(p.prec.to_dense().numpy(), Q.toarray(), rtol=1e-15, atol=1e-13)
    np.testing.assert_allclose(p.loc.numpy(), mean, rtol=1e-14, atol=1e-15)
    assert p.logdet_cov == pytest.approx(float(np.log(Sd).sum()), rel=1e-15)
    design = lgm.sites[0].design
    assert (design.nnz if isinstance(design, SparseOperator) else int((design.to_dense() != 0).sum())) == T
    old = chains.FILL_FACTOR
    try:
        chains.FILL_FACTOR = math.inf
        lgm_u = pcv.lgm_from_pyro(ar_loop, T, y=y)
    finally:
        chains.FILL_FACTOR = old
    assert lgm_u.chain is not None and len(lgm_u.priors) == T
    assert int((lgm_u.sites[0].design.to_dense() != 0).sum()) == T * (T + 1) // 2


@pytest.mark.parametrize("lik", ["bernoulli", "normal"])
@pytest.mark.parametrize("engine, form", [("dual_vg", "site"), ("dual_vg", "latent"), ("laplace", None)])
def test_model_coordinates_equal_the_innovation_form_and_one_sparse_gmrf(engine, form, lik, monkeypatch):
    """T = 50: the evidence bound (constants included) and the posterior (means, covariances) of the new form equal
    those of the innovation form and of the same prior as one ``SparseGMRF`` site, to rounding, when the engine runs
    the same algorithm on the three (dual_vg in one form: with form='auto' the SparseGMRF model takes the banded
    form while the loop's extracted design is a dense 50 x 50 identity, so the answers agree to the duality-gap
    tolerance only; the 2000-step test below compares the banded form)."""
    T = 50
    y = _data(T, lik)
    new = _fit(ar_loop, T, y, lik, engine, form=form)
    old = _fit(ar_loop, T, y, lik, engine, innovation=True, monkeypatch=monkeypatch, form=form)
    gmrf = _fit(ar_gmrf, T, y, lik, engine, form=form)
    assert new.converged and old.converged and gmrf.converged
    assert new.lgm.chain is None and old.lgm.chain is not None
    assert new.posterior.layout.names == [f"h_{t}" for t in range(T)]
    C_new = _covariance(new.posterior)
    for ref in (old, gmrf):
        assert abs(new.log_evidence_bound - ref.log_evidence_bound) < 1e-13 * abs(ref.log_evidence_bound)
        np.testing.assert_allclose(new.posterior.loc.numpy(), ref.posterior.loc.numpy(), rtol=0, atol=1e-12)
        np.testing.assert_allclose(C_new.numpy(), _covariance(ref.posterior).numpy(), rtol=0, atol=1e-13)
        np.testing.assert_allclose(new.posterior.variance.numpy(), ref.posterior.variance.numpy(), rtol=1e-12)


@pytest.mark.parametrize("engine", ["dual_vg", "laplace", "convex_relaxation"])
def test_gaussian_ar_loop_gives_the_exact_conjugate_posterior_and_marginal_likelihood(engine):
    """Normal likelihood: the posterior and ``log p(y)`` in closed form with dense NumPy (``Q + I / noise^2``, and
    ``N(y | m0, Q^{-1} + noise^2 I)``)."""
    T = 50
    y = _data(T, "normal")
    res = _fit(ar_loop, T, y, "normal", engine)
    mean0, Q, _, _ = ar_prior(T)
    Qd, yn = Q.toarray(), y.numpy()
    cov = np.linalg.inv(Qd + np.eye(T) / NOISE**2)
    mean = cov @ (Qd @ mean0 + yn / NOISE**2)
    K = np.linalg.inv(Qd) + NOISE**2 * np.eye(T)
    r = yn - mean0
    logml = -0.5 * (r @ np.linalg.solve(K, r) + np.linalg.slogdet(K)[1] + T * math.log(2 * math.pi))
    np.testing.assert_allclose(res.posterior.loc.numpy(), mean, rtol=0, atol=1e-11)
    np.testing.assert_allclose(_covariance(res.posterior).numpy(), cov, rtol=0, atol=1e-12)
    assert res.log_evidence_bound == pytest.approx(logml, abs=1e-9)


def test_the_guide_and_predictive_sample_the_model_sites():
    """The posterior's guide feeds ``pyro.infer.Predictive`` with every ``h_t`` site: the draws' means and sds match
    the posterior's (Monte Carlo tolerance), and they are draws of the exact conjugate posterior."""
    T = 50
    y = _data(T, "normal")
    res = pcv.fit(ar_loop, T, y=y, lik="normal", engine="dual_vg", progress=False)
    guide = res.posterior.as_guide(trainable=False)
    pyro.set_rng_seed(0)
    draws = pyro.infer.Predictive(ar_loop, guide=guide, num_samples=400, return_sites=[f"h_{t}" for t in range(T)])(
        T, lik="normal")
    H = torch.stack([draws[f"h_{t}"].reshape(-1) for t in range(T)], -1)
    sd = res.posterior.variance.sqrt()
    assert H.shape == (400, T)
    assert float(((H.mean(0) - res.posterior.loc).abs() / sd).max()) < 5 / math.sqrt(400)
    assert float((H.std(0) / sd - 1).abs().max()) < 0.2


def _stored_entries(op):
    """Entries an operator stores (nonzeros of a sparse matrix, the diagonal, every entry of a dense matrix)."""
    if op is None:
        return 0
    if isinstance(op, SparseOperator):
        return op.nnz
    if isinstance(op, DiagonalOperator):
        return op.shape[0]
    if isinstance(op, DenseOperator):
        return op.matrix.numel()
    parts = getattr(op, "operators", None) or [getattr(op, "base", None)]
    if any(p is None for p in parts):
        raise AssertionError(f"an operator of unknown storage: {type(op).__name__}")
    return sum(_stored_entries(p) for p in parts)


def test_a_2000_step_loop_stores_o_of_t_entries_and_fits_in_the_banded_form():
    """T = 2000 (Bernoulli): every prior block, design and offset of the extracted LGM stores O(T) entries (the
    innovation form stored the 2,001,000 nonzeros of (I - A)^{-1} in the design), and dual_vg fits it in the banded
    form of a ``SparseGMRF``, with the same posterior as the ``SparseGMRF`` model."""
    T = 2000
    y = _data(T, "bernoulli")
    lgm = pcv.lgm_from_pyro(ar_loop, T, y=y)
    stored = sum(_stored_entries(p.prec) + _stored_entries(p.cov) + p.size for p in lgm.priors)
    stored += sum(_stored_entries(g.design) + g.offset.numel() for g in lgm.sites)
    assert stored <= 6 * T, stored  # 3T - 2 precision, T means, T design entries, T offsets
    assert lgm.chain is None and not lgm.imputed  # (nothing stored in a chain's maps either)
    res = pcv.fit(lgm, engine="dual_vg", progress=False)
    ref = pcv.fit(ar_gmrf, T, y=y, engine="dual_vg", progress=False)
    assert res.info["form"] == ref.info["form"] == "banded" and res.converged
    assert abs(res.log_evidence_bound - ref.log_evidence_bound) < 1e-9 * abs(ref.log_evidence_bound)
    np.testing.assert_allclose(res.posterior.loc.numpy(), ref.posterior.loc.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(res.posterior.variance.numpy(), ref.posterior.variance.numpy(), rtol=1e-9)


def _pyro_exact(model, y):
    """``(mean, covariance, log p(y))`` of a Gaussian Pyro model from the derivatives of Pyro's own log joint at 0
    (dense float64; it never sees the extraction)."""
    tr = pyro.poutine.trace(model).get_trace(y)
    nodes = [(n, s["value"].shape) for n, s in tr.nodes.items()
             if s["type"] == "sample" and not s["is_observed"] and type(s["fn"]).__name__ != "_Subsample"]
    sizes = [int(math.prod(sh)) for _, sh in nodes]

    def log_joint(v):
        vals = {n: c.reshape(sh) for (n, sh), c in zip(nodes, v.split(sizes))}
        return pyro.poutine.trace(pyro.poutine.condition(model, vals)).get_trace(y).log_prob_sum()

    v0 = torch.zeros(sum(sizes), dtype=D)
    cov = torch.linalg.inv(-torch.autograd.functional.hessian(log_joint, v0))
    mean = cov @ torch.autograd.functional.jacobian(log_joint, v0)
    logml = float(log_joint(mean)) + 0.5 * float(torch.logdet(cov)) + 0.5 * len(v0) * math.log(2 * math.pi)
    return mean, cov, logml


def test_a_hierarchy_beside_an_ar_loop_keeps_its_innovation_form(monkeypatch):
    """A one-level hierarchy (mu, alpha_j ~ N(mu, s)) and an AR loop in one model: the hierarchy stays in the
    chain (innovation form, unchanged), the loop is one prior block; the posterior over the model's sites is the
    exact one from Pyro's log joint, as with everything in the innovation form."""
    T, J = 30, 4
    g = torch.Generator().manual_seed(1)
    y = torch.randn(T, generator=g, dtype=D)

    def model(y=None):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.3, dtype=D), 2.0))
        with pyro.plate("groups", J):
            alpha = pyro.sample("alpha", dist.Normal(mu, 0.7))
        h = pyro.sample("h_0", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        hs = [h]
        for t in pyro.markov(range(1, T)):
            h = pyro.sample(f"h_{t}", dist.Normal(PHI * h, S))
            hs.append(h)
        pyro.sample("y", dist.Normal(torch.stack(hs) + alpha[torch.arange(T) % J], NOISE).to_event(1), obs=y)

    lgm = pcv.lgm_from_pyro(model, y=y)
    assert lgm.chain is not None and lgm.chain.children == ["alpha"]
    assert [p.name for p in lgm.priors] == ["mu", "alpha", "h_0..h_29"]
    res = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    monkeypatch.setattr(chains, "FILL_FACTOR", math.inf)
    old = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    assert res.lgm.chain.children == ["alpha"] and old.lgm.chain.children == ["alpha"] + [f"h_{t}" for t in range(1, T)]
    mean, cov, logml = _pyro_exact(model, y)
    for r in (res, old):
        np.testing.assert_allclose(r.posterior.loc.numpy(), mean.numpy(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(r.posterior.covariance().numpy(), cov.numpy(), rtol=0, atol=1e-12)
        assert r.log_evidence_bound == pytest.approx(logml, abs=1e-9)


def test_keep_graph_keeps_the_innovation_form():
    """An extraction keeping the params' graph (type-II gradients) keeps the innovation form, as documented."""
    T = 20
    y = _data(T, "normal")
    lgm = pcv.lgm_from_pyro(ar_loop, T, y=y, lik="normal", keep_graph=True)
    assert lgm.chain is not None and len(lgm.priors) == T


def test_an_intrinsic_gmrf_read_by_a_long_chain_keeps_the_innovation_form():
    """A run holding an intrinsic SparseGMRF (constrained coordinates, dummy pivots) keeps the innovation form;
    its posterior is the one of the same model with the loop written in model coordinates by hand (one
    ``SparseGMRF`` child of joint precision ``Q`` whose mean reads the field), which the engines fit as before."""
    T, K = 30, 5
    R = pcv.distributions.rw_precision(K)
    y = torch.randn(T, generator=torch.Generator().manual_seed(2), dtype=D)

    def model(y=None):
        f = pyro.sample("f", pcv.distributions.SparseGMRF(torch.zeros(K, dtype=D), R, torch.tensor(4.0, dtype=D),
                                                          constraints="sum_to_zero"))
        h = pyro.sample("h_0", dist.Normal(f[0], 1.0))
        hs = [h]
        for t in pyro.markov(range(1, T)):
            h = pyro.sample(f"h_{t}", dist.Normal(PHI * h + f[t % K], S))
            hs.append(h)
        pyro.sample("y", dist.Normal(torch.stack(hs), NOISE).to_event(1), obs=y)

    lgm = pcv.lgm_from_pyro(model, y=y)
    assert lgm.chain is not None and lgm.chain.has_intrinsic and len(lgm.priors) == T + 1
    assert lgm.chain.children == [f"h_{t}" for t in range(T)]
    res = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    assert res.converged and np.isfinite(res.log_evidence_bound)


def test_a_site_sampled_inside_the_loop_joins_the_prior_block():
    """A coefficient sampled between the loop's sites (not part of the chain) joins the run's prior block with its
    own prior; the answer is the exact one from Pyro's log joint."""
    T = 30
    x = torch.linspace(-1, 1, T, dtype=D)
    y = torch.randn(T, generator=torch.Generator().manual_seed(3), dtype=D)

    def model(y=None):
        h = pyro.sample("h_0", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        hs = [h]
        for t in pyro.markov(range(1, T)):
            if t == 10:
                beta = pyro.sample("beta", dist.Normal(torch.zeros(2, dtype=D), 2.0).to_event(1))
            h = pyro.sample(f"h_{t}", dist.Normal(PHI * h, S))
            hs.append(h)
        pyro.sample("y", dist.Normal(torch.stack(hs) + beta[0] + beta[1] * x, NOISE).to_event(1), obs=y)

    lgm = pcv.lgm_from_pyro(model, y=y)
    assert lgm.chain is None and [p.name for p in lgm.priors] == ["h_0..h_29"] and lgm.priors[0].size == T + 2
    mean, cov, logml = _pyro_exact(model, y)
    res = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    assert res.posterior.layout.names[9:12] == ["h_9", "beta", "h_10"]
    np.testing.assert_allclose(res.posterior.loc.numpy(), mean.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(res.posterior.covariance().numpy(), cov.numpy(), rtol=0, atol=1e-12)
    assert res.log_evidence_bound == pytest.approx(logml, abs=1e-9)


def test_a_laplace_root_of_a_long_chain_keeps_the_innovation_form():
    """A flat block (a Laplace prior, turned into sites) in the run keeps the innovation form, as documented."""
    T = 30
    y = torch.randn(T, generator=torch.Generator().manual_seed(4), dtype=D)

    def model(y=None):
        mu = pyro.sample("mu", dist.Laplace(torch.tensor(0.0, dtype=D), 1.0))
        h = pyro.sample("h_0", dist.Normal(mu, 1.0))
        hs = [h]
        for t in pyro.markov(range(1, T)):
            h = pyro.sample(f"h_{t}", dist.Normal(PHI * h + mu, S))
            hs.append(h)
        pyro.sample("y", dist.Normal(torch.stack(hs), NOISE).to_event(1), obs=y)

    lgm = pcv.lgm_from_pyro(model, y=y)
    assert lgm.chain is not None and lgm.priors[0].flat and len(lgm.priors) == T + 1


def test_a_hyper_latent_innovation_scale_integrates_to_the_innovation_forms_answer(monkeypatch):
    """``s ~ HalfNormal`` on the loop's innovation scale (a hyper-latent, one extraction per design point, each
    rebuilding the joint prior block): the mixture posterior and the hyper-marginal equal those of the innovation
    form to rounding. Both fits difference their mode search's gradients: a graph-keeping extraction (envelope
    gradients) builds the innovation form, so the joint form's envelope is refused by its value check and the two
    forms would otherwise reach the mode along different paths (equal only to the search's tolerance)."""
    from pyro_convexvb.infer.dual_vg.engine import DualVGEngine

    monkeypatch.setattr(DualVGEngine, "envelope_bound", lambda self, result, lgm: None)
    T = 30

    def model(y=None):
        s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        h = pyro.sample("h_0", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        hs = [h]
        for t in pyro.markov(range(1, T)):
            h = pyro.sample(f"h_{t}", dist.Normal(PHI * h, s))
            hs.append(h)
        pyro.sample("y", dist.Normal(torch.stack(hs), NOISE).to_event(1), obs=y)

    y = torch.randn(T, generator=torch.Generator().manual_seed(0), dtype=D)
    new = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    monkeypatch.setattr(chains, "FILL_FACTOR", math.inf)
    old = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    np.testing.assert_allclose(new.posterior.loc.numpy(), old.posterior.loc.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(new.posterior.variance.numpy(), old.posterior.variance.numpy(), rtol=1e-12)
    m1, m2 = new.hyper["marginals"]["s"], old.hyper["marginals"]["s"]
    assert float(m1["mean"]) == pytest.approx(float(m2["mean"]), rel=1e-12)
    assert float(m1["sd"]) == pytest.approx(float(m2["sd"]), rel=1e-10)
