"""The nodes of a SLURM job, for ``scripts/slurm/rl.sbatch`` (not a command of its own: without SLURM, several nodes
are a Ray cluster, ``rl --ray.address``). The first ``--inference-nodes`` serve, the others train (torchrun across
them), and the orchestrator runs on the first training node. Every node shares ``--output-dir`` (a shared filesystem).

    python -m launch.slurm_nodes resolve --nodes h0,h1 [--gpus-per-node 8] -- <rl flags> --output-dir /shared/run
    python -m launch.slurm_nodes node --nodes h0,h1 --node-rank R [--gpus-per-node 8] [--dry-run] -- --output-dir …

``resolve`` runs once: ``rl --dry-run`` with the placement flags for these nodes writes each process's resolved
config to ``<output-dir>/configs/`` (servers listening on all addresses, the orchestrator given every server's
URL), and, for a real run, deletes what an earlier run wrote after the checkpoint it resumes from, as ``rl`` does.
``node`` then runs on each node (rl.sbatch starts it with srun) and starts that node's processes from those
configs: ``--dry-run`` prints them instead. Servers that listen beyond the loopback need ``TRIDENT_API_KEY`` (rl.sbatch
sets one). Inference nodes stop their servers once the training node has written ``<output-dir>/multinode_done``; a
training node that fails stops there, and srun's ``--kill-on-bad-exit`` stops the rest.
"""

import argparse
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from contracts.run_dir import clear_run_state, configs_dir, logs_dir
from launch.process import Child, command, shell_line, stop_all
from launch.supervise import child_env

DONE = "multinode_done"  # written by the orchestrator's node with the run's exit code


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launch.slurm_nodes", description="The nodes of a SLURM job, for rl.sbatch."
    )
    parser.add_argument("action", choices=["resolve", "node"])
    parser.add_argument("--nodes", required=True, help="the job's hostnames, comma-separated, in node-rank order")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index in --nodes (node)")
    parser.add_argument("--inference-nodes", type=int, default=1, help="how many of the first nodes serve")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs on each node (0: CPU only)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per inference server")
    parser.add_argument("--port", type=int, default=8000, help="the first inference server's port on each node")
    parser.add_argument("--rdzv-port", type=int, default=29500, help="torchrun's rendezvous port on the first trainer")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve: delete nothing of an earlier run; node: print its processes, start none",
    )
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.rl_args = argv[split + 1 :]  # after --: the rl flags (configs, --output-dir)
    args.nodes = [host for host in args.nodes.replace(" ", ",").split(",") if host]
    if not 0 < args.inference_nodes < len(args.nodes):
        parser.error(f"--inference-nodes {args.inference_nodes}: {len(args.nodes)} nodes leave none to train on")
    if not 0 <= args.node_rank < len(args.nodes):
        parser.error(f"--node-rank {args.node_rank}: --nodes has {len(args.nodes)} hosts")
    if args.gpus_per_node % args.tensor_parallel_size:
        parser.error(f"--gpus-per-node {args.gpus_per_node} does not split into servers of {args.tensor_parallel_size}")
    if "--output-dir" not in args.rl_args:
        parser.error("give rl's --output-dir after -- (on the shared filesystem)")
    args.output_dir = Path(args.rl_args[args.rl_args.index("--output-dir") + 1])
    return args


