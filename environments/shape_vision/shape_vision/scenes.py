"""Pictures of coloured shapes: generated from a seed, drawn with PIL, each shape alone in one cell of a 2×2 grid.

Shapes are filled with the exact colours of :data:`COLOURS` on a white background, without anti-aliasing, so
a picture's pixels say its answer back: the number of shapes, and their colour.
"""

import random
from typing import Literal, get_args

from PIL import Image, ImageDraw
from pydantic import BaseModel, ConfigDict

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (235, 195, 20)}
BACKGROUND = (255, 255, 255)
GRID = 2
"""Cells per side: a picture holds 1 to GRID² shapes."""
MIN_SHAPE_SHARE = 0.45
"""The smallest shape spans this share of its cell's side (the largest, all of it but a 2-pixel margin)."""

ShapeKind = Literal["square", "circle", "triangle"]
KINDS = get_args(ShapeKind)


class Shape(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: ShapeKind
    colour: str
    box: tuple[int, int, int, int]
    """Left, top, right, bottom pixel of the shape's bounding box, inclusive."""


def random_shapes(rng: random.Random, count: int, colour: str | None, image_size: int) -> list[Shape]:
    """``count`` shapes in distinct cells of an ``image_size`` square picture, all ``colour`` (None: each a random
    colour); sizes and positions inside the cells are random, 2 pixels from every cell edge at least."""
    cell = image_size // GRID
    shapes = []
    for index in sorted(rng.sample(range(GRID * GRID), count)):
        side = rng.randint(int(cell * MIN_SHAPE_SHARE), cell - 4)
        left = (index % GRID) * cell + rng.randint(2, cell - 2 - side)
        top = (index // GRID) * cell + rng.randint(2, cell - 2 - side)
        box = (left, top, left + side - 1, top + side - 1)
        shapes.append(Shape(kind=rng.choice(KINDS), colour=colour or rng.choice(list(COLOURS)), box=box))
    return shapes


def draw(shapes: list[Shape], image_size: int, zoom: int = 1) -> Image.Image:
    """The picture of ``shapes``: an ``image_size`` square RGB image; ``zoom`` > 1 magnifies its centre that many
    times (nearest-neighbour, so colours stay exact)."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for shape in shapes:
        left, top, right, bottom = shape.box
        fill = COLOURS[shape.colour]
        if shape.kind == "square":
            pen.rectangle(shape.box, fill=fill)
        elif shape.kind == "circle":
            pen.ellipse(shape.box, fill=fill)
        else:
            pen.polygon([((left + right) // 2, top), (right, bottom), (left, bottom)], fill=fill)
    if zoom == 1:
        return image
    margin = image_size * (zoom - 1) // (2 * zoom)
    centre = image.crop((margin, margin, image_size - margin, image_size - margin))
    return centre.resize((image_size, image_size), Image.Resampling.NEAREST)
