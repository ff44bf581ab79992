"""kill -9 during ``pcv.save``: the checkpoint is always a complete file, holding the old state or the new one.

A child process imports the library once and forks one writer per round; each writer saves numbered
states in a loop (about 3 MB each, so most of its time is spent inside ``save``) and is killed with
SIGKILL at a random moment. After every kill the parent loads the checkpoint (also with torch's
default ``weights_only=True``) and checks that it is one complete state that was written: every value of
``x`` equals the state's number, which is at least the last number confirmed before the kill.
"""
import os
import random
import signal
import sys

import pytest
import torch

from ._util import read_line, start_child, stop_child

pytestmark = pytest.mark.skipif(sys.platform == "win32" or not hasattr(os, "fork"),
                                reason="kill -9 scenarios need POSIX fork and SIGKILL")

_SERVER = r"""
import os, sys, torch
import pyro_convexvb as pcv

path = sys.argv[1] if len(sys.argv) > 1 else None
for line in sys.stdin:
    cmd, path, base = line.split()
    base = int(base)
    pid = os.fork()
    if pid == 0:  # the writer: save states base, base + 1, ... until killed
        i = base
        while True:
            pcv.save({"i": i, "x": torch.full((400_000,), float(i), dtype=torch.float64)}, path)
            if i == base:
                print(f"ready {os.getpid()}", flush=True)
            i += 1
    print(f"forked {pid}", flush=True)
    _, status = os.waitpid(pid, 0)
    print(f"reaped {status}", flush=True)
"""

KILLS = 12


def _check(path, written_at_least):
    raw = torch.load(path)  # weights_only=True: a complete file of plain data
    import pyro_convexvb as pcv

    state = pcv.load(path)
    i, x = state["i"], state["x"]
    assert raw["object"]["i"] == i
    assert x.shape == (400_000,) and bool((x == float(i)).all()), f"torn state: i = {i}, x spans {x.min()}..{x.max()}"
    assert i >= written_at_least, f"the file went back to state {i} < {written_at_least}"
    return i


def test_kill_9_during_save_never_leaves_a_truncated_checkpoint(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    rng = random.Random(0)
    server = start_child(_SERVER)
    stale = inside = 0  # temporaries on disk; kills that landed inside a save (they leave one)
    try:
        for k in range(KILLS):
            base = 1_000 * (k + 1)
            server.stdin.write(f"go {path} {base}\n")
            server.stdin.flush()
            read_line(server, "forked")
            pid = int(read_line(server, "ready").split()[1])  # state `base` is on disk
            # random moment: within the first saves of this writer (each takes a few to tens of ms)
            import time

            time.sleep(rng.uniform(0.0, 0.25))
            os.kill(pid, signal.SIGKILL)
            status = read_line(server, "reaped", timeout=30)
            assert os.WIFSIGNALED(int(status.split()[1])), status
            _check(path, base)
            tmp_files = sum(1 for f in os.listdir(tmp_path) if f.endswith(".tmp"))
            stale, inside = tmp_files, inside + (tmp_files > stale)
    finally:
        server.stdin.close()
        stop_child(server)  # the server and a writer it may have left
    # the checkpoint itself is the only complete file; stray temporaries are never read
    assert os.path.exists(path)
    print(f"{KILLS} kills, {inside} landed inside a save (left a temporary file)")
