"""The routers of a mixture-of-experts model in the trainer: frozen or trained, the load-balancing loss, per-step
router metrics, and routing replay (each token's experts forced to recorded ones).

transformers' Qwen3-MoE and Qwen2-MoE layers choose experts in a ``TopKRouter`` (the layer's ``mlp.gate``), whose
forward returns ``(router_logits, routing_weights, selected_experts)``; the layer's experts then compute with the
last two. A forward hook on each router (:class:`Routers`) reads them (metrics, the balancing loss) and, under
replay, replaces the last two: the experts by the recorded ones, the weights by the router's own probabilities at
those experts (:func:`replayed_weights`), so gradients reach the router as they do without replay. Nothing of
transformers' layers is copied or patched.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from contracts.errors import TridentError
from trainer.config import MoeConfig

ROUTER_TYPES = (Qwen3MoeTopKRouter, Qwen2MoeTopKRouter)  # the same interface: logits, weights, experts


def moe_routers(layers: nn.ModuleList) -> dict[int, nn.Module]:
    """Each MoE layer's router, by the decoder layer's index (empty for a dense model)."""
    return {
        i: layer.mlp.gate
        for i, layer in enumerate(layers)
        if isinstance(getattr(layer.mlp, "gate", None), ROUTER_TYPES)
    }


def configure_routers(layers: nn.ModuleList, moe: MoeConfig, model_name: str) -> None:
    """Freeze the routers unless ``moe.router`` trains them, in place; ``[model.moe]`` settings other than the
    defaults on a model without a router are a TridentError (the defaults are welcome: ``rl`` writes every key)."""
    routers = moe_routers(layers)
    if not routers:
        if moe != MoeConfig():
            raise TridentError(
                f"model.moe: {model_name} is a dense model (no mixture-of-experts router): drop the [model.moe] section"
            )
        return
    for router in routers.values():
        router.weight.requires_grad_(moe.router == "trained")


def replayed_weights(
    router_logits: Float[Tensor, "tokens experts"], experts: Int[Tensor, "tokens k"], normalize: bool
) -> Float[Tensor, "tokens k"]:
    """The routing weights of ``experts`` as the router gives them: its softmax probabilities at those experts,
    renormalised to sum to 1 when the router normalises its top-k (``norm_topk_prob``).

    Naive equivalent: ``p = softmax(router_logits.float(), -1); w = p[t, experts[t]]`` per token ``t``; ``w /
    w.sum()`` when ``normalize``. Equal to the router's own weights where ``experts`` is its own top-k choice.
    """
    weights = F.softmax(router_logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


def balance_loss(router_logits: Float[Tensor, "tokens experts"], experts: Int[Tensor, "tokens k"]) -> Float[Tensor, ""]:
    """Switch Transformer's load-balancing loss of one MoE layer: ``n_experts × Σ_e f_e · P_e``, with ``f_e`` the
    share of the token-to-expert assignments that went to expert ``e`` (no gradient) and ``P_e`` its mean router
    probability over the tokens. 1 when both are uniform; larger the more the load piles onto few experts."""
    num_experts = router_logits.shape[-1]
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
    share = expert_counts(experts, num_experts) / experts.numel()
    return num_experts * (share * probs.mean(0)).sum()


def expert_counts(experts: Int[Tensor, "tokens k"], num_experts: int) -> Float[Tensor, " experts"]:
    """How many of the tokens' assignments each expert got (no host sync, unlike ``bincount``)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, device=flat.device).index_add_(0, flat, torch.ones(len(flat), device=flat.device))


@dataclass
class LayerRecord:
    """What a router hook saw of one MoE layer in a micro-batch's forward pass."""

    experts: Int[Tensor, "tokens k"]  # the experts the layer computed with
    counts: Float[Tensor, " experts"]
    entropy: Float[Tensor, ""]  # summed over the tokens
    balance: Float[Tensor, ""] | None  # with gradient, when the balancing loss is on


