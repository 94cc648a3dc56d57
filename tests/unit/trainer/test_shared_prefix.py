"""Shared beginnings computed once: the groups found, the computed row, and the same scores and gradients as each
sample computed whole (the tiny model in fp32)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from contracts.protocol import BatchInfo, MicroBatch, Sample, pack_lengths, write_batch
from contracts.run_dir import weights_dir
from trainer.config import LossConfig, TrainerConfig, TrainerModelConfig
from trainer.loss import policy_loss
from trainer.model import load_model, packed_scores
from trainer.shared_prefix import MIN_SHARED_TOKENS, PrefixGroup, pack_groups, prefix_groups, shared_layout
from trainer.train import train


def pack_samples_of(samples: list[MicroBatch], seq_len: int) -> list[list[MicroBatch]]:
    """Samples (one-sample micro-batches) packed as an orchestrator packs them (first fit, longest first)."""
    return [[samples[i] for i in bin] for bin in pack_lengths([len(s.input_ids) for s in samples], seq_len)]


def ids(*parts) -> torch.Tensor:
    return torch.tensor([token for part in parts for token in part])


PROMPT_A, PROMPT_B = list(range(100, 120)), list(range(300, 330))  # 20 and 30 tokens


def test_groups_share_their_longest_common_beginning_and_keep_a_token_each():
    samples = [
        ids(PROMPT_A, [1, 2, 3]),
        ids(PROMPT_B, [7]),
        ids(PROMPT_A, [1, 2, 9, 9]),  # shares 22 tokens with the first
        ids(PROMPT_A[:MIN_SHARED_TOKENS]),  # too short to share: no token would be its own
        ids(PROMPT_B, [7]),  # the same as the second: all but the last token shared
        ids(range(500, 540)),
    ]
    prompts = [20, 30, 20, 16, 30, 20]
    assert prefix_groups(samples, prompts) == [PrefixGroup((0, 2), 22), PrefixGroup((1, 4), 30)]
    assert prefix_groups([ids(PROMPT_A[:-1], [5]), ids(PROMPT_A)], [20, 20]) == [PrefixGroup((0, 1), 19)]
    assert prefix_groups([ids(range(15), [1, 2]), ids(range(15), [3, 4])], [15, 15]) == []  # 15 alike: fewer than 16


def test_samples_sharing_an_instruction_are_grouped_by_their_prompts():
    """Three prompts that begin with the same 24-token instruction: two GRPO groups (2 and 3 samples, each sharing
    its whole prompt) and two lone prompts, which share the instruction and one token more."""
    instruction = list(range(600, 624))
    samples = [
        ids(instruction, [1, 2, 3], [50, 51]),  # group X: prompt instruction + [1, 2, 3]
        ids(instruction, [4, 5], [60]),  # group Y
        ids(instruction, [7, 8, 9], [70]),  # alone
        ids(instruction, [1, 2, 3], [52]),
        ids(instruction, [4, 5], [61, 62]),
        ids(instruction, [7, 1], [71]),  # alone: shares instruction + [7] with the other one
        ids(instruction, [4, 5], [60, 63]),  # group Y, sharing one sampled token with its second member
    ]
    prompts = [27, 26, 27, 27, 26, 26, 26]
    assert prefix_groups(samples, prompts) == [
        PrefixGroup((0, 3), 27), PrefixGroup((1, 4, 6), 26), PrefixGroup((2, 5), 25),
    ]  # fmt: skip
    # one group where every prompt is the same: the beginning all share
    assert prefix_groups(samples, [1] * 7) == [PrefixGroup(tuple(range(7)), 24)]


def micro_batch_of(
    token_ids: list[torch.Tensor], seed: int = 0, prompt_scored: bool = False, prompts: list[int] | None = None
) -> MicroBatch:
    """Samples of ``token_ids`` trained from their ``prompts``' ends (from the second token with ``prompt_scored``,
    from their middle without ``prompts``), with random logprobs and advantages."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index, tokens in enumerate(token_ids):
        n = len(tokens)
        first = 1 if prompt_scored else prompts[index] if prompts else n // 2
        logprobs = (-7.6 + 0.1 * torch.randn(n, generator=generator)).tolist()
        advantage = float(torch.randn(1, generator=generator))
        samples.append(Sample(tokens.tolist(), [i >= first for i in range(n)], logprobs, advantage, 0.0, 0))
    return MicroBatch.pack(samples)


