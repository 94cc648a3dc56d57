#!/usr/bin/env bash
# Five steps of the swe-grep configs on one GPU, inference and trainer sharing it (gpu_memory_utilization = 0.5
# in infer.toml). Logs go to outputs/logs/. Without a GPU it says so and runs the same configs on the CPU with
# the tiny model. Extra arguments go to `rl` (e.g. --model.name /path/to/model --wandb.offline true). The GPU branch
# plans on any machine: a stand-in `nvidia-smi` on PATH that lists GPU 0, UV_NO_SYNC=1 (uv then installs no extra and
# runs the environment as it is) and `--gpu-memory-gib 80 --dry-run` (tests/integration/test_single_gpu_script.py).
set -euo pipefail
cd "$(dirname "$0")/.."

configs=configs/swe-grep/rl
args=(--trainer @ "$configs/train.toml" --orchestrator @ "$configs/orch.toml" --inference @ "$configs/infer.toml"
      --output-dir outputs)

if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU 0'; then
    echo "GPU found: $(nvidia-smi -L | head -n 1); inference and trainer share GPU 0"
    exec uv run --extra gpu rl "${args[@]}" --trainer-gpu-ids 0 --inference-gpu-ids 0 "$@"
else
    echo "no GPU found: running the same configs on the CPU with the tiny model (trident/tiny-qwen3)"
    exec uv run --extra cpu rl "${args[@]}" --model.name trident/tiny-qwen3 "$@"
fi