class Routers:
    """Hooks on a model's routers and what they see: one micro-batch at a time (:meth:`micro_batch`), the step's
    router metrics added up on the device (:meth:`step_metrics` reads them once).

    The hooks measure only in passes with gradient and only inside :meth:`micro_batch` with ``measure``: the frozen
    reference's forward (no gradient) and a rank's filler micro-batch (weight 0) are left out. A pass recomputed
    for activation checkpointing overwrites its layer's record with the same values.
    """

    def __init__(self, layers: nn.ModuleList, moe: MoeConfig, device: torch.device):
        self.device = device
        self.routers = moe_routers(layers)
        self.num_layers = len(layers)
        self.balancing = moe.aux_loss_coef > 0
        self.routes: Int[Tensor, "tokens layers k"] | None = None
        self.measuring = False
        self.records: dict[int, LayerRecord] = {}
        self.attach(layers)
        router = next(iter(self.routers.values()))
        self.num_experts, self.top_k = router.num_experts, router.top_k
        self.start_step()

    @classmethod
    def install(cls, layers: nn.ModuleList, moe: MoeConfig, device: torch.device) -> "Routers | None":
        """Hooks on the routers of ``layers`` (computing on ``device``); None for a dense model."""
        return cls(layers, moe, device) if moe_routers(layers) else None

    def attach(self, layers: nn.ModuleList) -> None:
        """Hook the routers of ``layers`` too (the frozen reference's: it replays the same routes)."""
        for index, router in moe_routers(layers).items():
            router.register_forward_hook(partial(self._hook, index))

    def _hook(self, layer: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        router_logits, weights, experts = output
        if self.routes is not None:
            experts = self.routes[:, layer].to(device=router_logits.device, dtype=torch.long, non_blocking=True)
            weights = replayed_weights(router_logits, experts, router.norm_topk_prob).to(weights.dtype)
        if self.measuring and torch.is_grad_enabled():
            with torch.no_grad():
                logprobs = F.log_softmax(router_logits, dim=-1, dtype=torch.float)
                entropy = -(logprobs.exp() * logprobs).sum()
                counts = expert_counts(experts, router.num_experts)
            balance = balance_loss(router_logits, experts) if self.balancing else None
            self.records[layer] = LayerRecord(experts.detach(), counts, entropy, balance)
        return router_logits, weights, experts

    @contextmanager
    def micro_batch(self, routes: Int[Tensor, "tokens layers k"] | None, measure: bool) -> Iterator[None]:
        """Within this block the routers compute with ``routes`` (each token's experts per decoder layer; None:
        their own choice) and, with ``measure``, record what they do. Hold it over the backward pass too: a
        layer recomputed there for activation checkpointing must route as it did."""
        self.routes, self.measuring, self.records = routes, measure, {}
        try:
            yield
        finally:
            self.routes, self.measuring = None, False

    def balance(self) -> Float[Tensor, ""]:
        """The micro-batch's load-balancing loss: mean over the MoE layers (with gradient)."""
        return torch.stack([record.balance for record in self.records.values()]).mean()

    def start_step(self) -> None:
        """Zero the step's sums (at the start of a step's forward and backward passes, also when it runs again)."""
        self.counts = torch.zeros(len(self.routers), self.num_experts, device=self.device)
        self.entropy = torch.zeros(len(self.routers), device=self.device)
        self.tokens = torch.zeros((), device=self.device)

    def add_micro_batch(self) -> None:
        """Add the last measured micro-batch's records to the step's sums."""
        if not self.records:
            return
        records = [self.records[layer] for layer in self.routers]
        self.counts += torch.stack([r.counts for r in records])
        self.entropy += torch.stack([r.entropy for r in records])
        self.tokens += len(records[0].experts)

    def step_metrics(self) -> dict[str, float | list[float]]:
        """The step's router metrics over all ranks' real tokens (docs/metrics.md): each MoE layer's load (share
        of the token-to-expert assignments per expert), the imbalance (busiest expert's load over the mean load,
        max and mean over layers) and the router's entropy (nats, mean over layers and tokens)."""
        sums = torch.cat([self.counts.flatten(), self.entropy, self.tokens[None]]).double()
        if dist.is_initialized():
            dist.all_reduce(sums)
        layers = len(self.routers)
        counts = sums[: layers * self.num_experts].view(layers, self.num_experts)
        entropy, tokens = sums[layers * self.num_experts : -1], sums[-1].clamp(min=1)
        load = counts / counts.sum(-1, keepdim=True).clamp(min=1)
        imbalance = load.max(-1).values * self.num_experts
        metrics: dict[str, float | list[float]] = {
            f"router/load/{layer}": row for layer, row in zip(self.routers, load.tolist(), strict=True)
        }
        return metrics | {
            "router/imbalance_max": imbalance.max().item(),
            "router/imbalance_mean": imbalance.mean().item(),
            "router/entropy": (entropy / tokens).mean().item(),
        }


def check_routes(routes: Tensor, num_layers: int, top_k: int, num_experts: int, where: str) -> None:
    """A batch's routes must fit the model: ``[tokens, num_layers, top_k]``, expert ids below ``num_experts``."""
    if tuple(routes.shape[1:]) != (num_layers, top_k):
        raise TridentError(
            f"{where}: routes of shape {list(routes.shape)} do not fit the model's {num_layers} layers × top-{top_k} "
            "experts (replay the routes of the model being trained)"
        )
    if len(routes) and int(routes.max()) >= num_experts:
        raise TridentError(f"{where}: routes name expert {int(routes.max())}, the model has {num_experts}")
