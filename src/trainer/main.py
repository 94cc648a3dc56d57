"""``uv run trainer @ train.toml``: train on the orchestrator's batches and write weights for inference."""

from contracts.errors import exit_on_user_error
from contracts.lifeline import watch_launcher
from contracts.run_spec import load_config
from trainer.config import TrainerConfig


def main() -> None:
    config, _ = load_config(TrainerConfig, "trainer")  # with the run spec rl wrote to its output dir, if any
    from trainer.parallel import setup_rank_logging  # torch and transformers: imported once the config is good
    from trainer.train import train

    watch_launcher()
    setup_rank_logging("trainer", config.log.level)
    with exit_on_user_error("trainer"):
        train(config)


if __name__ == "__main__":
    main()
