"""shape-vision: its tasks are generated deterministically, each answer is what its picture's pixels say, the rewards
score right, partial and wrong replies as its docstring states, and the look variant's tool and user turns show
pictures."""

import asyncio
import base64
import io
from collections import Counter

import numpy as np
import pytest
import verifiers.v1 as vf
from PIL import Image
from renderers import create_renderer
from renderers.base import load_tokenizer
from scored_traces import scored_trace
from shape_vision import (
    LOOK,
    LOOK_AGAIN,
    ShapeVisionConfig,
    ShapeVisionTaskset,
    answer_set_share,
    answer_words,
    first_answer,
    look,
    look_again,
)
from shape_vision.scenes import BACKGROUND, COLOURS

from contracts.errors import TridentError
from orchestrator.config import EnvConfig
from orchestrator.verifiers_adapter.envs import load_env, load_tasks
from orchestrator.verifiers_adapter.harness import call_tool, message_content, tool_spec
from orchestrator.verifiers_adapter.renderer import renderer_config
from tools.tiny_model import built_model_path


def tasks(**config) -> list:
    return list(ShapeVisionTaskset(ShapeVisionConfig(**config)))


def decoded(url: str) -> np.ndarray:
    """The pixels of a PNG data URL, as a height × width × 3 array."""
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


def prompt_image(task) -> str:
    (message,) = task.data.prompt
    image, text = message.content
    assert isinstance(image, vf.ImageUrlContentPart) and isinstance(text, vf.TextContentPart)
    return image.image_url.url


def blobs(pixels: np.ndarray) -> int:
    """How many 4-connected regions of non-background pixels ``pixels`` holds."""
    todo = {tuple(p) for p in np.argwhere((pixels != BACKGROUND).any(axis=-1))}
    count = 0
    while todo:
        count += 1
        stack = [todo.pop()]
        while stack:
            y, x = stack.pop()
            for near in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if near in todo:
                    todo.remove(near)
                    stack.append(near)
    return count


def test_tasks_are_generated_deterministically_from_the_seed():
    first, again, other = tasks(num_examples=20), tasks(num_examples=20), tasks(num_examples=20, seed=1)
    dump = [t.data.model_dump(mode="json") for t in first]
    assert dump == [t.data.model_dump(mode="json") for t in again]
    assert dump != [t.data.model_dump(mode="json") for t in other]
    assert len({prompt_image(t) for t in first}) == 20


def test_each_answer_is_what_its_pictures_pixels_say():
    generated = tasks(num_examples=120)
    for task in generated:
        pixels = decoded(prompt_image(task))
        assert pixels.shape == (64, 64, 3)
        colours = {tuple(c) for c in pixels.reshape(-1, 3)} - {BACKGROUND}
        if task.data.question == "count":
            assert task.data.answer == str(blobs(pixels)) and task.data.choices == list("0123456789")
            assert colours <= set(COLOURS.values())
        else:
            assert colours == {COLOURS[task.data.answer]} and task.data.choices == list(COLOURS)
    answers = Counter((t.data.question, t.data.answer) for t in generated)
    assert {a for q, a in answers if q == "count"} == {"1", "2", "3", "4"}
    assert {a for q, a in answers if q == "colour"} == set(COLOURS)


def test_image_size_and_questions_come_from_the_config():
    generated = tasks(num_examples=10, questions=["count"], image_size=96)
    assert {t.data.question for t in generated} == {"count"}
    assert {decoded(prompt_image(t)).shape for t in generated} == {(96, 96, 3)}
    assert all(t.data.tools == [] and t.data.user is None and t.data.max_turns is None for t in generated)


@pytest.mark.parametrize(
    "reply, words, first, share",
    [
        ("3", ["3"], "3", 1.0),
        ("Red3 blue!", ["red", "3", "blue"], "red", 8 / 9),
        ("12 apples", ["1", "2", "apples"], "1", 2 / 8),
        ("", [], None, 0.0),
    ],
)
def test_a_reply_is_read_word_by_word_each_digit_a_word(reply, words, first, share):
    choices = ["red", "blue", *"0123456789"]
    assert answer_words(reply) == words
    assert first_answer(reply, choices) == first
    assert answer_set_share(reply, choices) == pytest.approx(share)


def score(task, *replies: str) -> vf.Trace:
    return scored_trace(task, [vf.AssistantMessage(content=reply) for reply in replies])


def first_of(question: str, **config):
    return next(t for t in tasks(num_examples=20, **config) if t.data.question == question)


