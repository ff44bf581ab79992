"""lgm_from_pyro: operators equal the true matrices; each unsupported case raises naming the site."""
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb.linalg.operators import IdentityOperator, SparseOperator, DenseOperator
from pyro_convexvb.lgm.sites import BernoulliLogit, Gaussian, Laplace, Poisson

D = torch.float64


def _data(q=30, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(q, n, generator=g, dtype=D)
    y = (torch.rand(q, generator=g, dtype=D) < 0.4).to(D)
    return X, y


def logistic(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.5).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def test_dense_logistic_operator_equals_design():
    X, y = _data()
    lgm = pcv.lgm_from_pyro(logistic, X, y=y)
    (g,) = lgm.sites
    assert isinstance(g.family, BernoulliLogit)
    assert isinstance(g.design, DenseOperator)
    torch.testing.assert_close(g.design.to_dense(), X, rtol=0, atol=1e-12)
    assert g.offset.abs().max() < 1e-12
    torch.testing.assert_close(g.family.y, y)
    assert lgm.priors[0].cov.to_dense().diagonal().allclose(torch.full((4,), 2.25, dtype=D))


def test_sparse_linear_keeps_operator_and_intercept_block():
    X, y = _data(q=40, n=5)
    X[X.abs() < 0.8] = 0
    Xs = X.to_sparse_csr()

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w) + b + 0.5), obs=y)

    lgm = pcv.lgm_from_pyro(model, Xs, y=y)
    assert lgm.layout.names == ["w", "b"] and lgm.n == 6
    (g,) = lgm.sites
    J = g.design.to_dense()
    torch.testing.assert_close(J[:, :5], X, rtol=0, atol=1e-12)
    torch.testing.assert_close(J[:, 5], torch.ones(40, dtype=D), rtol=0, atol=1e-12)
    torch.testing.assert_close(g.offset, torch.full((40,), 0.5, dtype=D), rtol=0, atol=1e-12)
    prior_var = lgm.priors[1].cov.to_dense()
    assert float(prior_var) == pytest.approx(4.0)


def test_a_large_sparse_linear_predictor_with_an_intercept_stays_sparse():
    """pcv.linear(X, w) + b: the recorded sparse design plus the intercept's one dense column. Above the dense limit
    the design was a matrix-free autograd operator, which the engines could not apply under no_grad (a bare 'does
    not require grad' after 11 s of dual_vg), and below it a dense N x (d + 1) matrix."""
    import scipy.sparse as sp
    N, d = 20_000, 2_000
    Xs = sp.random(N, d, density=0.001, random_state=1, format="csr")
    y = torch.as_tensor((np.random.default_rng(0).uniform(size=N) < 0.5).astype(float))

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(d, dtype=D), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("n", N):
            pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w) + b), obs=y)

    lgm = pcv.lgm_from_pyro(model, Xs, y=y)
    op = lgm.sites[0].design
    assert type(op).__name__ == "SumOperator"
    with torch.no_grad():  # as the engines apply it
        v = torch.randn(d + 1, generator=torch.Generator().manual_seed(2), dtype=D)
        ref = torch.as_tensor(Xs @ v[:d].numpy()) + v[d]
        torch.testing.assert_close(op.mv(v), ref, rtol=1e-12, atol=1e-12)
        r = torch.randn(N, generator=torch.Generator().manual_seed(3), dtype=D)
        torch.testing.assert_close(op.rmv(r)[:d], torch.as_tensor(Xs.T @ r.numpy()), rtol=1e-12, atol=1e-10)
        assert float(op.rmv(r)[d]) == pytest.approx(float(r.sum()), rel=1e-12)


def test_sparse_linear_alone_is_sparse_operator():
    X, y = _data(q=25, n=6)
    X[X.abs() < 1.0] = 0

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)

    lgm = pcv.lgm_from_pyro(model, X.to_sparse_csr(), y=y)
    assert isinstance(lgm.sites[0].design, SparseOperator)
    torch.testing.assert_close(lgm.sites[0].design.to_dense(), X)


def test_gp_mvn_prior_and_poisson():
    g = torch.Generator().manual_seed(1)
    Z = torch.randn(12, 2, generator=g, dtype=D)
    K = torch.exp(-0.5 * torch.cdist(Z, Z) ** 2) + 1e-4 * torch.eye(12, dtype=D)
    counts = torch.poisson(torch.full((12,), 2.0, dtype=D), generator=g)

    def model(K, y=None):
        f = pyro.sample("f", dist.MultivariateNormal(torch.full((12,), 0.3, dtype=D), covariance_matrix=K))
        with pyro.plate("data", 12):
            pyro.sample("y", dist.Poisson(torch.exp(f + 1.0)), obs=y)

    lgm = pcv.lgm_from_pyro(model, K, y=counts)
    (s,) = lgm.sites
    assert isinstance(s.family, Poisson)
    assert isinstance(s.design, IdentityOperator)
    torch.testing.assert_close(s.offset, torch.ones(12, dtype=D))
    torch.testing.assert_close(lgm.priors[0].cov.to_dense(), K)
    torch.testing.assert_close(lgm.prior_loc, torch.full((12,), 0.3, dtype=D))
    torch.testing.assert_close(lgm.dense_prior_prec() @ K, torch.eye(12, dtype=D), atol=1e-8, rtol=0)


