from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from safetensors.torch import save_file
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

from contracts.delta_chain import DELTA_WEIGHTS, DeltaInfo, write_delta_info
from contracts.inference_api import adapter_name
from contracts.run_dir import ADAPTER_CONFIG, mark_stable
from contracts.weight_manifest import read_manifest, write_manifest
from inference.adapters import Adapters
from inference.routes import WeightsRoutes, token_id_logprobs, training_client_answer
from inference.runs import Runs


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
    """Records the engine calls the weight routes make; answers each with ``answers[name]`` (None by default; a
    worker's receipt for the weights it received)."""

    def __init__(self):
        self.calls = []
        self.keywords = []  # (name, keyword arguments) of each call
        self.answers = {"collective_rpc": [{"tensors": 2, "seconds": 0.0}]}

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append((name, *args))
            self.keywords.append((name, kwargs))
            return self.answers.get(name)

        return call


class FakeModels:
    """vLLM's registry of served adapter names (``OpenAIServingModels``), as :class:`Adapters` uses it; ``calls``
    records loads and unloads in order. As vLLM's does, it refuses a name already served (400: it never overwrites
    one; :data:`VLLM_REFUSES_A_NAME_TWICE`) and a name it does not serve (404), and gives each adapter loaded its
    own engine id and keeps its path. A folder under ``broken/`` fails to load as vLLM's does."""

    def __init__(self):
        self.calls = []
        self.lora_requests = {}
        self.next_id = 1

    async def load_lora_adapter(self, request):
        if request.lora_name in self.lora_requests and not request.load_inplace:
            message = f"The lora adapter '{request.lora_name}' has already been loaded."
            return ErrorResponse(error=ErrorInfo(message=message, type="InvalidUserInput", code=400))
        if "broken" in Path(request.lora_path).parts:
            return ErrorResponse(error=ErrorInfo(message="not a peft adapter", type="BadRequestError", code=400))
        self.lora_requests[request.lora_name] = SimpleNamespace(lora_int_id=self.next_id, lora_path=request.lora_path)
        self.next_id += 1
        self.calls.append(("load", request.lora_name))

    async def unload_lora_adapter(self, request):
        if request.lora_name not in self.lora_requests:
            message = f"The lora adapter '{request.lora_name}' cannot be found."
            return ErrorResponse(error=ErrorInfo(message=message, type="NotFoundError", code=404))
        del self.lora_requests[request.lora_name]
        self.calls.append(("retire", request.lora_name))


# The checks in the installed vLLM's OpenAIServingModels that FakeModels does as it does (read from its source, not
# imported: importing it costs about 8 s of CPU)
VLLM_REFUSES_A_NAME_TWICE = "if not request.load_inplace and request.lora_name in self.lora_requests:"
VLLM_REFUSES_AN_UNKNOWN_NAME = "if request.lora_name not in self.lora_requests:"


def test_the_fake_registry_refuses_names_as_vllms_does():
    import asyncio
    import importlib.util

    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    vllm = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    source = (vllm / "entrypoints" / "openai" / "models" / "serving.py").read_text()
    assert VLLM_REFUSES_A_NAME_TWICE in source and VLLM_REFUSES_AN_UNKNOWN_NAME in source
    models = FakeModels()

    async def calls():
        load = LoadLoRAAdapterRequest(lora_name="a/lora-step-1", lora_path="/a/step_1")
        assert await models.load_lora_adapter(load) is None
        again = await models.load_lora_adapter(load.model_copy(update={"lora_path": "/b/step_1"}))
        assert again.error.code == 400 and models.lora_requests["a/lora-step-1"].lora_path == "/a/step_1"
        assert (await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name="b/lora-step-1"))).error.code == 404

    asyncio.run(calls())


BASE = "/models/base"  # the model the fake server started with


