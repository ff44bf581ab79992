"""The cases of ``hierarchical.py`` written independently in NumPyro, and a NumPyro NUTS runner.

Each builder takes the case's data (torch tensors, converted here) and returns ``(model, kwargs, hyper, field)``;
the field is recorded as a ``numpyro.deterministic`` site when the sampler runs in other coordinates (the GP in
whitened coordinates ``f = L(ell) v``, as the long reference does). float64 throughout (``jax_enable_x64``).

The ``zoo_*`` builders are the hierarchical models of the test zoo (``tests/zoo/models.py``), for
``zoo_hierarchical.py``: each takes the zoo model's torch ``(args, kwargs)`` and returns ``(model, kwargs, sites)``,
``sites`` the names of the Pyro model's latent sites, which the NumPyro model records under the same names (as
``numpyro.deterministic`` sites where it samples in other coordinates), in the Pyro sites' constrained coordinates.
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


# ----------------------------------------------------------------------------- the test zoo's hierarchical models
def _np(t):
    import numpy as np

    return np.asarray(t.detach().numpy() if hasattr(t, "detach") else t, dtype=np.float64)


def zoo_hier_logistic_halfcauchy(X, y):
    """``tau ~ HalfCauchy(1)``, ``w ~ N(0, tau^2 I_p)``, ``y_i ~ Bernoulli(logits=x_i w)`` (centred, as the zoo's
    NUTS reference)."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    def model(X, y):
        tau = numpyro.sample("tau", nd.HalfCauchy(1.0))
        w = numpyro.sample("w", nd.Normal(jnp.zeros(X.shape[1]), tau).to_event(1))
        numpyro.sample("y", nd.Bernoulli(logits=X @ w), obs=y)

    return model, {"X": jnp.asarray(_np(X)), "y": jnp.asarray(_np(y))}, ("tau", "w")


def lattice_car_precision(rows, cols, rho=0.9, ridge=0.1):
    """Dense proper CAR precision ``D - rho W + ridge I`` of the 4-neighbour ``rows x cols`` lattice (row-major
    numbering), NumPy ``(n, n)``."""
    import numpy as np

    from tests.zoo.models import lattice_adjacency  # the zoo's own lattice (the data, not the model)

    W = lattice_adjacency(rows, cols).numpy()
    return np.diag(W.sum(1) + ridge) - rho * W


def zoo_hier_gmrf_gamma(E, y):
    """Disease mapping on the 4 x 4 lattice: ``tau ~ Gamma(2, 1)``, ``b ~ N(0, 1)``, ``x ~ N(0, (tau Q)^{-1})``
    with ``Q`` the proper CAR precision (:func:`lattice_car_precision`), ``y_i ~ Poisson(E_i exp(b + x_i))``;
    sampled non-centred, ``x = L^{-T} v / sqrt(tau)`` with ``Q = L L^T`` and ``v ~ N(0, I)``."""
    import jax.numpy as jnp
    import jax.scipy.linalg as jsl
    import numpy as np
    import numpyro
    import numpyro.distributions as nd

    Q = lattice_car_precision(4, 4)
    n = Q.shape[0]
    if E.shape[0] != n:
        raise ValueError(f"E: expected the {n} regions of the 4 x 4 lattice, got {E.shape[0]}")
    Lt = jnp.asarray(np.linalg.cholesky(Q).T)

    def model(E, y):
        tau = numpyro.sample("tau", nd.Gamma(2.0, 1.0))
        b = numpyro.sample("b", nd.Normal(0.0, 1.0))
        v = numpyro.sample("v", nd.Normal(jnp.zeros(n), 1.0).to_event(1))
        x = numpyro.deterministic("x", jsl.solve_triangular(Lt, v, lower=False) / jnp.sqrt(tau))
        numpyro.sample("y", nd.Poisson(E * jnp.exp(b + x)), obs=y)

    return model, {"E": jnp.asarray(_np(E)), "y": jnp.asarray(_np(y))}, ("tau", "b", "x")


def zoo_hier_gp_lengthscale(x, y):
    """GP classification: ``ell ~ LogNormal(0, 0.5)``, ``f ~ N(0, K)`` with the RBF kernel written out,
    ``K_ij = 3 exp(-|x_i - x_j|^2 / (2 ell^2)) + 1e-6 [i = j]``, ``y_i ~ Bernoulli(logits=f_i)``; sampled whitened,
    ``f = L(ell) v`` with ``K = L L^T``."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    xs = _np(x).reshape(x.shape[0], -1)
    d2 = jnp.asarray(((xs[:, None, :] - xs[None, :, :]) ** 2).sum(-1))
    n = xs.shape[0]

    def model(d2, y):
        ell = numpyro.sample("ell", nd.LogNormal(0.0, 0.5))
        K = 3.0 * jnp.exp(-0.5 * d2 / ell**2) + 1e-6 * jnp.eye(n)
        v = numpyro.sample("v", nd.Normal(jnp.zeros(n), 1.0).to_event(1))
        f = numpyro.deterministic("f", jnp.linalg.cholesky(K) @ v)
        numpyro.sample("y", nd.Bernoulli(logits=f), obs=y)

    return model, {"d2": d2, "y": jnp.asarray(_np(y))}, ("ell", "f")


def zoo_linear_latent_noise(X, y):
    """``sigma ~ HalfNormal(1)``, ``w ~ N(0, I_p)``, ``y_i ~ N(x_i w, sigma^2)``."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    def model(X, y):
        sigma = numpyro.sample("sigma", nd.HalfNormal(1.0))
        w = numpyro.sample("w", nd.Normal(jnp.zeros(X.shape[1]), 1.0).to_event(1))
        numpyro.sample("y", nd.Normal(X @ w, sigma), obs=y)

    return model, {"X": jnp.asarray(_np(X)), "y": jnp.asarray(_np(y))}, ("sigma", "w")


