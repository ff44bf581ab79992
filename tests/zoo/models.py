r"""The model zoo: ordinary Pyro models, each a small builder returning ``(model, args, kwargs)``.

Every builder draws its data from a fixed seed, in float64. Each model declares how its reference
posterior is made:

* ``"exact"``: a closed form (conjugate linear-Gaussian posterior; a finite mixture of them);
* ``"quadrature"``: 1-D or 2-D quadrature of the exact posterior density, written out here
  independently of the Pyro model (:func:`quadrature`);
* ``"nuts"``: a long NUTS run (4 chains) made once by ``generate_references.py`` and stored in
  ``references.json``.

References are summaries in the model's *unconstrained* coordinates (Pyro's ``biject_to`` of each
site's support, the coordinates every engine's posterior lives in): per latent site the mean and
standard deviation of every coordinate.
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import gpytorch
import numpy as np
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch

import pyro_convexvb as pcv

D = torch.float64

__all__ = ["ZOO", "ZooModel", "quadrature", "build"]


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry.

    :ivar name: identifier (test ids, the docs table).
    :ivar builder: ``() -> (model, args, kwargs)``.
    :ivar reference: ``"exact"``, ``"quadrature"`` or ``"nuts"``.
    :ivar group: the section of the supported-models table.
    :ivar description: one line for the table.
    :ivar gaussian: linear-Gaussian given what the latent-Gaussian engines see (their answers are then exact).
    :ivar compare: the latent sites compared with the reference (default: every site of the reference).
    :ivar reference_fn: ``(args, kwargs) -> {site: {"mean": [...], "sd": [...]}}`` for exact and
        quadrature references.
    :ivar nuts_model: for NUTS references of models with a badly conditioned Gaussian prior (GPs):
        ``(args, kwargs) -> (model, to_sites)``, the same posterior in whitened coordinates, which NUTS
        mixes well in, and ``to_sites(samples)`` mapping its samples to the original latent sites.
    """

    name: str
    builder: Callable
    reference: str
    group: str
    description: str
    gaussian: bool = False
    compare: Optional[Tuple[str, ...]] = None
    reference_fn: Optional[Callable] = field(default=None, compare=False)
    nuts_model: Optional[Callable] = field(default=None, compare=False)


ZOO = {}


def _zoo(name, group, reference, description, **kw):
    def deco(builder):
        ZOO[name] = ZooModel(name, builder, reference, group, description, **kw)
        return builder

    return deco


def _reference_of(name):
    def deco(fn):
        ZOO[name] = dataclasses.replace(ZOO[name], reference_fn=fn)
        return fn

    return deco


def _nuts_model_of(*names):
    def deco(fn):
        for name in names:
            ZOO[name] = dataclasses.replace(ZOO[name], nuts_model=fn)
        return fn

    return deco


def build(name):
    """``(model, args, kwargs)`` of zoo model ``name``."""
    return ZOO[name].builder()


# ---------------------------------------------------------------------------------------------
# references: closed forms and quadrature
# ---------------------------------------------------------------------------------------------
def conjugate_gaussian(X, y, prior_var, noise_var, weights=None):
    """Mean and covariance of ``w`` for ``w ~ N(0, diag(prior_var))``, ``y_i ~ N(x_i w, noise_var)``
    with the log-likelihood of row ``i`` multiplied by ``weights[i]`` (``poutine.scale``)."""
    c = torch.ones(X.shape[0], dtype=D) if weights is None else weights
    P = torch.diag(1.0 / prior_var) + X.T @ (X * (c / noise_var)[:, None])
    cov = torch.linalg.inv(P)
    cov = 0.5 * (cov + cov.T)
    return cov @ (X.T @ (c * y / noise_var)), cov


def _summary(sites, mean, sd):
    return {s: {"mean": [float(mean[i]) for i in idx], "sd": [float(sd[i]) for i in idx]} for s, idx in sites.items()}


def quadrature(log_joint, sites, d, box=None, n=None, width=10.0):
    """Posterior mean and sd of every coordinate by quadrature of an exact ``d``-dimensional density (d <= 2).

    ``log_joint(T)`` maps ``(G, d)`` points to ``(G,)`` unnormalised log densities (in the coordinates of
    the summary). The box starts at ``box`` (default ``[-8, 8]^d``) and is re-centred three times on the
    mean +- ``width`` sd (10; wider for the polynomial tails of Student-t likelihoods); the final tensor grid has ``n`` points per dimension (8001 in 1-D, 401 in 2-D), so the
    rule is spectrally accurate for these smooth, rapidly decaying densities. The mass on the boundary of
    the final box is checked to be negligible.

    :returns: ``{site: {"mean": [...], "sd": [...]}}`` for ``sites = {site: [coordinate indices]}``.
    """
    lo = torch.full((d,), -8.0, dtype=D) if box is None else torch.tensor([b[0] for b in box], dtype=D)
    hi = torch.full((d,), 8.0, dtype=D) if box is None else torch.tensor([b[1] for b in box], dtype=D)
    final = n or (8001 if d == 1 else 401)
    for it in range(4):
        m = final if it == 3 else (2001 if d == 1 else 161)
        axes = [torch.linspace(float(lo[k]), float(hi[k]), m, dtype=D) for k in range(d)]
        T = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, d)
        lp = torch.cat([log_joint(t) for t in T.split(20000)])
        w = torch.softmax(lp, 0)
        mean = (w[:, None] * T).sum(0)
        sd = ((w[:, None] * (T - mean) ** 2).sum(0)).sqrt()
        if it < 3:
            lo, hi = mean - width * sd, mean + width * sd
    edge = torch.zeros(T.shape[0], dtype=torch.bool)
    for k in range(d):
        edge |= (T[:, k] == lo[k]) | (T[:, k] == hi[k])
    assert float(w[edge].sum()) < 1e-10, "quadrature box too small"
    return _summary(sites, mean, sd)


# ---------------------------------------------------------------------------------------------
# data helpers
# ---------------------------------------------------------------------------------------------
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _bernoulli(g, logits):
    return (torch.rand(logits.shape, generator=g, dtype=D) < torch.sigmoid(logits)).to(D)


def _poisson(g, rate):
    return torch.poisson(rate, generator=g).to(D)


def _std_normal_logpdf(t, scale=1.0, loc=0.0):
    return dist.Normal(torch.as_tensor(loc, dtype=D), torch.as_tensor(scale, dtype=D)).log_prob(t)


def _zeros(n):
    return torch.zeros(n, dtype=D)


# ---------------------------------------------------------------------------------------------
# GLMs: logistic, probit, Poisson, with and without an intercept site, with offsets
# ---------------------------------------------------------------------------------------------
@_zoo("logistic", "GLM", "quadrature", "logistic regression, 2 weights, no intercept (N=60)")
def logistic():
    g = _gen(101)
    X = torch.randn(60, 2, generator=g, dtype=D)
    y = _bernoulli(g, X @ torch.tensor([1.2, -0.8], dtype=D))

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X,), {"y": y}


def _logistic_lj(X, y, offset=0.0, weight=1.0, prior_loc=0.0, prior_scale=1.0, rows=None):
    if rows is not None:
        X, y = X[rows], y[rows]
        offset = offset[rows] if torch.is_tensor(offset) and offset.dim() else offset

    def lj(T):
        eta = T @ X.T + offset
        return (_std_normal_logpdf(T, prior_scale, prior_loc).sum(-1)
                + weight * dist.Bernoulli(logits=eta).log_prob(y).sum(-1))

    return lj


@_reference_of("logistic")
def _(args, kwargs):
    return quadrature(_logistic_lj(args[0], kwargs["y"]), {"w": [0, 1]}, 2)


@_zoo("logistic_intercept", "GLM", "nuts", "logistic regression with an intercept site b ~ N(0, 2^2) and 3 weights (N=80)")
def logistic_intercept():
    g = _gen(102)
    X = torch.randn(80, 3, generator=g, dtype=D)
    y = _bernoulli(g, -0.5 + X @ torch.tensor([1.0, -1.0, 0.5], dtype=D))

    def model(X, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=b + X @ w), obs=y)

    return model, (X,), {"y": y}


@_zoo("logistic_offset", "GLM", "quadrature", "logistic regression with a known offset in the logits (N=60)")
def logistic_offset():
    g = _gen(103)
    X = torch.randn(60, 2, generator=g, dtype=D)
    off = 0.8 * torch.randn(60, generator=g, dtype=D)
    y = _bernoulli(g, off + X @ torch.tensor([-1.0, 0.7], dtype=D))

    def model(X, offset, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w + offset), obs=y)

    return model, (X, off), {"y": y}


@_reference_of("logistic_offset")
def _(args, kwargs):
    return quadrature(_logistic_lj(args[0], kwargs["y"], offset=args[1]), {"w": [0, 1]}, 2)


