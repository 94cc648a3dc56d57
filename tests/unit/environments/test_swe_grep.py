import asyncio
import fcntl
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import swe_grep_oss_env
import verifiers.v1 as vf
from dataset_rows import DatasetSpec
from jsonl_files import write_jsonl
from swe_grep_oss_env import rewards, sandbox, swebench, synthetic, tools
from swe_grep_oss_env.catalog import BUGS, MODULES
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.types import AssistantMessage, ToolCall, UserMessage

from orchestrator.verifiers_adapter.harness import InProcessHarness

# --- the generator


def test_same_seed_same_task_and_seeds_differ():
    assert synthetic.plan(11) == synthetic.plan(11)
    assert synthetic.repo_files(synthetic.plan(11)) == synthetic.repo_files(synthetic.plan(11))
    assert len({synthetic.plan(seed).issue for seed in range(64)}) > 20


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_answer_files_are_exactly_the_files_the_bug_changes(bug):
    for seed in range(8):
        plan = synthetic.plan(seed, bug=bug)
        clean, planted = synthetic.repo_files(plan, plant_bug=False), synthetic.repo_files(plan)
        assert clean.keys() == planted.keys()
        changed = sorted(path for path in clean if clean[path] != planted[path])
        assert changed == plan.answer_files
        assert 1 <= len(plan.answer_files) <= 2


def _run_generated_tests(files: dict[str, str], root: Path, package: str) -> dict[str, bool]:
    """Write a generated repository and run its tests in this process: test name -> passed."""
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    sys.path.insert(0, str(root))
    outcomes = {}
    try:
        for relative in files:
            if relative.startswith("tests/"):
                spec = importlib.util.spec_from_file_location(f"generated_{Path(relative).stem}", root / relative)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                for name in [name for name in vars(module) if name.startswith("test_")]:
                    try:
                        getattr(module, name)()
                        outcomes[name] = True
                    except (Exception, pytest.fail.Exception):
                        outcomes[name] = False
    finally:
        sys.path.remove(str(root))
        for name in [name for name in sys.modules if name.split(".")[0] == package]:
            del sys.modules[name]
    return outcomes


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_generated_code_runs_its_tests_pass_and_the_bug_is_real(bug, tmp_path):
    plan = synthetic.plan(5, bug=bug)
    plan = synthetic.Plan(**{**plan.__dict__, "tested": plan.modules})  # every test file, for coverage
    planted = synthetic.repo_files(plan)
    for relative, text in planted.items():
        if relative.endswith(".py"):
            compile(text, relative, "exec")
    assert all(_run_generated_tests(planted, tmp_path / "planted", plan.package).values())
    # The tests left out of this repository because they catch the bug do fail on it, and pass without it.
    catching = [(name, test) for name in plan.modules for test in MODULES[name].tests if bug in test.catches]
    for name, test in catching:
        test_file = {
            "tests/test_catching.py": synthetic.fill(
                MODULES[name].test_imports + "\n\n" + test.code, synthetic.placeholders(plan.theme)
            )
        }
        clean = synthetic.repo_files(plan, plant_bug=False) | test_file
        assert all(_run_generated_tests(clean, tmp_path / f"clean_{name}", plan.package).values())
        assert not all(_run_generated_tests(planted | test_file, tmp_path / f"caught_{name}", plan.package).values())


def test_issue_points_at_the_answer_through_the_code():
    """The issue is in user terms but greppable: some quoted word of it appears in the repository's code."""
    plan = synthetic.plan(0, bug="validation_zero_quantity")
    files = synthetic.repo_files(plan)
    assert "quantity must be positive" in plan.issue
    assert [path for path, text in files.items() if "quantity must be positive" in text and "tests/" not in path] == [
        plan.answer_files[0]
    ]


# --- the taskset


