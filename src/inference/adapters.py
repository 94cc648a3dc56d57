"""LoRA adapters loaded into the running engine, each under its step's name (``rl.protocol.adapter_name``)."""

from typing import Any

from fastapi import HTTPException


class Adapters:
    """Load, retire and remove adapters through vLLM's registry of served names and its engine.

    A retired adapter has no name any more (requests naming it get 404) but stays resident until
    :meth:`remove_retired`, so requests admitted on it before it was retired finish from memory.
    """

    def __init__(self, models: Any, engine: Any):
        self.models = models  # vLLM's OpenAIServingModels: the names requests resolve
        self.engine = engine
        self.retired: list[int] = []  # engine ids of resident adapters without a name

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
