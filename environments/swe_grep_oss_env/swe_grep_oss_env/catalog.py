r"""The parts synthetic repositories are built from: themes, modules (with their tests) and planted bugs.

Templates name the theme through placeholders: ``<project>`` (package name), ``<Project>``, ``<PROJECT>``,
``<entity>``, ``<Entity>``, ``<entities>``; a bug's issue text may also use the names its ``params`` return.
A bug is a list of edits to clean module code, each ``old`` text occurring exactly once in its module; the
files it edits are the task's answer. Code templates are raw strings: ``\n`` in them stays a backslash-n.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass, field

# (package name, entity, plural)
THEMES = [
    ("shopkeeper", "order", "orders"),
    ("boxoffice", "ticket", "tickets"),
    ("rentwise", "rental", "rentals"),
    ("pagecorner", "book", "books"),
    ("billfold", "invoice", "invoices"),
    ("staybook", "booking", "bookings"),
    ("subscribely", "subscription", "subscriptions"),
    ("marketstall", "listing", "listings"),
    ("partsbin", "part", "parts"),
    ("menuboard", "dish", "dishes"),
]


@dataclass(frozen=True)
class Test:
    code: str
    catches: frozenset[str] = frozenset()
    """Bugs this test would fail on: it is left out of repositories with one of them planted."""


@dataclass(frozen=True)
class Module:
    path: str
    """Relative to the package directory."""
    code: str
    needs: tuple[str, ...] = ()
    """Modules it imports."""
    test_imports: str = ""
    tests: tuple[Test, ...] = ()


@dataclass(frozen=True)
class Edit:
    module: str
    old: str
    new: str


@dataclass(frozen=True)
class Bug:
    edits: tuple[Edit, ...]
    issues: tuple[str, ...]
    """Phrasings of the issue; one is picked per task."""
    needs: tuple[str, ...] = ()
    """Modules the issue text talks about besides the edited ones (e.g. the CLI)."""
    params: Callable[[random.Random], dict[str, str]] = field(default=lambda rng: {})


MODULES: dict[str, Module] = {}
MODULES["errors"] = Module(
    "core/errors.py",
    r'''"""Exceptions raised by <project>."""


class <Project>Error(Exception):
    """Base class of every error this package raises."""


class ValidationError(<Project>Error):
    """A <entity> cannot be stored as it is."""


class NotFoundError(<Project>Error):
    """No <entity> has the requested id."""
''',
)
MODULES["models"] = Module(
    "core/models.py",
    r'''"""The <Entity> record."""

from dataclasses import dataclass, field


@dataclass
class <Entity>:
    """One <entity>: ``quantity`` units at ``unit_price_cents`` each, less a ``discount`` (a fraction)."""

    id: int
    name: str
    quantity: int = 1
    unit_price_cents: int = 0
    discount: float = 0.0
    currency: str = "USD"
    tags: list[str] = field(default_factory=list)

    def total_cents(self) -> int:
        """Quantity times unit price, less the discount, rounded to a cent."""
        return round(self.quantity * self.unit_price_cents * (1 - self.discount))
''',
    test_imports="from <project>.core.models import <Entity>\n",
    tests=(
        Test(
            r"""def test_total_is_quantity_times_price():
    assert <Entity>(id=1, name="a", quantity=3, unit_price_cents=250).total_cents() == 750
"""
        ),
        Test(
            r"""def test_total_applies_discount():
    item = <Entity>(id=1, name="a", quantity=2, unit_price_cents=500, discount=0.1)
    assert item.total_cents() == 900
""",
            frozenset({"models_discount_sign", "discount_feature"}),
        ),
    ),
)
MODULES["validation"] = Module(
    "core/validation.py",
    r'''"""Checks run before a <entity> is stored."""

from <project>.core.errors import ValidationError
from <project>.core.models import <Entity>

SUPPORTED_CURRENCIES = {"USD", "GBP", "EUR"}
MAX_NAME_LENGTH = 80


def validate_<entity>(item: <Entity>) -> None:
    """Raise ValidationError if ``item`` cannot be stored."""
    if not item.name.strip():
        raise ValidationError("<entity> name must not be empty")
    if len(item.name) > MAX_NAME_LENGTH:
        raise ValidationError(f"<entity> name is longer than {MAX_NAME_LENGTH} characters")
    if item.quantity <= 0:
        raise ValidationError("quantity must be positive")
    if not 0 <= item.discount < 1:
        raise ValidationError("discount must be at least 0 and below 1")
    if item.currency not in SUPPORTED_CURRENCIES:
        raise ValidationError(f"unsupported currency: {item.currency}")
''',
    needs=("errors", "models"),
    test_imports=r"""import pytest