def weights_app(
    root, lora: bool = True, base: str = BASE, store: tuple[str, int] | None = None, **runs
) -> tuple[TestClient, FakeEngine, FakeModels | None]:
    """The weight routes on a fake engine serving ``base``; with ``lora``, real :class:`Adapters` on a fake registry
    of names (returned, its ``calls`` recording each adapter loaded and retired); ``runs``: :class:`Runs`'
    arguments (by default 3 named runs at once, 8 slots, 60 s to idle)."""
    app = FastAPI()
    app.include_router(WeightsRoutes(root, base, store).router)
    app.state.engine_client = engine = FakeEngine()
    models = FakeModels() if lora else None
    new_adapters = (lambda: Adapters(models, engine)) if lora else None
    app.state.trident_runs = Runs(base, new_adapters, **{"slots": 8, "max_named": 3, "idle_timeout_s": 60} | runs)
    return TestClient(app), engine, models


@pytest.fixture
def root(tmp_path):
    """Complete adapter folders step_1..4 and broken/step_3, full weights in full/step_2 and full/step_3, an
    incomplete unstable/step_3."""
    for name in [
        "step_1",
        "step_2",
        "step_3",
        "step_4",
        "broken/step_3",
        "full/step_2",
        "full/step_3",
        "unstable/step_3",
    ]:
        (tmp_path / name).mkdir(parents=True)
        if name.startswith("full"):  # the fake served model has no files: any readable weights fit it
            save_file({"w": torch.zeros(2)}, tmp_path / name / "model.safetensors")
        else:
            (tmp_path / name / ADAPTER_CONFIG).write_text("{}")
        if not name.startswith("unstable"):
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
        ({"path": str(root / "broken" / "step_3"), "step": 3}, 400),  # vLLM refuses the folder
        ({"path": str(root / "unstable" / "step_3"), "step": 3}, 400),
        ({"path": str(root / "full" / "step_3"), "step": 3}, 400),  # full weights, no adapter
        ({"path": str(root / "step_2"), "step": 3}, 400),  # step 2's adapter under step 3's number
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
    engine.keywords.clear()
    response = client.post("/reload_weights", json={"path": str(root / "full" / "step_2"), "step": 2})
    assert response.status_code == 200
    assert [c[0] for c in engine.calls] == [
        "pause_generation", "collective_rpc", "reset_prefix_cache", "update_weight_version", "resume_generation"
    ]  # fmt: skip
    assert engine.calls[1] == ("collective_rpc", "load_weights")
    assert engine.keywords[1] == ("collective_rpc", {"args": (str(root / "full" / "step_2"), None)})  # files
    # both named adapters were trained on the old base weights
    assert adapters.calls[-2:] == [("retire", adapter_name(1)), ("retire", adapter_name(3))]
    assert adapters.lora_requests == {}
    assert client.get("/weights").json() == {"step": 2, "path": str(root / "full" / "step_2"), "adapter": None}
    assert client.post("/reload_weights", json={"path": str(root / "step_3"), "step": 3}).status_code == 400
    assert (
        client.post("/reload_weights", json={"path": str(root / "unstable" / "step_3"), "step": 3}).status_code == 400
    )
    assert client.post("/reload_weights", json={"path": str(root / "full" / "step_2"), "step": 3}).status_code == 400
    assert client.post("/reload_weights", json={"path": "/", "step": 3}).status_code == 403
    assert client.get("/weights").json()["step"] == 2


def test_in_flight_reload_pauses_keeping_requests_and_says_how_long_generation_stopped(root):
    """Without in_flight the pause waits for the requests in flight to finish; with it, vLLM keeps them where they
    are (mode keep), and both drop the KV cache computed with the old weights."""
    for in_flight, mode in [(False, "wait"), (True, "keep")]:
        client, engine, _ = weights_app(root)
        body = {"path": str(root / "full" / "step_2"), "step": 2, "in_flight": in_flight}
        answer = client.post("/reload_weights", json=body).json()
        assert ("pause_generation", {"mode": mode, "clear_cache": True}) in engine.keywords
        assert 0 <= answer["paused_s"] <= answer["seconds"]


