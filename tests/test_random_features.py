"""Random Fourier features from GPyTorch kernels (Steinberg et al. 2017 §1.4) against GPyTorch's exact kernel matrices."""
import math

import pyro
import pytest
import torch
from gpytorch.kernels import (
    LinearKernel,
    MaternKernel,
    PeriodicKernel,
    RBFKernel,
    RQKernel,
    ScaleKernel,
    SpectralMixtureKernel,
)

import pyro_convexvb as pcv
from pyro_convexvb.blr import blr_posterior
from pyro_convexvb.gp.random_features import RandomFeatureGP, RandomFourierFeatures, orthogonal_gaussian
from pyro_convexvb.posterior.gaussian import GaussianPosterior

# our own defaults must reach their tolerances: an unconverged fit here is a failure, not a warning
pytestmark = pytest.mark.filterwarnings("error::pyro_convexvb.ConvergenceWarning")

DT = torch.float64


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _sm():
    k = SpectralMixtureKernel(num_mixtures=3, ard_num_dims=2).double()
    k.mixture_means = torch.tensor([[[0.1, 0.3]], [[0.5, 0.2]], [[0.05, 0.0]]], dtype=DT)
    k.mixture_scales = torch.tensor([[[0.3, 0.2]], [[0.4, 0.5]], [[0.2, 0.3]]], dtype=DT)
    k.mixture_weights = torch.tensor([0.5, 0.3, 0.2], dtype=DT)
    return k


def _rq():
    k = RQKernel().double()
    k.alpha = 0.7
    k.lengthscale = 0.8
    return k


def _scale_ard():
    k = ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=2)).double()
    k.base_kernel.lengthscale = torch.tensor([[0.5, 2.0]], dtype=DT)
    k.outputscale = 2.0
    return k


def _scale_rbf_ard():
    k = ScaleKernel(RBFKernel(ard_num_dims=2)).double()
    k.base_kernel.lengthscale = torch.tensor([[0.3, 1.5]], dtype=DT)
    k.outputscale = 0.5
    return k


KERNELS = {
    "rbf": lambda: RBFKernel().double(),
    "matern12": lambda: MaternKernel(nu=0.5).double(),
    "matern32": lambda: MaternKernel(nu=1.5).double(),
    "matern52": lambda: MaternKernel(nu=2.5).double(),
    "rq": _rq,
    "spectral_mixture": _sm,
    "scale_matern52_ard": _scale_ard,
    "scale_rbf_ard": _scale_rbf_ard,
    "product_active_dims": lambda: (RBFKernel(active_dims=[0]) * MaternKernel(nu=1.5, active_dims=[1])).double(),
    "sum": lambda: (RBFKernel() + ScaleKernel(MaternKernel(nu=0.5))).double(),
}


def _rel_err(k, x, D, seeds, orthogonal=False):
    K = k(x).to_dense().detach()
    e = 0.0
    for s in range(seeds):
        f = RandomFourierFeatures(k, D, seed=s, orthogonal=orthogonal)
        with torch.no_grad():
            e += float((f.kernel_matrix(x) - K).norm() / K.norm()) ** 2
    return math.sqrt(e / seeds)


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matrix_converges_at_root_D_rate(name):
    torch.manual_seed(0)
    x = torch.randn(25, 2, dtype=DT)
    k = KERNELS[name]()
    e_small, e_large = _rel_err(k, x, 64, 8), _rel_err(k, x, 4096, 8)
    slope = (math.log(e_large) - math.log(e_small)) / math.log(64)
    assert -0.65 < slope < -0.35, (name, e_small, e_large, slope)
    assert e_large < 0.06


def test_orthogonal_features_are_unbiased_and_more_accurate():
    torch.manual_seed(1)
    x = 0.5 * torch.randn(25, 4, dtype=DT)
    k = RBFKernel().double()
    K = k(x).to_dense().detach()
    mean = torch.zeros_like(K)
    for s in range(200):
        mean += RandomFourierFeatures(k, 8, seed=s, orthogonal=True).kernel_matrix(x).detach() / 200
    # unbiased: per-entry MC standard error ~0.018 here
    assert float((mean - K).abs().max()) < 0.07 and abs(float((mean - K).mean())) < 0.005
    x8 = torch.randn(25, 8, dtype=DT) * 0.25
    assert _rel_err(k, x8, 16, 40, orthogonal=True) < 0.8 * _rel_err(k, x8, 16, 40)  # measured ratio ~0.65
    W = orthogonal_gaussian(8, 4, torch.Generator().manual_seed(0))
    G = W[:4] @ W[:4].T
    assert torch.allclose(G - torch.diag(torch.diagonal(G)), torch.zeros(4, 4, dtype=DT), atol=1e-12)


