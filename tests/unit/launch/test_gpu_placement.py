"""GPU runs planned on CPU: GPU ids as people type them, and what ``rl --dry-run --gpu-memory-gib 80`` places and
starts (command lines, CUDA_VISIBLE_DEVICES, which GPU holds which process, the plan fitting)."""

import sys
from pathlib import Path

import pytest
import torch

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from launch.launcher import run
from launch.preflight import check_gpus, settle_broadcast
from launch.rl_config import RLConfig, resolve_shared

CONFIGS = Path(__file__).parents[3] / "configs"


def files(name: str) -> list[str]:
    folder = CONFIGS / name / "rl"
    return ["--trainer", "@", str(folder / "train.toml"), "--orchestrator", "@", str(folder / "orch.toml"),
            "--inference", "@", str(folder / "infer.toml")]  # fmt: skip


def dry_run(capsys, output_dir: Path, configs: str, *flags: str, on_gpu: bool = True) -> str:
    """What ``rl --dry-run`` prints for ``configs`` with ``flags``, run in this process."""
    flags = [*files(configs), "--output-dir", str(output_dir), *flags]
    config = resolve_shared(parse_config(RLConfig, flags), on_gpu)
    config.dry_run = True
    assert run(config) == 0
    return capsys.readouterr().out


def commands(out: str) -> dict[str, str]:
    """The ``commands:`` block of a dry run: process name -> its command line."""
    block = out.split("commands:\n")[1].split("memory plan")[0]
    return dict(line.strip().split(": ", 1) for line in block.splitlines())


@pytest.mark.parametrize("typed", ["0", "[0]", "0,1", "[0, 1]", "3"])
def test_gpu_ids_are_read_as_people_type_them(typed):
    config = parse_config(RLConfig, ["--trainer-gpu-ids", typed, "--inference-gpu-ids", typed])
    assert config.trainer_gpu_ids == config.inference_gpu_ids == [int(i) for i in typed.strip("[]").split(",")]


@pytest.mark.parametrize(
    ("typed", "message"),
    [("-1", r"\[-1\]: GPU ids are 0 or more"), ("0,0", r"\[0, 0\]: each GPU may be named once"),
     ("a", r"'a' is not a GPU id, a comma list \(0,1\) or a JSON list")],
)  # fmt: skip
def test_negative_repeated_or_unreadable_gpu_ids_are_refused_in_one_line(typed, message):
    with pytest.raises(ConfigError, match=rf"^--trainer-gpu-ids: trainer_gpu_ids: {message}"):
        parse_config(RLConfig, ["--trainer-gpu-ids", typed])


def test_one_gpu_shared_by_trainer_and_server(capsys, caplog, tmp_path):
    out = dry_run(capsys, tmp_path, "swe-grep", "--trainer-gpu-ids", "0", "--inference-gpu-ids", "0",
                  "--gpu-memory-gib", "80")  # fmt: skip
    configs = tmp_path / "configs"
    assert commands(out) == {
        "inference": f"CUDA_VISIBLE_DEVICES=0 {sys.executable} -m inference.main @ {configs}/inference.toml",
        "orchestrator": f"CUDA_VISIBLE_DEVICES= {sys.executable} -m orchestrator.main @ {configs}/orchestrator.toml",
        "trainer": f"CUDA_VISIBLE_DEVICES=0 {sys.executable} -m trainer.main @ {configs}/trainer.toml",
    }
    assert "memory plan (GPUs of 80.0 GiB):" in out and "  GPU 0: trainer + inference = " in out
    assert "enforce_eager = true turns vLLM's CUDA graphs off, which slows decoding" in caplog.text  # the user's file


def test_one_node_of_eight_gpus_runs_the_trainer_under_torchrun_with_a_rank_per_gpu(capsys, caplog, tmp_path):
    out = dry_run(capsys, tmp_path, "debug", "--model.name", "Qwen/Qwen3-8B", "--inference-gpu-ids", "0,1,2,3",
                  "--inference.tensor-parallel-size", "2", "--trainer-gpu-ids", "4,5,6,7",
                  "--gpu-memory-gib", "80")  # fmt: skip
    started, configs = commands(out), tmp_path / "configs"
    server = f"{sys.executable} -m inference.main @ {configs}/inference-0.toml"
    assert started["inference-0"] == f"CUDA_VISIBLE_DEVICES=0,1 {server}"
    assert started["inference-1"].startswith("CUDA_VISIBLE_DEVICES=2,3 ")
    assert started["trainer"] == (
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 {sys.executable} -m torch.distributed.run --standalone --nproc-per-node=4 "
        f"-m trainer.main @ {configs}/trainer.toml"
    )
    for gpu in range(8):
        assert f"  GPU {gpu}: {'inference' if gpu < 4 else 'trainer'} = " in out
    assert "CUDA graphs" not in caplog.text  # debug's infer.toml keeps them


