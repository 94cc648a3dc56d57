"""Benchmark: a trainer's and an orchestrator's start, spawned by ``rl`` against forked by the preloaded starter.

``uv run python benchmarks/preloaded_start.py`` (``--smoke``: one start of each kind).

Starts each process of the CPU debug run as ``rl`` does (:class:`launch.process.Child`), alternately itself and
from a preloaded starter (:mod:`launch.preloaded`, started once first, its own imports measured apart), until the
process reaches its first work: the trainer's "training" line, the orchestrator's "waiting for the inference server"
(no server is started). Measured per start: the process's CPU seconds then (``/proc/<pid>/stat``, its threads
included: what the machine paid, whatever else loads it) and the wall seconds from the request.
"""

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import benchmark_parser, machine_info, process_cpu_s, report, utc_now

from launch.preloaded import PRELOADED_ENV, start_starter, stop_starter
from launch.process import Child, command, stop_all
from launch.supervise import child_env

ROOT = Path(__file__).parents[1]
DEBUG = ROOT / "configs" / "debug" / "rl"
REPEATS = 3
CPU = {"CUDA_VISIBLE_DEVICES": ""}  # rl's placement of a process on the CPU
READY = {"trainer": "training", "orchestrator": "waiting for the inference server"}


def argv(name: str, work: Path) -> list[str]:
    flags = ["--output-dir", str(work / "run")]
    if name == "orchestrator":
        flags += ["--client.base-url", "http://127.0.0.1:9", "--no-eval"]  # no server there: it waits
    return [*command(f"{name}.main", DEBUG / ("train.toml" if name == "trainer" else "orch.toml")), *flags]


def start_once(name: str, work: Path, env: dict[str, str]) -> dict:
    """Start ``name`` as rl does; its CPU and wall seconds once it reaches its first work; stop it."""
    log = work / f"{name}.log"
    began = time.perf_counter()
    child = Child(name, argv(name, work), log, env)
    try:
        while READY[name] not in (log.read_text() if log.exists() else ""):
            assert child.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        return {"cpu_s": process_cpu_s(child.popen.pid), "wall_s": time.perf_counter() - began,
                "forked": not isinstance(child.popen, subprocess.Popen)}  # fmt: skip
    finally:
        stop_all([child])


def run(smoke: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="trident-preloaded-start-") as scratch:
        work = Path(scratch)
        spawned = {key: value for key, value in child_env(CPU).items() if key != PRELOADED_ENV}  # rl's, alone
        starter = start_starter(work / "starter.sock", spawned, work / "starter.log", wait_s=600)
        starter_cpu_s = process_cpu_s(starter.pid)  # its imports, ready to fork
        envs = {"spawned": spawned, "forked": spawned | {PRELOADED_ENV: str(work / "starter.sock")}}
        try:
            starts = {name: {side: [] for side in envs} for name in READY}
            for _ in range(1 if smoke else REPEATS):
                for name, side in ((name, side) for name in READY for side in envs):  # alternated
                    measured = start_once(name, work, envs[side])
                    assert measured["forked"] == (side == "forked"), f"{name} was not started {side}"
                    starts[name][side].append(measured)
        finally:
            stop_starter(starter)
    rows = [{"process": name, **{f"{side}_{key}": statistics.median(run[key] for run in runs)
                                 for side, runs in by_side.items() for key in ("cpu_s", "wall_s")}, "runs": by_side}
            for name, by_side in starts.items()]  # fmt: skip
    return {"repeats": 1 if smoke else REPEATS, "starter_cpu_s": starter_cpu_s, "rows": rows}


def summary_table(result: dict) -> str:
    lines = [
        f"the starter's own imports: {result['starter_cpu_s']:.1f} CPU s, once",
        f"{'process':14}{'spawned CPU s':>15}{'forked CPU s':>14}{'spawned wall s':>16}{'forked wall s':>15}",
    ]
    for row in result["rows"]:
        lines.append(f"{row['process']:14}{row['spawned_cpu_s']:>15.2f}{row['forked_cpu_s']:>14.2f}"
                     f"{row['spawned_wall_s']:>16.2f}{row['forked_wall_s']:>15.2f}")  # fmt: skip
    return "\n".join(lines)


def main(argv_: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "preloaded_start", "one start of each process each way")
    args = parser.parse_args(argv_)
    result = {"benchmark": "preloaded_start", "date": utc_now(), "machine": machine_info(), **run(args.smoke)}
    return report(args.output, result, summary_table(result))


if __name__ == "__main__":
    main()
