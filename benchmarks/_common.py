"""Helpers shared by the benchmark scripts in ``benchmarks/``.

``benchmarks/`` is not a package; a script imports this module with::

    import os, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import Timer, PeakRSS, markdown_table, write_json, save_figure, parse_args

What it offers:

* :class:`Timer` -- wall-clock seconds of a ``with`` block (``time.perf_counter``).
* memory: :func:`peak_rss_mb` (the process's lifetime peak: ``VmHWM`` on Linux, else
  ``resource.getrusage``),
  :class:`PeakRSS` (peak of one ``with`` block by a psutil sampling thread; cheap, in-process,
  may miss spikes shorter than its interval) and :func:`peak_rss_in_subprocess` (runs a function
  in a fresh ``spawn`` process and reads that process's peak; exact, includes the interpreter
  and imports, reported separately as ``baseline_mb``).
* :func:`markdown_table`, :func:`write_json` (to ``benchmarks/results/<name>.json`` with
  :func:`machine_info`), :func:`save_figure` (to ``docs/figures/<name>.png``).
* :func:`parse_args` -- the standard ``--quick``, ``--threads``, ``--seed`` flags.
* :func:`classification_metrics` -- test error and NLPD from predicted probabilities.
* :func:`lattice_precision` -- ``D - rho W`` of a 4-neighbour lattice (sparse), for GMRF cases.
"""
import argparse
import datetime
import json
import math
import multiprocessing
import os
import platform
import resource
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
FIGURES_DIR = os.path.join(ROOT, "docs", "figures")

__all__ = [
    "ROOT",
    "Timer",
    "PeakRSS",
    "peak_rss_mb",
    "current_rss_mb",
    "peak_rss_in_subprocess",
    "markdown_table",
    "machine_info",
    "default_results_dir",
    "default_figures_dir",
    "write_json",
    "save_figure",
    "make_parser",
    "parse_args",
    "test_error",
    "nlpd",
    "classification_metrics",
    "lattice_precision",
]


# ----------------------------------------------------------------------------- time


class Timer:
    """Wall-clock seconds of a block (``time.perf_counter``).

    ``seconds`` is readable inside the block (time so far) and fixed after it.

    Example::

        >>> with Timer() as t:
        ...     sum(range(1000))
        499500
        >>> t.seconds >= 0
        True
    """

    def __init__(self):
        self.start = self.end = None

    def __enter__(self):
        self.start, self.end = time.perf_counter(), None
        return self

    def __exit__(self, *exc):
        self.end = time.perf_counter()
        return False

    @property
    def seconds(self):
        if self.start is None:
            raise RuntimeError("Timer: not started (use it as a context manager)")
        return (self.end if self.end is not None else time.perf_counter()) - self.start

    def __repr__(self):
        return f"Timer({self.seconds:.4g} s)" if self.start is not None else "Timer(not started)"


# ----------------------------------------------------------------------------- memory

_MAXRSS_UNIT = 1.0 / 1024.0 if sys.platform != "darwin" else 1.0 / 2 ** 20  # ru_maxrss: kB (Linux), B (macOS)


