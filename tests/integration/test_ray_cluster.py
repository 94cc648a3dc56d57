"""A Trident process through a Ray actor on a local two-node Ray cluster (two raylets on this machine, as Ray's own
tests start them): placed by the plan on its node, its log copied to ``rl``'s side, its exit code reported, stopped
with its children by SIGTERM, and stopped with its children on its node when its actor dies (what a lost ``rl``
does); ``rl --dry-run --ray.address`` reading that cluster's nodes; and (slow) the debug run through ``rl`` on that
cluster, the server on the head and the trainer and orchestrator on the worker: trained to the end, failed in one
line when the trainer's actor is killed, stopped by SIGTERM, each time leaving no process behind; and a run stopped
after its checkpoint resumed through ``rl --ckpt.resume-step -1`` on that cluster, each step trained once; and an
on-policy distillation run with the teacher's server rl starts placed on the worker, trained to the end.

Skipped without the ray extra: CI's install (``uv sync --locked --extra cpu``) has no ray;
``uv sync --locked --extra cpu --extra ray`` adds it.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import psutil
import pytest
from procs import wait_gone
from resumed_runs import batch_tasks, run_config, uninterrupted_tasks
from rl_runs import ROOT, rl_argv

from contracts.lifeline import LAUNCHER_PID_ENV
from contracts.metrics import read_metrics
from contracts.run_dir import complete_checkpoints
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
    """A head of 2 CPUs (where the plan puts the debug run's server: the head comes first) and a worker node of 5
    (the trainer and the orchestrator, and an opd run's teacher's server), each its own raylet; this test's driver
    connected. Ray's memory monitor is off: on a machine other work shares, it would kill the run's actors when the
    machine, not the run, is short."""
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # read by the raylets as they start
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": STORE,
                                                            "include_dashboard": False})  # fmt: skip
    worker = cluster.add_node(num_cpus=5, object_store_memory=STORE)
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
        .remote()
    )
    ray.get(actor.start.remote(argv, {"PROBE": "set by rl"}, files or {}))
    return placed[0].node, actor, group


def head_node() -> str:
    return next(node["NodeID"] for node in ray.nodes() if "node:__internal_head__" in node["Resources"])


def wait_for(condition, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def test_a_process_runs_on_its_planned_node_its_log_copied_and_its_exit_code_reported(cluster, tmp_path):
    _, worker = cluster
    config = tmp_path / "node" / "configs" / "probe.toml"
    script = "import os, sys; print(open(sys.argv[1]).read()); print(os.environ['PROBE']); sys.exit(3)"
    node, actor, group = start([sys.executable, "-c", script, str(config)], cpus=3, files={str(config): "x = 1"})
    assert node == worker.node_id  # 3 CPUs: only the worker node holds it
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
    node, actor, group = start([sys.executable, "-c", sleeper], cpus=1)
    child = RayChild(name, actor, tmp_path / "logs" / f"{name}.log", node, "its address")
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


def test_a_dead_actor_takes_its_process_and_its_children_with_it(cluster, tmp_path):
    child, (pid, grandchild), group = start_sleeper(tmp_path, "orphaned")
    ray.kill(child.actor)  # as when rl is gone: Ray ends the actor's worker and SIGKILLs its direct children
    assert wait_for(lambda: child.poll() is not None) and child.poll() == -signal.SIGKILL
    assert child.lost == (f"orphaned is gone: its Ray actor died on node {child.node} (its address): killed, or its "
                          f"worker crashed (its log: {child.log_path})")  # fmt: skip
    assert wait_for(lambda: not running([pid])), f"pid {pid} still runs"
    left = wait_for(lambda: not running([grandchild]), timeout_s=5)  # the actor's guard stopped the group
    if running([grandchild]):
        os.kill(grandchild, signal.SIGKILL)
    remove_placement_group(group)
    assert left, f"the process's child {grandchild} outlived the actor"


def test_rl_dry_run_plans_on_the_live_cluster_and_refuses_what_its_nodes_cannot_hold(cluster, tmp_path):
    from contracts.config import parse_config
    from contracts.errors import TridentError
    from launch.launcher import run
    from launch.rl_config import RLConfig, resolve_shared

    head = head_node()
    configs = Path(__file__).parents[2] / "configs" / "debug" / "rl"
    files = {"trainer": "train.toml", "orchestrator": "orch.toml", "inference": "infer.toml"}
    flags = [arg for key, name in files.items() for arg in (f"--{key}", "@", str(configs / name))]
    workers = ["--orchestrator.rollout-workers", "4"]  # the orchestrator then needs 5 CPUs
    argv = [*flags, "--ray.address", cluster[0].address, "--output-dir", str(tmp_path), *workers, "--dry-run"]
    worker = cluster[1].node_id
    assert head != worker
    # the server (2 CPUs) takes the head, which comes first; the trainer (1) the worker, which has 4 CPUs left
    with pytest.raises(TridentError, match=rf"^the Ray cluster cannot hold the run: orchestrator needs 0 GPUs and 5 "
                                           rf"CPUs on trainer's node {worker}; left after the processes before it: "
                                           rf"{worker} 0 GPUs 4 CPUs \(cluster: 2 nodes, 0 GPUs\)$"):  # fmt: skip
        run(resolve_shared(parse_config(RLConfig, argv), on_gpu=False))


def left_of_run(output_dir: Path, actor_pids: set[int]) -> list[str]:
    """The processes of the run in ``output_dir`` still running: those whose command line names it (rl, each
    process), and those whose launcher is one of the run's actors (a server's engine, whatever its command line)."""
    left = []
    for process in psutil.process_iter(["pid", "cmdline", "environ", "status"]):
        info = process.info
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = " ".join(info["cmdline"] or [])
        launcher = (info["environ"] or {}).get(LAUNCHER_PID_ENV)
        if str(output_dir) in cmdline or (launcher is not None and int(launcher) in actor_pids):
            left.append(f"{info['pid']}: {cmdline[:160]}")
    return left


class RayRun:
    """``rl`` on the debug configs on the cluster, its output_dir shared (one machine), its console in a file."""

    def __init__(self, cluster, output_dir: Path, *flags: str, port: int | None = None):
        """``port``: the policy server's (a teacher's server rl starts takes the next); absent, one free now."""
        self.output_dir, self.start = output_dir, time.monotonic()
        if port is None:
            with socket.socket() as probe:  # a port of its own: the server listens on every address
                probe.bind(("", 0))
                port = probe.getsockname()[1]
        flags = ("--ray.address", cluster[0].address, "--ray.shared-output-dir", "--inference.port", str(port), *flags)
        argv = rl_argv(output_dir, *flags)
        self.console = (output_dir.parent / f"{output_dir.name}.console").open("w+")
        self.rl = subprocess.Popen(argv, stdout=self.console, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.actor_pids: set[int] = set()

    def output(self) -> str:
        self.console.seek(0)
        return self.console.read()

    def started(self) -> dict[str, tuple[int, str]]:
        """Each process rl started, by name: its pid and its node, from rl's log; each one's actor recorded."""
        path = self.output_dir / "logs" / "rl.log"
        found = re.findall(r"started (\S+) \(pid (\d+)\) on node (\w+)", path.read_text() if path.exists() else "")
        started = {name: (int(pid), node) for name, pid, node in found}
        for pid, _ in started.values():
            try:
                self.actor_pids.add(psutil.Process(pid).ppid())
            except psutil.NoSuchProcess:
                pass
        return started

    def wait_for_the_servers_engine(self) -> dict[str, tuple[int, str]]:
        """Wait until rl has started its three processes and the server its engine (a process of its own, which
        logs as ``(EngineCore pid=N)``)."""
        log = self.output_dir / "logs" / "inference.log"

        def engine() -> bool:
            started = self.started()
            return self.rl.poll() is not None or (len(started) == 3 and "(EngineCore" in log.read_text())

        assert wait_for(engine, timeout_s=300) and self.rl.poll() is None, self.output()
        return self.started()

    def wait(self, timeout_s: float, left_s: float = 30) -> int:
        """rl's exit code within ``timeout_s`` from now; no process of the run may be left ``left_s`` after it."""
        deadline = time.monotonic() + timeout_s
        while self.rl.poll() is None:  # each process's actor recorded while it runs
            assert time.monotonic() < deadline, self.output()
            self.started()
            time.sleep(1)
        code = self.rl.returncode
        self.seconds = time.monotonic() - self.start
        wait_gone(lambda: left_of_run(self.output_dir, self.actor_pids), timeout_s=left_s)
        return code


