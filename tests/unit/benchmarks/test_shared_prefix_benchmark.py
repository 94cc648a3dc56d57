"""The shared-prefix benchmark at its smoke size (the tiny model, 2 groups of 2 samples, one pair): it runs, the
shared setting computes fewer tokens, and both settings' first steps agree (no timing asserted)."""

import json


def test_smoke_run_computes_fewer_tokens_for_the_same_step(tmp_path, benchmarks):
    output = tmp_path / "results.json"
    benchmarks("shared_prefix").main(["--smoke", "--output", str(output)])

    result = json.loads(output.read_text())
    whole, shared = result["runs"]
    assert (whole["share_prefixes"], shared["share_prefixes"]) == (False, True)
    # 2 groups of 2 samples of a 49-token prompt and 8 sampled tokens: each group's second prompt not computed
    assert whole["computed_tokens"] == result["tokens"] == 4 * (49 + 8)
    assert shared["computed_tokens"] == whole["computed_tokens"] - 2 * 49
    assert abs(shared["first_loss"] - whole["first_loss"]) < 1e-5
    assert abs(shared["first_grad_norm"] - whole["first_grad_norm"]) < 1e-4 * whole["first_grad_norm"]
    assert result["cpu_ratio_off_over_on"]["each"] and result["cpu_ratio_off_over_on"]["median"] > 0
