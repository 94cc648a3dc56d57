"""The shared-memory weight handover (``backend = "shared"``) on the CPU: a buffer in /dev/shm that a second
process maps; the trainer's Sender writes each step's weights into it and waits until the receiver says it took
them."""

import multiprocessing
import os

import pytest
import torch

from contracts.broadcast import MANIFEST, Sender, open_store, read_manifest, taken_key, write_manifest
from contracts.errors import TridentError
from contracts.shared_weights import ALIGN, SHM_DIR, SharedBuffer, layout

TENSORS = {
    "model.embed_tokens.weight": torch.randn(5, 3),
    "model.layers.0.mlp.up_proj.weight": torch.randn(4, 3, dtype=torch.bfloat16),
    "model.norm.weight": torch.ones(3),
}


def test_layout_aligns_every_tensor_and_sizes_the_buffer():
    entries, nbytes = layout(TENSORS)
    assert [e[:3] for e in entries] == [["model.embed_tokens.weight", [5, 3], "float32"],
                                        ["model.layers.0.mlp.up_proj.weight", [4, 3], "bfloat16"],
                                        ["model.norm.weight", [3], "float32"]]  # fmt: skip
    assert [e[3] for e in entries] == [0, ALIGN, 2 * ALIGN] and nbytes == 3 * ALIGN


def test_each_step_reaches_a_second_process_and_the_sender_waits_until_it_is_taken(tmp_path, free_port):
    sender = Sender("127.0.0.1", free_port(), timeout_s=60, backend="shared", device=torch.device("cpu"))
    context = multiprocessing.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    manifest = sender.send(TENSORS)  # the first step: the buffer is made and holds the weights on return
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest  # valid JSON of the shared kind, as the server reads it
    shm_file = SHM_DIR / f"trident-weights-{sender.address['session']}"
    assert manifest["buffer"] == {"kind": "shm", "path": str(shm_file), "nbytes": layout(TENSORS)[1]}
    assert manifest["sequence"] == 1 and shm_file.is_file()

    process = context.Process(target=relay, args=(manifest, 2, inbox, outbox))
    process.start()
    for step in range(2):
        if step:
            manifest = sender.send({name: t + step for name, t in TENSORS.items()})  # waits for step 0's taking
            assert manifest["sequence"] == 2
        inbox.put(manifest)
        received = outbox.get(timeout=60)
        assert [name for name, _, _ in received] == list(TENSORS)
        for (_, dtype, got), want in zip(received, TENSORS.values(), strict=True):
            assert dtype == str(want.dtype) and got == (want + step).float().tolist()
    sender.wait()  # step 1 was taken
    process.join(timeout=60)
    assert process.exitcode == 0
    sender.close()
    assert not shm_file.exists()  # the trainer's exit removes the buffer


def relay(manifest: dict, steps: int, inbox, outbox) -> None:
    """The server's worker, as inference.worker does it: attach once, copy each step's tensors out, say so."""
    buffer = SharedBuffer.attach(manifest["buffer"])
    store = open_store(manifest, rank=1)
    for _ in range(steps):
        manifest = inbox.get(timeout=60)
        outbox.put(
            [(name, str(tensor.dtype), tensor.float().tolist()) for name, tensor in buffer.read(manifest["tensors"])]
        )
        store.set(taken_key(manifest), "1")


def test_weights_nobody_takes_fail_the_next_write_naming_the_timeout(free_port):
    sender = Sender("127.0.0.1", free_port(), timeout_s=1, backend="shared", device=torch.device("cpu"))
    sender.send(TENSORS)
    with pytest.raises(TridentError, match=r"did not receive the weights within weight_broadcast.timeout_s = 1s"):
        sender.send(TENSORS)  # the server never took the first
    sender.close()


def test_a_worker_attaches_to_trident_buffers_only(tmp_path):
    for handle in ({"kind": "shm", "path": "/etc/passwd", "nbytes": 4},
                   {"kind": "shm", "path": str(SHM_DIR / "trident-weights-../../x"), "nbytes": 4},
                   {"kind": "file", "path": str(tmp_path / MANIFEST), "nbytes": 4}):  # fmt: skip
        with pytest.raises(ValueError, match="not a shared weights buffer"):
            SharedBuffer.attach(handle)
    buffer = SharedBuffer.create(2 * ALIGN, torch.device("cpu"), "0" * 32)
    try:
        wrong_size = dict(buffer.handle, nbytes=ALIGN)
        with pytest.raises(ValueError, match=f"no shared weights buffer of {ALIGN} bytes there"):
            SharedBuffer.attach(wrong_size)
        attached = SharedBuffer.attach(buffer.handle)
        with pytest.raises(ValueError, match="lies outside a 512-byte buffer"):
            attached.read([["w", [1000], "float32", 0]])  # a manifest asking for more than the buffer holds
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
