"""The images of a rollout, out of verifiers' message graph into the run's image store: one ref per placeholder run,
in order, each distinct image decoded and written once however many turns or branches show it."""

import asyncio
import base64
import hashlib
import io

import pytest
import verifiers.v1 as vf
from PIL import Image
from rollouts import build_samples, rollout
from verifiers.v1.graph import MessageNode

import orchestrator.batching.images as images_module
import orchestrator.loop.groups as groups_module
from contracts.errors import TridentError
from contracts.images import placeholder_runs
from contracts.protocol import MicroBatch, read_batch
from contracts.run_dir import checkpoint_dir, clear_run_state, images_dir, mark_stable, weights_dir
from orchestrator.batching.images import EpisodeImages, decoded_with_images
from orchestrator.config import OrchestratorConfig
from orchestrator.verifiers_adapter.envs import trace_branches

VS, VE, PAD, VIDEO_PAD = 2038, 2039, 2040, 2041  # <|vision_start|> <|vision_end|> <|image_pad|> <|video_pad|>
MM_MAP = {PAD: 1, VIDEO_PAD: 2}  # renderers' mm_token_type_id_map of Qwen3-VL


def png(colour: str | tuple, size: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


RED, BLUE = png("red", 64), png("blue", 96)


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image(pads: int) -> list[int]:
    return [VS, *[PAD] * pads, VE]


def user(parent: int | None, *parts, tokens: list[int]) -> MessageNode:
    content = [vf.TextContentPart(text=p) if isinstance(p, str) else vf.ImageUrlContentPart(image_url={"url": url(p)})
               for p in parts]  # fmt: skip
    message = vf.UserMessage(content=content)
    return MessageNode(parent=parent, message=message, token_ids=tokens, mask=[False] * len(tokens))


def reply(parent: int, text: str, sampled: list[int]) -> MessageNode:
    tokens = [1, 2, *sampled]  # the generation prompt, then what the model sampled
    return MessageNode(parent=parent, message=vf.AssistantMessage(content=text), sampled=True, token_ids=tokens,
                       mask=[False, False] + [True] * len(sampled), logprobs=[-1.0] * len(sampled))  # fmt: skip


def two_turns_reusing_an_image() -> vf.Trace:
    """Turn 1 shows the red image; turn 2 shows it again and a blue one. A fork after the first reply (a user turn
    without images) gives a second branch sharing the first turn's nodes."""
    nodes = [
        user(None, "What colour?", RED, tokens=[5, 6, *image(4), 7]),  # 0
        reply(0, "red", [8, 9]),  # 1
        user(1, "And these?", RED, BLUE, tokens=[5, 10, *image(4), *image(9), 7]),  # 2
        reply(2, "red, blue", [8, 11]),  # 3
        user(1, "Thanks.", tokens=[5, 12, 7]),  # 4: the fork
        reply(4, "ok", [13]),  # 5
    ]
    return vf.Trace.model_construct(nodes=nodes, calls=[], mm_token_type_id_map=MM_MAP)


def one_turn_showing(picture: bytes) -> vf.Trace:
    nodes = [user(None, "Colour?", picture, tokens=[5, *image(4), 7]), reply(0, "red", [8])]
    return vf.Trace.model_construct(nodes=nodes, calls=[], mm_token_type_id_map=MM_MAP)


def ref(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def trace_images(trace: vf.Trace, images: EpisodeImages) -> list[list[str]]:
    """The image refs of each trainable branch of ``trace``, stored in ``images``."""
    return [branch.images for branch in trace_branches(trace, images)]


def test_a_rollout_reusing_an_image_stores_it_once_and_names_it_per_run(tmp_path, monkeypatch):
    decoded = []
    image_bytes = images_module.image_bytes
    monkeypatch.setattr(images_module, "image_bytes", lambda source: decoded.append(source) or image_bytes(source))
    trace = two_turns_reusing_an_image()

    refs = trace_images(trace, EpisodeImages(tmp_path))

    assert refs == [[ref(RED), ref(RED), ref(BLUE)], [ref(RED)]]  # per branch, in order of their placeholder runs
    assert sorted(p.name for p in images_dir(tmp_path).iterdir()) == sorted([ref(RED), ref(BLUE)])
    assert (images_dir(tmp_path) / ref(BLUE)).read_bytes() == BLUE  # the bytes sent, as they were
    assert len(decoded) == 2  # each distinct image decoded and hashed once, whatever the turns and branches
    first, _ = trace_branches(trace)
    assert [length for _, length in placeholder_runs(first.token_ids, PAD)] == [4, 4, 9]


def test_the_refs_reach_the_samples_and_the_micro_batch(tmp_path):
    trace = two_turns_reusing_an_image()
    shown, refs = trace_branches(trace, EpisodeImages(tmp_path)), trace_images(trace, EpisodeImages(tmp_path))
    samples, *_ = build_samples([[rollout(1.0, *shown), rollout(0.0, *trace_branches(trace))]], weight_step=0)
    assert [s.images for s in samples] == [*refs, [], []]
    for sample in samples[:2]:  # image placeholders are prompt tokens: never in the loss
        assert not any(m for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if t in (VS, PAD, VE))
    assert MicroBatch.pack(samples).images == [*refs, [], []]


def test_a_text_rollout_has_no_images_and_stores_nothing(tmp_path):
    nodes = [user(None, "Hi", tokens=[5, 6, 7]), reply(0, "hi", [8])]
    assert trace_images(vf.Trace.model_construct(nodes=nodes, calls=[], mm_token_type_id_map=MM_MAP),
                        EpisodeImages(tmp_path)) == [[]]  # fmt: skip
    assert trace_images(vf.Trace.model_construct(nodes=nodes, calls=[]), EpisodeImages(None)) == [[]]
    assert not images_dir(tmp_path).exists()


@pytest.mark.parametrize(
    ("parts", "tokens", "shown", "runs"),
    [
        ((RED, BLUE), [5, *image(4), 7], 2, 1),  # an image the server did not expand
        ((RED,), [5, *image(4), *image(4), 7], 1, 2),  # placeholders of no image
        ((RED,), [5, VS, VE, 7], 1, 0),
    ],
)
def test_images_and_placeholder_runs_that_differ_in_number_are_refused(tmp_path, parts, tokens, shown, runs):
    trace = vf.Trace.model_construct(nodes=[user(None, *parts, tokens=tokens), reply(0, "x", [8])], calls=[],
                                     mm_token_type_id_map=MM_MAP)  # fmt: skip
    with pytest.raises(TridentError, match=f"show {shown} images but its token ids hold {runs} image placeholder"):
        trace_images(trace, EpisodeImages(tmp_path))
    assert not images_dir(tmp_path).exists()  # nothing stored for a sample that is refused


def test_a_reply_that_sampled_an_image_placeholder_is_refused(tmp_path):
    trace = one_turn_showing(RED)
    trace.nodes[1] = reply(0, "x", [8, PAD, 9])  # a random model may sample any token
    with pytest.raises(TridentError, match=f"sampled the image placeholder \\(token {PAD}\\) at 1 positions"):
        trace_images(trace, EpisodeImages(tmp_path))


def test_sample_rollouts_show_each_image_as_one_placeholder_and_its_count():
    names = {VS: "<v>", VE: "</v>", PAD: "<pad>"}

    def decode(ids):
        return "".join(names.get(token, str(token)) for token in ids)

    ids = [5, *image(4), 7, *image(9)]
    assert decoded_with_images(ids, decode, PAD) == "5<v><pad>×4</v>7<v><pad>×9</v>"
    assert decoded_with_images(ids, decode, None) == decode(ids)


def test_an_image_with_nowhere_to_be_stored_is_an_error():
    with pytest.raises(TridentError, match="no run folder was given to store it"):
        trace_images(one_turn_showing(RED), EpisodeImages(None))


def test_a_resumed_run_names_the_same_images_and_finds_them_in_the_run_folder(tmp_path, monkeypatch,
                                                                              on_weights_server):  # fmt: skip
    """The orchestrator hands its run folder to the rollouts, which store each task's image there; a run stopped
    after the checkpoint of step 2 (its rollouts then cleared as ``rl`` does on resume, its images kept) resumes
    with batches naming exactly the images of an uninterrupted run, each found in its folder."""
    steps = 4

    async def run_group(env, task, n, ctx, limits, output_dir):  # as the adapter makes them, one image per task
        index = int(task.data.id.split("-")[-1])
        picture = png((index * 37 % 256, 0, 0), 64)
        trace = one_turn_showing(picture)
        return [rollout(float(k), *trace_branches(trace, EpisodeImages(output_dir))) for k in range(n)]

    monkeypatch.setattr(groups_module, "run_group", run_group)

    def build(output_dir, resume_step=None):
        config = OrchestratorConfig(
            output_dir=output_dir, env=[{"id": "char-target", "args": {"num_examples": 30}}], batch_size=2,
            rollouts_per_example=2, max_steps=steps, async_level=1, sample_rollouts_every=0,
            ckpt={"interval": 1, "keep": None, "resume_step": resume_step},
        )  # fmt: skip
        return on_weights_server(config)[0]

    async def run(orchestrator, stop_at=steps):
        for step in range(orchestrator.start_step() + 1, stop_at + 1):
            await orchestrator.step(step)
            orchestrator.save_checkpoint(step)
            for folder in (checkpoint_dir(orchestrator.output_dir, step) / "trainer",
                           weights_dir(orchestrator.output_dir, step)):  # fmt: skip
                folder.mkdir(parents=True, exist_ok=True)
                mark_stable(folder)

    def named(output_dir, step) -> list[list[str]]:
        return [refs for m in read_batch(output_dir, step)[1] for refs in m.images]

    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    asyncio.run(run(build(whole)))
    asyncio.run(run(build(stopped), stop_at=2))
    clear_run_state(stopped, resume_from=2)
    weights_dir(stopped, 2).mkdir(parents=True)  # as the resumed trainer writes its checkpoint's weights again
    mark_stable(weights_dir(stopped, 2))
    asyncio.run(run(build(stopped, resume_step=-1)))
    for step in (3, 4):
        assert named(stopped, step) == named(whole, step) and all(named(stopped, step))
        for ref in {ref for refs in named(stopped, step) for ref in refs}:
            assert hashlib.sha256((images_dir(stopped) / ref).read_bytes()).hexdigest() == ref
    assert len(list(images_dir(stopped).iterdir())) == len(list(images_dir(whole).iterdir())) == steps * 2
