"""Every command the docs give to run runs as written, as a new user runs it, on a fresh checkout.

The pages: README.md, configs/**/README.md, docs/*.md. Their commands: each line of a ```bash (sh, shell) block and
each ``$ `` line of any block, continued over trailing backslashes and split at ``&&``; a line ``NAME=value`` (or
``export NAME=value``) sets a variable for the page's later commands. Each page runs in a folder of its own (the
repository's configs/ linked in; the generic train.toml, orch.toml and infer.toml are the debug run's, eval.toml the
one docs/operations.md describes; a page's ```toml block that begins ``# NAME.toml`` is laid over that file), with
an empty model cache ($TRIDENT_CACHE), its commands in order. By program:

- ``rl`` runs with ``--dry-run``: it builds the tiny models it names, resolves its configs and prints its plan;
- ``build-tiny-model`` runs as written;
- the processes started alone, which have no dry run, read and check their config and model as they do at start;
- scripts, benchmarks and ``trident-plot`` parse their arguments (each stops once argparse has);
- a command none of these covers is listed in :data:`NOT_RUN` with its reason, or fails the test.
"""

import argparse
import re
import runpy
import shlex
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomli_w

from contracts.config import run_cli
from contracts.model_card import ModelCard
from contracts.run_spec import load_config
from inference.config import InferenceConfig
from launch.main import main as rl
from orchestrator.config import OrchestratorConfig
from orchestrator.eval_main import EvalCliConfig
from tools.plots import main as trident_plot
from tools.tiny_model import main as build_tiny_model
from trainer.config import SFTConfig, TrainerConfig

ROOT = Path(__file__).parents[3]
DOCS = [*ROOT.glob("configs/**/README.md"), *ROOT.glob("docs/*.md")]
PAGES = ["README.md", *sorted(str(path.relative_to(ROOT)) for path in DOCS)]
SHELL_FENCES = {"bash", "sh", "shell"}
UV_RUN_FLAGS = {"--no-sync": 0, "--locked": 0, "--extra": 1}  # uv run's flags the pages use, with their values' count
GENERIC_FILES = {"train.toml": "configs/debug/rl/train.toml", "orch.toml": "configs/debug/rl/orch.toml",
                 "infer.toml": "configs/debug/rl/infer.toml"}  # fmt: skip

NOT_RUN = {  # a part of a command (its words, its env assignments left out): why a command with it is not run
    "uv sync --locked --extra cpu": "the installation itself, done before any test runs",
    "uv run --no-sync pytest": "the test suite itself; test_readme holds it to the command CI runs",
    "vllm serve": "vLLM's own command, serving a hub model on a GPU",
    "sbatch": "needs SLURM; tests/integration/test_multinode.py runs rl.sbatch here, scontrol and srun faked",
    "ray start": "starts a Ray node (the ray extra); tests/integration/test_ray_cluster.py starts a cluster here",
    "--ray.address auto": "needs a running Ray cluster; tests/integration/test_ray_cluster.py runs rl on one it starts",
    "uv run python benchmarks/<name>.py": "a pattern for every benchmark, not a command",
    "--model.name outputs/sft/weights/step_60": "starts from the weights the SFT run above writes in 60 real steps",
}


@dataclass(frozen=True)
class Command:
    """A command of a page: where it is, its text as the page gives it, its environment and its words."""

    page: str
    line: int
    text: str
    env: dict[str, str]
    words: list[str]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def fenced_lines(text: str) -> list[tuple[int, str]]:
    """Each command line of a page's code blocks (the module's rule), with the number of its first line."""
    found, lines, fence, i = [], text.splitlines(), None, 0
    while i < len(lines):
        stripped, number = lines[i].strip(), i + 1
        if stripped.startswith("```"):
            fence = stripped[3:].strip() if fence is None else None
        elif fence is not None and (fence in SHELL_FENCES or stripped.startswith("$ ")):
            line = stripped.removeprefix("$ ") if fence not in SHELL_FENCES else stripped
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            if line and not line.startswith("#"):
                found.append((number, line))
        i += 1
    return found


def without_substitutions(line: str) -> str:
    """``line`` with each ``$(...)`` replaced by a word standing for its output."""
    out, depth, i = [], 0, 0
    while i < len(line):
        if depth:
            depth += {"(": 1, ")": -1}.get(line[i], 0)
        elif line.startswith("$(", i):
            out.append("COMMAND-OUTPUT")
            depth, i = 1, i + 1
        else:
            out.append(line[i])
        i += 1
    return "".join(out)


