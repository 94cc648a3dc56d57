"""scripts/plant_bugs.py's own logic, with no test run: an edit applies only where its text occurs exactly once, and
each bug it plants still applies to this checkout and names tests that exist."""

import ast
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).parents[3]
plant_bugs = load_script("plant_bugs")


def test_an_edit_applies_only_where_its_text_occurs_exactly_once():
    assert plant_bugs.apply_edit("a = 1\nb = 2\n", "b = 2", "b = 3", "f.py") == "a = 1\nb = 3\n"
    for text, old, found in [
        ("a = 1\n", "b = 2", "not found"),
        ("x\nx\n", "x", "found 2 times"),
        ("a", "", "not found"),
    ]:
        with pytest.raises(plant_bugs.PlantError, match=f"f.py: the text to replace is {found}"):
            plant_bugs.apply_edit(text, old, "y", "f.py")


def test_every_planted_bug_applies_to_this_checkout_and_names_tests_that_exist():
    assert len({bug.name for bug in plant_bugs.PLANTED}) == len(plant_bugs.PLANTED) >= 3
    for bug in plant_bugs.PLANTED:
        text = (ROOT / bug.file).read_text()
        assert plant_bugs.apply_edit(text, bug.old, bug.new, bug.file) != text
        for test in bug.tests:
            file, _, name = test.partition("::")
            assert (ROOT / file).is_file(), test
            functions = {node.name for node in ast.parse((ROOT / file).read_text()).body if hasattr(node, "name")}
            assert not name or name in functions, test


def test_a_run_reads_src_and_the_editable_environments_from_the_copy(tmp_path):
    root, copy = tmp_path / "root", tmp_path / "copy"
    site = root / ".venv" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (site / "_editable_impl_env.pth").write_text(f"{root / 'environments' / 'env'}\n/elsewhere\n")
    assert plant_bugs.python_path(root, copy).split(":") == [str(copy / "src"), str(copy / "environments" / "env")]