def test_the_computed_row_holds_a_shared_beginning_once_and_points_each_token_at_its_copy():
    row = micro_batch_of([ids(PROMPT_A, [1, 2]), ids(range(400, 403)), ids(PROMPT_A, [5, 6, 7])])
    layout = shared_layout(row)
    # segments: the group's 20 shared tokens, the first's own 2, the lone sample's 3, the third's own 3
    assert layout.bounds == (0, 20, 22, 25, 28) and layout.prefixes == (None, 0, None, 0)
    assert torch.equal(layout.order, torch.cat([torch.arange(0, 22), torch.arange(22, 25), torch.arange(45, 48)]))
    assert torch.equal(row.input_ids[layout.order[layout.where]], row.input_ids)  # every token finds its copy
    assert torch.equal(layout.where[25:45], torch.arange(20))  # the third's beginning: the first's copy
    assert shared_layout(micro_batch_of([ids(range(40)), ids(range(50, 90))])) is None


def loss_and_gradients(model, micro_batch: MicroBatch, share: bool):
    model.zero_grad(set_to_none=True)
    scores = packed_scores(model, micro_batch, 0.8, micro_batch.loss_mask, "trained", share=share)
    loss, _ = policy_loss(
        scores.logprobs, micro_batch.inference_logprobs, micro_batch.advantages, micro_batch.loss_mask,
        micro_batch.sample_lengths, LossConfig(entropy_coef=0.01), num_loss_tokens=100, num_samples=7,
        entropy=scores.entropy,
    )  # fmt: skip
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return scores, loss.detach(), gradients


@pytest.mark.parametrize("prompt_scored", [False, True])
def test_shared_beginnings_give_each_samples_own_scores_and_gradients(tiny_model_path, monkeypatch, prompt_scored):
    """Group A: a 20-token prompt, 3 members; two identical samples (a 30-token prompt, B); one whose prompt is B's
    first 25 tokens; a lone sample. Trained from their prompts' ends, B's two share 35 of their 36 tokens; trained
    from each sample's second token on (every prompt the same: its first token), B's three share 25 (the shared
    tokens' own scores, read from the one copy)."""
    generator = torch.Generator().manual_seed(5)

    def completion(n):
        return torch.randint(0, 2000, (n,), generator=generator).tolist()

    repeated = completion(6)
    token_ids = [
        ids(PROMPT_A, completion(9)),
        ids(PROMPT_B, repeated),
        ids(completion(14)),
        ids(PROMPT_A, completion(4)),
        ids(PROMPT_B, repeated),
        ids(PROMPT_A, completion(12)),
        ids(PROMPT_B[:25], completion(7)),
    ]
    micro_batch = micro_batch_of(token_ids, prompt_scored=prompt_scored, prompts=[20, 30, 7, 20, 30, 20, 25])
    model = load_model(TrainerModelConfig(name=tiny_model_path), torch.device("cpu"))
    computed = []
    embed = model.get_input_embeddings()
    monkeypatch.setattr(
        embed, "forward", lambda input_ids, f=embed.forward: computed.append(input_ids.shape[-1]) or f(input_ids)
    )
    whole = loss_and_gradients(model, micro_batch, share=False)
    shared = loss_and_gradients(model, micro_batch, share=True)
    tokens = len(micro_batch.input_ids)
    saved = 2 * 20 + (2 * 25 if prompt_scored else 35)  # each group's members past the first: the shared tokens
    assert computed == [tokens, tokens - saved]
    for got, expected in zip(shared[0], whole[0], strict=True):  # logprobs, entropies, where, outside the kept set
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1], whole[1], atol=1e-6, rtol=1e-5)
    assert shared[2].keys() == whole[2].keys() and whole[2]
    for name, gradient in whole[2].items():
        torch.testing.assert_close(shared[2][name], gradient, atol=1e-6, rtol=1e-4, msg=name)


