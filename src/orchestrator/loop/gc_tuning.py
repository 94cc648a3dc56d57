"""Python's cyclic garbage collector, tuned for hundreds of rollouts in flight.

CPython collects its youngest generation every 700 net allocations of container objects, and each collection
walks the young objects' references. A model turn through verifiers allocates tens of thousands (request and
reply dicts, pydantic messages, graph nodes), so with the default thresholds the collector took about 40 % of the
orchestrator's CPU per turn at 512 rollouts in flight (docs/benchmarks.md). The orchestrator's objects are
mostly freed by reference counting anyway; cycles still get collected, just in larger batches.
"""

import gc

YOUNG_THRESHOLD = 50_000
"""Net container allocations between collections of the youngest generation (CPython's default: 700)."""


def tune_gc() -> None:
    """Move what start-up allocated (imports, loaded environments) out of the collector's scans for good, and
    collect the youngest generation every :data:`YOUNG_THRESHOLD` allocations. Call once, after start-up."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
