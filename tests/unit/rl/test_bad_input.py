"""Bad input to ``rl``, checked in this process: a GPU id beyond the machine's GPUs is named, ``rl``'s own
``--max-steps`` and ``--async-level`` are judged together (issue 30). The checks that run the real ``rl`` command line
in a process of its own are in tests/integration/test_bad_input_cli.py."""

import pytest
from debug_configs import FILES

from contracts.config import parse_config
from contracts.errors import TridentError
from launch import preflight
from launch.preflight import check_gpus, check_lora_targets
from launch.rl_config import RLConfig, resolve_shared


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
