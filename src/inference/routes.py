"""Trident's routes on top of vLLM's OpenAI server: weight reloads, adapter swaps, what is served, and a
logprob-format fix."""

import asyncio
import base64
import io
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.datastructures import State

from contracts import inference_api as api
from contracts.delta_chain import read_delta_info
from contracts.run_dir import ADAPTER_CONFIG, is_adapter
from contracts.shared_config import RunId
from contracts.weight_manifest import read_manifest
from inference.runs import Run, Runs
from inference.security import check_delta, check_full_weights, check_manifest, checked_weights_path

# Under "vllm": vLLM configures its loggers at start-up and disables others created before then.
logger = logging.getLogger("vllm.trident")


class WeightsRoutes:
    """``POST /reload_weights`` and ``POST /load_adapter`` (both a :class:`~contracts.inference_api.WeightsRequest`, for
    ``step_N`` folders under ``weights_root`` only; broadcast weights through ``store`` only), ``POST
    /reset_weights`` (serve ``base_path``, the model the server started with, again), ``GET /weights``, ``GET
    /runs`` and ``POST /release_run``: each for one run (``run``; absent: the unnamed run), on :attr:`router`.

    Reads ``app.state``: ``engine_client`` and ``trident_runs`` (the runs served, :class:`~inference.runs.Runs`).
    """

    def __init__(self, weights_root: Path | None, base_path: str, store: tuple[str, int] | None = None):
        self.weights_root = weights_root
        self.base_path = base_path
        self.store = store
        self.lock = asyncio.Lock()  # one change of weights at a time
        self.full_weights_path = base_path  # what the model's own weights hold now (adapters come on top)
        self.router = APIRouter()
        self.router.add_api_route(api.RELOAD_WEIGHTS, self.reload_weights, methods=["POST"])
        self.router.add_api_route(api.RESET_WEIGHTS, self.reset_weights, methods=["POST"])
        self.router.add_api_route(api.LOAD_ADAPTER, self.load_adapter, methods=["POST"])
        self.router.add_api_route(api.WEIGHTS, self.weights, methods=["GET"])
        self.router.add_api_route(api.RUNS, self.run_shares, methods=["GET"])
        self.router.add_api_route(api.RELEASE_RUN, self.release_run, methods=["POST"])

    async def load_full_weights(
        self, state: State, path: str, step: int, manifest: dict | None = None, in_flight: bool = False
    ) -> JSONResponse:
        """Serve the full weights in ``path`` (files, or sent over the broadcast that ``manifest`` describes) as
        ``step`` to the unnamed run, no adapter; call holding :attr:`lock`. A 409 while named runs share the server:
        they sample the base it started with, or adapters trained on it.

        Requests in flight finish on the old weights before the swap, or with ``in_flight`` are paused where they
        are and go on with the new weights: their KV cache is dropped (they are preempted) and computed again
        under the new weights on resuming, so every token after the swap is the new policy's, and vLLM labels
        each request's tokens with the step that sampled them (``weight_versions``).
        """
        runs: Runs = state.trident_runs
        if sharing := sorted(runs.named()):
            raise HTTPException(409, f"runs {', '.join(sharing)} share this server on its base model: full weights "
                                     "cannot replace it under them")  # fmt: skip
        engine = state.engine_client
        start = time.perf_counter()
        # Drop KV computed with the old weights; pause where the requests are, or once they have finished.
        await engine.pause_generation(mode="keep" if in_flight else "wait", clear_cache=True)
        try:
            loaded = await engine.collective_rpc("load_weights", args=(path, manifest))
            if "gone" in loaded[0]:  # the trainer moved on: the orchestrator loads newer weights
                return JSONResponse({"error": f"{path}: {loaded[0]['gone']}"}, status_code=409)
            await engine.reset_prefix_cache()
            await engine.update_weight_version(str(step))
        except Exception as e:
            logger.exception("reload_weights failed")
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
        finally:
            await engine.resume_generation()
        paused_s = time.perf_counter() - start  # no request started (nor, in flight, went on) meanwhile
        self.full_weights_path = path
        unnamed = runs.get(None)
        if unnamed.adapters is not None:  # adapters were trained on the old base weights
            await unnamed.adapters.retire_all()
        return serving(unnamed, None, step, path, None, start, paused_s, loaded[0].get("checksum"))

    async def reload_weights(self, request: api.WeightsRequest, raw_request: Request) -> JSONResponse:
        if request.run is not None:
            raise HTTPException(400, f"run {request.run!r}: full weights cannot share a server; a named run loads "
                                     f"LoRA adapters ({api.LOAD_ADAPTER})")  # fmt: skip
        path = str(checked_weights_path(request.path, self.weights_root, request.step))
        if is_adapter(path):
            raise HTTPException(400, f"{path} holds a LoRA adapter: load it with {api.LOAD_ADAPTER}")
        try:
            manifest = read_manifest(path)  # sent by the trainer over the broadcast, or files
            delta = read_delta_info(path)  # files of a delta chain
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        if delta is not None and delta.kind == "delta":
            check_delta(Path(path), Path(self.base_path))
        elif manifest is None:
            check_full_weights(Path(path), Path(self.base_path))
        else:
            check_manifest(Path(path), manifest, self.store, Path(self.base_path))
        async with self.lock:
            return await self.load_full_weights(raw_request.app.state, path, request.step, manifest, request.in_flight)

    async def reset_weights(self, raw_request: Request, request: api.RunRequest | None = None) -> JSONResponse:
        """Serve the run the model the server started with, as step 0 and no adapter: a new run on a server that an
        earlier run used starts where a fresh server would. A named run's reset touches its own adapters only."""
        state = raw_request.app.state
        run = request.run if request is not None else None
        async with self.lock:
            await state.trident_runs.evict_idle()
            if run is None and self.full_weights_path != self.base_path:  # a run's full weights: read the base again
                return await self.load_full_weights(state, self.base_path, 0)
            target = state.trident_runs.get(run)
            if target.served == state.trident_runs.base():  # as a fresh server
                return JSONResponse(api.WeightsChange(**target.served.model_dump(), seconds=0.0).model_dump())
            if (adapters := target.adapters) is not None:
                # a named run's (re)start: nothing of it is in flight, and its room is free for another run at once
                await (adapters.retire_all() if run is None else adapters.remove_all())
            if run is None:  # the engine's label for tokens of the base model (named runs' tokens are relabelled)
                await state.engine_client.update_weight_version("0")
            return serving(target, run, 0, self.base_path, None, time.perf_counter())

    async def load_adapter(self, request: api.WeightsRequest, raw_request: Request) -> JSONResponse:
        state = raw_request.app.state
        runs: Runs = state.trident_runs
        if runs.new_adapters is None:
            raise HTTPException(400, "this server was started without [lora]: it cannot load adapters")
        path = str(checked_weights_path(request.path, self.weights_root, request.step))
        if not is_adapter(path):
            raise HTTPException(400, f"{path} holds no {ADAPTER_CONFIG}: load full weights with {api.RELOAD_WEIGHTS}")
        name = api.adapter_name(request.step, request.run)
        async with self.lock:
            await runs.evict_idle()
            if request.run is not None and self.full_weights_path != self.base_path:
                raise HTTPException(409, f"run {request.run!r}: this server serves full weights from "
                                         f"{self.full_weights_path}, not its base model; reset it first")  # fmt: skip
            run = runs.for_adapter(request.run)
            if name == run.served.adapter:
                raise HTTPException(409, f"adapter {name} is already served")
            start = time.perf_counter()
            await run.adapters.swap_in(name, path)  # the previous adapter keeps serving what started on it
            # vLLM labels every token with the engine's one version; a request naming an adapter is relabelled with
            # its step (adapter_weight_versions), so a named run's load leaves the unnamed run's label alone
            if request.run is None:
                await state.engine_client.update_weight_version(str(request.step))
            return serving(run, request.run, request.step, path, name, start)

    async def weights(self, raw_request: Request, run: RunId | None = None) -> JSONResponse:
        return JSONResponse(raw_request.app.state.trident_runs.served(run).model_dump())

    async def run_shares(self, raw_request: Request) -> JSONResponse:
        runs: Runs = raw_request.app.state.trident_runs
        async with self.lock:
            await runs.evict_idle()
        return JSONResponse({run: share.model_dump() for run, share in runs.shares().items()})

    async def release_run(self, request: api.RunRequest, raw_request: Request) -> JSONResponse:
        if request.run is None:
            raise HTTPException(400, f"{api.RELEASE_RUN} names the run that has ended ('run')")
        async with self.lock:
            released = await raw_request.app.state.trident_runs.release(request.run)
        if released:
            logger.info(f"run {request.run} released: its adapters are removed")
        return JSONResponse({"run": request.run, "released": released})