def test_taskset_builds_tasks_with_the_harness_fields_without_writing_repositories(monkeypatch):
    def no_repository(*args, **kwargs):
        raise AssertionError("a task's repository is generated in its set-up, not when the taskset loads")

    config = swe_grep_oss_env.SweGrepConfig(max_tokens=1024, max_tool_calls=20)
    with monkeypatch.context() as patch:
        patch.setattr(synthetic, "repo_files", no_repository)
        tasks = list(swe_grep_oss_env.SweGrepTaskset(config))
    assert len(tasks) == 64 and len({task.data.id for task in tasks}) == 64
    data = tasks[0].data
    assert data.tools == ["swe_grep_oss_env.tools:bash", "swe_grep_oss_env.tools:result"]
    assert data.final_tools == ["result"]
    assert data.max_turns == 21
    assert data.idx == 0 and data.system_prompt and "<issue>" in data.prompt
    assert [task.data.answer_files for task in swe_grep_oss_env.SweGrepTaskset(config)] == [
        task.data.answer_files for task in tasks
    ]


def test_exactly_one_taskset_is_exported_with_the_harness_it_is_written_for():
    exported = [getattr(swe_grep_oss_env, name) for name in swe_grep_oss_env.__all__]
    assert [cls for cls in exported if isinstance(cls, type) and issubclass(cls, vf.Taskset)] == [
        swe_grep_oss_env.SweGrepTaskset
    ]
    assert [cls for cls in exported if isinstance(cls, type) and issubclass(cls, vf.Harness)] == [InProcessHarness]
    assert not [cls for cls in exported if isinstance(cls, type) and issubclass(cls, vf.Env)]


def test_setup_writes_the_generated_repository(tmp_path):
    task = next(iter(swe_grep_oss_env.SweGrepTaskset(swe_grep_oss_env.SweGrepConfig(num_examples=1))))
    asyncio.run(task.setup(None, SimpleNamespace(workdir=tmp_path)))
    repo = tmp_path / "repo"
    assert (repo / "README.md").is_file()
    assert all((repo / path).is_file() for path in task.data.answer_files)


# --- rewards


def _tool_call(name: str, arguments, index: int = 0) -> ToolCall:
    return ToolCall(id=f"call{index}", name=name, arguments=json.dumps(arguments))


def test_normalize_path():
    assert rewards.normalize_path("./a//b/../c.py") == "a/c.py"
    assert rewards.normalize_path(" a\\b.py ") == "a/b.py"
    assert rewards.normalize_path("/root/.cache/x/repo/pkg/a.py") == "pkg/a.py"
    assert rewards.normalize_path(".") == ""


def test_named_files_reads_the_last_result_call():
    messages = [
        AssistantMessage(tool_calls=[_tool_call("bash", {"command": "ls"})]),
        AssistantMessage(tool_calls=[_tool_call("result", {"files": ["x.py"]})]),
        AssistantMessage(tool_calls=[_tool_call("result", {"files": ["./a.py", "a.py", "b/c.py"]})]),
    ]
    assert rewards.named_files(messages) == ["a.py", "b/c.py"]
    assert rewards.named_files(messages[:1]) is None
    assert rewards.named_files([AssistantMessage(tool_calls=[ToolCall(id="1", name="result", arguments="{")])]) == []
    openai_shaped = SimpleNamespace(
        tool_calls=[SimpleNamespace(function=SimpleNamespace(name="result", arguments='{"files": "a.py"}'))]
    )
    assert rewards.named_files([openai_shaped]) == ["a.py"]
    assert len(rewards.tool_calls(messages)) == 3


def test_file_scores():
    scores = rewards.file_scores(["a.py", "./wrong.py"], ["a.py", "b.py"])
    assert (scores.correct, scores.incorrect, scores.missed) == (0.5, 0.5, 0.5)
    assert rewards.file_scores(["b.py", "a.py"], ["a.py", "b.py"]) == rewards.FileScores(1.0, 0.0, 0.0)
    assert rewards.file_scores(None, ["a.py"]) == rewards.FileScores(0.0, 0.0, 1.0)
    assert rewards.file_scores([], ["a.py"]) == rewards.FileScores(0.0, 0.0, 1.0)


