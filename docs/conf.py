"""Sphinx configuration of qualia's documentation site.

Build it from the checkout's root, after installing the package with its ``docs`` extra::

    python -m pip install ".[docs]"
    python -m sphinx -W -b html docs docs/_build/html

The API reference is generated from the installed package: the compiled core's docstrings and
the signatures Cython embeds in them (``embedsignature``), and the Python modules' docstrings.
"""

from __future__ import annotations

import glob
import inspect
import os
import sys

# `python -m sphinx` puts the current folder first on sys.path.  From the checkout's root that
# folder holds the source tree's qualia/, whose compiled core exists only after an editable
# install (which builds it in place): without it, document the installed package instead.
_ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
if not glob.glob(os.path.join(_ROOT, "qualia", "_core.*.so")):
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _ROOT]

import qualia  # noqa: E402

project = "qualia"
author = "the qualia authors"
copyright = "the qualia authors, Apache License 2.0"
release = qualia.__version__
version = qualia.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown: heading anchors for the in-page links of DESIGN.md and the guides.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "groupwise"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}

html_theme = "furo"
html_title = f"qualia {release}"


# -- qualia.vllm without vLLM ---------------------------------------------------------------------
# qualia.vllm imports vLLM (and checks its release line) when it is imported.  Where vLLM is not
# installed, import it against a stand-in of vLLM's modules, of the supported release, so that
# its reference is generated all the same.
try:
    import vllm  # noqa: F401
except ImportError:
    from sphinx.ext.autodoc.mock import mock

    with mock(["vllm"]):
        import vllm as _vllm_stand_in

        _vllm_stand_in.__version__ = "0.32.0"
        import qualia.vllm  # noqa: F401  (stays imported, built on the stand-in)


# -- the twin's members --------------------------------------------------------------------------
# qualia.twin is the compiled core's executable specification, method for method: a twin member
# without a docstring of its own shows the docstring of the core member it mirrors.


#: Twin classes named apart from the core class they mirror.
_TWIN_OF = {"PyHashBackend": "HashBackend"}


def _twin_mirror(name):
    parts = name.split(".")
    if parts[:2] != ["qualia", "twin"] or len(parts) < 4:
        return None
    parts[-2] = _TWIN_OF.get(parts[-2], parts[-2])
    core = getattr(qualia, parts[-2], None)
    member = getattr(core, parts[-1], None) if core is not None else None
    doc = inspect.getdoc(member) if member is not None else None
    if not doc:
        return None
    lines = doc.splitlines()
    if lines and lines[0].startswith((f"{parts[-2]}.{parts[-1]}(", f"{parts[-1]}(")):
        lines = lines[1:]  # the signature Cython embeds
        while lines and not lines[0].strip():
            lines = lines[1:]
    return [f"As :py:obj:`qualia.{parts[-2]}.{parts[-1]}`:", ""] + lines


def _docstring(app, what, name, obj, options, lines):
    if not any(line.strip() for line in lines):
        mirrored = _twin_mirror(name)
        if mirrored:
            lines[:] = mirrored


def _signature(app, what, name, obj, options, signature, return_annotation):
    # Cython embeds a method's signature with its `self`: leave it out, as for Python methods
    if what == "method" and signature and signature.startswith("(self"):
        signature = "(" + signature[len("(self"):].lstrip(", ")
        return signature, return_annotation
    return None


def setup(app):
    app.connect("autodoc-process-docstring", _docstring)
    app.connect("autodoc-process-signature", _signature)
