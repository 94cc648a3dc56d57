"""A real full disk (a 600 KiB tmpfs, mounted in a user namespace of its own): a batch or weights that do not fit
fail with one line naming the folder, leave nothing partial, and what was written before stays intact."""

import json
import subprocess
import sys

import pytest
from namespaces import user_namespaces

WRITER = """
import json, os, sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from contracts.protocol import BatchInfo, MicroBatch, Sample, write_batch
from contracts.atomic_io import DiskFullError
from contracts.run_dir import weights_dir
from trainer.export import save_weights

out, model_path = Path(sys.argv[1]), sys.argv[2]
def batch(step, tokens):
    sample = Sample(list(range(tokens)), [True] * tokens, [-1.0] * tokens, 1.0, 1.0, 0)
    return BatchInfo(step, 1, tokens, tokens, 1.0, 1.0), [MicroBatch.pack([sample])]

results = {}
write_batch(out, *batch(0, 100))  # fits
for what, write in {
    "batch": lambda: write_batch(out, *batch(1, 50_000)),  # 1.2 MiB of tensors
    "weights": lambda: save_weights(AutoModelForCausalLM.from_pretrained(model_path),
                                    AutoTokenizer.from_pretrained(model_path), weights_dir(out, 1)),  # 0.9 MiB
}.items():
    try:
        write()
        results[what] = "written"
    except DiskFullError as e:
        results[what] = str(e)
results["left"] = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
print(json.dumps(results))
"""


@pytest.mark.skipif(not user_namespaces(), reason="needs unprivileged user namespaces to mount a small tmpfs")
def test_writes_that_do_not_fit_fail_in_one_line_and_leave_nothing_partial(tmp_path, tiny_model_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f'mount -t tmpfs -o size=600k tmpfs {disk} && exec {sys.executable} -c "$0" {disk} {tiny_model_path}'
    result = subprocess.run(["unshare", "-rm", "sh", "-c", mount, WRITER], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout.splitlines()[-1])
    for what, name in (("batch", "step_1"), ("weights", "step_1")):
        assert results[what].startswith(f"no space left on the disk of {disk}/"), results[what]
        assert f"could not write {name}, nothing of it was kept" in results[what]
    # the batch that fitted is whole; no partial folder of either is left
    assert results["left"] == ["rollouts", "rollouts/step_0", "rollouts/step_0/batch.json",
                               "rollouts/step_0/micro_batch_0.safetensors", "weights"]  # fmt: skip
