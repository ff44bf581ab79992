"""Intrinsic GMRFs (ICAR, RW1, RW2 with linear constraints): density, draws, BYM2 scaling, and exact LGM fits."""
import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.distributions import SparseGMRF, bym2_precision, bym2_scaling, icar_precision, rw_precision
from pyro_convexvb.errors import NotPositiveDefiniteError

D = torch.float64


def _cases():
    n = 7
    W = torch.zeros(6, 6, dtype=D)  # a connected graph: a ring with one chord
    for i in range(6):
        W[i, (i + 1) % 6] = W[(i + 1) % 6, i] = 1.0
    W[0, 3] = W[3, 0] = 1.0
    return [("rw1", rw_precision(n), torch.ones(1, n, dtype=D)),
            ("rw2", rw_precision(n, 2), torch.stack([torch.ones(n, dtype=D), torch.arange(n, dtype=D)])),
            ("icar", icar_precision(W), "sum_to_zero")]


def _constraint(C, n):
    return torch.ones(1, n, dtype=D) if isinstance(C, str) else C


@pytest.mark.parametrize("name,Q,C", _cases(), ids=[c[0] for c in _cases()])
def test_density_variances_and_draws_against_the_eigendecomposition(name, Q, C):
    n = Q.shape[0]
    Cm = _constraint(C, n)
    k = Cm.shape[0]
    s = torch.tensor(1.7, dtype=D)
    d = SparseGMRF(torch.full((n,), 0.2, dtype=D), Q, s, constraints=C)
    lam, U = torch.linalg.eigh(s * Q.to_dense())
    assert d.rank == n - k and d.is_intrinsic
    assert abs(float(d.log_det_precision()) - float(lam[k:].log().sum())) < 1e-10
    V = U[:, k:]  # orthonormal basis of the constraint subspace
    z = torch.randn(3, n - k, dtype=D, generator=torch.Generator().manual_seed(0))
    x = 0.2 + z @ V.T
    ref = dist.MultivariateNormal(torch.zeros(n - k, dtype=D), precision_matrix=torch.diag(lam[k:])).log_prob(
        z @ (V.T @ V))  # coordinates of x - loc in the basis V
    assert torch.allclose(d.log_prob(x), ref, atol=1e-10)
    cov = torch.linalg.pinv(s * Q.to_dense())
    assert torch.allclose(d.variance, cov.diagonal(), atol=1e-12)
    pyro.set_rng_seed(1)
    draws = d.rsample((4000,))
    assert float(((draws - 0.2) @ Cm.T).abs().max()) < 1e-10
    emp = torch.cov(draws.T)
    assert float((emp - cov).abs().max()) < 6 * float(cov.diagonal().max()) / math.sqrt(4000)


def test_bym2_scaling_gives_unit_generalised_variance():
    Q = rw_precision(9)
    c = bym2_scaling(Q)
    v = torch.linalg.pinv(Q.to_dense()).diagonal()
    assert abs(c - float(v.log().mean().exp())) < 1e-12
    scaled = SparseGMRF(torch.zeros(9, dtype=D), Q, torch.tensor(c, dtype=D), constraints="sum_to_zero")
    assert abs(float(scaled.variance.log().mean())) < 1e-12


def _disconnected_adjacency():
    """Seven nodes: a path 0-1-2-3, a pair 4-5 and an island 6."""
    W = torch.zeros(7, 7, dtype=D)
    for a, b in [(0, 1), (1, 2), (2, 3), (4, 5)]:
        W[a, b] = W[b, a] = 1.0
    return W


