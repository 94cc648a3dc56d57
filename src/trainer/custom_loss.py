"""A user's policy term, named by import path (``[loss] custom = "package.module:function"``, docs/losses.md)."""

import functools
import importlib
import inspect
from collections.abc import Callable

# The keyword arguments a custom policy term is called with (see ``trainer.loss.policy_loss``).
CUSTOM_LOSS_ARGUMENTS = ("logprobs", "inference_logprobs", "advantages", "loss_mask", "sample_lengths")


@functools.cache
def import_custom_loss(path: str) -> Callable:
    """The function at ``path`` (``"package.module:function"``), checked to take ``CUSTOM_LOSS_ARGUMENTS`` by
    keyword; a ValueError of one line saying what is wrong otherwise."""
    module_name, colon, name = path.partition(":")
    if not colon or not module_name or not name:
        raise ValueError(f"'{path}': not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module failing to import in any way is the same one-line mistake
        reason = (str(error).splitlines() or [""])[0]
        raise ValueError(f"'{path}': importing {module_name} failed: {type(error).__name__}: {reason}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"'{path}': {module_name} has no function {name}")
    try:
        inspect.signature(function).bind(**dict.fromkeys(CUSTOM_LOSS_ARGUMENTS))
    except TypeError:
        raise ValueError(
            f"'{path}': {name} must take the keyword arguments {', '.join(CUSTOM_LOSS_ARGUMENTS)}"
        ) from None
    return function
