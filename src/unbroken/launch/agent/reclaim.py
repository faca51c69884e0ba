"""The agent's side of OOM-free pre-initialization (Leto §6): when the node's memory is needed
by training, its shadows go, and come back at a level that fits.

Two triggers, one action (`ShadowPool.reclaim`: kill every shadow, wait until they are gone):

- the job's memory budget on a CPU node (`unbroken.shadow.memory`, cgroup v1): an allocation
  over the budget waits in the kernel and an eventfd wakes the agent (`on_oom`); the
  reclamation controller (`unbroken.shadow.controller`) decides, and the shadows are relaunched
  at once at the level it allows;
- a trainer's allocation failure (a device OOM, `unbroken.shadow.client`): a `ReclaimRequest`
  datagram (`on_request`), answered with a `ReclaimAnswer` once the shadows are gone; the device
  level policy (`unbroken.shadow.policy.LevelPolicy`, created with the first request) picks the
  level, and the shadows come back once that trainer is past the iteration it retries.

At each recovery the level is raised again as far as the policies allow (`level_at_recovery`).
Everything this decides is reported as a `MemoryReport` event.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from unbroken.launch.agent.shadows import RelaunchAfter, ShadowPool
from unbroken.messages import MemoryReport, ReclaimAnswer, ReclaimRequest, StartGeneration

if TYPE_CHECKING:
    from unbroken.shadow.controller import ReclaimController
    from unbroken.shadow.memory import MemoryBudget
    from unbroken.shadow.policy import LevelPolicy

__all__ = ["Reclaimer"]

MIB = 1 << 20


class Reclaimer:
    """Reclaims and relaunches the pool's shadows under memory pressure.

    Args:
        pool: the node's shadows.
        report: sends a message to the coordinator.
    """

    def __init__(self, pool: ShadowPool, report: Callable[[MemoryReport], None]) -> None:
        self.pool = pool
        self.report = report
        self.memory: ReclaimController | None = None
        """The reclamation controller under the node's memory budget (None: no budget)."""
        self.device_policy: LevelPolicy | None = None
        """Level policy for allocation failures reported by trainers (device OOM)."""

    def _event(self, event: str, **fields: Any) -> None:
        self.report(MemoryReport(event=event, t=time.time(), fields=fields))

    # -- the memory budget ------------------------------------------------------------------
    def setup(self, msg: StartGeneration) -> MemoryBudget | None:
        """The node's memory budget, created with the first generation that asks for one;
        returns it when created now (the caller wires its cgroup and eventfd), else None."""
        budget_mb = msg.memory_budget_mb
        if not budget_mb or self.memory is not None:
            return None
        from unbroken.shadow.controller import ReclaimController
        from unbroken.shadow.memory import MemoryBudget
        from unbroken.shadow.policy import LevelPolicy

        reclaim = msg.memory_reclaim
        budget = MemoryBudget(f"unbroken-agent{os.getpid()}", budget_mb << 20, reclaim)
        configured = msg.shadows.level if msg.shadows is not None else 0
        policy = LevelPolicy(configured=configured, budget=budget.limit)
        self.memory = ReclaimController(budget, policy)
        self._event("memory_budget", budget_mb=budget_mb, reclaim=reclaim, cgroup=str(budget.path))
        return budget

    def level_at_recovery(self, msg: StartGeneration, ranks: int) -> int:
        """The level for the shadows of generation `msg.generation` + 1: the configured one,
        as far as the policies allow after what they saw (a recovery resets their caps)."""
        level = msg.shadows.level if msg.shadows is not None else 0
        if level and self.device_policy is not None:
            self.device_policy.at_recovery(None, ranks)
        if level and self.memory is not None:
            chosen = self.memory.level_for_next(ranks)
            if chosen != level:
                self._event(
                    "shadow_level",
                    generation=msg.generation + 1,
                    level=chosen,
                    configured=level,
                    peak_active_mb=(self.memory.peak_active or 0) / MIB,
                    reason="at recovery: the level the observed peak memory leaves room for",
                )
            level = chosen
        return level

    def sample(self) -> None:
        """Every tick: the shadows' footprints and the active memory (rate-limited inside)."""
        if self.memory is None:
            return
        shadows = {
            t.proc.pid: (t.alive(), t.beat.footprint if t.beat else None)
            for t in self.pool.shadows.values()
        }
        self.memory.sample(shadows)

    def generation_over(self) -> None:
        """Every trainer of the generation is gone: the budget's story so far."""
        if self.memory is not None:
            self._event("memory_report", **self.memory.report())

    def close(self) -> None:
        """Remove the memory cgroup (every process in it must be gone)."""
        if self.memory is not None:
            self.memory.budget.close()

    # -- the two triggers ---------------------------------------------------------------------
    def on_oom(self, ranks: Collection[int]) -> None:
        """An allocation is waiting on the budget: reclaim the shadows; relaunch them for the
        trainers of `ranks` at the level the controller allows."""
        mem = self.memory
        assert mem is not None
        pool = self.pool
        live = pool.live()
        verdict = mem.on_oom([t.proc.pid for t in live], pool.level_now)
        if verdict == "real":
            self._event(
                "oom",
                usage_mb=mem.budget.usage() / MIB,
                budget_mb=mem.budget.limit / MIB,
                reason="out of budget with no shadow to reclaim: the kernel OOM killer acts",
            )
            return
        if verdict != "reclaim":
            return
        pending = pool.pending
        pool.reclaim()  # SIGKILL, then wait until each is gone (its memory returned)
        fields = mem.reclaimed(len(ranks))
        self._event("shadows_reclaimed", **fields)
        if pending is None and live:
            pool.relaunch(fields["level_to"], live[0].generation, ranks)

    def on_request(self, req: ReclaimRequest, ranks: Collection[int]) -> ReclaimAnswer:
        """A trainer's allocation failed (its allocator's OOM): reclaim the shadows, wait until
        they are gone, and say so; they come back for the trainers of `ranks` at a level the
        device policy allows, once the trainer is past the iteration it retries."""
        t0 = time.monotonic()
        pool = self.pool
        live = pool.live()
        if not live:
            self._event(
                "oom", reason=f"allocation failure in rank {req.rank} with no shadow to reclaim"
            )
            return ReclaimAnswer(reclaimed=0)
        level_from = pool.level_now
        pending = pool.pending
        pool.reclaim()
        level = self._device_policy(req).after_reclaim(active=req.used or 0, shadows=len(live))
        answer = ReclaimAnswer(reclaimed=len(live), level_to=level, wait_s=time.monotonic() - t0)
        self._event(
            "shadows_reclaimed",
            cause=f"allocation failure in rank {req.rank}: {req.reason}",
            t_oom=req.t,
            shadows=len(live),
            level_from=level_from,
            level_to=level,
            wait_s=answer.wait_s,
            device_used_mb=(req.used or 0) / MIB,
        )
        generation = live[0].generation
        if pending is None and req.iteration is None:
            pool.relaunch(level, generation, ranks)
        elif pending is None:
            pool.relaunch_after = RelaunchAfter(req.rank, req.iteration, level, generation)
        return answer

    def _device_policy(self, req: ReclaimRequest) -> LevelPolicy:
        """The device level policy, created with the first request (its budget: the device's
        capacity as the trainer reported it)."""
        if self.device_policy is None:
            from unbroken.shadow.policy import LevelPolicy

            plan = self.pool.plan.shadows if self.pool.plan is not None else None
            self.device_policy = LevelPolicy(
                configured=plan.level if plan is not None else 0,
                budget=req.total or (1 << 62),
            )
        return self.device_policy
