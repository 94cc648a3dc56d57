import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from contracts.errors import TridentError
from contracts.protocol import MicroBatch, Sample
from contracts.run_dir import PROBE_TEXT, PROBE_TOLERANCE, read_probe
from tools.tiny_model import built_model_path
from trainer.config import TrainerModelConfig
from trainer.export import save_weights
from trainer.model import compute_device, decoder_layers, load_model, packed_logprobs, use_packed_forward
from trainer.parallel import close_world, init_world, shard_model
from trainer.plan import reshards_after_forward
from trainer.train import build_model


def test_packed_logprobs_equal_separate_forwards(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    use_packed_forward(model)
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 2000, (n,), generator=generator).tolist() for n in (7, 5, 9)]
    micro_batch = MicroBatch.pack([Sample(ids, [True] * len(ids), [0.0] * len(ids), 0.0, 0.0, 0) for ids in samples])
    packed = packed_logprobs(model, micro_batch, temperature=0.7)
    start = 0
    for ids in samples:
        ids = torch.tensor(ids)
        logprobs = torch.log_softmax(plain(ids[None]).logits[0, :-1] / 0.7, -1).gather(1, ids[1:, None])[:, 0]
        # position 0 of each sample is never trained (it is prompt): compare the rest
        torch.testing.assert_close(packed[start + 1 : start + len(ids)], logprobs, atol=1e-5, rtol=1e-5)
        assert packed[start] == 0
        start += len(ids)


def one_step(model, micro_batch):
    """Gradients of a simple loss on a packed micro-batch (the trainer's forward)."""
    model.zero_grad(set_to_none=True)
    packed_logprobs(model, micro_batch, temperature=1.0).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def tiny_batch():
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 2000, (n,), generator=generator).tolist() for n in (6, 9)]
    return MicroBatch.pack([Sample(s, [True] * len(s), [0.0] * len(s), 1.0, 0.0, 0) for s in ids])


def test_activation_checkpointing_gives_the_same_gradients(tiny_model_path):
    plain = load_model(TrainerModelConfig(name=tiny_model_path), torch.device("cpu"))
    checkpointed = load_model(TrainerModelConfig(name=tiny_model_path, ac={"freq": 2}), torch.device("cpu"))
    assert [layer.gradient_checkpointing for layer in checkpointed.model.layers] == [True, False]
    expected, got = one_step(plain, tiny_batch()), one_step(checkpointed, tiny_batch())
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5)


MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(
    "model_id, targets",
    [("trident/tiny-qwen3", ["q_proj", "v_proj", "down_proj"]), ("trident/tiny-qwen3-moe", ["q_proj", "v_proj", *MLP]),
     ("trident/tiny-qwen2.5-moe", ["q_proj", "v_proj", *MLP, "experts.gate_up_proj", "experts.down_proj"])],
    ids=["dense", "moe-experts", "moe-shared-expert"],
)  # fmt: skip
def test_lora_trains_only_the_adapter_and_saves_merged_weights(model_id, targets, tmp_path):
    """On a mixture of experts, LoRA adapts the fused expert weights (peft's target_parameters: Qwen3-MoE's MLP
    targets, or the weights named; Qwen2-MoE's MLP targets adapt its shared expert): their adapters get gradients,
    and merged into the experts they give what the adapted model gives."""
    tiny_model_path = built_model_path(model_id)
    lora = {"rank": 4, "alpha": 8, "target_modules": targets}
    model = load_model(TrainerModelConfig(name=tiny_model_path, experimental={"lora": lora}), torch.device("cpu"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".experts." in n for n in trainable) == model_id.endswith("moe")
    assert any(".shared_expert." in n for n in trainable) == model_id.endswith("qwen2.5-moe")
    # a few steps move the adapter away from its zero-initialized B: every factor, the experts' too, gets gradients
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    before = {n: p.clone() for n, p in model.named_parameters()}
    for _ in range(3):
        one_step(model, tiny_batch())
        optimizer.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert [n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p, before[n])] == []

    save_weights(model, AutoTokenizer.from_pretrained(tiny_model_path), tmp_path / "step_1")
    merged = use_packed_forward(AutoModelForCausalLM.from_pretrained(tmp_path / "step_1", dtype=torch.float32))
    base = use_packed_forward(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32))
    batch = tiny_batch()
    with torch.no_grad():
        adapted = packed_logprobs(model.eval(), batch, 1.0)
        torch.testing.assert_close(packed_logprobs(merged, batch, 1.0), adapted, atol=1e-5, rtol=1e-5)
        assert (packed_logprobs(base, batch, 1.0) - adapted).abs().max() > 1e-4
    assert set(merged.state_dict()) == set(base.state_dict())
    # the probe written with the weights is what the saved weights give
    probe = read_probe(tmp_path / "step_1")
    assert probe.token_ids == AutoTokenizer.from_pretrained(tiny_model_path).encode(PROBE_TEXT)
    assert not probe.base_in_4bit and probe.tolerance == PROBE_TOLERANCE
    reference = probe_reference(merged, probe.token_ids)
    torch.testing.assert_close(torch.tensor(probe.logprobs), reference, atol=1e-5, rtol=1e-5)


