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
def lasso_spambase():
    """Sparse logistic regression on keel spambase (the training split of seed 0, its first 20 standardised
    features): ``w ~ Laplace(0, 0.5)``, intercept ``w0 ~ N(0, 2^2)`` (``examples/sparse_logistic_spambase.py``).
    The relaxation's Gaussian is 5x too narrow in the coefficient of ``x3`` (a rare word), whose posterior has an
    exponential right tail."""
    from pyro_convexvb.datasets import load_keel

    ds = load_keel("spambase", seed=0)
    X = ds.X_train[:, :20].to(D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Laplace(torch.zeros(X.shape[1], dtype=D), 0.5).to_event(1))
        w0 = pyro.sample("w0", dist.Normal(torch.zeros((), dtype=D), 2.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w + w0), obs=y)

    return model, (X,), {"y": ds.y_train.to(D)}


NUTS_REFERENCES = {"logistic_halfcauchy": logistic_halfcauchy, "gp_lengthscale": gp_lengthscale,
                   "lasso_spambase": lasso_spambase}


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


def _lattice_car(m, rho=0.99):
    """``D - rho W`` of the 4-neighbour ``m x m`` lattice (a proper CAR precision), dense."""
    n = m * m
    W = torch.zeros(n, n, dtype=D)
    for i in range(m):
        for j in range(m):
            k = i * m + j
            if j + 1 < m:
                W[k, k + 1] = W[k + 1, k] = 1.0
            if i + 1 < m:
                W[k, k + m] = W[k + m, k] = 1.0
    return torch.diag(W.sum(1)) - rho * W


def bym():
    """BYM disease mapping on a 5 x 5 lattice (Besag, York & Mollié 1991): a proper CAR field ``phi`` with
    precision ``kappa (D - 0.99 W)``, ``kappa ~ Gamma(2, 1)``, plus iid effects ``v ~ N(0, sigma_v^2)``,
    ``sigma_v ~ HalfNormal(0.5)``; counts ``y_i ~ Poisson(E_i exp(phi_i + v_i))``. Two hyper-latents; ``sigma_v``
    is weakly identified beside the spatial field, so its posterior is skewed toward zero."""
    m = 5
    Q0 = _lattice_car(m)
    g = torch.Generator().manual_seed(14)
    L = torch.linalg.cholesky(2.0 * Q0)
    phi = torch.linalg.solve_triangular(L.T, torch.randn(m * m, 1, generator=g, dtype=D), upper=True)[:, 0]
    v = 0.3 * torch.randn(m * m, generator=g, dtype=D)
    E = 5.0 + 10.0 * torch.rand(m * m, generator=g, dtype=D)
    y = torch.poisson(E * torch.exp(phi + v), generator=g)
    Qs = Q0.to_sparse()

    def model(E, y=None):
        kappa = pyro.sample("kappa", dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)))
        sigma_v = pyro.sample("sigma_v", dist.HalfNormal(torch.tensor(0.5, dtype=D)))
        from pyro_convexvb.distributions import SparseGMRF

        phi = pyro.sample("phi", SparseGMRF(torch.zeros(m * m, dtype=D), Qs, precision_scale=kappa))
        v = pyro.sample("v", dist.Normal(torch.zeros(m * m, dtype=D), sigma_v).to_event(1))
        with pyro.plate("areas", m * m):
            pyro.sample("y", dist.Poisson(E * torch.exp(phi + v)), obs=y)

    return model, (E,), {"y": y}


def _bym_noncentred(E, y=None):
    """:func:`bym` in non-centred coordinates (``phi = L0^{-T} z / sqrt(kappa)``, ``v = sigma_v e``): the same
    posterior, in coordinates NUTS mixes well in."""
    n = E.shape[0]
    m = int(round(math.sqrt(n)))
    L0 = torch.linalg.cholesky(_lattice_car(m))
    kappa = pyro.sample("kappa", dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)))
    sigma_v = pyro.sample("sigma_v", dist.HalfNormal(torch.tensor(0.5, dtype=D)))
    z = pyro.sample("z", dist.Normal(torch.zeros(n, dtype=D), 1.0).to_event(1))
    e = pyro.sample("e", dist.Normal(torch.zeros(n, dtype=D), 1.0).to_event(1))
    phi = torch.linalg.solve_triangular(L0.T, z.unsqueeze(-1), upper=True).squeeze(-1) / kappa.sqrt()
    with pyro.plate("areas", n):
        pyro.sample("y", dist.Poisson(E * torch.exp(phi + sigma_v * e)), obs=y)


def _bym_sites(samples, E):
    n = E.shape[0]
    L0 = torch.linalg.cholesky(_lattice_car(int(round(math.sqrt(n)))))
    kappa, sigma_v = samples["kappa"].reshape(-1), samples["sigma_v"].reshape(-1)
    phi = torch.linalg.solve_triangular(L0.T, samples["z"].T, upper=True).T / kappa.sqrt()[:, None]
    return {"kappa": kappa, "sigma_v": sigma_v, "phi": phi, "v": samples["e"] * sigma_v[:, None]}


NUTS_REFERENCES["bym"] = bym
NUTS_SAMPLERS["bym"] = (_bym_noncentred, _bym_sites)
