"""Weights reaching a second process on the CPU, as the trainer hands them to an inference server: over gloo (the
weight broadcast: each tensor arrives in the manifest's order with its values, shape and dtype, two steps over one
group) and through shared memory (``backend = "shared"``: a buffer in /dev/shm that the second process maps; the
trainer's sender writes each step's weights into it and waits until the receiver says it took them). What needs no
second process is checked in tests/unit/contracts/test_broadcast.py and tests/unit/contracts/test_shared_weights.py."""

import multiprocessing

import torch
from weight_tensors import TENSORS

from contracts.weight_manifest import SHM_DIR, layout, manifest_for, read_manifest, write_manifest
from contracts.weight_wire import RECEIVER_RANK, TRAINER_RANK, pair_group
from inference.transports.process_group import receive_over
from inference.transports.shared_buffer import SharedBufferReceiver
from trainer.transports import memory_sender
from trainer.transports.process_group import send_over


def receiver(manifest: dict, out) -> None:
    group = pair_group(manifest, RECEIVER_RANK, "server")
    for _ in range(2):  # two steps over one group, as the server receives every step of a trainer session
        out.put([(name, tensor.clone()) for name, tensor in receive_over(group, manifest, torch.device("cpu"))])


def test_tensors_arrive_in_manifest_order_with_their_values_shapes_and_dtypes(tmp_path, free_port):
    tensors = {
        "model.embed_tokens.weight": torch.randn(5, 3),
        "model.layers.0.mlp.up_proj.weight": torch.randn(4, 3, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(3),
    }
    manifest = manifest_for(tensors, "127.0.0.1", free_port(), "session-1", "gloo", timeout_s=60)
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest and read_manifest(tmp_path / "elsewhere") is None

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=receiver, args=(read_manifest(tmp_path), out))
    process.start()
    trainer = memory_sender("127.0.0.1", manifest["port"], 60, "gloo", torch.device("cpu"))
    hosted = trainer.host_store()  # the trainer hosts the store; the groups have their own connections
    group = pair_group(manifest, TRAINER_RANK, "server")
    for step in range(2):
        sent = {name: t + step for name, t in tensors.items()}
        send_over(group, list(sent.values()), torch.device("cpu"))
        received = out.get(timeout=60)
        assert [name for name, _ in received] == list(sent)
        for (_, got), want in zip(received, sent.values(), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    process.join(timeout=60)
    assert process.exitcode == 0
    assert hosted.num_keys() > 0  # the group met through it


def test_each_step_reaches_a_second_process_and_the_sender_waits_until_it_is_taken(tmp_path, free_port):
    sender = memory_sender("127.0.0.1", free_port(), timeout_s=60, backend="shared", device=torch.device("cpu"))
    context = multiprocessing.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    manifest = sender.offer(TENSORS)  # the first step: the buffer is made and holds the weights on return
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest  # valid JSON of the shared kind, as the server reads it
    shm_file = SHM_DIR / f"trident-weights-{sender.address['session']}"
    assert manifest["buffer"] == {"kind": "shm", "path": str(shm_file), "nbytes": layout(TENSORS)[1]}
    assert manifest["sequence"] == 1 and shm_file.is_file()

    process = context.Process(target=relay, args=(manifest, 2, inbox, outbox))
    process.start()
    for step in range(2):
        if step:
            manifest = sender.offer({name: t + step for name, t in TENSORS.items()})  # waits for step 0's taking
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
    receiver = SharedBufferReceiver(manifest)
    for _ in range(steps):
        manifest = inbox.get(timeout=60)
        outbox.put(
            [(name, str(tensor.dtype), tensor.float().tolist()) for name, tensor in receiver.read(manifest["tensors"])]
        )
        receiver.loaded(manifest)