def zoo_negbin_latent_concentration(x, y):
    """``w ~ N(0, 1)``, ``r ~ Gamma(2, 0.5)`` (rate), ``y_i ~ NB(r, logits=0.5 + x_i w - log r)``: the log pmf
    written out, ``lgamma(y + r) - lgamma(r) - lgamma(y + 1) + r log(1 - p) + y log p`` with ``p = sigmoid(logits)``
    (mean ``r exp(logits) = exp(0.5 + x w)``)."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd
    from jax.nn import log_sigmoid
    from jax.scipy.special import gammaln

    def model(x, y):
        w = numpyro.sample("w", nd.Normal(0.0, 1.0))
        r = numpyro.sample("r", nd.Gamma(2.0, 0.5))
        logits = 0.5 + x * w - jnp.log(r)
        numpyro.factor("y", jnp.sum(gammaln(y + r) - gammaln(r) - gammaln(y + 1.0)
                                    + r * log_sigmoid(-logits) + y * log_sigmoid(logits)))

    return model, {"x": jnp.asarray(_np(x)), "y": jnp.asarray(_np(y))}, ("w", "r")


def zoo_student_t_latent_scale(x, y):
    """``w ~ N(0, 1)``, ``s ~ HalfNormal(1)``, ``y_i ~ StudentT(4, x_i w, s)``."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    def model(x, y):
        w = numpyro.sample("w", nd.Normal(0.0, 1.0))
        s = numpyro.sample("s", nd.HalfNormal(1.0))
        numpyro.sample("y", nd.StudentT(4.0, x * w, s), obs=y)

    return model, {"x": jnp.asarray(_np(x)), "y": jnp.asarray(_np(y))}, ("w", "s")


ZOO_BUILDERS = {
    "hier_logistic_halfcauchy": zoo_hier_logistic_halfcauchy,
    "hier_gmrf_gamma": zoo_hier_gmrf_gamma,
    "hier_gp_lengthscale": zoo_hier_gp_lengthscale,
    "linear_latent_noise": zoo_linear_latent_noise,
    "negbin_latent_concentration": zoo_negbin_latent_concentration,
    "student_t_latent_scale": zoo_student_t_latent_scale,
}


def build_zoo(name, args, kwargs):
    """NumPyro version ``(model, kwargs, sites)`` of the test zoo's hierarchical model ``name`` from its torch
    ``(args, kwargs)`` (``ZOO[name].builder()``)."""
    _setup()
    if name not in ZOO_BUILDERS:
        raise KeyError(f"name: no NumPyro version of zoo model '{name}' (have {sorted(ZOO_BUILDERS)})")
    return ZOO_BUILDERS[name](args[0], kwargs["y"])


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


def enable_compile_cache(directory):
    """Keep XLA's compiled programs in ``directory`` (JAX's persistent compilation cache, every program kept).

    NumPyro's ``MCMC.run`` wraps its sampling loop in a new ``jax.jit`` object on every call, so without this cache
    every chain of every run compiles the loop again (NumPyro 0.22, JAX 0.10); with it, a program compiled once is
    loaded from ``directory`` (the loop is still traced and lowered). Call before the first compilation."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def use_temporary_compile_cache(prefix):
    """:func:`enable_compile_cache` in a fresh temporary directory (removed at exit): the first run compiles, later
    chains and runs load the programs. Returns the directory."""
    import atexit
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, directory, True)
    enable_compile_cache(directory)
    return directory


def add_compile_cache_option(parser):
    """``--numpyro-compile-cache on|off`` (default on): whether :func:`use_temporary_compile_cache` keeps NumPyro's
    compiled sampling loop between chains and runs (``off`` times every recompilation)."""
    parser.add_argument("--numpyro-compile-cache", choices=("on", "off"), default="on",
                        help="keep NumPyro's compiled sampling loop in a temporary persistent cache (default on)")


def _nuts(model, kwargs, chains, warmup, samples, seed, extra_fields=()):
    import jax
    from numpyro.infer import MCMC, NUTS

    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, num_chains=chains, chain_method="sequential",
                progress_bar=False)
    t0 = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed), extra_fields=extra_fields, **kwargs)
    out = mcmc.get_samples(group_by_chain=True)
    jax.block_until_ready(out)
    return mcmc, out, time.perf_counter() - t0


def run_nuts(model, kwargs, *, chains=4, warmup=1000, samples=1000, seed=0):
    """NumPyro NUTS, ``chains`` chains run sequentially; returns ``(samples by chain, seconds)``."""
    _, out, seconds = _nuts(model, kwargs, chains, warmup, samples, seed)
    return out, seconds


def run_nuts_counting_divergences(model, kwargs, *, chains=4, warmup=1000, samples=1000, seed=0):
    """As :func:`run_nuts`; returns ``(samples by chain, seconds, number of divergent transitions after warm-up)``
    (the seconds include collecting the ``diverging`` field)."""
    import numpy as np

    mcmc, out, seconds = _nuts(model, kwargs, chains, warmup, samples, seed, extra_fields=("diverging",))
    return out, seconds, int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum())
