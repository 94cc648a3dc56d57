"""The SLURM launcher in dry-run mode on CPU: ``scripts/slurm/rl.sbatch`` as sbatch runs it, with ``scontrol`` and
``srun`` standing in for a two-node allocation on this machine (each "node" its own process group), each node's part
run by ``python -m launch.slurm_nodes``. The debug configs resolve for two nodes with only placement flags added,
and each node prints the processes it would start; a resumed job's ``resolve`` deletes what the stopped run wrote
after its checkpoint (a dry run deletes nothing)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.config import parse_config
from contracts.metrics import read_metrics
from contracts.records import write_records
from contracts.run_dir import checkpoint_dir, mark_stable, metrics_path, rollouts_dir, weights_dir
from trainer.config import TrainerConfig

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"

SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames <list>: the allocation's hosts, one per line
[[ "$1 $2" == "show hostnames" ]] && printf '%s\\n' $FAKE_HOSTS
"""
SRUN = """#!/usr/bin/env bash
# srun --ntasks-per-node=1 ...: the command once per node, each in its own process group, with its SLURM_NODEID
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((rank = 0; rank < SLURM_JOB_NUM_NODES; rank++)); do
    SLURM_NODEID=$rank setsid "$@" > "$SRUN_LOGS/node-$rank.out" 2>&1 &
    pids+=($!)
done
code=0
for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
exit $code
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """``scontrol`` and ``srun`` for a two-node allocation whose hosts are two names of this machine."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_HOSTS", "localhost 127.0.0.1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[0-1]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SRUN_LOGS", str(tmp_path))
    monkeypatch.setenv("DRY_RUN", "1")
    monkeypatch.setenv("GPUS_PER_NODE", "0")
    monkeypatch.delenv("TRIDENT_API_KEY", raising=False)
    return tmp_path


def sbatch(output_dir: Path, *flags: str) -> str:
    """``rl.sbatch`` on the debug configs with ``flags`` added; returns what it printed."""
    argv = ["bash", "scripts/slurm/rl.sbatch", "--trainer", "@", str(DEBUG / "train.toml"),
            "--orchestrator", "@", str(DEBUG / "orch.toml"), "--inference", "@", str(DEBUG / "infer.toml"),
            "--output-dir", str(output_dir), *flags]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_sbatch_script_places_inference_on_the_first_node_and_training_on_the_second(fake_slurm):
    output_dir = fake_slurm / "run"
    out = sbatch(output_dir)
    assert "placement:" in out  # rl --dry-run resolved the configs

    configs = output_dir / "configs"
    inference = (configs / "inference.toml").read_text()
    assert 'host = "0.0.0.0"' in inference and "port = 8000" in inference
    orchestrator = (configs / "orchestrator.toml").read_text()
    assert 'base_url = "http://localhost:8000"' in orchestrator  # node 0's server, by its hostname
    # the trainer's config is the debug one: placement changed nothing of it
    trainer = parse_config(TrainerConfig, ["@", str(configs / "trainer.toml")])
    debug = parse_config(TrainerConfig, ["@", str(DEBUG / "train.toml"), "--output-dir", str(output_dir)])
    assert trainer.model == debug.model and trainer.optim == debug.optim and trainer.loss == debug.loss

    node0 = (fake_slurm / "node-0.out").read_text()
    node1 = (fake_slurm / "node-1.out").read_text()
    server = rf"\S+ -m inference.main @ {configs}/inference.toml"
    assert re.search(rf"node 0 \(localhost\) inference: CUDA_VISIBLE_DEVICES= {server}", node0)
    assert "trainer" not in node0 and "orchestrator" not in node0
    trainer_line = re.search(r"node 1 \(127.0.0.1\) trainer: .*", node1)[0]
    assert "-m torch.distributed.run --nnodes=1 --node-rank=0 --nproc-per-node=1 --rdzv-backend=c10d" in trainer_line
    assert "--rdzv-endpoint=127.0.0.1:29500 -m trainer.main" in trainer_line
    assert re.search(
        rf"node 1 \(127.0.0.1\) orchestrator: .* -m orchestrator.main @ {configs}/orchestrator.toml", node1
    )


