"""The inference server's HTTP API is defined once, in contracts.inference_api: no other module of src/ or benchmarks/
spells a route, and its models accept what the server answers."""

import ast
from pathlib import Path

from contracts import inference_api

ROOT = Path(__file__).parents[3]
ROUTES = {value for name, value in vars(inference_api).items() if name.isupper() and isinstance(value, str)} - {
    inference_api.API_KEY_ENV
}


def test_no_module_but_the_contract_spells_a_route():
    spelled = []
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        if path == Path(inference_api.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ROUTES:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert ROUTES >= {"/health", "/weights", "/reload_weights", "/load_adapter", "/reset_weights"}
    assert spelled == []


def test_a_weights_change_answer_is_what_is_served_and_its_seconds():
    answer = {"step": 3, "path": "/run/weights/step_3", "adapter": inference_api.adapter_name(3), "seconds": 0.5,
              "paused_s": 0.25, "checksum": "0123456789abcdef"}  # fmt: skip
    change = inference_api.WeightsChange.model_validate(answer)
    assert change.model_dump() == answer
    served = {key: value for key, value in answer.items() if key not in ("seconds", "paused_s", "checksum")}
    assert inference_api.Served.model_validate(answer).model_dump() == served


def test_weight_versions_give_each_completion_token_its_step():
    """vLLM's spans over output tokens, as the generate route answers them: the step of every token, or None when
    they are absent, not steps or do not tile the completion (the orchestrator then uses its own bound)."""
    spans = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 5}]
    assert inference_api.token_weight_steps(spans, 5) == [4, 4, 5, 5, 5]
    assert inference_api.token_weight_steps([], 0) == []
    assert inference_api.token_weight_steps(None, 5) is None
    assert inference_api.token_weight_steps(spans, 6) is None  # one token left out
    assert inference_api.token_weight_steps([{"version": "default", "start": 0, "end": 5}], 5) is None
    assert inference_api.token_weight_steps(spans[1:], 3) is None  # does not start at token 0
    names = ("lora-step-12", "lora-step-", "model", None)
    assert [inference_api.adapter_step(name) for name in names] == [12, None, None, None]
