"""Online learning from text files, end to end, against Vowpal Wabbit in the same run.

Cases (each file written once, then both tools alternate, median of ``--repeats``):

* ``criteo``: a Criteo-layout file (label, 13 integer, 26 categorical columns, tab-separated) from
  ``pcv.datasets.make_criteo_text`` -- labels from a known sparse logistic model over the hashed features, so the
  true model's log loss is reported as the floor -- and the same rows in VW's text format (the same tokens);
* ``svmlight``: a real-sim-shaped file (``make_sparse_classification("real-sim")``, 72,201 rows of 20,958
  tf-idf columns at ``--svm-scale 1``) in svmlight and VW formats;
* ``regret``: the ``dt20`` stream of ``benchmarks/online_regret.py`` (d = 200, E[d_t] = 20, weights N(0, 1)),
  written as svmlight and VW text; the true weights give the comparator loss.

Each run is a fresh process (``spawn``) that reads the whole file once and learns progressively
(predict, then update); reported: rows/s end to end (reading, parsing, hashing, learning), the progressive
log loss per row, and the process's peak resident memory (and above its interpreter + imports).  For ours, one
more run per pipeline times the stages one after the other in CPU seconds (parse + hash the whole file into
chunks, then learn from them): the split says which stage bounds the overlapped pipeline.

* ours: ``iter_criteo`` / ``iter_svmlight`` (reader thread, compiled parsing) + ``OnlineBayesLogistic`` at its
  defaults (``prior_var="auto"``), and the same with ``prior_var=1`` (one learner: the cost of "auto");
* VW: ``vowpalwabbit.Workspace("--loss_function logistic -b B -d FILE --quiet").run_parser()`` (its C++ parser
  thread and learner thread), progressive loss ``get_sum_loss() / get_weighted_examples()``.

    python benchmarks/online_text.py                      # 1M Criteo rows, real-sim, regret 1M; ~15 min
    python benchmarks/online_text.py --cases criteo --rows 300000
    python benchmarks/online_text.py --quick              # 20k rows, a 2% real-sim, < 2 min
    python benchmarks/online_text.py --chunk-sizes 20000,50000,100000   # chunk sizes side by side (*_chunks.json)
    python benchmarks/online_text.py --chunk-sizes default,50000        # the readers' default against fixed chunks

Writes ``benchmarks/results/online_text[_quick].json`` and prints a markdown table.
"""
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import make_parser, markdown_table, parse_args, peak_rss_in_subprocess, write_json  # noqa: E402

# imported here, so that a run's child process has them loaded before its baseline memory and its timer
import pyro_convexvb.online  # noqa: E402,F401

try:
    import vowpalwabbit  # noqa: F401
except ImportError:  # measured without VW
    vowpalwabbit = None


# ----------------------------------------------------------------------------- runs (in fresh processes)
def _warm_kernels():
    """Load the compiled (cached) kernels with a tiny input, outside the timed region."""
    import scipy.sparse as sp

    from pyro_convexvb.online import OnlineBayesLogistic, _textio

    OnlineBayesLogistic(4).partial_fit(sp.eye(2, 4, format="csr"), [0, 1])
    OnlineBayesLogistic(4, prior_var=1.0).partial_fit(sp.eye(2, 4, format="csr"), [0, 1])
    spec = _textio.DelimitedSpec(0, (1,), (2,), 16, 0, ",", True)
    with tempfile.NamedTemporaryFile("wb", suffix=".csv", delete=False) as f:
        f.write(b"1,3,a\n0,,b\n")
    list(_textio.iter_delimited(f.name, spec, 10))
    os.remove(f.name)
    with tempfile.NamedTemporaryFile("wb", suffix=".svm", delete=False) as f:
        f.write(b"1 1:0.5 3:1\n-1 2:0.25\n")
    for X, y in _textio.iter_svmlight_chunks(f.name, 10, 4, 1):
        OnlineBayesLogistic(4).partial_fit(X, y)
    os.remove(f.name)


def run_split(path, fmt, num_features, prior_var, chunk_size=None):
    """Where the time goes, one stage at a time in this thread (CPU seconds, so a shared core matters less):
    reading + parsing + hashing the whole file into chunks, then learning from the chunks held in memory."""
    from pyro_convexvb.online import OnlineBayesLogistic, iter_criteo, iter_svmlight

    _warm_kernels()
    t0 = time.thread_time()
    if fmt == "criteo":
        chunks = list(iter_criteo(path, chunk_size=chunk_size, num_features=num_features, prefetch=False))
    else:
        chunks = list(iter_svmlight(path, chunk_size=chunk_size, num_features=num_features, prefetch=False))
    t1 = time.thread_time()
    est = OnlineBayesLogistic(num_features, prior_var=prior_var)
    est._check_options()
    est._reset(num_features)  # the state's first touch (page faults) is not learning
    est.__dict__.pop("classes_", None)
    t2 = time.thread_time()
    for X, y in chunks:
        est.partial_fit(X, y, classes=[0, 1] if fmt == "criteo" else [-1, 1])
    t3 = time.thread_time()
    rows = int(est.n_seen_)
    return {"rows": rows, "parse_s": t1 - t0, "learn_s": t3 - t2, "parse_us_per_row": 1e6 * (t1 - t0) / rows,
            "learn_us_per_row": 1e6 * (t3 - t2) / rows}


