"""Step 3 (ResiHP §6.3, Algorithm 1): progress-aware migration of micro-batch stages across
data-parallel replicas.

Owns the DP half of the planner, in the paper's notation (Table 2). On the simulated timeline
of the current layout (`Scorer.traces`: when every group ran every forward and backward),

    P_{d,i,t} = forwards stage i of replica d has completed by time t (its own micro-batches
                and the ones migrated to it),

and time advances in slots of one forward + backward of a typical stage. At each slot t, for
each stage i: d_min and d_max are the replicas of least and most progress (ties to the lower
index); if P_{d_max,i,t} - P_{d_min,i,t} > delta, j = NextPending(d_min, i) (d_min's next own
micro-batch whose stage-i forward has not started by t; [Interpretation] preferring one whose
neighbouring stage already moved to d_max, so that a micro-batch moves whole rather than
crossing between replicas at every stage) moves its stage i to d_max when
MemoryFeasible(j, i, d_max): the activations alive on d_max's stage i at t (timeline) plus
those of earlier migrations still in flight there, plus j's, fit next to the stage's state.
Then P_{d_min} gains one and P_{d_max} loses one from t on (d_min owes one forward less, d_max
one more). Fail-stop eviction, the paper's other trigger, happens in step 1 (a replica that lost
a stage is dissolved and its micro-batches re-owned), so every stage left here can run.

The pass proposes migrations; the simulator times them ([Note: migration acceptance]) and they
are kept only if the predicted iteration time drops. Passes repeat on the new timeline (up to
`rounds`) while they help. The migrations are plan IR `Migration`s, which the engine runs.
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass

from unbroken.parallel import Migration
from unbroken.plan.balance import balance_simulated
from unbroken.plan.layout import Group, Layout
from unbroken.plan.memory import max_bound
from unbroken.plan.repartition import Improvement
from unbroken.plan.score import GroupTrace, Scorer

__all__ = ["FRACTIONS", "auto_delta", "migrate", "progress_pass", "whole_batch_seed"]


@dataclass(slots=True)
class _Progress:
    """P_{d,i,t} of one stage from the timeline, with the pass's updates."""

    ends: dict[int, list[float]]
    """d -> sorted forward end times."""
    shifts: dict[int, list[tuple[float, int]]]

    def at(self, d: int, t: float) -> int:
        return bisect_right(self.ends[d], t) + sum(n for t0, n in self.shifts[d] if t0 <= t)


class _Pass:
    """One pass of Algorithm 1 over the slots of one timeline."""

    def __init__(self, scorer: Scorer, layout: Layout, traces: dict[Group, GroupTrace]) -> None:
        self.scorer, self.layout, self.traces = scorer, layout, traces
        plan = layout.skeleton
        self.owner = {m: d for d in range(plan.dp) for m in plan.microbatch_ids(d)}
        self.moved = {(m.microbatch, m.stage) for m in layout.migrations}
        self.where = {(m.microbatch, m.stage): m.replica for m in layout.migrations}
        self.progress = {
            i: _Progress(
                {d: sorted(e for _, _, e in traces[(d, i)].forwards) for d in range(plan.dp)},
                defaultdict(list),
            )
            for i in range(layout.pp)
        }
        self.extra: dict[Group, list[tuple[float, float]]] = defaultdict(list)
        self.slot = self._slot()

    def _slot(self) -> float:
        spans = []
        for _, g in self.layout.groups():
            f, b = self.scorer.base_cost(g)
            spans.append((f + b) * self.scorer.slowness(g.ranks))
        return statistics.median(spans)

    def next_pending(self, d: int, i: int, t: float, to: int) -> int | None:
        """d's next own micro-batch whose stage-i forward has not started by t, preferring one
        whose neighbouring stage already runs on `to` (the micro-batch then moves whole
        instead of hopping between replicas twice)."""
        pending = [
            m
            for m, start, _ in self.traces[(d, i)].forwards
            if start > t and self.owner[m] == d and (m, i) not in self.moved
        ]
        for m in pending:
            if self.where.get((m, i - 1)) == to or self.where.get((m, i + 1)) == to:
                return m
        return pending[0] if pending else None

    def memory_feasible(self, d: int, i: int, t: float) -> bool:
        trace = self.traces[(d, i)]
        started = sum(1 for _, a, _ in trace.forwards if a <= t)
        finished = sum(1 for _, _, e in trace.backwards if e <= t)
        extra = sum(1 for a, e in self.extra[(d, i)] if a <= t < e)
        g = self.layout.group(d, i)
        return started - finished + extra + 1 <= max_bound(self.scorer.state, g.ranks, g.layers)

    def step(self, i: int, t: float, delta: int) -> Migration | None:
        progress = self.progress[i]
        p = {d: progress.at(d, t) for d in range(self.layout.dp)}
        d_min = min(p, key=lambda d: (p[d], d))
        layers = self.layout.group(d_min, i).layers
        peers = [d for d in p if self.layout.group(d, i).layers == layers]
        d_max = max(peers, key=lambda d: (p[d], -d))
        if p[d_max] - p[d_min] <= delta:
            return None
        j = self.next_pending(d_min, i, t, d_max)
        if j is None or not self.memory_feasible(d_max, i, t):
            return None
        self.moved.add((j, i))
        self.where[(j, i)] = d_max
        progress.shifts[d_min].append((t, 1))
        progress.shifts[d_max].append((t, -1))
        self.extra[(d_max, i)].append((t, t + (self.layout.pp - i) * self.slot))
        return Migration(j, i, d_max)

    def run(self, delta: int) -> list[Migration]:
        horizon = max((e for tr in self.traces.values() for _, _, e in tr.backwards), default=0.0)
        out, t = [], 0.0
        while t < horizon:
            for i in range(self.layout.pp):
                m = self.step(i, t, delta)
                if m is not None:
                    out.append(m)
            t += self.slot
        return out


