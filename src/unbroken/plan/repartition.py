"""Step 2 (ResiHP §6.2): layer repartition and schedule reordering, chosen by the simulator.

Owns the pipeline half of the planner.

*Repartition.* A straggling stage (after step 1: a shrunken or slow TP group) gets fewer layers
and the others more. The split stays the same in every replica (as in the paper: migrations
need equal layer ranges on both ends, and the IR's replicas then keep one model layout). The
search is greedy and every candidate is *timed* (`unbroken.plan.score`), never guessed: the
split proportional to the stages' speeds is only the first candidate; then take
the stage with the largest per-micro-batch load (its layers on its slowest group), move one
layer to the least loaded stage (or the next least loaded) if every group there can hold it
(`unbroken.plan.memory`), keep the move if the predicted iteration time drops, stop when no
move helps. This is Figure 5's (4, 4, 4) -> (5, 2, 5) reached one layer at a time.

*Per-replica repartition* [Extension]. The paper notes that one split for every replica "limits
flexibility". As a second candidate, every replica gets its own split (the same greedy search on
that replica simulated alone; equal replicas searched once) and the micro-batches are then
re-owned to match the replicas' new speeds (`balance.balance_simulated`). The simulator keeps
whichever of the two candidates is faster. Step 3 then migrates only between replicas whose
layer ranges agree at the migrated stage, as the plan IR requires.

*Reordering* (§6.2: "reorders workload execution to efficiently overlap communication and
computation"). A message over a slow link stalls the stage that waits for it; letting the
stages upstream of that link keep more micro-batches in flight (a deeper 1F1B warm-up) gives
the link time to deliver while they compute. Per replica whose slowest inter-stage message
takes much longer than the job's typical one, the in-flight bound of every stage up to that
link grows by one while memory allows and the predicted time drops. The Adaptra baseline
(`unbroken.plan.baselines`) adapts the same bound; here it is one step of three.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from unbroken.parallel import split_layers
from unbroken.plan.balance import balance_simulated
from unbroken.plan.layout import Layout
from unbroken.plan.memory import fits
from unbroken.plan.score import Scorer

__all__ = ["Improvement", "deepen_inflight", "repartition", "repartition_each", "stage_loads"]

SLOW_LINK = 1.5
"""A boundary is worth reordering around when its message takes this many times the job's
median message (otherwise there is no delay to absorb)."""


@dataclass(frozen=True, slots=True)
class Improvement:
    """What a search step kept."""

    layout: Layout
    time: float
    notes: tuple[str, ...]
    evaluated: int
    """Candidates timed."""


def stage_loads(scorer: Scorer, layout: Layout) -> list[float]:
    """Per stage, the slowest replica's forward + backward of one micro-batch there."""
    loads = []
    for s in range(layout.pp):
        worst = 0.0
        for d in range(layout.dp):
            g = layout.group(d, s)
            f, b = scorer.base_cost(g)
            worst = max(worst, (f + b) * scorer.slowness(g.ranks))
        loads.append(worst)
    return loads


def _moved(split: list[int], src: int, dst: int) -> list[int]:
    out = list(split)
    out[src] -= 1
    out[dst] += 1
    return out


def _proportional(scorer: Scorer, layout: Layout) -> list[int]:
    """Layers per stage in proportion to each stage's speed per layer (slowest replica)."""
    per_layer = []
    for s in range(layout.pp):
        worst = 0.0
        for d in range(layout.dp):
            g = layout.group(d, s)
            n = g.layers[1] - g.layers[0]
            f, b = scorer.base_cost(g)
            worst = max(worst, (f + b) * scorer.slowness(g.ranks) / n)
        per_layer.append(worst)
    return list(split_layers(layout.num_layers, layout.pp, [1.0 / t for t in per_layer]))


def repartition(scorer: Scorer, layout: Layout, time: float, *, budget: int = 64) -> Improvement:
    """The greedy layer repartition of the module docstring (at most `budget` candidates).

    The first candidate is the split proportional to the stages' speeds; it is kept only if
    the simulator says it is faster, and the single-layer moves start from whichever is best.
    """
    if not layout.uniform_split or layout.pp == 1:
        return Improvement(layout, time, (), 0)
    state = scorer.state
    split, best, evaluated = list(layout.split(0)), layout, 0
    start_split = tuple(split)
    guess = _proportional(scorer, layout)
    if guess != split and fits(state, layout.with_split(guess)):
        evaluated += 1
        t = scorer.time(layout.with_split(guess), bound=time)
        if t < time * (1 - 1e-9):
            best, time, split = layout.with_split(guess), t, guess
    while evaluated < budget:
        loads = stage_loads(scorer, best)
        src = max(range(len(split)), key=lambda s: (loads[s], -s))
        if split[src] <= 1:
            break
        kept = False
        for dst in sorted((s for s in range(len(split)) if s != src), key=lambda s: loads[s])[:2]:
            candidate = best.with_split(_moved(split, src, dst))
            if not fits(state, candidate):
                continue
            evaluated += 1
            t = scorer.time(candidate, bound=time)
            if t < time * (1 - 1e-9):
                best, time, split, kept = candidate, t, _moved(split, src, dst), True
                break
        if not kept:
            break
    notes = ()
    if tuple(split) != start_split:
        notes = (f"layers per stage {list(start_split)} -> {split}",)
    return Improvement(best, time, notes, evaluated)


def _signature(scorer: Scorer, layout: Layout, d: int) -> tuple:
    """What the search on replica d alone depends on (equal replicas are searched once)."""
    stages = layout.replicas[d].stages
    parts = []
    for s, g in enumerate(stages):
        nxt = scorer.message_s(g.ranks, stages[s + 1].ranks) if s + 1 < len(stages) else 0.0
        back = scorer.message_s(stages[s + 1].ranks, g.ranks) if s + 1 < len(stages) else 0.0
        parts.append((g.layers, scorer.base_cost(g), scorer.slowness(g.ranks), nxt, back))
    return (tuple(parts), layout.microbatches[d], layout.inflight[d])


