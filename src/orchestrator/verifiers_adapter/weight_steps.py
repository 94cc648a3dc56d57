"""The weights step that sampled each token, carried from the server's answer into verifiers' rollout graph.

The generate route labels each completion's tokens with the weights step that sampled them (``weight_versions``,
spans of output tokens: several when the weights changed in flight, :mod:`inference.routes`). Neither renderers nor
verifiers 0.4.0 keep them; but the completion's logprobs list that ``renderers.client.generate`` parses becomes,
unchanged and uncopied, the sampled node's ``logprobs`` in verifiers' graph. :func:`parse_completion_logprobs`
returns it as a :class:`StepLogprobs`, a list that also holds each token's step, which :func:`node_weight_steps`
reads back from the node. :func:`~orchestrator.verifiers_adapter.patches.install_patches` puts it in place.
"""

from typing import Any

import renderers.client

from contracts.inference_api import token_weight_steps

_parse_completion_logprobs = renderers.client._parse_completion_logprobs


class StepLogprobs(list):
    """A completion's logprobs, and the weights step that sampled each of its tokens (``weight_steps``)."""

    weight_steps: list[int]


def parse_completion_logprobs(choice: Any, completion_ids: list[int]) -> list[float]:
    """renderers' parse of a choice's logprobs, with its tokens' weights steps when the server labelled them."""
    logprobs = _parse_completion_logprobs(choice, completion_ids)
    steps = token_weight_steps(choice.get("weight_versions"), len(completion_ids))
    if steps is None:
        return logprobs
    labelled = StepLogprobs(logprobs)
    labelled.weight_steps = steps
    return labelled


def node_weight_steps(logprobs: list[float]) -> list[int] | None:
    """The weights step of each sampled token of a rollout-graph node, from its ``logprobs`` (None: not labelled)."""
    return logprobs.weight_steps if isinstance(logprobs, StepLogprobs) else None
