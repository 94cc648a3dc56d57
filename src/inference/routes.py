"""Trident's routes on top of vLLM's OpenAI server: weight reload, weight info, and a logprob-format fix."""

import asyncio
import json
import logging
import os
import time
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel

# Under "vllm": vLLM configures its loggers at start-up and disables others created before then.
logger = logging.getLogger("vllm.trident")


class ReloadRequest(BaseModel):
    path: str
    step: int


def weights_router() -> APIRouter:
    """``POST /reload_weights {path, step}`` and ``GET /weights`` (the step being served)."""
    router = APIRouter()
    lock = asyncio.Lock()

    @router.post("/reload_weights")
    async def reload_weights(request: ReloadRequest, raw_request: Request) -> JSONResponse:
        state = raw_request.app.state
        engine = state.engine_client
        path = os.path.abspath(request.path)
        if not os.path.isdir(path):
            return JSONResponse({"error": f"weights folder not found: {path}"}, status_code=400)
        async with lock:
            start = time.perf_counter()
            # Finish in-flight requests on the old weights, swap, and drop KV computed with the old weights.
            await engine.pause_generation(mode="wait", clear_cache=True)
            try:
                await engine.collective_rpc("reload_weights_from", args=(path,))
                await engine.reset_prefix_cache()
                await engine.update_weight_version(str(request.step))
                state.trident_weights = {"step": request.step, "path": path}
            except Exception as e:
                logger.exception("reload_weights failed")
                return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
            finally:
                await engine.resume_generation()
            seconds = time.perf_counter() - start
            logger.info(f"reloaded weights step {request.step} from {path} in {seconds:.3f}s")
            return JSONResponse({"step": request.step, "path": path, "seconds": round(seconds, 4)})

    @router.get("/weights")
    async def weights(raw_request: Request) -> JSONResponse:
        return JSONResponse(raw_request.app.state.trident_weights)

    return router


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


def patch_generate_route(app: FastAPI) -> bool:
    """Wrap ``POST /inference/v1/generate`` so its logprobs carry the field the training client reads."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.entrypoints.serve.utils.api_utils import validate_json_request

    routes = app.router.routes
    index = next(
        (
            i
            for i, route in enumerate(routes)
            if isinstance(route, APIRoute) and route.path == "/inference/v1/generate" and "POST" in route.methods
        ),
        None,
    )
    if index is None or routes[index].endpoint.__name__ == "disabled_scale_out":
        return False
    original = routes[index].endpoint

    async def generate(request: GenerateRequest, raw_request: Request):
        response = await original(request, raw_request)
        if isinstance(response, StreamingResponse):
            inner = response.body_iterator

            async def rewrite():
                async for chunk in inner:
                    text = chunk.decode() if isinstance(chunk, bytes) else chunk
                    if text.startswith("data: {"):
                        text = "data: " + json.dumps(token_id_logprobs(json.loads(text[6:]))) + "\n\n"
                    yield text

            response.body_iterator = rewrite()
            return response
        if isinstance(response, JSONResponse) and response.status_code == 200:
            return JSONResponse(token_id_logprobs(json.loads(response.body)), background=response.background)
        return response

    del routes[index]
    app.add_api_route(
        "/inference/v1/generate", generate, methods=["POST"], dependencies=[Depends(validate_json_request)]
    )
    routes.insert(index, routes.pop())  # back in its place, before any mounts
    app.openapi_schema = None
    return True
