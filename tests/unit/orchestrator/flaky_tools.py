"""A verifiers taskset whose per-rollout MCP tool server, written as verifiers' documentation shows, crashes on its
first ``FLAKY_TOOLS_FAILS`` starts (counted in ``FLAKY_TOOLS_DIR``): it reports a port, then exits before serving.
``python -m flaky_tools`` is how verifiers starts it, so this folder must be on ``PYTHONPATH``."""

import os
import sys
from pathlib import Path

import verifiers.v1 as vf

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


__all__ = ["FlakyTaskset"]


def crash_on_early_starts() -> None:
    """Count this start; on the first ``FLAKY_TOOLS_FAILS`` ones report a port nothing serves and exit."""
    starts = Path(os.environ["FLAKY_TOOLS_DIR"])
    count = len(list(starts.iterdir()))
    (starts / str(count)).touch()
    if count < int(os.environ["FLAKY_TOOLS_FAILS"]):
        Path(os.environ["MCP_PORT_FILE"]).write_text("9")
        sys.exit("flaky_tools: crashed on start")


if __name__ == "__main__":
    crash_on_early_starts()
    FlakyToolset.run()
