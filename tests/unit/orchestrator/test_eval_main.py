import asyncio
from types import SimpleNamespace

import httpx
import pytest
from rollouts import group

import orchestrator.loop.groups as groups_module
from contracts.errors import TridentError
from contracts.inference_api import Served
from contracts.metrics import read_metrics
from contracts.run_dir import mark_stable
from orchestrator.eval_main import EvalCliConfig, evaluate, serve_weights
from orchestrator.loop.run import Orchestrator


class FakeServers:
    """One server serving ``served``; records the changes eval asks of it."""

    def __init__(self, served: Served):
        self.calls = []
        self.now = served
        client = SimpleNamespace(served=self.served, use=lambda answer: None)
        self.servers = [SimpleNamespace(url="http://127.0.0.1:8000", client=client)]

    async def served(self) -> Served:
        return self.now

    async def reset_weights(self) -> None:
        self.calls.append("reset")
        self.now = Served(step=0, path="/models/base", adapter=None)

    async def reload_weights(self, path, step, tolerance) -> None:
        self.calls.append(("reload", step))
        self.now = Served(step=step, path=str(path.resolve()), adapter=None)


def config(**fields) -> EvalCliConfig:
    return EvalCliConfig(eval={"env": [{"id": "char-target"}]}, **fields)


@pytest.fixture
def weights(tmp_path):
    folder = tmp_path / "weights" / "step_20"
    folder.mkdir(parents=True)
    mark_stable(folder)
    return folder


A_RUNS = Served(step=7, path="/run/weights/step_7", adapter=None)  # a running run's server, mid-run


def test_eval_scores_what_the_server_serves_and_never_resets_it_unasked():
    servers = FakeServers(A_RUNS)
    assert asyncio.run(serve_weights(servers, config())) == A_RUNS
    assert servers.calls == []


def test_eval_loads_weights_into_a_server_serving_its_own_model_only(weights):
    fresh = FakeServers(Served(step=0, path="/models/base", adapter=None))
    assert asyncio.run(serve_weights(fresh, config(weights=weights))).step == 20
    assert fresh.calls == [("reload", 20)]
    busy = FakeServers(A_RUNS)
    with pytest.raises(TridentError, match=r"serves weights step 7 from /run/weights/step_7 .*pass --reset"):
        asyncio.run(serve_weights(busy, config(weights=weights)))
    assert busy.calls == []


def test_reset_lets_eval_replace_what_the_server_serves(weights):
    servers = FakeServers(A_RUNS)
    assert asyncio.run(serve_weights(servers, config(weights=weights, reset=True))).step == 20
    assert servers.calls == ["reset", ("reload", 20)]


def test_eval_runs_the_evaluation_part_alone(tmp_path, monkeypatch):
    """eval builds no training orchestrator: it asks the server what it serves, scores that on the held-out tasks
    and writes their record, and nothing else (no weights waited for or loaded, no batch, no training metrics)."""

    def no_orchestrator(self, config):
        raise AssertionError("eval built a training Orchestrator")

    monkeypatch.setattr(Orchestrator, "__init__", no_orchestrator)
    requests = []

    def server(request: httpx.Request) -> httpx.Response:
        requests.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={"step": 3, "path": "/run/weights/step_3", "adapter": None})

    class ToServer(httpx.AsyncClient):  # every client eval opens talks to ``server``
        def __init__(self, **kwargs):
            super().__init__(transport=httpx.MockTransport(server), **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", ToServer)
    groups = []

    async def run_group(env, task, n, ctx, limits, output_dir):
        groups.append((task.data.id, n))
        return group([1.0] + [0.0] * (n - 1))

    monkeypatch.setattr(groups_module, "run_group", run_group)
    config = EvalCliConfig(
        eval={"env": [{"id": "char-target", "args": {"seed": 1}}], "num_examples": 3, "rollouts_per_example": 2},
        output_dir=tmp_path,
    )
    record = asyncio.run(evaluate(config))

    assert len(groups) == 3 and {n for _, n in groups} == {2}  # each held-out task once, k rollouts
    assert record["step"] == 3 and record["eval/char-target/pass@2"] == 1.0
    assert record["eval/char-target/reward_mean"] == 0.5
    assert read_metrics(tmp_path, "eval") == [record]
    assert set(requests) == {"GET /health", "GET /weights"}  # what it serves was asked, never changed
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics"]  # no rollouts, weights or checkpoints
    assert [path.name for path in (tmp_path / "metrics").iterdir()] == ["eval.jsonl"]
