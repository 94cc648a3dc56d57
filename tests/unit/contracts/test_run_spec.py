"""The run spec (contracts.run_spec): derived once by ``rl`` from the three configs and written beside them; a
process started alone from those files takes its values, and one without a spec derives the same from its own file."""

from pathlib import Path

import pytest

from contracts.config import ConfigError, parse_config
from contracts.run_spec import HOMES, RunSpec, load_config, run_spec_path
from inference.config import InferenceConfig
from inference.server import vllm_argv
from launch.launcher import run
from launch.rl_config import SHARED_FIELDS, RLConfig, resolve_shared
from orchestrator.config import OrchestratorConfig
from orchestrator.verifiers_adapter.envs import model_context
from orchestrator.verifiers_adapter.renderer import renderer_config
from tools.tiny_model import built_model_path
from trainer.config import TrainerConfig

DEBUG = Path(__file__).parents[3] / "configs" / "debug" / "rl"
PROCESSES = {"trainer": TrainerConfig, "orchestrator": OrchestratorConfig, "inference": InferenceConfig}


def rl_dry_run(output_dir: Path, *flags: str) -> RunSpec:
    """Resolve the debug run's configs as ``rl --dry-run`` does (in this process) and return the run spec it wrote."""
    argv = ["--trainer", "@", str(DEBUG / "train.toml"), "--orchestrator", "@", str(DEBUG / "orch.toml"),
            "--inference", "@", str(DEBUG / "infer.toml"), "--output-dir", str(output_dir), "--dry-run"]  # fmt: skip
    argv += flags
    assert run(resolve_shared(parse_config(RLConfig, argv), on_gpu=False)) == 0
    return RunSpec.model_validate_json(run_spec_path(output_dir).read_text())


def start_alone(process: str, path: Path):
    """What ``uv run <process> @ <path>`` resolves before it starts: its config and its run spec."""
    return load_config(PROCESSES[process], process, ["@", str(path)])


def shared_values(trainer: TrainerConfig, orchestrator: OrchestratorConfig) -> dict:
    return {
        "model": (trainer.model.name, orchestrator.model.name),
        "seq_len": (trainer.seq_len, orchestrator.seq_len),
        "max_steps": (trainer.max_steps, orchestrator.max_steps),
        "async_level": orchestrator.async_level,
        "lora": (trainer.model.experimental.lora.rank, trainer.model.experimental.lora.export),
        "chat_family": orchestrator.model.chat_family,
        "renderer": renderer_config(
            orchestrator.model.renderer,
            orchestrator.model.chat_family,
            built_model_path(orchestrator.model.name),
            False,
        ).name,
        "base_url": orchestrator.client.base_url,
    }


def test_one_table_says_where_every_shared_fact_lives():
    """HOMES names each fact once: every fact of the spec has its homes there, and every other fact is a setting that
    rl hands the processes (its own key sets it in all of them)."""
    assert set(RunSpec.model_fields) <= set(HOMES)
    for fact, home in HOMES.items():
        assert fact in RunSpec.model_fields or home.rl_key is not None, f"{fact}: in no spec, and rl sets it nowhere"
        assert home.rl_key is None or home.rl_key.split(".")[0] in RLConfig.model_fields, home.rl_key
    assert SHARED_FIELDS["model.name"] == ("trainer.model.name", "orchestrator.model.name", "inference.model.name")
    assert SHARED_FIELDS["output_dir"] == ("trainer.output_dir", "orchestrator.output_dir", "inference.output_dir")


