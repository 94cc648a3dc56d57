"""The routers of a mixture-of-experts model in the trainer (trainer.moe.routing): frozen or trained, routing replay,
the load-balancing loss and the router metrics, on trident/tiny-qwen3-moe and small random MoEs."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from contracts.errors import TridentError
from contracts.protocol import BatchInfo, MicroBatch, read_batch, write_batch
from tools.tiny_model import built_model_path
from trainer.config import MoeConfig, TrainerConfig, TrainerModelConfig
from trainer.model import decoder_layers, load_model, packed_logprobs, use_packed_forward
from trainer.moe.routing import (
    LayerRecord,
    Routers,
    balance_loss,
    check_routes,
    expert_counts,
    moe_routers,
    replayed_weights,
)
from trainer.train import train

MOE = "trident/tiny-qwen3-moe"


@pytest.fixture(scope="module")
def moe_path() -> str:
    return built_model_path(MOE)


def moe_model(path: str, **moe) -> torch.nn.Module:
    """The policy as the trainer loads it, with ``[model.moe]`` set to ``moe`` when given."""
    return load_model(TrainerModelConfig(name=path, **({"moe": moe} if moe else {})), torch.device("cpu"))


def experts_seen(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Hooks that keep the experts each MoE layer's experts module was handed (what it computed with)."""
    seen = {}
    for i, layer in enumerate(decoder_layers(model)):
        layer.mlp.experts.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[1].clone()))
    return seen


def perturbed_routes(path: str, micro_batch: MicroBatch) -> torch.Tensor:
    """Routes recorded from a forward pass of the model with its routers' weights perturbed."""
    model = moe_model(path)
    torch.manual_seed(1)
    for router in moe_routers(decoder_layers(model)).values():
        router.weight.data += 0.5 * torch.randn_like(router.weight)
    routers = Routers(decoder_layers(model), MoeConfig(), torch.device("cpu"))
    with routers.micro_batch(None, measure=True):
        packed_logprobs(model, micro_batch, 1.0)  # measured: a pass with gradient
    return recorded_routes(routers)


def recorded_routes(routers: Routers) -> torch.Tensor:
    """The experts each token went to in each decoder layer in the routers' last measured pass (uint8, as the batch
    files hold them; 0 at layers without a router)."""
    first = next(iter(routers.records.values())).experts
    routes = torch.zeros(len(first), routers.num_layers, routers.top_k, dtype=torch.uint8)
    for layer, record in routers.records.items():
        routes[:, layer] = record.experts
    return routes


def test_replay_forces_every_tokens_experts_and_the_router_still_gets_gradients(moe_path, random_samples):
    micro_batch = MicroBatch.pack(random_samples(4))
    routes = perturbed_routes(moe_path, micro_batch)
    model = moe_model(moe_path, router="trained")
    seen = experts_seen(model)
    routers = Routers(decoder_layers(model), MoeConfig(router="trained"), torch.device("cpu"))
    packed_logprobs(model, micro_batch, 1.0)
    own = {i: experts.clone() for i, experts in seen.items()}
    assert any(not torch.equal(own[i], routes[:, i].long()) for i in own)  # the perturbed routes differ somewhere

    with routers.micro_batch(routes, measure=True):
        packed_logprobs(model, micro_batch, 1.0).sum().backward()
    for i, experts in seen.items():  # what each layer's experts computed with is the recorded choice, every token
        assert torch.equal(experts, routes[:, i].long())
    assert torch.equal(recorded_routes(routers), routes)
    for router in moe_routers(decoder_layers(model)).values():
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replaying_a_models_own_routes_changes_no_logprob(moe_path, random_samples):
    micro_batch = MicroBatch.pack(random_samples(4))
    model = moe_model(moe_path)
    routers = Routers(decoder_layers(model), MoeConfig(), torch.device("cpu"))
    with routers.micro_batch(None, measure=True):
        own = packed_logprobs(model, micro_batch, 1.0)
    routes = recorded_routes(routers)
    with routers.micro_batch(routes, measure=False):
        replayed = packed_logprobs(model, micro_batch, 1.0)
    assert torch.equal(replayed, own)
    with routers.micro_batch(perturbed_routes(moe_path, micro_batch), measure=False):
        assert not torch.allclose(packed_logprobs(model, micro_batch, 1.0), own)  # other routes do change them