@pytest.mark.slow
def test_the_debug_run_trains_through_rl_on_the_cluster_each_process_on_its_planned_node(cluster, tmp_path):
    """The server on the head, the trainer and the orchestrator on the worker; 3 steps, the probe passing after the
    reload (a step's rollouts come from the weights two steps back: step 3's from step 1's), the loss masks right."""
    run = RayRun(cluster, tmp_path / "run", "--max-steps", "3")
    code = run.wait(timeout_s=900)
    output = run.output()
    assert code == 0, output
    nodes = {name: node for name, (_, node) in run.started().items()}
    assert nodes == {"inference": head_node(), "trainer": cluster[1].node_id, "orchestrator": cluster[1].node_id}
    steps = [line for line in output.splitlines() if line.startswith("step ") and " | reward " in line]
    assert len(steps) == 3 and steps[-1].startswith("step 3/3"), output
    orchestrator = read_metrics(run.output_dir, "orchestrator")
    assert [r["weight_step"] for r in orchestrator] == [0, 0, 1]
    assert all(r["probe_gap"] < 1e-3 for r in orchestrator[2:]) and "probe_gap" in orchestrator[2]
    check = subprocess.run([sys.executable, "scripts/check_loss_mask.py", "--output-dir", str(run.output_dir)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert check.returncode == 0 and "loss masks OK" in check.stdout, check.stdout + check.stderr
    print(f"the debug run on Ray: {len(steps)} steps in {run.seconds:.0f}s")


@pytest.mark.slow
def test_an_opd_run_places_the_teachers_server_on_its_node_and_stops_it_with_the_run(cluster, tmp_path, free_port):
    """rl starts the teacher's server (the tiny model itself) as one more server of the run: a bundle of its own,
    on the worker (the head's 2 CPUs hold the policy's server), listening on every address and reached at its node's
    address with the run's key; 2 steps of opd train to the end, each scored by it, its log in output_dir/logs, and
    nothing of the run left."""
    port = free_port(2)
    opd = ("--orchestrator.algorithm", "opd", "--orchestrator.teacher.model", "trident/tiny-qwen3")
    run = RayRun(cluster, tmp_path / "run", "--max-steps", "2", "--no-orchestrator.eval", *opd, port=port)
    code = run.wait(timeout_s=900)
    assert code == 0, run.output()
    worker = cluster[1].node_id
    nodes = {name: node for name, (_, node) in run.started().items()}
    assert nodes == {"inference": head_node(), "teacher": worker, "trainer": worker, "orchestrator": worker}
    configs = run.output_dir / "configs"
    assert tomllib.loads((configs / "teacher.toml").read_text())["host"] == "0.0.0.0"
    url = tomllib.loads((configs / "orchestrator.toml").read_text())["teacher"]["base_url"]
    assert re.fullmatch(rf"http://(?!127\.)[\d.]+:{port + 1}", url), url
    assert [sorted(k for k in r if k.startswith("reverse_kl/")) for r in read_metrics(run.output_dir, "orchestrator")
            ] == [["reverse_kl/char-target"]] * 2  # fmt: skip
    assert "(EngineCore" in (run.output_dir / "logs" / "teacher.log").read_text()
    print(f"the opd run on Ray with the teacher's server: 2 steps in {run.seconds:.0f}s")


@pytest.mark.slow
def test_killing_the_trainers_actor_fails_the_run_in_one_line_and_leaves_no_process(cluster, tmp_path):
    run = RayRun(cluster, tmp_path / "run", "--no-orchestrator.eval")
    trainer, _ = run.wait_for_the_servers_engine()["trainer"]
    os.kill(psutil.Process(trainer).ppid(), signal.SIGKILL)  # the trainer's actor, as the OOM killer would
    assert run.wait(timeout_s=120) == 1
    errors = [line for line in run.output().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and re.search(r" ERROR trainer is gone: its Ray actor died on node \w+ \(", errors[0]), (
        run.output()
    )


@pytest.mark.slow
def test_sigterm_to_rl_stops_every_process_on_both_nodes(cluster, tmp_path):
    from ray.util import placement_group_table

    run = RayRun(cluster, tmp_path / "run", "--no-orchestrator.eval")
    run.wait_for_the_servers_engine()
    run.rl.send_signal(signal.SIGTERM)
    assert run.wait(timeout_s=120, left_s=2) == 130, run.output()  # rl stopped them all before it exited
    assert "all processes stopped" in (run.output_dir / "logs" / "rl.log").read_text()
    assert all(group["state"] == "REMOVED" for group in placement_group_table().values())


@pytest.mark.slow
def test_a_run_stopped_after_its_checkpoint_resumes_on_the_cluster_training_each_step_once(cluster, tmp_path):
    """4 steps, a checkpoint every 2: SIGTERM to ``rl`` once step 2's checkpoint is complete, then
    ``--ckpt.resume-step -1`` through ``rl`` on the cluster trains steps 3 and 4 from it, on the prompts a run never
    stopped draws (the orchestrator's sampler, in this process), each step trained once across the two runs. Ray
    adds nothing to resume (``rl`` resolves the checkpoint and clears what came after it, as on one machine): this
    shows the two compose."""
    output_dir, steps = tmp_path / "run", 4
    flags = ("--max-steps", str(steps), "--ckpt.interval", "2", "--no-orchestrator.eval",
             "--trainer.keep-rollouts", str(steps))  # fmt: skip
    run = RayRun(cluster, output_dir, *flags)
    assert wait_for(lambda: complete_checkpoints(output_dir) or run.rl.poll() is not None, timeout_s=600)
    run.rl.send_signal(signal.SIGTERM)
    assert run.wait(timeout_s=120) == 130, run.output()  # stopped before its end, so resumed below
    assert complete_checkpoints(output_dir) == [2]

    resumed = RayRun(cluster, output_dir, *flags, "--ckpt.resume-step", "-1")
    assert resumed.wait(timeout_s=600) == 0, resumed.output()
    output = resumed.output()
    assert "resuming from checkpoint step 2" in output, output
    step_lines = [line.split(" |")[0] for line in output.splitlines() if line.startswith("step ") and " | " in line]
    assert step_lines == ["step 3/4", "step 4/4"], output
    assert re.search(r"training \S+ on .* steps 3\.\.4", (output_dir / "logs" / "trainer.log").read_text())
    assert "resuming after step 2: prompts from task" in (output_dir / "logs" / "orchestrator.log").read_text()
    assert [r["step"] for r in read_metrics(output_dir, "trainer")] == list(range(1, steps + 1))
    assert [r["step"] for r in read_metrics(output_dir, "orchestrator")] == list(range(1, steps + 1))
    # the resumed steps' batches (the resume deleted the earlier ones) hold the tasks a run never stopped draws
    # (a failed rollout gives no sample: the sets of tasks)
    reference = uninterrupted_tasks(run_config(output_dir), range(3, steps + 1))
    for step in range(3, steps + 1):
        assert set(batch_tasks(output_dir, step)) == set(reference[step]), step
    assert complete_checkpoints(output_dir)[-1] == steps
    print(f"the resumed run on Ray: steps 3-4 in {resumed.seconds:.0f}s")
