"""Context parallelism's pieces: how a row is split, which logged entropies each shard computes, how the heads are
split (with key and value heads repeated where the group's size does not divide them), what is refused; and on a real
gloo group of two forked ranks, the all-to-alls (each rank's share of the heads for the whole row where the docstring
says, the way back its inverse, backward the reverse) and the row's score sum (the ranks' scores added, the identity
backward). The whole step on two ranks: tests/integration/test_context_parallel_two_ranks.py."""

import re
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from pydantic import ValidationError

from contracts.errors import TridentError
from tools.tiny_model import built_model_path
from trainer import context_parallel
from trainer.compilation import compiles
from trainer.config import ParallelConfig, SFTConfig, TrainerConfig
from trainer.context_parallel import (
    attend_across_shards,
    context_group,
    divisible_kv,
    heads_to_tokens,
    scores_of_the_row,
    shard_of,
    tokens_to_heads,
)
from trainer.parallel import World
from trainer.scoring import logged_entropy_rows
from trainer.train import check_start


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shards_cover_the_row_in_order_each_of_the_same_length(size):
    for tokens in range(1, 20):
        shards = [shard_of(tokens, rank, size) for rank in range(size)]
        assert shards[0].start == 0 and shards[-1].stop == shards[0].padded >= tokens
        assert shards[0].padded % size == 0 and shards[0].padded - tokens < size
        assert all(a.stop == b.start for a, b in zip(shards, shards[1:], strict=False))
        assert len({shard.stop - shard.start for shard in shards}) == 1


