"""``uv run inference @ infer.toml``: serve the model with vLLM plus Trident's reload routes."""

import os

from inference.config import InferenceConfig
from inference.security import api_key_for
from inference.server import serve
from rl.config import run_cli
from rl.errors import exit_on_user_error
from rl.lifeline import watch_launcher
from rl.metrics import setup_logging


def main() -> None:
    config = run_cli(InferenceConfig)
    watch_launcher()
    setup_logging("inference", config.log.level)
    with exit_on_user_error("inference"):
        api_key = api_key_for(config.host)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", config.log.level.upper())  # read when vLLM is imported
    serve(config, api_key)


if __name__ == "__main__":
    main()
