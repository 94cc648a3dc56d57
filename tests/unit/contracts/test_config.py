import pytest
from char_target import target_share
from debug_configs import DEBUG, FILES
from transformers import AutoTokenizer

from contracts.config import ConfigError, parse_config
from launch.rl_config import RLConfig, resolve_shared, sub_configs
from orchestrator.config import OrchestratorConfig
from trainer.config import TrainerConfig


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_defaults_env_files_flags(tmp_path, monkeypatch):
    a = write(tmp_path, "a.toml", "max_steps = 3\n[optim]\nlr = 0.1\nmax_norm = 2.0\n")
    b = write(tmp_path, "b.toml", "[optim]\nlr = 0.2\n")
    monkeypatch.setenv("TRIDENT_SEED", "7")
    monkeypatch.setenv("TRIDENT_MAX_STEPS", "99")
    config = parse_config(TrainerConfig, ["@", a, f"@{b}", "--optim.weight-decay", "0.5", "--max-steps", "4"])
    assert config.seed == 7  # env beats default
    assert config.optim.lr == 0.2  # later file beats earlier
    assert config.optim.max_norm == 2.0  # deep merge keeps the earlier file's other keys
    assert config.max_steps == 4  # flag beats file beats env
    assert config.optim.weight_decay == 0.5


def test_env_var_nests_with_double_underscore(monkeypatch):
    monkeypatch.setenv("TRIDENT_OPTIM__LR", "0.003")
    assert parse_config(TrainerConfig, []).optim.lr == 0.003


def test_unknown_key_names_file_and_key(tmp_path):
    path = write(tmp_path, "train.toml", "[optim]\nlrr = 0.1\n")
    with pytest.raises(ConfigError, match=r"train\.toml: optim\.lrr: unknown key"):
        parse_config(TrainerConfig, ["@", path])


def test_wrong_type_names_flag_and_value():
    with pytest.raises(ConfigError, match=r"--max-steps: max_steps: .*integer.*'many'"):
        parse_config(TrainerConfig, ["--max-steps", "many"])


def test_malformed_and_missing_toml(tmp_path):
    bad = write(tmp_path, "bad.toml", "max_steps = \n")
    with pytest.raises(ConfigError, match=r"bad\.toml: invalid TOML: .*\(at line 1, column 13\)"):
        parse_config(TrainerConfig, ["@", bad])
    with pytest.raises(ConfigError, match=rf"config file not found: {tmp_path / 'nope.toml'}"):
        parse_config(TrainerConfig, ["@", str(tmp_path / "nope.toml")])


def test_env_tables_repeat_and_json_flag_values(tmp_path):
    path = write(tmp_path, "orch.toml", '[[env]]\nid = "a"\nargs = { n = 1 }\n[[env]]\nid = "b"\n')
    config = parse_config(OrchestratorConfig, ["@", path])
    assert [(e.id, e.args) for e in config.env] == [("a", {"n": 1}), ("b", {})]
    config = parse_config(OrchestratorConfig, ["--env", '[{"id": "c"}]'])
    assert config.env[0].id == "c"


def test_sections_and_bare_boolean_flags(tmp_path):
    train = write(tmp_path, "t.toml", "max_steps = 3\n")
    config = parse_config(RLConfig, ["--trainer", "@", train, "--dry-run"])
    assert config.trainer.max_steps == 3 and config.dry_run
    assert not parse_config(RLConfig, ["--no-dry-run"]).dry_run


def test_rl_propagates_shared_fields(tmp_path):
    train = write(tmp_path, "t.toml", "max_steps = 3\n[model]\nname = 'm'\n")
    config = resolve_shared(parse_config(RLConfig, ["--trainer", "@", train, "--inference.port", "8123"]))
    assert config.orchestrator.max_steps == 3
    assert config.orchestrator.model.name == config.inference.model.name == "m"
    assert config.orchestrator.client.base_url == "http://127.0.0.1:8123"


def test_rl_flag_overrides_all_and_disagreement_is_an_error(tmp_path):
    train = write(tmp_path, "t.toml", "max_steps = 3\n")
    orch = write(tmp_path, "o.toml", "max_steps = 5\n")
    argv = ["--trainer", "@", train, "--orchestrator", "@", orch]
    with pytest.raises(
        ConfigError, match=r"disagree on max_steps: trainer\.max_steps = 3, orchestrator\.max_steps = 5"
    ):
        resolve_shared(parse_config(RLConfig, argv))
    config = resolve_shared(parse_config(RLConfig, [*argv, "--max-steps", "2"]))
    assert config.trainer.max_steps == config.orchestrator.max_steps == 2


def test_each_problem_is_its_own_line_and_cross_key_checks_read_plainly(tmp_path, capsys):
    path = write(tmp_path, "train.toml", "[optim]\nlr = -1\nlrr = 2\n")
    with pytest.raises(ConfigError) as error:
        parse_config(TrainerConfig, ["@", path, "--max-steps", "x"])
    lines = str(error.value).splitlines()
    assert len(lines) == 3
    assert lines[0] == f"{path}: optim.lr: Input should be greater than 0 (got -1)"
    assert lines[1] == f"{path}: optim.lrr: unknown key"
    assert lines[2].startswith("--max-steps: max_steps: Input should be a valid integer")
    # a check across keys, also when rl fills a shared value into a sub-config
    message = (
        "--orchestrator.sampling.max-tokens: orchestrator: seq_len = 64 is smaller than sampling.max_tokens = 128: a "
        "full reply could not fit in a training sample"
    )
    with pytest.raises(ConfigError, match=f"^{message}$"):
        resolve_shared(parse_config(RLConfig, ["--seq-len", "64", "--orchestrator.sampling.max-tokens", "128"]))


