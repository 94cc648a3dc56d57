"""A named run (``orchestrator.run_id``) on an inference server other runs share: it loads, reads, probes, resets
and releases only its own adapters, its requests carry its id, and its share of the server becomes metrics."""

import asyncio
import json

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from rollouts import TWO_SAMPLED, group
from verifiers.v1.clients.train import TrainClient

import orchestrator.loop.groups as groups_module
from contracts.errors import TridentError
from contracts.inference_api import RUN_HEADER, RunShare, adapter_name
from contracts.metrics import read_metrics
from contracts.model_path import TINY_MODEL_ID
from contracts.run_dir import ADAPTER_CONFIG, Probe, write_probe
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.run import Orchestrator
from orchestrator.serving.client import InferenceClient
from orchestrator.serving.run_share import share_metrics
from orchestrator.serving.servers import Servers
from orchestrator.verifiers_adapter.envs import at_server, model_context
from tools.tiny_model import built_model_path

RUN = "lr=1e-05"
BASE = {"step": 0, "path": "/base", "adapter": None}


class SharedServer:
    """Answers Trident's routes as a server that several runs share: what it serves each run (None: the unnamed
    run), each named run's share counters, and every request as (method, path, query, body, its run header)."""

    def __init__(self, has_runs: bool = True):
        self.served: dict[str | None, dict] = {}
        self.shares: dict[str, dict] = {}  # run -> in_flight, limit, waiting, waited_s, requests
        self.has_runs = has_runs  # False: an older server, without GET /runs
        self.probe_logprobs: list | None = None  # its answer to a probe (prompt_logprobs)
        self.requests: list[tuple] = []

    def state(self, run: str | None) -> dict:
        return self.served.get(run, BASE)

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        path, query = request.url.path, dict(request.url.params)
        self.requests.append((request.method, path, query, body, request.headers.get(RUN_HEADER)))
        if path == "/weights":
            return httpx.Response(200, json=self.state(query.get("run")))
        if path == "/load_adapter":
            self.served[body["run"]] = {"step": body["step"], "path": body["path"],
                                        "adapter": adapter_name(body["step"], body["run"])}  # fmt: skip
            return httpx.Response(200, json={**self.state(body["run"]), "seconds": 0.01})
        if path == "/reset_weights":
            run = (body or {}).get("run")
            self.served.pop(run, None)
            return httpx.Response(200, json={**self.state(run), "seconds": 0.01})
        if path == "/runs" and self.has_runs:
            return httpx.Response(200, json={run: {**self.state(run), **share} for run, share in self.shares.items()})
        if path == "/release_run":
            self.served.pop(body["run"], None)
            self.shares.pop(body["run"], None)
            return httpx.Response(200, json={})
        if path == "/inference/v1/generate":
            return httpx.Response(200, json={"prompt_logprobs": self.probe_logprobs})
        if path == "/health":
            return httpx.Response(200)
        return httpx.Response(404, json={"detail": "Not Found"})

    def sent(self, method: str, path: str) -> list[tuple]:
        return [r for r in self.requests if r[:2] == (method, path)]


def on(client: InferenceClient, server: SharedServer) -> InferenceClient:
    """``client`` talking to ``server``, with the headers it sends to a real one."""
    client.http = httpx.AsyncClient(base_url=client.base_url, headers=client.http.headers,
                                    transport=httpx.MockTransport(server.handle))  # fmt: skip
    return client


def adapter_folder(path, token_ids: list[int], logprobs: list[float]):
    path.mkdir(parents=True)
    (path / ADAPTER_CONFIG).write_text("{}")
    write_probe(path, Probe(token_ids, logprobs))
    return path


def test_a_named_run_loads_probes_and_resets_only_its_own_adapters(tmp_path):
    server = SharedServer()
    server.served["other"] = {"step": 5, "path": "/other/weights/step_5", "adapter": "other/lora-step-5"}
    server.probe_logprobs = [None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -2.0}}]
    client = on(InferenceClient("http://server", 10, "base", run=RUN), server)
    folder = adapter_folder(tmp_path / "weights" / "step_2", [5, 6, 7], [0.0, -1.0, -2.0])

    async def reload_probe_reset():
        await client.reload_weights(folder, 2)
        loaded = client.model
        gap = await client.check_probe(folder, 2, tolerance=1e-3)
        await client.reset_weights()
        return loaded, gap

    assert asyncio.run(reload_probe_reset()) == (f"{RUN}/lora-step-2", 0.0)
    assert client.model == "base"
    assert server.sent("POST", "/load_adapter")[0][3] == {"path": str(folder), "step": 2, "in_flight": False,
                                                          "run": RUN}  # fmt: skip
    assert [r[2] for r in server.sent("GET", "/weights")] == [{"run": RUN}]
    assert server.requests[2][3]["model"] == f"{RUN}/lora-step-2"  # the probe asks for this run's adapter
    assert server.sent("POST", "/reset_weights")[0][3] == {"run": RUN}
    assert server.served == {"other": {"step": 5, "path": "/other/weights/step_5", "adapter": "other/lora-step-5"}}
    assert {r[4] for r in server.requests} == {RUN}  # every request carries the run's id, the probe's too