@pytest.mark.parametrize(
    "question, reply, correct, answer_set",
    [
        ("count", "{answer}", 1.0, 1.0),  # right
        ("count", "{answer} shapes", 1.0, 1 / 7),
        ("count", "{wrong}", 0.0, 1.0),  # partial: a digit, the wrong one
        ("count", "ab{wrong}d", 0.0, 0.25),
        ("count", "many", 0.0, 0.0),  # wrong: no digit
        ("colour", "{answer}.", 1.0, 0.75),
        ("colour", "{wrong}", 0.0, 1.0),
        ("colour", "purple", 0.0, 0.0),
    ],
)
def test_rewards_score_right_partial_and_wrong_replies(question, reply, correct, answer_set):
    task = first_of(question)
    wrong = next(c for c in task.data.choices if c != task.data.answer)
    trace = score(task, reply.format(answer=task.data.answer.capitalize(), wrong=wrong))
    assert {name: (r.score, r.weight) for name, r in trace.rewards.items()} == {
        "correct": (correct, 1.0),
        "answer_set": (pytest.approx(answer_set), 0.5),
    }
    assert trace.reward == pytest.approx(correct + 0.5 * answer_set)


def test_the_last_reply_is_scored():
    task = first_of("count", look=True)
    assert score(task, "x", task.data.answer).rewards["correct"].score == 1.0
    assert score(task, task.data.answer, "x").rewards["correct"].score == 0.0


def test_look_offers_a_tool_whose_tool_message_is_the_picture():
    task = first_of("count", look=True)
    assert (task.data.tools, task.data.user, task.data.max_turns) == ([LOOK], LOOK_AGAIN, 3)
    original = decoded(prompt_image(task))

    # the harness's tool call, as the model makes it: the tool message's content is an image_url part
    content = asyncio.run(call_tool(look, '{"zoom": 1}', {"task": task.data}))
    assert content == [{"type": "image_url", "image_url": {"url": prompt_image(task)}}]  # the same picture, again
    (zoomed,) = asyncio.run(call_tool(look, '{"zoom": 2}', {"task": task.data}))
    assert (decoded(zoomed["image_url"]["url"]) == original[16:48, 16:48].repeat(2, axis=0).repeat(2, axis=1)).all()
    assert asyncio.run(call_tool(look, '{"zoom": 9}', {"task": task.data})).startswith("error: ValueError: zoom must")


def test_look_shows_the_same_picture_again_after_the_first_answer_then_ends():
    task = first_of("colour", look=True)
    messages = [{"role": "user", "content": "..."}, {"role": "assistant", "content": "red"}]
    image, text = message_content(look_again(messages, task.data))
    assert image == {"type": "image_url", "image_url": {"url": prompt_image(task)}}
    assert text == {"type": "text", "text": "Look again. " + task.data.prompt[0].content[1].text}
    messages += [{"role": "user", "content": [image, text]}, {"role": "assistant", "content": "blue"}]
    assert look_again(messages, task.data) is None


def test_the_environment_loads_by_its_id_with_its_args():
    (task,) = load_tasks(load_env(EnvConfig(id="shape-vision", args={"look": True, "questions": ["count"]})), 1)
    assert task.data.question == "count" and task.data.tools == [LOOK]
    assert task.data == tasks(num_examples=1, look=True, questions=["count"])[0].data


def test_an_empty_question_list_is_one_line_naming_it():
    with pytest.raises(TridentError, match=r"^environment 'shape-vision' rejects its args: questions: List should"):
        load_env(EnvConfig(id="shape-vision", args={"questions": []}))


def test_the_tiny_vlms_renderer_shows_the_look_tools_image_and_the_picture_shown_again():
    """The qwen3-vl renderer (what verifiers' training client renders with) expands the image of the prompt, of the
    look tool's message and of the user's second turn into 4 placeholders each (64 × 64 pixels); the second turn's
    picture is the prompt's own (one hash)."""
    path = built_model_path("trident/tiny-qwen3-vl")
    task = first_of("count", look=True)
    messages = [m.model_dump(exclude_none=True) for m in task.data.prompt]
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": '{"zoom": 2}'}}
    messages += [{"role": "assistant", "content": "", "tool_calls": [call]}]
    messages += [
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": asyncio.run(call_tool(look, '{"zoom": 2}', {"task": task.data})),
        }
    ]
    messages += [{"role": "assistant", "content": "2"}]
    messages += [{"role": "user", "content": message_content(look_again(messages, task.data))}]
    renderer = create_renderer(load_tokenizer(path), renderer_config("auto", "auto", path, False))
    rendered = renderer.render(messages, tools=[tool_spec(look)], add_generation_prompt=True)

    placeholders = rendered.multi_modal_data.mm_placeholders["image"]
    assert [p.length for p in placeholders] == [4, 4, 4]
    first, tool, again = rendered.multi_modal_data.mm_hashes["image"]
    assert first == again != tool
    text = load_tokenizer(path).decode(rendered.token_ids[: placeholders[1].offset])
    assert text.endswith("<tool_response>\n<|vision_start|>")