def peak_rss_mb():
    """Peak resident set size of this process since it started, MiB.

    On Linux this is ``VmHWM`` of ``/proc/self/status`` (the high-water mark of the current address
    space); elsewhere ``resource.getrusage(RUSAGE_SELF).ru_maxrss``. (Linux carries ``ru_maxrss``
    across ``exec``, so a process started from a large parent would report the parent's size.)
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:  # not Linux
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT


def current_rss_mb():
    """Current resident set size of this process, MiB (psutil)."""
    import psutil

    return psutil.Process().memory_info().rss / 2 ** 20


class PeakRSS:
    """Peak resident memory of a ``with`` block, sampled by a background thread (psutil).

    ``peak_mb`` is the largest RSS seen during the block (MiB), ``start_mb`` the RSS on entry and
    ``delta_mb = peak_mb - start_mb`` the extra memory the block needed. Sampling every
    ``interval`` seconds (default 20 ms: a faster Python sampler competes for the GIL with
    Python-driven solver loops and slowed a Lanczos fit by about 10%) can miss spikes shorter than
    that; for an exact figure use
    :func:`peak_rss_in_subprocess`. Memory freed by Python may stay resident, so run blocks to be
    compared in the same order or in fresh processes.

    Example::

        >>> with PeakRSS() as mem:
        ...     buf = bytearray(50 * 2 ** 20); buf[::4096] = b"x" * len(buf[::4096])
        >>> mem.delta_mb > 40
        True
    """

    def __init__(self, interval=0.02):
        self.interval = float(interval)
        self.start_mb = self.peak_mb = None
        self._stop = threading.Event()
        self._thread = None

    def _sample(self, proc):
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, proc.memory_info().rss / 2 ** 20)
            self._stop.wait(self.interval)

    def __enter__(self):
        import psutil

        proc = psutil.Process()
        self.start_mb = self.peak_mb = proc.memory_info().rss / 2 ** 20
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, args=(proc,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        import psutil

        self.peak_mb = max(self.peak_mb, psutil.Process().memory_info().rss / 2 ** 20)
        self._stop.set()
        self._thread.join()
        return False

    @property
    def delta_mb(self):
        return self.peak_mb - self.start_mb


def _child(conn, fn, args, kwargs, return_result):
    try:
        baseline = peak_rss_mb()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds = time.perf_counter() - t0
        conn.send(("ok", out if return_result else None, peak_rss_mb(), baseline, seconds))
    except BaseException as err:  # report any failure to the parent
        conn.send(("error", f"{type(err).__name__}: {err}", None, None, None))
    finally:
        conn.close()


def peak_rss_in_subprocess(fn, *args, return_result=False, **kwargs):
    """Run ``fn(*args, **kwargs)`` in a fresh process and measure its peak memory exactly.

    The process is started with ``multiprocessing``'s ``spawn`` method (no memory inherited
    from this one), so ``fn`` must be importable (a module-level function) and its arguments
    picklable. The peak is the child's :func:`peak_rss_mb`: it includes the interpreter and the
    imports ``fn`` needs; ``baseline_mb`` is the child's peak just before calling ``fn``.

    :returns: dict with ``peak_mb``, ``baseline_mb``, ``delta_mb`` (MiB), ``seconds`` (wall time
        of the call alone) and ``result`` (``fn``'s return value if ``return_result`` else ``None``).
    :raises RuntimeError: if ``fn`` raised in the child (with its message).

    Example::

        >>> import operator
        >>> r = peak_rss_in_subprocess(operator.mul, b"x", 100 * 2 ** 20)
        >>> r["delta_mb"] > 90
        True
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args, kwargs, return_result))
    proc.start()
    child.close()
    try:
        status, out, peak, baseline, seconds = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"peak_rss_in_subprocess: child died (exit code {proc.exitcode})") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"peak_rss_in_subprocess: {getattr(fn, '__name__', fn)} failed in the child: {out}")
    return {"peak_mb": peak, "baseline_mb": baseline, "delta_mb": peak - baseline, "seconds": seconds,
            "result": out}


# ----------------------------------------------------------------------------- tables


def _format_cell(value, fmt):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return format(value, fmt)
    return str(value)


