"""The training loop in-process (a one-rank FSDP2 group on CPU) on hand-made batches."""

import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from contracts.protocol import BatchError, BatchInfo, MicroBatch, write_batch
from contracts.run_dir import checkpoint_dir, read_probe, rollouts_dir, weights_dir
from contracts.sampling import Truncation
from trainer.config import TrainerConfig
from trainer.model import packed_logprobs, use_packed_forward
from trainer.train import EmptyBatchError, train


def run(output_dir, model_path, model=None, **overrides) -> list[dict]:
    overrides = {"max_steps": 2} | overrides
    config = TrainerConfig(output_dir=output_dir, model={"name": model_path, **(model or {})}, **overrides)
    train(config)
    return [json.loads(line) for line in (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]


# Trainer metrics logged only with a setting on: reference_kl with a KL penalty
# (test_lora_kl_reference_is_the_base_model), the corrected shares with an off-policy correction
# (test_a_correction_logs_the_shares_it_masked), the replay ones with routing replay on a mixture of experts
# (test_routing), outside_kept_fraction under a sampling truncation
# (test_a_truncated_batch_logs_the_share_of_tokens_outside_the_trainers_kept_set), too_stale_fraction with
# loss.max_token_staleness, borrowed_cores_s with async_level on the CPU
# (test_a_trainer_told_the_async_level_runs_wide_once_the_orchestrator_waits_for_it).
OPTIONAL_METRICS = {"reference_kl", "corrected_fraction", "corrected_sample_fraction", "replayed_fraction",
                    "mismatch_kl_no_replay", "outside_kept_fraction", "too_stale_fraction", "ce_loss",
                    "borrowed_cores_s"}  # fmt: skip


def documented_trainer_keys() -> set[str]:
    text = (Path(__file__).parents[3] / "docs" / "metrics.md").read_text().split("## Trainer")[1].split("##")[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.M))


def test_metrics_of_a_step_are_the_documented_ones(tmp_path, write_batches, tiny_model_path):
    write_batches(tmp_path)
    records = run(tmp_path, tiny_model_path, loss={"entropy_coef": 0.01})
    assert set(records[0]) == documented_trainer_keys() - OPTIONAL_METRICS
    # random ~2k-token vocabulary, near-uniform random model: entropy close to log(vocab)
    assert 6 < records[0]["entropy"] < 8
    assert records[0]["peak_memory_gib"] > 0


def test_a_trainer_told_the_async_level_runs_wide_once_the_orchestrator_waits_for_it(
    tmp_path, write_batches, tiny_model_path, monkeypatch
):
    """Batches 1 and 2 on disk, async_level 1, 2 steps: step 1's last batch before its weights is batch 2, step 2's
    the run's last, so both steps run on the spare cores from their start, and the trainer's own threads after."""
    own = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(own + 1)))
    write_batches(tmp_path)
    records = run(tmp_path, tiny_model_path, async_level=1)
    assert [r["borrowed_cores_s"] > 0 for r in records] == [True, True]
    assert all(r["borrowed_cores_s"] <= r["train_s"] for r in records)
    assert torch.get_num_threads() == own


def test_a_correction_logs_the_shares_it_masked(tmp_path, random_samples, tiny_model_path):
    samples = random_samples(6)  # server logprobs near the tiny model's: geometric mean weights near 1
    stale = samples[4]  # but the server gave this one's sampled tokens e^-12 of the trainer's probability
    stale.inference_logprobs = [lp - 12.0 * m for lp, m in zip(stale.inference_logprobs, stale.loss_mask, strict=True)]
    loss_tokens = [sum(s.loss_mask) for s in samples]
    info = BatchInfo(1, len(samples), sum(len(s.token_ids) for s in samples), sum(loss_tokens), 0.0, 1.0)
    write_batch(tmp_path, info, [MicroBatch.pack(samples[:3]), MicroBatch.pack(samples[3:])])
    loss = {"correction": "geometric_mask", "correction_low": 0.5, "correction_high": 2.0}
    (record,) = run(tmp_path, tiny_model_path, max_steps=1, loss=loss)
    assert set(record) == documented_trainer_keys() - (
        OPTIONAL_METRICS - {"corrected_fraction", "corrected_sample_fraction"}
    )
    # sample 4's weight is about e^12: all its loss tokens are masked, and no other sample's
    assert record["corrected_fraction"] == pytest.approx(loss_tokens[4] / sum(loss_tokens))
    assert record["corrected_sample_fraction"] == pytest.approx(1 / 6)
    assert record["bounded_fraction"] == pytest.approx(loss_tokens[4] / sum(loss_tokens))  # IcePop drops them too


