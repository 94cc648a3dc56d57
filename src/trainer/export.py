"""Writing the policy's weights for inference: gathered from the ranks in the export dtype, a LoRA adapter alone
or merged in, with the probe that lets the server prove it loaded them."""

import base64
import io
import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from jaxtyping import Float
from PIL import Image, ImageDraw
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from contracts.atomic_io import atomic_dir
from contracts.run_dir import PROBE_TEXT, Probe, mark_stable, step_of, write_probe
from trainer.config import LoraExport
from trainer.model import compute_device
from trainer.peft_model import is_peft
from trainer.transports.base import ExportedWeights, WeightSender
from trainer.transports.files import FileSender
from trainer.vision import is_vision_language, model_processor, save_processor, unwrapped

if TYPE_CHECKING:  # peft: imported only by a run with a LoRA adapter (trainer.peft_model)
    from peft import PeftModel


def gather_weights(model: nn.Module, dtype: torch.dtype | None = None, trainable_only: bool = False) -> dict:
    """The unsharded weights on CPU, on rank 0 (other ranks get ``{}``); every rank must call it.

    Gathered one tensor at a time, each cast to ``dtype`` first (None: as held), so the all-gather moves and rank 0
    keeps the exported size, never the float32 master weights in full. With ``trainable_only`` only the
    parameters that train are gathered (a LoRA adapter and its modules to save): the frozen base never moves.
    """
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    main = not dist.is_initialized() or dist.get_rank() == 0
    weights = {}
    for name, tensor in model.state_dict().items():
        if trainable_only and name not in trainable:
            continue
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if main:
            weights[name] = tensor.to("cpu", copy=True)
    return weights


def untied(state: dict[str, Tensor], model: PreTrainedModel) -> dict[str, Tensor]:
    """``state`` without the weights the model ties to another one (e.g. ``lm_head`` to the embeddings).

    Gathered from shards, tied weights are separate tensors that ``save_pretrained`` would write twice.
    """
    return {name: tensor for name, tensor in state.items() if name not in model.all_tied_weights_keys}


class ExpertAdapter(NamedTuple):
    """Where the LoRA adapter of a fused expert weight (peft's ``target_parameters``) lives, and its layout."""

    prefix: str  # the peft wrapper's name: its ``lora_A`` and ``lora_B`` are under it
    out_first: bool  # the weight is [experts, fan_out, fan_in] (else [experts, fan_in, fan_out])


def expert_adapters(model: "PeftModel") -> dict[str, ExpertAdapter]:
    """The adapter of each fused expert weight peft adapts in ``model``, by the weight's name in its state dict.

    peft nests one wrapper per adapted weight of a module (``experts`` adapts ``down_proj``, ``experts.base_layer``
    ``gate_up_proj``, the weights under ``experts.base_layer.base_layer``): which adapts which is the module's, not
    the names', to say."""
    from peft.tuners.lora.layer import ParamWrapper

    adapters = {}
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            inner, path = module.get_base_layer(), name + ".base_layer" * _depth(module)
            out_first = not getattr(inner, "is_transposed", False)  # as peft lays out the adapter
            adapters[f"{path}.{module.parameter_name}"] = ExpertAdapter(name, out_first)
    return adapters


def _depth(module: nn.Module) -> int:
    """How many peft parameter wrappers ``module`` nests, itself included."""
    from peft.tuners.lora.layer import ParamWrapper

    return 1 + _depth(module.base_layer) if isinstance(module, ParamWrapper) else 0


def expert_delta(
    lora_a: Float[Tensor, "experts_rank fan_in"], lora_b: Float[Tensor, "fan_out experts_rank"], experts: int
) -> Float[Tensor, "experts fan_out fan_in"]:
    """Each expert's ``B_e @ A_e`` of a peft adapter on a fused expert weight.

    peft lays the experts' factors out as ``A_e = lora_a[e·r:(e+1)·r]`` and ``B_e = lora_b[:, e::experts]``; the
    naive form: ``torch.stack([lora_b[:, e::experts] @ lora_a[e*r:(e+1)*r] for e in range(experts)])``.
    """
    a = lora_a.reshape(experts, -1, lora_a.shape[-1])
    b = lora_b.reshape(lora_b.shape[0], -1, experts)
    return torch.einsum("ore,eri->eoi", b, a)


