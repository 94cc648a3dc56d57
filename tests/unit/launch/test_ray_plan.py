"""``rl --dry-run`` on a planned Ray cluster (``--ray.planned-nodes 2 --ray.planned-gpus-per-node 8``, as
``--gpu-memory-gib`` plans GPUs without them): each process's node and GPUs, how files travel between the nodes,
the memory plan per GPU, and the one line that refuses a plan that cannot work. No Ray cluster and no ray needed."""

import sys
from pathlib import Path

import pytest

from contracts.config import parse_config
from contracts.errors import TridentError
from launch.launcher import run
from launch.rl_config import RLConfig, resolve_shared

C = Path(__file__).parents[3] / "configs" / "debug" / "rl"
QWEN3_8B_ON_TWO_NODES = [
    "--trainer", "@", str(C / "train.toml"), "--orchestrator", "@", str(C / "orch.toml"),
    "--inference", "@", str(C / "infer.toml"), "--model.name", "Qwen/Qwen3-8B",
    "--ray.planned-nodes", "2", "--ray.planned-gpus-per-node", "8", "--gpu-memory-gib", "80",
    "--inference-gpu-ids", "0,1,2,3,4,5,6,7",
]  # fmt: skip
TRAINER_ON_NODE_1 = ["--trainer-gpu-ids", "8,9,10,11,12,13,14,15"]


def dry_run(capsys, tmp_path: Path, *flags: str, dry: bool = True) -> str:
    config = resolve_shared(parse_config(RLConfig, [*QWEN3_8B_ON_TWO_NODES, "--output-dir", str(tmp_path), *flags]))
    config.dry_run = dry
    assert run(config) == 0
    return capsys.readouterr().out


def test_each_process_on_its_node_with_the_memory_plan_per_gpu(capsys, tmp_path):
    out = dry_run(capsys, tmp_path, *TRAINER_ON_NODE_1, "--ray.shared-output-dir")
    assert "one placement group of 17 bundles, strategy PACK" in out
    assert "  inference-0: node-0, GPU 0 (cluster GPU 0), 2 CPUs\n" in out
    assert "  inference-7: node-0, GPU 7 (cluster GPU 7), 2 CPUs\n" in out
    assert "  trainer rank 0: node-1, GPU 0 (cluster GPU 8), 1 CPUs\n" in out
    assert "  trainer rank 7: node-1, GPU 7 (cluster GPU 15), 1 CPUs\n" in out
    assert "  orchestrator: node-1, no GPU, 1 CPUs\n" in out
    assert "  weights: through output_dir/weights, which the servers on node-0 read\n" in out
    assert "  GPU 7: inference = 72.0 GiB, free 8.0 GiB\n" in out
    assert "  GPU 15: trainer = 29.8 GiB, free 50.2 GiB\n" in out
    assert "CUDA_VISIBLE_DEVICES=" not in out.split("commands")[1]  # Ray sets them


def test_servers_on_another_node_need_a_shared_output_dir_or_the_broadcast(capsys, tmp_path):
    room = ["--inference.gpu-memory-utilization", "0.7"]  # beside the broadcast's buffer
    with pytest.raises(TridentError, match=r"^the servers on node-0 load each step's weights from output_dir/weights"):
        dry_run(capsys, tmp_path, *TRAINER_ON_NODE_1)
    with pytest.raises(TridentError, match=r"^trainer.weight_broadcast.host = 127.0.0.1: the servers on node-0 cannot"):
        dry_run(capsys, tmp_path, *TRAINER_ON_NODE_1, *room, "--trainer.weight-broadcast.port", "29510")
    out = dry_run(capsys, tmp_path, *TRAINER_ON_NODE_1, *room, "--trainer.weight-broadcast.host", "10.0.0.2")
    assert (
        "  files: output_dir is on each node's own disk; the orchestrator and the trainer's first rank share "
        "node-1, where the batches and checkpoints are\n" in out
    )
    assert "  weights: in-memory broadcast from the trainer to the servers on node-0\n" in out


