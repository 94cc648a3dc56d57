"""Synthetic localisation tasks: a small Python project generated from a seed, with one planted bug.

:func:`plan` makes every random choice (theme, bug, which other modules and tests exist, the issue's wording)
and is cheap, so a taskset can describe thousands of tasks without writing a file; :func:`repo_files` turns a
plan into file contents, and the task's setup writes them into the rollout's copy.
"""

import random
from dataclasses import dataclass

from swe_grep_oss_env.catalog import BUGS, MODULES, THEMES

CORE_MODULES = ("errors", "models", "validation", "store")
"""In every repository."""


@dataclass(frozen=True)
class Plan:
    seed: int
    theme: tuple[str, str, str]
    bug: str
    modules: tuple[str, ...]
    """Module keys of the catalog, in catalog order."""
    tested: tuple[str, ...]
    """Modules that get a test file."""
    issue: str
    version: str

    @property
    def package(self) -> str:
        return self.theme[0]

    @property
    def answer_files(self) -> list[str]:
        """The files the planted bug edits, relative to the repository root."""
        return sorted({f"{self.package}/{MODULES[edit.module].path}" for edit in BUGS[self.bug].edits})


def placeholders(theme: tuple[str, str, str]) -> dict[str, str]:
    project, entity, entities = theme
    return {
        "project": project,
        "Project": project.capitalize(),
        "PROJECT": project.upper(),
        "entity": entity,
        "Entity": entity.capitalize(),
        "entities": entities,
    }


def fill(template: str, names: dict[str, str]) -> str:
    """``template`` with each ``<name>`` replaced by ``names[name]``; unknown ``<...>`` stay as they are."""
    for name, value in names.items():
        template = template.replace(f"<{name}>", value)
    return template


def plan(seed: int, bug: str | None = None) -> Plan:
    """The task of ``seed``: same seed, same task. ``bug`` forces which bug is planted (tests use it)."""
    rng = random.Random(seed)
    theme = rng.choice(THEMES)
    bug = bug if bug is not None else rng.choice(sorted(BUGS))
    wanted = set(CORE_MODULES) | {edit.module for edit in BUGS[bug].edits} | set(BUGS[bug].needs)
    optional = [name for name in MODULES if name not in wanted]
    wanted |= set(rng.sample(optional, rng.randint(1, 3)))
    modules = _with_dependencies(wanted)
    tested = tuple(name for name in modules if MODULES[name].tests and rng.random() < 0.7)
    issue = fill(rng.choice(BUGS[bug].issues), placeholders(theme) | BUGS[bug].params(rng))
    version = f"0.{rng.randint(1, 9)}.{rng.randint(0, 12)}"
    return Plan(seed, theme, bug, modules, tested, issue, version)


def _with_dependencies(names: set[str]) -> tuple[str, ...]:
    todo, closed = list(names), set()
    while todo:
        name = todo.pop()
        if name not in closed:
            closed.add(name)
            todo.extend(MODULES[name].needs)
    return tuple(name for name in MODULES if name in closed)


def repo_files(plan: Plan, plant_bug: bool = True) -> dict[str, str]:
    """Path (relative to the repository root) -> text of every file of the planned repository."""
    code = {name: MODULES[name].code for name in plan.modules}
    if plant_bug:
        for edit in BUGS[plan.bug].edits:
            code[edit.module] = replace_once(code[edit.module], edit.old, edit.new, f"{plan.bug} in {edit.module}")
    names = placeholders(plan.theme)
    package = plan.package
    files = {
        "README.md": readme(plan),
        "pyproject.toml": pyproject(plan),
        ".gitignore": "__pycache__/\n*.egg-info/\n.pytest_cache/\n",
        f"{package}/__init__.py": f'"""{names["Project"]}: keep track of {names["entities"]}."""\n\n'
        f'__version__ = "{plan.version}"\n',
        f"{package}/core/__init__.py": '"""Domain objects, their rules and their storage."""\n',
    }
    if any(MODULES[name].path.startswith("utils/") for name in plan.modules):
        files[f"{package}/utils/__init__.py"] = f'"""Helpers that know nothing about {names["entities"]}."""\n'
    for name in plan.modules:
        files[f"{package}/{MODULES[name].path}"] = fill(code[name], names)
    for name in plan.tested:
        tests = [test.code for test in MODULES[name].tests if plan.bug not in test.catches]
        if tests:
            stem = MODULES[name].path.rsplit("/", 1)[-1]
            text = MODULES[name].test_imports + "\n\n" + "\n\n".join(tests)
            files[f"tests/test_{stem}"] = fill(text, names)
    return files


def replace_once(text: str, old: str, new: str, where: str) -> str:
    """``text`` with its one occurrence of ``old`` replaced; a ValueError names ``where`` otherwise."""
    count = text.count(old)
    if count != 1:
        raise ValueError(f"bug edit {where}: expected the old text once, found it {count} times: {old!r}")
    return text.replace(old, new)


def readme(plan: Plan) -> str:
    names = placeholders(plan.theme)
    parts = [
        f"# {plan.package}\n\n{names['Project']} keeps track of {names['entities']}: what they cost, who may change "
        "them, and how they are reported.\n",
        "## Install\n\n    pip install -e .\n",
    ]
    if "cli" in plan.modules:
        parts.append(f"## Usage\n\n    {plan.package} list [--limit N]\n    {plan.package} show ID\n")
    if "config" in plan.modules:
        parts.append(
            f"## Configuration\n\nSettings come from the defaults, then from a TOML file given with `--config`, "
            f"then from environment variables named `{names['PROJECT']}_<KEY>` (e.g. "
            f"`{names['PROJECT']}_PAGE_SIZE=50`).\n\n| key | default |\n|---|---|\n| page_size | 20 |\n"
            "| timeout | 30s |\n| currency | USD |\n"
        )
    parts.append("## Development\n\n    pip install pytest\n    pytest\n")
    return "\n".join(parts)


def pyproject(plan: Plan) -> str:
    text = f'[project]\nname = "{plan.package}"\nversion = "{plan.version}"\nrequires-python = ">=3.11"\n'
    if "cli" in plan.modules:
        text += f'\n[project.scripts]\n{plan.package} = "{plan.package}.cli:main"\n'
    return text