def test_replayed_weights_are_the_routers_own_at_its_own_choice():
    logits = torch.randn(7, 8)
    for normalize in (False, True):
        probs = torch.softmax(logits, -1)
        top, experts = probs.topk(2, -1)
        expected = top / top.sum(-1, keepdim=True) if normalize else top
        assert torch.equal(replayed_weights(logits, experts, normalize), expected)
    forced = torch.tensor([[0, 1]] * 7)
    assert torch.allclose(replayed_weights(logits, forced, True).sum(-1), torch.ones(7))


def test_balance_loss_is_one_when_balanced_and_grows_with_imbalance():
    uniform = torch.zeros(8, 4)
    experts = torch.tensor([[0, 1], [2, 3]] * 4)
    assert balance_loss(uniform, experts).item() == pytest.approx(1.0)
    skewed = torch.tensor([[4.0, 3.0, 0.0, 0.0]] * 8)
    assert balance_loss(skewed, torch.tensor([[0, 1]] * 8)).item() > 1.5


def test_the_router_is_frozen_by_default_and_trains_when_asked(moe_path):
    for setting, trains in (({}, False), ({"router": "trained"}, True)):
        model = moe_model(moe_path, **setting)
        assert {r.weight.requires_grad for r in moe_routers(decoder_layers(model)).values()} == {trains}
        assert all(p.requires_grad for n, p in model.named_parameters() if "gate." not in n)


def test_moe_settings_are_refused_on_a_dense_model_and_bad_combinations_in_the_config(tiny_model_path):
    with pytest.raises(TridentError, match=r"^model.moe: .* is a dense model .*drop the \[model.moe\] section$"):
        moe_model(tiny_model_path, replay=True)
    moe_model(tiny_model_path)  # no [model.moe]: nothing to refuse
    moe_model(tiny_model_path, **MoeConfig().model_dump())  # its defaults written out, as rl writes every key
    with pytest.raises(ValueError, match="needs|router = 'trained'"):
        MoeConfig(aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="under \\[model.experimental.lora\\]"):
        TrainerModelConfig(moe={"router": "trained"}, experimental={"lora": {}})