def page_commands(page: str) -> list[Command]:
    """The commands of ``page`` in order, its variables filled in (an undefined one is a KeyError)."""
    commands, variables = [], {}

    def variable(match: re.Match) -> str:
        return variables[match[1]]

    for number, text in fenced_lines((ROOT / page).read_text()):
        line = re.sub(r"\$\{?(\w+)\}?", variable, without_substitutions(text))
        words = shlex.split(line, comments=True)
        if words and words[0] == "export":
            words = words[1:]
        env = {}
        while words and re.match(r"[A-Za-z_]\w*=", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if not words:
            variables.update(env)
            continue
        while words:
            end = words.index("&&") if "&&" in words else len(words)
            part = words[:end][:-1] if words[end - 1] == "&" else words[:end]
            commands.append(Command(page, number, text, env, part))
            words = words[end + 1 :]
    return commands


class ArgumentsParsed(Exception):
    """Raised by argparse (patched) once a program's arguments are parsed: the program stops before its work."""


def stop_after_parsing(monkeypatch) -> None:
    """Have argparse raise :class:`ArgumentsParsed` once a program's arguments are parsed (an error still exits 2)."""
    parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside = []

    def parsed(self, *args, **kwargs):
        inside.append(True)
        try:
            parse_args(self, *args, **kwargs)
        finally:
            inside.pop()
        raise ArgumentsParsed

    def known(self, *args, **kwargs):
        result = parse_known_args(self, *args, **kwargs)
        if not inside:  # called by the program itself, not by parse_args
            raise ArgumentsParsed
        return result

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", known)


def exit_code(call: Callable[[], object]) -> tuple[int, str]:
    """0 when ``call`` returns or stops after parsing its arguments; else its exit code (1 for an exception, with its
    line)."""
    try:
        call()
    except ArgumentsParsed:
        return 0, ""
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else int(e.code is not None)), ""
    except Exception as e:  # noqa: BLE001 (a program's one line, or a crash: either fails the command)
        return 1, f"{type(e).__name__}: {e}"
    return 0, ""


def script(path: str, args: list[str], monkeypatch) -> Callable[[], object]:
    """Run the script at ``path`` (in the repository) as ``python path args`` does, up to its arguments' parsing."""
    stop_after_parsing(monkeypatch)
    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.syspath_prepend(str((ROOT / path).parent))  # python puts the script's folder first
    return lambda: runpy.run_path(str(ROOT / path), run_name="__main__")


def entry_point(main: Callable[[], object], name: str, args: list[str], monkeypatch) -> Callable[[], object]:
    monkeypatch.setattr(sys, "argv", [name, *args])
    return main


def dry_run(args: list[str]) -> list[str]:
    return args if "--dry-run" in args else [*args, "--dry-run"]


PROGRAMS = {  # each console script the pages run: how the test runs it, from its arguments
    "rl": lambda args, _: lambda: rl(dry_run(args)),
    "build-tiny-model": lambda args, mp: entry_point(build_tiny_model, "build-tiny-model", args, mp),
    "inference": lambda args, _: lambda: load_config(InferenceConfig, "inference", args),
    "orchestrator": lambda args, _: lambda: load_config(OrchestratorConfig, "orchestrator", args),
    "trainer": lambda args, _: lambda: load_config(TrainerConfig, "trainer", args),
    "eval": lambda args, _: lambda: run_cli(EvalCliConfig, "eval", args),
    "sft": lambda args, _: lambda: ModelCard.of(run_cli(SFTConfig, "sft", args).model.name),  # sft reads it first
    "trident-plot": lambda args, mp: (stop_after_parsing(mp), entry_point(trident_plot, "trident-plot", args, mp))[1],
}


def program_and_args(words: list[str]) -> tuple[str, list[str]]:
    """What ``uv run [its flags] PROGRAM ARGS`` (or ``uv run python SCRIPT ARGS``) runs, with its arguments; a
    ValueError for another command or another flag of uv's."""
    if words[:2] != ["uv", "run"]:
        raise ValueError("not a `uv run` command")
    words = words[2:]
    while words and words[0].startswith("--"):
        if words[0] not in UV_RUN_FLAGS:
            raise ValueError(f"uv run's flag {words[0]} is not one of {list(UV_RUN_FLAGS)}")
        words = words[1 + UV_RUN_FLAGS[words[0]] :]
    return (words[1], words[2:]) if words[0] == "python" else (words[0], words[1:])


