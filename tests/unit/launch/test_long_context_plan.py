"""The launch side of context parallelism: the memory plan per CP rank (a rank's share of a micro-batch's tokens, the
all-to-all's buffers, checkpointed layers' inputs offloaded to host memory), ``rl --dry-run`` refusing Qwen3-8B LoRA
on 65,536-token samples at cp = 1 and taking the cp its advice names, one-line refusals, and docs/long-context.md's
table."""

import math
import sys
from pathlib import Path

import pytest
from test_gpu_placement import dry_run, files

from contracts.config import ConfigError, parse_config
from contracts.errors import TridentError
from contracts.model_card import GIB, KNOWN_SHAPES
from launch.launcher import run
from launch.memory_plan import plan_memory, size
from launch.rl_config import RLConfig, resolve_shared
from trainer.config import TrainerConfig

ROOT = Path(__file__).parents[3]
QWEN3_8B = KNOWN_SHAPES["Qwen3-8B"]
LORA = {"rank": 16}


def plan(cp: int, tokens: int, lora: dict | None = LORA, offload: bool = False, ranks: int = 8):
    model = {"name": "Qwen/Qwen3-8B", "ac": {"offload": offload}, "parallel": {"cp": cp}}
    trainer = TrainerConfig(model=model | ({"experimental": {"lora": lora}} if lora else {}), seq_len=tokens)
    return plan_memory(trainer, None, list(range(ranks)), [], gpu_gib=80.0)


def test_each_cp_rank_plans_its_share_of_the_tokens_and_the_all_to_all_around_attention():
    whole, split = plan(1, 65_536).trainer, plan(2, 65_536).trainer
    assert split["activations"] == pytest.approx(whole["activations"] / 2)  # 32,768 tokens a rank
    assert split["backward"] == pytest.approx(whole["backward"] / 2)
    assert split["weights"] == whole["weights"] and split["gathered"] == whole["gathered"]
    # q (32 heads) and k, v (8 heads) and the output (32 heads) of 128 dims, sent and received, bf16, 32,768 tokens
    assert split["all_to_all"] * GIB == 2 * 2 * (32 + 8) * 128 * 2 * 32_768
    assert "all_to_all" not in whole
    # where cp does not divide the 8 key and value heads, they are repeated up to lcm(8, cp)
    sixteen = plan(16, 65_536, ranks=16).trainer
    assert sixteen["all_to_all"] * GIB == 2 * 2 * (32 + math.lcm(8, 16)) * 128 * 2 * 4096


def test_offload_keeps_the_checkpointed_layers_inputs_in_host_memory():
    kept, offloaded = plan(2, 65_536).trainer, plan(2, 65_536, offload=True).trainer
    inputs = 36 * 4096 * 2 * 32_768  # every layer's input, bf16, a rank's 32,768 tokens
    assert offloaded["host"] * GIB == inputs and "host" not in kept
    assert (kept["activations"] - offloaded["activations"]) * GIB == pytest.approx(inputs)
    # the recomputed layer's input comes back to the GPU for its backward pass
    assert (offloaded["backward"] - kept["backward"]) * GIB == pytest.approx(4096 * 2 * 32_768)
    assert offloaded["total"] < kept["total"]
    line = plan(2, 65_536, offload=True).lines()
    assert "  trainer, per rank in host memory (model.ac.offload): 9.0 GiB" in line


def rl_dry_run(cp: int, output_dir: Path) -> int:
    """``rl --dry-run`` of configs/swe-grep (Qwen3-8B, LoRA rank 4, every layer checkpointed, vLLM claiming half of
    each GPU) with 65,536-token samples on two 80 GiB GPUs, each shared by a trainer rank and a server."""
    flags = [*files("swe-grep"), "--gpu-memory-gib", "80", "--seq-len", "65536", "--trainer-gpu-ids", "0,1",
             "--inference-gpu-ids", "0,1", "--trainer.model.parallel.cp", str(cp),
             "--output-dir", str(output_dir)]  # fmt: skip
    config = resolve_shared(parse_config(RLConfig, flags), on_gpu=True)
    config.dry_run = True
    return run(config)


def test_rl_dry_run_refuses_8b_lora_on_65536_tokens_at_cp_1_and_takes_the_cp_it_names(capsys, tmp_path):
    with pytest.raises(TridentError) as refused:
        rl_dry_run(1, tmp_path / "cp1")
    message = str(refused.value)
    assert message.startswith("the run does not fit in memory: GPU 0: trainer 50.4 GiB + inference 40.0 GiB"), message
    assert "; trainer.model.parallel.cp = 2 fits (32.5 GiB per rank) (rl --dry-run prints the plan)" in message
    assert not (tmp_path / "cp1").exists()  # refused before anything was written
    capsys.readouterr()
    assert rl_dry_run(2, tmp_path / "cp2") == 0
    out = capsys.readouterr().out
    assert "  trainer, per rank (cp 2: 32,768 of 65,536 tokens a rank): 32.5 GiB (" in out
    assert "  GPU 0: trainer + inference = 72.5 GiB, free 7.5 GiB" in out
    assert "torchrun with 2 ranks (FSDP2, each micro-batch's tokens split over 2 ranks)" in out


