"""Read a step's rollouts as conversations: decoded turns with roles, reward, rewards by function, advantage.

    uv run scripts/inspect_rollouts.py [--output-dir outputs] [--step N] [--sample I] [--model NAME] [--limit K]

Trained tokens are shown bold in their role's colour. The step's failed rollouts follow (and those of the evaluation
of weights step N, apart), counted by cause, each cause with its first full error and traceback
(``metrics/failed_rollouts.jsonl``); a step that wrote no batch (every rollout failed, and the run stopped) shows those
alone. The default step is the newest with either. Exit status 2 when
there is neither.
"""

import argparse
import sys
from pathlib import Path

from rich.console import Console

from contracts.chat_turns import segment
from tools.failures import failures_view, read_failures
from tools.rollout_check import RolloutReadError, choose_samples, open_step, rollout_steps
from tools.rollout_view import conversation_view, step_overview


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path("outputs"), help="the run's output_dir")
    parser.add_argument("--step", type=int, help="trainer step to read (default: the newest on disk)")
    parser.add_argument("--sample", type=int, action="append", help="show sample I (repeatable; default: all)")
    parser.add_argument("--model", help="tokenizer to decode with (default: [model] name of the run's config)")
    parser.add_argument("--limit", type=int, help="show at most K samples")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(highlight=False, markup=False)
    failures = [r for r in read_failures(args.output_dir) if isinstance(r.get("step"), int)]
    step = args.step
    if step is None:
        step = max([*rollout_steps(args.output_dir), *(r["step"] for r in failures)], default=None)
    failed = [r for r in failures if r["step"] == step]
    try:
        rollouts, chat = open_step(args.output_dir, step, args.model)
    except RolloutReadError as e:
        if failed:  # the step wrote no batch: its failures are what there is
            console.print(f"step {step}: no batch to show ({e})", soft_wrap=True)
            console.print(failures_view(failed), soft_wrap=True)
            return 0
        return refused(e)
    try:
        shown = choose_samples(len(rollouts.samples), args.sample, args.limit, list(range(len(rollouts.samples))))
    except RolloutReadError as e:
        return refused(e)
    console.print(step_overview(rollouts), soft_wrap=True)
    if failed:
        console.print(failures_view(failed), soft_wrap=True)
    for i in shown:
        record = rollouts.samples[i]
        console.print(
            conversation_view(
                record, segment(record.token_ids, chat, record.loss_mask), chat, console.color_system is None
            )
        )
    return 0


def refused(error: RolloutReadError) -> int:
    print(f"inspect_rollouts: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