def qwen2_moe(tmp_path: Path) -> str:
    """A random 2-layer Qwen2-MoE (a shared expert beside 8 routed ones, top-2) on the tiny tokenizer."""
    config = Qwen2MoeConfig(
        vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(config).save_pretrained(tmp_path / "qwen2-moe")
    return str(tmp_path / "qwen2-moe")


def test_qwen2_moe_replays_as_qwen3_moe(tmp_path, random_samples):
    path = qwen2_moe(tmp_path)
    model = use_packed_forward(AutoModelForCausalLM.from_pretrained(path))
    routers = Routers(decoder_layers(model), MoeConfig(), torch.device("cpu"))
    micro_batch = MicroBatch.pack(random_samples(3))
    with routers.micro_batch(None, measure=True):
        own = packed_logprobs(model, micro_batch, 1.0)
    routes = recorded_routes(routers)
    assert routes.shape == (len(micro_batch.input_ids), 2, 2) and int(routes.max()) < 8
    shifted = (routes + 1) % 8
    seen = experts_seen(model)
    with routers.micro_batch(shifted, measure=False):
        assert not torch.allclose(packed_logprobs(model, micro_batch, 1.0), own)
    assert all(torch.equal(experts, shifted[:, i].long()) for i, experts in seen.items())


def with_routes(samples, routes: torch.Tensor):
    """The samples, each carrying its slice of ``routes`` (packed in their order)."""
    start = 0
    for sample in samples:
        sample.routes = routes[start : start + len(sample.token_ids)]
        start += len(sample.token_ids)
    return samples


def run(output_dir: Path, path: str, **moe) -> dict:
    config = TrainerConfig(output_dir=output_dir, max_steps=1, model={"name": path, "moe": moe}, optim={"lr": 1e-3})
    train(config)
    return json.loads((output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()[0])


def test_a_step_logs_router_metrics_the_balancing_loss_and_the_mismatch_with_and_without_replay(
    tmp_path, moe_path, random_samples
):
    samples = random_samples(6)
    routes = perturbed_routes(moe_path, MicroBatch.pack(samples))
    samples = with_routes(samples, routes)
    micro_batches = [MicroBatch.pack(samples[:2]), MicroBatch.pack(samples[2:])]
    info = BatchInfo(1, 6, sum(len(s.token_ids) for s in samples), sum(sum(s.loss_mask) for s in samples), 0.0, 1.0)
    write_batch(tmp_path / "replay", info, micro_batches)
    assert read_batch(tmp_path / "replay", 1)[1][1].routes.dtype == torch.uint8  # the routes round-trip
    record = run(tmp_path / "replay", moe_path, router="trained", aux_loss_coef=0.01, replay=True)

    load = [record[f"router/load/{layer}"] for layer in (0, 1)]
    # the load is the replayed routes' share of each expert, over all the step's tokens
    for layer in (0, 1):
        counts = torch.bincount(routes[:, layer].flatten().long(), minlength=4).double()
        assert load[layer] == pytest.approx((counts / counts.sum()).tolist())
    imbalance = [4 * max(row) for row in load]
    assert record["router/imbalance_max"] == pytest.approx(max(imbalance))
    assert record["router/imbalance_mean"] == pytest.approx(sum(imbalance) / 2)
    assert 0 < record["router/entropy"] < torch.log(torch.tensor(4.0)).item() + 1e-6
    # the step's balancing loss is each micro-batch's (mean over layers) weighted by its share of the step's tokens
    model = moe_model(moe_path, router="trained", aux_loss_coef=0.01)
    routers = Routers(decoder_layers(model), MoeConfig(router="trained", aux_loss_coef=0.01), torch.device("cpu"))
    expected = 0.0
    for micro_batch in micro_batches:
        with routers.micro_batch(micro_batch.routes, measure=True):
            packed_logprobs(model, micro_batch, 1.0)
            expected += routers.balance().item() * len(micro_batch.input_ids) / info.num_tokens
    assert record["router/aux_loss"] == pytest.approx(expected, rel=1e-5) and expected > 1.0  # 1 at perfect balance
    assert record["replayed_fraction"] == 1.0
    # the perturbed routes are not the trainer's own: forcing them moves its logprobs away from the
    # (random-model-like) server logprobs differently than its own routing does
    assert record["mismatch_kl_no_replay"] != record["mismatch_kl"]
    assert {re.sub(r"/\d+$", "/<layer>", key) for key in record} <= documented_trainer_keys()

    write_batch(tmp_path / "off", info, micro_batches)
    record = run(tmp_path / "off", moe_path)  # routes in the files, replay off: not used
    assert (
        "replayed_fraction" not in record and "mismatch_kl_no_replay" not in record and "router/aux_loss" not in record
    )
    assert record["router/load/0"] != pytest.approx(load[0])


def documented_trainer_keys() -> set[str]:
    text = (Path(__file__).parents[3] / "docs" / "metrics.md").read_text().split("## Trainer")[1].split("\n## ")[0]
    return set(re.findall(r"^\| `([a-z_/<>]+)` \|", text, flags=re.M))


def test_sft_refuses_replay_and_the_balancing_loss():
    from trainer.config import SFTConfig

    for moe in ({"replay": True}, {"router": "trained", "aux_loss_coef": 0.01}):
        with pytest.raises(ValueError, match="are the RL trainer's"):
            SFTConfig(model={"moe": moe}, data={"path": "data.parquet"})
    SFTConfig(model={"moe": {"router": "trained"}}, data={"path": "data.parquet"})


def test_replay_holds_in_layers_recomputed_for_activation_checkpointing(moe_path, random_samples):
    """A layer recomputed in the backward pass routes as its forward pass did: same gradients with and without."""
    micro_batch = MicroBatch.pack(random_samples(4))
    routes = perturbed_routes(moe_path, micro_batch)
    grads = []
    for ac in (None, {"part": "layer"}, {"part": "mlp"}):
        config = TrainerModelConfig(name=moe_path, moe={"router": "trained"}, ac=ac)
        model = load_model(config, torch.device("cpu"))
        routers = Routers(decoder_layers(model), config.moe, torch.device("cpu"))
        with routers.micro_batch(routes, measure=True):
            packed_logprobs(model, micro_batch, 1.0).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[1], grads[0], atol=1e-6) and torch.allclose(grads[2], grads[0], atol=1e-6)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "norm_topk_prob"])