def test_log_joint_matches_pyro_trace_all_constants():
    X, y = _data(q=15, n=3)
    yy = X @ torch.tensor([1.0, -1.0, 0.5], dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Laplace(torch.zeros(3, dtype=D), 0.7).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w + 0.2, 0.4), obs=y)

    lgm = pcv.lgm_from_pyro(model, X, y=yy)
    kinds = sorted(type(g.family).__name__ for g in lgm.sites)
    assert kinds == ["Gaussian", "Laplace"] and lgm.priors[0].flat
    for seed in range(3):
        u = torch.randn(3, generator=torch.Generator().manual_seed(seed), dtype=D)
        tr = pyro.poutine.trace(pyro.poutine.condition(model, data={"w": u})).get_trace(X, y=yy)
        assert float(lgm.log_joint(u)) == pytest.approx(float(tr.log_prob_sum()), abs=1e-10)


def test_log_joint_gp_bernoulli_matches_trace():
    X, y = _data(q=10, n=2)
    K = X @ X.T + 0.5 * torch.eye(10, dtype=D)
    lgm = pcv.lgm_from_pyro(pcv.gp.gp_classification_model, K, y=y)
    u = torch.randn(10, dtype=D)
    tr = pyro.poutine.trace(pyro.poutine.condition(pcv.gp.gp_classification_model, data={"f": u})).get_trace(K, y=y)
    assert float(lgm.log_joint(u)) == pytest.approx(float(tr.log_prob_sum()), abs=1e-10)


def test_subsampled_plate_is_traced_on_full_data():
    X, y = _data(q=50, n=3)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0], subsample_size=7) as idx:
            pyro.sample("y", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])

    lgm = pcv.lgm_from_pyro(model, X, y=y)
    torch.testing.assert_close(lgm.sites[0].design.to_dense(), X)
    torch.testing.assert_close(lgm.sites[0].family.y, y)
    # the plate is restored afterwards: subsampling works again
    tr = pyro.poutine.trace(model).get_trace(X, y=y)
    assert tr.nodes["y"]["value"].shape == (7,)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_site_that_a_latent_switches_on_is_refused(sign):
    """A model whose sample sites depend on a latent's value (``if b[0] > 0: pyro.sample(...)``) is refused naming the
    site, whichever runs contain it: it was fitted without the site when the second run alone had it, and failed
    with a KeyError when only the first did."""
    y = torch.randn(5, dtype=D)

    def model(y):
        b = pyro.sample("b", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(b[1] + torch.zeros(5, dtype=D), 1.0).to_event(1), obs=y)
        if sign * b[0] > 0:
            pyro.sample("y2", dist.Normal(b[1], 1.0), obs=torch.tensor(0.5, dtype=D))

    for seed in range(4):  # the structure trace runs at a prior draw
        pyro.set_rng_seed(seed)
        with pytest.raises(pcv.UnsupportedModelError, match="branches on a latent") as e:
            pcv.lgm_from_pyro(model, y)
        assert e.value.site == "y2"


def test_latent_site_in_a_plate_with_explicit_subsample_indices_is_refused_saying_so():
    """A latent site under ``pyro.plate(size, subsample=idx)`` has its prior scaled by ``size / len(idx)``: refused
    naming the site and the plate's subsample indices as the cause (the message named only poutine.scale)."""
    y = torch.randn(10, dtype=D)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("groups", 6, subsample=torch.tensor([0, 2, 4])):
            a = pyro.sample("a", dist.Normal(mu, 1.0))
        pyro.sample("y", dist.Normal(a.sum() + torch.zeros(10, dtype=D), 1.0).to_event(1), obs=y)

    with pytest.raises(pcv.UnsupportedModelError, match=r"site 'a'.*explicit subsample= indices") as e:
        pcv.lgm_from_pyro(model, y)
    assert e.value.site == "a"


def test_masked_observations_drop_rows():
    X, y = _data(q=20, n=3)
    mask = torch.arange(20) % 3 != 0

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w).mask(mask), obs=y)

    lgm = pcv.lgm_from_pyro(model, X, y=y)
    torch.testing.assert_close(lgm.sites[0].design.to_dense(), X[mask])


def test_probs_parameterisation_and_observed_constant_site():
    X, y = _data(q=20, n=3)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        pyro.sample("c", dist.Normal(torch.tensor(0.0, dtype=D), 1.0), obs=torch.tensor(0.5, dtype=D))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(probs=torch.sigmoid(X @ w)), obs=y)

    lgm = pcv.lgm_from_pyro(model, X, y=y)
    torch.testing.assert_close(lgm.sites[0].design.to_dense(), X, atol=1e-9, rtol=0)
    const = dist.Normal(0.0, 1.0).log_prob(torch.tensor(0.5)).item()
    assert lgm.log_const == pytest.approx(const, abs=1e-7)


