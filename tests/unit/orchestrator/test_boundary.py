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
IMPORTS = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""
PATCHES = """
import importlib, json, sys
import pydantic._internal._fields, renderers.base, verifiers.v1.clients.train, verifiers.v1.rollout
import verifiers.v1.runtimes.subprocess

def patched():
    return {
        "Rollout.open": verifiers.v1.rollout.Rollout.open,
        "TrainClient.get_response": verifiers.v1.clients.train.TrainClient.get_response,
        "SubprocessRuntime.run_background": verifiers.v1.runtimes.subprocess.SubprocessRuntime.run_background,
        "build_async_openai": verifiers.v1.clients.train.build_async_openai,
        "load_tokenizer": renderers.base.load_tokenizer,
        "takes_validated_data_argument": pydantic._internal._fields.takes_validated_data_argument,
        "trident_in_process": sys.modules.get("trident_in_process"),
        "trident_judge": sys.modules.get("trident_judge"),
    }

before = patched()
for name in sys.argv[1:]:
    importlib.import_module(name)
imported = patched()
from orchestrator.verifiers_adapter.patches import install_patches
install_patches()
installed = patched()
install_patches()
again = patched()
print(json.dumps({
    "changed by importing the adapter": [key for key in before if imported[key] is not before[key]],
    "left as they were by install_patches": [key for key in before if installed[key] is before[key]],
    "changed by installing again": [key for key in before if again[key] is not installed[key]],
}))
"""


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


def test_importing_the_adapter_patches_nothing_until_install_patches_and_installing_twice_changes_nothing():
    adapter = [name for name in orchestrator_modules() if in_adapter(name)]
    assert "orchestrator.verifiers_adapter.envs" in adapter
    assert run_python(PATCHES, adapter) == {
        "changed by importing the adapter": [],
        "left as they were by install_patches": [],
        "changed by installing again": [],
    }


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