def test_tokens_of_a_request_naming_an_adapter_are_labelled_with_its_step():
    """vLLM labels tokens with the engine's one weight version, which moves on when a newer adapter is loaded; a
    request keeps the adapter it named, so its tokens are that adapter's step."""
    answer = {"choices": [{"token_ids": [4, 5, 6], "weight_versions": [{"version": "3", "start": 0, "end": 3}]}]}
    assert training_client_answer(answer, 0, adapter_step=2)["choices"][0]["weight_versions"] == [
        {"version": "2", "start": 0, "end": 3}
    ]
    engine_labels = [{"version": "0", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 3}]
    answer = {"choices": [{"token_ids": [4, 5, 6], "weight_versions": engine_labels}]}
    assert training_client_answer(answer, 0)["choices"][0]["weight_versions"] == engine_labels  # the base model


def test_reset_weights_serves_the_base_model_again_so_a_new_run_can_reuse_the_server(root):
    client, engine, adapters = weights_app(root)
    base = {"step": 0, "path": BASE, "adapter": None}
    timed = {"seconds": 0, "paused_s": 0, "checksum": None}
    assert client.post("/reset_weights").json() | timed == base | timed
    assert engine.calls == [] and adapters.calls == []  # a fresh server: nothing to do

    client.post("/load_adapter", json={"path": str(root / "step_1"), "step": 1})  # an earlier run's adapter
    engine.calls.clear()
    assert client.post("/reset_weights").status_code == 200
    assert adapters.calls[-1] == ("retire", adapter_name(1))
    assert "collective_rpc" not in [c[0] for c in engine.calls]  # the base weights never changed
    assert client.get("/weights").json() == base
    # the next run's first adapter has the earlier run's first name: no conflict any more
    assert client.post("/load_adapter", json={"path": str(root / "step_1"), "step": 1}).status_code == 200

    client.post("/reload_weights", json={"path": str(root / "full" / "step_2"), "step": 2})  # an earlier run's weights
    engine.calls.clear()
    assert client.post("/reset_weights").status_code == 200
    assert engine.calls[0][0] == "pause_generation" and ("collective_rpc", {"args": (BASE, None)}) in engine.keywords
    assert ("update_weight_version", "0") in engine.calls
    assert client.get("/weights").json() == base


def test_a_server_without_weights_root_refuses_every_reload(root):
    client, engine, _ = weights_app(None)
    for route, folder in [("/reload_weights", root / "full" / "step_2"), ("/load_adapter", root / "step_2")]:
        response = client.post(route, json={"path": str(folder), "step": 2})
        assert response.status_code == 403 and "weights_root" in response.text, response.text
    assert engine.calls == []


STORE = ("127.0.0.1", 29510)  # the configured weight_broadcast


@pytest.fixture
def served_model(tmp_path):
    """The served model's folder: two tensors the manifests below announce."""
    base = tmp_path / "base"
    base.mkdir()
    save_file({"embed.weight": torch.zeros(8, 4), "norm.weight": torch.zeros(4)}, base / "model.safetensors")
    return base


def manifest_folder(folder, host: str = STORE[0], port: int = STORE[1], tensors=None) -> str:
    """A stable weights folder holding a gloo broadcast manifest (by default: the served model's tensors)."""
    tensors = tensors or [["embed.weight", [8, 4], "float32"], ["norm.weight", [4], "float32"]]
    manifest = {"host": host, "port": port, "session": "s", "backend": "gloo", "timeout_s": 5, "sequence": 1,
                "tensors": tensors}  # fmt: skip
    folder.mkdir(parents=True)
    write_manifest(folder, manifest)
    mark_stable(folder)
    return str(folder)