@pytest.mark.parametrize(
    "case, match",
    [
        ("nonaffine", "not an affine function"),
        ("labels", "Bernoulli labels must be in"),
        ("nan", "NaN or inf"),
        ("negative_counts", "nonnegative"),
        ("gamma_prior", "unsupported prior Gamma"),
        ("discrete_latent", "discrete latent"),
        ("hierarchical", "scale \\(or precision\\) of the latent site depends"),
        ("gumbel_lik", "unsupported likelihood Gumbel"),
        ("latent_scale", "noise scale .*depends on a latent"),
    ],
)
def test_unsupported_models_name_the_site(case, match):
    X, y = _data(q=10, n=2)
    site = {"gamma_prior": "tau", "discrete_latent": "z", "hierarchical": "w"}.get(case, "y")

    def model(X, y=None):
        if case == "gamma_prior":
            pyro.sample("tau", dist.Gamma(torch.tensor(2.0, dtype=D), 1.0))
        if case == "discrete_latent":
            pyro.sample("z", dist.Bernoulli(torch.tensor(0.5, dtype=D)))
        if case == "hierarchical":
            s = pyro.sample("s", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
            w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), torch.exp(s)).to_event(1))
        else:
            w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        eta = X @ w
        with pyro.plate("data", X.shape[0]):
            if case == "nonaffine":
                pyro.sample("y", dist.Bernoulli(logits=eta**3), obs=y)
            elif case == "labels":
                pyro.sample("y", dist.Bernoulli(logits=eta), obs=2 * y - 1)
            elif case == "nan":
                yy = y.clone()
                yy[3] = float("nan")
                pyro.sample("y", dist.Normal(eta, 1.0), obs=yy)
            elif case == "negative_counts":
                pyro.sample("y", dist.Poisson(torch.exp(eta)), obs=-y)
            elif case == "gumbel_lik":
                pyro.sample("y", dist.Gumbel(eta, 1.0), obs=y)
            elif case == "latent_scale":
                pyro.sample("y", dist.Normal(eta, torch.exp(eta)), obs=y)
            else:
                pyro.sample("y", dist.Bernoulli(logits=eta), obs=y)

    with pytest.raises(pcv.UnsupportedModelError, match=match) as info:
        pcv.lgm_from_pyro(model, X, y=y)
    assert info.value.site == site
    assert f"site '{site}'" in str(info.value)


@pytest.mark.parametrize("kink", ["abs", "relu", "relu(-x)"])
@pytest.mark.parametrize("where", ["predictor", "noise scale", "predictor alone"])
def test_a_kink_at_zero_in_a_likelihood_is_refused(kink, where):
    """A predictor or noise scale with a kink at zero in a latent (``abs``, ``relu``) passed the affinity test when
    the two random points shared the orthant of the coordinates read, and a site with zero derivative at the first
    point (``relu(-b)`` with ``b > 0``) was taken for a constant and its log density at that point added to the
    evidence. The second point now lies in the opposite orthant, and sites found constant are compared there."""
    f = {"abs": torch.abs, "relu": torch.relu, "relu(-x)": lambda t: torch.relu(-t)}[kink]
    y = torch.randn(10, generator=torch.Generator().manual_seed(0), dtype=D)
    for j in range(3):
        def model(y):
            b = pyro.sample("b", dist.Normal(torch.zeros(4, dtype=D), 1.0).to_event(1))
            loc = (f(b[j]) if where == "predictor alone" else f(b[j]) + b[3]) if where != "noise scale" else b[3]
            scale = 1.0 + f(b[j]) if where == "noise scale" else torch.tensor(1.0, dtype=D)
            pyro.sample("y", dist.Normal(loc + torch.zeros(10, dtype=D), scale).to_event(1), obs=y)

        with pytest.raises(pcv.UnsupportedModelError) as e:
            pcv.lgm_from_pyro(model, y)
        assert e.value.site == "y", (j, e.value.site)
        assert "affine" in e.value.reason or "depends on" in e.value.reason


def test_explicit_constructor_matches_traced_model():
    X, y = _data(q=30, n=4)
    traced = pcv.lgm_from_pyro(logistic, X, y=y)
    explicit = pcv.LatentGaussianModel.from_design(X.to_sparse_csr(), BernoulliLogit(y), prior_scale=1.5)
    u = torch.randn(4, dtype=D)
    assert float(explicit.log_joint(u)) == pytest.approx(float(traced.log_joint(u)), abs=1e-10)


def test_evidence_lower_bound_exact_for_conjugate_model():
    """For linear-Gaussian models the ELBO at the exact posterior equals log p(y) (closed form)."""
    X, _ = _data(q=25, n=3)
    yy = X @ torch.tensor([0.5, -1.0, 2.0], dtype=D) + 0.3 * torch.randn(25, dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.3).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w - 0.1, 0.3), obs=y)

    lgm = pcv.lgm_from_pyro(model, X, y=yy)
    P = torch.eye(3, dtype=D) / 1.69 + X.T @ X / 0.09
    C = torch.linalg.inv(P)
    m = C @ X.T @ (yy + 0.1) / 0.09
    S = 1.69 * X @ X.T + 0.09 * torch.eye(25, dtype=D)
    logZ = dist.MultivariateNormal(torch.full((25,), -0.1, dtype=D), S).log_prob(yy)
    assert float(lgm.evidence_lower_bound(m, C)) == pytest.approx(float(logZ), abs=1e-9)
    assert float(lgm.evidence_lower_bound(m + 0.05, C)) < float(logZ)


def test_laplace_and_bernoulli_expectations_against_quadrature():
    import numpy as np
    from scipy import integrate

    m = torch.tensor([-1.3, 0.0, 0.7, 2.5], dtype=D)
    v = torch.tensor([0.2, 1.0, 3.0, 0.01], dtype=D)
    lap = Laplace(torch.full((4,), 0.6, dtype=D))
    ber = BernoulliLogit(torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D))
    for fam in (lap, ber):
        got = fam.expected_log_prob(m, v)
        for i in range(4):
            f = lambda e: float(fam.subset([i]).log_prob(torch.tensor([e], dtype=D))) * math.exp(
                -0.5 * (e - m[i].item()) ** 2 / v[i].item()) / math.sqrt(2 * math.pi * v[i].item())
            ref, _ = integrate.quad(f, -np.inf, np.inf, points=None, limit=200)
            assert got[i].item() == pytest.approx(ref, abs=1e-7)


