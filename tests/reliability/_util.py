"""Helpers of the fault-injection tests: run a Python child process with this checkout on its path."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: seconds a child may take to import the library and reach its first checkpoint (a loaded 2-core machine
#: imports torch + pyro in ~10 s)
STARTUP_TIMEOUT = 120


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


#: the child takes SIGINT as a terminal's Ctrl-C does: a process started in the background of a shell without job
#: control (a CI runner, ``nohup``, ``cmd &`` in a script) inherits SIGINT ignored, and Python then never raises
#: ``KeyboardInterrupt``
_SIGINT_DEFAULT = "import signal as _signal; _signal.signal(_signal.SIGINT, _signal.default_int_handler)\n"


def start_child(code, *args, **kwargs):
    """``subprocess.Popen`` of ``python -c code args...`` with line-buffered text pipes (SIGINT raising
    ``KeyboardInterrupt`` in the child, whatever the parent's disposition), in a session of its own so that
    :func:`stop_child` also ends the processes it forks."""
    kwargs.setdefault("start_new_session", True)
    return subprocess.Popen([sys.executable, "-c", _SIGINT_DEFAULT + code, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=child_env(),
                            cwd=ROOT, **kwargs)


def stop_child(proc):
    """SIGKILL the child and every process of its session (a forked writer left alive kept the pipes open, so
    reading the child's stderr after a timeout blocked for ever), then reap it."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.kill()
    proc.wait(timeout=30)


def _stderr_tail(proc):
    """The end of the stopped child's stderr, read without waiting for ever."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    try:
        return proc.stderr.read()[-3000:] if sel.select(5) else "(stderr not readable)"
    finally:
        sel.close()


def read_line(proc, expect_prefix, timeout=STARTUP_TIMEOUT):
    """The next stdout line of ``proc`` starting with ``expect_prefix`` (fails with the child's stderr otherwise)."""
    import selectors
    import time

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                stop_child(proc)
                raise AssertionError(f"child: no {expect_prefix!r} line within {timeout} s; stderr:\n"
                                     f"{_stderr_tail(proc)}")
            line = proc.stdout.readline()
            if not line:
                stop_child(proc)
                raise AssertionError(f"child exited ({proc.returncode}) before {expect_prefix!r}; stderr:\n"
                                     f"{_stderr_tail(proc)}")
            if line.startswith(expect_prefix):
                return line.rstrip("\n")
    finally:
        sel.close()
