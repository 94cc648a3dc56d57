"""The debug run's config files (configs/debug/rl), as ``rl`` takes them on its command line."""

from pathlib import Path

DEBUG = Path(__file__).parents[1] / "configs" / "debug" / "rl"
FILES = ["--trainer", "@", str(DEBUG / "train.toml"), "--orchestrator", "@", str(DEBUG / "orch.toml"),
         "--inference", "@", str(DEBUG / "infer.toml")]  # fmt: skip
