"""``uv run rl --trainer @ train.toml --orchestrator @ orch.toml --inference @ infer.toml``.

Resolves the three configs (shared fields made to agree), writes them and the run spec they share
(:mod:`contracts.run_spec`) to ``output_dir/configs/``, starts
inference, orchestrator and trainer with their output in ``output_dir/logs/``, prints one line per step,
and stops every process tree when the run ends, fails, or is interrupted.
"""

import logging
import time
from pathlib import Path

import httpx
import tomli_w

from contracts.config import ConfigError, exit_config_error, run_cli, to_toml_dict
from contracts.errors import TridentError, exit_on_user_error
from contracts.inference_api import HEALTH
from contracts.metrics import eval_line, read_metrics, setup_logging, write_summary
from contracts.progress import Activity, read_progress
from contracts.run_dir import clear_run_state, configs_dir, logs_dir, resume_step
from contracts.run_spec import RunSpec, write_run_spec
from launch.preflight import (
    build_tiny_models,
    check_adapters_servable,
    check_env_datasets,
    check_envs_installed,
    check_gpus,
    check_lora_targets,
    check_memory,
    check_model,
    check_port_free,
    gpu_memory_gib,
    lock_output_dir,
    note_enforce_eager,
    placement_env,
    placement_lines,
    settle_broadcast,
)
from launch.preloaded import ForkedProcess
from launch.process import MODULES, Child, command, shell_line, stop_all
from launch.ray_actor import RayChild
from launch.ray_cluster import plan_ray_run
from launch.ray_run import RayRun
from launch.rl_config import (
    RLConfig,
    resolve_shared,
    servers,
    settle_run_spec,
    started_servers,
    started_urls,
    sub_configs,
    teacher_server,
    trainer_ranks,
)
from launch.supervise import (
    WaitNotice,
    child_env,
    failure_message,
    keep_stopping,
    log_tail,
    log_to_file,
    stop_on_signals,
    write_plots_or_warn,
)

logger = logging.getLogger("rl")


def module_of(name: str, config: RLConfig) -> str:
    """The module a process runs: each of :func:`started_servers` (``inference``, or ``inference-0``, ..., and
    ``teacher``) is a server."""
    return MODULES["inference"] if name in started_servers(config) else MODULES[name]


def process_commands(config: RLConfig, paths: dict[str, Path], on_gpu: bool) -> dict[str, tuple[list[str], dict]]:
    """What ``rl`` starts, by process name: the command line and the placement (``CUDA_VISIBLE_DEVICES``)."""
    placement, ranks = placement_env(config, on_gpu), {"trainer": trainer_ranks(config, on_gpu)}
    return {
        name: (command(module_of(name, config), path, ranks.get(name, 1)), placement[name])
        for name, path in paths.items()
    }


def resume_point(config: RLConfig) -> int:
    """The step ``--ckpt.resume-step`` resumes from (-1 resolved to the newest complete checkpoint), or 0.

    Both processes get the resolved step, so they resume from the same checkpoint.
    """
    ckpt = config.trainer.ckpt
    if ckpt is None or ckpt.resume_step is None:
        return 0
    try:
        step = resume_step(config.trainer.output_dir, ckpt.resume_step)
    except TridentError as e:
        raise TridentError(f"--ckpt.resume-step {ckpt.resume_step}: {e}") from None
    config.trainer.ckpt = config.orchestrator.ckpt = ckpt.model_copy(update={"resume_step": step})
    return step


def write_configs(config: RLConfig, spec: RunSpec) -> dict[str, Path]:
    """Write the run spec (``run.json``) and each process's resolved config as TOML; returns the configs' paths."""
    folder = configs_dir(config.trainer.output_dir)
    write_run_spec(spec, config.trainer.output_dir)
    paths = {}
    for name, sub in sub_configs(config).items():
        paths[name] = folder / f"{name}.toml"
        paths[name].write_text(tomli_w.dumps(to_toml_dict(sub)))
    for stale in set(folder.glob("*.toml")) - set(paths.values()):  # e.g. an earlier run's inference.toml
        stale.unlink()
    return paths


def first_step_phase(output_dir: Path, server_url: str, done: int = 0, started_server: bool = True) -> str:
    """What the run is doing before its first step (after ``done`` steps of a resumed run) is done;
    ``started_server``: whether rl started the inference server (else it waits for a running one)."""
    if len(read_metrics(output_dir, "orchestrator")) > done:
        return f"training step {done + 1}"
    try:
        if httpx.get(f"{server_url}{HEALTH}", timeout=1).status_code == 200:
            return "sampling the first batch"
    except httpx.TransportError:
        pass
    return "starting the inference server" if started_server else f"waiting for the inference server at {server_url}"


