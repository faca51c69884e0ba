"""Integer balancing of micro-batches across data-parallel groups of different speeds.

Owns `balance_counts` (the integer program Greyhound's `solve_dp` and Oobleck's
`_distribute_batch` solve with cvxpy / pyomo: counts n_i >= 1 summing to the batch that
minimize the variance of n_i * t_i), `replica_rates` (t_i: a replica's simulated time per
micro-batch when it runs alone) and `balance_simulated` (the planner's: counts that minimize the
slowest replica's *simulated* time, proposed from two simulated points per replica and refined
by timed single moves — pipeline fill and drain are not proportional to the count, which the
variance objective ignores).

[Note: empty replica] `balance_simulated` may give a replica 0 micro-batches (issue 18): its
time is then only its reduction and optimizer step (`idle_s`; after its devices' step lead,
[Note: step lead] in `unbroken.plan.score`), and it gets 0 exactly when its time with one
micro-batch is above what the others reach with that micro-batch too. At least
one replica keeps work (the counts sum to the batch, which is >= 1). An empty replica still
holds a copy of the state: it joins the ordered reduction with no addend and steps
(`unbroken.engine.ordered_plan`), and its devices are watched by a probe micro-batch
(`unbroken.engine.probe`). The baselines' `balance_counts` keeps n >= 1: that is their papers'
program.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from unbroken.plan.layout import Layout
from unbroken.plan.score import Scorer

__all__ = ["balance_counts", "balance_simulated", "idle_s", "replica_rates"]


def _alone(layout: Layout, d: int, count: int) -> Layout:
    return Layout(
        replicas=(layout.replicas[d],), microbatches=(count,), inflight=(layout.inflight[d],)
    )


def idle_s(scorer: Scorer, layout: Layout, d: int) -> float:
    """Replica `d`'s simulated time alone with no micro-batch: per stage its step lead (a
    slow group's longer step of the iteration before, `Scorer.lead`), its gradient reduction
    and its optimizer step ([Note: empty replica])."""
    alone = _alone(layout, d, 1)
    reduce, opt = scorer.reduce_s(alone), scorer.opt_s(alone)
    return max(
        (
            (scorer.lead(g) + reduce.get(s, 0.0)) + opt
            for s, g in enumerate(layout.replicas[d].stages)
        ),
        default=0.0,
    )


def _greedy(
    first: Sequence[float], lines: Sequence[tuple[float, float]], total: int, floor: int
) -> list[int]:
    """Counts n_d >= `floor` summing to `total` that minimize max_d of each replica's time: its
    first micro-batch finishes at `first[d]` (simulated), the n-th after that at a_d + b_d n;
    each micro-batch goes where it finishes earliest ([Note: empty replica])."""
    counts = [floor] * len(lines)
    heap = [
        (t if floor == 0 else a + (floor + 1) * b, d)
        for d, (t, (a, b)) in enumerate(zip(first, lines, strict=True))
    ]
    heapq.heapify(heap)
    for _ in range(total - floor * len(lines)):
        _, d = heapq.heappop(heap)
        counts[d] += 1
        a, b = lines[d]
        heapq.heappush(heap, (a + (counts[d] + 1) * b, d))
    return counts


def balance_simulated(
    scorer: Scorer, layout: Layout, *, steps: int = 8, floor: int = 0
) -> list[int]:
    """Micro-batch counts per replica (summing to the layout's batch) that minimize the slowest
    replica's simulated time alone (module docstring); a count may be 0 ([Note: empty
    replica]).

    Each replica's time is simulated at one micro-batch, at its count and at one less; the line
    through the last two points prices its further micro-batches, the first is priced at its
    simulated time, and each micro-batch goes where it would finish earliest. Then at most
    `steps` single moves, each timed, from the replica the simulator says finishes last to the
    one finishing first (to 0 only when the simulated time with none is shorter).

    `floor`: the fewest micro-batches a replica keeps (1 for an executor that cannot run an
    empty replica, `PlannerConfig.empty_replicas`).
    """
    total = sum(layout.microbatches)
    if layout.dp == 1:
        return [total]
    memo: dict[tuple[int, int], float] = {}

    def time(d: int, n: int) -> float:
        if (d, n) not in memo:
            memo[(d, n)] = (
                idle_s(scorer, layout, d)
                if n == 0
                else scorer.time(_alone(layout, d, n), boundary=False)
            )
        return memo[(d, n)]

    lines = []
    for d, n in enumerate(layout.microbatches):
        hi, lo = max(n, 2), max(n, 2) - 1
        slope = max(time(d, hi) - time(d, lo), 1e-12)
        lines.append((time(d, hi) - slope * hi, slope))
    first = [time(d, 1) if floor == 0 else 0.0 for d in range(layout.dp)]
    counts = _greedy(first, lines, total, floor)
    times = [time(d, n) for d, n in enumerate(counts)]
    for _ in range(steps):
        hi = max(range(len(times)), key=lambda d: (times[d], -d))
        lo = min(range(len(times)), key=lambda d: (times[d], d))
        if hi == lo or counts[hi] <= floor:
            break
        t_hi, t_lo = time(hi, counts[hi] - 1), time(lo, counts[lo] + 1)
        rest = max((t for d, t in enumerate(times) if d not in (hi, lo)), default=0.0)
        if max(t_hi, t_lo, rest) >= times[hi]:
            break
        counts[hi], counts[lo] = counts[hi] - 1, counts[lo] + 1
        times[hi], times[lo] = t_hi, t_lo
    return counts


def replica_rates(scorer: Scorer, layout: Layout) -> list[float]:
    """Per replica, seconds per micro-batch of its pipeline simulated alone with its own
    micro-batches (no migrations)."""
    out = []
    for d in range(layout.dp):
        count = max(layout.microbatches[d], 1)
        out.append(scorer.time(_alone(layout, d, count), boundary=False) / count)
    return out


def balance_counts(rates: Sequence[float], total: int, weights: Sequence[int] = ()) -> list[int]:
    """Integer micro-batch counts n_i >= 1 with sum(w_i n_i) = total that minimize the variance
    of n_i * t_i (Greyhound's `solve_dp`; Oobleck's `_distribute_batch` with w_i instances).

    Args:
        rates: t_i, seconds per micro-batch of each group.
        total: micro-batches to place.
        weights: instances of each group (default 1 each).

    Raises:
        ValueError: fewer micro-batches than groups.
    """
    w = list(weights) or [1] * len(rates)
    if total < sum(w):
        raise ValueError(f"{total} micro-batches cannot give each of {sum(w)} groups one")
    inv = [1.0 / t for t in rates]
    share = [total * x / sum(i * wi for i, wi in zip(inv, w, strict=True)) for x in inv]
    counts = [max(1, int(s)) for s in share]
    while sum(c * wi for c, wi in zip(counts, w, strict=True)) > total:
        i = max(
            (i for i in range(len(counts)) if counts[i] > 1), key=lambda i: counts[i] * rates[i]
        )
        counts[i] -= 1
    while sum(c * wi for c, wi in zip(counts, w, strict=True)) < total:
        fits = [
            i
            for i in range(len(counts))
            if w[i] <= total - sum(c * wi for c, wi in zip(counts, w, strict=True))
        ]
        i = min(fits, key=lambda i: ((counts[i] + 1) * rates[i], i))
        counts[i] += 1
    return _polish(counts, rates, w)


def _polish(counts: list[int], rates: Sequence[float], w: Sequence[int]) -> list[int]:
    """Single moves from the most to the least loaded group of each weight while the variance of
    n_i t_i drops (a move between i and j changes only their two terms)."""
    load = [c * t for c, t in zip(counts, rates, strict=True)]
    for weight in sorted(set(w)):
        members = [i for i in range(len(counts)) if w[i] == weight]
        while len(members) > 1:
            i = max(members, key=lambda k: (load[k], -k))
            j = min(members, key=lambda k: (load[k] + rates[k], k))
            if i == j or counts[i] <= 1:
                break
            mean = sum(load) / len(load)
            before = (load[i] - mean) ** 2 + (load[j] - mean) ** 2
            li, lj = load[i] - rates[i], load[j] + rates[j]
            shift = (rates[j] - rates[i]) / len(load)
            after = (li - mean - shift) ** 2 + (lj - mean - shift) ** 2
            others = sum(
                (load[k] - mean - shift) ** 2 - (load[k] - mean) ** 2
                for k in range(len(load))
                if k not in (i, j)
            )
            if after + others >= before - 1e-12:
                break
            counts[i], counts[j], load[i], load[j] = counts[i] - 1, counts[j] + 1, li, lj
    return counts
