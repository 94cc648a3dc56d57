import asyncio

import pytest

from orchestrator.config import ClientConfig, OrchestratorConfig
from orchestrator.envs import model_context
from orchestrator.servers import Servers
from rl.config import ConfigError, parse_config
from rl.tiny_model import TINY_MODEL_ID, resolve_model_path


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
    servers = Servers(config.client.base_urls, 10, "base", model_context(config, resolve_model_path(TINY_MODEL_ID)))
    servers.clients[1].model = "lora-step-3"  # what server b serves the policy under

    async def groups():
        leases = [servers.lease(4) for _ in range(4)]
        contexts = [await lease.__aenter__() for lease in leases[:3]]  # three groups in flight
        await leases[1].__aexit__(None, None, None)  # b's group finished: b is the least loaded
        contexts.append(await leases[3].__aenter__())
        return contexts

    contexts = asyncio.run(groups())
    assert [c.client.base_url for c in contexts] == ["http://a:1/v1", "http://b:2/v1", "http://c:3/v1", "http://b:2/v1"]
    assert [c.model for c in contexts] == ["base", "lora-step-3", "base", "lora-step-3"]
    assert servers.reset_counts() == [4, 8, 4] and servers.rollouts == [0, 0, 0]
