"""A vision-language model's probe shows it an image, so that a server serving other vision weights fails it."""

import torch
from transformers import AutoProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

from contracts.images import image_bytes
from contracts.run_dir import PROBE_TEXT, read_probe
from tools.tiny_model import built_model_path
from trainer.export import make_probe, probe_image, probe_logprobs, save_weights


def test_a_vlms_probe_shows_its_image_and_moves_with_its_vision_weights_alone(tmp_path):
    path = built_model_path("trident/tiny-qwen3-vl")
    tokenizer, pad = AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path).image_token_id
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    probe = make_probe(model, tokenizer)
    assert image_bytes(probe.image) == probe_image()
    assert probe.prompt_ids.count(pad) == 1 and probe.token_ids.count(pad) == 4  # 64 x 64: 2 x 2 merged patches
    assert [t for t in probe.token_ids if t != pad] == [t for t in probe.prompt_ids if t != pad]
    assert tokenizer.decode(probe.prompt_ids).endswith(PROBE_TEXT) and len(probe.logprobs) == len(probe.token_ids)

    text_ids = tokenizer.encode(PROBE_TEXT)
    text_before = probe_logprobs(model, text_ids)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".visual." in name:
                parameter.add_(torch.randn_like(parameter) * (parameter.std() if parameter.numel() > 1 else 0.1))
    assert probe_logprobs(model, text_ids) == text_before  # text alone cannot see the vision tower
    moved = make_probe(model, tokenizer)
    assert max(abs(a - b) for a, b in zip(moved.logprobs, probe.logprobs, strict=True)) > 1e-3
    save_weights(model, tokenizer, tmp_path / "step_1")
    assert read_probe(tmp_path / "step_1") == moved  # written with the weights, image and all
