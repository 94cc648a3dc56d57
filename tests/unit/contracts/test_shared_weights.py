"""The shared-memory weight handover (``backend = "shared"``) on the CPU: a buffer in /dev/shm that a second
process maps; the trainer's sender writes each step's weights into it and waits until the receiver says it took
them. Here: the buffer's layout, a timeout when nobody takes the weights, and what a worker attaches to; a second
process taking each step is checked in tests/integration/test_weights_to_a_second_process.py."""

import os

import pytest
import torch
from weight_tensors import TENSORS

from contracts.errors import TridentError
from contracts.weight_manifest import ALIGN, MANIFEST, SHM_DIR, layout
from contracts.weight_wire import buffer_views
from inference.transports.shared_buffer import attach
from trainer.transports import memory_sender
from trainer.transports.shared_buffer import SharedBuffer


def test_layout_aligns_every_tensor_and_sizes_the_buffer():
    entries, nbytes = layout(TENSORS)
    assert [e[:3] for e in entries] == [["model.embed_tokens.weight", [5, 3], "float32"],
                                        ["model.layers.0.mlp.up_proj.weight", [4, 3], "bfloat16"],
                                        ["model.norm.weight", [3], "float32"]]  # fmt: skip
    assert [e[3] for e in entries] == [0, ALIGN, 2 * ALIGN] and nbytes == 3 * ALIGN


def test_weights_nobody_takes_fail_the_next_write_naming_the_timeout(free_port):
    sender = memory_sender("127.0.0.1", free_port(), timeout_s=1, backend="shared", device=torch.device("cpu"))
    sender.offer(TENSORS)
    with pytest.raises(TridentError, match=r"did not receive the weights within weight_broadcast.timeout_s = 1s"):
        sender.offer(TENSORS)  # the server never took the first
    sender.close()


def test_a_worker_attaches_to_trident_buffers_only(tmp_path):
    for handle in ({"kind": "shm", "path": "/etc/passwd", "nbytes": 4},
                   {"kind": "shm", "path": str(SHM_DIR / "trident-weights-../../x"), "nbytes": 4},
                   {"kind": "file", "path": str(tmp_path / MANIFEST), "nbytes": 4}):  # fmt: skip
        with pytest.raises(ValueError, match="not a shared weights buffer"):
            attach(handle)
    buffer = SharedBuffer.create(2 * ALIGN, torch.device("cpu"), "0" * 32)
    try:
        wrong_size = dict(buffer.handle, nbytes=ALIGN)
        with pytest.raises(ValueError, match=f"no shared weights buffer of {ALIGN} bytes there"):
            attach(wrong_size)
        with pytest.raises(ValueError, match="lies outside a 512-byte buffer"):
            buffer_views(attach(buffer.handle), [["w", [1000], "float32", 0]])  # more than the buffer holds
    finally:
        buffer.close()


def test_a_buffer_larger_than_dev_shm_is_refused_before_it_is_written(monkeypatch):
    """Writing past a full tmpfs through a mapping kills the process (SIGBUS): the room is checked first."""
    room = os.statvfs_result((4096, 4096, 100, 10, 10, 0, 0, 0, 0, 255))  # 40 KiB free
    monkeypatch.setattr(os, "statvfs", lambda path: room)
    with pytest.raises(TridentError, match=r"weight broadcast: /dev/shm has 0 MiB free, the weights need 1 MiB: "
                                           r"enlarge it .* or set weight_broadcast.backend = 'gloo'"):  # fmt: skip
        SharedBuffer.create(2**20, torch.device("cpu"), "1" * 32)
    assert not (SHM_DIR / f"trident-weights-{'1' * 32}").exists()