def run_ours(path, fmt, num_features, prior_var, chunk_size=None):
    """Read and learn the whole file; ``seconds`` from opening the file to the last update."""
    from pyro_convexvb.online import OnlineBayesLogistic, iter_criteo, iter_svmlight

    _warm_kernels()
    t0 = time.perf_counter()
    if fmt == "criteo":
        chunks = iter_criteo(path, chunk_size=chunk_size, num_features=num_features)
    else:
        chunks = iter_svmlight(path, chunk_size=chunk_size, num_features=num_features)
    est = OnlineBayesLogistic(num_features, prior_var=prior_var)
    for X, y in chunks:
        est.partial_fit(X, y, classes=[0, 1] if fmt == "criteo" else [-1, 1])
    seconds = time.perf_counter() - t0
    return {"rows": int(est.n_seen_), "log_loss": est.cumulative_log_loss_ / max(est.n_seen_, 1),
            "seconds": seconds}


def run_vw(path, bits):
    """VW's whole pass over the file (its parser thread and learner); ``seconds`` includes creating the
    workspace and finishing it."""
    from vowpalwabbit import Workspace

    t0 = time.perf_counter()
    vw = Workspace(f"--loss_function logistic -b {bits} -d {path} --quiet")
    vw.run_parser()
    rows, loss = vw.get_weighted_examples(), vw.get_sum_loss()
    vw.finish()
    seconds = time.perf_counter() - t0
    return {"rows": int(rows), "log_loss": loss / max(rows, 1), "seconds": seconds}


def have_vw():
    return vowpalwabbit is not None


# ----------------------------------------------------------------------------- files
def write_criteo(workdir, rows, seed, bits):
    from pyro_convexvb.datasets import make_criteo_text

    info = make_criteo_text(os.path.join(workdir, "criteo.txt"), rows, seed=seed, num_features=2 ** bits,
                            vw_path=os.path.join(workdir, "criteo.vw"))
    return {"ours": info.path, "vw": info.vw_path, "fmt": "criteo", "num_features": 2 ** bits,
            "floor": info.comparator_log_loss / max(rows, 1), "rows": rows}


def write_svmlight(workdir, scale, seed):
    """A real-sim-shaped file with values to 7 significant digits, as in the LIBSVM site's files."""
    from pyro_convexvb.datasets import make_sparse_classification, svmlight_to_vw

    X, y, _ = make_sparse_classification("real-sim", scale=scale, seed=seed)
    crow, col, val = X.crow_indices().numpy(), X.col_indices().numpy(), X.values().numpy()
    lab = (2 * y - 1).numpy()
    path = os.path.join(workdir, "realsim.svm")
    with open(path, "w") as f:
        for i in range(X.shape[0]):
            a, b = crow[i], crow[i + 1]
            f.write(f"{lab[i]:+.0f} " + " ".join(f"{c + 1}:{v:.7g}" for c, v in zip(col[a:b], val[a:b])) + "\n")
    svmlight_to_vw(path, os.path.join(workdir, "realsim.vw"))
    return {"ours": path, "vw": os.path.join(workdir, "realsim.vw"), "fmt": "svmlight",
            "num_features": X.shape[1], "floor": None, "rows": X.shape[0]}


def write_regret(workdir, rows, seed):
    from sklearn.datasets import dump_svmlight_file

    from pyro_convexvb.datasets import svmlight_to_vw
    from pyro_convexvb.online import make_online_stream

    stream = make_online_stream(d=200, d_t=20, weight_std=1.0, seed=20 + seed)
    path = os.path.join(workdir, "regret.svm")
    floor = 0.0
    with open(path, "wb") as fh:
        for X, y in stream.chunks(rows, 100_000):
            lp, ln = stream.comparator_log_loss(X)
            floor += float(np.where(y > 0, lp, ln).sum())
            dump_svmlight_file(X, y.astype(np.int64), fh, zero_based=False)
    svmlight_to_vw(path, os.path.join(workdir, "regret.vw"))
    return {"ours": path, "vw": os.path.join(workdir, "regret.vw"), "fmt": "svmlight", "num_features": 200,
            "floor": floor / rows, "rows": rows}