@pytest.mark.parametrize("value", ["0", "1.5"])
def test_gpu_memory_utilization_outside_0_1_is_refused(value):
    with pytest.raises(
        ConfigError, match=rf"--inference.gpu-memory-utilization: inference.gpu_memory_utilization: .*{value}"
    ):
        parse_config(RLConfig, ["--inference.gpu-memory-utilization", value])


def test_log_level_flag_reaches_every_process():
    config = resolve_shared(parse_config(RLConfig, ["--log.level", "debug", "--inference.port", "8000"]))
    assert {config.trainer.log.level, config.orchestrator.log.level, config.inference.log.level} == {"debug"}
    with pytest.raises(ConfigError, match=r"--log.level: log.level: Input should be 'debug', 'info'"):
        parse_config(RLConfig, ["--log.level", "loud"])


def test_adapter_export_turns_on_lora_serving_with_a_fitting_rank(tmp_path):
    lora = ["--trainer.model.experimental.lora.rank", "12", "--trainer.model.experimental.lora.export", "adapter",
            "--inference.port", "8000"]  # fmt: skip
    config = resolve_shared(parse_config(RLConfig, ["--output-dir", str(tmp_path), *lora]))
    assert config.inference.lora.max_rank == 16  # the smallest rank vLLM accepts above 12
    assert config.inference.weights_root == tmp_path / "weights"
    too_small = parse_config(RLConfig, [*lora, "--inference.lora.max-rank", "8"])
    with pytest.raises(ConfigError, match=r"inference.lora.max_rank = 8 is smaller than .*lora.rank = 12"):
        resolve_shared(too_small)
    with_modules = parse_config(RLConfig, [*lora, "--trainer.model.experimental.lora.modules-to-save", '["lm_head"]'])
    with pytest.raises(ConfigError, match=r"modules_to_save: vLLM cannot swap in fully trained modules"):
        resolve_shared(with_modules)
    merged = [*lora[:3], "merged", *lora[4:]]
    assert resolve_shared(parse_config(RLConfig, merged)).inference.lora is None  # full weights need no LoRA serving


def test_without_inference_rl_starts_no_server_and_uses_the_running_one():
    config = resolve_shared(
        parse_config(RLConfig, ["--seq-len", "512", "--orchestrator.client.base-url", "http://10.0.0.2:8000"])
    )
    assert config.inference is None and set(sub_configs(config)) == {"orchestrator", "trainer"}
    assert config.orchestrator.seq_len == config.trainer.seq_len == 512
    assert config.orchestrator.client.base_url == "http://10.0.0.2:8000"
    with_adapters = [
        "--trainer.model.experimental.lora.rank",
        "8",
        "--trainer.model.experimental.lora.export",
        "adapter",
    ]
    assert resolve_shared(parse_config(RLConfig, with_adapters)).inference is None  # the server's [lora] is its own


def test_the_server_takes_broadcast_weights_through_the_trainers_store_only():
    broadcast = ["--trainer.weight-broadcast.host", "127.0.0.1", "--trainer.weight-broadcast.port", "29600"]
    config = resolve_shared(parse_config(RLConfig, [*broadcast, "--inference.port", "8000"]))
    assert (config.inference.weight_broadcast.host, config.inference.weight_broadcast.port) == ("127.0.0.1", 29600)
    assert resolve_shared(parse_config(RLConfig, ["--inference.port", "8000"])).inference.weight_broadcast is None
    other = parse_config(RLConfig, [*broadcast, "--inference.weight-broadcast.port", "29601"])
    with pytest.raises(
        ConfigError, match=r"inference.weight_broadcast = 127.0.0.1:29601 is not trainer.weight_broadcast"
    ):
        resolve_shared(other)


def test_the_filter_runs_eval_passes_a_reply_with_one_target_character(tiny_model_path):
    """filter.toml's eval (char-target on 7s, replies of max_tokens tokens, about 3 % of the tiny model's characters
    7s): a reply of tokens of the vocabulary's mean length with one 7 in it passes. The debug run's pass_reward = 0.5
    did not, and pass@4 stayed at 0."""
    config = resolve_shared(parse_config(RLConfig, [*FILES, "@", str(DEBUG / "filter.toml")]))
    [env] = config.orchestrator.eval.env
    vocabulary = AutoTokenizer.from_pretrained(tiny_model_path).get_vocab()
    token_chars = sum(len(token) for token in vocabulary) / len(vocabulary)
    reply = "7" + "x" * round(config.orchestrator.sampling.max_tokens * token_chars - 1)
    assert target_share(reply, env.args["target_chars"]) >= config.orchestrator.eval.pass_reward
