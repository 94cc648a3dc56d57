"""The logprob memory benchmark at its smoke size: both sides run and agree (no memory figure asserted)."""

import json


def test_smoke_run_agrees_on_values_and_gradients(tmp_path, benchmarks):
    benchmark = benchmarks("logprob_memory")
    output = tmp_path / "results.json"
    benchmark.main(["--smoke", "--output", str(output)])

    result = json.loads(output.read_text())
    assert result["same_values"], result["max_abs_gap"]
    assert set(result["max_abs_gap"]) == {"logprobs", "entropies", "hidden_grad", "weight_grad"}
    for side in ("chunked", "unchunked"):
        assert result[side]["peak_mib"] >= 0 and result[side]["cpu_seconds"] > 0
