"""The chat format follows the model: gsm8k-calc's calculator loop on the tiny Qwen2.5- and Llama-3-format models,
each on its own server. A turn's trained tokens are exactly the text the server sampled, in the family's own
tool-call syntax; the tool's answer comes back in the family's framing as prompt; ``rl`` trains on each."""

import asyncio
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import verifiers.v1 as vf
from gsm8k_calc import calculator
from transformers import AutoTokenizer

from contracts.chat_turns import ChatFormat
from contracts.metrics import read_metrics
from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
from orchestrator.verifiers_adapter.limits import RolloutLimits
from tools.rollout_check import SampleRecord, check_sample, check_step, open_step
from tools.tiny_model import built_model_path

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
EXPRESSION = "[1-9][0-9]? [+*] [1-9][0-9]?"
# model -> (renderer, a forced calculator call in its syntax, how its template frames the tool's answer)
FAMILIES = {
    "trident/tiny-qwen2.5": (
        "default",
        '<tool_call>\n\\{"name": "calculator", "arguments": \\{"expression": "' + EXPRESSION + '"\\}\\}\n</tool_call>',
        "<tool_response>\n{}\n</tool_response>",
    ),
    "trident/tiny-llama3": (
        "llama-3",
        '\\{"name": "calculator", "parameters": \\{"expression": "' + EXPRESSION + '"\\}\\}',
        '<|start_header_id|>ipython<|end_header_id|>\n\n"{}"<|eot_id|>',
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request, tmp_path_factory, free_port, start_server):
    """(model id, base URL) of a server of the tiny model of one chat family, for this module's tests."""
    folder, root = tmp_path_factory.mktemp("inference"), tmp_path_factory.getbasetemp()
    with start_server(folder, request.param, free_port(), root) as base_url:
        yield request.param, base_url


def test_tool_turns_train_exactly_the_sampled_text_in_the_familys_syntax(family_server, recorded_calls):
    model, base_url = family_server
    renderer, call_regex, answer_frame = FAMILIES[model]
    path = built_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    plain_angle = [i for i in range(len(tokenizer)) if "<" in tokenizer.decode([i])]
    plain_angle = [i for i in plain_angle if i not in set(tokenizer.get_added_vocab().values())]
    ctx = model_context(OrchestratorConfig(model={"name": model}, client={"base_url": base_url}), path)
    assert ctx.client.renderer.name == renderer
    sampling = vf.SamplingConfig(
        temperature=1.0,
        max_tokens=48,
        structured_outputs={"regex": call_regex},
        logit_bias={i: -100.0 for i in plain_angle},
    )  # tags as their special ids
    ctx = dataclasses.replace(ctx, sampling=sampling)  # fmt: skip
    env = load_env(EnvConfig(id="gsm8k-calc", args={"num_examples": 4, "max_turns": 2}))
    task = next(iter(env.taskset.load()))
    chat = ChatFormat.from_tokenizer(tokenizer)
    stops = set(chat.stop_ids) | {chat.turn_end}

    async def one_rollout():
        async with env.serving():
            (rollout,) = await run_group(env, task, 1, ctx, RolloutLimits.of(1))
            return rollout

    for _ in range(2):
        before = len(recorded_calls)
        rollout = asyncio.run(one_rollout())
        calls = recorded_calls[before:]
        assert rollout.ok, rollout.error
        assert rollout.turns == len(calls) == 2 and rollout.metrics["calculator_calls"] >= 1
        # the trained tokens are exactly what the server sampled, turn after turn
        trained = [i for b in rollout.branches for i, m in zip(b.token_ids, b.loss_mask, strict=True) if m]
        assert trained == [i for _, completion, _ in calls for i in completion]
        for _, completion, _ in calls:  # each turn is the assistant's call in the family's syntax, and its end
            body = [i for i in completion if i not in stops]
            assert re.fullmatch(call_regex, tokenizer.decode(body)), tokenizer.decode(completion)
            assert completion[-1] in stops or len(completion) == 48
        # the first call's answer is in the second turn's prompt, framed as the family frames tool results
        expression = json.loads(tokenizer.decode([i for i in calls[0][1] if i not in stops]).split("</tool_call>")[0]
                                .removeprefix("<tool_call>\n"))  # fmt: skip
        arguments = expression.get("arguments") or expression["parameters"]
        answer = calculator(arguments["expression"])
        assert answer_frame.format(answer) in tokenizer.decode(calls[1][0], skip_special_tokens=False)
        for j, b in enumerate(rollout.branches):
            report = check_sample(SampleRecord.from_tokens(j, b.token_ids, b.loss_mask, b.logprobs), chat)
            assert report.errors == [] and report.role_counts().get("tool", {}).get("trainable", 0) == 0


def test_rl_runs_gsm8k_calc_on_the_family_with_clean_masks(family_server, tmp_path):
    model, base_url = family_server
    configs = ROOT / "configs" / "debug" / "rl"
    env = [{"id": "gsm8k-calc", "args": {"max_turns": 2}}]
    argv = [sys.executable, "-m", "launch.main", "--no-plots", "--trainer", "@", str(configs / "train.toml"),
            "--orchestrator", "@", str(configs / "orch.toml"), "--orchestrator.client.base-url", base_url,
            "--model.name", model, "--max-steps", "3", "--output-dir", str(tmp_path),
            "--orchestrator.env", json.dumps(env), "--orchestrator.batch-size", "4",
            "--orchestrator.rollouts-per-example", "4", "--orchestrator.eval", "false"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "logs" / "orchestrator.log").read_text()
    assert f"rendering chats with renderer {FAMILIES[model][0]!r}, checked against the template" in log
    assert "server now serves weights step 1" in log  # the trainer's weights reached this server, probe-checked
    assert [r["step"] for r in read_metrics(tmp_path, "orchestrator")] == [1, 2, 3]
    report = check_step(*open_step(tmp_path, None, None))
    assert [p for p in report.all_problems() if p.severity == "error"] == []
