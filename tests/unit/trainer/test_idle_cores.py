"""The trainer borrows the cores the inference server leaves idle: within a step it widens its torch threads once the
orchestrator's last batch before the step's weights (step + async_level) is on disk, looking before each layer's
forward and backward pass, and goes back to its own thread when the step ends."""

import os

import pytest
import torch
from torch import nn

from contracts.run_dir import rollouts_dir
from trainer.idle_cores import IdleCores


class Layers(nn.Module):
    def __init__(self, count: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(count))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.fixture
def one_thread(monkeypatch):
    """One torch thread, as rl starts the trainer, on a machine of four cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    yield
    torch.set_num_threads(before)


def threads_per_pass(model: Layers, appear_after: tuple[str, int], batch) -> dict[tuple[str, int], int]:
    """The torch threads each layer's forward and backward pass ran with; ``batch`` appears on disk once the pass
    ``appear_after`` (("forward" or "backward", layer)) ran."""
    seen = {}

    def record(kind, i):
        seen[(kind, i)] = torch.get_num_threads()
        if (kind, i) == appear_after:
            batch.mkdir(parents=True)

    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: record("forward", i))
        layer.register_full_backward_hook(lambda m, gi, go, i=i: record("backward", i))
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    return seen


@pytest.mark.parametrize("appear_after", [("forward", 0), ("backward", 2)])
def test_threads_widen_from_the_pass_after_the_batch_appears_and_narrow_when_the_step_ends(
    tmp_path, one_thread, appear_after
):
    model = Layers(4)
    idle = IdleCores.install(model, model.layers, tmp_path, async_level=1, max_steps=20)
    assert (idle.own, idle.wide) == (1, 4)
    with idle.step(3):
        seen = threads_per_pass(model, appear_after, rollouts_dir(tmp_path, 4))
    order = [("forward", i) for i in range(4)] + [("backward", i) for i in reversed(range(4))]
    after = order.index(appear_after)
    assert [seen[key] for key in order] == [1] * (after + 1) + [4] * (len(order) - after - 1)
    assert torch.get_num_threads() == 1 and idle.widened_s > 0


def test_a_step_whose_batch_is_already_there_runs_wide_and_one_without_it_stays_narrow(tmp_path, one_thread):
    model = Layers(2)
    idle = IdleCores.install(model, model.layers, tmp_path, async_level=0, max_steps=20)
    rollouts_dir(tmp_path, 5).mkdir(parents=True)  # async_level 0: the step's own batch, always there
    with idle.step(5):
        assert torch.get_num_threads() == 4
        model(torch.randn(2, 8)).sum().backward()
    assert torch.get_num_threads() == 1
    with idle.step(6):  # no batch of step 6: the orchestrator may still be writing it
        seen = threads_per_pass(model, ("forward", 9), rollouts_dir(tmp_path, 99))
    assert set(seen.values()) == {1} and idle.widened_s == 0
    model(torch.randn(2, 8))  # outside a step: nothing to look for
    assert torch.get_num_threads() == 1


def test_nothing_is_borrowed_without_async_level_or_a_spare_core(tmp_path, one_thread, monkeypatch):
    model = Layers(2)
    assert IdleCores.install(model, model.layers, tmp_path, async_level=None, max_steps=20) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks on the machine: one core each
    assert IdleCores.install(model, model.layers, tmp_path, async_level=1, max_steps=20) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert IdleCores.install(model, model.layers, tmp_path, async_level=1, max_steps=20).wide == 2


def test_near_the_runs_end_the_last_batch_is_what_the_orchestrator_writes_before_the_weights(tmp_path, one_thread):
    model = Layers(2)
    idle = IdleCores.install(model, model.layers, tmp_path, async_level=2, max_steps=10)
    rollouts_dir(tmp_path, 9).mkdir(parents=True)
    with idle.step(8):  # batch 10 may still come
        assert torch.get_num_threads() == 1
    rollouts_dir(tmp_path, 10).mkdir(parents=True)
    with idle.step(9):  # batch 10 is the run's last: no batch 11 will come
        assert torch.get_num_threads() == 4
    assert torch.get_num_threads() == 1
