"""The parts of ``src/orchestrator/``: the rollout core (the ``Rollout`` values, advantages, batches, stats, refills,
weight sync: plain Python and torch), the verifiers adapter in one subfolder, and the few modules that join the two
to run groups, evaluations and steps. ``tests/unit/project/test_floors.py`` and
``tests/unit/orchestrator/test_boundary.py`` hold the parts to their rules."""

import pkgutil

import orchestrator

ADAPTER = "orchestrator.verifiers_adapter"
ADAPTED_LIBRARIES = {"verifiers", "renderers", "aiohttp"}  # what the adapter wraps; nothing else imports them
JOINING = {  # run the adapter's rollouts for the core: they import both parts
    "orchestrator.groups",
    "orchestrator.workers",
    "orchestrator.evaluation",
    "orchestrator.schedule",
    "orchestrator.orchestrator",
    "orchestrator.main",
    "orchestrator.eval_main",
}


def orchestrator_modules() -> list[str]:
    """Every module of ``src/orchestrator/``, by dotted name."""
    return ["orchestrator"] + [m.name for m in pkgutil.walk_packages(orchestrator.__path__, "orchestrator.")]


def in_adapter(module: str) -> bool:
    return module == ADAPTER or module.startswith(ADAPTER + ".")


def rollout_core() -> list[str]:
    """The modules of the rollout core: those of ``src/orchestrator/`` neither in the adapter nor joining the two."""
    return [m for m in orchestrator_modules() if not in_adapter(m) and m not in JOINING]