@_zoo("probit", "GLM", "quadrature", "probit regression written Bernoulli(probs=Normal(0, 1).cdf(X @ w)) (N=60)")
def probit():
    g = _gen(104)
    X = torch.randn(60, 2, generator=g, dtype=D)
    eta = X @ torch.tensor([0.9, -0.6], dtype=D)
    y = (torch.rand(60, generator=g, dtype=D) < torch.special.ndtr(eta)).to(D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(probs=dist.Normal(0., 1.).cdf(X @ w)), obs=y)

    return model, (X,), {"y": y}


@_reference_of("probit")
def _(args, kwargs):
    X, y = args[0], kwargs["y"]

    def lj(T):
        eta = T @ X.T
        # log Phi(s eta) with s = 2y - 1, computed stably
        return _std_normal_logpdf(T).sum(-1) + torch.special.log_ndtr((2 * y - 1) * eta).sum(-1)

    return quadrature(lj, {"w": [0, 1]}, 2)


@_zoo("probit_intercept", "GLM", "nuts", "probit regression with an intercept site and 3 weights (N=80)")
def probit_intercept():
    g = _gen(105)
    X = torch.randn(80, 3, generator=g, dtype=D)
    eta = 0.4 + X @ torch.tensor([0.8, 0.0, -0.7], dtype=D)
    y = (torch.rand(80, generator=g, dtype=D) < torch.special.ndtr(eta)).to(D)

    def model(X, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(probs=dist.Normal(0., 1.).cdf(b + X @ w)), obs=y)

    return model, (X,), {"y": y}


def _poisson_lj(X, y, log_exposure=0.0, rows=None):
    if rows is not None:
        X, y = X[rows], y[rows]
        log_exposure = log_exposure[rows] if torch.is_tensor(log_exposure) and log_exposure.dim() else log_exposure

    def lj(T):
        eta = T @ X.T + log_exposure
        return _std_normal_logpdf(T).sum(-1) + (y * eta - torch.exp(eta) - torch.lgamma(y + 1)).sum(-1)

    return lj


@_zoo("poisson", "GLM", "quadrature", "Poisson regression rate=exp(X @ w), no intercept (N=50)")
def poisson():
    g = _gen(106)
    X = 0.6 * torch.randn(50, 2, generator=g, dtype=D)
    y = _poisson(g, torch.exp(X @ torch.tensor([1.0, -0.5], dtype=D)))

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Poisson(rate=torch.exp(X @ w)), obs=y)

    return model, (X,), {"y": y}


@_reference_of("poisson")
def _(args, kwargs):
    return quadrature(_poisson_lj(args[0], kwargs["y"]), {"w": [0, 1]}, 2)


@_zoo("poisson_intercept", "GLM", "nuts", "Poisson regression with an intercept site b ~ N(0, 2^2) and 2 weights (N=50)")
def poisson_intercept():
    g = _gen(107)
    X = 0.6 * torch.randn(50, 2, generator=g, dtype=D)
    y = _poisson(g, torch.exp(0.7 + X @ torch.tensor([0.8, -0.6], dtype=D)))

    def model(X, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Poisson(rate=torch.exp(b + X @ w)), obs=y)

    return model, (X,), {"y": y}


@_zoo("poisson_exposure", "GLM", "quadrature", "Poisson regression with an exposure offset rate=E * exp(X @ w) (N=50)")
def poisson_exposure():
    g = _gen(108)
    X = 0.6 * torch.randn(50, 2, generator=g, dtype=D)
    E = 0.5 + 4.5 * torch.rand(50, generator=g, dtype=D)
    y = _poisson(g, E * torch.exp(X @ torch.tensor([-0.7, 0.9], dtype=D)))

    def model(X, E, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Poisson(rate=E * torch.exp(X @ w)), obs=y)

    return model, (X, E), {"y": y}


@_reference_of("poisson_exposure")
def _(args, kwargs):
    return quadrature(_poisson_lj(args[0], kwargs["y"], torch.log(args[1])), {"w": [0, 1]}, 2)


@_zoo("poisson_intercept_exposure", "GLM", "nuts",
      "Poisson regression with an intercept site, 2 weights and an exposure offset (N=60)")
def poisson_intercept_exposure():
    g = _gen(109)
    X = 0.6 * torch.randn(60, 2, generator=g, dtype=D)
    E = 0.5 + 4.5 * torch.rand(60, generator=g, dtype=D)
    y = _poisson(g, E * torch.exp(-0.3 + X @ torch.tensor([0.5, 0.8], dtype=D)))

    def model(X, E, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Poisson(rate=E * torch.exp(b + X @ w)), obs=y)

    return model, (X, E), {"y": y}


# ---------------------------------------------------------------------------------------------
# linear regression and the Bayesian lasso
# ---------------------------------------------------------------------------------------------
LINEAR_NOISE = 0.5


@_zoo("linear", "linear", "exact", "Bayesian linear regression, 4 weights, fixed noise 0.5 (N=30)", gaussian=True)
def linear():
    g = _gen(110)
    X = torch.randn(30, 4, generator=g, dtype=D)
    y = X @ torch.tensor([1.0, -0.5, 0.0, 0.3], dtype=D) + LINEAR_NOISE * torch.randn(30, generator=g, dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, LINEAR_NOISE), obs=y)

    return model, (X,), {"y": y}


@_reference_of("linear")
def _(args, kwargs):
    m, S = conjugate_gaussian(args[0], kwargs["y"], torch.ones(4, dtype=D), LINEAR_NOISE**2)
    return _summary({"w": range(4)}, m, S.diagonal().sqrt())


@_zoo("linear_intercept", "linear", "exact",
      "Bayesian linear regression with an intercept site b ~ N(0, 3^2), 3 weights, noise 0.7 (N=25)", gaussian=True)
def linear_intercept():
    g = _gen(111)
    X = torch.randn(25, 3, generator=g, dtype=D)
    y = 2.0 + X @ torch.tensor([0.5, -1.0, 0.8], dtype=D) + 0.7 * torch.randn(25, generator=g, dtype=D)

    def model(X, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 3.0))
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(b + X @ w, 0.7), obs=y)

    return model, (X,), {"y": y}


@_reference_of("linear_intercept")
def _(args, kwargs):
    X = torch.cat([torch.ones(args[0].shape[0], 1, dtype=D), args[0]], 1)
    m, S = conjugate_gaussian(X, kwargs["y"], torch.tensor([9.0, 1.0, 1.0, 1.0], dtype=D), 0.49)
    return _summary({"b": [0], "w": [1, 2, 3]}, m, S.diagonal().sqrt())


@_zoo("lasso_gaussian", "sparse", "nuts", "Bayesian lasso: Laplace(0, 0.5) prior, Gaussian likelihood, 5 weights (N=30)")
def lasso_gaussian():
    g = _gen(112)
    X = torch.randn(30, 5, generator=g, dtype=D)
    y = X @ torch.tensor([1.5, 0.0, 0.0, -1.0, 0.0], dtype=D) + 0.6 * torch.randn(30, generator=g, dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Laplace(_zeros(X.shape[1]), 0.5).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, 0.6), obs=y)

    return model, (X,), {"y": y}


@_zoo("lasso_logistic", "sparse", "nuts", "Bayesian lasso: Laplace(0, 1) prior, logistic likelihood, 4 weights (N=60)")
def lasso_logistic():
    g = _gen(113)
    X = torch.randn(60, 4, generator=g, dtype=D)
    y = _bernoulli(g, X @ torch.tensor([2.0, 0.0, -1.0, 0.0], dtype=D))

    def model(X, y=None):
        w = pyro.sample("w", dist.Laplace(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X,), {"y": y}


# ---------------------------------------------------------------------------------------------
# GP classification with GPyTorch kernels (kernels are built and set once here, never mutated)
# ---------------------------------------------------------------------------------------------
def _gp_data(seed, n, dim, fn):
    g = _gen(seed)
    x = torch.rand(n, dim, generator=g, dtype=D) * 6 - 3
    y = _bernoulli(g, fn(x))
    return x, y


def _kernel_matrix(kernel, x, jitter=1e-6):
    with torch.no_grad():
        K = kernel(x).to_dense()
    return K + jitter * torch.eye(x.shape[0], dtype=D)


def gp_classifier(K, y=None):
    """GP classification: ``f ~ N(0, K)``, ``y ~ Bernoulli(logits=f)``."""
    f = pyro.sample("f", dist.MultivariateNormal(_zeros(K.shape[0]), covariance_matrix=K))
    with pyro.plate("data", K.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=f), obs=y)


@_zoo("gp_rbf", "GP classification", "nuts",
      "GP classification, GPyTorch ScaleKernel(RBFKernel), K built in the model under no_grad (N=30)")
def gp_rbf():
    x, y = _gp_data(114, 30, 1, lambda x: 2.0 * torch.sin(1.5 * x[:, 0]))
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale = 1.0
    kernel.outputscale = 2.0

    def model(x, y=None):
        with torch.no_grad():
            K = kernel(x).to_dense() + 1e-6 * torch.eye(x.shape[0], dtype=D)
        f = pyro.sample("f", dist.MultivariateNormal(_zeros(x.shape[0]), covariance_matrix=K))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

    return model, (x,), {"y": y}


