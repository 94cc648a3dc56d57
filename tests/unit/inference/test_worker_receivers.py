"""The server's worker picks its receiver from each weights folder's manifest (``inference.transports``) and loads
what it gives, in this process against the trainer's senders (``trainer.transports``), vLLM faked: files without a
manifest; a delta chain's copy, with its checksum; over gloo, one receiver (one group) for every step of a trainer
session, nothing loaded for weights the trainer replaced, a new receiver for a new session; from a shared buffer, the
trainer told when the worker took them."""

import torch
from weight_tensors import TENSORS

from inference.worker import WeightReloadExtension
from trainer.transports import memory_sender


class FakeWorker(WeightReloadExtension):
    """vLLM's worker as the extension uses it: ``reload_weights`` records what it was given to load."""

    def __init__(self):
        self.loads = []

    def reload_weights(self, weights_path=None, weights_iterator=None, is_checkpoint_format=False):
        assert is_checkpoint_format
        if weights_iterator is not None:
            weights_iterator = [(name, tensor.clone()) for name, tensor in weights_iterator]
        self.loads.append((weights_path, weights_iterator))

    def _loaded(self):
        """No model here to tie or pack."""


def same(loaded: list, tensors: dict) -> bool:
    return [name for name, _ in loaded] == list(tensors) and all(
        got.dtype == want.dtype and torch.equal(got, want)
        for (_, got), want in zip(loaded, tensors.values(), strict=True)
    )


def test_a_folder_without_manifest_is_loaded_from_its_files():
    worker = FakeWorker()
    assert worker.load_weights("/w/step_1")["path"] == "/w/step_1"
    assert worker.loads == [("/w/step_1", None)]


def test_a_delta_chains_folders_load_the_workers_copy_and_answer_its_checksum(tmp_path):
    """Through the extension: a full copy, then a delta applied to the copy, each answered with the checksum the
    trainer wrote, also after weights from files in between; files are answered with none."""
    from safetensors.torch import save_file

    from contracts.delta_chain import read_delta_info
    from trainer.transports.base import ExportedWeights
    from trainer.transports.delta_files import DeltaFileSender

    class Owner:
        def save_pretrained(self, folder, state_dict):
            save_file(state_dict, folder / "model.safetensors")
            (folder / "config.json").write_text("{}")

    sender, worker = DeltaFileSender("on", full_every=10), FakeWorker()
    steps = [{name: tensor.to(torch.bfloat16) for name, tensor in TENSORS.items()}]
    steps.append({name: tensor.clone() for name, tensor in steps[0].items()})
    first = next(iter(steps[1]))
    steps[1][first].view(-1)[0] += 1  # one element changes
    for step, tensors in enumerate(steps, start=1):
        (tmp_path / f"step_{step}").mkdir()
        sender.send(ExportedWeights({n: t.clone() for n, t in tensors.items()}, Owner(), torch.bfloat16, step))
        sender.write(tmp_path / f"step_{step}")
    assert read_delta_info(tmp_path / "step_2").kind == "delta"
    for step, tensors in [(1, steps[0]), (2, steps[1]), (2, steps[1])]:
        answer = worker.load_weights(str(tmp_path / f"step_{step}"))
        assert answer["checksum"] == read_delta_info(tmp_path / f"step_{step}").checksum
        assert worker.loads[-1][0] is None and same(worker.loads[-1][1], tensors)
        if step == 2:
            worker.load_weights("/w/files")  # weights from elsewhere: the copy is not what is served
    assert worker.load_weights("/w/files")["checksum"] is None


def test_a_gloo_session_is_received_over_one_group_and_weights_the_trainer_replaced_load_nothing(free_port):
    sender = memory_sender("127.0.0.1", free_port(), timeout_s=30, backend="gloo", device=torch.device("cpu"))
    worker = FakeWorker()
    try:
        first = sender.offer(TENSORS)
        worker.load_weights("/w/step_1", first)
        second = sender.offer({name: tensor + 1 for name, tensor in TENSORS.items()})  # waits until the first taken
        worker.load_weights("/w/step_2", second)
        assert [path for path, _ in worker.loads] == [None, None]
        assert same(worker.loads[0][1], TENSORS) and same(worker.loads[1][1], {n: t + 1 for n, t in TENSORS.items()})
        sender.wait()  # the trainer has noted the receipt
        assert len(sender.groups) == 1  # the worker's one receiver, over the group made at its first ask
        answer = worker.load_weights("/w/step_1", first)  # the trainer holds the second now
        assert answer == {"gone": "the trainer has sent newer weights than 1 of its session"} and len(worker.loads) == 2
        worker.load_weights("/w/files", None)  # files between two broadcasts leave the session's receiver in place
        third = sender.offer(TENSORS)
        worker.load_weights("/w/step_3", third)
        sender.wait()
        assert same(worker.loads[-1][1], TENSORS) and len(sender.groups) == 1
    finally:
        sender.close()

    restarted = memory_sender("127.0.0.1", free_port(), timeout_s=30, backend="gloo", device=torch.device("cpu"))
    try:  # a new trainer session: the worker asks the new trainer, over a new group
        worker.load_weights("/w/step_4", restarted.offer(TENSORS))
        restarted.wait()
        assert same(worker.loads[-1][1], TENSORS) and len(restarted.groups) == 1
    finally:
        restarted.close()


def test_a_shared_buffer_is_copied_out_and_the_trainer_told_so(free_port):
    sender = memory_sender("127.0.0.1", free_port(), timeout_s=30, backend="shared", device=torch.device("cpu"))
    worker = FakeWorker()
    try:
        for step in range(2):
            tensors = {name: tensor + step for name, tensor in TENSORS.items()}
            worker.load_weights(f"/w/step_{step}", sender.offer(tensors))  # the second offer waits for the first
            assert same(worker.loads[-1][1], tensors)
        sender.wait()  # the worker said it took the second
        assert worker.load_weights("/w/base")["path"] == "/w/base"  # then files (a reset to the base model)
    finally:
        sender.close()
