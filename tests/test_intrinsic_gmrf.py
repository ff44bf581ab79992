"""Intrinsic GMRFs (ICAR, RW1, RW2 with linear constraints): density, draws, BYM2 scaling, and exact LGM fits."""
import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.distributions import SparseGMRF, bym2_scaling, icar_precision, rw_precision
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
