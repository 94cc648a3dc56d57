"""What ``rl`` checks, claims and builds before it starts anything: the output dir, the server's port, the GPUs, the
tiny models its processes load."""

import fcntl
import importlib.machinery
import importlib.util
import json
import logging
import os
import socket
from pathlib import Path
from typing import IO

from dataset_rows import TASKSET_DATASET_KEYS, DatasetError, check_found

from contracts.errors import TridentError
from contracts.inference_api import is_loopback
from contracts.model_card import ModelCard
from inference.plan import adapters_refused
from launch.memory_plan import MemoryPlan, plan_memory
from launch.rl_config import TEACHER, RLConfig, process_configs, servers, started_servers, teacher_server, trainer_ranks
from tools.tiny_model import built_model_path
from trainer.rules import check_lora_targets as trainer_lora_targets

logger = logging.getLogger("rl")
BUILT_IN_ENVS = Path(__file__).parents[2] / "environments"  # Trident's own, in its checkout


def check_envs_installed(config: RLConfig) -> None:
    """Every ``[[env]] id`` names an installed package (verifiers imports ``gsm8k-calc`` as ``gsm8k_calc``); one
    that another package shadows is named (:func:`warn_if_shadowed`)."""
    for i, env in enumerate(config.orchestrator.env):
        module = env.id.split("/")[-1].split("@")[0].replace("-", "_").lower()
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise TridentError(
                f"orchestrator.env.{i}.id: environment {env.id!r} is not installed (no module {module!r}); "
                "see docs/environments.md for the ones that ship and how to add one"
            )
        warn_if_shadowed(f"orchestrator.env.{i}.id", env.id, spec)


def warn_if_shadowed(where: str, env_id: str, spec: importlib.machinery.ModuleSpec) -> None:
    """One warning, naming both places, where the module ``env_id`` loads (``spec``) is not Trident's own environment
    of that name in ``environments/`` but an installed package with the same module name. Not refused: installing,
    say, verifiers' own reverse-text example is how to run it unchanged."""
    built_in = (BUILT_IN_ENVS / spec.name / spec.name).resolve()
    loaded = Path(next(iter(spec.submodule_search_locations or []), None) or spec.origin).resolve()  # folder or file
    if built_in.is_dir() and loaded != built_in:
        logger.warning(
            f"{where}: environment {env_id!r} loads module {spec.name!r} from {loaded}, not Trident's built-in "
            f"{built_in}: an installed package of that name shadows it (uninstall it to run the built-in)"
        )


def check_env_datasets(config: RLConfig) -> None:
    """Every environment's ``dataset`` (or ``dataset_path``) arg, the workspace tasksets' dataset, that names a local
    file or folder names one that exists (:func:`dataset_rows.check_found`); reading it, and any hub id, is left to
    the orchestrator, which loads the environments."""
    evaluated = config.orchestrator.eval.env if config.orchestrator.eval else []
    tables = [(f"orchestrator.env.{i}", env) for i, env in enumerate(config.orchestrator.env)]
    tables += [(f"orchestrator.eval.env.{i}", env) for i, env in enumerate(evaluated)]
    for where, env in tables:
        for key in TASKSET_DATASET_KEYS:
            value = env.args.get(key)
            path = value.get("path") if isinstance(value, dict) else value
            if not isinstance(path, str):
                continue
            try:
                check_found(path)
            except DatasetError as e:
                raise TridentError(f"{where}.args.{key}: environment {env.id!r}: {e}") from None


def build_tiny_models(config: RLConfig) -> None:
    """Build the tiny models the processes will load that are not built yet (:mod:`tools.tiny_model`): a process
    started on one that is not would stop at once. A run and a sweep call it before anything reads a model's card."""
    for sub in [*process_configs(config).values(), *started_servers(config).values()]:
        built_model_path(sub.model.name)


def check_model(name: str) -> None:
    """A local model folder exists and its tokenizer has a chat template (rollouts are chats); a hub id is left
    to the processes to download."""
    looks_local = name.startswith((".", "/", "~")) or Path(name).expanduser().exists()
    if not looks_local:
        return
    card = ModelCard.of(name)
    if card.model_type is None:
        raise TridentError(f"model.name = {name!r}: no model there (expected a folder with config.json)")
    folder = Path(card.folder).expanduser()
    tokenizer_config = folder / "tokenizer_config.json"
    has_template = (folder / "chat_template.jinja").is_file() or (
        tokenizer_config.is_file() and "chat_template" in json.loads(tokenizer_config.read_text())
    )
    if not has_template:
        raise TridentError(
            f"model.name = {name!r}: its tokenizer has no chat template; RL rollouts are chats, so use a chat "
            "(instruct) model or add a chat_template to its tokenizer_config.json"
        )


def check_lora_targets(config: RLConfig) -> None:
    """Refuse a LoRA target module that names no linear layer of the model, where rl knows them: the trainer's own
    refusal (:func:`trainer.rules.check_lora_targets`) on its model's card."""
    model = config.trainer.model
    trainer_lora_targets(ModelCard.of(model.name), model, prefix="trainer.")


