"""``rl --sweep`` (issue 45), checked in this process: the spelling of the sweep's lists, its runs and their ids, each
run's ``rl`` command line, the server the runs share, what a sweep refuses, its dry run and memory plan; a named run
(``rl --run-id``) refused without LoRA. Its supervision of real processes (a run failing, SIGTERM) is checked in
tests/integration/test_sweep_supervision.py."""

import logging
import re
from types import SimpleNamespace

import pytest
from debug_configs import FILES

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.metrics import eval_line
from contracts.model_card import GIB, LINEARS, ModelCard, lora_parameters
from launch.launcher import server_lines, step_line
from launch.main import main
from launch.memory_plan import plan_memory
from launch.rl_config import RLConfig, resolve_shared
from launch.supervise import failure_message
from launch.sweep import (
    CONSOLE_LINE,
    RunOutcome,
    ended,
    plan_sweep,
    run_ids,
    split_sweep,
    sweep_axes,
    variants,
    wait_for_server,
)

LORA = ["--trainer.model.experimental.lora.rank", "8"]
LRS = ["--sweep", "trainer.optim.lr=[1e-5,3e-5,1e-4]"]


def sweep_of(tmp_path, *extra: str):
    return plan_sweep([*FILES, *LORA, "--output-dir", str(tmp_path), *extra])


def test_sweep_flags_are_taken_out_in_each_spelling():
    argv = ["--max-steps", "3", "--sweep", "a=[1]", "--sweep=b=[2]", "--sweep", "@", "s.toml", "--sweep", "@t.toml"]
    assert split_sweep(argv) == (["--max-steps", "3"], ["a=[1]", "b=[2]", "@s.toml", "@t.toml"])


def test_lists_come_from_flags_and_a_toml_file(tmp_path):
    toml = tmp_path / "sweep.toml"
    toml.write_text(
        '"orchestrator.sampling.temperature" = [0.7, 1.0]\n[trainer.model.experimental.lora]\nrank = [8, 16]\n'
    )
    axes = sweep_axes(["trainer.optim.lr=[1e-5, 1e-4]", f"@{toml}"])
    assert axes == {
        "trainer.optim.lr": [1e-5, 1e-4],
        "orchestrator.sampling.temperature": [0.7, 1.0],
        "trainer.model.experimental.lora.rank": [8, 16],
    }
    assert len(variants(axes)) == 8  # every combination
    assert variants({"a": [1, 2], "b": ["x", "y"]}) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("specs", "error"),
    [
        (["trainer.optim.lr=1e-5"], "--sweep trainer.optim.lr: expected a non-empty list of values, got 1e-05"),
        (["trainer.optim.lr=[]"], "--sweep trainer.optim.lr: expected a non-empty list of values, got []"),
        (["trainer.optim.lr"], "--sweep 'trainer.optim.lr': expected KEY=[VALUE, ...] (a JSON list) or @ sweep.toml"),
        (["a=[1, 1]"], r"--sweep a: a value is given twice in [1, 1]"),
        (["a=[1]", "a=[2]"], "--sweep a: a is swept twice; give all its values in one list"),
        (
            ["inference.port=[1, 2]"],
            "--sweep inference.port: the runs share one server; set inference.port for it in --inference, not per run",
        ),  # fmt: skip
        (['run-id=["a", "b"]'], "--sweep run_id: the sweep sets run_id for each run itself"),
        (
            ['trainer.output_dir=["a"]'],
            "--sweep trainer.output_dir: the sweep sets trainer.output_dir for each run itself",
        ),  # fmt: skip
    ],
)
def test_a_bad_sweep_list_is_one_line(specs, error):
    with pytest.raises(ConfigError) as raised:
        sweep_axes(specs)
    assert str(raised.value) == error


def test_run_ids_name_the_values_readably_and_stay_valid():
    assert run_ids(variants({"trainer.optim.lr": [1e-5, 3e-5, 1e-4]})) == ["lr=1e-05", "lr=3e-05", "lr=0.0001"]
    two = variants({"trainer.optim.lr": [1e-5], "trainer.model.experimental.lora.rank": [8, 16]})
    assert run_ids(two) == ["lr=1e-05_rank=8", "lr=1e-05_rank=16"]
    same_leaf = variants({"trainer.seed": [1], "orchestrator.seed": [2, 3]})  # a key whole where two end alike
    assert run_ids(same_leaf) == ["trainer.seed=1_orchestrator.seed=2", "trainer.seed=1_orchestrator.seed=3"]
    envs = variants({"orchestrator.env": [[{"id": "char-target"}], [{"id": "gsm8k"}]]})
    assert all(re.fullmatch(r"env=[A-Za-z0-9_.=+-]+", run_id) for run_id in run_ids(envs))
    # too long for a run id (64 characters at most), or not distinct once cleaned: numbered instead
    assert run_ids(variants({"a": ["x" * 70, "y"]})) == ["run-1", "run-2"]
    assert run_ids(variants({"a": ["x y", "x/y"]})) == ["run-1", "run-2"]


