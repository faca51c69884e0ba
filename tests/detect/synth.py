"""Synthetic data-parallel timing series with a known workload model (no real jobs)."""

from __future__ import annotations

import numpy as np

from unbroken.detect.detector import Observation
from unbroken.detect.timing import RankTiming

N = 2048
ALPHA = 2e-5
BETA = 2e-8


def mb_time(lengths: tuple[int, ...]) -> float:
    return ALPHA * sum(lengths) + BETA * sum(x * x for x in lengths)


def split(rng: np.random.Generator, pieces: int) -> tuple[int, ...]:
    """N tokens cut into `pieces` documents at random points."""
    if pieces == 1:
        return (N,)
    cuts = np.sort(rng.choice(np.arange(64, N - 64), pieces - 1, replace=False))
    return tuple(int(x) for x in np.diff(np.r_[0, cuts, N]))


def series(
    *,
    iterations: int = 60,
    world: int = 2,
    microbatches: int = 3,
    noise: float = 0.01,
    seed: int = 0,
    pieces=None,
    slow_rank: int | None = None,
    slow_iter: int | None = None,
    factor: float = 1.0,
    sync_s: float = 0.01,
    comm_s: float = 0.002,
    slow_what: str = "compute",
    slow_until: int | None = None,
) -> list[Observation]:
    """Iterations of `world` replicas x `microbatches` micro-batches; rank `slow_rank` runs
    `factor` x slower from `slow_iter` on. `pieces(it, rng)` gives the documents per
    micro-batch (default: mostly one, sometimes several).

    Every rank's all-reduce (`comm_s`) lasts `comm_s` plus its wait for the last arrival.
    `slow_what`: "compute" stretches the slow rank's micro-batches; "comm" its all-reduce
    (`factor` x `comm_s`; its peers then wait in the sync phase, outside `comm_s`, as with
    the `slow ... what=comm` fault); "link" every rank's all-reduce alike (a slow link in a
    ring, `slow_rank` only says when). `slow_until`: healthy again from that iteration."""
    rng = np.random.default_rng(seed)
    out = []
    for it in range(iterations):
        lengths, ranks, totals = [], {}, []
        for r in range(world):
            k = pieces(it, rng) if pieces else int(rng.choice([1, 1, 1, 1, 1, 1, 2]))
            docs = [split(rng, k) for _ in range(microbatches)]
            slowed = slow_iter is not None and slow_iter <= it < (slow_until or iterations)
            f = factor if slowed and slow_rank == r and slow_what == "compute" else 1.0
            times = [mb_time(d) * f * (1 + noise * rng.standard_normal()) for d in docs]
            lengths.append(docs)
            totals.append(sum(times))
            ranks[r] = times
        active = slow_iter is not None and slow_iter <= it < (slow_until or iterations)
        stall = (factor - 1.0) * comm_s if active else 0.0
        stall = stall if slow_what in ("comm", "link") else 0.0
        for r, times in list(ranks.items()):
            own = stall if slow_what == "link" or (slow_what == "comm" and r == slow_rank) else 0
            comm = max(totals) - totals[r] + comm_s * (1 + noise * rng.standard_normal()) + own
            ranks[r] = RankTiming(
                rank=r,
                iteration=it,
                mb_s=tuple(times),
                forward_s=tuple(t / 3 for t in times),
                compute_s=sum(times[:-1]),
                reduce_s=times[-1] + comm,
                comm_s=comm,
            )
        seconds = (max(totals) + comm_s + stall + sync_s) * (1 + noise * rng.standard_normal())
        out.append(Observation(iteration=it, seconds=seconds, doc_lengths=lengths, ranks=ranks))
    return out