def test_sampled_tokens_and_limits():
    nodes = [
        SimpleNamespace(sampled=False, mask=[False] * 5),
        SimpleNamespace(sampled=True, mask=[False, True, True]),
        SimpleNamespace(sampled=True, mask=[True] * 4),
    ]
    assert rewards.sampled_token_count(nodes, completion_tokens=99) == 6
    assert rewards.sampled_token_count([SimpleNamespace(sampled=True, mask=[])], completion_tokens=7) == 7
    assert rewards.sampled_token_count([], completion_tokens=None) == 0
    assert rewards.over_limit(6, 5) == 1.0 and rewards.over_limit(5, 5) == 0.0


def test_scoring_through_verifiers_uses_the_configured_weights():
    config = swe_grep_oss_env.SweGrepConfig(
        num_examples=1, max_tokens=10, max_tool_calls=1, incorrect_files_weight=-1.0
    )
    task = next(iter(swe_grep_oss_env.SweGrepTaskset(config)))
    answer = task.data.answer_files[0]
    nodes = [
        MessageNode(message=UserMessage(content="issue")),
        MessageNode(
            parent=0,
            message=AssistantMessage(tool_calls=[_tool_call("bash", {"command": "grep -rn x ."}, 1)]),
            sampled=True,
            token_ids=[1] * 8,
            mask=[False] * 2 + [True] * 6,
        ),
        MessageNode(
            parent=1,
            message=AssistantMessage(tool_calls=[_tool_call("result", {"files": [f"./{answer}", "README.md"]}, 2)]),
            sampled=True,
            token_ids=[1] * 8,
            mask=[False] * 2 + [True] * 6,
        ),
    ]
    trace = vf.Trace(
        task=TraceTask(type="SweGrepTask", data=task.data), agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes
    )
    asyncio.run(task.score(trace))
    scores = {name: (reward.score, reward.weight) for name, reward in trace.rewards.items()}
    assert scores == {
        "correct_files_reward": (1.0, 1.0),
        "incorrect_files_penalty": (0.5, -1.0),
        "missed_files_penalty": (0.0, -0.25),
        "max_tokens_penalty": (1.0, -0.5),  # 12 sampled tokens > 10
        "max_tool_calls_penalty": (1.0, -0.5),  # 2 calls > 1
        "completion_bonus": (1.0, 0.1),
    }


# --- SWE-bench style records

PATCH = """diff --git a/src/pkg/core.py b/src/pkg/core.py
--- a/src/pkg/core.py
+++ b/src/pkg/core.py
@@ -1 +1 @@
-x = 1
+x = 2
diff --git a/src/pkg/util.py b/src/pkg/util.py
--- a/src/pkg/util.py
+++ b/src/pkg/util.py
@@ -1 +1 @@
-y = 1
+y = 2
"""