def test_linear_lines_up_with_vectorised_particles():
    """pcv.linear under vectorised particles: (P, 1, n) latents give (P, q) predictors, not (P, P, q)."""
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    X, y = _data(q=30, n=3)
    Xs = X.to_sparse_csr()

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=pcv.linear(Xs, w)), obs=y)

    guide = AutoNormal(model)
    guide(X, y)
    w = torch.randn(5, 1, 3, dtype=D)
    assert pcv.linear(Xs, w).shape == (5, 30)
    torch.testing.assert_close(pcv.linear(Xs, w), w.squeeze(1) @ X.T)
    pyro.set_rng_seed(1)
    vec = Trace_ELBO(num_particles=4000, vectorize_particles=True).loss(model, guide, X, y)
    pyro.set_rng_seed(1)
    seq = Trace_ELBO(num_particles=400).loss(model, guide, X, y)
    assert abs(vec - seq) < 0.5  # both estimate the same ELBO (a P-fold likelihood would be ~4000x off)


# ----------------------------------------------------------------------------------------- Pyro handlers and idioms
def _trace_log_joint(model, values, *args, **kwargs):
    tr = pyro.poutine.trace(pyro.poutine.condition(model, data=values)).get_trace(*args, **kwargs)
    return float(tr.log_prob_sum())


def _assert_log_joint_matches(lgm, model, *args, **kwargs):
    for seed in range(3):
        u = torch.randn(lgm.n, generator=torch.Generator().manual_seed(seed), dtype=D)
        ref = _trace_log_joint(model, lgm.layout.unflatten(u), *args, **kwargs)
        assert float(lgm.log_joint(u)) == pytest.approx(ref, abs=1e-9)


def test_poutine_mask_drops_rows_and_the_bound_follows():
    X, y = _data(q=20, n=3)
    mask = torch.arange(20) % 4 != 1

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.5).to_event(1))
        with pyro.plate("data", X.shape[0]), pyro.poutine.mask(mask=mask):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        with pyro.poutine.mask(mask=False):  # a whole site masked out
            pyro.sample("z", dist.Normal(X @ w, 1.0).to_event(1), obs=torch.zeros(20, dtype=D))

    lgm = pcv.lgm_from_pyro(model, X, y=y)
    (g,) = lgm.sites
    torch.testing.assert_close(g.design.to_dense(), X[mask], rtol=0, atol=1e-12)
    torch.testing.assert_close(g.family.y, y[mask])
    _assert_log_joint_matches(lgm, model, X, y=y)
    reference = pcv.lgm_from_pyro(logistic, X[mask], y=y[mask])  # the kept rows only
    m, C = torch.randn(3, dtype=D), torch.eye(3, dtype=D) * 0.3
    assert float(lgm.evidence_lower_bound(m, C)) == pytest.approx(float(reference.evidence_lower_bound(m, C)), abs=1e-10)


def test_masks_with_event_dims_nan_in_masked_rows_and_identity_designs():
    X, _ = _data(q=6, n=2)
    Y = torch.randn(6, 3, dtype=D)
    keep = torch.tensor([True, False, True, True, False, True])

    def model(X, Y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3, dtype=D), 1.0).to_event(2))
        with pyro.plate("data", 6), pyro.poutine.mask(mask=keep):
            pyro.sample("Y", dist.Normal(X @ w, 0.5).to_event(1), obs=Y)

    lgm = pcv.lgm_from_pyro(model, X, Y)
    assert lgm.sites[0].size == 12
    _assert_log_joint_matches(lgm, model, X, Y)
    Ynan = Y.clone()
    Ynan[~keep] = float("nan")  # masked rows are not data: NaN is fine there
    lgm_nan = pcv.lgm_from_pyro(model, X, Ynan)
    u = torch.randn(lgm.n, dtype=D)
    assert float(lgm_nan.log_joint(u)) == pytest.approx(float(lgm.log_joint(u)), abs=1e-12)

    # a GP f observed through a mask: the identity design becomes a one-per-row selection (still sparse)
    K = X @ X.T + torch.eye(6, dtype=D)
    counts = torch.tensor([1.0, -1.0, 0.0, 3.0, 2.5, 2.0], dtype=D)  # invalid counts only in masked rows

    def gp(K, y):
        f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(6, dtype=D), K))
        with pyro.plate("data", 6):
            pyro.sample("y", dist.Poisson(torch.exp(f + 0.3)).mask(keep), obs=y)

    lgm = pcv.lgm_from_pyro(gp, K, counts)
    (g,) = lgm.sites
    assert isinstance(g.design, SparseOperator)
    torch.testing.assert_close(g.design.to_dense(), torch.eye(6, dtype=D)[keep])
    torch.testing.assert_close(g.offset, torch.full((4,), 0.3, dtype=D))
    torch.testing.assert_close(g.family.params["y"], counts[keep])


