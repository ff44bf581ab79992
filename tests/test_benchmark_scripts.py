"""Every ``benchmarks/*.py`` script runs in its ``--quick`` mode (slow: ``pytest -m slow``).

A benchmark is only run by hand, so an option it passes that the package no longer accepts, or a form an engine
now picks on its data, shows up nowhere else.  Results and figures go to a temporary directory
(``$PYRO_CONVEXVB_RESULTS_DIR``, ``$PYRO_CONVEXVB_FIGURES_DIR``): the committed ones are never touched.
"""
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_") and p.name != "check.py")


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_mode_runs_and_writes_only_to_the_given_directories(script, tmp_path):
    results, figures = tmp_path / "results", tmp_path / "figures"
    committed = {p: p.stat().st_mtime_ns for p in (BENCHMARKS / "results").glob("*.json")}
    env = dict(os.environ, MPLBACKEND="Agg", PYRO_CONVEXVB_RESULTS_DIR=str(results),
               PYRO_CONVEXVB_FIGURES_DIR=str(figures))
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"], env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert list(results.glob("*.json")), f"{script} --quick wrote no results JSON to $PYRO_CONVEXVB_RESULTS_DIR"
    changed = [p.name for p, t in committed.items() if p.stat().st_mtime_ns != t]
    assert not changed, f"{script} --quick rewrote committed results: {changed}"
