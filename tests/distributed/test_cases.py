"""Row-sharded fits on 2 processes (gloo, float64) equal the single-process fit on all rows, for every case of
every ``cases_*.py`` module, and the ranks agree exactly."""
import ast
import glob
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# one torchrun launch serves every case (a lock across pytest-xdist workers, conftest.py); --dist loadgroup keeps
# the cases on one worker, so that the other worker runs other tests meanwhile instead of waiting for the lock
pytestmark = pytest.mark.xdist_group("distributed")


def case_keys(slow=False):
    prefix = "slowcase_" if slow else "case_"
    keys = []
    for path in sorted(glob.glob(os.path.join(HERE, "cases_*.py"))):
        module = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            tree = ast.parse(f.read())
        keys += [f"{module}.{n.name}" for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith(prefix)]
    return keys


@pytest.mark.parametrize("key", case_keys())
def test_sharded_equals_single_process(distributed_results, check, key):
    check(distributed_results, key)


@pytest.mark.slow
@pytest.mark.parametrize("key", case_keys(slow=True))
def test_sharded_equals_single_process_slow(distributed_slow_results, check, key):
    check(distributed_slow_results, key)
