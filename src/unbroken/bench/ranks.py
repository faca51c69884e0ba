"""A world of local rank processes for the benchmarks that run outside the coordinator
(`unbroken bench detect`, `unbroken bench engine`): `python -m MODULE ARGS... RANK` per rank,
this checkout first on the path, waited for together — the first rank that fails takes the
others down (its peers would otherwise wait in a collective until their timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_ranks"]


def run_ranks(module: str, args: list[str], world_size: int, threads: int, what: str) -> None:
    """Run the ranks to completion.

    Raises:
        RuntimeError: "`what`: rank exit codes [...]" when any rank failed.
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", module, *args]
    procs = [subprocess.Popen([*cmd, str(r)], env=env) for r in range(world_size)]
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one rank died: its peers would wait in a collective until timeout
            time.sleep(0.2)  # polling child processes, not synchronizing with them
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"{what}: rank exit codes {codes}")
