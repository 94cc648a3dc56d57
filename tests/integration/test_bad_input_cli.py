"""Bad input to the real ``rl`` command line, run in a process of its own: one line naming the fault and the fix, a
non-zero exit, nothing started or written (issue 30). The checks that need no process are in
tests/unit/launch/test_bad_input.py."""

import os
import subprocess
import sys

import pytest
import torch
from debug_configs import FILES
from namespaces import user_namespaces

RL = [sys.executable, "-m", "launch.main"]


def rl(*args: str, prefix: tuple[str, ...] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """``rl ... --dry-run`` in a process of its own (with ``env`` added to this one's environment)."""
    argv, environ = [*prefix, *RL, *args, "--dry-run"], {**os.environ, **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=environ)


def one_line(result: subprocess.CompletedProcess, code: int) -> str:
    """The one line ``rl`` wrote to stderr, after checking it exited ``code`` with no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_an_output_dir_that_is_a_file_or_under_one(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    line = one_line(rl("--output-dir", str(taken)), 1)
    assert line.endswith(f"rl failed: --output-dir {taken}: is a file, not a folder; choose a folder (or move the "
                         "file)")  # fmt: skip
    line = one_line(rl("--output-dir", str(taken / "run")), 1)
    under = taken / "run"
    assert f"--output-dir {under}: cannot hold the run (Not a directory: {under}); choose a folder you can" in line
    assert taken.read_text() == "not a folder"


@pytest.mark.skipif(not user_namespaces(), reason="needs unprivileged user namespaces to mount a read-only tmpfs")
def test_an_output_dir_that_cannot_be_written(tmp_path):
    """A read-only mount refuses even root (the tests may run as root, where a chmod would not)."""
    mount = f'mount -t tmpfs -o ro tmpfs {tmp_path} && exec "$@"'
    line = one_line(rl("--output-dir", str(tmp_path), prefix=("unshare", "-rm", "sh", "-c", mount, "sh")), 1)
    assert f"--output-dir {tmp_path}: cannot hold the run (Read-only file system: {tmp_path / 'rl.lock'})" in line


def test_a_flag_where_a_file_belongs_after_at(tmp_path):
    line = one_line(rl("--trainer", "@", "--output-dir", str(tmp_path)), 2)
    assert line == ("error: --trainer @ --output-dir: expected a TOML file after '@', got a flag; write --trainer @ "
                    "file.toml")  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_a_group_of_one_rollout_learns_nothing_and_is_refused(tmp_path):
    line = one_line(rl(*FILES, "--orchestrator.rollouts-per-example", "1", "--output-dir", str(tmp_path)), 2)
    assert line == (
        "error: --orchestrator.rollouts-per-example: orchestrator: rollouts_per_example = 1 with advantage.baseline "
        "= 'mean': the baseline is the group's own reward, so every advantage is 0 and the run learns nothing; set "
        "rollouts_per_example >= 2"
    )
    assert not any(tmp_path.iterdir())


def test_an_async_level_above_max_steps_is_refused(tmp_path):
    line = one_line(rl(*FILES, "--max-steps", "10", "--async-level", "50", "--output-dir", str(tmp_path)), 2)
    assert line == (
        "error: async_level = 50 is above max_steps = 10: no step would wait for trained weights; lower async_level "
        "(1 or 2 is usual) or raise max_steps"
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_gpu_ids_on_a_machine_without_gpus_start_one_cpu_server_and_say_so(tmp_path):
    result = rl(*FILES, "--inference-gpu-ids", "0,1", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "  inference: CPU, port 8000" in result.stdout and "inference-1" not in result.stdout
    assert (
        "rl WARNING --inference-gpu-ids [0, 1]: this machine has no GPU, so rl starts one inference server on the "
        "CPU; --inference-servers N starts N there (or plan a GPU run with --gpu-memory-gib)"
    ) in result.stderr


def test_a_local_dataset_that_does_not_exist_is_refused_by_the_dry_run(tmp_path):
    """Checked in rl without verifiers: a dataset path with a file's suffix, or not a hub id, that is not on disk."""
    env = '[{"id": "gsm8k-calc", "args": {"dataset": {"path": "/nope.parquet"}}}]'
    line = one_line(rl(*FILES, "--orchestrator.env", env, "--output-dir", str(tmp_path)), 1)
    assert line.endswith(
        "rl failed: orchestrator.env.0.args.dataset: environment 'gsm8k-calc': dataset '/nope.parquet' not found: no "
        "such file or folder, and not a hub dataset id"
    )
    assert not any(tmp_path.iterdir())


def last_line_after_no_traceback(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_a_dataset_the_orchestrator_or_eval_cannot_read_is_one_line(tmp_path):
    """The orchestrator on a hub id while offline, eval on a file that is not there: each stops before it reaches a
    server, with one line naming the environment and the dataset."""
    orch = tmp_path / "orch.toml"
    orch.write_text('[[env]]\nid = "gsm8k-calc"\nargs = { dataset = "openai/gsm8k" }\n')
    offline = dict(os.environ, HF_HUB_OFFLINE="1")
    argv = [sys.executable, "-m", "orchestrator.main", "@", str(orch), "--output-dir", str(tmp_path / "run")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=offline)
    assert last_line_after_no_traceback(result).endswith(
        "orchestrator failed: environment 'gsm8k-calc': hub dataset 'openai/gsm8k' (split 'train'): the hub "
        "(https://huggingface.co) cannot be reached and no copy is cached; give it local data: [[datasets]] id = "
        '"openai/gsm8k" path = "<file or folder>" (docs/environments.md#air-gapped-clusters)'
    )
    missing = tmp_path / "gsm8k.jsonl"
    argv = [sys.executable, "-m", "orchestrator.eval_main", "--eval.env", f'[{{"id": "gsm8k-calc", "args": '
            f'{{"dataset": "{missing}"}}}}]', "--output-dir", str(tmp_path / "eval")]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert last_line_after_no_traceback(result).endswith(
        f"eval failed: environment 'gsm8k-calc': dataset '{missing}' not found: no such file or folder, and not a hub "
        "dataset id"
    )


def test_a_bad_env_var_is_one_line_not_a_traceback_at_import(tmp_path):
    """rl's config built no sub-config at import, where a bad variable was a pydantic traceback (issue 40)."""
    line = one_line(rl(*FILES, "--output-dir", str(tmp_path), env={"TRIDENT_OPTIM__LRR": "1"}), 2)
    assert line == "error: env var TRIDENT_OPTIM__LRR='1': trainer.optim.lrr: unknown key"
    assert not any(tmp_path.iterdir())
