"""``rl`` on a Ray cluster (``--ray.address``, or a planned cluster): the cluster's nodes, the run's processes placed
on them (:mod:`launch.ray_placement`), how files travel between the nodes, and the memory plan per GPU; what
``rl --dry-run`` prints, and the one line that refuses a plan that cannot work."""

import os
from dataclasses import dataclass

from contracts.errors import TridentError
from launch.memory_plan import MemoryPlan, plan_memory
from launch.ray_placement import STRATEGY, Node, Placed, PlacementError, Process, nodes_apart, place
from launch.rl_config import TEACHER, RayConfig, RLConfig, servers, started_servers, teacher_server, trainer_ranks

# CPUs each process reserves: a server's API process and engine, a trainer rank, the orchestrator and each of its
# rollout workers
SERVER_CPUS, RANK_CPUS, ORCHESTRATOR_CPUS = 2, 1, 1


def planned_nodes(ray: RayConfig) -> list[Node]:
    """The nodes of a planned cluster: ``node-0``, ``node-1``, ... each as ``--ray.planned-*`` says."""
    return [Node(f"node-{i}", ray.planned_gpus_per_node, ray.planned_cpus_per_node) for i in range(ray.planned_nodes)]


def import_ray():
    """The ``ray`` module, for processes that each node runs with its own install of Trident: Ray's copying of a
    ``uv run`` project to every worker (read when ray is imported) is turned off. ImportError without the extra."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    return ray


def connect(address: str):
    """Connect ``rl`` to the Ray cluster at ``address`` (once); the ``ray`` module."""
    try:
        ray = import_ray()
    except ImportError:
        raise TridentError(
            f"--ray.address {address}: ray is not installed here; `uv sync --extra cpu --extra ray` (or gpu) adds it"
        ) from None
    try:
        if not ray.is_initialized():
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as e:
        raise TridentError(f"--ray.address {address}: no Ray cluster there ({e})") from None
    return ray


HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives its head node alone


def live_nodes(address: str) -> list[Node]:
    """The alive nodes of the Ray cluster at ``address``, by node id, with their GPUs and CPUs: the head first, then
    the others in the cluster's order (the plan fills them in this order)."""
    alive = [node for node in connect(address).nodes() if node["Alive"]]
    alive.sort(key=lambda node: HEAD_RESOURCE not in node["Resources"])
    return [Node(node["NodeID"], int(node["Resources"].get("GPU", 0)), node["Resources"].get("CPU", 0))
            for node in alive]  # fmt: skip


def cluster_nodes(ray: RayConfig) -> list[Node]:
    """The planned cluster where one is planned, else the live one at ``--ray.address``."""
    return planned_nodes(ray) if ray.planned_nodes is not None else live_nodes(ray.address)


def run_processes(config: RLConfig, on_gpu: bool) -> list[Process]:
    """What the run needs placed, in the order it is placed: each server (its ``tensor_parallel_size`` GPUs on one
    node), the teacher's server rl starts (as a server, on GPUs of its own), the trainer's ranks (a GPU each, over as
    many nodes as it takes), the orchestrator beside the trainer's first rank (their batches and checkpoints are
    files in output_dir)."""
    gpus = on_gpu
    processes = [Process(name, server.tensor_parallel_size if gpus else 0, SERVER_CPUS)
                 for name, server in started_servers(config).items()]  # fmt: skip
    processes.append(Process("trainer", 1 if gpus else 0, RANK_CPUS, ranks=trainer_ranks(config, on_gpu)))
    workers = config.orchestrator.rollout_workers
    processes.append(Process("orchestrator", 0, ORCHESTRATOR_CPUS + (workers if workers > 1 else 0), beside="trainer"))
    return processes