def merge_lora(
    state: dict[str, Tensor], scaling: float, experts: dict[str, ExpertAdapter] | None = None
) -> dict[str, Tensor]:
    """The base model's weights with the adapter merged in, under the base model's own names.

    ``state`` is a peft model's state dict: each adapted layer keeps its weight ``W`` under ``base_layer`` next
    to ``lora_A`` (A) and ``lora_B`` (B), and becomes ``W + scaling · B @ A``; each fused expert weight of
    ``experts`` (:func:`expert_adapters`) gets its experts' ``scaling · B_e @ A_e`` (:func:`expert_delta`); a module
    to save replaces its ``original_module`` by its trained copy.
    """
    merged = {}
    for name, tensor in state.items():
        if "lora_" in name or ".original_module." in name:
            continue
        if ".base_layer." in name and name.endswith(".weight"):
            layer = name.removesuffix(".base_layer.weight")
            lora_a, lora_b = state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]
            tensor = tensor.float() + scaling * (lora_b.float() @ lora_a.float())
        elif (expert := (experts or {}).get(name)) is not None:
            lora_a, lora_b = (
                state[f"{expert.prefix}.lora_A.default.weight"],
                state[f"{expert.prefix}.lora_B.default.weight"],
            )
            delta = expert_delta(lora_a.float(), lora_b.float(), len(tensor))
            tensor = tensor.float() + scaling * (delta if expert.out_first else delta.transpose(1, 2))
        name = re.sub(r"(\.base_layer)+\.", ".", name.removeprefix("base_model.model."))
        merged[name.replace(".modules_to_save.default.", ".")] = tensor
    return merged


def probe_logprobs(model: "PreTrainedModel | PeftModel", token_ids: list[int], **images: Tensor) -> list[float]:
    """Logprob of each token given the ones before it (temperature 1; 0.0 at position 0), in eval mode; a
    vision-language model sees ``images`` too (its processor's other outputs: ``pixel_values``, ``image_grid_thw``,
    ``mm_token_type_ids``)."""
    return _logprobs_computed(model, token_ids, **images)[0]


