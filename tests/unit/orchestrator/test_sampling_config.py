"""[sampling] top_p / top_k / min_p: sent with each request only when on, carried to the trainer, and a trained
seat's own sampling (which the trainer could not replay) refused in one line naming the key."""

import pytest

from contracts.config import ConfigError, parse_config
from contracts.sampling import Truncation
from orchestrator.config import OrchestratorConfig, SamplingConfig


def test_requests_carry_each_truncation_that_is_on_and_none_by_default():
    assert SamplingConfig().request_params() == {"temperature": 1.0, "max_tokens": 128}  # as before the keys existed
    sampling = SamplingConfig(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05)
    assert sampling.request_params() == {"temperature": 0.6, "max_tokens": 128, "top_p": 0.95, "top_k": 20,
                                         "min_p": 0.05}  # fmt: skip
    assert sampling.truncation == Truncation(top_p=0.95, top_k=20, min_p=0.05)
    assert SamplingConfig(top_k=20).request_params() == {"temperature": 1.0, "max_tokens": 128, "top_k": 20}
    assert not SamplingConfig().truncation.on and SamplingConfig(min_p=0.1).truncation.on


@pytest.mark.parametrize("flag, value", [("top-p", "0"), ("top-p", "1.5"), ("top-k", "-1"), ("min-p", "1")])
def test_out_of_range_truncation_is_refused_naming_the_key(flag, value):
    with pytest.raises(ConfigError, match=rf"--sampling\.{flag}: sampling\.{flag.replace('-', '_')}: "):
        parse_config(OrchestratorConfig, [f"--sampling.{flag}", value])


def write(tmp_path, seat: str) -> str:
    path = tmp_path / "orch.toml"
    path.write_text(f'[[env]]\nid = "digit-duel"\n[env.env_args.player1]\n{seat}\n')
    return str(path)


def test_a_trained_seat_with_its_own_sampling_is_refused_in_one_line(tmp_path):
    path = write(tmp_path, "sampling = { max_tokens = 64, top_p = 0.5, logit_bias = { 7 = 5.0 } }")
    with pytest.raises(ConfigError) as refused:
        parse_config(OrchestratorConfig, ["@", path])
    message = str(refused.value)
    assert "\n" not in message
    assert "env.0.env_args.player1.sampling.logit_bias ('digit-duel'): the trainer replays [sampling] only" in message


@pytest.mark.parametrize(
    "seat", ["sampling = { max_tokens = 64 }", 'model = "judge-model"\nsampling = { top_p = 0.5 }']
)
def test_a_seat_may_cap_its_tokens_or_sample_as_it_likes_on_another_model(tmp_path, seat):
    config = parse_config(OrchestratorConfig, ["@", write(tmp_path, seat)])
    assert config.env[0].env_args["player1"]["sampling"]


def test_a_vision_language_models_markers_are_banned_from_its_replies_and_the_batch_says_so():
    """The tiny VLM's four vision markers (from its config.json and tokenizer.json) go to the server as bad_words;
    a text model bans nothing."""
    from contracts.model_card import ModelCard
    from tools.tiny_model import built_model_path

    markers = ModelCard.of(built_model_path("trident/tiny-qwen3-vl")).vision_markers()
    assert sorted(markers.values()) == ["<|image_pad|>", "<|video_pad|>", "<|vision_end|>", "<|vision_start|>"]
    assert ModelCard.of(built_model_path("trident/tiny-qwen3")).vision_markers() == {}
    params = SamplingConfig().request_params(tuple(markers.values()))
    assert params["bad_words"] == list(markers.values())
    assert "bad_words" not in SamplingConfig().request_params()