@_zoo("gp_matern52", "GP classification", "nuts",
      "GP classification, GPyTorch ScaleKernel(MaternKernel(nu=2.5)), K a fixed tensor (N=30)")
def gp_matern52():
    x, y = _gp_data(115, 30, 1, lambda x: 1.5 * x[:, 0] - 0.5 * x[:, 0] ** 2 + 1.0)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).double()
    kernel.base_kernel.lengthscale = 1.2
    kernel.outputscale = 2.0
    return gp_classifier, (_kernel_matrix(kernel, x),), {"y": y}


@_zoo("gp_ard_rbf", "GP classification", "nuts",
      "GP classification on 2-D inputs, GPyTorch ARD RBFKernel(ard_num_dims=2), K a fixed tensor (N=30)")
def gp_ard_rbf():
    x, y = _gp_data(116, 30, 2, lambda x: 2.0 * torch.sin(x[:, 0]) + 0.3 * x[:, 1])
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()
    kernel.base_kernel.lengthscale = torch.tensor([[0.8, 2.5]], dtype=D)
    kernel.outputscale = 2.0
    return gp_classifier, (_kernel_matrix(kernel, x),), {"y": y}


@_nuts_model_of("gp_matern52", "gp_ard_rbf")
def _whitened_gp(args, kwargs):
    """``f = L v`` with ``K = L L^T`` and ``v ~ N(0, I)``: the same posterior of ``f``."""
    (K,) = args
    L = torch.linalg.cholesky(K)

    def model(K, y=None):
        v = pyro.sample("v", dist.Normal(_zeros(K.shape[0]), 1.0).to_event(1))
        with pyro.plate("data", K.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=L @ v), obs=y)

    return model, lambda s: {"f": s["v"] @ L.T}


@_nuts_model_of("gp_rbf")
def _whitened_gp_rbf(args, kwargs):
    model, _, _ = ZOO["gp_rbf"].builder()
    tr = pyro.poutine.trace(model).get_trace(*args, **kwargs)
    K = tr.nodes["f"]["fn"].covariance_matrix
    wmodel, to_sites = _whitened_gp((K,), kwargs)
    return (lambda x, y=None: wmodel(K, y)), to_sites


# ---------------------------------------------------------------------------------------------
# GMRF disease mapping with pcv.distributions.SparseGMRF
# ---------------------------------------------------------------------------------------------
def lattice_adjacency(rows, cols):
    """``(n, n)`` 0/1 adjacency of a ``rows x cols`` lattice (4-neighbours)."""
    n = rows * cols
    W = torch.zeros(n, n, dtype=D)
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            if c + 1 < cols:
                W[i, i + 1] = W[i + 1, i] = 1.0
            if r + 1 < rows:
                W[i, i + cols] = W[i + cols, i] = 1.0
    return W


def random_graph_adjacency(n, radius, seed):
    """Adjacency of a random geometric graph: ``n`` uniform points in the unit square, edges below ``radius``."""
    g = _gen(seed)
    p = torch.rand(n, 2, generator=g, dtype=D)
    W = (torch.cdist(p, p) < radius).to(D)
    W.fill_diagonal_(0.0)
    return W


def car_precision(W, rho=0.9, ridge=0.1):
    """Proper CAR precision ``D - rho W + ridge I`` (``D`` the degrees) as a sparse COO tensor."""
    Q = torch.diag(W.sum(1) + ridge) - rho * W
    return Q.to_sparse()


def _disease_data(seed, Q, b):
    g = _gen(seed)
    n = Q.shape[0]
    Qd = Q.to_dense()
    L = torch.linalg.cholesky(Qd)
    x = torch.linalg.solve_triangular(L.T, torch.randn(n, 1, generator=g, dtype=D), upper=True).reshape(n)
    E = 2.0 + 8.0 * torch.rand(n, generator=g, dtype=D)
    return E, _poisson(g, E * torch.exp(b + x))


def _disease_model(Q):
    def model(E, y=None):
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        x = pyro.sample("x", pcv.distributions.SparseGMRF(_zeros(Q.shape[0]), Q))
        with pyro.plate("regions", Q.shape[0]):
            pyro.sample("y", dist.Poisson(rate=E * torch.exp(b + x)), obs=y)

    return model


@_zoo("gmrf_lattice", "GMRF", "nuts",
      "disease mapping: SparseGMRF proper-CAR field on a 5x5 lattice, intercept, Poisson counts with exposure")
def gmrf_lattice():
    Q = car_precision(lattice_adjacency(5, 5))
    E, y = _disease_data(117, Q, 0.2)
    return _disease_model(Q), (E,), {"y": y}


@_zoo("gmrf_graph", "GMRF", "nuts",
      "disease mapping: SparseGMRF proper-CAR field on a random geometric graph (20 nodes), Poisson with exposure")
def gmrf_graph():
    Q = car_precision(random_graph_adjacency(20, 0.35, 1180))
    E, y = _disease_data(118, Q, -0.1)
    return _disease_model(Q), (E,), {"y": y}


def _noncentred_disease(name):
    """The same posterior with the field written ``x = L^{-T} v / sqrt(tau)`` (``Q_0 = L L^T`` dense,
    ``v ~ N(0, I)``; ``tau = 1`` without a precision hyper-latent), independent of ``SparseGMRF``."""

    def make(args, kwargs):
        model, _, _ = ZOO[name].builder()
        tr = poutine.trace(model).get_trace(*args, **kwargs)
        L = torch.linalg.cholesky(tr.nodes["x"]["fn"].precision.matrix.to_dense())
        hyper = "tau" in tr.nodes
        n = L.shape[0]

        def field(v, tau):
            return torch.linalg.solve_triangular(L.T, v.reshape(-1, n).T, upper=True).T / tau.reshape(-1, 1).sqrt()

        def wmodel(E, y=None):
            tau = (pyro.sample("tau", dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D))) if hyper
                   else torch.ones((), dtype=D))
            b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
            v = pyro.sample("v", dist.Normal(_zeros(n), 1.0).to_event(1))
            x = field(v, tau).reshape(n)
            with pyro.plate("regions", n):
                pyro.sample("y", dist.Poisson(rate=E * torch.exp(b + x)), obs=y)

        def to_sites(s):
            tau = s["tau"] if hyper else torch.ones(s["v"].shape[0], dtype=D)
            out = {"b": s["b"], "x": field(s["v"], tau)}
            if hyper:
                out["tau"] = s["tau"]
            return out

        return wmodel, to_sites

    return make


for _name in ("gmrf_lattice", "gmrf_graph"):
    ZOO[_name] = dataclasses.replace(ZOO[_name], nuts_model=_noncentred_disease(_name))


# ---------------------------------------------------------------------------------------------
# several likelihoods, masks, subsampling, poutine.scale
# ---------------------------------------------------------------------------------------------
@_zoo("multi_family", "model structure", "nuts",
      "one weight vector, three observed sites: Bernoulli (40 rows), Poisson (30), Normal (20)")
def multi_family():
    g = _gen(119)
    w0 = torch.tensor([0.8, -0.6, 0.4], dtype=D)
    X1 = torch.randn(40, 3, generator=g, dtype=D)
    X2 = 0.5 * torch.randn(30, 3, generator=g, dtype=D)
    X3 = torch.randn(20, 3, generator=g, dtype=D)
    y1 = _bernoulli(g, X1 @ w0)
    y2 = _poisson(g, torch.exp(X2 @ w0))
    y3 = X3 @ w0 + torch.randn(20, generator=g, dtype=D)

    def model(X1, X2, X3, y1=None, y2=None, y3=None):
        w = pyro.sample("w", dist.Normal(_zeros(3), 1.0).to_event(1))
        with pyro.plate("bern", X1.shape[0]):
            pyro.sample("y1", dist.Bernoulli(logits=X1 @ w), obs=y1)
        with pyro.plate("pois", X2.shape[0]):
            pyro.sample("y2", dist.Poisson(rate=torch.exp(X2 @ w)), obs=y2)
        with pyro.plate("gauss", X3.shape[0]):
            pyro.sample("y3", dist.Normal(X3 @ w, 1.0), obs=y3)

    return model, (X1, X2, X3), {"y1": y1, "y2": y2, "y3": y3}


@_zoo("mask_poutine", "model structure", "quadrature", "logistic regression, a third of the rows masked by poutine.mask")
def mask_poutine():
    g = _gen(120)
    X = torch.randn(60, 2, generator=g, dtype=D)
    y = _bernoulli(g, X @ torch.tensor([1.0, 1.0], dtype=D))
    keep = torch.arange(60) % 3 != 0

    def model(X, keep, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]), poutine.mask(mask=keep):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X, keep), {"y": y}


@_reference_of("mask_poutine")
def _(args, kwargs):
    return quadrature(_logistic_lj(args[0], kwargs["y"], rows=args[1]), {"w": [0, 1]}, 2)


