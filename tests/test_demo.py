"""The demo's NUTS reference model: the preconditioned parametrisation has the whitened model's posterior."""
import math

import pyro
import pyro.poutine as poutine
import pytest
import torch

from pyro_convexvb.cli import preconditioned_gp_classification_model, preconditioner, whitened_gp_classification_model
from pyro_convexvb.posterior.gaussian import GaussianPosterior

# our own defaults must reach their tolerances: an unconverged fit here is a failure, not a warning
pytestmark = pytest.mark.filterwarnings("error::pyro_convexvb.ConvergenceWarning")


def _log_joint(model, args, site, value, y):
    cond = poutine.condition(model, data={site: value})
    tr = poutine.trace(cond).get_trace(*args, y=y)
    return tr.log_prob_sum()


def _small_gp(seed, n):
    """A small GP classification problem and a Gaussian over ``f`` (not the posterior: any one will do)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, dtype=torch.float64, generator=g)
    K = 2.0 * torch.exp(-0.5 * torch.cdist(X, X) ** 2) + 1e-6 * torch.eye(n, dtype=torch.float64)
    L = torch.linalg.cholesky(K)
    y = (torch.rand(n, generator=g) < 0.5).double()
    A = torch.randn(n, n, dtype=torch.float64, generator=g)
    q = GaussianPosterior(torch.randn(n, dtype=torch.float64, generator=g), covariance=0.3 * K + 0.1 * A @ A.T)
    return g, n, K, L, y, q


def test_preconditioned_model_is_the_whitened_model_in_other_coordinates():
    g, n, K, L, y, q = _small_gp(0, 6)
    loc_v, C, shift, M = preconditioner(L, q)
    # the map reproduces q: v = loc_v + C z has mean L^{-1} m and covariance L^{-1} V L^{-T}
    assert torch.allclose(L @ loc_v, q.loc, atol=1e-10)
    assert torch.allclose(L @ C @ C.T @ L.T, q.covariance(), atol=1e-8)
    assert torch.allclose(M, L @ C) and torch.allclose(shift, q.loc)
    # the log joint in z equals the whitened model's at v(z): the density of z is proportional to that of v
    # (the affine map's Jacobian is a constant), so the posteriors correspond exactly
    diffs = []
    for _ in range(4):
        z = torch.randn(n, dtype=torch.float64, generator=g)
        v = loc_v + C @ z
        with pyro.validation_enabled():
            a = _log_joint(preconditioned_gp_classification_model, (loc_v, C, shift, M), "z", z, y)
            b = _log_joint(whitened_gp_classification_model, (L,), "v", v, y)
        diffs.append(float(a - b))
    assert max(abs(d) for d in diffs) < 1e-10


def test_reference_potential_is_the_preconditioned_models_negative_log_joint_with_its_gradient():
    from pyro_convexvb.cli import preconditioned_potential

    g, n, K, L, y, q = _small_gp(1, 7)
    args = preconditioner(L, q)
    U = preconditioned_potential(*args, y)
    diffs = []
    for _ in range(3):
        z = torch.randn(n, dtype=torch.float64, generator=g).requires_grad_(True)
        u = U({"z": z})
        (gz,) = torch.autograd.grad(u, z)
        zz = z.detach().clone().requires_grad_(True)
        lj = _log_joint(preconditioned_gp_classification_model, args, "z", zz, y)
        (gref,) = torch.autograd.grad(-lj, zz)
        diffs.append(float((u + lj).detach()))
        assert torch.allclose(gz, gref, atol=1e-10)
    # equal up to the constant of the standard normal's normaliser
    assert max(diffs) - min(diffs) < 1e-10
    assert diffs[0] == pytest.approx(-0.5 * n * math.log(2 * math.pi), abs=1e-9)


def test_demo_probabilities_of_a_mixture_posterior_average_its_components():
    """The demo's test probabilities under a ``diag_mixture`` posterior (a mixture of diagonal Gaussians over the
    training latents): the logistic link's expectation under each component's latent predictive, averaged, against
    Monte Carlo through draws of the posterior (the probabilities of the mixture's moment-matched Gaussian were used
    before: further off than the Monte Carlo error here)."""
    from pyro_convexvb.cli import _predictive_probs
    from pyro_convexvb.gp.predict import gp_latent_predictive
    from pyro_convexvb.lgm.sites import gaussian_expectation
    from pyro_convexvb.posterior.mixture import DiagMixturePosterior

    g = torch.Generator().manual_seed(4)
    X = torch.randn(30, 2, dtype=torch.float64, generator=g)
    Xs = 1.5 * torch.randn(8, 2, dtype=torch.float64, generator=g)
    k = lambda a, b: 4.0 * torch.exp(-0.5 * torch.cdist(a, b) ** 2 / 0.25)  # noqa: E731
    K = k(X, X) + 1e-2 * torch.eye(30, dtype=torch.float64)  # well conditioned: A = K^{-1} K_n* stays moderate
    Kx, kd = k(Xs, X), torch.full((8,), 4.0, dtype=torch.float64)
    q = DiagMixturePosterior(3.0 * torch.randn(4, 30, dtype=torch.float64, generator=g),
                             0.2 + torch.rand(4, 30, dtype=torch.float64, generator=g))
    p = _predictive_probs(q, K, Kx, kd)
    # Monte Carlo: f ~ q, f* | f ~ N(A f, k** - diag(A K A^T)), E[sigmoid(f*)]
    f = q.sample(100_000, generator=torch.Generator().manual_seed(0)).reshape(-1, 30)
    A = torch.linalg.solve(K, Kx.T).T
    cond_var = kd - (A * Kx).sum(1)
    mean = f @ A.T
    ref = gaussian_expectation(torch.sigmoid, mean, cond_var.expand_as(mean), 64).mean(0)
    se = gaussian_expectation(torch.sigmoid, mean, cond_var.expand_as(mean), 64).std(0) / math.sqrt(f.shape[0])
    assert float(((p - ref).abs() / se).max()) < 4.0
    mm = gaussian_expectation(torch.sigmoid, *gp_latent_predictive(K, Kx, kd, q), 64)
    assert float(((mm - ref).abs() / se).max()) > 10.0  # the moment-matched answer is off (29 standard errors)
