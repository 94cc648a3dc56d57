"""Model names: a ``trident/`` id that is no tiny model is refused by name in one line, a tiny model not built yet
stops a process alone with one line saying how to build it, and the builder (a tool) builds the ids the contracts
name."""

import json

import pytest
from debug_configs import FILES
from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.model_card import ModelCard, resolve_model_path, routed_experts
from contracts.model_path import TINY_MODEL_IDS, tiny_model_path
from contracts.run_spec import load_config
from inference.config import InferenceConfig
from launch.rl_config import RLConfig
from tools import tiny_model
from trainer.config import TrainerConfig

UNKNOWN = (
    r"'trident/tiny-qwen4' is no model Trident builds; the tiny models are trident/tiny-qwen3, trident/tiny-qwen2.5, "
    r"trident/tiny-llama3, trident/tiny-qwen3-moe, trident/tiny-qwen2.5-moe, trident/tiny-qwen3-vl, trident/tiny-qwen3-wide$"
)


def test_an_unknown_trident_id_is_one_line_naming_it_and_the_tiny_models(tmp_path):
    with pytest.raises(ConfigError, match=rf"^--model.name: model.name: {UNKNOWN}"):
        parse_config(TrainerConfig, ["--model.name", "trident/tiny-qwen4"])
    train = tmp_path / "train.toml"
    train.write_text('[model]\nname = "trident/tiny-qwen4"\n')
    with pytest.raises(ConfigError, match=rf"^{train}: model.name: {UNKNOWN}"):
        parse_config(TrainerConfig, ["@", str(train)])
    with pytest.raises(ConfigError, match=rf"^--model.name: .*{UNKNOWN}"):  # rl --dry-run refuses it too
        parse_config(RLConfig, [*FILES, "--model.name", "trident/tiny-qwen4"])
    with pytest.raises(TridentError, match=rf"^model {UNKNOWN}"):  # a name that came another way than a config
        resolve_model_path("trident/tiny-qwen4")
    assert resolve_model_path("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub id is loaded by its name


def test_a_process_alone_on_a_tiny_model_not_built_stops_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRIDENT_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        load_config(InferenceConfig, "inference", ["--model.name", "trident/tiny-llama3"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "error: model 'trident/tiny-llama3' is not built yet: a process started alone needs it built first, with "
        "`uv run --no-sync build-tiny-model trident/tiny-llama3` (rl builds it itself)\n"
    )
    assert not tiny_model_path("trident/tiny-llama3").exists()  # nothing was built behind the user's back


def test_the_builder_builds_the_ids_the_contracts_name_where_they_look(tiny_model_path, monkeypatch, capsys):
    assert list(tiny_model.TINY_MODELS) == list(TINY_MODEL_IDS)
    assert tiny_model.built_model_path("trident/tiny-qwen3") == resolve_model_path("trident/tiny-qwen3")
    assert resolve_model_path("trident/tiny-qwen3") == tiny_model_path  # the conftest built it before the session
    monkeypatch.setattr("sys.argv", ["build-tiny-model", "trident/tiny-qwen4"])
    with pytest.raises(SystemExit, match=r"^build-tiny-model: unknown tiny model 'trident/tiny-qwen4'; choose one of "):
        tiny_model.main()
    monkeypatch.setattr("sys.argv", ["build-tiny-model"])
    tiny_model.main()
    assert capsys.readouterr().out == f"{tiny_model_path}\n"


@pytest.mark.parametrize(
    ("config", "experts"),
    [
        (Qwen3MoeConfig(num_experts=128), 128),  # written as num_local_experts by transformers 5
        ({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8}, 128),  # the hub's Qwen3-30B-A3B
        (MixtralConfig(num_local_experts=8), 8),
        (DeepseekV3Config(n_routed_experts=256), 256),
        (GptOssConfig(num_local_experts=32), 32),
        (Qwen3Config(), 0),
    ],
    ids=["qwen3-moe", "qwen3-moe-hub", "mixtral", "deepseek-v3", "gpt-oss", "dense"],
)
def test_every_reader_counts_the_experts_of_each_family_alike(config, experts, tmp_path):
    """The server, the preflight, the trainer's ep check and the memory plan all read the model card, which counts a
    config.json's routed experts with contracts.model_card.routed_experts."""
    fields = config if isinstance(config, dict) else config.to_dict()
    assert routed_experts(fields) == experts
    assert routed_experts({"model_type": "vlm", "text_config": fields}) == experts  # a multimodal model's text model
    (tmp_path / "config.json").write_text(json.dumps(fields))
    card = ModelCard.of(str(tmp_path))
    assert card.is_mixture_of_experts == (experts > 0)
    assert card.experts == experts
    if "vocab_size" in fields:  # the hub file above is cut to its expert fields
        assert card.hub_shape().num_experts == experts
