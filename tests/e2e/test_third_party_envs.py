"""Environments as outside users bring them. A taskset written from verifiers' documentation
(``user_envs/notes_env``) whose tools are ``vf.Toolset`` classes verifiers serves over MCP (one server per rollout,
one shared by the taskset, or one already running, by URL): its tools reach the model through Trident's harness,
their results come back as prompt, and ``rl`` trains on it, beside environments shaped as verifiers' reverse-text
and gsm8k examples (``user_envs/hub_reverse_text``, ``hub_gsm8k``) whose own hub ``load_dataset`` calls read local
rows through ``[[datasets]]``. And verifiers' own ``user-sim`` environment, where a model-played user talks to the
policy."""

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import verifiers.v1 as vf
from procs import run_processes, wait_gone
from rl_runs import started_pids
from transformers import AutoTokenizer

from contracts.chat_turns import ChatFormat
from contracts.metrics import read_metrics
from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.verifiers_adapter.envs import harness_for, load_env, model_context, run_group
from orchestrator.verifiers_adapter.harness import HARNESS_ID
from orchestrator.verifiers_adapter.limits import RolloutLimits
from tools.rollout_check import SampleRecord, check_sample, check_step, open_step

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
USER_ENVS = Path(__file__).parent / "user_envs"
# Calls in the Hermes syntax the tiny Qwen3 model's template declares: either tool, or the dictionary's alone.
READ_NOTE = '"notebook_toolset_read_note", "arguments": \\{"index": [0-9]'
DEFINE = '"dictionary_toolset_define", "arguments": \\{"word": "[a-z]{1,6}"'
FORCED_TOOL_CALL = f'<tool_call>\n\\{{"name": ({READ_NOTE}|{DEFINE})\\}}\\}}\n</tool_call>'
FORCED_DEFINE_CALL = f'<tool_call>\n\\{{"name": {DEFINE}\\}}\\}}\n</tool_call>'


@pytest.fixture
def user_env_installed(monkeypatch):
    """``notes_env`` importable here and in the processes verifiers and ``rl`` start, as an installed package is."""
    monkeypatch.syspath_prepend(str(USER_ENVS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(USER_ENVS), os.environ.get("PYTHONPATH")])))


def forced_tool_calls(tokenizer, base_url: str, model_path: str, regex: str = FORCED_TOOL_CALL) -> vf.ModelContext:
    """The tiny model, made to call notes-env's tools each turn (tags as their special ids)."""
    plain_angle = [i for i in range(len(tokenizer)) if "<" in tokenizer.decode([i])]
    plain_angle = [i for i in plain_angle if i not in set(tokenizer.get_added_vocab().values())]
    sampling = vf.SamplingConfig(temperature=1.0, max_tokens=64, structured_outputs={"regex": regex},
                                 logit_bias={i: -100.0 for i in plain_angle})  # fmt: skip
    ctx = model_context(OrchestratorConfig(client={"base_url": base_url}), model_path)
    return dataclasses.replace(ctx, sampling=sampling)


def rollouts(env_config: EnvConfig, ctx: vf.ModelContext, n: int):
    env = load_env(env_config)
    task = next(iter(env.taskset.load()))

    async def run():
        async with env.serving():  # starts the taskset's shared servers
            return await run_group(env, task, n, ctx, RolloutLimits.of(n))

    return asyncio.run(run())


def test_both_scopes_of_mcp_tools_reach_the_model_and_answer_as_prompt(user_env_installed, inference_server,
                                                                        tiny_model_path):  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ctx = forced_tool_calls(tokenizer, inference_server, tiny_model_path)
    chat = ChatFormat.from_tokenizer(tokenizer)
    for rollout in rollouts(EnvConfig(id="notes-env", harness="trident", max_turns=4), ctx, n=3):
        assert rollout.ok, rollout.error
        branch = rollout.branches[0]
        ids, mask, logprobs = branch.token_ids, branch.loss_mask, branch.logprobs
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


