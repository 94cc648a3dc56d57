import pytest

from rl.tiny_model import TINY_MODEL_ID, resolve_model_path


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The tiny test model's folder (built on first use, then cached)."""
    return resolve_model_path(TINY_MODEL_ID)


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` on a machine without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