def test_a_broadcast_manifest_is_received_only_through_the_configured_store_and_for_the_served_shapes(
    tmp_path, served_model
):
    root = tmp_path / "weights"
    client, engine, _ = weights_app(root, base=str(served_model), store=STORE)
    refused = [
        (manifest_folder(root / "a" / "step_1", port=29511), 403, "is not the configured weight_broadcast"),
        (manifest_folder(root / "b" / "step_1", host="10.0.0.9"), 403, "10.0.0.9:29510"),
        (manifest_folder(root / "c" / "step_1", tensors=[["embed.weight", [10**9, 4], "float32"]]), 400, "shape"),
        (manifest_folder(root / "d" / "step_1", tensors=[["norm.weight", [4], "float32"]] * 2), 400, "twice"),
        (manifest_folder(root / "e" / "step_1", tensors=[["embed.weight", [8, 4], "float32"]]), 400, "missing"),
        (manifest_folder(root / "f" / "step_1", tensors=[["x", [4], "float32"]]), 400, "not in the served"),
        (manifest_folder(root / "g" / "step_1", tensors=[["norm.weight", [4], "int64"]]), 400, "not a broadcast"),
        (manifest_folder(tmp_path / "elsewhere" / "step_1"), 403, "outside weights_root"),
    ]
    for path, status, reason in refused:
        response = client.post("/reload_weights", json={"path": path, "step": 1})
        assert response.status_code == status and reason in response.text, (path, response.text)
    assert engine.calls == []  # nothing paused, nothing received
    path = manifest_folder(root / "step_1")
    response = client.post("/reload_weights", json={"path": path, "step": 1})
    assert response.status_code == 200, response.text
    assert engine.calls[1] == ("collective_rpc", "load_weights")
    assert engine.keywords[1] == ("collective_rpc", {"args": (path, read_manifest(path))})


def delta_folder(folder, tensors: dict) -> str:
    """A stable weights folder holding a delta of a chain (its full copy at step 1) with these tensors."""
    folder.mkdir(parents=True)
    save_file(tensors, folder / DELTA_WEIGHTS)
    write_delta_info(folder, DeltaInfo(step=2, kind="delta", full_step=1, base_step=1, base_checksum="0" * 16,
                                       checksum="1" * 16, dtype="float32"))  # fmt: skip
    mark_stable(folder)
    return str(folder)


def test_a_delta_is_loaded_only_for_the_served_tensors_and_its_checksum_answered(tmp_path, served_model):
    root = tmp_path / "weights"
    client, engine, _ = weights_app(root, base=str(served_model))
    sparse = {"norm.weight:indices": torch.tensor([1], dtype=torch.int32), "norm.weight:values": torch.ones(1)}
    refused = [
        (delta_folder(root / "a" / "step_2", {"x:dense": torch.zeros(4)}), "deltas of tensors not in the served"),
        (delta_folder(root / "b" / "step_2", sparse), "unreadable"),
    ]
    (root / "b" / "step_2" / DELTA_WEIGHTS).write_bytes(b"not safetensors")
    for path, reason in refused:
        response = client.post("/reload_weights", json={"path": path, "step": 2})
        assert response.status_code == 400 and reason in response.text, (path, response.text)
    assert engine.calls == []  # nothing paused, nothing loaded
    engine.answers["collective_rpc"] = [{"seconds": 0.0, "checksum": "1" * 16}]  # the worker's copy's
    path = delta_folder(root / "step_2", sparse)
    response = client.post("/reload_weights", json={"path": path, "step": 2})
    assert response.status_code == 200 and response.json()["checksum"] == "1" * 16, response.text
    assert engine.keywords[1] == ("collective_rpc", {"args": (path, None)})  # the worker reads the chain itself


def test_broadcast_weights_the_trainer_no_longer_holds_are_a_409_and_nothing_changes(tmp_path, served_model):
    root = tmp_path / "weights"
    client, engine, _ = weights_app(root, base=str(served_model), store=STORE)
    engine.answers["collective_rpc"] = [{"gone": "the trainer has sent newer weights than 1 of its session"}]
    response = client.post("/reload_weights", json={"path": manifest_folder(root / "step_1"), "step": 1})
    assert response.status_code == 409 and "the trainer has sent newer weights than 1" in response.text
    assert client.get("/weights").json()["step"] == 0  # still the base model
    assert ("resume_generation",) in engine.calls and ("update_weight_version", "1") not in engine.calls


