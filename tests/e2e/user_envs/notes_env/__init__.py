"""notes-env: answer a question about a note, looking it up with tools served over MCP.

Written in the style of verifiers' v1 documentation: the task's tools are `vf.Toolset` classes, one server
started per rollout (`Task.toolsets`) and one shared by the taskset's rollouts (`Taskset.toolsets`), or reached
at `dictionary_url` when it runs elsewhere.
"""

import verifiers.v1 as vf

from notes_env.dictionary import DictionaryToolset
from notes_env.notebook import NotebookToolset


class NotesConfig(vf.TasksetConfig):
    num_examples: int = 8
    dictionary_url: str | None = None
    """A dictionary MCP server already running somewhere; unset, verifiers starts one for the taskset."""


class NotesTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [NotebookToolset(vf.ToolsetConfig())]

    @vf.reward
    async def looked_it_up(self, trace: vf.Trace) -> float:
        return float(any(message.tool_calls for message in trace.assistant_messages))


class NotesTaskset(vf.Taskset[NotesTask, NotesConfig]):
    @classmethod
    def toolsets(cls, config: NotesConfig) -> list[vf.Toolset]:
        return [DictionaryToolset(vf.SharedToolsetConfig(url=config.dictionary_url))]

    def load(self):
        for i in range(self.config.num_examples):
            data = vf.TaskData(id=f"note-{i}", prompt=f"What does note {i} say? Look it up, then define its word.")
            yield NotesTask(data, self.config.task)


__all__ = ["NotesTaskset"]
