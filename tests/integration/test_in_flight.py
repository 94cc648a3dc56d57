"""Weights swapped in flight on the real server: long generations are paused halfway, the weights change, and they
go on, every token labelled with the weights step that sampled it, through verifiers into the training samples."""

import asyncio

import httpx
import pytest
import torch
from rollouts import build_samples
from servers import counter
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.serving.client import InferenceClient
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
from orchestrator.verifiers_adapter.limits import RolloutLimits
from trainer.export import save_weights

pytestmark = pytest.mark.slow

MAX_TOKENS = 1024
ROLLOUTS = 3


def token_logprobs(model, sample, banned: list[int]) -> torch.Tensor:
    """The model's logprob of each token of ``sample`` given those before it (0 at position 0) with the ``banned``
    tokens left out of the distribution, as vLLM's ``min_tokens`` leaves out the stop tokens before its count."""
    with torch.no_grad():
        logits = model(torch.tensor([sample.token_ids])).logits[0, :-1].float()
    logits[:, banned] = -torch.inf
    picked = logits.log_softmax(-1).gather(1, torch.tensor(sample.token_ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), picked])


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two logprob tensors (0 for empty ones)."""
    return float((a - b).abs().max()) if len(a) else 0.0


@pytest.fixture
def full_length_calls(monkeypatch):
    """Every model call samples all of its ``max_tokens`` (vLLM's ``min_tokens``): the random tiny model ends a turn
    at random, and the swap must come while every generation is halfway."""
    import renderers.client

    generate = renderers.client.generate

    async def full_length(**kwargs):
        sampling = kwargs.get("sampling_params") or {}
        return await generate(**kwargs | {"sampling_params": sampling | {"min_tokens": sampling["max_tokens"]}})

    monkeypatch.setattr(renderers.client, "generate", full_length)


def test_a_generation_paused_halfway_goes_on_with_the_new_weights(
    inference_server, tiny_model_path, tmp_path, full_length_calls
):
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    changed = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        changed.model.embed_tokens.weight.mul_(3.0)  # tied: changes the lm_head too
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    save_weights(changed, tokenizer, tmp_path / "step_1")
    stop_ids = sorted({*tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]), tokenizer.eos_token_id})
    config = OrchestratorConfig(client={"base_url": inference_server},
                                sampling={"temperature": 1.0, "max_tokens": MAX_TOKENS})  # fmt: skip
    env = load_env(EnvConfig(id="reverse-text", args={"num_examples": 1}))
    task = next(iter(env.taskset.load()))

    async def metrics(http: httpx.AsyncClient) -> str:
        return (await http.get("/metrics")).raise_for_status().text

    async def swap_halfway():
        client = InferenceClient(inference_server, timeout_s=120, model="trident/tiny-qwen3", in_flight=True)
        http = client.http
        try:
            async with env.serving():
                before = await metrics(http)
                ctx, limits = model_context(config, tiny_model_path), RolloutLimits.of(ROLLOUTS)
                group = asyncio.ensure_future(run_group(env, task, ROLLOUTS, ctx, limits))
                half = counter(before, "vllm:generation_tokens_total") + ROLLOUTS * MAX_TOKENS / 2
                while counter(await metrics(http), "vllm:generation_tokens_total") < half:
                    assert not group.done(), "the generations ended before the swap"
                    await asyncio.sleep(0.02)
                await client.reload_weights(tmp_path / "step_1", 1)
                paused_s = client.paused_s
                probe_gap = await client.check_probe(tmp_path / "step_1", 1, tolerance=1e-3)
                rollouts = await group
                after = await metrics(http)
        finally:
            await client.close()
        finished = counter(after, "vllm:request_success_total") - counter(before, "vllm:request_success_total")
        return rollouts, paused_s, probe_gap, finished

    rollouts, paused_s, probe_gap, finished = asyncio.run(swap_halfway())
    assert probe_gap < 1e-4  # after the swap the server serves the new weights
    assert 0 < paused_s < 60
    # no request lost or duplicated: each rollout made one model call, and the server finished exactly those and
    # the probe's
    assert len(rollouts) == ROLLOUTS and all(r.ok and r.turns == 1 for r in rollouts), [r.error for r in rollouts]
    assert finished == ROLLOUTS + 1
    samples, *_ = build_samples([rollouts], weight_step=0)
    swapped = 0
    for sample in samples:
        mask = torch.tensor(sample.loss_mask)
        steps = torch.tensor(sample.weight_steps)[mask]
        # the steps of the sampled tokens: old weights up to the swap, new ones after it
        assert steps.tolist() == sorted(steps.tolist()) and set(steps.tolist()) <= {0, 1}
        served = torch.tensor(sample.inference_logprobs)[mask]
        old, new = steps == 0, steps == 1
        # each token's logprob is that of the weights its label names: the label is exact
        assert gap(token_logprobs(original, sample, stop_ids)[mask][old], served[old]) < 1e-4
        assert gap(token_logprobs(changed, sample, stop_ids)[mask][new], served[new]) < 1e-4
        swapped += bool(old.any() and new.any())
        assert sample.weight_step == int(steps.min())
        assert int(mask.sum()) == MAX_TOKENS
    # the swap came halfway: every generation was paused mid-completion and went on with the new weights
    assert swapped == ROLLOUTS, [s.weight_steps.count(1) for s in samples]
