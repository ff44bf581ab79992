"""Sparse Gaussian Markov random fields: the SparseGMRF distribution, the sparse Cholesky layer,
extraction with a sparse precision, and the dual_vg / convex_relaxation engines on a lattice GMRF.

Every number is checked against an independent dense reference (NumPy/SciPy inverses and
determinants, Pyro's dense ``MultivariateNormal(precision_matrix=Q)``, the N x N site form of
``dual_vg`` on the densified model, conjugate Gaussian posteriors).
"""
import math
import time
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import scipy.sparse as sp
import torch

import pyro_convexvb as pcv
from pyro_convexvb.errors import NotPositiveDefiniteError, UnsupportedModelError
from pyro_convexvb.infer.dual_vg import make_bound, solve_dual
from pyro_convexvb.infer.dual_vg.objective import SiteSpaceBackend, SparsePrecisionBackend, reduced_objective
from pyro_convexvb.infer.dual_vg.optim import _newton, default_gap_tol, initial_alpha
from pyro_convexvb.infer.result import History
from pyro_convexvb.lgm.model import LatentGaussianModel, PriorBlock
from pyro_convexvb.lgm.sites import Poisson
from pyro_convexvb.linalg import SparseCholesky, SparseOperator, DenseOperator
from pyro_convexvb.linalg.sparse_cholesky import available_backends
from pyro_convexvb.infer.convex_relaxation.problem import DENSE_BLOCK_LIMIT

D = torch.float64
BACKENDS = available_backends()


# ----------------------------------------------------------------------------- fixtures
def lattice(k, kappa=0.5, eight=False):
    """``kappa I + graph Laplacian`` of a k x k lattice (4- or 8-neighbour), SciPy CSC."""
    n = k * k
    idx = np.arange(n).reshape(k, k)
    pairs = [(idx[:, :-1], idx[:, 1:]), (idx[:-1, :], idx[1:, :])]
    if eight:
        pairs += [(idx[:-1, :-1], idx[1:, 1:]), (idx[:-1, 1:], idx[1:, :-1])]
    r = np.concatenate([a.ravel() for a, _ in pairs])
    c = np.concatenate([b.ravel() for _, b in pairs])
    A = sp.csc_matrix((np.ones(len(r)), (r, c)), shape=(n, n))
    A = A + A.T
    return (sp.diags(np.asarray(A.sum(1)).ravel() + kappa) - A).tocsc()


def torch_csr(M):
    M = M.tocsr()
    M.sort_indices()
    return torch.sparse_csr_tensor(torch.as_tensor(M.indptr, dtype=torch.int64),
                                   torch.as_tensor(M.indices, dtype=torch.int64),
                                   torch.as_tensor(M.data, dtype=D), size=M.shape, check_invariants=True)


def torch_coo(M):
    C = M.tocoo()
    return torch.sparse_coo_tensor(torch.as_tensor(np.vstack([C.row, C.col]), dtype=torch.int64),
                                   torch.as_tensor(C.data, dtype=D), C.shape, check_invariants=True).coalesce()


def random_spd(n, density=0.08, seed=0):
    rng = np.random.default_rng(seed)
    A = sp.random(n, n, density=density, random_state=rng)
    A = (A + A.T).tocsc()
    return (A + sp.diags(np.asarray(abs(A).sum(1)).ravel() + 0.3 + rng.random(n))).tocsc()


MATRICES = {
    "random": lambda: random_spd(60),
    "lattice4": lambda: lattice(7, 0.3),
    "lattice8": lambda: lattice(6, 0.1, eight=True),
}


# ----------------------------------------------------------------------------- sparse Cholesky layer
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", sorted(MATRICES))
def test_sparse_cholesky_matches_dense(backend, which):
    Q = MATRICES[which]()
    n = Q.shape[0]
    Qd = Q.toarray()
    Qi = np.linalg.inv(Qd)
    chol = SparseCholesky(Q, backend=backend)
    rng = np.random.default_rng(1)
    assert chol.logdet() == pytest.approx(np.linalg.slogdet(Qd)[1], abs=1e-10)
    b = rng.standard_normal(n)
    B = rng.standard_normal((n, 3))
    np.testing.assert_allclose(chol.solve(b), Qi @ b, atol=1e-11)
    np.testing.assert_allclose(chol.solve(B), Qi @ B, atol=1e-11)
    bt = torch.as_tensor(B)
    out = chol.solve(bt)
    assert torch.is_tensor(out) and out.dtype == D
    np.testing.assert_allclose(out.numpy(), Qi @ B, atol=1e-11)
    np.testing.assert_allclose(chol.diag_inverse(), np.diag(Qi), rtol=1e-11, atol=1e-14)
    Z = chol.selected_inverse()
    on = Z.toarray() != 0
    assert on[Q.toarray() != 0].all()  # the pattern of Q is inside the selected pattern
    np.testing.assert_allclose(Z.toarray()[on], Qi[on], atol=1e-12)
    R = chol.factor_matrix()
    np.testing.assert_allclose((R.T @ R).toarray(), Qd, atol=1e-11)
    # sampling: x = solve_Lt(eps) has covariance Q^{-1} exactly: X = solve_Lt(I), X X^T = Q^{-1}
    X = chol.solve_Lt(np.eye(n))
    np.testing.assert_allclose(X @ X.T, Qi, atol=1e-11)
    delta = rng.standard_normal(n)
    np.testing.assert_allclose(chol.diag_inverse_jvp(delta), -(Qi * Qi) @ delta, atol=1e-11)
    assert chol.nnz >= n


