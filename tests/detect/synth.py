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
) -> list[Observation]:
    """Iterations of `world` replicas x `microbatches` micro-batches; rank `slow_rank` runs
    `factor` x slower from `slow_iter` on. `pieces(it, rng)` gives the documents per
    micro-batch (default: mostly one, sometimes several)."""
    rng = np.random.default_rng(seed)
    out = []
    for it in range(iterations):
        lengths, ranks, totals = [], {}, []
        for r in range(world):
            k = pieces(it, rng) if pieces else int(rng.choice([1, 1, 1, 1, 1, 1, 2]))
            docs = [split(rng, k) for _ in range(microbatches)]
            f = factor if slow_rank == r and slow_iter is not None and it >= slow_iter else 1.0
            times = [mb_time(d) * f * (1 + noise * rng.standard_normal()) for d in docs]
            lengths.append(docs)
            totals.append(sum(times))
            ranks[r] = RankTiming(
                rank=r,
                iteration=it,
                mb_s=tuple(times[:-1]),
                forward_s=tuple(t / 3 for t in times),
                compute_s=sum(times[:-1]),
                reduce_s=times[-1],
            )
        seconds = (max(totals) + sync_s) * (1 + noise * rng.standard_normal())
        out.append(Observation(iteration=it, seconds=seconds, doc_lengths=lengths, ranks=ranks))
    return out
