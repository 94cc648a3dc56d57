"""Batch files from outside the run (truncated, corrupted, wrong dtypes or shapes, links out of the folder) are
refused with a BatchError naming the file, before anything is trained on them; nothing outside is read or deleted.
Hypothesis draws the faults."""

import json
import math
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from contracts.metrics import MetricsWriter
from contracts.protocol import (
    MICRO_BATCH_DTYPES,
    BatchError,
    BatchInfo,
    MicroBatch,
    Sample,
    prune_rollouts,
    read_batch,
    write_batch,
)
from contracts.run_dir import rollouts_dir, step_dirs

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def samples() -> list[Sample]:
    return [
        Sample([5, 6, 7, 8], [False, False, True, True], [0.0, 0.0, -1.0, -2.0], 0.5, 1.0, 0),
        Sample([9, 10, 11], [False, True, True], [0.0, -0.5, -0.25], -0.5, 0.0, 0),
    ]


def info(step: int = 0) -> BatchInfo:
    return BatchInfo(step, num_samples=2, num_tokens=7, num_loss_tokens=4, reward_mean=0.5, temperature=1.0)


def valid_batch(output_dir: Path, step: int = 0) -> Path:
    return write_batch(output_dir, info(step), [MicroBatch.pack(samples())])


@pytest.fixture(scope="module")
def micro_batch_bytes(tmp_path_factory) -> bytes:
    folder = valid_batch(tmp_path_factory.mktemp("valid"))
    return (folder / "micro_batch_0.safetensors").read_bytes()


def read_fuzzed(write) -> tuple[BatchInfo, list[MicroBatch]]:
    """Write a valid batch of step 0 in a fresh folder, let ``write(folder)`` spoil it, and read it."""
    with tempfile.TemporaryDirectory() as tmp:
        write(valid_batch(Path(tmp)))
        return read_batch(Path(tmp), 0, vocab_size=100)


def test_the_valid_batch_reads_back():
    info_read, micro_batches = read_fuzzed(lambda folder: None)
    assert info_read == info() and micro_batches[0].input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("truncation", [{"top_p": 0.0}, {"top_k": -1}, {"min_p": 1.0}, {"top_p": float("nan")}])
def test_a_truncation_the_server_cannot_have_applied_is_refused(truncation):
    def spoil(folder):
        described = json.loads((folder / "batch.json").read_text())
        described["truncation"].update(truncation)
        (folder / "batch.json").write_text(json.dumps(described))

    with pytest.raises(BatchError, match=rf"batch\.json: truncation {next(iter(truncation))} is "):
        read_fuzzed(spoil)


@FUZZ
@given(cut=st.floats(0, 1, exclude_max=True))
def test_a_truncated_micro_batch_file_is_refused(micro_batch_bytes, cut):
    def truncate(folder):
        (folder / "micro_batch_0.safetensors").write_bytes(micro_batch_bytes[: int(cut * len(micro_batch_bytes))])

    with pytest.raises(BatchError, match="micro_batch_0.safetensors: "):
        read_fuzzed(truncate)


@FUZZ
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=8))
def test_corrupted_bytes_are_refused_or_read_as_a_consistent_batch(micro_batch_bytes, flips):
    """Flipped bits in the data give other values, which must still make a consistent batch; anywhere else
    they must give a BatchError, never another exception."""
    data = bytearray(micro_batch_bytes)
    for where, mask in flips:
        data[int(where * len(data))] ^= mask
    try:
        _, micro_batches = read_fuzzed(lambda folder: (folder / "micro_batch_0.safetensors").write_bytes(bytes(data)))
    except BatchError:
        return
    assert micro_batches[0].problem() is None


MUTATIONS = {
    "dtype": lambda t: t.to(torch.float64 if t.dtype != torch.float64 else torch.int32),
    "2-d": lambda t: t.reshape(1, -1),
    "shorter": lambda t: t[:-1],
    "longer": lambda t: torch.cat([t, t[-1:]]),
}


@FUZZ
@given(name=st.sampled_from(sorted(MICRO_BATCH_DTYPES)), mutation=st.sampled_from(sorted(MUTATIONS)))
def test_a_tensor_of_another_dtype_or_shape_is_refused(name, mutation):
    def mutate(folder):
        tensors = MicroBatch.pack(samples()).to_dict()
        tensors[name] = MUTATIONS[mutation](tensors[name]).contiguous()
        save_file(tensors, folder / "micro_batch_0.safetensors")

    with pytest.raises(BatchError, match="micro_batch_0.safetensors: ") as error:
        read_fuzzed(mutate)
    if mutation in ("dtype", "2-d"):
        assert f": {name} is " in str(error.value)


NAN = "advantages or inference_logprobs hold NaN or infinite values"
POSITIONS = r"position_ids do not count 0, 1, \.\.\. from the start of each sample"