def test_a_server_without_weight_broadcast_takes_no_broadcast_weights(tmp_path, served_model):
    root = tmp_path / "weights"
    client, engine, _ = weights_app(root, base=str(served_model))
    response = client.post("/reload_weights", json={"path": manifest_folder(root / "step_1"), "step": 1})
    assert response.status_code == 403 and "weight_broadcast" in response.text
    assert engine.calls == []


def test_vllms_routes_reach_the_training_client_in_the_form_it_reads():
    """vLLM 0.32 answers with a base64 .npy of the routes; renderers' parser and verifiers read data/shape/start."""
    import binascii

    from renderers.client import parse_generate_response
    from vllm.utils.serial_utils import numpy2base64

    routes = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    answer = JSONResponse(
        training_client_answer({"choices": [{"token_ids": [1], "routed_experts": numpy2base64(routes)}]}, 3)
    )
    payload = parse_generate_response(answer.body)["choices"][0]["routed_experts"]
    assert payload["start"] == 3 and payload["shape"] == [5, 2, 2]
    # verifiers' _attribute_routed_experts decodes it so
    decoded = np.frombuffer(binascii.a2b_base64(payload["data"]), dtype=np.dtype(payload["dtype"])).reshape(
        payload["shape"]
    )
    assert np.array_equal(decoded, routes)
    assert training_client_answer({"choices": [{"routed_experts": None}]}, 0)["choices"][0]["routed_experts"] is None


@pytest.fixture
def runs_root(root):
    """:func:`root`, and adapter folders a/step_1..3, b/step_1..3, c/step_1 and d/step_1 of the named runs a to d."""
    for name in ["a/step_1", "a/step_2", "a/step_3", "b/step_1", "b/step_2", "b/step_3", "c/step_1", "d/step_1"]:
        (root / name).mkdir(parents=True)
        (root / name / ADAPTER_CONFIG).write_text("{}")
        mark_stable(root / name)
    return root


def load(client: TestClient, root, step: int, run: str | None = None):
    folder = root / run / f"step_{step}" if run else root / f"step_{step}"
    return client.post("/load_adapter", json={"path": str(folder), "step": step, "run": run})


def test_named_runs_load_and_retire_only_their_own_adapters_and_leave_the_engines_label_alone(runs_root):
    client, engine, adapters = weights_app(runs_root)
    assert load(client, runs_root, 1).status_code == 200  # the unnamed run, as ever
    engine.calls.clear()
    for step in (1, 2, 3):
        response = load(client, runs_root, step, "a")
        assert response.status_code == 200 and response.json()["adapter"] == adapter_name(step, "a")
    assert load(client, runs_root, 1, "b").status_code == 200
    # a's third adapter retired a's first only; b's and the unnamed run's stay served
    assert set(adapters.lora_requests) == {adapter_name(1), adapter_name(2, "a"), adapter_name(3, "a"),
                                           adapter_name(1, "b")}  # fmt: skip
    assert "update_weight_version" not in [c[0] for c in engine.calls]  # runs sharing the server are at other steps
    assert client.get("/weights", params={"run": "a"}).json() == {
        "step": 3, "path": str(runs_root / "a" / "step_3"), "adapter": adapter_name(3, "a")
    }  # fmt: skip
    assert client.get("/weights").json()["adapter"] == adapter_name(1)
    assert client.get("/weights", params={"run": "new"}).json() == {"step": 0, "path": BASE, "adapter": None}
    assert load(client, runs_root, 3, "a").status_code == 409  # its served name again
    shares = client.get("/runs").json()
    assert set(shares) == {"a", "b"} and shares["a"]["step"] == 3 and shares["b"]["adapter"] == adapter_name(1, "b")
    assert shares["a"] | {"waited_s": 0} == {"step": 3, "path": str(runs_root / "a" / "step_3"),
                                             "adapter": adapter_name(3, "a"), "in_flight": 0, "limit": 8,
                                             "waiting": 0, "waited_s": 0, "requests": 0}  # fmt: skip


