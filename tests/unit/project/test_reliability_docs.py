"""docs/reliability.md names tests that exist: every test file it names, and every test function (``file::name``, a
``*`` pattern matching at least one)."""

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).parents[3]
DOC = ROOT / "docs" / "reliability.md"


def named_tests(text: str) -> list[tuple[str, str | None]]:
    """Each ``tests/...py`` or ``tests/...py::name`` the page names in backticks: (file, name or None)."""
    return [(match[1], match[2]) for match in re.finditer(r"`(tests/[\w/.-]+\.py)(?:::([\w*]+))?`", text)]


def functions_of(path: Path) -> set[str]:
    """The names of the functions of a test file, at its top level or in its classes."""
    tree = ast.parse(path.read_text())
    nodes = [*tree.body, *(node for cls in tree.body if isinstance(cls, ast.ClassDef) for node in cls.body)]
    return {node.name for node in nodes if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_test_the_reliability_page_names_exists():
    named = named_tests(DOC.read_text())
    assert len(named) > 50  # the page's tables were read
    missing = []
    for file, name in named:
        if not (ROOT / file).is_file():
            missing.append(file)
        elif name and not fnmatch.filter(functions_of(ROOT / file), name):
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
