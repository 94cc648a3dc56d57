"""``rl`` plans a run in well under a second: it imports none of the libraries the processes take seconds to import
(torch, transformers, verifiers, vllm). Each ``rl`` start, restart and resume pays for what it imports."""

import subprocess
import sys

from debug_configs import FILES

HEAVY = ("torch", "transformers", "verifiers", "vllm")
# rl's whole dry run in one process, then the heavy libraries it left in sys.modules
SCRIPT = f"""
import sys
from launch.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
print(sorted(set({HEAVY!r}) & set(sys.modules)))
"""


def test_rl_plans_the_debug_run_without_importing_torch_transformers_verifiers_or_vllm(tmp_path):
    argv = [sys.executable, "-c", SCRIPT, *FILES, "--output-dir", str(tmp_path), "--dry-run"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "memory plan (CPU):" in result.stdout  # the plan was made
    assert result.stdout.strip().splitlines()[-1] == "[]"
