"""Where each process of a run goes on a Ray cluster, planned before anything starts.

Pure: the cluster's nodes and the run's processes in, each process's node and GPUs out, or a :class:`PlacementError`
naming what does not fit. Each placed process becomes one bundle of a Ray placement group pinned to its node
(:func:`bundles`, :func:`node_selectors`), so Ray reserves the whole run at once or none of it, and the plan
``rl --dry-run`` prints is the placement Ray makes. GPUs are counted per node here; which physical GPUs of a node a
process gets, Ray chooses.
"""

from dataclasses import dataclass

# the placement group's strategy: each bundle is pinned to its node (by the node-id label), so the strategy only
# says to keep them together; a group is reserved whole or not at all whatever its strategy
STRATEGY = "PACK"
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives each node: its id


class PlacementError(ValueError):
    """The cluster cannot hold the run: one line naming the process that does not fit."""


@dataclass(frozen=True)
class Node:
    """A node of the cluster: its Ray node id (or a planned node's name) and what it offers."""

    name: str
    gpus: int
    cpus: float


@dataclass(frozen=True)
class Process:
    """A process of the run: ``ranks`` copies (a trainer's ranks, which may span nodes), each needing ``gpus`` GPUs
    on one node and ``cpus`` CPUs; ``beside``: a process whose first rank's node it must share (the orchestrator
    shares the trainer's, where their batches and checkpoints are)."""

    name: str
    gpus: int
    cpus: float
    ranks: int = 1
    beside: str | None = None


@dataclass(frozen=True)
class Placed:
    """One rank of a process on its node, with the node's GPUs it holds (numbered within the node)."""

    process: str
    rank: int
    node: str
    gpus: tuple[int, ...]
    cpus: float


def place(nodes: list[Node], processes: list[Process]) -> list[Placed]:
    """Place each rank of each process, in the order given, on the first node with room for it (GPUs and CPUs),
    a process with ``beside`` on that process's first node; a :class:`PlacementError` for the first that finds none.

    No GPU is shared: on a cluster each process holds its GPUs alone.
    """
    free_gpus = {node.name: list(range(node.gpus)) for node in nodes}
    free_cpus = {node.name: node.cpus for node in nodes}
    placed: list[Placed] = []
    for process in processes:
        for rank in range(process.ranks):
            candidates = [node.name for node in nodes]
            if process.beside is not None:
                candidates = [next(p.node for p in placed if p.process == process.beside)]
            node = next(
                (n for n in candidates if len(free_gpus[n]) >= process.gpus and free_cpus[n] >= process.cpus), None
            )
            if node is None:
                raise PlacementError(refusal(process, rank, candidates, free_gpus, free_cpus, nodes))
            gpus, free_gpus[node] = tuple(free_gpus[node][: process.gpus]), free_gpus[node][process.gpus :]
            free_cpus[node] -= process.cpus
            placed.append(Placed(process.name, rank, node, gpus, process.cpus))
    return placed


def refusal(
    process: Process,
    rank: int,
    candidates: list[str],
    free_gpus: dict[str, list[int]],
    free_cpus: dict[str, float],
    nodes: list[Node],
) -> str:
    """The line that says ``process`` (its ``rank``) fits on none of ``candidates``, and what each has left."""
    who = f"{process.name} rank {rank}" if process.ranks > 1 else process.name
    where = "on one node" if process.beside is None else f"on {process.beside}'s node {candidates[0]}"
    left = ", ".join(f"{n} {len(free_gpus[n])} GPUs {free_cpus[n]:g} CPUs" for n in candidates)
    offered = f"{len(nodes)} nodes, {sum(n.gpus for n in nodes)} GPUs"
    return (
        f"the Ray cluster cannot hold the run: {who} needs {process.gpus} GPUs and {process.cpus:g} CPUs {where}; "
        f"left after the processes before it: {left} (cluster: {offered})"
    )


def bundles(placed: list[Placed]) -> list[dict[str, float]]:
    """The placement group's bundles, one per placed rank in order: its CPUs and GPUs."""
    return [{"CPU": p.cpus, **({"GPU": len(p.gpus)} if p.gpus else {})} for p in placed]


def node_selectors(placed: list[Placed]) -> list[dict[str, str]]:
    """Each bundle's label selector (``bundle_label_selector``): the node the plan put it on."""
    return [{NODE_ID_LABEL: p.node} for p in placed]


def nodes_apart(placed: list[Placed], process: str, others: set[str]) -> set[str]:
    """The nodes of ``others`` that hold none of ``process``'s ranks: where its files are not local."""
    own = {p.node for p in placed if p.process == process}
    return {p.node for p in placed if p.process in others} - own
