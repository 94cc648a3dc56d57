"""Config machinery shared by every process: strict pydantic-settings models loaded from TOML and flags.

Sources, later wins: field defaults < ``TRIDENT_*`` env vars (``__`` nests) < ``@ file.toml`` (several
allowed, later wins) < ``--dotted.key value`` flags. ``--section @ file.toml`` loads a file under a key
(how ``rl --trainer @ train.toml`` works). Booleans may be bare flags (``--wandb.offline``) or negated
(``--no-wandb.offline``). Any mistake ends in :class:`ConfigError`, one line naming the file, flag or env var.
``--help`` (``-h``) prints each command's usage from its config model (:func:`cli_help`).
"""

import inspect
import json
import os
import re
import sys
import textwrap
import tomllib
import typing
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "TRIDENT_"
HELP_FLAGS = ("-h", "--help")
CONFIG_REFERENCE = "docs/configs.md"


class ConfigError(Exception):
    """A user's config mistake: printed as one line, never as a traceback."""


class BaseConfig(BaseSettings):
    """Base of every config model: unknown keys are errors; env vars ``TRIDENT_A__B`` set ``a.b``."""

    model_config = SettingsConfigDict(
        extra="forbid",
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        validate_default=True,
        validate_assignment=True,
    )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings)


C = TypeVar("C", bound=BaseConfig)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{dotted}: '{key}' is a value, not a section")
        tree = node
    tree[leaf] = value


