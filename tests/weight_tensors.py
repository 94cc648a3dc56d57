"""Three tensors named, shaped and typed as a model's (float32 and bfloat16), for the weight handover tests."""

import torch

TENSORS = {
    "model.embed_tokens.weight": torch.randn(5, 3),
    "model.layers.0.mlp.up_proj.weight": torch.randn(4, 3, dtype=torch.bfloat16),
    "model.norm.weight": torch.ones(3),
}
