"""Render the config reference (docs/configs.md) from the config models, so the docs cannot drift."""

import json
import re
import sys
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from contracts.config import section_model
from inference.config import InferenceConfig
from orchestrator.config import EvalRunConfig, OrchestratorConfig
from trainer.config import SFTConfig, TrainerConfig

INTRO = """\
# Config reference

Generated from the config models by `uv run python -m launch.config_docs > docs/configs.md`; a test fails when
this file and the models disagree. How configs are loaded (files, flags, env vars, precedence) is described
in [operations.md](operations.md#configs).
"""


def _type_name(annotation) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(map(_is_annotated, args)):
        annotation = typing.Union[tuple(typing.get_args(a)[0] if _is_annotated(a) else a for a in args)]  # noqa: UP007
    name = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    return name or re.sub(r"\b[\w]+\.", "", str(annotation))  # drop module prefixes


def _is_annotated(annotation) -> bool:
    """An ``Annotated[X, Field(...)]`` type (``RunId``): its docs name X, its description is the field's."""
    return typing.get_origin(annotation) is typing.Annotated


def _rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    rows, sections = [], []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            sections.append((key, annotation))
            continue
        inner = typing.get_args(annotation)
        if (
            typing.get_origin(annotation) is list
            and inner
            and isinstance(inner[0], type)
            and issubclass(inner[0], BaseModel)
        ):
            sections.append((f"{key}[]", inner[0]))
        elif (optional := section_model(annotation)) is not None:  # an optional section: its row, then its keys
            sections.append((key, optional))
        default = field.get_default(call_default_factory=True)
        default = "required" if default is PydanticUndefined else f"`{json.dumps(to_jsonable_python(default))}`"
        rows.append(f"| `{key}` | `{_type_name(annotation)}` | {default} | {field.description or ''} |")
    for key, section in sections:
        rows += _rows(section, f"{key}.")
    return rows


def render() -> str:
    parts = [INTRO]
    for title, model, command in [
        ("Trainer", TrainerConfig, "trainer @ train.toml"),
        ("Orchestrator", OrchestratorConfig, "orchestrator @ orch.toml"),
        ("Inference", InferenceConfig, "inference @ infer.toml"),
        ("Evaluation", EvalRunConfig, "eval @ eval.toml"),
        ("SFT", SFTConfig, "sft @ sft.toml"),
    ]:
        parts.append(f"## {title} (`{command}`)\n")
        parts.append("| key | type | default | meaning |\n|---|---|---|---|")
        parts.append("\n".join(_rows(model)) + "\n")
    return "\n".join(parts)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
