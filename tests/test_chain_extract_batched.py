"""Extraction of long affine Gaussian chains with a few Jacobian products: every child's mean coefficients at once
(``extract._chain_batch``) and the predictor by residue classes (``chains.probe_by_residues``), against the per-child
and per-block extraction (the previous code path, kept as the fallback) on small loops, AR(2), a site-dependent
coefficient and a centred hierarchy: the same ``A``, prior blocks, designs, posterior and evidence."""
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import scipy.sparse as sp
import torch

import pyro_convexvb as pcv
import pyro_convexvb.lgm.chains as chains
import pyro_convexvb.lgm.extract as extract

D = torch.float64


def ar1(T, y=None):
    h = pyro.sample("h_0", dist.Normal(torch.tensor(0.2, dtype=D), 0.5 / math.sqrt(1 - 0.8**2)))
    hs = [h]
    for t in pyro.markov(range(1, T)):
        h = pyro.sample(f"h_{t}", dist.Normal(0.8 * h + 0.1, 0.5))
        hs.append(h)
    pyro.sample("y", dist.Bernoulli(logits=torch.stack(hs)).to_event(1), obs=y)


def ar2(T, y=None):
    """``h_t ~ N(0.5 h_{t-1} + 0.3 h_{t-2} + 0.05, 0.4^2)``: each mean reads two earlier sites."""
    hs = [pyro.sample("h_0", dist.Normal(torch.tensor(0.0, dtype=D), 1.0)),
          pyro.sample("h_1", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))]
    for t in range(2, T):
        hs.append(pyro.sample(f"h_{t}", dist.Normal(0.5 * hs[-1] + 0.3 * hs[-2] + 0.05, 0.4)))
    pyro.sample("y", dist.Normal(torch.stack(hs), 0.3).to_event(1), obs=y)


