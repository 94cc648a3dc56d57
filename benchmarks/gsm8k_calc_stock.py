"""gsm8k-calc for verifiers' stock harnesses: the same tasks and rewards, with the calculator served over MCP.

verifiers' stock chat harness (``null``) offers the model only tools that MCP servers declare; it ignores the
``tools`` field Trident's in-process harness reads. This taskset (id ``gsm8k-calc-stock``) is ``gsm8k-calc``
with the very same ``calculator`` function declared as a taskset-scoped toolset: one MCP server, started once
when the environment starts serving and shared by every rollout (the cheapest way verifiers offers; tools in
``Task.toolsets`` would start a server per rollout).

``benchmarks/orchestrator_rollouts.py`` imports it; verifiers runs ``python -m gsm8k_calc_stock`` to start the
server, so ``benchmarks/`` must be on ``PYTHONPATH``.
"""

import verifiers.v1 as vf
from gsm8k_calc import Gsm8kCalcTaskset, calculator


class CalculatorToolset(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    """gsm8k-calc's calculator as an MCP tool, under its own name (no server prefix)."""

    TOOL_PREFIX = None

    @vf.tool(name=calculator.__name__)
    async def calculate(self, expression: str) -> str:
        return calculator(expression)

    calculate.__doc__ = calculator.__doc__


class Gsm8kCalcStockTaskset(Gsm8kCalcTaskset):
    """gsm8k-calc whose calculator is served over MCP."""

    @classmethod
    def toolsets(cls, config) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.SharedToolsetConfig())]


__all__ = ["Gsm8kCalcStockTaskset"]

if __name__ == "__main__":
    CalculatorToolset.run()
