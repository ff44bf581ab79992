"""Sphinx configuration for pyro_convexvb."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "pyro_convexvb"
author = "pyro_convexvb developers"
release = "0.1.0"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax", "sphinx.ext.viewcode"]
myst_enable_extensions = ["dollarmath", "amsmath"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
master_doc = "index"
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_mock_imports = []
html_theme = "alabaster"
suppress_warnings = ["myst.header"]
myst_heading_anchors = 3


def _skip_scikit_learn_members(app, what, name, obj, skip, options):
    """Leave out the members scikit-learn generates on estimators (``set_fit_request`` and the other metadata
    routing setters): their docstrings refer to scikit-learn's own glossary and labels, which these docs lack;
    scikit-learn's documentation describes them."""
    qualname = getattr(obj, "__qualname__", "") or ""
    module = getattr(obj, "__module__", "") or ""
    if module.startswith("sklearn") or "RequestMethod" in qualname:
        return True
    return skip


def setup(app):
    app.connect("autodoc-skip-member", _skip_scikit_learn_members)