def file_routes(config: RLConfig, placed: list[Placed]) -> list[str]:
    """How batches, checkpoints and weights travel between the nodes, for a person; a TridentError in one line
    where they must cross nodes and cannot (output_dir not shared, and no in-memory weight broadcast)."""
    shared = config.ray.shared_output_dir
    trainer_nodes = sorted({p.node for p in placed if p.process == "trainer"})
    servers_apart = sorted(nodes_apart(placed, "trainer", set(servers(config))))
    broadcast = config.trainer.weight_broadcast
    if shared:
        lines = ["  files: output_dir is shared by every node (--ray.shared-output-dir): batches, checkpoints and "
                 "weights go through it"]  # fmt: skip
    else:
        lines = [f"  files: output_dir is on each node's own disk; the orchestrator and the trainer's first rank "
                 f"share {trainer_nodes[0]}, where the batches and checkpoints are"]  # fmt: skip
    if len(trainer_nodes) > 1 and not shared:
        raise TridentError(
            f"the trainer's ranks span nodes {', '.join(trainer_nodes)} and each rank reads the batch from output_dir: "
            "put output_dir on a filesystem every node sees and say --ray.shared-output-dir, or give the trainer "
            "the GPUs of one node"
        )
    if servers_apart and broadcast is not None:
        if broadcast.host in ("127.0.0.1", "localhost", "::1"):
            raise TridentError(
                f"trainer.weight_broadcast.host = {broadcast.host}: the servers on {', '.join(servers_apart)} cannot "
                "reach the trainer's store there; set it to the trainer's node's address"
            )
        lines.append(f"  weights: in-memory broadcast from the trainer to the servers on {', '.join(servers_apart)}")
    elif servers_apart and not shared:
        raise TridentError(
            f"the servers on {', '.join(servers_apart)} load each step's weights from output_dir/weights, which "
            "only the trainer's node sees: say --ray.shared-output-dir (output_dir on NFS, Lustre, ...) or set "
            "trainer.weight_broadcast (in memory)"
        )
    elif servers_apart:
        lines.append(f"  weights: through output_dir/weights, which the servers on {', '.join(servers_apart)} read")
    else:
        lines.append("  weights: on the trainer's node (no server elsewhere)")
    return lines


def gpu_numbers(nodes: list[Node]) -> dict[str, int]:
    """The cluster-wide number of each node's GPU 0: the nodes' GPUs numbered one after another, for the memory
    plan (node-1's GPU 0 is GPU 8 on nodes of 8)."""
    first, offsets = 0, {}
    for node in nodes:
        offsets[node.name] = first
        first += node.gpus
    return offsets


@dataclass(frozen=True)
class RayPlan:
    """A run placed on a Ray cluster: the nodes, each placed rank, the lines that say where and how, the memory."""

    nodes: list[Node]
    placed: list[Placed]
    lines: list[str]
    memory: MemoryPlan


def plan_ray_run(config: RLConfig, gpu_gib: float | None) -> RayPlan:
    """Place the run on its Ray cluster with GPUs of ``gpu_gib`` GiB (``--gpu-memory-gib``, which a cluster with GPUs
    needs; None: a CPU cluster); a TridentError in one line for a run that does not fit or cannot work there."""
    teacher, ids = teacher_server(config), config.teacher_gpu_ids
    if teacher is not None and ids is not None and gpu_gib is not None and len(ids) != teacher.tensor_parallel_size:
        raise TridentError(
            f"--teacher-gpu-ids {ids}: the teacher's server needs inference.tensor_parallel_size = "
            f"{teacher.tensor_parallel_size} GPUs (on a Ray cluster the ids only count them)"
        )
    nodes = cluster_nodes(config.ray)
    cluster_gpus = sum(node.gpus for node in nodes)
    if cluster_gpus and gpu_gib is None:
        raise TridentError(f"the Ray cluster has {cluster_gpus} GPUs: give --gpu-memory-gib (each GPU's GiB) for "
                           "the memory plan")  # fmt: skip
    if gpu_gib is not None and not cluster_gpus:
        raise TridentError(f"--gpu-memory-gib {gpu_gib:g}: the Ray cluster has no GPU (--ray.planned-gpus-per-node)")
    try:
        placed = place(nodes, run_processes(config, gpu_gib is not None))
    except PlacementError as e:
        raise TridentError(str(e)) from None
    numbers = gpu_numbers(nodes)

    def cluster_ids(names: set[str]) -> list[int]:
        return [numbers[p.node] + gpu for p in placed if p.process in names for gpu in p.gpus]

    memory = plan_memory(config.trainer, config.inference, cluster_ids({"trainer"}), cluster_ids(set(servers(config))),
                         gpu_gib, teacher, cluster_ids({TEACHER}))  # fmt: skip
    if problems := memory.problems():
        raise TridentError(f"the run does not fit in memory: {'; '.join(problems)} (rl --dry-run prints the plan)")
    lines = [f"placement on the Ray cluster ({len(nodes)} nodes; one placement group of {len(placed)} bundles, "
             f"strategy {STRATEGY}, each pinned to its node: the run starts whole or not at all):"]  # fmt: skip
    ranked = sum(p.process == "trainer" for p in placed) > 1
    for p in placed:
        rank = f" rank {p.rank}" if p.process == "trainer" and ranked else ""
        where = f"GPU {','.join(map(str, p.gpus))} (cluster GPU {','.join(str(numbers[p.node] + g) for g in p.gpus)})"
        lines.append(f"  {p.process}{rank}: {p.node}, {where if p.gpus else 'no GPU'}, {p.cpus:g} CPUs")
    return RayPlan(nodes, placed, lines + file_routes(config, placed), memory)
