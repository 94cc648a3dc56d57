"""The start-cost benchmark at its smoke size, this tree against itself: it runs and writes sane results (no timing
asserted)."""

import json
from pathlib import Path

SRC = Path(__file__).parents[3] / "src"


def test_smoke_run_writes_sane_results(tmp_path, benchmarks):
    output = tmp_path / "results.json"
    benchmarks("start_cost").main(["--smoke", "--output", str(output), "--before-src", str(SRC)])

    result = json.loads(output.read_text())
    assert {"date", "machine", "before", "repeats", "rows"} <= result.keys()
    assert [row["measurement"] for row in result["rows"]] == ["rl --help", "build-tiny-model --help"]
    for row in result["rows"]:
        assert row["before_cpu_s"] > 0 and row["after_cpu_s"] > 0
        assert len(row["runs"]["before"]) == len(row["runs"]["after"]) == result["repeats"] == 1
