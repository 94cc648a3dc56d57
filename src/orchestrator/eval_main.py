"""``uv run eval @ eval.toml``: score a model, or a run's weights, on held-out tasks.

The server at ``client.base_url`` serves the model (``uv run inference @ infer.toml`` with its ``[model] name`` a
folder or a hub id). ``weights`` loads a run's ``weights/step_N`` into it first, full weights or a LoRA adapter,
probe-checked as a run's reloads are; without it the server's own model is scored (it is reset to it). The
``[eval]`` section is the orchestrator's, so a run's can be copied as it is; the scores are logged and written
to ``output_dir/metrics/eval.jsonl``.
"""

import asyncio
from pathlib import Path

from orchestrator.config import EvalRunConfig
from orchestrator.orchestrator import Orchestrator
from rl.config import run_cli
from rl.errors import TridentError, exit_on_user_error
from rl.metrics import setup_logging
from rl.protocol import is_stable, step_of


def weights_step(folder: Path) -> int:
    """The trainer step of a run's ``weights/step_N`` folder, checked to be complete."""
    step = step_of(folder)
    if not folder.is_dir() or step is None:
        raise TridentError(f"weights = {str(folder)!r}: not a run's weights/step_N folder")
    if not is_stable(folder):
        raise TridentError(f"weights = {str(folder)!r}: incomplete (no STABLE marker; the trainer is still writing)")
    return step


async def evaluate(config: EvalRunConfig) -> dict:
    """Serve the model or weights to score, evaluate them once, and return the scores' record."""
    step = weights_step(config.weights) if config.weights is not None else 0
    orchestrator = Orchestrator(config.orchestrator_config())
    servers = orchestrator.servers
    try:
        await servers.wait_ready(config.client.server_timeout_s)
        await servers.reset_weights()
        if config.weights is not None:
            await servers.reload_weights(config.weights, step, config.client.probe_tolerance)
            orchestrator.served_step = step
        return await orchestrator.evaluate(step)
    finally:
        await servers.close()
        orchestrator.metrics.close()


def main() -> None:
    config = run_cli(EvalRunConfig)
    setup_logging("eval", config.log.level)
    with exit_on_user_error("eval"):
        asyncio.run(evaluate(config))


if __name__ == "__main__":
    main()
