"""A pipeline job's plan on fewer devices, when the scheduler has none (issue 18, lost stages).

The scheduler (`plan_for_state`) keeps the pipeline depth: it plans around a lost device with
a surviving replica of its stage, a TP group that shrinks, or a standby. A job of one replica
at TP 1 has none of these — its lost device held the only copy of a stage — and neither has a
DP x PP job that lost every copy of one stage, so `plan_for_state` raises `NoPlanError`. What such a job can still do is what Oobleck does on
every failure: run a fresh even plan on the devices it has left, from its newest checkpoint
loaded under that plan (`unbroken.engine.ckpt_layout`). `shrink_pipeline` is that plan:

- one replica with every micro-batch of the plan (the global batch stays as it was; the data
  of each micro-batch is keyed by its global id, `PlanWorker.shard_microbatches`);
- min(pp, survivors // tp, layers) stages, ranks 0..n-1 in the survivors' order, layers split
  evenly (`make_plan`);
- the plan's TP degree on every stage (fewer survivors than it: `NoPlanError`, unless the
  caller passes `tp`: a TP-2 job on one device runs TP 1 computing as TP 2,
  `unbroken.engine.emulate`), the same schedule; an interleaved schedule keeps its virtual
  stages while the layers allow it, else falls back to 1F1B (interleaving on one stage is not
  a pipeline).

A stage computes the reference model's bits whatever its depth and schedule at TP 1, and at
TP t whatever its depth with the same t (each layer's shards and the order of its TP
reductions do not depend on which stage holds the layer; docs/engine.md), so a job that
continues on the smaller plan stays bit-exact against its fault-free run on the original one.
A smaller TP degree would not, unless its stages compute as the launch degree's groups (TP 2
-> 1 under the ordered reduction, docs/engine.md): that is why the degree is kept by default.
"""

from __future__ import annotations

from collections.abc import Collection

from unbroken.parallel import ParallelPlan, make_plan, plan_for
from unbroken.plan.exclusion import NoPlanError

__all__ = ["dissolve_replicas", "shrink_pipeline"]


def dissolve_replicas(plan: ParallelPlan, lost: Collection[int]) -> ParallelPlan:
    """`plan` without every replica that holds a rank in `lost`: the replicas left own every
    micro-batch (spread evenly, the earlier replicas first), under the plan's schedule, without
    migrations; ranks keep their numbers. What a job can continue with in place when the
    scheduler's own plan would change the layers or TP degree a survivor holds (a TP group
    that shrinks needs its shards resharded): every survivor keeps its stage and its state.

    Raises:
        NoPlanError: every replica holds a lost rank.
    """
    keep = [
        rep
        for rep in plan.replicas
        if not any(r in lost for g in rep.stages[: plan.pp] for r in g.ranks)
    ]
    if not keep:
        raise NoPlanError("every replica holds a lost device")
    q, extra = divmod(plan.total_microbatches, len(keep))
    counts = [q + (i < extra) for i in range(len(keep))]
    return plan_for(keep, counts, plan.schedule, virtual_stages=plan.virtual_stages)


def shrink_pipeline(plan: ParallelPlan, devices: int, tp: int | None = None) -> ParallelPlan:
    """`plan`'s job as one replica on `devices` devices, ranks 0..n-1 (module docstring), at TP
    degree `tp` (default: the plan's).

    Raises:
        NoPlanError: no device is left, or fewer than the TP degree.
        ValueError: `plan`'s stages have different TP degrees (the scheduler's case).
    """
    if devices < 1:
        raise NoPlanError("no device is left to run the pipeline on")
    degrees = {g.tp for rep in plan.replicas for g in rep.stages}
    if len(degrees) != 1:
        raise ValueError("shrink_pipeline plans pipelines of one TP degree on every stage")
    tp = tp or next(iter(degrees))
    if devices < tp:
        raise NoPlanError(
            f"{devices} device(s) left, fewer than the TP degree {tp}: a smaller TP group "
            "changes the job's bits, and shrinking one is not built"
        )
    layers, microbatches = plan.num_layers, plan.total_microbatches
    pp = max(1, min(plan.pp, devices // tp, layers))
    v = plan.virtual_stages
    if v > 1 and pp > 1 and pp * v <= layers and microbatches % pp == 0:
        return make_plan(1, pp, tp, layers, microbatches, plan.schedule, virtual_stages=v)
    schedule = "1f1b" if plan.schedule == "interleaved_1f1b" else plan.schedule
    return make_plan(1, pp, tp, layers, microbatches, schedule)