def ar_varying(T, y=None):
    """``h_t ~ N(phi_t h_{t-1}, s_t^2)`` with a coefficient and a scale of each step."""
    phi = 0.9 * torch.cos(torch.arange(T, dtype=D))
    s = 0.3 + 0.1 * torch.arange(T, dtype=D) / T
    h = pyro.sample("h_0", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
    hs = [h]
    for t in range(1, T):
        h = pyro.sample(f"h_{t}", dist.Normal(phi[t] * h, s[t]))
        hs.append(h)
    pyro.sample("y", dist.Bernoulli(logits=torch.stack(hs)).to_event(1), obs=y)


K_REG, J_GRP = 5, 20
REG = torch.arange(J_GRP) % K_REG


def hierarchy(y=None):
    """A centred three-level hierarchy: ``mu``, regions ``r_k ~ N(mu)``, groups ``a_j ~ N(r_{k(j)})`` (two children,
    vector blocks)."""
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
    with pyro.plate("regions", K_REG):
        r = pyro.sample("r", dist.Normal(mu, 0.5))
    with pyro.plate("groups", J_GRP):
        a = pyro.sample("a", dist.Normal(1.5 * r[REG] - 0.2, 0.3))
        pyro.sample("y", dist.Bernoulli(logits=a), obs=y)


def _data(n, seed=0):
    return torch.bernoulli(torch.full((n,), 0.4, dtype=D), generator=torch.Generator().manual_seed(seed))


def _extract(model, args, kwargs, monkeypatch, batched):
    """The LGM and the chain coefficients ``A`` (SciPy CSR) of one extraction, by the batched path (residue probes
    from two latent blocks on) or by the per-child, per-block one."""
    seen = {}
    chain_of = extract._chain_of

    def spy(x, priors, chain_coo, *rest, **kw):
        r = np.concatenate([c[0] for c in chain_coo]) if chain_coo else np.zeros(0, np.int64)
        c = np.concatenate([c[1] for c in chain_coo]) if chain_coo else np.zeros(0, np.int64)
        v = np.concatenate([c[2] for c in chain_coo]) if chain_coo else np.zeros(0)
        seen["A"] = sp.csr_matrix((v, (r, c)), shape=(x.n, x.n))
        return chain_of(x, priors, chain_coo, *rest, **kw)

    batch = extract._chain_batch
    calls = []

    def counted(x, names):
        out = batch(x, names)
        calls.append(out is not None)
        return out

    with monkeypatch.context() as m:
        m.setattr(extract, "_chain_of", spy)
        if batched:
            m.setattr(extract, "RESIDUE_PROBE_FROM_BLOCKS", 2)
            m.setattr(extract, "CHAIN_BATCH_FROM", 2)
            m.setattr(extract, "_chain_batch", counted)
        else:
            m.setattr(extract, "RESIDUE_PROBE_FROM_BLOCKS", 10**9)
            m.setattr(extract, "_chain_batch", lambda x, names: None)
        lgm = pcv.lgm_from_pyro(model, *args, **kwargs)
    if batched:
        assert calls == [True]  # the batched coefficients were used
    return lgm, seen["A"]


def _dense(op):
    return op.to_dense().detach().numpy() if hasattr(op, "to_dense") else None


CASES = {
    "ar1_T5": (ar1, (5,), lambda: {"y": _data(5)}),
    "ar1_T50": (ar1, (50,), lambda: {"y": _data(50)}),
    "ar2_T50": (ar2, (50,), lambda: {"y": torch.randn(50, generator=torch.Generator().manual_seed(1), dtype=D)}),
    "ar2_T200": (ar2, (200,), lambda: {"y": torch.randn(200, generator=torch.Generator().manual_seed(2), dtype=D)}),
    "varying_T50": (ar_varying, (50,), lambda: {"y": _data(50, 3)}),
    "hierarchy": (hierarchy, (), lambda: {"y": _data(J_GRP, 4)}),
    "ar1_T50_keep_graph": (ar1, (50,), lambda: {"y": _data(50), "keep_graph": True}),  # the innovation form
}


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
@pytest.mark.parametrize("case", list(CASES))
def test_batched_extraction_equals_the_per_child_one(case, monkeypatch):
    model, args, kwargs = CASES[case]
    kwargs = kwargs()
    new, A = _extract(model, args, kwargs, monkeypatch, batched=True)
    ref, A_ref = _extract(model, args, kwargs, monkeypatch, batched=False)
    assert A.nnz > 0 and (A != A_ref).nnz == 0  # the same coefficients, bit for bit
    assert [p.name for p in new.priors] == [p.name for p in ref.priors]
    for p, q in zip(new.priors, ref.priors):
        torch.testing.assert_close(p.loc.detach(), q.loc.detach(), rtol=1e-15, atol=1e-15)
        np.testing.assert_allclose(_dense(p.prec), _dense(q.prec), rtol=1e-15, atol=1e-15)
        assert float(p.logdet_cov) == pytest.approx(float(q.logdet_cov), rel=1e-15)
    for g, h in zip(new.sites, ref.sites):
        np.testing.assert_array_equal(_dense(g.design), _dense(h.design))
        torch.testing.assert_close(g.offset.detach(), h.offset.detach(), rtol=1e-15, atol=1e-15)
    opts = {"gap_tol": 1e-12}
    r1 = pcv.fit(new, engine="dual_vg", progress=False, options=opts)
    r2 = pcv.fit(ref, engine="dual_vg", progress=False, options=opts)
    assert r1.converged and r2.converged
    torch.testing.assert_close(r1.posterior.loc, r2.posterior.loc, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r1.posterior.variance, r2.posterior.variance, rtol=1e-12, atol=1e-12)
    assert r1.log_evidence_bound == pytest.approx(r2.log_evidence_bound, rel=1e-12, abs=1e-12)


def test_ar2_coefficients_against_the_model(monkeypatch):
    """AR(2) at 200 steps (residue classes mod 2): A holds 0.5 on the first and 0.3 on the second subdiagonal, from
    step 2 on, and nothing else."""
    T = 200
    y = torch.randn(T, generator=torch.Generator().manual_seed(2), dtype=D)
    _, A = _extract(ar2, (T,), {"y": y}, monkeypatch, batched=True)
    ref = np.zeros((T, T))
    t = np.arange(2, T)
    ref[t, t - 1], ref[t, t - 2] = 0.5, 0.3
    np.testing.assert_array_equal(A.toarray(), ref)


def test_a_long_loop_takes_a_few_products_not_one_per_site(monkeypatch):
    """An AR(1) loop of 300 sites: no per-child coefficient extraction (``chain_jacobian``) and a few forward products
    for the chain and the predictor together, where the per-child, per-block extraction took about one per site
    for each."""
    T = 300
    calls = {"chain_jacobian": 0, "products": 0}
    cj = chains.chain_jacobian

    def counted_cj(*a, **k):
        calls["chain_jacobian"] += 1
        return cj(*a, **k)

    jvp, jvp_many = extract._AutogradJacobian.jvp, extract._AutogradJacobian.jvp_many

    def counted_jvp(self, v):
        calls["products"] += 1
        return jvp(self, v)

    def counted_many(self, V):
        calls["products"] += V.shape[0]
        return jvp_many(self, V)

    monkeypatch.setattr(chains, "chain_jacobian", counted_cj)
    monkeypatch.setattr(extract._AutogradJacobian, "jvp", counted_jvp)
    monkeypatch.setattr(extract._AutogradJacobian, "jvp_many", counted_many)
    lgm = pcv.lgm_from_pyro(ar1, T, y=_data(T))
    assert calls["chain_jacobian"] == 0
    assert calls["products"] <= 12
    # and the result: the joint prior of the loop, the identity design
    assert lgm.chain is None and len(lgm.priors) == 1
    np.testing.assert_array_equal(lgm.sites[0].design.to_dense().numpy(), np.eye(T))


def test_probe_by_residues_recovers_banded_maps_and_refuses_others():
    """A map whose rows read a window of three coordinates is recovered exactly (modulus 4) with a few products;
    rows reading coordinates ``0`` and ``n - 1`` with ``n - 1`` a multiple of every modulus give ``None``."""
    n = 1000
    g = torch.Generator().manual_seed(0)
    W = torch.randn(n, 3, generator=g, dtype=D)
    count = [0]

    def jvp(v):
        count[0] += 1
        out = W[:, 0] * v
        out[1:] += W[1:, 1] * v[:-1]
        out[2:] += W[2:, 2] * v[:-2]
        return out

    r, c, v = chains.probe_by_residues(jvp, n, n, D)
    M = sp.csr_matrix((v, (r, c)), shape=(n, n)).toarray()
    ref = np.diag(W[:, 0].numpy()) + np.diag(W[1:, 1].numpy(), -1) + np.diag(W[2:, 2].numpy(), -2)
    np.testing.assert_array_equal(M, ref)
    assert count[0] == 4 * (1 + 2 + 4)  # moduli 1 and 2 fail, 4 succeeds: 4 K products each
    m = 1 + 8 * 120  # n - 1 = 960 is a multiple of 1, 2, 4 and 8

    def far(v):
        return (v[0] + v[m - 1]).reshape(1)

    assert chains.probe_by_residues(far, 1, m, D) is None


def test_a_mean_reading_a_later_site_is_still_named(monkeypatch):
    """The batched coefficients give way to the per-child extraction on any refusal, which names the site."""
    def model():
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        b = pyro.sample("b", dist.Normal(a, 1.0))
        c = pyro.sample("c", dist.Normal(b * b, 1.0))  # not affine in b
        pyro.sample("y", dist.Normal(a + b + c, 1.0), obs=torch.tensor(0.3, dtype=D))

    from pyro_convexvb.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="'c'.*not an affine function"):
        pcv.lgm_from_pyro(model)