def test_poutine_scale_weights_gaussian_and_bernoulli_sites():
    X, y = _data(q=12, n=2)
    yr = X @ torch.tensor([0.4, -0.3], dtype=D) + 0.2 * torch.randn(12, dtype=D)
    wts = torch.linspace(0.5, 3.0, 12, dtype=D)

    def model(X, y, yr):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", 12), pyro.poutine.scale(scale=wts):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
            pyro.sample("yr", dist.Normal(X @ w + 0.1, 0.3), obs=yr)
        with pyro.poutine.scale(scale=3.0):
            pyro.sample("c", dist.Normal(torch.tensor(0.0, dtype=D), 1.0), obs=torch.tensor(0.4, dtype=D))

    lgm = pcv.lgm_from_pyro(model, X, y, yr)
    by_name = {g.name: g for g in lgm.sites}
    assert by_name["y"].family.name == "weighted_bernoulli_logit"
    torch.testing.assert_close(by_name["y"].weight, wts)
    assert isinstance(by_name["y"].base_family, BernoulliLogit)
    # Gaussian sites stay Gaussian, of variance s^2 / w (every engine fits them unchanged)
    assert isinstance(by_name["yr"].family, Gaussian) and by_name["yr"].weight is None
    torch.testing.assert_close(by_name["yr"].family.params["scale"], 0.3 / wts.sqrt())
    _assert_log_joint_matches(lgm, model, X, y, yr)

    # a Bernoulli likelihood of weight 2 is the data observed twice: same ELBO for every q
    def scaled(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.5).to_event(1))
        with pyro.plate("data", X.shape[0]), pyro.poutine.scale(scale=2.0):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    a = pcv.lgm_from_pyro(scaled, X, y)
    b = pcv.lgm_from_pyro(logistic, torch.cat([X, X]), y=torch.cat([y, y]))
    m, C = torch.tensor([0.3, -0.2], dtype=D), torch.tensor([[0.4, 0.1], [0.1, 0.3]], dtype=D)
    assert float(a.evidence_lower_bound(m, C)) == pytest.approx(float(b.evidence_lower_bound(m, C)), abs=1e-10)
    v = torch.tensor([0.4, 0.3], dtype=D)
    assert float(a.expected_log_joint(m, variance=v)) == pytest.approx(float(b.expected_log_joint(m, variance=v)),
                                                                       abs=1e-10)


def test_deterministic_sites_are_records():
    X, y = _data(q=10, n=2)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.5).to_event(1))
        eta = pyro.deterministic("eta", X @ w)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=eta), obs=y)

    lgm = pcv.lgm_from_pyro(model, X, y=y)
    assert [g.name for g in lgm.sites] == ["y"] and lgm.log_const == 0.0
    _assert_log_joint_matches(lgm, model, X, y=y)


def test_factors_constant_gaussian_and_refused():
    X, _ = _data(q=10, n=2)
    yr = torch.randn(10, dtype=D)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        pyro.factor("lik", dist.Normal(X @ w + b, 0.5).log_prob(y).sum())
        with pyro.plate("data", 10):
            pyro.factor("per_row", dist.Normal(X[:, 0] * w[0] - 0.3, 2.0).log_prob(y))
        pyro.factor("const", torch.tensor(-0.75, dtype=D))

    lgm = pcv.lgm_from_pyro(model, X, yr)
    assert sorted(g.name for g in lgm.sites) == ["lik", "per_row"]
    assert all(isinstance(g.family, Gaussian) for g in lgm.sites)
    _assert_log_joint_matches(lgm, model, X, yr)

    cases = {
        "bernoulli": lambda w: dist.Bernoulli(logits=X @ w).log_prob((yr > 0).to(D)).sum(),
        "convex": lambda w: (w**2).sum(),
        "linear": lambda w: w.sum(),
    }
    for case, why in [("bernoulli", "not quadratic"), ("convex", "convex, not a concave"), ("linear", "linearly")]:
        def bad(X):
            w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
            pyro.factor("f", cases[case](w))

        with pytest.raises(pcv.UnsupportedModelError, match=why) as info:
            pcv.lgm_from_pyro(bad, X)
        assert info.value.site == "f" and "pyro.factor" in str(info.value)


