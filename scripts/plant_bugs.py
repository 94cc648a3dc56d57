"""Plant known bugs one at a time in a copy of the repository and check that the unit tests named for each catch it.

    uv run --no-sync python scripts/plant_bugs.py [--only NAME ...] [--no-baseline]

Each entry of ``PLANTED`` is a bug the tests once let through (issue 55): a file, the exact text to replace (found
exactly once), the bugged text, and the unit tests that must fail with it. For each, the files git would commit
(tracked, and untracked files not ignored, as they are in the working tree) are copied into a temporary folder, the
one edit is applied there, and the named tests run there with this checkout's ``.venv`` python, the copy's ``src/``
(and its editable environments) first on ``PYTHONPATH``. First, unless ``--no-baseline``, the tests of every bug run
once on an unplanted copy: a test that fails without a bug catches nothing. Prints a table; exits 1 if a bug
survives, an edit no longer applies, a run errs, or the baseline fails.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PER_RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class PlantedBug:
    name: str
    file: str  # relative to the repository's root
    old: str  # the exact text replaced: found exactly once in ``file``
    new: str  # the bugged text
    tests: list[str]  # pytest node ids (files or file::test) that must fail with the bug


PLANTED = [
    PlantedBug(
        name="weight-steps patch not installed",
        file="src/orchestrator/verifiers_adapter/patches.py",
        old="    renderers.client._parse_completion_logprobs = weight_steps.parse_completion_logprobs\n",
        new="    # renderers.client._parse_completion_logprobs = weight_steps.parse_completion_logprobs\n",
        tests=[
            "tests/unit/orchestrator/test_boundary.py::"
            "test_install_patches_changes_exactly_the_patches_listed_and_importing_or_installing_again_changes_nothing"
        ],
    ),
    PlantedBug(
        name="libraries' loggers quiet at debug too (issue 56)",
        file="src/contracts/metrics.py",
        old='logger.setLevel(logging.NOTSET if level.upper() == "DEBUG" else max(logger.level, logging.WARNING))',
        new="logger.setLevel(max(logger.level, logging.WARNING))",
        tests=["tests/unit/contracts/test_process_logging.py"],
    ),
    PlantedBug(
        name="verifiers' CLI advice left as it is (issue 56)",
        file="src/orchestrator/verifiers_adapter/patches.py",
        old="    advice.install_advice_filter()\n",
        new="",
        tests=[
            "tests/unit/orchestrator/test_runtimes.py::test_verifiers_warning_about_the_subprocess_runtime_names_trident_keys"
        ],
    ),
    PlantedBug(
        name="an environment shadowing a built-in one goes unnamed (issue 56)",
        file="src/launch/preflight.py",
        old='        warn_if_shadowed(f"orchestrator.env.{i}.id", env.id, spec)\n',
        new="",
        tests=[
            "tests/unit/launch/test_preflight.py::"
            "test_an_environment_shadowing_a_built_in_one_is_named_once_with_both_places"
        ],
    ),
    PlantedBug(
        name="fair share ignores the body without a run header",
        file="src/inference/share.py",
        old="        if run is None and self.runs.named():  # no header: the request may name a run's adapter "
        "(read its body)\n            body, receive = await read_body(receive)\n            run = model_run(body)\n",
        new="",
        tests=["tests/unit/inference/test_share.py"],
    ),
    PlantedBug(
        name="adapter_name ignores the run",
        file="src/contracts/inference_api.py",
        old='    return f"lora-step-{step}" if run is None else f"{run}/lora-step-{step}"\n',
        new='    return f"lora-step-{step}"\n',
        tests=[
            "tests/unit/inference/test_routes.py::"
            "test_two_runs_adapters_at_the_same_step_are_served_apart_under_their_names_on_a_registry_like_vllms",
            "tests/unit/inference/test_routes.py::"
            "test_named_runs_load_and_retire_only_their_own_adapters_and_leave_the_engines_label_alone",
        ],
    ),
    PlantedBug(
        name="routing replay keeps the router's own top-k weights",
        file="src/trainer/moe/routing.py",
        old="            weights = replayed_weights(router_logits, experts, router.norm_topk_prob).to(weights.dtype)\n",
        new="            weights = weights\n",
        tests=["tests/unit/trainer/test_routing.py"],
    ),
    PlantedBug(
        name="activation offload makes no host copy",
        file="src/trainer/model.py",
        old='    held = hidden.to("cpu", non_blocking=device.type == "cuda")\n',
        new="    held = hidden\n",
        tests=["tests/unit/trainer/test_activation_offload.py"],
    ),
    PlantedBug(
        name="context parallelism's all-to-all sends head groups to the wrong ranks",
        file="src/trainer/context_parallel.py",
        old="    sent = x[0].reshape(cp, heads // cp, shard, dim).contiguous()  "
        "# the r-th group of heads goes to rank r\n",
        new="    sent = x[0].reshape(cp, heads // cp, shard, dim).flip(0).contiguous()\n",
        tests=["tests/unit/trainer/test_context_parallel.py"],
    ),
    PlantedBug(
        name="context parallelism's score sum sums gradients over the ranks too",
        file="src/trainer/context_parallel.py",
        old="    return _SumOverGroup.apply(scores, group)\n",
        new="    return torch.distributed.nn.functional.all_reduce(scores, group=group)\n",
        tests=["tests/unit/trainer/test_context_parallel.py"],
    ),
    PlantedBug(
        name="the probe's default tolerance lets a stale layer or expert through (0.05, as it was)",
        file="src/contracts/run_dir.py",
        old="PROBE_TOLERANCE = 1e-4\nPROBE_TOLERANCE_BF16 = 5e-3\n",
        new="PROBE_TOLERANCE = 0.05\nPROBE_TOLERANCE_BF16 = 0.05\n",
        tests=["tests/unit/trainer/test_probe_tolerance.py"],
    ),
    PlantedBug(
        name="failed rollouts counted by their raw first line (issue 56)",
        file="src/orchestrator/batching/causes.py",
        old="    key = error_cause(error)\n",
        new="    return (error.strip().splitlines() or [''])[0]\n",
        tests=[
            "tests/unit/orchestrator/test_no_sample.py::"
            "test_one_cause_with_per_rollout_text_counts_once_and_names_the_real_cause"
        ],
    ),
    PlantedBug(
        name="failed rollouts not kept in the run (issue 56)",
        file="src/orchestrator/loop/run.py",
        old="        write_failed_rollouts(self.output_dir, step, groups)  # before anything may stop the run\n",
        new="",
        tests=[
            "tests/unit/orchestrator/test_faults.py::"
            "test_a_step_where_every_rollout_failed_stops_with_one_line_naming_the_environment_and_keeps_them"
        ],
    ),
    PlantedBug(
        name="failed rollouts kept without verifiers' traceback (issue 56)",
        file="src/orchestrator/verifiers_adapter/envs.py",
        old="        traceback=_traceback_text(trace.last_error or episode.last_error),\n",
        new="",
        tests=[
            "tests/unit/orchestrator/test_faults.py::"
            "test_a_step_where_every_rollout_failed_stops_with_one_line_naming_the_environment_and_keeps_them"
        ],
    ),
    PlantedBug(
        name="a taskset's chained load() error named without its first cause (issue 56)",
        file="src/contracts/errors.py",
        old='    cause = _message_line(root) if root is not error else ""\n',
        new='    cause = ""\n',
        tests=[
            "tests/unit/orchestrator/test_env_errors.py::"
            "test_a_taskset_whose_load_raises_stops_the_start_with_one_line_and_its_traceback_in_the_log"
        ],
    ),
    PlantedBug(
        name="an evaluation's failed rollouts not kept (issue 56)",
        file="src/orchestrator/loop/evaluation.py",
        old="        write_failed_rollouts(self.metrics.output_dir, weight_step, every_group, evaluation=True)\n",
        new="",
        tests=[
            "tests/unit/orchestrator/test_failed_rollouts.py::"
            "test_an_evaluations_failed_rollouts_are_kept_marked_as_its_with_their_tracebacks"
        ],
    ),
]


class PlantError(Exception):
    """A planted bug's edit that no longer applies."""


