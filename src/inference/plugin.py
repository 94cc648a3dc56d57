"""A vLLM general plugin (entry point ``vllm.general_plugins``), which vLLM runs in each of the server's processes.

Two settings of the server reach vLLM's processes through it, by environment variables the server sets.

**Busy waiting** (:data:`BUSY_WAIT_ENV`).
vLLM's engine and worker processes pass messages through shared memory, and a process waiting for the next one
spins (``sched_yield``) for a second after the last before it sleeps on a socket until the writer's notification,
or 5 s. With cores to spare that saves microseconds; on a CPU server sharing two cores with the trainer and
orchestrator, the two spinning processes took the cores generation needed: 2x the server's CPU per rollout, and
batches that sometimes took 6x longer. Without the spinning, a notification that never came (it happens) stalled
the whole batch for the 5 s, so a sleeping reader also looks again every :data:`RECHECK_MS`. The server sets
:data:`BUSY_WAIT_ENV` (``inference.busy_wait_s``) for its processes; without it the waiting is vLLM's.

**Forking the CPU worker** (:data:`FORK_WORKER_ENV`, ``inference.cpu_worker_start``). vLLM's CPU platform starts its
worker by spawn, so that the worker's OpenMP threads take the settings vLLM gives them; the worker then imports
vLLM again, ~20 s on two cores. Where the worker gets one core either way, the engine process forks it instead.
Only a process that multiprocessing started (the engine) switches: the server's own process still spawns the
engine, whose event loop and threads a fork would copy.
"""

import logging
import multiprocessing
import os

BUSY_WAIT_ENV = "TRIDENT_VLLM_BUSY_WAIT_S"
FORK_WORKER_ENV = "TRIDENT_VLLM_FORK_WORKER"
RECHECK_MS = 20  # how often a sleeping reader looks for a message anyway (vLLM: 5,000)

logger = logging.getLogger("inference")


def register() -> None:
    """Apply the server's settings in this vLLM process: :func:`fork_worker` and :func:`set_busy_wait`."""
    fork_worker()
    set_busy_wait()


def fork_worker() -> None:
    """In a process multiprocessing started (vLLM's engine), start vLLM's workers by fork when
    ``$TRIDENT_VLLM_FORK_WORKER`` is set."""
    if os.environ.get(FORK_WORKER_ENV) and multiprocessing.parent_process() is not None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"


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
