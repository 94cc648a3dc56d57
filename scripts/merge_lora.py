"""Merge a LoRA adapter into its base model, and optionally publish the result on the Hugging Face hub.

    uv run scripts/merge_lora.py --base-model NAME --adapter-path DIR --output-dir DIR
                                 [--push --repo-name NAME [--private] [--model-card FILE]]

The adapter is a folder the trainer wrote with ``[model.experimental.lora] export = "adapter"``
(``weights/step_N/``) or any peft adapter. Pushing needs a token (``HF_TOKEN`` or ``hf auth login``).
"""

import argparse
import sys
from pathlib import Path

from contracts.errors import TridentError
from trainer.merge import merge_adapter, push_to_hub


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", required=True, help="hub id or local folder of the base model")
    parser.add_argument("--adapter-path", type=Path, required=True, help="folder with adapter_config.json")
    parser.add_argument("--output-dir", type=Path, required=True, help="where to write the merged model")
    parser.add_argument("--push", action="store_true", help="upload the merged model to the hub")
    parser.add_argument("--repo-name", help="hub repo to push to, e.g. me/my-model (with --push)")
    parser.add_argument("--private", action="store_true", help="create the hub repo private")
    parser.add_argument("--model-card", type=Path, help="markdown file uploaded as the repo's README.md")
    args = parser.parse_args(argv)
    if args.push and not args.repo_name:
        parser.error("--push needs --repo-name")
    if args.model_card is not None and not args.model_card.is_file():
        parser.error(f"--model-card {args.model_card}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        folder = merge_adapter(args.base_model, args.adapter_path, args.output_dir)
        print(f"merged model written to {folder}")
        if args.push:
            print(f"pushed to {push_to_hub(folder, args.repo_name, args.private, args.model_card)}")
    except TridentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
