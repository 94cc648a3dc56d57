"""The trainer throughput benchmark at its smoke size: it runs and writes sane results (no timing asserted)."""

import json

import torch


def test_smoke_run_writes_sane_results(tmp_path, benchmarks):
    benchmark = benchmarks("trainer_throughput")
    output = tmp_path / "results.json"
    # the benchmark sets torch's thread count: keep this process's for the tests that follow
    benchmark.main(["--smoke", "--output", str(output), "--threads", str(torch.get_num_threads())])

    result = json.loads(output.read_text())
    assert {"date", "machine", "config", "data", "trident", "plain", "first_step"} <= result.keys()
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    tokens = result["data"]["tokens"]
    for side in ("trident", "plain"):
        assert result[side]["tokens_per_s"] > 0 and result[side]["tokens_per_cpu_s"] > 0
        assert len(result[side]["step_seconds"]) == result["config"]["repetitions"]
        assert result[side]["positions"] >= tokens
        assert 0 < result[side]["attention_useful_share"] <= 1
    assert result["trident"]["padding_share"] == 0 and result["trident"]["positions"] == tokens
    assert 0 < result["trident"]["fill"] <= 1
    assert 0 < result["plain"]["padding_share"] < 1  # samples of varied lengths leave padding
    assert result["trident_over_plain"]["tokens_per_s"]["of_medians"] > 0
    assert result["first_step"]["same_loss"]
