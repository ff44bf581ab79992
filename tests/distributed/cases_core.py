"""Distributed cases of the core: operator products, readers and generators, convex_relaxation, laplace,
GLM / BayesianLogisticRegression. Each ``case_*(rank, world_size)`` builds this rank's rows (all rows when
``world_size == 1``) and returns float64 results that must equal the single-process ones."""
import torch

import pyro_convexvb as pcv
from pyro_convexvb.distributed import row_sharded, shard_range


def _problem(rank, world, q=90, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(q, n, generator=g, dtype=torch.float64)
    X = X * (torch.rand(q, n, generator=g, dtype=torch.float64) < 0.4)
    w = torch.randn(n, generator=g, dtype=torch.float64)
    y = (torch.rand(q, generator=g, dtype=torch.float64) < torch.sigmoid(X @ w)).to(torch.float64)
    a, b = shard_range(q, rank, world)
    return X[a:b], y[a:b]


def case_operator_products(rank, world):
    X, y = _problem(rank, world)
    Xs = row_sharded(X.to_sparse_csr())
    v = torch.linspace(-1, 1, X.shape[1], dtype=torch.float64, requires_grad=True)
    out = {"rmv": Xs.rmv(y), "rmv_sq": Xs.squared().rmv(y), "global_rows": Xs.global_rows}
    # the gradient of a replicated latent through the local rows is the global one, and so is its Hessian
    loss = torch.nn.functional.softplus(pcv.linear(Xs, v)).sum()
    g, = torch.autograd.grad(loss, v, create_graph=True)
    out["grad"] = g.detach()
    out["hvp"] = torch.autograd.grad(g @ torch.ones_like(g), v)[0]
    return out