def _merge(base: dict, update: dict) -> dict:
    """Deep-merge ``update`` into ``base`` (tables merge, everything else is replaced)."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def _parse_value(raw: str) -> Any:
    """A flag's value: JSON lists/tables/numbers/booleans when they parse as such, else the string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def read_toml(path: Path) -> dict:
    """Read a TOML file, turning a missing or malformed file into a :class:`ConfigError`."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def _file_after_at(where: str, path: str | None) -> Path:
    """The TOML file named after ``@``; a missing one, or a flag in its place (``--trainer @ --output-dir``), is a
    ConfigError."""
    if not path:
        raise ConfigError(f"{where} must be followed by a TOML file path")
    if path.startswith("--"):
        raise ConfigError(f"{where} {path}: expected a TOML file after '@', got a flag; write {where} file.toml")
    return Path(path)


class ParsedArgs:
    """argv split into config files (each under a dotted prefix, '' for the root) and flag overrides."""

    def __init__(self, argv: list[str]):
        self.files: list[tuple[str, Path]] = []
        self.flags: dict[str, Any] = {}
        i = 0
        while i < len(argv):
            arg = argv[i]
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if arg == "@" or (arg.startswith("@") and len(arg) > 1):
                self.files.append(("", _file_after_at("@", arg[1:] or nxt)))
                i += 1 if arg[1:] else 2
            elif arg.startswith("--"):
                key = arg[2:].replace("-", "_")
                if "=" in key:
                    key, value = key.split("=", 1)
                    self.flags[key] = _parse_value(arg.split("=", 1)[1])
                    i += 1
                elif nxt is not None and (nxt == "@" or nxt.startswith("@")):
                    path = nxt[1:] or (argv[i + 2] if i + 2 < len(argv) else None)
                    self.files.append((key, _file_after_at(f"{arg} @", path)))
                    i += 2 if nxt[1:] else 3
                elif nxt is None or nxt.startswith("--"):
                    if key.startswith("no_"):
                        self.flags[key[3:].replace(".no_", ".")] = False
                    else:
                        self.flags[key] = True
                    i += 1
                else:
                    self.flags[key] = _parse_value(nxt)
                    i += 2
            else:
                raise ConfigError(f"unexpected argument {arg!r}: use '@ file.toml' or '--key value'")

    def tree(self) -> tuple[dict, dict[str, str]]:
        """Merged values (files in order, then flags) and, for each dotted key, where it came from."""
        merged: dict = {}
        origin: dict[str, str] = {}
        for prefix, path in self.files:
            data = read_toml(path)
            for key in _dotted_keys(data, prefix):
                origin[key] = str(path)
            if prefix:
                wrapped: dict = {}
                _set_dotted(wrapped, prefix, data)
                data = wrapped
            _merge(merged, data)
        for key, value in self.flags.items():
            flag_tree: dict = {}
            _set_dotted(flag_tree, key, value)
            _merge(merged, flag_tree)
            for sub in _dotted_keys(flag_tree, ""):
                origin[sub] = f"--{key.replace('_', '-')}"
        return merged, origin


def _dotted_keys(tree: Any, prefix: str) -> list[str]:
    keys = [prefix] if prefix else []
    if isinstance(tree, dict):
        for key, value in tree.items():
            keys += _dotted_keys(value, f"{prefix}.{key}" if prefix else key)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            keys += _dotted_keys(value, f"{prefix}.{i}")
    return keys


def format_errors(error: ValidationError, origin: dict[str, str]) -> str:
    """One line per problem of ``error``, each naming where the value came from (``origin``: file or flag of each
    dotted key), the env var that set it, or that no source gave a required key."""
    lines = []
    for err in error.errors():
        key = ".".join(str(part) for part in err["loc"])
        if not key:  # a check across keys: its message names them
            lines.append(str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"])
            continue
        if err["type"] == "missing":
            lines.append(f"{key}: required, and no file or flag gives it (see --help)")
            continue
        message = err["msg"]
        if err["type"] == "value_error":  # a validator's own sentence, without pydantic's prefix
            message = str(err["ctx"]["error"])
        elif err["type"] == "extra_forbidden":
            message = "unknown key"
        elif "input" in err and not isinstance(err["input"], dict | list):
            message += f" (got {err['input']!r})"
        source = value_source(key, origin)
        lines.append(f"{source}: {key}: {message}" if source else f"{key}: {message}")
    return "\n".join(lines)  # one line per problem


def value_source(key: str, origin: dict[str, str]) -> str | None:
    """Where the value at dotted ``key`` came from: the file or flag that gives it, else a ``TRIDENT_*`` env var set
    for it or a section above it (under ``rl`` a sub-config reads its own: ``TRIDENT_OPTIM__LR`` for
    ``trainer.optim.lr``), else the file or flag that gives a section above it; None for a default."""
    if key in origin:
        return origin[key]
    environ = {name.upper(): value for name, value in os.environ.items()}  # pydantic-settings ignores the case
    parts = key.upper().split(".")
    for start in range(len(parts)):
        for end in range(len(parts), start, -1):
            name = ENV_PREFIX + "__".join(parts[start:end])
            if name in environ:
                return f"env var {name}={environ[name]!r}"
    return next((origin[parent] for parent in _parents(key) if parent in origin), None)


def _parents(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def build_config(cls: type[C], values: dict, origin: dict[str, str] | None = None) -> C:
    """Validate ``values`` (env vars filled in below them) into ``cls``, or raise a one-line ConfigError."""
    try:
        return cls(**values)
    except ValidationError as e:
        raise ConfigError(format_errors(e, origin or {})) from None


def parse_config(cls: type[C], argv: list[str]) -> C:
    """Parse argv (``@ file.toml`` and ``--dotted.key value``) into ``cls``."""
    values, origin = ParsedArgs(argv).tree()
    return build_config(cls, values, origin)


def run_cli(cls: type[C], command: str, argv: list[str] | None = None) -> C:
    """Parse ``sys.argv`` for the entry point ``command``: ``--help`` prints its usage and exits 0; a config mistake
    prints one line and exits 2."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in HELP_FLAGS for arg in argv):
        print(cli_help(cls, command))
        sys.exit(0)
    try:
        config = parse_config(cls, argv)
    except ConfigError as e:
        exit_config_error(e)
    return config


