import asyncio
import json
import logging

import httpx
import pytest
from rollouts import TWO_SAMPLED, group

import orchestrator.loop.groups as groups_module
import orchestrator.serving.servers as servers_module
from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.metrics import read_metrics
from contracts.model_path import TINY_MODEL_ID
from contracts.run_dir import mark_stable, weights_dir
from orchestrator.config import ClientConfig, OrchestratorConfig
from orchestrator.loop.groups import GroupRunner
from orchestrator.loop.run import Orchestrator
from orchestrator.serving.servers import Servers
from orchestrator.verifiers_adapter.envs import model_context
from orchestrator.verifiers_adapter.limits import RolloutLimits
from tools.tiny_model import built_model_path


def test_base_url_takes_one_server_or_several():
    assert ClientConfig().base_urls == ["http://127.0.0.1:8000"]
    several = ClientConfig(base_url="http://a:8000, http://b:8000")
    assert several.base_urls == ["http://a:8000", "http://b:8000"]
    config = parse_config(OrchestratorConfig, ["--client.base-url", '["http://a:1", "http://b:2"]'])
    assert config.client.base_urls == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match="client.base_url: .*several different ones"):
        parse_config(OrchestratorConfig, ["--client.base-url", "http://a:1,http://a:1"])


def test_each_group_goes_to_the_least_loaded_server_with_its_url_and_served_name():
    config = OrchestratorConfig(client={"base_url": "http://a:1,http://b:2,http://c:3"})
    ctx = model_context(config, built_model_path(TINY_MODEL_ID))
    servers = Servers(config.client.base_urls, 10, "base", stall_timeout_s=5)
    groups = GroupRunner(servers, ctx, RolloutLimits.of(1), group_size=1)
    servers.servers[1].client.model = "lora-step-3"  # what server b serves the policy under

    async def leases():
        leases = [servers.lease() for _ in range(4)]
        held = [await lease.__aenter__() for lease in leases[:3]]  # three groups in flight
        await leases[1].__aexit__(None, None, None)  # b's group finished: b is the least loaded
        held.append(await leases[3].__aenter__())
        return [groups.context(server) for server in held]

    contexts = asyncio.run(leases())
    assert [c.client.base_url for c in contexts] == ["http://a:1/v1", "http://b:2/v1", "http://c:3/v1", "http://b:2/v1"]
    assert [c.model for c in contexts] == ["base", "lora-step-3", "base", "lora-step-3"]


class FakeServer:
    """Answers like an inference server serving weights ``step``: alive, refusing connections, or stalled (every
    request times out)."""

    def __init__(self, step: int = 0, path: str = "/weights"):
        self.state, self.step, self.path, self.requests = "up", step, path, []
        self.broadcast_holds: int | None = None  # the only step the trainer's weight broadcast still sends

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        if self.state == "refusing":
            raise httpx.ConnectError("connection refused", request=request)
        if self.state == "stalled":
            raise httpx.ReadTimeout("timed out", request=request)
        if request.url.path == "/reload_weights":
            body = json.loads(request.content)
            if self.broadcast_holds not in (None, body["step"]):
                return httpx.Response(409, json={"error": f"{body['path']}: the trainer has sent newer weights"})
            self.step, self.path = body["step"], body["path"]
        if request.url.path == "/reset_weights":
            self.step, self.path = 0, "/base"
        return httpx.Response(200, json={"step": self.step, "path": self.path, "adapter": None, "seconds": 0.01})


def two_server_orchestrator(tmp_path, monkeypatch) -> tuple[Orchestrator, list[FakeServer]]:
    config = OrchestratorConfig(output_dir=tmp_path, batch_size=1, rollouts_per_example=2, sample_rollouts_every=0,
                                client={"base_url": "http://a:1,http://b:2", "stall_timeout_s": 1})  # fmt: skip
    orchestrator = Orchestrator(config)
    fakes = [FakeServer(), FakeServer()]
    for server, fake in zip(orchestrator.servers.servers, fakes, strict=True):
        server.client.http = httpx.AsyncClient(base_url=server.url, transport=httpx.MockTransport(fake.handle))
    monkeypatch.setattr(servers_module, "WATCH_INTERVAL_S", 0.01)
    return orchestrator, fakes


def test_a_group_whose_server_dies_runs_again_on_the_other(tmp_path, monkeypatch, caplog):
    orchestrator, (a, b) = two_server_orchestrator(tmp_path, monkeypatch)
    ran_on = []

    async def run_group(env, task, n, ctx, limit, output_dir):
        ran_on.append(ctx.client.base_url)
        if ctx.client.base_url == "http://a:1/v1":
            a.state = "refusing"  # it dies while the group runs: verifiers' calls fail
            return group(range(n), TWO_SAMPLED, ok=False, error="APIConnectionError: refused")
        return group(range(n), TWO_SAMPLED)

    monkeypatch.setattr(groups_module, "run_group", run_group)
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        asyncio.run(orchestrator.step(1))
    assert ran_on == ["http://a:1/v1", "http://b:2/v1"]
    assert [s.up for s in orchestrator.servers.servers] == [False, True]
    assert read_metrics(tmp_path, "orchestrator")[0]["samples"] == 2  # the group from b, once
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert (
        "inference server at http://a:1 cannot be reached (ConnectError): set aside, its rollouts go to the other 1"
        in messages
    )


