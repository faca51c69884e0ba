"""How a trainer obtains its state at start, executing the one recovery decision
(`unbroken.recovery`): fresh, retained and repaired in place, or loaded from the newest complete
checkpoint (the baseline, and the fallback when retained state is beyond repair or gone).

In place, each rank first repairs what it retained (`RetainedState.repair_locally`, no
collective), the ranks all-gather their `RetainedSummary` rows once, and every rank evaluates
`decide_restore` on the same table: resume in place (finishing an update a rank had synced, with
its recorded statistics), start over where the job stands when no rank retained progress, or
fall back to checkpoint-restart (every rank exits `RankExit.FALLBACK`).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from unbroken.checkpoint.policy import CheckpointPolicy
from unbroken.model import init_parameters
from unbroken.recovery import (
    RankAction,
    RestoreDecision,
    RestoreMode,
    RestorePath,
    RetainedSummary,
    decide_restore,
)
from unbroken.update.rmu import RepairReport, ResumableUpdater

__all__ = ["InconsistentState", "agree_and_resume", "collective_device", "restore_state"]


class InconsistentState(Exception):
    """Ranks' retained progress cannot be brought to one iteration boundary."""


def collective_device(group) -> torch.device:
    """Where a small control tensor must live for `group`'s backend: NCCL only moves CUDA
    tensors (the current device); gloo moves CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_summaries(summary: RetainedSummary, group) -> list[RetainedSummary]:
    """Every rank's summary, in rank order (one all_gather; collective)."""
    row = torch.tensor(summary.to_row(), dtype=torch.float64)
    if group is None:
        return [summary]
    row = row.to(collective_device(group))
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return [RetainedSummary.from_row(r.cpu().tolist()) for r in rows]


def finish_update(upd: ResumableUpdater, decision: RestoreDecision, rank: int, hook) -> None:
    """This rank's part of a RESUME decision: bring its state to the agreed boundary."""
    action = decision.actions[rank]
    if decision.finish is None or action in (
        RankAction.UPDATE_DONE,
        RankAction.FILL,
        RankAction.STANDBY,
    ):
        return  # a filled rank takes its replica's state once the donor has finished
    if action is RankAction.FINISH_WITH_PEER_STATS:
        stats = decision.stats
        assert stats is not None
        upd.record_sync(
            decision.finish,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            grad_scale=stats.grad_scale,
            lr=stats.lr,
        )
    marker = upd.marker.state
    upd.update(decision.finish, lr=marker.lr, grad_scale=marker.grad_scale, hook=hook)


def fill_from_replicas(state, decision: RestoreDecision, rank: int, group) -> None:
    """Send or receive the persistent state (parameters and optimizer slots) of each
    (rank, donor) pair of `decision.fill`, point to point: the donor has reached the boundary
    (after `finish_update`), the filled rank takes its bytes. Other ranks do nothing."""
    for target, donor in decision.fill:
        if rank not in (target, donor):
            continue
        for t in state.persistent().values():
            if rank == donor:
                dist.send(t, dst=dist.get_global_rank(group, target), group=group)
            else:
                dist.recv(t, src=dist.get_global_rank(group, donor), group=group)


def agree_and_resume(
    upd: ResumableUpdater, report: RepairReport | None, group, hook
) -> tuple[int, RestoreDecision]:
    """Agree with every rank on where the job stands and reach it: gather the summaries,
    decide, finish this rank's part. `report` is None when this rank could not repair.

    Raises:
        InconsistentState: the decision is not to resume in place.
    """
    repaired = report is not None
    summary = RetainedSummary(
        held=True,
        repaired=repaired,
        progress=not repaired or upd.marker.state.done_iter >= 0,
        marker=upd.marker.state if repaired else None,
    )
    decision = decide_restore(gather_summaries(summary, group))
    if decision.path is not RestorePath.RESUME:
        raise InconsistentState(decision.reason)
    rank = dist.get_rank(group) if group is not None else 0
    finish_update(upd, decision, rank, hook)
    return decision.next_iteration, decision