def test_replay_mixes_the_forced_experts_with_the_routers_probabilities_at_them(normalize):
    """One hand-made MoE layer (4 experts, top-2) whose router's logits are its input: under replay its experts are
    handed the router's softmax probabilities at the forced experts (renormalised under ``norm_topk_prob``), not the
    router's own top-k weights."""
    config = Qwen3MoeConfig(hidden_size=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=2,
                            norm_topk_prob=normalize)  # fmt: skip
    layer = torch.nn.Module()
    layer.mlp = Qwen3MoeSparseMoeBlock(config)
    layer.mlp.gate.weight.data = torch.eye(4)  # router logits = the hidden state
    torch.nn.init.normal_(layer.mlp.experts.gate_up_proj)
    torch.nn.init.normal_(layer.mlp.experts.down_proj)
    handed = []
    layer.mlp.experts.register_forward_pre_hook(lambda module, args: handed.append(args[1:]))
    routers = Routers(torch.nn.ModuleList([layer]), MoeConfig(), torch.device("cpu"))
    logits = torch.tensor([[3.0, 1.0, 0.5, -1.0], [0.0, 2.0, -2.0, 1.5]])  # the router's own top-2: (0, 1), (1, 3)
    forced = torch.tensor([[[2, 3]], [[3, 0]]], dtype=torch.uint8)  # tokens × layers × k

    with routers.micro_batch(forced, measure=False):
        layer.mlp(logits[None])
    experts, weights = handed[0]
    assert torch.equal(experts, forced[:, 0].long())
    # by hand: softmax(logits)[t, e] = exp(logits[t, e]) / Σ_e' exp(logits[t, e']), at the forced experts in their order
    e = math.exp
    totals = (e(3) + e(1) + e(0.5) + e(-1), e(0) + e(2) + e(-2) + e(1.5))
    expected = torch.tensor([[e(0.5) / totals[0], e(-1) / totals[0]], [e(1.5) / totals[1], e(0) / totals[1]]])
    if normalize:
        expected = torch.tensor([[e(0.5), e(-1)], [e(1.5), e(0)]]) / torch.tensor([[e(0.5) + e(-1)], [e(1.5) + e(0)]])
    torch.testing.assert_close(weights, expected)

    with routers.micro_batch(None, measure=False):  # without replay: the router's own top-2 and their weights
        layer.mlp(logits[None])
    own_experts, own_weights = handed[1]
    assert own_experts.tolist() == [[0, 1], [1, 3]]
    assert not torch.allclose(own_weights, expected, atol=1e-3)  # so keeping them under replay would fail above


def test_replayed_weights_of_a_bf16_router_are_computed_in_float32():
    # normalised in float32, each weight is the float64 one rounded to bf16; in bf16 about 3 in 10 are off by an ulp
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=generator).bfloat16()
    experts = torch.randint(0, 8, (64, 2), generator=generator)
    exact = torch.softmax(logits.double(), -1).gather(-1, experts)
    exact = exact / exact.sum(-1, keepdim=True)
    assert torch.equal(replayed_weights(logits, experts, normalize=True), exact.bfloat16())


