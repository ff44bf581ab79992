"""GaussianPosterior: every representation agrees with the dense reference; the guide works in Predictive."""
import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.linalg.operators import DenseOperator

D = torch.float64


def _spd(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, n, generator=g, dtype=D)
    return A @ A.T + n * torch.eye(n, dtype=D)


@pytest.mark.parametrize("kind", ["covariance", "scale_tril", "precision"])
def test_dense_representations_agree(kind):
    C = _spd(5)
    loc = torch.arange(5, dtype=D)
    arg = {"covariance": C, "scale_tril": torch.linalg.cholesky(C), "precision": torch.linalg.inv(C)}[kind]
    q = pcv.GaussianPosterior(loc, **{kind: arg})
    torch.testing.assert_close(q.covariance(), C, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(q.variance, C.diagonal(), rtol=1e-10, atol=1e-10)
    ref = dist.MultivariateNormal(loc, covariance_matrix=C)
    u = torch.randn(3, 5, dtype=D)
    torch.testing.assert_close(q.log_prob(u), ref.log_prob(u), rtol=1e-10, atol=1e-10)
    assert float(q.entropy()) == pytest.approx(float(ref.entropy()), abs=1e-10)
    s = q.sample(40000, generator=torch.Generator().manual_seed(1))
    assert s.shape == (40000, 5)
    emp = torch.cov(s.T)
    assert float((emp - C).abs().max() / C.abs().max()) < 0.03
    B = torch.randn(4, 5, dtype=D)
    mean, var = q.marginals(B, offset=torch.ones(4, dtype=D))
    torch.testing.assert_close(mean, B @ loc + 1)
    torch.testing.assert_close(var, (B @ C @ B.T).diagonal(), rtol=1e-10, atol=1e-10)


def test_matrix_free_precision_sampling_is_exact():
    g = torch.Generator().manual_seed(3)
    J = torch.randn(30, 6, generator=g, dtype=D)
    A = J.T @ J
    C = 0.5 * torch.linalg.inv(A)
    q = pcv.GaussianPosterior(torch.zeros(6, dtype=D), C.diagonal(), precision_operator=DenseOperator(A),
                              precision_factor=DenseOperator(J), precision_scale=0.5)
    torch.testing.assert_close(q.covariance(), C, rtol=1e-9, atol=1e-12)
    s = q.sample(20000, generator=torch.Generator().manual_seed(4))
    emp = torch.cov(s.T)
    assert float((emp - C).abs().max() / C.abs().max()) < 0.05
    with pytest.raises(ValueError, match="marginal variances"):
        pcv.GaussianPosterior(torch.zeros(6, dtype=D), precision_operator=DenseOperator(A))


def test_low_rank_variances():
    g = torch.Generator().manual_seed(5)
    Q, _ = torch.linalg.qr(torch.randn(8, 3, generator=g, dtype=D))
    T = _spd(3, seed=6)
    q = pcv.GaussianPosterior(torch.zeros(8, dtype=D), low_rank=(Q, T))
    ref = Q @ torch.linalg.inv(T) @ Q.T
    torch.testing.assert_close(q.variance, ref.diagonal(), rtol=1e-10, atol=1e-12)
    B = torch.randn(2, 8, dtype=D)
    torch.testing.assert_close(q.marginals(B)[1], (B @ ref @ B.T).diagonal(), rtol=1e-10, atol=1e-12)
    with pytest.raises(NotImplementedError, match="low-rank"):
        q.sample(3)


def test_low_rank_plus_diagonal_agrees_with_dense():
    g = torch.Generator().manual_seed(8)
    W = torch.randn(6, 2, generator=g, dtype=D)
    d = torch.rand(6, generator=g, dtype=D) + 0.1
    C = W @ W.T + torch.diag(d)
    loc = torch.linspace(-1, 1, 6, dtype=D)
    q = pcv.GaussianPosterior(loc, cov_factor=W, cov_diag=d)
    assert q.kind == "low_rank_diagonal"
    torch.testing.assert_close(q.covariance(), C, rtol=0, atol=1e-12)
    torch.testing.assert_close(q.variance, C.diagonal(), rtol=0, atol=1e-12)
    torch.testing.assert_close(q.scale_tril() @ q.scale_tril().T, C, rtol=0, atol=1e-12)
    ref = dist.MultivariateNormal(loc, covariance_matrix=C)
    u = torch.randn(4, 6, generator=g, dtype=D)
    torch.testing.assert_close(q.log_prob(u), ref.log_prob(u), rtol=1e-10, atol=1e-10)
    assert float(q.entropy()) == pytest.approx(float(ref.entropy()), abs=1e-10)
    torch.testing.assert_close(q.to_distribution().covariance_matrix, C, rtol=0, atol=1e-12)
    B = torch.randn(3, 6, generator=g, dtype=D)
    mean, var = q.marginals(B, offset=torch.ones(3, dtype=D))
    torch.testing.assert_close(mean, B @ loc + 1)
    torch.testing.assert_close(var, (B @ C @ B.T).diagonal(), rtol=1e-12, atol=1e-12)
    s = q.sample(40000, generator=torch.Generator().manual_seed(9))
    assert s.shape == (40000, 6)
    assert float((s.mean(0) - loc).abs().max()) < 4 * float(C.diagonal().max().sqrt()) / 200
    assert float((torch.cov(s.T) - C).abs().max() / C.abs().max()) < 0.03
    with pytest.raises(ValueError, match="both cov_factor"):
        pcv.GaussianPosterior(loc, cov_factor=W)
    with pytest.raises(ValueError, match="shape"):
        pcv.GaussianPosterior(loc, cov_factor=W[:5], cov_diag=d)
    with pytest.raises(ValueError, match="cov_diag must be positive"):
        pcv.GaussianPosterior(loc, cov_factor=W, cov_diag=d - 1)
    with pytest.raises(ValueError, match="one covariance representation"):
        pcv.GaussianPosterior(loc, covariance=C, cov_factor=W, cov_diag=d)


def test_bad_inputs():
    with pytest.raises(ValueError, match="one covariance representation"):
        pcv.GaussianPosterior(torch.zeros(2, dtype=D), covariance=torch.eye(2, dtype=D), precision=torch.eye(2, dtype=D))
    with pytest.raises(ValueError, match="shape"):
        pcv.GaussianPosterior(torch.zeros(2, dtype=D), covariance=torch.eye(3, dtype=D))
    with pytest.raises(ValueError, match="finite and nonnegative"):
        pcv.GaussianPosterior(torch.zeros(2, dtype=D), torch.tensor([1.0, -1.0], dtype=D))


@pytest.mark.parametrize("trainable", [True, False])
def test_guide_in_predictive_median_quantiles(trainable):
    X = torch.randn(20, 3, dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("data", X.shape[0]):
            return pyro.sample("y", dist.Normal(X @ w + b, 0.1), obs=y)

    C = _spd(4) / 10
    loc = torch.tensor([1.0, 2.0, 3.0, -4.0], dtype=D)
    q = pcv.GaussianPosterior(loc, covariance=C)
    y = model(X)
    q.model, q.model_args = model, ((X,), {"y": y})
    guide = q.as_guide(trainable=trainable)
    assert isinstance(guide, pcv.GaussianPosteriorGuide) != trainable
    med = guide.median()
    torch.testing.assert_close(med["w"], loc[:3])
    assert float(med["b"]) == -4.0
    qs = guide.quantiles([0.1587, 0.5])
    torch.testing.assert_close(qs["b"][0], torch.tensor(-4.0 - math.sqrt(C[3, 3]), dtype=D), atol=1e-3, rtol=0)
    pred = pyro.infer.Predictive(model, guide=guide, num_samples=300)(X)
    assert pred["y"].shape == (300, 20)
    wmean = pred["w"].reshape(300, 3).mean(0)
    assert float((wmean - loc[:3]).abs().max()) < 0.1
    ymean = pred["y"].mean(0)
    B = torch.cat([X, torch.ones(20, 1, dtype=D)], 1)
    sd = ((B @ C @ B.T).diagonal() + 0.01).sqrt()
    z = (ymean - (X @ loc[:3] - 4.0)) / (sd / math.sqrt(300))
    assert float(z.abs().max()) < 4.5


def test_precision_operator_marginals_exact():
    g = torch.Generator().manual_seed(7)
    J = torch.randn(30, 6, generator=g, dtype=D)
    A = J.T @ J
    C = 0.5 * torch.linalg.inv(A)
    q = pcv.GaussianPosterior(torch.ones(6, dtype=D), C.diagonal(), precision_operator=DenseOperator(A),
                              precision_factor=DenseOperator(J), precision_scale=0.5)
    B = torch.randn(3, 6, generator=g, dtype=D)
    mean, var = q.marginals(B)
    torch.testing.assert_close(mean, B @ torch.ones(6, dtype=D))
    torch.testing.assert_close(var, (B @ C @ B.T).diagonal(), rtol=1e-9, atol=1e-12)
    # the CG path (used for n > 4000) agrees
    torch.testing.assert_close(q._precision_operator_quad.__func__(
        type("Q", (), {"n": 5000, "dtype": D, "device": torch.device("cpu"), "precision_operator": DenseOperator(A),
                       "precision_scale": 0.5, "cg_options": dict(rtol=1e-12, on_fail="raise")})(),
        DenseOperator(B)), var, rtol=1e-8, atol=1e-12)


def test_weighted_quantiles_of_draws():
    """Weighted empirical quantiles (the hyper-latent surface marginals and the importance-sampling summaries use
    them): the mid-mass interpolation on a hand-computed case and the ends clamped."""
    import numpy as np

    from pyro_convexvb.posterior import empirical

    x = np.array([[2.0], [0.0], [1.0]])
    w = np.array([0.5, 0.25, 0.25])  # sorted: 0 (0.25), 1 (0.25), 2 (0.5); mid-masses 0.125, 0.375, 0.75
    q = empirical.weighted_quantiles(x, w, (0.05, 0.25, 0.5, 0.9))
    np.testing.assert_allclose(q[:, 0], [0.0, 0.5, 1.0 + 0.125 / 0.375, 2.0], rtol=0, atol=1e-15)
    q, se = empirical.weighted_quantiles(x, w, (0.5,), mcse=True)
    assert se.shape == (1, 1) and float(se[0, 0]) > 0


def test_matrix_free_marginals_solve_in_blocks_and_match_a_dense_factor():
    """Above 4,000 latents the marginals of new rows under a matrix-free precision come from batched CG, which held
    every right-hand side at once (about 9 n x q blocks: 3 GB for 2,000 rows of a 20,000-node field); the solves
    run in blocks of CG_BLOCK now, with the same answer as a dense Cholesky factor to rounding."""
    import scipy.sparse as sp

    from pyro_convexvb.linalg.operators import SparseOperator
    from pyro_convexvb.posterior.gaussian import CG_BLOCK
    from tests._fields import poisson_lattice

    m = 65
    model, y = poisson_lattice(m, 0.5)

    post = pcv.fit(model, y=y, engine="dual_vg", progress=False).posterior
    assert post.kind == "precision_operator" and post.n > 4000
    R = sp.random(CG_BLOCK + 44, m * m, density=0.002, random_state=0, format="csr")
    B = SparseOperator(torch.sparse_csr_tensor(torch.as_tensor(R.indptr), torch.as_tensor(R.indices),
                                               torch.as_tensor(R.data), size=R.shape))
    got = post._precision_operator_quad(B)
    L = torch.linalg.cholesky(post.precision_operator.to_dense())
    W = torch.linalg.solve_triangular(L, torch.as_tensor(R.toarray()).T, upper=False)
    ref = post.precision_scale * (W**2).sum(0)
    torch.testing.assert_close(got, ref, rtol=1e-8, atol=1e-12)
