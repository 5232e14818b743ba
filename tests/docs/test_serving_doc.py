"""docs/serving.md: every Python snippet runs as printed and prints what the page says it
prints; the page's profile table is what the profiles give."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import textwrap

import pytest

from qualia.sim.clock import PROFILES, ModeledClock, StepWork

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def snippets():
    """(code, expected output) of each Python block followed by "prints" and an indented
    block."""
    text = PAGE.read_text(encoding="utf-8")
    pat = re.compile(r"```python\n(.*?)```\n\n(?:which )?prints\n\n((?:    [^\n]*\n)+)", re.S)
    return [(code, textwrap.dedent(out).strip("\n")) for code, out in pat.findall(text)]


def test_the_page_has_its_snippets():
    assert len(snippets()) == 2
    assert PAGE.read_text(encoding="utf-8").count("```python") == 2


@pytest.mark.parametrize("index", range(2))
def test_each_snippet_prints_what_the_page_says(index):
    code, expected = snippets()[index]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, f"{PAGE.name} snippet {index}", "exec"), {})
    assert buf.getvalue().strip("\n") == expected


def test_the_profile_table_is_what_the_profiles_give():
    text = PAGE.read_text(encoding="utf-8")
    for name, p in PROFILES.items():
        c = ModeledClock(p)
        row = re.search(rf"^\| `{re.escape(name)}`[^|]*\|(.*)\|$", text, re.M)
        assert row is not None, name
        cells = [x.strip() for x in row.group(1).split("|")]
        expected = [f"{p.kv_pages(16):,}", f"{p.kv_tokens(16):,}",
                    f"{p.max_num_batched_tokens:,}",
                    f"{c.seconds(StepWork.from_lens([1], [1000])) * 1e3:.1f}",
                    f"{c.seconds(StepWork.from_lens([1] * 64, [1000] * 64)) * 1e3:.1f}",
                    f"{c.seconds(StepWork.from_lens([2048], [2048])) * 1e3:.1f}"]
        assert cells == expected, name
