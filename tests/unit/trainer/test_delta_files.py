"""Delta chains over files (``[weights] delta``): the trainer's sender writes full copies and deltas, and a server's
receiver, whatever it held before, ends on exactly the trainer's weights or refuses."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from contracts.delta_chain import read_delta_info
from contracts.errors import TridentError
from contracts.weight_delta import checksum, raw_bits, weights_checksum
from inference.transports import Receivers
from inference.transports.delta_files import DeltaReceiver
from orchestrator.serving.client import check_checksum
from trainer.config import TrainerConfig
from trainer.transports.base import ExportedWeights
from trainer.transports.delta_files import DeltaFileSender


class Owner:
    """Saves as a model's ``save_pretrained`` does: the tensors in one safetensors file beside a config.json."""

    def save_pretrained(self, folder: Path, state_dict: dict) -> None:
        save_file(state_dict, Path(folder) / "model.safetensors")
        (Path(folder) / "config.json").write_text("{}")


def trained_steps(steps: int, lr: float, dtype=torch.bfloat16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The exported weights after each of ``steps`` AdamW steps on random gradients (float32 master weights)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (96, 32), "layers.0.proj.weight": (32, 32), "norm.weight": (32,)}
    master = {
        name: torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02) for name, shape in shapes.items()
    }
    optimizer = torch.optim.AdamW(master.values(), lr=lr)
    exported = []
    for _ in range(steps):
        for parameter in master.values():
            parameter.grad = torch.randn(parameter.shape, generator=generator)
        optimizer.step()
        exported.append({name: p.detach().to(dtype, copy=True) for name, p in master.items()})
    return exported


def write_chain(root: Path, weights: list[dict], mode="on", full_every=4, dtype=torch.bfloat16) -> DeltaFileSender:
    sender = DeltaFileSender(mode, full_every)
    for step, tensors in enumerate(weights, start=1):
        folder = root / f"step_{step}"
        folder.mkdir(parents=True)
        sender.send(ExportedWeights({n: t.clone() for n, t in tensors.items()}, Owner(), dtype, step))
        sender.write(folder)
    return sender


def load(receiver: DeltaReceiver, folder: Path) -> dict[str, torch.Tensor]:
    """What vLLM would load from ``folder`` through ``receiver``."""
    loaded = dict(receiver.receive(str(folder), None)["weights_iterator"])
    receiver.loaded(None)
    return loaded


