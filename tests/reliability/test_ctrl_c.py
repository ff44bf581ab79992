"""Ctrl-C (SIGINT) during learning, in a child process.

* during a long ``pcv.fit``: ``KeyboardInterrupt`` reaches the caller, and the caller's Pyro param store,
  Pyro's handler stack, torch's grad mode and default dtype are as before; a new fit then works;
* during ``OnlineBayesLogistic.partial_fit(fast=False)`` on a large chunk: the learner's state is the one
  before the chunk (a chunk is applied whole or not at all), so re-feeding the chunk does not count rows twice.
"""
import json
import signal
import sys
import time

import pytest

from ._util import read_line, start_child, stop_child

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process needs POSIX signals")

_FIT = r"""
import json, sys, numpy as np, pyro, pyro.distributions as dist, torch
import pyro_convexvb as pcv
from pyro.poutine.runtime import _PYRO_STACK

def model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)

rng = np.random.default_rng(0)
X = torch.from_numpy(rng.normal(size=(2000, 20)))
y = (X[:, 0] > 0).double()
user = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
pyro.param("my_param", user.clone())
pyro.param("AutoNormal.locs.w", torch.full((20,), 7.0, dtype=torch.float64))  # a user's own guide entry
before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
# torch imports torch._dynamo lazily at the first optimizer; a SIGINT inside that import leaves torch half
# imported (torch's own state, not ours), so the child takes it before the interrupt window opens
torch.optim.LBFGS([torch.zeros(1, requires_grad=True)])
print("start", flush=True)
out = {"interrupted": False}
try:
    engine, options = sys.argv[1], json.loads(sys.argv[2])
    pcv.fit(model, X, y=y, engine=engine, options=options, progress=False)
except KeyboardInterrupt:
    out["interrupted"] = True
store = pyro.get_param_store()
out["keys"] = sorted(store.keys())
out["values_equal"] = all(k in store and torch.equal(store[k].detach(), v) for k, v in before.items())
out["pyro_stack_empty"] = len(_PYRO_STACK) == 0
out["grad_enabled"] = torch.is_grad_enabled()
out["default_dtype"] = str(torch.get_default_dtype())
res = pcv.fit(model, X[:200], y=y[:200], engine="laplace", progress=False)  # the library still works
out["refit_converged"] = bool(res.converged)
print("result " + json.dumps(out), flush=True)
"""


def _interrupt_after_start(code, delay, *args):
    proc = start_child(code, *args)
    try:
        read_line(proc, "start")
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        line = read_line(proc, "result", timeout=120)
    finally:
        stop_child(proc)
    return json.loads(line.split(" ", 1)[1])


_LONG = {"max_steps": 10**7, "min_steps": 10**7}

@pytest.mark.parametrize("engine,options", [
    ("nuts", {"num_samples": 10**6, "warmup_steps": 50}),
    ("svi_autonormal", _LONG),
    ("diag_mixture", _LONG),
])
def test_sigint_during_fit_leaves_caller_state_consistent(engine, options):
    out = _interrupt_after_start(_FIT, 3.0, engine, json.dumps(options))
    assert out["interrupted"], "the fit finished before the signal: make it longer"
    # the caller's entries are untouched; an engine's own entries live under its private prefix only
    assert [k for k in out["keys"] if not k.startswith("_pyro_convexvb.")] == ["AutoNormal.locs.w", "my_param"], \
        out["keys"]
    assert out["values_equal"]
    assert out["pyro_stack_empty"] and out["grad_enabled"] and out["default_dtype"] == "torch.float32"
    assert out["refit_converged"]


_PARTIAL_FIT = r"""
import json, numpy as np, scipy.sparse as sp, torch
from pyro_convexvb.online import OnlineBayesLogistic

rng = np.random.default_rng(0)
d = 200
m = OnlineBayesLogistic(d, fast=False)
X0 = rng.normal(size=(50, d)); y0 = (X0[:, 0] > 0).astype(int)
m.partial_fit(X0, y0)
before = m.state_dict()
# sparse rows: validation is instant, the row-by-row update of the reference path takes 0.05-0.5 ms a row (the
# machine), so the chunk runs for 20 s or more and the signal 3 s after the start always lands inside it
X = sp.random(400_000, d, density=0.05, format="csr", random_state=1); y = rng.integers(0, 2, 400_000)
print("start", flush=True)
out = {"interrupted": False}
try:
    m.partial_fit(X, y)
except KeyboardInterrupt:
    out["interrupted"] = True
after = m.state_dict()
same = {}
for k, v in before.items():
    w = after.get(k)
    if isinstance(v, (np.ndarray, torch.Tensor)):
        same[k] = bool(np.array_equal(np.asarray(v), np.asarray(w)))
    else:
        same[k] = v == w
out["same"] = same
print("result " + json.dumps(out), flush=True)
"""

def test_sigint_during_partial_fit_keeps_the_state_before_the_chunk():
    out = _interrupt_after_start(_PARTIAL_FIT, 3.0)
    assert out["interrupted"], "the chunk finished before the signal: make it larger"
    changed = sorted(k for k, same in out["same"].items() if not same)
    assert not changed, f"state entries changed by an interrupted chunk: {changed}"


def test_interrupt_inside_a_plate_enter_leaves_no_plate_allocated():
    """A Ctrl-C landing in ``pyro.plate.__enter__`` after the plate's dimension is allocated (Pyro then never
    frees it) must not leave the name taken: every later trace would fail with "duplicate plate 'data'"."""
    import pyro
    import pyro.distributions as dist
    import torch
    from pyro.poutine.runtime import _DIM_ALLOCATOR, _PYRO_STACK

    import pyro_convexvb as pcv

    calls = {"n": 0, "interrupt_at": 3}

    def model(X, y=None):
        calls["n"] += 1
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=X.dtype), 1.0).to_event(1))
        if calls["n"] == calls["interrupt_at"]:
            _DIM_ALLOCATOR.allocate("data", None)  # what the interrupted __enter__ had done
            raise KeyboardInterrupt
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    X = torch.randn(50, 3, dtype=torch.float64)
    y = (X[:, 0] > 0).double()
    dims_before, stack_before = list(_DIM_ALLOCATOR._stack), list(_PYRO_STACK)
    with pytest.raises(KeyboardInterrupt):
        pcv.fit(model, X, y=y, engine="diag_mixture", progress=False)
    assert calls["n"] == calls["interrupt_at"]
    assert list(_DIM_ALLOCATOR._stack) == dims_before and list(_PYRO_STACK) == stack_before
    calls["interrupt_at"] = -1
    res = pcv.fit(model, X, y=y, engine="laplace", progress=False)
    assert res.converged
