"""Trainer-side heartbeats: a daemon thread sends {rank, generation, iteration, phase} to the
node agent's Unix datagram socket every interval. A SIGSTOPped or wedged process sends nothing,
which is how the agent tells a hang from slow progress."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

__all__ = ["Heartbeat"]


class Heartbeat:
    def __init__(self, address: str, rank: int, generation: int, interval_s: float) -> None:
        self.address = address.replace("@", "\0", 1) if address.startswith("@") else address
        self.rank = rank
        self.generation = generation
        self.interval_s = interval_s
        self.iteration = -1
        self.phase = "init"
        self.extra: dict = {}
        """More fields for every beat (a shadow's measured footprint per level)."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        msg = {
            "rank": self.rank,
            "generation": self.generation,
            "iter": self.iteration,
            "phase": self.phase,
            "pid": os.getpid(),
            "t": time.time(),
            **self.extra,
        }
        # An agent that is gone or busy notices on its own; a lost beat is not an error.
        with contextlib.suppress(OSError):
            self._sock.sendto(json.dumps(msg).encode(), self.address)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def __call__(self, phase, iteration: int, step: int, n_steps: int) -> None:
        """Phase hook: record progress (sent with the next beat)."""
        self.iteration = iteration
        self.phase = str(phase)
