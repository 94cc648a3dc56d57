"""The run spec: the facts the three processes must agree on, derived once from their configs.

``rl`` derives it (:func:`derive_run_spec`) from the three resolved configs and writes it to
``output_dir/configs/run.json`` beside their files. Each process loads its config with :func:`load_config`: one whose
output dir holds a spec takes the spec's values for the keys its file leaves out and refuses, in one line, a key its
file sets otherwise; one with no spec derives its own with the same function. So a process started alone from the
files ``rl`` wrote runs with the values it has under ``rl``.

:data:`HOMES` is the one table of what the processes share and where each fact lives in their configs: the spec's
facts, and the settings ``rl`` hands every process it starts (``output_dir``, ``wandb``, ...).
"""

import json
import logging
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

from pydantic import ValidationError

from contracts.chat_family import model_family
from contracts.config import BaseConfig, ConfigError, exit_config_error, get_key, is_set, run_cli, set_key
from contracts.errors import TridentError
from contracts.model_card import ModelCard
from contracts.run_dir import configs_dir
from contracts.shared_config import StrictModel

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=BaseConfig)

# The adapter ranks vLLM sizes its LoRA buffers for (its --max-lora-rank choices).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def served_lora_rank(rank: int) -> int:
    """The server's ``max_rank`` for adapters of ``rank``: the smallest vLLM accepts that holds it."""
    fitting = [served for served in VLLM_LORA_RANKS if served >= rank]
    if not fitting:
        largest = max(VLLM_LORA_RANKS)
        raise ConfigError(
            f"trainer.model.experimental.lora.rank = {rank}: vLLM serves adapters of rank {largest} at most"
        )
    return fitting[0]


class RunSpec(StrictModel):
    """What every process of a run must agree on; None where the configs it came from do not say."""

    model: str
    seq_len: int | None = None
    max_steps: int | None = None
    async_level: int | None = None
    lora_rank: int | None = None
    lora_export: Literal["merged", "adapter"] | None = None
    served_lora_rank: int | None = None
    chat_family: str | None = None
    inference_urls: list[str] | None = None


class Home(NamedTuple):
    """Where a fact the processes share lives: its key in each process's config that holds it ("process.dotted.key"),
    and ``rl``'s own key that sets it in all of them (``--max-steps``; None where rl has none)."""

    keys: tuple[str, ...]
    rl_key: str | None = None


# Each fact the processes share, and where it lives. The run spec carries those it has a field for (RunSpec), so that
# a process started alone has them too; the others are settings rl hands each process it starts.
HOMES: dict[str, Home] = {
    "model": Home(("trainer.model.name", "orchestrator.model.name", "inference.model.name"), "model.name"),
    "chat_family": Home(("orchestrator.model.chat_family", "inference.model.chat_family"), "model.chat_family"),
    "output_dir": Home(("trainer.output_dir", "orchestrator.output_dir", "inference.output_dir"), "output_dir"),
    "max_steps": Home(("trainer.max_steps", "orchestrator.max_steps"), "max_steps"),
    # the server stops a rollout's context at seq_len, so every sample fits in a micro-batch
    "seq_len": Home(("trainer.seq_len", "orchestrator.seq_len", "inference.model.max_model_len"), "seq_len"),
    "async_level": Home(("orchestrator.async_level", "trainer.async_level"), "async_level"),
    "wandb": Home(("trainer.wandb", "orchestrator.wandb"), "wandb"),
    "ckpt": Home(("trainer.ckpt", "orchestrator.ckpt"), "ckpt"),
    "log": Home(("trainer.log", "orchestrator.log", "inference.log"), "log"),
    "run_id": Home(("orchestrator.run_id",), "run_id"),
    "lora_rank": Home(("trainer.model.experimental.lora.rank",)),
    "lora_export": Home(("trainer.model.experimental.lora.export",)),
    "served_lora_rank": Home(("inference.lora.max_rank",)),
    "inference_urls": Home(("orchestrator.client.base_url",)),
}


def spec_homes() -> dict[str, tuple[str, ...]]:
    """Each fact of the run spec, with its keys in the processes' configs (:data:`HOMES`)."""
    return {fact: home.keys for fact, home in HOMES.items() if fact in RunSpec.model_fields}


def run_spec_path(output_dir: Path) -> Path:
    return configs_dir(output_dir) / "run.json"


