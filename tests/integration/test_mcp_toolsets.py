"""A taskset an outside user wrote from verifiers' documentation (``user_envs/notes_env``), whose tools are
``vf.Toolset`` classes that verifiers serves over MCP: one server per rollout and one shared by the taskset. Its
tools reach the model through Trident's harness, their results come back as prompt, and ``rl`` trains on it."""

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import verifiers.v1 as vf
from transformers import AutoTokenizer

from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.envs import load_env, model_context, run_group
from rl.metrics import read_metrics
from rl.rollout_check import ChatFormat, SampleRecord, check_sample, check_step, open_step

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
USER_ENVS = Path(__file__).parent / "user_envs"
# Either tool, in the Hermes syntax the tiny Qwen3 model's template declares.
FORCED_TOOL_CALL = (
    '<tool_call>\n\\{"name": "(notebook_toolset_read_note", "arguments": \\{"index": [0-9]'
    '|dictionary_toolset_define", "arguments": \\{"word": "[a-z]{1,6}")\\}\\}\n</tool_call>'
)


@pytest.fixture
def user_env_installed(monkeypatch):
    """``notes_env`` importable here and in the processes verifiers and ``rl`` start, as an installed package is."""
    monkeypatch.syspath_prepend(str(USER_ENVS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(USER_ENVS), os.environ.get("PYTHONPATH")])))


def test_both_scopes_of_mcp_tools_reach_the_model_and_answer_as_prompt(user_env_installed, inference_server,
                                                                        tiny_model_path):  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    plain_angle = [i for i in range(len(tokenizer)) if "<" in tokenizer.decode([i])]
    plain_angle = [i for i in plain_angle if i not in set(tokenizer.get_added_vocab().values())]
    sampling = vf.SamplingConfig(temperature=1.0, max_tokens=64, structured_outputs={"regex": FORCED_TOOL_CALL},
                                 logit_bias={i: -100.0 for i in plain_angle})  # fmt: skip
    ctx = model_context(OrchestratorConfig(client={"base_url": inference_server}), tiny_model_path)
    ctx = dataclasses.replace(ctx, sampling=sampling)
    env = load_env(EnvConfig(id="notes-env", max_turns=4))
    task = next(iter(env.taskset.load()))

    async def run():
        async with env.serving():  # starts the taskset's shared server
            return await run_group(env, task, 3, ctx, asyncio.Semaphore(3))

    chat = ChatFormat.from_tokenizer(tokenizer)
    for rollout in asyncio.run(run()):
        assert rollout.ok, rollout.error
        (ids, mask, logprobs), *_ = rollout.branches
        assert rollout.turns >= 2 and rollout.rewards == {"looked_it_up": 1.0}
        text = tokenizer.decode(ids)
        sampled = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        prompt = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
        # both servers' tools are offered, named <server>_<tool>
        assert '"name": "notebook_toolset_read_note"' in text and '"name": "dictionary_toolset_define"' in text
        # every call the model made was answered by its server, and the answers are prompt, never trained
        calls = [json.loads(part.split("</tool_call>")[0]) for part in sampled.split("<tool_call>\n")[1:]]
        answered = calls[:-1] if rollout.turns == 4 else calls  # max_turns ends the rollout before the last answer
        reads = [c for c in answered if c["name"] == "notebook_toolset_read_note"]
        for n, call in enumerate(reads, start=1):  # the notebook is this rollout's own: its count starts at 1
            assert f"note {call['arguments']['index']} says:" in prompt and f"(read {n})" in prompt
        for call in answered:
            if call["name"] == "dictionary_toolset_define":
                assert f"{call['arguments']['word']}: a word from the notebook" in prompt
        assert "<tool_response>" not in sampled and sampled.count("<tool_call>") == len(calls)
        report = check_sample(SampleRecord.from_tokens(0, ids, mask, logprobs), chat)
        assert report.errors == [], report.errors


def test_rl_trains_on_a_taskset_with_mcp_toolsets(user_env_installed, inference_server, tmp_path):
    configs = ROOT / "configs" / "debug" / "rl"
    env = [{"id": "notes-env", "max_turns": 2}]
    argv = [sys.executable, "-m", "rl.launcher", "--trainer", "@", str(configs / "train.toml"),
            "--orchestrator", "@", str(configs / "orch.toml"), "--orchestrator.client.base-url", inference_server,
            "--max-steps", "2", "--output-dir", str(tmp_path), "--orchestrator.env", json.dumps(env),
            "--orchestrator.batch-size", "2", "--orchestrator.rollouts-per-example", "2"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    orchestrator = read_metrics(tmp_path, "orchestrator")
    assert [r["step"] for r in orchestrator] == [0, 1] and all(r["failed_rollouts"] == 0 for r in orchestrator)
    assert [r["step"] for r in read_metrics(tmp_path, "trainer")] == [0, 1]
    samples = json.loads((tmp_path / "rollouts" / "step_1" / "batch.json").read_text())["samples"]
    assert {s["env"] for s in samples} == {"notes-env"} and all("looked_it_up" in s["rewards"] for s in samples)
    report = check_step(*open_step(tmp_path, None, None))
    assert [p for p in report.all_problems() if p.severity == "error"] == []
