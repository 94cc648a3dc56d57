"""The memory plan benchmark at its smoke size: it measures a training step's peak and plans it (no ratio asserted)."""

import json


def test_smoke_run_measures_and_plans(tmp_path, benchmarks):
    benchmark = benchmarks("memory_plan")
    output = tmp_path / "results.json"
    benchmark.main(["--smoke", "--output", str(output)])

    [case] = json.loads(output.read_text())["cases"]
    assert case["measured_mib"] > 0 and case["baseline_mib"] > 0
    assert {"weights", "gradients", "optimizer", "activations", "backward", "total"} <= case["plan_gib"].keys()
    assert case["planned_over_measured"] > 0
