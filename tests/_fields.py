"""A Poisson count model on a large sparse lattice field, shared by the tests of what must stay sparse."""
import numpy as np
import pyro
import pyro.distributions as dist
import scipy.sparse as sp
import torch

import pyro_convexvb as pcv


def poisson_lattice(m, ridge):
    """``(model, y)``: a ``SparseGMRF`` over an ``m x m`` lattice with precision ``Laplacian + ridge I`` and Poisson
    counts of mean 3 (seeded); ``model(y=None)``."""
    step = sp.diags([1.0, 1.0], [-1, 1], shape=(m, m))
    Q = (sp.diags([4.0 + ridge] * (m * m)) - sp.kron(sp.eye(m), step) - sp.kron(step, sp.eye(m))).tocoo()
    Qt = torch.sparse_coo_tensor(np.vstack([Q.row, Q.col]), Q.data, Q.shape, dtype=torch.float64).coalesce()
    y = torch.poisson(torch.full((m * m,), 3.0, dtype=torch.float64), generator=torch.Generator().manual_seed(0))

    def model(y=None):
        f = pyro.sample("f", pcv.distributions.SparseGMRF(torch.zeros(m * m, dtype=torch.float64), Qt))
        with pyro.plate("d", m * m):
            pyro.sample("y", dist.Poisson(torch.exp(f)), obs=y)

    return model, y
