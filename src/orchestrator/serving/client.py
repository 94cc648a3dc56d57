"""The orchestrator's calls to the inference server's admin routes: readiness, weight reloads and their check.

A named run (``orchestrator.run_id``, on a server other runs share) reads, changes, probes and releases only its own
state there: its adapters are ``<run>/lora-step-N``, and every request carries its id (:data:`RUN_HEADER`).
"""

import asyncio
import logging
import time
from pathlib import Path

import httpx

from contracts.delta_chain import DELTA_INFO, read_delta_info
from contracts.errors import TridentError
from contracts.inference_api import (
    GENERATE,
    HEALTH,
    LOAD_ADAPTER,
    RELEASE_RUN,
    RELOAD_WEIGHTS,
    RESET_WEIGHTS,
    RUN_HEADER,
    RUNS,
    WEIGHTS,
    RunRequest,
    RunShare,
    Served,
    WeightsChange,
    WeightsRequest,
    adapter_name,
    auth_headers,
    probe_request,
    served_probe_logprobs,
)
from contracts.run_dir import is_adapter, read_probe
from contracts.weight_manifest import MANIFEST, read_manifest

logger = logging.getLogger("orchestrator")

NOTICE_S = 30.0  # how often to say that the server is still not up
RELEASE_TIMEOUT_S = 5.0  # for telling a shared server that the run has ended: the server evicts it later anyway


class Superseded(TridentError):
    """The server could not get the broadcast weights it was asked to load: the trainer has sent newer ones since."""


def run_headers(run: str | None) -> dict[str, str]:
    """The header a named run's requests carry (none for an unnamed run)."""
    return {RUN_HEADER: run} if run else {}