def _logprobs_computed(
    model: "PreTrainedModel | PeftModel", token_ids: list[int], **images: Tensor
) -> tuple[list[float], torch.dtype]:
    """:func:`probe_logprobs`, and the dtype the model computed its logits in."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        device = compute_device(model)
        ids = torch.tensor(token_ids, device=device)
        images = {name: tensor.to(device) for name, tensor in images.items()}
        logits = model(input_ids=ids[None], **images).logits[0, :-1]
        logprobs = torch.log_softmax(logits.float(), -1)
    model.train(was_training)
    return [0.0, *logprobs.gather(1, ids[1:, None])[:, 0].tolist()], logits.dtype


def probe_image() -> bytes:
    """The image a vision-language model's probe shows: a PNG of a red disc and a blue square on white, 64 x 64."""
    image = Image.new("RGB", (64, 64), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((8, 8, 36, 36), fill="red")
    draw.rectangle((30, 28, 58, 58), fill="blue")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_probe(
    model: "PreTrainedModel | PeftModel", tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype = torch.float32
) -> Probe:
    """The probe under ``model``'s weights, exported in ``dtype``: its logprobs of
    :data:`~contracts.run_dir.PROBE_TEXT`; a vision-language model's (Qwen-VL layout) shown :func:`probe_image`
    first, through its own processor, so that a server still serving other vision weights fails the probe too. Its
    ``dtype`` (which sets its default tolerance) is float32 only if the model computed it and the server computes in
    float32."""
    base = unwrapped(model)
    if not is_vision_language(base.config):
        token_ids = tokenizer.encode(PROBE_TEXT)
        logprobs, computed = _logprobs_computed(model, token_ids)
        return Probe(token_ids, logprobs, is_4bit(model), dtype=_probe_dtype(computed, dtype))
    processor = model_processor(base.name_or_path)
    text = f"{processor.vision_start_token}{processor.image_token}{processor.vision_end_token}{PROBE_TEXT}"
    png = probe_image()
    inputs = processor(images=[Image.open(io.BytesIO(png)).convert("RGB")], text=[text], return_tensors="pt")
    token_ids = inputs["input_ids"][0].tolist()
    images = {name: tensor for name, tensor in inputs.items() if name not in ("input_ids", "attention_mask")}
    logprobs, computed = _logprobs_computed(model, token_ids, **images)
    image = f"data:image/png;base64,{base64.b64encode(png).decode('ascii')}"
    return Probe(
        token_ids, logprobs, is_4bit(model), image, processor.tokenizer.encode(text), _probe_dtype(computed, dtype)
    )


def _probe_dtype(computed: torch.dtype, exported: torch.dtype) -> str:
    """The less precise of the trainer's and the server's dtype, by name."""
    return str(exported if computed == torch.float32 else computed).removeprefix("torch.")


def is_4bit(model: "PreTrainedModel | PeftModel") -> bool:
    """Whether the model's base was quantized to 4 bits as it loaded (QLoRA)."""
    quantization = getattr(model.config, "quantization_config", None)
    return quantization is not None and quantization.load_in_4bit


def save_weights(
    model: "PreTrainedModel | PeftModel",
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
    export: LoraExport = "merged",
    sender: WeightSender | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write weights for inference to ``folder`` atomically, ``STABLE`` last; every rank calls it, rank 0 writes.

    Full training exports HF-format weights in ``dtype`` (the compute dtype: what the server runs). A LoRA model
    exports its adapter merged into the base weights (``export = "merged"``: full weights any server can load) or
    the adapter alone (``"adapter"``: peft's format, for a server that swaps adapters; only the adapter is
    gathered). ``sender`` (rank 0's end of a weight transport, ``trainer.transports``; None: files) hands them over
    and writes into the folder what the server loads them from: the weight files, or the manifest of weights sent
    from memory (in the background, after the previous weights were received; a shared buffer holds them before the
    folder is stable). The probe's logprobs under these weights go with them, so that whoever loads them can check
    it serves exactly these weights.
    """
    adapter = is_peft(model) and export == "adapter"
    owner, weights = (model, gather_weights(model, trainable_only=True)) if adapter else full_weights(model, dtype)
    probe = make_probe(model, tokenizer, dtype)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    sender = FileSender() if sender is None else sender
    exported = ExportedWeights(weights, owner, None if adapter else dtype, step_of(folder) or 0)
    sender.send(exported)  # memory: once the previous were taken
    with atomic_dir(folder) as tmp:
        sender.write(tmp)
        tokenizer.save_pretrained(tmp)
        save_processor(model, tmp)
        write_probe(tmp, probe)
        mark_stable(tmp)


def full_weights(model: "PreTrainedModel | PeftModel", dtype: torch.dtype) -> tuple[PreTrainedModel, dict]:
    """The model's full weights for inference in ``dtype``, under the base model's names (a LoRA adapter merged
    in, in float32, tied copies left out), and the model that saves them; every rank must call it."""
    if is_peft(model):
        lora, base = model.peft_config["default"], model.get_base_model()
        merged = merge_lora(gather_weights(model), lora.lora_alpha / lora.r, expert_adapters(model))
        return base, {name: tensor.to(dtype) for name, tensor in untied(merged, base).items()}
    return model, untied(gather_weights(model, dtype), model)