def test_an_unnamed_run_sends_what_it_always_did(tmp_path):
    server = SharedServer()
    client = on(InferenceClient("http://server", 10, "base"), server)
    folder = adapter_folder(tmp_path / "step_1", [5, 6], [0.0, -1.0])
    asyncio.run(client.reload_weights(folder, 1))
    asyncio.run(client.reset_weights())
    assert server.sent("POST", "/load_adapter")[0][3]["run"] is None and client.model == "base"
    assert server.sent("GET", "/weights")[0][2] == {} and server.sent("POST", "/reset_weights")[0][3] is None
    assert {r[4] for r in server.requests} == {None}
    assert server.served == {}


def test_a_named_run_refuses_full_weights_in_one_line_before_asking_the_server(tmp_path):
    server = SharedServer()
    client = on(InferenceClient("http://server", 10, "base", run=RUN), server)
    (full := tmp_path / "weights" / "step_1").mkdir(parents=True)
    with pytest.raises(TridentError, match=rf"^orchestrator.run_id = '{RUN}': {full} holds full weights, .*LoRA only"):
        asyncio.run(client.reload_weights(full, 1))
    assert server.requests == []


def test_an_adapter_refused_with_409_is_a_refusal_naming_the_servers_reason(tmp_path):
    """A 409 from /load_adapter (the server holds adapters of as many runs as it can) is not a superseded
    broadcast: the run stops with the server's reason."""
    folder = adapter_folder(tmp_path / "step_1", [5, 6], [0.0, -1.0])
    reason = "3 named runs already hold adapters on this server, the most its [lora] max_loras allows"
    client = InferenceClient("http://server", 10, "base", run=RUN)
    client.http = httpx.AsyncClient(base_url="http://server", transport=httpx.MockTransport(
        lambda request: httpx.Response(409, json={"detail": reason})))  # fmt: skip
    with pytest.raises(TridentError, match=r"failed to load .*\(/load_adapter\): .*max_loras allows"):
        asyncio.run(client.reload_weights(folder, 1))


def test_a_named_run_starts_on_a_server_whatever_other_runs_are_served_and_resets_only_its_own(tmp_path):
    """Other runs' adapters and the unnamed run's weights are no reason to refuse or reset: a named run looks at its
    own state only. A resumed run whose adapters are still served resets them; one whose adapters were evicted
    starts as it is; a run of the same id from another output folder is refused in one line naming the run id."""
    run_weights = tmp_path / "run" / "weights"
    others = {None: {"step": 7, "path": "/unnamed/weights/step_7", "adapter": None},
              "other": {"step": 5, "path": "/other/weights/step_5", "adapter": "other/lora-step-5"}}  # fmt: skip

    def start(own: dict | None) -> SharedServer:
        server = SharedServer()
        server.served = {**others, **({RUN: own} if own else {})}
        servers = Servers(["http://server"], 10, "base", stall_timeout_s=5, run=RUN)
        on(servers.servers[0].client, server)
        asyncio.run(servers.serve_base_model(run_weights, reset=False))
        assert {run: state for run, state in server.served.items() if run != RUN} == others
        return server

    evicted = start(None)
    assert [r[:3] for r in evicted.requests] == [("GET", "/weights", {"run": RUN})]
    resumed = start({"step": 3, "path": str(run_weights / "step_3"), "adapter": f"{RUN}/lora-step-3"})
    assert [r[1] for r in resumed.requests] == ["/weights", "/reset_weights"] and RUN not in resumed.served
    assert resumed.requests[1][3] == {"run": RUN}
    with pytest.raises(TridentError, match=rf"step 4 from /elsewhere/step_4, not this run's: another run with "
                                           rf"orchestrator.run_id = '{RUN}' may be using it"):  # fmt: skip
        start({"step": 4, "path": "/elsewhere/step_4", "adapter": f"{RUN}/lora-step-4"})


def test_a_named_runs_generation_requests_carry_its_id(monkeypatch):
    """The header goes from the orchestrator's model context through verifiers' training client and Trident's
    transport onto the wire; an unnamed run's requests carry none."""
    seen = []

    async def generate(request):
        seen.append(request.headers.get(RUN_HEADER))
        return web.json_response({"choices": []})

    async def post(config: OrchestratorConfig):
        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate)
        async with TestServer(app) as server:
            base = str(server.make_url("")).rstrip("/")
            ctx = at_server(model_context(config, built_model_path(TINY_MODEL_ID)), f"{base}/v1", "m")
            client = TrainClient(ctx.client).client
            try:
                await client.post(f"{base}/inference/v1/generate", body={"token_ids": [1]})
            finally:
                await client.close()

    asyncio.run(post(OrchestratorConfig(run_id=RUN)))
    asyncio.run(post(OrchestratorConfig()))
    assert seen == [RUN, None]