def step_line(record: dict, orchestrator: dict | None, max_steps: int) -> str:
    """The one line ``rl`` prints per trainer step, from the trainer's and the orchestrator's records: the step's
    own time is the trainer's, from waiting for its batch to its weights written (``wait_s + train_s + save_s``)."""
    truncated = f" | truncated {orchestrator['truncated_rate']:.0%}" if orchestrator else ""
    step_s = record["wait_s"] + record["train_s"] + record["save_s"]
    return (
        f"step {record['step']}/{max_steps} | reward {record['reward_mean']:.4f} | loss {record['loss']:+.4f} "
        f"| tokens {record['tokens']}{truncated} | step time {step_s:.1f}s "
        f"({record['wait_s']:.1f}s waiting for rollouts)"
    )


def server_lines(config: RLConfig) -> list[str]:
    """Which inference servers the run uses: each one rl starts, or an external one, which the run resets to its
    model only with ``orchestrator.reset`` (the orchestrator refuses one that serves other weights without it). A
    named run (``run_id``) shares each of them: it serves, probes and resets only its own adapters there."""
    started, run_id = started_urls(config), config.orchestrator.run_id
    lines = ["inference servers the run uses:"]
    for url in config.orchestrator.client.base_urls:
        if url in started:
            lines.append(f"  {url}: started by rl")
        elif run_id is not None:
            lines.append(f"  {url}: external (rl does not start it), shared with other runs")
        elif config.orchestrator.reset:
            lines.append(f"  {url}: external (rl does not start it); --orchestrator.reset: the run resets its weights")
        else:
            lines.append(
                f"  {url}: external (rl does not start it); the run refuses it if it serves weights other than its "
                "model or this run's (--orchestrator.reset resets them)"
            )
    teacher = config.orchestrator.teacher
    if teacher is not None and teacher.adapter is not None:
        lines.append(f"  teacher: adapter {teacher.adapter} on {config.orchestrator.client.base_urls[0]}")
    elif teacher is not None:
        started = "started by rl" if teacher_server(config) is not None else "external (rl does not start it)"
        lines.append(f"  teacher: {teacher.model} at {teacher.base_url}: {started}")
    if run_id is not None:
        lines.append(
            f"  the run is named {run_id!r}: its adapters are served as {run_id}/lora-step-N beside other runs', "
            "each run with its fair share of the server (docs/sharing.md)"
        )
    return lines


def progress_line(head: str, activities: list[Activity]) -> str:
    """``head``, then what each process is doing and for how long (``progress/``)."""
    now = time.time()
    return " · ".join([head, *(activity.describe(now) for activity in activities)])


def supervise(children: dict[str, Child], config: RLConfig) -> int:
    """Wait for trainer and orchestrator to finish, printing each trainer step; return the exit code."""
    output_dir, max_steps = Path(config.trainer.output_dir), config.trainer.max_steps
    printed = first = len(read_metrics(output_dir, "trainer"))  # steps before a resume are already done
    evaluations = len(read_metrics(output_dir, "eval"))
    start = last = time.perf_counter()

    def print_new_steps() -> None:
        nonlocal printed, last, evaluations
        for record in read_metrics(output_dir, "eval")[evaluations:]:
            print(eval_line(record), flush=True)
            evaluations += 1
        records = read_metrics(output_dir, "trainer")[printed:]
        if not records:
            return
        orchestrator = {r["step"]: r for r in read_metrics(output_dir, "orchestrator")}
        for record in records:
            print(step_line(record, orchestrator.get(record["step"]), max_steps), flush=True)
            printed += 1
        last = time.perf_counter()

    server_names = set(servers(config))
    several = server_names if len(server_names) > 1 else set()  # a run goes on without one of several servers
    failed, lost = None, set()
    with WaitNotice(config.progress_every_s) as notice:
        while failed is None and not all(children[name].poll() == 0 for name in ("trainer", "orchestrator")):
            print_new_steps()
            now = time.perf_counter()
            if printed == first and notice.due(now - start):
                url, started = config.orchestrator.client.base_urls[0], config.inference is not None
                phase = first_step_phase(output_dir, url, first, started)
                head = f"waiting for step {first + 1}: {phase} ({now - start:.0f}s)"
                notice.show(progress_line(head, read_progress(output_dir)))
            elif printed > first and notice.due(now - last):
                head = f"step {printed + 1}/{max_steps}" if printed < max_steps else "after the last step"
                notice.show(progress_line(f"{head} ({now - last:.0f}s)", read_progress(output_dir)))
            exited = (name for name, child in children.items() if name not in lost and child.poll() not in (None, 0))
            failed = next(exited, None)
            if failed in several and any(children[name].poll() is None for name in several - lost - {failed}):
                lost.add(failed)
                logger.warning(
                    f"{failed} exited with code {children[failed].poll()}: the run goes on with the other servers "
                    f"(last lines of {children[failed].log_path}:\n{log_tail(children[failed].log_path)})"
                )
                failed = None
            time.sleep(0.2)
        print_new_steps()
    if failed is not None:
        child = children[failed]
        logged_as = "inference" if failed in started_servers(config) else None  # a server logs as inference
        logger.error(child.lost or failure_message(failed, child.poll(), child.log_path, logged_as))
        return 1
    logger.info(f"run finished: {printed - first} steps in {time.perf_counter() - start:.1f}s")
    return 0


