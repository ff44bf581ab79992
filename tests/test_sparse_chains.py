"""Sparse affine chains in dual_vg: the sparse latent form, the probed chain Jacobians, no dense n x n object."""
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import scipy.optimize
import scipy.sparse as sp
import torch
from torch.distributions import constraints

import pyro_convexvb as pcv
from pyro_convexvb.infer.dual_vg.bounds import make_bound
from pyro_convexvb.infer.dual_vg.objective import LatentSpaceBackend, reduced_objective
from pyro_convexvb.infer.dual_vg.sparse import SparseLatentBackend
from pyro_convexvb.lgm.chains import chain_jacobian, chain_jacobian_by_coordinates
from pyro_convexvb.lgm.sites import BernoulliLogit
from pyro_convexvb.linalg.operators import SparseOperator
from pyro_convexvb.linalg.sparse_cholesky import SparseCholesky

from _hierarchies import centred, noncentred, random_intercepts

D = torch.float64


def _fit(model, *args, y=None, **options):
    return pcv.fit(model, *args, y=y, engine="dual_vg", progress=False, options=options)


# ----------------------------------------------------------------------------- the backend
def _backend_pair(seed=0, L=14, N=50):
    g = torch.Generator().manual_seed(seed)
    Q = torch.diag(torch.rand(L, generator=g, dtype=D) + 0.5)
    Q[0, 2:] = Q[2:, 0] = 0.05  # an arrow: one latent coupled to all (a hierarchy's mean)
    W = torch.zeros(N, L, dtype=D)
    W[torch.arange(N), torch.randint(3, L, (N,), generator=g)] = 1.0
    W[:, 1] = torch.randn(N, generator=g, dtype=D)
    W[:, 2] = 1.0
    mu, d = torch.randn(L, generator=g, dtype=D), torch.randn(N, generator=g, dtype=D)
    y = (torch.rand(N, generator=g, dtype=D) < 0.5).to(D)
    return (SparseLatentBackend(Q.to_sparse_csr(), mu, W.to_sparse_csr(), d),
            LatentSpaceBackend(W, mu, d, prior_prec=Q), make_bound(BernoulliLogit(y)), y)


def test_sparse_latent_backend_equals_the_dense_latent_form():
    sb, lb, bound, y = _backend_pair()
    alpha = torch.where(y > 0, -0.4, 0.35).to(D)
    lam = torch.rand(len(y), generator=torch.Generator().manual_seed(1), dtype=D) + 0.1
    t1, t2 = sb.evaluate(alpha, lam), lb.evaluate(alpha, lam)
    for f in ("m_tilde", "v_tilde", "logdet_B", "quad"):
        assert torch.allclose(getattr(t1, f), getattr(t2, f), rtol=1e-12, atol=1e-12), f
    assert torch.allclose(sb.prior_marginals()[1], lb.prior_marginals()[1], rtol=1e-12)
    H = reduced_objective(sb, bound, alpha, hessian="operator").hessian
    H_dense = reduced_objective(lb, bound, alpha, hessian=True).hessian
    x = torch.randn(len(y), generator=torch.Generator().manual_seed(2), dtype=D)
    assert torch.allclose(H.mv(x), H_dense @ x, rtol=1e-11, atol=1e-11)
    # the Woodbury preconditioner is the inverse of Sigma_t + D_p
    Dp = torch.as_tensor(H._site_diagonal())
    Wd = sb.Ws.toarray()
    St = torch.as_tensor(Wd @ np.linalg.inv(sb._Qs.toarray()) @ Wd.T)
    assert torch.allclose(H.precondition((St + torch.diag(Dp)) @ x), x, rtol=1e-9, atol=1e-9)
    q1, q2 = sb.posterior(alpha, lam), lb.posterior(alpha, lam)
    assert torch.allclose(q1.loc, q2.loc, atol=1e-12) and torch.allclose(q1.variance, q2.variance, atol=1e-12)
    assert q1.kind == "precision_operator"


