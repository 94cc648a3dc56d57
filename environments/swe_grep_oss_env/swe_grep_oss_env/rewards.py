"""Reward math, as pure functions over what a trace holds (assistant messages, message nodes, usage).

The files the model names are read from its last call of the ``result`` tool. Paths are compared after
:func:`normalize_path`, so ``./pkg/a.py``, ``pkg//a.py`` and ``pkg/a.py`` are the same file.
"""

import json
import posixpath
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from swe_grep_oss_env.tools import REPO_DIR

RESULT_TOOL = "result"


def normalize_path(path: str) -> str:
    """A path relative to the repository root: ``./a//b/../c.py`` -> ``a/c.py``. An absolute path into the
    rollout's copy (``/.../repo/a.py``) loses everything up to the copy's directory."""
    path = path.strip().replace("\\", "/")
    if path.startswith("/"):
        marker = f"/{REPO_DIR}/"
        path = path.split(marker, 1)[1] if marker in path else path
    path = posixpath.normpath(path).lstrip("/")
    return "" if path == "." else path


def tool_call_name_and_arguments(call: Any) -> tuple[str, str]:
    """(name, JSON arguments) of a tool call: verifiers' ``ToolCall`` (``.name``) or OpenAI's (``.function.name``)."""
    function = getattr(call, "function", None)
    source = function if function is not None else call
    return source.name, source.arguments or ""


def tool_calls(messages: Iterable[Any]) -> list[tuple[str, str]]:
    """Every tool call of the sampled assistant messages, in order, as (name, JSON arguments)."""
    return [tool_call_name_and_arguments(call) for message in messages for call in (message.tool_calls or [])]


def named_files(messages: Iterable[Any]) -> list[str] | None:
    """The normalised, de-duplicated files of the last ``result`` call; None if the model never called it.
    A call whose arguments are not ``{"files": [...]}`` names no files (a lone string counts as one file)."""
    calls = [arguments for name, arguments in tool_calls(messages) if name == RESULT_TOOL]
    if not calls:
        return None
    try:
        files = json.loads(calls[-1]).get("files", [])
    except (json.JSONDecodeError, AttributeError):
        return []
    files = [files] if isinstance(files, str) else files
    if not isinstance(files, list):
        return []
    paths = [normalize_path(f) for f in files if isinstance(f, str)]
    return list(dict.fromkeys(path for path in paths if path))


@dataclass(frozen=True)
class FileScores:
    correct: float
    """Share of the answer files that were named (recall)."""
    incorrect: float
    """Share of the named files that are not answer files (1 - precision); 0 when none were named."""
    missed: float
    """Share of the answer files that were not named."""


def file_scores(named: Sequence[str] | None, answer: Sequence[str]) -> FileScores:
    """Compare the named files with the answer (both normalised here); naming nothing scores like missing all."""
    named_set = {normalize_path(path) for path in named or []}
    answer_set = {normalize_path(path) for path in answer}
    if not answer_set:
        raise ValueError("a task needs at least one answer file")
    hits = len(named_set & answer_set)
    return FileScores(
        correct=hits / len(answer_set),
        incorrect=len(named_set - answer_set) / len(named_set) if named_set else 0.0,
        missed=len(answer_set - named_set) / len(answer_set),
    )


def sampled_token_count(nodes: Iterable[Any], completion_tokens: int | None) -> int:
    """Tokens the model sampled in a rollout: the True entries of the sampled nodes' masks (each node is stored
    once, whatever the branches), or the provider's ``completion_tokens`` when no node carries token ids."""
    from_masks = sum(sum(node.mask) for node in nodes if node.sampled)
    return from_masks if from_masks else completion_tokens or 0


def over_limit(value: int, limit: int) -> float:
    """1.0 when ``value`` exceeds ``limit``, else 0.0 (penalties are positive; their weights are negative)."""
    return float(value > limit)
