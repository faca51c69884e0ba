"""The hang detector, on a fake clock and a fake /proc: late beats while burning CPU are
starvation (looked at again after half a timeout), a stopped process is hung at once, one asleep
without CPU progress is hung, and a rank still starting or exiting gets the start-up timeout."""

from __future__ import annotations

import pytest

from unbroken.launch.agent.hang import CpuSample, HangDetector, Liveness, Verdict
from unbroken.messages import RankStatus

TIMEOUT = 2.0
STARTUP = 300.0
PID = 4242


class FakeProc:
    """A process as the probe shows it; counts how often it was looked at."""

    def __init__(self, state: str = "S", ticks: int = 100) -> None:
        self.state, self.ticks, self.looks = state, ticks, 0

    def __call__(self, pid: int) -> CpuSample:
        assert pid == PID
        self.looks += 1
        return CpuSample(self.state, self.ticks)


def _detector(proc: FakeProc) -> HangDetector:
    return HangDetector(timeout_s=TIMEOUT, probe=proc, startup_timeout_s=STARTUP)


def _beating(at: float, status: RankStatus = RankStatus.TRAINING) -> Liveness:
    return Liveness(spawned=0.0).beat(at, status)


def test_beats_on_time_are_fine_without_looking_at_the_process():
    proc = FakeProc(state="T")
    judged = _detector(proc).assess(_beating(10.0), PID, now=10.0 + TIMEOUT)
    assert judged.verdict is Verdict.FINE and proc.looks == 0
    assert judged.silent_s == pytest.approx(TIMEOUT)


def test_late_beats_while_burning_cpu_are_starved_and_rechecked_after_half_a_timeout():
    proc = FakeProc(state="R", ticks=100)
    hangs = _detector(proc)
    now = 10.0 + TIMEOUT + 0.1
    first = hangs.assess(_beating(10.0), PID, now)
    assert first.verdict is Verdict.STARVED and proc.looks == 1
    assert first.silent_s == pytest.approx(TIMEOUT + 0.1)
    live = first.liveness
    assert live.cpu_mark == 100 and live.last_beat == pytest.approx(now - TIMEOUT / 2)
    # Not looked at again until half a timeout has passed.
    assert hangs.assess(live, PID, now + TIMEOUT / 2 - 0.01).verdict is Verdict.FINE
    assert proc.looks == 1
    proc.ticks = 150  # still making progress: starved again
    second = hangs.assess(live, PID, now + TIMEOUT / 2 + 0.01)
    assert second.verdict is Verdict.STARVED and second.liveness.cpu_mark == 150
    # No progress in the next half timeout: hung.
    third = hangs.assess(second.liveness, PID, now + TIMEOUT + 0.02)
    assert third.verdict is Verdict.HUNG and proc.looks == 3


def test_a_stopped_process_is_hung_at_once():
    proc = FakeProc(state="T", ticks=100)
    judged = _detector(proc).assess(_beating(10.0), PID, now=10.0 + TIMEOUT + 0.01)
    assert judged.verdict is Verdict.HUNG and proc.looks == 1


def test_asleep_without_cpu_progress_is_hung():
    proc = FakeProc(state="S", ticks=100)
    hangs = _detector(proc)
    first = hangs.assess(_beating(10.0), PID, now=10.0 + TIMEOUT + 0.01)
    assert first.verdict is Verdict.STARVED  # no earlier look to compare with yet
    later = 10.0 + TIMEOUT + 0.01 + TIMEOUT / 2 + 0.01
    assert hangs.assess(first.liveness, PID, later).verdict is Verdict.HUNG


def test_a_beat_forgets_the_cpu_mark():
    proc = FakeProc(state="S", ticks=100)
    hangs = _detector(proc)
    first = hangs.assess(_beating(10.0), PID, now=10.0 + TIMEOUT + 0.01)
    live = first.liveness.beat(13.0, RankStatus.TRAINING)
    assert live.cpu_mark is None
    again = hangs.assess(live, PID, now=13.0 + TIMEOUT + 0.01)
    assert again.verdict is Verdict.STARVED  # compared with nothing, not with the old mark


@pytest.mark.parametrize(
    "live",
    [
        Liveness(spawned=10.0),  # not beating yet: timed from its spawn
        _beating(10.0, RankStatus.EXITING),  # its group teardown may be slow
    ],
    ids=["not-yet-beating", "exiting"],
)
def test_starting_and_exiting_ranks_get_the_startup_timeout(live):
    proc = FakeProc(state="S", ticks=100)
    hangs = _detector(proc)
    assert hangs.assess(live, PID, now=10.0 + STARTUP).verdict is Verdict.FINE
    assert proc.looks == 0
    first = hangs.assess(live, PID, now=10.0 + STARTUP + 0.01)
    assert first.verdict is Verdict.STARVED and proc.looks == 1
    proc.state = "T"
    assert hangs.assess(live, PID, now=10.0 + STARTUP + 0.01).verdict is Verdict.HUNG


def test_a_promoted_shadow_is_timed_from_its_promotion():
    proc = FakeProc(state="T")
    hangs = _detector(proc)
    parked = _beating(10.0, RankStatus.SHADOW_READY)
    promoted = parked.promoted(500.0)
    assert hangs.assess(promoted, PID, now=500.0 + TIMEOUT).verdict is Verdict.FINE
    assert hangs.assess(promoted, PID, now=500.0 + TIMEOUT + 0.01).verdict is Verdict.HUNG
