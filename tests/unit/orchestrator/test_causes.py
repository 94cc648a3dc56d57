"""An error's cause: the line that names what went wrong, and the key that counts one cause once whatever
per-rollout text (temporary folders, ids, numbers, the model's reply) it carries."""

from rollouts import rollout

from orchestrator.batching.causes import cause_key, causes, error_cause, error_type

GIT = "HarnessError: harness 'bash' exited 128: Cloning into '/tmp/tmpk2j4x9/repo'...\nfatal: repository not found\n"
TRACEBACK = (
    "HarnessError: harness 'bash' exited 1: Traceback (most recent call last):\n"
    '  File "/tmp/tmpa1b2c3d4/run.py", line 3, in <module>\n    import nltk\n    ^^^^^^^^^^^\n\n'
    "ModuleNotFoundError: No module named 'nltk'\n"
)
CHAINED = (
    "TaskError: setup failed\nCalledProcessError: exit status 2\n\nThe above exception was the direct cause of the "
)
CHAINED += "following exception:\n\nRuntimeError: the task's volume is not mounted"


def test_error_types():
    assert error_type("InterceptionError: unauthorized request") == "InterceptionError"
    assert error_type("APIConnectionError") == "APIConnectionError"
    assert error_type("the environment returned no trace of a trainable agent") == "other"
    assert error_type(None) == "other"


def test_the_cause_is_the_last_meaningful_line_after_the_errors_type():
    assert error_cause("TaskError: no data") == "TaskError: no data"
    assert error_cause(GIT) == "HarnessError: fatal: repository not found"
    assert error_cause(TRACEBACK) == "HarnessError: ModuleNotFoundError: No module named 'nltk'"
    assert error_cause(CHAINED) == "TaskError: RuntimeError: the task's volume is not mounted"
    assert error_cause("ProviderError: 401 - unauthorized\n  at the interception server") == (
        "ProviderError: 401 - unauthorized"  # only a frame after it: the first line
    )
    assert error_cause("") == ""


def test_per_rollout_text_is_normalised_away_and_names_are_kept():
    def same(a: str, b: str) -> bool:
        return cause_key(a) == cause_key(b)

    assert same(
        "HarnessError: git clone failed in /tmp/tmpa1/x: fatal", "HarnessError: git clone failed in /tmp/b: fatal"
    )
    assert same(GIT.replace("k2j4x9", "zz99qq"), GIT)
    assert same("TaskError: cannot parse 'The answer is 4' as JSON", "TaskError: cannot parse 'I think 5' as JSON")
    assert same("SandboxError: box 3f2a9c01-1234-4abc-8def-0123456789ab gone", "SandboxError: box 00000000-1111-"
                "2222-3333-444444444444 gone")  # fmt: skip
    assert same("SandboxError: container 9f8e7d6c5b4a timed out after 12.5s", "SandboxError: container a0b1c2d3e4f5 "
                "timed out after 3s")  # fmt: skip
    assert same(
        "HarnessError: GET https://mcp.example/t?sig=abc1 failed",
        "HarnessError: GET https://mcp.example/t?sig=9z failed",
    )
    assert cause_key("HarnessError: git clone failed in /tmp/tmpa1/x: fatal") == (
        "HarnessError: git clone failed in <path>: fatal"
    )
    assert not same("ModuleNotFoundError: No module named 'nltk'", "ModuleNotFoundError: No module named 'numpy'")
    assert not same("TaskError: no data", "JudgeError: no data")
    assert (
        cause_key("HarnessError: Qwen3Renderer does not support it")
        == "HarnessError: Qwen3Renderer does not support it"
    )


def test_causes_are_counted_most_common_first_each_with_its_first_rollout():
    failed = [rollout(0.0, ok=False, error=f"TaskError: no row {i} in /data/{i}.jsonl", task=f"t{i}") for i in range(3)]
    failed.insert(1, rollout(0.0, ok=False, error="JudgeError: no verdict", task="j"))
    found = causes([*failed, rollout(1.0)])  # one without an error: not a cause
    assert [(c.key, c.count, c.first.task) for c in found] == [
        ("TaskError: no row <n> in <path>", 3, "t0"), ("JudgeError: no verdict", 1, "j")
    ]  # fmt: skip
    assert found[0].text == "TaskError: no row 0 in /data/0.jsonl"  # the first one's own text
