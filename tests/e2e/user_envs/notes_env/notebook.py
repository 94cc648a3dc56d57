"""A notebook served to each rollout alone: it counts the notes that rollout has read."""

import verifiers.v1 as vf

NOTES = ["maple", "river", "copper", "violet", "orbit", "candle", "garden", "winter", "silver", "tiger"]


class NotebookToolset(vf.Toolset[vf.ToolsetConfig, vf.State]):
    reads = 0

    @vf.tool
    async def read_note(self, index: int) -> str:
        """Read note number `index` (0-9) from the notebook."""
        self.reads += 1
        return f"note {index} says: {NOTES[index % len(NOTES)]} (read {self.reads})"


if __name__ == "__main__":
    NotebookToolset.run()
