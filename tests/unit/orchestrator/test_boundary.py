"""The verifiers boundary: importing the rollout core loads none of the libraries the verifiers adapter wraps, and
the adapter changes those libraries only when :func:`install_patches` is called (each checked in a fresh process:
the test session has installed them)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from orchestrator_parts import ADAPTED_LIBRARIES, in_adapter, orchestrator_modules, rollout_core

SRC = Path(__file__).parents[3] / "src"
PATCH_SNAPSHOT = Path(__file__).parents[2] / "patch_snapshot.py"
IMPORTS = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""
# What install_patches() changes, each as "module:attribute" (a class's attribute as "module:Class.attribute"): the
# whole set, checked against every attribute of every module loaded, and of every class one defines (patch_snapshot.py)
PATCHED = {
    "sys.modules:trident_in_process",  # verifiers imports a harness or judge plugin by the module its id names
    "sys.modules:trident_judge",
    "verifiers.v1.rollout:Rollout.open",
    "verifiers.v1.runtimes.subprocess:SubprocessRuntime.run_background",
    "verifiers.v1.clients.train:TrainClient.get_response",
    "verifiers.v1.clients.train:build_async_openai",
    "renderers.base:load_tokenizer",
    "renderers.client:_parse_completion_logprobs",
    "pydantic._internal._fields:takes_validated_data_argument",
    "datasets:load_dataset",
}


def run_python(script: str, args: list[str]):
    """What ``script``, run by a fresh interpreter with ``args``, prints last (as JSON)."""
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_rollout_core_loads_no_library_the_adapter_wraps():
    core = rollout_core()
    assert {
        "orchestrator.batching.rollout",
        "orchestrator.batching.batch",
        "orchestrator.batching.infra",
        "orchestrator.serving.weight_sync",
    } <= set(core)
    loaded = run_python(IMPORTS, core)
    assert "torch" in loaded and ADAPTED_LIBRARIES.isdisjoint(loaded)


def test_install_patches_changes_exactly_the_patches_listed_and_importing_or_installing_again_changes_nothing():
    """A patch installed without its entry in PATCHED, or an entry whose patch is not installed, fails; so does a
    patch applied by importing the adapter (the modules patched are loaded first, so theirs would show)."""
    adapter = [name for name in orchestrator_modules() if in_adapter(name)]
    assert "orchestrator.verifiers_adapter.envs" in adapter
    changes = run_python(PATCH_SNAPSHOT.read_text(), [json.dumps(sorted(PATCHED)), *adapter])
    installed = set(changes.pop("changed by install_patches"))
    assert {"installed, not in PATCHED": installed - PATCHED, "in PATCHED, not installed": PATCHED - installed} == {
        "installed, not in PATCHED": set(),
        "in PATCHED, not installed": set(),
    }
    assert changes == {"changed by importing the adapter": [], "changed by installing again": []}


def test_no_orchestrator_module_acts_on_another_object_at_import():
    """A call for its effect, or an assignment to another object's attribute or item, at a module's top level would
    patch at import: only definitions are there."""
    acts = []
    for path in sorted((SRC / "orchestrator").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            called = isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant)
            if called or any(isinstance(target, ast.Attribute | ast.Subscript) for target in targets):
                acts.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    assert acts == []