@pytest.mark.parametrize("name,param", [
    ("scale_rbf_ard", "base_kernel.raw_lengthscale"),
    ("scale_rbf_ard", "raw_outputscale"),
    ("matern32", "raw_lengthscale"),
    ("rq", "raw_alpha"),
    ("spectral_mixture", "raw_mixture_weights"),
    ("spectral_mixture", "raw_mixture_means"),
    ("spectral_mixture", "raw_mixture_scales"),
])
def test_gradients_reach_kernel_hyperparameters(name, param):
    """Autograd through the feature map matches central finite differences (fixed random draws)."""
    torch.manual_seed(2)
    x = torch.randn(6, 2, dtype=DT)
    k = KERNELS[name]()
    f = RandomFourierFeatures(k, 32, seed=0)
    p = dict(k.named_parameters())[param]
    probe = torch.randn(6, 6, dtype=DT)

    def fn():
        return (f.kernel_matrix(x) * probe).sum()

    (g,) = torch.autograd.grad(fn(), p)
    assert g is not None and g.abs().max() > 0
    num = torch.zeros_like(p)
    h = 1e-6
    with torch.no_grad():
        for i in range(p.numel()):
            p.view(-1)[i] += h
            up = fn()
            p.view(-1)[i] -= 2 * h
            dn = fn()
            p.view(-1)[i] += h
            num.view(-1)[i] = (up - dn) / (2 * h)
    # RQ: torch's implicit Gamma reparameterisation gradient is itself approximate (~1e-3 relative)
    assert torch.allclose(g, num, rtol=1e-2 if param == "raw_alpha" else 1e-5, atol=1e-7)


def test_expected_gradient_matches_kernel_gradient():
    """d/d lengthscale of the random-feature kernel approximates d/d lengthscale of the exact kernel."""
    x = torch.randn(10, 2, dtype=DT, generator=torch.Generator().manual_seed(3))
    k = ScaleKernel(RBFKernel()).double()
    p = k.base_kernel.raw_lengthscale
    (g_exact,) = torch.autograd.grad(k(x).to_dense().sum(), p)
    g_rff = sum(torch.autograd.grad(RandomFourierFeatures(k, 2000, seed=s).kernel_matrix(x).sum(), p)[0]
                for s in range(5)) / 5
    assert torch.allclose(g_rff, g_exact, rtol=0.1)


def test_unsupported_kernels_raise_clear_errors():
    with pytest.raises(TypeError, match="LinearKernel"):
        RandomFourierFeatures(LinearKernel(), 10)
    with pytest.raises(TypeError, match="PeriodicKernel"):
        RandomFourierFeatures(ScaleKernel(PeriodicKernel()), 10)
    with pytest.raises(TypeError, match="GPyTorch kernel"):
        RandomFourierFeatures(lambda a, b: a @ b.T, 10)
    with pytest.raises(ValueError, match="batched"):
        RandomFourierFeatures(RBFKernel(batch_shape=torch.Size([2])), 10)(torch.randn(3, 1))
    with pytest.raises(ValueError, match="lengthscales"):
        RandomFourierFeatures(RBFKernel(ard_num_dims=3), 10)(torch.randn(3, 2))
    with pytest.raises(ValueError, match="num_features"):
        RandomFourierFeatures(RBFKernel(), 0)
    f = RandomFourierFeatures(RBFKernel(), 10)
    with pytest.raises(ValueError, match="NaN"):
        f(torch.tensor([[float("nan")]]))
    f(torch.randn(3, 2))
    with pytest.raises(ValueError, match="columns"):
        f(torch.randn(3, 4))


def test_dtype_follows_inputs():
    k = MaternKernel(nu=1.5)  # float32 parameters
    f = RandomFourierFeatures(k, 16)
    assert f(torch.randn(4, 2)).dtype == torch.float32
    assert f(torch.randn(4, 2, dtype=DT)).dtype == DT
    assert f(torch.randn(4, 2)).shape == (4, 32) and f.output_dim == 32


