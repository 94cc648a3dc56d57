"""The run's images, stored once each by content: what the orchestrator writes when a rollout shows the model an
image and the trainer reads to score the tokens after it.

An image is named by the SHA-256 of its encoded bytes (its *ref*, 64 hex digits) and written once to
``images/<ref>`` (:func:`contracts.run_dir.images_dir`), however many turns, rollouts or steps show it; samples and
micro-batches carry refs, never pixels. Both processes decode the same bytes and run the model folder's processor
on them, as the server did.
"""

import base64
import binascii
import hashlib
import io
import re
from pathlib import Path

from contracts.atomic_io import atomic_file
from contracts.errors import TridentError
from contracts.run_dir import images_dir

IMAGE_REF = re.compile(r"[0-9a-f]{64}")
DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)


def image_bytes(source: str | bytes) -> bytes:
    """The encoded image in ``source``: a ``data:image/...;base64,`` URL (as verifiers puts images in messages), or
    bytes as they are."""
    if isinstance(source, bytes):
        return source
    match = DATA_URL.fullmatch(source)
    if match is None:
        raise TridentError(f"an image given as {source[:40]!r}…: only data:image/...;base64 URLs are stored")
    try:
        return base64.b64decode(match.group(1), validate=True)
    except binascii.Error as e:
        raise TridentError(f"an image data URL is not valid base64 ({e})") from None


def image_ref(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_path(output_dir: Path, ref: str) -> Path:
    """Where the image ``ref`` lives; a ref that is not 64 hex digits is refused (it names a file)."""
    if not isinstance(ref, str) or IMAGE_REF.fullmatch(ref) is None:
        raise TridentError(f"{ref!r} is no image ref (the SHA-256 of an image's bytes, 64 hex digits)")
    return images_dir(output_dir) / ref


def store_image(output_dir: Path, data: bytes) -> str:
    """Write the image ``data`` into the run's store unless it is there already; its ref."""
    ref = image_ref(data)
    path = image_path(output_dir, ref)
    if not path.exists():  # whoever writes it last writes the same bytes
        atomic_file(path, data)
    return ref


def load_image(output_dir: Path, ref: str):
    """The image ``ref`` of the run at ``output_dir``, decoded to RGB (a ``PIL.Image.Image``)."""
    from PIL import Image

    path = image_path(output_dir, ref)
    try:
        with Image.open(io.BytesIO(path.read_bytes())) as image:
            return image.convert("RGB")
    except OSError as e:
        raise TridentError(f"{path}: the image a batch names cannot be read ({type(e).__name__}: {e})") from None


def placeholder_runs(token_ids: list[int], image_pad: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each image's placeholder run in ``token_ids``, in order: the maximal runs of
    ``image_pad`` (``<|image_pad|>``, which the server expands each image to, N per image between
    ``<|vision_start|>`` and ``<|vision_end|>``)."""
    runs, i = [], 0
    while True:
        try:
            start = token_ids.index(image_pad, i)
        except ValueError:
            return runs
        i = start + 1
        while i < len(token_ids) and token_ids[i] == image_pad:
            i += 1
        runs.append((start, i - start))
