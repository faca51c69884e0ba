"""Trainer-side heartbeats: a daemon thread sends a `RankBeat` (rank, generation, status,
iteration, phase, last completed iteration) to the node agent's Unix datagram socket every
interval. A SIGSTOPped or wedged process sends nothing, which is how the agent tells a hang
from slow progress. State changes the agent acts on (a shadow ready, an iteration completed,
an exit on purpose) are sent at once, not with the next periodic beat."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

from unbroken.messages import RankBeat, RankStatus, encode_json

__all__ = ["Heartbeat"]


class Heartbeat:
    def __init__(self, address: str, rank: int, generation: int, interval_s: float) -> None:
        self.address = address.replace("@", "\0", 1) if address.startswith("@") else address
        self.rank = rank
        self.generation = generation
        self.interval_s = interval_s
        self.status = RankStatus.STARTING
        self.iteration = -1
        self.phase = ""
        self.last_completed = -1
        self.level = 0
        self.footprint: dict[str, int] = {}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def message(self) -> RankBeat:
        return RankBeat(
            rank=self.rank,
            generation=self.generation,
            pid=os.getpid(),
            t=time.time(),
            status=self.status,
            iteration=self.iteration,
            phase=self.phase,
            completed=self.last_completed,
            level=self.level,
            footprint=dict(self.footprint),
        )

    def beat(self) -> None:
        # An agent that is gone or busy notices on its own; a lost beat is not an error.
        with contextlib.suppress(OSError):
            self._sock.sendto(encode_json(self.message()), self.address)

    def shadow_ready(self, level: int, footprint: dict[int, int]) -> None:
        """A shadow parks at `level`, having held `footprint` private bytes at each level."""
        self.status, self.level = RankStatus.SHADOW_READY, level
        self.footprint = {str(k): int(v) for k, v in footprint.items()}
        self.beat()

    def promoted(self, generation: int, rank: int | None = None) -> None:
        """The shadow became the trainer of `generation` (as `rank` when the world changed)."""
        self.status, self.generation = RankStatus.STARTING, generation
        if rank is not None:
            self.rank = rank
        self.beat()

    def completed(self, iteration: int) -> None:
        """Iteration `iteration` is complete (its update and boundary done)."""
        self.last_completed = iteration
        self.beat()

    def exiting(self) -> None:
        """The rank exits on purpose; the agent allows its slow group teardown."""
        self.status = RankStatus.EXITING
        self.beat()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def __call__(self, phase, iteration: int, step: int, n_steps: int) -> None:
        """Phase hook: record progress (sent with the next beat)."""
        self.status = RankStatus.TRAINING
        self.iteration = iteration
        self.phase = str(phase)
