"""Sphinx configuration: the documentation site (``make docs``).

Sphinx, as mpi4py, NumPy and PyTorch build theirs: autodoc renders the API reference from the
docstrings the code already carries (napoleon reads their NumPy/Google sections), so a renamed
argument shows up in the reference without anyone editing a page; MyST lets the narrative pages
stay Markdown that also reads well on GitHub; the doctest builder runs the pages' examples.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "mpiallreduce"
author = "the mpiallreduce developers"
copyright = "the mpiallreduce developers"  # noqa: A001 - Sphinx's name for it

import mpiallreduce  # noqa: E402 - after the path above

release = version = mpiallreduce.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "results", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# mpiallreduce.torch imports torch, an optional extra the docs build does not need
autodoc_mock_imports = ["torch"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# defaults as the source spells them (op=MPI.SUM), not their repr (<mpi4py.MPI.Op object>)
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_numpy_docstring = True
napoleon_google_docstring = True

# The examples run at one rank (a singleton MPI process), as `python script.py` would.
doctest_global_setup = """
import numpy as np
from mpi4py import MPI
import mpiallreduce as mar
"""

html_theme = "furo" if __import__("importlib").util.find_spec("furo") else "alabaster"
html_title = f"mpiallreduce {release}"
html_static_path = []
