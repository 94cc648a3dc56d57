"""Config sections that several processes share (one definition each)."""

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from contracts.chat_family import FAMILIES, known_family
from contracts.model_path import TINY_MODEL_ID, known_model


class StrictModel(BaseModel):
    """A config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


ModelName = Annotated[str, AfterValidator(known_model)]


class ModelConfig(StrictModel):
    name: Annotated[
        ModelName,
        Field(
            description=f"HF hub id or local folder of the model. The 'trident/' ids are tiny models built locally "
            f"('{TINY_MODEL_ID}' and others: docs/operations.md); rl builds them, build-tiny-model by hand."
        ),
    ] = TINY_MODEL_ID


ChatFamilyName = Annotated[
    str,
    AfterValidator(known_family),
    Field(
        description="The model's chat format, one choice for the orchestrator's renderer and the server's tool-call "
        f"parser: a family of contracts/chat_family.py ({', '.join(FAMILIES)}), or 'auto': read from the model's files "
        "(its model_type and tokens). rl sets it for both."
    ),
]

OutputDir = Annotated[Path, Field(description="Root of the run's files: rollouts, weights, checkpoints, logs.")]
MaxSteps = Annotated[int, Field(ge=1, description="Number of trainer steps (optimizer updates) in the run.")]
SeqLen = Annotated[
    int,
    Field(
        ge=16,
        description="Tokens of the longest sample; also tokens per packed micro-batch, unless the trainer's "
        "micro_batch_tokens says more.",
    ),
]
AsyncLevel = Annotated[
    int,
    Field(
        ge=0,
        description="Rollouts for step N may come from weights step N - 1 - async_level or newer (weights step N - 1 "
        "are the newest: 0 is on-policy).",
    ),
]
Seed = Annotated[int, Field(description="Random seed.")]
RunId = Annotated[
    str,
    Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.=+-]{0,63}$",
        description="The run's name on an inference server that several runs share (its adapters are served as "
        "<run_id>/lora-step-N); letters, digits and _ . = + -, at most 64.",
    ),
]


def is_run_id(text: str | None) -> bool:
    """Whether ``text`` is a :data:`RunId`."""
    try:
        TypeAdapter(RunId).validate_python(text)
    except ValidationError:
        return False
    return True


class LogConfig(StrictModel):
    level: Annotated[
        Literal["debug", "info", "warning", "error"],
        Field(
            description="Least severe log lines written. Libraries' (httpx, mcp, verifiers, ...): warnings only, "
            "unless debug."
        ),
    ] = "info"


class WandbConfig(StrictModel):
    """Weights & Biases tracking; present (a [wandb] table or any --wandb.* flag) means on."""

    project: Annotated[str, Field(description="W&B project.")] = "trident"
    name: Annotated[
        str | None, Field(description="Run name; the trainer and orchestrator runs get it with their suffix.")
    ] = None
    offline: Annotated[
        bool, Field(description="Write runs to output_dir/wandb only (`wandb sync` uploads them later).")
    ] = False


WandbSection = Annotated[
    WandbConfig | None,
    Field(description="Weights & Biases tracking (absent: off). Offline when WANDB_API_KEY is unset."),
]


class CkptConfig(StrictModel):
    """Checkpoints to resume a run from; present (a [ckpt] table or any --ckpt.* flag) means on."""

    interval: Annotated[
        int, Field(ge=1, description="Save a checkpoint after every `interval` trainer steps (and after the last).")
    ] = 10
    keep: Annotated[
        int | None, Field(ge=1, description="Keep only the newest `keep` complete checkpoints (absent: keep all).")
    ] = 2
    resume_step: Annotated[
        int | None,
        Field(
            ge=-1,
            description="Resume from the checkpoint after this many steps; -1: the newest complete one; absent: "
            "start from scratch.",
        ),
    ] = None


CkptSection = Annotated[CkptConfig | None, Field(description="Checkpoints for resuming (absent: none are written).")]


class WeightBroadcastConfig(StrictModel):
    """Send each step's weights to the inference servers in memory instead of through files. Present (a
    [weight_broadcast] table or any --weight-broadcast.* flag) means on."""

    host: Annotated[str, Field(description="Address the server reaches the trainer at (the trainer listens).")] = (
        "127.0.0.1"
    )
    port: Annotated[int, Field(ge=1, le=65535, description="Port of the trainer's rendezvous store.")] = 29510
    timeout_s: Annotated[
        float, Field(gt=0, description="Seconds the trainer waits for the servers to take each step's weights.")
    ] = 600.0
    backend: Annotated[
        Literal["auto", "shared", "nccl", "gloo"],
        Field(
            description="'shared': trainer and server on one device (the same GPU, or the CPU) map one buffer, the "
            "trainer writes the weights in and the server copies them out (CUDA IPC, or /dev/shm); 'nccl': between "
            "two GPUs (NCCL cannot pair two ranks on one device); 'gloo': through CPU memory, anywhere. 'auto': under "
            "rl, 'shared' when trainer and its one server share a device, 'gloo' when one of several does, and 'nccl' "
            "between GPUs; a trainer started alone takes NCCL on GPU, else gloo."
        ),
    ] = "auto"
    receivers: Annotated[
        int,
        Field(
            ge=1,
            description="Inference servers that receive each step's weights (rl sets it: one per server). The trainer "
            "holds each step's weights until that many took them (at most timeout_s; then as many as took them), "
            "sending them to each server that asks. 'shared' serves one.",
        ),
    ] = 1

    @model_validator(mode="after")
    def _shared_serves_one(self):
        if self.backend == "shared" and self.receivers > 1:
            raise ValueError(
                f"weight_broadcast.backend = 'shared' hands the weights to one server, receivers = {self.receivers}: "
                "use 'gloo' (or 'nccl' between GPUs)"
            )
        return self


WeightBroadcastSection = Annotated[
    WeightBroadcastConfig | None,
    Field(description="In-memory weight broadcast to the servers (absent: weights go through output_dir/weights)."),
]