def test_diag_inverse_jvp_is_derivative_of_diag_inverse():
    Q = lattice(5, 0.4)
    delta = np.linspace(-1, 1, 25)
    h = 1e-6
    plus = SparseCholesky(Q + h * sp.diags(delta)).diag_inverse()
    minus = SparseCholesky(Q - h * sp.diags(delta)).diag_inverse()
    np.testing.assert_allclose(SparseCholesky(Q).diag_inverse_jvp(delta), (plus - minus) / (2 * h), atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_reuses_the_symbolic_analysis(backend):
    Q = lattice(6, 0.2)
    n = Q.shape[0]
    chol = SparseCholesky(Q, backend=backend)
    impl, pattern = chol._impl, chol.pattern
    rng = np.random.default_rng(0)
    Q2 = (Q + sp.diags(rng.random(n))).tocsc()
    assert chol.update(Q2) is chol
    assert chol._impl is impl and chol.pattern is pattern  # same analysis object, same pattern
    np.testing.assert_allclose(chol.diag_inverse(), np.diag(np.linalg.inv(Q2.toarray())), rtol=1e-11)
    assert chol.logdet() == pytest.approx(np.linalg.slogdet(Q2.toarray())[1], abs=1e-10)
    # a pattern without some diagonal entries is the same pattern: the diagonal is always stored
    Q3 = (Q - sp.diags(Q.diagonal()) + sp.diags(np.r_[0.0, Q.diagonal()[1:]])).tocsc()
    Q3.eliminate_zeros()
    Q3 = (Q3 + sp.diags(np.r_[5.0, np.zeros(n - 1)])).tocsc()
    chol.update(Q3)
    assert chol._impl is impl
    np.testing.assert_allclose(chol.diag_inverse(), np.diag(np.linalg.inv(Q3.toarray())), rtol=1e-11)
    # a different pattern: a new analysis, still exact
    Q4 = (Q + sp.diags(0.1 * np.ones(n - 3), 3) + sp.diags(0.1 * np.ones(n - 3), -3)).tocsc()
    chol.update(Q4)
    assert chol._impl is not impl
    np.testing.assert_allclose(chol.diag_inverse(), np.diag(np.linalg.inv(Q4.toarray())), rtol=1e-11)


def test_qdldl_is_the_default_and_refactors_in_place():
    Q = lattice(5, 0.3)
    chol = SparseCholesky(Q)
    assert chol.backend == "qdldl"
    solver = chol._impl.solver
    chol.update(2 * Q)
    assert chol._impl.solver is solver
    assert chol.logdet() == pytest.approx(np.linalg.slogdet(2 * Q.toarray())[1], abs=1e-10)


def test_sparse_cholesky_accepts_torch_and_operators():
    Q = lattice(4, 0.5)
    ref = np.diag(np.linalg.inv(Q.toarray()))
    for M in (torch_csr(Q), torch_coo(Q), SparseOperator(torch_csr(Q)), torch_csr(Q).to_sparse_csc()):
        np.testing.assert_allclose(SparseCholesky(M).diag_inverse(), ref, rtol=1e-12)


def test_sparse_cholesky_rejects_invalid_input():
    Q = lattice(4, 0.5)
    with pytest.raises(ValueError, match="square"):
        SparseCholesky(sp.random(4, 5, density=0.5, format="csc"))
    A = Q.tolil()
    A[0, 1] = 3.0
    with pytest.raises(ValueError, match="not symmetric"):
        SparseCholesky(A.tocsc())
    with pytest.raises(NotPositiveDefiniteError, match="not positive definite"):
        SparseCholesky(Q - 2.0 * sp.identity(16))
    with pytest.raises(NotPositiveDefiniteError, match="not positive definite"):
        SparseCholesky(sp.csc_matrix(np.ones((2, 2))))
    bad = Q.copy()
    bad.data[0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        SparseCholesky(bad)
    with pytest.raises(ValueError, match="backend"):
        SparseCholesky(Q, backend="magic")
    chol = SparseCholesky(Q)
    with pytest.raises(ValueError, match="b: expected shape"):
        chol.solve(np.ones(5))
    with pytest.raises(ValueError, match="delta"):
        chol.diag_inverse_jvp(np.ones(3))
    with pytest.raises(ValueError, match="expected shape"):
        chol.update(lattice(3, 0.5))


# ----------------------------------------------------------------------------- the distribution
def _gmrf(k=4, kappa=0.3, scale=None, eight=False, layout="csr"):
    Q = lattice(k, kappa, eight)
    n = Q.shape[0]
    loc = torch.linspace(-1, 1, n, dtype=D)
    Qt = torch_csr(Q) if layout == "csr" else torch_coo(Q)
    s = None if scale is None else torch.tensor(scale, dtype=D)
    return pcv.distributions.SparseGMRF(loc, Qt, s), Q, loc, s


@pytest.mark.parametrize("layout", ["csr", "coo"])
@pytest.mark.parametrize("scale", [None, 2.5])
def test_log_prob_equals_dense_multivariate_normal(layout, scale):
    d, Q, loc, s = _gmrf(scale=scale, layout=layout)
    sv = 1.0 if scale is None else scale
    ref = dist.MultivariateNormal(loc, precision_matrix=sv * torch.as_tensor(Q.toarray()))
    x = torch.randn(5, 3, Q.shape[0], dtype=D, generator=torch.Generator().manual_seed(0))
    lp = d.log_prob(x)
    assert lp.shape == (5, 3)
    torch.testing.assert_close(lp, ref.log_prob(x), rtol=0, atol=1e-10)
    assert d.log_prob(loc).shape == ()
    assert float(d.entropy()) == pytest.approx(float(ref.entropy()), abs=1e-10)
    assert d.event_shape == (Q.shape[0],) and d.batch_shape == ()
    assert d.support is dist.constraints.real_vector


def test_log_prob_gradients_equal_dense_reference():
    Q = lattice(4, 0.3, eight=True)
    Qd = torch.as_tensor(Q.toarray())
    n = Q.shape[0]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, n, dtype=D, generator=g)
    grads = []
    for dense in (False, True):
        loc = torch.linspace(-1, 1, n, dtype=D).requires_grad_(True)
        s = torch.tensor(1.7, dtype=D, requires_grad=True)
        xx = x.clone().requires_grad_(True)
        d = dist.MultivariateNormal(loc, precision_matrix=s * Qd) if dense else \
            pcv.distributions.SparseGMRF(loc, torch_csr(Q), s)
        grads.append(torch.autograd.grad(d.log_prob(xx).sum(), [xx, loc, s]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_rsample_moments_and_variance():
    d, Q, loc, s = _gmrf(k=4, kappa=0.4, scale=0.8)
    cov = torch.linalg.inv(0.8 * torch.as_tensor(Q.toarray()))
    torch.testing.assert_close(d.variance, torch.diagonal(cov), rtol=1e-12, atol=0)
    torch.manual_seed(0)
    x = d.rsample((40000,))
    assert x.shape == (40000, Q.shape[0])
    sd = torch.diagonal(cov).sqrt()
    assert ((x.mean(0) - loc).abs() / sd).max() < 5 / math.sqrt(40000)
    emp = torch.cov(x.T)
    assert ((emp - cov).abs() / (sd[:, None] * sd[None, :])).max() < 0.04
    # reparameterised: d/dloc of a sample is the identity, d/ds scales the centred sample by -1/(2s)
    loc2 = loc.clone().requires_grad_(True)
    s2 = torch.tensor(0.8, dtype=D, requires_grad=True)
    d2 = pcv.distributions.SparseGMRF(loc2, torch_csr(Q), s2)
    torch.manual_seed(3)
    y = d2.rsample()
    gl, gs = torch.autograd.grad(y.sum(), [loc2, s2])
    torch.testing.assert_close(gl, torch.ones_like(loc))
    assert float(gs) == pytest.approx(float(-(y.detach() - loc).sum() / (2 * 0.8)), rel=1e-10)
    # variance is differentiable in the scale: d/ds diag(Q0^-1)/s = -diag(Q0^-1)/s^2
    (gv,) = torch.autograd.grad(d2.variance.sum(), [s2])
    assert float(gv) == pytest.approx(-float(torch.diagonal(cov).sum()) / 0.8, rel=1e-10)


def test_factorisation_is_shared_by_instances_of_the_same_precision():
    Q = torch_csr(lattice(4, 0.3))
    a = pcv.distributions.SparseGMRF(torch.zeros(16, dtype=D), Q)
    b = pcv.distributions.SparseGMRF(torch.ones(16, dtype=D), Q, torch.tensor(3.0, dtype=D))
    assert a._chol is b._chol
    c = pcv.distributions.SparseGMRF(torch.zeros(16, dtype=D), torch_csr(lattice(4, 0.3)))
    assert c._chol is not a._chol


def test_expand_gives_independent_copies():
    d, Q, loc, _ = _gmrf()
    e = d.expand([3])
    x = e.sample()
    assert x.shape == (3, Q.shape[0])
    torch.testing.assert_close(e.log_prob(x), d.log_prob(x), rtol=0, atol=0)


def test_distribution_rejects_invalid_input():
    Q = lattice(4, 0.3)
    Qt = torch_csr(Q)
    G = pcv.distributions.SparseGMRF
    z = torch.zeros(16, dtype=D)
    with pytest.raises(TypeError, match="precision: expected a torch sparse tensor"):
        G(z, torch.as_tensor(Q.toarray()))
    with pytest.raises(TypeError, match="precision"):
        G(z, Q.toarray().tolist())
    with pytest.raises(ValueError, match="loc: expected shape \\(16,\\)"):
        G(torch.zeros(15, dtype=D), Qt)
    with pytest.raises(ValueError, match="batch"):
        G(torch.zeros(2, 16, dtype=D), Qt)
    with pytest.raises(ValueError, match="precision_scale: expected a scalar"):
        G(z, Qt, torch.ones(2, dtype=D))
    with pytest.raises(ValueError, match="precision_scale: must be positive"):
        G(z, Qt, torch.tensor(-1.0, dtype=D))
    A = Q.tolil()
    A[0, 5] = 0.7
    with pytest.raises(ValueError, match="precision: the matrix is not symmetric"):
        G(z, torch_csr(A.tocsc()))
    with pytest.raises(NotPositiveDefiniteError, match="precision"):
        G(z, torch_csr((Q - 3 * sp.identity(16)).tocsc()))
    with pytest.raises(ValueError, match="precision: must be a square"):
        G(torch.zeros(4, dtype=D), torch_csr(sp.random(4, 5, density=0.5)))
    with pytest.raises(ValueError, match="precision: the sparse precision is a fixed matrix"):
        G(z, torch_csr(Q).requires_grad_(True))
    d = G(z, Qt, validate_args=True)
    with pytest.raises(ValueError):
        d.log_prob(torch.zeros(15, dtype=D))


def _conjugate_model(Qt, loc, y, noise):
    def model():
        x = pyro.sample("x", pcv.distributions.SparseGMRF(loc, Qt))
        pyro.sample("y", dist.Normal(x, noise).to_event(1), obs=y)
    return model


def _conjugate_posterior(Q, loc, y, noise):
    Qd = torch.as_tensor(Q.toarray())
    A = Qd + torch.eye(Q.shape[0], dtype=D) / noise**2
    cov = torch.linalg.inv(A)
    return cov @ (Qd @ loc + y / noise**2), cov


def test_nuts_on_a_small_lattice_matches_the_exact_posterior():
    from pyro.infer import MCMC, NUTS

    Q = lattice(3, 0.5)
    n = Q.shape[0]
    loc = torch.linspace(-1, 1, n, dtype=D)
    y = torch.sin(torch.arange(n, dtype=D))
    noise = 0.7
    model = _conjugate_model(torch_csr(Q), loc, y, noise)
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=300, warmup_steps=150, disable_progbar=True)
    mcmc.run()
    x = mcmc.get_samples()["x"]
    assert x.shape == (300, n)
    mean, cov = _conjugate_posterior(Q, loc, y, noise)
    sd = torch.diagonal(cov).sqrt()
    # NUTS draws of a Gaussian are nearly independent: 6 standard errors of a 300-draw mean
    assert ((x.mean(0) - mean).abs() / sd).max() < 6 / math.sqrt(300)
    assert ((x.std(0) / sd) - 1).abs().max() < 0.3


# slow: the same property (SparseGMRF's density and gradient drive a Pyro inference to the exact posterior) is
# checked faster by test_nuts_on_a_small_lattice_matches_the_exact_posterior
@pytest.mark.slow
def test_svi_on_a_small_lattice_matches_the_exact_posterior():
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoMultivariateNormal

    Q = lattice(3, 0.5)
    n = Q.shape[0]
    loc = torch.linspace(-1, 1, n, dtype=D)
    y = torch.cos(torch.arange(n, dtype=D))
    noise = 0.7
    model = _conjugate_model(torch_csr(Q), loc, y, noise)
    pyro.set_rng_seed(0)
    guide = AutoMultivariateNormal(model, init_scale=0.1)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 0.03, "lrd": 0.999}), Trace_ELBO(num_particles=8,
                                                                                             vectorize_particles=True))
    for _ in range(1500):
        svi.step()
    mean, cov = _conjugate_posterior(Q, loc, y, noise)
    sd = torch.diagonal(cov).sqrt()
    got = guide.get_posterior()
    assert ((got.loc.detach() - mean).abs() / sd).max() < 0.15
    assert ((got.variance.detach().sqrt() / sd) - 1).abs().max() < 0.2


