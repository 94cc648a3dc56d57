"""Remember pydantic's answer to "does this default factory take the validated data?".

pydantic (2.14) answers it from ``inspect.signature(factory)`` every time ``model_construct`` fills in a field from
its default factory, and for a builtin such as ``list`` or ``time.time`` that parses the signature's text anew.
verifiers builds every message node of a rollout's graph with ``model_construct``: in the orchestrator's profile
that check alone was 16% of the event loop's time. The answer depends on the factory only, so it is kept.

:func:`~orchestrator.verifiers_adapter.patches.install_patches` puts
:func:`takes_validated_data_argument` for pydantic's in place.
"""

import functools

from pydantic._internal import _fields

_check = _fields.takes_validated_data_argument


@functools.lru_cache(maxsize=4096)
def _cached(factory) -> bool:
    return _check(factory)


def takes_validated_data_argument(factory) -> bool:
    """pydantic's answer for ``factory``, worked out once per factory (every time for an unhashable one)."""
    try:
        return _cached(factory)
    except TypeError:
        return _check(factory)
