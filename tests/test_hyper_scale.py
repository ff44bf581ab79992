"""Hyper-latents of large sparse models: the mode search's first step, the reused sparse structure, the memory kept
per design point, and the integrated posterior against quadrature with an exact conjugate inner posterior."""
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.infer import hyper as hyper_mod
from pyro_convexvb.infer.dual_vg.bounds import make_bound
from pyro_convexvb.infer.dual_vg.objective import reduced_objective
from pyro_convexvb.infer.dual_vg.sparse import SparseLatentBackend
from pyro_convexvb.lgm.sites import BernoulliLogit

from _hierarchies import centred_hyper, random_intercepts

D = torch.float64


# ----------------------------------------------------------------------------- the mode search
def test_first_step_of_the_mode_search_has_length_one():
    """A steep objective (|grad| = 5000 at the start) no longer sends L-BFGS-B to the edge of its box (z0 + 12):
    every evaluated point stays within a few units of the start, and the mode is found."""
    seen = []

    def f(z):
        seen.append(float(z[0]))
        return -0.5 * 1e4 * float((z[0] - 0.5) ** 2)

    z, val, _ = hyper_mod.find_mode(f, torch.zeros(1, dtype=D), gtol=1e-6)
    assert abs(float(z[0]) - 0.5) < 1e-6 and val > -1e-6
    assert max(abs(v) for v in seen) <= 1.0 + 2e-3, max(seen)


# ----------------------------------------------------------------------------- the reused backend
def _backend_inputs(scale, seed=0, L=30, N=80):
    g = torch.Generator().manual_seed(seed)
    Q = torch.diag(torch.rand(L, generator=g, dtype=D) + 0.5) / scale**2
    Q[0, 0] = 0.25
    W = torch.zeros(N, L, dtype=D)
    W[torch.arange(N), torch.randint(2, L, (N,), generator=g)] = 1.0
    W[:, 0] = 1.0
    W[:, 1] = torch.randn(N, generator=g, dtype=D)
    mu, d = 0.1 * scale * torch.ones(L, dtype=D), torch.randn(N, generator=torch.Generator().manual_seed(9), dtype=D)
    return Q.to_sparse_csr(), mu, W.to_sparse_csr(), d


def _terms(be, alpha, lam):
    t = be.evaluate(alpha, lam)
    return [t.m_tilde, t.v_tilde, t.logdet_B, t.quad]


def test_reused_backend_equals_a_fresh_one_and_leaves_the_old_one_correct():
    y = (torch.rand(80, generator=torch.Generator().manual_seed(3), dtype=D) < 0.5).to(D)
    alpha = torch.where(y > 0, -0.4, 0.35).to(D)
    lam = torch.rand(80, generator=torch.Generator().manual_seed(1), dtype=D) + 0.1
    old = SparseLatentBackend(*_backend_inputs(0.7))
    before = _terms(old, alpha, lam)
    new = SparseLatentBackend.reuse(old, *_backend_inputs(1.9))
    fresh = SparseLatentBackend(*_backend_inputs(1.9))
    assert new is not None
    for a, b in zip(_terms(new, alpha, lam), _terms(fresh, alpha, lam)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    bound = make_bound(BernoulliLogit(y))
    x = torch.randn(80, generator=torch.Generator().manual_seed(2), dtype=D)
    H1 = reduced_objective(new, bound, alpha, hessian="operator").hessian
    H2 = reduced_objective(fresh, bound, alpha, hessian="operator").hessian
    assert torch.allclose(H1.mv(x), H2.mv(x), rtol=1e-11, atol=1e-11)
    assert torch.allclose(H1.precondition(x), H2.precondition(x), rtol=1e-10, atol=1e-10)
    q1, q2 = new.posterior(alpha, lam), fresh.posterior(alpha, lam)
    assert torch.allclose(q1.loc, q2.loc, atol=1e-12) and torch.allclose(q1.variance, q2.variance, atol=1e-12)
    # the old backend gave its factors away: it refactors its own values on its next use
    for a, b in zip(_terms(old, alpha, lam), before):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    # another design, or a prior outside the pattern of A: no reuse
    Q, mu, W, d = _backend_inputs(1.9)
    W2 = W.to_dense().clone()
    W2[0, 1] += 1.0
    assert SparseLatentBackend.reuse(fresh, Q, mu, W2.to_sparse_csr(), d) is None
    Qd = Q.to_dense().clone()
    Qd[5, 7] = Qd[7, 5] = 0.01
    assert SparseLatentBackend.reuse(fresh, Qd.to_sparse_csr(), mu, W, d) is None


# ----------------------------------------------------------------------------- the Gaussian reference
def ri_gaussian(grp, J, y=None, noise=0.5):
    sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.3, dtype=D), 2.0))
    with pyro.plate("groups", J):
        alpha = pyro.sample("alpha", dist.Normal(mu, sigma))
    with pyro.plate("data", grp.shape[0]):
        pyro.sample("y", dist.Normal(alpha[grp], noise), obs=y)


