"""The floors of ``src/``, a folder each: the contracts (``contracts``) at the bottom, the three processes on them,
the operator tools (``tools``) and the launcher (``launch``) above. No module imports from a floor above its own
(lazy imports inside functions included), and the three processes import nothing from each other. Inside the
orchestrator, every module lies in the folder of its part (``tests/orchestrator_parts.py``), the rollout core's folders
import neither the verifiers adapter nor the run loop that joins the two, and only the adapter imports the libraries it
wraps."""

import ast
from pathlib import Path

from orchestrator_parts import (
    ADAPTED_LIBRARIES,
    ADAPTER,
    CORE,
    LOOP,
    TOP_LEVEL,
    folder,
    in_adapter,
    joins,
    orchestrator_modules,
)

SRC = Path(__file__).parents[3] / "src"
PROCESSES = {"trainer", "orchestrator", "inference"}
FLOORS = ["contracts", "processes", "tools", "launch"]  # bottom first


def floor(module: str) -> int | None:
    """The floor of a module of ``src/`` by its dotted name; None for one from outside (stdlib, third party)."""
    top = module.split(".")[0]
    if top in PROCESSES:
        return FLOORS.index("processes")
    return FLOORS.index(top) if top in FLOORS else None


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports (``from contracts import x`` counts as ``rl.x``), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def module_level_imports(path: Path) -> list[tuple[int, str]]:
    """The modules a file imports when it is imported (not inside a function)."""
    found = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def source_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_src_holds_only_the_floors_packages():
    assert {path.relative_to(SRC).parts[0] for path in source_files()} == PROCESSES | {"contracts", "tools", "launch"}


def test_no_module_imports_from_a_floor_above_its_own():
    wrong = []
    for path in source_files():
        name = module_name(path)
        for line, target in imported(path):
            if floor(target) is not None and floor(target) > floor(name):
                wrong.append(f"{path.relative_to(SRC)}:{line} ({FLOORS[floor(name)]}) imports {target} "
                             f"({FLOORS[floor(target)]})")  # fmt: skip
    assert wrong == []


def test_the_processes_import_nothing_from_each_other():
    wrong = []
    for path in source_files():
        package = module_name(path).split(".")[0]
        for line, target in imported(path):
            other = target.split(".")[0]
            if package in PROCESSES and other in PROCESSES and other != package:
                wrong.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert wrong == []


def test_the_walk_sees_imports_of_every_floor():
    floors = {floor(target) for path in source_files() for _, target in imported(path)}
    assert floors >= set(range(len(FLOORS)))


def test_every_orchestrator_module_lies_in_a_folder_of_its_parts():
    loose = [
        m for m in orchestrator_modules() if m != "orchestrator" and folder(m) not in CORE | {ADAPTER, LOOP} | TOP_LEVEL
    ]
    assert loose == []


def test_the_rollout_core_imports_neither_the_verifiers_adapter_nor_the_loop_that_joins_them():
    wrong = []
    for path in source_files():
        name = module_name(path)
        if folder(name) not in CORE:
            continue
        for line, target in imported(path):
            if in_adapter(target) or joins(target):
                wrong.append(f"{path.relative_to(SRC)}:{line} ({folder(name)}/, rollout core) imports {target}")
    assert wrong == []


def test_only_the_verifiers_adapter_imports_the_libraries_it_wraps():
    """At import: ``orchestrator/config.py`` asks renderers whether it knows a ``[model] renderer`` name only when it
    checks one."""
    wrong = []
    for path in source_files():
        for line, target in module_level_imports(path):
            if target.split(".")[0] in ADAPTED_LIBRARIES and not in_adapter(module_name(path)):
                wrong.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert wrong == []


def test_the_orchestrators_config_imports_no_orchestrator_logic():
    """``orchestrator/config.py`` describes the run; the parts that act on it import it, never the other way."""
    config = SRC / "orchestrator" / "config.py"
    wrong = [f"line {line}: {target}" for line, target in imported(config) if target.split(".")[0] == "orchestrator"]
    assert wrong == []