# ----------------------------------------------------------------------------- extraction
def test_extraction_keeps_a_sparse_precision(monkeypatch):
    Q = lattice(5, 0.3)
    n = Q.shape[0]
    Qt = torch_csr(Q)
    loc = torch.linspace(0, 1, n, dtype=D)
    y = torch.arange(n, dtype=D) % 3

    def model(y=None):
        f = pyro.sample("f", pcv.distributions.SparseGMRF(loc, Qt, torch.tensor(2.0, dtype=D)))
        pyro.sample("y", dist.Poisson(torch.exp(f + 0.1)).to_event(1), obs=y)

    def boom(self):
        raise AssertionError("a sparse precision was densified")

    monkeypatch.setattr(SparseOperator, "to_dense", boom)
    lgm = pcv.lgm_from_pyro(model, y=y)
    monkeypatch.undo()
    (p,) = lgm.priors
    assert isinstance(p.prec, SparseOperator) and p.cov is None and not p.flat
    np.testing.assert_allclose(p.prec.to_dense().numpy(), 2.0 * Q.toarray(), atol=1e-14)
    assert p.logdet_cov == pytest.approx(-np.linalg.slogdet(2.0 * Q.toarray())[1], abs=1e-10)
    torch.testing.assert_close(p.loc, loc)
    (g,) = lgm.sites
    assert isinstance(g.family, Poisson)
    torch.testing.assert_close(g.offset, torch.full((n,), 0.1, dtype=D))
    # the extracted prior is the distribution's density
    u = torch.randn(n, dtype=D, generator=torch.Generator().manual_seed(0))
    ref = dist.MultivariateNormal(loc, precision_matrix=2.0 * torch.as_tensor(Q.toarray())).log_prob(u)
    assert float(lgm.log_prior(u)) == pytest.approx(float(ref), abs=1e-9)