def test_a_trainer_over_two_nodes_needs_a_shared_output_dir(capsys, tmp_path):
    twelve = ",".join(map(str, range(8, 20)))  # 8 servers and 12 ranks: 4 ranks beside the servers on node-0
    with pytest.raises(TridentError, match=r"^the trainer's ranks span nodes node-0, node-1 and each rank reads"):
        dry_run(capsys, tmp_path, "--trainer-gpu-ids", twelve, "--inference-gpu-ids", "0,1,2,3")


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [(["--trainer-gpu-ids", ",".join(map(str, range(8, 17)))], r"^the Ray cluster cannot hold the run: trainer rank 8"),
     ([*TRAINER_ON_NODE_1, "--gpu-memory-gib", "16"], r"^the run does not fit in memory: inference: vLLM's share"),
     ([*TRAINER_ON_NODE_1, "--ray.planned-gpus-per-node", "0"], r"^--gpu-memory-gib 80: the Ray cluster has no GPU")],
)  # fmt: skip
def test_a_plan_that_does_not_fit_is_refused_in_one_line(capsys, tmp_path, flags, refusal):
    with pytest.raises(TridentError, match=refusal) as refused:
        dry_run(capsys, tmp_path, *flags, "--ray.shared-output-dir")
    assert "\n" not in str(refused.value)


def test_a_planned_cluster_is_for_a_dry_run_only(capsys, tmp_path):
    with pytest.raises(TridentError, match=r"^--ray.planned-nodes 2: a planned cluster is for --dry-run; give "):
        dry_run(capsys, tmp_path, *TRAINER_ON_NODE_1, "--ray.shared-output-dir", dry=False)
    assert not (tmp_path / "configs").exists()  # refused before it writes anything


TEACHER_8B = ["--orchestrator.algorithm", "opd", "--orchestrator.teacher.model", "Qwen/Qwen3-8B"]


def test_the_teacher_rl_starts_is_placed_as_a_server_on_gpus_of_its_own(capsys, tmp_path):
    """7 policy servers and the teacher's on node-0, the trainer on node-1: the teacher is a bundle of its own with
    its GPU and a server's CPUs, its command and its share of the memory plan printed with the others'."""
    seven = ["--inference-gpu-ids", "0,1,2,3,4,5,6"]
    out = dry_run(capsys, tmp_path, *TRAINER_ON_NODE_1, *seven, *TEACHER_8B, "--ray.shared-output-dir")
    assert "one placement group of 17 bundles" in out
    assert (
        "  inference-6: node-0, GPU 6 (cluster GPU 6), 2 CPUs\n  teacher: node-0, GPU 7 (cluster GPU 7), 2 CPUs\n"
        in out
    )
    assert "  teacher: Qwen/Qwen3-8B at http://127.0.0.1:8007: started by rl\n" in out  # its node's, once placed
    assert f"  teacher: {sys.executable} -m inference.main @ {tmp_path}/configs/teacher.toml\n" in out
    assert "  GPU 7: teacher = 72.0 GiB, free 8.0 GiB\n" in out
    assert "  weights: through output_dir/weights, which the servers on node-0 read\n" in out


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [([], r"^the Ray cluster cannot hold the run: trainer rank 7 needs 1 GPUs and 1 CPUs on one node; left after "
          r"the processes before it: node-0 0 GPUs 16 CPUs, node-1 0 GPUs 23 CPUs"),
     (["--teacher-gpu-ids", "8,9"], r"^--teacher-gpu-ids \[8, 9\]: the teacher's server needs "
                                    r"inference.tensor_parallel_size = 1 GPUs")],
)  # fmt: skip
def test_a_teacher_the_cluster_cannot_hold_is_refused_in_one_line(capsys, tmp_path, flags, refusal):
    """8 policy servers fill node-0: the teacher takes a GPU of node-1, where the trainer's 8 ranks then lack one."""
    with pytest.raises(TridentError, match=refusal) as refused:
        dry_run(capsys, tmp_path, *TRAINER_ON_NODE_1, *TEACHER_8B, "--ray.shared-output-dir", *flags)
    assert "\n" not in str(refused.value)
