import asyncio
from types import SimpleNamespace

import pytest

from contracts.errors import TridentError
from contracts.inference_api import Served
from contracts.protocol import mark_stable
from orchestrator.eval_main import EvalCliConfig, serve_weights


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
