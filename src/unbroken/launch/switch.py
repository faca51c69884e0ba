"""The ranks' side of a live re-plan: at every iteration boundary the ranks agree on the
placement the next iteration runs (issue 18).

The coordinator publishes a new placement in the job store (`JobStore.publish_placement`:
the placement, then its epoch). At each boundary rank 0 alone reads the newest epoch and
broadcasts it over the generation's group, so every rank sees the same epoch at the same
boundary — never each rank polling the store on its own (a rank that read a newer epoch than
its peers would compute other micro-batches and the collectives would not match). A newer
epoch is then read by every rank from the store (the placement is written before its epoch)
and takes effect from the next iteration. Rank 0 logs `plan_applied` with the first iteration
on the new placement: the summary's record of the plan changes.

A pipeline job's coordinator publishes a whole plan instead (``{"plan": ...}``, a
`ParallelPlan` that moves micro-batches between replicas and keeps every rank's layers); every
rank switches to it at the same boundary (`executor.set_plan`, collective: the new plan's
groups are created there).

A placement or plan for another world size (published for the next generation after a device
was lost) is not this generation's: it is skipped. One small broadcast per iteration is the
cost; jobs without `adapt.enabled` build no switch.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import torch.distributed as dist

from unbroken.jobstore import JobStore
from unbroken.launch.restore import collective_device
from unbroken.parallel import DataPlacement, ParallelPlan

__all__ = ["PlacementSwitch"]


class PlacementSwitch:
    """Args: store (the job store), group (the generation's), rank, executor (a
    data-parallel executor with `set_placement`, or a plan's with `set_plan`), events (the
    job's event log), epoch (the epoch of the placement the generation started with, from its
    spec)."""

    def __init__(
        self, store: JobStore, group: Any, rank: int, executor: Any, events: Any, epoch: int
    ) -> None:
        self.store, self.group, self.rank = store, group, rank
        self.executor, self.events, self.epoch = executor, events, epoch
        self.world = dist.get_world_size(group)
        self._flag = torch.zeros(1, dtype=torch.int64, device=collective_device(group))

    def at_boundary(self, iteration: int) -> None:
        """After `iteration`: agree on the newest epoch (collective) and switch to it."""
        t0 = time.perf_counter()
        if self.rank == 0:
            self._flag.fill_(self.store.placement_epoch())
        dist.broadcast(self._flag, src=0, group=self.group)
        epoch = int(self._flag.item())
        if epoch <= self.epoch:
            return
        self.epoch = epoch
        text = self.store.placement(epoch)
        if text is None:  # pragma: no cover - the coordinator writes the placement first
            raise RuntimeError(f"placement epoch {epoch} published without its placement")
        data = json.loads(text)
        if "plan" in data:
            self._switch_plan(ParallelPlan.from_dict(data["plan"]), iteration, epoch, t0)
            return
        placement = DataPlacement.from_dict(data)
        if placement.world_size != self.world:
            return  # meant for a world of another size (the next generation's)
        self.executor.set_placement(placement)
        if self.rank == 0:
            self.events.emit(
                "plan_applied",
                epoch=epoch,
                iter=iteration + 1,
                placement=placement.to_dict(),
                counts=list(placement.counts()),
                switch_s=time.perf_counter() - t0,
            )

    def _switch_plan(self, plan: ParallelPlan, iteration: int, epoch: int, t0: float) -> None:
        if max(plan.ranks) >= self.world:
            return  # meant for a world of another size (the next generation's)
        self.executor.set_plan(plan)
        if self.rank == 0:
            self.events.emit(
                "plan_applied",
                epoch=epoch,
                iter=iteration + 1,
                stages=plan.stage_records(),
                counts=list(plan.microbatches),
                switch_s=time.perf_counter() - t0,
            )
