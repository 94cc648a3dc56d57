"""``rl --trainer @ train.toml ... --inference @ infer.toml --sweep 'trainer.optim.lr=[1e-5,1e-4]'``:
several LoRA runs of one base model sharing one inference server.

Each ``--sweep KEY=[VALUE, ...]`` (a JSON list) or ``--sweep @ sweep.toml`` (lists under their dotted keys, or under
tables) is an axis; the runs are every combination of the axes' values, each named by its values (``lr=1e-05``). The
sweep starts one server from ``[inference]`` (LoRA slots for every run, loading from the sweep's output_dir), waits
for it, then starts each run as a child ``rl`` with the run's overrides, its run id, its own ``output_dir/<run id>``
and the server's URL: each run is supervised, resumed and fails exactly as a run alone does. The sweep prints each
run's step lines prefixed by its run id, goes on when a run fails (exit code 1 at the end), stops every run and the
server on SIGTERM or Ctrl-C, and writes ``sweep.json`` (each run's overrides, folder, status, last reward) and one
report comparing the runs (``plots/report.html``).
"""

import itertools
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import tomli_w

from contracts.config import ConfigError, ParsedArgs, exit_config_error, parse_config, read_toml, to_toml_dict
from contracts.errors import TridentError, exit_on_user_error
from contracts.inference_api import HEALTH
from contracts.lifeline import GRACE_S
from contracts.metrics import setup_logging
from contracts.run_dir import configs_dir, logs_dir
from contracts.run_spec import served_lora_rank
from contracts.shared_config import is_run_id
from inference.config import InferenceConfig
from launch.memory_plan import MemoryPlan, plan_memory
from launch.preflight import build_tiny_models, check_port_free, gpu_memory_gib, lock_output_dir, placement_env
from launch.process import MODULES, Child, command, shell_line, stop_all
from launch.rl_config import RLConfig, resolve_shared, servers, settle_run_spec, started_urls
from launch.supervise import (
    WaitNotice,
    child_env,
    failure_message,
    keep_stopping,
    log_to_file,
    stop_on_signals,
    write_plots_or_warn,
)

logger = logging.getLogger("rl")

# What a run's console shows that the sweep prints, prefixed by its run id: launcher.step_line and eval_line
CONSOLE_LINE = re.compile(r"step \d+/\d+ \| |eval of weights step ")
RUN_GRACE_S = 2 * GRACE_S + 5  # a run's rl stops its own processes first (their grace), then itself
SWEEP_FILE = "sweep.json"
SWEEP_FLAG = "--sweep"


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its id, the overrides that make it, its folder, and the command that starts it (an
    ``rl`` without ``--inference``)."""

    run_id: str
    overrides: dict[str, Any]
    output_dir: Path
    command: list[str]
    max_steps: int


@dataclass(frozen=True)
class SweepPlan:
    output_dir: Path
    server: InferenceConfig
    url: str
    placement: dict[str, str]  # the server's CUDA_VISIBLE_DEVICES
    runs: list[SweepRun]
    memory: MemoryPlan
    notes: list[str]  # what the sweep changed in [inference], for the operator
    plots: bool
    progress_every_s: float


def is_sweep(argv: list[str]) -> bool:
    """Whether ``argv`` asks for a sweep (a ``--sweep`` flag)."""
    return any(arg == SWEEP_FLAG or arg.startswith(f"{SWEEP_FLAG}=") for arg in argv)


def split_sweep(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` without its ``--sweep`` flags, and each one's value: ``KEY=[...]``, or ``@FILE`` for ``--sweep @
    FILE``."""
    rest, specs, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(f"{SWEEP_FLAG}="):
            specs.append(arg.split("=", 1)[1])
        elif arg == SWEEP_FLAG:
            value = argv[i + 1] if i + 1 < len(argv) else ""
            if value == "@":  # --sweep @ FILE
                value, i = "@" + (argv[i + 2] if i + 2 < len(argv) else ""), i + 1
            specs.append(value)
            i += 1
        else:
            rest.append(arg)
        i += 1
    return rest, specs


