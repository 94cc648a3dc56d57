"""``uv run sft @ sft.toml``: supervised fine-tuning on chat transcripts (:mod:`trainer.sft`)."""

from contracts.config import run_cli
from contracts.errors import exit_on_user_error
from trainer.config import SFTConfig


def main() -> None:
    config = run_cli(SFTConfig, "sft")
    from trainer.parallel import setup_rank_logging  # torch and transformers: imported once the config is good
    from trainer.sft import train_sft

    setup_rank_logging("sft", config.log.level)
    with exit_on_user_error("sft"):
        train_sft(config)


if __name__ == "__main__":
    main()