def serving(
    state: Run,
    run: str | None,
    step: int,
    path: str,
    adapter: str | None,
    start: float,
    paused_s: float = 0.0,
    checksum: str | None = None,
) -> JSONResponse:
    """Record what ``run`` (``state``) is now served; the answer to a weights change (``paused_s``: seconds
    generation was paused for it; ``checksum``: of the weights loaded, where the worker keeps a copy)."""
    state.served = api.Served(step=step, path=path, adapter=adapter)
    seconds = time.perf_counter() - start
    what = f"adapter {adapter}" if adapter else "weights"
    logger.info(f"serving {what} of step {step} from {path}{f' to run {run}' if run else ''} "
                f"(loaded in {seconds:.3f}s, paused {paused_s:.3f}s)")  # fmt: skip
    change = api.WeightsChange(
        **state.served.model_dump(), seconds=round(seconds, 4), paused_s=round(paused_s, 4), checksum=checksum
    )
    return JSONResponse(change.model_dump())


def token_id_logprobs(data: Any) -> Any:
    """Add ``"token": "token_id:N"`` beside each ``"token_id"`` in ``choices[*].logprobs.content``.

    vLLM 0.32's ``/inference/v1/generate`` names sampled tokens by ``token_id``; the renderers client that
    verifiers' training client uses only reads ``"token": "token_id:N"``.
    """
    if not isinstance(data, dict):
        return data
    for choice in data.get("choices") or []:
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        for entry in content or []:
            for item in [entry, *(entry.get("top_logprobs") or [])]:
                if "token_id" in item:
                    item.setdefault("token", f"token_id:{item['token_id']}")
    return data


