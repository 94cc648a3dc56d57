"""``uv run orchestrator @ orch.toml``: run environments against the server and write training batches."""

import asyncio

from contracts.errors import exit_on_user_error
from contracts.lifeline import stop_descendants_on_exit, watch_launcher
from contracts.metrics import setup_logging
from contracts.run_spec import load_config
from orchestrator.config import OrchestratorConfig
from orchestrator.loop.gc_tuning import tune_gc


def main() -> None:
    config, _ = load_config(OrchestratorConfig, "orchestrator")  # with the run spec rl wrote to its output dir, if any
    from orchestrator.loop.run import Orchestrator  # verifiers and torch: imported once the config is good
    from orchestrator.verifiers_adapter.patches import install_patches

    watch_launcher()
    stop_descendants_on_exit()  # verifiers' tool servers and harness programs run in sessions of their own
    setup_logging("orchestrator", config.log.level)
    install_patches(config.datasets)
    with exit_on_user_error("orchestrator"):
        orchestrator = Orchestrator(config)
        tune_gc()
        asyncio.run(orchestrator.run())


if __name__ == "__main__":
    main()
