"""The collectives of :mod:`pyro_convexvb.distributed` on one process: the reductions are the local values, the
autograd pair is the identity with its gradient, and a model's row-sharded argument is found where the engines
look for it. (Two processes: ``tests/distributed/cases_core.py::case_collectives``.)"""

import pytest
import torch

import pyro_convexvb as pcv
from pyro_convexvb import distributed
from pyro_convexvb.infer.result import InferenceResult

D = torch.float64


def _vectors():
    g = torch.Generator().manual_seed(0)
    return torch.randn(7, generator=g, dtype=D), torch.randn(7, generator=g, dtype=D)


@pytest.mark.parametrize("red", [distributed.LOCAL, distributed.WORLD], ids=["LOCAL", "WORLD"])
def test_reductions_of_one_process_are_the_local_values(red):
    a, b = _vectors()
    assert red.dot(a, b) == float(a @ b) and isinstance(red.dot(a, b), float)
    assert red.norm(a) == pytest.approx(float(a.norm()), rel=1e-15)
    assert torch.equal(red.sum(a), a) and red.sum(2.5) == 2.5
    assert red.min(-1.5) == -1.5 and red.max(3.0) == 3.0
    assert red.all(True) is True and red.all(False) is False
    assert red.count(7) == 7 and (red.rank, red.world_size) == (0, 1)
    assert red.active is (red is distributed.WORLD)


def test_reduction_of_reads_the_comm_attribute():
    class Backend:
        comm = None

    assert distributed.reduction_of(Backend()) is distributed.LOCAL
    Backend.comm = distributed.WORLD
    assert distributed.reduction_of(Backend()) is distributed.WORLD
    assert distributed.reduce_sites(None, 1.25) == 1.25


def test_autograd_pair_is_the_identity_with_its_derivatives():
    z = torch.tensor([0.3, -1.2], dtype=D, requires_grad=True)
    F = distributed.sum_over_ranks(torch.nn.functional.softplus(distributed.enter_local(z) * 2.0).sum())
    g, = torch.autograd.grad(F, z, create_graph=True)
    torch.testing.assert_close(g, 2.0 * torch.sigmoid(2.0 * z), rtol=1e-15, atol=0)
    h, = torch.autograd.grad(g.sum(), z)
    s = torch.sigmoid(2.0 * z)
    torch.testing.assert_close(h, 4.0 * s * (1 - s), rtol=1e-14, atol=0)
    assert distributed.all_reduce_sum(F) is F


def test_all_reduce_grads_leaves_one_process_alone():
    p = torch.ones(3, dtype=D, requires_grad=True)
    q = torch.ones(2, dtype=D, requires_grad=True)
    (2.0 * p).sum().backward()
    distributed.all_reduce_grads([p, q])
    assert p.grad.tolist() == [2.0, 2.0, 2.0] and q.grad is None
    distributed.all_reduce_grads([])


def test_find_comm_looks_into_list_tuple_and_dict_arguments(monkeypatch):
    """Every engine finds a model's row-sharded design where SVI's sharding looks for it: an argument, or an
    element of a list, tuple or dict argument (two levels below ``(args, kwargs)``)."""
    Xs = distributed.row_sharded(torch.ones(3, 2, dtype=D))
    y = torch.ones(3, dtype=D)
    assert distributed.find_comm((Xs,), {"y": y}) is None  # no process group: nothing to reduce
    monkeypatch.setattr(distributed, "is_active", lambda: True)
    assert distributed.find_comm((Xs,), {"y": y}) is Xs.comm
    assert distributed.find_comm(([Xs, y],), {}) is Xs.comm
    assert distributed.find_comm((), {"designs": {"a": Xs}}) is Xs.comm
    assert distributed.find_comm((y,), {"y": (y, y)}) is None
    assert distributed.find_comm(([[Xs]],), {}) is None  # three levels down: not a model's argument


def test_stored_info_lists_what_was_left_out():
    """``InferenceResult.info_to_store`` (``compact``, ``pcv.save``) keeps what the conversion accepts and lists the
    rest, with what an earlier copy had left out, under ``info["dropped"]``."""
    q = pcv.GaussianPosterior(torch.zeros(2, dtype=D), torch.ones(2, dtype=D))
    r = InferenceResult(q, -1.0, info={"site_var": torch.ones(5), "steps": 3, "dropped": ["lanczos"]})
    assert r.info_to_store() == {"steps": 3, "dropped": ["lanczos", "site_var"]}

    def only_numbers(key, value):
        if not isinstance(value, int):
            raise TypeError(key)
        return 10 * value

    assert r.info_to_store(only_numbers, ["hyper"]) == {"steps": 30, "dropped": ["hyper", "lanczos", "site_var"]}
    assert r.compact().info == {"steps": 3, "dropped": ["lanczos", "site_var"]}
    assert "dropped" in r.info and r.info["site_var"].shape == (5,)  # the result itself is unchanged


def test_init_destroys_the_group_it_made_at_exit(monkeypatch):
    """A process group left to the interpreter's exit aborted a gloo rank after a right fit in 2 of 6 two-rank runs
    of the docs' torchrun snippet: init() registers the teardown of the group it makes (and only of that group),
    and the teardown leaves no group behind."""
    import atexit
    import socket

    import torch.distributed as tdist

    if not tdist.is_available() or tdist.is_initialized():
        pytest.skip("torch.distributed unavailable, or a group is already set up in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    try:
        assert distributed.init("gloo") == (0, 1)
        assert registered == [distributed._destroy]
        assert distributed.init("gloo") == (0, 1) and len(registered) == 1  # an existing group: nothing more
    finally:
        distributed._destroy()
    assert not tdist.is_initialized()
    distributed._destroy()  # no group: nothing to do
