"""The benchmarks that need an inference server or subprocesses, at their smoke size (against the session's server
where they need one): they run and write sane results (no timing asserted). Those that use the server leave it
serving its base weights and no adapter."""

import json

import httpx
import pytest

from contracts.inference_api import auth_headers

pytestmark = pytest.mark.slow


def test_async_overlap_smoke_run(benchmarks, inference_server, tmp_path):
    output = tmp_path / "async_overlap.json"
    benchmarks("async_overlap").main(["--smoke", "--server", inference_server, "--output", str(output),
                                      "--work-dir", str(tmp_path)])  # fmt: skip

    result = json.loads(output.read_text())
    assert {"date", "machine", "config", "model", "runs", "async_level_0", "async_level_1"} <= result.keys()
    config = result["config"]
    assert [run["async_level"] for run in result["runs"]] == list(config["async_levels"])
    for run in result["runs"]:
        assert len(run["step_seconds"]) == config["steps"] - config["warmup_steps"]
        assert all(seconds > 0 for seconds in run["step_seconds"])
        assert run["orchestrator"]["generate_s"] > 0 and run["trainer"]["train_s"] > 0
        # the weights behind each batch obey the run's async level: the processes really ran at that level
        for step, weight_step in enumerate(run["weight_steps"]):
            assert step - run["async_level"] <= weight_step <= step
    assert result["step_ratio_1_over_0"] > 0
    assert 0.5 <= result["best_ratio"] < 1  # max / sum of two positive phases
    assert httpx.get(f"{inference_server}/weights").json()["adapter"] is None  # the base model serves again


def test_step_overlap_smoke_run(benchmarks, inference_server, tmp_path):
    output = tmp_path / "step_overlap.json"
    benchmarks("step_overlap").main(["--smoke", "--server", inference_server, "--output", str(output),
                                     "--work-dir", str(tmp_path)])  # fmt: skip

    result = json.loads(output.read_text())
    assert {"date", "machine", "config", "model", "runs", "on", "off", "ratio_on_over_off"} <= result.keys()
    config = result["config"]
    assert [run["overlap_steps"] for run in result["runs"]] == list(config["overlap"])
    for run in result["runs"]:
        assert len(run["step_seconds"]) == config["steps"] - config["warmup_steps"]
        assert all(seconds > 0 for seconds in run["step_seconds"])
        assert all(0 <= staleness <= config["async_level"] for staleness in run["staleness"])
        assert run["turns_mean"] > 1  # the multi-turn environment's rollouts took several turns
        if not run["overlap_steps"]:  # without it no step starts before the previous batch is written
            assert run["started_early_s"] == 0
    # the setting reached the orchestrator: with it, steps started in the one-turn group's wake (overlap_tail)
    assert any(run["started_early_s"] > 0 for run in result["runs"] if run["overlap_steps"])
    assert result["ratio_on_over_off"]["median"] > 0
    assert httpx.get(f"{inference_server}/weights").json()["step"] == 0  # the base model serves again


def test_reload_latency_smoke_run(benchmarks, inference_server, broadcast_port, tmp_path):
    output = tmp_path / "reload_latency.json"
    flags = ["--work-dir", str(tmp_path), "--broadcast-port", str(broadcast_port)]  # the session server's
    benchmarks("reload_latency").main(["--smoke", "--server", inference_server, "--output", str(output), *flags])

    result = json.loads(output.read_text())
    assert {"date", "machine", "config", "models"} <= result.keys()
    model = result["models"]["served"]
    assert model["model"]["weights_bytes"] > model["model"]["adapter_bytes"] > 0
    for kind in ("full", "lora", "shared"):
        assert len(model[kind]["server_s"]) == len(model[kind]["round_trip_s"]) == result["config"]["reloads"]
        assert 0 < model[kind]["server_median_s"] <= model[kind]["server_max_s"]
        assert model[kind]["server_median_s"] <= model[kind]["round_trip_median_s"]
        assert 0 < model[kind]["export_median_s"] and len(model[kind]["export_s"]) == result["config"]["reloads"]
        assert model[kind]["end_to_end_median_s"] > model[kind]["round_trip_median_s"]  # the trainer's export too
    assert model["full_over_lora_server"] > 0 and model["full_over_lora_round_trip"] > 0
    assert model["full_over_lora_end_to_end"] > 0
    assert model["shared_over_full_server"] > 0 and model["shared_over_full_end_to_end"] > 0
    assert httpx.get(f"{inference_server}/weights").json()["adapter"] is None  # the base model serves again


