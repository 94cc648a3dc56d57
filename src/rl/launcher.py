"""``uv run rl --trainer @ train.toml --orchestrator @ orch.toml --inference @ infer.toml``.

Resolves the three configs (shared fields made to agree), writes them to ``output_dir/configs/``, starts
inference, orchestrator and trainer with their output in ``output_dir/logs/``, prints one line per step,
and stops every process tree when the run ends, fails, or is interrupted.
"""

import logging
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import tomli_w

from rl.config import ConfigError, exit_config_error, parse_config, to_toml_dict
from rl.errors import exit_on_user_error
from rl.metrics import read_metrics, setup_logging, write_summary
from rl.preflight import check_envs_installed, check_port_free, gpu_env, lock_output_dir
from rl.process import Child
from rl.protocol import clear_run_state, configs_dir, logs_dir
from rl.rl_config import RLConfig, resolve_shared, sub_configs

logger = logging.getLogger("rl")

WAIT_NOTICE_S = 30.0  # how often to say what the run waits for before its first step

MODULES = {"inference": "inference.main", "orchestrator": "orchestrator.main", "trainer": "trainer.main"}


def write_configs(config: RLConfig) -> dict[str, Path]:
    """Write each process's resolved config as TOML; returns their paths."""
    folder = configs_dir(config.trainer.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, sub in sub_configs(config).items():
        paths[name] = folder / f"{name}.toml"
        paths[name].write_text(tomli_w.dumps(to_toml_dict(sub)))
    return paths


def child_env(placement: dict[str, str]) -> dict[str, str]:
    """Environment of a child: its GPUs, and one OpenMP thread on CPU, where three processes share the cores."""
    env = dict(os.environ) | placement
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file, indented, for the message that a process failed."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "  (no log)"
    return "\n".join(f"  | {line}" for line in text)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def first_step_phase(output_dir: Path, server_url: str) -> str:
    """What the run is doing before its first step is done, for the waiting user."""
    if read_metrics(output_dir, "orchestrator"):
        return "training step 1"
    try:
        if httpx.get(f"{server_url}/health", timeout=1).status_code == 200:
            return "sampling the first batch"
    except httpx.TransportError:
        pass
    return "starting the inference server"


def supervise(children: dict[str, Child], config: RLConfig) -> int:
    """Wait for trainer and orchestrator to finish, printing each trainer step; return the exit code."""
    output_dir, max_steps = Path(config.trainer.output_dir), config.trainer.max_steps
    printed = 0
    start = time.perf_counter()
    last = notice = start
    while True:
        if printed == 0 and time.perf_counter() - notice > WAIT_NOTICE_S:
            notice = time.perf_counter()
            phase = first_step_phase(output_dir, config.orchestrator.client.base_url)
            print(f"waiting for step 1: {phase} ({notice - start:.0f}s)", flush=True)
        for record in read_metrics(output_dir, "trainer")[printed:]:
            now = time.perf_counter()
            print(
                f"step {record['step'] + 1}/{max_steps} | reward {record['reward_mean']:.4f} "
                f"| loss {record['loss']:+.4f} | tokens {record['tokens']} | {now - last:.1f}s",
                flush=True,
            )
            last = now
            printed += 1
        for name, child in children.items():
            code = child.poll()
            if code not in (None, 0):
                tail = log_tail(child.log_path)
                logger.error(f"{name} exited with code {code}; last lines of {child.log_path}:\n{tail}")
                return 1
        if children["trainer"].poll() == 0 and children["orchestrator"].poll() == 0:
            logger.info(f"run finished: {printed} steps in {time.perf_counter() - start:.1f}s")
            return 0
        time.sleep(0.2)


def run(config: RLConfig) -> int:
    check_envs_installed(config)
    paths = write_configs(config)
    output_dir = Path(config.trainer.output_dir)
    if config.dry_run:
        for name, path in paths.items():
            print(f"{name}: {path}")
        return 0
    lock = lock_output_dir(output_dir)  # noqa: F841 (held until rl exits)
    check_port_free(config.inference.host, config.inference.port)
    log_dir = logs_dir(output_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger().addHandler(logging.FileHandler(log_dir / "rl.log", mode="w"))
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s rl %(levelname)s %(message)s", "%H:%M:%S"))
    for path in clear_run_state(output_dir):
        logger.info(f"deleted {path} of a previous run")

    placement = gpu_env(config)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    children: dict[str, Child] = {}
    start, code = time.perf_counter(), 1
    try:
        for name in ("inference", "orchestrator", "trainer"):
            log_path = log_dir / f"{name}.log"
            children[name] = Child(name, MODULES[name], paths[name], log_path, child_env(placement[name]))
            logger.info(f"started {name} (pid {children[name].popen.pid}), log: {children[name].log_path}")
        code = supervise(children, config)
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping all processes")
        code = 130
    finally:
        for child in reversed(children.values()):
            child.stop()
        logger.info("all processes stopped")
        status = {0: "finished", 130: "interrupted"}.get(code, "failed")
        logger.info(f"summary: {write_summary(output_dir, status, time.perf_counter() - start)}")
    return code


def main(argv: list[str] | None = None) -> None:
    setup_logging("rl")
    try:
        config = resolve_shared(parse_config(RLConfig, sys.argv[1:] if argv is None else argv))
    except ConfigError as e:
        exit_config_error(e)
    setup_logging("rl", config.trainer.log.level)
    with exit_on_user_error("rl"):
        code = run(config)
    sys.exit(code)


if __name__ == "__main__":
    main()
