"""Config machinery shared by every process: strict pydantic-settings models loaded from TOML and flags.

Sources, later wins: field defaults < ``TRIDENT_*`` env vars (``__`` nests) < ``@ file.toml`` (several
allowed, later wins) < ``--dotted.key value`` flags. ``--section @ file.toml`` loads a file under a key
(how ``rl --trainer @ train.toml`` works). Booleans may be bare flags (``--wandb.offline``) or negated
(``--no-wandb.offline``). Any mistake ends in :class:`ConfigError`, one line naming the file or flag.
"""

import json
import sys
import tomllib
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "TRIDENT_"


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
    lines = []
    for err in error.errors():
        key = ".".join(str(part) for part in err["loc"])
        if not key:  # a check across keys: its message names them
            lines.append(str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"])
            continue
        source = next(
            (origin[k] for k in (key, *_parents(key)) if k in origin),
            f"env var {ENV_PREFIX}{key.upper().replace('.', '__')} or default",
        )
        message = err["msg"]
        if err["type"] == "value_error":  # a validator's own sentence, without pydantic's prefix
            message = str(err["ctx"]["error"])
        elif err["type"] == "extra_forbidden":
            message = "unknown key"
        elif "input" in err and not isinstance(err["input"], dict | list):
            message += f" (got {err['input']!r})"
        lines.append(f"{source}: {key}: {message}")
    return "\n".join(lines)  # one line per problem


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


def run_cli(cls: type[C], argv: list[str] | None = None) -> C:
    """Parse ``sys.argv`` for an entry point; a config mistake prints one line and exits 2."""
    try:
        config = parse_config(cls, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        exit_config_error(e)
    return config


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
