"""The Ray placement plan, pure (no Ray cluster, no ray installed): each process on its node and GPUs, whole or
refused in one line naming what does not fit, and the placement group's bundles pinned to the planned nodes."""

import pytest

from launch.ray_placement import NODE_ID_LABEL, Node, PlacementError, Process, bundles, node_selectors, place

TWO_NODES_OF_8 = [Node("node-0", 8, 32), Node("node-1", 8, 32)]


def run(servers: int, tp: int, trainer_gpus: int) -> list[Process]:
    return [*(Process(f"inference-{i}", tp, 2) for i in range(servers)), Process("trainer", 1, 1, ranks=trainer_gpus),
            Process("orchestrator", 0, 1, beside="trainer")]  # fmt: skip


def test_servers_fill_the_first_node_the_trainer_the_second_the_orchestrator_beside_its_first_rank():
    placed = place(TWO_NODES_OF_8, run(servers=4, tp=2, trainer_gpus=8))
    where = {(p.process, p.rank): (p.node, p.gpus) for p in placed}
    assert [where[(f"inference-{i}", 0)] for i in range(4)] == [("node-0", (2 * i, 2 * i + 1)) for i in range(4)]
    assert [where[("trainer", r)] for r in range(8)] == [("node-1", (r,)) for r in range(8)]
    assert where[("orchestrator", 0)] == ("node-1", ())


def test_no_gpu_is_held_twice_and_a_small_run_stays_on_one_node():
    placed = place(TWO_NODES_OF_8, run(servers=2, tp=2, trainer_gpus=4))
    held = [(p.node, gpu) for p in placed for gpu in p.gpus]
    assert len(held) == len(set(held)) == 8
    assert {p.node for p in placed} == {"node-0"}


def test_a_tensor_parallel_server_never_spans_nodes():
    with pytest.raises(PlacementError, match=r"inference-0 needs 4 GPUs and 2 CPUs on one node; .*node-0 2 GPUs"):
        place([Node("node-0", 2, 8), Node("node-1", 2, 8)], run(servers=1, tp=4, trainer_gpus=1))


def test_a_run_larger_than_the_cluster_is_refused_naming_the_first_rank_that_does_not_fit():
    with pytest.raises(PlacementError) as refused:
        place(TWO_NODES_OF_8, run(servers=8, tp=1, trainer_gpus=9))
    assert str(refused.value).startswith("the Ray cluster cannot hold the run: trainer rank 8 needs 1 GPUs")
    assert str(refused.value).endswith("(cluster: 2 nodes, 16 GPUs)")
    assert "\n" not in str(refused.value)


def test_the_orchestrator_goes_beside_the_trainer_or_not_at_all():
    nodes = [Node("node-0", 0, 4), Node("node-1", 1, 1)]  # the trainer's node has no CPU left for the orchestrator
    with pytest.raises(PlacementError, match=r"orchestrator needs 0 GPUs and 1 CPUs on trainer's node node-1; "):
        place(nodes, [Process("trainer", 1, 1), Process("orchestrator", 0, 1, beside="trainer")])


def test_each_rank_is_one_bundle_pinned_to_its_planned_node():
    placed = place(TWO_NODES_OF_8, run(servers=8, tp=1, trainer_gpus=2))
    assert bundles(placed) == [{"CPU": 2, "GPU": 1}] * 8 + [{"CPU": 1, "GPU": 1}] * 2 + [{"CPU": 1}]
    assert node_selectors(placed) == [{NODE_ID_LABEL: "node-0"}] * 8 + [{NODE_ID_LABEL: "node-1"}] * 3
