"""Where an environment's agents run, as verifiers defines its runtimes.

verifiers runs an agent's program in a runtime: a local subprocess, or a container (docker, podman) or remote
sandbox. Trident runs it as a local subprocess unless the environment needs a container, which verifiers
states in three ways: the harness or the task class declares ``NEEDS_CONTAINER``, or a task names an image
(``TaskData.image``; the first task, read at start, is checked, a later one naming an image fails its rollouts with
verifiers' own message). Such an environment gets docker, else podman, where its daemon answers; where neither does,
loading it fails with one line. ``[[env]] runtime`` names the runtime instead of "auto".
"""

import shutil
import subprocess

import verifiers.v1 as vf
from verifiers.v1.utils.loaders import harness_class

from contracts.errors import TridentError

CONTAINER_RUNTIMES = {"docker": vf.DockerConfig, "podman": vf.PodmanConfig}
INFO_TIMEOUT_S = 20.0  # `docker info` waits on its daemon


def container_need(env: vf.Env, harness_id: str, first: vf.Task | None) -> str | None:
    """Why the loaded environment ``env`` (its agents on ``harness_id``, its first task ``first``: None for none)
    needs a container, or None."""
    if harness_class(harness_id).NEEDS_CONTAINER:
        return f"its harness {harness_id!r} declares NEEDS_CONTAINER"
    task_cls = type(env.taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        return f"its task class {task_cls.__name__} declares NEEDS_CONTAINER"
    if first is not None and first.data.image is not None:
        return f"its tasks name an image ({first.data.image!r})"
    return None


def daemon_problem(name: str) -> str | None:
    """Why container runtime ``name`` cannot run containers here (its command missing, or ``<name> info``
    failing: no daemon), or None when it can."""
    binary = shutil.which(name)
    if binary is None:
        return f"{name} is not installed"
    try:
        result = subprocess.run([binary, "info"], capture_output=True, text=True, timeout=INFO_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{name} info` failed: {type(e).__name__}: {e}"
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        return f"`{name} info` failed: {lines[-1] if lines else f'exit code {result.returncode}'}"
    return None


def container_runtime(env_id: str, runtime: str, need: str) -> vf.DockerConfig | vf.PodmanConfig:
    """The container runtime for environment ``env_id``: ``runtime`` ("docker", "podman", or "auto": docker, else
    podman), refused in one line naming ``need`` (why it needs one) where it cannot run containers here."""
    problems = []
    for name in CONTAINER_RUNTIMES if runtime == "auto" else (runtime,):
        problem = daemon_problem(name)
        if problem is None:
            return CONTAINER_RUNTIMES[name]()
        problems.append(problem)
    raise TridentError(
        f"environment {env_id!r} needs a container runtime ({need}), but {'; '.join(problems)}: start docker or "
        "podman on this machine, or run another environment"
    )