def test_selected_inverse_jvp_is_minus_z_dq_z():
    n = 9
    g = np.random.default_rng(0)
    M = sp.random(n, n, density=0.3, random_state=1)
    Q = (M @ M.T + sp.identity(n) * 2).tocsc()
    chol = SparseCholesky(Q)
    Qc = Q.tocoo()
    up = Qc.row <= Qc.col
    r, c = Qc.row[up], Qc.col[up]
    pos = chol.entry_positions(r, c)
    vals = g.standard_normal(len(r))
    dQ = sp.coo_matrix((vals, (r, c)), shape=(n, n)).toarray()
    dQ = dQ + np.triu(dQ, 1).T
    Z = np.linalg.inv(Q.toarray())
    ref = -(Z @ dQ @ Z)
    got = chol.selected_values_jvp(pos, vals)
    assert np.allclose(got[pos], ref[r, c], rtol=1e-10, atol=1e-12)
    assert np.allclose(chol.selected_values()[pos], Z[r, c], rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- probed Jacobians
def _loc_graph(loc_fn, n, seed=0):
    u0 = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=D).requires_grad_(True)
    return loc_fn(u0), u0


def _as_matrix(rcv, shape):
    r, c, v = rcv
    return sp.csr_matrix((v, (r, c)), shape=shape)


