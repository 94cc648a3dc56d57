import asyncio
import json

from orchestrator.harness import call_tool, tool_spec


def calculator(expression: str, precision: int = 2) -> str:
    """Evaluate an arithmetic expression."""
    return expression


def test_tool_spec_from_signature_and_docstring():
    spec = tool_spec(calculator)["function"]
    assert spec["name"] == "calculator"
    assert spec["description"] == "Evaluate an arithmetic expression."
    assert spec["parameters"]["properties"] == {"expression": {"type": "string"}, "precision": {"type": "integer"}}
    assert spec["parameters"]["required"] == ["expression"]


def read_file(path: str, files: list[str], runtime, task) -> str:
    """Read a file of the rollout's copy."""
    return f"{runtime}:{task}:{path}:{','.join(files)}"


def test_tool_spec_hides_injected_parameters_and_types_lists():
    params = tool_spec(read_file)["function"]["parameters"]
    assert params["properties"] == {"path": {"type": "string"}, "files": {"type": "array", "items": {"type": "string"}}}
    assert params["required"] == ["path", "files"]


def test_call_tool_injects_runtime_and_task_and_ignores_model_supplied_ones():
    args = json.dumps({"path": "a.py", "files": ["x", "y"], "runtime": "evil"})
    result = asyncio.run(call_tool(read_file, args, {"runtime": "R", "task": "T"}))
    assert result == "R:T:a.py:x,y"


def test_call_tool_reports_errors_to_the_model():
    assert asyncio.run(call_tool(read_file, "not json", {})).startswith("error: JSONDecodeError")
    assert asyncio.run(call_tool(read_file, "[1]", {})).startswith("error: TypeError: arguments must be")
    assert asyncio.run(call_tool(read_file, "{}", {"runtime": 1, "task": 2})).startswith("error: TypeError")
