"""Every console script answers ``--help`` and refuses a bad config or bad arguments before it imports torch,
transformers, verifiers, renderers or vLLM (docs/reliability.md): each command's ``main`` runs in a fresh
interpreter, and what it imported is read from ``sys.modules`` after each call. Not a timed test: the CPU time of the
same calls is ``benchmarks/start_cost.py``'s."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
HEAVY = ("torch", "transformers", "verifiers", "renderers", "vllm")
CONFIG_MISTAKES = (
    ["--no-such-key", "1"],  # unknown key
    ["--log.level", "loud"],  # bad value
    ["@", "/nonexistent/config.toml"],  # missing file
)
ARGUMENT_MISTAKES = {  # the commands that take arguments, not a config
    "build-tiny-model": [["trident/tiny-qwen4"]],  # no such tiny model
    "trident-plot": [[], ["--no-such-flag"]],  # no output_dir; unknown flag
}

# Calls the entry point with each argv in turn; prints, per call, its exit code and the heavy modules loaded so far.
PROBE = """
import importlib, json, sys
module, function, calls, heavy = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
main = getattr(importlib.import_module(module), function)
for argv in calls:
    sys.argv = ["command", *argv]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    print(json.dumps({"argv": argv, "code": code, "imported": [m for m in heavy if m in sys.modules]}))
"""


def calls_of(command: str) -> list[list[str]]:
    """``--help``, then the command's mistakes."""
    return [["--help"], *ARGUMENT_MISTAKES.get(command, CONFIG_MISTAKES)]


@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_help_and_refusals_import_no_heavy_library(command):
    module, function = SCRIPTS[command].split(":")
    calls = calls_of(command)
    probe = [sys.executable, "-c", PROBE, module, function, json.dumps(calls), json.dumps(HEAVY)]
    done = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, timeout=120)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["argv"] for r in results] == calls, done.stderr[-2000:]
    assert results[0]["code"] == 0, f"{command} --help: exit {results[0]['code']}"
    for result in results:
        assert result["imported"] == [], f"{command} {' '.join(result['argv'])} imported {result['imported']}"
    for result in results[1:]:
        assert result["code"] != 0, f"{command} {' '.join(result['argv'])} was not refused"
