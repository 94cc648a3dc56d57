"""``uv run inference @ infer.toml``: serve the model with vLLM plus Trident's reload routes."""

import os

from contracts.errors import exit_on_user_error
from contracts.lifeline import watch_launcher
from contracts.metrics import setup_logging
from contracts.run_spec import load_config
from inference.config import InferenceConfig
from inference.security import api_key_for


def main() -> None:
    config, _ = load_config(InferenceConfig, "inference")  # with the run spec rl wrote to its output dir, if any
    from inference.server import serve, vllm_argv  # torch: imported once the config is good

    watch_launcher()
    setup_logging("inference", config.log.level)
    with exit_on_user_error("inference"):
        api_key = api_key_for(config.host)
        vllm_argv(config)  # a setting the server cannot serve stops it here, in one line
    os.environ.setdefault("VLLM_LOGGING_LEVEL", config.log.level.upper())  # read when vLLM is imported
    serve(config, api_key)


if __name__ == "__main__":
    main()
