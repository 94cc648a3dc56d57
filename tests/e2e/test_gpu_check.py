"""The GPU check at its smoke size on CPU: every case trains, exports and is planned, a tiny mixture of experts and a
long sample with activation offload among them; the weight handover runs between two processes through the trainer's
shared buffer (no timing asserted). The mixture-of-experts cases for a GPU are checked for their shape and their eager
twins without running them; the long-sample cases for theirs."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_smoke_run_trains_exports_plans_and_hands_weights_over(tmp_path):
    output = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--output", str(output)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(output.read_text())
    assert result["smoke"] and result["device"] == "cpu" and result["date"]
    assert set(result["cases"]) == {"tiny-full", "tiny-lora", "tiny-short-samples", "tiny-moe-lora",
                                    "tiny-lora-long-offload"}  # fmt: skip
    for name, sides in result["cases"].items():
        assert list(sides) == ["new"]  # no --baseline-src
        run = sides["new"]
        assert run["export"]["kind"] == ("adapter" if "lora" in name else "merged")
        assert run["export"]["seconds"] > 0
        for batch in run["batches"]:
            assert batch["tokens"] == batch["samples"] * batch["tokens_per_sample"]
            assert len(batch["step_seconds"]) == result["timed_steps"] and batch["tokens_per_s"] > 0
            assert math.isfinite(batch["loss"]) and batch["plan_gib"] > 0 and batch["peak_rss_gib"] > 0
    lora, full = result["cases"]["tiny-lora"]["new"], result["cases"]["tiny-full"]["new"]
    assert not full["applied"]["compiled"] and full["applied"]["micro_batch_tokens"] is None  # the CPU's defaults
    assert full["batches"][0]["micro_batches"] == 1  # no seq_len: each batch in one micro-batch
    # 16 samples of 16 tokens, packed by seq_len = 64 into four micro-batches, then by the budget into one
    short = result["cases"]["tiny-short-samples"]["new"]
    assert short["applied"]["micro_batch_tokens"] == 256 and short["applied"]["ac_part"] == "mlp"
    assert short["batches"][0]["micro_batches"] == 1
    assert 0 < lora["trainable_parameters"] < full["trainable_parameters"]
    # the tiny MoE under LoRA on attention and experts, its experts by grouped GEMM; the dense cases have none
    moe = result["cases"]["tiny-moe-lora"]["new"]
    assert moe["applied"]["experts"] == "grouped_mm" and full["applied"]["experts"] is None
    assert moe["trainable_parameters"] > 0 and moe["batches"][0]["tokens"] == 64
    # the long-sample path: one 512-token sample, every layer's input offloaded (a copy in place on the CPU)
    long = result["cases"]["tiny-lora-long-offload"]["new"]
    assert long["applied"]["ac_offload"] and not lora["applied"]["ac_offload"] and long["applied"]["cp"] == 1
    (handover,) = result["handover"]
    assert handover["transport"] == "shm" and handover["tensors"] > 0  # a /dev/shm buffer on the CPU
    assert len(handover["write_s"]) == len(handover["take_s"]) == 4
    assert all(s > 0 for s in handover["write_s"] + handover["take_s"])
    assert "results: " in done.stdout


def test_the_moe_cases_run_four_layers_of_qwen3_30b_a3b_grouped_and_eager():
    import runpy

    import torch
    from transformers import AutoModelForCausalLM

    from contracts.model_card import ModelShape

    check = runpy.run_path(str(ROOT / "benchmarks" / "gpu_check.py"))
    moe = {name: case for name, case in check["CASES"].items() if case.experts}
    assert {case.experts for case in moe.values()} == {"grouped_mm", "eager"}
    for name, case in moe.items():  # each grouped-GEMM case has its eager twin, the same run otherwise
        if case.experts == "grouped_mm":
            assert moe[f"{name}-eager"] == check["Case"](**vars(case) | {"experts": "eager"})
    assert {case.lora_rank for case in moe.values()} == {None, 4}  # full and LoRA
    config = check["qwen3_config"]("Qwen3-30B-A3B", 4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config.to_dict())
    assert (config.model_type, shape.num_hidden_layers, shape.num_experts, shape.num_experts_per_tok) == (
        "qwen3_moe", 4, 128, 8)  # fmt: skip
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert sum(p.numel() for p in model.parameters()) - norms == shape.parameters  # 3.1B, planned as it is built


def test_the_long_sample_cases_train_one_65536_token_sample_of_8b_kept_offloaded_and_split():
    import runpy

    cases = runpy.run_path(str(ROOT / "benchmarks" / "gpu_check.py"))["CASES"]
    kept, offloaded, split = (cases[f"qwen3-8b-lora-64k{suffix}"] for suffix in ("", "-offload", "-cp2"))
    assert kept.shape == "Qwen3-8B" and kept.batches == [(1, 65_536)] and kept.ac_freq == 1 and kept.lora_rank
    assert vars(offloaded) == vars(kept) | {"ac_offload": True}  # the same run otherwise
    assert vars(split) == vars(kept) | {"cp": 2}
    assert split.model_config("m")["parallel"] == {"cp": 2} and offloaded.model_config("m")["ac"]["offload"]