def placement_flags(args: argparse.Namespace) -> list[str]:
    """The rl flags that place a run on these nodes: each inference node's servers, every server's URL."""
    count = max(1, args.gpus_per_node // args.tensor_parallel_size)  # servers per inference node
    urls = [f"http://{host}:{args.port + i}" for host in args.nodes[: args.inference_nodes] for i in range(count)]
    flags = ["--inference.host", "0.0.0.0", "--inference.port", str(args.port), "--inference-servers", str(count),
             "--inference.tensor-parallel-size", str(args.tensor_parallel_size),
             "--orchestrator.client.base-url", ",".join(urls)]  # fmt: skip
    if args.gpus_per_node:
        # rl plans one machine: the training nodes' GPUs are numbered after an inference node's, so that its plan
        # puts no trainer rank beside a server and splits FSDP over every training GPU (each node starts its
        # processes with its own GPUs, see node_processes)
        per_node, training = args.gpus_per_node, len(args.nodes) - args.inference_nodes
        ids = lambda first, count: ",".join(map(str, range(first, first + count)))  # noqa: E731
        flags += ["--inference-gpu-ids", ids(0, per_node), "--trainer-gpu-ids", ids(per_node, training * per_node)]
    return flags


def resolve(args: argparse.Namespace) -> int:
    """``rl --dry-run``: check the configs and write each process's to ``<output-dir>/configs/``; then, unless
    ``--dry-run``, delete what an earlier run wrote after the checkpoint this one resumes from (all of it for a new
    run), as ``rl`` does before it starts its processes."""
    (args.output_dir / DONE).unlink(missing_ok=True)  # an earlier run's
    argv = [sys.executable, "-m", "launch.main", *args.rl_args, *placement_flags(args), "--dry-run"]
    code = subprocess.run(argv).returncode
    if code == 0 and not args.dry_run:
        for path in clear_run_state(args.output_dir, resumed_step(args.output_dir)):
            print(f"deleted {path} of a previous run")
    return code


def resumed_step(output_dir: Path) -> int:
    """The checkpoint step the resolved trainer config resumes from (rl wrote ``-1`` resolved), or 0."""
    ckpt = tomllib.loads((configs_dir(output_dir) / "trainer.toml").read_text()).get("ckpt") or {}
    return ckpt.get("resume_step") or 0


def node_processes(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str]]]:
    """This node's processes: name -> (argv, environment overrides)."""
    configs = configs_dir(args.output_dir)
    gpus = list(range(args.gpus_per_node))
    visible = lambda ids: {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}  # noqa: E731
    if args.node_rank < args.inference_nodes:  # the servers resolve wrote, by port
        files = sorted(configs.glob("inference*.toml"), key=lambda f: tomllib.loads(f.read_text())["port"])
        tp = args.tensor_parallel_size
        return {
            file.stem: (command("inference.main", file), visible(gpus[i * tp : (i + 1) * tp]))
            for i, file in enumerate(files)
        }
    trainers = args.nodes[args.inference_nodes :]
    rank = args.node_rank - args.inference_nodes
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(trainers)}", f"--node-rank={rank}",
                f"--nproc-per-node={max(1, len(gpus))}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={trainers[0]}:{args.rdzv_port}", "-m", "trainer.main",
                "@", str(configs / "trainer.toml")]  # fmt: skip
    processes = {"trainer": (torchrun, visible(gpus))}
    if rank == 0:
        processes["orchestrator"] = (command("orchestrator.main", configs / "orchestrator.toml"), visible([]))
    return processes


def run_node(args: argparse.Namespace) -> int:
    """Start this node's processes and wait: a training node until its processes end (the orchestrator's node then
    writes :data:`DONE`), an inference node until :data:`DONE` appears."""
    processes = node_processes(args)
    if args.dry_run:
        for name, (argv, env) in processes.items():
            print(f"node {args.node_rank} ({args.nodes[args.node_rank]}) {name}: {shell_line(argv, env)}")
        return 0
    log_dir = logs_dir(args.output_dir) / f"node-{args.node_rank}"
    children = [Child(name, argv, log_dir / f"{name}.log", child_env(env)) for name, (argv, env) in processes.items()]
    done = args.output_dir / DONE
    try:
        if args.node_rank < args.inference_nodes:
            while not done.exists():
                if any(child.poll() is not None for child in children):
                    return 1  # a server ended before the run did
                time.sleep(1)
            return int(done.read_text() or 0)
        while any(child.poll() is None for child in children):
            if any(child.poll() not in (None, 0) for child in children):
                break  # one failed: stop the others
            time.sleep(1)
        code = next((abs(child.poll()) for child in children if child.poll() not in (None, 0)), 0)
        if "orchestrator" in processes:
            done.write_text(str(code))
        return code
    finally:
        stop_all(children)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return resolve(args) if args.action == "resolve" else run_node(args)


if __name__ == "__main__":
    sys.exit(main())
