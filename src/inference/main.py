"""``uv run inference @ infer.toml``: serve the model with vLLM plus Trident's reload routes."""

import os

from inference.config import InferenceConfig
from inference.server import serve
from rl.config import run_cli
from rl.metrics import setup_logging


def main() -> None:
    config = run_cli(InferenceConfig)
    setup_logging("inference", config.log.level)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", config.log.level.upper())  # read when vLLM is imported
    serve(config)


if __name__ == "__main__":
    main()
