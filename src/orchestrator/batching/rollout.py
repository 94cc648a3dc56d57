"""A finished rollout as the rest of the orchestrator sees it: plain values, whatever ran it. The verifiers adapter
(:func:`~orchestrator.verifiers_adapter.envs.run_group`) makes them; advantages, batches, stats and refills read
them."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Branch:
    """One trainable branch of a rollout, token for token as the server saw and sampled it: what one training sample
    is made from (:func:`~orchestrator.batching.batch.branch_sample`)."""

    token_ids: list[int]
    loss_mask: list[bool]  # True where the policy sampled the token and this branch trains it (a shared one: once)
    logprobs: list[float]  # the server's logprob of each sampled token, 0 elsewhere
    # a mixture-of-experts model's routes ([tokens, layers, top_k] uint8 expert ids) when the server returned them
    # (vLLM's enable_return_routed_experts, for routing replay), else None
    routes: "torch.Tensor | None" = None
    # per token: the weights step that sampled it as the server labelled it, None where it is not sampled or the
    # server labelled none (then it is the step served when its group started); None: no token labelled
    weight_steps: list[int | None] | None = None
    # the refs (contracts.images) of the images whose placeholder runs its token ids hold, in order; the images are in
    # the run's image store
    images: list[str] = field(default_factory=list)
    # on-policy distillation: the teacher's logprob of each token in its full context (0 for the first), else None
    teacher_logprobs: list[float] | None = None
    # per token: its weight in the cross-entropy term (Sample.ce_weights) where its environment's algorithm trains
    # tokens on their likelihood (echo, sft), else None
    ce_weights: list[float] | None = None
    ce_roles: list[str] | None = None  # the roles of the turns ce_weights may cover (batch.json's, for the checker)


@dataclass
class Rollout:
    """One finished rollout, one seat's trace of an episode: its reward and its trainable branches."""

    reward: float
    branches: list[Branch]
    ok: bool
    truncated: bool = False  # a model call stopped at max_tokens
    error: str | None = None  # "<Type>: <message>", e.g. "TaskError: ...": the metrics count failed rollouts by type
    traceback: str | None = None  # the error's traceback where it has one (kept in metrics/failed_rollouts.jsonl)
    rewards: dict[str, float] = field(default_factory=dict)  # score of each reward function
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's metrics (not rewards)
    turns: int = 0  # model calls
    task: str = ""  # the task's id
    env: str = ""  # the environment's id
    lost: bool = False  # failed with an infrastructure error (batching.infra), retries spent: not an outcome
    retries: int = 0  # times it was run again after an infrastructure error
    setup_s: float | None = None  # seconds from its runtime's start to its agent's, when set-up finished
    seat: str = ""  # the environment's agent that played it (e.g. "player0"; "agent" for a single-agent environment)
    trained: bool = True  # False: a seat the environment does not train, or one on another model: no branches
    episode: int = 0  # the episode of its group that gave it (several seats, or several runs of one, share one)
    algorithm: str = "grpo"  # its environment's (config.Algorithm): what its tokens train on