def test_orchestrator_rollouts_smoke_run(benchmarks, tiny_model_path, tmp_path):
    benchmark = benchmarks("orchestrator_rollouts")
    output = tmp_path / "results.json"
    benchmark.main(["--smoke", "--output", str(output)])

    result = json.loads(output.read_text())
    assert {"date", "machine", "config", "in_flight"} <= result.keys()
    config = result["config"]
    assert config["turns"] == config["tool_calls"] + 1
    for size in config["in_flight"]:
        summary = result["in_flight"][str(size)]
        batches = summary["batches"]
        assert list(batches) == ["trident", *map(benchmark.workers_side, config["workers"]), "bare"]
        assert config["workers"]  # the smoke run has a side on rollout workers
        for side, runs in batches.items():
            assert len(runs) == config["repetitions"]
            for run in runs:
                assert run["rollouts"] == size and run["cpu_ms_per_turn"] > 0 and run["rollouts_per_s"] > 0
                if side != "bare":  # every rollout ran every turn, the calculator called validly
                    assert run["first_error"] is None and run["ok_share"] == 1, run
                    assert run["turns_mean"] == config["turns"] and run["rewards_mean"]["tool_use"] == 1
        assert summary["rollouts_per_s_over_bare"].keys() == batches.keys() - {"bare"}


def test_trl_grpo_smoke_run(benchmarks, inference_server, tmp_path):
    benchmark = benchmarks("trl_grpo")
    output = tmp_path / "results.json"
    benchmark.main(["--smoke", "--output", str(output), "--server", inference_server, "--trl-threads", "1",
                    "--work-dir", str(tmp_path)])  # fmt: skip

    result = json.loads(output.read_text())
    assert {"date", "machine", "config", "trident", "trl", "trident_speedup_per_step"} <= result.keys()
    assert result["machine"]["cores"] >= 1 and result["config"]["trl"]
    config = result["config"]
    assert config["model"]["hidden_size"] == 64  # the tiny model
    for side in ("trident", "trl"):
        (run,) = result[side]["runs"]  # one repetition
        assert len(run["step_seconds"]) == len(run["rewards"]) == config["steps"]
        assert all(0 <= reward <= 1 for reward in run["rewards"])
        assert run["seconds_per_step"] > 0 and run["startup_s"] > 0 and run["cpu_s_per_step"] > 0
        assert run["wall_s"] > sum(run["step_seconds"][config["warmup_steps"] :])
        assert result[side]["rewards"] == run["rewards"] and result[side]["seconds_per_step"] == run["seconds_per_step"]
    trident = result["trident"]["runs"][0]
    assert trident["phases"]["orchestrator_generate_s"] > 0 and trident["phases"]["trainer_train_s"] > 0
    assert trident["phases"]["trainer_tokens"] > 0 and trident["phases"]["trainer_tokens_per_s"] > 0
    assert result["server_start_s"] is None and not trident["server_cpu_counted"]  # the server was given
    assert result["trl"]["runs"][0]["threads"] == 1
    speedup = result["trident_speedup_per_step"]
    assert speedup["min"] == speedup["median"] == speedup["max"] > 0 and len(speedup["each"]) == 1
    assert result["trident_cpu_saving_per_step"]["median"] > 0

    served = httpx.get(f"{inference_server}/weights", headers=auth_headers(), timeout=30).json()
    assert (served["step"], served["adapter"]) == (0, None)


def test_server_scaling_smoke_run(benchmarks, inference_server, tmp_path):
    output = tmp_path / "results.json"
    # the session's server under two names: two servers to the orchestrator
    servers = f"{inference_server},{inference_server.replace('127.0.0.1', 'localhost')}"
    benchmarks("server_scaling").main(["--smoke", "--output", str(output), "--servers", servers])

    result = json.loads(output.read_text())
    config = result["config"]
    rollouts = config["prompts"] * config["group_size"]
    for side, servers_used in (("one", 1), ("two", 2)):
        (run,) = result["runs"][side]
        assert run["rollouts"] == rollouts and run["sampled_tokens"] > 0
        assert len(run["per_server"]) == servers_used and all(n > 0 for n in run["per_server"])  # a group each
        assert result["sides"][side]["rollouts_per_s"] > 0
    assert result["speedup"] > 0 and len(result["speedup_pairs"]) == 1


def test_difficulty_filter_smoke_run(benchmarks, inference_server, tmp_path):
    output = tmp_path / "difficulty_filter.json"
    benchmarks("difficulty_filter").main(["--smoke", "--server", inference_server, "--output", str(output),
                                          "--work-dir", str(tmp_path)])  # fmt: skip

    result = json.loads(output.read_text())
    assert {"date", "machine", "config", "model", "runs", "on", "off", "step_ratio_on_over_off"} <= result.keys()
    config = result["config"]
    assert [run["setting"] for run in result["runs"]] == list(config["settings"])
    for run in result["runs"]:
        assert len(run["first_reward_mean"]) == len(run["step_seconds"]) == config["steps"]
        assert all(0 <= reward <= 1 for reward in run["first_reward_mean"])
        if run["setting"] == "off":  # the overlay's refill and pool were turned off: nothing refilled
            assert run["refill_groups"] == [0] * config["steps"]
            assert run["first_reward_mean"] == run["batch_reward_mean"]
        else:  # every replacement replaced a tied group; a place left tied had no attempt left
            assert all(d >= g for d, g in zip(run["dropped_groups"], run["refill_groups"], strict=True))
    assert result["step_ratio_on_over_off"] > 0
    assert httpx.get(f"{inference_server}/weights").json()["step"] == 0  # the base model serves again
