"""One 2-process ``torchrun`` launch per test run runs every distributed case (see ``worker.py``)."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORLD = 2


def launch(out, slow=False, timeout=900):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CI="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           os.path.join(HERE, "worker.py"), "--out", str(out)] + (["--slow"] if slow else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"distributed worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def launch_once(tmp_path_factory, name, **kwargs):
    """:func:`launch` once per test run, also when pytest-xdist runs the cases on several workers.

    Under xdist each worker has its own session (and session fixtures): the workers' base temporary directories
    share a parent, where the first worker to arrive launches under a file lock and the others read its results
    (or its error) instead of launching again."""
    from filelock import FileLock  # a dependency of torch

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    out = base / name
    failed = base / f"{name}.failed"
    with FileLock(str(base / f"{name}.lock")):
        if failed.exists():
            raise RuntimeError(f"(launched by another pytest worker) {failed.read_text()}")
        if not (out / "complete").exists():
            try:
                results = launch(out, **kwargs)
            except Exception as e:
                failed.write_text(str(e))
                raise
            (out / "complete").write_text("")
            return results
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="session")
def distributed_results(tmp_path_factory):
    return launch_once(tmp_path_factory, "distributed")


@pytest.fixture(scope="session")
def distributed_slow_results(tmp_path_factory):
    return launch_once(tmp_path_factory, "distributed_slow", slow=True, timeout=3600)


@pytest.fixture(scope="session")
def check():
    """:func:`check_case`, for the test modules."""
    return check_case


def check_case(results, key, rtol=1e-8):
    """Every rank's sharded result equals its single-process reference to ``rtol`` (relative to each tensor's
    largest entry) and the ranks agree exactly. Returns the worst relative difference.

    A case whose results are optima of a search stopped at a tolerance returns, beside them, ``rtol_<name>``:
    the relative distance that search can promise for ``<name>`` (derived from its own stopping point, e.g.
    :func:`cases_core.laplace_tolerances`); the larger of the sharded and the reference promise is used."""
    entries = [res[key] for res in results]
    for r, e in enumerate(entries):
        if "error" in e:
            pytest.fail(f"{key} failed on rank {r}:\n{e['error']}")
    worst = 0.0
    rtol = max(rtol, entries[0].get("rtol", rtol))
    ref = {k: v for k, v in entries[0]["reference"].items() if not k.startswith("rtol_")}
    promised = {}
    for e in entries:
        for part in ("sharded", "reference"):
            for k, v in e[part].items():
                if k.startswith("rtol_"):
                    promised[k[5:]] = max(promised.get(k[5:], 0.0), float(v))
    for r, e in enumerate(entries):
        got = {k: v for k, v in e["sharded"].items() if not k.startswith("rtol_")}
        assert set(got) == set(ref), f"{key}: rank {r} returned {sorted(got)}, reference {sorted(ref)}"
        for name, want in ref.items():
            tol = max(rtol, promised.get(name, 0.0))
            have = got[name]
            assert have.shape == want.shape, f"{key}.{name}: shape {tuple(have.shape)} vs reference {tuple(want.shape)}"
            if r > 0:
                assert torch.equal(have, entries[0]["sharded"][name]) or (
                    torch.isnan(have).all() and torch.isnan(entries[0]["sharded"][name]).all()), \
                    f"{key}.{name}: ranks 0 and {r} differ"
            if want.numel() == 0:
                continue
            nan = torch.isnan(want)
            assert torch.equal(nan, torch.isnan(have)), f"{key}.{name}: NaN pattern differs"
            scale = want[~nan].abs().max().clamp_min(1e-300) if (~nan).any() else torch.tensor(1.0)
            diff = float(((have - want)[~nan]).abs().max() / scale) if (~nan).any() else 0.0
            worst = max(worst, diff)
            assert diff <= tol, f"{key}.{name}: relative difference {diff:.3e} > {tol:g}"
    return worst


