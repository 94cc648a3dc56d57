from pathlib import Path

from launch.config_docs import render


def test_config_docs_are_generated_from_the_models():
    docs = Path(__file__).parents[3] / "docs" / "configs.md"
    assert docs.read_text() == render(), "regenerate: uv run python -m launch.config_docs > docs/configs.md"
