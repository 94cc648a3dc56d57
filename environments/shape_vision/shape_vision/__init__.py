"""shape-vision: questions about a generated picture of coloured shapes, for vision-language models.

Each task shows one picture (PIL, ``image_size`` pixels square, white, 1 to 4 filled squares, circles or triangles,
each alone in a cell of a 2×2 grid) as an OpenAI ``image_url`` content part holding a PNG data URL, followed by
a question:

- ``count``: "How many shapes are in the picture?", answered with a digit (1 to 4);
- ``colour``: "What colour are the shapes?" (all one colour), answered with red, green, blue or yellow.

Rewards, on the last reply:

- ``correct`` (weight 1): 1 if the reply's first answer-set word (a digit for ``count``, a colour name for
  ``colour``; each digit reads as a word of its own) is the answer, else 0;
- ``answer_set`` (weight 0.5): the share of the reply's non-space characters that spell answer-set words. For
  ``count`` it is char-target's digit share, which a randomly initialised model raises within minutes: the
  model first learns to answer in the answer set, then which answer.

``look = true`` makes it multi-turn: the model may call the tool ``look(zoom)``, whose result (a tool message)
is the picture again with its centre magnified ``zoom`` times; and after its first answer without a tool call,
the user shows the same picture again and asks once more (so a rollout always shows one picture at least
twice). The rollout ends at the model's second answer or after ``max_turns`` model turns.
"""

import random
from typing import Annotated, Literal

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.utils.image import image_data_url

from orchestrator.verifiers_adapter.harness import InProcessHarness
from shape_vision.answers import answer_set_share, answer_words, first_answer
from shape_vision.scenes import COLOURS, GRID, Shape, draw, random_shapes

Question = Literal["count", "colour"]
QUESTIONS = {
    "count": "How many shapes are in the picture? Answer with one digit.",
    "colour": "What colour are the shapes in the picture? Answer with one word: red, green, blue or yellow.",
}
DIGITS = list("0123456789")
MAX_ZOOM = 4
LOOK = "shape_vision:look"
LOOK_AGAIN = "shape_vision:look_again"


class ShapeVisionConfig(vf.TasksetConfig):
    num_examples: Annotated[int, Field(ge=1)] = 512
    """Tasks generated."""
    seed: int = 0
    """Seed of the task generator."""
    questions: Annotated[list[Question], Field(min_length=1)] = ["count", "colour"]
    """Kinds of question asked, one drawn per task."""
    image_size: Annotated[int, Field(ge=32, le=1024)] = 64
    """Side of the picture in pixels (64: 4 image tokens for a Qwen3-VL, whose tokens each cover 32×32 pixels)."""
    look: bool = False
    """Multi-turn: offer the look(zoom) tool and show the picture again after the first answer."""
    max_turns: Annotated[int, Field(ge=2)] = 3
    """Model turns per rollout with look (tool calls and answers together)."""


class ShapeVisionData(vf.TaskData):
    question: Question
    answer: str
    """The right answer: a digit, or a colour name."""
    choices: list[str]
    """The answer set: the words the reply is read for."""
    shapes: list[Shape]
    """What the picture shows (to draw it again)."""
    image_size: int
    """Side of the picture in pixels."""
    tools: list[str] = []
    """Tools offered to the model, as module:function import paths (the look tool with look = true)."""
    user: str | None = None
    """The simulated user's module:function, called when the model answers without a tool call."""
    max_turns: int | None = None
    """Model turns per rollout."""


def picture(shapes: list[Shape], image_size: int, zoom: int = 1) -> vf.ImageUrlContentPart:
    """The picture of ``shapes`` (:func:`~shape_vision.scenes.draw`) as an ``image_url`` part holding a PNG data
    URL."""
    url = image_data_url(draw(shapes, image_size, zoom))
    return vf.ImageUrlContentPart(image_url=vf.ImageUrlSource(url=url))


def asking(shapes: list[Shape], image_size: int, question: Question) -> list[vf.ContentPart]:
    """A user message's content: the picture of ``shapes``, then the question."""
    return [picture(shapes, image_size), vf.TextContentPart(text=QUESTIONS[question])]


def look(zoom: int, task: ShapeVisionData) -> list[vf.ContentPart]:
    """Look at the picture again, its centre magnified zoom times (1 to 4; 1 shows the whole picture)."""
    if not isinstance(zoom, int) or not 1 <= zoom <= MAX_ZOOM:
        raise ValueError(f"zoom must be a whole number from 1 to {MAX_ZOOM}, got {zoom!r}")
    return [picture(task.shapes, task.image_size, zoom)]


def look_again(messages: list[dict], task: ShapeVisionData) -> list[vf.ContentPart] | None:
    """The user's turn after the model answers without calling a tool: the first time, the same picture and the
    question again; after that, None (the rollout ends)."""
    if sum(message["role"] == "user" for message in messages) > 1:
        return None
    image, question = asking(task.shapes, task.image_size, task.question)
    return [image, vf.TextContentPart(text=f"Look again. {question.text}")]


class ShapeVisionTask(vf.Task[ShapeVisionData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ShapeVisionData, trace: vf.Trace) -> float:
        return float(first_answer(trace.last_reply, task.choices) == task.answer)

    @vf.reward(weight=0.5)
    async def answer_set(self, task: ShapeVisionData, trace: vf.Trace) -> float:
        return answer_set_share(trace.last_reply, task.choices)


class ShapeVisionTaskset(vf.Taskset[ShapeVisionTask, ShapeVisionConfig]):
    def load(self):
        config, rng = self.config, random.Random(self.config.seed)
        for i in range(config.num_examples):
            question = rng.choice(config.questions)
            count = rng.randint(1, GRID * GRID)
            colour = rng.choice(list(COLOURS)) if question == "colour" else None
            shapes = random_shapes(rng, count, colour, config.image_size)
            data = ShapeVisionData(
                id=f"shape-vision-{i}",
                question=question,
                answer=colour or str(count),
                choices=list(COLOURS) if question == "colour" else DIGITS,
                prompt=[vf.UserMessage(content=asking(shapes, config.image_size, question))],
                shapes=shapes,
                image_size=config.image_size,
                **({"tools": [LOOK], "user": LOOK_AGAIN, "max_turns": config.max_turns} if config.look else {}),
            )
            yield ShapeVisionTask(data, config.task)


__all__ = [
    "InProcessHarness",
    "ShapeVisionTaskset",
    "answer_set_share",
    "answer_words",
    "draw",
    "first_answer",
    "look",
    "look_again",
]
