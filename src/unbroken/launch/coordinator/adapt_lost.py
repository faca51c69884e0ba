"""A lost device's TP group shrunk to the device it has left (issue 18 item 3; ResiHP §6.1 and
Figure 8(c) for a device lost for good), instead of the group's replica dissolved.

Around a lost device of a DP x TP job, `PipelineAdaptation._dissolve` keeps every survivor's
stage: the broken replica is dissolved, its other devices stand by outside the world, and the
whole replicas take its micro-batches — in place, no checkpoint, but the lost device's TP peer
idles. The scheduler's own plan (exclusion first) shrinks the group to that peer instead. Where
the job retains its state and the shrunk group keeps the launch plan's bits (TP 2 -> 1: the
TP-1 stage computes as the group did, `unbroken.engine.emulate`), `regroup_lost` takes that
plan when it is predicted `adapt.min_gain` faster than the dissolve:

- the next generation runs in `RestoreMode.RESHARD`. The plan its devices' state holds
  (`GenerationSpec.plan_before`) is the dissolve in the survivors' numbering: every device of
  a whole replica holds its stage, the peer holds nothing (a rank of no stage, [Note: a rank
  of no stage] in `unbroken.recovery.decision`). The ranks restore that in place, then move
  the state to the shrunk plan (`unbroken.launch.relayout`): the peer receives its whole stage
  from the whole replicas' retained buffers (the half it held is a TP-2 shard, which a TP-1
  stage does not lay out the same way; the move does not need it).
- no checkpoint is read; a failure while moving restarts from the checkpoint under the shrunk
  plan, like any move (`CoordinatorCore._restore_for`).

Pure functions of plans and the scheduler's prices.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.launch.coordinator.adapt_costs import cluster
from unbroken.parallel import ParallelPlan, Replica, StageGroup, plan_for
from unbroken.plan import NoPlanError, PlannerConfig, Workload, plan_for_state
from unbroken.plan.shrink import dissolve_replicas

__all__ = ["Regrouped", "emulates", "regroup_lost", "relabeled", "renumbered"]


def emulates(
    launch: ParallelPlan, plan: ParallelPlan, world: int, bits_tp: int | None = None
) -> bool:
    """Whether `plan` runs in a world of `world` ranks with every stage computing the bits the
    job computes now: those of TP degree `bits_tp` (default: the launch plan's degree; a
    smaller one once a re-plan changed the bits, `PipelineAdaptation.bits_tp`). A stage keeps
    them at that degree, or at TP 1 where that degree and the launch degree are 2 (a TP-1
    stage computes as the launch group, `unbroken.engine.emulate`; a left fold of more
    positions is not the collective's order, [Note: emulated sums] there)."""
    degrees = {g.tp for rep in launch.replicas for g in rep.stages}
    if len(degrees) != 1 or max(plan.ranks) >= world:
        return False
    (t,) = degrees
    b = bits_tp or t
    return all(
        g.tp == b or (g.tp == 1 and b == t == 2) for rep in plan.replicas for g in rep.stages
    )


def renumbered(plan: ParallelPlan, ranks: list[int]) -> ParallelPlan:
    """`plan` with rank `ranks[i]` renamed i (every rank of `plan` must be in `ranks`; a rank
    of `ranks` that `plan` does not use is a rank of no stage)."""
    return relabeled(plan, {r: i for i, r in enumerate(ranks)})


def relabeled(plan: ParallelPlan, new_rank: dict[int, int]) -> ParallelPlan:
    """`plan` with every rank r renamed `new_rank[r]`."""
    replicas = [
        Replica(
            tuple(StageGroup(tuple(new_rank[r] for r in g.ranks), g.layers) for g in rep.stages)
        )
        for rep in plan.replicas
    ]
    return plan_for(
        replicas,
        plan.microbatches,
        plan.schedule,
        migrations=plan.migrations,
        virtual_stages=plan.virtual_stages,
    )


@dataclass(frozen=True, slots=True)
class Regrouped:
    """The shrunk plan around lost devices, ranks 0..n-1 over the survivors (`devices`)."""

    plan: ParallelPlan
    before: ParallelPlan
    """The dissolve in the same numbering: what the survivors' retained state holds."""
    devices: tuple[int, ...]
    dissolve_s: float
    """The scheduler's iteration for the dissolve, and for `plan`: its units."""
    predicted_s: float
    explain: str


def regroup_lost(
    plan: ParallelPlan,
    devices: tuple[int, ...],
    gone: list[int],
    launch: ParallelPlan,
    workload: Workload,
    *,
    config: PlannerConfig,
    min_gain: float,
    bits_tp: int | None = None,
) -> Regrouped | None:
    """The scheduler's plan around the lost devices `gone` (`config`: exclusion on) when it
    keeps every survivor at work, computes the job's bits (`emulates`, `bits_tp`), and is
    predicted `min_gain` faster than dissolving the broken replicas; None otherwise (no whole
    replica left, no TP group to shrink, or not worth it)."""
    lost = [r for r, d in enumerate(devices) if d in gone]
    alive = [r for r, d in enumerate(devices) if d not in gone]
    if any(r not in plan.ranks for r in lost):
        return None  # a standby of no stage lost: the plan runs on without it
    try:
        dissolved = dissolve_replicas(plan, lost)
        result = plan_for_state(cluster(plan, workload).with_lost(*lost), config)
    except NoPlanError:
        return None
    chosen = result.plan()
    if sorted(chosen.ranks) != alive:
        return None
    new = renumbered(chosen, alive)
    if not emulates(launch, new, len(alive), bits_tp):
        return None
    dissolve_s = plan_for_state(cluster(dissolved, workload)).current_s
    if result.predicted_s > dissolve_s * (1.0 - min_gain):
        return None
    peers = [devices[r] for r in alive if r not in dissolved.ranks]
    groups = [(list(g.ranks), g.tp) for rep in new.replicas for g in rep.stages]
    explain = (
        f"the lost device's TP group shrinks to device(s) {peers} (TP 1 computing as TP 2, "
        f"the launch plan's bits): TP groups {groups}, micro-batches "
        f"{list(new.microbatches)}, predicted {result.predicted_s:.3g} against "
        f"{dissolve_s:.3g} with the replica dissolved; the state moves from the whole "
        "replicas' retained buffers, no checkpoint"
    )
    devs = tuple(devices[r] for r in alive)
    return Regrouped(
        new, renumbered(dissolved, alive), devs, dissolve_s, result.predicted_s, explain
    )
