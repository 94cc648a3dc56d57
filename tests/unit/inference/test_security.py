import logging
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

import inference.main
import inference.server
from contracts.errors import TridentError
from contracts.inference_api import is_loopback
from contracts.run_dir import mark_stable
from inference.security import (
    API_KEY_ENV,
    ApiKeyMiddleware,
    api_key_for,
    check_shapes,
    checked_weights_path,
    tensor_shapes,
)
from trainer.export import untied


@pytest.mark.parametrize(
    "host, loopback",
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("example.org", False), ("", False)],
)  # fmt: skip
def test_is_loopback(host, loopback):
    assert is_loopback(host) == loopback


def test_a_reachable_host_needs_a_key(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_for("127.0.0.1") is None  # loopback without a key: no check
    with pytest.raises(TridentError, match=r"host = '0.0.0.0' .* set TRIDENT_API_KEY"):
        api_key_for("0.0.0.0")
    monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(TridentError):
        api_key_for("0.0.0.0")
    monkeypatch.setenv(API_KEY_ENV, "s3cret")
    assert api_key_for("0.0.0.0") == "s3cret"
    assert api_key_for("127.0.0.1") == "s3cret"  # a key set is checked on loopback too


def test_server_refuses_to_start_reachable_without_a_key(monkeypatch, caplog):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ["inference", "--host", "0.0.0.0"])
    monkeypatch.setattr(inference.main, "setup_logging", lambda *args: None)
    monkeypatch.setattr(inference.server, "serve", lambda *args: pytest.fail("the server started"))
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as e:
        inference.main.main()
    assert e.value.code == 1
    assert [r.message for r in caplog.records] == [
        "inference failed: host = '0.0.0.0' lets other machines reach the server, which can then load any weights: "
        "set TRIDENT_API_KEY to a secret (requests must send 'Authorization: Bearer <key>'), or use 127.0.0.1"
    ]


def test_api_key_middleware_refuses_all_but_health_without_the_key():
    app = FastAPI()
    for path in ["/health", "/metrics", "/reload_weights", "/v1/models", "/invocations"]:
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET"])
    app.add_middleware(ApiKeyMiddleware, key="s3cret")
    client = TestClient(app)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    for path in ["/reload_weights", "/v1/models", "/invocations", "/no-such-route"]:
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Basic s3cret"}).status_code == 401
    response = client.get("/reload_weights", headers={"Authorization": "Bearer s3cret"})
    assert response.status_code == 200
    assert "TRIDENT_API_KEY" in client.get("/v1/models").json()["error"]


@pytest.fixture
def weights(tmp_path):
    """A root with a complete weights folder, an incomplete one, and a complete one outside the root."""
    root = tmp_path / "weights"
    for folder in [root / "step_1", root / "step_2", tmp_path / "elsewhere"]:
        folder.mkdir(parents=True)
    mark_stable(root / "step_1")
    mark_stable(tmp_path / "elsewhere")
    return root


def refusal(path, root, step: int = 1) -> int:
    with pytest.raises(HTTPException) as e:
        checked_weights_path(str(path), root, step)
    return e.value.status_code


def test_weights_path_must_be_a_stable_folder(weights):
    assert checked_weights_path(str(weights / "step_1"), weights, 1) == weights / "step_1"
    assert refusal(weights / "step_2", weights, 2) == 400  # no STABLE: still being written
    assert refusal(weights / "step_9", weights, 9) == 400
    assert refusal(weights / "step_1" / "STABLE", weights) == 400  # a file


def test_a_server_without_weights_root_loads_nothing(weights):
    with pytest.raises(HTTPException, match="weights_root") as e:
        checked_weights_path(str(weights / "step_1"), None, 1)
    assert e.value.status_code == 403


def test_a_folder_is_loaded_as_the_step_it_holds_only(weights):
    """An older step's folder cannot be served under a newer step number (the orchestrator checks the number)."""
    with pytest.raises(HTTPException, match=r"step_1 is not the folder of weights step 2 \(step_2\)"):
        checked_weights_path(str(weights / "step_1"), weights, 2)
    (weights / "latest").symlink_to(weights / "step_1")  # the folder that is loaded counts, not the link's name
    assert checked_weights_path(str(weights / "latest"), weights, 1) == weights / "step_1"
    (weights / "final").mkdir()
    mark_stable(weights / "final")
    assert refusal(weights / "final", weights, 0) == 400


def test_weights_path_cannot_escape_the_root(weights):
    assert refusal(weights.parent / "elsewhere", weights) == 403
    assert refusal(weights / ".." / "elsewhere", weights) == 403
    assert refusal(weights / "step_1" / ".." / ".." / "elsewhere", weights) == 403
    (weights / "link").symlink_to(weights.parent / "elsewhere")
    assert refusal(weights / "link", weights) == 403
    assert refusal(weights.parent / "weights-sibling", weights) == 403  # a prefix of the path is not inside
    (weights.parent / "root-link").symlink_to(weights)
    assert checked_weights_path(str(weights / "step_1"), weights.parent / "root-link", 1) == weights / "step_1"


def test_a_mixture_of_experts_may_send_its_experts_fused(tiny_moe_path):
    """The trainer holds (and broadcasts) each layer's experts as two fused tensors; the checkpoint has one tensor per
    expert and projection. Both fit the served model; a fused tensor of other experts does not."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path)
    fused = {name: list(tensor.shape) for name, tensor in untied(model.state_dict(), model).items()}
    assert [4, 128, 64] == fused["model.layers.0.mlp.experts.gate_up_proj"]
    check_shapes(Path("step_1"), fused, Path(tiny_moe_path))
    check_shapes(Path("step_1"), tensor_shapes(Path(tiny_moe_path)), Path(tiny_moe_path))
    for name, shape in [
        ("model.layers.1.mlp.experts.down_proj", [3, 64, 64]),
        ("model.layers.1.mlp.experts.gate_up_proj", [4, 127, 64]),
    ]:
        with pytest.raises(HTTPException) as e:
            check_shapes(Path("step_1"), fused | {name: shape}, Path(tiny_moe_path))
        assert e.value.status_code == 400