# ----------------------------------------------------------------------------- driver
def main(argv=None):
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the Criteo and regret files")
    parser.add_argument("--svm-scale", type=float, default=1.0, help="scale of the real-sim-shaped file")
    parser.add_argument("--bits", type=int, default=22, help="hash bits of the Criteo case (both tools)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="criteo,svmlight,regret")
    parser.add_argument("--workdir", default=None, help="where the text files go (default: a temporary folder)")
    parser.add_argument("--chunk-sizes", default=None,
                        help="comma list of chunk_size values (rows, or 'default' for the readers' default) for ours "
                             "at prior_var='auto', each its own pipeline in the same alternating runs (default: the "
                             "readers' default only)")
    args = parse_args(parser=parser, argv=argv)
    if args.quick:
        args.rows, args.svm_scale, args.repeats = min(args.rows, 20_000), min(args.svm_scale, 0.02), 1
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    try:
        chunk_sizes = [None if c.strip() == "default" else int(c) for c in args.chunk_sizes.split(",")] \
            if args.chunk_sizes else [None]
    except ValueError:
        parser.error(f"--chunk-sizes: expected a comma list of positive integers, got {args.chunk_sizes!r}")
    if any(c is not None and c < 1 for c in chunk_sizes):
        parser.error(f"--chunk-sizes: expected positive integers, got {args.chunk_sizes!r}")
    bad = [c for c in cases if c not in ("criteo", "svmlight", "regret")]
    if bad:
        parser.error(f"--cases: unknown {bad}; choose from criteo, svmlight, regret")
    workdir = args.workdir or tempfile.mkdtemp(prefix="pcv_online_text_")
    os.makedirs(workdir, exist_ok=True)
    vw = have_vw()
    if not vw:
        print("vowpalwabbit is not installed (pip install 'pyro_convexvb[bench]'): VW rows are skipped")
    _warm_kernels()  # compile and cache the kernels once, before the timed runs

    rows_out, payload = [], {"args": vars(args), "cases": {}}
    for case in cases:
        if case == "criteo":
            files = write_criteo(workdir, args.rows, args.seed, args.bits)
        elif case == "svmlight":
            files = write_svmlight(workdir, args.svm_scale, args.seed)
        else:
            files = write_regret(workdir, args.rows, args.seed)
        bits = args.bits if case == "criteo" else 18
        runners = {"VW (C++ parser, logistic, -b %d)" % bits: (run_vw, (files["vw"], bits))} if vw else {}
        for c in chunk_sizes:
            label = "ours, prior_var='auto' (default)" + ("" if c is None else f", chunk_size={c:,}")
            runners[label] = (run_ours, (files["ours"], files["fmt"], files["num_features"], "auto")
                              + (() if c is None else (c,)))
        runners["ours, prior_var=1 (one learner)"] = (run_ours, (files["ours"], files["fmt"], files["num_features"],
                                                                1.0))
        runs = {k: [] for k in runners}
        for _ in range(args.repeats):  # alternate the tools
            for name, (fn, fargs) in runners.items():
                r = peak_rss_in_subprocess(fn, *fargs, return_result=True)
                runs[name].append(r)
        split = {}  # where ours spends its time: parse and learn one after the other, CPU seconds
        for name, (fn, fargs) in runners.items():
            if fn is run_ours:
                split[name] = peak_rss_in_subprocess(run_split, *fargs, return_result=True)["result"]
        res = {}
        for name, rs in runs.items():
            sec = statistics.median(r["result"]["seconds"] for r in rs)
            out = rs[0]["result"]
            res[name] = {"rows": out["rows"], "seconds": sec, "rows_per_s": out["rows"] / sec,
                         "log_loss": out["log_loss"], "peak_mb": max(r["peak_mb"] for r in rs),
                         "delta_mb": max(r["delta_mb"] for r in rs),
                         "all_seconds": [r["result"]["seconds"] for r in rs]}
            if name in split:
                res[name]["split"] = split[name]
            rows_out.append({"case": case, "pipeline": name, "rows": out["rows"], "rows/s": res[name]["rows_per_s"],
                             "log loss": out["log_loss"], "floor": files["floor"],
                             "peak MiB": res[name]["peak_mb"], "above imports MiB": res[name]["delta_mb"],
                             "parse us/row (CPU)": split[name]["parse_us_per_row"] if name in split else None,
                             "learn us/row (CPU)": split[name]["learn_us_per_row"] if name in split else None})
        payload["cases"][case] = {"files": {k: v for k, v in files.items() if k in ("fmt", "num_features", "rows",
                                                                                      "floor")},
                                  "results": res}
    table = markdown_table(rows_out, floatfmt={"rows/s": ",.0f", "log loss": ".4f", "floor": ".4f",
                                               "peak MiB": ".0f", "above imports MiB": ".0f",
                                               "parse us/row (CPU)": ".2f", "learn us/row (CPU)": ".2f"})
    print(table)
    payload["table"] = table
    subset = "" if set(cases) == {"criteo", "svmlight", "regret"} else "_" + "_".join(cases)
    subset += "" if args.chunk_sizes is None else "_chunks"
    path = write_json(("online_text_quick" if args.quick else "online_text") + subset, payload)
    print(f"wrote {path}; text files in {workdir}")


if __name__ == "__main__":
    main()
