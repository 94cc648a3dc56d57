"""QLoRA (``[model.experimental] load_in_4bit``): a LoRA adapter on a frozen base whose linear layers are 4-bit NF4."""

import json
from pathlib import Path

import pytest
import torch
from bitsandbytes.functional import dequantize_4bit
from bitsandbytes.nn import Linear4bit
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.model_card import GIB
from contracts.protocol import MicroBatch, Sample
from contracts.run_dir import PROBE_TOLERANCE_4BIT, read_probe
from launch.memory_plan import plan_memory
from launch.rl_config import RLConfig, resolve_shared
from trainer.config import SFTConfig, TrainerConfig, TrainerModelConfig
from trainer.export import probe_logprobs, save_weights
from trainer.model import load_model, packed_logprobs
from trainer.parallel import World
from trainer.train import build_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 4, "alpha": 8, "target_modules": TARGETS}


def load(model_path, in_4bit: bool):
    config = TrainerModelConfig(name=model_path, experimental={"lora": LORA, "load_in_4bit": in_4bit})
    torch.manual_seed(0)  # the same random adapter A in both models
    return load_model(config, torch.device("cpu"))


def quantized_layers(model) -> dict[str, Linear4bit]:
    return {name: module for name, module in model.named_modules() if isinstance(module, Linear4bit)}


def batch() -> MicroBatch:
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 2000, (n,), generator=generator).tolist() for n in (12, 9)]
    return MicroBatch.pack([Sample(s, [True] * len(s), [0.0] * len(s), 1.0, 0.0, 0) for s in ids])


def gradients(model) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    packed_logprobs(model, batch(), temperature=1.0).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_base_linears_are_frozen_nf4_and_only_the_float32_adapter_trains(tiny_model_path):
    model = load(tiny_model_path, in_4bit=True)
    full = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    layers = quantized_layers(model)
    # every targeted linear of both decoder layers, nothing else (the tied embeddings / output layer stay full)
    assert sorted(layers) == sorted(
        f"base_model.model.model.layers.{i}.{part}.{name}.base_layer"
        for i in range(2)
        for part, names in (("self_attn", TARGETS[:4]), ("mlp", TARGETS[4:]))
        for name in names
    )
    for name, layer in layers.items():
        weight = layer.weight
        assert weight.dtype == torch.uint8 and not weight.requires_grad
        assert weight.numel() * 2 == layer.in_features * layer.out_features  # two 4-bit codes a byte
        state = weight.quant_state
        assert state.quant_type == "nf4" and state.blocksize == 64 and state.nested  # double quantization
        values = dequantize_4bit(weight.data, state).float()
        # each block of 64 weights takes at most the 16 values of its scaled code; together near the full weights
        assert max(len(block.unique()) for block in values.reshape(-1, 64)) <= 16
        original = full.get_submodule(name.removeprefix("base_model.model.").removesuffix(".base_layer")).weight
        error = (values - original).abs().mean() / original.abs().mean()
        assert 0.01 < error < 0.2, name
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name and p.dtype == torch.float32 for name, p in trainable.items())


def test_adapter_gradients_are_those_of_the_dequantized_base_also_after_an_eval_forward(tiny_model_path):
    """The probe's forward (eval mode, no gradients) must not switch the layers to an inference-only kernel."""
    qlora, reference = load(tiny_model_path, in_4bit=True), load(tiny_model_path, in_4bit=False)
    with torch.no_grad():
        for name, layer in quantized_layers(qlora).items():
            reference.get_submodule(name).weight.copy_(dequantize_4bit(layer.weight.data, layer.weight.quant_state))
        for name, parameter in qlora.named_parameters():
            if "lora_B" in name:  # B starts at 0, which leaves A without gradient
                parameter.normal_(std=0.05)
        reference.load_state_dict({n: p for n, p in qlora.named_parameters() if p.requires_grad}, strict=False)

    probe_ids = list(range(10, 30))
    torch.testing.assert_close(probe_logprobs(qlora, probe_ids), probe_logprobs(reference, probe_ids))
    expected, got = gradients(reference), gradients(qlora)
    assert expected.keys() == got.keys() and len(got) == 2 * len(TARGETS) * 2  # A and B of 14 layers
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4)