def _reinitialize(cfg, executor, retained) -> None:
    """Fresh initial state in buffers that hold something else (no checkpoint to load)."""
    state = executor.state
    if retained is not None:
        for region in retained.regions.values():
            region.tensor.zero_()
    else:
        for t in (state.params, state.exp_avg, state.exp_avg_sq):
            t.zero_()
    if executor.reinit is not None:
        executor.reinit()  # an engine rank: its shard of the full model's initial parameters
        return
    if cfg.model.factory:
        raise RuntimeError("no checkpoint to restart a user model from")
    init_parameters(state.layout, state.params, std=cfg.train.init_std, seed=cfg.train.seed)


def restore_state(
    *, spec, cfg, rank, executor, retained, group, events, hook, checkpoints: CheckpointPolicy
) -> int | None:
    """The first iteration to run, or None when the retained state cannot be resumed in place
    and progress would be lost (every rank then exits `RankExit.FALLBACK`)."""
    updater = executor.updater
    if spec.restore is not RestoreMode.IN_PLACE or retained is None:
        start, _ = _restart(spec, cfg, executor, retained, checkpoints)
        return start
    t0 = time.perf_counter()
    summary, report = retained.repair_locally(updater, rank, events)
    # A rank of no stage holds nothing: left out of the decision ([Note: a rank of no stage]).
    summary = dataclasses.replace(summary, empty=executor.state.layout.numel == 0)
    rows = gather_summaries(summary, group)
    decision = decide_restore(rows, executor.replica_sets)
    if decision.path is RestorePath.FALLBACK:
        if rank == 0 or not summary.held:
            events.emit("inplace_fallback", rank=rank, reason=decision.reason)
        return None
    finish_ms = 0.0
    if decision.path is RestorePath.RESUME:
        t_finish = time.perf_counter()
        finish_update(updater, decision, rank, hook)
        finish_ms = (time.perf_counter() - t_finish) * 1e3
        fill_from_replicas(executor.state, decision, rank, group)
        start, action = decision.next_iteration, decision.reason
        if (own := decision.actions[rank]) in (RankAction.FILL, RankAction.STANDBY):
            # Parity and marker of the received state (a rank of no stage: its marker) at the
            # agreed boundary.
            updater.initialize(done_iter=start - 1)
            report = report or RepairReport()
            fixup = "filled from a replica" if own is RankAction.FILL else "a rank of no stage"
        else:
            assert report is not None  # it repaired, or it would be filled or fall back
            fixup = report.fixup
    else:
        # A trainer died before its state held anything (in its start-up): every rank begins
        # where the job stands, the initial state or a checkpoint (from a restart whose
        # trainers died in the same way), without another generation.
        start, source = _restart(spec, cfg, executor, retained, checkpoints)
        report = report or RepairReport()
        fixup = retained.nothing or report.fixup
        action = f"no rank retained progress: start at iteration {start} from {source}"
    events.emit(
        "inplace_repair",
        rank=rank,
        generation=spec.generation,
        localize_ms=retained.localize_ms,
        remap_ms=retained.remap_ms,
        register_ms=updater.parity_register_s * 1e3,  # host parity registered with CUDA
        reconstruct_ms=report.reconstruct_ms,
        finish_ms=finish_ms,
        lost_pages=report.lost_pages,
        fixup=fixup,
        marker=report.marker,
        action=action,
        total_ms=(time.perf_counter() - t0) * 1e3 + retained.localize_ms + retained.remap_ms,
    )
    return start


def _restart(spec, cfg, executor, retained, checkpoints: CheckpointPolicy) -> tuple[int, str]:
    """The checkpoint path: the newest complete checkpoint, else the initial state (and, for a
    job's first generation, the iteration-0 checkpoint). Returns (first iteration, its source)."""
    updater, state = executor.updater, executor.state
    transactional = isinstance(updater, ResumableUpdater)
    if spec.resume and checkpoints.enabled:
        start = checkpoints.load_latest(state)
        if start is not None:
            if transactional:
                updater.initialize(done_iter=start - 1)
            return start, "the newest checkpoint"
    if spec.resume and retained is not None and not retained.fresh:
        _reinitialize(cfg, executor, retained)  # no checkpoints to fall back to: start over
    if transactional:
        updater.initialize(done_iter=-1)
    if not spec.resume:
        checkpoints.at_job_start(state)
    return 0, "the initial state"
