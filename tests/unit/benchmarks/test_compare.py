"""benchmarks/compare.py: each ratio it names is found in our recorded results, and a new value outside the recorded
spread is reported as moved (run on results files written by the test; no benchmark runs)."""

import json
import shutil

import pytest


@pytest.fixture
def compare(benchmarks):
    return benchmarks("compare")


def test_every_ratio_reads_from_its_recorded_results(compare):
    for ratio in compare.RATIOS:
        recorded = json.loads((compare.RESULTS_DIR / ratio.results).read_text())
        reading = compare.read_ratio(recorded, ratio)
        assert reading.low <= reading.value <= reading.high and reading.value > 0, ratio.name
        assert (reading.repetitions > 1) == (ratio.repetitions is not None), ratio.name


def _set(result: dict, dotted: str, value) -> None:
    *path, key = dotted.split(".")
    for part in path:
        result = result[part]
    result[key] = value


def _with_ratio(compare, name, tmp_path, value, repetitions=None):
    """A copy of the recorded results of ``name`` in ``tmp_path`` with its ratio (and repetitions) replaced."""
    (ratio,) = [r for r in compare.RATIOS if r.name == name]
    result = json.loads((compare.RESULTS_DIR / ratio.results).read_text())
    _set(result, ratio.value, value)
    if repetitions is not None:
        _set(result, ratio.repetitions, repetitions)
    (tmp_path / ratio.results).write_text(json.dumps(result))
    return ratio


def test_a_value_outside_the_recorded_spread_is_reported_moved(compare, tmp_path, capsys):
    # the larger TRL comparison, recorded 1.66 (1.48-1.83, 2 repetitions): 1.16 (1.11-1.21), as before the trainer
    # borrowed the idle core and shared its prompts, moved down
    _with_ratio(compare, "trl_grpo_larger", tmp_path, 1.16, [1.11, 1.21])
    _with_ratio(compare, "async_overlap", tmp_path, 0.75, [0.72, 0.78])  # recorded 0.80 (0.71-0.87): within
    assert compare.main(["--results", str(tmp_path), "--only", "trl_grpo_larger", "async_overlap"]) == 1
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:3]}
    assert rows == {"trl_grpo_larger": "down", "async_overlap": "within"}

    _with_ratio(compare, "trl_grpo_larger", tmp_path, 2.1, [2.05, 2.15])
    assert compare.main(["--results", str(tmp_path), "--only", "trl_grpo_larger"]) == 1
    assert capsys.readouterr().out.splitlines()[1].split()[-1] == "up"


def test_a_ratio_recorded_once_moves_beyond_the_tolerance(compare, tmp_path):
    (ratio,) = [r for r in compare.RATIOS if r.name == "shared_fleet"]
    recorded = compare.read_ratio(json.loads((compare.RESULTS_DIR / ratio.results).read_text()), ratio)
    for factor, verdict in ((1.05, "within"), (0.95, "within"), (1.15, "up"), (0.85, "down")):
        _with_ratio(compare, "shared_fleet", tmp_path, recorded.value * factor)
        (row,) = compare.compare([ratio], tmp_path, compare.RESULTS_DIR, tolerance=0.1)
        assert row["verdict"] == verdict, factor


def test_results_missing_on_either_side_are_said(compare, tmp_path):
    ratios = [r for r in compare.RATIOS if r.name in ("trl_grpo", "in_flight")]
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    shutil.copy(compare.RESULTS_DIR / "trl_grpo.json", tmp_path / "trl_grpo.json")
    rows = compare.compare(ratios, tmp_path, recorded, tolerance=0.1)
    assert [(row["name"], row["verdict"]) for row in rows] == [("trl_grpo", "nothing recorded"),
                                                               ("in_flight", "not run")]  # fmt: skip


def test_a_ratio_measured_on_another_machine_says_how_it_differs(compare, tmp_path, capsys):
    ratio = _with_ratio(compare, "trl_grpo_larger", tmp_path, 0.99, [0.98, 1.0])
    recorded = json.loads((compare.RESULTS_DIR / ratio.results).read_text())
    new = json.loads((tmp_path / ratio.results).read_text())
    new["machine"] |= {"cpu_capability": "AVX512", "cores": 4}
    (tmp_path / ratio.results).write_text(json.dumps(new))
    machine = recorded["machine"]
    expected = f"cpu_capability {machine['cpu_capability']} -> AVX512, cores {machine['cores']} -> 4"
    assert compare.machine_change(recorded, new) == expected
    compare.main(["--results", str(tmp_path), "--only", "trl_grpo_larger"])
    assert capsys.readouterr().out.splitlines()[-1] == f"(trl_grpo_larger: another machine: {expected})"
    assert compare.machine_change(recorded, recorded) is None
    older = {"machine": {key: value for key, value in machine.items() if key != "cpu_capability"}}  # before 2026-12-05
    assert compare.machine_change(older, recorded) == f"cpu_capability not recorded -> {machine['cpu_capability']}"
