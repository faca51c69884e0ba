"""A shadow's inbox: the agent's lines on its stdin, read where the shadow waits for them.

A shadow waits twice (`unbroken.launch.session`): on a GPU, before its kernel warm-up, for
`WarmUp` (`recovery.shadow_warmup = "after_trainer"`); parked at its level, for `Promote`, mapping
the retained state when a `MapRetained` comes first. The agent sends each line once, when its
condition holds (`unbroken.launch.agent.shadows.ShadowPool`), whether or not this shadow waits
for it, so a line may arrive before its wait (it stays in the pipe), or at a wait for another:

- a `Promote` while waiting for `WarmUp` (the trainer failed before completing an iteration):
  kept, the warm-up runs at once, and the park returns it without reading;
- a `WarmUp` while parked (a shadow that never waited: CPU, level 1, or `at_start`): nothing
  to do.

End of input: the agent let the shadow go (`SystemExit(0)`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO

from unbroken.messages import MapRetained, Promote, WarmUp, decode_json

__all__ = ["ShadowInbox"]


class ShadowInbox:
    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdin
        self.promote: tuple[Promote, float] | None = None
        """A `Promote` that came while waiting for something else, and when."""

    def _next(self) -> tuple[Promote | MapRetained | WarmUp, float]:
        line = self.stream.readline()
        if not line:
            raise SystemExit(0)  # the agent let the shadow go
        return decode_json(line, (Promote, MapRetained, WarmUp)), time.time()

    def await_warm_up(self) -> bool:
        """Until `WarmUp`, or a `Promote` (kept for `await_promotion`). Returns whether the
        shadow was promoted meanwhile."""
        while self.promote is None:
            msg, t = self._next()
            if isinstance(msg, WarmUp):
                return False
            if isinstance(msg, Promote):
                self.promote = (msg, t)
            # A MapRetained goes only to a parked shadow: none can come before WarmUp.
        return True

    def await_promotion(self, on_map: Callable[[], None]) -> tuple[Promote, float]:
        """Until `Promote` (and when it came); `on_map` for each `MapRetained` before it."""
        while self.promote is None:
            msg, t = self._next()
            if isinstance(msg, Promote):
                self.promote = (msg, t)
            elif isinstance(msg, MapRetained):
                on_map()
        return self.promote