def test_a_step_is_packed_so_that_groups_share_micro_batches_within_the_budget():
    generator = torch.Generator().manual_seed(1)
    prompts = [list(range(k * 100, k * 100 + 40)) for k in range(3)]
    token_ids = [
        ids(prompts[k % 3], torch.randint(0, 2000, (30 + k,), generator=generator).tolist()) for k in range(12)
    ]
    token_ids.append(ids(range(1000, 1050)))
    # as an orchestrator packs them (longest first): groups spread over micro-batches
    given = [micro_batch_of(token_ids[i : i + 4]) for i in range(0, 13, 4)]
    packed = pack_groups(given, capacity=200)
    samples = sorted(tuple(s.input_ids.tolist()) for m in packed for s in m.samples())
    assert samples == sorted(tuple(t.tolist()) for t in token_ids)  # every sample once, unchanged
    for micro_batch in packed:
        layout = shared_layout(micro_batch)
        assert (len(layout.order) if layout else len(micro_batch.input_ids)) <= 200
    # each group of 4 members (40 + 4 × ~32 tokens computed) fits whole: one micro-batch holds each prompt
    holders = [{tuple(s.input_ids[:40].tolist()) for s in m.samples()} for m in packed]
    for prompt in prompts:
        assert sum(tuple(prompt) in held for held in holders) == 1
    split = pack_groups(given, capacity=120)  # a group no longer fits: split into parts that do
    assert all(len(shared_layout(m).order if shared_layout(m) else m.input_ids) <= 120 for m in split)
    assert pack_groups([micro_batch_of([ids(range(40)), ids(range(50, 90))])], 200) is None


def test_the_trainer_trains_groups_as_it_trains_each_sample_whole(tmp_path, tiny_model_path):
    """The trainer process's loop, 2 steps on one batch of 3 groups of 4 samples (a 24-token prompt each, 6-20
    sampled tokens) packed into seq_len = 128 as an orchestrator packs them (3 samples a micro-batch): with
    share_prefixes on, each group is packed into one micro-batch (24 + 4 × at most 20 tokens fit) and its prompt
    computed once; the metrics and the written weights are those of the run that
    computes each sample whole."""
    generator = torch.Generator().manual_seed(2)
    lengths = torch.randint(6, 21, (12,), generator=generator).tolist()
    token_ids = [ids(range(200 * k, 200 * k + 24), torch.randint(0, 2000, (lengths[4 * k + i],), generator=generator))
                 for k in range(3) for i in range(4)]  # fmt: skip
    samples = micro_batch_of(token_ids, seed=3, prompts=[24] * 12).samples()
    micro_batches = [MicroBatch.concat(b) for b in pack_samples_of(samples, 128)]
    runs = {}
    for share in (False, True):
        output_dir = tmp_path / f"share-{share}"
        info = BatchInfo(1, len(samples), sum(len(s.input_ids) for s in samples),
                         sum(int(s.loss_mask.sum()) for s in samples), 0.0, 1.0)  # fmt: skip
        for step in (1, 2):
            write_batch(output_dir, info.__class__(**{**vars(info), "step": step}), micro_batches)
        train(TrainerConfig(output_dir=output_dir, model={"name": tiny_model_path}, max_steps=2, seq_len=128,
                            share_prefixes=share))  # fmt: skip
        records = [json.loads(line) for line in (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
        runs[share] = records, load_file(weights_dir(output_dir, 2) / "model.safetensors")
    (whole, whole_weights), (shared, shared_weights) = runs[False], runs[True]
    tokens = sum(len(t) for t in token_ids)
    assert [r["computed_tokens"] for r in whole] == [tokens] * 2
    assert [r["computed_tokens"] for r in shared] == [tokens - 3 * 3 * 24] * 2  # 3 of each group's 4 prompts
    for got, expected in zip(shared, whole, strict=True):
        for key in ("loss", "grad_norm", "entropy", "mismatch_kl"):
            assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key
    assert shared_weights.keys() == whole_weights.keys()
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(shared_weights[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