@_zoo("mask_dist", "model structure", "quadrature", "Poisson regression, 20 of 50 rows masked by dist.mask")
def mask_dist():
    g = _gen(121)
    X = 0.6 * torch.randn(50, 2, generator=g, dtype=D)
    y = _poisson(g, torch.exp(0.5 + X @ torch.tensor([0.6, -1.0], dtype=D)))
    keep = torch.rand(50, generator=g, dtype=D) > 0.4

    def model(X, keep, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Poisson(rate=torch.exp(X @ w)).mask(keep), obs=y)

    return model, (X, keep), {"y": y}


@_reference_of("mask_dist")
def _(args, kwargs):
    return quadrature(_poisson_lj(args[0], kwargs["y"], rows=args[1]), {"w": [0, 1]}, 2)


@_zoo("obs_mask", "model structure", "exact",
      "linear regression with 8 of 30 responses missing (obs_mask); the weights are compared", gaussian=True,
      compare=("w",))
def obs_mask():
    g = _gen(122)
    X = torch.randn(30, 3, generator=g, dtype=D)
    y = X @ torch.tensor([0.7, -0.4, 1.1], dtype=D) + LINEAR_NOISE * torch.randn(30, generator=g, dtype=D)
    observed = torch.ones(30, dtype=torch.bool)
    observed[torch.randperm(30, generator=g)[:8]] = False
    y = torch.where(observed, y, torch.zeros((), dtype=D))

    def model(X, observed, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, LINEAR_NOISE), obs=y, obs_mask=observed)

    return model, (X, observed), {"y": y}


@_reference_of("obs_mask")
def _(args, kwargs):
    X, keep = args
    m, S = conjugate_gaussian(X[keep], kwargs["y"][keep], torch.ones(3, dtype=D), LINEAR_NOISE**2)
    return _summary({"w": range(3)}, m, S.diagonal().sqrt())


@_zoo("subsample", "model structure", "quadrature",
      "logistic regression in a subsampled plate (subsample_size=20 of 80); reference: the full-data posterior")
def subsample():
    g = _gen(123)
    X = torch.randn(80, 2, generator=g, dtype=D)
    y = _bernoulli(g, X @ torch.tensor([-0.8, 1.3], dtype=D))

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0], subsample_size=20) as idx:
            pyro.sample("y", dist.Bernoulli(logits=X[idx] @ w), obs=y[idx])

    return model, (X,), {"y": y}


@_reference_of("subsample")
def _(args, kwargs):
    return quadrature(_logistic_lj(args[0], kwargs["y"]), {"w": [0, 1]}, 2)


@_zoo("scale_gaussian", "model structure", "exact",
      "linear regression whose rows are weighted by poutine.scale (weights in [0.5, 2])", gaussian=True)
def scale_gaussian():
    g = _gen(124)
    X = torch.randn(30, 3, generator=g, dtype=D)
    y = X @ torch.tensor([0.2, 0.9, -0.6], dtype=D) + LINEAR_NOISE * torch.randn(30, generator=g, dtype=D)
    c = 0.5 + 1.5 * torch.rand(30, generator=g, dtype=D)

    def model(X, c, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]), poutine.scale(scale=c):
            pyro.sample("y", dist.Normal(X @ w, LINEAR_NOISE), obs=y)

    return model, (X, c), {"y": y}


@_reference_of("scale_gaussian")
def _(args, kwargs):
    m, S = conjugate_gaussian(args[0], kwargs["y"], torch.ones(3, dtype=D), LINEAR_NOISE**2, weights=args[1])
    return _summary({"w": range(3)}, m, S.diagonal().sqrt())


@_zoo("scale_logistic", "model structure", "quadrature",
      "logistic regression with its likelihood tempered by poutine.scale(scale=0.5)")
def scale_logistic():
    g = _gen(125)
    X = torch.randn(60, 2, generator=g, dtype=D)
    y = _bernoulli(g, X @ torch.tensor([1.5, 0.5], dtype=D))

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]), poutine.scale(scale=0.5):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X,), {"y": y}


@_reference_of("scale_logistic")
def _(args, kwargs):
    return quadrature(_logistic_lj(args[0], kwargs["y"], weight=0.5), {"w": [0, 1]}, 2)


# ---------------------------------------------------------------------------------------------
# hierarchical models with hyper-latents
# ---------------------------------------------------------------------------------------------
@_zoo("hier_logistic_halfcauchy", "hierarchical", "nuts",
      "logistic regression, w ~ N(0, tau^2), tau ~ HalfCauchy(1) (N=60, 4 weights)")
def hier_logistic_halfcauchy():
    g = _gen(126)
    X = torch.randn(60, 4, generator=g, dtype=D)
    y = _bernoulli(g, X @ torch.tensor([1.2, -0.8, 0.0, 0.4], dtype=D))

    def model(X, y=None):
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(1.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), tau).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (X,), {"y": y}


@_zoo("hier_gmrf_gamma", "hierarchical", "nuts",
      "disease mapping on a 4x4 lattice, SparseGMRF with precision_scale tau ~ Gamma(2, 1)")
def hier_gmrf_gamma():
    Q = car_precision(lattice_adjacency(4, 4))
    E, y = _disease_data(127, Q, 0.3)

    def model(E, y=None):
        tau = pyro.sample("tau", dist.Gamma(torch.tensor(2.0, dtype=D), torch.tensor(1.0, dtype=D)))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        x = pyro.sample("x", pcv.distributions.SparseGMRF(_zeros(Q.shape[0]), Q, precision_scale=tau))
        with pyro.plate("regions", Q.shape[0]):
            pyro.sample("y", dist.Poisson(rate=E * torch.exp(b + x)), obs=y)

    return model, (E,), {"y": y}


ZOO["hier_gmrf_gamma"] = dataclasses.replace(ZOO["hier_gmrf_gamma"], nuts_model=_noncentred_disease("hier_gmrf_gamma"))


@_zoo("hier_gp_lengthscale", "hierarchical", "nuts",
      "GP classification, GPyTorch RBF kernel at inputs x / ell, lengthscale ell ~ LogNormal(0, 0.5) (N=25)")
def hier_gp_lengthscale():
    x, y = _gp_data(128, 25, 1, lambda x: 2.0 * torch.sin(1.5 * x[:, 0]))
    unit = gpytorch.kernels.RBFKernel().double()
    unit.lengthscale = 1.0  # set once: the kernel at x / ell is the RBF kernel of lengthscale ell

    def model(x, y=None):
        ell = pyro.sample("ell", dist.LogNormal(torch.tensor(0.0, dtype=D), torch.tensor(0.5, dtype=D)))
        K = 3.0 * unit(x / ell).to_dense() + 1e-6 * torch.eye(x.shape[0], dtype=D)
        f = pyro.sample("f", dist.MultivariateNormal(_zeros(x.shape[0]), covariance_matrix=K))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=f), obs=y)

    return model, (x,), {"y": y}


@_nuts_model_of("hier_gp_lengthscale")
def _whitened_gp_lengthscale(args, kwargs):
    """``f = L(ell) v``; the RBF kernel written out (checked against the GPyTorch kernel of the model)."""
    (x,) = args
    d2 = (x - x.T) ** 2
    eye = torch.eye(x.shape[0], dtype=D)

    def cov(ell):
        return 3.0 * torch.exp(-0.5 * d2 / ell**2) + 1e-6 * eye

    def chol(ell):
        return torch.linalg.cholesky(cov(ell))

    model, _, _ = ZOO["hier_gp_lengthscale"].builder()
    ell0 = torch.tensor(0.7, dtype=D)
    tr = poutine.trace(poutine.condition(model, data={"ell": ell0})).get_trace(*args, **kwargs)
    assert torch.allclose(tr.nodes["f"]["fn"].covariance_matrix.detach(), cov(ell0), rtol=0, atol=1e-12)

    def wmodel(x, y=None):
        ell = pyro.sample("ell", dist.LogNormal(torch.tensor(0.0, dtype=D), torch.tensor(0.5, dtype=D)))
        v = pyro.sample("v", dist.Normal(_zeros(x.shape[0]), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=chol(ell) @ v), obs=y)

    def to_sites(s):
        f = torch.stack([chol(e) @ v for e, v in zip(s["ell"].reshape(-1), s["v"])])
        return {"ell": s["ell"], "f": f}

    return wmodel, to_sites


@_zoo("linear_latent_noise", "hierarchical", "quadrature",
      "linear regression with a latent noise scale sigma ~ HalfNormal(1) (N=25, 3 weights)")
def linear_latent_noise():
    g = _gen(129)
    X = torch.randn(25, 3, generator=g, dtype=D)
    y = X @ torch.tensor([0.6, -0.9, 0.3], dtype=D) + 0.5 * torch.randn(25, generator=g, dtype=D)

    def model(X, y=None):
        sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, sigma), obs=y)

    return model, (X,), {"y": y}