def markdown_table(rows, columns=None, floatfmt=".4g"):
    """A GitHub-flavoured markdown table.

    :param rows: list of dicts (looked up by column key) or of sequences (in column order).
    :param columns: list of keys, or of ``(key, header)`` pairs; default: the keys of the first
        dict row.
    :param floatfmt: format spec for floats (``".3f"``), or a dict ``{key: spec}`` (missing keys
        use ``".4g"``). ``None`` prints as ``-``. Numeric columns are right-aligned.
    :returns: the table as one string (no trailing newline).

    Example::

        >>> print(markdown_table([{"engine": "cvi", "s": 0.0312}], ["engine", ("s", "seconds")], ".2f"))
        | engine | seconds |
        |:-------|--------:|
        | cvi    |    0.03 |
    """
    rows = list(rows)
    if columns is None:
        if not rows or not isinstance(rows[0], dict):
            raise ValueError("columns: required unless rows are dicts")
        columns = list(rows[0].keys())
    keys = [c[0] if isinstance(c, (tuple, list)) else c for c in columns]
    headers = [str(c[1]) if isinstance(c, (tuple, list)) else str(c) for c in columns]
    fmts = {k: (floatfmt.get(k, ".4g") if isinstance(floatfmt, dict) else floatfmt) for k in keys}
    cells, numeric = [], [True] * len(keys)
    for r in rows:
        if isinstance(r, dict):
            values = [r.get(k) for k in keys]
        else:
            values = list(r)
            if len(values) != len(keys):
                raise ValueError(f"rows: a row has {len(values)} entries for {len(keys)} columns")
        for j, v in enumerate(values):
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)) \
                    and not (hasattr(v, "item") and getattr(v, "ndim", 1) == 0):
                numeric[j] = False
        cells.append([_format_cell(v, fmts[k]) for v, k in zip(values, keys)])
    widths = [max([len(h)] + [len(row[j]) for row in cells]) for j, h in enumerate(headers)]
    widths = [max(w, 3) for w in widths]

    def line(items, right):
        return "| " + " | ".join(s.rjust(w) if r else s.ljust(w) for s, w, r in zip(items, widths, right)) + " |"

    sep = "|" + "|".join((("-" * (w + 1) + ":") if r else (":" + "-" * (w + 1))) for w, r in zip(widths, numeric)) + "|"
    return "\n".join([line(headers, [False] * len(keys)), sep] + [line(row, numeric) for row in cells])


# ----------------------------------------------------------------------------- output


def _version(dist):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # not installed
        return None