from <project>.core.errors import ValidationError
from <project>.core.models import <Entity>
from <project>.core.validation import validate_<entity>
""",
    tests=(
        Test(
            r"""def test_negative_quantity_is_rejected():
    with pytest.raises(ValidationError, match="quantity"):
        validate_<entity>(<Entity>(id=1, name="a", quantity=-1))
"""
        ),
        Test(
            r"""def test_empty_name_is_rejected():
    with pytest.raises(ValidationError, match="name"):
        validate_<entity>(<Entity>(id=1, name=""))
"""
        ),
    ),
)
MODULES["store"] = Module(
    "core/store.py",
    r'''"""In-memory storage of <entities>."""

from <project>.core.errors import NotFoundError
from <project>.core.models import <Entity>
from <project>.core.validation import validate_<entity>


def _by_id(item: <Entity>) -> int:
    return item.id


def _by_name(item: <Entity>) -> str:
    return item.name.lower()


def _by_total(item: <Entity>) -> int:
    return item.total_cents()


class <Entity>Store:
    def __init__(self) -> None:
        self._items: dict[int, <Entity>] = {}

    def add(self, item: <Entity>) -> None:
        validate_<entity>(item)
        self._items[item.id] = item

    def get(self, item_id: int) -> <Entity>:
        try:
            return self._items[item_id]
        except KeyError:
            raise NotFoundError(f"no <entity> with id {item_id}") from None

    def list(self, limit: int = 20, offset: int = 0, sort_by: str = "id") -> list[<Entity>]:
        """One page of <entities>, ordered by ``sort_by``: ``"id"``, ``"name"`` or ``"total"``."""
        keys = {"id": _by_id, "name": _by_name, "total": _by_total}
        items = sorted(self._items.values(), key=keys[sort_by])
        return items[offset : offset + limit]
''',
    needs=("errors", "models", "validation"),
    test_imports="from <project>.core.models import <Entity>\nfrom <project>.core.store import <Entity>Store\n",
    tests=(
        Test(
            r"""def test_add_then_get():
    store = <Entity>Store()
    store.add(<Entity>(id=7, name="seven"))
    assert store.get(7).name == "seven"
"""
        ),
        Test(
            r"""def test_second_page_starts_after_the_first():
    store = <Entity>Store()
    for i in range(5):
        store.add(<Entity>(id=i, name=str(i)))
    assert [item.id for item in store.list(limit=2, offset=2)] == [2, 3]
""",
            frozenset({"store_page_off_by_one"}),
        ),
    ),
)
MODULES["reports"] = Module(
    "core/reports.py",
    r'''"""Summary figures over stored <entities>."""

from <project>.core.models import <Entity>


def average_total_cents(items: list[<Entity>]) -> float:
    """Mean of the items' totals; 0.0 when there are none."""
    if not items:
        return 0.0
    return sum(item.total_cents() for item in items) / len(items)


def busiest_tag(items: list[<Entity>]) -> str | None:
    """The tag used by the most items (ties go to the alphabetically first); None without tags."""
    counts: dict[str, int] = {}
    for item in items:
        for tag in item.tags:
            counts[tag] = counts.get(tag, 0) + 1
    if not counts:
        return None
    return min(counts, key=lambda tag: (-counts[tag], tag))
