"""The weight-delta benchmark at its smoke size: the server's copy equals the trainer's after every step (the
benchmark asserts it) and the numbers add up (no timing asserted)."""

import json


def test_smoke_run_writes_sane_results(tmp_path, benchmarks, tiny_model_path):
    output = tmp_path / "results.json"
    benchmarks("weight_delta").main(["--smoke", "--output", str(output)])

    (entry,) = json.loads(output.read_text())["results"]
    assert (entry["model"], entry["dtype"], entry["lr"]) == ("tiny", "bfloat16", 1e-5)
    for step in entry["steps"]:
        assert 0 < step["unchanged_share"] < 1  # at lr 1e-5 in bf16 some elements move, most do not
        assert step["tensors"]["sparse"] > 0
        assert 0 < step["delta_bytes"] < step["full_bytes"]
