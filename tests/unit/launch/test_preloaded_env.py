"""The preloaded starter forks a process only where the environment ``rl`` gives it could not have changed an
import the starter already made: what differs must be read at run time (Trident's and wandb's variables, pytest's)
or say how the process was launched (a shell's and uv's bookkeeping, PATH, the terminal's size)."""

from launch.preloaded import added_path, differing_env


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


def test_a_pythonpath_may_put_folders_of_modules_not_imported_before_the_starters(tmp_path):
    new, imported = tmp_path / "new", tmp_path / "imported"
    new.mkdir(), imported.mkdir()
    (new / "user_env_module.py").write_text("")
    (imported / "json.py").write_text("")  # imported by this process: a process of its own would import this one
    ours = {"PYTHONPATH": "/src"}
    assert added_path(ours, {"PYTHONPATH": f"{new}:/src"}) == [str(new)]
    assert added_path(ours, ours) == [] and added_path({}, {"PYTHONPATH": str(new)}) == [str(new)]
    assert differing_env(ours, {"PYTHONPATH": f"{new}:/src"}) == []
    for theirs in (f"{imported}:/src", f"/src:{new}", str(new), f"{new}::/src"):  # shadowing, after, without, ""
        assert added_path(ours, {"PYTHONPATH": theirs}) is None, theirs
        assert differing_env(ours, {"PYTHONPATH": theirs}) == ["PYTHONPATH"], theirs
