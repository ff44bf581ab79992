"""Every link between the documentation pages names a page that exists and, with ``#``, one of its headings' anchors
as MyST makes them (``myst_heading_anchors = 3``: hand-written slugs such as ``#benchmark-benchmarks-dual-vg-py``
did not resolve, and ``suppress_warnings = ["myst.header"]`` kept the build quiet about it)."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
LINK = re.compile(r"\]\(([A-Za-z0-9_]+\.md)?#([^)\s]+)\)|\]\(([A-Za-z0-9_]+\.md)\)")


def _anchors(path):
    from markdown_it import MarkdownIt
    from mdit_py_plugins.anchors import anchors_plugin

    md = MarkdownIt("commonmark").enable("table").use(anchors_plugin, max_level=3)
    with open(path, encoding="utf-8") as f:
        tokens = md.parse(f.read())
    return {t.attrGet("id") for t in tokens if t.type == "heading_open" and t.attrGet("id")}


def test_links_between_pages_resolve():
    pytest.importorskip("mdit_py_plugins")
    pages = sorted(glob.glob(os.path.join(DOCS, "*.md")))
    anchors = {os.path.basename(p): _anchors(p) for p in pages}
    bad = []
    for page in pages:
        name = os.path.basename(page)
        with open(page, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                for m in LINK.finditer(line):
                    target = m.group(1) or m.group(3) or name
                    if target not in anchors:
                        bad.append(f"{name}:{lineno}: no page {target}")
                    elif m.group(2) and m.group(2) not in anchors[target]:
                        bad.append(f"{name}:{lineno}: no heading anchor {target}#{m.group(2)}")
    assert not bad, "\n".join(bad)