@_reference_of("linear_latent_noise")
def _(args, kwargs):
    """1-D quadrature over s = log sigma of p(s | y) (w integrated out exactly); w's moments by the laws of
    total expectation and variance over the conditionally conjugate posteriors."""
    X, y = args[0], kwargs["y"]
    N, p = X.shape
    mu, V = torch.linalg.eigh(X.T @ X)
    lam, U = torch.linalg.eigh(X @ X.T)
    yu2 = (U.T @ y) ** 2
    xty = V.T @ (X.T @ y)
    s = torch.linspace(math.log(0.05), math.log(3.0), 20001, dtype=D)
    S2 = torch.exp(2 * s)[:, None]
    c = lam + S2  # eigenvalues of X X^T + sigma^2 I (prior variance 1)
    loglik = -0.5 * (torch.log(c).sum(-1) + (yu2 / c).sum(-1))
    lp = loglik + dist.HalfNormal(torch.tensor(1.0, dtype=D)).log_prob(s.exp()) + s
    wts = torch.softmax(lp, 0)
    assert float(wts[0] + wts[-1]) < 1e-12
    prec = 1.0 + mu / S2  # (G, p) posterior precision of V^T w given sigma
    mean_v = (xty / S2) / prec
    m_w = mean_v @ V.T  # (G, p)
    var_w = (V**2 / prec[:, None, :]).sum(-1)  # (G, p) diag of V diag(1/prec) V^T
    mean = (wts[:, None] * m_w).sum(0)
    var = (wts[:, None] * (var_w + m_w**2)).sum(0) - mean**2
    ms = float((wts * s).sum())
    ss = float((wts * (s - ms) ** 2).sum()) ** 0.5
    return {"sigma": {"mean": [ms], "sd": [ss]}, "w": {"mean": mean.tolist(), "sd": var.sqrt().tolist()}}


# ---------------------------------------------------------------------------------------------
# outside the latent Gaussian class
# ---------------------------------------------------------------------------------------------
@_zoo("nonaffine_cubic", "outside the class", "quadrature",
      "a non-affine predictor: logits = X @ w + 0.3 (X @ w)^3 (unimodal posterior) (N=60)")
def nonaffine_cubic():
    g = _gen(130)
    X = torch.randn(60, 2, generator=g, dtype=D)
    eta = X @ torch.tensor([0.8, -0.5], dtype=D)
    y = _bernoulli(g, eta + 0.3 * eta**3)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        eta = X @ w
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=eta + 0.3 * eta**3), obs=y)

    return model, (X,), {"y": y}


@_reference_of("nonaffine_cubic")
def _(args, kwargs):
    X, y = args[0], kwargs["y"]

    def lj(T):
        eta = T @ X.T
        return _std_normal_logpdf(T).sum(-1) + dist.Bernoulli(logits=eta + 0.3 * eta**3).log_prob(y).sum(-1)

    return quadrature(lj, {"w": [0, 1]}, 2)


@_zoo("discrete_mixture", "outside the class", "exact",
      "a discrete latent: z ~ Bernoulli(0.3), mu ~ N(0, 1), y_i ~ N(mu + 2 z, 1) (10 points)", compare=("mu",))
def discrete_mixture():
    g = _gen(131)
    y = 2.0 + 0.3 + torch.randn(10, generator=g, dtype=D)

    def model(y=None):
        z = pyro.sample("z", dist.Bernoulli(torch.tensor(0.3, dtype=D)))
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        with pyro.plate("data", 10):
            pyro.sample("y", dist.Normal(mu + 2.0 * z, 1.0), obs=y)

    return model, (), {"y": y}


@_reference_of("discrete_mixture")
def _(args, kwargs):
    y = kwargs["y"]
    n = y.shape[0]
    post_var = 1.0 / (1.0 + n)
    logw, means = [], []
    for z, pz in ((0.0, 0.7), (1.0, 0.3)):
        r = y - 2.0 * z
        # log p(y | z) with mu integrated out: N(r; 0, I + 11^T)
        C = torch.eye(n, dtype=D) + torch.ones(n, n, dtype=D)
        logw.append(math.log(pz) + float(dist.MultivariateNormal(_zeros(n), C).log_prob(r)))
        means.append(float(r.sum()) * post_var)
    w = torch.softmax(torch.tensor(logw, dtype=D), 0)
    m = float(w[0] * means[0] + w[1] * means[1])
    second = float(w[0] * (post_var + means[0] ** 2) + w[1] * (post_var + means[1] ** 2))
    return {"mu": {"mean": [m], "sd": [math.sqrt(second - m * m)]}}


@_zoo("student_t", "outside the class", "quadrature",
      "robust regression: StudentT(df=4, X @ w, 0.5) likelihood with 4 outliers (N=40)")
def student_t():
    g = _gen(132)
    X = torch.randn(40, 2, generator=g, dtype=D)
    y = X @ torch.tensor([1.0, -1.5], dtype=D) + 0.5 * torch.randn(40, generator=g, dtype=D)
    y[:4] += torch.tensor([6.0, -5.0, 8.0, -7.0], dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.StudentT(4.0, X @ w, 0.5), obs=y)

    return model, (X,), {"y": y}


@_reference_of("student_t")
def _(args, kwargs):
    X, y = args[0], kwargs["y"]

    def lj(T):
        return _std_normal_logpdf(T).sum(-1) + dist.StudentT(4.0, T @ X.T, 0.5).log_prob(y).sum(-1)

    return quadrature(lj, {"w": [0, 1]}, 2)


@_zoo("laplace_latent_scale", "outside the class", "quadrature",
      "a latent noise scale over a non-Gaussian likelihood: y ~ Laplace(x w, sigma), sigma ~ HalfNormal(1) (N=30)")
def laplace_latent_scale():
    g = _gen(133)
    x = torch.randn(30, generator=g, dtype=D)
    # Laplace(0, 0.4) noise: an exponential of random sign
    y = 0.8 * x + 0.4 * (torch.log(torch.rand(30, generator=g, dtype=D))
                         * torch.sign(torch.rand(30, generator=g, dtype=D) - 0.5))

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Laplace(x * w, sigma), obs=y)

    return model, (x,), {"y": y}


@_reference_of("laplace_latent_scale")
def _(args, kwargs):
    x, y = args[0], kwargs["y"]

    def lj(T):
        w, s = T[:, :1], T[:, 1:]
        sigma = s.exp()
        ll = dist.Laplace(w * x, sigma).log_prob(y).sum(-1)
        return (_std_normal_logpdf(w[:, 0]) + dist.HalfNormal(torch.tensor(1.0, dtype=D)).log_prob(sigma[:, 0])
                + s[:, 0] + ll)

    return quadrature(lj, {"w": [0], "sigma": [1]}, 2, box=((-3.0, 3.0), (-4.0, 2.0)))


# ---------------------------------------------------------------------------------------------
# likelihood families: negative binomial, Gamma, heteroscedastic (stochastic-volatility) noise, Laplace
# ---------------------------------------------------------------------------------------------
def _two_weight_quadrature(loglik, box=None):
    def lj(T):
        return _std_normal_logpdf(T).sum(-1) + loglik(T)

    return quadrature(lj, {"w": [0, 1]}, 2, box=box)


@_zoo("negbin", "GLM", "quadrature",
      "negative-binomial regression, log link: NegativeBinomial(total_count=3, logits=X @ w - log 3) (N=40)")
def negbin():
    g = _gen(140)
    X = torch.cat([torch.ones(40, 1, dtype=D), 0.8 * torch.randn(40, 1, generator=g, dtype=D)], 1)
    mu = torch.exp(X @ torch.tensor([1.0, -0.7], dtype=D))
    lam = mu * torch.as_tensor(np.random.default_rng(140).gamma(3.0, 1.0 / 3.0, 40), dtype=D)
    y = _poisson(g, lam)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        r = torch.tensor(3.0, dtype=D)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.NegativeBinomial(r, logits=X @ w - torch.log(r)), obs=y)

    return model, (X,), {"y": y}


@_reference_of("negbin")
def _(args, kwargs):
    X, y = args[0], kwargs["y"]
    # GammaPoisson(concentration r, rate r / mu): the same density, written independently of the NB logits
    return _two_weight_quadrature(lambda T: dist.GammaPoisson(torch.tensor(3.0, dtype=D),
                                                              3.0 * torch.exp(-(T @ X.T))).log_prob(y).sum(-1))


#: Bliss (1935): beetles killed after five hours' exposure to carbon disulphide, per dose (log10 CS2 mg/l)
BEETLES_DOSE = (1.6907, 1.7242, 1.7552, 1.7842, 1.8113, 1.8369, 1.8610, 1.8839)
BEETLES_N = (59, 60, 62, 56, 63, 59, 62, 60)
BEETLES_KILLED = (6, 13, 18, 28, 52, 53, 61, 60)
#: Racine et al. (1986), the bioassay of Gelman et al. (2013, §3.7): deaths of 5 animals at 4 log doses (g/ml)
BIOASSAY_DOSE = (-0.86, -0.30, -0.05, 0.73)
BIOASSAY_N = (5, 5, 5, 5)
BIOASSAY_DEATHS = (0, 1, 3, 5)