def test_obs_mask_and_unread_gaussian_latents_are_imputed_blocks():
    X, _ = _data(q=9, n=2)
    Xt = torch.randn(4, 2, dtype=D)
    yr = torch.randn(9, dtype=D)
    obs = torch.arange(9) % 3 != 2

    def model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", 9):
            y = pyro.sample("y", dist.Normal((w.unsqueeze(-2) * X).sum(-1) + 0.3, 0.5), obs=y, obs_mask=obs)
        pyro.sample("y_new", dist.Normal(Xt @ w - 1.0, 0.2).to_event(1))  # a predictive draw inside the model
        return y

    lgm = pcv.lgm_from_pyro(model, X, yr)
    assert lgm.layout.names == ["w"]
    assert lgm.model_layout.names == ["w", "y_unobserved", "y_new"]
    imp = {b.name: b for b in lgm.imputed}
    torch.testing.assert_close(imp["y_unobserved"].design.to_dense(), X)
    torch.testing.assert_close(imp["y_unobserved"].offset, torch.full((9,), 0.3, dtype=D))
    torch.testing.assert_close(imp["y_unobserved"].scale, torch.full((9,), 0.5, dtype=D))
    torch.testing.assert_close(imp["y_new"].design.to_dense(), Xt)
    (g,) = lgm.sites
    assert g.name == "y_observed" and g.size == int(obs.sum())

    def observed_only(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w + 0.3, 0.5), obs=y)

    _assert_log_joint_matches(lgm, observed_only, X[obs], yr[obs])
    # the completed posterior is the exact joint of q(w) and the predictive, packed in trace order
    q = pcv.GaussianPosterior(torch.tensor([0.2, -0.4], dtype=D), covariance=torch.tensor([[0.3, 0.1], [0.1, 0.2]],
                                                                                           dtype=D))
    full = lgm.complete_posterior(q)
    assert full.layout.names == ["w", "y_unobserved", "y_new"] and full.n == 2 + 9 + 4
    G = torch.cat([X, Xt])
    torch.testing.assert_close(full.loc, torch.cat([q.loc, X @ q.loc + 0.3, Xt @ q.loc - 1.0]))
    C = full.covariance()
    noise = torch.cat([torch.full((9,), 0.25, dtype=D), torch.full((4,), 0.04, dtype=D)])
    torch.testing.assert_close(C[2:, 2:], G @ q.covariance() @ G.T + torch.diag(noise))
    torch.testing.assert_close(C[2:, :2], G @ q.covariance())
    back = lgm.latent_marginal(full)
    torch.testing.assert_close(back.loc, q.loc)
    torch.testing.assert_close(back.covariance(), q.covariance())

    # a latent Normal that another site reads is the child of an affine Gaussian chain (tests/test_chains.py)
    def read(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        z = pyro.sample("z", dist.Normal(X @ w, 0.5).to_event(1))
        pyro.sample("y", dist.Normal(z, 0.1).to_event(1), obs=y)

    lgm_read = pcv.lgm_from_pyro(read, X, yr)
    assert lgm_read.chain.children == ["z"] and not lgm_read.imputed


def test_mixed_float_dtypes_cast_or_fail_clearly():
    X, y = _data(q=10, n=2)
    lgm32 = pcv.lgm_from_pyro(logistic, X, y=y.float())  # float32 labels, float64 parameters
    lgm64 = pcv.lgm_from_pyro(logistic, X, y=y)
    assert lgm32.dtype == D and lgm32.sites[0].family.y.dtype == D
    u = torch.randn(2, dtype=D)
    assert float(lgm32.log_joint(u)) == pytest.approx(float(lgm64.log_joint(u)), abs=1e-12)
    def fixed64(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    with pytest.raises(pcv.UnsupportedModelError, match="different floating dtypes") as info:
        pcv.lgm_from_pyro(fixed64, X.float(), y=y)  # the model itself cannot multiply float32 by float64
    assert info.value.site == "<model>"


def test_latent_layout_of_several_shapes_matches_the_unconstrained_layout():
    from pyro_convexvb.lgm.extract import unconstrained_layout

    X, _ = _data(q=8, n=3)
    yr = torch.randn(8, dtype=D)

    def model(X, y):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        W = pyro.sample("W", dist.Normal(torch.zeros(3, 2, dtype=D), 1.0).to_event(2))
        with pyro.plate("g", 2):
            z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("data", 8):
            pyro.sample("y", dist.Normal(b + (X @ W).sum(-1) + z.sum(), 1.0), obs=y)

    lgm = pcv.lgm_from_pyro(model, X, yr)
    ref = unconstrained_layout(model, (X, yr), {})
    assert [(b.name, b.shape, b.start) for b in lgm.layout.blocks] == [(b.name, b.shape, b.start) for b in ref.blocks]
    u = torch.arange(lgm.n, dtype=D)
    vals = lgm.layout.unflatten(u)
    torch.testing.assert_close(vals["W"], u[1:7].reshape(3, 2))
    torch.testing.assert_close(lgm.layout.flatten(vals), u)
    _assert_log_joint_matches(lgm, model, X, yr)


def test_full_data_plates_acts_only_inside_its_handler():
    """FullDataPlates is a poutine handler: subsampled plates run on the full data inside it (also nested) and
    Pyro's own subsampling is unchanged outside it."""
    from pyro_convexvb.lgm.extract import full_data_plates

    def sizes():
        with pyro.plate("data", 10, subsample_size=3) as idx:
            return len(idx)

    with full_data_plates():
        assert sizes() == 10
        with full_data_plates():
            assert sizes() == 10
        assert sizes() == 10
    assert sizes() == 3
    tr = pyro.poutine.trace(full_data_plates()(sizes)).get_trace()
    assert tr.nodes["_RETURN"]["value"] == 10


def test_extraction_cache_is_traced_again_when_the_sites_change():
    """A model's extraction_cache keeps its structure trace; when the model's sites change (here with a flag read
    by the model), the extraction traces the structure again instead of using the stale one."""
    X = torch.randn(8, 2, dtype=torch.float64)
    y = torch.randn(8, dtype=torch.float64)

    class Model:
        extraction_cache = {}
        wide = False

        def __call__(self, X, y=None):
            w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.0).to_event(1))
            eta = X @ w
            if self.wide:
                eta = eta + pyro.sample("b", dist.Normal(torch.zeros((), dtype=X.dtype), 1.0))
            with pyro.plate("data", 8):
                pyro.sample("y", dist.Normal(eta, 0.5), obs=y)

    m = Model()
    assert pcv.lgm_from_pyro(m, X, y=y).n == 2 and "structure" in m.extraction_cache
    m.wide = True
    lgm = pcv.lgm_from_pyro(m, X, y=y)
    ref = pcv.lgm_from_pyro(lambda X, y=None: m(X, y), X, y=y)
    assert lgm.n == ref.n == 3
    torch.testing.assert_close(lgm.sites[0].design.to_dense(), ref.sites[0].design.to_dense())


