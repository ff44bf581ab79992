"""The first fit in a process does not pay for torch's symbolic-shape machinery (sympy, ~0.5 s)."""
import subprocess
import sys

import pytest
import torch

from pyro_convexvb.linalg.scalar import _broadcast_shapes

SCRIPT = r"""
import sys, warnings
warnings.simplefilter("ignore")
import torch, pyro, pyro.distributions as dist
import pyro_convexvb as pcv
assert "sympy" not in sys.modules, "imported at import time"
g = torch.Generator().manual_seed(0)
X = torch.randn(200, 5, generator=g, dtype=torch.float64)
y = (X[:, 0] > 0).double()
def model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(5, dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("data", 200):
        pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
for engine in ("convex_relaxation", "dual_vg"):
    pcv.fit(model, X, y=y, engine=engine, progress=False)
print("sympy" in sys.modules)
"""


def test_first_fits_do_not_import_sympy():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("shapes", [((3, 1), (1, 4)), ((), (2, 3)), ((5,), (2, 1, 5)), ((1,), ())])
def test_broadcast_shapes_is_torchs(shapes):
    assert _broadcast_shapes(*[torch.Size(s) for s in shapes]) == torch.broadcast_shapes(*shapes)


def test_broadcast_shapes_refuses_mismatches():
    with pytest.raises(RuntimeError, match="not broadcastable"):
        _broadcast_shapes(torch.Size((3,)), torch.Size((4,)))