def test_share_metrics_sum_the_servers_and_count_the_step_from_the_counters(tmp_path):
    def share(in_flight, limit, waited_s, requests) -> RunShare:
        return RunShare(**BASE, in_flight=in_flight, limit=limit, waiting=0, waited_s=waited_s, requests=requests)

    before = {"http://a": share(0, 4, 1.0, 10), "http://b": share(0, 2, 5.0, 30)}
    # b restarted since (its counters began again), c is new
    now = {"http://a": share(2, 4, 3.5, 18), "http://b": share(1, 2, 0.5, 4), "http://c": share(0, 8, 0.25, 2)}
    assert share_metrics(before, now) == {"share/in_flight": 3, "share/limit": 14, "share/wait_s": 2.5 + 0.5 + 0.25,
                                          "share/requests": 8 + 4 + 2}  # fmt: skip
    assert share_metrics(before, {}) == {}


def named_run(tmp_path, monkeypatch, server: SharedServer, run_id: str | None = RUN, fail: bool = False,
              hang: asyncio.Event | None = None):  # fmt: skip
    """An orchestrator of two steps (no trained weights needed) on ``server``; each group adds 3 requests that
    waited 0.5 s in all to the run's share counters, or fails with ``fail``, or with ``hang`` sets it and never
    ends."""
    config = OrchestratorConfig(output_dir=tmp_path, batch_size=1, rollouts_per_example=2, sample_rollouts_every=0,
                                max_steps=2, async_level=2, run_id=run_id)  # fmt: skip
    orchestrator = Orchestrator(config)
    on(orchestrator.servers.servers[0].client, server)

    async def run_group(env, task, n, ctx, limit, output_dir):
        if fail:
            return group(range(n), TWO_SAMPLED, ok=False, error="ProviderError: Error code: 500")
        if hang:
            hang.set()
            await asyncio.Event().wait()
        counters = server.shares.setdefault(RUN, {"in_flight": 0, "limit": 4, "waiting": 0, "waited_s": 0.0,
                                                  "requests": 0})  # fmt: skip
        counters["waited_s"] += 0.5
        counters["requests"] += 3
        counters["in_flight"] = 1
        return group(range(n), TWO_SAMPLED)

    monkeypatch.setattr(groups_module, "run_group", run_group)
    return orchestrator


def test_a_named_run_logs_its_share_of_each_step_and_releases_the_run_at_its_end(tmp_path, monkeypatch):
    server = SharedServer()
    server.shares[RUN] = {"in_flight": 0, "limit": 4, "waiting": 0, "waited_s": 7.0, "requests": 40}  # from before
    asyncio.run(named_run(tmp_path, monkeypatch, server).run())
    records = read_metrics(tmp_path, "orchestrator")
    assert [{k: v for k, v in r.items() if k.startswith("share/")} for r in records] == [
        {"share/in_flight": 1, "share/limit": 4, "share/wait_s": 0.5, "share/requests": 3}
    ] * 2
    assert server.sent("POST", "/release_run")[0][3] == {"run": RUN} and server.requests[-1][1] == "/release_run"
    assert RUN not in server.shares


def test_a_named_run_that_fails_still_releases_the_run(tmp_path, monkeypatch):
    server = SharedServer()
    with pytest.raises(TridentError, match="^step 1: no rollout produced a training sample"):
        asyncio.run(named_run(tmp_path, monkeypatch, server, fail=True).run())
    assert server.sent("POST", "/release_run")[0][3] == {"run": RUN}


def test_a_named_run_cancelled_mid_step_releases_the_run(tmp_path, monkeypatch):
    server = SharedServer()

    async def cancel_mid_step():
        sampling = asyncio.Event()
        run = asyncio.create_task(named_run(tmp_path, monkeypatch, server, hang=sampling).run())
        await sampling.wait()
        assert not server.sent("POST", "/release_run")
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(cancel_mid_step())
    assert server.sent("POST", "/release_run")[0][3] == {"run": RUN}


class GoneAtRelease(SharedServer):
    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/release_run":
            raise httpx.ConnectError("connection refused", request=request)
        return super().handle(request)


def test_a_release_the_server_does_not_answer_does_not_hide_the_runs_error(tmp_path, monkeypatch, caplog):
    with pytest.raises(TridentError, match="^step 1: no rollout produced a training sample"):
        asyncio.run(named_run(tmp_path, monkeypatch, GoneAtRelease(), fail=True).run())
    assert f"could not release run {RUN!r} on the inference server at http://127.0.0.1:8000" in caplog.text


@pytest.mark.parametrize("run_id, has_runs", [(None, True), (RUN, False)])
def test_no_share_metrics_for_an_unnamed_run_or_from_a_server_without_runs(run_id, has_runs, tmp_path, monkeypatch):
    server = SharedServer(has_runs=has_runs)
    asyncio.run(named_run(tmp_path, monkeypatch, server, run_id=run_id).run())
    assert not [k for r in read_metrics(tmp_path, "orchestrator") for k in r if k.startswith("share/")]
    assert bool(server.sent("POST", "/release_run")) == (run_id is not None)
    if run_id is None:
        assert not server.sent("GET", "/runs") and {r[4] for r in server.requests} == {None}
