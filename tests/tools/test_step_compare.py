"""bench/step_compare.py's paired mode: windows pair up by position, the children measure the
tree they were given, and a figure it cannot measure is refused (no timing is asserted)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import qualia

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import step_compare as sc  # noqa: E402

TREE = os.path.dirname(os.path.dirname(os.path.abspath(qualia.__file__)))


def run(*args):
    return subprocess.run([sys.executable, str(BENCH / "step_compare.py"), *args],
                          capture_output=True, text=True, cwd=BENCH)


def test_the_table_pairs_the_windows_by_position():
    vals = [{"f": [10.0, 20.0, 30.0]}, {"f": [11.0, 19.0, 33.0]}]
    table = sc.paired_table(["/a", "/b"], vals).splitlines()
    assert table[0] == "| figure | a | b | b - a by window |"
    # medians 20.0 and 19.0; differences +1, -1, +3: median +1, one window lower, two higher
    assert table[2] == "| f | 20.0 | 19.0 | +1.00 (1 lower, 2 higher of 3, p=1) |"


def test_paired_windows_measure_each_figure_in_each_tree_the_same_tree_twice_included():
    fig = "decode n=64 ctx=128 mode=auto"
    r = run(TREE, TREE, "--paired", "--windows", "2", "--steps", "16", "--figure", fig)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()
    assert len(rows) == 3 and rows[2].startswith(f"| {fig} | ")
    cells = [c.strip() for c in rows[2].split("|")[2:4]]
    assert all(float(c) > 0 for c in cells)
    assert "of 2, p=" in rows[2]


def test_a_figure_the_paired_mode_cannot_measure_is_refused():
    r = run(TREE, "--paired", "--figure", "mixed mode=auto")
    assert r.returncode == 2 and "must name a decode figure" in r.stderr
    r = run(TREE, "--paired", "--steps", "20")
    assert r.returncode == 2 and "multiple of 16" in r.stderr
