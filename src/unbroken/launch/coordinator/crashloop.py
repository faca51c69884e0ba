"""A device that crash-loops is lost hardware (issue 18 item 1, Leto §2.2).

The agent's health check finds a device that is gone (`launch.agent.health`). A device that is
broken but still answers — every trainer started on it dies before completing an iteration —
passes that check, and the job-level crash-loop rule (`recovery.fsm.CRASH_LOOP`: three stalled,
uninjected failures in a row) would end the job. `CrashLoopWatch` names the device instead.

Which device failed is not simply the first exit the coordinator hears of: when one trainer dies,
its peers' collectives break and they exit too, and an agent may report a peer first. So the
watch collects every exit of a failed generation that reached the coordinator (the agent reports
each trainer that exits on its own; the ones it kills for the stop are not reported) and, when
the next generation starts, attributes the failure to the one device whose trainer died of its
own cause — killed by a signal, or an error that is not a broken connection to a peer
(`collateral`). `DEVICE_CRASH_LOOP` stalled, uninjected failures in a row attributed to one
device make it lost. A failure after which the job made progress, an injected fault, or a
failure with no single culprit starts the counts over: a first crash on a healthy device stays
hardware-operable and is recovered in place.

Pure bookkeeping: no processes, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["DEVICE_CRASH_LOOP", "CrashLoopWatch", "collateral"]

DEVICE_CRASH_LOOP = 2
"""Stalled, uninjected failures in a row of one device that make it lost: below the job's own
crash-loop count (3), so the device is excluded before the job would give up."""

_PEER_BROKE = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|remote process|peer.*(exited|closed|died)|"
    r"DistBackendError|NCCL (error|communicator)|ProcessGroup.*(abort|timed out)|"
    r"Socket Timeout|timed out",
    re.IGNORECASE,
)


def collateral(returncode: int, said: str) -> bool:
    """Whether a trainer's exit reads as a consequence of a peer's death (its collective's
    connection broke) rather than a failure of its own device."""
    return returncode > 0 and bool(_PEER_BROKE.search(said))


@dataclass(slots=True)
class _Failed:
    progressed: bool = False
    injected: bool = False
    primary: set[int] = field(default_factory=set)
    """Devices whose trainer died of its own cause."""


class CrashLoopWatch:
    """Exits per failed generation, and consecutive stalled failures per device."""

    def __init__(self) -> None:
        self.stalls: dict[int, int] = {}
        self._generations: dict[int, _Failed] = {}

    def exited(self, generation: int, device: int, returncode: int, said: str) -> None:
        """A trainer of `generation` on `device` exited with `returncode` (non-zero)."""
        if returncode != 0 and not collateral(returncode, said):
            self._generations.setdefault(generation, _Failed()).primary.add(device)

    def failed(self, generation: int, progressed: bool, injected: bool) -> None:
        """`generation` failed: had it completed an iteration, was a fault injected since the
        failure before?"""
        record = self._generations.setdefault(generation, _Failed())
        record.progressed, record.injected = progressed, injected

    def conclude(self, generation: int) -> tuple[int, str] | None:
        """At the start of the generation after `generation`: (device, why it is lost) when
        the failure makes a device's `DEVICE_CRASH_LOOP`-th stalled failure in a row."""
        record = self._generations.pop(generation, None)
        for old in [g for g in self._generations if g < generation]:
            del self._generations[old]
        if record is None:
            return None
        if record.progressed or record.injected or len(record.primary) != 1:
            self.stalls.clear()  # the job moved on, the failure is explained, or no culprit
            return None
        (device,) = record.primary
        n = self.stalls.get(device, 0) + 1
        self.stalls = {device: n}
        if n < DEVICE_CRASH_LOOP:
            return None
        del self.stalls[device]
        return device, (
            f"device {device} crash-loops: its trainers failed {n} times in a row before "
            "completing an iteration"
        )
