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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep ``--dist loadgroup`` grouping on pytest >= 9.

    pytest-xdist (3.8) groups the tests marked ``xdist_group(name)`` by appending ``@name`` to their node ids on
    each worker, by assigning ``item._nodeid``. pytest 9 keeps node ids in a structured ``item._id`` and ignores
    that attribute, so the suffix is lost and every grouped test is scheduled on its own (pytest-xdist issue
    #1386): the torchrun launch of ``tests/distributed`` then ran once on each worker. This hook, run after
    xdist's, adds the suffix where it is missing; on older pytest xdist's own suffix is already there.
    """
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        if not names:
            continue
        suffix = "@" + "_".join(sorted(names))
        if item.nodeid.endswith(suffix):
            continue
        node_id = getattr(item, "_id", None)
        if node_id is not None and not isinstance(node_id, str) and hasattr(type(node_id), "parse"):
            item._id = type(node_id).parse(item.nodeid + suffix)
        else:
            item._nodeid = item.nodeid + suffix
        if not item.nodeid.endswith(suffix):  # a pytest whose node ids take neither: grouping is lost, not results
            warnings.warn(f"tests/conftest.py: cannot add the xdist group suffix {suffix!r} on pytest "
                          f"{pytest.__version__}; grouped tests are scheduled one by one (tests/distributed still "
                          f"launches torchrun once: its fixture holds a lock across workers)", pytest.PytestWarning)
            return
