"""Live progress on the terminal: one line per few iterations and one per failure/recovery."""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, run_name: str, total_iters: int, stream: TextIO = sys.stderr, quiet=False):
        self.run_name = run_name
        self.total = total_iters
        self.stream = stream
        self.quiet = quiet
        self.every = max(1, total_iters // 10)

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"[{self.run_name}] {text}", file=self.stream, flush=True)

    def iteration(self, m: dict[str, Any]) -> None:
        it = m["iter"]
        if (it + 1) % self.every == 0 or it + 1 == self.total:
            self.say(
                f"iter {it + 1:>4}/{self.total}  loss {m['loss']:.4f}  "
                f"{m['tokens_per_s']:>8.0f} tok/s  {m['iter_s'] * 1000:6.0f} ms  "
                f"state {m['state_hash'] or '-'}"
            )
