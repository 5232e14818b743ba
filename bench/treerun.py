"""A bench's measurement in a child interpreter per checkout, the checkouts taking turns: shared
by step_compare.py and ring_latency.py (no numpy here: the parent imports it, and numpy's BLAS
threads would spin beside the children)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def rotated(n, r):
    """The order of n trees in round r: it rotates, so that no tree always runs first."""
    return list(range(r % n, n)) + list(range(r % n))


def child_env(tree):
    """The environment of a child whose ``qualia`` is the tree's."""
    return dict(os.environ, PYTHONPATH=tree)


def check_qualia(tree, path):
    """A child's ``qualia`` (the folder it imported) must be the tree's."""
    assert path == os.path.join(tree, "qualia"), f"wrong qualia imported: {path}"


def run_child(script, tree, args):
    """The JSON object ``script --child ARGS...`` prints, run in a child whose ``qualia`` is the
    tree's (its "qualia" key checked and removed)."""
    res = subprocess.run([sys.executable, script, "--child", *args], env=child_env(tree),
                         cwd=os.path.dirname(script), capture_output=True, text=True, check=True)
    r = json.loads(res.stdout)
    check_qualia(tree, r.pop("qualia"))
    return r
