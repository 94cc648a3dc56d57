"""Context parallelism: each packed micro-batch's tokens split over the ``cp`` ranks of a group (Ulysses).

The ranks form a ``dp × cp`` device mesh: ``cp`` consecutive ranks (within a node first, as torchrun numbers them)
take one micro-batch together, each a contiguous :class:`Shard` of its row (padded to a multiple of ``cp`` by a
sample of padding). A rank runs embeddings, norms, MLPs and the scoring head on its shard alone; attention needs the
whole row, so around it an all-to-all trades tokens for heads: q, k and v go from ``[its tokens, all heads]`` to
``[all tokens, heads / cp]``, the packed attention runs on the whole row for those heads, and the result comes back
(:func:`attend_across_shards`). Both all-to-alls are autograd functions whose backward is the reverse all-to-all.

Each rank scores its shard's positions; :func:`scores_of_the_row` adds them up over the group, so every rank of the
group holds the whole row's scores and computes the same loss from them, exactly as one rank would (each position is
scored by one rank, the others add zeros). The backward of that sum is the identity: each rank's loss is the same
function of the same scores, so its gradient at its own positions is the whole loss's.

FSDP2 shards over all ranks and sums gradients over all of them, as without CP: a parameter's gradient is the sum of
each rank's tokens' parts, over the group and over the micro-batches of the step.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh

from contracts.errors import TridentError


def context_group(cp: int, device_type: str) -> dist.ProcessGroup:
    """This rank's group of ``cp`` consecutive ranks (all ranks as a ``dp × cp`` mesh); ``cp`` must divide them."""
    ranks = dist.get_world_size()
    if ranks % cp:
        raise TridentError(f"model.parallel.cp = {cp} must divide the trainer's {ranks} ranks")
    return init_device_mesh(device_type, (ranks // cp, cp), mesh_dim_names=("dp", "cp"))["cp"].get_group()


@dataclass(frozen=True)
class Shard:
    """A rank's share of a packed row of ``tokens`` tokens: positions ``start:stop`` of the row padded to ``padded``
    tokens (a multiple of the group's size)."""

    start: int
    stop: int
    padded: int


def shard_of(tokens: int, rank: int, size: int) -> Shard:
    """Rank ``rank``'s contiguous share of a row of ``tokens`` tokens split over ``size`` ranks."""
    per_rank = -(-tokens // size)
    return Shard(rank * per_rank, (rank + 1) * per_rank, per_rank * size)


def tokens_to_heads(x: Float[Tensor, "1 heads shard dim"], group: dist.ProcessGroup) -> Tensor:
    """``[1, heads, shard, dim]`` of this rank's tokens → ``[1, heads / cp, cp · shard, dim]``: every token of the
    row for this rank's share of the heads (the ``r``-th ``heads / cp`` heads on rank ``r``)."""
    cp = dist.get_world_size(group)
    _, heads, shard, dim = x.shape
    sent = x[0].reshape(cp, heads // cp, shard, dim).contiguous()  # the r-th group of heads goes to rank r
    received = all_to_all_single_autograd(sent.flatten(), None, None, group).view(cp, heads // cp, shard, dim)
    return received.transpose(0, 1).reshape(1, heads // cp, cp * shard, dim)  # rank r's tokens r-th


def heads_to_tokens(x: Float[Tensor, "1 tokens heads dim"], group: dist.ProcessGroup) -> Tensor:
    """The inverse of :func:`tokens_to_heads` on attention's output layout: ``[1, cp · shard, heads / cp, dim]`` →
    ``[1, shard, heads, dim]``, this rank's tokens with every head."""
    cp = dist.get_world_size(group)
    _, tokens, heads, dim = x.shape
    sent = x[0].reshape(cp, tokens // cp, heads, dim).contiguous()  # the r-th shard of tokens goes back to rank r
    received = all_to_all_single_autograd(sent.flatten(), None, None, group).view(cp, tokens // cp, heads, dim)
    return received.permute(1, 0, 2, 3).reshape(1, tokens // cp, cp * heads, dim)  # head groups in rank order


def divisible_kv(key: Tensor, cp: int) -> Tensor:
    """``key`` (or value) ``[1, kv_heads, tokens, dim]`` with each head repeated so that ``cp`` divides their number
    (``lcm(kv_heads, cp)`` heads, in order): each query head still meets its own key and value head after the split,
    since ``cp`` divides the query heads."""
    kv_heads = key.shape[1]
    repeats = math.lcm(kv_heads, cp) // kv_heads
    return key if repeats == 1 else key.repeat_interleave(repeats, dim=1)


def attend_across_shards(attend, query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Ulysses attention: ``attend(query, key, value)`` (``[1, heads, tokens, dim]`` in, ``[1, tokens, heads, dim]``
    out) on the whole row for this rank's share of the heads, given this rank's shard of each; returns this shard's
    output with every head. Naive equivalent: ``attend`` on the gathered row, this shard's rows of its result."""
    cp = dist.get_world_size(group)
    key, value = divisible_kv(key, cp), divisible_kv(value, cp)
    output = attend(*(tokens_to_heads(x, group) for x in (query, key, value)))
    return heads_to_tokens(output, group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) in the forward pass; the identity in the backward pass (see :func:`scores_of_the_row`)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def scores_of_the_row(scores: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The whole row's scores on every rank of ``group``, from each rank's: its own positions set, zeros elsewhere.

    Every rank then computes the same loss of the same scores, so the gradient each rank's own positions get from
    its loss is the whole loss's gradient there: the backward pass of the sum is the identity (no communication),
    and each position's gradient reaches the model once, on the rank that scored it."""
    return _SumOverGroup.apply(scores, group)
