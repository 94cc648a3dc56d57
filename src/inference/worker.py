"""Worker extension loaded into vLLM's engine process (``--worker-extension-cls``).

Imported inside the engine core process: keep the top level free of heavy imports.
"""

import ctypes
import time
from typing import Any

WORKER_EXTENSION = "inference.worker.WeightReloadExtension"


class WeightReloadExtension:
    """Mixed into vLLM's worker class; adds full-weight reloads, from files or the trainer's broadcast, that keep
    tied embeddings tied."""

    def load_weights(self, path: str, manifest: dict | None = None) -> dict[str, Any]:
        """Load the weights of the folder ``path`` into the running model, in place, through the receiver its
        ``manifest`` picks (``inference.transports``; None: the folder's HF safetensors files or its delta chain),
        made at the first manifest of each trainer session; with the ``checksum`` of the weights loaded where the
        receiver keeps a copy (a delta chain's). ``{"gone": why}``, loading nothing, when the trainer holds newer
        weights than these."""
        from inference.transports import Receivers

        start = time.perf_counter()
        receiver = self.__dict__.setdefault("_trident_receivers", Receivers()).pick(manifest, path)
        weights = receiver.receive(path, manifest)
        if weights is None:
            return {"gone": f"the trainer has sent newer weights than {manifest['sequence']} of its session"}
        self.reload_weights(**weights, is_checkpoint_format=True)
        self._loaded()
        receiver.loaded(manifest)
        seconds = round(time.perf_counter() - start, 4)
        return {"path": path, "seconds": seconds, "checksum": receiver.served_checksum()}

    def _loaded(self) -> None:
        """After new weights are in: tie the output layer to the embeddings again, pack a mixture of experts'
        weights for the CPU kernel again, and give the heap glibc kept from the reload back to the OS
        (``malloc_trim``), so the worker's memory does not creep up reload by reload."""
        self._tie_lm_head()
        self._pack_cpu_experts()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass

    def _tie_lm_head(self) -> None:
        import torch
        from vllm.model_executor.models.interfaces import supports_multimodal

        model = self.model_runner.get_model()
        if supports_multimodal(model):  # a vision-language model's output layer and embeddings are its text model's
            model = model.get_language_model()
        tied = bool(getattr(self.model_config.hf_text_config, "tie_word_embeddings", False))
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if tied and lm_head is not None and embed is not None:
            # A tied checkpoint has no lm_head tensor, so the reload leaves lm_head on the old weights
            # (and, on CPU, its packed GEMM copy): tie it again and redo its post-load processing.
            with torch.no_grad():
                lm_head.weight = embed.weight
                lm_head.quant_method.process_weights_after_loading(lm_head)

    def _pack_cpu_experts(self) -> None:
        """Pack each mixture-of-experts layer's expert weights into the CPU kernel's layout again.

        vLLM 0.32 packs them only when the model first loads (``UnquantizedFusedMoEMethod`` skips the experts'
        own processing on a weight update): after an in-place reload they stay in checkpoint layout, which the CPU
        kernel reads as packed, and the server serves other weights than it loaded (probe gap about 0.01 on the
        tiny MoE, for the very weights it started with). GPU kernels need no packing.
        """
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.utils import replace_parameter

        for layer in self.model_runner.get_model().modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
                for name in ("w13_weight", "w2_weight"):
                    replace_parameter(layer, name, cpu_prepack_moe_weight(getattr(layer, name), experts.isa))