def probe_reference(model, token_ids):
    ids = torch.tensor(token_ids)
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    return torch.cat([torch.zeros(1), torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]])


def test_a_lora_target_module_the_model_lacks_is_named_with_the_models_linear_layers(tiny_model_path):
    lora = {"target_modules": ["q_proj", "qproj"]}
    with pytest.raises(TridentError) as error:
        load_model(TrainerModelConfig(name=tiny_model_path, experimental={"lora": lora}), torch.device("cpu"))
    assert str(error.value) == (
        "model.experimental.lora.target_modules: no linear layer 'qproj' in the qwen3 model; its linear layers: "
        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    )
    lora = {"target_modules": ["self_attn.q_proj", "layers.0.mlp.up_proj"]}  # peft's dotted suffixes are names too
    load_model(TrainerModelConfig(name=tiny_model_path, experimental={"lora": lora}), torch.device("cpu"))


def test_the_compute_device_of_an_offloaded_model_is_the_gpu(tiny_model_path, monkeypatch):
    """Under FSDP2's CPU offload the parameters stay on the CPU but each layer runs on the GPU: the inputs and the
    scored targets must go there (a one-rank group on the CPU stands in; CUDA is made to look present)."""
    model = load_model(TrainerModelConfig(name=tiny_model_path), torch.device("cpu"))
    assert compute_device(model) == torch.device("cpu")
    init_world()
    try:
        shard_model(model, decoder_layers(model), torch.float32, offload=False)
        assert compute_device(model) == torch.device("cpu")  # no GPU: the CPU computes
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        assert compute_device(model) == torch.device("cuda", 0)  # offloaded parameters, a GPU computes
    finally:
        close_world()


@pytest.mark.parametrize("part", ["mlp", "attention"])
def test_checkpointing_a_part_of_each_layer_keeps_less_and_gives_the_same_gradients(
    tiny_model_path, part, saved_for_backward
):
    plain = load_model(TrainerModelConfig(name=tiny_model_path), torch.device("cpu"))
    checkpointed = load_model(TrainerModelConfig(name=tiny_model_path, ac={"part": part}), torch.device("cpu"))
    whole = load_model(TrainerModelConfig(name=tiny_model_path, ac={}), torch.device("cpu"))
    kept = {}
    for name, model in [("plain", plain), ("part", checkpointed), ("layer", whole)]:
        with saved_for_backward(model) as saved:
            packed_logprobs(model, tiny_batch(), temperature=1.0)
        kept[name] = sum(saved.values())
    assert kept["layer"] < kept["part"] < kept["plain"]
    assert set(checkpointed.state_dict()) == set(plain.state_dict())  # names unchanged: checkpoints and exports
    expected, got = one_step(plain, tiny_batch()), one_step(checkpointed, tiny_batch())
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("reshard", [True, False])
def test_layers_not_resharded_after_forward_stay_gathered(tiny_model_path, reshard):
    """FSDP2 leaves a layer's registered parameters unsharded (plain tensors) after its forward pass when it does
    not reshard, sharded (DTensors) when it does."""
    world = init_world()
    try:
        model_config = TrainerModelConfig(name=tiny_model_path, reshard_after_forward=reshard)
        model = build_model(model_config, world, offload=False)
        packed_logprobs(model, tiny_batch(), temperature=1.0)
        assert isinstance(decoder_layers(model)[0].self_attn.q_proj.weight, DTensor) == reshard
    finally:
        close_world()


def test_reshard_after_forward_is_chosen_by_world_size_lora_offload_and_device(tiny_model_path):
    def reshards(ranks=1, gpu=True, offload=False, **model) -> bool:
        return reshards_after_forward(TrainerModelConfig(name=tiny_model_path, **model), ranks, gpu, offload)

    assert not reshards()  # one GPU, full training: the gathered layers are kept (a copy, not communication)
    assert reshards(ranks=2)  # several ranks: gathering is communication
    assert reshards(experimental={"lora": {"rank": 4}})  # kept copies would hold the frozen base twice
    assert reshards(offload=True)  # kept copies would hold every layer on the GPU
    assert reshards(gpu=False)  # the CPU: keeping them was no faster
    assert not reshards(ranks=8, reshard_after_forward=False) and reshards(reshard_after_forward=True)
