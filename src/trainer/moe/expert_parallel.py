"""Expert parallelism: each mixture-of-experts layer's experts split over ``ep`` ranks, tokens sent to the rank that
holds their expert and back by all-to-all.

The ranks form a ``replica × ep`` device mesh: rank ``r`` is the ``r % ep``-th of its expert-parallel group. Each
MoE layer's fused experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) become DTensors sharded by expert
over the ``ep`` dimension (a rank holds E / ep whole experts), and FSDP2 shards them further over the ``replica``
dimension, as it shards everything else over all ranks. The parameters keep their names and global shapes, so
checkpoints (``torch.distributed.checkpoint``) and weight export (``full_tensor``) see the full experts.

A layer's forward, on each rank of an expert-parallel group at once: the router (transformers' own, untouched) picks
each token's top-k experts; each (token, expert) pair is sent to the rank holding that expert (an all-to-all of
rows, sorted by expert), goes through its expert's MLP there (torch's grouped GEMM on a GPU in bfloat16, a loop over
the local experts elsewhere), comes back by the reverse all-to-all, and is weighted by its routing weight and added
up on the token's own rank. Both all-to-alls are autograd functions, whose backward is the reverse all-to-all: a
rank's experts get the gradient of every token routed to them from the whole group.

Gradients are scaled as FSDP2 scales the others (``trainer.parallel.shard_model``): summed, never averaged. A
non-expert gradient is the sum over all ranks of each rank's tokens; an expert's is the sum over its ``replica``
ranks of the gradients its ``ep`` group's tokens sent it: both are the sum over all the step's tokens.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from contracts.errors import TridentError


def expert_mesh(ep: int, device_type: str) -> DeviceMesh:
    """All ranks as a ``replica × ep`` mesh: ``ep`` consecutive ranks split each layer's experts between them."""
    ranks = dist.get_world_size()
    if ranks % ep:
        raise TridentError(f"model.parallel.ep = {ep} must divide the trainer's {ranks} ranks")
    return init_device_mesh(device_type, (ranks // ep, ep), mesh_dim_names=("replica", "ep"))


def split_experts(model: nn.Module, mesh: DeviceMesh) -> list["ParallelExperts"]:
    """Replace each mixture-of-experts layer's experts (a block's ``experts`` module, transformers' fused layout)
    by :class:`ParallelExperts` over ``mesh``, in place; returns them. Every rank holds the full model before; each
    keeps its own experts after. A dense model, experts that do not split evenly over the ``ep`` ranks, or experts
    under a LoRA adapter are a TridentError."""
    ep, replaced = mesh["ep"].size(), []
    for block in [module for module in model.modules() if isinstance(getattr(module, "experts", None), nn.Module)]:
        experts = block.experts
        if hasattr(experts, "base_layer"):  # peft's wrapper of adapted expert weights
            raise TridentError(
                f"model.parallel.ep = {ep}: a LoRA adapter on the experts' weights cannot be split over ranks; "
                "leave them out of model.experimental.lora.target_modules (or set ep = 1)"
            )
        if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False):
            raise TridentError(
                f"model.parallel.ep = {ep}: the {type(experts).__name__} layout (biases or transposed weights) is "
                "not supported by expert parallelism; set ep = 1"
            )
        if experts.gate_up_proj.shape[0] % ep:
            raise TridentError(
                f"model.parallel.ep = {ep} must divide the model's {experts.gate_up_proj.shape[0]} experts"
            )
        block.experts = ParallelExperts(experts, mesh)
        replaced.append(block.experts)
    if not replaced:
        raise TridentError(
            f"model.parallel.ep = {ep}: the {model.config.model_type} model has no mixture-of-experts layers; "
            "set ep = 1"
        )
    return replaced


class ParallelExperts(nn.Module):
    """A mixture-of-experts layer's experts (transformers' fused ``gate_up_proj`` / ``down_proj`` layout) split by
    expert over the ranks of ``mesh``'s ``ep`` dimension; ``forward(hidden, selected_experts, routing_weights)`` as
    transformers' experts module. Every rank of the ``ep`` group must run each forward and backward pass."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh["ep"]
        self.group = self.mesh.get_group()
        self.ep = self.mesh.size()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.act_fn = experts.act_fn
        self.gate_up_proj = self.own_share(experts.gate_up_proj)
        self.down_proj = self.own_share(experts.down_proj)

    def own_share(self, parameter: nn.Parameter) -> nn.Parameter:
        """This rank's experts of a fused ``[E, ...]`` parameter, as a DTensor of the full shape."""
        local = parameter.detach().chunk(self.ep)[self.mesh.get_local_rank()].clone()
        tensor = DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)
        return nn.Parameter(tensor, requires_grad=parameter.requires_grad)

    def forward(
        self,
        hidden: Float[Tensor, "tokens hidden"],
        selected_experts: Int[Tensor, "tokens k"],
        routing_weights: Float[Tensor, "tokens k"],
    ) -> Float[Tensor, "tokens hidden"]:
        """Naive equivalent: ``Σ_j routing_weights[t, j] · mlp_{selected_experts[t, j]}(hidden[t])`` for each token."""
        tokens, k = selected_experts.shape
        choices = selected_experts.reshape(-1)  # the (token, expert) pairs, token by token
        order = torch.argsort(choices, stable=True)  # sorted by expert, so by the rank that holds it
        per_expert = torch.bincount(choices, minlength=self.num_experts)
        counts = self.counts_received(per_expert)
        sent = per_expert.view(self.ep, -1).sum(1).tolist()
        received = counts.sum(1).tolist()
        rows = all_to_all_single_autograd(hidden[order // k], received, sent, self.group)

        local_expert = torch.arange(counts.shape[1], device=hidden.device).repeat(self.ep)
        by_expert = torch.argsort(local_expert.repeat_interleave(counts.flatten()), stable=True)
        gate_up_proj, down_proj = self.gate_up_proj.to_local(), self.down_proj.to_local()
        grouped = hidden.is_cuda and gate_up_proj.dtype == torch.bfloat16
        outputs = expert_mlps(rows[by_expert], counts.sum(0), gate_up_proj, down_proj, self.act_fn, grouped)

        returned = all_to_all_single_autograd(outputs[torch.argsort(by_expert)], sent, received, self.group)
        per_choice = returned[torch.argsort(order)].view(tokens, k, -1)
        return (per_choice * routing_weights[..., None].to(per_choice.dtype)).sum(1).to(hidden.dtype)

    def counts_received(self, per_expert: Int[Tensor, " experts"]) -> Int[Tensor, "ranks local_experts"]:
        """How many rows this rank receives from each rank of its group for each of its experts, given how many it
        sends to each expert (an all-to-all of the counts)."""
        received = torch.empty_like(per_expert)
        dist.all_to_all_single(received, per_expert, group=self.group)
        return received.view(self.ep, -1)


def expert_mlps(
    rows: Float[Tensor, "rows hidden"],
    rows_per_expert: Int[Tensor, " experts"],
    gate_up_proj: Float[Tensor, "experts two_inter hidden"],
    down_proj: Float[Tensor, "experts hidden inter"],
    act_fn: nn.Module,
    grouped: bool,
) -> Float[Tensor, "rows hidden"]:
    """Each row through its expert's gated MLP, the rows grouped by expert (``rows_per_expert[e]`` rows for expert
    ``e``, in order). Naive equivalent: ``down_e(act(gate_e(x)) * up_e(x))`` for each row ``x`` of expert ``e``.

    ``grouped``: one grouped GEMM per projection covers all experts (``torch.nn.functional.grouped_mm``, what a GPU
    runs in bfloat16); else a loop over the experts.
    """
    if grouped:
        offsets = torch.cumsum(rows_per_expert, 0, dtype=torch.int32)
        gate, up = F.grouped_mm(rows, gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, -1)
        return F.grouped_mm(act_fn(gate) * up, down_proj.transpose(1, 2), offs=offsets)
    outputs = []
    for x, gate_up, down in zip(rows.split(rows_per_expert.tolist()), gate_up_proj, down_proj, strict=True):
        gate, up = F.linear(x, gate_up).chunk(2, -1)
        outputs.append(F.linear(act_fn(gate) * up, down))
    return torch.cat(outputs)
