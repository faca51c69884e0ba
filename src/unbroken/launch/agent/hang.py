"""Hang detection for a node's trainers, as a pure decision over what the agent observed.

A trainer sends a `RankBeat` every `heartbeat_interval_s`; a SIGSTOPped or wedged process sends
nothing. Silence alone is not a hang on a busy machine, though: a 2-core node oversubscribed by
shadows and other work delays beats of trainers that are making progress. So a rank whose beats
are late is looked at before it is called hung:

- stopped (SIGSTOP, /proc state "T")           -> hung at once;
- asleep without CPU progress since last look   -> hung (stuck in a collective, deadlocked);
- still burning CPU                             -> starved, not hung: it gets half a timeout
                                                   more, then is looked at again.

A rank that never beat (still starting: imports, rendezvous) or that said it is exiting (its
group teardown may be slow) gets the start-up timeout instead of the heartbeat timeout.

`HangDetector.assess` takes the rank's `Liveness` (spawn time, last beat, status, the CPU ticks
seen when its beats were first found late), the time now and its pid, and returns a `Verdict`
with the updated `Liveness`; the only outside input is the injected CPU probe (`/proc` by
default), so the decision is tested with a fake clock and a fake probe.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

from unbroken.messages import RankStatus

__all__ = [
    "STARTUP_TIMEOUT_S",
    "Assessment",
    "CpuSample",
    "HangDetector",
    "Liveness",
    "Verdict",
    "proc_cpu_sample",
]

STARTUP_TIMEOUT_S = 300.0
"""How long a rank may stay silent before its first beat, or after saying it is exiting."""


class Verdict(enum.Enum):
    FINE = "fine"
    """Beats on time."""
    STARVED = "starved"
    """Beats late but burning CPU: looked at again after half a timeout."""
    HUNG = "hung"


@dataclass(frozen=True, slots=True)
class CpuSample:
    """A process as /proc shows it."""

    state: str
    """The state letter: "R" running, "S"/"D" asleep, "T" stopped, "X" gone."""
    ticks: int
    """User + system CPU time, in clock ticks."""


def proc_cpu_sample(pid: int) -> CpuSample:
    """The state letter and CPU ticks of process `pid`, from /proc/PID/stat ("X" if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return CpuSample("X", 0)
    return CpuSample(fields[0], int(fields[11]) + int(fields[12]))


@dataclass(frozen=True, slots=True)
class Liveness:
    """What the agent knows about one rank's heartbeats."""

    spawned: float
    last_beat: float | None = None
    """When its last beat arrived (None: none yet), or the point a starved rank is timed from."""
    status: RankStatus | None = None
    """The status its last beat reported."""
    cpu_mark: int | None = None
    """CPU ticks when its beats were first found late (None while beats are on time)."""

    def beat(self, now: float, status: RankStatus) -> Liveness:
        """A beat arrived at `now`."""
        return dataclasses.replace(self, last_beat=now, status=status, cpu_mark=None)

    def promoted(self, now: float) -> Liveness:
        """A parked shadow was promoted at `now`: its silence is timed from here."""
        return dataclasses.replace(self, last_beat=now)


@dataclass(frozen=True, slots=True)
class Assessment:
    verdict: Verdict
    liveness: Liveness
    """The rank's liveness to keep (a starved rank's is moved on)."""
    silent_s: float
    """How long it has been silent, as judged."""


@dataclass(frozen=True, slots=True)
class HangDetector:
    """Decides hung vs starved vs fine for one rank at a time (no state of its own).

    Args:
        timeout_s: the heartbeat timeout (`recovery.heartbeat_timeout_s`).
        probe: pid -> its `CpuSample` (default: /proc).
        startup_timeout_s: the limit before a first beat and after an exiting one.
    """

    timeout_s: float = 2.0
    probe: Callable[[int], CpuSample] = proc_cpu_sample
    startup_timeout_s: float = STARTUP_TIMEOUT_S

    def limit(self, live: Liveness) -> float:
        """The silence `live` is allowed before it is looked at."""
        if live.last_beat is None or live.status is RankStatus.EXITING:
            return self.startup_timeout_s
        return self.timeout_s

    def assess(self, live: Liveness, pid: int, now: float) -> Assessment:
        """Judge the rank `live` (process `pid`) at time `now`; the probe is asked only once
        its silence is over the limit."""
        last = live.last_beat if live.last_beat is not None else live.spawned
        silent = now - last
        if silent <= self.limit(live):
            return Assessment(Verdict.FINE, live, silent)
        sample = self.probe(pid)
        if sample.state == "T":
            return Assessment(Verdict.HUNG, live, silent)
        progressed = live.cpu_mark is None or sample.ticks > live.cpu_mark
        if progressed:
            recheck = dataclasses.replace(
                live, cpu_mark=sample.ticks, last_beat=now - self.timeout_s / 2
            )
            return Assessment(Verdict.STARVED, recheck, silent)
        return Assessment(Verdict.HUNG, dataclasses.replace(live, cpu_mark=sample.ticks), silent)