def test_extraction_refuses_a_batched_gmrf_site():
    Qt = torch_csr(lattice(3, 0.3))

    def model(y=None):
        f = pyro.sample("f", pcv.distributions.SparseGMRF(torch.zeros(9, dtype=D), Qt).expand([2]).to_event(1))
        pyro.sample("y", dist.Poisson(torch.exp(f)).to_event(2), obs=y)

    with pytest.raises(UnsupportedModelError, match="site 'f'.*SparseGMRF.*shape \\(9,\\)"):
        pcv.lgm_from_pyro(model, y=torch.ones(2, 9, dtype=D))


# ----------------------------------------------------------------------------- dual_vg
def _poisson_lattice(k, kappa=0.2, seed=0, offset=0.5):
    Q = lattice(k, kappa)
    n = Q.shape[0]
    rng = np.random.default_rng(seed)
    z = SparseCholesky(Q).solve_Lt(rng.standard_normal(n))
    y = torch.as_tensor(rng.poisson(np.exp(z + offset)), dtype=D)
    Qt = torch_csr(Q)

    def model(y=None):
        f = pyro.sample("f", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Qt))
        pyro.sample("y", dist.Poisson(torch.exp(f + offset)).to_event(1), obs=y)

    return model, y, Q


def test_dual_vg_on_a_30x30_poisson_gmrf_equals_the_dense_site_form(monkeypatch):
    model, y, Q = _poisson_lattice(30)
    n = Q.shape[0]
    calls = []
    orig = SparseOperator.to_dense

    def counted(self):
        if self.shape == (n, n):
            calls.append(self)
        return orig(self)

    monkeypatch.setattr(SparseOperator, "to_dense", counted)
    res = pcv.fit(model, y=y, engine="dual_vg", options=dict(gap_tol=1e-11), progress=False)
    assert not calls  # the sparse fit never densifies the n x n precision
    monkeypatch.undo()
    assert res.info["form"] == "banded" and res.converged
    lgm = pcv.lgm_from_pyro(model, y=y)
    p = lgm.priors[0]
    dense = LatentGaussianModel(lgm.layout, [PriorBlock("f", p.loc, prec=DenseOperator(p.prec.to_dense()),
                                                        logdet_cov=p.logdet_cov)], lgm.sites, lgm.log_const)
    ref = pcv.fit(dense, engine="dual_vg", options=dict(form="site", gap_tol=1e-11), progress=False)
    assert ref.info["form"] == "site" and ref.converged
    torch.testing.assert_close(res.info["site_mean"], ref.info["site_mean"], rtol=0, atol=1e-6)
    torch.testing.assert_close(res.info["site_var"], ref.info["site_var"], rtol=0, atol=1e-6)
    assert res.log_evidence_bound == pytest.approx(ref.log_evidence_bound, abs=1e-6)
    torch.testing.assert_close(res.posterior.variance, ref.posterior.variance, rtol=0, atol=1e-6)
    torch.testing.assert_close(res.posterior.loc, res.info["site_mean"] - 0.5, rtol=0, atol=1e-12)


def _backend_pair(k=5, seed=0, design="identity"):
    """A sparse-precision backend and the N x N site backend of the same problem."""
    Q = lattice(k, 0.3, eight=True)
    L = Q.shape[0]
    rng = np.random.default_rng(seed)
    mu = torch.as_tensor(rng.standard_normal(L) * 0.3)
    if design == "identity":
        W, Wd = None, np.eye(L)
    else:  # sites read cells with weights; some cells twice, some never
        cols = np.concatenate([rng.permutation(L)[: L - 3], rng.integers(0, L, 6)])
        Wd = np.zeros((len(cols), L))
        Wd[np.arange(len(cols)), cols] = rng.uniform(0.5, 1.5, len(cols))
        W = torch_csr(sp.csr_matrix(Wd))
    N = Wd.shape[0]
    d = torch.as_tensor(rng.standard_normal(N) * 0.2)
    be = SparsePrecisionBackend(torch_csr(Q), mu, W, d)
    Wt = torch.as_tensor(Wd)
    St = Wt @ torch.linalg.inv(torch.as_tensor(Q.toarray())) @ Wt.T
    ref = SiteSpaceBackend(0.5 * (St + St.T), Wt @ mu + d)
    y = torch.as_tensor(rng.poisson(2.0, N), dtype=D)
    return be, ref, make_bound(Poisson(y)), N


