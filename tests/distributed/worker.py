"""Runs every ``case_*`` (and with ``--slow`` every ``slowcase_*``) of ``tests/distributed/cases_*.py``.

Launched once per test session by ``python -m torch.distributed.run --standalone --nproc_per_node=2``.
Each case is a function ``case(rank, world_size)`` that builds this rank's rows (``world_size == 1``:
all rows), fits and returns a dict of tensors or numbers. Every rank runs it sharded (under the process
group) and then, inside :func:`pyro_convexvb.distributed.local_only`, as the single-process reference
on all rows. Results go to ``OUT/rank{r}.pt`` as ``{case: {"sharded": ..., "reference": ...}}`` (or
``{"error": traceback}``), with the case's tolerance (a function attribute ``rtol``, default 1e-8, for
results that are optima of an iterative search stopped at a tolerance).
"""
import argparse
import glob
import importlib.util
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import pyro  # noqa: E402

import pyro_convexvb as pcv  # noqa: E402


def load_cases(slow, only=None):
    cases = []
    for path in sorted(glob.glob(os.path.join(HERE, "cases_*.py"))):
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for attr in sorted(vars(mod)):
            if attr.startswith("case_") or (slow and attr.startswith("slowcase_")):
                key = f"{name}.{attr}"
                if only is None or any(o in key for o in only):
                    cases.append((key, getattr(mod, attr)))
    return cases


def as_tensors(out):
    res = {}
    for k, v in out.items():
        if isinstance(v, torch.Tensor):
            res[k] = v.detach().to(torch.float64).cpu().clone()
        elif isinstance(v, (int, float, bool)) or v is None:
            res[k] = torch.tensor(float("nan") if v is None else float(v), dtype=torch.float64)
        else:
            res[k] = torch.as_tensor(v, dtype=torch.float64)
    return res


def run(fn, r, p):
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    return as_tensors(fn(r, p))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--slow", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    r, p = pcv.distributed.init()
    results = {}
    for key, fn in load_cases(args.slow, args.only):
        entry = {}
        t0 = time.perf_counter()
        try:
            entry["sharded"] = run(fn, r, p)
            with pcv.distributed.local_only():
                entry["reference"] = run(fn, 0, 1)
        except Exception:  # noqa: BLE001 - reported by the tests, per case
            entry = {"error": traceback.format_exc()}
        entry["seconds"] = time.perf_counter() - t0
        entry["rtol"] = float(getattr(fn, "rtol", 1e-8))
        results[key] = entry
        if r == 0:
            print(f"{key}: {entry['seconds']:.2f} s{' ERROR' if 'error' in entry else ''}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    torch.save(results, os.path.join(args.out, f"rank{r}.pt"))
    if pcv.distributed.is_active():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