HOW = (
    "Sources, later wins: defaults < env vars TRIDENT_<KEY>, __ between levels (TRIDENT_OPTIM__LR=1e-5) < "
    "@ FILE.toml, several allowed, later files win < flags --dotted.key VALUE (--optim.lr 1e-5). A section also "
    "loads from a file of its own (--section @ FILE.toml); booleans are bare (--flag) or negated (--no-flag); lists "
    "and tables are JSON (--key '[1, 2]')."
)


def cli_help(cls: type[BaseConfig], command: str) -> str:
    """``command --help``: its usage, how sources combine, and each top-level key of ``cls`` with the first sentence
    of its description (the config model's docstring and descriptions, so the help cannot drift)."""
    summary = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("``", "").replace("\n", " ")
    lines = [f"usage: {command} [@ FILE.toml ...] [--KEY VALUE ...]", "", *textwrap.wrap(summary, 100), ""]
    lines += [*textwrap.wrap(HOW, 100), "", "keys:"]
    for name, field in cls.model_fields.items():
        flag, section = "--" + name.replace("_", "-"), section_model(field.annotation)
        if section is not None and typing.get_origin(field.annotation) is list:  # [[env]] tables
            flag += " JSON"
        elif section is not None:
            flag += " @ FILE.toml" if issubclass(section, BaseConfig) else ".KEY VALUE"
        elif field.annotation is not bool:
            flag += " VALUE"
        about = _description(field) or (section and section.__doc__) or ""  # a section's own docstring
        about = _first_sentence(about) if about else f"Keys: {', '.join(section.model_fields)}."
        about += " (required)" if field.is_required() else ""
        column = f"  {flag:<32}" if len(flag) < 32 else f"  {flag}\n{' ' * 34}"
        lines.append(textwrap.fill(about, 100, initial_indent=column, subsequent_indent=" " * 34) or column)
    lines += ["", f"Every key, with its type, default and meaning: {CONFIG_REFERENCE}"]
    return "\n".join(line.rstrip() for line in lines)


def _description(field: FieldInfo) -> str | None:
    """A field's description, also one its type carries inside an optional (``OutputDir | None``)."""
    inner = [meta for arg in typing.get_args(field.annotation) for meta in getattr(arg, "__metadata__", ())]
    return field.description or next((meta.description for meta in inner if isinstance(meta, FieldInfo)), None)


def _first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not one of 'e.g.' or a file name)."""
    text = " ".join(text.replace("``", "").split())
    return re.split(r"(?<!e\.g)(?<!i\.e)\.(?=\s)", text, maxsplit=1)[0].rstrip(".") + "."


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds, also when optional (``Section | None``)."""
    candidates = [annotation, *typing.get_args(annotation)] if typing.get_origin(annotation) else [annotation]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def exit_config_error(error: Exception) -> NoReturn:
    """Print each problem as its own ``error: ...`` line and exit 2 (nothing started)."""
    for line in str(error).splitlines():
        print(f"error: {line}", file=sys.stderr)
    sys.exit(2)


def get_key(config: Any, dotted: str) -> Any:
    """The value at ``dotted`` (``model.experimental.lora.rank``); None where a section on the way is absent."""
    for part in dotted.split("."):
        if config is None:
            return None
        config = getattr(config, part)
    return config


def is_set(config: Any, dotted: str) -> bool:
    """Whether ``dotted`` was given explicitly (file, flag or env var) rather than left at its default."""
    for part in dotted.split("."):
        if config is None or part not in config.model_fields_set:
            return False
        config = getattr(config, part)
    return True


def set_key(config: Any, dotted: str, value: Any) -> None:
    """Assign ``value`` at ``dotted`` (validated: the models assign with validation)."""
    *parents, leaf = dotted.split(".")
    setattr(get_key(config, ".".join(parents)) if parents else config, leaf, value)


def to_toml_dict(config: BaseConfig) -> dict:
    """The config as plain TOML-able data (None values dropped), e.g. to hand to a child process."""
    return config.model_dump(mode="json", exclude_none=True)
