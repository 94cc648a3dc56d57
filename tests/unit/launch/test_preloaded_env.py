"""The preloaded starter forks a process only where the environment ``rl`` gives it could not have changed an
import the starter already made: what differs must be read at run time (Trident's and wandb's variables, pytest's)
or say how the process was launched (a shell's and uv's bookkeeping, PATH, the terminal's size)."""

from launch.preloaded import differing_env


def test_variables_read_at_run_time_may_differ():
    ours = {"PATH": "/bin", "TRIDENT_CACHE": "/a", "UV_RUN_RECURSION_DEPTH": "1", "PYTEST_CURRENT_TEST": "x (setup)",
            "PWD": "/", "SHLVL": "1"}  # fmt: skip
    theirs = {"PATH": "/venv/bin:/bin", "TRIDENT_CACHE": "/b", "TRIDENT_LAUNCHER_PID": "12", "WANDB_MODE": "offline",
              "PYTEST_CURRENT_TEST": "x (call)", "PWD": "/tmp", "SHLVL": "2", "UV_RUN_RECURSION_DEPTH": "2",
              "VIRTUAL_ENV": "/venv", "COLUMNS": "80", "LINES": "24"}  # fmt: skip
    assert differing_env(ours, theirs) == []


def test_a_variable_an_import_may_read_set_otherwise_added_or_removed_is_named():
    ours = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "/src", "CUDA_VISIBLE_DEVICES": ""}
    theirs = {"OMP_NUM_THREADS": "4", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert differing_env(ours, theirs) == ["CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH"]
