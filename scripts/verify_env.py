"""Run a few rollouts of an environment against a running inference server and show their rewards.

    uv run scripts/verify_env.py <env-id> [--args JSON] [--base-url http://127.0.0.1:8000] [--model NAME]
        [-n ROLLOUTS] [--max-tokens N]

Loads the environment as the orchestrator does, runs ``-n`` rollouts of one task, prints each rollout's reward
(and score per reward function) and checks the loss masks of its samples (see :mod:`tools.rollout_check`).
Exit status: 0 when every rollout finished with clean masks, 1 otherwise or on a user error.
"""

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from contracts.chat_turns import ChatFormat
from contracts.errors import TridentError, exit_on_user_error
from contracts.metrics import setup_logging
from contracts.model_path import TINY_MODEL_ID
from tools.rollout_check import SampleRecord, check_sample
from tools.rollout_view import conversation_view
from tools.tiny_model import built_model_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("env_id", help="installed environment id, e.g. reverse-text")
    parser.add_argument("--args", default="{}", help="the environment's args as a JSON object")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the inference server's root URL")
    parser.add_argument("--model", default=TINY_MODEL_ID, help="the model the server serves (its tokenizer too)")
    parser.add_argument("-n", type=int, default=4, help="rollouts to run (one advantage group)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens sampled in one turn")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--task", type=int, default=0, help="which task of the environment (its index)")
    parser.add_argument("--show", action="store_true", help="print each rollout's conversation")
    parser.add_argument("--server-timeout", type=float, default=10.0, help="seconds to wait for the server")
    return parser.parse_args(argv)


def env_args(raw: str) -> dict:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TridentError(f"--args is not valid JSON ({e}): {raw!r}") from None
    if not isinstance(value, dict):
        raise TridentError(f"--args must be a JSON object, got {raw!r}")
    return value


async def run_rollouts(args: argparse.Namespace, env_arguments: dict) -> list:
    # Imported here: verifiers is slow to import, and argument errors should not wait for it.
    from orchestrator.config import EnvConfig, OrchestratorConfig
    from orchestrator.serving.client import InferenceClient
    from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
    from orchestrator.verifiers_adapter.limits import RolloutLimits
    from orchestrator.verifiers_adapter.patches import install_patches

    install_patches()
    env_config = EnvConfig(id=args.env_id, args=env_arguments)
    env = load_env(env_config)
    tasks = list(env.taskset.load())
    if not tasks:
        raise TridentError(f"environment {args.env_id!r} has no tasks with args {args.args}")
    task = tasks[args.task % len(tasks)]
    try:
        config = OrchestratorConfig(
            model={"name": args.model},
            client={"base_url": args.base_url},
            sampling={"temperature": args.temperature, "max_tokens": args.max_tokens},
            env=[env_config],
        )
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise TridentError(f"invalid settings: {problems}") from None
    client = InferenceClient(args.base_url, timeout_s=30.0)
    try:
        await client.wait_ready(args.server_timeout)
    finally:
        await client.close()
    ctx = model_context(config, built_model_path(args.model))
    async with env.serving():
        with tempfile.TemporaryDirectory() as images:  # the images the rollouts show: only their refs are shown
            return await run_group(env, task, args.n, ctx, RolloutLimits.of(args.n), Path(images))


def report(rollouts: list, chat: ChatFormat, show: bool) -> bool:
    """Print one row per rollout (and its conversations with ``show``); True when all are fine."""
    console = Console(highlight=False, markup=False)
    functions = sorted({name for r in rollouts for name in getattr(r, "rewards", {})})
    table = Table(title=f"{len(rollouts)} rollouts", title_justify="left")
    for column in ["rollout", "reward", *functions, "turns", "samples", "trained", "truncated", "mask", "status"]:
        table.add_column(column)
    all_fine = True
    for i, rollout in enumerate(rollouts):
        summary = {"reward": rollout.reward, "rewards": getattr(rollout, "rewards", {}), "truncated": rollout.truncated}
        records = [SampleRecord.from_tokens(j, b.token_ids, b.loss_mask, b.logprobs, summary, b.images)
                   for j, b in enumerate(rollout.branches)]  # fmt: skip
        reports = [check_sample(record, chat) for record in records]
        errors = [f"{p.check}" for r in reports for p in r.errors]
        all_fine &= rollout.ok and not errors
        scores = getattr(rollout, "rewards", {})
        table.add_row(
            str(i),
            f"{rollout.reward:.4g}",
            *(f"{scores[name]:.4g}" if name in scores else "-" for name in functions),
            str(getattr(rollout, "turns", "-")),
            str(len(records)),
            str(sum(r.num_trainable for r in records)),
            "yes" if rollout.truncated else "no",
            ", ".join(sorted(set(errors))) or "ok",
            "ok" if rollout.ok else f"failed: {rollout.error}",
        )
        if show:
            for record, sample_report in zip(records, reports, strict=True):
                console.print(f"rollout {i}, sample {record.index}")
                console.print(conversation_view(record, sample_report.segmentation, chat, console.color_system is None))
    console.print(table)
    return all_fine


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("verify_env")
    logging.getLogger("orchestrator").setLevel(logging.WARNING)
    with exit_on_user_error("verify_env"):
        if args.n < 1 or args.max_tokens < 1:
            raise TridentError(f"-n and --max-tokens must be at least 1, got {args.n} and {args.max_tokens}")
        rollouts = asyncio.run(run_rollouts(args, env_args(args.args)))
        from transformers import AutoTokenizer

        chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(built_model_path(args.model)))
        all_fine = report(rollouts, chat, args.show)
    return 0 if all_fine else 1


if __name__ == "__main__":
    sys.exit(main())
