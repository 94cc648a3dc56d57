"""A Trident process through a Ray actor on a local two-node Ray cluster (two raylets on this machine, as Ray's own
tests start them): placed by the plan on its node, its log copied to ``rl``'s side, its exit code reported, stopped
with its children by SIGTERM, and stopped on its node when its actor dies (what a lost ``rl`` does); a child of its
own is then left running (an xfail: not built); and ``rl --dry-run --ray.address`` reading that cluster's nodes.

Skipped without the ray extra: CI's install (``uv sync --locked --extra cpu``) has no ray;
``uv sync --locked --extra cpu --extra ray`` adds it.
"""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from launch.ray_actor import ProcessActor, RayChild
from launch.ray_cluster import connect, import_ray, live_nodes
from launch.ray_placement import STRATEGY, Process, bundles, node_selectors, place

try:
    ray = import_ray()
except ImportError:
    pytest.skip("the ray extra is not installed (CI's `uv sync --extra cpu` has none)", allow_module_level=True)

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

STORE = 80 * 2**20  # each node's object store: near Ray's least, the processes pass no objects


@pytest.fixture(scope="module")
def cluster():
    """A head of 1 CPU and a worker node of 2, each its own raylet; ``rl``'s driver connected."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE,
                                                            "include_dashboard": False})  # fmt: skip
    worker = cluster.add_node(num_cpus=2, object_store_memory=STORE)
    cluster.wait_for_nodes()
    connect(cluster.address)
    yield cluster, worker
    ray.shutdown()
    cluster.shutdown()


def start(argv: list[str], cpus: float, files: dict[str, str] | None = None):
    """Place a process of ``cpus`` CPUs by the plan, reserve its bundle, start its actor there."""
    placed = place(live_nodes("auto"), [Process("probe", 0, cpus)])
    group = placement_group(bundles(placed), strategy=STRATEGY, bundle_label_selector=node_selectors(placed))
    ray.get(group.ready(), timeout=60)
    actor = (
        ray.remote(ProcessActor)
        .options(num_cpus=cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0))
        .remote(argv, {"PROBE": "set by rl"}, files or {})
    )
    return placed[0].node, actor, group


def wait_for(condition, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def test_a_process_runs_on_its_planned_node_its_log_copied_and_its_exit_code_reported(cluster, tmp_path):
    _, worker = cluster
    config = tmp_path / "node" / "configs" / "probe.toml"
    script = "import os, sys; print(open(sys.argv[1]).read()); print(os.environ['PROBE']); sys.exit(3)"
    node, actor, group = start([sys.executable, "-c", script, str(config)], cpus=2, files={str(config): "x = 1"})
    assert node == worker.node_id  # 2 CPUs: only the worker node holds it
    assert ray.get(actor.node_id.remote()) == node
    child = RayChild("probe", actor, tmp_path / "logs" / "probe.log")
    assert wait_for(lambda: child.poll() is not None) and child.poll() == 3
    assert child.log_path.read_text() == "x = 1\nset by rl\n"
    ray.kill(actor)
    remove_placement_group(group)


def start_sleeper(tmp_path, name: str):
    """A process and a child of its own (as a server's engine or a trainer's ranks), both sleeping: its handle,
    their pids, its placement group."""
    sleeper = (
        "from contracts.lifeline import watch_launcher; watch_launcher(1); import os, subprocess, time; "
        "child = subprocess.Popen(['sleep', '120']); print(os.getpid(), child.pid, flush=True); time.sleep(120)"
    )
    _, actor, group = start([sys.executable, "-c", sleeper], cpus=1)
    child = RayChild(name, actor, tmp_path / "logs" / f"{name}.log")
    assert wait_for(lambda: child.poll() is None and child.log_path.read_text().strip())
    return child, [int(pid) for pid in child.log_path.read_text().split()], group


def running(pids: list[int]) -> list[int]:
    return [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def test_stop_ends_the_process_and_its_children(cluster, tmp_path):
    child, pids, group = start_sleeper(tmp_path, "stopped")
    child.stop(grace_s=5)
    assert child.code == -15
    assert wait_for(lambda: not running(pids)), f"of pids {pids}, {running(pids)} still run"
    remove_placement_group(group)


def test_a_dead_actor_takes_its_process_with_it(cluster, tmp_path):
    child, (pid, grandchild), group = start_sleeper(tmp_path, "orphaned")
    ray.kill(child.actor)  # as when rl is gone: Ray ends the actor's worker and its direct children
    assert wait_for(lambda: not running([pid])), f"pid {pid} still runs"
    left = wait_for(lambda: not running([grandchild]), timeout_s=5)
    if running([grandchild]):
        os.kill(grandchild, signal.SIGKILL)
    remove_placement_group(group)
    if not left:
        pytest.xfail(
            "not built: Ray SIGKILLs the actor's direct child, so its lifeline never stops its group and a child of "
            "the process is left running (docs/scaling.md#ray)"
        )


def test_rl_dry_run_plans_on_the_live_cluster_and_refuses_what_its_nodes_cannot_hold(cluster, tmp_path):
    from contracts.config import parse_config
    from contracts.errors import TridentError
    from launch.launcher import run
    from launch.rl_config import RLConfig, resolve_shared

    head = next(node["NodeID"] for node in ray.nodes() if node["Resources"].get("CPU") == 1)
    configs = Path(__file__).parents[2] / "configs" / "debug" / "rl"
    files = {"trainer": "train.toml", "orchestrator": "orch.toml", "inference": "infer.toml"}
    flags = [arg for key, name in files.items() for arg in (f"--{key}", "@", str(configs / name))]
    argv = [*flags, "--ray.address", cluster[0].address, "--output-dir", str(tmp_path), "--dry-run"]
    # the server (2 CPUs) takes the worker node, the trainer (1) the head, which has no CPU left for the orchestrator
    with pytest.raises(TridentError, match=rf"^the Ray cluster cannot hold the run: orchestrator needs 0 GPUs and 1 "
                                           rf"CPUs on trainer's node {head}; left after the processes before it: "
                                           rf"{head} 0 GPUs 0 CPUs \(cluster: 2 nodes, 0 GPUs\)$"):  # fmt: skip
        run(resolve_shared(parse_config(RLConfig, argv), on_gpu=False))
