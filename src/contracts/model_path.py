"""Which folder a model name loads from (in transformers and vLLM): a tiny test model's build, made on first use by
:mod:`contracts.tiny_model`, or the name itself (a hub id or a local folder)."""

TINY_MODEL_ID = "trident/tiny-qwen3"  # the default model: the debug configs and the tests run it on CPU


def resolve_model_path(name: str) -> str:
    """Map a model name to what transformers and vLLM load: a tiny model's built folder, else ``name``."""
    from contracts import tiny_model  # the builder, loaded once a name is resolved

    if name in tiny_model.TINY_MODELS:
        return str(tiny_model.build_tiny_model(tiny_model.tiny_model_path(name), name))
    return name