@pytest.mark.parametrize("gpus", [1, 8])
def test_two_nodes_of_gpus_put_a_server_on_each_gpu_of_node_0_and_a_trainer_rank_on_each_of_node_1(
    fake_slurm, monkeypatch, gpus
):
    monkeypatch.setenv("GPUS_PER_NODE", str(gpus))
    output_dir = fake_slurm / "run"
    out = sbatch(output_dir, "--model.name", "Qwen/Qwen3-0.6B", "--gpu-memory-gib", "80")  # planned for 80 GB GPUs
    # rl's plan: node 0's GPUs serve, node 1's (numbered after them) train, one FSDP rank each, and it fits
    assert "memory plan (GPUs of 80.0 GiB):" in out
    for gpu in range(2 * gpus):
        assert f"  GPU {gpu}: {'inference' if gpu < gpus else 'trainer'} = " in out

    configs = output_dir / "configs"
    node0 = (fake_slurm / "node-0.out").read_text().splitlines()
    servers = ["inference"] if gpus == 1 else [f"inference-{i}" for i in range(gpus)]
    assert [line.split(": ")[0] for line in node0] == [f"node 0 (localhost) {name}" for name in servers]
    for gpu, (name, line) in enumerate(zip(servers, node0, strict=True)):
        assert re.fullmatch(rf".*: CUDA_VISIBLE_DEVICES={gpu} \S+ -m inference.main @ {configs}/{name}.toml", line)
    node1 = (fake_slurm / "node-1.out").read_text()
    visible = ",".join(map(str, range(gpus)))
    assert re.search(rf"node 1 \(127.0.0.1\) trainer: CUDA_VISIBLE_DEVICES={visible} \S+ -m torch.distributed.run "
                     rf"--nnodes=1 --node-rank=0 --nproc-per-node={gpus} ", node1)  # fmt: skip
    assert re.search(r"node 1 \(127.0.0.1\) orchestrator: CUDA_VISIBLE_DEVICES= \S+ -m orchestrator.main", node1)


def test_resolving_a_resumed_job_deletes_what_the_stopped_run_wrote_after_its_checkpoint(tmp_path):
    """A run stopped after step 3 with its newest complete checkpoint at step 2: ``resolve --ckpt.resume-step -1``
    resolves step 2 into the trainer's config and, as rl does before a resumed run, deletes the batches and weights
    and keeps the metrics of steps 1-2 only, so no process reads step 3's stale batch; with ``--dry-run``, nothing."""
    output_dir = tmp_path / "run"
    for part in ("trainer", "orchestrator"):
        (checkpoint_dir(output_dir, 2) / part).mkdir(parents=True)
        mark_stable(checkpoint_dir(output_dir, 2) / part)
    for folder in (rollouts_dir(output_dir, 3), weights_dir(output_dir, 3)):
        folder.mkdir(parents=True)
    write_records(metrics_path(output_dir, "trainer"), [{"step": step} for step in (1, 2, 3)])
    rl_flags = ["--trainer", "@", str(DEBUG / "train.toml"), "--orchestrator", "@", str(DEBUG / "orch.toml"),
                "--inference", "@", str(DEBUG / "infer.toml"), "--output-dir", str(output_dir),
                "--ckpt.interval", "2", "--ckpt.resume-step", "-1"]  # fmt: skip

    def resolve(*flags: str) -> None:
        argv = [sys.executable, "-m", "launch.slurm_nodes", "resolve", "--nodes", "h0,h1", *flags, "--", *rl_flags]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stdout + result.stderr

    resolve("--dry-run")
    assert rollouts_dir(output_dir, 3).exists() and len(read_metrics(output_dir, "trainer")) == 3
    resolve()
    assert parse_config(TrainerConfig, ["@", str(output_dir / "configs" / "trainer.toml")]).ckpt.resume_step == 2
    assert not (output_dir / "rollouts").exists() and not (output_dir / "weights").exists()
    assert [record["step"] for record in read_metrics(output_dir, "trainer")] == [1, 2]
    assert (checkpoint_dir(output_dir, 2) / "trainer").exists()