def test_no_cp_is_named_where_none_would_fit():
    # full fine-tuning of 8B on one GPU: its optimizer state does not fit, whatever the tokens' split
    assert len(plan(1, 65_536, lora=None, ranks=1).problems()) == 1
    # LoRA on 131,072 tokens on two GPUs: cp = 2 fits
    assert plan(1, 131_072, ranks=2).problems()[-1].startswith("trainer.model.parallel.cp = 2 fits (")


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [("trident/tiny-qwen3", ["--trainer.model.parallel.cp", "4", "--trainer-gpu-ids", "0,1,2,3"],
      r"trainer.model.parallel.cp = 4 must divide the 2 attention heads of model 'trident/tiny-qwen3'"),
     ("Qwen/Qwen3-8B", ["--trainer.model.parallel.cp", "4", "--trainer-gpu-ids", "0,1"],
      r"trainer.model.parallel.cp = 4 must divide the trainer's ranks: --trainer-gpu-ids \[0, 1\]"),
     ("trident/tiny-qwen3-moe", ["--trainer.model.parallel.cp", "2", "--trainer-gpu-ids", "0,1"],
      r"trainer.model.parallel.cp = 2: model 'trident/tiny-qwen3-moe' is a mixture of experts, not split over ranks "
      r"by tokens yet; set cp = 1"),
     ("trident/tiny-qwen3", ["--trainer.model.parallel.cp", "2",
                             "--trainer.model.experimental", '{"load_in_4bit": true, "lora": {}}'],
      r"trainer.model.parallel.cp = 2: trainer.model.experimental.load_in_4bit trains on one rank; set cp = 1")],
)  # fmt: skip
def test_a_context_parallelism_the_trainer_cannot_run_is_refused_in_one_line(model, flags, message):
    config = parse_config(RLConfig, [*files("debug"), "--model.name", model, *flags])
    with pytest.raises(ConfigError, match=rf"^{message}$"):
        resolve_shared(config, on_gpu=True)


def test_rl_on_the_cpu_starts_cp_gloo_ranks(capsys, tmp_path):
    if sys.platform != "linux":
        pytest.skip("torchrun's command line as on linux")
    out = dry_run(capsys, tmp_path, "debug", "--trainer", "@", str(ROOT / "configs/debug/cp/train.toml"), on_gpu=False)
    assert "--nproc-per-node=2 -m trainer.main" in out
    assert "  trainer: CPU, torchrun with 2 ranks (FSDP2, each micro-batch's tokens split over 2 ranks)" in out


def table_row(kind: str, lora: dict | None, tokens: int, cp: int) -> str:
    """A row of docs/long-context.md's first table, from the plan: Qwen3-8B on eight 80 GiB trainer GPUs."""
    trainer, fits = plan(cp, tokens, lora).trainer, "refused" if plan(cp, tokens, lora).problems() else "fits"
    cells = [size(trainer[part]) for part in ("activations", "backward")]
    cells.append(size(trainer["all_to_all"]) if "all_to_all" in trainer else "-")
    return f"| {kind} | {tokens:,} | {cp} | {' | '.join(cells)} | {size(trainer['total'])} | {fits} |"


def offload_row(tokens: int, offload: bool) -> str:
    """A row of docs/long-context.md's second table: Qwen3-8B LoRA on one 80 GiB GPU, offload off or on."""
    one = plan(1, tokens, offload=offload, ranks=1)
    host = size(one.trainer["host"]) if offload else "-"
    fits = "refused" if one.problems() else "fits"
    return f"| {tokens:,} | {'on' if offload else 'off'} | {size(one.trainer['activations'])} | {host} | " \
           f"{size(one.trainer['total'])} | {fits} |"  # fmt: skip


TABLE = [(kind, lora, tokens, cp) for kind, lora in (("LoRA rank 16", LORA), ("full", None))
         for tokens in (32_768, 65_536, 131_072) for cp in (1, 2, 4)]  # fmt: skip
OFFLOAD_TABLE = [(tokens, offload) for tokens in (32_768, 65_536, 131_072) for offload in (False, True)]


def test_docs_tables_are_the_plan():
    docs = (ROOT / "docs" / "long-context.md").read_text()
    rows = [table_row(*row) for row in TABLE] + [offload_row(*row) for row in OFFLOAD_TABLE]
    for row in rows:
        assert row in docs, f"docs/long-context.md lacks (or has another) row: {row}"


if __name__ == "__main__":  # print the tables for the docs
    print(
        "\n".join(table_row(*row) for row in TABLE), "\n".join(offload_row(*row) for row in OFFLOAD_TABLE), sep="\n\n"
    )
