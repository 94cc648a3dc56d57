"""Each step's failed rollouts, and each evaluation's, are kept in the run, each with its full error and traceback,
where it was and its cause."""

import asyncio

from rollouts import ONE_SAMPLED, TWO_SAMPLED, rollout

from contracts.metrics import MetricsWriter, read_metrics
from contracts.model_path import TINY_MODEL_ID
from contracts.progress import Progress
from contracts.run_dir import FAILED_ROLLOUT_KEYS, clear_run_state
from orchestrator.config import EvalConfig
from orchestrator.loop.evaluation import Evaluation
from orchestrator.metrics.failed_rollouts import write_failed_rollouts

TRACEBACK = (
    "HarnessError: harness 'bash' exited 1: Traceback (most recent call last):\n"
    '  File "/tmp/tmpa1b2c3d4/run.py", line 3, in <module>\n    import nltk\n'
    "ModuleNotFoundError: No module named 'nltk'\n"
)


def failed(error: str, task: str, **fields):
    return rollout(0.0, ok=False, error=error, env="wiki", task=task, seat="agent", **fields)


def test_failed_rollouts_are_written_with_their_full_errors_step_by_step(tmp_path):
    step_1 = [[failed(TRACEBACK, "t0"), rollout(1.0, TWO_SAMPLED)], [failed("SandboxError: gone", "t1", lost=True)]]
    assert write_failed_rollouts(tmp_path, 1, step_1) == 2
    assert write_failed_rollouts(tmp_path, 2, [[rollout(1.0, TWO_SAMPLED)]]) == 0  # nothing failed: nothing written
    assert write_failed_rollouts(tmp_path, 3, [[failed(TRACEBACK.replace("a1b2c3d4", "e5f6a7b8"), "t2")]]) == 1
    records = read_metrics(tmp_path, "failed_rollouts")
    assert [set(r) for r in records] == [set(FAILED_ROLLOUT_KEYS)] * 3
    assert [(r["step"], r["task"], r["lost"]) for r in records] == [(1, "t0", False), (1, "t1", True), (3, "t2", False)]
    assert records[0]["error"] == TRACEBACK and records[1]["error"] == "SandboxError: gone"  # in full
    assert records[0]["cause"] == records[2]["cause"] == "HarnessError: ModuleNotFoundError: No module named 'nltk'"


def test_a_resumed_run_keeps_the_failures_of_the_steps_it_keeps(tmp_path):
    for step in (1, 2, 3):
        write_failed_rollouts(tmp_path, step, [[failed(f"TaskError: step {step}", "t0")]])
    clear_run_state(tmp_path, resume_from=2)
    assert [r["step"] for r in read_metrics(tmp_path, "failed_rollouts")] == [1, 2]


class FailingGroups:
    """Runs an evaluation's groups: each task's first rollout fails with a traceback, the others score 1."""

    async def run(self, env, task, k: int):
        error = rollout(0.0, ok=False, error="TaskError: no answer", traceback=TRACEBACK, env="char-target", task="t0")
        return [error, *(rollout(1.0, ONE_SAMPLED) for _ in range(k - 1))]


def test_an_evaluations_failed_rollouts_are_kept_marked_as_its_with_their_tracebacks(tmp_path):
    held_out = EvalConfig(env=[{"id": "char-target"}], num_examples=2, rollouts_per_example=2)
    metrics = MetricsWriter(tmp_path, "orchestrator")
    evaluation = Evaluation(held_out, TINY_MODEL_ID, FailingGroups(), metrics, Progress(None, "eval"))
    assert asyncio.run(evaluation.evaluate(4))["eval/char-target/failed"] == 2
    write_failed_rollouts(tmp_path, 5, [[failed("TaskError: step 5", "t0", traceback=TRACEBACK)]])  # training's
    records = read_metrics(tmp_path, "failed_rollouts")
    assert [(r["step"], r["eval"], r["env"], r["traceback"]) for r in records] == [
        (4, True, "char-target", TRACEBACK), (4, True, "char-target", TRACEBACK), (5, False, "wiki", TRACEBACK)
    ]  # fmt: skip