@pytest.mark.parametrize(
    "spoil, fault",
    [
        (lambda t: t.pop("advantages"), "holds tensors"),
        (lambda t: t.update({"../../evil": torch.zeros(1)}), "holds tensors"),
        (lambda t: t["advantages"].__setitem__(0, float("nan")), NAN),
        (lambda t: t["input_ids"].__setitem__(0, -3), "input_ids holds negative token ids"),
        (lambda t: t["weight_steps"].__setitem__(6, -1), "weight_steps holds negative steps"),
        (lambda t: t["position_ids"].__setitem__(5, 0), POSITIONS),
        (lambda t: t["sample_lengths"].__setitem__(0, 5), r"sample_lengths \[5, 3\] do not split 7 tokens"),
        # a sample of no tokens, though the lengths add up and the positions count from 0
        (
            lambda t: t.update(sample_lengths=torch.tensor([0, 7]), position_ids=torch.arange(7)),
            r"sample_lengths \[0, 7\] do not split 7 tokens",
        ),
        (
            lambda t: t.update(ce_weights=torch.tensor([0.0, 0.0, -1.0, 0, 0, 0, 0])),
            "ce_weights hold negative, NaN or infinite values",
        ),
    ],
)
def test_tensors_that_do_not_make_a_batch_are_refused(spoil, fault):
    """The whole message after the file's name: the fault named as it is, nothing else."""

    def write(folder):
        tensors = MicroBatch.pack(samples()).to_dict()
        spoil(tensors)
        save_file(tensors, folder / "micro_batch_0.safetensors")

    with pytest.raises(BatchError, match=rf"micro_batch_0\.safetensors: {fault}"):
        read_fuzzed(write)


def test_the_lengths_a_bad_layout_shows_are_the_first_eight():
    micro_batch = MicroBatch.pack([Sample([i], [True], [-1.0], 0.0, 0.0, 0) for i in range(9)])
    micro_batch.sample_lengths = torch.tensor([1] * 8 + [2])
    assert micro_batch.problem() == "sample_lengths [1, 1, 1, 1, 1, 1, 1, 1] do not split 9 tokens into samples"


@pytest.mark.parametrize(
    "name, tensor, shown",
    [
        ("routes", torch.zeros(7, 2, 2, dtype=torch.int64), "torch.int64 of shape [7, 2, 2], expected 3-d torch.uint8"),
        ("routes", torch.zeros(7, 4, dtype=torch.uint8), "torch.uint8 of shape [7, 4], expected 3-d torch.uint8"),
        ("ce_weights", torch.zeros(7, dtype=torch.float64), "torch.float64 of shape [7], expected 1-d torch.float32"),
        ("ce_weights", torch.zeros(7, 1), "torch.float32 of shape [7, 1], expected 1-d torch.float32"),
    ],
)
def test_optional_tensors_of_another_dtype_or_shape_are_refused(name, tensor, shown):
    def write(folder):
        save_file({**MicroBatch.pack(samples()).to_dict(), name: tensor}, folder / "micro_batch_0.safetensors")

    with pytest.raises(BatchError) as error:
        read_fuzzed(write)
    assert str(error.value).endswith(f"micro_batch_0.safetensors: {name} is {shown}")


def test_an_unreadable_micro_batch_file_is_refused_naming_the_reader_error():
    with pytest.raises(BatchError, match=r"micro_batch_0\.safetensors: not a readable safetensors file \(\w*Error: "):
        read_fuzzed(lambda folder: (folder / "micro_batch_0.safetensors").write_bytes(b"\x08" + bytes(7)))


@pytest.mark.parametrize(
    "key, said, found", [("step", 5, 0), ("num_samples", 3, 2), ("num_tokens", 8, 7), ("num_loss_tokens", 5, 4)]
)
def test_counts_that_differ_from_the_files_are_refused_naming_the_key(key, said, found):
    def write(folder):
        (folder / "batch.json").write_text(json.dumps({**asdict(info()), key: said}))

    with pytest.raises(BatchError, match=rf"batch\.json: {key} is {said}, but the micro-batch files hold {found}$"):
        read_fuzzed(write)


@pytest.mark.parametrize("key, value", [("num_tokens", "7"), ("temperature", "1.0"), ("step", 0.0)])
def test_a_batch_description_is_read_strictly_not_coerced(key, value):
    """A count written as a string or a float is not what the orchestrator writes: refused, not converted."""

    def write(folder):
        (folder / "batch.json").write_text(json.dumps({**asdict(info()), key: value}))

    with pytest.raises(BatchError, match=r"batch\.json: not a batch description \(ValidationError: "):
        read_fuzzed(write)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf")])
def test_a_temperature_the_server_cannot_have_sampled_at_is_refused(temperature):
    def write(folder):
        (folder / "batch.json").write_text(json.dumps({**asdict(info()), "temperature": temperature}))

    with pytest.raises(BatchError, match=rf"batch\.json: temperature is {temperature}, expected a positive number$"):
        read_fuzzed(write)


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    valid_batch(tmp_path)  # token ids 5..11
    for vocab_size in (10, 11):  # 11: the id 11 is one past the last
        with pytest.raises(BatchError, match=f"step_0: token ids beyond the model's vocabulary of {vocab_size}$"):
            read_batch(tmp_path, 0, vocab_size=vocab_size)
    assert read_batch(tmp_path, 0, vocab_size=12)[0] == info()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(key=st.sampled_from(sorted(asdict(info()))), value=json_values | st.just("missing"))