@pytest.mark.parametrize("design", ["identity", "one-per-row"])
def test_sparse_backend_terms_equal_the_site_form(design):
    be, ref, bound, N = _backend_pair(design=design)
    rng = np.random.default_rng(3)
    alpha = torch.as_tensor(rng.uniform(-0.5, 0.5, N))
    lam = torch.as_tensor(rng.uniform(0.1, 2.0, N))
    t, r = be.evaluate(alpha, lam), ref.evaluate(alpha, lam)
    for a, b in ((t.m_tilde, r.m_tilde), (t.v_tilde, r.v_tilde)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    assert float(t.logdet_B) == pytest.approx(float(r.logdet_B), abs=1e-10)
    assert float(t.quad) == pytest.approx(float(r.quad), abs=1e-10)
    for a, b in zip(be.prior_marginals(), ref.prior_marginals()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    with pytest.raises(NotImplementedError, match="hessian_operator"):
        be.evaluate(alpha, lam, hessian=True)


@pytest.mark.parametrize("design", ["identity", "one-per-row"])
def test_sparse_backend_hessian_operator_equals_the_dense_hessian(design):
    be, ref, bound, N = _backend_pair(design=design)
    alpha = initial_alpha(ref, bound)
    H = reduced_objective(be, bound, alpha, hessian="operator").hessian
    Hd = reduced_objective(ref, bound, alpha, hessian=True).hessian
    X = torch.randn(N, 3, dtype=D, generator=torch.Generator().manual_seed(0))
    for j in range(3):
        torch.testing.assert_close(H.mv(X[:, j]), Hd @ X[:, j], rtol=0, atol=1e-10)
    torch.testing.assert_close(H.to_dense(), Hd, rtol=0, atol=1e-10)
    # the preconditioner is the exact inverse of Sigma_t + D_p
    val = reduced_objective(ref, bound, alpha)
    lam, dl, d2l = bound.ell(alpha)
    _, _, d2psi = bound.psi(alpha)
    Dp = d2psi - 0.5 * d2l * val.v_tilde + 0.5 * (dl * val.v_tilde) ** 2
    P = ref.St + torch.diag(Dp)
    r = X[:, 0]
    torch.testing.assert_close(H.precondition(P @ r), r, rtol=0, atol=1e-10)


def test_sparse_backend_hessian_of_a_quadratic_bound_needs_no_selected_inversion(monkeypatch):
    """Gaussian pseudo-observations ``f = a (h^2 + rho) / 2 - b h``: lambda does not move with alpha, the Hessian is
    ``Sigma_t + diag(psi'')`` and a product solves with ``Q`` only."""
    from pyro_convexvb.lgm.families.bound import QuadraticBound

    class Pseudo(QuadraticBound):
        name, exact = "pseudo_observations", True

        def __init__(self, a, b):
            super().__init__(None)
            self._coef = (a, b, torch.zeros_like(a))

        def __len__(self):
            return self._coef[0].shape[0]

        def _abc(self):
            return self._coef

    be, ref, _, N = _backend_pair(design="one-per-row")
    rng = np.random.default_rng(5)
    a = torch.as_tensor(rng.uniform(0.5, 2.0, N))
    work = Pseudo(a, torch.as_tensor(rng.standard_normal(N)))
    alpha = initial_alpha(ref, work)
    H = reduced_objective(be, work, alpha, hessian="operator").hessian
    Hd = reduced_objective(ref, work, alpha, hessian=True).hessian
    monkeypatch.setattr(SparseCholesky, "diag_inverse_jvp", lambda *a, **k: pytest.fail("selected inversion"))
    X = torch.randn(N, 2, dtype=D, generator=torch.Generator().manual_seed(1))
    for j in range(2):
        torch.testing.assert_close(H.mv(X[:, j]), Hd @ X[:, j], rtol=0, atol=1e-10)


def test_newton_on_the_sparse_backend_matches_lbfgs_and_the_site_form():
    be, ref, bound, N = _backend_pair(k=8)
    tol = 1e-12
    sol_ref = solve_dual(ref, bound, gap_tol=tol)
    lb = solve_dual(be, bound, method="lbfgs", gap_tol=tol)
    nt = _newton(be, bound, initial_alpha(be, bound), tol, 50, 20, History(), "raise", None, newton_solver="cg")
    assert lb.converged and nt.converged
    assert nt.iterations <= 10 and lb.iterations <= 10  # L-BFGS with the Woodbury preconditioner of Newton-CG
    for sol in (lb, nt):
        torch.testing.assert_close(sol.m_tilde, sol_ref.m_tilde, rtol=0, atol=1e-6)
        torch.testing.assert_close(sol.v_tilde, sol_ref.v_tilde, rtol=0, atol=1e-6)
        assert sol.g == pytest.approx(sol_ref.g, abs=1e-9)


def test_sparse_backend_posterior_samples_and_moments():
    model, y, Q = _poisson_lattice(6, kappa=0.5, seed=2)
    res = pcv.fit(model, y=y, engine="dual_vg", options=dict(gap_tol=1e-10), progress=False)
    q = res.posterior
    lam = res.state.lam
    A = torch.as_tensor(Q.toarray()) + torch.diag(lam)
    V = torch.linalg.inv(A)
    torch.testing.assert_close(q.variance, torch.diagonal(V), rtol=0, atol=1e-12)
    torch.testing.assert_close(q.precision_operator.to_dense(), A, rtol=0, atol=1e-12)
    J = q.precision_factor.to_dense()
    torch.testing.assert_close(J.T @ J, A, rtol=0, atol=1e-11)
    s = q.sample(4000, generator=torch.Generator().manual_seed(0))
    assert ((s.var(0) / q.variance) - 1).abs().max() < 0.15


# ----------------------------------------------------------------------------- convex_relaxation
def test_convex_relaxation_on_a_lattice_gmrf_never_densifies(monkeypatch):
    Q = lattice(30, 0.2)
    n = Q.shape[0]
    Qt = torch_csr(Q)
    g = torch.Generator().manual_seed(0)
    z = pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Qt).sample()
    y = (torch.rand(n, dtype=D, generator=g) < torch.sigmoid(z)).to(D)

    def model(y=None):
        f = pyro.sample("f", pcv.distributions.SparseGMRF(torch.zeros(n, dtype=D), Qt))
        pyro.sample("y", dist.Bernoulli(logits=f).to_event(1), obs=y)

    orig = SparseOperator.to_dense

    def guarded(self):
        if self.shape[0] == n and self.shape[1] == n:
            raise AssertionError("an n x n sparse operator was densified")
        return orig(self)

    monkeypatch.setattr(SparseOperator, "to_dense", guarded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcv.ConvergenceWarning)  # a few outer steps are enough here
        res = pcv.fit(model, y=y, engine="convex_relaxation",
                      options=dict(variance="lanczos", dense_logdet_max=0, max_outer=4, lanczos_rank=40),
                      progress=False)
    assert res.posterior.loc.shape == (n,) and torch.isfinite(res.posterior.loc).all()
    assert res.log_evidence_bound is not None and math.isfinite(res.log_evidence_bound)
    assert res.info["log_det_method"] in ("fischer", "hadamard")
    x = res.posterior.sample(2, generator=torch.Generator().manual_seed(1))  # perturb-and-solve, sparse factor
    assert x.shape == (2, n) and torch.isfinite(x).all()


def test_sparse_square_root_factor_and_diagonal():
    Q = lattice(6, 0.4, eight=True)
    op = SparseOperator(torch_csr(Q))
    R = op.sqrt_factor(DENSE_BLOCK_LIMIT)
    assert isinstance(R, SparseOperator)
    Rd = R.to_dense()
    torch.testing.assert_close(Rd.T @ Rd, torch.as_tensor(Q.toarray()), rtol=0, atol=1e-12)
    torch.testing.assert_close(op.diagonal(DENSE_BLOCK_LIMIT), torch.as_tensor(Q.diagonal()), rtol=0, atol=0)
    big = SparseOperator(torch_csr(lattice(80, 0.1)))  # 6400 > DENSE_BLOCK_LIMIT: still exact, still sparse
    torch.testing.assert_close(big.diagonal(DENSE_BLOCK_LIMIT), torch.as_tensor(lattice(80, 0.1).diagonal()), rtol=0, atol=0)


# ----------------------------------------------------------------------------- large
@pytest.mark.slow
def test_dual_vg_fits_a_10000_node_lattice_gmrf():
    model, y, Q = _poisson_lattice(100, kappa=0.2, seed=1)
    t0 = time.perf_counter()
    res = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    seconds = time.perf_counter() - t0
    assert res.converged and res.info["form"] == "banded"
    assert res.info["gap"] <= default_gap_tol(10_000)
    assert torch.isfinite(res.posterior.variance).all() and (res.posterior.variance > 0).all()
    assert seconds < 60  # target 5 s on a quiet machine (docs/linalg.md); generous for shared CI


def test_laplace_start_stops_at_its_per_site_gain_and_newton_reaches_the_same_gap(monkeypatch):
    """The Laplace start's IRLS stops once a step gains at most ``LAPLACE_START_TOL`` nats per site: fewer working
    solves than running it to a 1e-12 relative decrease, and the dual Newton iteration from either start ends at
    the same optimum (site-space reference backend, float64)."""
    from pyro_convexvb.infer.dual_vg import optim

    be, ref, bound, N = _backend_pair(k=12)
    h, rho = be.prior_marginals()
    alpha0 = optim._clip_into(bound.data_alpha(h, rho), bound)
    calls = []
    means = be.working_means

    def counting(lam, b):
        calls.append(1)
        return means(lam, b)

    monkeypatch.setattr(be, "working_means", counting)
    starts, solves, default = {}, {}, optim.LAPLACE_START_TOL
    for tol in (default, 0.0):
        monkeypatch.setattr(optim, "LAPLACE_START_TOL", tol)
        calls.clear()
        starts[tol] = optim._laplace_start(be, bound, alpha0)
        solves[tol] = len(calls)
    assert solves[default] < solves[0.0]
    gap_tol = optim.default_gap_tol(N)
    sols = [_newton(ref, bound, a, gap_tol, 100, 20, History(), "raise", None) for a in starts.values()]
    assert all(s.converged and s.gap <= gap_tol for s in sols)
    torch.testing.assert_close(sols[0].m_tilde, sols[1].m_tilde, rtol=0, atol=1e-5)
    torch.testing.assert_close(sols[0].v_tilde, sols[1].v_tilde, rtol=0, atol=1e-5)


def _working_cases():
    """``(backend, Sigma_t, mu_t)`` of the four dual backends on small problems (float64)."""
    from pyro_convexvb.infer.dual_vg.objective import LatentSpaceBackend
    from pyro_convexvb.infer.dual_vg.sparse import SparseLatentBackend

    g = torch.Generator().manual_seed(5)
    L, N = 7, 11
    Q = 2.0 * torch.eye(L, dtype=D) - 0.6 * (torch.diag(torch.ones(L - 1, dtype=D), 1)
                                            + torch.diag(torch.ones(L - 1, dtype=D), -1))
    W = torch.randn(N, L, generator=g, dtype=D) * (torch.rand(N, L, generator=g, dtype=D) < 0.4)
    mu, d = torch.randn(L, generator=g, dtype=D), torch.randn(N, generator=g, dtype=D)
    St = W @ torch.linalg.inv(Q) @ W.T
    sparse_prec, ref, _, _ = _backend_pair(k=3, design="one-per-row")
    return [SiteSpaceBackend(0.5 * (St + St.T), W @ mu + d), LatentSpaceBackend(W, mu, d, prior_prec=Q),
            SparseLatentBackend(Q.to_sparse_csr(), mu, W.to_sparse_csr(), d), sparse_prec], \
        [(St, W @ mu + d)] * 3 + [(ref.St, ref.mu_t)]


@pytest.mark.parametrize("which", range(4), ids=["site", "latent", "sparse-latent", "sparse-precision"])
def test_working_means_are_the_gaussian_posterior_means_and_leave_the_variances_correct(which):
    """``working_means(lam, b)`` of every backend equals ``mu_t + Sigma_t (I + Lam Sigma_t)^{-1} (b - Lam mu_t)``
    (dense NumPy solve, float64); evaluations at another ``lam`` afterwards still return that ``lam``'s site
    variances and Hessian (the sparse forms refactor ``A`` for the working step)."""
    backends, refs = _working_cases()
    be, (St, mu_t) = backends[which], refs[which]
    N = mu_t.shape[0]
    rng = np.random.default_rng(which)
    alpha = torch.as_tensor(rng.uniform(-0.5, 0.5, N))
    lam1, lam2 = (torch.as_tensor(rng.uniform(0.1, 3.0, N)) for _ in range(2))
    b = torch.as_tensor(rng.standard_normal(N))
    before = be.evaluate(alpha, lam1)
    m = be.working_means(lam2, b)
    S, lm = St.numpy(), lam2.numpy()
    want = mu_t.numpy() + S @ np.linalg.solve(np.eye(N) + lm[:, None] * S, b.numpy() - lm * mu_t.numpy())
    np.testing.assert_allclose(m.numpy(), want, rtol=0, atol=1e-11)
    # the dual point a = lam m - b is the stationary point of the working model: m = mu_t - Sigma_t a
    np.testing.assert_allclose(m.numpy(), mu_t.numpy() - S @ (lm * m.numpy() - b.numpy()), rtol=0, atol=1e-11)
    after = be.evaluate(alpha, lam1)
    V1 = S - S @ np.linalg.solve(np.eye(N) + lam1.numpy()[:, None] * S, lam1.numpy()[:, None] * S)
    for t in (before, after):
        np.testing.assert_allclose(t.v_tilde.numpy(), np.diag(V1), rtol=0, atol=1e-11)
        np.testing.assert_allclose(t.m_tilde.numpy(), mu_t.numpy() - S @ alpha.numpy(), rtol=0, atol=1e-11)
    if hasattr(be, "hessian_operator"):
        dl, diag = torch.as_tensor(rng.uniform(0.5, 1.5, N)), torch.as_tensor(rng.uniform(0.1, 0.5, N))
        x = torch.as_tensor(rng.standard_normal(N))
        be.working_means(lam2, b)
        H = S + 0.5 * dl.numpy()[:, None] * V1 * V1 * dl.numpy()[None, :] + np.diag(diag.numpy())
        np.testing.assert_allclose(be.hessian_operator(lam1, dl, diag).mv(x).numpy(), H @ x.numpy(), rtol=0,
                                   atol=1e-10)


def test_laplace_start_reaches_the_laplace_mode_on_every_backend():
    """Run to a 0 per-site tolerance, the Laplace start's site means are the mode of the log joint (dense Newton
    in NumPy, float64) on every backend, and its site variances those of the Laplace approximation (taken at the
    precisions of the last accepted step, one step behind the mode: agreement to 1e-6)."""
    from pyro_convexvb.infer.dual_vg import optim

    backends, refs = _working_cases()
    for be, (St, mu_t) in zip(backends, refs):
        N = mu_t.shape[0]
        y = torch.as_tensor(np.random.default_rng(N).poisson(2.0, N), dtype=D)
        bound = make_bound(Poisson(y))
        S, mt, yn = St.numpy(), mu_t.numpy(), y.numpy()
        # the mode of sum_n (y_n h_n - e^h_n) + log N(h; mu_t, Sigma_t) in a = Sigma_t-coordinates: h = mu_t - S a,
        # stationarity a = e^h - y (Newton on a; Sigma_t may be singular)
        a = np.zeros(N)
        for _ in range(100):
            h = mt - S @ a
            r = a - (np.exp(h) - yn)
            J = np.eye(N) + np.exp(h)[:, None] * S
            a = a - np.linalg.solve(J, r)
        h = mt - S @ a
        lam = np.exp(h)
        V = S - S @ np.linalg.solve(np.eye(N) + lam[:, None] * S, lam[:, None] * S)
        h0, rho0 = be.prior_marginals()
        alpha0 = optim._clip_into(bound.data_alpha(h0, rho0), bound)
        old = optim.LAPLACE_START_TOL
        try:
            optim.LAPLACE_START_TOL = 0.0
            cand = optim._laplace_start(be, bound, alpha0)
        finally:
            optim.LAPLACE_START_TOL = old
        want = bound.alpha_star(torch.as_tensor(h), torch.as_tensor(np.diag(V).copy()))
        torch.testing.assert_close(cand, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", range(4), ids=["site", "latent", "sparse-latent", "sparse-precision"])
def test_value_only_objective_equals_the_full_one_without_variances(which, monkeypatch):
    """``reduced_objective(..., gradient=False)`` returns the same ``g`` and site means as the full evaluation, with
    no site variances; the sparse forms then run no selected inversion, and a full evaluation at the same ``lambda``
    afterwards adds it (float64)."""
    from pyro_convexvb.infer.dual_vg.optim import initial_alpha as start

    backends, refs = _working_cases()
    be, (St, mu_t) = backends[which], refs[which]
    N = mu_t.shape[0]
    y = torch.as_tensor(np.random.default_rng(1).poisson(2.0, N), dtype=D)
    bound = make_bound(Poisson(y))
    alpha = start(be, bound) * 0.9
    calls = []
    for name in ("diag_inverse", "selected_values"):
        orig = getattr(SparseCholesky, name)
        monkeypatch.setattr(SparseCholesky, name, lambda self, *a, _o=orig, **k: calls.append(1) or _o(self, *a, **k))
    part = reduced_objective(be, bound, alpha, gradient=False)
    assert not calls and part.grad is None and part.v_tilde is None
    full = reduced_objective(be, bound, alpha)
    assert bool(calls) == (which >= 2)
    assert float(part.g) == pytest.approx(float(full.g), rel=1e-14, abs=1e-12)
    torch.testing.assert_close(part.m_tilde, full.m_tilde, rtol=0, atol=1e-13)
    lam = bound.ell(alpha)[0].numpy()
    S = St.numpy()
    V = S - S @ np.linalg.solve(np.eye(N) + lam[:, None] * S, lam[:, None] * S)
    np.testing.assert_allclose(full.v_tilde.numpy(), np.diag(V), rtol=0, atol=1e-11)
    with pytest.raises(ValueError, match="gradient"):
        reduced_objective(be, bound, alpha, hessian=True, gradient=False)


def test_log_prob_at_an_infinite_precision_scale_is_that_of_a_point_mass_not_nan():
    """precision_scale = inf (an MCMC proposal exp(z) that overflowed) gave inf - inf = NaN; now -inf off loc (the
    limit, as torch's distributions give for a vanishing scale) and +inf at loc; 0 gives -inf (unvalidated)."""
    from pyro_convexvb.distributions import SparseGMRF

    n = 3
    Q = (2 * torch.eye(n, dtype=torch.float64) - torch.diag(torch.ones(n - 1, dtype=torch.float64), 1)
         - torch.diag(torch.ones(n - 1, dtype=torch.float64), -1)).to_sparse_csr()
    x = torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.0, 0.0]], dtype=torch.float64)
    d = SparseGMRF(torch.zeros(n, dtype=torch.float64), Q, precision_scale=torch.tensor(math.inf, dtype=torch.float64))
    assert d.log_prob(x).tolist() == [-math.inf, math.inf]
    d0 = SparseGMRF(torch.zeros(n, dtype=torch.float64), Q, precision_scale=torch.tensor(0.0, dtype=torch.float64),
                    validate_args=False)
    assert d0.log_prob(x[:1]).tolist() == [-math.inf]
    finite = SparseGMRF(torch.zeros(n, dtype=torch.float64), Q,
                        precision_scale=torch.tensor(1e300, dtype=torch.float64))
    assert math.isfinite(float(finite.log_prob(x[1])))  # a large finite scale is untouched