def verifiers_routes(data: Any, start: int) -> Any:
    """Give each choice's ``routed_experts`` the form verifiers' training client reads.

    vLLM 0.32 returns a mixture-of-experts model's routes (with ``--enable-return-routed-experts``) as a base64
    ``.npy`` file of ``[tokens, layers, top_k]`` expert ids, for the tokens from the request's
    ``routed_experts_prompt_start`` (``start``) on; renderers and verifiers 0.4.0 read ``{"data": base64 of the raw
    ids, "shape", "dtype", "start"}``.
    """
    if not isinstance(data, dict):
        return data
    for choice in data.get("choices") or []:
        encoded = choice.get("routed_experts") if isinstance(choice, dict) else None
        if isinstance(encoded, str):
            routes = np.ascontiguousarray(np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False))
            choice["routed_experts"] = {
                "data": base64.b64encode(routes.tobytes()).decode("ascii"),
                "shape": list(routes.shape),
                "dtype": str(routes.dtype),
                "start": start,
            }
    return data


def adapter_weight_versions(data: Any, step: int | None) -> Any:
    """Label every token of each choice with ``step``, the step of the adapter the request named (None: it named
    none, and the engine's labels stand).

    vLLM labels tokens with the engine's one weight version, which :class:`WeightsRoutes` sets to each adapter the
    unnamed run loads (a named run's loads leave it alone: runs sharing the server are at other steps); but a
    request keeps the adapter it named to its end (adapters are swapped without a pause), so its tokens are that
    adapter's step.
    """
    if step is None or not isinstance(data, dict):
        return data
    for choice in data.get("choices") or []:
        if isinstance(choice, dict) and choice.get("weight_versions") is not None:
            count = len(choice.get("token_ids") or [])
            choice["weight_versions"] = [{"version": str(step), "start": 0, "end": count}]
    return data


