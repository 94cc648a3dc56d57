"""The weight broadcast over gloo on the CPU, in this process: a broadcast nobody receives fails naming the timeout,
the store listens on its host only and a taken port fails in one line; full weights only. One trainer feeding
several receivers (threads here, each a server's worker): each gets the newest weights, the trainer waits until all
took them, one that left is waited for once, one that asks for replaced weights is told so; a shared buffer serves
one. Tensors reaching a second process are checked in tests/integration/test_weights_to_a_second_process.py."""

import logging
import socket

import pytest
import torch
from weight_tensors import take

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.weight_manifest import manifest_for
from contracts.weight_wire import connect_store
from inference.transports.process_group import ProcessGroupReceiver
from trainer.config import TrainerConfig
from trainer.transports import memory_sender


def test_a_broadcast_nobody_receives_fails_naming_the_timeout(free_port):
    sender = memory_sender("127.0.0.1", free_port(), timeout_s=1, backend="auto", device=torch.device("cpu"))
    assert sender.address["backend"] == "gloo"  # no GPU: gloo
    sender.offer({"w": torch.zeros(2)})  # in the background: training goes on
    with pytest.raises(TridentError, match=r"did not receive the weights within weight_broadcast.timeout_s = 1s"):
        sender.wait()  # before the next weights are written
    sender.close()


def test_the_store_listens_on_the_host_it_is_given_only(free_port):
    port = free_port()
    store = memory_sender("127.0.0.1", port, timeout_s=30, backend="gloo", device=torch.device("cpu")).host_store()
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):  # another address of this machine: nothing listens there
        socket.create_connection(("127.0.0.2", port), timeout=5)
    store.set("k", "v")
    joined = connect_store(manifest_for({}, "127.0.0.1", port, "s", "gloo", timeout_s=5))
    assert joined.get("k") == b"v"


def test_a_store_port_already_taken_fails_the_send_in_one_line(free_port):
    taken = socket.create_server(("127.0.0.1", free_port()))
    sender = memory_sender("127.0.0.1", taken.getsockname()[1], timeout_s=5, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(TridentError, match=r"weight broadcast \(gloo, store 127.0.0.1:\d+\) failed: .*in use"):
        sender.offer({"w": torch.zeros(2)})
    taken.close()


def test_broadcast_sends_full_weights_only():
    lora = ["--model.experimental.lora.rank", "8", "--weight-broadcast.port", "29510"]
    with pytest.raises(ConfigError, match=r"weight_broadcast sends full weights: set model.experimental.lora.export"):
        parse_config(TrainerConfig, [*lora, "--model.experimental.lora.export", "adapter"])
    merged = parse_config(TrainerConfig, [*lora, "--model.experimental.lora.export", "merged"])
    assert merged.weight_broadcast.port == 29510


def test_every_receiver_gets_the_newest_weights_and_the_next_send_waits_until_all_took_them(free_port):
    sender = memory_sender(
        "127.0.0.1", free_port(), timeout_s=30, backend="gloo", device=torch.device("cpu"), receivers=2
    )
    first = sender.offer({"w": torch.zeros(2), "b": torch.ones(1)})
    assert first["sequence"] == 1 and first["tensors"] == [["w", [2], "float32"], ["b", [1], "float32"]]
    receivers = [ProcessGroupReceiver(first), ProcessGroupReceiver(first)]
    assert take(first, receivers) == [[("w", [0.0, 0.0]), ("b", [1.0])]] * 2
    sender.wait()  # both took the first: returns at once
    assert sender.takers == {receiver.name for receiver in receivers}
    second = sender.offer({"w": torch.full((2,), 2.0), "b": torch.ones(1)})
    assert second["sequence"] == 2 and sender.receivers == 2
    assert take(second, receivers) == [[("w", [2.0, 2.0]), ("b", [1.0])]] * 2  # over the groups made at first
    # a server restarted on its base model asks for weights the trainer no longer holds: told so, nothing sent
    assert take(first, [ProcessGroupReceiver(first)]) == [None]
    sender.close()


def test_a_receiver_that_stops_asking_is_waited_for_once_and_counts_again_when_it_takes_weights(free_port, caplog):
    sender = memory_sender(
        "127.0.0.1", free_port(), timeout_s=5, backend="gloo", device=torch.device("cpu"), receivers=2
    )
    manifest = sender.offer({"w": torch.zeros(2)})
    staying = ProcessGroupReceiver(manifest)
    assert take(manifest, [staying, ProcessGroupReceiver(manifest)]) != [None, None]
    manifest = sender.offer({"w": torch.ones(2)})
    assert take(manifest, [staying]) == [[("w", [1.0, 1.0])]]  # the other server died
    with caplog.at_level(logging.WARNING, logger="trainer"):
        manifest = sender.offer({"w": torch.ones(2)})  # waits timeout_s for the dead one, then goes on
    assert "weight broadcast: 1 of 2 inference servers took weights 2 within weight_broadcast.timeout_s = 5s" in (
        caplog.text
    )
    assert sender.receivers == 1  # no longer waited for
    back = ProcessGroupReceiver(manifest)  # restarted: a new worker asks for the weights the trainer holds
    assert take(manifest, [staying, back]) == [[("w", [1.0, 1.0])]] * 2
    with sender.changed:  # the trainer's sending threads note each receipt just after the receiver has it
        assert sender.changed.wait_for(lambda: len(sender.takers) == 2, timeout=30)
    sender.offer({"w": torch.zeros(2)})
    assert sender.receivers == 2  # it counts again
    sender.close()


def test_a_shared_buffer_serves_one_server():
    with pytest.raises(ConfigError, match=r"weight_broadcast.backend = 'shared' hands the weights to one server, "
                                          r"receivers = 2: use 'gloo'"):  # fmt: skip
        parse_config(TrainerConfig, ["--weight-broadcast.backend", "shared", "--weight-broadcast.receivers", "2"])