def _write_dataset(tmp_path: Path) -> Path:
    for name in ("snap-a", "repos/proj__proj-2"):
        (tmp_path / name / "src" / "pkg").mkdir(parents=True)
        (tmp_path / name / "src" / "pkg" / "core.py").write_text("x = 1\n")
        (tmp_path / name / ".git").mkdir()
        (tmp_path / name / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    rows = [
        {"instance_id": "proj__proj-1", "problem_statement": "x is 1", "patch": PATCH, "repo_path": "snap-a"},
        {
            "instance_id": "proj__proj-2",
            "problem_statement": "y is 1",
            "patch": PATCH.split("diff --git a/src/pkg/util")[0],
        },
    ]
    path = tmp_path / "lite.jsonl"
    write_jsonl(path, [*rows, ""])  # a blank last line
    return path


def test_loader_reads_records_and_the_taskset_copies_snapshots(tmp_path):
    path = _write_dataset(tmp_path)
    records = list(swebench.read_records(DatasetSpec(path=str(path))))
    assert [record.answer_files for record in records] == [["src/pkg/core.py", "src/pkg/util.py"], ["src/pkg/core.py"]]
    assert records[0].repo_path == str((tmp_path / "snap-a").resolve())
    assert records[1].repo_path == str((tmp_path / "repos" / "proj__proj-2").resolve())

    tasks = list(swe_grep_oss_env.SweGrepTaskset(swe_grep_oss_env.SweGrepConfig(dataset_path=str(path))))
    assert [task.data.id for task in tasks] == ["proj__proj-1", "proj__proj-2"]
    assert "x is 1" in tasks[0].data.prompt
    workdir = tmp_path / "rollout"
    workdir.mkdir()
    asyncio.run(tasks[0].setup(None, SimpleNamespace(workdir=workdir)))
    assert (workdir / "repo" / "src" / "pkg" / "core.py").read_text() == "x = 1\n"
    assert not (workdir / "repo" / ".git").exists()


def test_the_taskset_reads_a_parquet_dataset_with_a_renamed_column_streamed(tmp_path):
    rows = [json.loads(line) for line in _write_dataset(tmp_path).read_text().splitlines() if line]
    renamed = [{"issue" if key == "problem_statement" else key: value for key, value in row.items()} for row in rows]
    datasets.Dataset.from_list(renamed).to_parquet(tmp_path / "lite.parquet")
    dataset = {"path": str(tmp_path / "lite.parquet"), "columns": {"problem_statement": "issue"}, "streaming": True}
    from_parquet = list(swe_grep_oss_env.SweGrepTaskset(swe_grep_oss_env.SweGrepConfig(dataset=dataset)))
    config = swe_grep_oss_env.SweGrepConfig(dataset_path=str(tmp_path / "lite.jsonl"))
    from_jsonl = list(swe_grep_oss_env.SweGrepTaskset(config))
    assert [task.data.model_dump() for task in from_parquet] == [task.data.model_dump() for task in from_jsonl]
    assert from_parquet[1].data.repo_path == str((tmp_path / "repos" / "proj__proj-2").resolve())


def test_loader_error_names_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"instance_id": "a", "problem_statement": "p", "patch": PATCH, "repo_path": "."}
    write_jsonl(path, [good, {"instance_id": "b", "patch": PATCH}])
    with pytest.raises(swebench.DatasetError, match=r"bad\.jsonl:2: missing field 'problem_statement'"):
        list(swebench.read_records(DatasetSpec(path=str(path))))
    write_jsonl(path, [good | {"repo_path": "nowhere"}])
    with pytest.raises(swebench.DatasetError, match=r"bad\.jsonl:1: no repository snapshot"):
        list(swebench.read_records(DatasetSpec(path=str(path))))


def test_patch_files_without_git_headers():
    patch = "--- a/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n--- /dev/null\n+++ b/new.py\n@@ -0,0 +1 @@\n+y\n"
    assert swebench.patch_files(patch) == ["old.py", "new.py"]
    assert swebench.patch_files("not a diff") == []


# --- the bash tool's confinement

needs_landlock = pytest.mark.skipif(sandbox.landlock_abi() < 1, reason="this kernel has no Landlock")
# generous: starting the sandbox takes a good part of a second on a loaded 2-core machine
LIMITS = {"bash_timeout_s": 10.0, "bash_output_bytes": 4096}


@pytest.fixture
def copy(tmp_path) -> SimpleNamespace:
    """A fake runtime whose workdir holds a repository copy, with a secret file beside the copy."""
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "main.py").write_text("print('hello')\n")
    (tmp_path / "secret.txt").write_text("TOP-SECRET\n")
    return SimpleNamespace(workdir=tmp_path)


def _bash(command: str, runtime, **limits) -> str:
    return asyncio.run(tools.bash(command, runtime, SimpleNamespace(**(LIMITS | limits))))


@needs_landlock
def test_bash_reads_the_copy_but_nothing_private_outside(copy):
    assert "hello" in _bash("cat main.py && grep -rn hello .", copy)
    assert "TOP-SECRET" not in _bash(f"cat ../secret.txt {copy.workdir}/secret.txt", copy)
    assert "Permission denied" in _bash("cat /etc/shadow", copy)
    assert "Permission denied" in _bash("ls /root", copy)
    assert "Permission denied" in _bash("cat /proc/1/environ", copy)


