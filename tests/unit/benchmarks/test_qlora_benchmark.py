"""The QLoRA benchmark at its smoke size: the probe gap between a 4-bit and an unquantized base, on the tiny model."""

import json

from contracts.run_dir import PROBE_TOLERANCE_4BIT


def test_smoke_run_measures_a_probe_gap_within_the_tolerance(tmp_path, benchmarks):
    output = tmp_path / "results.json"
    benchmarks("qlora").main(["--smoke", "--output", str(output)])

    result = json.loads(output.read_text())
    gaps = result["probe_gap"]["tiny"]["gaps"]
    assert len(gaps) == 3 and all(0 < gap < PROBE_TOLERANCE_4BIT for gap in gaps)  # quantized, not another model
    assert "debug_run" not in result  # the RL run is the full benchmark's
