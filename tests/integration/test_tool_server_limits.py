"""The orchestrator's retries of a per-rollout MCP tool server, written as verifiers documents it, that crashes on
start (flaky_tools, started by verifiers as a process of its own): retried, lost past the retries, the step failing
past the bound on lost groups, and a step with 30% of starts crashing losing nothing. The other limits are checked in
tests/unit/orchestrator/test_limits.py."""

import asyncio
from pathlib import Path

import flaky_tools
import httpx
import pytest
from fake_policy import counting_server, rollouts_of

from contracts.errors import TridentError
from contracts.metrics import read_metrics
from contracts.run_dir import rollouts_dir
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.run import Orchestrator
from orchestrator.verifiers_adapter.limits import RolloutLimits


@pytest.fixture
def flaky_tools_starts(tmp_path, monkeypatch) -> Path:
    """The folder where each start of flaky_tools' server is counted; set ``FLAKY_TOOLS_FAILS`` to make it crash."""
    monkeypatch.setenv("PYTHONPATH", str(Path(flaky_tools.__file__).parent))
    monkeypatch.setenv("FLAKY_TOOLS_DIR", str(tmp_path))
    return tmp_path


def flaky_tools_step(output_dir: Path, rollouts: int, infra: dict) -> None:
    """Step 0 of an orchestrator on one flaky-tools task (``rollouts`` rollouts, ``infra`` as given), its model
    calls answered by a counting server and its weight routes from memory."""
    with counting_server() as server:
        config = OrchestratorConfig(
            output_dir=output_dir, env=[{"id": flaky_tools.ENV_ID}], batch_size=1, rollouts_per_example=rollouts,
            sample_rollouts_every=0, client={"base_url": server.base_url}, infra=infra,
        )  # fmt: skip
        orchestrator = Orchestrator(config)
        served = {"step": 0, "path": "/base", "adapter": None}
        orchestrator.servers.servers[0].client.http = httpx.AsyncClient(
            base_url=server.base_url, transport=httpx.MockTransport(lambda request: httpx.Response(200, json=served))
        )

        async def step():
            async with orchestrator.envs[0].serving():
                await orchestrator.step(1)

        asyncio.run(step())


def test_a_tool_server_that_crashes_on_its_first_start_is_retried(flaky_tools_starts, monkeypatch):
    monkeypatch.setenv("FLAKY_TOOLS_FAILS", "1")
    with counting_server() as server:
        limits = RolloutLimits.of(rollouts=1, setup_timeout_s=60, max_retries=2, backoff_s=0.01)
        (rollout,) = rollouts_of(flaky_tools.ENV_ID, server.base_url, 1, limits)
    assert rollout.ok and rollout.retries == 1 and not rollout.lost, rollout.error
    assert len(list(flaky_tools_starts.iterdir())) == 2


def test_a_tool_server_that_always_crashes_loses_its_group_naming_its_exit(flaky_tools_starts, monkeypatch):
    monkeypatch.setenv("FLAKY_TOOLS_FAILS", "99")
    with counting_server() as server:
        # noticed as it exits: verifiers would poll the dead server for 180 s, and the set-up would time out
        limits = RolloutLimits.of(rollouts=1, setup_timeout_s=600, max_retries=1, backoff_s=0.01)
        (rollout,) = rollouts_of(flaky_tools.ENV_ID, server.base_url, 1, limits)  # a group of one: 2 starts, not 4
    assert rollout.lost and rollout.retries == 1
    assert rollout.error == "ToolsetError: tool server exited with code 1 during set-up: flaky_tools: crashed on start"
    assert len(list(flaky_tools_starts.iterdir())) == 2  # 1 start + 1 retry


def test_a_tool_server_that_never_starts_loses_its_group_and_past_the_bound_the_step(flaky_tools_starts, monkeypatch):
    monkeypatch.setenv("FLAKY_TOOLS_HANG", "1")
    with pytest.raises(TridentError) as error:
        flaky_tools_step(flaky_tools_starts / "run", rollouts=2,
                         infra={"max_retries": 1, "retry_backoff_s": 0.01, "setup_timeout_s": 3})  # fmt: skip
    assert str(error.value) == (
        "step 1: 1 of 1 groups lost to infrastructure errors (more than infra.max_lost_groups = 0.5); first in "
        "environment 'flaky-tools' (task t0), after 1 retries: SetupTimeoutError: set-up took more than "
        "infra.setup_timeout_s = 3.0s"
    )
    assert not rollouts_dir(flaky_tools_starts / "run", 1).exists()


def test_with_30_percent_of_tool_server_starts_crashing_a_step_loses_nothing_and_counts_its_retries(
    flaky_tools_starts, monkeypatch
):
    monkeypatch.setenv("FLAKY_TOOLS_SHARE", "0.3")  # starts 3, 6, 9, ... crash: with 6 rollouts, starts 3 and 6
    starts_dir, output_dir = flaky_tools_starts / "starts", flaky_tools_starts / "run"
    starts_dir.mkdir()
    monkeypatch.setenv("FLAKY_TOOLS_DIR", str(starts_dir))
    flaky_tools_step(output_dir, rollouts=6,
                     infra={"max_retries": 2, "retry_backoff_s": 0.01, "max_concurrent_setups": 6,
                            "setup_timeout_s": 600})  # fmt: skip
    # 600 s, not 60: six servers importing verifiers at once on a loaded 2-core CI machine took over 60 s, and the
    # time-outs counted as three more retries (12 starts for 3 crashes)
    starts = len(list(starts_dir.iterdir()))
    crashed = sum(map(flaky_tools.crashes, range(starts)))
    assert crashed >= 2 and starts == 6 + crashed  # each crash was run again, and every rollout served
    (record,) = read_metrics(output_dir, "orchestrator")
    assert record["infra/flaky-tools/retries"] == crashed
    assert record["infra/flaky-tools/lost_groups"] == 0 and record["failed_rollouts"] == 0
    assert rollouts_dir(output_dir, 1).exists()  # the step's batch was written
