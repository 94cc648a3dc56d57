"""A vision-language policy (the tiny Qwen3-VL) in the trainer: logprobs with the pixel inputs, packed; the vision
tower frozen or trained; LoRA on the language model; the weights and adapters it writes for the server."""

import io
import json

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from contracts.errors import TridentError
from contracts.images import store_image
from contracts.protocol import BatchError, BatchInfo, MicroBatch, Sample, write_batch
from contracts.run_dir import weights_dir
from tools.tiny_model import built_model_path
from trainer.config import OptimConfig, TrainerConfig, TrainerModelConfig
from trainer.export import save_weights
from trainer.model import load_model, packed_logprobs
from trainer.optim import build_optimizer
from trainer.train import train
from trainer.vision import vision_tower_name

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def tiny_vlm_path() -> str:
    return built_model_path("trident/tiny-qwen3-vl")


def random_image(width: int, height: int, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=generator) * 255).byte().numpy())


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# Two samples with images (the first with two, one resized by the processor) and one text sample, packed in a row.
TEXTS = [f"look {IMAGE} and {IMAGE} now", f"a {IMAGE} b c", "just some text here"]
SIZES = [[(64, 64), (96, 64)], [(50, 70)], []]


def image_samples(model_path, output_dir):
    """Each sample's processor outputs (what a plain forward of it alone takes) and the packed micro-batch, its
    images in the run's image store under ``output_dir``."""
    processor = AutoProcessor.from_pretrained(model_path)
    images = [[random_image(w, h, seed=10 * i + j) for j, (w, h) in enumerate(sizes)] for i, sizes in enumerate(SIZES)]
    inputs = [processor(text=[text], images=shown or None, return_tensors="pt")
              for text, shown in zip(TEXTS, images, strict=True)]  # fmt: skip
    samples = []
    for one, shown in zip(inputs, images, strict=True):
        ids = one["input_ids"][0].tolist()
        refs = [store_image(output_dir, png(image)) for image in shown]
        samples.append(Sample(ids, [True] * len(ids), [0.0] * len(ids), 1.0, 0.0, 0, images=refs))
    return inputs, MicroBatch.pack(samples)


def test_packed_logprobs_with_images_equal_each_samples_own_forward(tiny_vlm_path, tmp_path):
    """The trainer's logprobs of a packed row of two samples with images and a text sample equal those of a plain
    forward of each sample alone with its own processor outputs (pixel values, grids, M-RoPE positions)."""
    inputs, micro_batch = image_samples(tiny_vlm_path, tmp_path)
    model = load_model(TrainerModelConfig(name=tiny_vlm_path), torch.device("cpu"))
    plain = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32)
    with torch.no_grad():
        packed = packed_logprobs(model, micro_batch, temperature=0.7, output_dir=tmp_path)
    start = 0
    for one in inputs:
        ids = one["input_ids"][0]
        with torch.no_grad():
            logits = plain(**one).logits[0]
        expected = torch.log_softmax(logits[:-1] / 0.7, -1).gather(1, ids[1:, None])[:, 0]
        torch.testing.assert_close(packed[start + 1 : start + len(ids)], expected, atol=1e-5, rtol=1e-5)
        start += len(ids)


def test_a_sample_whose_placeholders_do_not_match_its_images_is_refused(tiny_vlm_path, tmp_path):
    _, micro_batch = image_samples(tiny_vlm_path, tmp_path)
    model = load_model(TrainerModelConfig(name=tiny_vlm_path), torch.device("cpu"))
    micro_batch.images[0] = micro_batch.images[0][::-1]  # a 4-token image where a 6-token image's run is
    refused = (r"micro-batch sample 0: its image placeholder runs are \[4, 6\] tokens long, its 2 images "
               r"\(\w{12}, \w{12}\) make \[6, 4\] \(image_grid_thw.prod\(\) // 2\*\*2 each\)")  # fmt: skip
    with pytest.raises(BatchError, match=refused):
        packed_logprobs(model, micro_batch, temperature=1.0, output_dir=tmp_path)
    micro_batch.images[0] = micro_batch.images[0][:1]  # one image for two runs
    with pytest.raises(BatchError, match=r"sample 0: .* are \[4, 6\] tokens long, its 1 images .* make \[6\]"):
        packed_logprobs(model, micro_batch, temperature=1.0, output_dir=tmp_path)


@pytest.mark.parametrize("vision_tower", ["frozen", "trained"])
def test_the_vision_tower_trains_only_on_request(tiny_vlm_path, tmp_path, vision_tower):
    """Frozen (the default): no gradient, not in the optimizer, unchanged by a step while the language model
    changes; trained: it changes too."""
    config = TrainerModelConfig(name=tiny_vlm_path, **({} if vision_tower == "frozen" else {"vision_tower": "trained"}))
    model = load_model(config, torch.device("cpu"))
    tower = vision_tower_name(model)
    assert tower == "model.visual"
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-2), num_steps=1)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    in_tower = {name: p for name, p in model.named_parameters() if name.startswith(f"{tower}.")}
    assert {id(p) in optimized for p in in_tower.values()} == {vision_tower == "trained"}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _, micro_batch = image_samples(tiny_vlm_path, tmp_path)
    packed_logprobs(model, micro_batch, temperature=1.0, output_dir=tmp_path).sum().backward()
    optimizer.step()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert any(name.startswith("model.language_model.layers.") for name in changed)
    assert bool(changed & set(in_tower)) == (vision_tower == "trained")


