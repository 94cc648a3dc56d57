"""FSDP2 across two gloo ranks (torchrun) gives the one-rank result."""

import json
import os
import subprocess
import sys

import pytest
from batches import write_random_batches
from safetensors.torch import load_file

from contracts.run_dir import weights_dir
from trainer.config import TrainerConfig
from trainer.train import train

TORCHRUN = ["--standalone", "--nproc-per-node", "2"]  # a free rendezvous port on this machine


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path, tiny_model_path):
    settings = {"max_steps": 2, "optim": {"lr": 1e-3}, "loss": {"kl_coef": 0.1, "entropy_coef": 0.01}}
    # three micro-batches on two ranks: one rank also runs a zero-weight pass to match the other's collectives
    assert write_random_batches(tmp_path / "one", num_samples=9) == 3
    write_random_batches(tmp_path / "two", num_samples=9)
    train(TrainerConfig(output_dir=tmp_path / "one", model={"name": tiny_model_path, "ac": {"freq": 1}}, **settings))
    flags = ["--output-dir", str(tmp_path / "two"), "--model.name", tiny_model_path, "--model.ac.freq", "1",
             "--max-steps", "2", "--optim.lr", "1e-3", "--loss.kl-coef", "0.1",
             "--loss.entropy-coef", "0.01"]  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *TORCHRUN, "-m", "trainer.main", *flags],
        check=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        timeout=300,
    )

    def metrics(run):
        return [json.loads(line) for line in (tmp_path / run / "metrics" / "trainer.jsonl").read_text().splitlines()]

    for one, two in zip(metrics("one"), metrics("two"), strict=True):
        for key in ("loss", "grad_norm", "entropy", "reference_kl", "mismatch_kl", "bounded_fraction"):
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-9), key
    assert metrics("one")[1]["reference_kl"] > 0  # the policy moved away from its reference
    one, two = (load_file(weights_dir(tmp_path / run, 2) / "model.safetensors") for run in ("one", "two"))
    assert one.keys() == two.keys()
    for name in one:
        assert (one[name] - two[name]).abs().max() < 1e-5, name