# ------------------------------------------------------------------------------- the Pyro module
def test_random_feature_gp_is_a_latent_gaussian_model():
    g = torch.Generator().manual_seed(4)
    X = torch.rand(40, 1, generator=g, dtype=DT) * 4 - 2
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(40, generator=g, dtype=DT)
    k = ScaleKernel(MaternKernel(nu=2.5)).double()
    gp = RandomFeatureGP(k, num_features=30, noise_scale=0.1)
    lgm = pcv.lgm_from_pyro(gp, X, y=y)
    Phi = gp.features(X).detach()
    assert lgm.n == 60 and torch.allclose(lgm.sites[0].design.to_dense(), Phi)
    assert torch.allclose(lgm.dense_prior_cov(), torch.eye(60, dtype=DT))
    # exact posterior = Bayesian linear regression on Phi; the module's predictions use it
    m, C = blr_posterior(Phi, y, 0.01, 1.0)
    q = GaussianPosterior(m, covariance=C)
    assert abs(float(lgm.evidence_lower_bound(m, C)) -
               float(torch.distributions.MultivariateNormal(torch.zeros(40, dtype=DT),
                                                           0.01 * torch.eye(40, dtype=DT) + Phi @ Phi.T).log_prob(y))) < 1e-8
    Xs = torch.linspace(-2, 2, 7, dtype=DT).unsqueeze(-1)
    mean, std = gp.predict(Xs, q, return_std=True)
    Ps = gp.features(Xs).detach()
    assert torch.allclose(mean, Ps @ m)
    assert torch.allclose(std, (((Ps @ C) * Ps).sum(-1) + 0.01).sqrt())


def test_random_feature_gp_vectorises_and_subsamples():
    X = torch.randn(20, 2, dtype=DT)
    y = (X[:, 0] > 0).to(DT)
    gp = RandomFeatureGP(RBFKernel().double(), num_features=8, likelihood="bernoulli", subsample_size=5)
    with pyro.plate("particles", 3, dim=-2):
        tr = pyro.poutine.trace(gp).get_trace(X, y)
    assert tr.nodes["y"]["fn"].batch_shape == (3, 5)
    assert tr.nodes["y"]["scale"] == 4.0
    with pytest.raises(ValueError, match="labels"):
        gp(X, y + 2)


def test_learn_kernel_registers_pyro_params():
    pyro.clear_param_store()
    X = torch.randn(10, 1, dtype=DT)
    gp = RandomFeatureGP(RBFKernel().double(), num_features=4, learn_kernel=True)
    tr = pyro.poutine.trace(gp).get_trace(X, torch.zeros(10, dtype=DT))
    # one name per hyperparameter: PyroModule's own registration of the feature map would add "features$$$..."
    params = [n for n, s in tr.nodes.items() if s["type"] == "param"]
    assert params == ["rff_kernel$$$kernel.raw_lengthscale"]
    assert list(pyro.get_param_store().keys()) == params
    assert tr.nodes["y"]["fn"].loc.requires_grad
    pyro.clear_param_store()


def test_fixed_kernel_is_neither_a_param_nor_learned():
    """With ``learn_kernel=False`` (the default) the model has no ``pyro.param`` sites, so an engine's type-II
    learning has nothing to learn and the user's GPyTorch kernel is left as it was."""
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(5)
    X = torch.randn(50, 2, generator=g, dtype=DT)
    y = (X[:, 0] > 0).to(DT)
    k = ScaleKernel(RBFKernel()).double()
    before = [p.detach().clone() for p in k.parameters()]
    gp = RandomFeatureGP(k, num_features=10, likelihood="bernoulli")
    tr = pyro.poutine.trace(gp).get_trace(X, y)
    assert [n for n, s in tr.nodes.items() if s["type"] == "param"] == []
    res = pcv.fit(gp, X, y=y, engine="dual_vg", progress=False)
    assert res.converged
    assert len(pyro.get_param_store().keys()) == 0
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, k.parameters()))
    # the fit is the dual_vg fit of the extracted LGM with the kernel as given
    ref = pcv.fit(pcv.lgm_from_pyro(gp, X, y=y), engine="dual_vg", progress=False)
    assert torch.allclose(res.posterior.loc, ref.posterior.loc, atol=1e-8)