def test_bym2_on_a_disconnected_graph_scales_each_component_and_frees_the_island():
    """Freni-Sterrantino, Ventrucci & Rue (2018): each component of two or more nodes has its own sum-to-zero
    constraint and unit generalised variance; an island is an iid effect of unit variance. ``bym2_scaling`` had
    returned 0.0 for per-component constraints with an island (a zero variance, log 0) and one global factor
    otherwise; it now refuses a disconnected graph and points to ``bym2_precision``."""
    W = _disconnected_adjacency()
    Q, C = bym2_precision(W)
    assert torch.equal(C, torch.tensor([[1.0, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 0]], dtype=D))
    L = icar_precision(W).to_dense()
    expected = torch.zeros(7, dtype=D)
    for idx in ([0, 1, 2, 3], [4, 5]):
        v = torch.linalg.pinv(L[idx][:, idx]).diagonal()  # constrained variances of the component's ICAR
        gm = v.log().mean().exp()
        torch.testing.assert_close(Q.to_dense()[idx][:, idx], L[idx][:, idx] * gm, rtol=1e-12, atol=1e-12)
        expected[idx] = v / gm
    expected[6] = 1.0
    assert float(Q.to_dense()[6, 6]) == 1.0 and float(Q.to_dense()[6, :6].abs().sum()) == 0.0
    d = SparseGMRF(torch.zeros(7, dtype=D), Q, torch.tensor(4.0, dtype=D), constraints=C)
    torch.testing.assert_close(d.variance, expected / 4.0, rtol=1e-10, atol=1e-12)
    for comp in (slice(0, 4), slice(4, 6)):
        assert abs(float(d.variance[comp].log().mean()) + math.log(4.0)) < 1e-10
    Qc, Cc = bym2_precision(W[:4, :4])  # connected: bym2_scaling's factor and the row of ones
    torch.testing.assert_close(Qc.to_dense(), bym2_scaling(icar_precision(W[:4, :4])) * L[:4, :4])
    assert torch.equal(Cc, torch.ones(1, 4, dtype=D))
    Qi, Ci = bym2_precision(torch.zeros(3, 3))
    assert Ci is None and torch.equal(Qi.to_dense(), torch.eye(3, dtype=D))
    with pytest.raises(TypeError, match="dtype: expected a floating point dtype"):
        bym2_precision(W, dtype=torch.int64)
    for constraints in ("sum_to_zero", C, torch.cat([C, torch.eye(7, dtype=D)[6:]])):
        with pytest.raises(ValueError, match="3 connected components .* use bym2_precision"):
            bym2_scaling(icar_precision(W), constraints)


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_bym2_field_on_a_disconnected_graph_is_fitted_exactly(engine):
    """Gaussian observations of ``b0 + x`` with the BYM2 structured field of a disconnected graph (two
    constraints, an island): exact against the model written in an orthonormal basis of the constraint
    subspace."""
    W = _disconnected_adjacency()
    Q, C = bym2_precision(W)
    s, sigma = 2.5, 0.6
    y = torch.randn(7, generator=torch.Generator().manual_seed(4), dtype=D) + 0.4

    def model(y):
        b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        x = pyro.sample("x", SparseGMRF(torch.zeros(7, dtype=D), Q, torch.tensor(s, dtype=D), constraints=C))
        pyro.sample("y", dist.Normal(b0 + x, sigma).to_event(1), obs=y)

    res = pcv.fit(model, y, engine=engine, progress=False)
    assert res.converged
    V = torch.linalg.svd(C, full_matrices=True)[2][2:].T  # (7, 5) orthonormal basis of {C x = 0}
    B = torch.cat([torch.ones(7, 1, dtype=D), V], 1)
    P0 = torch.block_diag(torch.tensor([[0.25]], dtype=D), s * V.T @ Q.to_dense() @ V)
    cov = torch.linalg.inv(P0 + B.T @ B / sigma**2)
    m = cov @ (B.T @ y / sigma**2)
    T = torch.block_diag(torch.eye(1, dtype=D), V)
    torch.testing.assert_close(res.posterior.loc, T @ m, rtol=0, atol=1e-7)
    torch.testing.assert_close(res.posterior.covariance(), T @ cov @ T.T, rtol=0, atol=1e-7)
    evidence = dist.MultivariateNormal(torch.zeros(7, dtype=D), B @ torch.linalg.inv(P0) @ B.T
                                       + sigma**2 * torch.eye(7, dtype=D)).log_prob(y)
    assert abs(res.log_evidence_bound - float(evidence)) < 1e-6


