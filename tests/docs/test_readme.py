"""README.md's Python snippets run as printed, and tests/typing/readme_snippets.py (which .ci/run
type-checks with mypy) holds every one of them word for word."""

from __future__ import annotations

import pathlib
import re
import runpy

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
SNIPPETS = CHECKOUT / "tests" / "typing" / "readme_snippets.py"


def readme_python_blocks():
    text = (CHECKOUT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_every_readme_snippet_is_type_checked():
    blocks = readme_python_blocks()
    assert len(blocks) >= 3
    typed = SNIPPETS.read_text(encoding="utf-8")
    for block in blocks:
        assert block in typed, f"README snippet missing from {SNIPPETS.name}:\n{block}"


def test_readme_snippets_run(capsys):
    namespace = runpy.run_path(str(SNIPPETS), run_name="readme_snippets")
    # the error snippet's admission failed in the store's attach, which then counts nothing
    assert namespace["sched"].active_count() == 0
    assert (namespace["store"].hits, namespace["store"].misses) == (0, 0)
    lines = capsys.readouterr().out.splitlines()
    # the engine step snippet: 8 requests finished at max_new_tokens, then run()'s 8 more
    assert [line.split()[1] for line in lines[:8]] == ["length"] * 8
    assert lines[8].startswith("8 ")
    # the forks snippet: the n group's 4 outputs, the beam group's 3 hypotheses best first
    assert lines[9].startswith("1 4 ['length', 'length', 'length', 'length'] None")
    assert lines[10].startswith("2 3 ['length', 'length', 'length'] [-")
    scores = [float(x) for x in lines[10].split("[")[2].rstrip("]").split(",")]
    assert scores == sorted(scores, reverse=True)
    forks, copies = int(lines[11].split()[0]), int(lines[11].split()[2])
    assert forks >= 3 + 2 and copies >= 3
    assert lines[12].startswith("1 ")  # the facade snippet's print(batch_size, ...)
