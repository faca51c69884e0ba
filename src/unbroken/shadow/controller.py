"""The agent's reclamation controller: keeps shadows from ever making training run out of memory
(Leto §6), against the job's memory budget on this node (`unbroken.shadow.memory`).

It watches the cgroup (an OOM notification is an allocation that is waiting), measures what the
shadows hold at each level, tracks the active (non-shadow) memory, and decides with the pure
`LevelPolicy`. The agent owns the processes; the controller tells it what to do:

    on_oom()          -> "reclaim": the agent kills the shadows and waits until they are gone,
                         then `reclaimed()` -> the level to relaunch at (0: none)
    level_for_next()  -> the level for a new generation's shadows
    sample()          -> every tick: footprints and active memory
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from unbroken.shadow.memory import MIB, MemoryBudget, private_bytes
from unbroken.shadow.policy import LevelPolicy

__all__ = ["ReclaimController"]

SAMPLE_S = 0.25


@dataclass(slots=True)
class _Reclaim:
    t_oom: float
    t0: float
    usage_before: int
    held: int
    shadows: int
    level_from: int


@dataclass(slots=True)
class ReclaimController:
    budget: MemoryBudget
    policy: LevelPolicy
    peak_active: int | None = None
    """Largest memory in use without shadows seen so far (bytes)."""
    measured: set[int] = field(default_factory=set)
    """Shadow pids whose footprint at their level was recorded."""
    peak_total: int = 0
    """Largest memory in use with shadows (bytes)."""
    _next_sample: float = 0.0
    _pending: _Reclaim | None = None

    def sample(self, shadows: dict[int, tuple[bool, dict | None]]) -> None:
        """`shadows`: pid -> (alive?, its footprint per level once it reported one)."""
        now = time.monotonic()
        if now < self._next_sample:
            return
        self._next_sample = now + SAMPLE_S
        held = 0
        for pid, (alive, footprint) in shadows.items():
            if alive:
                held += private_bytes(pid)
            if footprint and pid not in self.measured:
                self.measured.add(pid)
                for level, nbytes in footprint.items():
                    self.policy.record_footprint(int(level), int(nbytes))
        peak = self.budget.peak()
        self.budget.reset_peak()
        total = max(self.budget.usage(), peak)
        self.peak_total = max(self.peak_total, total)
        active = total - held
        self.peak_active = max(active, self.peak_active or 0)

    def level_for_next(self, ranks: int) -> int:
        level = self.policy.at_recovery(self.peak_active, ranks)
        self.budget.restore_oom_hold()
        return level

    def on_oom(self, shadow_pids: list[int], level: int) -> str:
        """An OOM notification. Returns "reclaim" (kill `shadow_pids`, wait until they are gone,
        then call `reclaimed`; `level` is theirs), "real" (nothing to reclaim: the hold was released and the
        kernel's OOM killer decides, as without a controller) or "none" (already resolved)."""
        self.budget.drain_events()
        if not self.budget.under_oom():
            return "none"
        if not shadow_pids:
            self.budget.release_oom_hold()
            return "real"
        self._start(shadow_pids, level)
        return "reclaim"

    def _start(self, shadow_pids: list[int], level: int) -> None:
        held = sum(private_bytes(pid) for pid in shadow_pids)
        usage = self.budget.usage()
        self.peak_active = max(usage - held, self.peak_active or 0)
        self._pending = _Reclaim(
            time.time(), time.monotonic(), usage, held, len(shadow_pids), level
        )

    def reclaimed(self, ranks: int) -> dict:
        """After the agent killed the shadows and saw them gone: the event fields, with
        `level_to` the level to relaunch at."""
        r = self._pending
        assert r is not None, "reclaimed() without on_oom()"
        self._pending = None
        wait_s = time.monotonic() - r.t0
        after = self.budget.usage()
        self.budget.reset_peak()  # the peak so far was reached with the shadows still there
        # The demand that hit the budget: what was in use without the shadows then (the
        # waiting allocation may already be done and freed by now — it may come again).
        active = max(after, r.usage_before - r.held)
        level = self.policy.after_reclaim(active=active, shadows=ranks)
        return {
            "t_oom": r.t_oom,
            "shadows": r.shadows,
            "level_from": r.level_from,
            "level_to": level,
            "freed_mb": r.held / MIB,
            "wait_s": wait_s,
            "usage_mb_before": r.usage_before / MIB,
            "usage_mb_after": after / MIB,
            "budget_mb": self.budget.limit / MIB,
            "footprint_mb": {lv: b / MIB for lv, b in sorted(self.policy.footprint.items())},
        }

    def report(self) -> dict:
        """The budget's story so far, for the event log."""
        return {
            "budget_mb": self.budget.limit / MIB,
            "peak_mb": self.peak_total / MIB,
            "peak_active_mb": (self.peak_active or 0) / MIB,
            "footprint_mb": {lv: b / MIB for lv, b in sorted(self.policy.footprint.items())},
            "oom_kills": self.budget.oom_kills(),
        }
