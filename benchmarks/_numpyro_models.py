"""The cases of ``hierarchical.py`` written independently in NumPyro, and a NumPyro NUTS runner.

Each builder takes the case's data (torch tensors, converted here) and returns ``(model, kwargs, hyper, field)``;
the field is recorded as a ``numpyro.deterministic`` site when the sampler runs in other coordinates (the GP in
whitened coordinates ``f = L(ell) v``, as the long reference does). float64 throughout (``jax_enable_x64``).
"""
import math
import time


def available():
    try:
        import jax  # noqa: F401
        import numpyro  # noqa: F401
    except ImportError:
        return False
    return True


def _setup():
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_platform_name", "cpu")


def logistic_sonar(X, y):
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    def model(X, y):
        tau = numpyro.sample("tau", nd.HalfCauchy(1.0))
        w = numpyro.sample("w", nd.Normal(jnp.zeros(X.shape[1]), tau).to_event(1))
        numpyro.sample("y", nd.Bernoulli(logits=X @ w), obs=y)

    return model, {"X": jnp.asarray(X.numpy()), "y": jnp.asarray(y.numpy())}, "tau", "w"


def poisson_gmrf(E, y, Q0_dense):
    """Proper CAR field with precision ``kappa Q0``: its log density written out (``log det Q0`` once)."""
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as nd

    Q0 = jnp.asarray(Q0_dense)
    n = Q0.shape[0]
    logdet_Q0 = float(np.linalg.slogdet(np.asarray(Q0_dense))[1])

    def model(E, y):
        kappa = numpyro.sample("kappa", nd.Gamma(1.0, 0.1))
        f = numpyro.sample("f", nd.ImproperUniform(nd.constraints.real_vector, (), (n,)))
        numpyro.factor("f_prior", 0.5 * (n * jnp.log(kappa) + logdet_Q0 - n * math.log(2 * math.pi))
                       - 0.5 * kappa * f @ (Q0 @ f))
        numpyro.sample("y", nd.Poisson(E * jnp.exp(f)), obs=y)

    return model, {"E": jnp.asarray(E.numpy()), "y": jnp.asarray(y.numpy())}, "kappa", "f"


def gp_lengthscale(d2, y):
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    n = d2.shape[0]

    def model(d2, y):
        ell = numpyro.sample("ell", nd.LogNormal(math.log(4.0), 0.5))
        K = 4.0 * jnp.exp(-0.5 * d2 / ell**2) + 1e-6 * jnp.eye(n)
        v = numpyro.sample("v", nd.Normal(jnp.zeros(n), 1.0).to_event(1))
        f = numpyro.deterministic("f", jnp.linalg.cholesky(K) @ v)
        numpyro.sample("y", nd.Bernoulli(logits=f), obs=y)

    return model, {"d2": jnp.asarray(d2.numpy()), "y": jnp.asarray(y.numpy())}, "ell", "f"


def bym(E, y, Q0_dense):
    """BYM: the proper CAR field's log density written out, the iid effects non-centred (``v = sigma_v e``)."""
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as nd

    Q0 = jnp.asarray(Q0_dense)
    n = Q0.shape[0]
    logdet_Q0 = float(np.linalg.slogdet(np.asarray(Q0_dense))[1])

    def model(E, y):
        kappa = numpyro.sample("kappa", nd.Gamma(2.0, 1.0))
        sigma_v = numpyro.sample("sigma_v", nd.HalfNormal(0.5))
        phi = numpyro.sample("phi", nd.ImproperUniform(nd.constraints.real_vector, (), (n,)))
        numpyro.factor("phi_prior", 0.5 * (n * jnp.log(kappa) + logdet_Q0 - n * math.log(2 * math.pi))
                       - 0.5 * kappa * phi @ (Q0 @ phi))
        e = numpyro.sample("e", nd.Normal(jnp.zeros(n), 1.0).to_event(1))
        v = numpyro.deterministic("v", sigma_v * e)
        numpyro.sample("y", nd.Poisson(E * jnp.exp(phi + v)), obs=y)

    return model, {"E": jnp.asarray(E.numpy()), "y": jnp.asarray(y.numpy())}, "sigma_v", "v"


def build(name, margs, mkw, extra=None):
    """NumPyro version of case ``name`` from the torch data of ``hierarchical.py``."""
    _setup()
    if name == "logistic-sonar":
        return logistic_sonar(margs[0], mkw["y"])
    if name == "poisson-gmrf":
        return poisson_gmrf(margs[0], mkw["y"], extra)
    if name == "gp-lengthscale":
        return gp_lengthscale(margs[0], mkw["y"])
    if name == "bym":
        return bym(margs[0], mkw["y"], extra)
    raise KeyError(name)


def run_nuts(model, kwargs, *, chains=4, warmup=1000, samples=1000, seed=0):
    """NumPyro NUTS, ``chains`` chains run sequentially; returns ``(samples by chain, seconds)``."""
    import jax
    from numpyro.infer import MCMC, NUTS

    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, num_chains=chains, chain_method="sequential",
                progress_bar=False)
    t0 = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed), **kwargs)
    out = mcmc.get_samples(group_by_chain=True)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0
