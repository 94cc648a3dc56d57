"""Benchmark: a long CPU run, watched for growth: each process's resident memory, open file descriptors and
threads, and the output folder's size, from warm-up to the last step.

``uv run --no-sync python benchmarks/soak.py`` (``--steps 300`` by default; ``--smoke`` for 6 steps; ``--server
URL`` to run against a running server, serving the tiny model with ``[lora] max_rank`` of at least 8, instead of
starting one; ``--stream`` to train on an endless generated taskset, ``configs/debug/rl/stream.toml`` laid over the
run, with its results in ``results/soak_stream.json``).

``rl`` runs the CPU debug configs (``configs/debug/rl/``) for ``steps`` steps with checkpoints every
``CKPT_INTERVAL`` steps (the newest 2 kept) and the trainer's default ``keep_rollouts``. Every ``SAMPLE_S``
seconds the benchmark reads ``/proc`` for each process of the run (``rl``, orchestrator, trainer, and the
inference server when it started one), summed over the process's group (the server's vLLM engine core, the
orchestrator's tool servers), and the size of each folder of ``output_dir``.

Reported per measure: its value at the end of warm-up (``warmup_steps``), at the end, and its growth per 100 steps
(a least-squares slope over the samples after warm-up). Flat means a slope near 0; metrics and logs grow by design
(a line per step), everything else must not. Besides, from the orchestrator's own metrics, its resident memory after
each step (``resident_gib``) and the tasks its task streams hold (``stream_tasks_held``), with the same slope.
"""

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from common import RESULTS_DIR, benchmark_parser, exit_on_sigterm, machine_info, report, server_for, utc_now

from contracts.metrics import read_metrics
from contracts.model_path import TINY_MODEL_ID

ROOT = Path(__file__).parents[1]
DEBUG_CONFIGS = ROOT / "configs" / "debug" / "rl"
LORA_RANK = 8
SAMPLE_S = 5.0
CKPT_INTERVAL = 25
FOLDERS = ("rollouts", "weights", "checkpoints", "metrics", "logs")


def tree_usage(pid: int, descendants: bool = True) -> dict[str, float]:
    """Resident memory (MiB), open file descriptors and threads of process ``pid`` (and its descendants)."""
    rss = fds = threads = 0
    try:
        root = psutil.Process(pid)
        tree = [root, *(root.children(recursive=True) if descendants else [])]
    except psutil.NoSuchProcess:
        tree = []
    for process in tree:
        try:
            with process.oneshot():
                rss, fds, threads = (
                    rss + process.memory_info().rss,
                    fds + process.num_fds(),
                    threads + process.num_threads(),
                )
        except psutil.NoSuchProcess:  # it exited meanwhile
            continue
    return {"rss_mib": rss / 2**20, "fds": fds, "threads": threads}


def folder_mib(folder: Path) -> float:
    """The size of the files under ``folder`` in MiB (0 when it does not exist); files and folders deleted while
    it walks (the run prunes them) are skipped."""
    total = 0
    for parent, _, files in os.walk(folder):  # os.walk skips folders that vanish
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total / 2**20