@pytest.fixture
def running_dictionary(free_port):
    """notes-env's dictionary MCP server, started as its author would run it elsewhere; its URL."""
    port = free_port()
    env = {**os.environ, "MCP_PORT": str(port), "PYTHONPATH": str(USER_ENVS)}
    server = subprocess.Popen([sys.executable, "-m", "notes_env.dictionary"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, "the dictionary server did not start"
            time.sleep(0.5)
    yield url, server
    server.kill()
    server.wait()


def test_a_remote_mcp_server_by_url_serves_its_tools_and_its_absence_fails_the_rollouts(
    user_env_installed, inference_server, tiny_model_path, running_dictionary
):
    url, server = running_dictionary
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ctx = forced_tool_calls(tokenizer, inference_server, tiny_model_path, FORCED_DEFINE_CALL)
    env = EnvConfig(id="notes-env", args={"dictionary_url": url}, harness="trident", max_turns=6)
    defined = []
    for rollout in rollouts(env, ctx, n=2):
        assert rollout.ok, rollout.error
        ids, mask = rollout.branches[0].token_ids, rollout.branches[0].loss_mask
        prompt = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
        defined += [line for line in prompt.splitlines() if line.endswith(": a word from the notebook")]
    assert len(defined) == 10, defined  # 2 rollouts x 5 answered calls, each answered by the running server
    server.kill()
    server.wait()
    for rollout in rollouts(env, ctx, n=1):
        assert not rollout.ok and "cannot list the tools of MCP servers" in rollout.error and url in rollout.error


def test_a_model_played_user_talks_to_the_policy_and_only_the_policy_trains(inference_server, tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ctx = model_context(OrchestratorConfig(client={"base_url": inference_server}, sampling={"max_tokens": 16}),
                        tiny_model_path)  # fmt: skip
    rollout, user = rollouts(EnvConfig(id="reverse-text", verifiers_env="user-sim", max_turns=3), ctx, n=1)
    assert rollout.ok and rollout.seat == "assistant", rollout.error
    assert (user.seat, user.trained, user.branches) == ("user", False, [])  # the user's seat: a rollout, not trained
    assert rollout.turns == 3 and rollout.metrics["user_turns"] >= 3 and "similarity" in rollout.rewards
    branch = rollout.branches[0]
    ids, mask, logprobs = branch.token_ids, branch.loss_mask, branch.logprobs
    # the policy's sample: the user's persona (its own system prompt) is not in it; the user's words are prompt
    text = tokenizer.decode(ids)
    assert "role-playing a USER" not in text and text.count("<|im_start|>user") == 3
    report = check_sample(SampleRecord.from_tokens(0, ids, mask, logprobs), ChatFormat.from_tokenizer(tokenizer))
    assert report.errors == [] and report.role_counts()["user"]["trainable"] == 0


def test_a_taskset_that_brings_its_own_harness_runs_on_it_with_the_servers_tokens(
    user_env_installed, inference_server, tiny_model_path
):
    assert harness_for(EnvConfig(id="echo-twice")) == "echo-twice"  # declared by the package: kept
    assert harness_for(EnvConfig(id="echo-twice", harness="trident")) == HARNESS_ID
    assert harness_for(EnvConfig(id="notes-env")) == "bash"  # declares none: verifiers' default
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ctx = model_context(OrchestratorConfig(client={"base_url": inference_server}, sampling={"max_tokens": 8}),
                        tiny_model_path)  # fmt: skip
    for rollout in rollouts(EnvConfig(id="echo-twice"), ctx, n=2):
        assert rollout.ok and rollout.turns == 2 and rollout.rewards == {"replied_twice": 1.0}, rollout.error
        branch = rollout.branches[0]
        ids, mask, logprobs = branch.token_ids, branch.loss_mask, branch.logprobs
        assert tokenizer.decode(ids).count("Once more, please.") == 1  # the harness's own follow-up, as prompt
        report = check_sample(SampleRecord.from_tokens(0, ids, mask, logprobs), ChatFormat.from_tokenizer(tokenizer))
        assert report.errors == [] and report.role_counts()["assistant"]["trainable"] == sum(mask) > 0


def notes_env_rl(server: str, output_dir: Path, steps: int, rollout_workers: int = 1, also: tuple = (),
                 datasets: tuple = ()) -> list[str]:  # fmt: skip
    """``rl`` on the debug configs with notes-env (MCP tool servers per rollout), and the ``also`` [[env]] tables
    with the ``datasets`` [[datasets]] ones, against ``server``, at one prompt per environment (at least 2) × 2
    rollouts a step (not the debug configs' batch) and without their held-out evaluation, its rollouts run by the
    orchestrator or by ``rollout_workers`` worker processes (which then start the tool servers)."""
    configs = ROOT / "configs" / "debug" / "rl"
    env = [{"id": "notes-env", "harness": "trident", "max_turns": 2}, *also]
    return [sys.executable, "-m", "launch.main", "--no-plots", "--trainer", "@", str(configs / "train.toml"),
            "--orchestrator", "@", str(configs / "orch.toml"), "--orchestrator.client.base-url", server,
            "--max-steps", str(steps), "--output-dir", str(output_dir), "--orchestrator.env", json.dumps(env),
            "--orchestrator.datasets", json.dumps(list(datasets)),
            "--orchestrator.batch-size", str(max(2, len(env))), "--orchestrator.rollouts-per-example", "2",
            "--orchestrator.rollout-workers", str(rollout_workers), "--orchestrator.eval", "false"]  # fmt: skip


def hub_examples_on_local_rows(folder: Path) -> tuple[list[dict], list[dict]]:
    """[[env]] tables for the environments shaped as verifiers' reverse-text and gsm8k examples (their own
    ``load_dataset("<hub id>", ...)`` calls), and [[datasets]] tables giving those ids local rows written here."""
    folder.mkdir()
    (folder / "reverse-train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("stressed", "live")))
    (folder / "gsm8k-test.jsonl").write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}))
    # neither declares a harness: reverse-text runs verifiers' default, bash (its chat program, installed by uv, one
    # per rollout), as verifiers would run it; gsm8k Trident's in-process one, chosen by the user
    envs = [{"id": "hub-reverse-text"}, {"id": "hub-gsm8k", "harness": "trident", "args": {"split": "test"}}]
    datasets = [
        {"id": "PrimeIntellect/Reverse-Text-RL", "split": "train", "path": str(folder / "reverse-train.jsonl")},
        {"id": "openai/gsm8k", "name": "main", "split": "test", "path": str(folder / "gsm8k-test.jsonl")},
    ]
    return envs, datasets


def test_rl_trains_on_a_taskset_with_mcp_toolsets_and_on_hub_dataset_examples_given_local_rows(
    user_env_installed, inference_server, tmp_path
):
    """notes-env, and verifiers' reverse-text and gsm8k examples (their shape) reading local rows through
    [[datasets]], through rl for one step of 3 prompts x 2 rollouts (a second step sampled the same three again from the
    same base weights, async level 1): it trains on all three, and its samples' loss masks check out. reverse-text
    runs under verifiers' own default harness, bash: its prompts offer the bash and edit tools."""
    envs, datasets = hub_examples_on_local_rows(tmp_path / "rows")
    # each notes-env rollout starts its notebook's tool server (seconds of imports each)
    command = notes_env_rl(inference_server, tmp_path / "run", 1, also=tuple(envs), datasets=tuple(datasets))
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "run"
    orchestrator = read_metrics(run, "orchestrator")
    assert [r["step"] for r in orchestrator] == [1] and all(r["failed_rollouts"] == 0 for r in orchestrator)
    assert [r["step"] for r in read_metrics(run, "trainer")] == [1]
    samples = json.loads((run / "rollouts" / "step_1" / "batch.json").read_text())["samples"]
    assert {s["env"] for s in samples} == {"notes-env", "hub-reverse-text", "hub-gsm8k"}
    reward = {"notes-env": "looked_it_up", "hub-reverse-text": "similarity", "hub-gsm8k": "correct"}
    assert all(reward[s["env"]] in s["rewards"] for s in samples)
    rollouts, chat_format = open_step(run, 1, None)
    report = check_step(rollouts, chat_format)
    assert [p for p in report.all_problems() if p.severity == "error"] == []
    for sample in rollouts.samples:  # the bash harness's system prompt and tools, only where it ran
        text = chat_format.tokenizer.decode(sample.token_ids)
        bash = "You are a coding agent" in text and '"name": "bash"' in text and '"name": "edit"' in text
        assert bash == (sample.summary["env"] == "hub-reverse-text"), (sample.summary["env"], text[:2000])


def tool_servers(launcher: int) -> list[int]:
    """The running notes-env tool servers (``python -m notes_env.<toolset>``, in sessions of their own) of the run
    whose ``rl`` is ``launcher``."""

    def command(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone meanwhile
            return b""

    return [pid for pid in run_processes(launcher) if b"notes_env" in command(pid)]


def test_stopping_rl_during_a_tool_using_step_leaves_no_tool_server(user_env_installed, inference_server, tmp_path):
    """verifiers starts each tool server in a session of its own, outside the orchestrator's process group that rl
    stops, here from two rollout workers: SIGTERM to rl while they serve a step, and 30 s later no process of the
    run is left, workers and tool servers included."""
    command = notes_env_rl(inference_server, tmp_path, 20, rollout_workers=2)
    rl = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not ((tmp_path / "rl.lock").exists() and (tmp_path / "rl.lock").read_text() and
                   tool_servers(launcher := int((tmp_path / "rl.lock").read_text()))):  # fmt: skip
            assert rl.poll() is None and time.monotonic() < deadline, "no tool server started"
            time.sleep(0.2)
        os.kill(launcher, signal.SIGTERM)  # as a user stops a run
        assert rl.wait(timeout=60) == 130
        wait_gone(lambda: run_processes(launcher, started_pids(tmp_path).values()), timeout_s=30)
    finally:
        if rl.poll() is None:
            os.killpg(rl.pid, signal.SIGKILL)
