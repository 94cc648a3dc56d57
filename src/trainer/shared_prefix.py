"""Samples that begin alike computed once where they are alike: a GRPO group's prompt goes through the model once.

The samples of a group (``rollouts_per_example`` of them) repeat their prompt token for token. Packed as they are,
each copy goes through every layer, forward and backward: with a 49-token prompt and 121-token completions, a
quarter of the trainer's work. Here a micro-batch's samples with the same prompt, or else sharing their first
:data:`MIN_SHARED_TOKENS` tokens or more, form a :class:`PrefixGroup` (:func:`prefix_groups`); the row the model
computes (:class:`SharedLayout`) holds the group's shared tokens once, then each member's own tokens, which attend to
the shared ones and causally to themselves (:func:`trainer.attention.per_sample_causal`) at the positions they have
in their sample. Each scored position reads the hidden state its sample would have had: the same logprobs and
gradients as the samples computed apart, up to float rounding (a shared token's gradient is the sum of its
members', as autograd adds them).

:func:`pack_groups` packs a step's samples so that a group lands in one micro-batch where it fits, counting the
tokens the model computes, not the row's.
"""

from collections import defaultdict
from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from contracts.protocol import MicroBatch, pack_lengths

MIN_SHARED_TOKENS = 16  # the shortest beginning worth a segment of its own


@dataclass(frozen=True)
class PrefixGroup:
    """Samples (their indices, in order; two or more) whose first ``length`` tokens are the same; each has at least
    one token past them."""

    members: tuple[int, ...]
    length: int


def prefix_groups(token_ids: list[Int[Tensor, " tokens"]], prompt_lengths: list[int]) -> list[PrefixGroup]:
    """The samples of ``token_ids`` grouped by what they begin with, each group with the longest beginning all its
    members share (short of each member's last token); a sample in no group is in none of them.

    Samples that begin with the same :data:`MIN_SHARED_TOKENS` tokens are alike; among them, those with the same
    prompt (their tokens before the first of ``prompt_lengths``' trained token: a GRPO group's) form a group, and
    the others, whose prompts differ past what they share (an instruction, a system prompt), one more."""
    alike: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for index, ids in enumerate(token_ids):
        if len(ids) > MIN_SHARED_TOKENS:
            alike[tuple(ids[:MIN_SHARED_TOKENS].tolist())].append(index)
    groups = []
    for members in alike.values():
        prompts: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for index in members:
            prompts[tuple(token_ids[index][: prompt_lengths[index]].tolist())].append(index)
        alone = [same[0] for same in prompts.values() if len(same) == 1]
        for same in [*prompts.values(), alone]:
            if len(same) > 1:
                groups.append(PrefixGroup(tuple(sorted(same)), shared_length([token_ids[i] for i in same])))
    return sorted(groups, key=lambda group: group.members)


def shared_length(token_ids: list[Int[Tensor, " tokens"]]) -> int:
    """How many first tokens all of ``token_ids`` share, short of the shortest one's last token."""
    length = min(len(ids) for ids in token_ids) - 1
    for ids in token_ids[1:]:
        differs = (ids[:length] != token_ids[0][:length]).nonzero()
        if len(differs):
            length = int(differs[0, 0])
    return length


def prompt_length(loss_mask: Tensor) -> int:
    """A sample's prompt: its tokens before the first trained one (all of them where none is trained)."""
    trained = loss_mask.nonzero()
    return int(trained[0, 0]) if len(trained) else len(loss_mask)


@dataclass(frozen=True)
class SharedLayout:
    """The row the model computes for a packed row whose samples share beginnings: ``order`` is the packed row's
    index of each computed token, ``where`` the computed index of each packed token (a shared token's, its group's
    one copy), ``bounds`` the computed row's segments (``0, len_0, len_0 + len_1, ..., tokens``) and ``prefixes``,
    per segment, the segment whose tokens it continues (None: it starts a sample)."""

    order: Int[Tensor, " computed"]
    where: Int[Tensor, " tokens"]
    bounds: tuple[int, ...]
    prefixes: tuple[int | None, ...]


def shared_layout(micro_batch: MicroBatch) -> SharedLayout | None:
    """The :class:`SharedLayout` of ``micro_batch``'s row, its groups' beginnings computed once (None: no two of its
    samples share :data:`MIN_SHARED_TOKENS` first tokens)."""
    lengths = micro_batch.sample_lengths.tolist()
    masks = micro_batch.loss_mask.split(lengths)
    groups = prefix_groups(list(micro_batch.input_ids.split(lengths)), [prompt_length(mask) for mask in masks])
    if not groups:
        return None
    starts = [0, *torch.cumsum(micro_batch.sample_lengths, 0).tolist()]
    group_of = {index: group for group in groups for index in group.members}
    where = torch.empty(starts[-1], dtype=torch.long)
    pieces: list[Tensor] = []
    bounds, prefixes = [0], []
    prefix_segment: dict[int, tuple[int, int]] = {}  # a group's first member -> (its segment, computed start)

    def add(first: int, stop: int, prefix: int | None) -> None:
        where[first:stop] = torch.arange(bounds[-1], bounds[-1] + stop - first)
        pieces.append(torch.arange(first, stop))
        bounds.append(bounds[-1] + stop - first)
        prefixes.append(prefix)

    for index, (start, stop) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        group = group_of.get(index)
        if group is None:
            add(start, stop, None)
            continue
        leader = group.members[0]
        if index == leader:
            prefix_segment[leader] = (len(prefixes), bounds[-1])
            add(start, start + group.length, None)
        segment, computed = prefix_segment[leader]
        where[start : start + group.length] = torch.arange(computed, computed + group.length)
        add(start + group.length, stop, segment)
    return SharedLayout(torch.cat(pieces), where, tuple(bounds), tuple(prefixes))


def computed_tokens(micro_batch: MicroBatch, share: bool) -> int:
    """The tokens the model computes for ``micro_batch``: with ``share``, each shared beginning once."""
    layout = shared_layout(micro_batch) if share else None
    return len(micro_batch.input_ids) if layout is None else len(layout.order)


def pack_groups(micro_batches: list[MicroBatch], capacity: int) -> list[MicroBatch] | None:
    """A step's samples packed anew (first fit, longest first) so that each :class:`PrefixGroup` of them shares a
    micro-batch, counting its shared tokens once against ``capacity``: a group that does not fit is split into
    parts that do. None where no two samples share a beginning."""
    samples = [sample for micro_batch in micro_batches for sample in micro_batch.samples()]
    groups = prefix_groups([s.input_ids for s in samples], [prompt_length(s.loss_mask) for s in samples])
    if not groups:
        return None
    units: list[list[int]] = []
    sizes: list[int] = []
    for group in groups:
        unit, size = [], group.length
        for index in group.members:
            own = len(samples[index].input_ids) - group.length
            if unit and size + own > capacity:
                units.append(unit)
                sizes.append(size)
                unit, size = [], group.length
            unit.append(index)
            size += own
        units.append(unit)
        sizes.append(size)
    grouped = {index for group in groups for index in group.members}
    for index, sample in enumerate(samples):
        if index not in grouped:
            units.append([index])
            sizes.append(len(sample.input_ids))
    bins = pack_lengths(sizes, capacity)
    return [MicroBatch.concat([samples[i] for unit in bin for i in units[unit]]) for bin in bins]
