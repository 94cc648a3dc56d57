"""The run's image store: each image once by the hash of its bytes, refs checked before they name a file, and the
micro-batch files carry each sample's refs through writing, reading, splitting and repacking."""

import base64
import hashlib
import io
import json

import pytest
from PIL import Image
from safetensors.torch import save_file

from contracts.errors import TridentError
from contracts.images import image_bytes, load_image, store_image
from contracts.protocol import BatchError, BatchInfo, MicroBatch, Sample, read_batch, repack, write_batch
from contracts.run_dir import clear_run_state, images_dir


def png(colour: str, size: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_an_image_is_stored_once_under_the_hash_of_its_bytes(tmp_path):
    red, blue = png("red"), png("blue")
    refs = [store_image(tmp_path, image_bytes(data_url(red))) for _ in range(3)] + [store_image(tmp_path, blue)]
    assert refs[:3] == [hashlib.sha256(red).hexdigest()] * 3
    assert sorted(p.name for p in images_dir(tmp_path).iterdir()) == sorted({refs[0], refs[3]})
    assert load_image(tmp_path, refs[0]).getpixel((3, 3)) == (255, 0, 0)
    assert load_image(tmp_path, refs[3]).getpixel((0, 0)) == (0, 0, 255)


@pytest.mark.parametrize("ref", ["../../etc/passwd", "A" * 64, "0" * 63, ""])
def test_a_ref_that_is_no_hash_is_refused_before_it_names_a_file(tmp_path, ref):
    with pytest.raises(TridentError, match="no image ref"):
        load_image(tmp_path, ref)


def test_only_base64_data_urls_are_taken_for_images():
    with pytest.raises(TridentError, match="only data:image"):
        image_bytes("https://example.com/cat.png")
    with pytest.raises(TridentError, match="not valid base64"):
        image_bytes("data:image/png;base64,%%%")


def sample(tokens: list[int], images: list[str]) -> Sample:
    n = len(tokens)
    return Sample(tokens, [False] * (n - 1) + [True], [0.0] * (n - 1) + [-1.0], 1.0, 1.0, 0, images=images)


def test_micro_batches_carry_each_samples_images_through_the_file_and_repacking(tmp_path):
    a, b = store_image(tmp_path, png("red")), store_image(tmp_path, png("green"))
    samples = [sample([1, 2, 3], [a, b, a]), sample([4, 5], []), sample([6, 7, 8, 9], [b])]
    info = BatchInfo(1, num_samples=3, num_tokens=9, num_loss_tokens=3, reward_mean=1.0, temperature=1.0)
    write_batch(tmp_path, info, [MicroBatch.pack(samples[:2]), MicroBatch.pack(samples[2:])])
    _, (first, second) = read_batch(tmp_path, 1)
    assert first.images == [[a, b, a], []] and second.images == [[b]]
    assert [m.images for m in first.samples()] == [[[a, b, a]], None]
    (packed,) = repack([first, second], 16)  # longest first: [6..9], [1..3], [4, 5]
    assert packed.images == [[b], [a, b, a], []]
    text_only = MicroBatch.pack(samples[1:2])
    assert text_only.images is None and text_only.metadata() is None
    assert MicroBatch.concat([text_only, text_only]).images is None  # joined text-only rows: still no images


def test_a_micro_batch_whose_images_do_not_fit_its_samples_is_refused(tmp_path):
    batch = MicroBatch.pack([sample([1, 2, 3], [])])
    info = BatchInfo(1, num_samples=1, num_tokens=3, num_loss_tokens=1, reward_mean=1.0, temperature=1.0)
    folder = write_batch(tmp_path, info, [batch])
    for images, error in (
        (["x"], "not a list of lists"),
        ([[], []], "for 1 samples"),
        ([["../x"]], "not an image ref"),
    ):
        save_file(batch.to_dict(), folder / "micro_batch_0.safetensors", metadata={"images": json.dumps(images)})
        with pytest.raises(BatchError, match=error):
            read_batch(tmp_path, 1)


def test_a_new_run_clears_the_images_and_a_resumed_run_keeps_them(tmp_path):
    store_image(tmp_path, png("red"))
    clear_run_state(tmp_path, resume_from=3)
    assert len(list(images_dir(tmp_path).iterdir())) == 1
    clear_run_state(tmp_path)
    assert not images_dir(tmp_path).exists()
