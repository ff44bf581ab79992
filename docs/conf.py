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
