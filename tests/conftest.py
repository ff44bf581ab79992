import os
import warnings

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
# small dense problems: one intra-op thread avoids oversubscription on the 2-core CI machine
torch.set_num_threads(1)
try:  # numpy/scipy BLAS too (threadpoolctl comes with scikit-learn, a test dependency)
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(autouse=True)
def _seed_and_dtype():
    """Every test starts from a fixed seed; tests choose float64 explicitly."""
    import pyro

    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    old = torch.get_default_dtype()
    yield
    torch.set_default_dtype(old)


def pytest_configure(config):
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
