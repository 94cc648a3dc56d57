"""What the orchestrator and its rollout workers send each other: a message read back is the message sent, and a
task that cannot be sent is one error naming its environment and the way out, before any worker starts. The
workers themselves (processes) are tested in tests/integration/test_rollout_workers.py."""

import asyncio

import pytest
from rollouts import rollout, sampled

from contracts.errors import TridentError
from orchestrator.config import EnvConfig, InfraConfig, OrchestratorConfig
from orchestrator.loop.workers import RolloutWorkers, frame, receive


def test_messages_read_back_as_sent_one_after_another():
    done = rollout(0.5, sampled([1, 2, 3], 1, [-0.1, -0.2]), rewards={"exact": 0.5}, turns=2, task="t0",
                   env="reverse-text", setup_s=0.25)  # fmt: skip
    sent = [("run", 1, EnvConfig(id="reverse-text"), {"prompt": "abc"}, 2, "http://h:8000/v1", "tiny"),
            ("done", 1, [done] * 2), ("cancel", 7)]  # fmt: skip

    async def read_back() -> list[tuple]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(map(frame, sent)))
        reader.feed_eof()
        received = [await receive(reader) for _ in sent]
        with pytest.raises(asyncio.IncompleteReadError):  # the other side closed
            await receive(reader)
        return received

    assert asyncio.run(read_back()) == sent


def test_a_task_that_cannot_be_sent_is_one_error_before_any_worker_starts():
    class LocalTask:  # defined in a function: pickle cannot send it
        pass

    workers = RolloutWorkers(2, OrchestratorConfig(), InfraConfig(), "unused")
    run = workers.run_group(EnvConfig(id="my-env"), LocalTask(), 2, "http://h:8000/v1", "tiny", "KEY_VAR")
    with pytest.raises(TridentError, match=r"^environment 'my-env': its task LocalTask cannot be sent to a rollout "
                                           r"worker \(.+\); .* rollout_workers = 1$"):  # fmt: skip
        asyncio.run(run)
    assert workers.pids == []
