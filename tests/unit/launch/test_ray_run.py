"""What ``rl`` settles for a run on a Ray cluster once its actors are on their nodes, without Ray: the line naming
what Ray could not place, where the orchestrator reaches each server, the trainer ranks' rendezvous."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from contracts.config import parse_config
from contracts.inference_api import API_KEY_ENV
from launch.ray_placement import Placed
from launch.ray_run import RayRun, unplaced
from launch.rl_config import RLConfig, resolve_shared, teacher_server

C = Path(__file__).parents[3] / "configs" / "debug" / "rl"
DEBUG = ["--trainer", "@", str(C / "train.toml"), "--orchestrator", "@", str(C / "orch.toml"), "--inference", "@",
         str(C / "infer.toml"), "--ray.address", "head:6379", "--ray.shared-output-dir"]  # fmt: skip


def test_the_bundles_ray_could_not_place_are_named_with_what_their_node_has_free():
    placed = [Placed("inference", 0, "n0", (), 2), Placed("trainer", 0, "n1", (0,), 1),
              Placed("trainer", 1, "n2", (0,), 1), Placed("orchestrator", 0, "n1", (), 1)]  # fmt: skip
    free = {"n0": {"CPU": 2.0}, "n1": {"CPU": 4.0, "GPU": 0.0}}
    assert unplaced(placed, free) == [
        "trainer on node n1 (1 CPUs, 1 GPUs; 4 CPUs, 0 GPUs free)",
        "trainer-1 on node n2, which is not in the cluster",
    ]


class Ray:
    """What the run asks of Ray once its actors run: ``get`` of a value an actor gave."""

    @staticmethod
    def get(value):
        return value


def actor(port: int = 0):
    return SimpleNamespace(free_port=SimpleNamespace(remote=lambda: port))


def placed_run(placed: list[Placed], addresses: list[str], ports: list[int] | None = None) -> RayRun:
    """A :class:`RayRun` whose actors are on the nodes at ``addresses`` (no Ray)."""
    run = object.__new__(RayRun)
    run.ray, run.placed, run.addresses = Ray(), placed, addresses
    run.actors = [actor(port) for port in ports or [0] * len(placed)]
    return run


def test_the_orchestrator_reaches_the_server_at_its_nodes_address_with_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = resolve_shared(parse_config(RLConfig, [*DEBUG, "--output-dir", str(tmp_path)]), on_gpu=False)
    run = placed_run([Placed("inference", 0, "n0", (), 2), Placed("trainer", 0, "n1", (), 1),
                      Placed("orchestrator", 0, "n1", (), 1)], ["10.0.0.1", "10.0.0.2", "10.0.0.2"])  # fmt: skip
    env = run.reach_servers(config)
    assert config.inference.host == "0.0.0.0"  # the orchestrator's node is another
    assert config.orchestrator.client.base_url == "http://10.0.0.1:8000"
    assert len(env[API_KEY_ENV]) >= 32  # every route but /health then checks it
    monkeypatch.setenv(API_KEY_ENV, "the user's")
    assert run.reach_servers(config) == {}  # theirs reaches the processes with rl's other TRIDENT_* variables


def test_the_orchestrator_reaches_the_teacher_rl_starts_at_its_nodes_address(tmp_path, monkeypatch):
    """The teacher's server listens on every address of its node, like the policy's, and is reached with the run's
    key at its own node's address, not the policy server's."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    opd = ["--orchestrator.algorithm", "opd", "--orchestrator.teacher.model", "trident/tiny-qwen3"]
    config = resolve_shared(parse_config(RLConfig, [*DEBUG, *opd, "--output-dir", str(tmp_path)]), on_gpu=False)
    run = placed_run([Placed("inference", 0, "n0", (), 2), Placed("teacher", 0, "n1", (), 2),
                      Placed("trainer", 0, "n1", (), 1), Placed("orchestrator", 0, "n1", (), 1)],
                     ["10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.2"])  # fmt: skip
    env = run.reach_servers(config)
    assert (teacher_server(config).host, config.inference.host) == ("0.0.0.0", "0.0.0.0")
    assert config.orchestrator.teacher.base_url == "http://10.0.0.2:8001"
    assert config.orchestrator.client.base_url == "http://10.0.0.1:8000"
    assert config.orchestrator.teacher.api_key_var == API_KEY_ENV and len(env[API_KEY_ENV]) >= 32


def test_a_base_url_the_user_gave_is_kept(tmp_path):
    flags = ["--orchestrator.client.base-url", "http://10.9.9.9:8000", "--output-dir", str(tmp_path)]
    config = resolve_shared(parse_config(RLConfig, [*DEBUG, *flags]), on_gpu=False)
    run = placed_run([Placed("inference", 0, "n0", (), 2)], ["10.0.0.1"])
    run.reach_servers(config)
    assert config.orchestrator.client.base_url == "http://10.9.9.9:8000"


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_trainers_ranks_meet_at_their_first_ranks_node(ranks):
    trainer = [Placed("trainer", rank, f"n{rank + 1}", (0,), 1) for rank in range(ranks)]
    placed = [Placed("inference", 0, "n0", (0,), 2), *trainer]
    run = placed_run(placed, ["10.0.0.1", "10.0.0.2", "10.0.0.3"][: len(placed)], ports=[0, 29533, 0][: len(placed)])
    envs = run.rendezvous()
    if ranks == 1:
        assert envs == [{}, {}]  # the trainer alone makes its own one-rank group
        return
    world = {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29533", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
             "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
    assert envs == [{}, world | {"RANK": "0"}, world | {"RANK": "1"}]
