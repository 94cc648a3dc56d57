"""Benchmark: the CPU each command spends answering ``--help``, and each process's start, before and after.

``uv run python benchmarks/start_cost.py`` (``--smoke``: two commands, once each).

Two source trees side by side, alternated in one run: this checkout's ``src/`` (after) and the ``src/`` of
``--before-commit`` (default: the commit before the commands started at once), checked out into a temporary git
worktree, or ``--before-src`` given; both trees' bytecode is compiled first. Each measurement is a fresh interpreter
of this environment with ``PYTHONPATH`` pointing at one tree; its CPU time (user + sys, the child's ``getrusage``) is
what the machine paid, whatever else loads it. Measured: every console script of the tree's ``pyproject.toml``
called with ``--help``, and what each process imports before it does anything (``import trainer.train``, ``import
orchestrator.orchestrator``, ``import inference.server``), with the orchestrator's start up to its first rollout (the
import, then the renderer's tokenizer of the tiny model, which the start's renderer check loads).
"""

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import tomllib
from contextlib import contextmanager
from pathlib import Path

from common import benchmark_parser, machine_info, report, utc_now

ROOT = Path(__file__).parents[1]
BEFORE_COMMIT = "a037d3b"  # the last commit before the commands started at once
REPEATS = 2
HELP_PROBE = """
import importlib, sys
module, function = sys.argv[1].split(":")
sys.argv = ["command", "--help"]
try:
    getattr(importlib.import_module(module), function)()
except SystemExit:
    pass
"""
STARTS = {  # what each process imports (and the orchestrator loads) before its first piece of work
    "trainer import": "import trainer.train",
    "inference import": "import inference.server",
    "orchestrator import": "import orchestrator.loop.run",
    "orchestrator start": "import orchestrator.loop.run, renderers.base; from contracts.model_card import "
    "resolve_model_path; renderers.base.load_tokenizer(resolve_model_path('trident/tiny-qwen3'))",
}


@contextmanager
def before_tree(commit: str):
    """The ``src/`` of ``commit``, checked out into a temporary git worktree (removed after)."""
    with tempfile.TemporaryDirectory(prefix="trident-before-") as tmp:
        folder = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(folder), commit], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        try:
            yield folder / "src"
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT, capture_output=True)


def cpu_s(argv: list[str], src: Path) -> float:
    """User + sys CPU seconds of running ``argv`` with ``src`` first on the import path."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = os.environ | {"PYTHONPATH": str(src)}
    subprocess.run(argv, env=env, cwd=ROOT, check=True, capture_output=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def scripts(src: Path) -> dict[str, str]:
    """The console scripts of the tree ``src`` belongs to: name -> ``module:function``."""
    return tomllib.loads((src.parent / "pyproject.toml").read_text())["project"]["scripts"]


def measurements(src: Path, smoke: bool) -> dict[str, list[str]]:
    """Each measurement's name and the command that makes it, for the tree ``src``."""
    helps = {f"{name} --help": [sys.executable, "-c", HELP_PROBE, target] for name, target in scripts(src).items()}
    starts = {name: [sys.executable, "-c", code] for name, code in STARTS.items()}
    if smoke:
        return {name: helps[name] for name in ("rl --help", "build-tiny-model --help")}
    return helps | starts


def run(before: Path, after: Path, smoke: bool) -> dict:
    trees = {"before": before, "after": after}
    for src in trees.values():  # a fresh worktree has no bytecode yet: compiling it is no part of a start
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True, capture_output=True)
    commands = {label: measurements(src, smoke) for label, src in trees.items()}
    seconds: dict[str, dict[str, list[float]]] = {name: {"before": [], "after": []} for name in commands["after"]}
    for _ in range(1 if smoke else REPEATS):
        for name in seconds:
            for label in ("before", "after"):  # alternated, so a change in the machine's load hits both
                seconds[name][label].append(cpu_s(commands[label][name], trees[label]))
    rows = [
        {"measurement": name, "before_cpu_s": statistics.median(runs["before"]),
         "after_cpu_s": statistics.median(runs["after"]), "runs": runs}
        for name, runs in seconds.items()
    ]  # fmt: skip
    return {"repeats": 1 if smoke else REPEATS, "rows": rows}


def summary_table(result: dict) -> str:
    lines = [f"{'measurement':28}{'before CPU s':>14}{'after CPU s':>13}{'after/before':>14}"]
    for row in result["rows"]:
        ratio = row["after_cpu_s"] / row["before_cpu_s"]
        lines.append(f"{row['measurement']:28}{row['before_cpu_s']:>14.2f}{row['after_cpu_s']:>13.2f}{ratio:>14.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "start_cost", "rl and build-tiny-model --help, once each")
    parser.add_argument("--before-commit", default=BEFORE_COMMIT, help="the commit whose src/ is 'before'")
    parser.add_argument("--before-src", type=Path, help="a src/ folder to use as 'before' instead of a commit's")
    args = parser.parse_args(argv)
    after = ROOT / "src"
    if args.before_src is not None:
        measured = run(args.before_src.resolve(), after, args.smoke)
        before_name = str(args.before_src)
    else:
        with before_tree(args.before_commit) as before:
            measured = run(before, after, args.smoke)
        before_name = args.before_commit
    result = {"benchmark": "start_cost", "date": utc_now(), "machine": machine_info(), "before": before_name,
              **measured}  # fmt: skip
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
