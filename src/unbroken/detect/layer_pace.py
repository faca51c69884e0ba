"""A one-replica pipeline rank's healthy pace, whatever layers a re-plan left it.

A rank reported slow is at full speed again when it runs at the pace of the ranks that hold
its stages in the other replicas (`unbroken.detect.pipeline.PlanFit.pace`). A one-replica
pipeline has no such ranks, and a re-plan may have moved layers off the slow rank, so it is
measured against itself: its compute on healthy iterations before the slowdown, priced by the
scheduler's model of a stage (its layers) and the fitted workload model (T_MB per micro-batch).

Cost of a rank's compute over a window (each action: a virtual stage's F, B or W of one
micro-batch):

    seconds = c x actions + b_rank x units,    units = sum over actions of layers x T_MB(m)

c is a fixed cost per action that does not scale with the layers (inputs, the micro-batch's
mask, Python around the stage; measured on the 2-core VM at about one 128-wide layer's worth:
F 6.5 ms with two layers, 4.3 ms with one), b_rank the rank's seconds per unit. With c taken
as 0 (every second proportional to layers) a rank left with fewer layers looks slower per
layer than it is, and a device back at full speed was found back in 2 runs of 5.

c is estimated from a healthy reference: another rank of the pipeline, never reported, whose
actions the re-plan changed (its units per action differ by at least `MIN_CHANGE`): its two
windows (healthy before the slowdown, now) are two equations in c and its own b. The slow
rank's b is then its healthy window's seconds less c per action, over its units. When no
rank qualifies (no layers moved, or a fit that is not positive) c is 0, as before.

The reference's c includes what only its stage pays (the last stage's head and loss), so
against the first stage c is overestimated, and the estimate errs toward finding the rank back
a little early (the arithmetic in docs/architecture.md); a return found too early costs one
planned stop each way, bounded by `adapt.max_replans`.

Never reads clocks, never talks to ranks; only models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from unbroken.detect.pipeline import by_microbatch
from unbroken.detect.timing import StageTiming
from unbroken.detect.workload import DocLengths, MicroBatchModel
from unbroken.parallel import ParallelPlan

__all__ = ["MIN_CHANGE", "LayerPace", "Work"]

Window = Sequence[tuple[Sequence[Sequence[DocLengths]], Mapping[int, StageTiming]]]

MIN_CHANGE = 0.15
"""A reference rank's units per action must differ by this fraction between its two windows
for the two equations to separate c from b (less: the fixed cost is not estimated)."""


@dataclass(frozen=True, slots=True)
class Work:
    """One rank's compute over a window: seconds, actions, units (layers x T_MB)."""

    seconds: float
    actions: int
    units: float

    @classmethod
    def of(cls, plan: ParallelPlan, mb: MicroBatchModel, window: Window, rank: int) -> Work:
        seconds = units = 0.0
        actions = 0
        for lengths, stages in window:
            timing = stages.get(rank)
            if timing is None:
                continue
            docs = by_microbatch(plan, lengths)
            for _, k, m, took in timing.compute:
                if m not in docs:
                    continue
                lo, hi = plan.replicas[plan.executor(m, k)].stages[k].layers
                seconds += took
                units += (hi - lo) * mb.predict(docs[m])
                actions += 1
        return cls(seconds, actions, units)

    @property
    def per_action(self) -> float:
        return self.units / self.actions


def fixed_cost(before: Work, now: Work) -> float | None:
    """c from one healthy rank's two windows, or None when they do not separate it."""
    if min(before.actions, now.actions) == 0 or min(before.units, now.units) <= 0:
        return None
    u0, u1 = before.per_action, now.per_action
    if abs(u1 - u0) < MIN_CHANGE * max(u0, u1):
        return None
    det = before.actions * now.units - now.actions * before.units
    c = (before.seconds * now.units - now.seconds * before.units) / det
    b = (before.actions * now.seconds - now.actions * before.seconds) / det
    return c if c >= 0 and b > 0 else None


@dataclass(frozen=True, slots=True)
class LayerPace:
    """A rank's healthy compute, measured before it slowed down: what it is held to when no
    other replica holds its stages (module notes)."""

    mb: MicroBatchModel
    """The workload model of the healthy fit (T_MB)."""
    own: Work
    """The rank's compute on the healthy iterations."""
    others: Mapping[int, Work]
    """Every other rank's compute on the same iterations (the fixed cost's references)."""

    @property
    def seconds(self) -> float:
        """Compute seconds per unit of work on the healthy iterations (c taken as 0)."""
        return self.own.seconds / self.own.units

    @classmethod
    def measure(
        cls, plan: ParallelPlan, mb: MicroBatchModel, window: Window, rank: int
    ) -> LayerPace | None:
        """`rank`'s pace over the healthy `window` of `plan`; None if it computed nothing."""
        own = Work.of(plan, mb, window, rank)
        if own.units <= 0:
            return None
        ranks = {r for _, stages in window for r in stages if r != rank}
        others = {r: Work.of(plan, mb, window, r) for r in sorted(ranks)}
        return cls(mb=mb, own=own, others=others)

    def fixed_cost(self, plan: ParallelPlan, window: Window, exclude: set[int]) -> float:
        """c from the reference whose units per action changed most (0 without one)."""
        best: tuple[float, float] | None = None
        for r, before in self.others.items():
            if r in exclude:
                continue
            now = Work.of(plan, self.mb, window, r)
            c = fixed_cost(before, now)
            if c is not None:
                change = abs(now.per_action - before.per_action) / before.per_action
                if best is None or change > best[0]:
                    best = (change, c)
        return 0.0 if best is None else best[1]

    def ratio(
        self, plan: ParallelPlan, window: Window, rank: int, exclude: set[int] | None = None
    ) -> float | None:
        """`rank`'s compute over `window` of `plan` (the running plan, which may hold other
        layers than the one measured) over what its healthy pace predicts for it: 1.0 is
        healthy. `exclude`: ranks that are no reference (reported slow themselves). None if
        it computed nothing."""
        now = Work.of(plan, self.mb, window, rank)
        if now.units <= 0 or self.own.units <= 0:
            return None
        c = self.fixed_cost(plan, window, (exclude or set()) | {rank})
        b = (self.own.seconds - c * self.own.actions) / self.own.units
        if b <= 0:  # the reference's fixed cost exceeds this rank's whole action: not usable
            c, b = 0.0, self.seconds
        return now.seconds / (c * now.actions + b * now.units)