def _gaussian_data(J=10, per=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    grp = torch.arange(J).repeat_interleave(per)
    a = 0.3 + 0.6 * torch.randn(J, generator=g, dtype=D)
    y = a[grp] + 0.5 * torch.randn(J * per, generator=g, dtype=D)
    return grp, J, y


def _quadrature_reference(grp, J, y, noise=0.5):
    """``sigma``'s 5/50/95% quantiles and the field's mean and sd by quadrature over ``log sigma`` (4001 points) with
    the exact Gaussian posterior of ``(mu, alpha)`` given ``sigma`` (conjugate; NumPy, independent of the package)."""
    grp, yv = grp.numpy(), y.numpy()
    N = yv.shape[0]
    H = np.zeros((N, J + 1))
    H[np.arange(N), 1 + grp] = 1.0  # y = H x + e, x = (mu, alpha)
    zs = np.linspace(-7.0, 2.5, 4001)
    m0 = np.full(J + 1, 0.3)
    logp, means, variances = [], [], []
    for z in zs:
        s = math.exp(z)
        C = np.full((J + 1, J + 1), 4.0)  # prior covariance of (mu, alpha): alpha = mu + s e
        C[1:, 1:] += s**2 * np.eye(J)
        S = H @ C @ H.T + noise**2 * np.eye(N)
        Lc = np.linalg.cholesky(S)
        r = np.linalg.solve(Lc, yv - H @ m0)
        lik = -0.5 * r @ r - np.log(np.diag(Lc)).sum() - 0.5 * N * math.log(2 * math.pi)
        prior = 0.5 * math.log(2 / math.pi) - 0.5 * s**2  # HalfNormal(1)
        logp.append(lik + prior + z)  # density of z = log sigma
        K = np.linalg.solve(S, H @ C).T
        means.append(m0 + K @ (yv - H @ m0))
        variances.append(np.diag(C - K @ H @ C))
    logp = np.array(logp)
    w = np.exp(logp - logp.max())
    w /= w.sum()
    M, V = np.array(means), np.array(variances)
    mean = w @ M
    var = w @ (V + M**2) - mean**2
    cdf = np.cumsum(w)
    q = {p: math.exp(float(np.interp(p, cdf, zs))) for p in (0.05, 0.5, 0.95)}
    return q, torch.as_tensor(mean), torch.as_tensor(np.sqrt(var))


@pytest.mark.parametrize("form", ["sparse", "auto"])
def test_integrated_random_intercept_scale_matches_quadrature_with_the_exact_inner_posterior(form):
    grp, J, y = _gaussian_data()
    q_ref, m_ref, s_ref = _quadrature_reference(grp, J, y)
    res = pcv.fit(ri_gaussian, grp, J, y=y, engine="dual_vg", progress=False, options=dict(form=form))
    assert res.converged
    q = res.hyper["marginals"]["sigma"]["quantiles"]
    for p in (0.05, 0.5, 0.95):
        assert abs(float(q[p]) / q_ref[p] - 1) < 0.04, (p, float(q[p]), q_ref[p])
    m, s = res.posterior.loc, res.posterior.variance.sqrt()
    assert res.posterior.layout.names == ["mu", "alpha"]
    assert float(((m - m_ref) / s_ref).abs().max()) < 0.02
    assert float((s / s_ref - 1).abs().max()) < 0.03


# ----------------------------------------------------------------------------- the same answer as before, less kept
def test_reuse_and_released_results_leave_the_hyper_posterior_unchanged(monkeypatch):
    """The sparse form with the structure reused and only summaries kept equals fresh builds with every result kept."""
    J = 40
    X, grp, y = random_intercepts(J, per=3, grouping="blocks")
    built = []
    init = SparseLatentBackend.__init__

    def counting_init(self, *a, **k):
        built.append(1)
        init(self, *a, **k)

    monkeypatch.setattr(SparseLatentBackend, "__init__", counting_init)
    opts = dict(form="sparse")
    r1 = pcv.fit(centred_hyper, X, grp, J, y=y, engine="dual_vg", progress=False, options=opts)
    fresh_builds = len(built)
    assert fresh_builds <= 2, fresh_builds  # the first point builds it (and hyper_check's extraction is not fitted)
    monkeypatch.setattr(SparseLatentBackend, "reuse", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(hyper_mod.HyperObjective, "_release_latest", lambda self, key: setattr(self, "_latest", key))
    r2 = pcv.fit(centred_hyper, X, grp, J, y=y, engine="dual_vg", progress=False, options=opts)
    assert len(built) - fresh_builds == r2.hyper["evaluations"]  # one fresh build per point without reuse
    assert r1.converged and r2.converged and r1.hyper["evaluations"] == r2.hyper["evaluations"]
    for p in (0.05, 0.5, 0.95):
        a, b = r1.hyper["marginals"]["sigma"]["quantiles"][p], r2.hyper["marginals"]["sigma"]["quantiles"][p]
        assert abs(float(a) / float(b) - 1) < 1e-6
    assert torch.allclose(r1.posterior.loc, r2.posterior.loc, rtol=1e-7, atol=1e-8)
    assert torch.allclose(r1.posterior.variance, r2.posterior.variance, rtol=1e-6, atol=1e-9)


def test_only_the_mode_keeps_its_full_result_and_design_points_their_posteriors():
    J = 30
    X, grp, y = random_intercepts(J, per=3, grouping="blocks")
    res = pcv.fit(centred_hyper, X, grp, J, y=y, engine="dual_vg", progress=False, options=dict(form="sparse"))
    details, mode = res.info["hyper_details"], res.info["mode_result"]
    assert details["fits"] >= details["evaluations"]
    assert mode.lgm is not None and mode.state is not None and mode.state.backend is not None
    points = details["results"]
    assert len(points) == res.posterior.num_points
    assert all(r.posterior is not None and r.converged for r in points)
    assert all(r.lgm is None and r.state is None for r in points if r is not mode)
    # the mixture's summaries are those of the kept posteriors
    w = res.posterior.weights
    loc = sum(wk * r.posterior.loc for wk, r in zip(w, points))
    assert torch.allclose(res.posterior.loc, loc, atol=1e-12)


@pytest.mark.slow
def test_a_2000_group_hyper_fit_allocates_nothing_quadratic(monkeypatch):
    """The hyper variant at 2000 groups (10000 rows) in the sparse form, the whole integration (every design point's
    extraction and fit, the mixture's summaries): no torch tensor of ``n^2 / 4`` entries or more is created by the
    usual constructors or densified, and the NumPy/Python peak stays below a bound linear in ``n``."""
    import tracemalloc

    J = 2000
    X, grp, y = random_intercepts(J, per=5, grouping="blocks", seed=1)
    n = 1 + X.shape[1] + J
    limit = n * n // 4
    big = []

    def watch(fn):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            if torch.is_tensor(out) and out.numel() >= limit:
                big.append((fn.__name__, tuple(out.shape)))
            return out
        return wrapped

    for name in ("zeros", "ones", "empty", "eye", "full", "zeros_like", "ones_like", "empty_like", "stack", "cat"):
        monkeypatch.setattr(torch, name, watch(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "to_dense", watch(torch.Tensor.to_dense))
    tracemalloc.start()
    res = pcv.fit(centred_hyper, X, grp, J, y=y, engine="dual_vg", progress=False)
    loc, var = res.posterior.loc, res.posterior.variance
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert res.converged and res.info["mode_result"].info["form"] == "sparse"
    assert loc.shape == (n,) and bool(torch.isfinite(var).all())
    assert not big, big
    assert peak < 40_000 * n, peak  # n^2 float64 would be 32 MB
    torch.eye(n, dtype=D)  # the watch itself sees an n x n tensor
    assert big == [("eye", (n, n))]