def test_a_soft_gate_trains_and_logs_no_bounded_share(tmp_path, random_samples, tiny_model_path):
    samples = random_samples(4)
    info = BatchInfo(1, len(samples), sum(len(s.token_ids) for s in samples), sum(sum(s.loss_mask) for s in samples),
                     0.0, 1.0)  # fmt: skip
    write_batch(tmp_path, info, [MicroBatch.pack(samples)])
    (record,) = run(tmp_path, tiny_model_path, max_steps=1, loss={"bound": "sapo"})
    assert set(record) == documented_trainer_keys() - OPTIONAL_METRICS - {"bounded_fraction"}  # SAPO masks nothing
    assert math.isfinite(record["loss"]) and record["grad_norm"] > 0


def test_a_truncated_batch_logs_the_share_of_tokens_outside_the_trainers_kept_set(
    tmp_path, random_samples, tiny_model_path
):
    """Under top_k = 1 the trainer's kept set is its greedy token: one sample's replies are the model's greedy
    continuation (inside), the others' random tokens (outside, scored as kept all the same)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    samples = random_samples(4)
    greedy = samples[0]
    prompt = greedy.loss_mask.index(True)
    ids = greedy.token_ids[:prompt]
    with torch.no_grad():
        for _ in range(len(greedy.token_ids) - prompt):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    greedy.token_ids = ids
    outside = []
    with torch.no_grad():
        for sample in samples:
            best = model(input_ids=torch.tensor([sample.token_ids])).logits[0, :-1].argmax(-1)
            trained = torch.tensor(sample.loss_mask[1:])
            outside.append(int((best != torch.tensor(sample.token_ids[1:]))[trained].sum()))
    assert outside[0] == 0 and all(n > 0 for n in outside[1:])
    loss_tokens = sum(sum(s.loss_mask) for s in samples)
    info = BatchInfo(1, 4, sum(len(s.token_ids) for s in samples), loss_tokens, 0.0, 1.0, Truncation(top_k=1))
    write_batch(tmp_path, info, [MicroBatch.pack(samples)])
    (record,) = run(tmp_path, tiny_model_path, max_steps=1)
    assert record["outside_kept_fraction"] == pytest.approx(sum(outside) / loss_tokens)
    assert all(math.isfinite(value) for value in record.values())  # every token scored finite, as kept


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["lora", "qlora"])
def test_lora_kl_reference_is_the_base_model(tmp_path, write_batches, tiny_model_path, load_in_4bit):
    write_batches(tmp_path)
    lora = {"rank": 4, "alpha": 8}
    records = run(tmp_path, tiny_model_path, model={"experimental": {"lora": lora, "load_in_4bit": load_in_4bit}},
                  loss={"kl_coef": 0.5}, optim={"lr": 1e-2})  # fmt: skip
    # the adapter starts as a no-op (B = 0): the policy is its reference; after one step it has moved away
    assert records[0]["reference_kl"] == 0
    assert records[1]["reference_kl"] > 0


def checkpointed_dtypes(output_dir: Path, step: int) -> dict[str, torch.dtype]:
    """The dtype of each model tensor in the trainer's checkpoint after ``step`` (its master weights)."""
    metadata = FileSystemReader(checkpoint_dir(output_dir, step) / "trainer").read_metadata()
    return {
        name.removeprefix("model."): entry.properties.dtype
        for name, entry in metadata.state_dict_metadata.items()
        if name.startswith("model.")
    }


def test_bf16_compute_keeps_fp32_master_weights_and_exports_bf16(tmp_path, write_batches, tiny_model_path):
    for name in ("fp32", "bf16"):
        write_batches(tmp_path / name)
    fp32 = run(tmp_path / "fp32", tiny_model_path, model={"dtype": "float32"})
    bf16 = run(tmp_path / "bf16", tiny_model_path, model={"dtype": "bfloat16"}, ckpt={"interval": 2})
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2e-2)
    assert bf16[0]["loss"] != fp32[0]["loss"]  # bf16 did run
    weights = load_file(weights_dir(tmp_path / "bf16", 2) / "model.safetensors")
    initial = load_file(weights_dir(tmp_path / "fp32", 2) / "model.safetensors")
    # the server gets weights in the compute dtype, the trainer keeps float32 master weights
    assert all(tensor.dtype == torch.bfloat16 for tensor in weights.values())
    assert all(tensor.dtype == torch.float32 for tensor in initial.values())
    assert json.loads((weights_dir(tmp_path / "bf16", 2) / "config.json").read_text())["dtype"] == "bfloat16"
    assert set(checkpointed_dtypes(tmp_path / "bf16", 2).values()) == {torch.float32}
    assert weights.keys() == initial.keys()


