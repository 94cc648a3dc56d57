"""``uv run eval @ eval.toml``: score a model, or a run's weights, on held-out tasks.

The server at ``client.base_url`` serves the model (``uv run inference @ infer.toml`` with its ``[model] name`` a
folder or a hub id, and ``weights_root`` the run's ``weights`` folder to load ``weights``). eval changes what a
server serves only as it is told: ``weights`` (a run's ``weights/step_N``, full weights or a LoRA adapter,
probe-checked as a run's reloads are) is loaded into a server serving its own model (step 0, no adapter), and
``--reset`` first has the server serve its own model again; without either, what the server serves is scored. It
says which server and which weights it scores. The ``[eval]`` section is the orchestrator's, so a run's can be
copied as it is; the scores are logged and written to ``output_dir/metrics/eval.jsonl``.
"""

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from contracts.config import run_cli
from contracts.errors import TridentError, exit_on_user_error
from contracts.inference_api import Served
from contracts.metrics import MetricsWriter, setup_logging
from contracts.progress import Progress
from contracts.run_dir import is_stable, step_of
from orchestrator.config import EvalRunConfig, InfraConfig
from orchestrator.loop.gc_tuning import tune_gc

if TYPE_CHECKING:  # verifiers and torch: imported once the config is good
    from orchestrator.serving.servers import Servers

logger = logging.getLogger("orchestrator")


class EvalCliConfig(EvalRunConfig):
    reset: Annotated[
        bool,
        Field(description="Have the server serve the model it started with again before scoring (and loading "
                          "weights): never point it at a running run's server. Off: eval loads weights only into a "
                          "server serving its own model, and otherwise scores what it serves."),
    ] = False  # fmt: skip


def weights_step(folder: Path) -> int:
    """The trainer step of a run's ``weights/step_N`` folder, checked to be complete."""
    step = step_of(folder)
    if not folder.is_dir() or step is None:
        raise TridentError(f"weights = {str(folder)!r}: not a run's weights/step_N folder")
    if not is_stable(folder):
        raise TridentError(f"weights = {str(folder)!r}: incomplete (no STABLE marker; the trainer is still writing)")
    return step


def urls(servers: "Servers") -> str:
    return ", ".join(server.url for server in servers.servers)


async def served(servers: "Servers") -> Served:
    """What every server serves (requests name it from now on); a TridentError when they serve different weights."""
    answers = [await server.client.served() for server in servers.servers]
    for server, answer in zip(servers.servers, answers, strict=True):
        server.client.use(answer)
    if len({answer.model_dump_json() for answer in answers}) > 1:
        raise TridentError(f"the servers at {urls(servers)} serve different weights: pass --reset to score them alike")
    return answers[0]


async def serve_weights(servers: "Servers", config: EvalCliConfig) -> Served:
    """Make the servers serve what eval scores, changing what they serve only as ``config`` allows; what they
    serve then."""
    if config.reset:
        await servers.reset_weights()
    now = await served(servers)
    if config.weights is None:
        return now
    step = weights_step(config.weights)
    if (now.step, Path(now.path)) == (step, config.weights.resolve()):
        return now
    if (now.step, now.adapter) != (0, None):
        raise TridentError(
            f"weights = {str(config.weights)!r}: the server at {urls(servers)} serves weights step {now.step} from "
            f"{now.path} (a run's?); pass --reset to have eval replace them"
        )
    await servers.reload_weights(config.weights, step, config.client.probe_tolerance)
    return await served(servers)


async def evaluate(config: EvalCliConfig) -> dict:
    """Serve the model or weights to score, evaluate them once, and return the scores' record. Only the evaluation
    part runs: no training orchestrator, no batch, no weights but what ``config`` names."""
    from orchestrator.loop.evaluation import Evaluation
    from orchestrator.loop.groups import connect

    if config.weights is not None:
        weights_step(config.weights)  # before touching any server
    groups = connect(config, InfraConfig(), config.eval.rollouts_per_example)
    metrics = MetricsWriter(config.output_dir, "orchestrator")
    # no progress file: that is for rl's console, and a run's orchestrator writes its own
    evaluation = Evaluation(config.eval, config.model.name, groups, metrics, Progress(None, "eval"))
    servers = groups.servers
    try:
        await servers.wait_ready(config.client.server_timeout_s)
        scored = await serve_weights(servers, config)
        adapter = f", adapter {scored.adapter}" if scored.adapter else ""
        logger.info(f"eval: scoring weights step {scored.step} from {scored.path}{adapter} on {urls(servers)}")
        return await evaluation.evaluate(scored.step)
    finally:
        await groups.close()
        await servers.close()
        metrics.close()


def main() -> None:
    config = run_cli(EvalCliConfig, "eval")
    from orchestrator.verifiers_adapter.patches import install_patches

    setup_logging("eval", config.log.level)
    install_patches(config.datasets)
    with exit_on_user_error("eval"):
        tune_gc()
        asyncio.run(evaluate(config))


if __name__ == "__main__":
    main()
