"""Checkpoint policy, one owner: where a job's checkpoints live, when one is taken, and the
job-wide decisions behind that (the checkpoint's measured cost, the interval).

- **Where**: `checkpoint.dir`, else `RUN_DIR/checkpoints/RUN`; ranks holding different state
  (engine plans) key their shard by rank (`shard`).
- **When**: at the job's start (iteration 0: the fallback's floor, and the measured cost C);
  then every `interval` iterations, where the interval is `checkpoint.interval` or Young's
  `sqrt(2·C·MTTF)/t_iter` (`young_interval`) with t_iter the median of the first three
  iteration times — decided once, by rank 0, and shared through the job store so every rank
  and every generation agrees; and at an in-place recovery that resumes on a checkpoint
  boundary whose save the failure interrupted (the "missed" checkpoint), so the fallback keeps
  its interval.
- **Loading**: the newest complete, intact checkpoint (rank 0 looks, every rank loads).

Every method that saves or loads is collective over the job's group: every rank calls it with
the same arguments. Only rank 0 writes events. The save/verify/load mechanics are
`unbroken.checkpoint.dcp`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from unbroken.checkpoint.dcp import (
    CheckpointInfo,
    CheckpointStager,
    checkpoint_path,
    find_latest_valid,
    load_checkpoint,
    read_layout,
    save_checkpoint,
    save_checkpoint_async,
    verify_checkpoint,
)
from unbroken.checkpoint.interval import young_interval
from unbroken.config import CheckpointConfig
from unbroken.train.state import TrainState

__all__ = ["CheckpointPolicy", "IntervalBoard"]

HEALTHY_ITERATIONS = 3
"""Iterations timed before Young's interval is decided."""


class IntervalBoard(Protocol):
    """Where the job-wide checkpoint decisions are shared (`unbroken.jobstore.JobStore`)."""

    def checkpoint_cost(self) -> float | None: ...
    def set_checkpoint_cost(self, seconds: float) -> None: ...
    def checkpoint_interval(self) -> int | None: ...
    def wait_checkpoint_interval(self) -> int: ...
    def set_checkpoint_interval(self, iterations: int) -> None: ...