def _binomial_data(dose, n, k):
    x = torch.tensor(dose, dtype=D)
    X = torch.stack([torch.ones_like(x), (x - x.mean()) / x.std()], 1)
    return X, torch.tensor(n, dtype=D), torch.tensor(k, dtype=D)


def _binomial_model(X, total, y=None):
    w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 2.5).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Binomial(total_count=total, logits=X @ w), obs=y)


def _binomial_reference(args, kwargs):
    X, total, y = args[0], args[1], kwargs["y"]

    def lj(T):  # the binomial log-likelihood written out: k eta - n log(1 + e^eta) + log C(n, k)
        eta = T @ X.T
        c = torch.lgamma(total + 1) - torch.lgamma(y + 1) - torch.lgamma(total - y + 1)
        return (_std_normal_logpdf(T, 2.5).sum(-1)
                + (y * eta - total * torch.nn.functional.softplus(eta) + c).sum(-1))

    return quadrature(lj, {"w": [0, 1]}, 2)


@_zoo("binomial_beetles", "GLM", "quadrature",
      "Binomial(total_count=n, logits=X @ w): beetle mortality against dose (Bliss 1935; 8 doses, 481 beetles), "
      "standardised dose, w ~ N(0, 2.5^2)")
def binomial_beetles():
    X, total, y = _binomial_data(BEETLES_DOSE, BEETLES_N, BEETLES_KILLED)
    return _binomial_model, (X, total), {"y": y}


@_zoo("binomial_bioassay", "GLM", "quadrature",
      "Binomial(total_count=5, logits=X @ w): the bioassay of Gelman et al. (2013, §3.7; 4 doses, 20 animals), "
      "standardised log dose, w ~ N(0, 2.5^2): few rows, a skewed posterior")
def binomial_bioassay():
    X, total, y = _binomial_data(BIOASSAY_DOSE, BIOASSAY_N, BIOASSAY_DEATHS)
    return _binomial_model, (X, total), {"y": y}


_reference_of("binomial_beetles")(_binomial_reference)
_reference_of("binomial_bioassay")(_binomial_reference)


@_zoo("gamma_regression", "GLM", "quadrature",
      "Gamma regression, log link: Gamma(2, rate=2 exp(-X @ w)) (N=40)")
def gamma_regression():
    g = _gen(141)
    X = torch.cat([torch.ones(40, 1, dtype=D), torch.randn(40, 1, generator=g, dtype=D)], 1)
    mu = torch.exp(X @ torch.tensor([0.5, -0.8], dtype=D))
    y = mu * torch.as_tensor(np.random.default_rng(141).gamma(2.0, 0.5, 40), dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Gamma(torch.tensor(2.0, dtype=D), 2.0 * torch.exp(-(X @ w))), obs=y)

    return model, (X,), {"y": y}


@_reference_of("gamma_regression")
def _(args, kwargs):
    X, y = args[0], kwargs["y"]
    return _two_weight_quadrature(lambda T: dist.Gamma(torch.tensor(2.0, dtype=D),
                                                       2.0 / torch.exp(T @ X.T)).log_prob(y).sum(-1))


@_zoo("heteroscedastic", "GLM", "quadrature",
      "heteroscedastic noise around a known mean: Normal(0.3, exp(X @ w / 2)), the stochastic-volatility site (N=40)")
def heteroscedastic():
    g = _gen(142)
    X = torch.stack([torch.ones(40, dtype=D), torch.linspace(-1.5, 1.5, 40, dtype=D)], 1)
    y = 0.3 + torch.exp(X @ torch.tensor([-0.5, 1.2], dtype=D) / 2) * torch.randn(40, generator=g, dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(0.3, torch.exp(X @ w / 2)), obs=y)

    return model, (X,), {"y": y}


@_reference_of("heteroscedastic")
def _(args, kwargs):
    X, y = args[0], kwargs["y"]
    return _two_weight_quadrature(lambda T: dist.Normal(0.3, torch.exp(T @ X.T / 2)).log_prob(y).sum(-1))


@_zoo("laplace_regression", "GLM", "quadrature",
      "robust regression: Laplace(X @ w, 0.5) likelihood with 3 outliers (N=30)")
def laplace_regression():
    g = _gen(143)
    X = torch.cat([torch.ones(30, 1, dtype=D), torch.randn(30, 1, generator=g, dtype=D)], 1)
    y = X @ torch.tensor([0.5, -1.0], dtype=D) + 0.5 * torch.randn(30, generator=g, dtype=D)
    y[:3] += torch.tensor([5.0, -4.0, 6.0], dtype=D)

    def model(X, y=None):
        w = pyro.sample("w", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Laplace(X @ w, 0.5), obs=y)

    return model, (X,), {"y": y}


@_reference_of("laplace_regression")
def _(args, kwargs):
    X, y = args[0], kwargs["y"]
    return _two_weight_quadrature(lambda T: dist.Laplace(T @ X.T, 0.5).log_prob(y).sum(-1))


@_zoo("negbin_latent_concentration", "hierarchical", "quadrature",
      "negative-binomial regression with a hyper-latent concentration: r ~ Gamma(2, 0.5), "
      "y ~ NegativeBinomial(r, logits=0.5 + x w - log r) (N=80)")
def negbin_latent_concentration():
    g = _gen(144)
    x = 0.8 * torch.randn(80, generator=g, dtype=D)
    mu = torch.exp(0.5 + 0.7 * x)
    y = _poisson(g, mu * torch.as_tensor(np.random.default_rng(144).gamma(4.0, 0.25, 80), dtype=D))

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        r = pyro.sample("r", dist.Gamma(torch.tensor(2.0, dtype=D), 0.5))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.NegativeBinomial(r, logits=0.5 + x * w - torch.log(r)), obs=y)

    return model, (x,), {"y": y}


@_reference_of("negbin_latent_concentration")
def _(args, kwargs):
    x, y = args[0], kwargs["y"]

    def lj(T):
        w, s = T[:, :1], T[:, 1:]
        r = s.exp()
        ll = dist.GammaPoisson(r, r * torch.exp(-(0.5 + w * x))).log_prob(y).sum(-1)
        return (_std_normal_logpdf(w[:, 0]) + dist.Gamma(torch.tensor(2.0, dtype=D), 0.5).log_prob(r[:, 0])
                + s[:, 0] + ll)

    return quadrature(lj, {"w": [0], "r": [1]}, 2, box=((-2.0, 3.0), (-2.0, 5.0)))


@_zoo("student_t_latent_scale", "hierarchical", "quadrature",
      "robust regression with a hyper-latent scale: s ~ HalfNormal(1), y ~ StudentT(4, x w, s), 3 outliers (N=30)")
def student_t_latent_scale():
    g = _gen(145)
    x = torch.randn(30, generator=g, dtype=D)
    y = 0.8 * x + 0.4 * torch.randn(30, generator=g, dtype=D)
    y[:3] += torch.tensor([4.0, -5.0, 6.0], dtype=D)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, dtype=D)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.StudentT(4.0, x * w, s), obs=y)

    return model, (x,), {"y": y}


@_reference_of("student_t_latent_scale")
def _(args, kwargs):
    x, y = args[0], kwargs["y"]

    def lj(T):
        w, ls = T[:, :1], T[:, 1:]
        s = ls.exp()
        ll = dist.StudentT(4.0, w * x, s).log_prob(y).sum(-1)
        return (_std_normal_logpdf(w[:, 0]) + dist.HalfNormal(torch.tensor(1.0, dtype=D)).log_prob(s[:, 0])
                + ls[:, 0] + ll)

    return quadrature(lj, {"w": [0], "s": [1]}, 2, box=((-3.0, 3.0), (-4.0, 2.0)), width=20.0)


def ar1_precision(T, phi, s):
    """Sparse tridiagonal precision of a stationary AR(1) ``h_t = phi h_{t-1} + s eps_t`` (COO)."""
    diag = torch.full((T,), (1 + phi ** 2) / s ** 2, dtype=D)
    diag[0] = diag[-1] = 1 / s ** 2
    i = torch.arange(T - 1)
    rows = torch.cat([torch.arange(T), i, i + 1])
    cols = torch.cat([torch.arange(T), i + 1, i])
    vals = torch.cat([diag, torch.full((2 * (T - 1),), -phi / s ** 2, dtype=D)])
    return torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (T, T)).coalesce()


@_zoo("stochastic_volatility", "GMRF", "nuts",
      "stochastic volatility: h ~ AR(1) (phi 0.9, innovation sd 0.4) as a SparseGMRF, y_t ~ Normal(0, exp(h_t / 2)) "
      "(T=40)")
def stochastic_volatility():
    T, phi, s = 40, 0.9, 0.4
    g = _gen(146)
    Q = ar1_precision(T, phi, s)
    L = torch.linalg.cholesky(Q.to_dense())
    h = torch.linalg.solve_triangular(L.T, torch.randn(T, 1, generator=g, dtype=D), upper=True).reshape(T)
    y = torch.exp(h / 2) * torch.randn(T, generator=g, dtype=D)

    def model(y=None):
        h = pyro.sample("h", pcv.distributions.SparseGMRF(_zeros(T), Q))
        with pyro.plate("time", T):
            pyro.sample("y", dist.Normal(0.0, torch.exp(h / 2)), obs=y)

    return model, (), {"y": y}