def test_two_runs_adapters_at_the_same_step_are_served_apart_under_their_names_on_a_registry_like_vllms(runs_root):
    """The names are the ones clients send as ``model``, written out (not made by ``adapter_name``); the registry
    refuses a name loaded twice, as vLLM's does, so two runs at the same step sharing a name could not both load."""
    client, _, models = weights_app(runs_root)
    for step, run in [(1, None), (1, "a"), (1, "b"), (2, "a"), (2, "b")]:
        response = load(client, runs_root, step, run)
        assert response.status_code == 200, response.text
    for run, name in [("a", "a/lora-step-3"), ("b", "b/lora-step-3")]:  # each retires its own step 1
        assert load(client, runs_root, 3, run).json()["adapter"] == name
    served = {name: request.lora_path for name, request in models.lora_requests.items()}
    assert served == {
        "lora-step-1": str(runs_root / "step_1"),
        "a/lora-step-2": str(runs_root / "a" / "step_2"),
        "a/lora-step-3": str(runs_root / "a" / "step_3"),
        "b/lora-step-2": str(runs_root / "b" / "step_2"),
        "b/lora-step-3": str(runs_root / "b" / "step_3"),
    }
    assert len({request.lora_int_id for request in models.lora_requests.values()}) == 5  # five adapters in the engine
    assert client.get("/weights").json()["adapter"] == "lora-step-1"
    assert [client.get("/weights", params={"run": run}).json()["adapter"] for run in "ab"] == [
        "a/lora-step-3", "b/lora-step-3"
    ]  # fmt: skip
    assert client.post("/release_run", json={"run": "a"}).status_code == 200
    assert set(models.lora_requests) == {"lora-step-1", "b/lora-step-2", "b/lora-step-3"}


def test_full_weights_cannot_share_a_server(runs_root):
    client, engine, _ = weights_app(runs_root)
    full = {"path": str(runs_root / "full" / "step_2"), "step": 2}
    response = client.post("/reload_weights", json=full | {"run": "a"})
    assert response.status_code == 400 and "full weights cannot share a server" in response.text
    load(client, runs_root, 1, "a")
    load(client, runs_root, 1, "b")
    response = client.post("/reload_weights", json=full)  # the unnamed run's: it would change the base under a, b
    assert response.status_code == 409 and "runs a, b share this server" in response.text
    assert "pause_generation" not in [c[0] for c in engine.calls]
    assert client.post("/reset_weights").status_code == 200  # the unnamed run's reset keeps the base: allowed
    assert client.get("/weights", params={"run": "a"}).json()["adapter"] == adapter_name(1, "a")

    client.post("/release_run", json={"run": "a"})
    client.post("/release_run", json={"run": "b"})
    client.post("/reset_weights", json={"run": "c"})  # a run at step 0, sampling the base model
    assert client.post("/reload_weights", json=full).status_code == 409
    client.post("/release_run", json={"run": "c"})
    assert client.post("/reload_weights", json=full).status_code == 200  # no run shares it any more
    response = load(client, runs_root, 2, "a")  # an adapter on the unnamed run's full weights
    assert response.status_code == 409 and "not its base model" in response.text