def test_constraints_that_miss_the_null_space_are_refused():
    with pytest.raises(ValueError, match="span the null space"):
        SparseGMRF(torch.zeros(5, dtype=D), rw_precision(5), constraints=torch.arange(5, dtype=D).reshape(1, 5))
    with pytest.raises(NotPositiveDefiniteError, match="one constraint per null direction"):
        SparseGMRF(torch.zeros(5, dtype=D), rw_precision(5, 2), constraints="sum_to_zero")


def _design_basis(n, k, Q):
    lam, U = torch.linalg.eigh(Q.to_dense())
    return U[:, k:], lam[k:]


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_intrinsic_field_with_intercept_is_exact(engine):
    """Gaussian observations of b0 + x, x an RW1 summing to zero: exact against the model written in an
    orthonormal basis of the constraint subspace (an independent parametrisation)."""
    n, s = 8, 2.0
    Q = rw_precision(n)
    y = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=D)

    def model(y):
        b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 3.0))
        x = pyro.sample("x", SparseGMRF(torch.zeros(n, dtype=D), Q, torch.tensor(s, dtype=D), constraints="sum_to_zero"))
        pyro.sample("y", dist.Normal(b0 + x, 0.5).to_event(1), obs=y)

    res = pcv.fit(model, y, engine=engine, progress=False)
    V, lam = _design_basis(n, 1, Q)
    B = torch.cat([torch.ones(n, 1, dtype=D), V], 1)
    P0 = torch.block_diag(torch.tensor([[1 / 9.0]], dtype=D), s * torch.diag(lam))
    C = torch.linalg.inv(P0 + B.T @ B / 0.25)
    m = C @ (B.T @ y / 0.25)
    T = torch.block_diag(torch.eye(1, dtype=D), V)
    assert torch.allclose(res.posterior.loc, T @ m, atol=1e-8)
    assert torch.allclose(res.posterior.covariance(), T @ C @ T.T, atol=1e-8)
    evidence = dist.MultivariateNormal(torch.zeros(n, dtype=D), B @ torch.linalg.inv(P0) @ B.T
                                       + 0.25 * torch.eye(n, dtype=D)).log_prob(y)
    assert abs(res.log_evidence_bound - float(evidence)) < 1e-7
    assert float(res.posterior.loc[1:].sum().abs()) < 1e-10  # the constraint holds in the posterior


@pytest.mark.parametrize("name,Q,C", _cases(), ids=[c[0] for c in _cases()])
def test_posterior_draws_and_guides_of_an_intrinsic_field_keep_its_constraints(name, Q, C):
    """The posterior of an intrinsic field has a covariance singular to rounding. Whether Cholesky succeeded on it
    was decided by rounding: draws left the constraint subspace by 1e-7 when it did, and the guides failed with a
    bare error when it did not. Draws now come from its eigen-root (null directions exactly zero), the fixed guide
    samples through Predictive, and a trainable guide, which holds a Cholesky factor, is refused with the reason."""
    from pyro.infer import Predictive

    n = Q.shape[0]
    Cm = _constraint(C, n)
    y = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=D)

    def model(y):
        x = pyro.sample("x", SparseGMRF(torch.full((n,), 0.3, dtype=D), Q, torch.tensor(2.0, dtype=D), constraints=C))
        pyro.sample("y", dist.Normal(x, 0.7).to_event(1), obs=y)

    q = pcv.fit(model, y, engine="dual_vg", progress=False).posterior
    assert q.is_singular()
    draws = q.sample(2000, generator=torch.Generator().manual_seed(2))
    assert float(((draws - 0.3) @ Cm.T).abs().max()) < 1e-12
    emp = torch.cov(draws.T)
    assert float((emp - q.covariance()).abs().max()) < 0.15 * float(q.covariance().diagonal().max())
    with pytest.raises(ValueError, match="covariance is singular .* use as_guide\\(trainable=False\\)"):
        q.as_guide()
    with pytest.raises(ValueError, match="log_prob: the posterior's covariance is singular"):
        q.log_prob(q.loc)
    pyro.set_rng_seed(3)
    out = Predictive(model, guide=q.as_guide(trainable=False), num_samples=300, return_sites=["x"])(y)
    assert float(((out["x"].reshape(300, n) - 0.3) @ Cm.T).abs().max()) < 1e-12


