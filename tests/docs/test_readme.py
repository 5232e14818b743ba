"""README.md: its Python snippets run as printed, tests/typing/readme_snippets.py (which .ci/run
type-checks with mypy) holds every one of them word for word, it stays within 300 lines, and its
two commands are the ones .ci/run runs."""

from __future__ import annotations

import pathlib
import re
import runpy

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
README = CHECKOUT / "README.md"
SNIPPETS = CHECKOUT / "tests" / "typing" / "readme_snippets.py"


def readme_python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_every_readme_snippet_is_type_checked():
    blocks = readme_python_blocks()
    assert len(blocks) >= 1
    typed = SNIPPETS.read_text(encoding="utf-8")
    for block in blocks:
        assert block in typed, f"README snippet missing from {SNIPPETS.name}:\n{block}"


def test_readme_snippets_run(capsys):
    runpy.run_path(str(SNIPPETS), run_name="readme_snippets")
    lines = capsys.readouterr().out.splitlines()
    # the engine step snippet: 8 requests finished at max_new_tokens, then run()'s 8 more, the
    # later ones' system prompt taken from the cache
    assert [line.split()[1] for line in lines[:8]] == ["length"] * 8
    finished, tokens, hits = (int(x) for x in lines[8].split())
    assert finished == 8 and tokens > 0 and hits > 0


def test_readme_fits_in_300_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300


def test_the_readme_commands_are_the_ones_ci_runs():
    text = README.read_text(encoding="utf-8")
    ci = (CHECKOUT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python -m pip install . && qualia simulate --check" in text
    assert 'python -m pip install ".[test]" && pytest' in text
    assert re.search(r"^python -m pip install .*\"\.\[test[],]", ci, re.M)
    assert re.search(r"^pytest$", ci, re.M)


def test_the_readme_names_the_layout():
    text = README.read_text(encoding="utf-8")
    table = text[text.index("## Layout"):]
    for path in ("qualia/core/step/", "qualia/twin/", "qualia/sim/", "qualia/cli/",
                 "qualia/cluster/", "qualia/vllm/", "qualia/model/", "csrc/", "tests/", "bench/",
                 "tools/", "docs/", "examples/"):
        assert f"`{path}" in table, path
        assert (CHECKOUT / path).is_dir(), path


def test_the_readme_tells_no_history():
    text = README.read_text(encoding="utf-8")
    assert not re.search(r"issue [0-9]+|\(#[0-9]+\)|used to|previously|no longer|"
                         r"commit `?[0-9a-f]{7}|\*\*(met|missed)\*\*", text, re.I)