def machine_info():
    """CPU count, platform, Python and library versions, torch threads, and the date (ISO, UTC)."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }
    for dist in ("torch", "pyro-ppl", "gpytorch", "numpy", "scipy", "scikit-learn", "pyro_convexvb"):
        info[dist] = _version(dist)
    if "torch" in sys.modules:
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    return info


def _jsonable(obj):
    if hasattr(obj, "tolist"):  # numpy arrays/scalars, torch tensors
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if hasattr(obj, "__fspath__"):
        return os.fspath(obj)
    raise TypeError(f"write_json: cannot serialise {type(obj).__name__}")


def default_results_dir():
    """Where results are written: ``$PYRO_CONVEXVB_RESULTS_DIR``, else ``benchmarks/results``."""
    return os.environ.get("PYRO_CONVEXVB_RESULTS_DIR") or RESULTS_DIR


def default_figures_dir():
    """Where figures are written: ``$PYRO_CONVEXVB_FIGURES_DIR``, else ``docs/figures``."""
    return os.environ.get("PYRO_CONVEXVB_FIGURES_DIR") or FIGURES_DIR


def write_json(name, payload, results_dir=None):
    """Write ``payload`` (a dict) to ``<results_dir>/<name>.json`` with a ``machine`` entry.

    :param str name: file stem (the benchmark's name).
    :param dict payload: results; numpy/torch values are converted to lists/numbers, NaN/inf are
        written as ``null``.
    :param results_dir: default ``benchmarks/results`` (or ``$PYRO_CONVEXVB_RESULTS_DIR``).
    :returns: the path written.
    """
    if not isinstance(payload, dict):
        raise ValueError(f"payload: expected a dict, got {type(payload).__name__}")
    directory = results_dir or default_results_dir()
    os.makedirs(directory, exist_ok=True)
    doc = {"benchmark": name, "machine": machine_info(), **payload}
    path = os.path.join(directory, f"{name}.json")
    text = json.dumps(_nan_to_none(doc), indent=2, default=_jsonable, allow_nan=False)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:  # written whole, then renamed: a run stopped mid-write keeps the previous file
        f.write(text + "\n")
    os.replace(tmp, path)
    return path


def _nan_to_none(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return _nan_to_none(obj.tolist())
    return obj


def save_figure(fig, name, figures_dir=None, dpi=120):
    """Save a matplotlib figure to ``<figures_dir>/<name>.png`` and close it.

    :param figures_dir: default ``docs/figures`` (or ``$PYRO_CONVEXVB_FIGURES_DIR``).
    :returns: the path written.
    """
    directory = figures_dir or default_figures_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.png")
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- command line


def make_parser(description):
    """``argparse`` parser with the standard flags; add a script's own flags to it.

    ``--quick`` (small version, under about a minute), ``--threads N`` (torch threads, default 1),
    ``--seed S`` (default 0).
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small version (runs in under about a minute)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    return p


def parse_args(description=None, argv=None, parser=None):
    """Parse the standard flags (or those of ``parser``) and apply ``--threads`` to torch.

    :param description: used when ``parser`` is not given.
    :param argv: argument list (default ``sys.argv[1:]``).
    :param parser: a parser from :func:`make_parser` with extra flags.
    :returns: ``argparse.Namespace``.

    Example::

        >>> parse_args("demo", ["--quick", "--threads", "2"]).quick
        True
    """
    parser = parser or make_parser(description)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    return args


# ----------------------------------------------------------------------------- metrics


def _as_arrays(p, y):
    import numpy as np

    def arr(a):
        if hasattr(a, "detach"):
            a = a.detach().cpu().double().numpy()
        return np.asarray(a, dtype=np.float64).reshape(-1)

    p, y = arr(p), arr(y)
    if p.shape != y.shape:
        raise ValueError(f"p, y: shapes differ ({p.shape} vs {y.shape})")
    if not np.all(np.isfinite(p)) or p.min(initial=0) < 0 or p.max(initial=0) > 1:
        raise ValueError("p: predicted probabilities must be finite and in [0, 1]")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("y: labels must be in {0, 1}")
    return p, y


def test_error(p, y):
    """Fraction of cases with ``1[p > 1/2] != y`` (``p = P(y = 1)``; ties count as class 0)."""
    p, y = _as_arrays(p, y)
    return float(((p > 0.5) != (y == 1)).mean()) if len(y) else float("nan")


def nlpd(p, y, eps=1e-12):
    """Negative log predictive density per case, nats: ``-mean(y log p + (1-y) log(1-p))``.

    Probabilities are clipped to ``[eps, 1 - eps]``.
    """
    import numpy as np

    p, y = _as_arrays(p, y)
    if not len(y):
        return float("nan")
    p = np.clip(p, eps, 1 - eps)
    return float(-np.mean(np.where(y == 1, np.log(p), np.log1p(-p))))


def classification_metrics(p, y):
    """``{"test_error", "accuracy", "nlpd", "n"}`` of predicted probabilities ``p = P(y=1)`` (numpy or torch).

    Example::

        >>> m = classification_metrics([0.9, 0.2], [1, 1])
        >>> m["test_error"], round(m["nlpd"], 4)
        (0.5, 0.8574)
    """
    err = test_error(p, y)
    return {"test_error": err, "accuracy": 1.0 - err, "nlpd": nlpd(p, y), "n": int(len(_as_arrays(p, y)[1]))}


test_error.__test__ = False  # not a pytest test when imported into a test module


def lattice_precision(m, rho=0.99, dtype=None):
    """``D - rho W`` of the 4-neighbour ``m x m`` lattice (``W`` the adjacency, ``D`` its degrees), as a
    coalesced sparse COO tensor (float64 unless ``dtype``)."""
    import torch

    dtype = dtype or torch.float64
    idx = torch.arange(m * m).reshape(m, m)
    pairs = torch.cat([torch.stack([idx[:, :-1].reshape(-1), idx[:, 1:].reshape(-1)]),
                       torch.stack([idx[:-1, :].reshape(-1), idx[1:, :].reshape(-1)])], 1)
    rows = torch.cat([pairs[0], pairs[1]])
    cols = torch.cat([pairs[1], pairs[0]])
    deg = torch.bincount(rows, minlength=m * m).to(dtype)
    ii = torch.arange(m * m)
    return torch.sparse_coo_tensor(torch.stack([torch.cat([ii, rows]), torch.cat([ii, cols])]),
                                   torch.cat([deg, -rho * torch.ones(rows.numel(), dtype=dtype)]),
                                   (m * m, m * m)).coalesce()