@_nuts_model_of("stochastic_volatility")
def _whitened_sv(args, kwargs):
    """``h = L^{-T} v`` with ``Q = L L^T`` dense and ``v ~ N(0, I)``: the same posterior of ``h``."""
    T = kwargs["y"].shape[0]
    L = torch.linalg.cholesky(ar1_precision(T, 0.9, 0.4).to_dense())

    def field(v):
        return torch.linalg.solve_triangular(L.T, v.reshape(-1, T).T, upper=True).T

    def wmodel(y=None):
        v = pyro.sample("v", dist.Normal(_zeros(T), 1.0).to_event(1))
        h = field(v).reshape(T)
        with pyro.plate("time", T):
            pyro.sample("y", dist.Normal(0.0, torch.exp(h / 2)), obs=y)

    return wmodel, lambda smp: {"h": field(smp["v"])}


# ---------------------------------------------------------------------------------------------
# affine Gaussian chains (centred and non-centred twins) and intrinsic GMRFs
# ---------------------------------------------------------------------------------------------
_RI_J, _RI_SIGMA = 6, 0.7


def _ri_data(seed, lik):
    g = _gen(seed)
    N = 48
    grp = torch.arange(N) % _RI_J
    X = torch.randn(N, 1, generator=g, dtype=D)
    alpha = 0.3 + _RI_SIGMA * torch.randn(_RI_J, generator=g, dtype=D)
    eta = alpha[grp] + 0.8 * X[:, 0]
    y = eta + 0.5 * torch.randn(N, generator=g, dtype=D) if lik == "normal" else _bernoulli(g, eta)
    return X, grp, y


def _ri_model(centred, lik):
    def model(X, grp, y=None):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 2.0))
        b = pyro.sample("b", dist.Normal(_zeros(X.shape[1]), 1.0).to_event(1))
        with pyro.plate("groups", _RI_J):
            if centred:
                alpha = pyro.sample("alpha", dist.Normal(mu, _RI_SIGMA))
            else:
                alpha = mu + _RI_SIGMA * pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        eta = alpha[grp] + X @ b
        with pyro.plate("data", X.shape[0]):
            if lik == "normal":
                pyro.sample("y", dist.Normal(eta, 0.5), obs=y)
            else:
                pyro.sample("y", dist.Bernoulli(logits=eta), obs=y)

    return model


def _ri_exact(centred):
    """Exact posterior of the Gaussian random-intercept model: conjugate in the non-centred coordinates
    (mu, b, z) (independent priors), mapped linearly to (mu, b, alpha) for the centred form."""

    def ref(args, kwargs):
        X, grp, y = args[0], args[1], kwargs["y"]
        N, p = X.shape
        B = torch.zeros(N, 1 + p + _RI_J, dtype=D)
        B[:, 0] = 1.0
        B[:, 1:1 + p] = X
        B[torch.arange(N), 1 + p + grp] = _RI_SIGMA
        prior_var = torch.cat([torch.tensor([4.0], dtype=D), torch.ones(p + _RI_J, dtype=D)])
        m, C = conjugate_gaussian(B, y, prior_var, 0.25)
        if centred:
            T = torch.eye(1 + p + _RI_J, dtype=D)
            T[1 + p:, 0] = 1.0
            T[1 + p:, 1 + p:] *= _RI_SIGMA
            m, C = T @ m, T @ C @ T.T
        sd = C.diagonal().sqrt()
        last = "alpha" if centred else "z"
        return _summary({"mu": [0], "b": list(range(1, 1 + p)), last: list(range(1 + p, 1 + p + _RI_J))}, m, sd)

    return ref


@_zoo("ri_centred_gaussian", "affine chains", "exact",
      "random intercepts, centred: mu ~ N(0, 2^2), alpha_j ~ N(mu, 0.7^2), y ~ N(alpha[g] + x b, 0.5^2) (6 groups, "
      "N=48)", gaussian=True)
def ri_centred_gaussian():
    X, grp, y = _ri_data(140, "normal")
    return _ri_model(True, "normal"), (X, grp), {"y": y}


@_zoo("ri_noncentred_gaussian", "affine chains", "exact",
      "the same model non-centred: alpha = mu + 0.7 z, z_j ~ N(0, 1)", gaussian=True)
def ri_noncentred_gaussian():
    X, grp, y = _ri_data(140, "normal")
    return _ri_model(False, "normal"), (X, grp), {"y": y}


ZOO["ri_centred_gaussian"] = dataclasses.replace(ZOO["ri_centred_gaussian"], reference_fn=_ri_exact(True))
ZOO["ri_noncentred_gaussian"] = dataclasses.replace(ZOO["ri_noncentred_gaussian"], reference_fn=_ri_exact(False))


@_zoo("ri_centred_logistic", "affine chains", "nuts",
      "random intercepts, centred: alpha_j ~ N(mu, 0.7^2), y ~ Bernoulli(logits=alpha[g] + x b) (6 groups, N=48)")
def ri_centred_logistic():
    X, grp, y = _ri_data(141, "bernoulli")
    return _ri_model(True, "bernoulli"), (X, grp), {"y": y}


@_zoo("ri_noncentred_logistic", "affine chains", "nuts", "the same model non-centred: alpha = mu + 0.7 z")
def ri_noncentred_logistic():
    X, grp, y = _ri_data(141, "bernoulli")
    return _ri_model(False, "bernoulli"), (X, grp), {"y": y}


_EIGHT_Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], dtype=D)
_EIGHT_S = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], dtype=D)


def _eight_model(centred):
    def model(s, y=None):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=D), 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(5.0, dtype=D)))
        with pyro.plate("schools", s.shape[0]):
            if centred:
                theta = pyro.sample("theta", dist.Normal(mu, tau))
            else:
                theta = mu + tau * pyro.sample("z", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
            pyro.sample("y", dist.Normal(theta, s), obs=y)

    return model


def _eight_exact(centred):
    """1-D quadrature over t = log tau; given tau the field is conjugate Gaussian (mu and theta, or mu and z), its
    moments mixed by the laws of total expectation and variance."""

    def ref(args, kwargs):
        s, y = args[0], kwargs["y"]
        J = y.shape[0]
        t = torch.linspace(math.log(1e-9), math.log(1e5), 30001, dtype=D)
        tau = t.exp()
        G = t.shape[0]
        # non-centred coordinates (mu, z) given tau: y = mu + tau z + noise s (batched over the grid)
        B = torch.zeros(G, J, J + 1, dtype=D)
        B[:, :, 0] = 1.0
        B[:, torch.arange(J), 1 + torch.arange(J)] = tau[:, None]
        P0 = torch.diag(torch.cat([torch.tensor([1 / 25.0], dtype=D), torch.ones(J, dtype=D)]))
        P = P0 + B.transpose(1, 2) @ (B / (s**2)[None, :, None])
        C = torch.linalg.inv(P)
        M = (C @ (B.transpose(1, 2) @ (y / s**2)[None, :, None]))[..., 0]
        if centred:
            T = torch.eye(J + 1, dtype=D).repeat(G, 1, 1)
            T[:, 1:, 0] = 1.0
            T[:, 1 + torch.arange(J), 1 + torch.arange(J)] = tau[:, None]
            M = (T @ M[..., None])[..., 0]
            C = T @ C @ T.transpose(1, 2)
        V = C.diagonal(dim1=1, dim2=2)
        cov_y = 25.0 + torch.diag_embed(tau[:, None] ** 2 + s**2)
        L = dist.MultivariateNormal(torch.zeros(J, dtype=D), cov_y).log_prob(y)
        lp = L + dist.HalfCauchy(torch.tensor(5.0, dtype=D)).log_prob(tau) + t
        w = torch.softmax(lp, 0)
        assert float(w[0] + w[-1]) < 1e-10
        mean = (w[:, None] * M).sum(0)
        var = (w[:, None] * (V + M**2)).sum(0) - mean**2
        mt = float((w * t).sum())
        st = float((w * (t - mt) ** 2).sum()) ** 0.5
        out = _summary({"mu": [0], "theta" if centred else "z": list(range(1, J + 1))}, mean, var.sqrt())
        out["tau"] = {"mean": [mt], "sd": [st]}
        return out

    return ref


@_zoo("eight_schools_centred", "affine chains", "quadrature",
      "eight schools, centred: theta_j ~ N(mu, tau), tau ~ HalfCauchy(5) (a hyper-latent), y_j ~ N(theta_j, s_j)")
def eight_schools_centred():
    return _eight_model(True), (_EIGHT_S,), {"y": _EIGHT_Y}


@_zoo("eight_schools_noncentred", "affine chains", "quadrature", "the same model non-centred: theta = mu + tau z")
def eight_schools_noncentred():
    return _eight_model(False), (_EIGHT_S,), {"y": _EIGHT_Y}


ZOO["eight_schools_centred"] = dataclasses.replace(ZOO["eight_schools_centred"], reference_fn=_eight_exact(True))
ZOO["eight_schools_noncentred"] = dataclasses.replace(ZOO["eight_schools_noncentred"], reference_fn=_eight_exact(False))

_AR_T, _AR_PHI, _AR_S = 10, 0.8, 0.5


@_zoo("ar1_loop", "affine chains", "exact",
      "AR(1) written as a loop: h_t ~ N(0.8 h_{t-1}, 0.5^2) (stationary start), y_t ~ N(h_t, 0.3^2) (T=10)",
      gaussian=True)
def ar1_loop():
    y = torch.randn(_AR_T, generator=_gen(142), dtype=D)

    def model(y=None):
        h = pyro.sample("h_0", dist.Normal(torch.tensor(0.0, dtype=D), _AR_S / math.sqrt(1 - _AR_PHI**2)))
        hs = [h]
        for k in range(1, _AR_T):
            h = pyro.sample(f"h_{k}", dist.Normal(_AR_PHI * h, _AR_S))
            hs.append(h)
        pyro.sample("y", dist.Normal(torch.stack(hs), 0.3).to_event(1), obs=y)

    return model, (), {"y": y}


@_reference_of("ar1_loop")
def _(args, kwargs):
    y = kwargs["y"]
    T = _AR_T
    L = torch.eye(T, dtype=D) - _AR_PHI * torch.diag(torch.ones(T - 1, dtype=D), -1)
    S = torch.full((T,), _AR_S**2, dtype=D)
    S[0] = _AR_S**2 / (1 - _AR_PHI**2)
    Q = L.T @ torch.diag(1 / S) @ L + torch.eye(T, dtype=D) / 0.09
    C = torch.linalg.inv(Q)
    m = C @ (y / 0.09)
    return _summary({f"h_{k}": [k] for k in range(T)}, m, C.diagonal().sqrt())


def _rw1_data():
    n = 12
    g = _gen(143)
    y = 0.5 + torch.sin(torch.arange(n, dtype=D) / 2) + 0.4 * torch.randn(n, generator=g, dtype=D)
    return n, y


@_zoo("rw1_intrinsic", "affine chains", "exact",
      "intrinsic RW1 trend, sum-to-zero, BYM2-scaled precision 4 c Q_RW1, plus an intercept; y_t ~ N(b0 + x_t, 0.4^2)"
      " (T=12)", gaussian=True)
def rw1_intrinsic():
    n, y = _rw1_data()
    Q = pcv.distributions.rw_precision(n)
    c = pcv.distributions.bym2_scaling(Q)

    def model(y=None):
        b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 3.0))
        x = pyro.sample("x", pcv.distributions.SparseGMRF(_zeros(n), Q, torch.tensor(4.0 * c, dtype=D),
                                                          constraints="sum_to_zero"))
        pyro.sample("y", dist.Normal(b0 + x, 0.4).to_event(1), obs=y)

    return model, (), {"y": y}