@pytest.mark.parametrize("case", ["broadcast", "gather", "lag", "two_per_row", "small_dense"])
def test_probed_chain_jacobian_equals_the_per_coordinate_one(case):
    K, J = 120, 300
    idx = torch.randint(0, K, (J,), generator=torch.Generator().manual_seed(4))
    coef = torch.randn(J, generator=torch.Generator().manual_seed(5), dtype=D)
    n = 3 + K + J
    parents = {"broadcast": [slice(0, 1)], "gather": [slice(3, 3 + K)], "lag": [slice(3, 3 + K)],
               "two_per_row": [slice(3, 3 + K)], "small_dense": [slice(0, 3)]}[case]

    def loc_fn(u):
        mu, x = u[:3], u[3:3 + K]
        if case == "broadcast":
            return (2.5 * mu[0]).expand(J) + 1.0
        if case == "gather":
            return coef * x[idx] - 0.5
        if case == "lag":
            return torch.cat([0.8 * x[:-1], torch.zeros(J - K + 1, dtype=D)])
        if case == "two_per_row":
            return x[idx] - x[(idx + 1) % K]
        return torch.stack([mu[0] - 2 * mu[1], mu[2], mu[0] + mu[1] + mu[2]]).repeat(J // 3)

    loc, u0 = _loc_graph(loc_fn, n)
    a = _as_matrix(chain_jacobian("x", loc, u0, parents, D), (J, n))
    b = _as_matrix(chain_jacobian_by_coordinates("x", loc, u0, parents, D), (J, n))
    assert (a != b).nnz == 0 and a.nnz == b.nnz


def test_chain_matrix_of_a_two_level_hierarchy_equals_the_per_coordinate_one(monkeypatch):
    """The extraction's A (region means read by 200 intercepts, a parent of 100 coordinates) is exactly the one
    the per-coordinate products give."""
    K, J = 100, 200
    reg = torch.randint(0, K, (J,), generator=torch.Generator().manual_seed(0))
    y = torch.randn(J, generator=torch.Generator().manual_seed(1), dtype=D)

    def model(y=None):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("regions", K):
            r = pyro.sample("r", dist.Normal(mu, 0.5))
        with pyro.plate("groups", J):
            a = pyro.sample("a", dist.Normal(r[reg], 0.3))
            pyro.sample("y", dist.Normal(a, 0.2), obs=y)

    A = pcv.lgm_from_pyro(model, y=y).chain.A
    import pyro_convexvb.lgm.chains as chains

    monkeypatch.setattr(chains, "chain_jacobian", chains.chain_jacobian_by_coordinates)
    A_ref = pcv.lgm_from_pyro(model, y=y).chain.A
    assert (A != A_ref).nnz == 0
    assert A.nnz == K + J  # every region reads mu, every intercept its region


# ----------------------------------------------------------------------------- fits
def test_sparse_form_equals_the_dense_latent_form_on_a_centred_model():
    J = 8
    X, grp, y = random_intercepts(J, rows=60)
    r1 = _fit(centred, X, grp, J, y=y, form="sparse", gap_tol=1e-12)
    r2 = _fit(centred, X, grp, J, y=y, form="latent", gap_tol=1e-12)
    assert r1.info["form"] == "sparse" and r1.converged and r2.converged
    assert r1.posterior.coordinates == "model" and r1.posterior.layout.names == ["mu", "b", "alpha"]
    assert torch.allclose(r1.posterior.loc, r2.posterior.loc, atol=1e-8)
    assert torch.allclose(r1.posterior.variance.sqrt(), r2.posterior.variance.sqrt(), atol=1e-8)
    assert abs(r1.log_evidence_bound - r2.log_evidence_bound) < 1e-8
    # the sparse-precision posterior stays usable: marginals of a design, samples, a guide
    B = torch.zeros(2, r1.posterior.n, dtype=D)
    B[0, 0], B[1, 3] = 1.0, 1.0
    m, v = r1.posterior.marginals(B)
    assert torch.allclose(m, r2.posterior.loc[[0, 3]], atol=1e-8)
    assert torch.allclose(v, r2.posterior.variance[[0, 3]], rtol=1e-6)
    s = r1.posterior.sample((4000,), generator=torch.Generator().manual_seed(0))
    assert s.shape == (4000, r1.posterior.n)
    assert float(((s.mean(0) - r2.posterior.loc) / r2.posterior.variance.sqrt()).abs().max()) < 0.1


def test_centred_equals_noncentred_on_the_sparse_form():
    J, sigma = 8, 0.7
    X, grp, y = random_intercepts(J, rows=60, seed=3)
    r1 = _fit(centred, X, grp, J, y=y, form="sparse", gap_tol=1e-12)
    r2 = _fit(noncentred, X, grp, J, y=y, form="sparse", gap_tol=1e-12)
    assert r2.info["form"] == "sparse"
    p = X.shape[1]
    T = torch.zeros(1 + p + J, 1 + p + J, dtype=D)
    T[:1 + p, :1 + p] = torch.eye(1 + p, dtype=D)
    T[1 + p:, 0] = 1.0
    T[1 + p:, 1 + p:] = sigma * torch.eye(J, dtype=D)
    C2 = T @ r2.posterior.covariance() @ T.T
    assert torch.allclose(r1.posterior.loc, T @ r2.posterior.loc, atol=1e-8)
    assert torch.allclose(r1.posterior.variance.sqrt(), C2.diagonal().sqrt(), atol=1e-8)
    assert abs(r1.log_evidence_bound - r2.log_evidence_bound) < 1e-8


def _big_problem(J):
    """2000-group-scale data: three rows per group, round robin, three noise covariates."""
    return random_intercepts(J, rows=3 * J, grouping="cyclic", p=3, intercept=(0.0, 0.5), slopes=False)


def test_a_2000_group_model_allocates_nothing_quadratic():
    """Extraction and fit of 2000 groups (20000 rows) in the sparse form: no torch tensor of n x n entries is
    allocated (the profiler's allocation records), and the NumPy/Python peak stays below a bound linear in n."""
    import tracemalloc

    J = 2000
    X, grp, y = _big_problem(J)
    n = 1 + X.shape[1] + J
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        tracemalloc.start()
        lgm = pcv.lgm_from_pyro(centred, X, grp, J, y=y)
        res = pcv.fit(lgm, engine="dual_vg", progress=False)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert isinstance(lgm.sites[0].design, SparseOperator)
    assert res.info["form"] == "sparse" and res.converged and res.posterior.kind == "precision_operator"
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    N = X.shape[0]
    # the largest tensors are the sites' Gauss-Hermite grids (N x 64 float64, 3 MB); an n x n one would be 32 MB
    assert largest <= 8 * 64 * N < n * n * 8 / 4, largest
    assert peak < 40_000 * n, peak  # about 40 kB per latent (the site pairs, factors and designs); n^2 would be 32 MB


# ----------------------------------------------------------------------------- type-II learning through a chain
def centred_gaussian(X, grp, J, y=None):
    s = pyro.param("s", torch.tensor(1.0, dtype=D), constraint=constraints.positive)
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
    b = pyro.sample("b", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
    with pyro.plate("groups", J):
        alpha = pyro.sample("alpha", dist.Normal(mu, 0.7))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Normal(alpha[grp] + X @ b, s), obs=y)


@pytest.mark.parametrize("form", ["auto", "sparse"])
def test_type2_learning_of_a_param_outside_the_chain_is_the_marginal_likelihood_optimum(form):
    J = 6
    X, grp, _ = random_intercepts(J, rows=40, seed=7)
    g = torch.Generator().manual_seed(8)
    y = 0.8 * torch.randn(J, generator=g, dtype=D)[grp] + X @ torch.tensor([1.0, -0.5], dtype=D) \
        + 0.6 * torch.randn(40, generator=g, dtype=D)
    Z = torch.zeros(40, J, dtype=D)
    Z[torch.arange(40), grp] = 1.0
    H = torch.cat([Z.sum(1, keepdim=True), X, Z], 1)  # eta = mu 1 + X b + Z (alpha - mu) in (mu, b, e)
    prior = torch.diag(torch.cat([torch.tensor([4.0], dtype=D), torch.ones(2, dtype=D), torch.full((J,), 0.49, dtype=D)]))

    def neg(z):
        C = H @ prior @ H.T + np.exp(2 * z[0]) * torch.eye(40, dtype=D)
        return -float(dist.MultivariateNormal(torch.zeros(40, dtype=D), C).log_prob(y))

    opt = scipy.optimize.minimize(neg, np.zeros(1), method="Nelder-Mead", options=dict(xatol=1e-10, fatol=1e-12))
    pyro.clear_param_store()
    res = pcv.fit(centred_gaussian, X, grp, J, y=y, engine="dual_vg", progress=False, options=dict(form=form))
    assert res.converged and "type-II" in res.stop_reason
    assert abs(float(pyro.param("s").detach()) - float(np.exp(opt.x[0]))) < 1e-4
    assert abs(res.log_evidence_bound + opt.fun) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_probe_recovers_a_gather_in_four_products_and_refuses_two_per_row(dtype):
    from pyro_convexvb.lgm.chains import probe_sparse_jacobian

    K, J = 500, 2000
    idx = torch.randint(0, K, (J,), generator=torch.Generator().manual_seed(0))
    coef = (torch.rand(J, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    calls = []

    def jvp(v):
        calls.append(1)
        return 0.5 * (coef * v[idx])

    r, c, v = probe_sparse_jacobian(jvp, [slice(0, K)], J, K, dtype)
    assert len(calls) == 4 and len(r) == J
    assert np.array_equal(c[np.argsort(r)], idx.numpy())
    assert np.allclose(v[np.argsort(r)], 0.5 * coef.double().numpy(), rtol=1e-6)
    assert probe_sparse_jacobian(lambda v: v[idx] + v[(idx + 1) % K], [slice(0, K)], J, K, dtype) is None


def test_probe_in_vectorised_batches_equals_one_product_at_a_time():
    """The same Jacobian, small blocks column by column and large ones as gathers, with the products batched
    (jvp_many, several batches) or one at a time."""
    from pyro_convexvb.lgm import chains
    from pyro_convexvb.lgm.chains import probe_sparse_jacobian

    K, J = 300, 700
    idx = torch.randint(0, K, (J,), generator=torch.Generator().manual_seed(0))
    W = torch.randn(J, 3, generator=torch.Generator().manual_seed(1), dtype=D)

    def jvp(v):  # a gather of a K-block plus a dense (J, 3) block, on columns [0, K) and [K, K + 3)
        return 2.0 * v[idx] + W @ v[K:K + 3]

    slices = [slice(0, K), slice(K, K + 3)] + [slice(K + 3 + j, K + 4 + j) for j in range(600)]  # 600 unread blocks
    n = K + 603
    calls = []

    def many(V):
        calls.append(V.shape[0])
        return torch.stack([jvp(v) for v in V])

    one = probe_sparse_jacobian(jvp, slices, J, n, D)
    batched = probe_sparse_jacobian(jvp, slices, J, n, D, jvp_many=many)
    assert max(calls) == chains.PROBE_BATCH and len(calls) == 5  # 602 first products in 3 batches, then 3 + 3
    for a, b in zip(one, batched):
        np.testing.assert_array_equal(a, b)
    M = sp.csr_matrix((batched[2], (batched[0], batched[1])), shape=(J, n)).toarray()
    ref = np.zeros((J, n))
    ref[np.arange(J), idx.numpy()] = 2.0
    ref[:, K:K + 3] = W.numpy()
    np.testing.assert_allclose(M, ref, rtol=1e-15)


def test_a_long_ar1_loop_takes_the_batched_products_and_gives_the_exact_posterior():
    """An AR(1) loop of 260 sites (batched Jacobian products in extraction) against the exact Gaussian posterior of
    its sparse precision."""
    from pyro_convexvb.lgm import extract

    T, phi, s, noise = 260, 0.8, 0.5, 0.3
    assert T >= extract.BATCHED_PRODUCTS_FROM
    y = torch.randn(T, generator=torch.Generator().manual_seed(5), dtype=D)

    def model(y=None):
        h = pyro.sample("h_0", dist.Normal(torch.tensor(0.0, dtype=D), s / (1 - phi**2) ** 0.5))
        hs = [h]
        for k in range(1, T):
            h = pyro.sample(f"h_{k}", dist.Normal(phi * h, s))
            hs.append(h)
        pyro.sample("y", dist.Normal(torch.stack(hs), noise).to_event(1), obs=y)

    res = pcv.fit(model, y=y, engine="dual_vg", progress=False)
    L = torch.eye(T, dtype=D) - phi * torch.diag(torch.ones(T - 1, dtype=D), -1)
    S = torch.full((T,), s**2, dtype=D)
    S[0] = s**2 / (1 - phi**2)
    Q = L.T @ torch.diag(1 / S) @ L + torch.eye(T, dtype=D) / noise**2
    C = torch.linalg.inv(Q)
    post = res.posterior
    assert res.converged and post.layout.names == [f"h_{k}" for k in range(T)]
    np.testing.assert_allclose(post.loc.detach().numpy(), (C @ (y / noise**2)).numpy(), rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(post.variance.detach().sqrt().numpy(), C.diagonal().sqrt().numpy(), rtol=1e-8)


# ----------------------------------------------------------------------------- deep chains
def three_level(region_of_school, school_of_pupil, pupil_of_row, X, y=None):
    """Region -> school -> pupil intercepts (a chain three deep), pupils observed through a gather."""
    R, S, P = int(region_of_school.max()) + 1, region_of_school.shape[0], school_of_pupil.shape[0]
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
    b = pyro.sample("b", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
    with pyro.plate("regions", R):
        r = pyro.sample("r", dist.Normal(mu, 0.5))
    with pyro.plate("schools", S):
        s = pyro.sample("s", dist.Normal(r[region_of_school], 0.4))
    with pyro.plate("pupils", P):
        a = pyro.sample("a", dist.Normal(s[school_of_pupil], 0.3))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=a[pupil_of_row] + X @ b), obs=y)


def _three_level_data(R, S, P, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    ros, sop = torch.arange(S) % R, torch.arange(P) % S
    por = torch.randint(0, P, (N,), generator=g)
    X = torch.randn(N, 2, generator=g, dtype=D)
    y = (torch.rand(N, generator=g, dtype=D) < torch.sigmoid(0.3 + X[:, 0])).to(D)
    return (ros, sop, por, X), y


def test_three_level_chain_sparse_form_equals_the_dense_latent_form():
    args, y = _three_level_data(3, 8, 30, 60)
    r1 = _fit(three_level, *args, y=y, form="sparse", gap_tol=1e-12)
    r2 = _fit(three_level, *args, y=y, form="latent", gap_tol=1e-12)
    assert r1.info["form"] == "sparse" and r1.converged and r2.converged
    assert r1.posterior.layout.names == ["mu", "b", "r", "s", "a"]
    assert torch.allclose(r1.posterior.loc, r2.posterior.loc, atol=1e-8)
    assert torch.allclose(r1.posterior.variance.sqrt(), r2.posterior.variance.sqrt(), atol=1e-8)
    assert abs(r1.log_evidence_bound - r2.log_evidence_bound) < 1e-8
    A = pcv.lgm_from_pyro(three_level, *args, y=y).chain.A  # every region reads mu, school its region, pupil its school
    assert A.nnz == 3 + 8 + 30


def test_a_three_level_chain_with_2000_pupils_and_few_rows_stays_sparse(monkeypatch):
    """2,000 pupil intercepts under 200 schools and 20 regions, observed in 400 rows (``q n`` below the probing
    threshold of entries): the design is probed sparse, dual_vg runs in the sparse latent form, and no torch tensor
    of ``n^2 / 4`` entries or more is created by the usual constructors or densified."""
    import tracemalloc

    args, y = _three_level_data(20, 200, 2000, 400)
    n = 1 + 2 + 20 + 200 + 2000
    big = []

    def watch(fn):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            if torch.is_tensor(out) and out.numel() >= n * n // 4:
                big.append((fn.__name__, tuple(out.shape)))
            return out
        return wrapped

    for name in ("zeros", "ones", "empty", "eye", "full", "diag", "diag_embed", "zeros_like", "stack", "cat"):
        monkeypatch.setattr(torch, name, watch(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "to_dense", watch(torch.Tensor.to_dense))
    tracemalloc.start()
    lgm = pcv.lgm_from_pyro(three_level, *args, y=y)
    res = pcv.fit(three_level, *args, y=y, engine="dual_vg", progress=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert isinstance(lgm.sites[0].design, SparseOperator)
    assert res.info["form"] == "sparse" and res.converged and res.posterior.kind == "precision_operator"
    assert not big, big
    assert peak < 40_000 * n, peak  # n^2 float64 would be 39 MB


# ----------------------------------------------------------------------------- the relaxation's posterior, chains
def test_matrix_free_precision_with_an_explicit_factor_maps_to_the_model_sparsely():
    """A posterior over ``u`` given by a matrix-free precision, a stacked factor ``[R; W^{1/2} B]`` and
    ``precision_scale = 2`` (the relaxation's form) maps to the chain's sites as the dense ``M C M^T`` does."""
    from pyro_convexvb.lgm.chains import AffineChain
    from pyro_convexvb.linalg.operators import ComposedOperator, DiagonalOperator, FunctionOperator, StackedOperator
    from pyro_convexvb.posterior.gaussian import GaussianPosterior

    n, N = 6, 15
    A = sp.csr_matrix(([1.0, 1.0, 0.5, 0.7], ([2, 3, 4, 5], [0, 0, 2, 1])), shape=(n, n))
    chain = AffineChain(A, ["x"])
    g = torch.Generator().manual_seed(0)
    Bd = torch.zeros(N, n, dtype=D)
    Bd[torch.arange(N), torch.randint(0, n, (N,), generator=g)] = 1.0
    Bd[:, 1] = torch.randn(N, generator=g, dtype=D)
    w = torch.rand(N, generator=g, dtype=D) + 0.2
    R = DiagonalOperator(torch.rand(n, generator=g, dtype=D) + 0.5)
    J = StackedOperator([R, ComposedOperator(DiagonalOperator(w.sqrt()), SparseOperator(Bd.to_sparse_csr()))])
    P = J.to_dense().T @ J.to_dense()
    C = 2.0 * torch.linalg.inv(P)
    loc = torch.randn(n, generator=g, dtype=D)
    A_free = FunctionOperator(lambda v: P @ v, lambda v: P @ v, (n, n), dtype=D)
    post = GaussianPosterior(loc, C.diagonal().clone(), precision_operator=A_free, precision_factor=J,
                             precision_scale=2.0)
    out = chain.to_model(post)
    M = torch.as_tensor(chain.M.toarray())
    assert out.kind == "precision_operator"
    assert torch.allclose(out.loc, M @ loc, atol=1e-12)
    assert torch.allclose(out.variance, (M @ C @ M.T).diagonal(), rtol=1e-10)
    assert torch.allclose(out.covariance(), M @ C @ M.T, rtol=1e-9, atol=1e-12)


def test_convex_relaxation_on_2000_random_intercepts_keeps_the_design_sparse(monkeypatch):
    """The relaxation's posterior over ``u`` (matrix-free precision) is mapped to the centred sites without the
    dense ``N x n`` design or ``n x n`` covariance it went through before; on a small instance the mapped posterior
    equals the dense map."""
    J = 8
    X, grp, y = random_intercepts(J, rows=60)
    r1 = pcv.fit(centred, X, grp, J, y=y, engine="convex_relaxation", progress=False)
    import pyro_convexvb.lgm.chains as chains

    with monkeypatch.context() as m:
        m.setattr(chains.AffineChain, "_sparse_precision_to_model", lambda self, *a: None)
        r2 = pcv.fit(centred, X, grp, J, y=y, engine="convex_relaxation", progress=False)
    assert r1.posterior.kind == "precision_operator" and r2.posterior.kind == "covariance"
    assert torch.allclose(r1.posterior.loc, r2.posterior.loc, atol=1e-10)
    assert torch.allclose(r1.posterior.variance, r2.posterior.variance, rtol=1e-8, atol=1e-12)

    J = 2000
    X, grp, y = _big_problem(J)
    n = 1 + X.shape[1] + J
    big = []

    def watch(fn):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            if torch.is_tensor(out) and out.numel() >= n * n // 4:
                big.append((fn.__name__, tuple(out.shape)))
            return out
        return wrapped

    for name in ("zeros", "ones", "empty", "eye", "full", "diag", "zeros_like", "stack", "cat"):
        monkeypatch.setattr(torch, name, watch(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "to_dense", watch(torch.Tensor.to_dense))
    monkeypatch.setattr(torch.Tensor, "__matmul__", watch(torch.Tensor.__matmul__))
    with pytest.warns(pcv.ConvergenceWarning):  # two outer steps: the posterior's form is what is checked
        res = pcv.fit(centred, X, grp, J, y=y, engine="convex_relaxation", progress=False, options=dict(max_outer=2))
    assert res.posterior.kind == "precision_operator" and res.posterior.n == n
    assert not big, big  # before: an eye(n), A applied to it (n x n) and B to it (N x n)


def _dense_precision_gp(idx, L, y=None):
    g = torch.Generator().manual_seed(3)
    A = torch.randn(L, L, generator=g, dtype=D)
    Q = A @ A.T / L + torch.eye(L, dtype=D)  # every entry nonzero: a GP's precision
    f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(L, dtype=D), precision_matrix=Q))
    with pyro.plate("data", len(idx)):
        pyro.sample("y", dist.Bernoulli(logits=f[idx]), obs=y)


def test_a_dense_prior_precision_keeps_the_dense_latent_form(monkeypatch):
    """``form='auto'`` above the size threshold with a sparse design but a dense prior precision: the dense
    ``L x L`` form (the sparse form would factor a full matrix); ``form='sparse'`` asked for takes the dense
    precision's entries and gives the same fit."""
    from pyro_convexvb.infer.dual_vg import engine as dual_engine

    monkeypatch.setattr(dual_engine, "SPARSE_MIN_LATENTS", 10)
    L, N = 30, 90
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, L, (N,), generator=g)
    y = (torch.rand(N, generator=g, dtype=D) < 0.5).to(D)
    r_auto = _fit(_dense_precision_gp, idx, L, y=y, gap_tol=1e-12)
    r_sparse = _fit(_dense_precision_gp, idx, L, y=y, form="sparse", gap_tol=1e-12)
    assert r_auto.info["form"] in ("latent", "site") and r_auto.converged
    assert r_sparse.info["form"] == "sparse" and r_sparse.converged
    assert torch.allclose(r_auto.posterior.loc, r_sparse.posterior.loc, atol=1e-8)
    assert torch.allclose(r_auto.posterior.variance, r_sparse.posterior.variance, rtol=1e-6)
    assert abs(r_auto.log_evidence_bound - r_sparse.log_evidence_bound) < 1e-8
