import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from launch import preflight
from launch.preflight import (
    check_envs_installed,
    check_model,
    check_port_free,
    lock_output_dir,
    placement,
    placement_env,
    placement_lines,
)
from launch.process import command
from launch.rl_config import RLConfig, resolve_shared, sub_configs

DEBUG = Path(__file__).parents[3] / "configs" / "debug" / "rl"


def test_output_dir_lock_refuses_a_second_run_and_names_the_first(tmp_path):
    first = lock_output_dir(tmp_path)
    with pytest.raises(TridentError, match=rf"another rl run \(pid {os.getpid()}\) is using {tmp_path}"):
        lock_output_dir(tmp_path)
    first.close()  # the first run ended: the dir is free again
    lock_output_dir(tmp_path).close()


def test_port_in_use_is_reported_with_the_flag_to_change():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(TridentError, match=rf"port {port} on 127.0.0.1 is already in use.*--inference.port"):
            check_port_free("127.0.0.1", port)


def test_no_gpu_places_everything_on_cpu_and_says_so(caplog):
    config = parse_config(RLConfig, ["--trainer-gpu-ids", "0,1", "--inference-gpu-ids", "[0]"])
    assert config.trainer_gpu_ids == [0, 1] and config.inference_gpu_ids == [0]
    with caplog.at_level("INFO"):
        placement = placement_env(config, on_gpu=False)
    assert all(env == {"CUDA_VISIBLE_DEVICES": ""} for env in placement.values())
    assert "no GPU found: inference and trainer run on the CPU" in caplog.text


def test_several_cpu_servers_compute_on_cores_of_their_own_unless_the_binding_is_set(monkeypatch):
    monkeypatch.delenv(preflight.BIND_ENV, raising=False)
    monkeypatch.setattr(preflight.os, "sched_getaffinity", lambda pid: {3, 1})  # the cores rl may use
    config = resolved("--inference-servers", "3")
    placement = placement_env(config, on_gpu=False)
    binds = {name: env.get(preflight.BIND_ENV) for name, env in placement.items()}
    assert binds == {"inference-0": "1", "inference-1": "3", "inference-2": "1", "orchestrator": None, "trainer": None}
    assert placement_env(resolved(), on_gpu=False)["inference"] == {"CUDA_VISIBLE_DEVICES": ""}  # vLLM's own choice
    monkeypatch.setenv(preflight.BIND_ENV, "nobind")  # the user's choice stands
    assert all(preflight.BIND_ENV not in env for env in placement_env(config, on_gpu=False).values())


def test_unknown_environment_is_named_before_anything_starts():
    config = parse_config(RLConfig, ["--orchestrator.env", '[{"id": "gsm8k-calc"}, {"id": "no-such-env"}]'])
    with pytest.raises(TridentError, match=r"orchestrator.env.1.id: environment 'no-such-env' is not installed"):
        check_envs_installed(config)


def test_a_trainer_on_several_devices_starts_under_torchrun(tmp_path):
    config_path = tmp_path / "trainer.toml"
    assert command("trainer.main", config_path) == [sys.executable, "-m", "trainer.main", "@", str(config_path)]
    argv = command("trainer.main", config_path, nproc=4)
    assert argv[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert argv[5:] == ["-m", "trainer.main", "@", str(config_path)]


def test_model_folder_must_exist_and_have_a_chat_template(tmp_path, tiny_model_path):
    check_model(tiny_model_path)
    check_model("Qwen/Qwen3-8B")  # a hub id: the processes download it
    with pytest.raises(TridentError, match=r"model.name = '/no/such/model': no model there"):
        check_model("/no/such/model")
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model_path, plain)
    (plain / "chat_template.jinja").unlink()
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TridentError, match=r"its tokenizer has no chat template"):
        check_model(str(plain))


def resolved(*flags: str) -> RLConfig:
    return resolve_shared(parse_config(RLConfig, ["--inference", "@", str(DEBUG / "infer.toml"), *flags]))


