"""Deltas over the weight broadcast (``[weights] delta`` with ``[weight_broadcast]``), over gloo in this process,
receivers as threads: a server that holds the weights sent before gets only deltas and ends with the trainer's
weights bit for bit and its checksum; a new or restarted one, one that missed weights, or one that loaded other
weights in between gets full weights; ``full_every`` and ``auto`` send full weights to all; with delta off the
manifest has no checksum and nothing is kept. Over a real server: tests/integration/test_weight_broadcast.py."""

import logging

import pytest
import torch
from weight_tensors import TENSORS, take

from contracts.errors import TridentError
from contracts.weight_delta import checksum, weights_checksum
from contracts.weight_manifest import manifest_for, write_manifest
from inference.transports import Receivers
from inference.transports.process_group import ProcessGroupReceiver
from orchestrator.serving.client import check_checksum
from trainer.transports import memory_sender

BF16 = {name: tensor.to(torch.bfloat16) for name, tensor in TENSORS.items()}


def stepped(tensors: dict, changed: int = 1) -> dict:
    """``tensors`` with the first ``changed`` elements of the first tensor moved, the others as they were."""
    new = {name: tensor.clone() for name, tensor in tensors.items()}
    first = next(iter(new.values())).view(-1)
    first[:changed] += 1
    return new


def load(receivers: list[ProcessGroupReceiver], manifest: dict) -> list:
    """What each receiver gets, as the worker loads it (``loaded`` after a receipt)."""
    got = take(manifest, receivers)
    for receiver, tensors in zip(receivers, got, strict=True):
        if tensors is not None:
            receiver.loaded(manifest)
    return got


def as_lists(tensors: dict) -> list:
    return [(name, tensor.tolist()) for name, tensor in tensors.items()]


def sent(caplog) -> list[str]:
    """How the trainer sent each server its weights, in order: ``deltas`` or ``full weights``."""
    return [r.getMessage().split(" as ")[1].split(" (")[0] for r in caplog.records if " to a server as " in r.message]


@pytest.fixture
def sender(free_port):
    def make(delta="on", full_every=10, timeout_s=30):
        cpu = torch.device("cpu")
        made.append(memory_sender("127.0.0.1", free_port(), timeout_s, "gloo", cpu, 1, delta, full_every))
        return made[-1]

    made = []
    yield make
    for one in made:
        one.close()


def test_a_server_holding_the_weights_before_gets_deltas_and_ends_with_the_trainers_bit_for_bit(sender, caplog):
    trainer = sender()
    steps = [BF16, stepped(BF16), stepped(stepped(BF16), changed=15)]  # a sparse delta, then a dense one
    receiver = None
    with caplog.at_level(logging.INFO, logger="trainer"):
        for weights in steps:
            manifest = trainer.offer(weights)
            receiver = receiver or ProcessGroupReceiver(manifest)
            assert load([receiver], manifest) == [as_lists(weights)]
            assert receiver.served_checksum() == manifest["checksum"]
            assert manifest["checksum"] == weights_checksum({name: checksum(t) for name, t in weights.items()})
            trainer.wait()
    assert sent(caplog) == ["full weights", "deltas", "deltas"]
    sizes = [int(r.message.split("(")[1].split()[0]) for r in caplog.records if " to a server as " in r.message]
    assert sizes[1] == 4 + 2  # one int32 position and one bf16 value
    assert sizes[2] < sizes[0]


def test_a_new_or_behind_server_gets_full_weights_never_a_delta_on_another_base(sender, caplog):
    trainer = sender(timeout_s=5)  # waits that long for the server that misses weights 2
    first = trainer.offer(BF16)
    staying, behind = ProcessGroupReceiver(first), ProcessGroupReceiver(first)
    load([staying, behind], first)
    second = trainer.offer(stepped(BF16))
    load([staying], second)  # the other one missed these weights
    trainer.wait()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        third = trainer.offer(stepped(stepped(BF16)))
        restarted = ProcessGroupReceiver(third)  # a server restarted mid-run: it holds nothing
        got = load([staying, behind, restarted], third)
    assert got == [as_lists(stepped(stepped(BF16)))] * 3
    assert sorted(sent(caplog)) == ["deltas", "full weights", "full weights"]
    assert {r.served_checksum() for r in (staying, behind, restarted)} == {third["checksum"]}


def test_a_server_that_loaded_other_weights_in_between_gets_full_weights(sender, caplog):
    trainer, worker = sender(), Receivers()
    manifest = trainer.offer(BF16)
    receiver = worker.pick(manifest, "/w/step_1")
    load([receiver], manifest)
    assert worker.pick(None, "/base") is worker.files  # the base model again (a reset): the copy is forgotten
    assert receiver.served_checksum() is None
    trainer.wait()
    with caplog.at_level(logging.INFO, logger="trainer"):
        manifest = trainer.offer(stepped(BF16))
        assert worker.pick(manifest, "/w/step_2") is receiver
        assert load([receiver], manifest) == [as_lists(stepped(BF16))]
    assert sent(caplog) == ["full weights"]


@pytest.mark.parametrize(("mode", "full_every", "changed"), [("on", 1, True), ("auto", 10, False)])
def test_full_every_and_auto_send_full_weights_to_every_server(sender, caplog, mode, full_every, changed):
    """``full_every`` 1: always full; ``auto``: full when every element changed (not ``changed``)."""
    trainer = sender(mode, full_every)
    manifest = trainer.offer(BF16)
    receiver = ProcessGroupReceiver(manifest)
    load([receiver], manifest)
    trainer.wait()
    with caplog.at_level(logging.INFO, logger="trainer"):
        new = stepped(BF16) if changed else {name: tensor + 1 for name, tensor in BF16.items()}
        manifest = trainer.offer(new)
        assert load([receiver], manifest) == [as_lists(new)]
    assert sent(caplog) == ["full weights"]
    assert receiver.served_checksum() == manifest["checksum"]


def test_with_delta_off_the_manifest_has_no_checksum_and_the_server_keeps_no_copy(sender, caplog):
    trainer = sender("off")
    manifest = trainer.offer(BF16)
    assert "checksum" not in manifest
    receiver = ProcessGroupReceiver(manifest)
    load([receiver], manifest)
    trainer.wait()
    with caplog.at_level(logging.INFO, logger="trainer"):
        manifest = trainer.offer(stepped(BF16))
        assert load([receiver], manifest) == [as_lists(stepped(BF16))]
    assert sent(caplog) == ["full weights"] and not receiver.served.tensors and receiver.served_checksum() is None


def test_the_orchestrator_fails_a_server_whose_checksum_is_not_the_manifests(tmp_path):
    write_manifest(tmp_path, manifest_for(BF16, "127.0.0.1", 1234, "s", "gloo", 5, checksum="0123456789abcdef"))
    check_checksum(tmp_path, 3, "0123456789abcdef")
    with pytest.raises(TridentError, match=r"checksum ffffffffffffffff, the trainer's 0123456789abcdef \(.*broadc"):
        check_checksum(tmp_path, 3, "ffffffffffffffff")
