"""What a weights folder written with ``[weights] delta`` says about itself (:data:`DELTA_INFO`): a full copy or a
delta, the step and checksum of the weights a delta applies to, where its chain starts, and the checksum of the
weights it gives. Torch-free: the orchestrator reads it to keep a chain's folders and to check a server's checksum.

A chain is one full copy (``step_F``: HF safetensors files) followed by deltas (``step_F+1`` .. ``step_N``: each a
:data:`DELTA_WEIGHTS` file against the previous step's weights, :mod:`contracts.weight_delta`); a server that holds
step N-1 exactly applies step N's delta, any other replays the chain from its full copy.
"""

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DELTA_INFO = "delta.json"
DELTA_WEIGHTS = "delta.safetensors"  # a delta folder's tensors (contracts.weight_delta.to_tensors)

Step = Annotated[int, Field(ge=0)]


class DeltaInfo(BaseModel):
    """One weights folder of a delta chain."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    step: Step
    kind: Literal["full", "delta"]
    full_step: Step  # the chain's full copy: this step for a full one
    base_step: Step | None = None  # a delta's: the step of the weights it applies to (step - 1)
    base_checksum: str | None = None  # ... and their checksum (contracts.weight_delta.weights_checksum)
    checksum: str  # of the weights this folder gives
    dtype: Literal["float32", "bfloat16", "float16"]  # the served dtype, the deltas'

    @model_validator(mode="after")
    def _a_chain(self):
        full = self.kind == "full"
        if (
            full != (self.full_step == self.step)
            or full != (self.base_step is None)
            or full != (self.base_checksum is None)
            or (not full and not self.full_step <= self.base_step < self.step)
        ):
            raise ValueError("a full copy is its own chain's start with no base; a delta's base is a step between")
        return self


def write_delta_info(folder: Path, info: DeltaInfo) -> None:
    (Path(folder) / DELTA_INFO).write_text(info.model_dump_json(indent=1) + "\n")


def read_delta_info(folder: str | Path) -> DeltaInfo | None:
    """The delta chain entry of a weights folder, None for one written without ``[weights] delta``; a ValueError
    names a file that is not one."""
    path = Path(folder) / DELTA_INFO
    if not path.exists():
        return None
    try:
        return DeltaInfo.model_validate_json(path.read_bytes())
    except ValidationError as e:
        raise ValueError(f"{path} is not a delta chain entry: {e}") from None


def chain_start(folder: Path) -> int | None:
    """The step of the full copy the weights in ``folder`` are replayed from (its own for a full copy); None for a
    folder outside any chain."""
    info = read_delta_info(folder)
    return None if info is None else info.full_step
