"""How far shadows pre-initialize under a memory budget (Leto §6), as a pure state machine.

States: the level cap of the current generation, lowered by reclamations and reset at each
recovery. Inputs: measured per-shadow footprints by level, the job's active (non-shadow) memory.

- After a reclamation, shadows are relaunched at the most advanced level that fits the
  remaining headroom, never above the cap; a second or later reclamation in the same
  generation lowers the cap by at least one more level (repeated pressure), so the controller
  does not rebuild and reclaim the same state in a loop. Level 0 means no shadows.
- At a recovery (a new generation), the level is raised again — up to the configured one —
  as far as the observed peak active memory leaves room for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LevelPolicy"]


@dataclass(slots=True)
class LevelPolicy:
    configured: int
    """recovery.shadow_level: the most advanced level ever used."""
    budget: int
    """The job's memory budget on this node, bytes."""
    margin: float = 0.05
    """Share of the budget kept free when judging whether a level fits."""
    footprint: dict[int, int] = field(default_factory=dict)
    """Level -> the largest per-shadow footprint measured at that level, bytes."""
    cap: int = -1
    reclaims: int = 0
    """Reclamations in the current generation."""

    def __post_init__(self) -> None:
        if self.cap < 0:
            self.cap = self.configured

    def record_footprint(self, level: int, nbytes: int) -> None:
        self.footprint[level] = max(nbytes, self.footprint.get(level, 0))

    def estimate(self, level: int) -> int | None:
        """Per-shadow bytes at `level`: measured, else the nearest measured higher level
        (deeper levels hold more), else None (unknown)."""
        for lv in range(level, 4):
            if lv in self.footprint:
                return self.footprint[lv]
        return None

    def fits(self, level: int, active: int, shadows: int) -> bool:
        if level == 0:
            return True
        per = self.estimate(level)
        if per is None:
            return True  # nothing measured yet: try it (a reclamation measures the truth)
        return active + shadows * per <= self.budget * (1.0 - self.margin)

    def _best(self, ceiling: int, active: int, shadows: int) -> int:
        for level in range(max(0, ceiling), 0, -1):
            if self.fits(level, active, shadows):
                return level
        return 0

    def after_reclaim(self, active: int, shadows: int) -> int:
        """The level to relaunch at after a reclamation; `active` = memory in use without
        shadows, right after they were reclaimed."""
        self.reclaims += 1
        ceiling = self.cap if self.reclaims == 1 else self.cap - 1
        self.cap = self._best(ceiling, active, shadows)
        return self.cap

    def at_recovery(self, peak_active: int | None, shadows: int) -> int:
        """The level for the next generation's shadows, from the peak active memory seen."""
        self.reclaims = 0
        if peak_active is None:
            self.cap = self.configured
        else:
            self.cap = self._best(self.configured, peak_active, shadows)
        return self.cap
