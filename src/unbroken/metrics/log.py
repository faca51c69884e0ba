"""Append-only JSON-lines logs shared by several processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["JsonlLog", "JsonlTail", "read_jsonl"]


class JsonlLog:
    """Appends one JSON object per line; safe to share between processes (O_APPEND, one write).

    Args:
        path: the log file (created if missing).
        base: fields added to every record (e.g. {"run": "faulty"}).
    """

    def __init__(self, path: str | Path, **base: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.base = base
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({**self.base, **record}, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())

    def emit(self, kind: str, **fields: Any) -> None:
        """Append an event `{"t": now, "kind": kind, **fields}`."""
        self.write({"t": time.time(), "kind": kind, **fields})

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a JSON-lines file (a torn last line is ignored)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class JsonlTail:
    """Reads the records appended to a JSON-lines file since the last call (a torn last line
    is left for the next call)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out
