import gc
import weakref

import pytest

from orchestrator.loop.gc_tuning import YOUNG_THRESHOLD, tune_gc


class Node:
    pass


def cycles(n: int) -> list[weakref.ref]:
    """``n`` unreachable reference cycles (only the collector frees them); weak references to them."""
    refs = []
    for _ in range(n):
        node = Node()
        node.me = node
        refs.append(weakref.ref(node))
    return refs


@pytest.fixture
def tuned():
    """The collector tuned as the orchestrator tunes it, and counting its automatic collections; restored after."""
    before, collections = gc.get_threshold(), []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    tune_gc()
    gc.callbacks.append(count)
    yield collections
    gc.callbacks.remove(count)
    gc.unfreeze()
    gc.set_threshold(*before)


def test_start_up_objects_are_frozen_and_young_objects_collected_in_larger_batches(tuned):
    assert gc.isenabled() and gc.get_freeze_count() > 0
    refs = cycles(5_000)  # CPython's default would have collected 7 times by now
    assert tuned == []
    refs += cycles(2 * YOUNG_THRESHOLD)
    assert tuned and any(ref() is None for ref in refs)  # cycles are still freed, in larger batches
