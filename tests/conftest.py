import pytest

from rl.tiny_model import TINY_MODEL_ID, resolve_model_path


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The tiny test model's folder (built on first use, then cached)."""
    return resolve_model_path(TINY_MODEL_ID)
