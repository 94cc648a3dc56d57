"""``rl`` on a Ray cluster: the plan's placement group reserved whole (or one line naming what Ray could not place),
one :class:`~launch.ray_actor.ProcessActor` in each of its bundles, the addresses the processes reach each other at
(taken from the actors' nodes), each process started there and handed to ``rl``'s supervision as a
:class:`~launch.ray_actor.RayChild`, and all of it stopped at the end: every process, every actor, the group."""

import logging
import os
import secrets
from pathlib import Path

from contracts.config import ENV_PREFIX
from contracts.errors import TridentError
from contracts.inference_api import API_KEY_ENV, is_loopback
from contracts.lifeline import GRACE_S, LAUNCHER_PID_ENV
from contracts.run_spec import run_spec_path
from launch.process import command
from launch.ray_actor import ProcessActor, RayChild
from launch.ray_cluster import RayPlan, import_ray
from launch.ray_placement import STRATEGY, Placed, bundles, node_selectors
from launch.rl_config import TEACHER, RLConfig, servers, started_urls, teacher_server

logger = logging.getLogger("rl")

ALL_ADDRESSES = "0.0.0.0"  # where a server on Ray listens: the orchestrator may be on another node


def process_name(placed: Placed) -> str:
    """The name ``rl`` supervises a placed rank by: its process's, ``trainer-1``, ... for the trainer's other ranks."""
    return placed.process if placed.rank == 0 else f"{placed.process}-{placed.rank}"


def unplaced(placed: list[Placed], free: dict[str, dict[str, float]]) -> list[str]:
    """What Ray could not place, by the nodes' ``free`` resources now (node id -> resource -> amount; a node not
    there is gone): each bundle its node cannot hold, as ``trainer on node N (1 CPUs; 0 CPUs free)``."""
    lines = []
    for p in placed:
        needs = {"CPU": p.cpus, **({"GPU": len(p.gpus)} if p.gpus else {})}
        if p.node not in free:
            lines.append(f"{process_name(p)} on node {p.node}, which is not in the cluster")
        elif any(free[p.node].get(resource, 0) < amount for resource, amount in needs.items()):
            wants = ", ".join(f"{amount:g} {name}s" for name, amount in needs.items())
            has = ", ".join(f"{free[p.node].get(name, 0):g} {name}s" for name in needs)
            lines.append(f"{process_name(p)} on node {p.node} ({wants}; {has} free)")
    return lines


def process_env() -> dict[str, str]:
    """What each process gets over its node's environment, as on one machine: ``rl``'s ``TRIDENT_*`` variables (its
    cache, its key, config values), one OpenMP thread and no tokenizer threads unless ``rl``'s environment says
    otherwise."""
    env = {key: value for key, value in os.environ.items() if key.startswith(ENV_PREFIX) and key != LAUNCHER_PID_ENV}
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    env["TOKENIZERS_PARALLELISM"] = os.environ.get("TOKENIZERS_PARALLELISM", "false")
    return env


