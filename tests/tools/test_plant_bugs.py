"""tools/plant_bugs.py: every planted bug still applies to the current sources (its old text occurs
exactly once), names a known area, and is not a no-op.  Cheap: nothing is built or run."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "plant_bugs.py")

spec = importlib.util.spec_from_file_location("plant_bugs", TOOL)
plant_bugs = importlib.util.module_from_spec(spec)
sys.modules.setdefault("plant_bugs", plant_bugs)    # its dataclasses look their module up
spec.loader.exec_module(plant_bugs)


@pytest.mark.parametrize("m", plant_bugs.MUTATIONS, ids=lambda m: m.name)
def test_each_planted_bug_applies_exactly_once(m):
    with open(os.path.join(ROOT, m.path), encoding="utf-8") as f:
        text = f.read()
    assert text.count(m.old) == 1, f"{m.name}: old text not found exactly once in {m.path}"
    assert m.new != m.old
    assert m.area in plant_bugs.AREAS
    assert m.path.startswith(("qualia/core/", "qualia/twin/"))


def test_planted_bug_names_are_unique_and_every_area_is_used():
    names = [m.name for m in plant_bugs.MUTATIONS]
    assert len(names) == len(set(names))
    assert {m.area for m in plant_bugs.MUTATIONS} == set(plant_bugs.AREAS)
    for area in plant_bugs.AREAS:
        for f in plant_bugs.area_tests(area, ROOT):
            assert os.path.exists(os.path.join(ROOT, f)), f


def test_check_applies_rejects_a_missing_or_repeated_old_text(tmp_path):
    (tmp_path / "x.pxi").write_text("a = 1\na = 1\nb = 2\n")
    M = plant_bugs.Mutation
    plant_bugs.check_applies(M("ok", "pool", "x.pxi", "b = 2", "b = 3", ""), str(tmp_path))
    with pytest.raises(ValueError, match="2 times"):
        plant_bugs.check_applies(M("twice", "pool", "x.pxi", "a = 1", "a = 2", ""), str(tmp_path))
    with pytest.raises(ValueError, match="0 times"):
        plant_bugs.check_applies(M("gone", "pool", "x.pxi", "c = 3", "c = 4", ""), str(tmp_path))