def sweep_axes(specs: list[str]) -> dict[str, list]:
    """Each swept key with its values, from ``--sweep`` values (:func:`split_sweep`); a ConfigError names a value
    that is no list, a key swept twice, or a key the sweep sets itself."""
    axes: dict[str, list] = {}
    for spec in specs:
        if spec.startswith("@"):
            if not spec[1:]:
                raise ConfigError("--sweep @ must be followed by a TOML file of lists")
            path = Path(spec[1:])
            items = [(flag_key(key), values, f"{path}: {key}") for key, values in flat_items(read_toml(path))]
        else:
            key, equals, raw = spec.partition("=")
            if not equals or not key:
                raise ConfigError(f"--sweep {spec!r}: expected KEY=[VALUE, ...] (a JSON list) or @ sweep.toml")
            try:
                values = json.loads(raw)
            except json.JSONDecodeError:
                values = raw
            items = [(flag_key(key), values, f"--sweep {flag_key(key)}")]
        for key, values, where in items:
            check_axis(key, values, where)
            if key in axes:
                raise ConfigError(f"{where}: {key} is swept twice; give all its values in one list")
            axes[key] = values
    if not axes:
        raise ConfigError("--sweep: no key to sweep; give KEY=[VALUE, ...] or @ sweep.toml")
    return axes


def flag_key(key: str) -> str:
    """A dotted key as a flag names it: ``trainer.optim.lr``, ``run_id`` for ``run-id``."""
    return key.strip().replace("-", "_")


