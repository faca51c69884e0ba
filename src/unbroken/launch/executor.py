"""What runs a rank's iterations, built once: data-parallel training (`unbroken.train.Trainer`)
or one rank of a hybrid-parallel plan (`unbroken.engine.PlanWorker`), behind one `Executor`
protocol.

`build_executor` is the one place a trainer process decides between the two (`job_plan`: a
plan when `parallel.tp`/`pp` > 1); everything after it — restore, the loop, checkpoints, the
state hash, the fail-slow timings — asks the executor instead of the config.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from unbroken.config import JobConfig
from unbroken.train import IterationResult, PhaseHook, TrainState
from unbroken.train.tail import Updater
from unbroken.update import PlainUpdater, StateGeometry

__all__ = ["DataParallelExecutor", "Executor", "PlanExecutor", "build_executor"]


class Executor(Protocol):
    """One rank's iterations over its flat state."""

    state: TrainState
    geometry: StateGeometry
    updater: Updater
    reinit: Callable[[], None] | None
    """Fresh initial parameters in this rank's buffers when it cannot initialize them the
    data-parallel way (an engine rank's shard of the full model), else None."""
    checkpoint_shard: str
    """Per-rank checkpoint key prefix when ranks hold different state ("" when replicated)."""
    collective_hash: bool
    """`state_hash` is a collective (every rank must call it at the same iterations)."""

    def hook(self, phase: Any, iteration: int, step: int = 0, n_steps: int = 1) -> None:
        """Call the rank's phase hooks (restore finishes an update through them)."""

    def run_iteration(self, iteration: int) -> IterationResult: ...

    def timing_record(self, iteration: int, result: IterationResult) -> dict[str, Any] | None:
        """This rank's compute timings and workload of `iteration` for the fail-slow watch
        (`timings.jsonl`), or None when it has none."""

    def state_hash(self) -> str:
        """The job's model state hash (collective for plans: every rank calls it)."""


def _make_updater(retained, cfg: JobConfig):
    """`(state, geometry, step) -> updater`: the resumable updater over the retained regions
    (in-place recovery), else the plain one."""

    def make(state, geometry, step) -> Updater:
        if retained is None:
            return PlainUpdater(state, geometry, step)
        from unbroken.update.rmu import ResumableUpdater

        return ResumableUpdater(state, geometry, step, retained.tensors(), cfg.protection)

    return make


@dataclass(slots=True)
class DataParallelExecutor:
    """A data-parallel replica: the whole model, `Trainer` over its shard of the data."""

    trainer: Any
    timer: Any
    state: TrainState
    geometry: StateGeometry
    updater: Updater
    reinit: Callable[[], None] | None = None
    checkpoint_shard: str = ""
    collective_hash: bool = False

    def hook(self, phase: Any, iteration: int, step: int = 0, n_steps: int = 1) -> None:
        self.trainer._hook(phase, iteration, step, n_steps)

    def run_iteration(self, iteration: int) -> IterationResult:
        return self.trainer.run_iteration(iteration)

    def timing_record(self, iteration: int, result: IterationResult) -> dict[str, Any] | None:
        self.timer.flush()
        records = self.timer.records
        if not records or records[-1].iteration != iteration:
            return None
        return {
            **records[-1].to_dict(),
            "doc_lengths": [list(x) for x in result.doc_lengths],
        }

    def state_hash(self) -> str:
        return self.state.state_hash()  # every replica holds all of it


@dataclass(slots=True)
class PlanExecutor:
    """One rank of a hybrid-parallel plan (`unbroken.engine`): its stage, its TP shard."""

    worker: Any
    group: dist.ProcessGroup
    state: TrainState
    geometry: StateGeometry
    updater: Updater
    reinit: Callable[[], None] | None
    checkpoint_shard: str
    collective_hash: bool = True

    def hook(self, phase: Any, iteration: int, step: int = 0, n_steps: int = 1) -> None:
        self.worker._hook(phase, iteration, step, n_steps)

    def run_iteration(self, iteration: int) -> IterationResult:
        return self.worker.run_iteration(iteration)

    def timing_record(self, iteration: int, result: IterationResult) -> dict[str, Any] | None:
        timing = self.worker.timing
        if timing is None or timing.iteration != iteration:
            return None
        return {
            **timing.to_dict(),
            "microbatches": list(result.microbatches),
            "doc_lengths": [list(x) for x in result.doc_lengths],
        }

    def state_hash(self) -> str:
        """A hash over every rank's shard hash in rank order (collective)."""
        hashes: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(hashes, self.state.state_hash(), group=self.group)
        return hashlib.sha256("".join(map(str, hashes)).encode()).hexdigest()[:16]


def build_executor(
    cfg: JobConfig,
    *,
    rank: int,
    group: dist.ProcessGroup,
    device: torch.device,
    retained,
    hooks: Sequence[PhaseHook],
    autocast: torch.dtype | None,
    search: Sequence[str] = (),
) -> Executor:
    """This rank's executor on its (retained or fresh) buffers, with `hooks` at every phase."""
    from unbroken.engine.build import job_plan

    plan = job_plan(cfg)
    if plan is not None:
        return _plan_executor(cfg, plan, group, device, retained, hooks, autocast)
    return _data_parallel_executor(cfg, rank, group, device, retained, hooks, autocast, search)


def _data_parallel_executor(cfg, rank, group, device, retained, hooks, autocast, search):
    from unbroken.detect.timing import PhaseTimer
    from unbroken.train import Trainer
    from unbroken.train.build import build_training

    # Last among the hooks: a `slow` stall lands in the interval it times. On a GPU it times
    # the work with CUDA events, not the host's enqueueing.
    timer = PhaseTimer(rank, device=device)
    built = build_training(
        cfg,
        n_shards=cfg.parallel.dp,
        device=device,
        search=search,
        allocate=retained.allocate if retained else None,
    )
    updater = _make_updater(retained, cfg)(built.state, built.geometry, built.step)
    trainer = Trainer(
        model=built.model,
        state=built.state,
        source=built.source,
        shard=rank % cfg.parallel.dp,
        cfg=cfg.train,
        group=group,
        device=device,
        autocast_dtype=autocast,
        hooks=[*hooks, timer],
        updater=updater,
        loss_fn=built.loss_fn,
    )
    return DataParallelExecutor(trainer, timer, built.state, built.geometry, updater)


def _plan_executor(cfg, plan, group, device, retained, hooks, autocast):
    """A plan's worker times itself (its waits are not at phase hooks): no PhaseTimer."""
    from unbroken.engine.build import build_worker, full_initial_params
    from unbroken.engine.sharding import load_from_full

    rank_engine = build_worker(
        cfg,
        plan,
        group,
        device=device,
        allocate=retained.allocate if retained else None,
        hooks=list(hooks),
        autocast_dtype=autocast,
        make_updater=_make_updater(retained, cfg),
    )
    worker, state = rank_engine.worker, rank_engine.state
    tp = rank_engine.groups.tp

    def reinit() -> None:
        load_from_full(full_initial_params(cfg), state.layout, state.params, tp.size, tp.rank)

    return PlanExecutor(
        worker=worker,
        group=group,
        state=state,
        geometry=rank_engine.geometry,
        updater=worker.updater,
        reinit=reinit,
        checkpoint_shard=f"rank{dist.get_rank(group)}",
    )
