"""A vision-language policy (Qwen3-VL) in the trainer: its vision tower, frozen or trained, and the inputs a packed
micro-batch with images adds to the forward pass.

A vision-language model is one whose config has a ``vision_config``; its vision tower is the submodel transformers
builds from that config (Qwen3-VL's ``model.visual``: the patch embedding, the vision blocks, the patch merger and
the DeepStack mergers). The samples' token ids already hold each image's run of ``<|image_pad|>`` placeholders, as
the server expanded them; the trainer derives the rest from the images (``MicroBatch.images``, in the run's image
store) and the model folder's image processor, as the server did: the pixel values and grids of every image of the
row in order of appearance, and each sample's 3-D M-RoPE positions (the model's ``get_rope_index`` on the sample
alone), concatenated. A micro-batch without images takes the text path unchanged.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformers import AutoImageProcessor, AutoProcessor, PretrainedConfig, PreTrainedModel

from contracts.errors import TridentError
from contracts.images import load_image, placeholder_runs
from contracts.protocol import BatchError, MicroBatch
from trainer.config import VisionTower
from trainer.peft_model import is_peft


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether a model's config is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def unwrapped(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if is_peft(model) else model


def vision_tower_name(model: nn.Module) -> str | None:
    """The qualified name, in ``model``, of its vision tower: the submodel built from its config's ``vision_config``
    (None: a text model)."""
    config = getattr(unwrapped(model).config, "vision_config", None)
    if config is None:
        return None
    return next(name for name, module in model.named_modules() if isinstance(module, PreTrainedModel)
                and module.config is config)  # fmt: skip


def configure_vision_tower(model: PreTrainedModel, setting: VisionTower, model_name: str) -> None:
    """Freeze the vision tower unless ``setting`` trains it, in place; ``trained`` on a text model is a TridentError."""
    name = vision_tower_name(model)
    if name is None:
        if setting == "trained":
            raise TridentError(f"model.vision_tower = 'trained': {model_name} has no vision tower (a text model)")
        return
    model.get_submodule(name).requires_grad_(setting == "trained")


@functools.cache
def image_processor(model_path: str):
    """The image processor of the model folder (what the server's processor runs on each image)."""
    return AutoImageProcessor.from_pretrained(model_path)


@functools.cache
def model_processor(model_path: str):
    """The processor of the model folder (its image processor, tokenizer and chat template)."""
    return AutoProcessor.from_pretrained(model_path)


def save_processor(model: nn.Module, folder: Path) -> None:
    """Write a vision-language model's processor (image processor, tokenizer, chat template) to ``folder`` as its model
    folder holds it, so that the folder loads as a model; nothing for a text model."""
    base = unwrapped(model)
    if is_vision_language(base.config):
        model_processor(base.name_or_path).save_pretrained(folder)


@dataclass(frozen=True)
class ImageInputs:
    """What a packed row with images adds to the forward pass: every image's patches and grid, in order of
    appearance in the row, and the positions (text positions in row 0, then M-RoPE's temporal, height, width)."""

    pixel_values: Float[Tensor, "patches features"]
    image_grid_thw: Int[Tensor, "images 3"]
    position_ids: Int[Tensor, "4 1 seq"]


def image_inputs(model: nn.Module, micro_batch: MicroBatch, output_dir: Path | None) -> ImageInputs | None:
    """The image inputs of ``micro_batch`` for ``model`` (None: it has no images), its images read from the image
    store of the run in ``output_dir``.

    Each sample's runs of image placeholders must be as long as its images' grids say (``image_grid_thw.prod() //
    spatial_merge_size**2`` tokens each, in order): else a BatchError names the sample and both counts. Its M-RoPE
    positions are the model's ``get_rope_index`` of the sample alone (Qwen3-VL's, on its inner ``model``).
    """
    if not any(micro_batch.images or []):
        return None
    base = unwrapped(model)
    config = base.config
    if not is_vision_language(config):
        raise BatchError(f"a micro-batch holds images, and {base.name_or_path} is a text model (no vision tower)")
    if output_dir is None:
        raise ValueError("a micro-batch with images is scored with the output_dir of the run that stored them")
    images = [load_image(output_dir, ref) for refs in micro_batch.images for ref in refs]
    pixels = image_processor(base.name_or_path)(images=images, return_tensors="pt")
    merge, grids = config.vision_config.spatial_merge_size, pixels["image_grid_thw"]
    samples = zip(
        micro_batch.input_ids.split(micro_batch.sample_lengths.tolist()),
        grids.split([len(refs) for refs in micro_batch.images]),
        micro_batch.images,
        strict=True,
    )
    positions = []
    for index, (input_ids, sample_grids, refs) in enumerate(samples):
        runs = [length for _, length in placeholder_runs(input_ids.tolist(), config.image_token_id)]
        tokens = (sample_grids.prod(-1) // merge**2).tolist()
        if runs != tokens:
            raise BatchError(
                f"micro-batch sample {index}: its image placeholder runs are {runs} tokens long, its {len(refs)} "
                f"images ({', '.join(ref[:12] for ref in refs)}) make {tokens} (image_grid_thw.prod() // {merge}**2 "
                "each)"
            )
        rope, _ = base.model.get_rope_index(
            input_ids[None],
            mm_token_type_ids=(input_ids == config.image_token_id).int()[None],
            image_grid_thw=sample_grids if refs else None,
        )
        positions.append(rope)
    position_ids = torch.cat([micro_batch.position_ids[None, None], torch.cat(positions, -1)])
    return ImageInputs(pixels["pixel_values"], grids, position_ids)
