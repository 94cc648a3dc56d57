"""Who may use the server, and which folders it loads weights from."""

import hmac
import os
from pathlib import Path

from fastapi import HTTPException
from safetensors import safe_open
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from contracts.delta_chain import DELTA_WEIGHTS
from contracts.errors import TridentError
from contracts.inference_api import API_KEY_ENV, OPEN_ROUTES, is_loopback
from contracts.run_dir import STABLE, step_of


def api_key_for(host: str) -> str | None:
    """The key requests must carry (``$TRIDENT_API_KEY``; None: no check), or an error for a host that others
    can reach without one."""
    key = os.environ.get(API_KEY_ENV) or None
    if key is None and not is_loopback(host):
        raise TridentError(
            f"host = {host!r} lets other machines reach the server, which can then load any weights: "
            f"set {API_KEY_ENV} to a secret (requests must send 'Authorization: Bearer <key>'), or use 127.0.0.1"
        )
    return key


class ApiKeyMiddleware:
    """Refuse every request but :data:`~contracts.inference_api.OPEN_ROUTES` unless it carries
    ``Authorization: Bearer <key>``.

    Deny by default: it also covers vLLM's own routes, whichever a vLLM version or its env vars add.
    """

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.key = key.encode()

    def authorized(self, scope: Scope) -> bool:
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_ROUTES or self.authorized(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await WebSocketClose(code=1008)(scope, receive, send)
        else:
            message = f"missing or wrong API key: send 'Authorization: Bearer ${API_KEY_ENV}'"
            await JSONResponse({"error": message}, status_code=401)(scope, receive, send)


def checked_weights_path(path: str, root: Path | None, step: int) -> Path:
    """``path`` resolved (``..`` and symlinks), if it is a complete weights folder the server may load as ``step``.

    403 without ``root`` or outside it; 400 unless it is a ``step_<step>`` folder with the ``STABLE`` marker.
    """
    if root is None:
        raise HTTPException(403, "this server loads no weights: start it with weights_root (--weights-root "
                                 "<output_dir>/weights of the run; rl sets it)")  # fmt: skip
    try:
        resolved = Path(path).resolve()
        outside = not resolved.is_relative_to(root.resolve())
        complete = resolved.is_dir() and (resolved / STABLE).is_file()
    except (OSError, ValueError, RuntimeError) as e:  # too long, a NUL byte, a symlink loop, not UTF-8
        raise HTTPException(400, f"{path!r} is not a usable path: {e}") from None
    if outside:
        raise HTTPException(403, f"{path} is outside weights_root {root}")
    if not complete:
        raise HTTPException(400, f"{path} is not a weights folder with a {STABLE} marker")
    if step_of(resolved) != step:
        raise HTTPException(400, f"{path} is not the folder of weights step {step} (step_{step})")
    return resolved


def tensor_shapes(folder: Path) -> dict[str, list[int]]:
    """The name and shape of every tensor in the ``*.safetensors`` files of ``folder`` (headers only)."""
    shapes = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as tensors:
            shapes |= {name: tensors.get_slice(name).get_shape() for name in tensors.keys()}
    return shapes


# A mixture of experts' fused expert weights (the trainer's in-memory layout, which vLLM loads as it is) and the
# per-expert weights each one holds in a checkpoint, in order: ``gate_up_proj`` [experts, 2 x width, hidden] is each
# expert's ``gate_proj`` [width, hidden] over its ``up_proj``; ``down_proj`` [experts, hidden, width] its ``down_proj``.
FUSED_EXPERT_WEIGHTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def per_expert_shapes(shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """``shapes`` with each fused expert weight (``….experts.gate_up_proj``, ``….experts.down_proj``: 3-d) under the
    names and shapes of the per-expert weights it holds in a checkpoint (``….experts.N.gate_proj.weight``, …)."""
    unfused = {}
    for name, shape in shapes.items():
        prefix, _, weight = name.rpartition(".experts.")
        parts = FUSED_EXPERT_WEIGHTS.get(weight, ()) if prefix else ()
        if len(shape) != 3 or not parts or shape[1] % len(parts):
            unfused[name] = shape
            continue
        experts, rows, columns = shape
        for expert in range(experts):
            for part in parts:
                unfused[f"{prefix}.experts.{expert}.{part}.weight"] = [rows // len(parts), columns]
    return unfused


def check_shapes(path: Path, shapes: dict[str, list[int]], base: Path) -> None:
    """400 unless ``shapes`` (of the weights in ``path``) are the tensors of the served model ``base``, of the same
    shapes (a tied ``lm_head`` may be absent; a mixture of experts' may come fused, :func:`per_expert_shapes`)."""
    shapes, expected = per_expert_shapes(shapes), tensor_shapes(base)
    unknown = sorted(shapes.keys() - expected.keys())
    wrong = sorted(name for name in shapes.keys() & expected.keys() if list(shapes[name]) != expected[name])
    missing = sorted(expected.keys() - shapes.keys() - {"lm_head.weight"})
    for fault, names in (("not in the served model", unknown), ("of another shape", wrong), ("missing", missing)):
        if expected and names:
            raise HTTPException(400, f"{path}: tensors {fault}: {', '.join(names[:3])}")


def check_full_weights(path: Path, base: Path) -> None:
    """400 unless ``path`` holds readable safetensors that fit the served model ``base`` (:func:`check_shapes`):
    weights that do not fit are refused before any is loaded."""
    try:
        shapes = tensor_shapes(path)
    except Exception as e:  # safetensors raises its own error types for truncated or malformed files
        raise HTTPException(400, f"{path}: unreadable safetensors ({type(e).__name__}: {e})") from None
    if not shapes:
        raise HTTPException(400, f"{path} holds no .safetensors weights")
    check_shapes(path, shapes, base)


def fused_expert_of(name: str, expected: dict) -> bool:
    """Whether ``name`` is a fused expert weight (:data:`FUSED_EXPERT_WEIGHTS`) of experts ``expected`` holds."""
    prefix, _, weight = name.rpartition(".experts.")
    parts = FUSED_EXPERT_WEIGHTS.get(weight, ()) if prefix else ()
    return bool(parts) and f"{prefix}.experts.0.{parts[0]}.weight" in expected


def check_delta(path: Path, base: Path) -> None:
    """400 unless ``path`` holds a readable delta file whose tensors are the served model ``base``'s (their sizes
    are checked as the deltas apply)."""
    try:
        with safe_open(path / DELTA_WEIGHTS, "pt") as tensors:
            names = {key.rpartition(":")[0] for key in tensors.keys()}
    except Exception as e:  # safetensors raises its own error types for missing, truncated or malformed files
        raise HTTPException(400, f"{path}: unreadable {DELTA_WEIGHTS} ({type(e).__name__}: {e})") from None
    expected = tensor_shapes(base)
    if unknown := sorted(name for name in names if name not in expected and not fused_expert_of(name, expected)):
        raise HTTPException(400, f"{path}: deltas of tensors not in the served model: {', '.join(unknown[:3])}")


def check_manifest(path: Path, manifest: dict, store: tuple[str, int] | None, base: Path) -> None:
    """403 unless the broadcast ``manifest`` of ``path`` names the configured ``store`` (host, port; None: the
    server takes no broadcast weights); 400 unless its tensors, each named once, fit the served model ``base``."""
    if store is None:
        raise HTTPException(403, f"{path} holds broadcast weights and this server has no weight_broadcast store "
                                 "configured (rl sets it from trainer.weight_broadcast)")  # fmt: skip
    named = (manifest["host"], manifest["port"])
    if named != tuple(store):
        raise HTTPException(403, f"{path}: broadcast store {named[0]}:{named[1]} is not the configured "
                                 f"weight_broadcast {store[0]}:{store[1]}")  # fmt: skip
    names = [tensor[0] for tensor in manifest["tensors"]]
    if len(set(names)) < len(names):
        raise HTTPException(400, f"{path}: a tensor is named twice in the broadcast manifest")
    check_shapes(path, {tensor[0]: tensor[1] for tensor in manifest["tensors"]}, base)
