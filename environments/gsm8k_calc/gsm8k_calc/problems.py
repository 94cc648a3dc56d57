"""Math word problems: a seeded generator of grade-school problems, and a reader for GSM8K-format datasets."""

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from dataset_rows import DatasetError, DatasetSpec, Row, read_rows

from gsm8k_calc.answers import canonical_number, parse_number

NAMES = "Ava Ben Chloe Diego Emma Farah Gus Hana Ivan Jade Kofi Lena Mateo Nora Omar Priya Quinn Rosa Sam Tariq".split()
ITEMS = "pencils stickers apples notebooks marbles cupcakes erasers batteries".split()


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    """The final answer, as a plain number (``"42"``, ``"-3"``, ``"2.5"``)."""
    source: str
    """The generator template's name, or ``"gsm8k"`` for a row read from a file."""
    numbers: dict[str, int] = field(default_factory=dict)
    """The template's drawn numbers (empty for rows read from a file)."""


# Each template draws its numbers, then states the problem; the answer is computed from the same numbers and is a
# positive integer by construction. The comment gives the solution steps.


def shopping(rng: random.Random) -> Problem:
    # cost = packs * price; change = bill - cost
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    packs, price = rng.randint(2, 9), rng.randint(2, 15)
    bill = next(b for b in (20, 50, 100, 200) if b > packs * price)
    question = (
        f"{name} buys {packs} packs of {item} at ${price} per pack and pays with a ${bill} bill. "
        f"How many dollars of change does {name} get?"
    )
    numbers = {"packs": packs, "price": price, "bill": bill}
    return Problem(question, str(bill - packs * price), "shopping", numbers)


def savings(rng: random.Random) -> Problem:
    # saved = weekly * weeks; left = saved - spent
    name = rng.choice(NAMES)
    weekly, weeks = rng.randint(3, 25), rng.randint(4, 12)
    spent = rng.randint(1, weekly * weeks - 1)
    question = (
        f"{name} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a new bike helmet. "
        f"How many dollars does {name} have left?"
    )
    numbers = {"weekly": weekly, "weeks": weeks, "spent": spent}
    return Problem(question, str(weekly * weeks - spent), "savings", numbers)


def sharing(rng: random.Random) -> Problem:
    # baked = trays * per_tray; shared = baked - eaten; each = shared / friends
    name = rng.choice(NAMES)
    trays, per_tray, friends = rng.randint(2, 6), rng.randint(6, 24), rng.randint(2, 8)
    eaten = (trays * per_tray) % friends or friends  # what is left divides evenly among the friends
    question = (
        f"{name} bakes {trays} trays of cookies with {per_tray} cookies on each tray, eats {eaten} of them, "
        f"and shares the rest equally among {friends} friends. How many cookies does each friend get?"
    )
    numbers = {"trays": trays, "per_tray": per_tray, "eaten": eaten, "friends": friends}
    return Problem(question, str((trays * per_tray - eaten) // friends), "sharing", numbers)


def garden(rng: random.Random) -> Problem:
    # plants = rows * per_row; alive = plants - died; total = alive + planted; tomatoes = total * per_plant
    name = rng.choice(NAMES)
    rows, per_row = rng.randint(3, 12), rng.randint(4, 15)
    died, planted, per_plant = rng.randint(2, rows * per_row // 2), rng.randint(2, 20), rng.randint(2, 9)
    question = (
        f"{name}'s garden has {rows} rows of {per_row} tomato plants. {died} plants die, then {name} plants "
        f"{planted} new ones. Each plant gives {per_plant} tomatoes. How many tomatoes does the garden give?"
    )
    numbers = {"rows": rows, "per_row": per_row, "died": died, "planted": planted, "per_plant": per_plant}
    return Problem(question, str((rows * per_row - died + planted) * per_plant), "garden", numbers)


def trip(rng: random.Random) -> Problem:
    # first = speed1 * hours1; second = speed2 * hours2; total = first + second
    speed1, hours1 = rng.randint(4, 12) * 5, rng.randint(1, 5)
    speed2, hours2 = rng.randint(4, 12) * 5, rng.randint(1, 5)
    question = (
        f"A bus drives at {speed1} km per hour for {hours1} hours, then at {speed2} km per hour for {hours2} "
        f"hours. How many km does the bus drive in total?"
    )
    numbers = {"speed1": speed1, "hours1": hours1, "speed2": speed2, "hours2": hours2}
    return Problem(question, str(speed1 * hours1 + speed2 * hours2), "trip", numbers)


def discount(rng: random.Random) -> Problem:
    # off = price * percent / 100; sale = price - off; paid = sale * count
    name, item = rng.choice(NAMES), rng.choice(["jacket", "lamp", "backpack", "board game"])
    price, percent, count = rng.randint(2, 15) * 20, rng.choice([10, 20, 25, 50]), rng.randint(2, 5)
    question = (
        f"A {item} costs ${price}. This week it is {percent}% off. {name} buys {count} of them. "
        f"How many dollars does {name} pay?"
    )
    numbers = {"price": price, "percent": percent, "count": count}
    return Problem(question, str((price - price * percent // 100) * count), "discount", numbers)


TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    fn.__name__: fn for fn in (shopping, savings, sharing, garden, trip, discount)
}


def generate_problems(num_examples: int, seed: int) -> list[Problem]:
    """``num_examples`` problems from randomly chosen templates; the same seed gives the same problems."""
    rng = random.Random(seed)
    templates = list(TEMPLATES.values())
    return [rng.choice(templates)(rng) for _ in range(num_examples)]


def load_gsm8k(spec: DatasetSpec, limit: int | None = None) -> list[Problem]:
    """Problems from a GSM8K-format dataset (:mod:`dataset_rows`: a local JSONL or parquet file, the hub's
    ``openai/gsm8k`` with name ``main``, ...): rows with ``question`` and ``answer``, the answer ending in
    ``#### <number>``. Reads the first ``limit`` problems (all when None).

    Any bad row raises a DatasetError (a ValueError) naming the file, the row (its line in a JSONL file) and what
    was expected.
    """
    return [_problem(row) for row in itertools.islice(read_rows(spec), limit)]


def _problem(row: Row) -> Problem:
    data = row.data
    for key in ("question", "answer"):
        if not isinstance(data.get(key), str):
            problem = "missing" if data.get(key) is None else f"not a string ({type(data[key]).__name__})"
            raise DatasetError(f"{row.where}: field {key!r} is {problem}")
    _, hashes, final = data["answer"].rpartition("####")
    answer = parse_number(final) if hashes else None
    if answer is None:
        raise DatasetError(f"{row.where}: field 'answer' must end with '#### <number>', got {data['answer'][-40:]!r}")
    return Problem(data["question"].strip(), canonical_number(answer), "gsm8k")


__all__ = ["TEMPLATES", "Problem", "generate_problems", "load_gsm8k"]