def _affected(scorer: Scorer, layout: Layout, d: int) -> bool:
    """A replica with a slowed group, a slow link, or a narrower group than its peers."""
    for s, g in enumerate(layout.replicas[d].stages):
        widest = max(rep.stages[s].tp for rep in layout.replicas)
        slow_link = any(scorer.state.device(r).link_speed < 1 for r in g.ranks)
        if scorer.slowness(g.ranks) > 1 or slow_link or g.tp < widest:
            return True
    return False


def repartition_each(
    scorer: Scorer, layout: Layout, time: float, *, budget: int = 64, floor: int = 0
) -> Improvement:
    """The per-replica repartition of the module docstring, with re-owned micro-batches: each
    affected replica (a slowed or narrowed group, a slow link) of `layout` gets its own split,
    the others keep theirs. `floor`: fewest micro-batches a replica keeps (0: [Note: empty
    replica] in `unbroken.plan.balance`)."""
    if layout.dp == 1 or layout.pp == 1:
        return Improvement(layout, time, (), 0)
    found: dict[tuple, tuple[int, ...]] = {}
    evaluated, replicas = 0, []
    for d in range(layout.dp):
        alone = Layout(
            replicas=(layout.replicas[d],),
            microbatches=(max(layout.microbatches[d], 1),),  # an empty one: split for one
            inflight=(layout.inflight[d],),
        )
        if not _affected(scorer, layout, d):
            replicas.append(layout.replicas[d])
            continue
        key = _signature(scorer, layout, d)
        if key not in found:
            imp = repartition(scorer, alone, scorer.time(alone), budget=budget)
            evaluated += imp.evaluated + 1
            found[key] = imp.layout.split(0)
        replicas.append(alone.with_split(found[key]).replicas[0])
    split = Layout(
        replicas=tuple(replicas), microbatches=layout.microbatches, inflight=layout.inflight
    )
    counts = tuple(balance_simulated(scorer, split, floor=floor))
    candidate = Layout(replicas=split.replicas, microbatches=counts, inflight=layout.inflight)
    evaluated += 1
    t = scorer.time(candidate, bound=time)
    if t >= time * (1 - 1e-9) or not fits(scorer.state, candidate):
        return Improvement(layout, time, (), evaluated)
    changed = [d for d in range(layout.dp) if candidate.split(d) != layout.split(d)]
    notes = (
        *(
            f"replica {d}: layers per stage {list(layout.split(d))} -> {list(candidate.split(d))}"
            for d in changed
        ),
        f"micro-batches per replica {list(layout.microbatches)} -> {list(counts)}",
    )
    return Improvement(candidate, t, notes, evaluated)


def _slow_boundary(scorer: Scorer, layout: Layout, d: int, typical: float) -> int | None:
    """The boundary (after stage b) of replica d whose message is slowest, if it is slow."""
    link = scorer.group_link(layout)
    worst, where = 0.0, None
    for b in range(layout.pp - 1):
        t = max(link((d, b), (d, b + 1)), link((d, b + 1), (d, b)))
        if t > worst:
            worst, where = t, b
    return where if worst > SLOW_LINK * typical else None


def _slow_stage_boundary(scorer: Scorer, layout: Layout, d: int) -> int | None:
    """The boundary just before replica d's slowest stage, if that stage is slowed."""
    slow = [scorer.slowness(layout.group(d, s).ranks) for s in range(layout.pp)]
    s = max(range(layout.pp), key=lambda k: (slow[k], -k))
    return s - 1 if slow[s] > 1 and s > 0 else None


def _typical_message(scorer: Scorer, layout: Layout) -> float:
    link = scorer.group_link(layout)
    times = [link((d, b), (d, b + 1)) for d in range(layout.dp) for b in range(layout.pp - 1)]
    return statistics.median(times) if times else 0.0


def deepen_inflight(
    scorer: Scorer,
    layout: Layout,
    time: float,
    *,
    budget: int = 32,
    slow_stages: bool = False,
) -> Improvement:
    """Reordering around slow links (module docstring), at most `budget` candidates.

    Args:
        scorer: times candidates.
        layout: the starting layout.
        time: its predicted iteration time.
        budget: most candidates timed.
        slow_stages: also treat the boundary before a replica's slowed stage as a delay to
            absorb (the Adaptra baseline does; ResiHP's steps 1-2 handle slow stages).
    """
    if layout.pp == 1:
        return Improvement(layout, time, (), 0)
    typical = _typical_message(scorer, layout)
    best, evaluated, notes = layout, 0, []
    targets = []
    for d in range(layout.dp):
        targets.append((d, _slow_boundary(scorer, layout, d, typical)))
        if slow_stages:
            targets.append((d, _slow_stage_boundary(scorer, layout, d)))
    for d, b in targets:
        if b is None:
            continue
        while evaluated < budget:
            bounds = [list(row) for row in best.inflight]
            for s in range(b + 1):
                bounds[d][s] += 1
            candidate = best.with_inflight(bounds)
            if not fits(scorer.state, candidate):
                break
            evaluated += 1
            t = scorer.time(candidate, bound=time)
            if t >= time * (1 - 1e-9):
                break
            best, time = candidate, t
        if best.inflight[d] != layout.inflight[d]:
            notes.append(
                f"replica {d}: in-flight bounds {list(layout.inflight[d])} -> "
                f"{list(best.inflight[d])} to absorb the delay after stage {b}"
            )
    return Improvement(best, time, tuple(notes), evaluated)
