"""NumPyro versions of reference models whose Pyro NUTS runs take hours (``generate.py --numpyro NAME``).

Each builder takes the torch ``(args, kwargs)`` of the model of the same name in ``hyper_models.py`` and returns
``(model, kwargs, to_sites)``: a NumPyro model of the same posterior written independently (in coordinates NUTS
mixes well in) and a map from its draws (NumPy arrays, ``(num_samples, ...)``) to the sites of the Pyro model.
float64 throughout (``jax_enable_x64``).
"""
import math

import numpy as np


def setup():
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_platform_name", "cpu")


def bym_noncentred(E, y, Q0):
    """BYM in non-centred coordinates: ``phi = L0^{-T} z / sqrt(kappa)`` with ``L0 L0^T = Q0`` (a proper CAR
    precision, dense ``(n, n)``), ``v = sigma_v e``; ``kappa ~ Gamma(2, 1)``, ``sigma_v ~ HalfNormal(0.5)``,
    ``y ~ Poisson(E exp(phi + v))``. ``E``, ``y``: ``(n,)`` torch tensors."""
    import jax.numpy as jnp
    import jax.scipy.linalg as jsl
    import numpyro
    import numpyro.distributions as nd

    n = E.shape[0]
    L0 = np.linalg.cholesky(np.asarray(Q0, dtype=np.float64))
    L0j = jnp.asarray(L0)

    def model(E, y):
        kappa = numpyro.sample("kappa", nd.Gamma(2.0, 1.0))
        sigma_v = numpyro.sample("sigma_v", nd.HalfNormal(0.5))
        z = numpyro.sample("z", nd.Normal(jnp.zeros(n), 1.0).to_event(1))
        e = numpyro.sample("e", nd.Normal(jnp.zeros(n), 1.0).to_event(1))
        phi = jsl.solve_triangular(L0j.T, z, lower=False) / jnp.sqrt(kappa)
        numpyro.sample("y", nd.Poisson(E * jnp.exp(phi + sigma_v * e)), obs=y)

    def to_sites(s):
        kappa, sigma_v = s["kappa"].reshape(-1), s["sigma_v"].reshape(-1)
        phi = np.linalg.solve(L0.T, s["z"].T).T / np.sqrt(kappa)[:, None]
        return {"kappa": kappa, "sigma_v": sigma_v, "phi": phi, "v": s["e"] * sigma_v[:, None]}

    return model, {"E": jnp.asarray(E.numpy()), "y": jnp.asarray(y.numpy())}, to_sites


def bym(args, kwargs):
    """:func:`bym_noncentred` on the data of ``hyper_models.bym`` (5 x 5 lattice, ``Q0 = D - 0.99 W``)."""
    from tests.references.hyper_models import _lattice_car

    (E,), y = args, kwargs["y"]
    return bym_noncentred(E, y, _lattice_car(int(round(math.sqrt(E.shape[0])))).numpy())


def sonar_noncentred(X, y):
    """Bayesian logistic regression with a shared prior scale in non-centred coordinates: ``tau ~ HalfCauchy(1)``,
    ``z ~ N(0, I)``, ``w = tau z``, ``y ~ Bernoulli(logits = X w)`` (the centred model of ``benchmarks/hierarchical.py``'s
    ``logistic-sonar`` case, whose funnel slows NUTS). ``X`` ``(N, p)``, ``y`` ``(N,)``: torch tensors."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    p = X.shape[1]

    def model(X, y):
        tau = numpyro.sample("tau", nd.HalfCauchy(1.0))
        z = numpyro.sample("z", nd.Normal(jnp.zeros(p), 1.0).to_event(1))
        numpyro.sample("y", nd.Bernoulli(logits=X @ (tau * z)), obs=y)

    def to_sites(s):
        tau = s["tau"].reshape(-1)
        return {"tau": tau, "w": s["z"] * tau[:, None]}

    return model, {"X": jnp.asarray(X.numpy()), "y": jnp.asarray(y.numpy())}, to_sites


NUMPYRO_MODELS = {"bym": bym}
