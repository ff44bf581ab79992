"""convex_relaxation's Lanczos variances do not depend on the thread count (users read them as error bars).

The fit runs in two fresh processes, with 1 and 2 threads, on a real-sim-shaped sparse logistic problem with
``variance="lanczos"``; means and variances must be bitwise equal."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import sys, warnings, torch, pyro, pyro.distributions as dist
import pyro_convexvb as pcv
torch.set_num_threads(int(sys.argv[1]))
X, y, _ = pcv.datasets.make_sparse_classification("real-sim", scale=float(sys.argv[2]), seed=0)
def model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[1], dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=pcv.linear(X, w)), obs=y)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    r = pcv.fit(model, X, y, engine="convex_relaxation", progress=False,
                options={"variance": "lanczos", "lanczos_rank": 80})
torch.save({"loc": r.posterior.loc, "var": r.posterior.variance}, sys.argv[3])
"""


def _fit(threads, scale, out):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", SCRIPT, str(threads), str(scale), str(out)], env=env, check=True,
                   timeout=1800, capture_output=True)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_lanczos_variances_do_not_depend_on_the_thread_count(tmp_path, scale):
    one = _fit(1, scale, tmp_path / "one.pt")
    two = _fit(2, scale, tmp_path / "two.pt")
    assert torch.equal(one["loc"], two["loc"])
    assert torch.equal(one["var"], two["var"])