def run(config: RLConfig) -> int:
    check_envs_installed(config)
    check_env_datasets(config)
    build_tiny_models(config)
    check_model(config.trainer.model.name)
    check_lora_targets(config)
    on_gpu = gpu_memory_gib(config) is not None
    check_adapters_servable(config, on_gpu)
    settle_broadcast(config, on_gpu)
    if config.ray.planned_nodes is not None and not config.dry_run:
        raise TridentError(f"--ray.planned-nodes {config.ray.planned_nodes}: a planned cluster is for --dry-run; "
                           "give --ray.address alone to start the run on a cluster")  # fmt: skip
    ray_plan = plan_ray_run(config, gpu_memory_gib(config)) if config.ray.enabled else None
    plan = check_memory(config) if ray_plan is None else ray_plan.memory
    if ray_plan is None:
        check_gpus(config, on_gpu)
    output_dir = Path(config.trainer.output_dir)
    lock = lock_output_dir(output_dir)  # noqa: F841 (held until rl exits; a refused rl writes nothing)
    resume_from = resume_point(config)
    paths = write_configs(config, settle_run_spec(config))
    processes = process_commands(config, paths, on_gpu)
    if config.dry_run:
        for name, path in paths.items():
            print(f"{name}: {path}")
        where = placement_lines(config, on_gpu) if ray_plan is None else ray_plan.lines
        print("\n".join(where + server_lines(config)))
        print("commands:" if ray_plan is None else "commands (on its node; Ray sets each one's CUDA_VISIBLE_DEVICES):")
        for name, (argv, placement) in processes.items():
            print(f"  {name}: {shell_line(argv, placement if ray_plan is None else {})}")
        print("\n".join(plan.lines()))
        note_enforce_eager(config, on_gpu)
        return 0
    for server in started_servers(config).values() if ray_plan is None else []:  # on Ray: on its node
        check_port_free(server.host, server.port)
    log_dir = logs_dir(output_dir)
    log_to_file(log_dir / "rl.log")
    for line in plan.lines():
        logger.info(line)
    note_enforce_eager(config, on_gpu)
    for line in server_lines(config):
        logger.info(line)
    if resume_from:
        logger.info(f"resuming from checkpoint step {resume_from}")
    for path in clear_run_state(output_dir, resume_from):
        logger.info(f"deleted {path} of a previous run")

    stop_on_signals()
    children: dict[str, Child | RayChild] = {}
    cluster: RayRun | None = None
    start, code = time.perf_counter(), 1
    try:
        if ray_plan is None:
            for name, (argv, placement) in processes.items():
                children[name] = child = Child(name, argv, log_dir / f"{name}.log", child_env(placement))
                forked = " (forked by the preloaded starter)" if isinstance(child.popen, ForkedProcess) else ""
                logger.info(f"started {name} (pid {child.popen.pid}), log: {child.log_path}{forked}")
        else:
            cluster = RayRun(ray_plan, config.ray.placement_timeout_s)
            children = start_on_ray(cluster, config)
        code = supervise(children, config)
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping all processes")
        code = 130
    finally:
        keep_stopping()
        if cluster is not None:
            cluster.stop()
        else:
            stop_all(list(children.values()))
        logger.info("all processes stopped")
        status = {0: "finished", 130: "interrupted"}.get(code, "failed")
        logger.info(f"summary: {write_summary(output_dir, status, time.perf_counter() - start)}")
    if code == 0 and config.plots:
        write_plots_or_warn(output_dir)
    return code


def start_on_ray(cluster: RayRun, config: RLConfig) -> dict[str, RayChild]:
    """Start the run's processes on their nodes: the servers' addresses settled first (:meth:`RayRun.reach_servers`),
    then the run spec and the configs written again with them."""
    env = cluster.reach_servers(config)
    paths = write_configs(config, settle_run_spec(config))
    modules = {name: module_of(name, config) for name in paths}
    return cluster.start(modules, paths, Path(config.trainer.output_dir), env)


def launch(argv: list[str]) -> int:
    """``rl`` for one run: its config from ``argv`` (a mistake is one line and exit code 2), then :func:`run`;
    returns the exit code."""
    config = run_cli(RLConfig, "rl", argv)
    setup_logging("rl")  # resolve_shared may warn
    try:
        config = resolve_shared(config, on_gpu=gpu_memory_gib(config) is not None)
    except ConfigError as e:
        exit_config_error(e)
    setup_logging("rl", config.trainer.log.level)
    with exit_on_user_error("rl"):
        return run(config)