def test_fixed_kernel_design_follows_every_hyperparameter_change():
    """The cached design of a fixed kernel was keyed on the sum of each hyperparameter tensor: swapping two ARD
    lengthscales (0.5, 2) -> (2, 0.5) kept the sum, and the model (and every engine's extraction of it) silently used
    the old features. The design is compared with Eq. (35) of Steinberg et al. 2017 written out from the fixed
    standard-normal draws, ``sqrt(1/D) [cos(X S^T), sin(X S^T)]`` with ``S = eps / ell``."""
    k = RBFKernel(ard_num_dims=2).double()
    k.lengthscale = torch.tensor([[0.5, 2.0]], dtype=DT)
    D = 20
    gp = RandomFeatureGP(k, num_features=D, noise_scale=0.1)
    X = torch.randn(7, 2, dtype=DT, generator=torch.Generator().manual_seed(6))
    y = torch.sin(X[:, 0])
    lgm0 = pcv.lgm_from_pyro(gp, X, y=y)
    eps = gp.features.spectral.eps

    def eq35(ell):
        proj = X @ (eps / torch.tensor(ell, dtype=DT)).T
        return torch.cat([proj.cos(), proj.sin()], -1) / math.sqrt(D)

    torch.testing.assert_close(lgm0.sites[0].design.to_dense(), eq35([0.5, 2.0]), rtol=0, atol=1e-14)
    k.lengthscale = torch.tensor([[2.0, 0.5]], dtype=DT)  # same sum of raw values
    lgm1 = pcv.lgm_from_pyro(gp, X, y=y)
    torch.testing.assert_close(lgm1.sites[0].design.to_dense(), eq35([2.0, 0.5]), rtol=0, atol=1e-14)
    assert float((eq35([2.0, 0.5]) - eq35([0.5, 2.0])).abs().max()) > 0.1
    torch.testing.assert_close(gp.design(X), eq35([2.0, 0.5]), rtol=0, atol=1e-14)
    assert gp.design(X) is gp.design(X)  # unchanged hyperparameters and X: the cached design


def test_scale_kernel_of_a_kernel_with_active_dims_converges_to_it():
    """GPyTorch's ScaleKernel copies its base kernel's active_dims onto itself, so ``ScaleKernel(RBFKernel(
    active_dims=[2]))`` was refused ("put active_dims on the base kernel", which it was). It is the kernel on column 2
    only; the features converge to GPyTorch's kernel matrix at the root-D rate. A ScaleKernel's own active_dims over
    a base kernel without them (GPyTorch would select those columns) is still refused, naming both."""
    torch.manual_seed(7)
    x = torch.randn(20, 3, dtype=DT)
    k = (ScaleKernel(RBFKernel(active_dims=[2])) + ScaleKernel(MaternKernel(nu=2.5, active_dims=[0, 1]))).double()
    k.kernels[0].outputscale = 0.3
    k.kernels[0].base_kernel.lengthscale = 0.5
    e_small, e_large = _rel_err(k, x, 64, 8), _rel_err(k, x, 4096, 8)
    slope = (math.log(e_large) - math.log(e_small)) / math.log(64)
    assert -0.65 < slope < -0.35 and e_large < 0.05, (e_small, e_large, slope)
    S, _ = RandomFourierFeatures(k, 10, input_dim=3, seed=0).frequencies()
    assert torch.equal(S[:5, :2], torch.zeros(5, 2, dtype=DT)) and bool((S[:5, 2] != 0).all())  # column 2 only
    with pytest.raises(ValueError, match=r"ScaleKernel active_dims \[1\] differ from its base kernel's \(None\)"):
        RandomFourierFeatures(ScaleKernel(RBFKernel(), active_dims=[1]), 10)(x)


def test_predictions_take_float32_queries_and_large_stored_covariances(monkeypatch):
    """Float32 query inputs of a float64 fit are promoted (a raw addmv dtype error before); a dense stored covariance
    above MAX_DENSE still gives marginals (covariance() refused n > 10,000 although the matrix was stored)."""
    import pyro_convexvb.posterior.gaussian as gaussian

    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 2, generator=g, dtype=torch.float64)
    y = (X[:, 0] > 0).double()
    gp = RandomFeatureGP(RBFKernel().double(), num_features=10, likelihood="bernoulli")
    res = pcv.fit(gp, X, y=y, engine="dual_vg", options={"form": "site"},
                  progress=False)  # a dense covariance posterior
    ref = gp.predict(X[:5], res.posterior)
    assert torch.allclose(gp.predict(X[:5].float(), res.posterior), ref, atol=1e-6)
    monkeypatch.setattr(gaussian, "MAX_DENSE", 5)
    assert res.posterior.kind == "covariance"
    torch.testing.assert_close(gp.predict(X[:5], res.posterior), ref, rtol=1e-12, atol=1e-12)
