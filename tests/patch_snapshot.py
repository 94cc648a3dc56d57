"""Run by a fresh interpreter (``tests/unit/orchestrator/test_boundary.py``): what importing the verifiers adapter,
then calling ``install_patches()``, then calling it again, changes in the process, as JSON on the last line.

``python tests/patch_snapshot.py '<patched, as a JSON list of "module:attribute">' <adapter module>...``

What changes is read from a snapshot of every module loaded: each module's attributes, and each attribute of each
class a module defines, compared by identity, so any patch anywhere shows, declared or not."""

import importlib
import json
import sys

THIS_SCRIPT = {"__main__", "__mp_main__"}


def snapshot() -> dict[str, object]:
    """Every module loaded (``sys.modules:name``), each module's attributes (``module:name``) and those of each class
    it defines (``module:Class.name``)."""
    seen = {}
    for name, module in list(sys.modules.items()):
        seen[f"sys.modules:{name}"] = module
        if name in THIS_SCRIPT or getattr(module, "__name__", None) != name:
            continue  # this script, or a module registered under a second name too (seen as that entry alone)
        for key, value in list(vars(module).items()):
            seen[f"{name}:{key}"] = value
            # vars, not getattr: a lazy proxy imports on getattr
            if type in type(value).__mro__ and vars(value).get("__module__") == name:
                seen.update({f"{name}:{key}.{attr}": item for attr, item in list(vars(value).items())})
    return seen


def changed(before: dict, after: dict) -> list[str]:
    """What was added, removed or replaced (by identity)."""
    keys = before.keys() | after.keys()
    return sorted(key for key in keys if key not in before or key not in after or before[key] is not after[key])


def replaced(before: dict, after: dict, libraries: set[str]) -> list[str]:
    """What both hold in ``libraries`` (top-level names) and ``after`` holds another object for."""
    both = before.keys() & after.keys()
    return sorted(key for key in both if key.split(".")[0] in libraries and before[key] is not after[key])


def main(patched: list[str], adapter: list[str]) -> dict[str, list[str]]:
    modules = {key.split(":")[0] for key in patched} - {"sys.modules"}
    for name in modules:  # loaded first, so a patch applied by importing the adapter would show
        importlib.import_module(name)
    before = snapshot()
    for name in adapter:
        importlib.import_module(name)
    imported = snapshot()
    from orchestrator.verifiers_adapter.patches import install_patches

    install_patches()
    installed = snapshot()
    install_patches()
    return {
        # importing more of a library adds modules and names: only what was there is compared
        "changed by importing the adapter": replaced(before, imported, {name.split(".")[0] for name in modules}),
        "changed by install_patches": changed(imported, installed),
        "changed by installing again": changed(installed, snapshot()),
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]), sys.argv[2:])))
