"""Attention for packed micro-batches: one kernel call per layer, each sample attending causally to itself alone.

A packed micro-batch is one row of several samples. The model runs with :data:`PACKED_ATTENTION`, registered
with transformers' attention interface; transformers builds no mask for an attention implementation it has no
mask function for, and hands the ``packing`` keyword of the model's forward to every attention call. That
keyword is a :class:`Packing`, built once per micro-batch by :func:`packing` and shared by all layers:

- on GPU a FlexAttention ``BlockMask`` for the document-causal mask (``causal & same_sample``): the compiled
  flex kernel skips the blocks that cross samples, so the work is about ``Σ len(sample)²`` query-key pairs;
- on CPU a ``[tokens, tokens]`` boolean block-causal mask for SDPA: one call per layer instead of one per
  sample is faster on the small rows the CPU trains on, and FlexAttention would have to compile first.

Without ``packing`` (a plain, unpacked forward) it is causal SDPA over the whole row.
"""

from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
from jaxtyping import Bool, Int
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trainer.loss import sample_segments

PACKED_ATTENTION = "trident_packed"

Kernel = Literal["sdpa", "flex"]


@dataclass(frozen=True)
class Packing:
    """Where the samples of a packed row are: in the form the attention kernel takes, a boolean ``[tokens, tokens]``
    mask (SDPA) or a ``BlockMask`` (FlexAttention), and as the samples' start offsets and the row's length
    (``0, len_0, len_0 + len_1, ..., tokens``)."""

    mask: Bool[Tensor, "tokens tokens"] | BlockMask
    sample_bounds: tuple[int, ...]


def block_causal_mask(document: Int[Tensor, " tokens"]) -> Bool[Tensor, "tokens tokens"]:
    """``mask[q, k]``: query ``q`` may attend to key ``k`` (same sample, not later). Naive equivalent:
    ``[[document[q] == document[k] and k <= q for k in range(L)] for q in range(L)]``."""
    position = torch.arange(len(document), device=document.device)
    return (document[:, None] == document[None, :]) & (position[None, :] <= position[:, None])


def document_causal(document: Int[Tensor, " tokens"]):
    """FlexAttention's ``mask_mod`` for :func:`block_causal_mask`: same sample, key not after query."""

    def mask_mod(batch: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
        return (document[query] == document[key]) & (key <= query)

    return mask_mod


def document_block_mask(document: Int[Tensor, " tokens"]) -> BlockMask:
    """The FlexAttention ``BlockMask`` of :func:`block_causal_mask`, built on ``document``'s device (no host
    synchronisation). Blocks wholly inside one sample's causal part are full, blocks across samples empty."""
    tokens = len(document)
    return create_block_mask(document_causal(document), None, None, tokens, tokens, device=document.device)


def packing(sample_lengths: Int[Tensor, " samples"], device: torch.device, kernel: Kernel | None = None) -> Packing:
    """The :class:`Packing` of a row of samples of ``sample_lengths`` (a CPU tensor) for attention on ``device``,
    built once per micro-batch: FlexAttention on CUDA and SDPA elsewhere, unless ``kernel`` says which."""
    kernel = kernel or ("flex" if device.type == "cuda" else "sdpa")
    bounds = (0, *torch.cumsum(sample_lengths, 0).tolist())
    document = sample_segments(sample_lengths).to(device, non_blocking=True)
    if kernel == "flex":
        return Packing(document_block_mask(document), bounds)
    return Packing(block_causal_mask(document), bounds)


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
    """Attention within each sample of a packed row, one kernel call: ``query`` is ``[1, heads, tokens,
    head_dim]`` (keys and values may have fewer heads), the result ``[1, tokens, heads, head_dim]`` as
    transformers expects. Naive equivalent: causal SDPA on each sample alone, concatenated."""
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
    return sdpa_attention_forward(module, query, key, value, packing.mask[None, None], is_causal=False, **kwargs)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def use_packed_attention(model: PreTrainedModel) -> None:
    """Make ``model`` attend within packed samples (:func:`packed_attention`), in place."""
    model.set_attn_implementation(PACKED_ATTENTION)
