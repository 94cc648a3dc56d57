"""Turning a trained LoRA adapter into a standalone model, and publishing it (``scripts/merge_lora.py``)."""

import shutil
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoTokenizer

from contracts.atomic_io import atomic_dir
from contracts.errors import TridentError
from contracts.model_card import ModelCard
from contracts.run_dir import ADAPTER_CONFIG, is_adapter
from trainer.export import full_weights
from trainer.model import pretrained
from trainer.vision import save_processor


def merge_adapter(base_model: str, adapter_path: Path, output_dir: Path) -> Path:
    """Write ``base_model`` with the adapter merged in (HF format, with tokenizer) to ``output_dir``, atomically.

    The merged model gives the same logits as the base model with the adapter applied, in float32: the same
    merge as the trainer's merged exports (``trainer.export.full_weights``).
    """
    if not is_adapter(adapter_path):
        raise TridentError(f"--adapter-path {adapter_path}: no {ADAPTER_CONFIG} there (not a peft adapter folder)")
    base_card = ModelCard.of(base_model)
    base = pretrained(base_card, dtype=torch.float32)
    owner, weights = full_weights(PeftModel.from_pretrained(base, adapter_path), torch.float32)
    with atomic_dir(Path(output_dir)) as tmp:
        owner.save_pretrained(tmp, state_dict=weights)
        AutoTokenizer.from_pretrained(base_card.path).save_pretrained(tmp)
        save_processor(owner, tmp)
    return Path(output_dir)


def push_to_hub(folder: Path, repo_name: str, private: bool, model_card: Path | None) -> str:
    """Upload ``folder`` (with ``model_card`` as its README.md) to the hub repo ``repo_name``; returns its URL."""
    from huggingface_hub import HfApi  # imported only to publish

    if model_card is not None:
        shutil.copyfile(model_card, Path(folder) / "README.md")
    api = HfApi()
    url = api.create_repo(repo_name, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_name, commit_message="Upload model merged by Trident")
    return str(url)
