"""A process of a run stops when ``rl`` is gone, even when ``rl`` is SIGKILLed, and takes what it started with it (by
its mark, when it was SIGKILLed itself): real processes, real signals."""

import os
import signal
import subprocess
import sys

from procs import alive, group_running, wait_gone

from contracts.lifeline import marked, stop_marked

# A stand-in for rl: it starts the child (a group leader, or not) and a bystander in its own group, prints both pids.
LAUNCHER = """
import os, subprocess, sys, time
from contracts.lifeline import launcher_env
leader = sys.argv[2] == "leader"
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=leader, env=os.environ | launcher_env())
bystander = subprocess.Popen(["sleep", "600"])
print(child.pid, bystander.pid, flush=True)
time.sleep(600)
"""
# A process of the run: it watches rl, and starts a process into its group that ignores SIGTERM.
CHILD = """
import subprocess, sys, time
from contracts.lifeline import watch_launcher
watch_launcher(grace_s=1)
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(99)"
subprocess.Popen([sys.executable, "-c", stubborn], stdout=sys.stdout).wait()
"""


def start_launcher(leader: bool) -> tuple[subprocess.Popen, int, int]:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, CHILD, "leader" if leader else "member"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    child, bystander = map(int, launcher.stdout.readline().split())
    assert launcher.stdout.readline().strip() == "up"  # the stubborn grandchild runs
    return launcher, child, bystander


def test_a_child_leading_its_group_stops_it_all_when_rl_is_killed():
    launcher, child, bystander = start_launcher(leader=True)
    try:
        launcher.kill()  # SIGKILL: rl runs no teardown at all
        launcher.wait()
        # the grandchild ignores SIGTERM: the group ends only by the SIGKILL that follows the 1 s grace
        took = wait_gone(lambda: group_running(child), timeout_s=15)
        assert took >= 1.0
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)


def test_a_child_that_leads_no_group_stops_only_itself():
    """Started in the launcher's group (not as rl starts it), a process must not stop a group that is not its own."""
    launcher, child, bystander = start_launcher(leader=False)
    try:
        launcher.kill()
        launcher.wait()
        wait_gone(lambda: alive(child), timeout_s=15)
        assert alive(bystander)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)


# A process of the run that starts what verifiers starts: processes in sessions of their own, one of which leaves an
# orphan in yet another session (its parent exits at once), and one that ignores SIGTERM. Prints their pids.
STARTER = """
import subprocess, sys, time
from contracts.lifeline import stop_descendants_on_exit
stop_descendants_on_exit(grace_s=1)
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(99)"
orphaning = "import subprocess as s; print(s.Popen(['sleep', '99'], start_new_session=True, stderr=s.DEVNULL,\
 stdout=s.DEVNULL).pid)"
server = subprocess.Popen(["sleep", "99"], start_new_session=True)
hard = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
orphan = subprocess.run([sys.executable, "-c", orphaning], start_new_session=True, capture_output=True, text=True)
print(server.pid, hard.pid, orphan.stdout.strip(), flush=True)
time.sleep(float(sys.argv[1]))
"""


def started(seconds: float) -> tuple[subprocess.Popen, list[int]]:
    process = subprocess.Popen([sys.executable, "-c", STARTER, str(seconds)], stdout=subprocess.PIPE, text=True)
    pids = list(map(int, process.stdout.readline().split()))
    assert len(pids) == 3 and all(alive(pid) for pid in pids)
    return process, pids


def test_processes_started_in_sessions_of_their_own_stop_with_a_sigtermed_process():
    process, pids = started(600)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    wait_gone(lambda: [pid for pid in pids if alive(pid)], timeout_s=10)  # the stubborn one by SIGKILL, after 1 s


def test_processes_started_in_sessions_of_their_own_stop_when_the_process_ends():
    process, pids = started(0)
    assert process.wait(timeout=30) == 0
    wait_gone(lambda: [pid for pid in pids if alive(pid)], timeout_s=10)


def test_what_a_sigkilled_process_started_stops_by_the_mark_it_inherited():
    """A SIGKILLed process runs no exit: its orphans, in sessions of their own, are found by the environment variable
    they inherited from it (as the orchestrator stops a killed rollout worker's tool servers)."""
    mark = f"lifeline-test-{os.getpid()}"
    process = subprocess.Popen([sys.executable, "-c", STARTER, "600"], stdout=subprocess.PIPE, text=True,
                               env=os.environ | {"TRIDENT_TEST_MARK": mark})  # fmt: skip
    pids = list(map(int, process.stdout.readline().split()))
    process.kill()
    process.wait()
    try:
        assert all(alive(pid) for pid in pids)  # nothing stopped them
        assert {pid for pid, _ in marked("TRIDENT_TEST_MARK", mark)} == set(pids)
        stop_marked("TRIDENT_TEST_MARK", mark, grace_s=1)  # the stubborn one by SIGKILL, after 1 s
        wait_gone(lambda: [pid for pid in pids if alive(pid)], timeout_s=10)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# A process of a Ray actor: it leads its group and starts a grandchild into it that ignores SIGTERM.
MEMBER = """
import subprocess, sys
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(99)"
subprocess.Popen([sys.executable, "-c", stubborn], stdout=sys.stdout).wait()
"""


def test_a_guard_stops_a_group_whose_leader_was_killed_once_the_process_it_watches_is_gone():
    """As when Ray kills an actor: the actor and its child SIGKILLed, the child's group left to its guard."""
    watched = subprocess.Popen(["sleep", "600"])  # the actor
    member = subprocess.Popen([sys.executable, "-c", MEMBER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    guard = subprocess.Popen([sys.executable, "-c", f"from contracts.lifeline import guard_group; "
                                                    f"guard_group({watched.pid}, {member.pid}, 1)"])  # fmt: skip
    try:
        assert member.stdout.readline().strip() == "up"
        member.kill()
        member.wait()
        assert group_running(member.pid)  # the grandchild runs on
        watched.kill()
        watched.wait()
        took = wait_gone(lambda: group_running(member.pid), timeout_s=15)
        assert took >= 1.0  # it ignores SIGTERM: the SIGKILL after the grace ends it
        assert guard.wait(timeout=5) == 0
    finally:
        for process in (watched, guard):
            process.kill()
        if group_running(member.pid):
            os.killpg(member.pid, signal.SIGKILL)


def test_a_guard_leaves_when_its_group_ends_by_itself():
    watched = subprocess.Popen(["sleep", "600"])
    member = subprocess.Popen(["sleep", "0.5"], start_new_session=True)
    guard = subprocess.Popen([sys.executable, "-c", f"from contracts.lifeline import guard_group; "
                                                    f"guard_group({watched.pid}, {member.pid}, 1)"])  # fmt: skip
    try:
        member.wait()
        assert guard.wait(timeout=10) == 0
        assert watched.poll() is None
    finally:
        watched.kill()
        guard.kill()
