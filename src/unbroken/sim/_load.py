"""Building the simulator's typed configs from TOML tables and JSON objects.

Owns one rule for every `unbroken.sim` config: a key the dataclass does not declare is an error
that names the key and the file, a value of the wrong type is an error that names the field, and
the dataclass's own `__post_init__` checks the invariants. It never guesses a default for a
misspelled key.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from unbroken.errors import UserError

__all__ = ["build", "check_positive", "check_range", "read_json", "read_toml"]

T = TypeVar("T")


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file, turning a missing file or a syntax error into a `UserError`."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: invalid TOML: {exc}") from None


def read_json(path: str | Path) -> Any:
    """Read a JSON file, turning a missing file or a syntax error into a `UserError`."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON: {exc}") from None


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise UserError(f"{where}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        if not isinstance(value, list | tuple):
            raise UserError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def build(cls: type[T], table: dict[str, Any], where: str) -> T:
    """Construct dataclass `cls` from `table`, rejecting keys it does not declare.

    Args:
        cls: a dataclass whose fields carry plain type hints.
        table: the parsed TOML table or JSON object.
        where: the file (and table) the values came from, used in every error message.

    Returns:
        The constructed, validated instance.

    Raises:
        UserError: on an unknown key, a missing required key, a mistyped value or a violated
            invariant.
    """
    if not isinstance(table, dict):
        raise UserError(f"{where}: expected a table, got {table!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in table:
        if key not in fields:
            raise UserError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(fields))})")
    kwargs = {k: _coerce(v, hints[k], f"{where}: {k}") for k, v in table.items()}
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise UserError(f"{where}: missing key {missing[0]!r}")
    try:
        return cls(**kwargs)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None


def check_positive(obj: Any, *names: str) -> None:
    """Raise `UserError` unless each named attribute of `obj` is > 0."""
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise UserError(f"{name} must be > 0, got {value!r}")


def check_range(obj: Any, name: str, low: float, high: float) -> None:
    """Raise `UserError` unless `low <= obj.name <= high`."""
    value = getattr(obj, name)
    if not low <= value <= high:
        raise UserError(f"{name} must be in [{low}, {high}], got {value!r}")
