"""An orchestrator or trainer forked by a preloaded starter (:mod:`launch.preloaded`) behaves as one ``rl`` starts
itself: its config read from ``rl``'s working directory, its output in its log, its exit code, a session of its own
that ``rl``'s stop ends, and the environment ``rl`` gives it. Where the environment differs in what an import may have
read, the starter refuses and ``rl`` starts the process itself. One starter for the module (about 15 CPU s of
imports)."""

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rl_runs import DEBUG

from launch.preloaded import PRELOADED_ENV, ForkedProcess, start, start_starter, stop_starter
from launch.process import Child, command, stop_all
from launch.supervise import child_env

CPU = {"CUDA_VISIBLE_DEVICES": ""}  # how rl places a process on the CPU


@pytest.fixture(scope="module")
def starter(tmp_path_factory) -> str:
    """A starter with the environment rl gives a process on the CPU, once its imports are done: its socket."""
    folder = tmp_path_factory.mktemp("starter")
    env = {key: value for key, value in child_env(CPU).items() if key != PRELOADED_ENV}  # not the suite's starter
    process = start_starter(folder / "starter.sock", env, folder / "starter.log", wait_s=600)
    try:
        yield str(folder / "starter.sock")
    finally:
        stop_starter(process)


@pytest.fixture
def rl_env(starter) -> Callable[[dict[str, str]], dict[str, str]]:
    """The environment rl gives a process placed as ``placement``, naming this module's starter."""
    return lambda placement: child_env(placement) | {PRELOADED_ENV: starter}


def test_a_forked_trainer_reads_its_config_from_rls_directory_and_exits_as_it_would(tmp_path, monkeypatch, rl_env):
    monkeypatch.chdir(tmp_path)
    Path("bad.toml").write_text("[optim]\nlr = -1.0\n")
    log = tmp_path / "trainer.log"
    child = Child("trainer", command("trainer.main", Path("bad.toml")), log, rl_env(CPU))
    assert isinstance(child.popen, ForkedProcess)
    assert child.popen.wait(timeout=120) == 2, log.read_text()
    text = log.read_text()
    assert "bad.toml" in text and "optim.lr" in text and "Traceback" not in text, text


def test_a_forked_trainer_leads_its_own_session_and_stops_as_rl_stops_it(tmp_path, rl_env):
    log = tmp_path / "trainer.log"
    argv = [*command("trainer.main", DEBUG / "train.toml"), "--output-dir", str(tmp_path)]
    child = Child("trainer", argv, log, rl_env(CPU))
    assert isinstance(child.popen, ForkedProcess)
    pid = child.popen.pid
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid  # not in the test's session: rl's stop reaches its group
    time.sleep(2)
    assert child.poll() is None, log.read_text()  # waiting for its first batch
    stop_all([child], grace_s=30)
    assert child.poll() == -signal.SIGTERM, log.read_text()
    assert not child.group_alive()


def test_an_environment_an_import_may_have_read_makes_rl_start_the_process_itself(tmp_path, rl_env):
    env = rl_env(CPU) | {"OMP_NUM_THREADS": "3"}
    missing = tmp_path / "missing.toml"
    assert start(command("trainer.main", missing), tmp_path / "forked.log", env) is None
    assert not (tmp_path / "forked.log").exists()  # nothing was forked
    child = Child("trainer", command("trainer.main", missing), tmp_path / "trainer.log", env)
    assert isinstance(child.popen, subprocess.Popen)  # started by rl itself
    assert child.popen.wait(timeout=120) == 2 and "missing.toml" in (tmp_path / "trainer.log").read_text()
    assert start(command("inference.main", missing), tmp_path / "forked.log", rl_env(CPU)) is None  # not preloaded


def test_a_pythonpath_that_adds_folders_of_new_modules_is_forked_with_them_first_on_its_path(tmp_path, rl_env):
    """The config names a custom loss in a module only the added folder holds: the forked trainer imports it (its
    only complaint is the learning rate). A folder holding a module the starter has imported (``torch``) would
    change what a process of its own imports: rl starts that one itself."""
    added, shadowing = tmp_path / "user_code", tmp_path / "shadowing"
    added.mkdir(), shadowing.mkdir()
    (added / "user_loss_term.py").write_text(
        "def term(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths):\n    return logprobs.sum()\n"
    )
    (shadowing / "torch.py").write_text("")
    config = tmp_path / "custom.toml"
    config.write_text('[optim]\nlr = -1.0\n\n[loss]\ncustom = "user_loss_term:term"\n')
    env = rl_env(CPU)
    log = tmp_path / "trainer.log"
    child = Child("trainer", command("trainer.main", config), log, env | {"PYTHONPATH": str(added)})
    assert isinstance(child.popen, ForkedProcess)
    assert child.popen.wait(timeout=120) == 2, log.read_text()
    assert "optim.lr" in log.read_text() and "user_loss_term" not in log.read_text(), log.read_text()
    refused = start(command("trainer.main", config), tmp_path / "forked.log", env | {"PYTHONPATH": str(shadowing)})
    assert refused is None and not (tmp_path / "forked.log").exists()
