"""The images a task's prompt shows (verifiers' ``image_url`` content parts), and the refusal, at start, of an
environment whose first task shows images to a model without a vision tower."""

import verifiers.v1 as vf

from contracts.errors import TridentError
from contracts.model_card import ModelCard


def prompt_images(task: vf.Task) -> int:
    """How many images ``task``'s prompt shows: its messages' ``image_url`` content parts."""
    prompt = task.data.prompt
    if not isinstance(prompt, list):
        return 0
    return sum(
        part.type == "image_url" for message in prompt if isinstance(message.content, list) for part in message.content
    )


def check_model_sees_images(env_id: str, where: str, task: vf.Task, model: str) -> None:
    """Refuse environment ``env_id`` (``where``: its config table, e.g. "env.0") when its first task ``task`` shows
    images and ``model`` is a text model (its card has no vision tower): every rollout would fail at the server."""
    images = prompt_images(task)
    if images and not ModelCard.of(model).vision_language:
        raise TridentError(
            f"{where}: environment {env_id!r} shows images (its first task's prompt holds {images}), but model "
            f"{model!r} is a text model (no vision tower): train a vision-language model on it (e.g. "
            "trident/tiny-qwen3-vl), or run a text environment"
        )
