"""Attention for packed micro-batches: each sample of the row attends causally to itself alone.

A packed micro-batch is one row of several samples. The model runs with :data:`PACKED_ATTENTION`, registered
with transformers' attention interface; transformers builds no mask for an attention implementation it has no
mask function for, and hands the ``packing`` keyword of the model's forward to every attention call. That
keyword is a :class:`Packing`, built once per micro-batch by :func:`packing` and shared by all layers:

- on a GPU in bf16 or fp16, the samples' cumulative lengths on the device: one varlen flash-attention call per
  layer (``torch.nn.attention.varlen``) covers every sample of the row, each causal within itself, so the work is
  ``Σ len(sample)²`` query-key pairs whatever the packing (64 samples of 128 tokens cost what they need);
- elsewhere (the CPU, a GPU in fp32) the sample bounds: causal SDPA once per sample, no mask tensor. One SDPA
  call with a ``[tokens × tokens]`` block-causal mask was 3-4× slower on the CPU (it computes every pair of the
  row, and the mask keeps SDPA off its causal kernel), and FlexAttention has no backward on the CPU;
- with samples whose shared beginning is computed once (:mod:`trainer.shared_prefix`), segments: a segment that
  continues another attends to that one's keys and causally to its own.

Without ``packing`` (a plain, unpacked forward) it is causal SDPA over the whole row.
"""

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trainer.context_parallel import attend_across_shards
from trainer.vision import is_vision_language

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10: per-sample SDPA everywhere
    varlen_attn = None

PACKED_ATTENTION = "trident_packed"
VARLEN_DTYPES = (torch.bfloat16, torch.float16)  # what flash attention computes in
VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}


@dataclass(frozen=True)
class Packing:
    """Where the samples of a packed row are: their start offsets and the row's length (``0, len_0, len_0 + len_1,
    ..., tokens``) on the host, and for varlen attention the same as int32 on the device (None: SDPA per sample)
    with the longest sample's length. Under context parallelism, ``group`` is the ranks the row's tokens are split
    over (each holds a contiguous shard; the bounds are the whole row's). ``prefixes`` (None: every segment is a
    sample) gives, per segment, the earlier segment it continues, or None where it starts a sample."""

    sample_bounds: tuple[int, ...]
    cumulative: Int[Tensor, " samples_plus_one"] | None = None
    longest: int = 0
    group: dist.ProcessGroup | None = None
    prefixes: tuple[int | None, ...] | None = None


def packing(
    sample_lengths: Int[Tensor, " samples"],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    prefixes: tuple[int | None, ...] | None = None,
) -> Packing:
    """The :class:`Packing` of a row of samples (segments, with ``prefixes``) of ``sample_lengths`` (a CPU tensor)
    for attention on ``device``, its tokens split over ``group`` (None: all on this rank), built once per
    micro-batch; the device copy is made without waiting. Segments continuing others attend by SDPA per segment."""
    bounds = (0, *torch.cumsum(sample_lengths, 0).tolist())
    if device.type != "cuda" or varlen_attn is None or prefixes is not None:
        return Packing(bounds, group=group, prefixes=prefixes)
    cumulative = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)
    return Packing(bounds, cumulative, int(sample_lengths.max()), group)