def test_icar_poisson_equals_its_subspace_parametrisation():
    """Poisson disease mapping with an ICAR field: dual_vg's optimum equals the one of the same model written
    through an orthonormal basis of the sum-to-zero subspace (a Gaussian variational optimum is invariant under
    the linear change of variables)."""
    Q = _cases()[2][1]
    n = Q.shape[0]
    g = torch.Generator().manual_seed(3)
    E = 5.0 + 5.0 * torch.rand(n, generator=g, dtype=D)
    y = torch.poisson(E * 1.2, generator=g)
    c = bym2_scaling(Q)

    def icar(E, y):
        b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        x = pyro.sample("x", SparseGMRF(torch.zeros(n, dtype=D), Q, torch.tensor(c, dtype=D), constraints="sum_to_zero"))
        with pyro.plate("areas", n):
            pyro.sample("y", dist.Poisson(E * torch.exp(b0 + x)), obs=y)

    V, lam = _design_basis(n, 1, Q)

    def subspace(E, y):
        b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        z = pyro.sample("z", dist.Normal(torch.zeros(n - 1, dtype=D), (c * lam).rsqrt()).to_event(1))
        with pyro.plate("areas", n):
            pyro.sample("y", dist.Poisson(E * torch.exp(b0 + V @ z)), obs=y)

    r1 = pcv.fit(icar, E, y, engine="dual_vg", progress=False)
    r2 = pcv.fit(subspace, E, y, engine="dual_vg", progress=False)
    assert r1.converged and r2.converged
    T = torch.block_diag(torch.eye(1, dtype=D), V)
    m2, C2 = T @ r2.posterior.loc, T @ r2.posterior.covariance() @ T.T
    assert torch.allclose(r1.posterior.loc, m2, atol=1e-6)
    assert torch.allclose(r1.posterior.covariance(), C2, atol=1e-6)
    assert abs(r1.log_evidence_bound - r2.log_evidence_bound) < 1e-6


def test_constraints_are_cached_by_their_values():
    """The factorisation is shared by instances with equal constraint values (a model that builds its constraint
    matrix at every execution factors once) and never by a matrix whose values differ: the cache was keyed by the
    object's id, so a matrix changed in place (or a new one at the id of a freed one) reused the factorisation of
    the old values and skipped their checks (an RW2 given one constraint instead of two was accepted with k = 2)."""
    n = 7
    Q = rw_precision(n, 2)

    def basis():
        return torch.stack([torch.ones(n, dtype=D), torch.arange(n, dtype=D)])

    C1, C2 = basis(), basis()
    d1 = SparseGMRF(torch.zeros(n, dtype=D), Q, constraints=C1)
    assert SparseGMRF(torch.zeros(n, dtype=D), Q, constraints=C2).constraint_factor is d1.constraint_factor
    C1[1] = torch.linspace(0.0, 1.0, n, dtype=D) ** 2  # no longer in the null space of Q
    with pytest.raises(ValueError, match="span the null space"):
        SparseGMRF(torch.zeros(n, dtype=D), Q, constraints=C1)
    C1[1] = 3.0 * torch.arange(n, dtype=D) - 1.0  # another basis of the same null space: the same field
    d3 = SparseGMRF(torch.zeros(n, dtype=D), Q, torch.tensor(1.7, dtype=D), constraints=C1)
    assert d3.constraint_factor is not d1.constraint_factor
    lam = torch.linalg.eigvalsh(1.7 * Q.to_dense())
    assert abs(float(d3.log_det_precision()) - float(lam[2:].log().sum())) < 1e-9
    assert torch.allclose(d3.variance, torch.linalg.pinv(1.7 * Q.to_dense()).diagonal(), atol=1e-10)