''',
    needs=("models",),
    test_imports="from <project>.core.models import <Entity>\nfrom <project>.core.reports import "
    "average_total_cents, busiest_tag\n",
    tests=(
        Test(
            r"""def test_average_total():
    items = [<Entity>(id=1, name="a", unit_price_cents=100), <Entity>(id=2, name="b", unit_price_cents=300)]
    assert average_total_cents(items) == 200
"""
        ),
        Test(
            r"""def test_busiest_tag():
    items = [<Entity>(id=1, name="a", tags=["x", "y"]), <Entity>(id=2, name="b", tags=["y"])]
    assert busiest_tag(items) == "y"
"""
        ),
    ),
)
MODULES["permissions"] = Module(
    "core/permissions.py",
    r'''"""Who may change what."""

from dataclasses import dataclass

ROLES = ("viewer", "editor", "admin")


@dataclass
class User:
    name: str
    role: str = "viewer"
    active: bool = True


def can_edit(user: User) -> bool:
    """Editors and admins may edit <entities>, as long as their account is active."""
    return user.active and user.role in ("editor", "admin")


def can_delete(user: User) -> bool:
    """Only active admins may delete <entities>."""
    return user.active and user.role == "admin"
''',
    test_imports="from <project>.core.permissions import User, can_delete, can_edit\n",
    tests=(
        Test(
            r"""def test_inactive_admin_cannot_edit():
    assert not can_edit(User("ann", role="admin", active=False))
""",
            frozenset({"permissions_viewer_edit"}),
        ),
        Test(
            r"""def test_admin_can_delete():
    assert can_delete(User("bob", role="admin"))
"""
        ),
    ),
)
MODULES["money"] = Module(
    "utils/money.py",
    r'''"""Formatting of amounts kept in cents."""

SYMBOLS = {"USD": "$", "GBP": "£", "EUR": "€"}


def format_price(cents: int, currency: str = "USD") -> str:
    """``123456`` in USD -> ``"$1,234.56"``; negative amounts get a leading minus sign."""
    sign = "-" if cents < 0 else ""
    whole, rest = divmod(abs(cents), 100)
    return f"{sign}{SYMBOLS[currency]}{whole:,}.{rest:02d}"
''',
    test_imports="from <project>.utils.money import format_price\n",
    tests=(
        Test(
            r"""def test_thousands_separator():
    assert format_price(123450) == "$1,234.50"
"""
        ),
        Test(
            r"""def test_pounds():
    assert format_price(1999, "GBP") == "£19.99"
"""
        ),
    ),
)
MODULES["text"] = Module(
    "utils/text.py",
    r'''"""Small string helpers."""

import re
import unicodedata


def slugify(title: str) -> str:
    """``"Hello, World!"`` -> ``"hello-world"``: ASCII, lower case, words joined by dashes."""
    ascii_text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    words = re.findall(r"[a-z0-9]+", ascii_text.lower())
    return "-".join(words)


def truncate(text: str, width: int, suffix: str = "...") -> str:
    """``text`` cut to at most ``width`` characters, ending in ``suffix`` when it was cut."""
    if len(text) <= width:
        return text
    return text[: width - len(suffix)] + suffix
''',
    test_imports="from <project>.utils.text import slugify, truncate\n",
    tests=(
        Test(
            r"""def test_slugify_joins_words():
    assert slugify("tea and cake") == "tea-and-cake"
"""
        ),
        Test(
            r"""def test_short_text_is_not_truncated():
    assert truncate("short", 10) == "short"
"""
        ),
    ),
)
MODULES["durations"] = Module(
    "utils/durations.py",
    r'''"""Parsing of human-written durations such as ``1h30m`` or ``45s``."""

import re

UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+)([dhms])")


def parse_duration(text: str) -> int:
    """Seconds in ``text``: ``"1h30m"`` -> 5400. Raises ValueError on anything else."""
    text = text.strip().lower()
    parts = _PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"invalid duration: {text!r}")
    return sum(int(number) * UNIT_SECONDS[unit] for number, unit in parts)
''',
    test_imports="import pytest\n\nfrom <project>.utils.durations import parse_duration\n",
    tests=(
        Test(
            r"""def test_minutes_and_seconds():
    assert parse_duration("2m30s") == 150
"""
        ),
        Test(
            r"""def test_garbage_is_rejected():
    with pytest.raises(ValueError):
        parse_duration("soon")
"""
        ),
    ),
)
MODULES["dates"] = Module(
    "utils/dates.py",
    r'''"""Dates as written in files and on the command line."""