def apply_edit(text: str, old: str, new: str, where: str) -> str:
    """``text`` with its one occurrence of ``old`` replaced by ``new``; a :class:`PlantError` naming ``where`` when
    ``old`` is absent or occurs more than once."""
    count = text.count(old) if old else 0
    if count != 1:
        found = "not found" if count == 0 else f"found {count} times"
        raise PlantError(f"{where}: the text to replace is {found} (it must occur exactly once): {old!r}")
    return text.replace(old, new)


def repository_files(root: Path) -> list[str]:
    """The files git would commit in ``root``: tracked ones still there, and untracked ones not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    return sorted({name for name in listed if name and (root / name).is_file()})


def copy_repository(root: Path, files: list[str], into: Path) -> None:
    for name in files:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, into / name)


def python_path(root: Path, copy: Path) -> str:
    """``PYTHONPATH`` for a run in ``copy``: its ``src/``, then the copy's side of each folder of ``root`` that the
    virtual environment's editable installs put on the path (the environments), so that none is read from ``root``."""
    paths = [copy / "src"]
    for pth in sorted((root / ".venv").glob("lib/python*/site-packages/*.pth")):
        for line in pth.read_text().splitlines():
            folder = Path(line.strip())
            if folder.is_absolute() and folder.is_relative_to(root) and copy / folder.relative_to(root) not in paths:
                paths.append(copy / folder.relative_to(root))
    return os.pathsep.join(str(path) for path in paths)


