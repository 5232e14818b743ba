"""Explain a missing compiled core: what went wrong and what to do.

``import qualia`` from a checkout whose ``qualia/_core`` was never built (``python -m qualia`` or
``python -m pytest`` run in the checkout's root put the current directory first on ``sys.path``,
ahead of the installed package) would otherwise fail with a bare ``No module named
'qualia._core'``.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from typing import List, Optional

__all__ = ["explain_missing_core", "compiled_core", "installed_elsewhere"]


def compiled_core(package_dir: str) -> Optional[str]:
    """The path of the compiled core in ``package_dir`` for this interpreter, or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(package_dir, "_core" + suffix)
        if os.path.isfile(path):
            return path
    return None


def installed_elsewhere(package: str, package_dir: str) -> Optional[str]:
    """The folder of another copy of ``package`` on sys.path that has its compiled core."""
    here = os.path.realpath(os.path.dirname(package_dir))
    others: List[str] = []
    for entry in sys.path:
        if os.path.realpath(entry or os.getcwd()) != here:
            others.append(entry)
    spec = importlib.machinery.PathFinder.find_spec(package, others)
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        if compiled_core(where):
            return where
    return None


def explain_missing_core(package: str, package_dir: str) -> Optional[str]:
    """The message for an ImportError of ``package._core``, or None when the compiled core is
    present (it then failed to load for a reason of its own, which must be shown as it is)."""
    if compiled_core(package_dir):
        return None
    root = os.path.dirname(package_dir)
    if not os.path.isfile(os.path.join(root, "setup.py")):
        return (f"{package}'s compiled core ({package}._core) is missing from {package_dir}: the "
                f"installation is incomplete; reinstall it with `python -m pip install "
                f"--force-reinstall {package}` (building needs a C compiler and the Python "
                f"headers).")
    lines = [f"`import {package}` found the source tree {package_dir}, whose compiled core "
             f"({package}._core) is not built."]
    other = installed_elsewhere(package, package_dir)
    if other:
        lines.append(f"It hides the installed {package} in {other}: the current directory (or "
                     f"PYTHONPATH) comes first on sys.path, as with `python -m ...` run in the "
                     f"checkout.")
    lines.append(f"To use the installed package, run from outside the checkout or use the "
                 f"console scripts (`{package} simulate ...`, `pytest` rather than `python -m "
                 f"pytest`).")
    lines.append(f"To work on the source tree, build the core in place: `python -m pip install "
                 f"-e \".[test]\"` in {root} (needs a C compiler and the Python headers).")
    return "\n".join(lines)
