from orchestrator.harness import tool_spec


def calculator(expression: str, precision: int = 2) -> str:
    """Evaluate an arithmetic expression."""
    return expression


def test_tool_spec_from_signature_and_docstring():
    spec = tool_spec(calculator)["function"]
    assert spec["name"] == "calculator"
    assert spec["description"] == "Evaluate an arithmetic expression."
    assert spec["parameters"]["properties"] == {"expression": {"type": "string"}, "precision": {"type": "integer"}}
    assert spec["parameters"]["required"] == ["expression"]