def test_a_named_runs_reset_removes_its_own_adapters_only(runs_root):
    client, engine, adapters = weights_app(runs_root)
    for step, run in [(1, None), (1, "a"), (2, "a"), (1, "b")]:
        load(client, runs_root, step, run)
    engine.calls.clear()
    response = client.post("/reset_weights", json={"run": "a"})
    assert response.status_code == 200 and response.json()["adapter"] is None
    assert set(adapters.lora_requests) == {adapter_name(1), adapter_name(1, "b")}
    assert sorted(c[1] for c in engine.calls if c[0] == "remove_lora") == [2, 3]  # a's, freed at once
    assert "update_weight_version" not in [c[0] for c in engine.calls]
    assert client.get("/weights", params={"run": "a"}).json() == {"step": 0, "path": BASE, "adapter": None}
    assert client.get("/weights").json()["adapter"] == adapter_name(1)
    assert load(client, runs_root, 1, "a").status_code == 200  # its first name again, as a fresh server


def test_releasing_a_run_removes_its_adapters_and_keeps_the_others(runs_root):
    client, engine, adapters = weights_app(runs_root)
    for step, run in [(1, "a"), (2, "a"), (3, "a"), (1, "b")]:
        load(client, runs_root, step, run)
    response = client.post("/release_run", json={"run": "a"})
    assert response.status_code == 200 and response.json() == {"run": "a", "released": True}
    assert set(adapters.lora_requests) == {adapter_name(1, "b")}
    # all three of a's adapters are freed now: its two named and the one it retired
    assert sorted(c[1] for c in engine.calls if c[0] == "remove_lora") == [1, 2, 3]
    assert set(client.get("/runs").json()) == {"b"}
    assert client.post("/release_run", json={"run": "a"}).json()["released"] is False
    assert client.post("/release_run", json={}).status_code == 400  # the unnamed run never ends on the server


def test_a_run_beyond_what_max_loras_holds_is_refused_until_one_is_released(runs_root):
    client, _, _ = weights_app(runs_root, max_named=2)
    assert load(client, runs_root, 1, "a").status_code == 200
    assert load(client, runs_root, 1, "b").status_code == 200
    response = load(client, runs_root, 1, "c")
    assert response.status_code == 409 and "max_loras" in response.text and "'c'" in response.text
    assert load(client, runs_root, 2, "a").status_code == 200  # the runs already there go on
    assert load(client, runs_root, 1).status_code == 200  # and so does the unnamed run
    client.post("/release_run", json={"run": "b"})
    assert load(client, runs_root, 1, "c").status_code == 200


def test_a_run_that_sent_nothing_for_the_idle_timeout_is_evicted(runs_root):
    now = [0.0]
    client, _, adapters = weights_app(runs_root, idle_timeout_s=60, clock=lambda: now[0])
    load(client, runs_root, 1, "a")
    now[0] = 40.0
    load(client, runs_root, 1, "b")
    now[0] = 61.0  # a: 61 s since its last call; b: 21 s
    assert set(client.get("/runs").json()) == {"b"}
    assert set(adapters.lora_requests) == {adapter_name(1, "b")}
    now[0] = 90.0
    client.get("/weights", params={"run": "b"})  # a weights call keeps it
    now[0] = 149.0
    load(client, runs_root, 1, "c")
    assert set(client.get("/runs").json()) == {"b", "c"}


def test_a_prompt_over_the_image_limit_is_refused_naming_the_key_and_the_count_it_needs():
    from contracts.inference_api import GENERATE
    from inference.routes import patch_generate_route

    app = FastAPI()

    @app.post(GENERATE)
    async def generate(request: dict, raw_request: Request):  # vLLM's own route: answers whatever reaches it
        return JSONResponse({"choices": []})

    assert patch_generate_route(app, max_images=4)
    image = {"type": "image_url", "url": "data:image/png;base64,AAAA"}
    client = TestClient(app)
    over = client.post(GENERATE, json={"token_ids": [1, 2], "sampling_params": {}, "content_parts": [image] * 6})
    assert over.status_code == 400
    assert over.json()["error"]["message"] == (
        "this prompt holds 6 images, over the server's [model] max_images_per_prompt = 4 (inference config): raise "
        "it to 6 or more"
    )
    within = client.post(GENERATE, json={"token_ids": [1, 2], "sampling_params": {}, "content_parts": [image] * 4})
    assert within.status_code == 200