def detect_chat_family(model: str) -> str | None:
    """The chat family of ``model`` read from its files; None for a model of no known family, or one not on this
    machine (each process then detects it itself, as with 'auto')."""
    folder = ModelCard.of(model).folder
    if folder is None:
        logger.info(f"model {model!r} is not on this machine: each process reads its chat family itself")
        return None
    family = model_family(folder)
    return family.name if family else None


def _as_spec_value(fact: str, value: Any) -> Any:
    if fact == "inference_urls" and isinstance(value, str):
        return [value]
    if fact == "chat_family" and value == "auto":
        return None
    return value


def _as_config_value(fact: str, value: Any) -> Any:
    if fact == "inference_urls" and value is not None and len(value) == 1:
        return value[0]
    if fact == "chat_family" and value is None:
        return "auto"
    return value


def derive_run_spec(configs: dict[str, Any]) -> RunSpec:
    """The spec of a run from its processes' configs (``{"trainer": ..., "orchestrator": ..., "inference": ...}``,
    any of them), each fact read from the first config that holds it; a chat family of 'auto' is detected here."""
    values = {}
    for fact, homes in spec_homes().items():
        present = [home for home in homes if home.split(".", 1)[0] in configs]
        if present:
            process, key = present[0].split(".", 1)
            values[fact] = _as_spec_value(fact, get_key(configs[process], key))
    if "chat_family" in values and values["chat_family"] is None:
        values["chat_family"] = detect_chat_family(values["model"])
    return RunSpec(**values)


def apply_run_spec(config: BaseConfig, process: str, spec: RunSpec, source: str) -> None:
    """Give ``config`` (of ``process``) the spec's values: a key its file left out takes the spec's; one set
    otherwise, or one the config cannot hold, is a ConfigError naming the key, both values and ``source``."""
    for fact, homes in spec_homes().items():
        for home in homes:
            owner, key = home.split(".", 1)
            if owner != process:
                continue
            wanted = _as_config_value(fact, getattr(spec, fact))
            current = get_key(config, key)
            if _as_spec_value(fact, current) == getattr(spec, fact):
                continue
            refused = f"{process} {key} = {current!r} contradicts {fact} = {getattr(spec, fact)!r} in {source}"
            if is_set(config, key) and not (fact == "chat_family" and current == "auto"):  # 'auto': the run's
                raise ConfigError(f"{refused}; leave {key} out or set it to the run's value")
            try:
                set_key(config, key, wanted)
            except (AttributeError, ValidationError):  # e.g. a spec's LoRA rank for a config without [lora]
                raise ConfigError(f"{refused}; set the run's value in the file") from None


def read_or_derive_run_spec(config: BaseConfig, process: str, output_dir: Path | None) -> RunSpec:
    """Apply the spec in ``output_dir`` (written by rl) to ``config``, or derive one from ``config`` alone."""
    path = run_spec_path(output_dir) if output_dir is not None else None
    if path is None or not path.is_file():
        spec = derive_run_spec({process: config})
        apply_run_spec(config, process, spec, "the detected chat family")
        return spec
    try:
        spec = RunSpec.model_validate(json.loads(path.read_text()))
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(f"{path}: not a run spec ({'.'.join(map(str, first['loc']))}: {first['msg']}); delete it "
                          "or run rl again") from None  # fmt: skip
    except ValueError as e:  # not JSON
        raise ConfigError(f"{path}: not a run spec ({e}); delete it or run rl again") from None
    apply_run_spec(config, process, spec, str(path))
    return spec


def write_run_spec(spec: RunSpec, output_dir: Path) -> Path:
    """Write ``spec`` to ``output_dir/configs/run.json``; returns its path."""
    path = run_spec_path(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec.model_dump_json(indent=2) + "\n")
    return path


def load_config(cls: type[C], process: str, argv: list[str] | None = None) -> tuple[C, RunSpec]:
    """An entry point's config (``sys.argv``) with the run spec applied (:func:`read_or_derive_run_spec`); a config
    mistake, or a tiny model not built yet, prints one line and exits 2; ``--help`` prints the usage of ``process``
    (:func:`contracts.config.run_cli`)."""
    config = run_cli(cls, process, argv)
    try:
        ModelCard.of(config.model.name)  # a tiny model must be built before a process starts on it
        spec = read_or_derive_run_spec(config, process, getattr(config, "output_dir", None))
    except (ConfigError, TridentError) as e:
        exit_config_error(e)
    return config, spec
