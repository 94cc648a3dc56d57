"""The batch files of a fixed step, byte for byte: verifiers traces (images shown twice and forked, MoE routes on some
branches and not others, in-flight weight-step labels, a truncated rollout, a timed-out one, an overlong sample)
through the adapter's :func:`~orchestrator.verifiers_adapter.envs.to_rollouts`, :func:`~orchestrator.batching.batch.
assemble_batch` and :func:`~contracts.protocol.write_batch`, against the files the same code wrote before a
rollout's branches became :class:`~orchestrator.batching.rollout.Branch` values (``batch_bytes/``).

A change to these files is a change to what the trainer reads: regenerate them only on purpose, with
``uv run --no-sync python -c "import sys; sys.path[:0] = ['tests', 'tests/unit/orchestrator'];
import test_batch_bytes; test_batch_bytes.regenerate()"``."""

import base64
import io
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import verifiers.v1 as vf
from PIL import Image
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, TraceTask

from contracts.protocol import write_batch
from contracts.sampling import Truncation
from orchestrator.batching.batch import assemble_batch
from orchestrator.config import AdvantageConfig
from orchestrator.verifiers_adapter.envs import to_rollouts
from orchestrator.verifiers_adapter.weight_steps import StepLogprobs

GOLDEN = Path(__file__).parent / "batch_bytes"
MODEL = "policy"
VS, VE, PAD = 2038, 2039, 2040  # <|vision_start|> <|vision_end|> <|image_pad|>


def data_url(colour: str, size: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


RED, BLUE = data_url("red", 8), data_url("blue", 12)


def image(pads: int) -> list[int]:
    return [VS, *[PAD] * pads, VE]


def routes(tokens: int, expert: int, routed: bool) -> np.ndarray | None:
    return np.full((tokens, 2, 2), expert, np.uint8) if routed else None


def user(parent: int | None, *parts: str, tokens: list[int], routed: bool = True) -> MessageNode:
    content = [vf.ImageUrlContentPart(image_url={"url": p}) if p.startswith("data:") else vf.TextContentPart(text=p)
               for p in parts]  # fmt: skip
    return MessageNode(parent=parent, message=vf.UserMessage(content=content), token_ids=tokens,
                       mask=[False] * len(tokens), routed_experts=routes(len(tokens), 1, routed))  # fmt: skip


def reply(parent: int, sampled: list[int], logprob: float, steps: list[int] | None = None, routed: bool = True):
    """An assistant turn: the generation prompt (1, 2), then ``sampled``, labelled with ``steps`` when given."""
    tokens = [1, 2, *sampled]
    logprobs = [logprob - 0.25 * i for i in range(len(sampled))]
    if steps is not None:
        logprobs = StepLogprobs(logprobs)
        logprobs.weight_steps = steps
    mask = [False, False] + [True] * len(sampled)
    node = MessageNode(parent=parent, message=vf.AssistantMessage(content="x"), sampled=True, token_ids=tokens,
                       mask=mask, routed_experts=routes(len(tokens), 2, routed))  # fmt: skip
    node.logprobs = logprobs  # assigned, not validated: a labelled list stays one, as the adapter's patch leaves it
    return node


def trace(nodes: list[MessageNode], reward: float, truncated: bool = False, timed_out: bool = False) -> vf.Trace:
    return vf.Trace.model_construct(
        task=TraceTask(type="Task", data=vf.TaskData(prompt="p")),
        agent=AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig(), model=MODEL)),
        nodes=nodes,
        calls=[SimpleNamespace(node=None, finish_reason="length" if truncated else "stop")],
        mm_token_type_id_map={PAD: 1},
        rewards={"correct": SimpleNamespace(value=reward, score=reward)},
        metrics={"turns": float(sum(n.sampled for n in nodes))},
        is_timeout=timed_out,
    )


