"""Attention for packed micro-batches: each sample attends causally to itself alone, with no ``L × L`` mask.

A packed micro-batch is one row of several samples. A dense block-causal mask for it costs ``L²`` memory, keeps
SDPA off its fused kernels and evaluates every query-key pair of the row, most of which cross samples. Instead
the model runs with :data:`PACKED_ATTENTION`, registered with transformers' attention interface: it calls SDPA
once per sample with ``is_causal=True`` (no mask tensor at all, so SDPA may pick its flash or memory-efficient
kernels on GPU) and concatenates the results. The work is ``Σ len(sample)²`` query-key pairs, what the samples
need. The sample boundaries travel as the ``sample_bounds`` keyword of the model's forward, which transformers
hands to every attention call; transformers builds no mask for an attention implementation it has no mask
function for.
"""

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PACKED_ATTENTION = "trident_packed_sdpa"


def packed_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    sample_bounds: tuple[int, ...] | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Causal SDPA within each sample of a packed row: ``query`` is ``[1, heads, tokens, head_dim]`` (keys and
    values may have fewer heads), the result ``[1, tokens, heads, head_dim]`` as transformers expects.

    ``sample_bounds`` are the samples' start offsets and the row's length (``0, len_0, len_0 + len_1, ...``);
    without them (a plain, unpacked forward) this is causal SDPA over the whole row.
    Naive equivalent: SDPA with the mask ``causal & same_sample`` over the row.
    """
    if attention_mask is not None:
        raise ValueError(f"{PACKED_ATTENTION} attends within packed samples and takes no attention mask")
    bounds = sample_bounds or (0, query.shape[2])
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None, is_causal=True, **kwargs
        )[0]
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)


def use_packed_attention(model: PreTrainedModel) -> None:
    """Make ``model`` attend within packed samples (:func:`packed_sdpa`), in place."""
    model.set_attn_implementation(PACKED_ATTENTION)


def sample_bounds(sample_lengths: Tensor) -> tuple[int, ...]:
    """``(0, len_0, len_0 + len_1, ..., total)``: where each packed sample starts, and the row's end."""
    return (0, *torch.cumsum(sample_lengths, 0).tolist())
