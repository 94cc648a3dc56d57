"""A vLLM general plugin (entry point ``vllm.general_plugins``), which vLLM runs in each of the server's processes.

One setting of the server reaches vLLM's processes through it, by an environment variable the server sets: **busy
waiting** (:data:`BUSY_WAIT_ENV`). vLLM's engine and worker processes pass messages through shared memory, and a
process waiting for the next one spins (``sched_yield``) for a second after the last before it sleeps on a socket
until the writer's notification, or 5 s. With cores to spare that saves microseconds; on a CPU server sharing two
cores with the trainer and orchestrator, the two spinning processes took the cores generation needed: 2x the
server's CPU per rollout, and batches that sometimes took 6x longer. Without the spinning, a notification that never
came (it happens) stalled the whole batch for the 5 s, so a sleeping reader also looks again every
:data:`RECHECK_MS`. The server sets :data:`BUSY_WAIT_ENV` (``inference.busy_wait_s``) for its processes; without it
the waiting is vLLM's.
"""

import logging
import os

BUSY_WAIT_ENV = "TRIDENT_VLLM_BUSY_WAIT_S"
RECHECK_MS = 20  # how often a sleeping reader looks for a message anyway (vLLM: 5,000)

logger = logging.getLogger("inference")


def register() -> None:
    """Apply the server's settings in this vLLM process: :func:`set_busy_wait`."""
    set_busy_wait()


def set_busy_wait() -> None:
    """Make vLLM's shared-memory message readers spin for ``$TRIDENT_VLLM_BUSY_WAIT_S`` seconds, when it is set."""
    value = os.environ.get(BUSY_WAIT_ENV)
    if value is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    original = shm_broadcast.SpinCondition
    if getattr(original, "busy_wait_s", None) is not None:  # vLLM may run a plugin more than once in a process
        return
    seconds = float(value)

    class SpinCondition(original):
        busy_wait_s = seconds

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("busy_loop_s", seconds)
            super().__init__(*args, **kwargs)

    shm_broadcast.SpinCondition = SpinCondition
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_MS
    logger.info(f"vLLM's processes spin {seconds:g}s waiting for each other's messages ({BUSY_WAIT_ENV})")
