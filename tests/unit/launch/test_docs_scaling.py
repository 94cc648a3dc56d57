"""Every ``uv run rl`` command of docs/scaling.md passes ``rl --dry-run``: its configs resolve and its memory plan
fits (an 80 GB GPU planned for the GPU sections)."""

import re
import shlex
from pathlib import Path

import pytest

from contracts.config import parse_config
from launch.launcher import run
from launch.rl_config import RLConfig, resolve_shared

ROOT = Path(__file__).parents[3]
DOC = ROOT / "docs" / "scaling.md"


def rl_commands(text: str) -> list[tuple[str, list[str]]]:
    """Each ``uv run rl`` command of the page's bash blocks (its arguments, the variables set above it filled in)
    with the heading of its section."""
    commands, variables, heading, in_bash = [], {}, "", False
    for line in text.replace("\\\n", " ").splitlines():
        if line.startswith("## "):
            heading = line[3:]
        elif line.startswith("```"):
            in_bash = line == "```bash"
        elif in_bash:
            line = re.sub(r"\s+#.*", "", line).strip()
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            if match := re.fullmatch(r"([A-Z]\w*)=(.*)", line):
                variables[match[1]] = " ".join(shlex.split(match[2]))
            elif line.startswith("uv run rl "):
                commands.append((heading, shlex.split(line)[3:]))
    return commands


COMMANDS = rl_commands(DOC.read_text())


def test_the_page_has_its_cpu_and_gpu_commands():
    headings = [heading for heading, _ in COMMANDS]
    assert {"CPU (the tiny model)", "One GPU", "One node, 8 GPUs"} <= set(headings)


@pytest.mark.parametrize(("heading", "argv"), COMMANDS, ids=[" ".join(argv[-4:]) for _, argv in COMMANDS])
def test_each_rl_command_of_the_scaling_page_passes_a_dry_run(heading, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the page's paths are relative to the repository
    gpu = ["--gpu-memory-gib", "80"] if "GPU" in heading else []
    config = parse_config(RLConfig, [*argv, *gpu, "--output-dir", str(tmp_path), "--dry-run"])
    assert run(resolve_shared(config)) == 0
