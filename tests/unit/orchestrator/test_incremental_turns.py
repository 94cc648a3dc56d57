"""A multi-turn rollout's prompts are extended turn by turn (verifiers bridges each new turn onto the tokens it
already has) and are exactly what rendering the whole conversation afresh gives."""

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestServer
from renderers import create_renderer
from renderers.base import load_tokenizer
from transformers import AutoTokenizer
from verifiers.v1.clients.train import tool_to_wire
from verifiers.v1.dialects.chat import message_to_wire

from contracts.inference_api import GENERATE, MODELS
from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.verifiers_adapter.envs import load_env, model_context, trace_branches
from orchestrator.verifiers_adapter.renderer import renderer_config

TOOL_CALLS = 3
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call><|im_end|>'
ANSWER = "6 * 7 = 42\n#### 42<|im_end|>"


def generate_reply(token_ids: list[int]) -> dict:
    logprobs = [{"token": f"token_id:{token}", "logprob": -0.5} for token in token_ids]
    return {"request_id": "r", "choices": [{"index": 0, "token_ids": token_ids, "logprobs": {"content": logprobs},
                                            "finish_reason": "stop"}]}  # fmt: skip


async def run_rollout(tiny_model_path: str, prompts: list[list[int]]):
    """One gsm8k-calc rollout against a server that calls the calculator ``TOOL_CALLS`` times, then answers;
    the prompt of each request is appended to ``prompts``. Returns the rollout's trace."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    call, answer = (tokenizer.encode(text, add_special_tokens=False) for text in (TOOL_CALL, ANSWER))
    tool_response = tokenizer.convert_tokens_to_ids("<tool_response>")

    async def generate(request):
        prompt = (await request.json())["token_ids"]
        prompts.append(prompt)
        return web.json_response(generate_reply(call if prompt.count(tool_response) < TOOL_CALLS else answer))

    async def models(request):
        return web.json_response({"data": [{"id": "tiny"}]})

    app = web.Application()
    app.router.add_post(GENERATE, generate)
    app.router.add_get(MODELS, models)
    env = load_env(EnvConfig(id="gsm8k-calc", args={"max_turns": TOOL_CALLS + 2}))
    async with TestServer(app) as server, env.serving():
        config = OrchestratorConfig(client={"base_url": str(server.make_url(""))})
        (slot,) = env.slots(next(iter(env.taskset.load())), 1)
        episode = await env.run_slot(slot, model_context(config, tiny_model_path))
    return episode.traces[0]


def test_each_turns_prompt_is_bridged_and_equals_a_full_render_of_the_conversation(tiny_model_path, monkeypatch):
    config = renderer_config("auto", "auto", tiny_model_path, enable_thinking=False)
    renderer = create_renderer(load_tokenizer(tiny_model_path), config)
    bridges = []
    bridge = type(renderer).bridge_to_next_turn

    def counted_bridge(self, *args, **kwargs):
        bridged = bridge(self, *args, **kwargs)
        bridges.append(bridged is not None)
        return bridged

    monkeypatch.setattr(type(renderer), "bridge_to_next_turn", counted_bridge)
    prompts: list[list[int]] = []
    trace = asyncio.run(run_rollout(tiny_model_path, prompts))

    assert len(trace.calls) == len(prompts) == TOOL_CALLS + 1
    assert bridges == [True] * TOOL_CALLS  # every turn after the first extends the tokens of the one before
    (branch,) = trace.branches
    messages = [message_to_wire(m) for m in branch.messages]
    tools = [tool_to_wire(t) for t in branch.tools]
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(assistant_turns) == TOOL_CALLS + 1
    for prompt, turn in zip(prompts, assistant_turns, strict=True):
        assert prompt == renderer.render_ids(messages[:turn], tools=tools, add_generation_prompt=True)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    call, answer = (tokenizer.encode(text, add_special_tokens=False) for text in (TOOL_CALL, ANSWER))
    (branch,) = trace_branches(trace)
    token_ids, mask, logprobs = branch.token_ids, branch.loss_mask, branch.logprobs
    assert token_ids == prompts[-1] + answer  # one sample: the last prompt and the answer sampled after it
    assert [t for t, trained in zip(token_ids, mask, strict=True) if trained] == call * TOOL_CALLS + answer
    assert {p for p, trained in zip(logprobs, mask, strict=True) if trained} == {-0.5}
