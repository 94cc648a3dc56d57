"""``rl`` starting the teacher's server itself (a ``[teacher]`` model without ``base_url``): the processes, GPUs and
ports it plans, the URL the orchestrator gets, the memory plan with and without it, each refusal's one line, and the
run failing (everything stopped) when the teacher's server dies. Dry runs and fake processes: no server starts."""

import json
import logging
import sys
import tomllib
from pathlib import Path

import pytest
from debug_configs import FILES

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from launch import launcher
from launch.preflight import BIND_ENV
from launch.rl_config import RLConfig, resolve_shared, teacher_server

OPD = ["--orchestrator.algorithm", "opd"]
# a student of 1.7B on GPU 0 with its trainer on GPU 1, planned for GPUs of 80 GiB
GPU_RUN = ["--model.name", "Qwen/Qwen3-1.7B", "--inference-gpu-ids", "0", "--trainer-gpu-ids", "1",
           "--gpu-memory-gib", "80", "--inference.gpu-memory-utilization", "0.5"]  # fmt: skip
TEACHER_8B = [*OPD, "--orchestrator.teacher.model", "Qwen/Qwen3-8B"]


def resolved(tmp_path: Path, *flags: str, on_gpu: bool = True, files: list[str] = FILES) -> RLConfig:
    return resolve_shared(parse_config(RLConfig, [*files, "--output-dir", str(tmp_path), *flags]), on_gpu)


def dry_run(capsys, tmp_path: Path, *flags: str, on_gpu: bool = True) -> str:
    """What ``rl --dry-run`` prints for the debug configs with ``flags``."""
    config = resolved(tmp_path, *flags, on_gpu=on_gpu)
    config.dry_run = True
    assert launcher.run(config) == 0
    return capsys.readouterr().out


def commands(out: str) -> dict[str, str]:
    block = out.split("commands:\n")[1].split("memory plan")[0]
    return dict(line.strip().split(": ", 1) for line in block.splitlines())


def written(tmp_path: Path, name: str) -> dict:
    return tomllib.loads((tmp_path / "configs" / f"{name}.toml").read_text())


def test_rl_starts_the_teacher_on_the_policy_servers_gpu_and_counts_it_in_the_plan(capsys, tmp_path):
    """Sharing GPU 0 at 0.4 of it beside the policy server's 0.5: 32 + 40 = 72 of 80 GiB. The teacher's server is
    the policy server's config with the teacher's model, on the next port, loading no weights and reading no run
    spec (which names the student); the orchestrator gets its URL, and the run's key for it (the server checks
    $TRIDENT_API_KEY where it is set, as the policy's does)."""
    out = dry_run(capsys, tmp_path / "with", *GPU_RUN, *TEACHER_8B, "--teacher-gpu-memory-utilization", "0.4")
    configs = tmp_path / "with" / "configs"
    assert (
        commands(out)["teacher"]
        == f"CUDA_VISIBLE_DEVICES=0 {sys.executable} -m inference.main @ {configs}/teacher.toml"
    )
    teacher, policy = written(tmp_path / "with", "teacher"), written(tmp_path / "with", "inference")
    assert (teacher["model"]["name"], teacher["port"], teacher["gpu_memory_utilization"]) == (
        "Qwen/Qwen3-8B",
        8001,
        0.4,
    )
    assert teacher["model"]["max_model_len"] == policy["model"]["max_model_len"] == 1024
    assert not {"output_dir", "weights_root", "lora", "weight_broadcast"} & teacher.keys() and "weights_root" in policy
    teacher_table = written(tmp_path / "with", "orchestrator")["teacher"]
    assert (teacher_table["base_url"], teacher_table["api_key_var"]) == ("http://127.0.0.1:8001", "TRIDENT_API_KEY")
    assert "  teacher: Qwen/Qwen3-8B at http://127.0.0.1:8001: started by rl" in out
    assert "  teacher: 32.0 GiB claimed by vLLM (weights 15.3 GiB, kv_one_context 144 MiB)" in out
    assert "  GPU 0: inference + teacher = 72.0 GiB, free 8.0 GiB" in out

    out = dry_run(capsys, tmp_path / "without", *GPU_RUN)
    assert "teacher" not in commands(out) and "  teacher:" not in out
    assert "  GPU 0: inference = 40.0 GiB, free 40.0 GiB" in out


def test_a_teacher_on_gpus_of_its_own_takes_the_policy_servers_share_of_them(capsys, tmp_path):
    out = dry_run(capsys, tmp_path, *GPU_RUN, *TEACHER_8B, "--teacher-gpu-ids", "2")
    assert commands(out)["teacher"].startswith("CUDA_VISIBLE_DEVICES=2 ")
    assert "  GPU 0: inference = 40.0 GiB, free 40.0 GiB" in out and "  GPU 2: teacher = 40.0 GiB, free 40.0 GiB" in out