@_reference_of("rw1_intrinsic")
def _(args, kwargs):
    """Exact, in an orthonormal basis V of the sum-to-zero subspace (the eigenvectors of Q_RW1 with nonzero
    eigenvalues): x = V z, z ~ N(0, diag(4 c lambda)^{-1})."""
    y = kwargs["y"]
    n = y.shape[0]
    Q = pcv.distributions.rw_precision(n).to_dense()
    c = float(torch.linalg.pinv(Q).diagonal().log().mean().exp())
    lam, U = torch.linalg.eigh(Q)
    V = U[:, 1:]
    B = torch.cat([torch.ones(n, 1, dtype=D), V], 1)
    m, C = conjugate_gaussian(B, y, torch.cat([torch.tensor([9.0], dtype=D), 1 / (4 * c * lam[1:])]), 0.16)
    T = torch.block_diag(torch.eye(1, dtype=D), V)
    m, C = T @ m, T @ C @ T.T
    return _summary({"b0": [0], "x": list(range(1, n + 1))}, m, C.diagonal().sqrt())


_BYM_ROWS = _BYM_COLS = 4
_BYM_TAU, _BYM_SIGMA_V = 2.0, 0.3


@_zoo("bym_icar", "affine chains", "nuts",
      "BYM disease mapping: intrinsic CAR field (4x4 lattice, sum-to-zero, BYM2-scaled precision 2 c Q_ICAR) plus "
      "iid effects N(0, 0.3^2) and an intercept; Poisson counts with exposure")
def bym_icar():
    n = _BYM_ROWS * _BYM_COLS
    Q = pcv.distributions.icar_precision(lattice_adjacency(_BYM_ROWS, _BYM_COLS))
    c = pcv.distributions.bym2_scaling(Q)
    g = _gen(144)
    E = 3.0 + 7.0 * torch.rand(n, generator=g, dtype=D)
    s = torch.sin(torch.arange(n, dtype=D) / 3)
    s = 0.6 * (s - s.mean())
    y = _poisson(g, E * torch.exp(0.1 + s + _BYM_SIGMA_V * torch.randn(n, generator=g, dtype=D)))

    def model(E, y=None):
        b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        s = pyro.sample("s", pcv.distributions.SparseGMRF(_zeros(n), Q, torch.tensor(_BYM_TAU * c, dtype=D),
                                                          constraints="sum_to_zero"))
        with pyro.plate("areas", n):
            v = pyro.sample("v", dist.Normal(torch.tensor(0.0, dtype=D), _BYM_SIGMA_V))
            pyro.sample("y", dist.Poisson(E * torch.exp(b0 + s + v)), obs=y)

    return model, (E,), {"y": y}


@_nuts_model_of("bym_icar")
def _bym_icar_whitened(args, kwargs):
    """``s = V diag(tau c lambda)^{-1/2} z`` with ``Q_ICAR = U diag(lambda) U^T`` and ``V`` the eigenvectors of the
    nonzero eigenvalues (the sum-to-zero subspace), ``z ~ N(0, I)``; ``v = 0.3 e``: the same posterior, written
    with a dense eigendecomposition independent of ``SparseGMRF``."""
    (E,) = args
    n = E.shape[0]
    Q = lattice_adjacency(_BYM_ROWS, _BYM_COLS)
    Q = torch.diag(Q.sum(1)) - Q
    lam, U = torch.linalg.eigh(Q)
    c = float(torch.linalg.pinv(Q).diagonal().log().mean().exp())
    T = U[:, 1:] / (_BYM_TAU * c * lam[1:]).sqrt()

    def model(E, y=None):
        b0 = pyro.sample("b0", dist.Normal(torch.tensor(0.0, dtype=D), 1.0))
        z = pyro.sample("z", dist.Normal(_zeros(n - 1), 1.0).to_event(1))
        e = pyro.sample("e", dist.Normal(_zeros(n), 1.0).to_event(1))
        with pyro.plate("areas", n):
            pyro.sample("y", dist.Poisson(E * torch.exp(b0 + T @ z + _BYM_SIGMA_V * e)), obs=y)

    return model, lambda s: {"b0": s["b0"], "s": s["z"] @ T.T, "v": _BYM_SIGMA_V * s["e"]}


# ---------------------------------------------------------------------------------------------
# softmax (multinomial-logit) regression: Categorical(logits=X @ W), vector sites of K logits per row
# ---------------------------------------------------------------------------------------------
def _iris():
    """Fisher's iris (scikit-learn ships it): 150 rows, an intercept column and the 4 standardised features;
    classes 0, 1, 2."""
    from sklearn.datasets import load_iris

    data = load_iris()
    F = torch.as_tensor(data.data, dtype=D)
    F = (F - F.mean(0)) / F.std(0)
    X = torch.cat([torch.ones(F.shape[0], 1, dtype=D), F], 1)
    return X, torch.as_tensor(data.target, dtype=torch.long)


@_zoo("softmax_iris", "GLM", "nuts",
      "softmax regression on iris: W ~ N(0, 1) (5 x 3), y ~ Categorical(logits=X @ W) (N=150, K=3)")
def softmax_iris():
    X, y = _iris()

    def model(X, y=None):
        W = pyro.sample("W", dist.Normal(torch.zeros(X.shape[1], 3, dtype=D), 1.0).to_event(2))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Categorical(logits=X @ W), obs=y)

    return model, (X,), {"y": y}


@_zoo("softmax_iris_reference_class", "GLM", "nuts",
      "softmax regression on iris, last class as reference: W ~ N(0, 1) (5 x 2), "
      "y ~ Categorical(logits=[X @ W, 0]) (N=150, K=3)")
def softmax_iris_reference_class():
    X, y = _iris()

    def model(X, y=None):
        W = pyro.sample("W", dist.Normal(torch.zeros(X.shape[1], 2, dtype=D), 1.0).to_event(2))
        logits = torch.cat([X @ W, torch.zeros(X.shape[0], 1, dtype=D)], -1)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Categorical(logits=logits), obs=y)

    return model, (X,), {"y": y}
