"""overlap_steps: the next step's groups start while this step's slowest groups run (its tail, overlap_tail), once
the server serves weights that step may use, and never before."""

import asyncio
import json
import time

from rollouts import ONE_SAMPLED, TWO_SAMPLED, group, rollout

import orchestrator.loop.groups as groups_module
from contracts.metrics import read_metrics
from contracts.run_dir import mark_stable, weights_dir
from orchestrator.config import OrchestratorConfig


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_next_steps_groups_start_during_the_slowest_group_once_its_weights_are_served(
    tmp_path, monkeypatch, on_weights_server
):
    config = OrchestratorConfig(output_dir=tmp_path, batch_size=2, rollouts_per_example=2, async_level=1,
                                sample_rollouts_every=0, max_steps=3, overlap_tail=0.5)  # fmt: skip
    orchestrator, server = on_weights_server(config)
    started = []  # the weights step served as each group started

    def waiting_for(what: str) -> bool:
        return any(a.text == f"waiting for {what}" for a in orchestrator.progress.activities.values())

    slowest = asyncio.Event()

    async def run_group(env, task, n, ctx, limit, output_dir):
        started.append(server.step)
        if len(started) == 1:
            await slowest.wait()  # step 2's first group is its slowest
        return group(range(n), TWO_SAMPLED)

    monkeypatch.setattr(groups_module, "run_group", run_group)

    async def steps():
        step_2 = asyncio.create_task(orchestrator.step(2, start_next=True))  # on the base weights (step 0)
        await until(lambda: len(started) == 2)
        await until(lambda: waiting_for("the trainer's weights step 1"))  # in the tail (1 group of 2 left) ...
        assert len(started) == 2  # ... but step 3 needs weights 1: none yet
        weights = weights_dir(tmp_path, 1)
        weights.mkdir(parents=True)
        mark_stable(weights)
        await until(lambda: len(started) == 4)  # the server loads them, and step 3's groups start ...
        assert not step_2.done()  # ... while step 2's slowest group still runs
        slowest.set()
        await step_2
        await orchestrator.step(3)

    asyncio.run(steps())
    assert started == [0, 0, 1, 1] and server.steps == [1]
    metrics = read_metrics(tmp_path, "orchestrator")
    assert [m["weight_step"] for m in metrics] == [0, 1]
    assert metrics[0]["started_early_s"] == 0 and metrics[1]["started_early_s"] > 0
    for step, weight_step in [(2, 0), (3, 1)]:  # every sample records the weights its group started on
        batch = json.loads((tmp_path / "rollouts" / f"step_{step}" / "batch.json").read_text())
        assert {sample["weight_step"] for sample in batch["samples"]} == {weight_step}


def test_the_next_steps_groups_wait_for_this_steps_tail(tmp_path, monkeypatch, on_weights_server):
    """With weights at hand, the next step's groups still wait until at most overlap_tail of this step's groups run:
    sooner they would only share the server's batch with them."""
    config = OrchestratorConfig(output_dir=tmp_path, batch_size=4, rollouts_per_example=2, async_level=2,
                                sample_rollouts_every=0, max_steps=3, overlap_tail=0.25)  # fmt: skip
    orchestrator, server = on_weights_server(config)
    finish = [asyncio.Event() for _ in range(4)]  # step 1's groups end when told; step 2's at once
    started, returned = [], []
    running_when_next_started = []  # step 1's groups still running as step 2's first group started

    async def run_group(env, task, n, ctx, limit, output_dir):
        started.append(len(started))
        if len(started) <= 4:
            await finish[len(started) - 1].wait()
            returned.append(len(returned))
        elif len(started) == 5:
            running_when_next_started.append(4 - len(returned))
        return [rollout(1.0, ONE_SAMPLED)]

    def done_groups() -> int:  # as the orchestrator counted them
        return sum(a.done for a in orchestrator.progress.activities.values() if a.text == "sampling step 1")

    monkeypatch.setattr(groups_module, "run_group", run_group)

    async def steps():
        step_1 = asyncio.create_task(orchestrator.step(1, start_next=True))  # step 2 may use weights 0: served
        await until(lambda: len(started) == 4)
        for i in range(2):  # 3, then 2 groups of 4 left: more than a quarter
            finish[i].set()
            await until(lambda i=i: done_groups() == i + 1)  # seen by the orchestrator
        finish[2].set()
        await until(lambda: len(started) == 8)  # 1 of 4 left: step 2's groups start ...
        assert running_when_next_started == [1]  # ... not sooner ...
        assert not step_1.done()  # ... beside step 1's last
        finish[3].set()
        await step_1
        await orchestrator.step(2)

    asyncio.run(steps())
    assert [m["weight_step"] for m in read_metrics(tmp_path, "orchestrator")] == [0, 0]