def test_each_run_is_an_rl_of_its_own_attached_to_the_sweeps_server(tmp_path):
    plan, _ = sweep_of(tmp_path, *LRS, "--max-steps", "3")
    assert [run.run_id for run in plan.runs] == ["lr=1e-05", "lr=3e-05", "lr=0.0001"]
    run = plan.runs[0]
    assert run.output_dir == tmp_path / "lr=1e-05"
    assert run.overrides == {"trainer.optim.lr": 1e-5}
    assert run.max_steps == 3
    assert run.command[1:3] == ["-m", "launch.main"]
    args = run.command[3:]
    assert "--inference" not in args  # the run starts no server
    config = resolve_shared(parse_config(RLConfig, args))  # what the run's rl will resolve
    assert config.inference is None
    assert config.orchestrator.run_id == "lr=1e-05"
    assert config.trainer.output_dir == tmp_path / "lr=1e-05"
    assert config.trainer.optim.lr == 1e-5
    assert config.trainer.max_steps == 3
    assert config.orchestrator.client.base_url == "http://127.0.0.1:8000"
    assert config.plots is False  # the sweep draws one report of all its runs


def test_the_sweeps_server_serves_every_runs_adapters(tmp_path):
    plan, _ = sweep_of(tmp_path, *LRS)
    assert plan.url == "http://127.0.0.1:8000"
    assert plan.server.weights_root == tmp_path  # each run's weights/step_N is under it
    assert plan.server.lora.max_loras == 4  # a slot per run and one more
    assert plan.server.lora.max_rank == 8
    assert plan.notes == [
        "inference.lora.max_loras raised from 2 to 4: each of the 3 runs' newest adapter, and one more while a run "
        "swaps in its next"
    ]
    ranks, _ = sweep_of(tmp_path, "--sweep", "trainer.model.experimental.lora.rank=[8, 32]")
    assert ranks.server.lora.max_rank == 32  # the largest run's
    assert ranks.server.lora.max_loras == 3
    roomy, _ = sweep_of(tmp_path, *LRS, "--inference.lora.max-loras", "6")
    assert roomy.server.lora.max_loras == 6 and roomy.notes == []


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            [*FILES, *LRS],
            "--sweep: the runs of a sweep share one server, so each trains a LoRA adapter "
            "(trainer.model.experimental.lora with export = 'adapter'); full weights cannot share a "
            "server",
        ),  # fmt: skip
        (
            [*FILES, *LORA, "--trainer.model.experimental.lora.export", "merged", *LRS],
            "--sweep: the runs of a sweep share one server, so each trains a LoRA adapter "
            "(trainer.model.experimental.lora with export = 'adapter'); full weights cannot share a server",
        ),
        (
            [*FILES[:-3], *LORA, *LRS],
            "--sweep: the sweep starts its inference server from --inference @ infer.toml; "
            "give one (runs attach to a server already running with --run-id each: "
            "docs/sharing.md)",
        ),  # fmt: skip
        (
            [*FILES, *LORA, *LRS, "--run-id", "mine"],
            "--sweep: the sweep names each of its runs itself; leave --run-id (orchestrator.run_id) out",
        ),
        (
            [*FILES, *LORA, "--sweep", 'model.name=["trident/tiny-qwen3", "trident/tiny-qwen3-moe"]'],
            "run name=trident-tiny-qwen3-moe: model 'trident/tiny-qwen3-moe', but the sweep's one server serves "
            "'trident/tiny-qwen3'; the runs of a sweep share one base model",
        ),
        (
            [*FILES, *LORA, "--sweep", "seq_len=[512, 1024]"],
            "run seq_len=512: seq_len 512, but the sweep's server stops contexts at max_model_len 1024; the runs of a "
            "sweep share one seq_len",
        ),
        (
            [
                *FILES,
                *LORA,
                "--inference.lora.max-rank",
                "8",
                "--sweep",
                "trainer.model.experimental.lora.rank=[8, 32]",
            ],
            "inference.lora.max_rank = 8 is smaller than a run's trainer.model.experimental.lora.rank (32); the server "
            "serves adapters up to its max_rank",
        ),
        (
            [*FILES, *LORA, "--sweep", "trainer.optim.lrr=[1]"],
            "run lrr=1: --trainer.optim.lrr: trainer.optim.lrr: unknown key",
        ),  # fmt: skip
        (
            [*FILES, *LORA, *LRS, "--inference-servers", "2"],
            "--inference-servers: a sweep starts one inference server; leave it out",
        ),
    ],
)
def test_what_a_sweep_refuses_is_one_line_before_anything_starts(argv, error, tmp_path):
    with pytest.raises(ConfigError) as raised:
        plan_sweep([*argv, "--output-dir", str(tmp_path)])
    assert str(raised.value) == error
    assert not (tmp_path / "configs").exists()