from datetime import date, datetime

DATE_FORMAT = "%Y-%m-%d"


def parse_date(text: str) -> date:
    """``"2024-03-05"`` -> 5 March 2024."""
    return datetime.strptime(text.strip(), DATE_FORMAT).date()


def days_between(start: date, end: date) -> int:
    """Days from ``start`` to ``end``, counting both the first and the last day."""
    return (end - start).days + 1
''',
    test_imports="from datetime import date\n\nfrom <project>.utils.dates import days_between, parse_date\n",
    tests=(
        Test(
            r"""def test_parse_date():
    assert parse_date("2024-12-31") == date(2024, 12, 31)
""",
            frozenset({"dates_swapped"}),
        ),
        Test(
            r"""def test_same_day_counts_once():
    assert days_between(date(2024, 1, 1), date(2024, 1, 1)) == 1
""",
            frozenset({"dates_inclusive"}),
        ),
    ),
)
MODULES["config"] = Module(
    "config.py",
    r'''"""Settings: defaults, then a TOML file, then ``<PROJECT>_<KEY>`` environment variables."""

import os
import tomllib

DEFAULTS = {"page_size": 20, "timeout": "30s", "currency": "USD"}
ENV_PREFIX = "<PROJECT>_"


def load_config(path: str | None = None) -> dict:
    """DEFAULTS, updated by the file at ``path`` (if any), then by environment variables."""
    config = dict(DEFAULTS)
    if path is not None:
        with open(path, "rb") as f:
            config.update(tomllib.load(f))
    for key, default in DEFAULTS.items():
        value = os.environ.get(ENV_PREFIX + key.upper())
        if value is not None:
            config[key] = type(default)(value)
    return config
''',
    test_imports="from <project>.config import load_config\n",
    tests=(
        Test(
            r"""def test_defaults():
    assert load_config()["page_size"] == 20
"""
        ),
    ),
)
MODULES["cli"] = Module(
    "cli.py",
    r'''"""Command line: ``<project> list`` and ``<project> show ID``."""

import argparse

from <project>.config import load_config
from <project>.core.store import <Entity>Store
from <project>.utils.money import format_price
from <project>.utils.text import truncate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="<project>")
    parser.add_argument("--config", help="TOML settings file")
    commands = parser.add_subparsers(dest="command", required=True)
    list_command = commands.add_parser("list", help="list <entities>")
    list_command.add_argument("--limit", type=int, help="<entities> per page (default: the page_size setting)")
    list_command.add_argument("--sort", choices=["id", "name", "total"], default="id")
    show_command = commands.add_parser("show", help="show one <entity>")
    show_command.add_argument("id", type=int)
    return parser