def test_without_a_planned_gpu_everything_runs_on_the_cpu(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks a machine without GPUs")
    out = dry_run(capsys, tmp_path, "swe-grep", "--trainer-gpu-ids", "0", "--inference-gpu-ids", "0")
    started = commands(out)
    assert all(line.startswith("CUDA_VISIBLE_DEVICES= ") for line in started.values())
    assert "torch.distributed.run" not in started["trainer"] and "memory plan (CPU):" in out


def test_the_broadcast_shares_memory_on_one_device_and_nccl_there_is_refused():
    def settled(*flags: str, on_gpu: bool = True) -> str:
        flags = (*files("debug"), "--gpu-memory-gib", "80", "--trainer.weight-broadcast.port", "29510", *flags)
        config = resolve_shared(parse_config(RLConfig, [*flags, "--dry-run"]))
        settle_broadcast(config, on_gpu)
        return config.trainer.weight_broadcast.backend

    assert settled("--trainer-gpu-ids", "0", "--inference-gpu-ids", "0") == "shared"  # one GPU: CUDA IPC
    assert settled("--trainer-gpu-ids", "1", "--inference-gpu-ids", "0") == "nccl"  # two GPUs: NCCL pairs them
    assert settled(on_gpu=False) == "shared"  # the CPU: /dev/shm
    assert settled("--trainer.weights.delta", "on", on_gpu=False) == "gloo"  # deltas go over a process group
    assert settled("--inference.host", "0.0.0.0") == "auto"  # a server for other nodes: the trainer decides
    assert settled("--trainer.weight-broadcast.backend", "gloo") == "gloo"  # works anywhere, as asked
    with pytest.raises(TridentError, match=r"^trainer.weight_broadcast.backend = 'nccl': the trainer and an inference "
                                           r"server share GPU 0, where NCCL cannot pair two ranks on one device; use "
                                           r"backend = 'auto'"):  # fmt: skip
        settled("--trainer-gpu-ids", "0", "--inference-gpu-ids", "0", "--trainer.weight-broadcast.backend", "nccl")
    # several servers: a shared buffer serves one, so gloo where the trainer shares a device with one, else NCCL
    assert settled("--inference-servers", "2", on_gpu=False) == "gloo"
    assert settled("--trainer-gpu-ids", "2", "--inference-gpu-ids", "0,1") == "nccl"
    assert settled("--trainer-gpu-ids", "0", "--inference-gpu-ids", "0,1") == "gloo"
    with pytest.raises(TridentError, match=r"^trainer.weight_broadcast.backend = 'shared': the trainer \(GPU 1\) and "
                                           r"the inference server \(GPU 0\) are on two devices"):  # fmt: skip
        settled("--trainer-gpu-ids", "1", "--inference-gpu-ids", "0", "--trainer.weight-broadcast.backend", "shared")


def test_a_planned_gpu_run_on_a_machine_without_gpus_starts_nothing():
    if torch.cuda.is_available():
        pytest.skip("checks a machine without GPUs")
    config = resolve_shared(parse_config(RLConfig, ["--gpu-memory-gib", "80"]))
    with pytest.raises(TridentError, match=r"--gpu-memory-gib 80: plans a GPU run, and this machine has no GPU"):
        check_gpus(config, on_gpu=True)


def test_expert_parallelism_on_the_cpu_starts_a_trainer_rank_per_expert_share(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks a machine without GPUs")
    out = dry_run(capsys, tmp_path, "debug", "--model.name", "trident/tiny-qwen3-moe",
                  "--trainer.model.parallel.ep", "2", on_gpu=False)  # fmt: skip
    assert commands(out)["trainer"] == (
        f"CUDA_VISIBLE_DEVICES= {sys.executable} -m torch.distributed.run --standalone --nproc-per-node=2 "
        f"-m trainer.main @ {tmp_path}/configs/trainer.toml"
    )
    assert "  trainer: CPU, torchrun with 2 ranks (FSDP2, experts split over 2 ranks)" in out


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [("trident/tiny-qwen3-moe", ["--trainer.model.parallel.ep", "3", "--trainer-gpu-ids", "0,1,2"],
      r"trainer.model.parallel.ep = 3 must divide the 4 experts of model 'trident/tiny-qwen3-moe'"),
     ("Qwen/Qwen3-30B-A3B", ["--trainer.model.parallel.ep", "3", "--trainer-gpu-ids", "0,1,2"],
      r"trainer.model.parallel.ep = 3 must divide the 128 experts of model 'Qwen/Qwen3-30B-A3B'"),
     ("Qwen/Qwen3-30B-A3B", ["--trainer.model.parallel.ep", "4", "--trainer-gpu-ids", "0,1"],
      r"trainer.model.parallel.ep = 4 must divide the trainer's ranks: --trainer-gpu-ids \[0, 1\]"),
     ("trident/tiny-qwen3", ["--trainer.model.parallel.ep", "2", "--trainer-gpu-ids", "0,1"],
      r"trainer.model.parallel.ep = 2: model 'trident/tiny-qwen3' is dense \(no experts to split\); set ep = 1"),
     ("trident/tiny-qwen3-moe", ["--trainer.model.parallel.ep", "2", "--trainer.model.experimental",
                                 '{"load_in_4bit": true, "lora": {}}'],
      r"trainer.model.parallel.ep = 2: trainer.model.experimental.load_in_4bit trains on one rank; set ep = 1")],
)  # fmt: skip
def test_an_expert_parallelism_the_trainer_cannot_run_is_refused_in_one_line(model, flags, message):
    config = parse_config(RLConfig, [*files("debug"), "--model.name", model, *flags])
    with pytest.raises(ConfigError, match=rf"^{message}$"):
        resolve_shared(config, on_gpu=True)
    eight = ["--model.name", "Qwen/Qwen3-30B-A3B", "--trainer-gpu-ids", "0,1,2,3,4,5,6,7"]
    for ep in ("2", "8"):  # where it divides both, it is taken
        config = parse_config(RLConfig, [*files("debug"), *eight, "--trainer.model.parallel.ep", ep])
        assert resolve_shared(config, on_gpu=True).trainer.model.parallel.ep == int(ep)