@dataclass(slots=True)
class CheckpointPolicy:
    """One rank's view of the job's checkpoint policy.

    Args:
        cfg: the job's `checkpoint` section.
        root: the checkpoint directory.
        iterations: the job's length (the longest interval).
        board: the job-wide decisions (the job store).
        rank: this rank (rank 0 decides and writes events).
        group: the job's process group (None: one process).
        emit: appends an event to the job's log.
        shard: per-rank key prefix when ranks hold different state (engine plans).
        rng_seed: train.seed, saved with every checkpoint and checked on load.
        layout: this rank's parallel layout record (`unbroken.engine.ckpt_layout`), saved
            with every checkpoint; "" records none.
        reshard: loads a checkpoint saved under another layout into this rank's state
            (collective-free; returns the next iteration), or None when this rank cannot.
    """

    cfg: CheckpointConfig
    root: Path
    iterations: int
    board: IntervalBoard
    rank: int
    group: dist.ProcessGroup | None
    emit: Callable[..., Any]
    shard: str = ""
    rng_seed: int = 0
    layout: str = ""
    reshard: Callable[[CheckpointInfo], int] | None = None
    interval: int | None = None
    cost_s: float | None = None
    """The checkpoint cost this generation measured (its iteration-0 save)."""
    _healthy: list[float] = field(default_factory=list)
    stager: CheckpointStager | None = None
    """Host buffers and the save in flight (`checkpoint.asynchronous`), made at the first
    save of the generation."""

    def __post_init__(self) -> None:
        self.interval = self.cfg.interval or None

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    # -- storage --------------------------------------------------------------------------
    def complete(self, iteration: int) -> bool:
        """Whether a complete, intact checkpoint of the state before `iteration` exists."""
        info = CheckpointInfo(checkpoint_path(self.root, iteration), iteration)
        return verify_checkpoint(info) is None

    def save(self, state: TrainState, iteration: int, **event: Any) -> float:
        """Checkpoint `state` before `iteration` (collective); returns the seconds the caller
        was blocked (with `asynchronous`, the staging copy: the rest runs in the background)."""
        common = {
            "group": self.group,
            "rank": self.rank,
            "keep": self.cfg.keep,
            "shard": self.shard,
            "rng_seed": self.rng_seed,
            "layout": self.layout,
        }
        if self.cfg.asynchronous:
            pending = save_checkpoint_async(
                self.root, state, iteration, stager=self._stager(state), **common
            )
            seconds = pending.blocking_s
            event["asynchronous"] = True
        else:
            seconds = save_checkpoint(self.root, state, iteration, **common)
        if self.rank == 0:
            self.emit("checkpoint_saved", iter=iteration, seconds=seconds, **event)
        return seconds

    def _stager(self, state: TrainState) -> CheckpointStager:
        if self.stager is None:
            self.stager = CheckpointStager()
            self.stager.reserve(state, self.shard)
        return self.stager

    def flush(self) -> None:
        """Wait for a background save in flight (before a load, and before the generation's
        trainers exit: a save they leave unsealed is skipped by every reader).

        Raises:
            RuntimeError: it failed.
        """
        if self.stager is not None:
            total = self.stager.wait()
            if total is not None and self.rank == 0:
                self.emit("checkpoint_sealed", seconds=total)

    def load_latest(self, state: TrainState) -> int | None:
        """Load the newest complete checkpoint into `state` (collective); returns the next
        iteration to run, or None when there is none."""
        self.flush()
        holder: list[Any] = [None]
        if self.rank == 0:

            def skipped(info, reason):
                self.emit("checkpoint_skipped", path=str(info.path), reason=reason)

            found = find_latest_valid(self.root, on_skip=skipped)
            holder[0] = str(found.path) if found else None
        if self.group is not None:
            dist.broadcast_object_list(holder, src=0, group=self.group)
        if holder[0] is None:
            return None
        path = Path(holder[0])
        info = CheckpointInfo(path, int(path.name[5:]))
        t0 = time.time()
        saved = read_layout(info)
        # Every rank reads the same record, so every rank takes the same branch.
        if saved is None or not self.layout or saved == self.layout:
            start = load_checkpoint(
                info, state, group=self.group, shard=self.shard, rng_seed=self.rng_seed
            )
            resharded = False
        elif self.reshard is None:
            raise RuntimeError(
                f"{path}: saved under another parallel layout, which this rank cannot load"
            )
        else:
            start, resharded = self.reshard(info), True
        if self.rank == 0:
            self.emit(
                "checkpoint_loaded", iter=start, seconds=time.time() - t0, resharded=resharded
            )
        return start

    # -- when -----------------------------------------------------------------------------
    def at_job_start(self, state: TrainState) -> None:
        """The job's first generation: the iteration-0 checkpoint, and its cost for Young."""
        if self.enabled:
            self.cost_s = self.save(state, 0)

    def before_loop(self, state: TrainState, start: int) -> None:
        """Before a generation's first iteration (collective): measure the checkpoint cost if
        no generation has (the first one failed before it saved), and take the checkpoint a
        resumed boundary missed."""
        if not self.enabled:
            return
        if self.interval is None:
            self.interval = self.board.checkpoint_interval()
        # The cost is published here, by rank 0, after any save: a rank that reads the board
        # after rank 0 wrote it skips only a branch that holds no collective (the cost was
        # measured at the job's start), and a save's barriers keep every rank's read before
        # the write otherwise — so the ranks' collectives always match.
        if self.interval is None and self.board.checkpoint_cost() is None:
            if self.cost_s is None:
                self.cost_s = self.save(state, start)
            if self.rank == 0:
                self.board.set_checkpoint_cost(self.cost_s)
        if self.interval and 0 < start < self.iterations and not start % self.interval:
            self._take_missed(state, start)

    def after_iteration(self, state: TrainState, iteration: int, seconds: float) -> float:
        """After `iteration` completed in `seconds` (collective): decide the interval once
        enough iterations are timed, save when a boundary is due; returns the save's seconds."""
        if not self.enabled:
            return 0.0
        self._healthy.append(seconds)
        if self.interval is None and len(self._healthy) >= HEALTHY_ITERATIONS:
            self.interval = self._decide_interval()
        nxt = iteration + 1
        if self.interval and nxt % self.interval == 0 and nxt < self.iterations:
            return self.save(state, nxt)
        return 0.0

    def _decide_interval(self) -> int:
        """Young's formula from the measured cost and iteration time; rank 0 decides once for
        the job, every rank waits for its decision."""
        if self.rank == 0:
            cost = self.board.checkpoint_cost()
            assert cost is not None  # published before the job's first iteration
            iter_s = sorted(self._healthy)[len(self._healthy) // 2]
            value = young_interval(cost, self.cfg.mttf_s, iter_s, self.iterations)
            self.board.set_checkpoint_interval(value)
            self.emit(
                "checkpoint_interval",
                interval=value,
                ckpt_cost_s=cost,
                iter_s=iter_s,
                mttf_s=self.cfg.mttf_s,
            )
        return self.board.wait_checkpoint_interval()

    def _take_missed(self, state: TrainState, start: int) -> None:
        """After an in-place recovery the run resumes at `start`, a checkpoint boundary: its
        checkpoint was due at the end of the iteration the failure interrupted, which the
        recovery finished instead of the loop. Take it now (a restart from a checkpoint
        resumes at one that exists: nothing to do). Rank 0 looks, every rank follows."""
        missing = [not self.complete(start)] if self.rank == 0 else [None]
        if self.group is not None:
            dist.broadcast_object_list(missing, src=0, group=self.group)
        if missing[0]:
            self.save(state, start, missed=True)
