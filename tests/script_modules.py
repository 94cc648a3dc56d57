"""The entry points in scripts/, loaded as modules so that a test calls their ``main`` in its own process."""

import contextlib
import importlib.util
import io
from pathlib import Path

SCRIPTS = Path(__file__).parents[1] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_loss_masks_ok(output_dir: Path) -> None:
    """``scripts/check_loss_mask.py --output-dir output_dir`` passes on the run's newest step, run in this process (as
    a process of its own it imports transformers again: 6 CPU s, against 0.1 s in a test worker that has)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = load_script("check_loss_mask").main(["--output-dir", str(output_dir)])
    assert code == 0 and "loss masks OK" in out.getvalue(), out.getvalue()
