"""A YAML or `--set` value as its field's declared type (int, float, bool, str, lists and tuples of them).

Only the type is checked here; ranges are keel/config/bounds.py's and the rules between fields are
keel/config/rules.py's. Every refusal is a `ConfigError` naming the field.
"""

from __future__ import annotations

import math
import typing
from typing import Any

import yaml

from keel.config.bounds import INT64_MAX
from keel.config.yaml_text import parse_yaml

_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message is one line naming the field (a message of several lines,
    such as a parser's or a list of mismatches, is joined with "; ", so the CLI's error stays one line)."""

    def __init__(self, message: str):
        super().__init__(
            "; ".join(line.strip() for line in str(message).splitlines() if line.strip())
        )


def _integer(name: str, value: Any) -> int:
    """An int from an int, an integral float or their text; NaN, inf and anything past int64 are mistakes."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    number: int | float = value  # exact for int text (float would round 2**63 - 1)
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    if isinstance(number, float):
        if not math.isfinite(number) or number != int(number):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        number = int(number)
    if abs(number) > INT64_MAX:
        raise ConfigError(f"{name}: {value!r} does not fit in 64 bits")
    return number


def _number(name: str, value: Any) -> float:
    """A finite float from a number or its text (a boolean is not a number; 1e400 overflows to inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{name}: expected a finite number, got {value!r}")
    return number


def coerce(name: str, hint: Any, value: Any) -> Any:
    """Convert a YAML/CLI value to the field's declared type, or say which field is wrong."""
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if hint is int:
        return _integer(name, value)
    if hint is float:
        return _number(name, value)
    if hint is str:
        if isinstance(value, bool):  # YAML's `compile: false` (model.compile reads it as a setting)
            return str(value)
        if value is None or not isinstance(value, (str, int, float)):
            raise ConfigError(
                f"{name}: expected a string, got {'null' if value is None else repr(value)}"
            )
        return str(value)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = _list_text(name, value)
        if not isinstance(value, (list, tuple)):
            value = [value]
        args = typing.get_args(hint)
        if origin is tuple:
            if len(value) != len(args):
                raise ConfigError(f"{name}: expected {len(args)} values, got {value!r}")
            return tuple(coerce(f"{name}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))
        return [coerce(f"{name}[{i}]", args[0], v) for i, v in enumerate(value)]
    return value


def _list_text(name: str, text: str) -> list[Any]:
    """A list field given as text: YAML flow `[a, b]`, or comma-separated `a,b` ("" is the empty list)."""
    if not text.strip():
        return []
    if not text.strip().startswith("["):
        return text.split(",")
    try:
        value = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: {text!r} is not a YAML list ({yaml_problem(exc)})") from None
    return value if isinstance(value, list) else [value]


def yaml_problem(exc: yaml.YAMLError) -> str:
    return getattr(exc, "problem", None) or str(exc).splitlines()[0]