def test_trainer_and_orchestrator_started_alone_from_rls_files_get_the_values_they_have_under_rl(tmp_path):
    spec = rl_dry_run(tmp_path, "--seq-len", "512", "--trainer.model.experimental.lora.rank", "12")
    assert spec == RunSpec(
        model="trident/tiny-qwen3", seq_len=512, max_steps=20, async_level=1, lora_rank=12, lora_export="adapter",
        served_lora_rank=16, chat_family="qwen3", inference_urls=["http://127.0.0.1:8000"],
    )  # fmt: skip
    configs = tmp_path / "configs"
    (trainer, trainer_spec), (orchestrator, orchestrator_spec) = (
        start_alone(process, configs / f"{process}.toml") for process in ("trainer", "orchestrator")
    )
    assert trainer_spec == orchestrator_spec == spec
    under_rl = {
        "model": ("trident/tiny-qwen3",) * 2, "seq_len": (512, 512), "max_steps": (20, 20), "async_level": 1,
        "lora": (12, "adapter"), "chat_family": "qwen3", "renderer": "qwen3", "base_url": "http://127.0.0.1:8000",
    }  # fmt: skip
    assert shared_values(trainer, orchestrator) == under_rl

    # Without the spec, each derives the same facts from its own file, with the same function (the chat family
    # detected from the model's files, as rl detected it): a file rl wrote says the family, so strip it first.
    run_spec_path(tmp_path).unlink()
    orchestrator_file = configs / "orchestrator.toml"
    orchestrator_file.write_text(orchestrator_file.read_text().replace('chat_family = "qwen3"\n', ""))
    assert "chat_family" not in orchestrator_file.read_text()
    (trainer, trainer_spec), (orchestrator, orchestrator_spec) = (
        start_alone(process, configs / f"{process}.toml") for process in ("trainer", "orchestrator")
    )
    assert shared_values(trainer, orchestrator) == under_rl
    for own, facts in ((trainer_spec, ("model", "seq_len", "max_steps", "lora_rank", "lora_export")),
                       (orchestrator_spec, ("model", "seq_len", "max_steps", "async_level", "chat_family",
                                            "inference_urls"))):  # fmt: skip
        assert {fact: getattr(own, fact) for fact in facts} == {fact: getattr(spec, fact) for fact in facts}


def test_a_process_file_leaving_shared_keys_out_takes_the_runs_values(tmp_path):
    spec = rl_dry_run(tmp_path, "--seq-len", "512", "--orchestrator.async-level", "2")
    own = tmp_path / "own.toml"
    own.write_text(f'output_dir = "{tmp_path}"\n')
    orchestrator, _ = start_alone("orchestrator", own)
    assert (orchestrator.seq_len, orchestrator.async_level, orchestrator.model.chat_family) == (512, 2, "qwen3")
    assert orchestrator.client.base_urls == spec.inference_urls
    inference, _ = start_alone("inference", own)  # the server finds the spec through output_dir too
    assert (inference.model.max_model_len, inference.model.chat_family) == (512, "qwen3")


def test_one_chat_family_override_picks_both_the_renderer_and_the_tool_call_parser(tmp_path):
    spec = rl_dry_run(tmp_path, "--model.chat-family", "llama-3")
    assert spec.chat_family == "llama-3"
    orchestrator, _ = start_alone("orchestrator", tmp_path / "configs" / "orchestrator.toml")
    inference, _ = start_alone("inference", tmp_path / "configs" / "inference.toml")
    renderer = model_context(orchestrator, built_model_path(orchestrator.model.name)).client.renderer
    argv = vllm_argv(inference)
    assert (renderer.name, argv[argv.index("--tool-call-parser") + 1]) == ("llama-3", "llama3_json")


def test_a_process_file_contradicting_the_run_spec_is_refused_in_one_line(tmp_path, capsys):
    rl_dry_run(tmp_path)
    own = tmp_path / "own.toml"
    own.write_text(f'output_dir = "{tmp_path}"\nseq_len = 4096\n')
    with pytest.raises(SystemExit) as exit_info:
        start_alone("trainer", own)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: trainer seq_len = 4096 contradicts seq_len = 1024 in {run_spec_path(tmp_path)}; leave seq_len out "
        "or set it to the run's value\n"
    )


def test_an_unknown_chat_family_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"^--model.chat-family: model.chat_family: unknown chat family 'qwen9'; "
                                          r"choose auto, qwen3, qwen2.5, qwen3-vl, llama-3$"):  # fmt: skip
        parse_config(RLConfig, ["--model.chat-family", "qwen9"])


def test_a_run_json_that_is_no_run_spec_is_refused_naming_it(tmp_path, capsys):
    run_spec_path(tmp_path).parent.mkdir()
    run_spec_path(tmp_path).write_text('{"model": "m", "seq_len": "long"}')
    own = tmp_path / "own.toml"
    own.write_text(f'output_dir = "{tmp_path}"\n')
    with pytest.raises(SystemExit):
        start_alone("orchestrator", own)
    error = capsys.readouterr().err
    assert error == (
        f"error: {run_spec_path(tmp_path)}: not a run spec (seq_len: Input should be a valid integer, unable to parse "
        "string as an integer); delete it or run rl again\n"
    )
