"""One run's LoRA adapters loaded into the running engine, each under its step's name
(``contracts.inference_api.adapter_name``)."""

from typing import Any

from fastapi import HTTPException

NAMED = 2  # adapters served under their names: the newest, and the one before for rollouts started on it
RESIDENT_PER_RUN = NAMED + 1  # the most one run keeps in the engine: its named ones and one retired


class Adapters:
    """Load, retire and remove adapters through vLLM's registry of served names and its engine.

    The newest adapter and the one before it are served under their names: a rollout started on the previous
    step's adapter (a multi-turn rollout, or the orchestrator's next step started early) finishes its turns on
    the weights it began with. An older one is retired: it has no name any more (requests naming it get 404) but
    stays resident until the next swap, so requests admitted on it before finish from memory.
    """

    def __init__(self, models: Any, engine: Any):
        self.models = models  # vLLM's OpenAIServingModels: the names requests resolve
        self.engine = engine
        self.named: list[str] = []  # served names, oldest first
        self.retired: list[int] = []  # engine ids of resident adapters without a name

    async def swap_in(self, name: str, path: str) -> None:
        """Serve the peft adapter in ``path`` as ``name``; of those served before, only the newest keeps its
        name. Retired adapters are freed first."""
        await self.remove_retired()
        await self.load(name, path)
        self.named.append(name)
        while len(self.named) > NAMED:
            await self.retire(self.named.pop(0))

    async def retire_all(self) -> None:
        """Stop serving every adapter (the base weights change, or a new run starts)."""
        while self.named:
            await self.retire(self.named.pop(0))

    async def remove_all(self) -> None:
        """Stop serving every adapter and free them all (the run has ended)."""
        await self.retire_all()
        await self.remove_retired()

    async def load(self, name: str, path: str) -> None:
        """Load the peft adapter in ``path`` into the engine and serve it as ``name``."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        result = await self.models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
        if isinstance(result, ErrorResponse):  # the folder's fault (vLLM answers 500 for a broken adapter): 400
            raise HTTPException(400, f"loading adapter {name} from {path}: {result.error.message}")

    async def retire(self, name: str) -> None:
        """Stop serving ``name``; the engine keeps the adapter until :meth:`remove_retired`."""
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        request = self.models.lora_requests.get(name)
        if request is not None:
            await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
            self.retired.append(request.lora_int_id)

    async def remove_retired(self) -> None:
        """Free the retired adapters' memory in the engine."""
        while self.retired:
            await self.engine.remove_lora(self.retired.pop())