def test_lora_adapts_the_language_model_unless_the_vision_tower_trains(tiny_vlm_path):
    model = load_model(TrainerModelConfig(name=tiny_vlm_path, experimental={"lora": {}}), torch.device("cpu"))
    adapted = {name.split(".lora_")[0] for name, p in model.named_parameters() if p.requires_grad}
    layers = model.get_base_model().config.text_config.num_hidden_layers
    assert adapted == {f"base_model.model.model.language_model.layers.{i}.self_attn.{proj}" for i in range(layers)
                       for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}  # fmt: skip
    # a target only the vision tower has names nothing while it is frozen, and adapts it when it trains
    lora = {"target_modules": ["q_proj", "qkv"]}
    with pytest.raises(TridentError, match="no linear layer 'qkv' in the qwen3_vl model"):
        load_model(TrainerModelConfig(name=tiny_vlm_path, experimental={"lora": lora}), torch.device("cpu"))
    config = TrainerModelConfig(name=tiny_vlm_path, vision_tower="trained", experimental={"lora": lora})
    model = load_model(config, torch.device("cpu"))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any(".visual.blocks.0.attn.qkv.lora_A" in name for name in trainable)
    assert all("lora_" in name for name in trainable)  # under LoRA the tower's own weights stay frozen


def test_the_vision_tower_setting_on_a_text_model_is_refused(tiny_model_path):
    with pytest.raises(TridentError, match="model.vision_tower = 'trained': .* has no vision tower"):
        load_model(TrainerModelConfig(name=tiny_model_path, vision_tower="trained"), torch.device("cpu"))


@pytest.mark.parametrize("export", ["merged", "adapter"])
def test_exported_weights_and_adapters_carry_the_names_vllm_loads(tiny_vlm_path, tmp_path, export):
    """What weights/step_N holds maps, by vLLM's own Qwen3-VL name mapper, onto its vision tower and language model
    (full weights: every weight; an adapter: the language model's attention, by the module names vLLM adapts), and
    the folder loads as the model with its processor."""
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration

    mapper = Qwen3VLForConditionalGeneration.hf_to_vllm_mapper
    lora = {"lora": {"export": export}}
    model = load_model(TrainerModelConfig(name=tiny_vlm_path, experimental=lora), torch.device("cpu"))
    save_weights(model, AutoTokenizer.from_pretrained(tiny_vlm_path), tmp_path / "step_1", export)
    folder = tmp_path / "step_1"
    if export == "adapter":
        with safe_open(folder / "adapter_model.safetensors", "pt") as weights:
            modules = {parse_fine_tuned_lora_name(name, mapper)[0] for name in weights.keys()}  # noqa: SIM118
        assert {module.split(".self_attn.")[0] for module in modules} == {"language_model.model.layers.0",
                                                                          "language_model.model.layers.1"}  # fmt: skip
        assert json.loads((folder / "adapter_config.json").read_text())["exclude_modules"] == r"model\.visual\..*"
        return
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
    mapped = [mapper._map_name(name) for name in names]
    assert {name.split(".")[0] for name in mapped} == {"visual", "language_model"}
    assert mapped == [name for name in mapped if name.startswith(("visual.", "language_model.model."))]
    plain = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32)
    assert set(names) == set(plain.state_dict()) - {"lm_head.weight"}  # tied to the embeddings
    assert type(AutoProcessor.from_pretrained(folder)).__name__ == "Qwen3VLProcessor"


def test_the_trainer_trains_on_batches_with_images_and_keeps_the_vision_tower(tiny_vlm_path, tmp_path):
    """Two steps of the training loop (with a KL penalty: its reference scores the images too) on batch files of
    image samples sampled on policy, the placeholders out of the loss: no mismatch at the first step, and the weights
    change but the vision tower's."""
    _, micro_batch = image_samples(tiny_vlm_path, tmp_path)
    image_token = AutoTokenizer.from_pretrained(tiny_vlm_path).convert_tokens_to_ids("<|image_pad|>")
    micro_batch.loss_mask = micro_batch.input_ids != image_token
    micro_batch.advantages = torch.linspace(-1, 1, len(micro_batch.input_ids))
    with torch.no_grad():  # sampled on policy
        policy = load_model(TrainerModelConfig(name=tiny_vlm_path), torch.device("cpu"))
        micro_batch.inference_logprobs = packed_logprobs(policy, micro_batch, 1.0, output_dir=tmp_path)
    tokens, loss_tokens = len(micro_batch.input_ids), int(micro_batch.loss_mask.sum())
    for step in (1, 2):
        write_batch(tmp_path, BatchInfo(step, len(SIZES), tokens, loss_tokens, 0.0, 1.0), [micro_batch])
    train(TrainerConfig(output_dir=tmp_path, model={"name": tiny_vlm_path}, max_steps=2, optim={"lr": 1e-2},
                        loss={"kl_coef": 0.1}))  # fmt: skip
    first = json.loads((tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()[0])
    assert first["mismatch_kl"] < 1e-9  # the batch files' images give the trainer the logprobs it sampled with
    base = load_file(f"{tiny_vlm_path}/model.safetensors")
    trained = load_file(weights_dir(tmp_path, 2) / "model.safetensors")
    changed = {name for name in trained if not torch.equal(trained[name], base[name])}
    assert changed and all(name.startswith("model.language_model.") for name in changed)
