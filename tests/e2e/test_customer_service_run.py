"""The customer-service configs through ``rl`` on CPU with the tiny model (multi-turn dialogues with the scripted
customer, scored by all four rewards, trained, and the loss masks checked), and the model-played customer talking
to a real inference server."""

import asyncio
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from customer_service import CustomerServiceConfig, CustomerServiceTaskset, model_customer

from contracts.metrics import read_metrics
from tools.rollout_check import check_step, open_step

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
CONFIGS = ROOT / "configs" / "customer-service" / "rl"
REWARDS = {"goal_resolved", "no_wrong_action", "politeness", "brevity"}


def short_reply_env() -> list[dict]:
    """The configs' env with max_reply_words 10: a random model's replies then differ in brevity, the one reward
    it can earn unevenly, so advantages are not all zero."""
    env = tomllib.loads((CONFIGS / "orch.toml").read_text())["env"]
    env[0]["args"]["max_reply_words"] = 10
    env[0]["args"]["max_turns"] = 3  # a few customer turns prove the dialogue; more only cost CI time
    return env


def test_customer_service_configs_run_on_cpu_with_the_tiny_model(tmp_path, inference_server):
    # trainer and orchestrator as configured, against the session's server (rl starts none without --inference)
    argv = [sys.executable, "-m", "launch.main", "--no-plots", "--trainer", "@", str(CONFIGS / "train.toml"),
            "--orchestrator", "@", str(CONFIGS / "orch.toml"), "--orchestrator.client.base-url", inference_server,
            "--model.name", "trident/tiny-qwen3", "--max-steps", "2", "--output-dir", str(tmp_path),
            # the tiny model never stops by itself: every turn runs to max_tokens, 64 keeps a step near a minute
            "--orchestrator.sampling.max-tokens", "64",
            # 2 scenarios × 4 dialogues a step, not the configs' 4 × 8: each group's rewards still differ in brevity
            "--orchestrator.batch-size", "2", "--orchestrator.rollouts-per-example", "4",
            "--orchestrator.env", json.dumps(short_reply_env())]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [
        line.split(" |")[0] for line in result.stdout.splitlines() if line.startswith("step ") and " | " in line
    ] == [f"step {i}/2" for i in range(1, 3)]
    orchestrator = read_metrics(tmp_path, "orchestrator")
    assert len(orchestrator) == 2 and all(r["failed_rollouts"] == 0 for r in orchestrator)

    samples = json.loads((tmp_path / "rollouts" / "step_1" / "batch.json").read_text())["samples"]
    assert {s["env"] for s in samples} == {"customer-service"}
    assert all(set(s["rewards"]) == REWARDS for s in samples)
    # the tiny model never calls a tool nor stops by itself: the customer answers each reply until max_turns
    assert max(s["turns"] for s in samples) > 1
    assert all(s["rewards"]["no_wrong_action"] == 1.0 for s in samples)
    assert len({s["reward"] for s in samples}) > 1 and any(s["advantage"] != 0 for s in samples)

    # the loss-mask checker passes (scripts/check_loss_mask.py's checks, in-process)
    report = check_step(*open_step(tmp_path, None, None))
    assert [p for p in report.all_problems() if p.severity == "error"] == []


def test_model_customer_talks_through_the_inference_server(inference_server):
    config = CustomerServiceConfig(
        num_examples=1,
        customer="model",
        customer_model="trident/tiny-qwen3",
        customer_base_url=f"{inference_server}/v1",
        customer_max_tokens=16,
    )
    task = next(iter(CustomerServiceTaskset(config))).data
    messages = [
        {"role": "system", "content": task.system_prompt},
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": "Sorry to hear that. What is your order number?"},
    ]
    reply = asyncio.run(model_customer.model_reply(messages, task))
    assert isinstance(reply, str) and reply.strip()  # the random tiny model writes noise, but it answers