def test_balance_loss_of_a_bf16_router_is_computed_in_float32():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=generator).bfloat16()
    experts = torch.randint(0, 8, (64, 2), generator=generator)
    share = torch.bincount(experts.flatten(), minlength=8).double() / experts.numel()
    exact = 8 * (share * torch.softmax(logits.double(), -1).mean(0)).sum()
    # within 1e-7 of float64 (about 5e-4 off with the probabilities in bf16)
    assert balance_loss(logits, experts).item() == pytest.approx(exact.item(), abs=1e-6)


class Layer(nn.Module):
    """A decoder layer as moe_routers sees it: its ``mlp``, with or without a router at ``mlp.gate``."""

    def __init__(self, top_k: int | None):
        super().__init__()
        self.mlp = nn.Module()
        if top_k is not None:
            config = Qwen3MoeConfig(hidden_size=8, num_experts=4, num_experts_per_tok=top_k)
            self.mlp.gate = Qwen3MoeTopKRouter(config)


def test_a_dense_model_gets_no_router_hooks():
    assert Routers.install(nn.ModuleList([Layer(None), Layer(None)]), MoeConfig(), torch.device("cpu")) is None


def test_the_step_sums_expert_counts_and_replayed_routes_are_on_the_routers_device():
    """On a device other than the host's (meta here, as a GPU would be): the step's sums, the expert counts and the
    replayed routes (read on the host from the batch files) are on it, as the routers' outputs are."""
    meta = torch.device("meta")
    layers = nn.ModuleList([Layer(2)]).to(meta)
    routers = Routers.install(layers, MoeConfig(), meta)
    assert [t.device for t in (routers.counts, routers.entropy, routers.tokens)] == [meta] * 3
    assert expert_counts(torch.zeros(3, 2, dtype=torch.long, device=meta), 4).device == meta
    routes = torch.tensor([[[1, 3]], [[0, 2]], [[2, 3]]], dtype=torch.uint8)  # tokens × layers × k, on the host
    with routers.micro_batch(routes, measure=False):
        _, weights, experts = layers[0].mlp.gate(torch.zeros(3, 8, device=meta))
    assert (experts.device, experts.dtype, weights.device) == (meta, torch.long, meta)


def test_the_balancing_loss_is_computed_only_when_it_is_on():
    """Off (the default), no layer computes it: it would keep a graph no loss reads."""
    for moe in (MoeConfig(), MoeConfig(router="trained", aux_loss_coef=0.01)):
        layers = nn.ModuleList([Layer(1)])
        routers = Routers.install(layers, moe, torch.device("cpu"))
        layers[0].mlp.gate.weight.requires_grad_()
        with routers.micro_batch(None, measure=True):
            layers[0].mlp.gate(torch.randn(3, 8))
        assert (routers.records[0].balance is None) == (moe.aux_loss_coef == 0)


def test_a_pass_outside_a_measured_micro_batch_adds_nothing_to_the_step():
    layers = nn.ModuleList([Layer(1)])
    routers = Routers.install(layers, MoeConfig(), torch.device("cpu"))
    layers[0].mlp.gate.weight.requires_grad_()
    layers[0].mlp.gate(torch.randn(3, 8))  # with gradient, outside micro_batch
    routers.add_micro_batch()
    with routers.micro_batch(None, measure=False):
        layers[0].mlp.gate(torch.randn(3, 8))
    routers.add_micro_batch()
    assert routers.step_metrics()["router/load/0"] == [0, 0, 0, 0]


