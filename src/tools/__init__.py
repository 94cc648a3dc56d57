"""Operator tools over a run's files (rollout checks and views, plots, the HTML report): above the contracts, used by
``scripts/``, ``trident-plot`` and ``rl`` after a run."""