def how_to_run(command: Command, monkeypatch) -> Callable[[], object] | str:
    """What runs ``command`` (:data:`PROGRAMS`, a script), or why it is not run (:data:`NOT_RUN`); a string starting
    with ``no check`` for a command nothing covers."""
    text = " ".join(command.words)
    if reason := next((why for part, why in NOT_RUN.items() if part in text), None):
        return reason
    try:
        program, args = program_and_args(command.words)
    except ValueError as e:
        return f"no check: {e}"
    if program.endswith(".py"):
        if not (ROOT / program).is_file():
            return f"no check: no script {program} in the repository"
        return script(program, args, monkeypatch)
    if program not in PROGRAMS:
        return f"no check: no way to run {program!r} in PROGRAMS"
    return PROGRAMS[program](args, monkeypatch)


def page_files(text: str) -> dict[str, dict]:
    """The files a page shows: each ```toml block whose first line is ``# NAME.toml``, by NAME.toml."""
    blocks = re.findall(r"^```toml\n# ([\w.-]+\.toml)\b.*?\n(.*?)^```", text, re.M | re.S)
    return {name: tomllib.loads(body) for name, body in blocks}


def generic_files() -> dict[str, dict]:
    """What the pages' generic file names hold: the debug run's files, and the eval.toml docs/operations.md describes
    (orch.toml's ``[eval]``, a server's ``[client] base_url``, a run's weights)."""
    files = {name: tomllib.loads((ROOT / path).read_text()) for name, path in GENERIC_FILES.items()}
    client = {"base_url": "http://127.0.0.1:8000/v1"}
    return files | {
        "eval.toml": {"eval": files["orch.toml"]["eval"], "client": client, "weights": "outputs/weights/step_20"}
    }


def laid_over(base: dict, update: dict) -> dict:
    """``update``'s keys laid over ``base``'s (tables merged), as a second ``@ file`` is."""
    merged = dict(base)
    for key, value in update.items():
        is_table = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = laid_over(base[key], value) if is_table else value
    return merged


def new_users_folder(folder: Path, page: str) -> None:
    """A folder to follow ``page`` in: the repository's configs/, the generic files and the page's own, nothing else."""
    folder.mkdir()
    (folder / "configs").symlink_to(ROOT / "configs")
    files, shown = generic_files(), page_files((ROOT / page).read_text())
    for name in files.keys() | shown.keys():
        (folder / name).write_text(tomli_w.dumps(laid_over(files.get(name, {}), shown.get(name, {}))))


def test_the_pages_give_commands_of_each_kind():
    commands = [command for page in PAGES for command in page_commands(page)]
    assert len(commands) > 40
    programs = {program_and_args(command.words)[0] for command in commands if command.words[:2] == ["uv", "run"]}
    assert set(PROGRAMS) <= programs  # each way to run a program is used
    assert {"scripts/check_loss_mask.py", "benchmarks/trl_grpo.py"} <= programs
    assert "configs/debug/sweep/README.md" in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_every_command_of_the_page_runs_as_written(page, tmp_path, monkeypatch, capsys, saved_handlers):
    monkeypatch.setenv("TRIDENT_CACHE", str(tmp_path / "cache"))  # empty: a fresh checkout
    new_users_folder(tmp_path / "work", page)
    monkeypatch.chdir(tmp_path / "work")
    failures = []
    for command in page_commands(page):
        with monkeypatch.context() as mp:
            for name, value in command.env.items():
                mp.setenv(name, value)
            run = how_to_run(command, mp)
            if isinstance(run, str):
                if run.startswith("no check"):
                    failures.append(f"{command}\n  {run}: add a way to run it, or list it in NOT_RUN with a reason")
                continue
            code, error = exit_code(run)
        output = capsys.readouterr()
        if code != 0:
            tail = "\n    ".join((output.out + output.err + error).strip().splitlines()[-5:])
            failures.append(f"{command}\n  exit code {code}:\n    {tail}")
    assert not failures, "\n".join(failures)