def run_tests(root: Path, copy: Path, tests: list[str]) -> tuple[int, str]:
    """pytest's exit status and output for ``tests``, run in ``copy``."""
    python = root / ".venv" / "bin" / "python"
    env = os.environ | {"PYTHONPATH": python_path(root, copy)}
    command = [str(python if python.exists() else sys.executable), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(
            [*command, *tests], cwd=copy, env=env, capture_output=True, text=True, timeout=PER_RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {PER_RUN_TIMEOUT_S} s"
    return done.returncode, done.stdout + done.stderr


def check(root: Path, files: list[str], bug: PlantedBug | None, tests: list[str]) -> tuple[str, str]:
    """Copy the repository, plant ``bug`` (None: nothing), run ``tests``: (outcome, pytest's output tail)."""
    with tempfile.TemporaryDirectory(prefix="plant-") as folder:
        copy = Path(folder)
        copy_repository(root, files, copy)
        if bug is not None:
            try:
                path = copy / bug.file
                path.write_text(apply_edit(path.read_text(), bug.old, bug.new, bug.file))
            except (PlantError, FileNotFoundError) as error:
                return "edit does not apply", str(error)
        status, output = run_tests(root, copy, tests)
    tail = "\n".join(output.strip().splitlines()[-15:])
    if bug is None:
        return ("passed" if status == 0 else f"failed (pytest exit {status})"), tail
    return {0: "SURVIVED", 1: "caught"}.get(status, f"error (pytest exit {status})"), tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="plant only these bugs (by name)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the tests without a bug")
    args = parser.parse_args(argv)
    bugs = [bug for bug in PLANTED if not args.only or bug.name in args.only]
    if args.only and len(bugs) != len(args.only):
        parser.error(f"no planted bug named {sorted(set(args.only) - {bug.name for bug in bugs})}")
    files = repository_files(ROOT)
    rows, failed = [], False
    if not args.no_baseline:
        tests = list(dict.fromkeys(test for bug in bugs for test in bug.tests))
        start = time.monotonic()
        outcome, tail = check(ROOT, files, None, tests)
        rows.append(("(no bug: the tests of every bug)", outcome, time.monotonic() - start))
        if outcome != "passed":
            failed = True
            print(f"without a bug planted the tests fail:\n{tail}\n", flush=True)
    for bug in bugs:
        start = time.monotonic()
        outcome, tail = check(ROOT, files, bug, bug.tests)
        rows.append((bug.name, outcome, time.monotonic() - start))
        print(f"{bug.name}: {outcome} ({time.monotonic() - start:.0f} s)", flush=True)
        if outcome != "caught":
            failed = True
            print(f"  {bug.file}; tests {' '.join(bug.tests)}\n{tail}\n", flush=True)
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'planted bug':<{width}}  {'outcome':<24}  seconds")
    for name, outcome, seconds in rows:
        print(f"{name:<{width}}  {outcome:<24}  {seconds:7.0f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