def test_router_entropy_is_per_token_over_the_experts():
    layers = nn.ModuleList([Layer(1)])
    routers = Routers.install(layers, MoeConfig(), torch.device("cpu"))
    layers[0].mlp.gate.weight.requires_grad_()  # zeros: the 4 experts equally likely for each of the 3 tokens
    with routers.micro_batch(None, measure=True):
        layers[0].mlp.gate(torch.randn(3, 8))
    routers.add_micro_batch()
    assert routers.step_metrics()["router/entropy"] == pytest.approx(math.log(4))


def test_router_entropy_of_a_bf16_router_is_computed_in_float32():
    layers = nn.ModuleList([Layer(2)]).bfloat16()
    routers = Routers.install(layers, MoeConfig(), torch.device("cpu"))
    gate = layers[0].mlp.gate
    generator = torch.Generator().manual_seed(0)
    gate.weight.data = torch.randn(4, 8, generator=generator).bfloat16()
    gate.weight.requires_grad_()
    hidden = torch.randn(16, 8, generator=generator).bfloat16()
    with routers.micro_batch(None, measure=True):
        gate(hidden)
    routers.add_micro_batch()
    logprobs = torch.log_softmax(torch.nn.functional.linear(hidden, gate.weight.detach()).double(), -1)
    exact = -(logprobs.exp() * logprobs).sum(-1).mean()
    assert routers.step_metrics()["router/entropy"] == pytest.approx(exact.item(), abs=1e-5)


def record(counts: list[float], entropy: float) -> LayerRecord:
    """A layer's record of ``sum(counts)`` tokens, each routed to one expert (top-1)."""
    return LayerRecord(torch.zeros(int(sum(counts)), 1), torch.tensor(counts), torch.tensor(entropy), None)


def test_step_metrics_add_up_the_micro_batches_hand_computed():
    routers = Routers.install(nn.ModuleList([Layer(1), Layer(1)]), MoeConfig(), torch.device("cpu"))
    for records in [
        {0: record([2, 0, 0, 0], 1.0), 1: record([1, 1, 0, 0], 2.0)},  # 2 tokens
        {0: record([0, 1, 0, 0], 0.5), 1: record([0, 0, 0, 1], 1.0)},  # 1 token
    ]:
        routers.records = records
        routers.add_micro_batch()
    metrics = routers.step_metrics()
    assert metrics["router/load/0"] == pytest.approx([2 / 3, 1 / 3, 0, 0])
    assert metrics["router/load/1"] == pytest.approx([1 / 3, 1 / 3, 0, 1 / 3])
    assert metrics["router/imbalance_max"] == pytest.approx(8 / 3)  # the busiest expert's load × 4 experts
    assert metrics["router/imbalance_mean"] == pytest.approx((8 / 3 + 4 / 3) / 2)
    assert metrics["router/entropy"] == pytest.approx((1.5 / 3 + 3.0 / 3) / 2)  # per token, mean over layers
    routers.start_step()  # a step of one token
    routers.records = {0: record([0, 0, 1, 0], 0.7), 1: record([1, 0, 0, 0], 0.3)}
    routers.add_micro_batch()
    metrics = routers.step_metrics()
    assert metrics["router/load/0"] == [0, 0, 1, 0] and metrics["router/imbalance_max"] == 4
    assert metrics["router/entropy"] == pytest.approx(0.5)


def test_routes_that_do_not_fit_the_model_are_refused_in_one_line():
    check_routes(torch.zeros(5, 2, 2, dtype=torch.long) + 3, 2, 2, 4, "batch step_3")  # experts 0..3 fit
    with pytest.raises(TridentError) as refused:
        check_routes(torch.zeros(5, 3, 2, dtype=torch.long), 2, 2, 4, "batch step_3")
    assert str(refused.value) == (
        "batch step_3: routes of shape [5, 3, 2] do not fit the model's 2 layers × top-2 experts (replay the routes of "
        "the model being trained)"
    )
    with pytest.raises(TridentError) as refused:
        check_routes(torch.zeros(5, 2, 2, dtype=torch.long) + 4, 2, 2, 4, "batch step_3")
    assert str(refused.value) == "batch step_3: routes name expert 4, the model has 4"
