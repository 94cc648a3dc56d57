"""A verifiers taskset whose per-rollout MCP tool server, written as verifiers' documentation shows, crashes on some
of its starts (counted in ``FLAKY_TOOLS_DIR``; :func:`crashes`): it reports a port, then exits before serving; with
``FLAKY_TOOLS_HANG`` set, every start hangs instead, reporting no port. ``python -m flaky_tools`` is how verifiers
starts it, so this folder must be on ``PYTHONPATH``."""

import os
import sys
import time
from pathlib import Path

import verifiers.v1 as vf

from orchestrator.verifiers_adapter.harness import InProcessHarness

ENV_ID = "flaky-tools"  # verifiers imports the taskset of this id as module flaky_tools: this one


class FlakyToolset(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    async def ping(self) -> str:
        """Answer pong."""
        return "pong"


class FlakyTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [FlakyToolset(vf.ToolsetConfig())]

    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class FlakyTaskset(vf.Taskset[FlakyTask, vf.TasksetConfig]):
    def load(self):
        yield FlakyTask(vf.TaskData(id="t0", prompt="Say hi."), self.config.task)


__all__ = ["InProcessHarness", "FlakyTaskset"]


def crashes(start: int) -> bool:
    """Whether start number ``start`` (from 0) crashes: one of the first ``FLAKY_TOOLS_FAILS``, or with
    ``FLAKY_TOOLS_SHARE`` set, that share of all starts spread evenly (0.3: starts 3, 6, 9, 13, ...)."""
    share = float(os.environ.get("FLAKY_TOOLS_SHARE", "0"))
    return start < int(os.environ.get("FLAKY_TOOLS_FAILS", "0")) or int((start + 1) * share) > int(start * share)


def crash_on_early_starts() -> None:
    """Count this start; hang when asked to; if it :func:`crashes`, report a port nothing serves and exit."""
    starts, count = Path(os.environ["FLAKY_TOOLS_DIR"]), 0
    while True:  # take the next free number atomically: servers start at the same time
        try:
            os.close(os.open(starts / str(count), os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            count += 1
    while os.environ.get("FLAKY_TOOLS_HANG"):
        time.sleep(60)
    if crashes(count):
        Path(os.environ["MCP_PORT_FILE"]).write_text("9")
        sys.exit("flaky_tools: crashed on start")


if __name__ == "__main__":
    crash_on_early_starts()
    FlakyToolset.run()
