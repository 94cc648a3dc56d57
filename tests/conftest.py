import asyncio
import importlib
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from contracts.model_path import TINY_MODEL_ID, resolve_model_path


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The tiny test model's folder (built on first use, then cached)."""
    return resolve_model_path(TINY_MODEL_ID)


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """Call it for a TCP port nobody listens on right now; ``pick(count)``: the first of ``count`` consecutive ones
    (``rl`` puts its servers on consecutive ports)."""

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    def pick(count: int = 1) -> int:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if all(free(port + i) for i in range(1, count)):
                return port

    return pick


@pytest.fixture(autouse=True)
def fresh_renderers_lock():
    """A new ``renderers.client._max_prompt_len_lock`` for each test. renderers keeps one module-level
    ``asyncio.Lock``, which binds to the first event loop that waits on it: a process runs one loop (the
    orchestrator) but a test session runs many (``asyncio.run`` per test), and the next test whose rollouts wait
    on the lock would fail with "bound to a different event loop". (Where renderers is not installed, as on a GPU
    machine that runs the gpu-marked tests, there is no lock.)"""
    client = sys.modules.get("renderers.client")
    if client is not None:
        client._max_prompt_len_lock = asyncio.Lock()


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` on a machine without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def benchmarks(monkeypatch):
    """Import a benchmark script by name (they import their shared helpers as ``common``)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    return importlib.import_module


@contextmanager
def _saved_for_backward(model) -> Iterator[dict[int, int]]:
    """Within the block, the bytes of each storage autograd keeps for the backward pass, by storage (the model's
    parameters left out; tensors saved inside checkpointed regions are not kept, so not seen)."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


@pytest.fixture
def saved_for_backward():
    """``with saved_for_backward(model) as saved:`` a forward pass; then ``sum(saved.values())`` is the bytes of
    activations it keeps for the backward pass."""
    return _saved_for_backward
