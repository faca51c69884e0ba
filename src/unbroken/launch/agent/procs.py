"""One supervised trainer or shadow process, as the agent tracks it: its rank and generation,
its process handle, its liveness (`unbroken.launch.agent.hang`), its last heartbeat, and its log
(read back for the last words and the traceback of a rank that died)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from unbroken.launch.agent.hang import Liveness
from unbroken.messages import RankBeat

if TYPE_CHECKING:
    from unbroken.shadow.forkserver import ForkedProc

__all__ = ["RankProc", "last_line", "last_traceback"]


@dataclass(slots=True)
class RankProc:
    rank: int
    generation: int
    proc: subprocess.Popen | ForkedProc
    liveness: Liveness
    log: str | None = None
    beat: RankBeat | None = None
    """Its last heartbeat."""
    reported: bool = False
    """Its exit or hang went to the coordinator (nothing more is said about it)."""
    warm_sent: bool = False
    """A shadow: it was told to run its GPU warm-up (`WarmUp`)."""
    premap_sent: bool = False
    """A shadow: it was told to map its device's retained state (`MapRetained`)."""

    @property
    def completed(self) -> int:
        return self.beat.completed if self.beat is not None else -1

    def alive(self) -> bool:
        return self.proc.poll() is None

    def traceback(self) -> str:
        """The last traceback the process wrote to its log ("" if none)."""
        return last_traceback(self.log)

    def last_words(self) -> str:
        """The last line the process wrote to its log (why it died, if it said)."""
        return last_line(self.log)


def _tail(path: str | None, nbytes: int) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as fh:
        fh.seek(max(0, os.path.getsize(path) - nbytes))
        return fh.read().decode(errors="replace")


def last_traceback(path: str | None) -> str:
    """The last Python traceback in the log at `path` ("" if none)."""
    text = _tail(path, 65536)
    at = text.rfind("Traceback (most recent call last):")
    return text[at:] if at >= 0 else ""


_TORCH_WARNING = re.compile(r"^\[rank\d+\]:\[W\d{4} ")
"""A warning line of torch's C++ logging ("[rank0]:[W1202 04:16:11.914 ...] Warning: ..."),
e.g. ProcessGroupNCCL's "destroy_process_group() was not called" at exit: never the reason."""


def last_line(path: str | None) -> str:
    """Why the process at `path` died, from the tail of its log, at most 300 characters ("" if
    it wrote nothing): the last line a trainer wrote about its own failure
    ("unbroken-trainer[rank R] in PHASE: ..."), else the last non-blank line that is not a
    torch C++ warning, else the last non-blank line."""
    lines = [ln for ln in _tail(path, 16384).splitlines() if ln.strip()]
    own = [ln for ln in lines if ln.startswith("unbroken-trainer[")]
    plain = [ln for ln in lines if not _TORCH_WARNING.match(ln)]
    for choice in (own, plain, lines):
        if choice:
            return choice[-1][:300]
    return ""