def training_client_answer(data: Any, start: int, adapter_step: int | None = None) -> Any:
    """``/inference/v1/generate``'s answer as verifiers' training client reads it: :func:`token_id_logprobs`,
    :func:`verifiers_routes` and :func:`adapter_weight_versions`."""
    return adapter_weight_versions(verifiers_routes(token_id_logprobs(data), start), adapter_step)


def prompt_images(request: Any) -> int:
    """How many images a ``/inference/v1/generate`` request's prompt holds: its raw ``content_parts`` or its
    processed features' images."""
    if request.content_parts:
        return sum(str(part.get("type", "")).startswith("image") for part in request.content_parts)
    return len(request.features.mm_hashes.get("image", [])) if request.features else 0


def too_many_images(images: int, max_images: int) -> JSONResponse:
    """The answer (400, in vLLM's error form) to a prompt of ``images`` images, over ``max_images``: what to raise,
    and to what (vLLM's own answer names neither)."""
    message = (f"this prompt holds {images} images, over the server's [model] max_images_per_prompt = {max_images} "
               f"(inference config): raise it to {images} or more")  # fmt: skip
    error = {"message": message, "type": "BadRequestError", "param": "image", "code": 400}
    return JSONResponse({"error": error}, status_code=400)


def patch_generate_route(app: FastAPI, max_images: int | None = None) -> bool:
    """Wrap ``POST /inference/v1/generate`` so its logprobs and routes are in the form the training client reads, and
    a prompt of more than ``max_images`` images (None: no limit of ours) is refused naming the key that sets it."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.entrypoints.serve.utils.api_utils import validate_json_request

    routes = app.router.routes
    index = next(
        (
            i
            for i, route in enumerate(routes)
            if isinstance(route, APIRoute) and route.path == api.GENERATE and "POST" in route.methods
        ),
        None,
    )
    if index is None or routes[index].endpoint.__name__ == "disabled_scale_out":
        return False
    original = routes[index].endpoint

    async def generate(request: GenerateRequest, raw_request: Request):
        if max_images is not None and (images := prompt_images(request)) > max_images:
            return too_many_images(images, max_images)
        response = await original(request, raw_request)
        start = request.sampling_params.routed_experts_prompt_start
        step = api.adapter_step(request.model)
        if isinstance(response, StreamingResponse):
            inner = response.body_iterator

            async def rewrite():
                async for chunk in inner:
                    text = chunk.decode() if isinstance(chunk, bytes) else chunk
                    if text.startswith("data: {"):
                        text = "data: " + json.dumps(training_client_answer(json.loads(text[6:]), start, step)) + "\n\n"
                    yield text

            response.body_iterator = rewrite()
            return response
        if isinstance(response, JSONResponse) and response.status_code == 200:
            return JSONResponse(
                training_client_answer(json.loads(response.body), start, step), background=response.background
            )
        return response

    del routes[index]
    app.add_api_route(api.GENERATE, generate, methods=["POST"], dependencies=[Depends(validate_json_request)])
    routes.insert(index, routes.pop())  # back in its place, before any mounts
    app.openapi_schema = None
    return True
