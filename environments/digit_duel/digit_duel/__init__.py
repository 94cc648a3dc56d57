"""digit-duel: a two-seat self-play game, written from verifiers' v1 documentation.

Two seats of the same policy, ``player0`` and ``player1``, take turns on one conversation topic: ``player0`` opens
on the task's prompt, and each then answers the other's last reply, for ``rounds`` rounds. The player who wrote more
digits over the game wins: reward +1 for the winner, -1 for the loser, 0 each on a tie (zero-sum). Each seat's
trace is one rollout; ``train_player1 = false`` keeps the second seat as a fixed opponent that is not trained.
"""

import random

import verifiers.v1 as vf

from orchestrator.verifiers_adapter.harness import InProcessHarness

TOPICS = "apple river stone cloud music paper light green quiet north window garden".split()


def digits(replies: list[str]) -> int:
    """How many digits ``replies`` hold together."""
    return sum(c.isdigit() for reply in replies for c in reply)


class DigitDuelTasksetConfig(vf.TasksetConfig):
    num_examples: int = 256
    """Topics generated."""
    seed: int = 0
    """Seed of the topic generator."""


class DigitDuelTaskset(vf.Taskset[vf.Task, DigitDuelTasksetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_examples):
            topic = " ".join(rng.choices(TOPICS, k=2))
            prompt = f"Let us talk about {topic}. Use as many digits as you can."
            yield vf.Task(vf.TaskData(id=f"duel-{i}", prompt=prompt), self.config.task)


class DigitDuelConfig(vf.EnvConfig):
    player0: vf.AgentConfig = vf.AgentConfig()
    """The seat that opens the game."""
    player1: vf.AgentConfig = vf.AgentConfig()
    """The seat that answers."""
    rounds: int = 2
    """Replies each player writes."""
    train_player1: bool = True
    """Whether the answering seat's tokens train the policy (false: a fixed opponent)."""


class DigitDuelEnv(vf.Env[DigitDuelConfig]):
    async def setup(self, agents):
        agents.player1.trainable = self.config.train_player1

    async def run(self, task, agents):
        # player1 plays the same task with its prompt held back: player0's replies open and carry its side
        answering = type(task)(task.data.model_copy(update={"prompt": None}), task.config)
        async with agents.player0.interaction(task) as first, agents.player1.interaction(answering) as second:
            reply = await first.turn()
            for played in range(1, self.config.rounds + 1):
                answer = await second.turn(reply.last_reply or "(silence)")
                if answer.terminated or played == self.config.rounds:
                    break
                reply = await first.turn(answer.last_reply or "(silence)")
                if reply.terminated:
                    break

    async def finalize(self, task, episode):
        written = {trace.agent.name: digits([m.content or "" for m in trace.assistant_messages])
                   for trace in episode.traces}  # fmt: skip
        for trace in episode.traces:
            other = max((count for name, count in written.items() if name != trace.agent.name), default=0)
            mine = written[trace.agent.name]
            trace.record_reward("win", float((mine > other) - (mine < other)))


__all__ = ["InProcessHarness", "DigitDuelEnv", "DigitDuelTaskset", "digits"]
