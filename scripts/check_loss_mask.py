"""Check a step's rollouts: loss masks on sampled tokens only, consistent lengths, logprobs where trained.

    uv run scripts/check_loss_mask.py [--output-dir outputs] [--step N] [--json] [--model NAME] [--limit K]

Shows the flagged samples' tokens coloured by role and mask (``--all`` or ``--sample I`` for others) and ends
with a one-line summary. Exit status: 0 clean (warnings allowed), 1 problems found, 2 rollouts unreadable.
The checks are listed in :mod:`tools.rollout_check`.
"""

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from tools.rollout_check import RolloutReadError, check_step, choose_samples, open_step
from tools.rollout_view import batch_problem_lines, legend, mask_view, report_json, summary_line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path("outputs"), help="the run's output_dir")
    parser.add_argument("--step", type=int, help="trainer step to check (default: the newest on disk)")
    parser.add_argument("--model", help="tokenizer to decode with (default: [model] name of the run's config)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")
    parser.add_argument("--limit", type=int, help="show (or list in JSON) at most K samples")
    parser.add_argument("--sample", type=int, action="append", help="show sample I (repeatable)")
    parser.add_argument("--all", action="store_true", help="show every sample, not only flagged ones")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rollouts, chat = open_step(args.output_dir, args.step, args.model)
        report = check_step(rollouts, chat)
        flagged = [s.record.index for s in report.samples if s.problems]
        default = list(range(len(report.samples))) if args.all or args.json else flagged
        shown = choose_samples(len(report.samples), args.sample, args.limit, default)
    except RolloutReadError as e:
        print(f"check_loss_mask: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report_json(report, shown), indent=1, allow_nan=False))
        return 0 if report.ok else 1
    console = Console(highlight=False, markup=False)
    brackets = console.color_system is None
    if shown:
        console.print(legend(brackets))
    if report.problems:
        console.print(batch_problem_lines(report))
    for i in shown:
        console.print(mask_view(report.samples[i], chat, brackets))
    hidden = len(flagged) - len(set(flagged) & set(shown))
    if hidden:
        console.print(f"({hidden} more flagged samples not shown: raise --limit or pick --sample I)")
    console.print(summary_line(report), style="green" if report.ok else "bold red", soft_wrap=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