def test_the_adapter_learns_a_fixed_batch(tiny_model_path):
    model = load(tiny_model_path, in_4bit=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = -packed_logprobs(model, batch(), temperature=1.0).sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 5, losses  # ~19 tokens: more than 0.25 nat a token


def test_the_adapter_is_exported_as_under_lora_and_the_probe_says_its_base_was_4bit(tiny_model_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    qlora, lora = load(tiny_model_path, in_4bit=True), load(tiny_model_path, in_4bit=False)
    with torch.no_grad():
        for name, parameter in qlora.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    save_weights(qlora, tokenizer, tmp_path / "qlora", export="adapter")
    save_weights(lora, tokenizer, tmp_path / "lora", export="adapter")

    runs = (tmp_path / "qlora", tmp_path / "lora")
    assert sorted(p.name for p in runs[0].iterdir()) == sorted(p.name for p in runs[1].iterdir())
    configs = [json.loads((run / "adapter_config.json").read_text()) for run in runs]
    assert configs[0] == configs[1]
    tensors = [{n: (t.shape, t.dtype) for n, t in load_file(run / "adapter_model.safetensors").items()} for run in runs]
    assert tensors[0] == tensors[1]
    assert {dtype for _, dtype in tensors[0].values()} == {torch.float32}

    # the server's view: the adapter on the unquantized base; the trainer's probe is near it, not equal to it
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    served = PeftModel.from_pretrained(base, tmp_path / "qlora").eval()
    probe = read_probe(tmp_path / "qlora")
    assert probe.base_in_4bit and probe.tolerance == PROBE_TOLERANCE_4BIT
    assert not read_probe(tmp_path / "lora").base_in_4bit
    gap = (torch.tensor(probe_logprobs(served, probe.token_ids)) - torch.tensor(probe.logprobs)).abs()[1:].mean()
    assert 1e-4 < gap < PROBE_TOLERANCE_4BIT


def write(tmp_path, text: str) -> str:
    path = tmp_path / "train.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[model.experimental]\nload_in_4bit = true\n", "load_in_4bit needs [model.experimental.lora]"),
        (
            "[model.experimental]\nload_in_4bit = true\n[model.experimental.lora]\nexport = 'merged'\n",
            "load_in_4bit exports the adapter alone (lora.export = 'adapter')",
        ),
    ],
)
def test_a_4bit_base_without_an_exported_adapter_is_one_line_naming_file_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        parse_config(TrainerConfig, ["@", path])
    [line] = str(error.value).splitlines()
    assert line.startswith(f"{path}: model.experimental: {message}")


def test_sft_refuses_a_4bit_base_in_one_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("")
    text = f"[data]\npath = '{data}'\n[model.experimental]\nload_in_4bit = true\n[model.experimental.lora]\n"
    with pytest.raises(ConfigError) as error:
        parse_config(SFTConfig, ["@", write(tmp_path, text)])
    [line] = str(error.value).splitlines()
    assert line.startswith("model.experimental.load_in_4bit: sft writes merged full weights")


def test_a_4bit_base_on_several_trainer_ranks_is_refused_before_loading(tiny_model_path):
    config = TrainerModelConfig(name=tiny_model_path, experimental={"lora": LORA, "load_in_4bit": True})
    with pytest.raises(TridentError, match=r"^model.experimental.load_in_4bit trains on one rank; this trainer has 2"):
        build_model(config, World(0, 2, torch.device("cpu")), offload=False)


def test_the_debug_qlora_config_resolves_with_an_adapter_serving_server_and_a_4bit_plan():
    configs = Path(__file__).parents[3] / "configs" / "debug"
    files = ["--trainer", "@", str(configs / "qlora" / "train.toml"), "--orchestrator", "@",
             str(configs / "rl" / "orch.toml"), "--inference", "@", str(configs / "rl" / "infer.toml")]  # fmt: skip
    config = resolve_shared(parse_config(RLConfig, files), on_gpu=False)
    trainer = config.trainer
    assert trainer.model.experimental.load_in_4bit and trainer.model.experimental.lora.export == "adapter"
    assert config.inference.lora.max_rank >= trainer.model.experimental.lora.rank  # rl turned the server's [lora] on
    plan = plan_memory(trainer, config.inference, [0], [0], gpu_gib=None)
    full_base = trainer.model_copy(deep=True)
    full_base.model.experimental.load_in_4bit = False
    # the tiny model's tied embeddings (131,072 weights) stay float32; its 73,728 linear weights drop to 4 bits
    saved = plan_memory(full_base, None, [0], [0], gpu_gib=None).trainer["weights"] - plan.trainer["weights"]
    assert 0.9 * 73_728 * 3.5 < saved * GIB < 73_728 * 3.5  # less their scales and code tables
    assert "dequantized" in plan.trainer


def test_rl_refuses_a_4bit_base_on_several_trainer_gpus_before_starting_anything():
    files = ["--trainer", "@", str(Path(__file__).parents[3] / "configs" / "debug" / "qlora" / "train.toml")]
    with pytest.raises(ConfigError, match=r"^--trainer-gpu-ids \[0, 1\]: trainer.model.experimental.load_in_4bit"):
        resolve_shared(parse_config(RLConfig, [*files, "--trainer-gpu-ids", "0,1"]), on_gpu=True)
    one_gpu = resolve_shared(parse_config(RLConfig, [*files, "--trainer-gpu-ids", "1"]), on_gpu=True)
    assert one_gpu.trainer_gpu_ids == [1]
