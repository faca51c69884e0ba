"""The process groups one plan needs, built as one value from an explicit world group.

`PlanGroups.build(plan, world)` creates, in one fixed order on every rank, a TP group per
(replica, physical stage) whose degree is above 1 and a DP group per (physical stage, TP
position) across the replicas, for a model with tied embeddings a two-rank group per replica
and TP position joining the holders of the embedding and its copy on the last stage
(`unbroken.engine.tied`), and returns this rank's view of them. Point-to-point transfers
and the iteration-wide reductions (loss, gradient norm) use `world` itself, named explicitly.

Re-planning builds a new `PlanGroups` for the new plan (or a new world, a new generation with a
new `PrefixStore`); replicas whose layouts differ get a `FineShardSync` instead of DP groups.
Nothing here is module-global, and no call reads the default group
implicitly. `torch.distributed.new_group` is collective over the default group, so every rank of
the job (standbys included) must call `build` with the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from unbroken.engine.dp_sync import FineShardSync
from unbroken.engine.tied import TiedGradReduction, embedding_pairs
from unbroken.engine.tp import TPGroup
from unbroken.model import TransformerArgs
from unbroken.parallel import ParallelPlan, same_layouts

__all__ = ["PlanGroups", "same_layouts"]


def _tie_group(
    plan: ParallelPlan, rank: int, new_group, tied: tuple[str, str]
) -> tuple[dist.ProcessGroup | None, str]:
    """Create every tied-embedding pair's group (collective, fixed order); this rank's group
    and the name it holds its copy under, or (None, "")."""
    tie, tie_name = None, ""
    for ranks, names in embedding_pairs(plan, tied):
        group = new_group(ranks)
        if rank in ranks:
            tie, tie_name = group, names[ranks.index(rank)]
    return tie, tie_name


def _layouts(
    plan: ParallelPlan, args: TransformerArgs | None, tied: tuple[str, ...]
) -> tuple[bool, tuple[str, ...]]:
    """Whether every replica has the same layout (`same_layouts`), and the tied embedding's
    names (`tied`, else the reference model's from `args`; empty when untied)."""
    uniform = same_layouts(plan)
    if not uniform and args is None:
        raise ValueError("replicas with different layouts need the model args to sync")
    tied = tuple(tied or (args.tied[0] if args is not None and args.tied else ()))
    if tied and not uniform:
        raise ValueError("tied embeddings with replicas of different layouts: not built")
    return uniform, tied


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
    """This rank's peers at the same stage and TP position in the other replicas (replicas
    with the same layout only)."""
    dp_size: int
    fine: FineShardSync | TiedGradReduction | None = None
    """A gradient reduction that replaces the flat DP all-reduce: averaging at the finest
    shard when replica layouts differ (`dp_sync`), or the DP average plus the tied-embedding
    sum across stages (`tied`, set by `unbroken.engine.build` once the buffers exist)."""
    tie: dist.ProcessGroup | None = None
    """The two holders of this rank's copy of a tied embedding (`unbroken.engine.tied`)."""
    tie_name: str = ""
    """The name this rank holds that copy under."""

    @classmethod
    def build(
        cls,
        plan: ParallelPlan,
        world: dist.ProcessGroup,
        args: TransformerArgs | None = None,
        *,
        tied: tuple[str, ...] = (),
    ) -> PlanGroups:
        """Create the groups of `plan`; collective, every rank of the job calls it.

        Args:
            plan: the plan.
            world: the group the plan's ranks are numbered in.
            args: the model's sizes; needed when replica layouts differ.
            tied: an own model's tied names, the first stage's first (`engine.own_stages`);
                default: the reference model's, from `args`.

        Raises:
            ValueError: `world` has fewer ranks than the plan names, or replica layouts differ
                and `args` is missing.
        """
        uniform, tied = _layouts(plan, args, tied)
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
        dp, dp_size, fine = None, 1, None
        if not uniform:
            fine, dp_size = FineShardSync.build(plan, args, world, tp), plan.dp
        elif plan.dp > 1:
            for s in range(plan.pp):
                for i in range(plan.replicas[0].stages[s].tp):
                    ranks = tuple(rep.stages[s].ranks[i] for rep in plan.replicas)
                    group = new_group(ranks)
                    if rank in ranks:
                        dp, dp_size = group, len(ranks)
        tie, tie_name = _tie_group(plan, rank, new_group, tied) if tied else (None, "")
        # NCCL: the first operation on a communicator must involve all its ranks; the first
        # p2p batch of a plan does not, so the world meets once here.
        dist.barrier(group=world)
        return cls(
            world=world,
            rank=rank,
            tp=tp,
            dp=dp,
            dp_size=dp_size,
            fine=fine,
            tie=tie,
            tie_name=tie_name,
        )
