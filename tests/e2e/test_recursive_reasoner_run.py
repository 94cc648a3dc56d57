"""The recursive-reasoner configs through ``rl`` on CPU with the tiny model: a LoRA planner whose JSON plans the
frozen base model carries out, served by the same server.

The random tiny model never writes valid JSON, so no plan would ever reach the worker: the test first teaches it two
fixed plans with a short SFT run (``trainer.sft``, 80 steps) and starts the RL run from there (3 steps of 4 prompts ×
8 rollouts); sampling with thinking on makes the planner's prompt end as the SFT transcripts' do (no empty
``<think></think>`` prefilled). At temperature 1 about two plans in five are then valid (41 of 96 in one run, 17 of
them decomposed), of both kinds. What is checked is the plumbing, not learning: worker calls named
the base model (also in rollouts whose planner ran on a LoRA adapter), only the planner's tokens are trainable,
malformed plans scored 0.
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from jsonl_files import write_jsonl
from recursive_reasoner import RecursiveReasonerConfig, RecursiveReasonerTaskset

from contracts.metrics import read_metrics
from tools.rollout_check import check_step, open_step, rollout_steps

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
CONFIGS = ROOT / "configs" / "recursive-reasoner" / "rl"
PROMPTS = 4  # a step's prompts, each with the configs' 8 rollouts (the configs' batch is 8 prompts)
SFT_STEPS = 80  # the loss levels off near 0.04 by then (about 2.5 at step 20)
PLANS = [
    {"should_decompose": False, "subproblems": [], "plan": ""},
    {"should_decompose": True, "subproblems": ["Find the cost.", "Find the change."], "plan": ""},
]


def teach_plans(folder: Path) -> Path:
    """The tiny model after SFT on planner transcripts (the env's own prompts, answered with one of :data:`PLANS`),
    trained in ``folder``."""
    tasks = RecursiveReasonerTaskset(RecursiveReasonerConfig(worker_model="unused", num_examples=64, seed=1))
    rows = [
        {"messages": [{"role": "system", "content": task.data.system_prompt},
                      {"role": "user", "content": task.data.prompt_text},
                      {"role": "assistant", "content": json.dumps(PLANS[i % 2])}]}
        for i, task in enumerate(tasks)
    ]  # fmt: skip
    data = folder / "planner.jsonl"
    folder.mkdir()
    write_jsonl(data, rows)
    argv = [sys.executable, "-m", "trainer.sft_main", "--model.name", "trident/tiny-qwen3", "--data.path", str(data),
            "--output-dir", str(folder / "sft"), "--max-steps", str(SFT_STEPS), "--optim.lr", "3e-3",
            "--seq-len", "1024"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # more threads on a busy 2-core machine run several times slower
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder / "sft" / "weights" / f"step_{SFT_STEPS}"


def test_recursive_reasoner_configs_run_on_cpu_with_the_tiny_model(tmp_path, free_port):
    port = free_port()
    base = str(teach_plans(tmp_path / "planner"))
    output_dir, log = tmp_path / "run", tmp_path / "reasoner.jsonl"
    args = {"worker_model": base, "worker_base_url": f"http://127.0.0.1:{port}/v1", "worker_max_tokens": 16,
            "token_budget": 256, "log_path": str(log)}  # fmt: skip
    argv = [sys.executable, "-m", "launch.main", "--no-plots", "--trainer", "@", str(CONFIGS / "train.toml"),
            "--orchestrator", "@", str(CONFIGS / "orch.toml"), "--inference", "@", str(CONFIGS / "infer.toml"),
            "--model.name", base, "--max-steps", "3", "--output-dir", str(output_dir), "--inference.port", str(port),
            "--orchestrator.env", json.dumps([{"id": "recursive-reasoner", "args": args}]),
            "--orchestrator.sampling.max-tokens", "48", "--orchestrator.sampling.enable-thinking", "true",
            "--orchestrator.batch-size", str(PROMPTS)]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [
        line.split(" |")[0] for line in result.stdout.splitlines() if line.startswith("step ") and " | " in line
    ] == [f"step {i}/3" for i in range(1, 4)]
    orchestrator = read_metrics(output_dir, "orchestrator")
    assert len(orchestrator) == 3 and all(r["failed_rollouts"] == 0 for r in orchestrator)
    assert all({"reward/correct", "reward/token_efficiency", "reward/independence"} <= set(r) for r in orchestrator)

    # One JSON line per rollout. Valid plans reached the worker, which always named the base model and was answered
    # as the base model, also in rollouts whose planner ran on a trained adapter (lora-step-N).
    rollouts = [json.loads(line) for line in log.read_text().splitlines()]
    planned = [r for r in rollouts if r["malformed"] is None]
    assert planned and {r["decomposed"] for r in planned} == {False, True}, Counter(r["malformed"] for r in rollouts)
    calls = [call for r in planned for call in r["calls"]]
    assert {(call["model"], call["served_model"]) for call in calls} == {(base, base)}
    assert {call["stage"] for call in calls} == {"direct", "subproblem", "combine"}
    assert any(r["planner_model"].startswith("lora-step-") for r in planned)
    assert {r["planner_model"] for r in rollouts} <= {base} | {f"lora-step-{step}" for step in range(1, 3)}
    assert all(r["calls"] == [] and r["tokens"] == r["planner_tokens"] for r in rollouts if r["malformed"])

    # Only the planner's tokens are trainable: every sample is one planner turn, its reply the only trained span.
    samples = []
    for step in rollout_steps(output_dir):
        report = check_step(*open_step(output_dir, step, None))
        assert [p.message for p in report.all_problems() if p.severity == "error"] == []
        for sample in report.samples:
            assert sample.record.summary["turns"] == 1
            trained = {role for role, turn in sample.role_counts().items() if turn["trainable"]}
            assert trained == {"assistant"} and [t.role for t in sample.segmentation.turns].count("assistant") == 1
            assert sample.record.num_trainable <= 48 + 1  # the reply, and the <|im_end|> the server adds after EOS
            samples.append(sample.record.summary)
    assert len(samples) == len(rollouts) == 3 * PROMPTS * 8
    assert all(set(s["rewards"]) == {"correct", "token_efficiency", "independence"} for s in samples)
    # a valid plan always earns token efficiency (at most 48 + 3 × 16 tokens of 256): zero reward <=> malformed
    zero = sum(all(score == 0.0 for score in s["rewards"].values()) for s in samples)
    assert zero == sum(r["malformed"] is not None for r in rollouts)