def test_intrinsic_precision_is_checked_like_a_proper_one():
    """Only ``Q_RR`` is factored for an intrinsic field, so an asymmetry in the pivot rows (each row still summing to
    zero) went unnoticed and ``log_prob`` used a matrix the factor never saw; a precision with a gradient was
    accepted although no gradient flows into its values. Both are refused as for a proper field."""
    Q = torch.tensor([[2., -1, -1, 0], [-1, 2, 0, -1], [-1, 0, 2, -1], [0, -1, -1, 2]], dtype=D)
    P = int(SparseGMRF(torch.zeros(4, dtype=D), Q.to_sparse_csr(), constraints="sum_to_zero").constraint_factor.P[0])
    asym = Q.clone()
    cols = [c for c in range(4) if c != P and Q[P, c] != 0]
    asym[P, cols[0]] -= 0.5
    asym[P, cols[1]] += 0.5
    assert torch.equal(asym.sum(1), torch.zeros(4, dtype=D))
    with pytest.raises(ValueError, match="precision: the matrix is not symmetric"):
        SparseGMRF(torch.zeros(4, dtype=D), asym.to_sparse_csr(), constraints="sum_to_zero")
    with pytest.raises(ValueError, match="precision: the sparse precision is a fixed matrix"):
        SparseGMRF(torch.zeros(4, dtype=D), Q.to_sparse_csr().requires_grad_(), constraints="sum_to_zero")
    with pytest.raises(TypeError, match="got a dense tensor"):
        SparseGMRF(torch.zeros(4, dtype=D), Q, constraints="sum_to_zero")


def test_a_plate_of_intrinsic_fields_is_refused_naming_the_site():
    """A plate over an intrinsic field is a batch of fields, which the extraction does not stack; it is refused
    like a batch of proper ones (it failed deep in the chain's construction with a NumPy broadcasting error)."""
    n = 5

    def model(y):
        with pyro.plate("replicates", 2):
            x = pyro.sample("x", SparseGMRF(torch.zeros(n, dtype=D), rw_precision(n), constraints="sum_to_zero"))
        pyro.sample("y", dist.Normal(x, 0.5).to_event(2), obs=y)

    with pytest.raises(pcv.UnsupportedModelError, match=r"site 'x'.*SparseGMRF latent site must have shape \(5,\)"):
        pcv.lgm_from_pyro(model, torch.zeros(2, n, dtype=D))


def test_a_sparse_gmrf_deep_copies_with_its_density():
    # torch cannot deepcopy a sparse CSR tensor: copy.deepcopy of the distribution (sklearn's clone, a model's
    # deep-copied arguments) raised NotImplementedError
    import copy

    d = SparseGMRF(torch.zeros(6, dtype=torch.float64), rw_precision(6), constraints="sum_to_zero")
    e = copy.deepcopy(d)
    x = torch.linspace(-1, 1, 6, dtype=torch.float64)
    assert e is not d and float(e.log_prob(x)) == float(d.log_prob(x))
    assert torch.equal(e.variance, d.variance)


def test_icar_precision_of_a_sparse_adjacency_is_that_of_the_dense_one():
    # a torch sparse adjacency was densified to n x n first
    dense = torch.zeros(6, 6, dtype=torch.float64)
    for a, b in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (0, 5), (1, 4)]:
        dense[a, b] = dense[b, a] = 1.0
    ref = icar_precision(dense).to_dense()
    for sparse in (dense.to_sparse(), dense.to_sparse_csr()):
        assert torch.equal(icar_precision(sparse).to_dense(), ref)
    with pytest.raises(ValueError, match="0/1 entries"):
        icar_precision((2 * dense).to_sparse())
