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

Replicas whose layouts differ (the scheduler's layer repartition of one replica of a DP x PP
job, ResiHP §6.2) hold a layer on different stages, so a stage's flat buffers do not line up
across replicas. There the fold runs per *part*: the parameters with the same holders, one
rank per replica (`dp_sync.holders`, the groups `FineShardSync` made for them), gathered from
the flat buffer into one contiguous buffer per part at each `keep` and folded over the part's
holders exactly as above. The fold is elementwise, so a parameter's gradient is the same sum in
the same id order whichever stage holds it: a run that moves layers on one replica stays bit
for bit on the launch plan's result.

Replicas in different layouts above TP 1 (the scheduler's TP exclusion, ResiHP §6.1: one
replica's group shrunk to TP 1 beside another's TP 2) fold per *fine piece* the same way: a
part gathers the slices of its parameters along their split dimension (`FineShardSync`'s
pieces), and the replicated norm weights, folded between TP position 0 of the replicas, are
then broadcast inside each TP group. With the shrunk stage computing as the group it replaced
(`unbroken.engine.emulate`), every micro-batch's piece has the launch plan's bits, and so has
the fold.

What it refuses (`ValueError`): virtual stages and split backward (a W action writes weight
gradients after other micro-batches' Bs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unbroken.engine.dp_sync import FineShardSync
from unbroken.engine.groups import PlanGroups
from unbroken.parallel import ActionKind, DataPlacement, ParallelPlan, same_layouts
from unbroken.train.ordered import OrderedGradients
from unbroken.train.phases import Phase, PhaseHook

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


def _placement(plan: ParallelPlan, shard_microbatches: int, items) -> DataPlacement:
    m = shard_microbatches
    if plan.total_microbatches % m:
        raise ValueError(f"{plan.total_microbatches} micro-batches are not shards of {m}")
    return DataPlacement(plan.total_microbatches // m, m, tuple(map(tuple, items)))


def _backwarded(plan: ParallelPlan, rank: int) -> list[int]:
    """The micro-batches `rank` runs its stage's backward for, in id order."""
    d, s = plan.locate(rank)
    return [mb for mb in range(plan.total_microbatches) if plan.executor(mb, s) == d]


@dataclass(slots=True)
class _Part:
    """The parameters of this rank with one set of holders (replicas with different layouts):
    their gradient views in the flat buffer and the contiguous buffer the fold runs on."""

    views: list[torch.Tensor]
    """The gradient's views of the part's pieces (slices along a split dimension: strided)."""
    buf: torch.Tensor
    reduction: OrderedGradients

    def gather(self) -> None:
        torch.cat([v.reshape(-1) for v in self.views], out=self.buf)

    def scatter(self) -> None:
        offset = 0
        for v in self.views:
            v.copy_(self.buf[offset : offset + v.numel()].view_as(v))
            offset += v.numel()


def _broadcast(views: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """TP position 0's `views` to the other positions of `group` (one message)."""
    buf = torch.cat([v.reshape(-1) for v in views])
    dist.broadcast(buf, group=group, group_src=0)
    offset = 0
    for v in views:
        v.copy_(buf[offset : offset + v.numel()].view_as(v))
        offset += v.numel()


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
        views: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        check_ordered_plan(plan)
        self.tied, self.grads = tied, grads
        self.reduction: OrderedGradients | None = None
        """The stage's fold when the replicas share one layout (None on a standby)."""
        self.parts: list[_Part] = []
        """The folds per set of holders when they do not (module docstring)."""
        self.replicated: tuple[list[torch.Tensor], dist.ProcessGroup] | None = None
        """With the parts above TP 1: the replicated gradients (norm weights) and the TP group
        they are broadcast in from position 0 after the fold."""
        self.index: dict[int, int] = {}
        if groups.rank not in plan.ranks:
            return
        mine = _backwarded(plan, groups.rank)
        self.index = {mb: j for j, mb in enumerate(mine)}
        if not same_layouts(plan):
            self._parts(plan, groups, shard_microbatches, views)
            return
        d, s = plan.locate(groups.rank)
        items = [[] for _ in range(plan.dp)]
        for mb in range(plan.total_microbatches):
            items[plan.executor(mb, s)].append(mb)
        placement = _placement(plan, shard_microbatches, items)
        group = groups.dp if groups.dp_size > 1 else None
        self.reduction = OrderedGradients(grads, placement, d, group)

    def _parts(
        self,
        plan: ParallelPlan,
        groups: PlanGroups,
        shard_microbatches: int,
        views: Mapping[str, torch.Tensor] | None,
    ) -> None:
        if views is None or not isinstance(groups.fine, FineShardSync):
            raise ValueError(
                "replicas with different layouts: the ordered reduction needs the gradient's "
                "views by name and the groups' FineShardSync"
            )
        for ranks, group, pieces in groups.fine.reductions:
            # The fold's rows are indexed by rank in the part's group (torch numbers a group's
            # ranks in sorted order, not in the replica order of `ranks`).
            where = [
                dist.get_group_rank(group, dist.get_global_rank(groups.world, r)) for r in ranks
            ]
            items: list[list[int]] = [[] for _ in ranks]
            for r, g in zip(ranks, where, strict=True):
                items[g] = _backwarded(plan, r)
            part_views = [
                views[p.name] if p.dim is None else views[p.name].narrow(p.dim, p.start, p.length)
                for p in pieces
            ]
            n = sum(v.numel() for v in part_views)
            buf = torch.zeros(n, dtype=self.grads.dtype, device=self.grads.device)
            me = where[ranks.index(groups.rank)]
            placement = _placement(plan, shard_microbatches, items)
            self.parts.append(_Part(part_views, buf, OrderedGradients(buf, placement, me, group)))
        tp = groups.fine.tp
        if tp.size > 1 and groups.fine.replicated:
            self.replicated = ([views[n] for n in groups.fine.replicated], tp.group)

    def keep(self, microbatch: int) -> None:
        """After this rank's backward of `microbatch`: set its gradient aside."""
        j = self.index[microbatch]
        if self.reduction is not None:
            self.reduction.keep(j)
            return
        assert self.parts, "a standby runs no backward"
        for part in self.parts:
            part.gather()
            part.reduction.keep(j)
        self.grads.zero_()

    def reduce(self, hook: PhaseHook, iteration: int) -> None:
        """The stage's gradient into the flat buffer (collective over the stage's holders)."""
        if self.reduction is not None:
            self.reduction.reduce(hook, iteration)
        else:
            assert self.parts, "a standby reduces nothing"
            last = len(self.parts) - 1
            for i, part in enumerate(self.parts):

                def relay(phase: Phase, it: int, step: int = 0, n: int = 1, i: int = i) -> None:
                    # One reduction to the hooks: the first part's start, the last's middle
                    # and end.
                    if (i == 0 and phase is Phase.ALLREDUCE and step == 0) or (
                        i == last and (phase is not Phase.ALLREDUCE or step > 0)
                    ):
                        hook(phase, it, step, n)

                part.reduction.reduce(relay, iteration)
                part.scatter()
            if self.replicated is not None:
                _broadcast(*self.replicated)
        if self.tied is not None:
            group, view = self.tied
            dist.all_reduce(view, group=group)
