"""Entry points run inside fork-server children by tests/shadow (importable by module name)."""

from __future__ import annotations

import os
import sys


def echo(argv: list[str]) -> int:
    """Print who we are, wait for one line on stdin (the promotion), print it, exit argv[0]."""
    print(f"pid={os.getpid()} ppid={os.getppid()} nice={os.nice(0)}", flush=True)
    print(f"torch-preloaded={'torch' in sys.modules}", flush=True)
    line = sys.stdin.readline()
    print(f"got={line.strip()}", flush=True)
    return int(argv[0])