def test_one_node_of_eight_gpus_places_two_tensor_parallel_servers_and_a_torchrun_trainer():
    config = resolved("--inference-gpu-ids", "0,1,2,3", "--inference.tensor-parallel-size", "2",
                      "--trainer-gpu-ids", "4,5,6,7", "--inference.port", "8100")  # fmt: skip
    assert config.inference_servers == 2
    assert placement(config) == {
        "inference-0": [0, 1],
        "inference-1": [2, 3],
        "orchestrator": [],
        "trainer": [4, 5, 6, 7],
    }
    assert config.orchestrator.client.base_urls == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert [sub.port for name, sub in sub_configs(config).items() if name.startswith("inference")] == [8100, 8101]
    assert placement_lines(config, on_gpu=True) == [
        "placement:",
        "  inference-0: GPU 0,1, port 8100, tensor_parallel_size 2",
        "  inference-1: GPU 2,3, port 8101, tensor_parallel_size 2",
        "  orchestrator: CPU",
        "  trainer: GPU 4,5,6,7, torchrun with 4 ranks (FSDP2)",
    ]


def test_server_count_must_match_the_gpus_given():
    cpu = resolved("--inference-servers", "2")  # no GPU ids given: two servers on the CPU
    assert list(sub_configs(cpu)) == ["inference-0", "inference-1", "orchestrator", "trainer"]
    assert resolved().orchestrator.client.base_url == "http://127.0.0.1:8000"  # one server: as before
    with pytest.raises(ConfigError, match=r"--inference-gpu-ids \[0, 1\]: 3 servers of inference.tensor_parallel_size"
                                          r" = 1 need 3 GPUs"):  # fmt: skip
        resolved("--inference-servers", "3", "--inference-gpu-ids", "0,1")
    with pytest.raises(ConfigError, match=r"--inference-gpu-ids \[0, 1, 2\]: 3 GPUs do not split into servers"):
        resolved("--inference-gpu-ids", "0,1,2", "--inference.tensor-parallel-size", "2")
    with pytest.raises(ConfigError, match="--inference-servers: rl starts servers only with --inference @ infer.toml"):
        resolve_shared(parse_config(RLConfig, ["--inference-servers", "2"]))


def test_the_weight_broadcast_feeds_every_server_and_a_shared_buffer_one():
    """rl tells the trainer how many servers take its broadcast weights (those it starts, or the URLs given); a count
    that disagrees, and a shared buffer for several servers, are refused in one line."""
    broadcast = ["--trainer.weight-broadcast.port", "29510"]
    assert resolved("--inference-servers", "2", *broadcast).trainer.weight_broadcast.receivers == 2
    given = resolve_shared(parse_config(RLConfig, ["--orchestrator.client.base-url", "http://a:1,http://b:2",
                                                   *broadcast]))  # fmt: skip
    assert given.trainer.weight_broadcast.receivers == 2
    assert resolved(*broadcast).trainer.weight_broadcast.receivers == 1
    with pytest.raises(ConfigError, match=r"^trainer.weight_broadcast.receivers = 3, but the orchestrator samples "
                                          r"from 2 servers; leave it out"):  # fmt: skip
        resolved("--inference-servers", "2", *broadcast, "--trainer.weight-broadcast.receivers", "3")
    with pytest.raises(ConfigError, match=r"^weight_broadcast.backend = 'shared' hands the weights to one server, "
                                          r"receivers = 2: use 'gloo'"):  # fmt: skip
        resolved("--inference-servers", "2", *broadcast, "--trainer.weight-broadcast.backend", "shared")


def test_an_environment_shadowing_a_built_in_one_is_named_once_with_both_places(tmp_path, monkeypatch, caplog):
    config = parse_config(RLConfig, ["--orchestrator.env", '[{"id": "reverse-text"}]'])
    built_in = DEBUG.parents[2] / "environments" / "reverse_text" / "reverse_text"
    monkeypatch.delitem(sys.modules, "reverse_text", raising=False)  # find_spec answers from here once imported
    with caplog.at_level("WARNING", logger="rl"):
        check_envs_installed(config)
        assert caplog.records == []  # the built-in itself
        (tmp_path / "reverse_text").mkdir()
        (tmp_path / "reverse_text" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(tmp_path)  # an installed package of the same module name, first on the path
        check_envs_installed(config)
    (warning,) = caplog.records
    assert warning.levelname == "WARNING" and "orchestrator.env.0.id: environment 'reverse-text'" in warning.message
    shadow = (tmp_path / "reverse_text").resolve()
    assert f"from {shadow}, not Trident's built-in {built_in.resolve()}:" in warning.message
