"""``uv run trainer @ train.toml``: train on the orchestrator's batches and write weights for inference."""

import os

from rl.config import run_cli
from rl.errors import exit_on_user_error
from rl.metrics import setup_logging
from trainer.config import TrainerConfig
from trainer.train import train


def main() -> None:
    config = run_cli(TrainerConfig)
    rank = int(os.environ.get("RANK", 0))  # under torchrun, only rank 0 says more than warnings
    setup_logging("trainer" if rank == 0 else f"trainer[{rank}]", config.log.level if rank == 0 else "WARNING")
    with exit_on_user_error("trainer"):
        train(config)


if __name__ == "__main__":
    main()
