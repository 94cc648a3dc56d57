"""``rl``: one run (:mod:`launch.launcher`), or with ``--sweep`` several runs sharing one server
(:mod:`launch.sweep`)."""

import sys

from contracts.config import HELP_FLAGS
from contracts.lifeline import watch_launcher
from launch.launcher import launch
from launch.supervise import ignore_stop_signals
from launch.sweep import is_sweep, launch_sweep


def main(argv: list[str] | None = None) -> None:
    """``uv run rl ...``: hand ``argv`` (default ``sys.argv``) to a run or a sweep and exit with its code, ignoring
    stop signals from then on (:func:`launch.supervise.ignore_stop_signals`)."""
    argv = sys.argv[1:] if argv is None else argv
    watch_launcher()  # a run of a sweep stops when the sweep is gone
    sweep = is_sweep(argv) and not any(arg in HELP_FLAGS for arg in argv)
    try:
        code = (launch_sweep if sweep else launch)(argv)
    finally:
        ignore_stop_signals()
    sys.exit(code)


if __name__ == "__main__":
    main()
