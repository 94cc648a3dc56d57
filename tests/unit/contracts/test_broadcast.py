"""The weight broadcast over gloo on the CPU, in this process: a broadcast nobody receives fails naming the timeout,
the store listens on its host only and a taken port fails in one line; full weights only. Tensors reaching a second
process are checked in tests/integration/test_weights_to_a_second_process.py."""

import socket

import pytest
import torch

from contracts.broadcast import Sender, manifest_for, open_store
from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from trainer.config import TrainerConfig


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
