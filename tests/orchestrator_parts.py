"""The parts of ``src/orchestrator/``, a folder each. The rollout core (``batching/``: the ``Rollout`` values,
advantages, batches; ``tasks/``: samplers and streams; ``serving/``: the servers, their client and weight sync;
``metrics/``: step statistics and the process's memory) is plain Python and torch; the verifiers adapter
(``verifiers_adapter/``) alone talks to verifiers; the run loop (``loop/``) joins the two to run groups, evaluations
and steps. Beside the folders lie only the config (``config.py``) and the two entry points, which join too.
``tests/unit/project/test_floors.py`` and ``tests/unit/orchestrator/test_boundary.py`` hold the parts to their
rules."""

import pkgutil

import orchestrator

CORE = {"batching", "tasks", "serving", "metrics"}
ADAPTER = "verifiers_adapter"
LOOP = "loop"
TOP_LEVEL = {"config", "main", "eval_main"}  # the only modules outside a folder
ADAPTED_LIBRARIES = {"verifiers", "renderers", "aiohttp"}  # what the adapter wraps; nothing else imports them


def orchestrator_modules() -> list[str]:
    """Every module of ``src/orchestrator/``, by dotted name."""
    return ["orchestrator"] + [m.name for m in pkgutil.walk_packages(orchestrator.__path__, "orchestrator.")]


def folder(module: str) -> str | None:
    """The folder (or top-level module) of ``src/orchestrator/`` a dotted module name lies in; None outside it."""
    parts = module.split(".")
    return parts[1] if parts[0] == "orchestrator" and len(parts) > 1 else None


def in_adapter(module: str) -> bool:
    return folder(module) == ADAPTER


def joins(module: str) -> bool:
    """The run loop and the entry points: they import both the core and the adapter."""
    return folder(module) in {LOOP, "main", "eval_main"}


def rollout_core() -> list[str]:
    """The modules of the rollout core: those of its folders."""
    return [m for m in orchestrator_modules() if folder(m) in CORE]
