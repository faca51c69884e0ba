"""How a trainer obtains its state at start: fresh, retained and repaired in place, or loaded
from the newest complete checkpoint (the baseline, and the fallback when retained state is
beyond repair or gone).

In place, each rank first repairs what it retained (no collective), then all ranks agree on one
path: resume in place when every rank retained state; when some rank retained nothing (new
regions, or a marker never written: its trainer died in its start-up, see [Note: no valid marker
slot] in `unbroken.update.rmu`) and no rank completed an iteration, start where the job stands in
this generation — nothing is lost; otherwise checkpoint-restart (every rank exits `FATAL_EXIT`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unbroken.checkpoint import (
    find_latest_valid,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from unbroken.checkpoint.dcp import CheckpointInfo, checkpoint_path
from unbroken.erasure import UnrecoverableError
from unbroken.model import init_parameters
from unbroken.update.rmu import RepairReport

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
    rng_seed: int = 0
    """train.seed: saved with every checkpoint, checked on load (`unbroken.train.rng`)."""

    def complete(self, iteration: int) -> bool:
        """Whether a complete, intact checkpoint of the state before `iteration` exists."""
        info = CheckpointInfo(checkpoint_path(self.root, iteration), iteration)
        return verify_checkpoint(info) is None

    def save(self, state, iteration: int, *, group, rank: int) -> float:
        """Checkpoint `state` before `iteration` under this plan; returns the seconds taken."""
        return save_checkpoint(
            self.root,
            state,
            iteration,
            group=group,
            rank=rank,
            keep=self.keep,
            shard=self.shard,
            rng_seed=self.rng_seed,
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
        CheckpointInfo(path, int(path.name[5:])),
        state,
        group=group,
        shard=plan.shard,
        rng_seed=plan.rng_seed,
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


@dataclass(slots=True)
class _Retained:
    """What one rank's retained regions hold, found locally before any collective."""

    report: RepairReport | None = None
    """The repair, when the rank retained state and it could be repaired."""
    nothing: str = ""
    """Why the rank retained nothing at all ("" when it retained something)."""
    progress: bool = False
    """Whether a completed iteration may be lost without it (also when beyond repair)."""


def _repair_locally(updater, retained, rank: int, events) -> _Retained:
    """Repair this rank's retained state (no collective), or say why it holds nothing."""
    from unbroken.update.rmu import NothingRetained

    if retained.fresh:
        return _Retained(nothing="this rank's retained state is gone (its regions are new)")
    if retained.regions["marker"].fresh:  # its trainer died while allocating the regions
        return _Retained(nothing="this rank's marker region is new")
    try:
        report = updater.repair(retained.lost or {})
    except NothingRetained as exc:
        return _Retained(nothing=f"this rank retained nothing: {exc}")
    except UnrecoverableError as exc:
        events.emit("inplace_unrecoverable", rank=rank, reason=str(exc))
        return _Retained(progress=True)
    return _Retained(report=report, progress=updater.marker.state.done_iter >= 0)


def collective_device(group) -> torch.device:
    """Where a small control tensor must live for `group`'s backend: NCCL only moves CUDA
    tensors (the current device); gloo moves CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_on_path(held: _Retained, group) -> str:
    """The restore path every rank takes (their collectives differ, so they must agree):
    "resume" in place when every rank retained state; "start_over" (the checkpoint path, in
    this generation) when some rank retained nothing and no rank completed an iteration —
    nothing is lost, there is just nothing to resume; else "fallback" (checkpoint-restart)."""
    flags = torch.tensor([int(bool(held.nothing)), int(held.progress)], dtype=torch.int64)
    if group is not None:
        flags = flags.to(collective_device(group))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    nothing, progress = (bool(x) for x in flags.tolist())
    if not nothing:
        return "resume"
    return "fallback" if progress else "start_over"


def restore_state(
    *, spec, cfg, rank, built, updater, retained, group, events, hook
) -> tuple[int, CheckpointPlan] | None:
    """Returns (first iteration to run, checkpoint plan), or None when the retained state is
    beyond repair on some rank (every rank then exits with FATAL_EXIT)."""
    from unbroken.launch.retained import InconsistentState, agree_and_resume

    plan = CheckpointPlan(
        Path(cfg.checkpoint.dir or Path(spec.run_dir) / "checkpoints" / spec.run_name),
        keep=cfg.checkpoint.keep,
        shard=f"rank{rank}" if cfg.parallel.planned else "",
        rng_seed=cfg.train.seed,
    )
    if spec.recovery == "inplace" and retained is not None:
        t0 = time.perf_counter()
        held = _repair_locally(updater, retained, rank, events)
        path = _agree_on_path(held, group)
        if path == "fallback":
            if held.nothing:
                events.emit(
                    "inplace_fallback", rank=rank, reason=f"{held.nothing}; peers made progress"
                )
            return None
        if path == "resume":
            try:
                start, decision = agree_and_resume(updater, held.report, group, hook)
            except InconsistentState as exc:
                if rank == 0:
                    events.emit("inplace_fallback", reason=str(exc))
                return None
            report = held.report
            assert report is not None  # agree_and_resume raised for every rank otherwise
            fixup, action = report.fixup, decision["action"]
        else:
            # A trainer died before its state held anything (in its start-up): every rank
            # begins where the job stands, the initial state or a checkpoint (from a restart
            # whose trainers died in the same way), without another generation.
            start, source = _restart(spec, cfg, rank, built, updater, retained, group, events, plan)
            report = held.report or RepairReport()
            fixup = held.nothing or report.fixup
            action = f"no rank retained progress: start at iteration {start} from {source}"
        events.emit(
            "inplace_repair",
            rank=rank,
            generation=spec.generation,
            localize_ms=retained.localize_ms,
            remap_ms=retained.remap_ms,
            reconstruct_ms=report.reconstruct_ms,
            lost_pages=report.lost_pages,
            fixup=fixup,
            action=action,
            total_ms=(time.perf_counter() - t0) * 1e3 + retained.localize_ms + retained.remap_ms,
        )
        return start, plan
    start, _ = _restart(spec, cfg, rank, built, updater, retained, group, events, plan)
    return start, plan


def _restart(
    spec, cfg, rank, built, updater, retained, group, events, plan: CheckpointPlan
) -> tuple[int, str]:
    """The checkpoint path: the newest complete checkpoint, else the initial state (and, for a
    job's first generation, the iteration-0 checkpoint). Returns (first iteration, its source)."""
    from unbroken.update.rmu import ResumableUpdater

    transactional = isinstance(updater, ResumableUpdater)
    if spec.resume and cfg.checkpoint.enabled:
        start = _load_latest(plan, built.state, rank, group, events)
        if start is not None:
            if transactional:
                updater.initialize(done_iter=start - 1)
            return start, "the newest checkpoint"
    if spec.resume and retained is not None and not retained.fresh:
        _reinitialize(cfg, built, retained)  # no checkpoints to fall back to: start over
    if transactional:
        updater.initialize(done_iter=-1)
    if cfg.checkpoint.enabled and not spec.resume:
        plan.cost_s = plan.save(built.state, 0, group=group, rank=rank)
        if rank == 0:
            events.emit("checkpoint_saved", iter=0, seconds=plan.cost_s)
    return 0, "the initial state"
