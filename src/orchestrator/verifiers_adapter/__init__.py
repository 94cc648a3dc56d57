"""The orchestrator's one adapter to verifiers (pinned to 0.4.0) and the libraries under it (renderers, aiohttp):
loading environments, running rollouts into :class:`~orchestrator.batching.rollout.Rollout` values, the in-process
harness, the judge, the limits, the renderer and the transport to the server. The rest of the orchestrator imports none
of them; what this package changes in those libraries is applied by :func:`~.patches.install_patches`, never at
import."""
