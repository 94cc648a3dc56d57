"""verifiers' runtimes as verifiers defines them: an environment that needs a container gets docker or podman where
its daemon answers, one line where not; one that does not runs its agents as local subprocesses; verifiers' warnings
name Trident's keys, and none about the subprocess runtime is left for an environment that does not run in it."""

import logging
import os
import stat
import sys

import pytest
import verifiers.v1 as vf

from contracts.errors import TridentError
from orchestrator.config import EnvConfig
from orchestrator.verifiers_adapter.envs import load_env

# verifiers imports a taskset by id: this module is the `trident-test-containers` taskset package.
ENV_ID = "trident-test-containers"
sys.modules.setdefault(ENV_ID.replace("-", "_"), sys.modules[__name__])


class ContainerConfig(vf.TasksetConfig):
    kind: str = "plain"  # "plain", "image" (tasks name an image) or "needs" (tests make the task class ContainerTask)


class PlainTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class ContainerTask(PlainTask):
    NEEDS_CONTAINER = True  # e.g. its set-up builds a repository inside the box


class ContainerTaskset(vf.Taskset[PlainTask, ContainerConfig]):
    def load(self):
        image = "python:3.12-slim" if self.config.kind == "image" else None
        task_cls = ContainerTask if self.config.kind == "needs" else PlainTask
        yield task_cls(vf.TaskData(id="t0", prompt="Say hi.", image=image), self.config.task)


__all__ = ["ContainerTaskset"]


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A PATH holding only python and the container commands a test writes with :func:`install`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")
    monkeypatch.setenv("PATH", str(bin_dir))

    def install(name: str, info_exit: int, message: str = "") -> None:
        """A ``name`` command whose ``info`` prints ``message`` to stderr and exits ``info_exit``; every call is
        recorded in ``<name>.calls``."""
        script = bin_dir / name
        script.write_text(
            f'#!/bin/sh\necho "$@" >> {tmp_path / (name + ".calls")}\n'
            f'[ "$1" = info ] && {{ echo "{message}" >&2; exit {info_exit}; }}\nexit 0\n'
        )
        script.chmod(script.stat().st_mode | stat.S_IEXEC)

    install.calls = lambda name: (tmp_path / f"{name}.calls").read_text().split("\n")[:-1]
    return install


def agent_runtime(env: vf.Env) -> str:
    return env.config.agent.runtime.type


def test_an_environment_that_needs_no_container_runs_as_subprocesses_without_asking_docker(machine):
    machine("docker", 0)
    env = load_env(EnvConfig(id=ENV_ID))
    assert agent_runtime(env) == "subprocess"
    with pytest.raises(FileNotFoundError):
        machine.calls("docker")  # not even `docker info`


def test_tasks_that_name_an_image_get_docker_where_its_daemon_answers(machine):
    machine("docker", 0)
    env = load_env(EnvConfig(id=ENV_ID, args={"kind": "image"}))
    assert agent_runtime(env) == "docker"
    assert machine.calls("docker") == ["info"]


def test_a_task_class_that_needs_a_container_gets_podman_when_docker_has_no_daemon(machine, monkeypatch):
    monkeypatch.setattr(ContainerTaskset, "task_type", classmethod(lambda cls: ContainerTask))
    machine("docker", 1, "Cannot connect to the Docker daemon at unix:///var/run/docker.sock.")
    machine("podman", 0)
    env = load_env(EnvConfig(id=ENV_ID, args={"kind": "needs"}))
    assert agent_runtime(env) == "podman"


def test_no_container_runtime_is_one_line_naming_the_need_and_what_is_missing(machine, monkeypatch):
    monkeypatch.setattr(ContainerTaskset, "task_type", classmethod(lambda cls: ContainerTask))
    machine("docker", 1, "Cannot connect to the Docker daemon at unix:///var/run/docker.sock.")
    with pytest.raises(TridentError) as error:
        load_env(EnvConfig(id=ENV_ID, args={"kind": "needs"}))
    message = str(error.value)
    assert "\n" not in message
    assert f"environment {ENV_ID!r} needs a container runtime" in message
    assert "ContainerTask declares NEEDS_CONTAINER" in message
    assert "Cannot connect to the Docker daemon" in message
    assert "podman is not installed" in message


def test_a_named_runtime_is_used_or_refused(machine):
    with pytest.raises(TridentError, match=r"\[\[env\]\] runtime = 'podman'.*podman is not installed"):
        load_env(EnvConfig(id=ENV_ID, runtime="podman"))
    machine("podman", 0)
    assert agent_runtime(load_env(EnvConfig(id=ENV_ID, runtime="podman"))) == "podman"
    # an image needs a container: verifiers refuses it per rollout under a subprocess named by the user
    assert agent_runtime(load_env(EnvConfig(id=ENV_ID, args={"kind": "image"}, runtime="subprocess"))) == "subprocess"


def subprocess_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "subprocess runtime" in r.getMessage()]


def test_verifiers_warning_about_the_subprocess_runtime_names_trident_keys(caplog):
    with caplog.at_level(logging.WARNING):
        load_env(EnvConfig(id=ENV_ID, harness="bash"))  # bash executes code: verifiers warns about running it locally
    (warning,) = subprocess_warnings(caplog)
    assert "Harness 'bash' is running in the subprocess runtime" in warning
    assert '[[env]] runtime = "docker"' in warning and "--env." not in warning


def test_verifiers_subprocess_warning_is_dropped_for_a_refused_environment(machine, monkeypatch, caplog):
    monkeypatch.setattr(ContainerTaskset, "task_type", classmethod(lambda cls: ContainerTask))
    with caplog.at_level(logging.WARNING), pytest.raises(TridentError, match="needs a container runtime"):
        load_env(EnvConfig(id=ENV_ID, harness="bash", args={"kind": "needs"}))
    assert subprocess_warnings(caplog) == []


def test_verifiers_taskset_flags_read_as_env_args(caplog):
    harbor = logging.getLogger("verifiers.v1.tasksets.harbor.taskset")  # its message, as verifiers 0.4.0 logs it
    with caplog.at_level(logging.WARNING):
        harbor.warning(
            "%s: asks for a separate verifier; grading in the agent's box anyway (--taskset.ignore-separate-verifier)",
            "task-7",
        )
    assert caplog.records[-1].getMessage().endswith("anyway ([[env]] args.ignore_separate_verifier)")
