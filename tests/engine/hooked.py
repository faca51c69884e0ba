"""Run a plan on local gloo ranks with phase hooks and a fault injector, and return what each
rank's hooks saw.

`run_hooked(job, tmp)` forks `job.plan`'s ranks from a preloaded fork server (FileStore
rendezvous in `tmp`; the server also pays torch's first meta-device init once, `_warm`),
builds each rank's `PlanWorker` with its hooks — a recorder, then the `Injector` with
`job.faults` (its own in-memory store, so a fault fires once per rank) — runs
`job.iterations` iterations and returns per rank a `RankRecord`: the hook calls, the stalls
the injector asked for, the injector's events and the worker's `StageTiming` per iteration.

A rank in `job.slow_peer` also sleeps that many seconds at each of its FORWARD hooks: a slow
neighbour that the others wait for in their p2p batches (the waits a compute fault must not
stretch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.engine.harness import gloo_rank, spawn_ranks
from unbroken.config import JobConfig
from unbroken.jobstore import JobStore
from unbroken.parallel import ParallelPlan


@dataclass(frozen=True)
class HookedJob:
    plan: ParallelPlan
    cfg: JobConfig
    iterations: int
    faults: tuple[str, ...] = ()
    real_stalls: bool = False
    """Whether the injector really sleeps (else it only records what it would sleep)."""
    slow_peer: dict[int, float] = field(default_factory=dict)
    """rank -> seconds slept at each of its FORWARD hooks."""


@dataclass
class RankRecord:
    calls: list[tuple[str, int, int, int]]
    """(phase, iteration, step, n_steps) of every hook call."""
    stalls: list[tuple[int, str, float]]
    """(iteration being run, "hook" or "transfer", seconds) of every injector stall."""
    events: list[tuple[str, dict]]
    timings: list[dict]
    """`StageTiming.to_dict()` of every iteration."""


def _rank_main(rank: int, world_size: int, store_path: str, job: HookedJob, out: str) -> None:
    import torch.distributed as dist

    from unbroken.engine.build import build_worker
    from unbroken.inject import Injector, parse_fault
    from unbroken.train.phases import Phase

    rec = RankRecord([], [], [], [])
    running = [0]
    where = ["hook"]

    def stall(seconds: float) -> None:
        rec.stalls.append((running[0], where[0], seconds))
        if job.real_stalls:
            time.sleep(seconds)

    class RecordingInjector(Injector):
        def after_transfer(self, iteration: int, seconds: float, sent: bool) -> None:
            where[0] = "transfer"
            try:
                super().after_transfer(iteration, seconds, sent)
            finally:
                where[0] = "hook"

    def record(phase, iteration: int, step: int, n_steps: int) -> None:
        rec.calls.append((str(phase), iteration, step, n_steps))

    def slow_peer(phase, iteration: int, step: int, n_steps: int) -> None:
        if phase is Phase.FORWARD and rank in job.slow_peer:
            time.sleep(job.slow_peer[rank])  # load on this rank, not synchronization

    injector = RecordingInjector(
        [parse_fault(f) for f in job.faults],
        rank,
        JobStore(dist.HashStore()),
        lambda kind, **fields: rec.events.append((kind, fields)),
        0.0,
        sleep=stall,
    )
    with gloo_rank(rank, world_size, store_path, out, rec) as world:
        er = build_worker(
            job.cfg,
            job.plan,
            world,
            device=torch.device("cpu"),
            hooks=[record, injector, slow_peer],
        )
        for it in range(job.iterations):
            running[0] = it
            er.worker.run_iteration(it)
            rec.timings.append(er.worker.timing.to_dict())


def run_hooked(job: HookedJob, tmp: Path) -> dict[int, RankRecord]:
    """Run `job` on as many gloo ranks as its plan has; records by rank."""
    preload = ["unbroken.engine.build", "unbroken.inject", "tests.engine._warm", __name__]
    world_size = max(job.plan.ranks) + 1
    return dict(enumerate(spawn_ranks(_rank_main, job, world_size, tmp, preload, "plan ranks")))


__all__ = ["HookedJob", "RankRecord", "run_hooked"]