def test_log_prob_of_a_value_in_another_dtype_is_evaluated_in_the_distributions_dtype():
    """A float32 SparseGMRF given a float64 value raised torch's raw 'addmv ... same dtype' error; now it is evaluated
    in the distribution's dtype, as torch's MultivariateNormal does, and agrees with it."""
    from pyro_convexvb.distributions import SparseGMRF

    n = 3
    Q = 2 * torch.eye(n) - torch.diag(torch.ones(n - 1), 1) - torch.diag(torch.ones(n - 1), -1)
    x = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64)
    lp = SparseGMRF(torch.zeros(n), Q.to_sparse_csr()).log_prob(x)
    ref = torch.distributions.MultivariateNormal(torch.zeros(n), precision_matrix=Q).log_prob(x)
    assert lp.dtype == torch.float32 and float(lp) == pytest.approx(float(ref), rel=1e-6)
    lp64 = SparseGMRF(torch.zeros(n, dtype=torch.float64), Q.double().to_sparse_csr()).log_prob(x.float())
    assert lp64.dtype == torch.float64 and float(lp64) == pytest.approx(float(ref), rel=1e-6)


def test_gmrf_input_errors_name_the_argument():
    """Bare NumPy/SciPy errors for a constraint matrix of the wrong width or with NaN; 'the parameter depends on the
    latent sites' for a non-finite loc or precision_scale; 'Q:' with no hint for a singular precision without
    constraints; newton_solver='dense' on a sparse-precision form ended in a NotImplementedError; a rejected far start
    leaked numpy's overflow warning."""
    from pyro_convexvb.distributions import SparseGMRF, rw_precision

    D = torch.float64
    n = 8
    with pytest.raises(ValueError, match=r"constraints: expected 'sum_to_zero' or a \(k, n\) matrix with n = 8"):
        SparseGMRF(torch.zeros(n, dtype=D), rw_precision(n), constraints=torch.ones(1, n + 1, dtype=D))
    with pytest.raises(ValueError, match="constraints: the matrix has non-finite entries"):
        SparseGMRF(torch.zeros(n, dtype=D), rw_precision(n), constraints=torch.full((1, n), float("nan"), dtype=D))
    with pytest.raises(NotPositiveDefiniteError, match=r"^precision: the matrix is not positive definite.*needs "
                                                       r"constraints="):
        SparseGMRF(torch.zeros(n, dtype=D), rw_precision(n))
    Q = (rw_precision(n).to_dense() + torch.eye(n, dtype=D)).to_sparse_csr()
    y = torch.arange(n, dtype=D) / n

    def model(bad, y=None):  # the non-finite parameter computed inside the model (an argument is checked first)
        loc = torch.full((n,), math.inf if bad == "loc" else 0.0, dtype=D)
        scale = torch.tensor(math.inf if bad == "precision_scale" else 1.0, dtype=D)
        x = pyro.sample("x", SparseGMRF(loc, Q, scale))
        with pyro.plate("o", n):
            pyro.sample("y", dist.Normal(x, 1.0), obs=y)

    for bad in ("loc", "precision_scale"):
        with pytest.raises(ValueError, match=rf"site 'x': the parameter '{bad}' of its prior is not finite"):
            pcv.fit(model, bad, y=y, engine="dual_vg", progress=False)

    def counts(y=None):
        x = pyro.sample("x", SparseGMRF(torch.zeros(n, dtype=D), Q, torch.tensor(1e-3, dtype=D)))
        with pyro.plate("o", n):
            pyro.sample("y", dist.Poisson(torch.exp(x)), obs=y)

    c = torch.tensor([3.0, 0, 5, 2, 1, 4, 0, 2], dtype=D)
    with pytest.raises(ValueError, match="newton_solver='dense' needs the N x N Hessian"):
        pcv.fit(counts, y=c, engine="dual_vg", options=dict(newton_solver="dense"), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert pcv.fit(counts, y=c, engine="dual_vg", progress=False).converged


def test_an_intrinsic_fields_posterior_samples_on_its_constraint_subspace():
    """The posterior covariance of an ICAR field has rank n - 1: ``posterior.sample()`` raised torch's bare
    LinAlgError (a Cholesky of a singular matrix). Draws now come from its eigen-root: they sum to zero and have its
    covariance."""
    from pyro_convexvb.distributions import SparseGMRF, icar_precision

    D = torch.float64
    W = torch.zeros(12, 12, dtype=D)
    for i in range(3):
        for j in range(4):
            k = 4 * i + j
            if j < 3:
                W[k, k + 1] = W[k + 1, k] = 1
            if i < 2:
                W[k, k + 4] = W[k + 4, k] = 1
    Q = icar_precision(W)
    y = torch.randn(12, dtype=D, generator=torch.Generator().manual_seed(0))

    def model(y=None):
        x = pyro.sample("x", SparseGMRF(torch.zeros(12, dtype=D), Q, torch.tensor(2.0, dtype=D),
                                        constraints="sum_to_zero"))
        with pyro.plate("o", 12):
            pyro.sample("y", dist.Normal(x, 0.4), obs=y)

    post = pcv.fit(model, y=y, engine="dual_vg", progress=False).posterior
    S = post.sample(40000, generator=torch.Generator().manual_seed(1))
    assert float(S.sum(1).abs().max()) < 1e-10
    C = post.covariance()
    emp = torch.cov(S.T)
    assert float((emp - C).abs().max()) < 0.05 * float(C.diagonal().max())


def test_an_intrinsic_field_above_the_dense_limit_is_refused_by_name(monkeypatch):
    """Intrinsic fields are still extracted through a dense n x n constraint map (about 40 n^2 x 8 bytes); one
    above INTRINSIC_MAX_N is refused by site instead of exhausting memory (a 100 x 100 ICAR field needed ~29 GB)."""
    from pyro_convexvb.distributions import SparseGMRF, rw_precision
    from pyro_convexvb.lgm import extract

    monkeypatch.setattr(extract, "INTRINSIC_MAX_N", 10)
    D = torch.float64

    def model(y=None):
        x = pyro.sample("field", SparseGMRF(torch.zeros(12, dtype=D), rw_precision(12), torch.tensor(1.0, dtype=D),
                                            constraints="sum_to_zero"))
        with pyro.plate("o", 12):
            pyro.sample("y", dist.Normal(x, 1.0), obs=y)

    with pytest.raises(UnsupportedModelError, match=r"site 'field'.*intrinsic SparseGMRF of 12 nodes.*limits to "
                                                    r"n <= 10"):
        pcv.fit(model, y=torch.zeros(12, dtype=D), engine="dual_vg", progress=False)


def test_jit_tracing_of_a_sparse_gmrf_is_refused_with_the_alternatives():
    """torch.jit cannot trace sparse tensors: JitTrace_ELBO and NUTS(jit_compile=True) failed with a bare
    'Unsupported value kind: Tensor'; the refusal names the non-JIT alternatives."""
    from pyro.infer import SVI, JitTrace_ELBO
    from pyro.infer.autoguide import AutoNormal

    from pyro_convexvb.distributions import SparseGMRF, rw_precision

    Q = (rw_precision(4).to_dense() + 0.5 * torch.eye(4, dtype=torch.float64)).to_sparse_csr()
    y = torch.tensor([0.1, -0.3, 0.2, 0.4], dtype=torch.float64)

    def model(y=None):
        x = pyro.sample("x", SparseGMRF(torch.zeros(4, dtype=torch.float64), Q))
        pyro.sample("y", dist.Normal(x, 0.5).to_event(1), obs=y)

    pyro.clear_param_store()
    svi = SVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}), JitTrace_ELBO())
    with pytest.raises(NotImplementedError, match="torch.jit tracing does not support sparse tensors.*Trace_ELBO"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svi.step(y)
