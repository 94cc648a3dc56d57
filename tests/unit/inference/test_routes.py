from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from safetensors.torch import save_file
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

from inference.adapters import Adapters
from inference.routes import token_id_logprobs, weights_router
from rl.inference_api import adapter_name
from rl.protocol import ADAPTER_CONFIG, mark_stable


def test_token_id_logprobs_adds_token_field_everywhere():
    data = {
        "choices": [
            {
                "logprobs": {
                    "content": [
                        {"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 7, "logprob": -0.5}]},
                        {"token_id": 9, "logprob": -1.5, "top_logprobs": []},
                    ]
                }
            },
            {"logprobs": None},
        ]
    }
    out = token_id_logprobs(data)
    content = out["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["token_id:7", "token_id:9"]
    assert content[0]["top_logprobs"][0]["token"] == "token_id:7"
    assert content[0]["logprob"] == -0.5


class FakeEngine:
    """Records the engine calls the weight routes make."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append((name, *args))

        return call


class FakeModels:
    """vLLM's registry of served adapter names, as :class:`Adapters` uses it; ``calls`` records loads and
    unloads in order. A folder named ``broken`` fails to load as vLLM's does."""

    def __init__(self):
        self.calls = []
        self.lora_requests = {}
        self.next_id = 1

    async def load_lora_adapter(self, request):
        if request.lora_path.endswith("broken"):
            return ErrorResponse(error=ErrorInfo(message="not a peft adapter", type="BadRequestError", code=400))
        self.lora_requests[request.lora_name] = SimpleNamespace(lora_int_id=self.next_id)
        self.next_id += 1
        self.calls.append(("load", request.lora_name))

    async def unload_lora_adapter(self, request):
        del self.lora_requests[request.lora_name]
        self.calls.append(("retire", request.lora_name))


BASE = "/models/base"  # the model the fake server started with


def weights_app(root, lora: bool = True) -> tuple[TestClient, FakeEngine, FakeModels | None]:
    """The weight routes on a fake engine; with ``lora``, real :class:`Adapters` on a fake registry of names
    (returned, its ``calls`` recording each adapter loaded and retired)."""
    app = FastAPI()
    app.include_router(weights_router(root, BASE))
    app.state.engine_client = FakeEngine()
    models = FakeModels() if lora else None
    app.state.trident_adapters = Adapters(models, app.state.engine_client) if lora else None
    app.state.trident_weights = {"step": 0, "path": BASE, "adapter": None}
    return TestClient(app), app.state.engine_client, models


@pytest.fixture
def root(tmp_path):
    """Complete adapter folders step_1..3 and broken, full weights in full_1 and full_2, an incomplete one."""
    for name in ["step_1", "step_2", "step_3", "step_4", "broken", "full_1", "full_2", "unstable"]:
        (tmp_path / name).mkdir()
        if name.startswith("full"):  # the fake served model has no files: any readable weights fit it
            save_file({"w": torch.zeros(2)}, tmp_path / name / "model.safetensors")
        else:
            (tmp_path / name / ADAPTER_CONFIG).write_text("{}")
        if name != "unstable":
            mark_stable(tmp_path / name)
    return tmp_path


def test_load_adapter_serves_the_new_name_and_the_previous_until_the_next_swap(root):
    client, engine, adapters = weights_app(root)
    response = client.post("/load_adapter", json={"path": str(root / "step_1"), "step": 1})
    assert response.status_code == 200
    assert response.json()["adapter"] == adapter_name(1)
    assert adapters.calls == [("load", adapter_name(1))]
    assert ("update_weight_version", "1") in engine.calls
    assert client.get("/weights").json() == {"step": 1, "path": str(root / "step_1"), "adapter": adapter_name(1)}

    def swap(step: int) -> None:
        adapters.calls.clear()
        engine.calls.clear()
        assert client.post("/load_adapter", json={"path": str(root / f"step_{step}"), "step": step}).status_code == 200
        assert client.get("/weights").json()["adapter"] == adapter_name(step)

    swap(2)  # step 1's adapter keeps its name: rollouts started on it finish their turns on it
    assert adapters.calls == [("load", adapter_name(2))]
    assert set(adapters.lora_requests) == {adapter_name(1), adapter_name(2)}
    swap(3)  # the new one is loaded before the oldest loses its name, which stays resident
    assert adapters.calls == [("load", adapter_name(3)), ("retire", adapter_name(1))]
    assert set(adapters.lora_requests) == {adapter_name(2), adapter_name(3)}
    assert "remove_lora" not in [c[0] for c in engine.calls]
    swap(4)  # step 1's adapter is freed at the swap after it lost its name
    assert ("remove_lora", 1) in engine.calls
    assert adapters.calls == [("load", adapter_name(4)), ("retire", adapter_name(2))]
    assert "pause_generation" not in [c[0] for c in engine.calls]  # generation never stops for an adapter


def test_load_adapter_refusals_keep_the_served_adapter(root):
    client, _, adapters = weights_app(root)
    client.post("/load_adapter", json={"path": str(root / "step_1"), "step": 1})
    served = client.get("/weights").json()
    adapters.calls.clear()
    for body, status in [
        ({"path": str(root / "step_1"), "step": 1}, 409),  # the served name again
        ({"path": str(root / "broken"), "step": 3}, 400),  # vLLM refuses the folder
        ({"path": str(root / "unstable"), "step": 3}, 400),
        ({"path": str(root / "full_1"), "step": 3}, 400),  # full weights, no adapter
        ({"path": str(root / ".." / "elsewhere"), "step": 3}, 403),
        ({"path": str(root / "step_3"), "step": -1}, 422),
    ]:
        assert client.post("/load_adapter", json=body).status_code == status, body
    assert client.get("/weights").json() == served
    assert ("retire", adapter_name(1)) not in adapters.calls


def test_load_adapter_without_lora_is_refused(root):
    client, _, _ = weights_app(root, lora=False)
    response = client.post("/load_adapter", json={"path": str(root / "step_1"), "step": 1})
    assert response.status_code == 400
    assert "[lora]" in response.text


def test_reload_weights_swaps_paused_and_retires_the_adapters(root):
    client, engine, adapters = weights_app(root)
    client.post("/load_adapter", json={"path": str(root / "step_1"), "step": 1})
    client.post("/load_adapter", json={"path": str(root / "step_3"), "step": 3})
    engine.calls.clear()
    response = client.post("/reload_weights", json={"path": str(root / "full_2"), "step": 2})
    assert response.status_code == 200
    assert [c[0] for c in engine.calls] == [
        "pause_generation", "collective_rpc", "reset_prefix_cache", "update_weight_version", "resume_generation"
    ]  # fmt: skip
    assert engine.calls[1] == ("collective_rpc", "reload_weights_from")
    # both named adapters were trained on the old base weights
    assert adapters.calls[-2:] == [("retire", adapter_name(1)), ("retire", adapter_name(3))]
    assert adapters.lora_requests == {}
    assert client.get("/weights").json() == {"step": 2, "path": str(root / "full_2"), "adapter": None}
    assert client.post("/reload_weights", json={"path": str(root / "step_3"), "step": 3}).status_code == 400
    assert client.post("/reload_weights", json={"path": str(root / "unstable"), "step": 3}).status_code == 400
    assert client.post("/reload_weights", json={"path": "/", "step": 3}).status_code == 403
    assert client.get("/weights").json()["step"] == 2


def test_reset_weights_serves_the_base_model_again_so_a_new_run_can_reuse_the_server(root):
    client, engine, adapters = weights_app(root)
    base = {"step": 0, "path": BASE, "adapter": None}
    assert client.post("/reset_weights").json() | {"seconds": 0} == base | {"seconds": 0}
    assert engine.calls == [] and adapters.calls == []  # a fresh server: nothing to do

    client.post("/load_adapter", json={"path": str(root / "step_1"), "step": 1})  # an earlier run's adapter
    engine.calls.clear()
    assert client.post("/reset_weights").status_code == 200
    assert adapters.calls[-1] == ("retire", adapter_name(1))
    assert "collective_rpc" not in [c[0] for c in engine.calls]  # the base weights never changed
    assert client.get("/weights").json() == base
    # the next run's first adapter has the earlier run's first name: no conflict any more
    assert client.post("/load_adapter", json={"path": str(root / "step_1"), "step": 1}).status_code == 200

    client.post("/reload_weights", json={"path": str(root / "full_2"), "step": 2})  # an earlier run's weights
    engine.calls.clear()
    assert client.post("/reset_weights").status_code == 200
    assert engine.calls[0][0] == "pause_generation" and ("collective_rpc", "reload_weights_from") in engine.calls
    assert ("update_weight_version", "0") in engine.calls
    assert client.get("/weights").json() == base