def assert_exact(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(raw_bits(loaded[name]), raw_bits(tensor)), name


def test_a_server_following_every_step_serves_the_trainers_weights_exactly(tmp_path):
    weights = trained_steps(6, lr=5e-6)
    write_chain(tmp_path, weights, full_every=4)
    infos = [read_delta_info(tmp_path / f"step_{step}") for step in range(1, 7)]
    assert [info.kind for info in infos] == ["full", "delta", "delta", "delta", "full", "delta"]
    assert [info.full_step for info in infos] == [1, 1, 1, 1, 5, 5]
    assert [info.base_step for info in infos] == [None, 1, 2, 3, None, 5]
    receiver = DeltaReceiver()
    for step, (info, expected) in enumerate(zip(infos, weights, strict=True), start=1):
        assert_exact(load(receiver, tmp_path / f"step_{step}"), expected)
        expected_sum = weights_checksum({name: checksum(tensor) for name, tensor in expected.items()})
        assert receiver.served_checksum() == info.checksum == expected_sum
        assert receiver.replayed == ([step] if info.kind == "full" else [step - 1, step])  # one read, or one delta
    # at lr 5e-6 on weights of 0.02 most bf16 elements stay: the deltas are sparse, smaller than a full copy
    delta = json.loads((tmp_path / "step_2" / "delta.json").read_text())
    assert delta["kind"] == "delta" and not list((tmp_path / "step_2").glob("model.safetensors"))
    full_bytes = (tmp_path / "step_1" / "model.safetensors").stat().st_size
    assert (tmp_path / "step_2" / "delta.safetensors").stat().st_size < full_bytes / 2


def test_a_server_that_missed_deltas_or_restarted_replays_the_chain_and_a_broken_chain_is_refused(tmp_path):
    weights = trained_steps(4, lr=5e-6)
    write_chain(tmp_path, weights, full_every=10)
    behind = DeltaReceiver()
    load(behind, tmp_path / "step_1")
    assert_exact(load(behind, tmp_path / "step_4"), weights[3])  # missed 2 and 3: applies 2, 3, 4 to its copy
    assert behind.replayed == [1, 2, 3, 4]
    restarted = DeltaReceiver()  # holds nothing: reads the full copy, then the deltas
    assert_exact(load(restarted, tmp_path / "step_3"), weights[2])
    assert restarted.replayed == [1, 2, 3]
    other_chain = DeltaReceiver()  # holds step 2 of weights that are not this chain's
    load(other_chain, tmp_path / "step_2")
    other_chain.held = (2, "0" * 16)
    assert_exact(load(other_chain, tmp_path / "step_3"), weights[2])
    assert other_chain.replayed == [1, 2, 3]
    shutil.rmtree(tmp_path / "step_2")
    with pytest.raises(ValueError, match="step_2: no delta weights"):
        load(DeltaReceiver(), tmp_path / "step_3")


def test_a_delta_whose_base_is_not_held_exactly_is_never_applied(tmp_path):
    weights = trained_steps(3, lr=5e-6)
    write_chain(tmp_path, weights)
    receiver = DeltaReceiver()
    load(receiver, tmp_path / "step_2")
    receiver.served.tensors["embed.weight"].view(-1)[0] += 1  # the copy is not what step 2 wrote
    receiver.served.checksums["embed.weight"] = checksum(receiver.served.tensors["embed.weight"])
    with pytest.raises(ValueError, match="a delta against step 2"):
        receiver.receive(str(tmp_path / "step_3"), None)
    assert receiver.held is None  # and it knows it holds nothing known: the next load reads the full copy
    assert_exact(load(receiver, tmp_path / "step_3"), weights[2])


def test_full_copies_when_the_deltas_do_not_pay(tmp_path):
    # float32 at the debug run's lr: every element changes, a delta would be the whole tensor
    weights = trained_steps(3, lr=3e-3, dtype=torch.float32)
    write_chain(tmp_path / "auto", weights, mode="auto", dtype=torch.float32)
    assert [read_delta_info(tmp_path / "auto" / f"step_{s}").kind for s in (1, 2, 3)] == ["full"] * 3
    # under "on" the dense delta of step 2 is kept, and step 3's would make the chain outgrow a full copy
    write_chain(tmp_path / "on", weights, mode="on", dtype=torch.float32)
    assert [read_delta_info(tmp_path / "on" / f"step_{s}").kind for s in (1, 2, 3)] == ["full", "delta", "full"]
    receiver = DeltaReceiver()
    for step in (1, 2, 3):
        assert_exact(load(receiver, tmp_path / "on" / f"step_{step}"), weights[step - 1])


def test_a_checksum_other_than_the_trainers_fails_the_reload(tmp_path):
    write_chain(tmp_path, trained_steps(2, lr=5e-6))
    trainer_checksum = read_delta_info(tmp_path / "step_2").checksum
    check_checksum(tmp_path / "step_2", 2, trainer_checksum)
    for served in ("0" * 16, None):
        with pytest.raises(TridentError, match="does not serve the weights"):
            check_checksum(tmp_path / "step_2", 2, served)
    (tmp_path / "plain").mkdir()
    check_checksum(tmp_path / "plain", 2, None)  # weights outside a chain: nothing to compare


def test_weights_loaded_another_way_make_the_chain_receiver_forget_its_copy(tmp_path):
    write_chain(tmp_path, trained_steps(2, lr=5e-6))
    receivers = Receivers()
    assert receivers.pick(None, str(tmp_path / "step_1")) is receivers.delta
    load(receivers.delta, tmp_path / "step_1")
    assert receivers.delta.held is not None
    (tmp_path / "plain").mkdir()
    assert receivers.pick(None, str(tmp_path / "plain")) is receivers.files  # e.g. the base model, on a reset
    assert receivers.delta.held is None and not receivers.delta.served.tensors


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        ({"weight_broadcast": {"backend": "shared"}}, "goes over files or a process group, not a shared buffer"),
        ({"model": {"experimental": {"lora": {"export": "adapter"}}}}, "is for full weights"),
    ],
)
def test_deltas_are_refused_where_they_cannot_go(flags, refusal):
    TrainerConfig(weights={"delta": "auto"})
    TrainerConfig(weights={"delta": "on"}, weight_broadcast={})  # over a process group
    with pytest.raises(ValueError, match=refusal):
        TrainerConfig(weights={"delta": "on"}, **flags)
