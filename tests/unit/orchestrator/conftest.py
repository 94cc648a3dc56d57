"""An orchestrator whose server answers the weight routes from memory (no inference server)."""

import json

import httpx
import pytest

from contracts.delta_chain import read_delta_info
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.run import Orchestrator


class WeightsServer:
    """Answers the weight routes like an inference server serving weights ``step``; ``steps`` records each reload;
    a delta chain's weights it loads with their checksum."""

    def __init__(self):
        self.step, self.steps = 0, []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/reload_weights":
            self.step = json.loads(request.content)["step"]
            self.steps.append(self.step)
        else:
            return httpx.Response(200, json={"step": self.step, "path": "/weights", "adapter": None, "seconds": 0.01})
        chain = read_delta_info(json.loads(request.content)["path"])  # the copy of a delta chain's weights it loaded
        checksum = None if chain is None else chain.checksum
        answer = {"step": self.step, "path": "/weights", "adapter": None, "seconds": 0.01, "checksum": checksum}
        return httpx.Response(200, json=answer)


@pytest.fixture
def on_weights_server():
    """Builds an Orchestrator of a config with its one server a :class:`WeightsServer`; returns both."""

    def build(config: OrchestratorConfig) -> tuple[Orchestrator, WeightsServer]:
        orchestrator, server = Orchestrator(config), WeightsServer()
        client = orchestrator.servers.servers[0].client
        client.http = httpx.AsyncClient(base_url=client.base_url, transport=httpx.MockTransport(server.handle))
        return orchestrator, server

    return build
