"""Tests of the shared benchmark helpers (benchmarks/_common.py)."""
import json
import math
import operator
import os
import sys
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _common as bc  # noqa: E402


def test_timer_measures_sleep():
    with bc.Timer() as t:
        time.sleep(0.05)
        inside = t.seconds
    assert 0.045 <= t.seconds < 1.0
    assert inside <= t.seconds
    frozen = t.seconds
    time.sleep(0.01)
    assert t.seconds == frozen
    with pytest.raises(RuntimeError, match="not started"):
        bc.Timer().seconds


def test_peak_rss_monotone_and_positive():
    a = bc.peak_rss_mb()
    buf = np.ones(30 * 2 ** 20 // 8)  # 30 MiB, touched
    b = bc.peak_rss_mb()
    assert a > 10 and b >= a
    assert bc.current_rss_mb() > 10
    del buf


def test_peak_rss_sampler_sees_block_allocation():
    with bc.PeakRSS(interval=0.001) as mem:
        buf = np.ones(200 * 2 ** 20 // 8)  # 200 MiB, alive until the exit sample (no timing dependence)
    del buf
    # freed memory of earlier tests may be reused, so only a clear majority of the block must show
    assert 120 < mem.delta_mb < 400
    assert mem.peak_mb >= mem.start_mb


def test_peak_rss_in_subprocess_exact():
    r = bc.peak_rss_in_subprocess(operator.mul, b"x", 100 * 2 ** 20)
    assert 95 <= r["delta_mb"] < 130, r
    assert r["baseline_mb"] > 5 and r["result"] is None and r["seconds"] >= 0
    r = bc.peak_rss_in_subprocess(operator.add, 2, 3, return_result=True)
    assert r["result"] == 5
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        bc.peak_rss_in_subprocess(operator.truediv, 1, 0)


def test_markdown_table_layout_and_formats():
    rows = [{"engine": "cvi", "seconds": 0.03125, "nlpd": 0.25, "iters": 12},
            {"engine": "svi_automvn", "seconds": 12.5, "nlpd": None, "iters": 3000}]
    out = bc.markdown_table(rows, ["engine", ("seconds", "time (s)"), "nlpd", "iters"],
                            floatfmt={"seconds": ".2f", "nlpd": ".3f"})
    lines = out.split("\n")
    assert lines[0] == "| engine      | time (s) | nlpd  | iters |"
    assert lines[1] == "|:------------|---------:|------:|------:|"
    assert lines[2] == "| cvi         |     0.03 | 0.250 |    12 |"
    assert lines[3] == "| svi_automvn |    12.50 |     - |  3000 |"
    # sequences, default columns, numpy/torch scalars, NaN
    out2 = bc.markdown_table([("a", np.float64(1.5), torch.tensor(2.0))], ["n", "x", "y"], ".1f")
    assert out2.split("\n")[2] == "| a   | 1.5 | 2.0 |"
    assert bc.markdown_table([{"v": float("nan")}]).split("\n")[2] == "| nan |"
    with pytest.raises(ValueError, match="columns"):
        bc.markdown_table([(1, 2)])
    with pytest.raises(ValueError, match="entries"):
        bc.markdown_table([(1, 2)], ["a"])


def test_write_json_and_machine_info(tmp_path):
    path = bc.write_json("unit", {"x": np.float64(1.5), "arr": np.arange(3), "t": torch.tensor([1.0, 2.0]),
                                  "bad": float("nan"), "nested": {"k": (1, 2)}}, results_dir=str(tmp_path))
    assert path == str(tmp_path / "unit.json")
    doc = json.loads(open(path).read())
    assert doc["benchmark"] == "unit"
    assert doc["x"] == 1.5 and doc["arr"] == [0, 1, 2] and doc["t"] == [1.0, 2.0]
    assert doc["bad"] is None and doc["nested"] == {"k": [1, 2]}
    m = doc["machine"]
    assert m["cpu_count"] == os.cpu_count()
    assert m["torch"].startswith(torch.__version__.split("+")[0])
    assert m["pyro-ppl"] and m["gpytorch"] and m["date"][:4].isdigit()
    with pytest.raises(ValueError, match="payload"):
        bc.write_json("unit", [1, 2], results_dir=str(tmp_path))


def test_save_figure(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    path = bc.save_figure(fig, "unit", figures_dir=str(tmp_path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)


def test_parse_args_standard_flags():
    old = torch.get_num_threads()
    try:
        args = bc.parse_args("x", ["--quick", "--threads", "1", "--seed", "7"])
        assert args.quick and args.threads == 1 and args.seed == 7
        assert torch.get_num_threads() == 1
        args = bc.parse_args("x", [])
        assert not args.quick and args.seed == 0
        p = bc.make_parser("x")
        p.add_argument("--n", type=int, default=3)
        assert bc.parse_args(argv=["--n", "5"], parser=p).n == 5
        with pytest.raises(SystemExit):
            bc.parse_args("x", ["--threads", "0"])
    finally:
        torch.set_num_threads(old)


def test_classification_metrics_against_hand_values():
    p = np.array([0.9, 0.2, 0.5, 0.7])
    y = np.array([1, 1, 0, 0])
    m = bc.classification_metrics(torch.tensor(p), torch.tensor(y, dtype=torch.float32))
    # predictions 1, 0, 0 (tie -> class 0), 1 -> errors at cases 2 and 4
    assert m["test_error"] == 0.5 and m["accuracy"] == 0.5 and m["n"] == 4
    expected = -(math.log(0.9) + math.log(0.2) + math.log(0.5) + math.log(0.3)) / 4
    assert m["nlpd"] == pytest.approx(expected, rel=1e-12)
    assert bc.nlpd([1.0], [0]) == pytest.approx(-math.log(1e-12), rel=1e-5)  # clipped, finite
    with pytest.raises(ValueError, match="labels"):
        bc.test_error([0.5], [2])
    with pytest.raises(ValueError, match="probabilities"):
        bc.nlpd([1.5], [1])
    with pytest.raises(ValueError, match="shapes"):
        bc.nlpd([0.5, 0.5], [1])