def test_a_teacher_that_does_not_fit_beside_the_policy_server_is_refused_in_one_line(tmp_path):
    config = resolved(tmp_path, *GPU_RUN, *TEACHER_8B, "--teacher-gpu-memory-utilization", "0.6")
    config.dry_run = True
    with pytest.raises(TridentError) as refused:
        launcher.run(config)
    assert str(refused.value).startswith(
        "the run does not fit in memory: GPU 0: inference 40.0 GiB + teacher 48.0 GiB = 88.0 GiB does not fit in its "
        "80.0 GiB"
    )
    assert str(refused.value).endswith(
        "; lower --teacher-gpu-memory-utilization and inference.gpu_memory_utilization, or give the teacher GPUs of "
        "its own (--teacher-gpu-ids) (rl --dry-run prints the plan)"
    )
    assert "\n" not in str(refused.value)


def test_on_the_cpu_each_server_gets_a_core_and_the_plan_counts_the_teachers_kv_cache(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(BIND_ENV, raising=False)  # as on a machine that does not pin vLLM's threads itself
    out = dry_run(capsys, tmp_path, *OPD, "--orchestrator.teacher.model", "trident/tiny-qwen3", on_gpu=False)
    started = commands(out)
    assert started["inference"].startswith("CUDA_VISIBLE_DEVICES= VLLM_CPU_OMP_THREADS_BIND=0 ")
    assert started["teacher"].startswith("CUDA_VISIBLE_DEVICES= VLLM_CPU_OMP_THREADS_BIND=1 ")
    assert "  inference: 1.0 GiB (weights 1 MiB, kv_cache 1.0 GiB)" in out
    assert "  teacher: 1.0 GiB (weights 1 MiB, kv_cache 1.0 GiB)" in out


def test_resolving_a_run_again_keeps_the_teacher_rl_starts(tmp_path):
    config = resolved(tmp_path, *TEACHER_8B, "--teacher-gpu-ids", "1")
    again = resolve_shared(config)
    assert teacher_server(again).model.name == "Qwen/Qwen3-8B" and again.orchestrator.teacher.base_url.endswith(":8001")


def test_a_teacher_url_given_keeps_the_users_server(capsys, tmp_path):
    url = "http://127.0.0.1:9001"
    out = dry_run(capsys, tmp_path, *TEACHER_8B, "--orchestrator.teacher.base-url", url, on_gpu=False)
    assert "teacher" not in commands(out) and not (tmp_path / "configs" / "teacher.toml").exists()
    assert f"  teacher: Qwen/Qwen3-8B at {url}: external (rl does not start it)" in out
    assert "api_key_var" not in written(tmp_path, "orchestrator")["teacher"]  # none sent to a server of the user's


@pytest.mark.parametrize(
    ("flags", "line"),
    [([*OPD, "--orchestrator.teacher.adapter", "my-adapter"],
      "orchestrator.teacher.adapter = 'my-adapter': the trainer trains full weights, so the base under the adapter "
      "would move with the policy; a teacher adapter needs a LoRA trainer with export = 'adapter'"),
     ([*TEACHER_8B, "--orchestrator.teacher.base-url", "http://h:1", "--teacher-gpu-ids", "1"],
      "--teacher-gpu-ids: rl starts no teacher server (that takes a [teacher] model without base_url)")],
)  # fmt: skip
def test_a_teacher_rl_cannot_start_as_configured_is_refused_in_one_line(tmp_path, flags, line):
    with pytest.raises(ConfigError) as refused:
        resolved(tmp_path, *flags)
    assert str(refused.value) == line


def adapter_folder(tmp_path: Path, rank: int) -> str:
    folder = tmp_path / "teacher-adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return str(folder)


def test_a_teacher_adapter_is_served_by_the_policy_server_with_room_for_its_rank(capsys, tmp_path):
    """A LoRA run of rank 8 with a teacher adapter of rank 16: no teacher process, the policy server's LoRA slots
    sized for 16 (8 without it), and the orchestrator given the adapter, no URL."""
    adapter = adapter_folder(tmp_path, 16)
    lora = ["--trainer.model.experimental.lora.rank", "8"]
    out = dry_run(capsys, tmp_path / "with", *OPD, *lora, "--orchestrator.teacher.adapter", adapter, on_gpu=False)
    assert list(commands(out)) == ["inference", "orchestrator", "trainer"]
    assert f"  teacher: adapter {adapter} on http://127.0.0.1:8000" in out
    assert written(tmp_path / "with", "inference")["lora"]["max_rank"] == 16
    assert written(tmp_path / "with", "orchestrator")["teacher"] == {
        "adapter": adapter,
        "coef": 1.0,
        "timeout_s": 300.0,
    }
    dry_run(capsys, tmp_path / "without", *lora, on_gpu=False)
    assert written(tmp_path / "without", "inference")["lora"]["max_rank"] == 8


@pytest.mark.parametrize(
    ("rank", "flags", "line"),
    [(16, ["--inference.lora.max-rank", "8"],
      "inference.lora.max_rank = 8 is smaller than the rank of orchestrator.teacher.adapter = 16"),
     (None, [], "orchestrator.teacher.adapter = '{adapter}': no peft adapter there (a folder with adapter_config.json "
                 "giving its rank r)")],
)  # fmt: skip
def test_a_teacher_adapter_the_server_cannot_load_is_refused_before_anything_starts(tmp_path, rank, flags, line):
    adapter = adapter_folder(tmp_path, rank) if rank else str(tmp_path / "nothing")
    teacher = [*OPD, "--orchestrator.teacher.adapter", adapter, "--trainer.model.experimental.lora.rank", "8"]
    with pytest.raises(ConfigError) as refused:
        resolved(tmp_path, *teacher, *flags, on_gpu=False)
    assert str(refused.value) == line.format(adapter=adapter)


def test_a_teacher_model_without_a_url_needs_the_policy_server_rl_starts(tmp_path):
    without_inference = FILES[:6]
    with pytest.raises(ConfigError) as refused:
        resolved(tmp_path, *TEACHER_8B, files=without_inference)
    assert str(refused.value) == (
        "orchestrator.teacher.model = 'Qwen/Qwen3-8B' without base_url: rl starts the teacher's server only beside "
        "the policy's (--inference @ infer.toml); give teacher.base_url of a server you started"
    )


@pytest.mark.parametrize("dies", ["teacher", "trainer"])
def test_a_teacher_server_that_dies_fails_the_run_in_one_line_and_every_process_is_stopped(
    monkeypatch, caplog, saved_handlers, free_port, tmp_path, dies
):
    """Fake processes under the names rl gives them: the one that ``dies`` logs its failure as a server does and
    exits 1; the others would run for a minute. rl fails naming it (the teacher's own line) and stops every process
    group, the teacher's server included."""
    config = resolved(tmp_path, *OPD, "--orchestrator.teacher.model", "trident/tiny-qwen3",
                      "--inference.port", str(free_port(2)), "--no-plots", on_gpu=False)  # fmt: skip
    real_commands, started = launcher.process_commands, []

    def fake_commands(config, paths, on_gpu):
        planned = real_commands(config, paths, on_gpu)
        assert list(planned) == ["inference", "teacher", "orchestrator", "trainer"]
        dying = "echo '00:00:00 inference ERROR inference failed: no model there'; sleep 0.5; exit 1"
        return {name: (["sh", "-c", dying if name == dies else "sleep 60"], env) for name, (_, env) in planned.items()}

    def child(*args):
        started.append(launcher.Child.__wrapped__(*args))
        return started[-1]

    child.__wrapped__ = launcher.Child
    monkeypatch.setattr(launcher, "process_commands", fake_commands)
    monkeypatch.setattr(launcher, "Child", child)
    handlers = list(logging.getLogger().handlers)
    try:
        assert launcher.run(config) == 1
    finally:
        for handler in set(logging.getLogger().handlers) - set(handlers):  # rl.log's
            logging.getLogger().removeHandler(handler)
            handler.close()
    log = tmp_path / "logs" / f"{dies}.log"
    why = f": inference failed: no model there (its log: {log})" if dies == "teacher" else f"; last lines of {log}"
    assert f"{dies} exited with code 1{why}" in caplog.text
    assert len(started) == 4 and not any(process.group_alive() for process in started)


def test_opsd_on_a_trainer_that_serves_its_adapter_is_refused_in_one_line(tmp_path):
    """opsd's self-teacher scores under model.name: with the policy served as an adapter, that is the bare base."""
    opsd = ["--orchestrator.algorithm", "opsd", "--trainer.model.experimental.lora.rank", "8"]
    with pytest.raises(ConfigError) as refused:
        resolved(tmp_path, *opsd)
    assert str(refused.value).startswith("orchestrator.env.0 ('char-target') on 'opsd' with a LoRA trainer that")
    merged = resolved(tmp_path, *opsd, "--trainer.model.experimental.lora.export", "merged")  # served as full weights
    assert merged.orchestrator.env_algorithm(0) == "opsd"
