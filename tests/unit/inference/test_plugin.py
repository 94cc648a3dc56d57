import zmq
from vllm.distributed.device_communicators import shm_broadcast

from inference.plugin import BUSY_WAIT_ENV, RECHECK_MS, register


def reader(tmp_path) -> shm_broadcast.SpinCondition:
    """A reader of vLLM's shared-memory message queue, as vLLM builds it (no spin time given)."""
    return shm_broadcast.SpinCondition(is_reader=True, context=zmq.Context.instance(),
                                       notify_address=f"ipc://{tmp_path}/notify")  # fmt: skip


def test_vllm_readers_spin_as_long_as_the_server_says(monkeypatch, tmp_path):
    vllms = shm_broadcast.SpinCondition
    monkeypatch.setattr(shm_broadcast, "SpinCondition", vllms)  # undone after the test
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
    monkeypatch.setenv(BUSY_WAIT_ENV, "0.25")
    register()
    register()  # vLLM may run the plugin more than once in a process
    assert reader(tmp_path).busy_loop_s == 0.25
    assert shm_broadcast.SpinCondition.__bases__ == (vllms,)  # wrapped once
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == RECHECK_MS  # a lost notification costs no more
    writer = shm_broadcast.SpinCondition(is_reader=False, context=zmq.Context.instance(),
                                         notify_address=f"ipc://{tmp_path}/notify")  # fmt: skip
    assert writer.busy_loop_s == 0  # writers never spin


def test_without_the_servers_setting_vllm_keeps_its_own(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_broadcast, "SpinCondition", shm_broadcast.SpinCondition)
    monkeypatch.delenv(BUSY_WAIT_ENV, raising=False)
    register()
    assert reader(tmp_path).busy_loop_s == 1 and shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000  # vLLM's
