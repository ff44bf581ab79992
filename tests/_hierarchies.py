"""Random-intercept data and models shared by the tests of sparse chains, hyper-latents and their extraction.

One data factory, :func:`random_intercepts`, with the layouts of the groups the tests use (random assignment,
blocks of equal size, round robin), and the models written centred and non-centred, with the group scale fixed or
a ``HalfNormal(1)`` hyper-latent. Everything is float64.
"""
import pyro
import pyro.distributions as dist
import torch

D = torch.float64


def random_intercepts(J, *, rows=None, per=None, grouping="random", p=2, seed=0, intercept=(-0.3, 0.8), slopes=True):
    """Logistic random-intercept data: ``y_i ~ Bernoulli(sigmoid(a[g_i] + x_i^T beta))``.

    :param int J: number of groups.
    :param int rows: number of rows ``N`` (``grouping="random"`` or ``"cyclic"``); or ``per`` rows per group.
    :param str grouping: ``"random"`` (each row's group drawn uniformly, first from the generator), ``"blocks"``
        (``per`` consecutive rows per group) or ``"cyclic"`` (row ``i`` in group ``i mod J``).
    :param int p: number of covariates (standard normal).
    :param tuple intercept: ``(mean, sd)`` of the true intercepts ``a_j``.
    :param bool slopes: ``beta = linspace(-1, 1, p)`` when true, else zero (the covariates are noise).
    :returns: ``(X, grp, y)``: ``(N, p)`` covariates, ``(N,)`` group indices (int64), ``(N,)`` labels in {0, 1}.
    """
    g = torch.Generator().manual_seed(seed)
    if grouping == "random":
        grp = torch.randint(0, J, (rows,), generator=g)
    elif grouping == "blocks":
        grp = torch.arange(J).repeat_interleave(per)
    elif grouping == "cyclic":
        grp = torch.arange(rows if rows is not None else per * J) % J
    else:
        raise ValueError(f"grouping: expected 'random', 'blocks' or 'cyclic', got {grouping!r}")
    N = grp.shape[0]
    X = torch.randn(N, p, generator=g, dtype=D)
    a = intercept[0] + intercept[1] * torch.randn(J, generator=g, dtype=D)
    logits = a[grp] + X @ torch.linspace(-1, 1, p, dtype=D) if slopes else a[grp]
    y = (torch.rand(N, generator=g, dtype=D) < torch.sigmoid(logits)).to(D)
    return X, grp, y


def centred(X, grp, J, y=None, sigma=0.7, mu_loc=0.2):
    """``mu ~ N(mu_loc, 2^2)``, ``b ~ N(0, I)``, ``alpha_j ~ N(mu, sigma^2)``, ``y ~ Bernoulli(alpha[g] + X b)``."""
    mu = pyro.sample("mu", dist.Normal(torch.tensor(mu_loc, dtype=D), 2.0))
    b = pyro.sample("b", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
    with pyro.plate("groups", J):
        alpha = pyro.sample("alpha", dist.Normal(mu, sigma))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=alpha[grp] + X @ b), obs=y)


def noncentred(X, grp, J, y=None, sigma=0.7, mu_loc=0.2):
    """The same model as :func:`centred` with ``alpha = mu + sigma z``, ``z_j ~ N(0, 1)``."""
    mu = pyro.sample("mu", dist.Normal(torch.tensor(mu_loc, dtype=D), 2.0))
    b = pyro.sample("b", dist.Normal(torch.zeros(X.shape[1], dtype=D), 1.0).to_event(1))
    with pyro.plate("groups", J):
        z = pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=(mu + sigma * z)[grp] + X @ b), obs=y)


def centred_hyper(X, grp, J, y=None):
    """:func:`centred` with ``sigma ~ HalfNormal(1)`` a hyper-latent and ``mu ~ N(0, 2^2)``."""
    sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    centred(X, grp, J, y=y, sigma=sigma, mu_loc=0.0)


def noncentred_hyper(X, grp, J, y=None):
    """:func:`noncentred` with ``sigma ~ HalfNormal(1)`` a hyper-latent and ``mu ~ N(0, 2^2)``."""
    sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
    noncentred(X, grp, J, y=y, sigma=sigma, mu_loc=0.0)


def small_logistic_hierarchy_fit():
    """``dual_vg`` fit of a small hierarchical logistic regression (25 rows, 3 weights ``w ~ N(0, tau^2)``,
    ``tau ~ HalfNormal(2)`` integrated over): a hyper-latent result for the importance-correction tests."""
    import pyro_convexvb as pcv

    g = torch.Generator().manual_seed(5)
    X = torch.randn(25, 3, generator=g, dtype=D)
    y = (torch.rand(25, generator=g, dtype=D) < torch.sigmoid(X @ torch.tensor([1.0, -1.0, 0.5], dtype=D))).to(D)

    def model(X, y=None):
        tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(2.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=D), tau).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return pcv.fit(model, X, y=y, engine="dual_vg", progress=False)