@pytest.mark.parametrize("engine", ["dual_vg", "convex_relaxation"])
def test_a_hyper_latent_fixed_by_pyro_condition_is_a_constant_of_any_family(engine):
    """pyro.condition(model, data={"tau": 0.5}) makes the HalfNormal site observed: it reads no latent, so its log
    density is a constant of the evidence, whatever its family (it was refused as an 'unsupported likelihood'),
    and the bound is the blocked model's plus log p(tau = 0.5)."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(20, 3, generator=g, dtype=D)
    y = (X[:, 0] > 0).to(D)
    tau0 = torch.tensor(0.5, dtype=D)

    def model(X, y=None):
        tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), tau).to_event(1))
        with pyro.plate("data", 20):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    conditioned = pcv.fit(pyro.condition(model, data={"tau": tau0}), X, y=y, engine=engine, progress=False)
    blocked = pcv.fit(pyro.poutine.block(pyro.condition(model, data={"tau": tau0}), hide=["tau"]), X, y=y,
                      engine=engine, progress=False)
    const = float(dist.HalfNormal(torch.tensor(1.0, dtype=D)).log_prob(tau0))
    assert conditioned.log_evidence_bound == pytest.approx(blocked.log_evidence_bound + const, abs=1e-10)
    torch.testing.assert_close(conditioned.posterior.loc, blocked.posterior.loc, rtol=0, atol=1e-10)

    def reads_w(X, y=None):  # a HalfNormal observation that reads a latent stays refused, by name
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), 1.0).to_event(1))
        pyro.sample("s", dist.HalfNormal(w.exp().sum()), obs=tau0)

    with pytest.raises(pcv.UnsupportedModelError, match="site 's'.*unsupported likelihood HalfNormal"):
        pcv.fit(reads_w, X, engine=engine, progress=False)


def test_site_families_and_moments_of_the_wrong_shape_are_refused():
    """A column of data (q, 1), as a scikit-learn 2-D target, broadcast y - eta to (q, q): log_joint and the ELBO
    were silently wrong (-59.55 for -11.80). Moments of the wrong shape, a non-symmetric cov or negative variances
    gave numbers that are no expectation."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(6, 3, generator=g, dtype=D)
    y = torch.randn(6, generator=g, dtype=D)
    with pytest.raises(ValueError, match=r"y: a gaussian site family takes one value per site, shape \(q,\); got "
                                         r"shape \(6, 1\)"):
        Gaussian(y[:, None], torch.ones(6, dtype=D))
    with pytest.raises(ValueError, match=r"y: a bernoulli_logit site family .* \(6, 1\)"):
        BernoulliLogit((y[:, None] > 0).to(D))
    lgm = pcv.LatentGaussianModel.from_design(X, Gaussian(y, torch.ones(6, dtype=D)))
    m, C = torch.zeros(3, dtype=D), torch.eye(3, dtype=D)
    ok = float(lgm.evidence_lower_bound(m, C))
    assert math.isfinite(ok)
    bad_cov = C.clone()
    bad_cov[0, 1] = 0.5
    for kwargs, match in (({"loc": m[:, None], "cov": C}, r"loc: expected shape \(3,\)"),
                          ({"loc": m, "cov": bad_cov}, "cov: must be symmetric"),
                          ({"loc": m, "variance": torch.tensor([1.0, -1.0, 1.0], dtype=D)}, "variance: must be non"),
                          ({"loc": m.float(), "cov": C}, "loc: dtype torch.float32 differs")):
        with pytest.raises((ValueError, TypeError), match=match):
            lgm.evidence_lower_bound(**kwargs)
    with pytest.raises(ValueError, match=r"u: expected shape \(3,\), got \(3, 1\)"):  # it returned a (3, 3) tensor
        lgm.log_joint(m[:, None])


def test_saturated_probs_say_to_write_logits():
    """Bernoulli(probs=sigmoid(X @ w)) with covariates of scale 5: torch recovers logits from clamped probabilities
    only within about +-36, so the extraction's random points see a nonlinear predictor; the refusal said only 'not
    an affine function', of a predictor the user wrote affine."""
    g = torch.Generator().manual_seed(0)
    X = 5.0 * torch.randn(30, 4, generator=g, dtype=D)
    y = (X[:, 0] > 0).to(D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(4, dtype=D), 1.0).to_event(1))
        with pyro.plate("data", 30):
            pyro.sample("y", dist.Bernoulli(probs=torch.sigmoid(X @ w)), obs=y)

    with pytest.raises(pcv.UnsupportedModelError, match="site 'y': .*not an affine.*probs=.*write logits="):
        pcv.lgm_from_pyro(model, X, y=y)


def test_hand_built_families_refuse_data_outside_their_support():
    """Labels {1, 2} in a hand-built BernoulliLogit were fitted by convex_relaxation as a likelihood that is no
    Bernoulli's, with converged=True; negative Poisson counts failed deep in dual_vg with advice about covariates;
    a Categorical label beyond its classes raised a bare IndexError."""
    from pyro_convexvb.lgm.families import Categorical

    with pytest.raises(ValueError, match=r"y: expected labels in \{0, 1\}.*got \[2.0"):
        BernoulliLogit(torch.tensor([1.0, 2.0, 1.0], dtype=D))
    with pytest.raises(ValueError, match=r"y: expected non-negative counts, got \[-1.0\]"):
        Poisson(torch.tensor([3.0, -1.0], dtype=D))
    with pytest.raises(ValueError, match=r"y: expected class labels in 0 .. 2, got \[5.0\]"):
        Categorical(torch.tensor([0.0, 5.0], dtype=D), 3)
    assert len(BernoulliLogit(torch.tensor([0.0, 0.25, 1.0], dtype=D))) == 3  # a binomial rate is fine


def test_pcv_linear_converts_integer_and_lower_precision_designs():
    """A count matrix (int64 SciPy CSR, as scikit-learn's CountVectorizer gives) or a float32 one failed with torch's
    bare dtype error; they are converted exactly to the latent's dtype, and a design of a higher precision than the
    latent is refused by name."""
    import scipy.sparse as sp
    counts = sp.csr_matrix(np.array([[1, 0, 2], [0, 3, 0]], dtype=np.int64))
    w = torch.tensor([0.5, -1.0, 2.0], dtype=D)
    ref = torch.tensor([4.5, -3.0], dtype=D)
    for X in (counts, counts.astype(np.float32), torch.tensor(counts.toarray(), dtype=torch.int64)):
        out = pcv.linear(X, w)
        assert out.dtype == D
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with pytest.raises(TypeError, match="pcv.linear: the design is torch.float64 and the latent torch.float32"):
        pcv.linear(torch.ones(2, 3, dtype=D), w.float())
    with pytest.raises(TypeError, match="pcv.linear: the design is torch.complex128"):  # not cast to real
        pcv.linear(torch.ones(2, 3, dtype=torch.complex128), w)
    with pytest.raises(TypeError, match="pcv.linear: u: expected a floating-point torch tensor"):
        pcv.linear(torch.ones(2, 3, dtype=D), np.ones(3))