@pytest.mark.parametrize("positions", [5, 128, 129, 300, 1000])
def test_each_shards_logged_entropies_are_the_whole_rows_share(positions):
    whole = list(range(positions))[logged_entropy_rows(positions)]
    for cuts in ([0, positions], [0, 3, positions], [0, positions // 3, positions // 2 + 1, positions]):
        split = []
        for first, stop in zip(cuts, cuts[1:], strict=False):  # a shard scores positions first..stop - 1 of the row's
            split += [first + row for row in range(stop - first)[logged_entropy_rows(positions, first)]]
        assert split == whole


@pytest.mark.parametrize(
    ("heads", "kv_heads", "cp"), [(2, 1, 2), (4, 2, 2), (8, 2, 4), (6, 2, 2), (12, 4, 6), (8, 8, 4)]
)
def test_split_heads_each_meet_their_own_key_and_value_heads(heads, kv_heads, cp):
    """Attention of each rank's share of the heads (query heads split in cp groups, key and value heads repeated by
    ``divisible_kv`` then split the same way) equals the whole attention's heads."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, 9, 8, generator=generator)
    key, value = (torch.randn(1, kv_heads, 9, 8, generator=generator) for _ in range(2))
    whole = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    key, value = divisible_kv(key, cp), divisible_kv(value, cp)
    assert key.shape[1] % cp == 0
    parts = [
        F.scaled_dot_product_attention(*(x.chunk(cp, dim=1)[rank] for x in (query, key, value)), is_causal=True,
                                       enable_gqa=True)
        for rank in range(cp)
    ]  # fmt: skip
    assert torch.allclose(torch.cat(parts, dim=1), whole, atol=1e-6)


@pytest.mark.parametrize(
    ("model", "cp", "message"),
    [
        ("trident/tiny-qwen3", 4, "must divide the 2 attention heads of model"),
        ("trident/tiny-qwen3-moe", 2, "is a mixture of experts, not split over ranks by tokens yet; set cp = 1"),
        ("trident/tiny-qwen3-vl", 2, "is a vision-language model, not split over ranks by tokens yet; set cp = 1"),
    ],
)
def test_what_context_parallelism_cannot_split_is_refused_in_one_line(model, cp, message):
    """The trainer refuses these at its start, before loading the model (trainer.rules, as rl does)."""
    config = TrainerConfig(model={"name": built_model_path(model), "parallel": {"cp": cp}})
    with pytest.raises(TridentError, match=rf"^model\.parallel\.cp = {cp}:? .*{re.escape(message)}"):
        check_start(config, World(0, cp, torch.device("cpu"), cp=cp))


def test_the_tiny_model_splits_over_two_ranks():
    config = TrainerConfig(model={"name": built_model_path("trident/tiny-qwen3"), "parallel": {"cp": 2}})
    check_start(config, World(0, 2, torch.device("cpu"), cp=2))


def test_configs_refuse_context_parallelism_where_it_does_not_apply():
    with pytest.raises(ValidationError, match="context and expert parallelism do not combine yet"):
        ParallelConfig(cp=2, ep=2)
    with pytest.raises(ValidationError, match="context parallelism is the RL trainer's"):
        SFTConfig(model={"parallel": {"cp": 2}}, data={"path": "x.jsonl"})
    assert not compiles("auto", torch.device("cuda"), torch.bfloat16, cp=2)  # not compiled yet under cp


RANKS, HEADS, SHARD, DIM = 2, 4, 3, 2


def shard_input(rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``[1, heads, shard, dim]`` input, each entry naming itself: 1000·rank + 100·head + 10·token
    + dim (token counted within the shard)."""
    head, token, dim = torch.meshgrid(torch.arange(HEADS), torch.arange(SHARD), torch.arange(DIM), indexing="ij")
    return (1000 * rank + 100 * head + 10 * token + dim)[None].float()


def check_all_to_alls(rank: int, group: dist.ProcessGroup) -> None:
    x = shard_input(rank).requires_grad_()
    by_heads = tokens_to_heads(x, group)
    # naively: the whole row (the ranks' shards in rank order along the tokens), rank r's r-th group of heads
    whole_row = torch.cat([shard_input(r) for r in range(RANKS)], dim=2)
    per_rank = HEADS // RANKS
    torch.testing.assert_close(by_heads, whole_row[:, rank * per_rank : (rank + 1) * per_rank], rtol=0, atol=0)
    # the way back, from attention's output layout [1, tokens, heads, dim]: this rank's tokens with every head
    back = heads_to_tokens(by_heads.transpose(1, 2), group)
    torch.testing.assert_close(back, x.transpose(1, 2), rtol=0, atol=0)
    # backward: the all-to-all moves each entry to one place, so the gradient of Σ over ranks of ⟨y, y.detach()⟩
    # (each rank's y = tokens_to_heads of its x) at each rank's x is x itself
    (by_heads * by_heads.detach()).sum().backward()
    torch.testing.assert_close(x.grad, x.detach(), rtol=0, atol=0)
    x.grad = None
    (back * back.detach()).sum().backward()  # and there and back again: the same
    torch.testing.assert_close(x.grad, x.detach(), rtol=0, atol=0)


def check_score_sum(rank: int, group: dist.ProcessGroup) -> None:
    row = 2 * SHARD
    own = torch.zeros(row)
    own[rank * SHARD : (rank + 1) * SHARD] = torch.arange(SHARD) + 10.0 * (rank + 1)  # its positions, zeros elsewhere
    scores = own.clone().requires_grad_()
    summed = scores_of_the_row(scores, group)
    expected = torch.zeros(row)
    for r in range(RANKS):  # naively: every rank's own positions
        expected[r * SHARD : (r + 1) * SHARD] = torch.arange(SHARD) + 10.0 * (r + 1)
    torch.testing.assert_close(summed, expected, rtol=0, atol=0)
    assert torch.equal(scores.detach(), own)  # the input is left as it was
    weights = torch.arange(row, dtype=torch.float) + 1
    (summed * weights).sum().backward()
    torch.testing.assert_close(scores.grad, weights, rtol=0, atol=0)  # identity: not summed over the ranks


def rank_main(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)  # a rank left waiting on one that failed gives up (the test stops both sooner)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS, timeout=timeout)
    try:
        check_all_to_alls(rank, dist.group.WORLD)
        check_score_sum(rank, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_the_all_to_alls_and_the_score_sum_on_two_gloo_ranks(tmp_path):
    """Two spawned processes, one gloo group. Not forked: a fork of a session that has run a backward pass (the other
    trainer tests) cannot run autograd ("Unable to handle autograd's threading in combination with fork")."""
    mp.start_processes(rank_main, args=(str(tmp_path / "store"),), nprocs=RANKS, start_method="spawn")
    # a rank's failed check raises here, with its traceback


class ThreadGroup:
    """A fake process group for the collectives in one process: each rank a thread, the all-to-all and the sum
    exchanged through shared slots between two barriers (gloo's semantics for equal splits: the input's ``r``-th
    chunk goes to rank ``r``, the output holds every rank's chunk in rank order)."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots, self.local = size, threading.Barrier(size), {}, threading.local()

    def exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, in rank order."""
        self.slots[self.local.rank] = tensor.detach().clone()
        self.barrier.wait()
        gathered = [self.slots[r] for r in range(self.size)]
        self.barrier.wait()  # every rank has read before a later call writes
        return gathered

    def all_to_all(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat([chunks.chunk(self.size)[self.local.rank] for chunks in self.exchange(flat)])

    def run(self, check, *args) -> None:
        """``check(rank, *args)`` on each rank's thread; a rank's failure raised here."""
        failures = []

        def rank_main(rank):
            self.local.rank = rank
            try:
                check(rank, *args)
            except BaseException as e:
                failures.append(e)
                self.barrier.abort()  # the other rank stops waiting

        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        if failures:
            raise next((e for e in failures if not isinstance(e, threading.BrokenBarrierError)), failures[0])


class _FakeAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat, group):
        ctx.group = group
        return group.all_to_all(flat)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_to_all(grad), None


@pytest.fixture
def thread_group(monkeypatch) -> ThreadGroup:
    """Context parallelism's collectives over a :class:`ThreadGroup` of two ranks."""
    group = ThreadGroup(RANKS)

    def all_reduce(x, group):
        x.copy_(sum(group.exchange(x)))

    monkeypatch.setattr(context_parallel, "all_to_all_single_autograd", lambda x, _, __, g: _FakeAllToAll.apply(x, g))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: group.size)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return group


def test_the_all_to_alls_and_the_score_sum_on_a_fake_group_of_two_threads(thread_group):
    """The checks of the two-rank gloo test below, in one process (cheap, and seen by the mutation report)."""
    thread_group.run(lambda rank: (check_all_to_alls(rank, thread_group), check_score_sum(rank, thread_group)))


def check_attention(rank: int, group) -> None:
    """Ulysses attention on this rank's shard equals causal attention over the whole row, this shard's rows; its
    gradient at this shard's inputs is the whole row's there."""
    heads, kv_heads, shard = 4, 1, 3  # 1 key and value head: repeated to 2 so that each rank gets one
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, RANKS * shard, DIM, generator=generator, requires_grad=True)
    key, value = (torch.randn(1, kv_heads, RANKS * shard, DIM, generator=generator, requires_grad=True) for _ in "kv")

    def attend(q, k, v):  # [1, heads, tokens, dim] in, [1, tokens, heads, dim] out
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

    own = slice(rank * shard, (rank + 1) * shard)
    whole = attend(query, key, value)[:, own]
    pieces = [x[:, :, own].detach().requires_grad_() for x in (query, key, value)]
    split = attend_across_shards(attend, *pieces, group)
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-6)
    weights = torch.randn(whole.shape, generator=generator)
    (whole * weights).sum().backward()
    (split * weights).sum().backward()
    torch.testing.assert_close(pieces[0].grad, query.grad[:, :, own], rtol=0, atol=1e-6)


def test_ulysses_attention_on_a_fake_group_equals_the_whole_rows(thread_group):
    thread_group.run(check_attention, thread_group)


def test_the_context_group_is_the_cp_axis_of_a_dp_by_cp_mesh(monkeypatch):
    """Four ranks at cp = 2: a (2, 2) mesh named dp, cp, its cp axis's group; cp = 3 does not divide them."""
    meshes = []

    class Mesh:
        def __getitem__(self, name):
            return SimpleNamespace(get_group=lambda: f"the {name} group")

    def mesh(*args, **kwargs):
        meshes.append((args, kwargs))
        return Mesh()

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(context_parallel, "init_device_mesh", mesh)
    assert context_group(2, "cpu") == "the cp group"
    assert meshes == [(("cpu", (2, 2)), {"mesh_dim_names": ("dp", "cp")})]
    assert all(type(n) is int for n in meshes[0][0][1])  # a mesh's shape counts ranks: 2, not 2.0
    with pytest.raises(TridentError, match=r"^model\.parallel\.cp = 3 must divide the trainer's 4 ranks$"):
        context_group(3, "cpu")
