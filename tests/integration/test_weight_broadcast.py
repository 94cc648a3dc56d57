"""In-memory weights (``[weight_broadcast]``): trainer and orchestrator against the session's server; the server
gets every step's full weights over the trainer's process group (gloo on CPU) or from a shared buffer in /dev/shm
(``backend = "shared"``, as ``rl`` picks for a trainer and a server on one device), or with ``[weights] delta`` each
step's deltas over gloo, never from files, and serves exactly them (the probe; with deltas the checksum too). A
server of its own killed after deltas and started again gets full weights and serves them exactly."""

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from servers import launch, stop, wait_healthy
from transformers import AutoModelForCausalLM, AutoTokenizer
from weight_tensors import LR, train_step

from contracts.metrics import read_metrics
from contracts.run_dir import read_probe
from contracts.weight_manifest import read_manifest
from orchestrator.serving.client import InferenceClient
from trainer.export import save_weights
from trainer.transports import memory_sender

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
DEBUG = ROOT / "configs" / "debug" / "rl"
STEPS = 3


@pytest.mark.parametrize(("backend", "delta"), [("gloo", "off"), ("shared", "off"), ("gloo", "on")])
def test_every_step_reaches_the_server_in_memory(tmp_path, inference_server, broadcast_port, backend, delta):
    steps = STEPS + (delta == "on")  # with deltas: a full copy, then two deltas
    shared = ["--output-dir", str(tmp_path), "--max-steps", str(steps)]
    trainer = [sys.executable, "-m", "trainer.main", "@", str(DEBUG / "train.toml"), *shared,
               "--weight-broadcast.port", str(broadcast_port), "--weight-broadcast.backend", backend,
               "--weights.delta", delta]  # fmt: skip
    orchestrator = [sys.executable, "-m", "orchestrator.main", "@", str(DEBUG / "orch.toml"), *shared,
                    "--client.base-url", inference_server, "--async-level", "0", "--no-eval",
                    "--batch-size", "2", "--rollouts-per-example", "4"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for argv in (trainer, orchestrator)]  # fmt: skip
    outputs = []
    for process in processes:
        output, _ = process.communicate(timeout=900)
        outputs.append(output)
        assert process.returncode == 0, output[-3000:]

    # on-policy: batches 1 and 2 were sampled from weights 1 and 2, each received over the broadcast
    orchestrator_records = read_metrics(tmp_path, "orchestrator")
    assert [r["weight_step"] for r in orchestrator_records] == list(range(steps))
    assert all(r["probe_gap"] < 1e-3 for r in orchestrator_records[1:])  # the server serves the trainer's weights
    served = [int(step) for step in re.findall(r"server now serves weights step (\d+)", outputs[1])]
    assert served == list(range(1, steps))
    how = re.findall(r"weights \d+ to a server as (deltas|full weights)", outputs[0])
    sent = ["full weights", "deltas", "deltas"] if delta == "on" else ["full weights", "full weights"]
    assert how == (sent if backend == "gloo" else [])  # a shared buffer is mapped, not sent
    # what the server received had no weight files: a manifest (with deltas, with the checksum the orchestrator
    # compared the server's with after each reload); the last weights, which no one samples from, are the run's
    # model on disk. The orchestrator has deleted the folders of weights before the last two.
    for step in served[-2:]:
        folder = tmp_path / "weights" / f"step_{step}"
        manifest = read_manifest(folder)
        assert manifest["backend"] == backend and not list(folder.glob("*.safetensors"))
        assert ("checksum" in manifest) == (delta == "on")
    assert list((tmp_path / "weights" / f"step_{steps}").glob("*.safetensors"))
    if backend == "shared":  # the buffer's file went once the server had mapped it
        assert not Path(read_manifest(folder)["buffer"]["path"]).exists()


def test_a_server_killed_after_deltas_catches_up_from_full_weights(tmp_path, tiny_model_path, free_port, caplog):
    """A server of its own (two starts of the tiny model, about a minute of CPU each) takes weights 1 in full and 2
    and 3 as deltas, is killed (SIGKILL) and started again: it gets weights 3 in full, with the trainer's checksum
    and the same logprobs as before it died, and weights 4 as a delta again."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    store, port = free_port(), free_port()
    sender = memory_sender("127.0.0.1", store, 120, "gloo", torch.device("cpu"), delta="on", full_every=10)

    def export(step: int) -> None:
        train_step(model, optimizer, seed=step)
        save_weights(model, tokenizer, tmp_path / f"step_{step}", "merged", sender, torch.float32)

    def start(folder: str):
        (tmp_path / folder).mkdir()
        server = launch(tmp_path / folder, "trident/tiny-qwen3", port, tmp_path, store, lora=False)
        return server, wait_healthy(server)

    async def load(url: str, step: int) -> list[float]:
        """Reload ``step`` (the client compares the server's checksum), check its probe; the probe's logprobs."""
        client = InferenceClient(url, timeout_s=120, model="trident/tiny-qwen3")
        try:
            await client.reload_weights(tmp_path / f"step_{step}", step)
            assert await client.check_probe(tmp_path / f"step_{step}", step, tolerance=1e-4) < 1e-4
            return await client.prompt_logprobs(read_probe(tmp_path / f"step_{step}").token_ids)
        finally:
            await client.close()

    server, url = start("first")
    try:
        with caplog.at_level(logging.INFO, logger="trainer"):
            for step in (1, 2, 3):
                export(step)
                before = asyncio.run(load(url, step))
            os.killpg(server.process.pid, signal.SIGKILL)  # mid-run: the trainer holds weights 3
            server.process.wait()
            server, url = start("restarted")
            assert asyncio.run(load(url, 3)) == before  # the same weights, served exactly
            export(4)
            asyncio.run(load(url, 4))
    finally:
        stop(server)
        sender.close()
    how = [r.getMessage().split(" as ")[1].split(" (")[0] for r in caplog.records if " to a server as " in r.message]
    assert how == ["full weights", "deltas", "deltas", "full weights", "deltas"]