def test_from_design_and_families_refuse_improper_parameters():
    """prior_scale 0 or negative gave a NaN log joint and an engine error about the conjugate's domain; a Laplace
    scale of 0 NaN; Binomial counts above the total -inf; a float64 family on a float32 design a bare dtype error."""
    from pyro_convexvb.lgm.families import Binomial

    X = torch.randn(4, 2, generator=torch.Generator().manual_seed(0), dtype=D)
    y = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=D)
    for bad in (0.0, -2.0, float("nan")):
        with pytest.raises(ValueError, match="prior_scale: expected positive finite"):
            pcv.LatentGaussianModel.from_design(X, BernoulliLogit(y), prior_scale=bad)
    with pytest.raises(TypeError, match="family: its 'y' is torch.float64 and the design torch.float32"):
        pcv.LatentGaussianModel.from_design(X.float(), BernoulliLogit(y))
    with pytest.raises(ValueError, match="scale: expected positive finite scales"):
        Laplace(torch.tensor([1.0, 0.0], dtype=D))
    with pytest.raises(ValueError, match=r"y: expected counts in \[0, total_count\], got \[6.0\]"):
        Binomial(torch.tensor([2.0, 6.0], dtype=D), torch.tensor([5.0, 5.0], dtype=D))


@pytest.mark.parametrize("engine", ["convex_relaxation", "dual_vg"])
def test_a_prior_variance_that_underflows_is_refused_naming_the_prior(engine):
    # a scale of 1e-160 squares to a subnormal 1e-320: convex_relaxation returned a NaN posterior with converged=True
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(30, 2, generator=g, dtype=torch.float64), torch.randn(30, generator=g, dtype=torch.float64)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64),
                                         torch.tensor([1.0, 1e-160], dtype=torch.float64)).to_event(1))
        with pyro.plate("d", 30):
            pyro.sample("y", dist.Normal(X @ w, 0.4), obs=y)

    with pytest.raises(pcv.NotPositiveDefiniteError, match="prior of 'w': variance 1e-320 at coordinate 1"):
        pcv.fit(model, engine=engine, progress=False)


def test_completing_or_marginalising_something_that_is_no_posterior_is_refused():
    lgm = pcv.LatentGaussianModel.from_design(torch.eye(2, dtype=torch.float64),
                                              Gaussian(torch.zeros(2, dtype=torch.float64),
                                                       torch.ones(2, dtype=torch.float64)))
    for method in (lgm.complete_posterior, lgm.latent_marginal):
        with pytest.raises(TypeError, match="posterior: expected a pyro_convexvb posterior .*got Tensor"):
            method(torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("family", ["bernoulli", "categorical"])
def test_observed_data_of_another_shape_than_the_site_name_the_site(family):
    X = torch.randn(12, 2, dtype=torch.float64)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3, dtype=torch.float64), 1.0).to_event(2))
        with pyro.plate("n", 12):
            if family == "bernoulli":
                pyro.sample("y", dist.Bernoulli(logits=X @ w[:, 0]), obs=torch.ones(10, dtype=torch.float64))
            else:
                pyro.sample("y", dist.Categorical(logits=X @ w), obs=torch.zeros(10, dtype=torch.long))

    with pytest.raises(ValueError, match=r"site 'y': its observed value has shape \(10,\), which does not broadcast"):
        pcv.fit(model, engine="dual_vg", progress=False)


@pytest.mark.parametrize("engine", ["dual_vg", "laplace", "nuts"])
def test_a_latent_site_that_cannot_be_sampled_is_refused_by_name(engine):
    """An ImproperUniform prior: Pyro cannot draw it, and every engine starts from prior draws; the refusal names
    the site (it was Pyro's bare NotImplementedError)."""
    from torch.distributions import constraints

    X = torch.randn(20, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def improper(y=None):
        tau = pyro.sample("tau", dist.ImproperUniform(constraints.positive, (), ()))
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), tau).to_event(1))
        with pyro.plate("data", 20):
            pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    with pytest.raises(pcv.UnsupportedModelError, match=r"site 'tau': its distribution cannot be sampled "
                                                        r"\(ImproperUniform does not support sampling\)"):
        pcv.fit(improper, y=X @ torch.tensor([1.0, 0.6], dtype=torch.float64), engine=engine, progress=False)


def test_the_entropy_of_a_singular_gaussian_is_minus_infinity_not_a_bare_error():
    """svi_automvn's bound at a guide early in its fit (a scale_tril with a vanishing diagonal entry) refactored
    ``L L^T`` and died with torch's bare 'not positive-definite'; the entropy of such a Gaussian is -inf."""
    import math

    from pyro_convexvb.lgm.model import _gaussian_entropy

    A = torch.tensor([[2.0, 0.3], [0.3, 1.0]], dtype=torch.float64)
    exact = 0.5 * 2 * (1 + math.log(2 * math.pi)) + 0.5 * float(torch.logdet(A))
    assert float(_gaussian_entropy(A)) == pytest.approx(exact, abs=1e-14)
    L = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    assert float(_gaussian_entropy(L @ L.T)) == -math.inf