def uses_varlen(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed attention on ``device`` in ``dtype`` is one varlen call per layer (else SDPA per sample)."""
    return device.type == "cuda" and varlen_attn is not None and dtype in VARLEN_DTYPES


def varlen_causal(query: Tensor, key: Tensor, value: Tensor, packing: Packing, scale: float | None) -> Tensor:
    """Causal attention within each sample of a packed row in one flash-attention call: ``query`` is ``[tokens,
    heads, head_dim]``, ``key`` and ``value`` may have fewer heads (GQA). What torch's signature lacks is done
    around it: without ``enable_gqa`` (torch 2.11) the key and value heads are repeated, without ``scale`` it is
    folded into the query, without ``window_size`` (torch 2.10) causality is a flag."""
    options = {}
    if key.shape[1] != query.shape[1] and "enable_gqa" in VARLEN_PARAMETERS:
        options["enable_gqa"] = True
    elif key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if "scale" in VARLEN_PARAMETERS:
        options["scale"] = scale
    elif scale is not None:
        query = query * (scale * query.shape[-1] ** 0.5)  # the kernel's own scale is 1 / sqrt(head_dim)
    if "window_size" in VARLEN_PARAMETERS:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    lengths = (packing.cumulative, packing.cumulative, packing.longest, packing.longest)
    return varlen_attn(query, key, value, *lengths, **options)


def per_sample_causal(
    query: Tensor, key: Tensor, value: Tensor, packing: Packing, scaling: float | None = None, dropout: float = 0.0
) -> Tensor:
    """Causal SDPA on each sample of the row alone, concatenated: ``[1, tokens, heads, head_dim]``; a segment that
    continues another (``packing.prefixes``) attends to all of that one's keys before its own. Keys and values may
    have fewer heads than the query (any number dividing them: grouped-query attention)."""
    bounds, gqa = packing.sample_bounds, key.shape[1] != query.shape[1]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    # split, not a slice per sample: its backward is one concatenation, where each slice's fills a zero tensor of
    # the whole row
    pieces = list(zip(*(tensor.split(lengths, dim=2) for tensor in (query, key, value)), strict=True))
    prefixes = packing.prefixes or (None,) * len(pieces)
    outputs = []
    for (q, k, v), prefix in zip(pieces, prefixes, strict=True):
        mask = None
        if prefix is not None:  # the prefix's keys, then its own causally: the causal mask aligned bottom right
            k, v = torch.cat([pieces[prefix][1], k], 2), torch.cat([pieces[prefix][2], v], 2)
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        outputs.append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        ))  # fmt: skip
    return torch.cat(outputs, dim=2).transpose(1, 2)


def attend_packed(query: Tensor, key: Tensor, value: Tensor, packing: Packing, **kwargs) -> Tensor:
    """Causal attention within each sample of the row on this rank, ``[1, heads, tokens, head_dim]`` in,
    ``[1, tokens, heads, head_dim]`` out: one varlen call, or SDPA per sample (see the module's docstring)."""
    if packing.cumulative is None or query.dtype not in VARLEN_DTYPES:
        return per_sample_causal(query, key, value, packing, kwargs.get("scaling"), kwargs.get("dropout", 0.0))
    rows = [tensor[0].transpose(0, 1).contiguous() for tensor in (query, key, value)]  # [tokens, heads, head_dim]
    return varlen_causal(*rows, packing, kwargs.get("scaling"))[None]


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
    equivalent: causal SDPA on each sample alone, concatenated. Under context parallelism (``packing.group``) the
    tokens are this rank's shard of the row, and the heads are traded for the whole row around it
    (:func:`~trainer.context_parallel.attend_across_shards`)."""
    if attention_mask is not None:
        raise ValueError(f"{PACKED_ATTENTION} attends within packed samples and takes no attention mask")
    if packing is None:
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)
    attend = functools.partial(attend_packed, packing=packing, **kwargs)
    if packing.group is None:
        return attend(query, key, value), None
    return attend_across_shards(attend, query, key, value, packing.group), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def use_packed_attention(model: PreTrainedModel) -> None:
    """Make ``model`` attend within packed samples (:func:`packed_attention`), in place; a vision-language model's
    vision tower keeps SDPA (it attends within each image, both ways; it is handed ``packing`` and ignores it)."""
    if not is_vision_language(model.config):
        model.set_attn_implementation(PACKED_ATTENTION)
    else:
        model.set_attn_implementation({"": PACKED_ATTENTION, "text_config": PACKED_ATTENTION, "vision_config": "sdpa"})
