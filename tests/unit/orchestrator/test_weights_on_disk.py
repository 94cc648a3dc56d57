"""How many weights folders a run keeps (docs/operations.md#disk-use): the orchestrator, moving the server to the
newest, deletes every older folder but the one served until then (requests admitted under it may still read it),
while the trainer writes up to ``async_level + 1`` folders ahead of the server: ``async_level + 3`` at most."""

import asyncio

from contracts.run_dir import mark_stable, step_dirs, weights_dir
from orchestrator.config import OrchestratorConfig


def test_a_run_keeps_at_most_async_level_plus_3_weights_folders(tmp_path, on_weights_server):
    orchestrator, server = on_weights_server(OrchestratorConfig(output_dir=tmp_path, async_level=1))

    def trainer_writes(*steps: int) -> list[int]:
        for step in steps:
            weights_dir(tmp_path, step).mkdir(parents=True)
            mark_stable(weights_dir(tmp_path, step))
        return list(step_dirs(tmp_path / "weights"))

    assert trainer_writes(1) == [1]
    asyncio.run(orchestrator.weights.update(1))
    # Served 1, the orchestrator samples steps up to 1 + 1 + async_level = 3 without a reload: the trainer writes
    # weights 2 and 3 meanwhile.
    assert trainer_writes(2, 3) == [1, 2, 3]
    asyncio.run(orchestrator.weights.update(2))  # the newest is loaded: 3; 2 is deleted, 1 (served until now) kept
    assert (server.steps, list(step_dirs(tmp_path / "weights"))) == ([1, 3], [1, 3])
    assert trainer_writes(4, 5) == [1, 3, 4, 5]  # the bound: async_level + 3 = 4 folders
    asyncio.run(orchestrator.weights.update(4))
    assert (server.steps, list(step_dirs(tmp_path / "weights"))) == ([1, 3, 5], [3, 5])