def auto_delta(layout: Layout) -> int:
    """The default progress-gap threshold: an eighth of a replica's micro-batches (at least 1).

    [Interpretation] The paper leaves delta a "predefined threshold" (0 in its example). A gap
    of one or two forwards triggers migrations while the pipelines are still filling, which on
    the simulator mostly moves work back and forth; an eighth of the batch worked better on the
    shapes we timed (docs/scheduler.md) and scales with the batch.
    """
    return max(1, sum(layout.microbatches) // (8 * layout.dp))


def progress_pass(scorer: Scorer, layout: Layout, delta: int) -> list[Migration]:
    """One pass of Algorithm 1 on `layout`'s simulated timeline: the new migrations, in the
    order the pass chose them."""
    if layout.dp < 2:
        return []
    return _Pass(scorer, layout, scorer.traces(layout)).run(delta)


FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""Prefixes of a pass's migrations that are timed ([Note: migration acceptance])."""


def whole_batch_seed(scorer: Scorer, layout: Layout, floor: int = 0) -> list[Migration]:
    """Whole micro-batches (every stage) moved from slow replicas to fast ones so that each
    replica's share matches its speed ([Note: migration seed]); none unless every replica has
    the same layer split (a migration needs equal layers at both ends)."""
    if layout.dp < 2 or layout.migrations or not layout.uniform_split:
        return []
    target = balance_simulated(scorer, layout, floor=floor)
    plan = layout.skeleton
    give = []
    for d in range(layout.dp):
        ids = list(plan.microbatch_ids(d))
        give += [(m, d) for m in ids[target[d] :]] if target[d] < len(ids) else []
    takers = [
        d for d in range(layout.dp) for _ in range(max(0, target[d] - layout.microbatches[d]))
    ]
    return [
        Migration(m, s, to)
        for (m, _), to in zip(give, takers, strict=False)
        for s in range(layout.pp)
    ]


def _seed(scorer: Scorer, layout: Layout, ownership: bool, floor: int) -> tuple[Layout | None, int]:
    """The seed as a layout: re-owned micro-batches when ownership may change, else whole
    micro-batch migrations (same timing, [Note: migration seed])."""
    if ownership:
        if layout.dp < 2 or layout.migrations:
            return None, 0
        counts = tuple(balance_simulated(scorer, layout, floor=floor))
        if counts == layout.microbatches:
            return None, 0
        moved = sum(abs(a - b) for a, b in zip(counts, layout.microbatches, strict=True)) // 2
        return Layout(
            replicas=layout.replicas, microbatches=counts, inflight=layout.inflight
        ), moved * layout.pp
    seed = whole_batch_seed(scorer, layout, floor)
    return (layout.with_migrations(seed), len(seed)) if seed else (None, 0)


def migrate(
    scorer: Scorer,
    layout: Layout,
    time: float,
    *,
    delta: int | None = None,
    rounds: int = 3,
    ownership: bool = True,
    floor: int = 0,
) -> Improvement:
    """Algorithm 1 passes while they shorten the predicted iteration (module docstring).

    [Note: migration seed] [Extension] Before the passes, whole micro-batches are moved (all
    their stages, so with no replica hopping) from slower to faster replicas until each
    replica's share matches its simulated speed alone (`balance.balance_simulated`: the integer
    balance Greyhound and Oobleck solve, then refined by simulating each replica); the seed is
    kept only if the simulator predicts it faster. Algorithm 1's stage-level passes then refine from there. A whole-micro-batch move
    is a point of the paper's formulation (x for every stage of j) that the stage-by-stage
    heuristic reaches only slowly, because it weighs each stage on its own.

    [Note: migration acceptance] The paper simulates each migration before finalizing it. Here a
    pass proposes its migrations in the order it chose them, and the simulator times the first
    quarter, half, three quarters and all of them; the best prefix is kept if it beats the
    layout without them, and the next pass starts from the timeline of what was kept.
    `floor`: fewest micro-batches the seed leaves a replica ([Note: empty replica])."""
    delta = auto_delta(layout) if delta is None else delta
    best, evaluated, added = layout, 0, 0
    notes: list[str] = []
    candidate, seeded = _seed(scorer, layout, ownership, floor)
    if candidate is not None:
        evaluated += 1
        t = scorer.time(candidate, bound=time)
        if t < time * (1 - 1e-9):
            best, time = candidate, t
            if candidate.microbatches != layout.microbatches:
                notes.append(
                    f"micro-batches re-owned by replica speed: {list(layout.microbatches)} -> "
                    f"{list(candidate.microbatches)}"
                )
            else:
                added = seeded
    for _ in range(rounds):
        new = progress_pass(scorer, best, delta)
        if not new:
            break
        options = []
        for k in sorted({max(1, round(len(new) * f)) for f in FRACTIONS}):
            candidate = best.with_migrations(best.migrations + tuple(new[:k]))
            evaluated += 1
            options.append((scorer.time(candidate, bound=time), k, candidate))
        t, k, candidate = min(options, key=lambda o: (o[0], o[1]))
        if t >= time * (1 - 1e-9):
            break
        best, time, added = candidate, t, added + k
    if added:
        moved: dict[tuple[int, int], int] = defaultdict(int)
        for m in best.migrations:
            moved[(m.stage, m.replica)] += 1
        where = ", ".join(f"stage {s} -> replica {d}: {n}" for (s, d), n in sorted(moved.items()))
        notes.append(f"delta {delta}: {added} micro-batch stages migrated ({where})")
    return Improvement(best, time, tuple(notes), evaluated)
