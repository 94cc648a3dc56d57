"""Weights from a delta chain's folders (``contracts.delta_chain``): the worker keeps a copy of the weights it serves,
under the checkpoint's names in the served dtype (host memory: the weights' size once more), applies a delta to it
only when it holds exactly the delta's base (step and checksum), and otherwise rebuilds it from the chain's full
copy and the deltas after it, checking each base on the way; vLLM then loads the copy in place, as from files."""

from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from contracts.delta_chain import DELTA_INFO, DELTA_WEIGHTS, DeltaInfo, read_delta_info
from contracts.weight_delta import WeightsCopy, from_tensors
from inference.transports.base import WeightReceiver


class DeltaReceiver(WeightReceiver):
    """One per worker: the served copy and the step and checksum it holds (None: nothing known, e.g. after weights
    came another way or a load failed half way)."""

    def __init__(self):
        self.served = WeightsCopy()
        self.held: tuple[int, str] | None = None  # (step, checksum) of the copy, once vLLM loaded it
        self.pending: tuple[int, str] | None = None
        self.replayed: list[int] = []  # the steps the last receive read, in order

    def forget(self) -> None:
        """The model's weights came another way: the copy no longer says what is served."""
        self.served.clear()
        self.held = None

    def receive(self, path: str, manifest: dict | None) -> dict[str, Any]:
        info = read_delta_info(path)
        held, self.held = self.held, None  # until vLLM has loaded the copy
        folders = Path(path).parent
        if info.kind == "full" or held is None or not info.full_step <= held[0] < info.step:
            self.read_full(folders, info.full_step)
        elif not self.extends(folders, held, info.step):  # another chain holds these step numbers
            self.read_full(folders, info.full_step)
        for step in range(self.replayed[-1] + 1, info.step + 1):
            self.apply_delta(folders / f"step_{step}")
        self.pending = (info.step, self.served.checksum)
        return {"weights_iterator": iter(list(self.served.tensors.items()))}

    def loaded(self, manifest: dict | None) -> None:
        self.held = self.pending

    def served_checksum(self) -> str | None:
        return None if self.held is None else self.held[1]

    def extends(self, folders: Path, held: tuple[int, str], step: int) -> bool:
        """Whether the chain's delta after the held step applies to the held copy (its base is the copy's)."""
        after = read_delta_info(folders / f"step_{held[0] + 1}")
        self.replayed = [held[0]]
        return after is not None and (after.base_step, after.base_checksum) == held

    def read_full(self, folders: Path, step: int) -> None:
        """Make the copy the full weights of ``step_<step>``, checked against their own checksum."""
        folder = folders / f"step_{step}"
        info = self.entry(folder, "full")
        self.served.clear()
        tensors = {}
        for file in sorted(folder.glob("*.safetensors")):
            tensors |= load_file(file)
        self.served.replace(tensors)
        if self.served.checksum != info.checksum:
            raise ValueError(
                f"{folder}: its weights' checksum is {self.served.checksum}, its {DELTA_INFO} says {info.checksum}"
            )
        self.replayed = [step]

    def apply_delta(self, folder: Path) -> None:
        """Apply the delta of ``folder`` to the copy, which must hold its base exactly."""
        info = self.entry(folder, "delta")
        if (self.replayed[-1], self.served.checksum) != (info.base_step, info.base_checksum):
            raise ValueError(f"{folder}: a delta against step {info.base_step} ({info.base_checksum}), and the copy "
                             f"holds step {self.replayed[-1]} ({self.served.checksum})")  # fmt: skip
        try:
            self.served.apply(from_tensors(load_file(folder / DELTA_WEIGHTS)))
        except ValueError as e:
            raise ValueError(f"{folder}: {e}") from None
        self.replayed.append(info.step)

    @staticmethod
    def entry(folder: Path, kind: str) -> DeltaInfo:
        """The chain entry of ``folder``, which must be a ``kind`` one: else a ValueError (the chain is broken)."""
        info = read_delta_info(folder) if folder.is_dir() else None
        if info is None or info.kind != kind:
            raise ValueError(f"{folder}: no {kind} weights of a delta chain there (deleted, or another chain's)")
        return info
