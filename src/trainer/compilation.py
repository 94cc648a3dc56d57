"""Regional compilation of the decoder layers (``model.compile``), and the eager fallback where compiling fails.

Each decoder layer is compiled on its own (``torch.compile`` of the layer; the rest of the model stays eager) as
one whole graph (``fullgraph``): a graph break is an error, not a silent split. Compiling happens at a layer's first
call with new shapes, its backward graph included (compiled then, not lazily at the first backward). A compile error
therefore surfaces in the forward pass, before the step computed anything that lasts: the step is run again with
every layer eager, from zeroed gradients, with one warning line.
"""

import logging
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import torch
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

from contracts.errors import first_line
from trainer.attention import uses_varlen
from trainer.model import decoder_layers

logger = logging.getLogger("trainer")

Result = TypeVar("Result")


def compiles(
    setting: bool | Literal["auto"], device: torch.device, dtype: torch.dtype, ep: int = 1, cp: int = 1
) -> bool:
    """Whether the decoder layers are compiled (``model.compile``): ``auto`` where the packed attention is one
    varlen call per layer (a GPU in bf16 or fp16), whose compiled graph serves every packing of samples, and the
    experts are not split over ranks (``ep`` > 1: the all-to-all's sizes are read on the host, a graph break), nor
    the tokens (``cp`` > 1: not compiled yet)."""
    if setting != "auto":
        return setting
    return uses_varlen(device, dtype) and ep == 1 and cp == 1


def per_packing_warning(setting: bool | Literal["auto"], device: torch.device, dtype: torch.dtype) -> str | None:
    """The warning for ``model.compile = true`` where attention runs once per sample (the CPU, a GPU in fp32):
    each new packing of samples is a new graph, compiled anew, until torch stops compiling and runs it eagerly."""
    if setting is not True or uses_varlen(device, dtype):
        return None
    return (
        f"model.compile = true on {device.type} in {str(dtype).removeprefix('torch.')}: attention runs once per "
        "sample here, so each new packing of samples is compiled anew (slow steps, no gain); 'auto' leaves it off"
    )


def compile_layers(model: nn.Module, backend: str | Callable = "inductor") -> None:
    """Compile each decoder layer on its own, as one graph, in place."""
    # the backward graph compiles with the forward's, so a compile error surfaces before the backward pass starts
    torch._functorch.config.force_non_lazy_backward_lowering = True
    for layer in decoder_layers(model):
        layer.compile(backend=backend, fullgraph=True)


def uncompile_layers(model: nn.Module) -> bool:
    """Run each decoder layer eagerly again, in place; whether any was compiled."""
    compiled = False
    for layer in decoder_layers(model):
        compiled |= layer._compiled_call_impl is not None
        layer._compiled_call_impl = None  # what nn.Module.compile set
    return compiled


def compile_error_line(error: TorchDynamoException) -> str:
    """What went wrong in compiling, in one line: the backend's own error, or Dynamo's (a graph break)."""
    cause = error.inner_exception if isinstance(error, BackendCompilerFailed) else error
    return f"{type(cause).__name__}: {first_line(str(cause), 200)}"


def eager_on_compile_failure(step: Callable[[], Result], models: Sequence[nn.Module]) -> Result:
    """``step()`` (forward and backward passes, no optimizer step); if compiling a decoder layer of ``models`` fails
    or breaks its graph, every layer of ``models`` runs eagerly from then on and ``step()`` runs again from zeroed
    gradients, with one warning line. The eager step's results are the eager model's."""
    try:
        return step()
    except TorchDynamoException as error:
        if not [model for model in models if uncompile_layers(model)]:
            raise
        logger.warning(
            f"model.compile: compiling the decoder layers failed ({compile_error_line(error)}); they run eagerly "
            "from now on (set model.compile = false to skip compiling)"
        )
        logger.debug("the compile error", exc_info=error)
    for model in models:
        model.zero_grad(set_to_none=True)
    return step()
