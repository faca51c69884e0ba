"""The probe micro-batch of an empty replica: how a device the scheduler took all work from
stays observed, so that a wrong or outdated "slow" verdict stays reversible (issue 18 item 6).

[Note: probe micro-batch] A plan may give a replica no micro-batch ([Note: empty replica] in
`unbroken.plan.balance`): its ranks' lists are REDUCE_GRAD, OPT_STEP. Every `probe_every`-th
iteration (`adapt.probe_every`) those ranks run one *probe*: micro-batch `PROBE_MICROBATCH`
(the plan's first, whose data every rank can read) through their replica's pipeline — forward
down the stages, backward up — before REDUCE_GRAD, while the other replicas compute. Its
effect on the run is none: the gradients it writes are zeroed before the reduction (the empty
replica adds nothing to the ordered fold), its loss and tokens are not counted, the RNG state
is restored, its data is dropped (the data order is keyed by iteration and shard, not by what
was read), and its messages travel only between the empty replica's own ranks. Its action
timings are reported apart from the compute (`StageTiming.probe`); the fail-slow detector's
recovery check compares them with the same stage's holders in the busy replicas, as it did the
one micro-batch that plans used to leave on a slow replica (`PlanFit.pace`), and a device
back at full speed gets its micro-batches back (`PipelineAdaptation.on_recovered`).

Why a probe every few iterations rather than every iteration, or a kept micro-batch: the probe
is off the critical path only while it is shorter than the busy replicas' compute, and a
device the scheduler emptied is by definition the one for which it is not (one micro-batch on
it took longer than the busy replica's whole share, or it would have kept one). Every
iteration it would cost what the kept micro-batch cost; every K-th it costs at most 1/K of
that, and the recovery check (`DetectorConfig.recover_window` iterations) still sees
`recover_window / K` probes per window. With no probe (`probe_every = 0`) an empty replica's
ranks report no compute, and the detector never takes them for recovered (nor for slow: a
rank that computes nothing has no pace).

This module owns the probe's action lists; `PlanWorker` runs them. Never used for a replica
that owns micro-batches, and never changes the state.
"""

from __future__ import annotations

from unbroken.parallel import Action, ActionKind, ParallelPlan
from unbroken.parallel.schedules import p2p_chunks

__all__ = ["PROBE_MICROBATCH", "probe_actions", "probes"]

PROBE_MICROBATCH = 0
"""The micro-batch a probe runs: the plan's first (some busy replica computes it too, so the
detector has its predicted cost and its stage's timings in the other replicas)."""


def probes(plan: ParallelPlan, rank: int, iteration: int, every: int) -> bool:
    """Whether `rank` runs a probe at `iteration`: it holds a stage of a replica that owns no
    micro-batch, takes no migrated one, and `iteration` is a multiple of `every` (> 0)."""
    if every <= 0 or iteration % every or rank not in plan.ranks or plan.dp < 2:
        return False
    d, _ = plan.locate(rank)
    return plan.microbatches[d] == 0 and not any(m.replica == d for m in plan.migrations)


def probe_actions(plan: ParallelPlan, rank: int) -> tuple[Action, ...]:
    """`rank`'s list for one probe micro-batch through its replica's pipeline: receive the
    input, forward, send it on; receive the output's gradient, backward, send the input's
    gradient back (one virtual stage per rank; a message split in TP chunks as the plan's)."""
    d, s = plan.locate(rank)
    stages = plan.replicas[d].stages
    m, last = PROBE_MICROBATCH, len(stages) - 1
    K = ActionKind

    def chunks(kind: ActionKind, src: int, dst: int) -> list[Action]:
        a, b = stages[src].ranks, stages[dst].ranks
        send = kind in (K.SEND_F, K.SEND_B)
        stage = s
        out = []
        for c, x, y in p2p_chunks(a, b):
            if (x if send else y) == rank:
                n = max(len(a), len(b))
                out.append(Action(kind, stage, m, y if send else x, c, n))
        return out

    acts: list[Action] = []
    if s > 0:
        acts += chunks(K.RECV_F, s - 1, s)
    acts.append(Action(K.F, s, m))
    if s < last:
        acts += chunks(K.SEND_F, s, s + 1)
        acts += chunks(K.RECV_B, s + 1, s)
    acts.append(Action(K.B, s, m))
    if s > 0:
        acts += chunks(K.SEND_B, s, s - 1)
    return tuple(acts)
