"""``uv run inference @ infer.toml``: serve the model with vLLM plus Trident's reload routes."""

from inference.config import InferenceConfig
from inference.server import serve
from rl.config import run_cli
from rl.metrics import setup_logging


def main() -> None:
    config = run_cli(InferenceConfig)
    setup_logging("inference")
    serve(config)


if __name__ == "__main__":
    main()
