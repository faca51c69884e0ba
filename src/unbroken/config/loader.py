"""Generic TOML → nested dataclass loader with strict keys and types.

Hand-written because the checks we need (reject unknown keys naming key *and* file, coerce int
to float, nested dataclasses, `Literal` choices) are ~100 lines, and the maintained libraries
(pydantic, cattrs) would add a large dependency for this alone.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from unbroken.errors import UserError

__all__ = ["config_from_dict", "load_config", "to_dict"]

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _is_integer(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


_SCALARS: dict[type, tuple[str, Callable[[Any], bool], Callable[[Any], Any]]] = {
    float: ("a number", _is_number, float),
    int: ("an integer", _is_integer, lambda v: v),
    bool: ("true or false", lambda v: isinstance(v, bool), lambda v: v),
    str: ("a string", lambda v: isinstance(v, str), lambda v: v),
}
"""Scalar field type -> (what the message asks for, accepts(value), the value as stored)."""


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, key, source)
    if origin is Literal:
        if value not in get_args(tp):
            choices = ", ".join(repr(a) for a in get_args(tp))
            raise UserError(f"{source}: key '{key}' is {value!r}; choose one of {choices}")
        return value
    if origin in (list, tuple):
        return _coerce_sequence(value, tp, key, source)
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{source}: key '{key}' must be a table, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"{source}: '[{key}]' must be a table, got {value!r}")
        return _build(tp, value, source, prefix=f"{key}.")
    if tp is Any:
        return value
    if tp in _SCALARS:
        what, accepts, stored = _SCALARS[tp]
        if not accepts(value):
            raise UserError(f"{source}: key '{key}' must be {what}, got {value!r}")
        return stored(value)
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def _coerce_union(value: Any, tp: Any, key: str, source: str) -> Any:
    """The value as the first arm of the union that accepts it (None only for `None`)."""
    for arm in get_args(tp):
        if arm is type(None):
            if value is None:
                return None
            continue
        try:
            return _coerce(value, arm, key, source)
        except UserError:
            continue
    raise UserError(
        f"{source}: key '{key}' has value {value!r}; expected "
        f"{' or '.join(_type_name(a) for a in get_args(tp))}"
    )


def _coerce_sequence(value: Any, tp: Any, key: str, source: str) -> list | tuple:
    if not isinstance(value, list | tuple):
        raise UserError(f"{source}: key '{key}' must be a list, got {value!r}")
    (item_tp, *_rest) = get_args(tp) or (Any,)
    items = [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
    return tuple(items) if get_origin(tp) is tuple else items


def _build(cls: type[T], data: dict[str, Any], source: str, prefix: str = "") -> T:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise UserError(f"{source}: unknown key '{prefix}{key}' (known keys here: {known})")
    kwargs = {name: _coerce(data[name], hints[name], prefix + name, source) for name in data}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{source}: {exc}") from None


def config_from_dict(cls: type[T], data: dict[str, Any], source: str = "<config>") -> T:
    """Build `cls` from a plain dict, rejecting unknown keys and wrong types.

    Raises:
        UserError: naming the offending key and `source`.
    """
    return _build(cls, data, source)


def load_config(cls: type[T], path: str | Path) -> T:
    """Load a TOML file into the dataclass `cls`.

    Raises:
        UserError: the file is missing, is not valid TOML, or has an unknown/mistyped key.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    return _build(cls, data, str(path))


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON/TOML-ready dict of a config (tuples become lists)."""
    return dataclasses.asdict(cfg)