def listening_pid(url: str) -> int | None:
    """The pid of the process that listens on ``url``'s port on this machine (None if none of ours)."""
    port = httpx.URL(url).port
    listening = (c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
    return next((c.pid for c in listening if c.pid is not None), None)


def growth_per_100_steps(samples: list[dict], key: tuple[str, str]) -> float:
    """The least-squares slope of ``sample[a][b]`` against the step, times 100."""
    steps = [s["step"] for s in samples]
    values = [s[key[0]][key[1]] for s in samples]
    if len(set(steps)) < 2:
        return 0.0
    return statistics.linear_regression(steps, values).slope * 100


def run_processes(rl: subprocess.Popen, server_pid: int | None) -> dict[str, int]:
    """The processes to watch by name: rl, its children (orchestrator, trainer), and the server."""
    children = psutil.Process(rl.pid).children()
    named = {"rl": rl.pid} | {c.cmdline()[2].split(".")[0]: c.pid for c in children if c.cmdline()[1:2] == ["-m"]}
    return named | ({"inference": server_pid} if server_pid else {})


def sample(output_dir: Path, processes: dict[str, int], step: int, start: float) -> dict:
    """One row: the step reached, each process tree's usage (rl: rl alone), and each folder's size."""
    row = {"t_s": round(time.monotonic() - start, 1), "step": step}
    for name, pid in processes.items():
        row[name] = tree_usage(pid, descendants=name != "rl")  # rl's descendants are the others
    row["disk_mib"] = {folder: folder_mib(output_dir / folder) for folder in FOLDERS}
    row["disk_mib"]["total"] = folder_mib(output_dir)
    return row


def run_soak(server_url: str, steps: int, work_dir: Path, stream: bool = False) -> tuple[list[dict], list[dict]]:
    """Run ``rl`` for ``steps`` steps against the server (with ``stream``, on the debug run's task stream), sampling
    every ``SAMPLE_S``; the samples, and the orchestrator's step metrics."""
    output_dir = work_dir / "run"
    stream_toml = ["@", str(DEBUG_CONFIGS / "stream.toml")] if stream else []
    argv = [sys.executable, "-m", "launch.main", "--trainer", "@", str(DEBUG_CONFIGS / "train.toml"),
            "--orchestrator", "@", str(DEBUG_CONFIGS / "orch.toml"), "--orchestrator.client.base-url", server_url,
            "--max-steps", str(steps), "--ckpt.interval", str(CKPT_INTERVAL),
            "--output-dir", str(output_dir), *stream_toml]  # fmt: skip
    samples, start, server_pid = [], time.monotonic(), listening_pid(server_url)
    with (work_dir / "rl.out").open("w") as out:
        rl = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            while rl.poll() is None:
                step = len(read_metrics(output_dir, "trainer"))
                if 0 < step < steps:  # once the last step is done, the processes exit
                    samples.append(sample(output_dir, run_processes(rl, server_pid), step, start))
                time.sleep(SAMPLE_S)
        finally:
            rl.terminate()
            rl.wait()
    if rl.returncode != 0:
        raise RuntimeError(f"rl exited with code {rl.returncode}; see {work_dir / 'rl.out'}")
    return samples, read_metrics(output_dir, "orchestrator")


def orchestrator_steps(records: list[dict], warmup_steps: int) -> dict:
    """The orchestrator's resident memory (MiB) and the tasks its streams hold after each step, as its metrics
    give them; the memory's value at the end of warm-up, at the end, and its growth per 100 steps after warm-up."""
    steps = [{"step": r["step"], "orchestrator": {"resident_mib": r["resident_gib"] * 1024,
              "stream_tasks_held": r.get("stream_tasks_held", 0)}} for r in records]  # fmt: skip
    after = [s for s in steps if s["step"] >= warmup_steps] or steps
    key = ("orchestrator", "resident_mib")
    return {
        "resident_mib": {
            "warm": after[0][key[0]][key[1]],
            "end": after[-1][key[0]][key[1]],
            "per_100_steps": growth_per_100_steps(after, key),
        },
        "stream_tasks_held_max": max(s["orchestrator"]["stream_tasks_held"] for s in steps),
        "per_step": steps,
    }


def summarize(samples: list[dict], warmup_steps: int) -> dict:
    """Per measure: the value at the end of warm-up, at the end, and the growth per 100 steps after warm-up."""
    after = [s for s in samples if s["step"] >= warmup_steps] or samples
    summary = {}
    for group in (k for k in samples[-1] if k not in ("t_s", "step")):
        for measure in samples[-1][group]:
            key = (group, measure)
            summary[f"{group}.{measure}"] = {
                "warm": after[0][group][measure],
                "end": after[-1][group][measure],
                "per_100_steps": growth_per_100_steps(after, key),
            }
    return summary


def summary_table(result: dict) -> str:
    lines = [
        f"soak: {result['steps']} steps in {result['seconds']:.0f}s, warm-up {result['warmup_steps']} steps",
        f"{'measure':<34} {'warm-up':>8} {'end':>10} {'per 100 steps':>14}",
    ]
    steps = {"orchestrator.resident_mib (step)": result["orchestrator_steps"]["resident_mib"]}
    for name, row in (result["summary"] | steps).items():
        lines.append(f"{name:<34} {row['warm']:>8.1f} {row['end']:>10.1f} {row['per_100_steps']:>+14.2f}")
    return "\n".join(lines + [f"stream tasks held, at most: {result['orchestrator_steps']['stream_tasks_held_max']}"])


def main(argv: list[str] | None = None) -> dict:
    """Run the soak, write its JSON to ``--output`` and print a summary; returns the results."""
    parser = benchmark_parser(__doc__, "soak", "a short run: 6 steps", server=True)
    parser.add_argument("--steps", type=int, default=300, help="steps of the run")
    parser.add_argument("--stream", action="store_true", help="train on configs/debug/rl/stream.toml's task stream")
    args = parser.parse_args(argv)
    if args.stream and args.output == RESULTS_DIR / "soak.json":
        args.output = args.output.with_name("soak_stream.json")
    steps = 6 if args.smoke else args.steps
    warmup = max(2, steps // 10)
    with exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="trident-bench-soak-", dir=args.work_dir) as tmp:
        start = time.monotonic()
        with server_for(args.server, TINY_MODEL_ID, LORA_RANK, Path(tmp)) as url:
            samples, records = run_soak(url, steps, Path(tmp), args.stream)
        seconds = time.monotonic() - start
    result = {
        "date": utc_now(),
        "machine": machine_info(),
        "steps": steps,
        "stream": args.stream,
        "warmup_steps": warmup,
        "seconds": seconds,
        "sample_s": SAMPLE_S,
        "summary": summarize(samples, warmup),
        "orchestrator_steps": orchestrator_steps(records, warmup),
        "samples": samples,
    }
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
