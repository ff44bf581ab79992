"""docs/design.md's code runs as written, and docs/api.md documents every module of pyro_convexvb.design."""
import pathlib
import pkgutil
import re

import pytest

import pyro_convexvb.design

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def test_the_active_learner_block_runs_as_written():
    """The block used X_pool, y_pool, initial_indices, X_test and y_test without defining them (NameError)."""
    pytest.importorskip("sklearn")
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "design.md").read_text(), re.S)
    block = next(b for b in blocks if "ActiveLearner(" in b)
    ns = {}
    exec(compile(block, "docs/design.md", "exec"), ns)
    h = ns["history"]
    assert len(h.chosen) == 30 and len(set(h.chosen)) == 30
    assert h.num_included[0] == 10 and h.num_included[-1] == 40
    # the numbers the page quotes: 10 and 3 errors among the 169 test cases
    assert h.test_error[0] == pytest.approx(10 / 169) and h.test_error[-1] == pytest.approx(3 / 169)
    assert "the test error is 5.9%; after the 30 inclusions (40 labels) it is 1.8%" in (DOCS / "design.md").read_text()


def test_api_page_lists_every_design_module():
    api = (DOCS / "api.md").read_text()
    names = [m.name for m in pkgutil.iter_modules(pyro_convexvb.design.__path__, "pyro_convexvb.design.")]
    assert "pyro_convexvb.design.imaging_map" in names
    missing = [n for n in names if f".. automodule:: {n}\n" not in api]
    assert not missing, missing