def check_adapters_servable(config: RLConfig, on_gpu: bool) -> None:
    """Refuse a LoRA run that exports adapters to a server rl starts that cannot serve them: the server's own
    refusal (:func:`inference.plan.adapters_refused`)."""
    lora, name = config.trainer.model.experimental.lora, config.trainer.model.name
    if config.inference is None or lora is None or lora.export != "adapter":
        return
    if refused := adapters_refused(ModelCard.of(name), on_gpu):
        raise TridentError(
            f"trainer.model.experimental.lora.export = 'adapter' for {name!r}: {refused}; use export = 'merged'"
        )


def lock_output_dir(output_dir: Path) -> IO:
    """Claim ``output_dir`` for this run; the lock lasts as long as the returned file stays open (or the process).

    A second ``rl`` on the same output dir would delete the first one's rollouts and weights: it is refused, as is
    an output dir that is a file or cannot be written to.
    """
    if output_dir.exists() and not output_dir.is_dir():
        raise TridentError(f"--output-dir {output_dir}: is a file, not a folder; choose a folder (or move the file)")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = (output_dir / "rl.lock").open("a+")
    except OSError as e:  # a file above it, a read-only or foreign folder
        raise TridentError(
            f"--output-dir {output_dir}: cannot hold the run ({e.strerror}: {e.filename}); choose a folder you can "
            "write to"
        ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "unknown"
        lock.close()
        raise TridentError(
            f"another rl run (pid {owner}) is using {output_dir}; stop it or choose another --output-dir"
        ) from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def check_port_free(host: str, port: int) -> None:
    """Fail now, with the port named, rather than after the server's minutes-long start-up."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            raise TridentError(
                f"port {port} on {host} is already in use (another server?); set --inference.port to a free one"
            ) from None


def placement(config: RLConfig) -> dict[str, list[int]]:
    """The GPUs of each process rl starts: each inference server its ``tensor_parallel_size`` consecutive ids of
    ``inference_gpu_ids``, the teacher's server ``teacher_gpu_ids`` (absent: the first server's), the trainer
    ``trainer_gpu_ids``, the orchestrator none."""
    ids = config.inference_gpu_ids
    gpus = {
        name: ids[i * server.tensor_parallel_size : (i + 1) * server.tensor_parallel_size]
        for i, (name, server) in enumerate(servers(config).items())
    }
    if teacher_server(config) is not None:
        gpus[TEACHER] = config.teacher_gpu_ids or next(iter(gpus.values()))
    return {**gpus, "orchestrator": [], "trainer": config.trainer_gpu_ids}


def placement_lines(config: RLConfig, on_gpu: bool) -> list[str]:
    """Where each process runs, for a person: its GPUs (or the CPU), ports, ranks."""
    lines, started = ["placement:"], started_servers(config)
    for name, gpus in placement(config).items():
        where = f"GPU {','.join(map(str, gpus))}" if on_gpu and gpus else "CPU"
        if name in started:
            server = started[name]
            lines.append(f"  {name}: {where}, port {server.port}, tensor_parallel_size {server.tensor_parallel_size}")
        elif name == "trainer":
            ranks, parallel = trainer_ranks(config, on_gpu), config.trainer.model.parallel
            sharding = "FSDP2" + (f", experts split over {parallel.ep} ranks" if parallel.ep > 1 else "")
            sharding += f", each micro-batch's tokens split over {parallel.cp} ranks" if parallel.cp > 1 else ""
            lines.append(f"  trainer: {where}" + (f", torchrun with {ranks} ranks ({sharding})" if ranks > 1 else ""))
        else:
            lines.append(f"  {name}: {where}")
    return lines


# vLLM's CPU backend pins each server's compute threads; left to choose ("auto"), every server takes the same core
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def placement_env(config: RLConfig, on_gpu: bool) -> dict[str, dict[str, str]]:
    """Environment overrides placing each process: ``CUDA_VISIBLE_DEVICES``, its GPUs or none on the CPU. Several
    servers on the CPU each get a core of their own (``VLLM_CPU_OMP_THREADS_BIND``, unless it is set already):
    left to vLLM, every one of them would compute on the same core."""
    where = placement(config)
    if not on_gpu:
        logger.info("no GPU found: inference and trainer run on the CPU")
        env = {name: {"CUDA_VISIBLE_DEVICES": ""} for name in where}
        started, cores = list(started_servers(config)), sorted(os.sched_getaffinity(0))
        if len(started) > 1 and BIND_ENV not in os.environ:
            for i, name in enumerate(started):
                env[name][BIND_ENV] = str(cores[i % len(cores)])
        return env
    shared = set(config.trainer_gpu_ids) & set(config.inference_gpu_ids if config.inference else [])
    logger.info(
        f"inference on GPU {config.inference_gpu_ids}, trainer on GPU {config.trainer_gpu_ids}"
        + (f" (sharing GPU {sorted(shared)}: keep gpu_memory_utilization low enough)" if shared else "")
    )
    return {name: {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))} for name, ids in where.items()}


def check_gpus(config: RLConfig, on_gpu: bool) -> None:
    """On GPUs, refuse a placement that cannot start: a server without its ``tensor_parallel_size`` GPUs, or (unless
    a dry run plans for another machine) GPU ids this machine lacks."""
    if not on_gpu:
        return
    where = placement(config)
    for name, server in started_servers(config).items():
        if len(where[name]) != server.tensor_parallel_size:
            key = "teacher_gpu_ids" if name == TEACHER else "inference_gpu_ids"
            raise TridentError(
                f"--{key.replace('_', '-')} {getattr(config, key)}: {name} needs inference.tensor_parallel_size = "
                f"{server.tensor_parallel_size} GPUs, it has {where[name]}"
            )
    if not config.dry_run:
        check_gpus_exist(config)


def settle_broadcast(config: RLConfig, on_gpu: bool) -> None:
    """The weight broadcast's backend for servers ``rl`` starts on this machine: ``auto`` becomes ``shared`` (a
    buffer both processes map: CUDA IPC, or ``/dev/shm`` on the CPU) when the trainer's first rank and the one server
    are on one device, NCCL when no server is on the trainer's GPU, else gloo (several servers on the CPU, or one of
    several on the trainer's GPU; gloo too for one server under ``[weights] delta``, which a shared buffer does not
    carry). NCCL on one device and a shared buffer across two are refused."""
    broadcast = config.trainer.weight_broadcast
    if broadcast is None or config.inference is None or not is_loopback(config.inference.host):
        return  # a server on another node: the trainer picks by its own device
    trainer = config.trainer_gpu_ids[0]
    same = not on_gpu or trainer in config.inference_gpu_ids
    device = f"GPU {trainer}" if on_gpu else "the CPU"
    key = "trainer.weight_broadcast.backend"
    if broadcast.backend == "auto":
        one = broadcast.receivers == 1 and config.trainer.weights.delta == "off"
        broadcast.backend = ("shared" if one else "gloo") if same else "nccl"
    elif broadcast.backend == "nccl" and same:
        raise TridentError(
            f"{key} = 'nccl': the trainer and an inference server share {device}, where NCCL cannot pair two ranks on "
            "one device; use backend = 'auto', which hands the weights over in shared memory (one server) or by gloo"
        )
    elif broadcast.backend == "shared" and not same:
        raise TridentError(
            f"{key} = 'shared': the trainer (GPU {trainer}) and the inference server (GPU "
            f"{config.inference_gpu_ids[0]}) are on two devices; use backend = 'nccl' (or 'auto')"
        )


def cuda_memory_gib() -> list[float]:
    """GiB of each CUDA GPU of this machine. torch (seconds to import) is asked only where an NVIDIA driver is
    present: without one there is no GPU, and ``rl`` starts faster."""
    if not (Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()):
        return []
    import torch

    return [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(torch.cuda.device_count())]


def check_gpus_exist(config: RLConfig) -> None:
    count = len(cuda_memory_gib())
    if count == 0:
        raise TridentError(
            f"--gpu-memory-gib {config.gpu_memory_gib:g}: plans a GPU run, and this machine has no GPU; "
            "use it with --dry-run"
        )
    for key in ("trainer_gpu_ids", "inference_gpu_ids", "teacher_gpu_ids"):
        ids = getattr(config, key)
        if ids is None:
            continue
        if not ids or any(i >= count for i in ids):
            raise TridentError(f"--{key.replace('_', '-')} {ids}: this machine has GPUs 0..{count - 1}; name those")


def note_enforce_eager(config: RLConfig, on_gpu: bool) -> None:
    """A user's ``enforce_eager`` is kept, with one line on what it costs on a GPU."""
    if on_gpu and config.inference is not None and config.inference.model.enforce_eager:
        logger.warning(
            "inference.model.enforce_eager = true turns vLLM's CUDA graphs off, which slows decoding; "
            "leave it out of infer.toml to keep them"
        )


def gpu_memory_gib(config: RLConfig) -> float | None:
    """GiB of each GPU the run is planned for: ``--gpu-memory-gib``, else the smallest GPU of this machine; None
    when there is neither. The one place that decides whether the run is on GPUs."""
    if config.gpu_memory_gib is not None:
        return config.gpu_memory_gib
    return min(cuda_memory_gib(), default=None)


def check_memory(config: RLConfig) -> MemoryPlan:
    """The run's memory plan (each process's share of each GPU); a TridentError names what does not fit.

    With no GPU (:func:`gpu_memory_gib`) the plan is for the CPU and refuses nothing.
    """
    gpu_gib = gpu_memory_gib(config)
    where = placement(config)
    teacher = teacher_server(config)
    plan = plan_memory(config.trainer, config.inference, config.trainer_gpu_ids, config.inference_gpu_ids, gpu_gib,
                       teacher, where.get(TEACHER, []))  # fmt: skip
    problems = plan.problems()
    if problems:
        raise TridentError(f"the run does not fit in memory: {'; '.join(problems)} (rl --dry-run prints the plan)")
    return plan
