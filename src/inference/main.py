"""``uv run inference @ infer.toml``: serve the model with vLLM plus Trident's reload routes."""

import os

from contracts.errors import exit_on_user_error
from contracts.lifeline import watch_launcher
from contracts.metrics import setup_logging
from contracts.run_spec import load_config
from inference.config import InferenceConfig
from inference.security import api_key_for
from inference.server import serve


def main() -> None:
    config, _ = load_config(InferenceConfig, "inference")  # with the run spec rl wrote to its output dir, if any
    watch_launcher()
    setup_logging("inference", config.log.level)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", config.log.level.upper())  # read when vLLM is imported
    with exit_on_user_error("inference"):
        serve(config, api_key_for(config.host))


if __name__ == "__main__":
    main()