def test_lora_in_bf16_holds_the_base_in_bf16_and_its_export_gathers_only_the_adapter(
    tmp_path, write_batches, tiny_model_path, monkeypatch
):
    gathered = []
    full_tensor = DTensor.full_tensor

    def counting_full_tensor(self, *args, **kwargs):
        tensor = full_tensor(self, *args, **kwargs)
        if tensor.numel() > 1:  # not the gradient norm
            gathered.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(DTensor, "full_tensor", counting_full_tensor)
    write_batches(tmp_path)
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "export": "adapter"}
    run(tmp_path, tiny_model_path, model={"dtype": "bfloat16", "experimental": {"lora": lora}}, optim={"lr": 1e-2},
        ckpt={"interval": 2})  # fmt: skip
    adapter = load_file(weights_dir(tmp_path, 2) / "adapter_model.safetensors")
    assert all(tensor.dtype == torch.float32 for tensor in adapter.values())
    adapter_bytes = sum(tensor.numel() * tensor.element_size() for tensor in adapter.values())
    assert sum(gathered) == 2 * adapter_bytes  # two exports (steps 1 and 2), the adapter alone each time
    dtypes = checkpointed_dtypes(tmp_path, 2)
    assert {dtype for name, dtype in dtypes.items() if "lora_" in name} == {torch.float32}
    assert {dtype for name, dtype in dtypes.items() if "lora_" not in name} == {torch.bfloat16}


def test_lora_adapter_export_loads_in_peft(tmp_path, write_batches, random_samples, tiny_model_path):
    write_batches(tmp_path)
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "export": "adapter"}
    run(tmp_path, tiny_model_path, model={"experimental": {"lora": lora}},
        optim={"lr": 1e-2})  # fmt: skip
    folder = weights_dir(tmp_path, 2)
    assert (folder / "adapter_config.json").exists() and not (folder / "model.safetensors").exists()
    base = use_packed_forward(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32))
    adapted = PeftModel.from_pretrained(base, folder).eval()
    probe = read_probe(folder)
    batch = MicroBatch.pack(random_samples(2))
    with torch.no_grad():
        ids = torch.tensor(probe.token_ids)
        logprobs = torch.log_softmax(adapted(ids[None]).logits[0, :-1], -1).gather(1, ids[1:, None])[:, 0]
        torch.testing.assert_close(logprobs, torch.tensor(probe.logprobs[1:]), atol=1e-5, rtol=1e-5)
        with adapted.disable_adapter():
            unadapted = packed_logprobs(adapted, batch, 1.0)
        assert (packed_logprobs(adapted, batch, 1.0) - unadapted).abs().max() > 1e-4  # the adapter trained


@pytest.mark.gpu
def test_gpu_default_is_bf16_compute_with_fp32_master_weights_and_offload_works(
    tmp_path, write_batches, tiny_model_path
):
    for name in ("fp32", "auto", "offload"):
        write_batches(tmp_path / name)
    fp32 = run(tmp_path / "fp32", tiny_model_path, model={"dtype": "float32"})
    auto = run(tmp_path / "auto", tiny_model_path)
    offload = run(tmp_path / "offload", tiny_model_path, optim={"offload": True})
    assert auto[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2e-2) and auto[0]["loss"] != fp32[0]["loss"]
    assert offload[1]["loss"] == pytest.approx(auto[1]["loss"], rel=1e-4)
    assert auto[1]["peak_memory_gib"] > 0
    weights = load_file(weights_dir(tmp_path / "auto", 2) / "model.safetensors")
    assert all(tensor.dtype == torch.bfloat16 for tensor in weights.values())  # what the server runs


def test_a_batch_without_trainable_tokens_stops_the_trainer_naming_it(tmp_path, random_samples, tiny_model_path):
    samples = [replace(s, loss_mask=[False] * len(s.loss_mask)) for s in random_samples(3)]
    info = BatchInfo(1, 3, sum(len(s.token_ids) for s in samples), 0, 0.0, 1.0)
    write_batch(tmp_path, info, [MicroBatch.pack(samples)])
    with pytest.raises(EmptyBatchError, match=r"step 1: the batch in .*rollouts/step_1 has no sampled token"):
        run(tmp_path, tiny_model_path)


def test_a_spoiled_batch_stops_the_trainer_before_it_trains_or_deletes(tmp_path, write_batches, tiny_model_path):
    write_batches(tmp_path, steps=3)
    spoiled = rollouts_dir(tmp_path, 2) / "micro_batch_0.safetensors"
    spoiled.write_bytes(spoiled.read_bytes()[:100])  # truncated
    with pytest.raises(BatchError, match=f"{spoiled}: not a readable safetensors file"):
        run(tmp_path, tiny_model_path, max_steps=3, keep_rollouts=1)
    assert len((tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()) == 1  # step 1 only
    assert not weights_dir(tmp_path, 2).exists()
    assert rollouts_dir(tmp_path, 1).exists()  # pruned only after the next batch is read and checked


def test_batches_older_than_keep_rollouts_are_deleted_once_trained_on(tmp_path, write_batches, tiny_model_path):
    write_batches(tmp_path, steps=3)
    run(tmp_path, tiny_model_path, max_steps=3, keep_rollouts=2)
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_2", "step_3"]
