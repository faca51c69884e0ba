"""What runs a rank's iterations, built once: data-parallel training (`unbroken.train.Trainer`)
or one rank of a hybrid-parallel plan (`unbroken.engine.PlanWorker`), behind one `Executor`
protocol.

`build_executor` is the one place a trainer process decides between the two (`job_plan`: a
plan when `parallel.tp`/`pp` > 1); everything after it — restore, the loop, checkpoints, the
state hash, the fail-slow timings — asks the executor instead of the config.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from unbroken.config import JobConfig
from unbroken.parallel import held_stages
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
    checkpoint_layout: str
    """The layout record saved with checkpoints (`unbroken.engine.ckpt_layout`)."""
    reshard: Callable[[Any], int] | None
    """Loads a checkpoint saved under another layout into this rank (`load_resharded`)."""
    replica_sets: tuple[tuple[int, ...], ...]
    """Sets of ranks that hold identical state (data-parallel replicas of the same shard): the
    audit checks that each set's hashes agree."""
    build_s: dict[str, float]
    """Seconds each part of building this executor took (`trainer_ready` reports them)."""

    def hook(self, phase: Any, iteration: int, step: int = 0, n_steps: int = 1) -> None:
        """Call the rank's phase hooks (restore finishes an update through them)."""

    def run_iteration(self, iteration: int) -> IterationResult: ...

    def timing_record(self, iteration: int, result: IterationResult) -> dict[str, Any] | None:
        """This rank's compute timings and workload of `iteration` for the fail-slow watch
        (`timings.jsonl`), or None when it has none."""

    def rank_hash(self) -> str:
        """This rank's own state hash (replicas of one shard must agree on it)."""

    def job_hash(self, rank_hashes: list[str]) -> str:
        """The job's model state hash from every rank's own (`rank_hash`); every rank calls
        it (it may gather)."""


def _make_updater(retained, cfg: JobConfig):
    """`(state, geometry, step) -> updater`: the resumable updater over the retained regions
    (in-place recovery), else the plain one."""

    def make(state, geometry, step) -> Updater:
        if retained is None:
            return PlainUpdater(state, geometry, step)
        from unbroken.update.factory import resumable_updater

        return resumable_updater(state, geometry, step, retained.tensors(), cfg.protection)

    return make


@dataclass(slots=True)
class DataParallelExecutor:
    """A data-parallel replica: the whole model, `Trainer` over its shard of the data."""

    trainer: Any
    timer: Any
    state: TrainState
    geometry: StateGeometry
    updater: Updater
    replica_sets: tuple[tuple[int, ...], ...] = ()
    reinit: Callable[[], None] | None = None
    checkpoint_shard: str = ""
    checkpoint_layout: str = ""
    reshard: Callable[[Any], int] | None = None
    build_s: dict[str, float] = field(default_factory=dict)

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

    def rank_hash(self) -> str:
        return self.state.state_hash()

    def job_hash(self, rank_hashes: list[str]) -> str:
        return rank_hashes[0]  # every replica holds all of it (`replica_sets` checks that)

    def set_placement(self, placement) -> None:
        """Compute `placement`'s micro-batches from the next iteration on (the ordered path;
        every rank calls it at the same boundary, `unbroken.launch.switch`)."""
        self.trainer.set_placement(placement)


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
    checkpoint_layout: str = ""
    reshard: Callable[[Any], int] | None = None
    replica_sets: tuple[tuple[int, ...], ...] = ()
    build_s: dict[str, float] = field(default_factory=dict)
    shard_tag: str = ""
    """Appended to parameter names in the state hash: the TP position of this rank's shards
    ("" at TP 1)."""
    switch: Callable[[Any], None] | None = None
    """Runs another plan from the next iteration on (`engine.build.switch_plan`)."""
    _slots: dict[str, str] = field(default_factory=dict)

    def set_plan(self, plan) -> None:
        """Run `plan` (the same layers on every rank) from the next iteration on; every rank
        calls it at the same boundary (`unbroken.launch.switch`)."""
        from unbroken.engine.ckpt_layout import layout_record

        assert self.switch is not None
        self.switch(plan)
        self.checkpoint_layout = layout_record(plan)
        self.replica_sets = plan_replica_sets(plan)

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

    def rank_hash(self) -> str:
        """sha256 over this rank's per-parameter hashes (kept for `job_hash`)."""
        from unbroken.engine.sharding import shard_of
        from unbroken.train.digest import slot_digests

        # A TP-1 stage computing as a TP group (`unbroken.engine.emulate`) hashes its shards
        # under that group's tags.
        emulate = getattr(self.worker.model, "emulate", 1)
        self._slots = slot_digests(self.state, self.shard_tag, emulate, shard_of)
        joined = "".join(f"{k}={v};" for k, v in sorted(self._slots.items()))
        return hashlib.sha256(joined.encode()).hexdigest()[:16]

    def job_hash(self, rank_hashes: list[str]) -> str:
        """A hash over every parameter's hash by name, whichever rank holds it: the same
        model state gives the same hash under any pipeline layout, so a job re-planned onto
        fewer stages is audited against its fault-free run on the original plan. (A tensor
        shard's name carries its TP position: TP layouts hash by shard.) Gathers."""
        if not self._slots:
            self.rank_hash()
        gathered: list[dict[str, str] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, self._slots, group=self.group)
        merged: dict[str, str] = {}
        for slots in gathered:
            for name, h in (slots or {}).items():
                merged.setdefault(name, h)  # replicas hold the same (their rank hashes agree)
        joined = "".join(f"{k}={v};" for k, v in sorted(merged.items()))
        return hashlib.sha256(joined.encode()).hexdigest()[:16]


