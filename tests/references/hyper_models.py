"""Hierarchical models with hyper-latents, shared by the tests and by ``generate.py`` (long NUTS references).

Every builder returns ``(model, args, kwargs)`` with data drawn from a fixed seed, in float64.
"""
import math

import pyro
import pyro.distributions as dist
import torch

D = torch.float64


def logistic_halfcauchy():
    """Logistic regression ``w ~ N(0, tau^2 I)``, ``tau ~ HalfCauchy(1)``: 80 rows, 4 features."""
    g = torch.Generator().manual_seed(11)
    X = torch.randn(80, 4, generator=g, dtype=D)
    w = torch.tensor([1.5, -1.0, 0.5, 0.0], dtype=D)
    y = (torch.rand(80, generator=g, dtype=D) < torch.sigmoid(X @ w)).to(D)

    def model(X, y=None):
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(1.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), tau).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X,), {"y": y}


def gp_lengthscale():
    """GP classification on 1-D inputs with an RBF lengthscale ``ell ~ LogNormal(0, 0.5)`` (outputscale 4)."""
    g = torch.Generator().manual_seed(12)
    x = torch.sort(torch.rand(40, generator=g, dtype=D) * 6 - 3).values
    f = torch.sin(1.5 * x) * 2
    y = (torch.rand(40, generator=g, dtype=D) < torch.sigmoid(f)).to(D)

    def model(x, y=None):
        ell = pyro.sample("ell", dist.LogNormal(torch.tensor(0.0, dtype=D), torch.tensor(0.5, dtype=D)))
        K = 4.0 * torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / ell**2) + 1e-6 * torch.eye(x.shape[0], dtype=D)
        f = pyro.sample("f", dist.MultivariateNormal(torch.zeros(x.shape[0], dtype=D), covariance_matrix=K))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

    return model, (x,), {"y": y}


def linear_noise_and_scale():
    """Linear regression with two hyper-latents: prior scale ``tau ~ HalfCauchy(1)`` and noise ``sigma ~ HalfNormal(1)``.

    Given ``(tau, sigma)`` the model is Gaussian, so ``log p(y | tau, sigma)`` is exact and the hyper-posterior
    has a 2-D quadrature reference.
    """
    g = torch.Generator().manual_seed(13)
    X = torch.randn(25, 3, generator=g, dtype=D)
    y = X @ torch.tensor([0.8, -0.4, 0.2], dtype=D) + 0.4 * torch.randn(25, generator=g, dtype=D)

    def model(X, y=None):
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(1.0, dtype=D)))
        sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=D), tau).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, sigma), obs=y)

    return model, (X,), {"y": y}


def linear_noise_exact_log_post(X, y, tau, sigma):
    """``log p(y | tau, sigma) + log p(tau) + log p(sigma)`` of :func:`linear_noise_and_scale` (exact)."""
    n = X.shape[0]
    C = tau**2 * X @ X.T + sigma**2 * torch.eye(n, dtype=D)
    return (dist.MultivariateNormal(torch.zeros(n, dtype=D), C).log_prob(y)
            + dist.HalfCauchy(torch.tensor(1.0, dtype=D)).log_prob(torch.as_tensor(tau, dtype=D))
            + dist.HalfNormal(torch.tensor(1.0, dtype=D)).log_prob(torch.as_tensor(sigma, dtype=D)))


#: name -> builder of the models with NUTS references in ``hyper_nuts.json``
NUTS_REFERENCES = {"logistic_halfcauchy": logistic_halfcauchy, "gp_lengthscale": gp_lengthscale}


def _gp_whitened(x, y=None):
    """``gp_lengthscale`` in whitened coordinates ``f = L(ell) v``, ``v ~ N(0, I)``: the same posterior, in
    coordinates NUTS mixes well in (in f-space the GP prior is badly conditioned)."""
    ell = pyro.sample("ell", dist.LogNormal(torch.tensor(0.0, dtype=D), torch.tensor(0.5, dtype=D)))
    v = pyro.sample("v", dist.Normal(torch.zeros(x.shape[0], dtype=D), 1.0).to_event(1))
    f = _gp_cholesky(x, ell) @ v
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=f), obs=y)


def _gp_cholesky(x, ell):
    K = 4.0 * torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / ell**2) + 1e-6 * torch.eye(x.shape[0], dtype=D)
    return torch.linalg.cholesky(K)


def _gp_sites(samples, x):
    f = torch.stack([_gp_cholesky(x, e) @ v for e, v in zip(samples["ell"], samples["v"])])
    return {"ell": samples["ell"], "f": f}


#: references sampled from a reparametrised model: name -> (model, (samples, *args) -> {site: draws})
NUTS_SAMPLERS = {"gp_lengthscale": (_gp_whitened, _gp_sites)}