class RayRun:
    """The run's placement group and its actors on the cluster, one per placed rank, in the plan's order."""

    def __init__(self, plan: RayPlan, timeout_s: float):
        """Reserve the plan's placement group, whole or not at all: a TridentError in one line naming what could not
        be placed when Ray has not reserved it within ``timeout_s``; then create each rank's actor in its bundle."""
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray, self.placed, self.children = ray, plan.placed, {}
        self.group = placement_group(bundles(plan.placed), strategy=STRATEGY,
                                     bundle_label_selector=node_selectors(plan.placed))  # fmt: skip
        if not self.group.wait(timeout_seconds=timeout_s):
            from ray._private.state import available_resources_per_node  # a DeveloperAPI of Ray's

            remove_placement_group(self.group)
            free = available_resources_per_node()
            missing = unplaced(plan.placed, free) or ["each node has room for its processes now: try again"]
            raise TridentError(f"the Ray cluster did not reserve the run's placement group within {timeout_s:g}s "
                               f"(--ray.placement-timeout-s): {'; '.join(missing)} (`ray status` shows the "
                               "cluster)")  # fmt: skip
        self.actors = [
            ray.remote(ProcessActor)
            .options(
                num_cpus=p.cpus,
                num_gpus=len(p.gpus),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, index),
            )
            .remote()
            for index, p in enumerate(plan.placed)
        ]
        self.addresses = ray.get([actor.node_address.remote() for actor in self.actors])

    def address_of(self, name: str) -> str:
        """The address of the node process ``name`` (its rank 0) runs on."""
        return next(a for p, a in zip(self.placed, self.addresses, strict=True) if process_name(p) == name)

    def reach_servers(self, config: RLConfig) -> dict[str, str]:
        """Where the servers rl starts are reached: each listens on every address of its node (a loopback
        ``inference.host`` becomes ``0.0.0.0``, the teacher's server's too), and the orchestrator reaches each at its
        node's address (the policy's servers unless it is given its own ``client.base_url``). Returns the environment
        every process gets for it: the key requests carry (``$TRIDENT_API_KEY``, one made for the run where rl's
        environment has none)."""
        if config.inference is None:
            return {}
        ours = config.orchestrator.client.base_urls == started_urls(config)
        if is_loopback(config.inference.host):
            config.inference.host = ALL_ADDRESSES
        if ours:
            urls = [f"http://{self.address_of(name)}:{server.port}" for name, server in servers(config).items()]
            config.orchestrator.client.base_url = urls[0] if len(urls) == 1 else urls
            logger.info(f"the orchestrator reaches the servers at their nodes' addresses: {', '.join(urls)}")
        if (teacher := teacher_server(config)) is not None:
            teacher.host = config.inference.host
            url = config.orchestrator.teacher.base_url = f"http://{self.address_of(TEACHER)}:{teacher.port}"
            logger.info(f"the orchestrator reaches the teacher's server at its node's address: {url}")
        if os.environ.get(API_KEY_ENV):
            return {}
        logger.info(f"the servers listen on {config.inference.host}: rl made a key for this run's requests "
                    f"(${API_KEY_ENV} sets your own)")  # fmt: skip
        return {API_KEY_ENV: secrets.token_urlsafe(32)}

    def rendezvous(self) -> list[dict[str, str]]:
        """Each placed rank's torch.distributed environment (as torchrun sets it): for a trainer of several ranks,
        its rank, the world's size and its first rank's node and a port free there; nothing for one rank. Ray gives
        each rank its own GPUs (``CUDA_VISIBLE_DEVICES``), so each is its node's local rank 0."""
        ranks = [i for i, p in enumerate(self.placed) if p.process == "trainer"]
        if len(ranks) < 2:
            return [{} for _ in self.placed]
        first = ranks[0]
        port = self.ray.get(self.actors[first].free_port.remote())
        world = {"MASTER_ADDR": self.addresses[first], "MASTER_PORT": str(port), "WORLD_SIZE": str(len(ranks)),
                 "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
        return [world | {"RANK": str(p.rank)} if p.process == "trainer" else {} for p in self.placed]

    def start(self, modules: dict[str, str], paths: dict[str, Path], output_dir: Path, env: dict[str, str]
              ) -> dict[str, RayChild]:  # fmt: skip
        """Start each placed rank's process (``modules``: process -> module; ``paths``: process -> its resolved config,
        which its actor writes on its node with the run spec) with ``env``; their handles, by name."""
        spec = run_spec_path(output_dir)
        env = process_env() | env
        starting = []
        for p, actor, rank_env in zip(self.placed, self.actors, self.rendezvous(), strict=True):
            files = {str(paths[p.process]): paths[p.process].read_text(), str(spec): spec.read_text()}
            argv = command(modules[p.process], paths[p.process])
            starting.append((p, actor, actor.start.remote(argv, env | rank_env, files)))
        for (p, actor, pid), address in zip(starting, self.addresses, strict=True):
            name = process_name(p)
            child = RayChild(name, actor, output_dir / "logs" / f"{name}.log", p.node, address)
            self.children[name] = child
            logger.info(f"started {name} (pid {self.ray.get(pid)}) on node {p.node} ({address}), log: "
                        f"{child.log_path}")  # fmt: skip
        return self.children

    def stop(self, grace_s: float = GRACE_S) -> None:
        """Stop every process (SIGTERM to its group on its node, SIGKILL after ``grace_s``), all at once, copy their
        last lines, end every actor, and remove the placement group."""
        from ray.util.placement_group import remove_placement_group

        stopping = [(child, child.actor.stop.remote(grace_s)) for child in self.children.values()]
        for child, ref in stopping:
            child.finish(ref, grace_s)
        for actor in self.actors:
            self.ray.kill(actor)
        remove_placement_group(self.group)
