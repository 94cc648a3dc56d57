"""The single-GPU swe-grep configs load as they are, and resolve to what each key documents."""

from pathlib import Path

import pytest

from contracts.config import ConfigError, parse_config
from launch.rl_config import RLConfig, resolve_shared
from orchestrator.config import OrchestratorConfig

CONFIGS = Path(__file__).parents[3] / "configs" / "swe-grep" / "rl"
FILES = ["--trainer", "@", str(CONFIGS / "train.toml"), "--orchestrator", "@", str(CONFIGS / "orch.toml")]
FILES += ["--inference", "@", str(CONFIGS / "infer.toml")]


def test_swe_grep_configs_resolve_to_their_documented_values():
    config = resolve_shared(parse_config(RLConfig, FILES))
    trainer, orchestrator, inference = config.trainer, config.orchestrator, config.inference
    assert {trainer.model.name, orchestrator.model.name, inference.model.name} == {"willcb/Qwen3-8B"}
    assert trainer.max_steps == orchestrator.max_steps == 5
    assert trainer.seq_len == orchestrator.seq_len == 1024  # set in orch.toml only, filled into the trainer
    assert trainer.model.ac.freq == 1
    lora = trainer.model.experimental.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (4, 8, 0.0)
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (trainer.optim.lr, trainer.optim.weight_decay) == (1e-5, 0.0)
    assert inference.gpu_memory_utilization == 0.5
    assert inference.model.enforce_eager and inference.model.enable_auto_tool_choice
    assert inference.model.tool_call_parser == "hermes"
    assert (orchestrator.batch_size, orchestrator.rollouts_per_example) == (4, 4)
    assert orchestrator.mask_truncated_completions is False
    assert orchestrator.sampling.max_tokens == 1024
    assert [(e.id, e.args) for e in orchestrator.env] == [
        ("swe-grep-oss-env", {"max_tokens": 1024, "max_tool_calls": 20})
    ]


def test_model_name_flag_overrides_all_three_files():
    config = resolve_shared(parse_config(RLConfig, [*FILES, "--model.name", "trident/tiny-qwen3"]))
    assert {config.trainer.model.name, config.orchestrator.model.name, config.inference.model.name} == {
        "trident/tiny-qwen3"
    }


def test_absent_tables_leave_lora_and_checkpointing_off():
    trainer = resolve_shared(parse_config(RLConfig, [])).trainer
    assert trainer.model.ac is None and trainer.model.experimental.lora is None


def test_seq_len_smaller_than_max_tokens_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"seq_len = 512 is smaller than sampling.max_tokens = 1024"):
        parse_config(OrchestratorConfig, ["@", str(CONFIGS / "orch.toml"), "--seq-len", "512"])
