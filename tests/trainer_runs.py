"""Short runs of the trainer on the tiny model for the checkpoint tests: 4 steps, a checkpoint every 2, and the loss
each step logged; and the check that a resumed run equals an uninterrupted one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from contracts.metrics import read_metrics
from contracts.run_dir import weights_dir
from orchestrator.loop.ckpt import Checkpointer
from orchestrator.tasks.sampler import TaskFeed, TaskSampler
from orchestrator.tasks.stream import TaskList
from trainer.config import TrainerConfig

SETTINGS = {"max_steps": 4, "optim": {"lr": 1e-2, "schedule": "cosine", "warmup_steps": 1}, "batch_timeout_s": 1}


def config(output_dir, model_path, model=None, **ckpt) -> TrainerConfig:
    model = {"name": model_path, **(model or {})}
    return TrainerConfig(output_dir=output_dir, model=model, ckpt={"interval": 2, **ckpt}, **SETTINGS)


def write_orchestrator_part(output_dir: Path, step: int) -> Path:
    """The orchestrator's part of the checkpoint of ``step`` for a run of 8 prompts a step from 64 tasks, seed 0: with
    the trainer's, a checkpoint the trainer resumes from."""
    feed = TaskFeed([TaskList(list(range(64)))], TaskSampler([64], [8], seed=0), last_step=SETTINGS["max_steps"])
    feed.finish(step)
    return Checkpointer(output_dir, [feed]).save(step)


def losses(output_dir) -> dict[int, float]:
    lines = (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def assert_resumed_equals_whole(whole_dir: Path, resumed_dir: Path, steps: int) -> dict:
    """The run in ``resumed_dir`` (stopped and resumed) logged every step of ``steps`` with the loss and gradient
    norm of the uninterrupted run in ``whole_dir``, and its last weights equal that run's; returns those weights."""
    whole, resumed = read_metrics(whole_dir, "trainer"), read_metrics(resumed_dir, "trainer")
    assert [record["step"] for record in resumed] == list(range(1, steps + 1))
    for one, two in zip(whole, resumed, strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6)
    expected, got = (load_file(weights_dir(run, steps) / "model.safetensors") for run in (whole_dir, resumed_dir))
    assert expected.keys() == got.keys()
    for name in expected:
        assert (expected[name] - got[name]).abs().max() < 1e-6, name
    return expected


def run_on_two_ranks(script: Path, folder: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 script folder`` on two gloo ranks (one thread each); raises if it
    fails."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), folder]
    subprocess.run(argv, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600)
