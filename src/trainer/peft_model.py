"""Telling a peft (LoRA) model from a plain one without importing peft: only a run that trains a LoRA adapter, or
merges one, imports it (about 2.4 s of CPU at every trainer start otherwise, with the bitsandbytes it pulls in)."""

import sys

from torch import nn


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (``peft.PeftModel``): none can exist before peft is imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)
