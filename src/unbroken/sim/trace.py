"""Failure traces: CSV files of failure times and kinds for the discrete-event mode.

Owns the trace format: a header `t_s,kind` (extra columns are ignored), one failure per line,
`t_s` in seconds since the run's first iteration started, `kind` one of `hof`, `fatal`,
`fail-slow` (also accepted: `HOF`, `FF`, `fatal-failure`, `slow`). Lines starting with `#` are
comments. Every malformed line is reported with its file and line number.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import MappingProxyType

from unbroken.errors import UserError
from unbroken.sim.des import Failure

__all__ = ["KIND_ALIASES", "read_trace", "write_trace"]

KIND_ALIASES = MappingProxyType(
    {
        "hof": "hof",
        "ff": "fatal",
        "fatal": "fatal",
        "fatal-failure": "fatal",
        "fail-slow": "fail-slow",
        "failslow": "fail-slow",
        "slow": "fail-slow",
    }
)


def read_trace(path: str | Path) -> list[Failure]:
    """Read a failure trace CSV.

    Raises:
        UserError: missing file, missing columns, bad time or unknown kind (with line number).
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: no such trace file") from None
    rows = [(n, line) for n, line in enumerate(lines, 1) if line.strip() and line[0] != "#"]
    if not rows:
        raise UserError(f"{path}: empty trace (expected a header t_s,kind)")
    reader = csv.DictReader([line for _, line in rows])
    fields = [f.strip() for f in reader.fieldnames or []]
    if "t_s" not in fields or "kind" not in fields:
        raise UserError(f"{path}:{rows[0][0]}: header must name columns t_s and kind")
    failures = []
    for (lineno, _), raw in zip(rows[1:], reader, strict=True):
        record = {k.strip(): (v or "").strip() for k, v in raw.items() if k}
        try:
            t = float(record["t_s"])
        except ValueError:
            raise UserError(f"{path}:{lineno}: t_s {record['t_s']!r} is not a number") from None
        if not math.isfinite(t) or t < 0:
            raise UserError(f"{path}:{lineno}: t_s must be a finite time >= 0")
        kind = KIND_ALIASES.get(record["kind"].lower())
        if kind is None:
            raise UserError(
                f"{path}:{lineno}: unknown kind {record['kind']!r} (use hof, fatal or fail-slow)"
            )
        failures.append(Failure(t, kind))
    return sorted(failures, key=lambda f: f.t_s)


def write_trace(path: str | Path, failures: list[Failure]) -> None:
    """Write `failures` in the trace format."""
    with Path(path).open("w", newline="") as fh:
        fh.write("t_s,kind\n")
        for f in failures:
            fh.write(f"{f.t_s:.3f},{f.kind}\n")
