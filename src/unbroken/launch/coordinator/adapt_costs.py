"""The scheduler's view of a running pipeline job (`PipelineAdaptation`, `adapt_plan.py`):
its plan as a `ClusterState` (`cluster`), the job's measured costs as a `Workload`
(`measured_workload`), and which devices keep their layers across two plans (`keeps_stages`).
Pure functions of plans and fits."""

from __future__ import annotations

import statistics
from dataclasses import replace

from unbroken.detect.pipeline import PlanFit
from unbroken.parallel import ParallelPlan, held_stages
from unbroken.plan import ClusterState, Fabric, Workload

__all__ = ["cluster", "keeps_stages", "measured_workload", "unit_workload"]


def unit_workload(num_layers: int) -> Workload:
    """Unit costs per layer and no optimizer step: what the scheduler prices a pipeline job
    with until the fail-slow watch has measured it (`measured_workload`)."""
    return Workload(
        num_layers=num_layers,
        tokens=1,
        sum_sq=1.0,
        alpha_s=1e-3,
        beta_s=0.0,
        message_bytes=1.0,
        layer_params=1.0,
        act_bytes_per_layer=1.0,
    )


def measured_workload(plan: ParallelPlan, fit: PlanFit) -> Workload | None:
    """The scheduler's workload for `plan` from the fail-slow watch's warm-up fit: per layer
    the forward seconds of a typical micro-batch (from the stages before the last; the last
    stage's forward beyond its layers is the output head and loss), the backward over forward
    ratio measured, and the optimizer step (`PlanFit.step_s`) spread over the parameters of
    the device that holds the most layers (one unit per layer, a t-th of it on a TP-t
    device), so that a plan that moves layers moves step time with them. A TP-t rank's
    measured seconds are its share of its stage: the stage's work is t times them (its TP
    collectives included, which a smaller group does not pay: a TP exclusion is priced high,
    not low). Every rank of a live job meets at every boundary (`Workload.boundary_sync`:
    a slow device's step is waited for, not overlapped). None when the fit has no per-stage
    shares to read.

    Why: with unit costs per layer and no step the live planner saw one micro-batch's path
    through a slow replica as the only cost of keeping it busy, and kept [7, 1] on a 6-8x slow
    PP2 x DP2 replica; on a job whose step costs as much as a few micro-batches (the tiny CPU
    model: bench/results/adapt-cpu.md, stops 42-43) that micro-batch waits for the slow
    device's own step (`unbroken.parallel.simulate`), and emptying the replica is faster."""
    replica = plan.replicas[0]
    forward = [0.0] * plan.pp
    backward = [0.0] * plan.pp
    for (d, s, kind), share in fit.schedule.shares.items():
        if d == 0 and 0 <= s < plan.pp:
            (forward if kind == "F" else backward)[s] += share * fit.mb_s
    layers = [g.layers[1] - g.layers[0] for g in replica.stages]
    # A TP-t rank's seconds are a t-th of its stage's work (the scheduler divides by t,
    # `Workload.stage_compute_s`): the whole stage's are t times them.
    forward = [f * g.tp for f, g in zip(forward, replica.stages, strict=True)]
    backward = [b * g.tp for b, g in zip(backward, replica.stages, strict=True)]
    inner = [forward[s] / layers[s] for s in range(plan.pp - 1) if layers[s]] or [
        forward[-1] / max(layers[-1], 1)
    ]
    layer_f = statistics.median(inner)
    if fit.mb_s <= 0 or layer_f <= 0 or sum(forward) <= 0:
        return None
    unit = unit_workload(plan.num_layers)
    most = max((g.layers[1] - g.layers[0]) / g.tp for rep in plan.replicas for g in rep.stages)
    return replace(
        unit,
        alpha_s=layer_f,
        head_s=max(0.0, forward[-1] - layers[-1] * layer_f) if plan.pp > 1 else 0.0,
        backward_ratio=sum(backward) / sum(forward),
        step_s_per_param=max(fit.step_s, 0.0) / max(most, 1e-9),
        boundary_sync=True,  # the switch's broadcast meets every rank at every boundary
    )


def cluster(plan: ParallelPlan, workload: Workload | None = None) -> ClusterState:
    """`plan` as the scheduler sees it: every rank healthy, `workload` (default unit costs per
    layer, `unit_workload`), memory that never binds (a lost device's plan depends on the
    structure, not on speeds)."""
    workload = workload or unit_workload(plan.num_layers)
    n = max(plan.ranks) + 1
    fabric = Fabric(gpus_per_node=n, intra_bytes_per_s=1e12, inter_bytes_per_s=1e12)
    return ClusterState.healthy(plan, workload, fabric, memory_bytes=float(1 << 50))


def _stages_by_device(plan: ParallelPlan, devices: tuple[int, ...]) -> dict[int, tuple]:
    """device -> the layer ranges it holds (at its TP degree) under `plan`."""
    return {devices[rank]: held_stages(plan, rank) for rank in plan.ranks}


def keeps_stages(
    before: ParallelPlan,
    devices_before: tuple[int, ...],
    after: ParallelPlan,
    devices: tuple[int, ...],
) -> bool:
    """Whether every device of the new plan that ran the old one holds what it held before
    (its retained state is the new layout's: restore in place). Devices new to the world
    (returned ones) take a replica's state, or the generation falls back to a checkpoint."""
    old = _stages_by_device(before, devices_before)
    new = _stages_by_device(after, devices)
    return all(old[dev] == held for dev, held in new.items() if dev in old)
