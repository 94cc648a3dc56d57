"""Attention for packed micro-batches: each sample of the row attends causally to itself alone.

A packed micro-batch is one row of several samples. The model runs with :data:`PACKED_ATTENTION`, registered
with transformers' attention interface; transformers builds no mask for an attention implementation it has no
mask function for, and hands the ``packing`` keyword of the model's forward to every attention call. That
keyword is a :class:`Packing`, built once per micro-batch by :func:`packing` and shared by all layers:

- on GPU (``flex``) a FlexAttention ``BlockMask`` for the document-causal mask (``causal & same_sample``): one
  compiled flex kernel call per layer, which skips the blocks across samples (about ``Σ len(sample)²`` pairs);
- on CPU (``per_sample``) the sample bounds: causal SDPA once per sample, no mask tensor. FlexAttention has no
  backward on CPU, and one SDPA call with a ``[tokens × tokens]`` block-causal mask was 3-4× slower than the
  per-sample calls on 1,000-token rows of 4-7 samples (it computes every pair of the row, and the mask keeps
  SDPA off its causal kernel); only rows of dozens of very short samples favour one call.

Without ``packing`` (a plain, unpacked forward) it is causal SDPA over the whole row.
"""

from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
from jaxtyping import Int
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trainer.loss import sample_segments

PACKED_ATTENTION = "trident_packed"

Kernel = Literal["flex", "per_sample"]


@dataclass(frozen=True)
class Packing:
    """Where the samples of a packed row are: as the samples' start offsets and the row's length (``0, len_0,
    len_0 + len_1, ..., tokens``), and for FlexAttention as a ``BlockMask`` (None: SDPA per sample)."""

    mask: BlockMask | None
    sample_bounds: tuple[int, ...]


def document_causal(document: Int[Tensor, " tokens"]):
    """FlexAttention's ``mask_mod`` of a packed row: same sample, key not after query. Naive equivalent: the
    ``[tokens × tokens]`` mask ``(document[:, None] == document[None, :]) & (key <= query)``."""

    def mask_mod(batch: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
        return (document[query] == document[key]) & (key <= query)

    return mask_mod


def document_block_mask(document: Int[Tensor, " tokens"], device: torch.device, block: int = 128) -> BlockMask:
    """The FlexAttention ``BlockMask`` of :func:`document_causal` for attention on ``device``, from the sample
    ids ``document`` on the host. Naive equivalent: ``create_block_mask(document_causal(document), None, None,
    tokens, tokens)``, which evaluates the mask at every query-key pair (``tokens²`` memory on the device).

    Here the blocks come from each ``block``-token block's first and last sample id (ids only grow along the
    row): a key block before a query block is in the mask when they share a sample, and full when both lie in
    one sample; diagonal blocks are partial. The host computes ``[blocks × blocks]`` flags and copies them
    without waiting; only partial blocks call the ``mask_mod``, which reads a device copy of ``document``.
    """
    tokens = len(document)
    starts = torch.arange(0, tokens, block)
    first, last = document[starts], document[(starts + block).clamp(max=tokens) - 1]
    query, key = torch.arange(len(starts))[:, None], torch.arange(len(starts))[None, :]
    before = key < query
    shared = (key == query) | (before & (last[None, :] >= first[:, None]))
    one_sample = (first == last)[:, None] & (first == last)[None, :] & (first[:, None] == first[None, :])
    full = before & one_sample & (starts + block <= tokens)[:, None]  # a short last query block stays partial

    def ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:  # per query block: how many key blocks, which first
        counts, indices = blocks.sum(-1, dtype=torch.int32), torch.argsort((~blocks).int(), dim=-1, stable=True).int()
        return counts[None, None].to(device, non_blocking=True), indices[None, None].to(device, non_blocking=True)

    return BlockMask.from_kv_blocks(
        *ordered(shared & ~full),
        *ordered(full),
        BLOCK_SIZE=block,
        mask_mod=document_causal(document.to(device, non_blocking=True)),
        seq_lengths=(tokens, tokens),
    )


def packing(sample_lengths: Int[Tensor, " samples"], device: torch.device, kernel: Kernel | None = None) -> Packing:
    """The :class:`Packing` of a row of samples of ``sample_lengths`` (a CPU tensor) for attention on ``device``,
    built once per micro-batch: FlexAttention on CUDA, SDPA per sample elsewhere, unless ``kernel`` says which."""
    kernel = kernel or ("flex" if device.type == "cuda" else "per_sample")
    bounds = (0, *torch.cumsum(sample_lengths, 0).tolist())
    if kernel == "flex":
        return Packing(document_block_mask(sample_segments(sample_lengths), device), bounds)
    return Packing(None, bounds)


@cache
def compiled_flex_attention():
    """``flex_attention`` compiled (uncompiled it is a slow reference that builds the whole score matrix)."""
    return torch.compile(flex_attention, dynamic=None)


def packed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    packing: Packing | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention within each sample of a packed row: ``query`` is ``[1, heads, tokens, head_dim]`` (keys and
    values may have fewer heads), the result ``[1, tokens, heads, head_dim]`` as transformers expects. Naive
    equivalent: causal SDPA on each sample alone, concatenated (what it does without a ``BlockMask``)."""
    if attention_mask is not None:
        raise ValueError(f"{PACKED_ATTENTION} attends within packed samples and takes no attention mask")
    if packing is None:
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)
    if isinstance(packing.mask, BlockMask):
        attend = compiled_flex_attention() if query.device.type == "cuda" else flex_attention
        output = attend(
            query,
            key,
            value,
            block_mask=packing.mask,
            scale=kwargs.get("scaling"),
            enable_gqa=key.shape[1] != query.shape[1],
        )
        return output.transpose(1, 2).contiguous(), None
    bounds = packing.sample_bounds
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True, **kwargs
        )[0]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def use_packed_attention(model: PreTrainedModel) -> None:
    """Make ``model`` attend within packed samples (:func:`packed_attention`), in place."""
    model.set_attn_implementation(PACKED_ATTENTION)
