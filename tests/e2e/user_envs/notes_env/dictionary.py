"""A dictionary shared by every rollout of the taskset."""

import verifiers.v1 as vf


class DictionaryToolset(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    @vf.tool
    async def define(self, word: str) -> str:
        """Give the meaning of a word."""
        return f"{word}: a word from the notebook"


if __name__ == "__main__":
    DictionaryToolset.run()
