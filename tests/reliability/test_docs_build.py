"""The documentation builds without a warning (Sphinx, MyST): broken anchors and foreign docstrings fail it."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    warn = tmp_path / "warnings.txt"
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html", os.path.join(ROOT, "docs"),
                           str(tmp_path / "html"), "-w", str(warn)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = warn.read_text() if warn.exists() else ""
    assert "WARNING" not in text and "ERROR" not in text, text[:3000]