def test_a_stalled_server_is_set_aside_mid_group_and_brought_to_the_runs_weights_when_it_answers(
    tmp_path, monkeypatch, caplog
):
    orchestrator, (a, b) = two_server_orchestrator(tmp_path, monkeypatch)
    (weights := weights_dir(tmp_path, 2)).mkdir(parents=True)
    mark_stable(weights)
    orchestrator.weights.served_step = a.step = b.step = 2
    cancelled = []

    async def run_group(env, task, n, ctx, limit, output_dir):
        if ctx.client.base_url == "http://a:1/v1" and not cancelled:
            a.state = "stalled"  # it hangs: only the watch notices
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
        return group(range(n), TWO_SAMPLED)

    async def steps():
        watch = asyncio.create_task(orchestrator.servers.watch())
        await orchestrator.step(3)  # a stalls: its group is cancelled and runs on b
        a.state, a.step = "up", 0  # it answers again, restarted on its base model
        await orchestrator.step(4)
        watch.cancel()

    monkeypatch.setattr(groups_module, "run_group", run_group)
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        asyncio.run(steps())
    assert cancelled == [True]
    assert [r["samples"] for r in read_metrics(tmp_path, "orchestrator")] == [2, 2]
    assert a.step == 2 and "POST /reload_weights" in a.requests  # the run's weights before any work
    assert all(s.up for s in orchestrator.servers.servers)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "inference server at http://a:1 stalled (no reply within 1s): set aside" in messages
    assert "inference server at http://a:1 serves weights step 0, not 2: loading step 2" in messages
    assert "inference server at http://a:1 is back, serving weights step 2" in messages


def test_a_server_back_after_the_broadcast_moved_on_stays_aside_until_the_next_reload_brings_it_back(
    tmp_path, monkeypatch, caplog
):
    """With the weight broadcast, a server restarted on its base model cannot get the run's weights step 2 once the
    trainer has sent step 3 (the server answers 409): it gets no work until the reload of step 3, in the same step."""
    orchestrator, (a, b) = two_server_orchestrator(tmp_path, monkeypatch)
    for step in (2, 3):
        (weights := weights_dir(tmp_path, step)).mkdir(parents=True)
        mark_stable(weights)
    orchestrator.weights.served_step = b.step = 2
    a.broadcast_holds = 3  # a restarted on its base model (step 0); the trainer holds step 3 only
    ran_on = []

    async def run_group(env, task, n, ctx, limit, output_dir):
        ran_on.append(ctx.client.base_url)
        return group(range(n), TWO_SAMPLED)

    monkeypatch.setattr(groups_module, "run_group", run_group)
    with caplog.at_level(logging.INFO, logger="orchestrator"):
        asyncio.run(orchestrator.step(4))
    assert a.requests.count("POST /reload_weights") == 2 and (a.step, b.step) == (3, 3)
    assert all(s.up for s in orchestrator.servers.servers) and ran_on == ["http://a:1/v1"]  # back before work
    messages = " ".join(r.getMessage() for r in caplog.records)
    back = "inference server at http://a:1 is back, serving weights step 3"
    aside = "inference server at http://a:1 could not load the run's weights ("
    assert aside in messages and back in messages and messages.index(aside) < messages.index(back)
    assert "is back, serving weights step 2" not in messages


def test_a_run_resets_a_server_only_from_its_own_weights_unless_told(tmp_path):
    """A run starts on a server serving its own model as it is, resets one left on this run's weights (a resumed
    run's), and refuses one serving another run's weights in one line naming it, unless ``reset``."""
    run_weights = tmp_path / "run" / "weights"
    fakes = {"http://base:1": FakeServer(), "http://resumed:2": FakeServer(3, str(run_weights / "step_3")),
             "http://other:3": FakeServer(7, str(tmp_path / "other" / "weights" / "step_7"))}  # fmt: skip

    def start(urls: list[str], reset: bool) -> None:
        servers = Servers(urls, 10, "base", stall_timeout_s=5)
        for server in servers.servers:
            handle = fakes[server.url].handle
            server.client.http = httpx.AsyncClient(base_url=server.url, transport=httpx.MockTransport(handle))
        asyncio.run(servers.serve_base_model(run_weights, reset))

    start(["http://base:1", "http://resumed:2"], reset=False)
    assert fakes["http://base:1"].requests == ["GET /weights"]  # nothing changed
    assert fakes["http://resumed:2"].requests == ["GET /weights", "POST /reset_weights"]
    other = fakes["http://other:3"]
    message = rf"^the inference server at http://other:3 serves weights step 7 from {tmp_path}/other/weights/step_7, "
    with pytest.raises(TridentError, match=message + r"not this run's: .*pass --orchestrator.reset"):
        start(["http://other:3"], reset=False)
    assert (other.requests, other.step) == (["GET /weights"], 7)
    start(["http://other:3"], reset=True)
    assert (other.requests[-1], other.step) == ("POST /reset_weights", 0)
