"""Read a step's rollouts as conversations: decoded turns with roles, reward, rewards by function, advantage.

    uv run scripts/inspect_rollouts.py [--output-dir outputs] [--step N] [--sample I] [--model NAME] [--limit K]

Trained tokens are shown bold in their role's colour. Exit status 2 when the rollouts cannot be read.
"""

import argparse
import sys
from pathlib import Path

from rich.console import Console

from tools.rollout_check import RolloutReadError, choose_samples, open_step, segment
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
    try:
        rollouts, chat = open_step(args.output_dir, args.step, args.model)
        shown = choose_samples(len(rollouts.samples), args.sample, args.limit, list(range(len(rollouts.samples))))
    except RolloutReadError as e:
        print(f"inspect_rollouts: {e}", file=sys.stderr)
        return 2
    console = Console(highlight=False, markup=False)
    console.print(step_overview(rollouts), soft_wrap=True)
    for i in shown:
        record = rollouts.samples[i]
        console.print(
            conversation_view(
                record, segment(record.token_ids, chat, record.loss_mask), chat, console.color_system is None
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
