"""Mutation testing of the core, one module at a time (issue 55 item 4): a report, like a benchmark, not a CI test.

    uv sync --locked --extra cpu --group mutation --compile-bytecode     # once: mutmut, pinned in pyproject.toml
    uv run --no-sync python scripts/mutation_report.py loss advantages
    uv run --no-sync python scripts/mutation_report.py loss --survivors   # after adding tests

For each named module, mutmut (one worker) makes every small mutant of that one source file and runs only that
module's own unit tests against each. It works in a scratch copy of src/, tests/, docs/ and configs/ (the checkout
is left as it is) and writes the score (killed / total) and each surviving mutant's diff to
benchmarks/results/mutation.json, under the module's name. ``--survivors`` reruns only the mutants that survived
the module's last run (its source unchanged: tests added since cannot revive a killed mutant), which takes a minute
where a whole run takes many. docs/mutation.md records the scores and why each survivor left is equivalent.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "mutation.json"


@dataclass(frozen=True)
class Core:
    """A core module and the unit tests that are its own."""

    source: str
    tests: tuple[str, ...]


MODULES = {
    "loss": Core("src/trainer/loss.py", ("tests/unit/trainer/test_loss.py",)),
    "advantages": Core("src/orchestrator/batching/advantage.py", ("tests/unit/orchestrator/test_advantage.py",)),
    "sampling_replay": Core("src/trainer/truncation.py", ("tests/unit/trainer/test_truncation.py",)),
    "routing_replay": Core("src/trainer/moe/routing.py", ("tests/unit/trainer/test_routing.py",)),
    "packing": Core(
        "src/orchestrator/batching/batch.py",
        tuple(
            f"tests/unit/orchestrator/test_{name}.py"
            for name in ("batch", "samples", "advantage", "distill", "running_baseline", "no_sample", "ce_algorithms")
        ),
    ),
    "context_parallel": Core("src/trainer/context_parallel.py", ("tests/unit/trainer/test_context_parallel.py",)),
    "disk_protocol": Core(
        "src/contracts/protocol.py",
        (
            "tests/unit/contracts/test_protocol.py",
            "tests/unit/contracts/test_batch_files.py",
            "tests/unit/contracts/test_images.py",
        ),
    ),
}
ALSO_COPIED = ("docs", "configs")  # what some unit tests read beside src/ and tests/ (documented keys, configs)
KILLED = {"killed", "timeout"}  # a mutant the tests stopped; every other status counts as survived


def mutmut_config(core: Core) -> str:
    """The ``[tool.mutmut]`` table for one module: mutate that file only, run its own tests only."""
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f"also_copy = {json.dumps(list(ALSO_COPIED))}\n"
        f'only_mutate = ["{core.source}"]\n'
        f"pytest_add_cli_args_test_selection = {json.dumps(list(core.tests))}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-o", "addopts="]\n'
    )


def scratch_copy(core: Core, folder: Path) -> None:
    """src/, tests/, what they read and pyproject.toml (with the module's mutmut table) copied into ``folder``."""
    for name in ("src", "tests", *ALSO_COPIED):
        shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text() + mutmut_config(core))


def mutmut(folder: Path, *args: str) -> str:
    """Run one mutmut command in ``folder``; its standard output."""
    return python_in(folder, ["-m", "mutmut", *args], f"mutmut {' '.join(args)}")


def python_in(folder: Path, args: list[str], what: str) -> str:
    """Run this Python with ``args`` in ``folder``; its standard output (exit naming ``what`` if it fails)."""
    done = subprocess.run([sys.executable, *args], cwd=folder, capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        sys.exit(f"{what} failed in {folder} (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return done.stdout


SHOW_EACH = (
    "import sys\nfrom mutmut.__main__ import show\nfor key in sys.argv[1:]:\n    show.callback(key)\n    print('\\0')"
)


def mutant_diffs(folder: Path, keys: list[str]) -> dict[str, str]:
    """``mutmut show`` of each of ``keys`` (its status and diff), in one process: one process each took seconds."""
    if not keys:
        return {}
    shown = python_in(folder, ["-c", SHOW_EACH, *keys], "mutmut show").split("\0\n")
    return dict(zip(keys, shown[: len(keys)], strict=True))


def source_digest(core: Core) -> str:
    """The module's source, hashed: mutant names hold only for the source they were made from."""
    return hashlib.sha256((REPO / core.source).read_bytes()).hexdigest()[:16]


def run_module(name: str, core: Core, last: dict | None) -> dict:
    """Mutation-test one module (only ``last``'s survivors, given it); its score and its survivors."""
    if last is not None and last["source_sha256"] != source_digest(core):
        sys.exit(f"{core.source} changed since its last mutation run: run {name} without --survivors")
    with tempfile.TemporaryDirectory(prefix=f"mutation-{name}-") as scratch:
        folder = Path(scratch)
        scratch_copy(core, folder)
        mutmut(folder, "run", "--max-children", "1", *(last["survivors"] if last else ()))
        statuses = dict(re.findall(r"^\s+(\S+): (.+)$", mutmut(folder, "results", "--all", "true"), re.MULTILINE))
        if last is not None:
            statuses = {key: statuses[key] for key in last["survivors"]}
        survivors = mutant_diffs(folder, [key for key, status in statuses.items() if status not in KILLED])
    total = last["total"] if last else len(statuses)
    killed = total - len(survivors)
    return {
        "source": core.source,
        "source_sha256": source_digest(core),
        "tests": list(core.tests),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "killed": killed,
        "total": total,
        "score": round(killed / total, 3) if total else None,
        "survivors": {key: {"status": statuses[key], "diff": diff} for key, diff in survivors.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="+", choices=sorted(MODULES), help="the core modules to mutation-test")
    parser.add_argument("--survivors", action="store_true", help="rerun only each module's last survivors")
    args = parser.parse_args()
    for name in args.modules:
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        if args.survivors and name not in results:
            sys.exit(f"{name} has no mutation run in {RESULTS} yet: run it without --survivors first")
        result = run_module(name, MODULES[name], results[name] if args.survivors else None)
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        results[name] = result
        RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(f"{name}: {result['killed']}/{result['total']} killed, {len(result['survivors'])} survived")


if __name__ == "__main__":
    main()