def test_the_dry_run_shows_runs_server_commands_and_memory_and_starts_nothing(tmp_path, capsys, saved_handlers):
    with pytest.raises(SystemExit) as exit:
        main([*FILES, *LORA, *LRS, "--output-dir", str(tmp_path), "--dry-run"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert f"sweep of 3 runs in {tmp_path}:" in out
    assert f"  lr=3e-05: trainer.optim.lr=3e-05 -> {tmp_path / 'lr=3e-05'}" in out
    assert (
        "inference server, shared by the runs: http://127.0.0.1:8000, model trident/tiny-qwen3, LoRA max_loras 4, "
        f"max_rank 8, loading from {tmp_path}"
    ) in out
    assert f"-m inference.main @ {tmp_path / 'configs' / 'inference.toml'}" in out
    assert "--run-id lr=0.0001" in out and "--orchestrator.client.base-url http://127.0.0.1:8000" in out
    assert "  3 trainers (one per run, each its own base, adapter and optimizer state):" in out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["configs", "rl.lock"]  # no run's folder


def test_the_memory_plan_counts_a_trainer_per_run_and_the_servers_lora_slots(tmp_path):
    gpus = ["--gpu-memory-gib", "80", "--trainer-gpu-ids", "1", "--inference-gpu-ids", "0"]
    qwen = ["--model.name", "Qwen/Qwen3-4B", "--trainer.model.experimental.lora.rank", "16"]
    plan, config = sweep_of(tmp_path, *LRS, *gpus, *qwen)
    alone = plan_memory(config.trainer, plan.server, [1], [0], 80.0)
    memory = plan.memory
    assert memory.runs == 3
    assert memory.trainer == alone.trainer  # each run's trainer as planned alone
    assert memory.total("trainer") == pytest.approx(3 * alone.trainer["total"])
    slots = (
        4 * lora_parameters(ModelCard.of("Qwen/Qwen3-4B").hub_shape(), list(LINEARS), 16) * 2 / GIB
    )  # bf16, every linear
    assert memory.inference["adapters"] == pytest.approx(slots)
    (gpu_line,) = [line for line in memory.lines() if line.startswith("  GPU 1:")]
    used = 3 * alone.trainer["total"]
    assert gpu_line == f"  GPU 1: 3 trainers = {used:.1f} GiB, free {80 - used:.1f} GiB"
    with pytest.raises(TridentError, match=r"^the sweep does not fit in memory: GPU 0: 3 trainers \d+\.\d GiB \+ "
                                           r"inference 72\.0 GiB"):  # fmt: skip
        sweep_of(tmp_path, *LRS, "--gpu-memory-gib", "80", *qwen)  # three 4B bases beside vLLM on one GPU


def test_a_run_id_needs_a_lora_adapter_and_the_dry_run_says_the_run_is_named(monkeypatch):
    monkeypatch.delenv("TRIDENT_TRAINER__BORROW_IDLE_CORES", raising=False)  # the suite's (conftest): rl's default
    external = [*FILES[:-3], "--orchestrator.client.base-url", "http://gpu-box:8000", "--run-id", "lr=1e-05"]
    with pytest.raises(ConfigError) as raised:
        resolve_shared(parse_config(RLConfig, external))
    assert str(raised.value) == (
        "--run-id lr=1e-05: a named run shares its inference server, so it must train a LoRA adapter "
        "(trainer.model.experimental.lora with export = 'adapter'); this trainer exports full weights"
    )
    config = resolve_shared(parse_config(RLConfig, [*external, *LORA]))
    assert config.orchestrator.run_id == "lr=1e-05"
    # the server it waits on generates for other runs: its trainer borrows no idle core, unless told to
    assert not config.trainer.borrow_idle_cores
    told = resolve_shared(parse_config(RLConfig, [*external, *LORA, "--trainer.borrow-idle-cores", "true"]))
    assert told.trainer.borrow_idle_cores
    alone = resolve_shared(parse_config(RLConfig, [*FILES[:-3], *LORA, "--async-level", "2"]))
    assert alone.trainer.borrow_idle_cores and alone.trainer.async_level == alone.orchestrator.async_level == 2
    assert server_lines(config)[1:] == [
        "  http://gpu-box:8000: external (rl does not start it), shared with other runs",
        "  the run is named 'lr=1e-05': its adapters are served as lr=1e-05/lora-step-N beside other runs', each "
        "run with its fair share of the server (docs/sharing.md)",
    ]
    with pytest.raises(ConfigError, match="String should match pattern"):
        parse_config(RLConfig, [*external, "--run-id", "a/b"])  # a run id cannot hold the adapter names' '/'


def test_the_sweep_shows_each_runs_step_and_eval_lines_and_its_last_reward():
    record = {"step": 2, "reward_mean": 0.25, "loss": 0.1, "tokens": 10, "wait_s": 1.0, "train_s": 1.0, "save_s": 0.0}
    line = step_line(record, None, 5)
    assert CONSOLE_LINE.match(line)
    assert CONSOLE_LINE.match(eval_line({"step": 2, "eval/char-target/reward_mean": 0.5, "eval/seconds": 3.0}))
    assert not CONSOLE_LINE.match("step 3/5 (31s) · trainer: training")  # rl's progress notice
    outcome = RunOutcome(status="finished")
    outcome.seen(line)
    assert (outcome.steps, outcome.last_reward) == (2, 0.25)
    assert outcome.describe() == "finished, 2 steps, last reward 0.2500"


def test_rl_refuses_a_full_weight_sweep_in_one_line_and_exit_code_2(tmp_path, capsys, saved_handlers):
    with pytest.raises(SystemExit) as exit:
        main([*FILES, *LRS, "--output-dir", str(tmp_path)])
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        "error: --sweep: the runs of a sweep share one server, so each trains a LoRA adapter "
        "(trainer.model.experimental.lora with export = 'adapter'); full weights cannot share a server\n"
    )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_failed_run_shows_the_one_line_its_rl_gave_not_the_end_of_its_log(tmp_path, caplog):
    orchestrator_log = tmp_path / "orchestrator.log"
    cause = "environment 'x': loading its tasks failed: LookupError: Resource punkt not found."
    orchestrator_log.write_text(f"12:00:01 orchestrator ERROR orchestrator failed: {cause}\n")
    rl_line = failure_message("orchestrator", 1, orchestrator_log)  # as the run's rl logs it
    run_log = tmp_path / "lr=1e-05.log"
    run_log.write_text(f"12:00:02 rl ERROR {rl_line}\n" + "12:00:03 rl INFO stopping the processes\n" * 20)
    with caplog.at_level(logging.ERROR, logger="rl"):
        ended("lr=1e-05", SimpleNamespace(log_path=run_log), outcome := RunOutcome(status="running"), 1)
    assert outcome.status == "failed"
    assert caplog.messages == [
        f"run lr=1e-05 exited with code 1: orchestrator exited with code 1: orchestrator failed: {cause} (its log: "
        f"{orchestrator_log}) (its log: {run_log})"
    ]
    run_log.write_text("Traceback (most recent call last):\n  KeyError: 'x'\n")  # rl crashed: no line of its own
    caplog.clear()
    ended("lr=1e-05", SimpleNamespace(log_path=run_log), RunOutcome(status="running"), 1)
    assert caplog.messages[0].endswith("  |   KeyError: 'x'")


def test_a_server_that_fails_to_start_shows_its_one_line(tmp_path, caplog):
    log = tmp_path / "inference.log"
    cause = "[model] max_images_per_prompt = 0: expected at least 1"
    log.write_text(f"12:00:01 inference ERROR inference failed: {cause}\n" + "12:00:02 inference INFO bye\n" * 20)
    server = SimpleNamespace(log_path=log, poll=lambda: 1)
    with caplog.at_level(logging.ERROR, logger="rl"):
        assert not wait_for_server(server, "http://127.0.0.1:9", 30.0)
    assert caplog.messages == [
        f"before it was up, inference exited with code 1: inference failed: {cause} (its log: {log})"
    ]
