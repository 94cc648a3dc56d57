import multiprocessing
import socket

import pytest
import torch

from contracts.broadcast import (
    Sender,
    manifest_for,
    open_group,
    open_store,
    read_manifest,
    receive,
    send,
    write_manifest,
)
from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from trainer.config import TrainerConfig


def receiver(manifest: dict, out) -> None:
    group = open_group(manifest, rank=1)
    for _ in range(2):  # two steps over one group, as the server receives every step of a trainer session
        out.put([(name, tensor.clone()) for name, tensor in receive(group, manifest, torch.device("cpu"))])


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
    group = open_group(manifest, rank=0)
    for step in range(2):
        sent = {name: t + step for name, t in tensors.items()}
        send(group, sent, torch.device("cpu"))
        received = out.get(timeout=60)
        assert [name for name, _ in received] == list(sent)
        for (_, got), want in zip(received, sent.values(), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    process.join(timeout=60)
    assert process.exitcode == 0


def test_a_broadcast_nobody_receives_fails_naming_the_timeout(free_port):
    sender = Sender("127.0.0.1", free_port(), timeout_s=1, backend="auto", device=torch.device("cpu"))
    assert sender.address["backend"] == "gloo"  # no GPU: gloo
    sender.send({"w": torch.zeros(2)})  # in the background: training goes on
    with pytest.raises(TridentError, match=r"did not receive the weights within weight_broadcast.timeout_s = 1s"):
        sender.wait()  # before the next weights are written


def test_the_store_listens_on_the_host_it_is_given_only(free_port):
    port = free_port()
    store = open_store(manifest_for({}, "127.0.0.1", port, "s", "gloo", timeout_s=5), rank=0)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):  # another address of this machine: nothing listens there
        socket.create_connection(("127.0.0.2", port), timeout=5)
    store.set("k", "v")
    joined = open_store(manifest_for({}, "127.0.0.1", port, "s", "gloo", timeout_s=5), rank=1)
    assert joined.get("k") == b"v"


def test_a_store_port_already_taken_fails_the_send_in_one_line(free_port):
    taken = socket.create_server(("127.0.0.1", free_port()))
    sender = Sender("127.0.0.1", taken.getsockname()[1], timeout_s=5, backend="gloo", device=torch.device("cpu"))
    sender.send({"w": torch.zeros(2)})
    with pytest.raises(TridentError, match=r"weight broadcast \(gloo, store 127.0.0.1:\d+\) failed: .*in use"):
        sender.wait()
    taken.close()


def test_broadcast_sends_full_weights_only():
    lora = ["--model.experimental.lora.rank", "8", "--weight-broadcast.port", "29510"]
    with pytest.raises(ConfigError, match=r"weight_broadcast sends full weights: set model.experimental.lora.export"):
        parse_config(TrainerConfig, [*lora, "--model.experimental.lora.export", "adapter"])
    merged = parse_config(TrainerConfig, [*lora, "--model.experimental.lora.export", "merged"])
    assert merged.weight_broadcast.port == 29510