def test_a_batch_description_with_a_wrong_field_is_refused_or_changes_only_what_is_logged(key, value):
    def write(folder):
        described = asdict(info())
        if value == "missing":
            described.pop(key)
        else:
            described[key] = value
        (folder / "batch.json").write_text(json.dumps(described))

    try:
        read_info, _ = read_fuzzed(write)
    except BatchError as e:
        assert "batch.json: " in str(e)
        return
    # the counts the trainer normalizes by and the step are checked against the files; the rest, which is only
    # logged, has its type
    assert (read_info.step, read_info.num_loss_tokens, read_info.num_tokens) == (0, 4, 7)
    assert read_info.temperature > 0 and math.isfinite(read_info.temperature)
    assert isinstance(read_info.reward_mean, int | float) and isinstance(read_info.metrics, dict)
    assert all(isinstance(s, int) for s in read_info.weight_steps) and isinstance(read_info.samples, list)


@FUZZ
@given(text=st.text(max_size=40) | json_values.map(json.dumps))
def test_a_batch_description_that_is_not_one_is_refused(text):
    try:
        read_fuzzed(lambda folder: (folder / "batch.json").write_text(text))
    except BatchError as e:
        assert "batch.json: " in str(e)
        return
    raise AssertionError(f"read {text!r} as a batch description")


def test_links_out_of_the_rollouts_folder_are_refused_and_nothing_outside_is_deleted(tmp_path):
    outside = valid_batch(tmp_path / "outside")  # a complete batch somewhere else
    run = tmp_path / "run"
    rollouts_dir(run, 0).parent.mkdir(parents=True)
    rollouts_dir(run, 0).symlink_to(outside, target_is_directory=True)
    with pytest.raises(BatchError, match="step_0: not a folder"):
        read_batch(run, 0)

    step_1 = valid_batch(run, 1)
    (step_1 / "micro_batch_0.safetensors").unlink()
    (step_1 / "micro_batch_0.safetensors").symlink_to(outside / "micro_batch_0.safetensors")
    with pytest.raises(BatchError, match="micro_batch_0.safetensors: not a regular file"):
        read_batch(run, 1)
    (step_1 / "micro_batch_1..safetensors").write_bytes(b"")  # not a micro-batch name: never read
    (step_1 / "micro_batch_\N{SUPERSCRIPT TWO}.safetensors").write_bytes(b"")  # a digit, but no number int() reads
    (step_1 / "micro_batch_0.safetensors").unlink()
    shutil.copy(outside / "micro_batch_0.safetensors", step_1)
    assert read_batch(run, 1)[0].step == 1

    for step in (2, 3):
        valid_batch(run, step)
    prune_rollouts(run, 3, keep=1)  # deletes steps 2 and 1, and must not follow the link of step 0
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step_0", "step_3"]
    assert sorted(p.name for p in outside.iterdir()) == ["batch.json", "micro_batch_0.safetensors"]


def test_pruning_keeps_the_batches_of_the_sample_rollouts_the_report_shows(tmp_path):
    """The debug run logs sample rollouts at steps 1 and 11 and keeps 8 batches: at its end (step 20) the report's
    two steps still have their batches, older sampled steps do not."""
    writer = MetricsWriter(tmp_path, "orchestrator")
    for step in range(1, 21):
        valid_batch(tmp_path, step)
        if step % 10 == 1:
            writer.write_table("sample_rollouts", step, [{"step": step, "completion": "abc"}])
        prune_rollouts(tmp_path, step, keep=8)
    writer.close()
    assert sorted(step_dirs(tmp_path / "rollouts")) == [1, 11, *range(13, 21)]
    for step in (21, 22):  # a run resumed for more steps: step 21's sample rollouts replace step 1's batch
        valid_batch(tmp_path, step)
        writer = MetricsWriter(tmp_path, "orchestrator")
        if step == 21:
            writer.write_table("sample_rollouts", step, [{"step": step, "completion": "abc"}])
        writer.close()
        prune_rollouts(tmp_path, step, keep=8)
    assert sorted(step_dirs(tmp_path / "rollouts")) == [11, *range(15, 23)]


def test_pruning_skips_a_step_it_cannot_delete_and_deletes_nothing_outside(tmp_path):
    """A step folder that is a link (here one to a batch outside the run) is left, not followed, and does not stop
    the training step that prunes."""
    outside = valid_batch(tmp_path / "outside")
    run = tmp_path / "run"
    valid_batch(run, 1)
    rollouts_dir(run, 2).symlink_to(outside, target_is_directory=True)
    valid_batch(run, 3)
    prune_rollouts(run, 3, keep=1)
    assert sorted(step_dirs(run / "rollouts")) == [2, 3] and rollouts_dir(run, 2).is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == ["batch.json", "micro_batch_0.safetensors"]
