"""A stand-in for varlen flash attention on the CPU (the kernel runs on CUDA only): what
``torch.nn.attention.varlen.varlen_attn`` documents, computed with plain SDPA, and the
:class:`~trainer.attention.Packing` the trainer makes for a CUDA device, made on the CPU. Used by
tests/unit/trainer/test_attention.py and by the context-parallel ranks (tests/context_parallel_ranks.py)."""

import torch

from trainer.attention import Packing


def documented_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                      enable_gqa=False, is_causal=False):  # fmt: skip
    """What varlen_attn computes, as torch documents it ([tokens, heads, head_dim] in and out), with plain SDPA."""
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    causal = is_causal or tuple(window_size) == (-1, 0)
    if key.shape[1] != query.shape[1]:
        assert enable_gqa, "fewer key/value heads need enable_gqa"
    bounds = cu_seq_q.tolist()
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[a:b].transpose(0, 1), key[a:b].transpose(0, 1), value[a:b].transpose(0, 1), is_causal=causal,
            scale=scale, enable_gqa=key.shape[1] != query.shape[1],
        ).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]  # fmt: skip
    return torch.cat(outputs)


def varlen_packing(sample_lengths: torch.Tensor, device: torch.device, group=None) -> Packing:
    """The Packing ``packing`` makes for a CUDA device, made on the CPU."""
    bounds = (0, *torch.cumsum(sample_lengths, 0).tolist())
    return Packing(bounds, torch.tensor(bounds, dtype=torch.int32), int(sample_lengths.max()), group)