def plan_replica_sets(plan) -> tuple[tuple[int, ...], ...]:
    """Ranks of `plan` that hold identical state: the same layers at the same TP degree and
    TP position, in different replicas (sets of one are left out)."""
    sets: dict[tuple, list[int]] = {}
    for rank in plan.ranks:
        d, s = plan.locate(rank)
        position = plan.replicas[d].stages[s].ranks.index(rank)
        sets.setdefault((held_stages(plan, rank), position), []).append(rank)
    return tuple(tuple(r) for r in sets.values() if len(r) > 1)


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
    placement=None,
    plan=None,
) -> Executor:
    """This rank's executor on its (retained or fresh) buffers, with `hooks` at every phase.

    `placement` (`unbroken.parallel.DataPlacement`, data-parallel jobs with
    `parallel.reduce = "ordered"`): who computes which micro-batch; None, rank r computes
    shard r. `plan` (`unbroken.parallel.ParallelPlan`): the plan this generation runs instead
    of the config's (a pipeline job re-planned around a lost device)."""
    from unbroken.engine.build import job_plan

    plan = plan if plan is not None else job_plan(cfg, search)
    if plan is not None:
        return _plan_executor(cfg, plan, group, device, retained, hooks, autocast, search)
    if cfg.ordered_reduction and placement is None:
        from unbroken.parallel import DataPlacement

        placement = DataPlacement.identity(cfg.parallel.dp, cfg.data.microbatches)
    return _data_parallel_executor(
        cfg, rank, group, device, retained, hooks, autocast, search, placement
    )


def _data_parallel_executor(cfg, rank, group, device, retained, hooks, autocast, search, placement):
    from unbroken.detect.timing import PhaseTimer
    from unbroken.engine.ckpt_layout import layout_record
    from unbroken.engine.replica import build_training
    from unbroken.engine.tp import TPGroup
    from unbroken.train import Trainer

    # Last among the hooks: a `slow` stall lands in the interval it times. On a GPU it times
    # the work with CUDA events, not the host's enqueueing.
    timer = PhaseTimer(rank, device=device)
    t0 = time.perf_counter()
    built = build_training(
        cfg,
        n_shards=cfg.parallel.dp,
        device=device,
        search=search,
        allocate=retained.allocate if retained else None,
    )
    t1 = time.perf_counter()
    updater = _make_updater(retained, cfg)(built.state, built.geometry, built.step)
    t2 = time.perf_counter()
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
        placement=placement,
        probe_every=cfg.adapt.probe_every,
    )
    world = dist.get_world_size(group) if group is not None else 1
    return DataParallelExecutor(
        trainer,
        timer,
        built.state,
        built.geometry,
        updater,
        replica_sets=(tuple(range(world)),) if world > 1 else (),
        checkpoint_layout=layout_record(None),
        reshard=_resharder(cfg, built.state, TPGroup(), search),
        build_s={
            "model_and_state": round(t1 - t0, 4),
            "updater": round(t2 - t1, 4),
            "trainer": round(time.perf_counter() - t2, 4),
        },
    )


def _resharder(cfg, state, tp, search) -> Callable[[Any], int]:
    """Loads a checkpoint of another layout into `state` (`load_resharded`)."""

    from unbroken.engine.ckpt_layout import load_resharded

    def load(info) -> int:
        return load_resharded(info, state, state.layout, tp, cfg, search=search)

    return load


def _plan_executor(cfg, plan, group, device, retained, hooks, autocast, search):
    """A plan's worker times itself (its waits are not at phase hooks): no PhaseTimer."""
    from unbroken.engine.build import build_worker, full_initial_params, switch_plan
    from unbroken.engine.ckpt_layout import layout_record
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
        search=search,
    )
    worker, state = rank_engine.worker, rank_engine.state
    tp = rank_engine.groups.tp

    def reinit() -> None:
        full = full_initial_params(cfg, search)
        load_from_full(full, state.layout, state.params, tp.size, tp.rank)

    def switch(new_plan) -> None:
        switch_plan(cfg, rank_engine, new_plan, group, search)

    return PlanExecutor(
        worker=worker,
        group=group,
        state=state,
        geometry=rank_engine.geometry,
        updater=worker.updater,
        reinit=reinit,
        checkpoint_shard=f"rank{dist.get_rank(group)}",
        checkpoint_layout=layout_record(plan),
        reshard=_resharder(cfg, state, tp, search),
        replica_sets=plan_replica_sets(plan),
        shard_tag=f"@tp{tp.rank}/{tp.size}" if tp.size > 1 else "",
        switch=switch,
    )
