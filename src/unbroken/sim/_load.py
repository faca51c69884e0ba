"""Building the simulator's typed configs from TOML tables and JSON objects.

Owns one rule for every `unbroken.sim` config: a key the dataclass does not declare is an error
that names the key and the file, a value of the wrong type is an error that names the field, and
the dataclass's own `__post_init__` checks the invariants. It never guesses a default for a
misspelled key. Also the one reader of a runtime output dir's JSON-lines logs, for `--validate`
and `--profile-from`.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from unbroken.config.loader import config_from_dict
from unbroken.errors import UserError

__all__ = ["build", "check_positive", "check_range", "read_json", "read_run_log", "read_toml"]

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


def read_run_log(path: Path) -> list[dict[str, Any]]:
    """Read one JSON-lines log of a runtime output dir (metrics, events, timings).

    Raises:
        UserError: the file is missing or a line is not JSON.
    """
    if not path.exists():
        hint = (
            " (written by runtimes with per-rank timings)" if path.name == "timings.jsonl" else ""
        )
        raise UserError(f"{path}: missing (is this an `unbroken train`/`demo` output dir?){hint}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(f"{path}:{n}: not a JSON object") from None
    return out


def read_json(path: str | Path) -> Any:
    """Read a JSON file, turning a missing file or a syntax error into a `UserError`."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON: {exc}") from None


def build(cls: type[T], table: dict[str, Any], where: str) -> T:
    """Construct dataclass `cls` from `table`, rejecting keys it does not declare.

    The key and type checks are the project's one strict loader
    (`unbroken.config.loader.config_from_dict`); this adds the simulator's rule that a required
    key must be present, named in the error.

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
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    missing = [
        f.name
        for f in fields
        if f.name not in table
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing and set(table) <= {f.name for f in fields}:
        raise UserError(f"{where}: missing key {missing[0]!r}")
    try:
        return config_from_dict(cls, table, where)
    except UserError as exc:
        text = str(exc)
        raise UserError(text if text.startswith(where) else f"{where}: {text}") from None


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