@needs_landlock
def test_bash_writes_only_inside_the_copy(copy):
    in_tmp = Path(f"/tmp/swe-grep-test-{os.getpid()}-{time.monotonic_ns()}.txt")
    try:
        _bash(f"echo inside > new.txt; echo outside > {copy.workdir}/outside.txt; echo tmp > {in_tmp}", copy)
        assert (copy.workdir / "repo" / "new.txt").read_text() == "inside\n"
        assert not (copy.workdir / "outside.txt").exists()
        assert not in_tmp.exists()
    finally:
        in_tmp.unlink(missing_ok=True)


@needs_landlock
def test_bash_cannot_connect_to_a_local_tcp_port(copy):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        output = _bash(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED", copy)
        output += _bash(
            f'python3 -c \'import socket; socket.create_connection(("127.0.0.1", {port})); print("CONNECTED")\'', copy
        )
        assert "CONNECTED" not in output
        with pytest.raises(BlockingIOError):
            server.accept()


@needs_landlock
@pytest.mark.parametrize("command", ["sleep 100; echo finished", "while true; do :; done"])
def test_bash_kills_commands_at_the_timeout(copy, command):
    limits = SimpleNamespace(**(LIMITS | {"bash_timeout_s": 1.0}))
    output = asyncio.run(asyncio.wait_for(tools.bash(command, copy, limits), 120))  # 120 s: only against a hang
    assert "[command killed after 1 s]" in output and "finished" not in output


@needs_landlock
def test_bash_caps_huge_output(copy):
    output = _bash("yes | head -c 1000000", copy)
    assert len(output.encode()) < 4096 + 200
    assert "[output cut at 4096 bytes" in output


@needs_landlock
def test_bash_environment_is_scrubbed(copy, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    output = _bash("env", copy)
    assert "sk-should-not-leak" not in output
    assert f"HOME={copy.workdir / 'repo'}" in output


def _namespaces_available() -> bool:
    probe = f"import sys; sys.path.insert(0, {str(Path(sandbox.__file__).parent)!r}); import sandbox; "
    probe += "sys.exit(0 if sandbox.enter_namespaces() else 1)"
    return subprocess.run([sys.executable, "-I", "-S", "-c", probe]).returncode == 0


@needs_landlock
@pytest.mark.skipif(not _namespaces_available(), reason="no PID namespace: detached processes can outlive a command")
def test_bash_detached_processes_die_with_the_command(copy):
    """A detached process holds a lock on a file of the copy (for 10 minutes); once the command ends, the lock is
    free: the process is gone."""
    holder = (
        "import fcntl, time; f = open('lock', 'w'); fcntl.flock(f, fcntl.LOCK_EX); open('held', 'w'); time.sleep(600)"
    )
    output = _bash(f'(setsid python3 -c "{holder}" &); until [ -e held ]; do sleep 0.05; done; echo started', copy)
    assert "started" in output  # the detached process took the lock before the command ended
    with open(copy.workdir / "repo" / "lock") as lock:
        deadline = time.monotonic() + 60  # only against a hang: the holder would keep it for 600 s
        while not try_lock(lock):
            assert time.monotonic() < deadline, "the detached process still holds its lock"
            time.sleep(0.05)


def try_lock(file) -> bool:
    """Whether an exclusive lock on ``file`` could be taken (and was) without waiting."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def test_bash_refuses_without_landlock(copy, monkeypatch):
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
    with pytest.raises(tools.SandboxUnavailable, match="Landlock"):
        _bash("echo unconfined", copy)
    assert sandbox.main([str(copy.workdir / "repo"), "--", "/bin/echo", "unconfined"]) == sandbox.REFUSED


def test_result_tool_acknowledges():
    assert tools.result(["a.py", "b.py"]) == "Recorded 2 file(s): a.py, b.py"