def shown_twice_and_forked(first: int, steps: list[int] | None) -> list[MessageNode]:
    """Turn 1 shows RED, turn 2 RED again and BLUE; a fork after the first reply gives a second branch."""
    return [
        user(None, "What colour?", RED, tokens=[5, 6, *image(4), 7]),
        reply(0, [first, 9], -0.5, steps),
        user(1, "And these?", RED, BLUE, tokens=[5, 10, *image(4), *image(2), 7]),
        reply(2, [first, 11], -1.0, steps),
        user(1, "Thanks.", tokens=[5, 12, 7]),
        reply(4, [13], -2.0),  # the fork's reply: no label came back
    ]


def text(sampled: int, routed: bool) -> list[MessageNode]:
    return [user(None, "Hi", tokens=[5, 6, 7], routed=routed), reply(0, list(range(20, 20 + sampled)), -0.75,
                                                                       routed=routed)]  # fmt: skip


def unexpanded_image() -> list[MessageNode]:
    """A turn showing an image the server did not expand (no placeholder run): an error, were its images read."""
    return [user(None, "Colour?", RED, tokens=[5, 6, 7]), reply(0, [8], -0.5)]


def episode(task: str, one: vf.Trace) -> SimpleNamespace:
    return SimpleNamespace(task=SimpleNamespace(data=vf.TaskData(id=task, prompt="p")), traces=[one],
                           last_error=None, ok=True)  # fmt: skip


def golden_groups(output_dir: Path) -> list[list]:
    """Two groups of rollouts, made by the adapter from traces, their images stored under ``output_dir``."""
    traces = [
        ("shown", trace(shown_twice_and_forked(8, [3, 4]), 1.0)),
        ("shown", trace(shown_twice_and_forked(14, None), 0.0, truncated=True)),
        ("text", trace(text(3, routed=True), 0.5)),
        ("text", trace(text(36, routed=False), 0.0)),  # overlong: left out of the batch
        ("text", trace(text(2, routed=False), 0.25)),
        ("text", trace(unexpanded_image(), 1.0, timed_out=True)),  # not ok: no sample, its images never read
    ]
    rollouts = [to_rollouts(episode(task, one), "env", ["agent"], MODEL, output_dir)[0] for task, one in traces]
    return [rollouts[:2], rollouts[2:]]


def write_golden(output_dir: Path) -> Path:
    """The batch of step 3 from :func:`golden_groups`, written under ``output_dir``: its folder."""
    batch = assemble_batch(3, golden_groups(output_dir), weight_step=2, seq_len=32,
                           advantage=AdvantageConfig(), mask_truncated=True)  # fmt: skip
    info = batch.info(3, temperature=0.7, reward_mean=0.45, metrics={"reward/mean": 0.45},
                      truncation=Truncation(top_p=0.9, banned=(VS, VE, PAD)))  # fmt: skip
    return write_batch(output_dir, info, batch.micro_batches)


def test_the_batch_files_are_the_same_bytes_as_before(tmp_path):
    written = write_golden(tmp_path)
    expected = sorted(p.name for p in GOLDEN.iterdir())
    assert sorted(p.name for p in written.iterdir()) == expected
    for name in expected:
        assert (written / name).read_bytes() == (GOLDEN / name).read_bytes(), name


def test_the_golden_batch_holds_what_it_is_for(tmp_path):
    """The fixed step exercises each per-branch part: images, routes in some micro-batches, mixed weight steps."""
    from contracts.protocol import read_batch

    info, micro_batches = read_batch(write_golden(tmp_path).parent.parent, 3)
    assert any(m.images for m in micro_batches) and any(m.routes is not None for m in micro_batches)
    assert any(m.routes is None for m in micro_batches) and info.weight_steps == [2, 3, 4]
    assert info.num_samples == 6  # 2 forked branches each of 2 rollouts, 2 text ones (not the overlong, the timed-out)


def regenerate() -> None:
    """Write :data:`GOLDEN` anew (by hand, on purpose: see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_golden(Path(tmp))
        shutil.rmtree(GOLDEN, ignore_errors=True)
        shutil.copytree(folder, GOLDEN)
