"""The GPU check (benchmarks/gpu_check.py): the trainer's real code on random Qwen3-shaped models, timed and sized
against the memory plan. ``uv run scripts/gpu_check.py`` on a GPU machine; ``--smoke`` on CPU; ``--help``."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"), run_name="__main__")
