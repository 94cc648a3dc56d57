"""The images a rollout showed the model, stored once each in the run's image store (:mod:`contracts.images`) and
named in its samples by ref, one per placeholder run of their token ids.

The verifiers adapter reads each sample's token ids and the images of the messages it covers, in order
(:func:`~orchestrator.verifiers_adapter.envs.trace_branches`); the rest is here, with no verifiers.
"""

from collections.abc import Callable
from pathlib import Path

from contracts.errors import TridentError
from contracts.images import image_bytes, placeholder_runs, store_image


class EpisodeImages:
    """Stores the images of one episode into the run at ``output_dir``: each distinct image (a data URL) decoded,
    hashed and written once, however many turns, branches or seats show it. Held while its episode's rollouts are
    made, so that it keeps no image longer than verifiers does. ``output_dir`` None: a rollout with an image is an
    error (nowhere to store it)."""

    def __init__(self, output_dir: Path | None):
        self.output_dir = output_dir
        self.refs: dict[str, str] = {}

    def ref(self, source: str) -> str:
        """The ref of the image ``source`` (a ``data:image/...;base64,`` URL), stored on first sight."""
        ref = self.refs.get(source)
        if ref is None:
            if self.output_dir is None:
                raise TridentError("a rollout showed the model an image, but no run folder was given to store it in")
            ref = self.refs[source] = store_image(self.output_dir, image_bytes(source))
        return ref


def sample_images(
    token_ids: list[int], sampled: list[bool], sources: list[str], image_pad: int | None, images: EpisodeImages
) -> list[str]:
    """The refs of a sample's images, one per placeholder run of ``image_pad`` in ``token_ids``, in order:
    ``sources`` are the images of the messages the sample covers, in order (the n-th run is the n-th image). A
    :class:`TridentError` when the model sampled a placeholder (``sampled``: which tokens it sampled), or when the
    runs and the images differ in number (the renderer and the server disagree)."""
    runs = placeholder_runs(token_ids, image_pad) if image_pad is not None else []
    in_reply = [start + i for start, length in runs for i in range(length) if sampled[start + i]]
    if in_reply:
        raise TridentError(
            f"the model sampled the image placeholder (token {image_pad}) at {len(in_reply)} positions of its reply, "
            "which the trainer would read as an image: its image tokens must be banned from sampling"
        )
    if len(runs) != len(sources):
        lengths = ", ".join(str(length) for _, length in runs) or "none"
        raise TridentError(
            f"a sample's messages show {len(sources)} images but its token ids hold {len(runs)} image placeholder "
            f"runs (of {lengths} tokens): the renderer and the server disagree on the image tokens"
        )
    return [images.ref(source) for source in sources]


def decoded_with_images(token_ids: list[int], decode: Callable[[list[int]], str], image_pad: int | None) -> str:
    """``decode(token_ids)`` with each image's run of placeholders written once, as ``<|image_pad|>×N``: a prompt's
    text for people (the sample rollouts), not thousands of placeholders."""
    if image_pad is None:
        return decode(token_ids)
    pieces, start = [], 0
    for run_start, length in placeholder_runs(token_ids, image_pad):
        pieces += [decode(token_ids[start:run_start]), f"{decode([image_pad])}×{length}"]
        start = run_start + length
    return "".join(pieces) + decode(token_ids[start:])