class InferenceClient:
    def __init__(self, base_url: str, timeout_s: float, model: str = "", in_flight: bool = False,
                 run: str | None = None, headers: dict[str, str] | None = None):  # fmt: skip
        self.base_url = base_url.rstrip("/")
        self.base_model = model
        self.model = model  # the name the policy is served under: the base model's, or the current adapter's
        self.in_flight = in_flight  # full-weight reloads keep requests in flight (WeightsRequest.in_flight)
        self.run = run  # orchestrator.run_id: the run shares the server with others (None: it has it to itself)
        self.paused_s = 0.0  # seconds the server paused generation for the last reload
        headers = auth_headers() | run_headers(run) if headers is None else headers  # None: Trident's server's
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, headers=headers)

    async def wait_ready(self, timeout_s: float, notice_s: float = NOTICE_S) -> None:
        """Poll ``/health`` until the server answers 200, backing off from 1 s to 10 s between tries and logging
        every ``notice_s`` that it is still not up."""
        start = time.monotonic()
        notice = start + notice_s
        delay = 1.0
        while True:
            try:
                if (await self.http.get(HEALTH)).status_code == 200:
                    logger.info(f"inference server ready after {time.monotonic() - start:.0f}s")
                    return
            except httpx.TransportError:
                pass
            now = time.monotonic()
            if now - start > timeout_s:
                raise TridentError(f"inference server at {self.base_url} not ready after {timeout_s:.0f}s")
            if now >= notice:
                logger.info(f"still waiting for the inference server at {self.base_url} ({now - start:.0f}s)")
                notice = now + notice_s
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def served(self, timeout_s: float | None = None) -> Served:
        """What the server says it serves this run (``GET /weights``); an ``httpx.HTTPError`` when it cannot be
        reached or stays silent for ``timeout_s`` (the client's timeout by default)."""
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        params = {"run": self.run} if self.run else None
        response = await self.http.get(WEIGHTS, params=params, timeout=timeout)
        return Served.model_validate(response.raise_for_status().json())

    async def reset_weights(self) -> None:
        """Make the server serve the model it started with, no adapter, as step 0: a server that an earlier run
        left on its own weights or adapter serves what a fresh one would. A named run resets only its own
        adapters."""
        body = RunRequest(run=self.run).model_dump() if self.run else None
        response = await self.http.post(RESET_WEIGHTS, json=body)
        if response.status_code != 200:
            raise TridentError(f"inference server failed to serve its base model again: {response.text}")
        self.use(WeightsChange.model_validate(response.json()))

    def use(self, served: Served) -> None:
        """Name what ``served`` reports in requests from now on: its adapter, or the base model."""
        self.model = served.adapter or self.base_model

    async def reload_weights(self, path: Path, step: int) -> float:
        """Make the server serve the weights in ``path`` (trainer step ``step``): full weights, or a LoRA adapter
        swapped in under :func:`adapter_name`, which becomes :attr:`model`. Returns the seconds taken; the seconds
        generation was paused for it become :attr:`paused_s`. A named run loads adapters only. Weights of a delta
        chain are checked by their checksum (:func:`check_checksum`)."""
        adapter = adapter_name(step, self.run) if is_adapter(path) else None
        if self.run and not adapter:
            raise TridentError(
                f"orchestrator.run_id = {self.run!r}: {path} holds full weights, which cannot share an inference "
                f"server: a run with a run id is LoRA only (the trainer's [model.experimental.lora], export = "
                f"'adapter')"
            )
        route = LOAD_ADAPTER if adapter else RELOAD_WEIGHTS
        body = WeightsRequest(path=str(path.resolve()), step=step, in_flight=self.in_flight, run=self.run)
        response = await self.http.post(route, json=body.model_dump())
        if response.status_code == 409 and route == RELOAD_WEIGHTS:  # an adapter's 409 is a refusal (a full server)
            raise Superseded(response.json()["error"])
        if response.status_code != 200:
            raise TridentError(f"inference server failed to load {path} ({route}): {response.text}")
        served = await self.served()
        if (served.step, served.adapter) != (step, adapter):
            raise TridentError(
                f"inference server reports step {served.step} (adapter {served.adapter}) after "
                f"loading step {step} (adapter {adapter})"
            )
        self.use(served)
        change = WeightsChange.model_validate(response.json())
        check_checksum(path, step, change.checksum)
        self.paused_s = change.paused_s
        return change.seconds

    async def prompt_logprobs(
        self, token_ids: list[int], image: str | None = None, prompt_ids: list[int] | None = None
    ) -> list[float]:
        """The server's logprob of each token given the ones before it (temperature 1; 0.0 at position 0). With an
        ``image`` (a data URL), ``prompt_ids`` (``token_ids`` with the image's placeholder not expanded) are sent with
        it, and the server must expand them to ``token_ids``."""
        response = await self.http.post(GENERATE, json=probe_request(self.model, prompt_ids or token_ids, image))
        if response.status_code != 200:
            raise TridentError(f"inference server refused the probe request: {response.text}")
        answer = response.json()
        if image is not None and answer.get("prompt_token_ids") != token_ids:
            raise TridentError(
                f"the server expands the probe's image into other tokens than the trainer's processor does: "
                f"{len(answer.get('prompt_token_ids') or [])} prompt tokens, the trainer's {len(token_ids)}"
            )
        return served_probe_logprobs(answer, token_ids)

    async def check_probe(self, path: Path, step: int, tolerance: float | None) -> float | None:
        """Compare the server's logprobs of the probe with the trainer's for the weights in ``path``.

        Returns their mean absolute difference (None when the weights carry no probe); raises when it exceeds
        ``tolerance`` (None: the probe's own, wider for a trainer on a 4-bit base): the server is not sampling from
        the weights the trainer wrote.
        """
        probe = read_probe(path)
        if probe is None:
            return None
        tolerance = probe.tolerance if tolerance is None else tolerance
        gap = probe.gap(await self.prompt_logprobs(probe.token_ids, probe.image, probe.prompt_ids))
        if gap > tolerance:
            rounding = (
                "as the trainer's base was 4-bit, by the quantization error"
                if probe.base_in_4bit
                else f"as the probe is {probe.dtype or 'bfloat16'}, by its rounding"
            )
            raise TridentError(
                f"after reloading weights step {step}, the server's logprobs of the probe differ from the trainer's "
                f"by {gap:.3g} on average (tolerance client.probe_tolerance = {tolerance}): the server does not "
                f"serve the weights in {path} (or, {rounding}, which grows with how peaked the model is: if a "
                "correct reload's gap is that large, set client.probe_tolerance above it)"
            )
        return gap

    async def run_share(self, timeout_s: float) -> RunShare | None:
        """This named run's entry in the server's ``GET /runs`` (an ``httpx.HTTPError`` without an answer in
        ``timeout_s``): None for an unnamed run, a run the server does not list, or a server without the route (an
        older one)."""
        if not self.run:
            return None
        response = await self.http.get(RUNS, timeout=timeout_s)
        if response.status_code == 404:
            return None
        entry = response.raise_for_status().json().get(self.run)
        return None if entry is None else RunShare.model_validate(entry)

    async def release_run(self) -> None:
        """Tell the server that this named run has ended (``POST /release_run``), so that it removes the run's
        adapters now; best effort: a server that does not answer in :data:`RELEASE_TIMEOUT_S` evicts the run once it
        has been idle long enough."""
        if not self.run:
            return
        try:
            response = await self.http.post(RELEASE_RUN, json=RunRequest(run=self.run).model_dump(),
                                            timeout=RELEASE_TIMEOUT_S)  # fmt: skip
            response.raise_for_status()
        except httpx.HTTPError as e:
            logger.warning(f"could not release run {self.run!r} on the inference server at {self.base_url}: {e!r}")

    async def close(self) -> None:
        await self.http.aclose()


def check_checksum(path: Path, step: int, served: str | None) -> None:
    """Raise, as a failed probe does, unless the checksum of the weights the server reports it loaded from ``path``
    (``served``) is the trainer's: in its delta chain entry, or in the broadcast manifest of weights that may come
    as deltas; nothing to check for other weights."""
    info = read_delta_info(path)
    where, expected = (DELTA_INFO, info.checksum) if info is not None else (MANIFEST, manifest_checksum(path))
    if expected is not None and served != expected:
        raise TridentError(
            f"after reloading weights step {step}, the server's weights have checksum {served}, the trainer's "
            f"{expected} ({path / where}): the server does not serve the weights in {path}"
        )


def manifest_checksum(path: Path) -> str | None:
    """The checksum in the broadcast manifest of ``path`` (``[weights] delta``), None without one."""
    manifest = read_manifest(path)
    return None if manifest is None else manifest.get("checksum")
