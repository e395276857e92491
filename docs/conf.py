"""Sphinx configuration of pyccl's documentation (Markdown pages through MyST, API from docstrings).

Build: bash tools/docs.sh (or python3 -m sphinx -W --keep-going -b html docs <out>), with pyccl
importable: built in place in this checkout (python3 setup.py build_ext --inplace; documented
first) or installed (pip install ., a wheel).  Importing pyccl needs no GPU.
"""
import importlib.machinery
import os
import re
import sys

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

_CHECKOUT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _built_in_place(root):
    """True where root/pyccl holds its extension (setup.py build_ext --inplace, an editable install)."""
    return any(os.path.isfile(os.path.join(root, "pyccl", "_C" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


if _built_in_place(_CHECKOUT):
    sys.path.insert(0, _CHECKOUT)
else:
    # the sources without their extension must not shadow an installed pyccl: sphinx runs with
    # the current folder first on sys.path, which is this checkout where tools/docs.sh runs
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _CHECKOUT]

try:
    import pyccl  # noqa: E402
except ImportError as e:
    raise ImportError(f"docs/conf.py: cannot import pyccl ({e}); build it in place (python3 setup.py "
                      "build_ext --inplace) or install it (pip install .)") from e

project = "pyccl"
author = "the pyccl authors"
release = pyccl.__version__
version = release

extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "results", "requirements.txt"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# `name` in docstrings is code, as in the Markdown pages
default_role = "literal"
autodoc_member_order = "bysource"
autodoc_default_options = {"undoc-members": False}
autodoc_typehints = "signature"

html_theme = "alabaster"
html_title = f"pyccl {release}"
html_static_path = []


class BenchHelp(SphinxDirective):
    """The `--help` text of `python -m pyccl.bench`, taken from its parser at build time."""

    def run(self):
        from pyccl.bench.cli import build_parser

        parser = build_parser()
        os.environ["COLUMNS"] = "100"  # the same text whatever the terminal
        text = parser.format_help()
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def named_op_default(app, what, name, obj, options, signature, return_annotation):
    """pyccl's ops are plain ints (SUM is 0), so Python reports a default of `op=0`: the
    reference shows the name that the guides and the docstrings use."""
    if signature:
        signature = re.sub(r"\bop=0\b", "op=SUM", signature)
    return signature, return_annotation


def setup(app):
    app.add_directive("bench-help", BenchHelp)
    app.connect("autodoc-process-signature", named_op_default)
    return {"parallel_read_safe": True}
