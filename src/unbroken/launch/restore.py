"""How a trainer obtains its state at start: fresh, retained and repaired in place, or loaded
from the newest complete checkpoint (the baseline, and the fallback when retained state is
beyond repair or gone)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unbroken.checkpoint import find_latest_valid, load_checkpoint, save_checkpoint
from unbroken.checkpoint.dcp import CheckpointInfo
from unbroken.erasure import UnrecoverableError
from unbroken.model import init_parameters

__all__ = ["CheckpointPlan", "restore_state"]


@dataclass(slots=True)
class CheckpointPlan:
    root: Path
    keep: int
    """Complete checkpoints kept (checkpoint.keep)."""
    cost_s: float = 0.0
    """Measured cost of the iteration-0 checkpoint (0 when none was taken here)."""
    shard: str = ""
    """Per-rank key prefix when ranks hold different state (engine plans); see dcp."""

    def save(self, state, iteration: int, *, group, rank: int) -> float:
        """Checkpoint `state` before `iteration` under this plan; returns the seconds taken."""
        return save_checkpoint(
            self.root, state, iteration, group=group, rank=rank, keep=self.keep, shard=self.shard
        )


def _load_latest(plan: CheckpointPlan, state, rank: int, group, events) -> int | None:
    holder: list[Any] = [None]
    if rank == 0:

        def skipped(info, reason):
            events.emit("checkpoint_skipped", path=str(info.path), reason=reason)

        found = find_latest_valid(plan.root, on_skip=skipped)
        holder[0] = str(found.path) if found else None
    dist.broadcast_object_list(holder, src=0, group=group)
    if holder[0] is None:
        return None
    path = Path(holder[0])
    t0 = time.time()
    start = load_checkpoint(
        CheckpointInfo(path, int(path.name[5:])), state, group=group, shard=plan.shard
    )
    if rank == 0:
        events.emit("checkpoint_loaded", iter=start, seconds=time.time() - t0)
    return start


def _reinitialize(cfg, built, retained) -> None:
    """Fresh initial state in buffers that hold something else (no checkpoint to load)."""
    if retained is not None:
        for region in retained.regions.values():
            region.tensor.zero_()
    else:
        for t in (built.state.params, built.state.exp_avg, built.state.exp_avg_sq):
            t.zero_()
    if getattr(built, "reinit", None) is not None:
        built.reinit()  # an engine rank: its shard of the full model's initial parameters
        return
    if cfg.model.factory:
        raise RuntimeError("no checkpoint to restart a user model from")
    init_parameters(
        built.state.layout, built.state.params, std=cfg.train.init_std, seed=cfg.train.seed
    )


def restore_state(
    *, spec, cfg, rank, built, updater, retained, group, events, hook
) -> tuple[int, CheckpointPlan] | None:
    """Returns (first iteration to run, checkpoint plan), or None when the retained state is
    beyond repair on some rank (every rank then exits with FATAL_EXIT)."""
    from unbroken.launch.retained import InconsistentState, agree_and_resume
    from unbroken.update.rmu import ResumableUpdater

    plan = CheckpointPlan(
        Path(cfg.checkpoint.dir or Path(spec.run_dir) / "checkpoints" / spec.run_name),
        keep=cfg.checkpoint.keep,
        shard=f"rank{rank}" if cfg.parallel.planned else "",
    )
    transactional = isinstance(updater, ResumableUpdater)
    inplace = spec.recovery == "inplace" and retained is not None and not retained.fresh
    if spec.recovery == "inplace" and group is not None:
        # Every rank must take the same path (their collectives differ). A rank whose retained
        # state is gone (fresh regions) takes the whole job to checkpoint-restart.
        seen = torch.tensor([int(inplace), int(not inplace)], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
        if int(seen[0]) and int(seen[1]):  # mixed: nobody can resume in place
            if not inplace:
                events.emit(
                    "inplace_fallback",
                    rank=rank,
                    reason="this rank's retained state is gone (its regions are new)",
                )
            return None
    if inplace:
        t0 = time.perf_counter()
        report = None
        try:
            report = updater.repair(retained.lost or {})
        except UnrecoverableError as exc:
            events.emit("inplace_unrecoverable", rank=rank, reason=str(exc))
        try:
            start, decision = agree_and_resume(updater, report, group, hook)
        except InconsistentState as exc:
            if rank == 0:
                events.emit("inplace_fallback", reason=str(exc))
            return None
        events.emit(
            "inplace_repair",
            rank=rank,
            generation=spec.generation,
            localize_ms=retained.localize_ms,
            remap_ms=retained.remap_ms,
            reconstruct_ms=report.reconstruct_ms,
            lost_pages=report.lost_pages,
            fixup=report.fixup,
            action=decision["action"],
            total_ms=(time.perf_counter() - t0) * 1e3 + retained.localize_ms + retained.remap_ms,
        )
        return start, plan
    if spec.resume and cfg.checkpoint.enabled:
        start = _load_latest(plan, built.state, rank, group, events)
        if start is None:
            start = 0
            if retained is not None and not retained.fresh:
                _reinitialize(cfg, built, retained)
        if transactional:
            updater.initialize(done_iter=start - 1)
        return start, plan
    if spec.resume and retained is not None and not retained.fresh:
        _reinitialize(cfg, built, retained)  # no checkpoints to fall back to: start over
    if transactional:
        updater.initialize(done_iter=-1)
    if cfg.checkpoint.enabled and not spec.resume:
        plan.cost_s = plan.save(built.state, 0, group=group, rank=rank)
        if rank == 0:
            events.emit("checkpoint_saved", iter=0, seconds=plan.cost_s)
    return 0, plan
