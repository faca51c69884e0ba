"""The ordered gradient reduction of a plan's rank: bits that do not depend on the plan.

[Note: ordered reduction] in `unbroken.train.ordered` makes a data-parallel job's gradient the
same fold, in global micro-batch id order, whichever rank computed each micro-batch. A pipeline
job re-planned live (issue 18: a lost device dissolves its replica and the survivors take its
micro-batches) needs the same guarantee per stage: the stage's gradient after the re-plan must
equal the one the fault-free plan computes, or the run drifts by rounding. Here each rank of a
plan keeps the gradient of every micro-batch it backwards through its stage (1F1B and GPipe
lists run one B per micro-batch, nothing else writes gradients between two Bs), and the
holders of the stage in every replica — the plan's DP group, in replica order — run the
all-to-all fold of `OrderedGradients` over them, divided by the job's logical shard count S.
Each micro-batch's loss is divided by M, the micro-batches of one logical shard (not by the
running plan's per-replica count), so G_k is the same tensor under any plan.

The loss and the gradient norm are folded the same way (`PlanWorker._sync`): each micro-batch's
loss in its own slot, summed in id order; each layer's sum of squares in its own slot (the
embedding and the rest in two more), summed in layer order — so moving layers between stages
(the scheduler's repartition) does not change the clipping scale by a rounding either.

With a tied embedding the two copies' gradients are then summed between their holders, as
`unbroken.engine.tied` does after the average (two addends: the sum is exact either way).

What it refuses (`ValueError`): virtual stages and split backward (a W action writes weight
gradients after other micro-batches' Bs), and replicas whose layouts differ (their flat
buffers do not line up; `FineShardSync` averages those).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from unbroken.engine.groups import PlanGroups
from unbroken.parallel import ActionKind, DataPlacement, ParallelPlan, same_layouts
from unbroken.train.ordered import OrderedGradients
from unbroken.train.phases import PhaseHook

__all__ = ["PlanOrderedGradients", "check_ordered_plan"]


def check_ordered_plan(plan: ParallelPlan) -> None:
    """Raise ValueError when `plan` cannot reduce in micro-batch order (module docstring)."""
    if plan.virtual_stages != 1:
        raise ValueError("the ordered reduction of a plan needs one virtual stage per rank")
    if any(a.kind is ActionKind.W for acts in plan.actions.values() for a in acts):
        raise ValueError(
            "the ordered reduction of a plan needs a schedule without split backward (1f1b or "
            "gpipe, not zb_h1)"
        )
    if not same_layouts(plan):
        raise ValueError("the ordered reduction of a plan needs replicas with one layout")


class PlanOrderedGradients:
    """One plan rank's ordered reduction; see the module docstring.

    Args:
        plan: the plan (checked by `check_ordered_plan`).
        groups: this rank's groups (`dp`: its stage's holders, in replica order).
        grads: the rank's flat gradient buffer.
        shard_microbatches: M, micro-batches per logical shard.
        tied: (tie group, this rank's copy's gradient view) when it holds a tied embedding.
    """

    def __init__(
        self,
        plan: ParallelPlan,
        groups: PlanGroups,
        grads: torch.Tensor,
        shard_microbatches: int,
        tied: tuple[dist.ProcessGroup, torch.Tensor] | None = None,
    ) -> None:
        check_ordered_plan(plan)
        self.tied = tied
        self.reduction: OrderedGradients | None = None
        """None on a standby (it holds no stage and only joins the sync)."""
        if groups.rank not in plan.ranks:
            return
        d, s = plan.locate(groups.rank)
        items = [[] for _ in range(plan.dp)]
        for mb in range(plan.total_microbatches):
            items[plan.executor(mb, s)].append(mb)
        m = shard_microbatches
        if plan.total_microbatches % m:
            raise ValueError(f"{plan.total_microbatches} micro-batches are not shards of {m}")
        placement = DataPlacement(plan.total_microbatches // m, m, tuple(map(tuple, items)))
        group = groups.dp if groups.dp_size > 1 else None
        self.reduction = OrderedGradients(grads, placement, d, group)
        self.index = {mb: j for j, mb in enumerate(self.reduction.items)}

    def keep(self, microbatch: int) -> None:
        """After this rank's backward of `microbatch`: set its gradient aside."""
        assert self.reduction is not None, "a standby runs no backward"
        self.reduction.keep(self.index[microbatch])

    def reduce(self, hook: PhaseHook, iteration: int) -> None:
        """The stage's gradient into the flat buffer (collective over the stage's holders)."""
        assert self.reduction is not None, "a standby reduces nothing"
        self.reduction.reduce(hook, iteration)
        if self.tied is not None:
            group, view = self.tied
            dist.all_reduce(view, group=group)