def main(argv: list[str] | None = None, store: <Entity>Store | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = load_config(args.config)
    store = store if store is not None else <Entity>Store()
    if args.command == "list":
        limit = args.limit if args.limit is not None else config["page_size"]
        for item in store.list(limit=limit, sort_by=args.sort):
            price = format_price(item.total_cents(), item.currency)
            print(f"{item.id:>5}  {truncate(item.name, 40):<40}  {price}")
    else:
        item = store.get(args.id)
        print(f"{item.name}: {item.quantity} x {format_price(item.unit_price_cents, item.currency)}")
''',
    needs=("config", "store", "money", "text"),
)
MODULES["export"] = Module(
    "export.py",
    r'''"""CSV export of <entities>."""

import csv
import io

from <project>.core.models import <Entity>
from <project>.utils.money import format_price

COLUMNS = ["id", "name", "quantity", "total"]


def export_csv(items: list[<Entity>]) -> str:
    """The items as CSV text with a header row; values holding commas or quotes are quoted."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    for item in items:
        writer.writerow([item.id, item.name, item.quantity, format_price(item.total_cents(), item.currency)])
    return buffer.getvalue()
''',
    needs=("models", "money"),
    test_imports="from <project>.core.models import <Entity>\nfrom <project>.export import export_csv\n",
    tests=(
        Test(
            r"""def test_header_row():
    assert export_csv([]).splitlines() == ["id,name,quantity,total"]
"""
        ),
    ),
)


def _discount_numbers(rng: random.Random) -> dict[str, str]:
    quantity, price, percent = rng.choice([2, 3, 4]), rng.choice([250, 500, 1200]), rng.choice([10, 20, 25])
    gross = quantity * price
    return {
        "quantity": str(quantity),
        "price": str(price),
        "discount": str(percent / 100),
        "percent": str(percent),
        "expected": str(round(gross * (1 - percent / 100))),
        "actual": str(round(gross * (1 + percent / 100))),
    }


def _hours(rng: random.Random) -> dict[str, str]:
    hours = rng.choice([2, 3, 5, 8])
    return {"hours": str(hours), "expected": str(hours * 3600), "actual": str(hours * 360)}


def _limit(rng: random.Random) -> dict[str, str]:
    limit = rng.choice([5, 10, 25])
    return {"limit": str(limit), "shown": str(limit - 1)}


BUGS: dict[str, Bug] = {
    "models_discount_sign": Bug(
        (Edit("models", "(1 - self.discount)", "(1 + self.discount)"),),
        (
            "Discount makes <entities> more expensive\n\nA <entity> with quantity=<quantity>, unit_price_cents=<price> "
            "and discount=<discount> reports total_cents() == <actual>. With <percent>% off it should be <expected>.",
            "Totals are wrong when a discount is set: <quantity> x <price> cents at <percent>% off comes out as "
            "<actual> cents instead of <expected>. Without a discount the totals are right.",
        ),
        params=_discount_numbers,
    ),
    "validation_zero_quantity": Bug(
        (Edit("validation", "if item.quantity <= 0:", "if item.quantity < 0:"),),
        (
            "A <entity> with quantity 0 is accepted\n\nNegative quantities are rejected with `ValidationError: "
            "quantity must be positive`, but quantity=0 is stored without complaint. Zero is not positive either.",
            "I could add a <entity> with `quantity=0` to the store. It should fail like a negative quantity does "
            "(quantity must be positive).",
        ),
    ),
    "validation_blank_name": Bug(
        (Edit("validation", "if not item.name.strip():", "if not item.name:"),),
        (
            "A <entity> named '   ' (only spaces) is accepted. An empty name fails with `<entity> name must not be "
            "empty`; a name made of whitespace should fail the same way.",
        ),
    ),
    "store_page_off_by_one": Bug(
        (Edit("store", "items[offset : offset + limit]", "items[offset : offset + limit - 1]"),),
        (
            "Pages are one <entity> short\n\nAsking the store for `list(limit=<limit>)` returns <shown> <entities> "
            "even though there are more than <limit> stored. Every page misses its last item.",
            "When I page through <entities> with limit=<limit>, each page has only <shown> items and one <entity> "
            "per page never shows up anywhere.",
        ),
        params=_limit,
    ),
    "store_get_returns_none": Bug(
        (
            Edit(
                "store",
                "        try:\n            return self._items[item_id]\n        except KeyError:\n"
                '            raise NotFoundError(f"no <entity> with id {item_id}") from None\n',
                "        return self._items.get(item_id)\n",
            ),
        ),
        (
            "Looking up a <entity> id that does not exist returns None, so callers crash later with `AttributeError: "
            "'NoneType' object has no attribute 'name'`. It should raise NotFoundError ('no <entity> with id 42').",
        ),
    ),
    "money_cents_padding": Bug(
        (Edit("money", "{rest:02d}", "{rest}"),),
        (
            "Prices with fewer than 10 cents are printed wrong: 1205 cents shows as `$12.5` instead of `$12.05`.",
            "Amounts like 3.07 are displayed as $3.7. Looks like the cents lose their leading zero.",
        ),
    ),
    "money_negative": Bug(
        (Edit("money", "divmod(abs(cents), 100)", "divmod(cents, 100)"),),
        ("Refunds are printed with a wrong amount: -1205 cents comes out as `-$-13.95`; expected `-$12.05`.",),
    ),
    "text_slug_case": Bug(
        (Edit("text", "ascii_text.lower()", "ascii_text"),),
        (
            "Slugs lose capital letters\n\nslugify('Summer Sale') returns 'ummer-ale'. Expected 'summer-sale'.",
            "The URL slug generated for a <entity> titled 'Big Red Box' is 'ig-ed-ox' - every capital letter is "
            "dropped instead of lower-cased.",
        ),
    ),
    "text_truncate_width": Bug(
        (Edit("text", "text[: width - len(suffix)] + suffix", "text[:width] + suffix"),),
        (
            "Long <entity> names overflow their column: truncate(name, 40) returns 43 characters for long names. "
            "The result must never be longer than the width, the '...' included.",
        ),
    ),
    "durations_hours": Bug(
        (Edit("durations", '"h": 3600', '"h": 360'),),
        (
            'parse_duration("<hours>h") returns <actual>; <hours> hours are <expected> seconds. Minutes and seconds '
            "are parsed fine.",
            "A timeout of '<hours>h' expires after a tenth of the time: the duration parser turns it into <actual> "
            "seconds instead of <expected>.",
        ),
        params=_hours,
    ),
    "durations_case": Bug(
        (Edit("durations", "text = text.strip().lower()", "text = text.strip()"),),
        (
            "Durations written in capitals are rejected: '90M' or '1H' fail with `ValueError: invalid duration`. "
            "'90m' works. Units should be case-insensitive.",
        ),
    ),
    "dates_swapped": Bug(
        (Edit("dates", '"%Y-%m-%d"', '"%Y-%d-%m"'),),
        (
            "Dates are read with day and month swapped: '2024-03-05' becomes 3 May, and '2024-03-25' fails with "
            "`ValueError: time data '2024-03-25' does not match format`.",
        ),
    ),
    "dates_inclusive": Bug(
        (Edit("dates", "return (end - start).days + 1", "return (end - start).days"),),
        (
            "days_between(date(2024, 3, 1), date(2024, 3, 3)) returns 2, but the period counts both its first and "
            "last day, so it is 3 days; a single-day period gives 0 where it should give 1.",
        ),
    ),
    "reports_empty": Bug(
        (Edit("reports", "    if not items:\n        return 0.0\n    return sum(", "    return sum("),),
        (
            "The summary crashes with `ZeroDivisionError: division by zero` when there are no <entities> yet. "
            "The average total of nothing should be 0.0.",
        ),
    ),
    "reports_tie": Bug(
        (
            Edit(
                "reports",
                "min(counts, key=lambda tag: (-counts[tag], tag))",
                "max(counts, key=lambda tag: (counts[tag], tag))",
            ),
        ),
        (
            "When two tags are used equally often, the busiest tag shown is not the alphabetically first one: with "
            "tags 'alpha' and 'zeta' on one <entity> each, I get 'zeta'.",
        ),
    ),
    "permissions_viewer_edit": Bug(
        (
            Edit(
                "permissions",
                'user.active and user.role in ("editor", "admin")',
                'user.active or user.role in ("editor", "admin")',
            ),
        ),
        ("Users with the viewer role can edit <entities>. Only editors and admins with an active account should.",),
    ),
    "permissions_editor_delete": Bug(
        (
            Edit(
                "permissions",
                'user.active and user.role == "admin"',
                'user.active and user.role in ("editor", "admin")',
            ),
        ),
        ("Editors can delete <entities>. Deleting is meant to be admin-only.",),
    ),
    "config_env_name": Bug(
        (Edit("config", "ENV_PREFIX + key.upper())", 'ENV_PREFIX + key.upper().replace("_", ""))'),),
        (
            "Setting <PROJECT>_PAGE_SIZE=50 in the environment has no effect, although <PROJECT>_TIMEOUT and "
            "<PROJECT>_CURRENCY work. The README documents <PROJECT>_<KEY> for every setting.",
        ),
    ),
    "config_env_type": Bug(
        (Edit("config", "config[key] = type(default)(value)", "config[key] = value"),),
        (
            "With <PROJECT>_PAGE_SIZE=50 set, `<project> list` crashes with `TypeError: unsupported operand type(s) "
            "for +: 'int' and 'str'`. Without the variable it works.",
        ),
        needs=("cli",),
    ),
    "cli_limit_ignored": Bug(
        (
            Edit(
                "cli",
                'limit = args.limit if args.limit is not None else config["page_size"]',
                'limit = config["page_size"]',
            ),
        ),
        ("`<project> list --limit 5` prints 20 <entities> (the page size setting): the --limit flag is ignored.",),
    ),
    "export_commas": Bug(
        (
            Edit(
                "export",
                '    buffer = io.StringIO()\n    writer = csv.writer(buffer, lineterminator="\\n")\n'
                "    writer.writerow(COLUMNS)\n    for item in items:\n"
                "        writer.writerow([item.id, item.name, item.quantity, format_price(item.total_cents(), "
                "item.currency)])\n    return buffer.getvalue()\n",
                '    lines = [",".join(COLUMNS)]\n    for item in items:\n'
                "        price = format_price(item.total_cents(), item.currency)\n"
                '        lines.append(",".join([str(item.id), item.name, str(item.quantity), price]))\n'
                '    return "\\n".join(lines) + "\\n"\n',
            ),
        ),
        (
            "The CSV export breaks when a <entity> name contains a comma: 'Tea, green' ends up split over two "
            "columns and every later column shifts. Totals above $999 are split too (the thousands separator).",
        ),
    ),
    "currency_eur": Bug(
        (
            Edit("validation", '{"USD", "GBP", "EUR"}', '{"USD", "GBP"}'),
            Edit("money", ', "EUR": "€"}', "}"),
        ),
        (
            "Support euros\n\nCreating a <entity> priced in EUR fails with `ValidationError: unsupported currency: "
            "EUR`. We need EUR as well as USD and GBP, with prices shown with the € sign.",
        ),
    ),
    "sort_option": Bug(
        (
            Edit(
                "store",
                '    def list(self, limit: int = 20, offset: int = 0, sort_by: str = "id") -> list[<Entity>]:\n'
                '        """One page of <entities>, ordered by ``sort_by``: ``"id"``, ``"name"`` or ``"total"``."""\n'
                '        keys = {"id": _by_id, "name": _by_name, "total": _by_total}\n'
                "        items = sorted(self._items.values(), key=keys[sort_by])\n",
                "    def list(self, limit: int = 20, offset: int = 0) -> list[<Entity>]:\n"
                '        """One page of <entities>, ordered by id."""\n'
                "        items = sorted(self._items.values(), key=_by_id)\n",
            ),
            Edit(
                "store",
                "def _by_name(item: <Entity>) -> str:\n    return item.name.lower()\n\n\n"
                "def _by_total(item: <Entity>) -> int:\n    return item.total_cents()\n\n\n",
                "",
            ),
            Edit("cli", '    list_command.add_argument("--sort", choices=["id", "name", "total"], default="id")\n', ""),
            Edit("cli", "store.list(limit=limit, sort_by=args.sort)", "store.list(limit=limit)"),
        ),
        (
            "Feature request: sorting the list\n\n`<project> list --sort name` fails with `error: unrecognized "
            "arguments: --sort name`. Please add --sort with the choices id (the default), name (case-insensitive) "
            "and total.",
        ),
    ),
    "discount_feature": Bug(
        (
            Edit("models", ", less a ``discount`` (a fraction)", ""),
            Edit("models", "    discount: float = 0.0\n", ""),
            Edit(
                "models",
                "Quantity times unit price, less the discount, rounded to a cent.",
                "Quantity times unit price.",
            ),
            Edit(
                "models",
                "round(self.quantity * self.unit_price_cents * (1 - self.discount))",
                "self.quantity * self.unit_price_cents",
            ),
            Edit(
                "validation",
                '    if not 0 <= item.discount < 1:\n        raise ValidationError("discount must be at least 0 and '
                'below 1")\n',
                "",
            ),
        ),
        (
            "Support discounts\n\n`<Entity>(id=1, name='x', unit_price_cents=1000, discount=0.15)` raises `TypeError: "
            "<Entity>.__init__() got an unexpected keyword argument 'discount'`. Please add a discount (a fraction: "
            "0.15 is 15% off) that the total takes off, and reject discounts below 0 or of 1 and more when a "
            "<entity> is stored.",
        ),
    ),
}
