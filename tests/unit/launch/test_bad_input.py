"""Bad input to ``rl``, checked in this process: a GPU id beyond the machine's GPUs is named, ``rl``'s own
``--max-steps`` and ``--async-level`` are judged together (issue 30). The checks that run the real ``rl`` command line
in a process of its own are in tests/integration/test_bad_input_cli.py."""

import pytest
from debug_configs import FILES

from contracts.config import parse_config
from contracts.errors import TridentError
from launch import preflight
from launch.launcher import server_lines
from launch.preflight import check_gpus
from launch.rl_config import RLConfig, resolve_shared


def test_rl_lowers_max_steps_below_a_files_async_level_together_with_it(tmp_path):
    """Copied one at a time, ``--max-steps 5`` would meet the file's async_level = 10 before ``--async-level 1``."""
    orch = tmp_path / "orch.toml"
    orch.write_text("max_steps = 100\nasync_level = 10\n")
    config = resolve_shared(parse_config(RLConfig, ["--orchestrator", "@", str(orch), "--max-steps", "5",
                                                    "--async-level", "1"]))  # fmt: skip
    assert (config.orchestrator.max_steps, config.orchestrator.async_level) == (5, 1)


def test_a_gpu_id_beyond_the_machines_gpus_is_named(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_memory_gib", lambda: [80.0, 80.0])
    config = resolve_shared(parse_config(RLConfig, [*FILES, "--inference-gpu-ids", "0,2", "--trainer-gpu-ids", "1"]))
    with pytest.raises(TridentError, match=r"^--inference-gpu-ids \[0, 2\]: this machine has GPUs 0..1; name those$"):
        check_gpus(config, on_gpu=True)
    config = resolve_shared(parse_config(RLConfig, [*FILES, "--inference-gpu-ids", "1", "--trainer-gpu-ids", "5"]))
    with pytest.raises(TridentError, match=r"^--trainer-gpu-ids \[5\]: this machine has GPUs 0..1; name those$"):
        check_gpus(config, on_gpu=True)


def test_the_dry_run_and_the_start_log_say_which_servers_the_run_uses_and_whether_it_resets_them():
    """rl without --inference starts no server: the run uses the one at client.base_url, which it resets only when
    told (--orchestrator.reset); with --inference, the server rl starts."""
    config = resolve_shared(parse_config(RLConfig, FILES))
    assert server_lines(config) == ["inference servers the run uses:", "  http://127.0.0.1:8000: started by rl"]
    external = FILES[:-3] + ["--orchestrator.client.base-url", "http://gpu-box:8000"]
    (_, line) = server_lines(resolve_shared(parse_config(RLConfig, external)))
    assert line.startswith("  http://gpu-box:8000: external (rl does not start it); the run refuses it if it serves")
    (_, line) = server_lines(resolve_shared(parse_config(RLConfig, [*external, "--orchestrator.reset"])))
    assert (
        line
        == "  http://gpu-box:8000: external (rl does not start it); --orchestrator.reset: the run resets its weights"
    )
