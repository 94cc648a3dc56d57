"""propose-solve: a proposer writes a problem, ``solvers`` solver runs answer it; written from verifiers' v1
documentation.

Each task asks the ``proposer`` seat for a new addition problem like the task's example (``37 + 45``), with numbers up
to the task's bound. ``run`` hands the proposer's problem (the first ``a + b`` in its reply; the example when its reply
holds none) to the ``solver`` seat, played ``solvers`` times on it, each run a trace of its own. A solver's reward
``correct`` is puzzle-stream's: 1 when its reply's last number is the sum, else half the share of the sum's digits it
holds. The proposer's reward ``balance`` is ``1 - |2p - 1|`` for the share ``p`` of the solvers that got the sum
exactly: 1 when half of them do, 0 when none or all do, and 0 for a reply that holds no problem (metrics ``solved`` =
p and ``valid_problem``). ``train_proposer = false`` keeps the proposer untrained, as a fixed problem writer.
"""

import random
import re

import verifiers.v1 as vf
from puzzle_stream import sum_reward
from pydantic import Field

from orchestrator.verifiers_adapter.harness import InProcessHarness

PROBLEM = re.compile(r"(\d+)\s*\+\s*(\d+)")


def problem_in(reply: str) -> tuple[int, int] | None:
    """The first ``a + b`` written in ``reply``, if any."""
    match = PROBLEM.search(reply)
    return (int(match[1]), int(match[2])) if match else None


def balance(solved: float) -> float:
    """The proposer's reward for a problem ``solved`` (a share) of the solvers got right: highest at one half."""
    return 1.0 - abs(2.0 * solved - 1.0)


class ProposeSolveConfig(vf.TasksetConfig):
    num_examples: int = 256
    """Tasks generated."""
    max_number: int = 99
    """Largest number the proposer is asked to use (the task's bound is drawn up to it)."""
    seed: int = 0
    """Seed of the task generator."""


class ProposeData(vf.TaskData):
    example: str
    """The example problem, ``a + b``: what the solvers get when the proposer writes none."""


class SolveData(vf.TaskData):
    answer: str


class SolveTask(vf.Task[SolveData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SolveData, trace: vf.Trace) -> float:
        return sum_reward(trace.last_reply, task.answer)


class ProposeSolveTaskset(vf.Taskset[vf.Task[ProposeData, vf.State, vf.TaskConfig], ProposeSolveConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_examples):
            bound = rng.randint(10, max(10, self.config.max_number))
            example = f"{rng.randint(1, bound)} + {rng.randint(1, bound)}"
            prompt = (f"Write one new addition problem for a student, like {example}, with whole numbers up to "
                      f"{bound}. Reply with the problem only.")  # fmt: skip
            yield vf.Task(ProposeData(id=f"propose-{i}", prompt=prompt, example=example), self.config.task)


class ProposeSolveEnvConfig(vf.EnvConfig):
    proposer: vf.AgentConfig = vf.AgentConfig()
    """The seat that writes the problem."""
    solver: vf.AgentConfig = vf.AgentConfig()
    """The seat that answers it, played ``solvers`` times an episode."""
    solvers: int = Field(2, ge=1)
    """Solver runs per episode, each a trace of the ``solver`` seat."""
    train_proposer: bool = True
    """Whether the proposer's tokens train the policy (false: a fixed problem writer)."""


class ProposeSolveEnv(vf.Env[ProposeSolveEnvConfig]):
    async def setup(self, agents):
        agents.proposer.trainable = self.config.train_proposer

    async def run(self, task, agents):
        proposal = await agents.proposer.run(task)
        a, b = problem_in(proposal.last_reply or "") or problem_in(task.data.example)
        prompt = f"What is {a} + {b}? Reply with the number only."
        problem = SolveTask(SolveData(id=task.data.id, prompt=prompt, answer=str(a + b)), task.config)
        for _ in range(self.config.solvers):
            await agents.solver.run(problem)

    async def finalize(self, task, episode):
        (proposal,) = episode.by_agent["proposer"]
        solved = [trace.rewards["correct"].score == 1.0 for trace in episode.by_agent.get("solver", [])]
        share = sum(solved) / len(solved) if solved else 0.0
        valid = problem_in(proposal.last_reply or "") is not None
        proposal.record_reward("balance", balance(share) if valid else 0.0)
        proposal.record_metric("solved", share)
        proposal.record_metric("valid_problem", float(valid))


__all__ = ["InProcessHarness", "ProposeSolveEnv", "ProposeSolveTaskset", "balance", "problem_in"]