def flat_items(table: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """The leaves of a TOML table under their dotted keys (``[trainer.optim] lr = [...]``: ``trainer.optim.lr``)."""
    items = []
    for key, value in table.items():
        dotted = f"{prefix}.{key}" if prefix else key
        items += flat_items(value, dotted) if isinstance(value, dict) else [(dotted, value)]
    return items


def check_axis(key: str, values: Any, where: str) -> None:
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: expected a non-empty list of values, got {values!r}")
    if len({json.dumps(value, sort_keys=True) for value in values}) < len(values):
        raise ConfigError(f"{where}: a value is given twice in {values!r}")
    if key.startswith("inference"):
        raise ConfigError(f"{where}: the runs share one server; set {key} for it in --inference, not per run")
    if key in ("run_id", "orchestrator.run_id", "output_dir", "orchestrator.client.base_url") or key.endswith(
        ".output_dir"
    ):
        raise ConfigError(f"{where}: the sweep sets {key} for each run itself")


def variants(axes: dict[str, list]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, the last axis changing fastest."""
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def run_ids(runs: list[dict[str, Any]]) -> list[str]:
    """A run id for each variant, from its values: ``lr=1e-05``, ``lr=1e-05_rank=8`` (a key by its last part, or
    whole where two keys end alike); ``run-1``, ``run-2``, ... where those would not be distinct valid run ids."""
    keys = list(runs[0])
    leaves = [key.rsplit(".", 1)[-1] for key in keys]
    labels = [leaf if leaves.count(leaf) == 1 else key for key, leaf in zip(keys, leaves, strict=True)]
    ids = ["_".join(f"{label}={id_text(run[key])}" for key, label in zip(keys, labels, strict=True)) for run in runs]
    if len(set(ids)) == len(ids) and all(map(is_run_id, ids)):
        return ids
    return [f"run-{i}" for i in range(1, len(runs) + 1)]


def id_text(value: Any) -> str:
    """A value as a run id shows it: a string as it is, anything else as JSON; characters a run id cannot hold
    become ``-``."""
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", text)


def flag_value(value: Any) -> str:
    """A flag's value as ``rl`` parses it back to ``value``: a plain string as it is, anything else as JSON."""
    if isinstance(value, str) and not value.startswith(("--", "@")):
        try:
            json.loads(value)
        except json.JSONDecodeError:
            return value
    return json.dumps(value)


def run_argv(base: ParsedArgs, overrides: dict[str, Any]) -> list[str]:
    """The arguments of one run's ``rl``: the sweep's files and flags without its ``[inference]`` (the run attaches
    to the sweep's server) and without ``--dry-run``, then ``overrides`` (dotted keys: values)."""
    argv = []
    for prefix, path in base.files:
        if not prefix.startswith("inference"):
            argv += [f"--{prefix.replace('_', '-')}", "@", str(path)] if prefix else ["@", str(path)]
    flags = {key: value for key, value in base.flags.items() if not key.startswith("inference") and key != "dry_run"}
    for key, value in (flags | overrides).items():
        argv += [f"--{key.replace('_', '-')}", flag_value(value)]
    return argv


def plan_sweep(argv: list[str]) -> tuple[SweepPlan, RLConfig]:
    """The sweep ``argv`` asks for, each run's config resolved (a mistake in any is a ConfigError before anything
    starts); also the sweep's own config (its server's)."""
    base_argv, specs = split_sweep(argv)
    combinations = variants(sweep_axes(specs))
    config = parse_config(RLConfig, base_argv)
    if config.inference is None:
        raise ConfigError(
            "--sweep: the sweep starts its inference server from --inference @ infer.toml; give one (runs attach to "
            "a server already running with --run-id each: docs/sharing.md)"
        )
    if config.run_id is not None or config.orchestrator.run_id is not None:
        raise ConfigError("--sweep: the sweep names each of its runs itself; leave --run-id (orchestrator.run_id) out")
    lora = config.trainer.model.experimental.lora
    if lora is None or lora.export != "adapter":
        raise ConfigError(
            "--sweep: the runs of a sweep share one server, so each trains a LoRA adapter "
            "(trainer.model.experimental.lora with export = 'adapter'); full weights cannot share a server"
        )
    given_lora = config.inference.lora
    given_rank = given_lora.max_rank if given_lora and "max_rank" in given_lora.model_fields_set else None
    on_gpu = gpu_memory_gib(config) is not None
    config = resolve_shared(config, on_gpu)
    build_tiny_models(config)  # the run spec reads the model's card; the server and the runs load it
    settle_run_spec(config)
    if len(servers(config)) > 1:
        raise ConfigError("--inference-servers: a sweep starts one inference server; leave it out")
    output_dir, url = Path(config.trainer.output_dir), started_urls(config)[0]
    parsed = ParsedArgs(base_argv)
    runs, configs = [], []
    for run_id, overrides in zip(run_ids(combinations), combinations, strict=True):
        run_dir = output_dir / run_id
        named = {"run_id": run_id, "output_dir": str(run_dir), "orchestrator.client.base_url": url, "plots": False}
        args = run_argv(parsed, overrides | named)
        try:
            run_config = resolve_shared(parse_config(RLConfig, args), on_gpu)
        except ConfigError as e:
            raise ConfigError(f"run {run_id}: {e}") from None
        check_shares_server(run_id, run_config, config)
        rl = [sys.executable, "-m", "launch.main", *args]
        runs.append(SweepRun(run_id, overrides, run_dir, rl, run_config.trainer.max_steps))
        configs.append(run_config)
    server, notes = shared_server(config, [c.trainer.model.experimental.lora.rank for c in configs], given_rank)
    memory = sweep_memory(config, server, configs)
    placement = placement_env(config, on_gpu)["inference"]
    plan = SweepPlan(output_dir, server, url, placement, runs, memory, notes, config.plots, config.progress_every_s)
    return plan, config


def check_shares_server(run_id: str, run: RLConfig, sweep: RLConfig) -> None:
    """A ConfigError when run ``run_id`` cannot use the sweep's server: it serves one base model, at one context
    length; and ``[inference]`` must come from ``--inference`` alone (the runs start no server)."""
    if run.inference is not None:
        raise ConfigError(
            f"run {run_id}: [inference] comes from a file the runs read too; give it with --inference @ infer.toml"
        )
    server = sweep.inference.model
    if run.trainer.model.name != server.name:
        raise ConfigError(
            f"run {run_id}: model {run.trainer.model.name!r}, but the sweep's one server serves {server.name!r}; "
            "the runs of a sweep share one base model"
        )
    if run.trainer.seq_len != server.max_model_len:
        raise ConfigError(
            f"run {run_id}: seq_len {run.trainer.seq_len}, but the sweep's server stops contexts at max_model_len "
            f"{server.max_model_len}; the runs of a sweep share one seq_len"
        )


def shared_server(config: RLConfig, ranks: list[int], given_rank: int | None) -> tuple[InferenceConfig, list[str]]:
    """The sweep's server: ``[inference]`` loading adapters from the sweep's output_dir, with LoRA slots for every
    run (``max_loras`` at least one more than the runs) of the largest rank among them; and a note of each change."""
    server = config.inference.model_copy(deep=True)
    server.weights_root = Path(config.trainer.output_dir)
    server.output_dir = None  # not a run's folder: the server's own config holds the run spec's values
    notes, lora = [], server.lora
    if given_rank is not None and max(ranks) > given_rank:
        raise ConfigError(
            f"inference.lora.max_rank = {given_rank} is smaller than a run's trainer.model.experimental.lora.rank "
            f"({max(ranks)}); the server serves adapters up to its max_rank"
        )
    lora.max_rank = given_rank or max(map(served_lora_rank, ranks))
    if lora.max_loras < len(ranks) + 1:
        notes.append(
            f"inference.lora.max_loras raised from {lora.max_loras} to {len(ranks) + 1}: each of the {len(ranks)} "
            "runs' newest adapter, and one more while a run swaps in its next"
        )
        lora.max_loras = len(ranks) + 1
    return server, notes


def sweep_memory(config: RLConfig, server: InferenceConfig, runs: list[RLConfig]) -> MemoryPlan:
    """The memory plan of the sweep: as many trainers as runs on the trainer GPUs (each as large as the largest
    run's), one server with its LoRA slots; a TridentError names what does not fit."""
    gpu_gib, gpus = gpu_memory_gib(config), (config.trainer_gpu_ids, config.inference_gpu_ids)
    plans = [plan_memory(run.trainer, server, *gpus, gpu_gib) for run in runs]
    plan = replace(max(plans, key=lambda plan: plan.trainer["total"]), runs=len(runs))
    if problems := plan.problems():
        raise TridentError(f"the sweep does not fit in memory: {'; '.join(problems)}")
    return plan


def plan_lines(plan: SweepPlan, server_argv: list[str]) -> list[str]:
    """The sweep for a person: each run's id, overrides and folder, the server, the commands, the memory plan."""
    lines = [f"sweep of {count_runs(len(plan.runs))} in {plan.output_dir}:"]
    for run in plan.runs:
        overrides = " ".join(f"{key}={flag_value(value)}" for key, value in run.overrides.items())
        lines.append(f"  {run.run_id}: {overrides} -> {run.output_dir}")
    lora = plan.server.lora
    lines.append(
        f"inference server, shared by the runs: {plan.url}, model {plan.server.model.name}, LoRA max_loras "
        f"{lora.max_loras}, max_rank {lora.max_rank}, loading from {plan.server.weights_root}"
    )
    lines += [f"  {note}" for note in plan.notes]
    lines.append("commands:")
    lines.append(f"  inference: {shell_line(server_argv, plan.placement)}")
    lines += [f"  {run.run_id}: {shell_line(run.command, {})}" for run in plan.runs]
    return lines + plan.memory.lines()


def count_runs(count: int) -> str:
    return f"{count} run" if count == 1 else f"{count} runs"


def write_server_config(plan: SweepPlan) -> Path:
    path = configs_dir(plan.output_dir) / "inference.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(to_toml_dict(plan.server)))
    return path


def write_sweep_file(plan: SweepPlan, outcomes: dict[str, "RunOutcome"]) -> Path:
    """``output_dir/sweep.json``: each run's overrides, folder, command line and (once it ended) status, steps and
    last reward."""
    runs = {
        run.run_id: {
            "overrides": run.overrides,
            "output_dir": str(run.output_dir),
            "command": shell_line(run.command, {}),
        }
        | vars(outcomes[run.run_id])
        for run in plan.runs
    }
    path = plan.output_dir / SWEEP_FILE
    path.write_text(json.dumps({"server": plan.url, "runs": runs}, indent=1) + "\n")
    return path


@dataclass
class RunOutcome:
    """How a run of the sweep went, as its console showed it."""

    status: str = "not started"  # running, finished, failed, stopped
    exit_code: int | None = None
    steps: int = 0  # the last step line's step
    last_reward: float | None = None

    def seen(self, line: str) -> None:
        if match := re.match(r"step (\d+)/\d+ \| reward (\S+)", line):
            self.steps, self.last_reward = int(match[1]), float(match[2])

    def describe(self) -> str:
        reward = f", last reward {self.last_reward:.4f}" if self.last_reward is not None else ""
        code = f" (exit code {self.exit_code})" if self.status == "failed" else ""
        return f"{self.status}{code}, {self.steps} steps{reward}"


class RunConsole:
    """A run's console log, read as it grows: its new step and eval lines (:data:`CONSOLE_LINE`)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as log:
                log.seek(self.offset)
                data = log.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [line for line in complete.decode(errors="replace").splitlines() if CONSOLE_LINE.match(line)]


def supervise_sweep(
    server_argv: list[str], placement: dict[str, str], url: str, runs: list[SweepRun], log_dir: Path, every_s: float
) -> tuple[int, dict[str, RunOutcome]]:
    """Start the server, wait for it, start every run, print their step lines until all have ended; stop them all
    and the server at the end, on a stop signal, or when the server exits. Returns the exit code (0: every run
    finished; 1: a run or the server failed; 130: stopped) and each run's outcome."""
    stop_on_signals()
    outcomes = {run.run_id: RunOutcome() for run in runs}
    server, children, code = None, {}, 1
    try:
        server = Child("inference", server_argv, log_dir / "inference.log", child_env(placement))
        logger.info(f"started the inference server (pid {server.popen.pid}), log: {server.log_path}")
        if wait_for_server(server, url, every_s):
            for run in runs:
                children[run.run_id] = Child(run.run_id, run.command, log_dir / f"{run.run_id}.log", child_env({}))
                outcomes[run.run_id].status = "running"
                logger.info(f"started run {run.run_id} (pid {children[run.run_id].popen.pid}) in {run.output_dir}")
            code = watch_runs(server, children, runs, outcomes, every_s)
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping every run and the inference server")
        code = 130
    finally:
        keep_stopping()
        stop_all(list(children.values()), grace_s=RUN_GRACE_S)  # each run's rl stops its own processes
        stop_all([server] if server else [])
        for run_id, child in children.items():
            if outcomes[run_id].status == "running":
                outcomes[run_id].status, outcomes[run_id].exit_code = "stopped", child.poll()
        logger.info("all runs and the inference server stopped")
    return code, outcomes


def wait_for_server(server: Child, url: str, every_s: float) -> bool:
    """Wait until the server answers ``/health``; False (logged: :func:`~launch.supervise.failure_message`) when it
    exits first."""
    start = time.perf_counter()
    with WaitNotice(every_s) as notice:
        while server.poll() is None:
            try:
                if httpx.get(f"{url}{HEALTH}", timeout=1).status_code == 200:
                    logger.info(f"the inference server at {url} is up ({time.perf_counter() - start:.0f}s)")
                    return True
            except httpx.TransportError:
                pass
            if notice.due(time.perf_counter() - start):
                notice.show(f"starting the inference server at {url} ({time.perf_counter() - start:.0f}s)")
            time.sleep(0.5)
    logger.error(f"before it was up, {failure_message('inference', server.poll(), server.log_path)}")
    return False


def watch_runs(
    server: Child, children: dict[str, Child], runs: list[SweepRun], outcomes: dict[str, RunOutcome], every_s: float
) -> int:
    """Print each run's step lines as they come, prefixed by its id, and each run's end; a failed run leaves the
    others running. Returns 0 when every run finished, else 1 (also when the server exits: then at once)."""
    consoles = {run_id: RunConsole(child.log_path) for run_id, child in children.items()}
    max_steps = {run.run_id: run.max_steps for run in runs}
    last = time.perf_counter()
    with WaitNotice(every_s) as notice:
        while any(outcome.status == "running" for outcome in outcomes.values()):
            for run_id, child in children.items():
                if outcomes[run_id].status != "running":
                    continue
                exit_code = child.poll()  # before reading: every line it printed is then read
                for line in consoles[run_id].new_lines():
                    print(f"[{run_id}] {line}", flush=True)
                    outcomes[run_id].seen(line)
                    last = time.perf_counter()
                if exit_code is not None:
                    ended(run_id, child, outcomes[run_id], exit_code)
            if server.poll() is not None:
                logger.error(f"stopping the runs: {failure_message('inference', server.poll(), server.log_path)}")
                return 1
            if notice.due(time.perf_counter() - last):
                running = [run_id for run_id, outcome in outcomes.items() if outcome.status == "running"]
                states = ", ".join(f"{run_id} step {outcomes[run_id].steps}/{max_steps[run_id]}" for run_id in running)
                since = f"{time.perf_counter() - last:.0f}s since a step"
                notice.show(f"{count_runs(len(running))} running ({since}): {states}")
            time.sleep(0.2)
    return 0 if all(outcome.status == "finished" for outcome in outcomes.values()) else 1


def ended(run_id: str, child: Child, outcome: RunOutcome, exit_code: int) -> None:
    outcome.exit_code = exit_code
    outcome.status = "finished" if exit_code == 0 else "failed"
    if exit_code == 0:
        logger.info(f"run {run_id} finished: {outcome.describe()}")
    else:
        logger.error(failure_message(f"run {run_id}", exit_code, child.log_path, "rl"))  # the other runs go on


def run_sweep(plan: SweepPlan, dry_run: bool) -> int:
    lock = lock_output_dir(plan.output_dir)  # noqa: F841 (held until the sweep exits)
    server_argv = command(MODULES["inference"], write_server_config(plan))
    if dry_run:
        print("\n".join(plan_lines(plan, server_argv)))
        return 0
    check_port_free(plan.server.host, plan.server.port)
    log_dir = logs_dir(plan.output_dir)
    log_to_file(log_dir / "sweep.log")
    for line in plan_lines(plan, server_argv):
        logger.info(line)
    outcomes = {run.run_id: RunOutcome() for run in plan.runs}
    write_sweep_file(plan, outcomes)
    code, outcomes = supervise_sweep(server_argv, plan.placement, plan.url, plan.runs, log_dir, plan.progress_every_s)
    write_sweep_file(plan, outcomes)
    logger.info("sweep summary:")
    for run_id, outcome in outcomes.items():
        logger.info(f"  {run_id}: {outcome.describe()} ({plan.output_dir / run_id})")
    if code != 130 and plan.plots and any(outcome.steps for outcome in outcomes.values()):
        write_plots_or_warn(plan.output_dir)
    return code


def launch_sweep(argv: list[str]) -> int:
    """``rl ... --sweep ...``: the sweep's plan from ``argv`` (a mistake is one line and exit code 2), then
    :func:`run_sweep`; returns the exit code."""
    setup_logging("rl")
    with exit_on_user_error("rl"):
        try:
            plan, config = plan_sweep(argv)
        except ConfigError as e:
            exit_config_error(e)
        setup_logging("rl", config.trainer.log.level)
        return run_sweep(plan, config.dry_run)
