"""A running baseline per environment and seat (``[advantage] baseline = "running"``): role-conditioned advantage
estimation (RAE, SPIRAL, arXiv:2506.24119), for self-play, where a group's mean says little (a zero-sum game's is 0
whatever the policy does) and each seat has its own usual result. A checkpoint part: the baselines are state across
steps, so a resumed run computes the advantages an uninterrupted one would.
"""

import logging
from typing import Any

from orchestrator.batching.rollout import Rollout

logger = logging.getLogger("orchestrator")
STATE_KEY = "running_baselines"


class RunningBaselines:
    """Each (environment, seat)'s running average of its rollouts' rewards, 0 until its first rollout.

    A rollout's advantage is ``r - b``, with ``b`` its environment and seat's baseline before its own reward moves it
    (so ``b`` does not depend on ``r``); then ``b <- decay * b + (1 - decay) * r``. Rollouts are taken in the step's
    order (group by group, rollout by rollout). Failed rollouts and untrained seats get 0 and move nothing.
    """

    def __init__(self, decay: float):
        self.decay = decay
        self.baselines: dict[tuple[str, str], float] = {}

    def advantages(self, groups: list[list[Rollout]], rewards: list[list[float]]) -> list[list[float]]:
        """The advantages of ``groups`` (rewards ``rewards``, one row per group, as advantages see them), moving the
        baselines past them."""
        advantages = [[0.0] * len(group) for group in groups]
        for group, row, advantages_row in zip(groups, rewards, advantages, strict=True):
            for i, (rollout, reward) in enumerate(zip(group, row, strict=True)):
                if rollout.trained and rollout.ok:
                    key = (rollout.env, rollout.seat)
                    baseline = self.baselines.get(key, 0.0)
                    advantages_row[i] = reward - baseline
                    self.baselines[key] = self.decay * baseline + (1 - self.decay) * reward
        return advantages

    def metrics(self) -> dict[str, float]:
        """Each environment seat's baseline now, as ``running_baseline/<env>/<seat>``."""
        return {f"running_baseline/{env}/{seat}": b for (env, seat), b in self.baselines.items()}

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: [{"env": env, "seat": seat, "baseline": b} for (env, seat), b in self.baselines.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the baselines of ``state``; a checkpoint without them (written without a running baseline) starts
        them at 0, with a warning."""
        if STATE_KEY not in state:
            logger.warning("the checkpoint has no running baselines: they start at 0")
            return
        self.baselines = {(entry["env"], entry["seat"]): entry["baseline"] for entry in state[STATE_KEY]}
        logger.info(f"running baselines restored: {len(self.baselines)} environment seats")
