"""The process groups one plan needs, built as one value from an explicit world group.

`PlanGroups.build(plan, world)` creates, in one fixed order on every rank, a TP group per
(replica, physical stage) whose degree is above 1 and a DP group per (physical stage, TP
position) across the replicas, and returns this rank's view of them. Point-to-point transfers
and the iteration-wide reductions (loss, gradient norm) use `world` itself, named explicitly.

Re-planning builds a new `PlanGroups` for the new plan (or a new world, a new generation with a
new `PrefixStore`); nothing here is module-global, and no call reads the default group
implicitly. `torch.distributed.new_group` is collective over the default group, so every rank of
the job (standbys included) must call `build` with the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from unbroken.engine.tp import TPGroup
from unbroken.parallel import ParallelPlan

__all__ = ["PlanGroups", "check_dp_layout"]


def check_dp_layout(plan: ParallelPlan) -> None:
    """The engine reduces gradients between replicas position by position, so every replica
    must hold the same layer ranges with the same TP degree at each stage.

    Raises:
        NotImplementedError: replicas with different stage layouts (finest-shard
            synchronization, issue #5 item 6, is not built).
    """
    first = [(g.layers, g.tp) for g in plan.replicas[0].stages]
    for d, rep in enumerate(plan.replicas[1:], start=1):
        if [(g.layers, g.tp) for g in rep.stages] != first:
            raise NotImplementedError(
                f"replica {d} has a different stage layout (layers, TP) than replica 0; "
                "gradient reduction across unequal replicas is not built"
            )


@dataclass(frozen=True, slots=True)
class PlanGroups:
    """One rank's groups for one plan."""

    world: dist.ProcessGroup
    """The group whose ranks are the plan's ranks (p2p, loss and norm reductions)."""
    rank: int
    """This process's rank in `world` (the plan's rank numbering)."""
    tp: TPGroup
    """TP position and group of this rank's stage (size 1 for standbys)."""
    dp: dist.ProcessGroup | None
    """This rank's peers at the same stage and TP position in the other replicas."""
    dp_size: int

    @classmethod
    def build(cls, plan: ParallelPlan, world: dist.ProcessGroup) -> PlanGroups:
        """Create the groups of `plan`; collective, every rank of the job calls it.

        Raises:
            ValueError: `world` has fewer ranks than the plan names.
            NotImplementedError: see `check_dp_layout`.
        """
        check_dp_layout(plan)
        size, rank = dist.get_world_size(world), dist.get_rank(world)
        if max(plan.ranks) >= size:
            raise ValueError(f"the plan names rank {max(plan.ranks)}; the world has {size}")

        def new_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
            return dist.new_group([dist.get_global_rank(world, r) for r in ranks])

        tp = TPGroup()
        for rep in plan.replicas:
            for g in rep.stages[: plan.pp]:
                if g.tp > 1:
                    group = new_group(g.ranks)
                    if rank in g.ranks:
                        tp = TPGroup(g.tp, g.ranks.index(rank), group)
        dp, dp_size = None, 1
        if plan.dp > 1:
            for s in range(plan.pp):
                for i in range(plan.replicas[0].stages[s].tp):
                    ranks = tuple(rep.stages[s].ranks[i] for rep in plan.replicas)
                    group = new_group(ranks)
                    if rank in ranks:
                        dp, dp_size = group, len(ranks)
        return cls(world=world, rank=rank, tp=tp, dp=dp, dp_size=dp_size)
