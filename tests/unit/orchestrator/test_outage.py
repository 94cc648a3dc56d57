"""The only inference server goes away mid-run and comes back restarted (serving the base model): the orchestrator
sets it aside, waits for it with backoff, makes it serve the run's weights again, and redoes the step."""

import asyncio
import logging

import httpx
import pytest
from rollouts import TWO_SAMPLED, group

import orchestrator.loop.groups as groups_module
import orchestrator.serving.client as client_module
from contracts.errors import TridentError
from contracts.run_dir import mark_stable, rollouts_dir, weights_dir
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.run import Orchestrator


class FakeServer:
    """Answers like the inference server: up, then down (connection refused), then up again after a restart."""

    def __init__(self, served_step: int):
        self.up, self.restarted = True, False
        self.weights = {"step": served_step, "path": "/run/weights", "adapter": None}
        self.requests: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/weights":
            return httpx.Response(200, json=self.weights)
        if request.url.path == "/reload_weights":
            self.weights = {"step": 2, "path": "/run/weights/step_2", "adapter": None}
            return httpx.Response(200, json={**self.weights, "seconds": 0.01})
        return httpx.Response(200)  # /health


def test_a_restarted_server_gets_the_runs_weights_back_and_the_step_is_redone(tmp_path, monkeypatch, caplog):
    config = OrchestratorConfig(output_dir=tmp_path, batch_size=1, rollouts_per_example=2, sample_rollouts_every=0)
    orchestrator = Orchestrator(config)
    for step in (1, 2):
        (weights := weights_dir(tmp_path, step)).mkdir(parents=True)
        mark_stable(weights)
    orchestrator.weights.served_step = 2  # the server served the run's step-2 weights, then went away
    server = FakeServer(served_step=2)
    orchestrator.servers.servers[0].client.http = httpx.AsyncClient(
        base_url="http://server", transport=httpx.MockTransport(server.handle)
    )
    sleeps = []

    async def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 3:  # the server is back, restarted: it serves the base model
            server.up, server.weights = True, {"step": 0, "path": "/base", "adapter": None}

    monkeypatch.setattr(client_module.asyncio, "sleep", sleep)
    attempts = []

    async def run_group(env, task, n, ctx, limit, output_dir):
        attempts.append(ctx.model)
        if len(attempts) == 1:  # the server dies while the step's rollouts run
            server.up = False
            return group(range(n), TWO_SAMPLED, ok=False, error="APIConnectionError")
        return group(range(n), TWO_SAMPLED)

    monkeypatch.setattr(groups_module, "run_group", run_group)
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        asyncio.run(orchestrator.step_surviving_outage(3))

    assert sleeps == [1.0, 2.0, 4.0]  # backing off while the server is down
    assert "POST /reload_weights" in server.requests  # the restarted server got the run's weights back
    assert orchestrator.weights.served_step == 2 and len(attempts) == 2
    assert weights_dir(tmp_path, 2).exists()  # what it serves again
    assert (rollouts_dir(tmp_path, 3) / "batch.json").exists()
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "inference server at http://127.0.0.1:8000 cannot be reached" in messages
    assert "step 3: no inference server answers (all 1 set aside); waiting up to 600s for one" in messages
    assert "serves weights step 0, not 2: loading step 2" in messages


def test_a_failure_with_the_server_up_is_not_retried(tmp_path, monkeypatch):
    config = OrchestratorConfig(output_dir=tmp_path, batch_size=1, rollouts_per_example=2, sample_rollouts_every=0)
    orchestrator = Orchestrator(config)
    server = FakeServer(served_step=0)
    orchestrator.servers.servers[0].client.http = httpx.AsyncClient(
        base_url="http://server", transport=httpx.MockTransport(server.handle)
    )

    async def run_group(env, task, n, ctx, limit, output_dir):
        # the environment fails, the server is fine
        return group(range(n), TWO_SAMPLED, ok=False, error="APIConnectionError")

    monkeypatch.setattr(groups_module, "run_group", run_group)
    with pytest.raises(TridentError, match=r"^step 0: no rollout produced a training sample: 2 failed \(APIConnection"):
        asyncio.run(orchestrator.step_surviving_outage(0))
