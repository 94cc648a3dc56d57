"""Weights one training step on, and what a server serves that left part of them behind: the stale reloads the
probe must catch (tests/unit/trainer/test_probe_tolerance.py, tests/integration/test_inference.py)."""

import copy

import torch
from transformers import AutoModelForCausalLM

DEBUG_LR = 3e-3  # configs/debug/rl/train.toml's: a debug run's step


def trained_one_step(path: str, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model after one AdamW step at the debug run's lr on random tokens, and its parameters before it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (4, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=DEBUG_LR).step()
    return model, before


def left_behind(model: torch.nn.Module, before: dict[str, torch.Tensor], layer: int, expert: int | None = None):
    """What a server serves that reloaded ``model`` except decoder layer ``layer`` (or only its expert ``expert``),
    which it kept at ``before``."""
    stale = copy.deepcopy(model)
    prefix = f"model.layers.{layer}." + ("mlp.experts." if expert is not None else "")
    with torch.no_grad():
        for name, parameter in stale.named_parameters():
            if name.startswith(prefix):
                if expert is None:
                    parameter.copy_(before[name])
                else:
                    parameter[expert].copy_(before[name][expert])
    return stale
