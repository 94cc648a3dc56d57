"""How many weights folders a run keeps (docs/operations.md#disk-use): the orchestrator, moving the server to the
newest, deletes every older folder but the one served until then (requests admitted under it may still read it),
while the trainer writes up to ``async_level + 1`` folders ahead of the server: ``async_level + 3`` at most."""

import asyncio

from contracts.delta_chain import DeltaInfo, write_delta_info
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


def test_a_delta_chain_keeps_its_folders_from_its_full_copy_on(tmp_path, on_weights_server):
    orchestrator, server = on_weights_server(OrchestratorConfig(output_dir=tmp_path, async_level=1))

    def trainer_writes(step: int, full_step: int) -> None:
        folder, full = weights_dir(tmp_path, step), step == full_step
        folder.mkdir(parents=True)
        base = None if full else step - 1
        write_delta_info(folder, DeltaInfo(step=step, kind="full" if full else "delta", full_step=full_step,
                                           base_step=base, base_checksum=None if full else f"{base:016x}",
                                           checksum=f"{step:016x}", dtype="bfloat16"))  # fmt: skip
        mark_stable(folder)

    trainer_writes(1, full_step=1)
    asyncio.run(orchestrator.weights.update(1))
    trainer_writes(2, full_step=1)
    trainer_writes(3, full_step=1)
    asyncio.run(orchestrator.weights.update(2))  # loads 3, a delta: 2 stays with it, as a restarted server replays 1-3
    assert (server.steps, list(step_dirs(tmp_path / "weights"))) == ([1, 3], [1, 2, 3])
    trainer_writes(4, full_step=4)  # a full copy: a new chain
    trainer_writes(5, full_step=4)
    asyncio.run(orchestrator.weights.update(4))  # loads 5: the old chain goes but 3, served until now
    assert (server.steps, list(step_dirs(tmp_path / "weights"))) == ([1, 3, 5], [3, 4, 5])
