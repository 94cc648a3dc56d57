"""The GPU check at its smoke size on CPU: every case trains, exports and is planned; the weight handover runs
between two processes through the trainer's shared buffer (no timing asserted)."""

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
    assert set(result["cases"]) == {"tiny-full", "tiny-lora", "tiny-short-samples"}
    for name, sides in result["cases"].items():
        assert list(sides) == ["new"]  # no --baseline-src
        run = sides["new"]
        assert run["export"]["kind"] == ("adapter" if name == "tiny-lora" else "merged")
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
    (handover,) = result["handover"]
    assert handover["transport"] == "shm" and handover["tensors"] > 0  # a /dev/shm buffer on the CPU
    assert len(handover["write_s"]) == len(handover["take_s"]) == 4
    assert all(s > 0 for s in handover["write_s"] + handover["take_s"])
    assert "results: " in done.stdout
